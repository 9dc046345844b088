"""The "OpenVINO" section of the Settings tab: its option keys, and what they hold, read in one place.

:func:`read_options` is the only reader of the extension's options: the panel's defaults (one option per
settings field, ``openvino_<field>``), "Enable for every generation", "Keep every compiled size", what
happens to the compiled models of the weights used before, and the disk cache's size limit.
``ui.add_settings_section`` registers them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ov_accelerate_sd.step_cache import INTERVALS, StepCacheSettings

from . import host
from .settings import DEFAULTS, FIELDS, AccelerateSettings, build_settings

logger = logging.getLogger(__name__)

SECTION = ("openvino", "OpenVINO")

#: Precision name -> how the panel and the Settings tab show it (the settings hold the name; a value from the
#: panel, or from an API request that copied the panel, is read back by :func:`precision_name`).
PRECISION_LABELS: dict[str, str] = {
    "auto": "Automatic (fastest the device supports)",
    "f32": "Full precision (f32)",
    "int8": "INT8 UNet (calibrated on your first generation; needs NNCF)",
    "int8-weights": "8-bit weights (least memory: UNet and text encoder; computes at Automatic)",
}
#: Step caching interval -> how the panel and the Settings tab show it (read back by :func:`panel_values`).
STEP_CACHE_LABELS: dict[int, str] = {1: "Off", **{n: f"Every {n} steps" for n in INTERVALS[1:]}}

OPTION_PREFIX = "openvino_"


#: Settings-tab option: keep the compiled models of every size in memory, not only the last generation's.
KEEP_SIZES_OPTION = OPTION_PREFIX + "keep_all_sizes"
KEEP_SIZES_LABEL = (
    "Keep every compiled size in memory (a size seen before never compiles again). On the CPU one model "
    "compiled for all sizes serves them (up to about 12% slower per step where measured); on other devices "
    "each size holds its own copy of the weights: about 1.7 GB for an SD 1.5 UNet at bf16. Off: the sizes of the last "
    "generation stay compiled, another costs at most a compile of seconds, never a conversion."
)


#: Settings-tab option: what happens to the compiled models of the weights used before a LoRA or checkpoint
#: change (the backend's ``previous_weights``, for each generation).
PREVIOUS_WEIGHTS_OPTION = OPTION_PREFIX + "previous_weights"
PREVIOUS_WEIGHTS_LABEL = (
    "Compiled models of the checkpoint or LoRA used before a change: keep them in memory, so going back "
    "compiles nothing (about 1.7 GB for an SD 1.5 UNet at bf16), or release them, also from parts not called "
    "since the change (a long prompt's UNet). auto: keep them while a third of the machine's memory is free"
)


#: Settings-tab option: PyTorch's copy of the accelerated weights in a memory-mapped file (``ov_backend``'s
#: ``weights_in_file``): one copy of each weight in memory, OpenVINO's.
WEIGHTS_IN_FILE_OPTION = OPTION_PREFIX + "weights_in_file"
WEIGHTS_IN_FILE_LABEL = (
    "Keep PyTorch's copy of the accelerated weights in a file on disk, in the cache folder (memory holds one copy of "
    "each weight, OpenVINO's; PyTorch reads the file when it needs them, e.g. for a LoRA). Off: both copies stay in "
    "memory (SD 1.5 at f32: about 3.4 GB more). Takes effect for models compiled from then on"
)

#: Settings-tab option: the disk cache's size limit in GB (GiB, as the panel shows sizes; the backend's
#: ``cache_max_bytes``).
CACHE_LIMIT_OPTION = OPTION_PREFIX + "cache_limit_gb"
CACHE_LIMIT_LABEL = (
    "Disk cache limit (GB): after each new compiled model, the least recently used ones are removed until the cache "
    "folder holds at most this, never those in use (an SD 1.5 UNet takes 1.7-3.4 GB, an SDXL one 5-10 GB). 0: no limit"
)

#: Settings-tab option: the always-on section's Enable is on by default (new page loads, API requests that do
#: not send the section's arguments).
ENABLE_ALWAYS_OPTION = OPTION_PREFIX + "enable_always"
#: Settings-tab options: how step caching runs (its interval is the panel's).
STEP_CACHE_DEPTH_OPTION = OPTION_PREFIX + "step_cache_depth"
STEP_CACHE_DEPTH_LABEL = (
    "Step caching depth: the UNet's input blocks (and as many of its last output blocks) a cached step runs; the "
    "deeper, the closer to the full UNet and the slower (SD 1.x/2.x have 12 input blocks, SDXL 9)"
)
STEP_CACHE_START_OPTION = OPTION_PREFIX + "step_cache_full_start"
STEP_CACHE_START_LABEL = "Step caching: sampling steps at the start that always run the full UNet"
STEP_CACHE_END_OPTION = OPTION_PREFIX + "step_cache_full_end"
STEP_CACHE_END_LABEL = "Step caching: sampling steps at the end that always run the full UNet"

ENABLE_ALWAYS_LABEL = (
    "Enable for every generation: the OpenVINO section of txt2img and img2img starts enabled (on a new page "
    "load; API requests that do not send the section's arguments after a restart of the WebUI), and each checkpoint's "
    "weights move into the weight file as it loads"
)


def precision_name(value: object) -> object:
    """The precision name of a panel label; any other value is returned as it is (a name, or a mistake
    for the settings' check to name)."""
    return next((name for name, label in PRECISION_LABELS.items() if label == value), value)


def panel_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """Settings field values as the panel (or an API request that copied it) gives them, with the precision
    as its name."""
    values = dict(values)
    if "precision" in values:
        values["precision"] = precision_name(values["precision"])
    if "step_cache" in values:
        values["step_cache"] = step_cache_interval(values["step_cache"])
    return values


def step_cache_interval(value: object) -> object:
    """The step caching interval of a panel label ("Every 3 steps" -> 3); any other value as it is."""
    return next((n for n, label in STEP_CACHE_LABELS.items() if label == value), value)


def option_key(name: str) -> str:
    """Settings-tab key of a settings field, e.g. "openvino_device"."""
    return OPTION_PREFIX + name


@dataclass(frozen=True)
class Options:
    """The extension's Settings-tab options."""

    panel: AccelerateSettings = DEFAULTS
    """The panel's and the section's defaults."""
    enable_always: bool = False
    """The always-on section starts enabled."""
    keep_all_sizes: bool = False
    """Keep the compiled models of every size in memory (no use windows)."""
    previous_weights: str = "auto"
    """The backend's ``previous_weights`` for each generation, one of ``ov_backend.PREVIOUS_WEIGHTS`` (the backend
    checks it: another value, e.g. edited by hand in ``config.json``, leaves the generation in PyTorch and says
    why)."""
    step_cache: StepCacheSettings = StepCacheSettings()
    """Step caching's depth and full steps (its interval is the panel's, ``AccelerateSettings.step_cache``)."""
    weights_in_file: bool = True
    """PyTorch's copy of the accelerated weights moves into a memory-mapped file before their first compile."""
    cache_limit_bytes: int | None = None
    """The disk cache's size limit in bytes (0: none), the backend's ``cache_max_bytes``; None: the backend's
    default (``ov_backend.DEFAULT_CACHE_MAX_BYTES``, what the option shows until the user changes it)."""


def cache_limit_bytes(value: object) -> int:
    """Bytes of a "Disk cache limit (GB)" value (a number >= 0; GB as powers of 1024, as sizes are shown).

    Raises:
        ValueError: it is no number >= 0.
    """
    try:
        gigabytes = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        gigabytes = float("nan")
    if isinstance(value, bool) or not gigabytes >= 0 or gigabytes == float("inf"):
        raise ValueError(f"the disk cache limit must be a number of GB >= 0 (0: no limit), got {value!r}")
    return int(gigabytes * (1 << 30))


def read_options() -> Options:
    """The options as the Settings tab holds them now. A panel default that is not valid (e.g. edited by hand in
    ``config.json``) gives the panel its defaults, with a WARNING that says which."""
    values = {f.name: host.option(option_key(f.name), getattr(DEFAULTS, f.name)) for f in FIELDS}
    try:
        panel = build_settings(panel_values(values))
    except ValueError as exc:
        logger.warning("Accelerate with OpenVINO: Settings -> OpenVINO: %s; the panel starts at the defaults", exc)
        panel = DEFAULTS
    previous = str(host.option(PREVIOUS_WEIGHTS_OPTION, "auto") or "auto")
    default = StepCacheSettings()
    keys = {"depth": STEP_CACHE_DEPTH_OPTION, "full_start": STEP_CACHE_START_OPTION, "full_end": STEP_CACHE_END_OPTION}
    shape = {name: host.option(key, getattr(default, name)) for name, key in keys.items()}
    try:  # (a slider gives a float)
        step_cache = StepCacheSettings(**{name: int(v) if isinstance(v, float) and v.is_integer() else v
                                          for name, v in shape.items()})
    except ValueError as exc:
        logger.warning("Accelerate with OpenVINO: Settings -> OpenVINO: %s; step caching uses its defaults", exc)
        step_cache = default
    limit_gb = host.option(CACHE_LIMIT_OPTION, None)
    try:
        limit = None if limit_gb is None else cache_limit_bytes(limit_gb)
    except ValueError as exc:
        logger.warning("Accelerate with OpenVINO: Settings -> OpenVINO: %s; using the default limit", exc)
        limit = None
    return Options(panel=panel, enable_always=bool(host.option(ENABLE_ALWAYS_OPTION, False)),
                   keep_all_sizes=bool(host.option(KEEP_SIZES_OPTION, False)), previous_weights=previous,
                   step_cache=step_cache, weights_in_file=bool(host.option(WEIGHTS_IN_FILE_OPTION, True)),
                   cache_limit_bytes=limit)
