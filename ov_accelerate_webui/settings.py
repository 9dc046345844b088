"""The adapter's settings: one frozen, validated object built from the panel, the API or the options.

The field order of :class:`AccelerateSettings` is the order of the panel's controls, of
``Script.ui()``'s return value and therefore of ``script_args`` in ``/sdapi/v1/txt2img``. It is
defined here once; the panel, the settings section and the JavaScript hints read it from here.
How the settings are spelled in the "OpenVINO" infotext entry is defined once too, by
:data:`INFOTEXT_ITEMS`: :func:`format_infotext` writes the entry and :func:`parse_infotext` reads it back.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ov_accelerate_sd.backends import BackendChoice
from ov_accelerate_sd.openvino_entry import (
    NO_PARTS,
    NOTE_SEPARATOR,
    PART_NAMES,
    SLOTS,
    STEP_CACHE_SLOT,
    format_entry,
    split_step_cache,
)
from ov_accelerate_sd.parts import PARTS
from ov_accelerate_sd.step_cache import INTERVALS

from .backend_bridge import ov_backend

logger = logging.getLogger(__name__)

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
        default=ov_backend.DEFAULT_PRECISION,
        metadata=_meta(
            "Precision",
            "Automatic lets the device use its fastest precision (bf16/f16 where supported; "
            "results differ slightly from PyTorch). Full precision (f32) matches PyTorch closely. "
            "INT8 quantizes the UNet to 8 bits with NNCF: the first generation runs at Automatic while its "
            "steps are recorded, then the UNet is quantized (minutes, once per checkpoint and LoRA set: "
            "kept in the disk cache); the VAE and text encoder stay at Automatic. 8-bit weights keeps the "
            "UNet's and text encoder's weights at 8 bits (a quarter of f32's memory) and computes at Automatic: "
            "the least memory, a small loss of quality.",
        ),
    )
    """A name of ``ov_backend.PRECISIONS``: "auto", "f32", "int8" or "int8-weights" (the panel shows them with labels,
    ``options.PRECISION_LABELS``)."""
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
    step_cache: int = field(
        default=1,
        metadata=_meta(
            "Step caching",
            "Run the full UNet only every N sampling steps and its shallow blocks on the steps between, "
            "reusing its deep features (DeepCache): faster, and the picture changes a little. The depth and the "
            "steps kept full at the start and the end are in Settings -> OpenVINO.",
        ),
    )
    """The step caching interval: the full UNet every ``step_cache`` sampler steps (1: off), one of
    ``ov_accelerate_sd.step_cache.INTERVALS`` (the panel shows them with labels, ``options.STEP_CACHE_LABELS``)."""

    @property
    def parts(self) -> tuple[str, ...]:
        """The parts to accelerate, in ``PARTS`` order."""
        return tuple(name for name in PARTS if getattr(self, name))

    def backend_choice(self, default_cache_dir: str) -> BackendChoice:
        """The backend these settings choose (the cache folder ``default_cache_dir`` when none is given)."""
        return BackendChoice(device=self.device, precision=self.precision, model_caching=self.model_caching,
                             cache_dir=self.cache_dir or default_cache_dir)

    def infotext(self) -> str:
        """The value of the "OpenVINO" infotext entry, e.g. "CPU, UNet+VAE+TE, f32" (see :func:`format_infotext`)."""
        return format_infotext(self)


FIELDS: tuple[dataclasses.Field, ...] = dataclasses.fields(AccelerateSettings)
FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in FIELDS)
DEFAULTS = AccelerateSettings()


class InfotextItem(NamedTuple):
    """How one settings field is written in the "OpenVINO" infotext entry."""

    field: str
    """The settings field."""
    name: str
    """Its name in the infotext: a part's short name (written when the part is on); pasted as "OpenVINO <name>"."""
    slot: int
    """Position in the entry; slots are joined by ", "."""
    spellings: Mapping[str, str] | None = None
    """Value -> text in the entry; None: a text field is written as is, a boolean as its name when true."""


#: The one table of the "OpenVINO" infotext entry, e.g. "CPU, UNet+VAE+TE, auto": slot 0 is the device,
#: slot 1 the names of the parts that are on, joined by "+" (:data:`NO_PARTS` when none is), slot 2 the
#: precision. The fields not listed (model_caching, cache_dir) belong to this machine, not to the image.
INFOTEXT_ITEMS: tuple[InfotextItem, ...] = (
    InfotextItem("device", "device", 0),
    *(InfotextItem(part, PART_NAMES[part], 1) for part in PARTS),
    InfotextItem("precision", "precision", 2, {name: name for name in ov_backend.PRECISIONS}),
    # optional, after the three (``openvino_entry.split_step_cache``): written only with step caching on
    InfotextItem("step_cache", "step caching", SLOTS, {n: STEP_CACHE_SLOT.format(n) for n in INTERVALS}),
)


