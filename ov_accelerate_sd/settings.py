"""Settings of the Stable Diffusion layer: one frozen, validated object and its builder.

The SD layer's options are a small superset of what the WebUI script offers (device, precision,
caching, cache folder, which parts run through OpenVINO). ``backend_choice`` is the backend they choose,
as the WebUI's settings give theirs, so both entry points configure the backend the same way.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from ov_backend.precision import DEFAULT_PRECISION, PRECISIONS

from .backends import BackendChoice
from .parts import PARTS, in_order
from .step_cache import StepCacheSettings

logger = logging.getLogger(__name__)



@dataclasses.dataclass(frozen=True)
class SDSettings:
    """How the Stable Diffusion layer routes a pipeline through ov_backend."""

    device: str = "CPU"
    """OpenVINO device name ("CPU", "GPU", "AUTO", ...); checked by ov_backend's device rule."""
    precision: str = DEFAULT_PRECISION
    """A name of ``ov_backend.precision.PRECISIONS``: "auto" lets the plugin choose (bf16 on CPUs that
    have it); "f32" forces f32 inference. ov_backend maps it to the plugin's properties."""
    model_caching: bool = True
    """Store compiled models on disk so a later run skips conversion."""
    cache_dir: str | None = None
    """Folder of the compiled-model cache; None means ov_backend's per-user default."""
    cache_max_bytes: int | None = None
    """The compiled-model cache's size limit in bytes (0: none); None means ov_backend's default."""
    accelerate: tuple[str, ...] = PARTS
    """The parts that run through OpenVINO, in ``PARTS`` order; the others stay in PyTorch."""
    prediction_type: str | None = None
    """Override of the checkpoint's prediction type ("epsilon" or "v_prediction"); None: detect."""
    step_cache: StepCacheSettings = StepCacheSettings()
    """Step caching of the UNet (DeepCache; off by default): its interval, depth and full steps."""
    threads: int | None = None
    """OpenVINO's threads per inference (``BackendChoice.threads``); None: every core the process may use."""
    cpu_pinning: bool | None = None
    """Whether the CPU plugin pins its threads to cores (``BackendChoice.cpu_pinning``); None: its default."""
    shared_shapes: str | None = None
    """One compiled model for every shape or one per shape (``BackendChoice.shared_shapes``, checked by the backend
    when it is made); None: the backend's default."""

    def backend_choice(self) -> BackendChoice:
        """The backend these settings choose (see :class:`~.backends.Backends`)."""
        return BackendChoice(device=self.device, precision=self.precision, model_caching=self.model_caching,
                             cache_dir=self.cache_dir, cache_max_bytes=self.cache_max_bytes, threads=self.threads,
                             cpu_pinning=self.cpu_pinning, shared_shapes=self.shared_shapes)


_FIELDS = tuple(f.name for f in dataclasses.fields(SDSettings))


def build_sd_settings(options: Mapping[str, Any] | None = None) -> SDSettings:
    """Build validated settings from a plain mapping.

    Args:
        options: keys among the fields of ``SDSettings``; missing keys take the defaults.

    Returns:
        The frozen settings.

    Raises:
        ValueError: an unknown key (named) or a value out of range (with the valid ones).
    """
    options = dict(options or {})
    unknown = sorted(set(options) - set(_FIELDS))
    if unknown:
        raise ValueError(f"unknown SD setting(s) {unknown}; valid keys: {list(_FIELDS)}")
    if "accelerate" in options:
        options["accelerate"] = in_order(options["accelerate"])
    step_cache = options.get("step_cache")
    if isinstance(step_cache, Mapping):
        options["step_cache"] = StepCacheSettings(**step_cache)
    elif isinstance(step_cache, int) and not isinstance(step_cache, bool):
        options["step_cache"] = StepCacheSettings(interval=step_cache)
    elif step_cache is not None and not isinstance(step_cache, StepCacheSettings):
        raise ValueError(f"step_cache must be an interval (1: off), a mapping of StepCacheSettings fields or "
                         f"StepCacheSettings, got {step_cache!r}")
    settings = SDSettings(**options)
    if settings.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {settings.precision!r}")
    if not isinstance(settings.device, str) or not settings.device:
        raise ValueError(f"device must be a non-empty device name, got {settings.device!r}")
    if settings.threads is not None and (isinstance(settings.threads, bool) or not isinstance(settings.threads, int)
                                         or settings.threads < 1):
        raise ValueError(f"threads must be a whole number >= 1 or None, got {settings.threads!r}")
    if settings.cpu_pinning not in (None, True, False):
        raise ValueError(f"cpu_pinning must be True, False or None, got {settings.cpu_pinning!r}")
    if settings.prediction_type not in (None, "epsilon", "v_prediction"):
        raise ValueError(
            f"prediction_type must be 'epsilon', 'v_prediction' or None, got {settings.prediction_type!r}"
        )
    return settings
