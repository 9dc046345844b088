"""The adapter's settings: one frozen, validated object built from the panel, the API or the options.

The field order of :class:`AccelerateSettings` is the order of the panel's controls, of
``Script.ui()``'s return value and therefore of ``script_args`` in ``/sdapi/v1/txt2img``. It is
defined here once; the panel, the settings section and the JavaScript hints read it from here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

PRECISION_AUTO = "Automatic (fastest the device supports)"
PRECISION_F32 = "Full precision (f32)"
PRECISIONS: tuple[str, ...] = (PRECISION_AUTO, PRECISION_F32)

#: Part name -> short name used in the infotext and the status.
PART_LABELS: dict[str, str] = {"text_encoder": "TE", "unet": "UNet", "vae": "VAE"}


def _meta(label: str, hint: str) -> dict[str, str]:
    return {"label": label, "hint": hint}


@dataclass(frozen=True)
class AccelerateSettings:
    """What the user chose for one generation (defaults block = the field defaults)."""

    device: str = field(
        default="CPU",
        metadata=_meta(
            "OpenVINO device",
            "Where the accelerated parts run. AUTO lets OpenVINO pick; HETERO splits a model across devices.",
        ),
    )
    """OpenVINO device name: "CPU", "GPU.0", "NPU", "AUTO" or "HETERO:..."."""
    unet: bool = field(
        default=True,
        metadata=_meta("Accelerate UNet", "Run the denoising UNet (most of the time of a generation) in OpenVINO."),
    )
    """Route the UNet (``model.diffusion_model``) through OpenVINO."""
    vae: bool = field(
        default=True,
        metadata=_meta(
            "Accelerate VAE",
            "Run the VAE that turns latents into images (and images into latents for img2img) in OpenVINO.",
        ),
    )
    """Route the VAE encoder and decoder (``first_stage_model``) through OpenVINO."""
    text_encoder: bool = field(
        default=True,
        metadata=_meta("Accelerate text encoder", "Run the CLIP text encoder that reads the prompt in OpenVINO."),
    )
    """Route the text encoder(s) through OpenVINO."""
    precision: str = field(
        default=PRECISION_AUTO,
        metadata=_meta(
            "Precision",
            "Automatic lets the device use its fastest precision (bf16/f16 where supported; "
            "results differ slightly from PyTorch). Full precision (f32) matches PyTorch closely.",
        ),
    )
    """One of :data:`PRECISIONS`."""
    model_caching: bool = field(
        default=True,
        metadata=_meta(
            "Cache compiled models on disk",
            "Keep compiled models on disk so the next start of the WebUI skips the compile.",
        ),
    )
    """Store compiled models in ``cache_dir``."""
    cache_dir: str = field(
        default="",
        metadata=_meta(
            "Cache folder",
            "Where compiled models are stored. Empty: 'openvino_cache' under the WebUI's models folder.",
        ),
    )
    """Folder of the disk cache; empty means the default under the WebUI's models folder."""

    @property
    def parts(self) -> tuple[str, ...]:
        """The parts to accelerate, sorted by name."""
        return tuple(name for name in sorted(PART_LABELS) if getattr(self, name))

    def parts_label(self) -> str:
        """E.g. "UNet+VAE+TE" (fixed order, as in the infotext)."""
        order = ("unet", "vae", "text_encoder")
        return "+".join(PART_LABELS[name] for name in order if getattr(self, name)) or "none"

    def backend_options(self, default_cache_dir: str) -> dict[str, Any]:
        """The options handed to ``ov_backend.build_settings``."""
        config: dict[str, str] = {}
        if self.precision == PRECISION_F32:
            config["INFERENCE_PRECISION_HINT"] = "f32"
        return {
            "device": self.device,
            "model_caching": self.model_caching,
            "cache_dir": self.cache_dir or default_cache_dir,
            "config": config,
        }

    def infotext(self) -> str:
        """The value of the "OpenVINO" infotext entry, e.g. "CPU, UNet+VAE+TE, f32"."""
        precision = "f32" if self.precision == PRECISION_F32 else "auto"
        return f"{self.device}, {self.parts_label()}, {precision}"


FIELDS: tuple[dataclasses.Field, ...] = dataclasses.fields(AccelerateSettings)
FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in FIELDS)
DEFAULTS = AccelerateSettings()


def _check_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"OpenVINO setting {name!r} must be true or false, got {value!r}")


def build_settings(values: Mapping[str, Any], device_names: Sequence[str] | None = None) -> AccelerateSettings:
    """Build validated settings from a mapping; missing keys take the defaults.

    Args:
        values: field name -> value. A device may be given as a panel label ("GPU.0: Intel ...").
        device_names: devices accepted besides AUTO/HETERO/MULTI; None skips the device check.

    Raises:
        ValueError: on an unknown key, an unknown device or precision, or a value of the wrong type.
    """
    unknown = sorted(set(values) - set(FIELD_NAMES))
    if unknown:
        raise ValueError(f"Unknown OpenVINO setting(s) {unknown}; known: {list(FIELD_NAMES)}")
    merged = {**dataclasses.asdict(DEFAULTS), **values}
    for f in FIELDS:
        if isinstance(f.default, bool):
            merged[f.name] = _check_bool(f.name, merged[f.name])
    device = device_from_label(str(merged["device"] or DEFAULTS.device))
    if device_names is not None and not _device_known(device, device_names):
        raise ValueError(f"Unknown OpenVINO device {device!r}; available: {['AUTO', *device_names]}")
    merged["device"] = device
    precision = merged["precision"]
    if precision in ("f32", "auto"):
        precision = PRECISION_F32 if precision == "f32" else PRECISION_AUTO
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}; choose one of {list(PRECISIONS)}")
    merged["precision"] = precision
    merged["cache_dir"] = str(merged["cache_dir"] or "").strip()
    return AccelerateSettings(**merged)


def from_ui_args(args: Sequence[Any], device_names: Sequence[str] | None = None) -> AccelerateSettings:
    """Settings from ``run(p, *args)``: positional in field order; missing trailing args take defaults."""
    if len(args) > len(FIELD_NAMES):
        raise ValueError(
            f"Accelerate with OpenVINO takes at most {len(FIELD_NAMES)} script_args "
            f"({', '.join(FIELD_NAMES)}), got {len(args)}"
        )
    return build_settings(dict(zip(FIELD_NAMES, args)), device_names)


def device_from_label(label: str) -> str:
    """ "GPU.0: Intel(R) Arc(TM) A770 Graphics" -> "GPU.0"; a bare name is returned unchanged."""
    return label.split(": ", 1)[0].strip()


def _device_known(device: str, device_names: Sequence[str]) -> bool:
    if device == "AUTO" or device in device_names:
        return True
    head, _, rest = device.partition(":")
    if head in ("HETERO", "MULTI", "AUTO") and rest:
        return all(name in device_names for name in rest.split(","))
    return False