def format_infotext(settings: AccelerateSettings) -> str:
    """The value of the "OpenVINO" infotext entry (``ov_accelerate_sd.openvino_entry``, the command line's
    too), e.g. "CPU, UNet+VAE+TE, f32"."""
    return format_entry(settings.device, settings.parts, settings.precision, step_cache=settings.step_cache)


def parse_infotext(text: str) -> tuple[dict[str, Any], list[str]]:
    """Read an "OpenVINO" infotext entry back into settings field values.

    A note after ``openvino_entry.NOTE_SEPARATOR`` is ignored. A slot that cannot be read (an unknown
    part or precision, a wrong number of slots) gives no values, only a problem saying what was wrong
    and what would be right; the other slots are still read.

    Returns:
        (field name -> value, problems). Values are those of :class:`AccelerateSettings` (the device as
        written, e.g. "GPU.0"; whether it exists on this machine is for the caller to check).
    """
    entry, step_cache = split_step_cache(text.split(NOTE_SEPARATOR, 1)[0].strip())
    slots = [s.strip() for s in entry.rsplit(", ", SLOTS - 1)]
    if len(slots) != SLOTS:
        return {}, [f"expected 'device, parts, precision' (e.g. {DEFAULTS.infotext()!r}), got {text!r}"]
    values: dict[str, Any] = {}
    problems: list[str] = []
    if step_cache in INTERVALS:  # no step caching slot: made without it
        values["step_cache"] = step_cache
    else:
        known = [STEP_CACHE_SLOT.format(n) for n in INTERVALS[1:]]
        problems.append(f"unknown step caching in {text!r}; known: {known} or none")
    for slot, slot_text in enumerate(slots):
        items = [item for item in INFOTEXT_ITEMS if item.slot == slot]
        if all(isinstance(getattr(DEFAULTS, item.field), bool) for item in items):
            words = [] if slot_text == NO_PARTS else slot_text.split("+")
            known = [item.name for item in items]
            unknown = [word for word in words if word not in known]
            if unknown:
                problems.append(f"unknown part(s) {unknown}; parts are written as {'+'.join(known)} or {NO_PARTS}")
                continue
            values.update({item.field: item.name in words for item in items})
            continue
        (item,) = items
        if item.spellings is None:
            if slot_text:
                values[item.field] = slot_text
            else:
                problems.append(f"empty {item.name}")
            continue
        by_text = {text: value for value, text in item.spellings.items()}
        if slot_text in by_text:
            values[item.field] = by_text[slot_text]
        else:
            problems.append(f"unknown {item.name} {slot_text!r}; known: {list(by_text)}")
    return values, problems


def _check_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(f"OpenVINO setting {name!r} must be true or false (a boolean), got {value!r}")


def build_settings(values: Mapping[str, Any], device_names: Sequence[str] | None = None) -> AccelerateSettings:
    """Build validated settings from a mapping; missing keys take the defaults.

    Args:
        values: field name -> value. A device may be given as a panel label ("GPU.0: Intel ..."); a precision
            by its name (the panel's labels are read by ``ui.panel_values``).
        device_names: the devices OpenVINO sees (from the loaded backend); the device is checked
            against them by ov_backend's device rule (``ov_backend.check_device``). None
            skips the device check.

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
    if device_names is not None:
        device = ov_backend.check_device(device, device_names)
    merged["device"] = device
    if merged["precision"] not in ov_backend.PRECISIONS:
        raise ValueError(f"Unknown precision {merged['precision']!r}; choose one of {list(ov_backend.PRECISIONS)}")
    merged["cache_dir"] = str(merged["cache_dir"] or "").strip()
    step_cache = merged["step_cache"]
    if isinstance(step_cache, float) and step_cache.is_integer() or isinstance(step_cache, str) and \
            step_cache.strip().isdigit():  # a number field, JSON, a typed value
        step_cache = int(step_cache)
    if isinstance(step_cache, bool) or step_cache not in INTERVALS:
        raise ValueError(f"Unknown step caching interval {merged['step_cache']!r}; choose one of {list(INTERVALS)} "
                         "(1: off)")
    merged["step_cache"] = step_cache
    return AccelerateSettings(**merged)


def from_ui_args(args: Sequence[Any], device_names: Sequence[str] | None = None,
                 read: Callable[[Mapping[str, Any]], Mapping[str, Any]] = dict) -> AccelerateSettings:
    """Settings from ``run(p, *args)``: positional in field order; missing trailing args take defaults.
    ``read`` turns the values as the caller has them into field values (the panel's: ``options.panel_values``)."""
    if len(args) > len(FIELD_NAMES):
        raise ValueError(
            f"Accelerate with OpenVINO takes at most {len(FIELD_NAMES)} script_args "
            f"({', '.join(FIELD_NAMES)}), got {len(args)}"
        )
    return build_settings(read(dict(zip(FIELD_NAMES, args))), device_names)


def device_from_label(label: str) -> str:
    """ "GPU.0: Intel(R) Arc(TM) A770 Graphics" -> "GPU.0"; a bare name is returned unchanged."""
    return label.split(": ", 1)[0].strip()
