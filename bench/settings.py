"""Benchmark settings: one frozen, validated object built from the command line.

Owns the defaults of a full run and of ``--quick``, and the checks of every value.
Change a settings object with :func:`dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import models, variants

logger = logging.getLogger(__name__)

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
DEFAULT_COMPONENTS: tuple[str, ...] = ("unet", "vae_decoder", "text_encoder")
DEFAULT_VARIANTS: tuple[str, ...] = (
    "eager",
    "stock/auto", "ov_backend/auto", "static/auto",
    "stock/f32", "ov_backend/f32", "static/f32",
)
DEFAULT_RESOLUTIONS: tuple[tuple[int, int], ...] = ((64, 64), (96, 64), (64, 96))


@dataclass(frozen=True)
class BenchSettings:
    """What one benchmark run measures.

    Attributes:
        quick: small models (seconds, for CI) instead of full-size SD 1.5.
        components: component names (see :data:`bench.models.COMPONENTS`).
        variants: variant names, "eager" first (the reference).
        rounds: timed calls of each variant, interleaved round by round.
        size: image size in pixels (the UNet and VAE decoder get a size/8 latent).
        out: folder of the JSON and markdown results.
        work_dir: folder of the weights files and disk caches; None: a temporary folder.
        warm: measure the first call of a second process with a warm disk cache.
        group_by_precision: keep only one precision's compiled models in memory at a time
            (eager stays for every group); needed for full-size models in 24 GiB.
        resolutions: latent (height, width) sizes for the new-shape measurement of the UNet
            through ov_backend; empty to skip it.
        resolutions_dynamic: compile the UNet of the new-shape measurement with
            ``torch.compile(dynamic=True)`` (every dimension symbolic from the first call).
        image_steps: sampler steps of the whole-image split; 0 to skip it.
        image_precision: precision of the whole-image split.
        call_timeout: seconds a worker may take for one answer (a cold conversion included).
        log_level: logging level of the worker processes.
    """

    quick: bool = False
    components: tuple[str, ...] = DEFAULT_COMPONENTS
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    rounds: int = 3
    size: int = 512
    out: Path = DEFAULT_OUT
    work_dir: Path | None = None
    warm: bool = True
    group_by_precision: bool = True
    resolutions: tuple[tuple[int, int], ...] = DEFAULT_RESOLUTIONS
    resolutions_dynamic: bool = False
    image_steps: int = 20
    image_precision: str = "auto"
    call_timeout: float = 3600.0
    log_level: int = logging.WARNING


QUICK_DEFAULTS: dict[str, Any] = {
    "quick": True, "rounds": 2, "size": 64, "group_by_precision": False,
    "resolutions": ((8, 8), (12, 8), (8, 12)), "image_steps": 2, "call_timeout": 600.0,
}

_FIELDS = tuple(f.name for f in dataclasses.fields(BenchSettings))


def _resolution(value: Any) -> tuple[int, int]:
    if isinstance(value, str):
        height, _, width = value.lower().partition("x")
        value = (height, width)
    try:
        height, width = (int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"a latent size is HEIGHTxWIDTH in latent pixels (e.g. 64x96), got {value!r}") from None
    if height < 1 or width < 1:
        raise ValueError(f"latent sizes must be positive, got {height}x{width}")
    return height, width


def build_settings(options: Mapping[str, Any] | None = None) -> BenchSettings:
    """Validated settings; with ``quick`` the quick defaults apply to every key not given.

    Raises:
        ValueError: an unknown key, component, variant or a value out of range (with the valid ones).
    """
    options = {k: v for k, v in dict(options or {}).items() if v is not None}
    unknown = sorted(set(options) - set(_FIELDS))
    if unknown:
        raise ValueError(f"unknown benchmark setting(s) {unknown}; valid: {list(_FIELDS)}")
    if options.get("quick"):
        options = {**QUICK_DEFAULTS, **options}
    if "components" in options:
        options["components"] = tuple(dict.fromkeys(options["components"]))
        for name in options["components"]:
            models.component(name)
    if "variants" in options:
        names = tuple(dict.fromkeys(variants.parse_variant(v).name for v in options["variants"]))
        if "eager" not in names:
            raise ValueError("the variants must include 'eager' (the reference of every ratio and L2 difference)")
        options["variants"] = ("eager", *(n for n in names if n != "eager"))
    if "resolutions" in options:
        options["resolutions"] = tuple(_resolution(r) for r in options["resolutions"])
    for key in ("out", "work_dir"):
        if key in options:
            options[key] = Path(options[key]).expanduser()
    settings = BenchSettings(**options)
    if settings.rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {settings.rounds}")
    if settings.size < 8 or settings.size % 8:
        raise ValueError(f"size must be a positive multiple of 8 (pixels), got {settings.size}")
    if settings.image_steps < 0:
        raise ValueError(f"image_steps must be 0 (skip) or more, got {settings.image_steps}")
    if settings.image_precision not in variants.PRECISIONS:
        raise ValueError(f"image_precision must be one of {list(variants.PRECISIONS)}, "
                         f"got {settings.image_precision!r}")
    if not settings.components:
        raise ValueError(f"give at least one component of {list(models.COMPONENT_NAMES)}")
    return settings
