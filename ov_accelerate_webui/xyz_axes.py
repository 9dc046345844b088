"""The X/Y/Z plot axes of the extension: "[OpenVINO] Enabled", "[OpenVINO] Precision", "[OpenVINO] Device",
"[OpenVINO] Step caching".

A1111's built-in X/Y/Z plot (``scripts/xyz_grid.py``) keeps its axes in a module-level list,
``axis_options``, read when its ``ui()`` builds the "X type" dropdowns; extensions add theirs to that
list before the UI is built (the ``before_ui`` callback), as sd-webui-controlnet does. The module is
the one A1111 loaded from that file (found in ``modules.scripts.scripts_data``), never imported again.

An axis writes its value for one cell into ``p`` (a copy X/Y/Z makes per cell; the dict is replaced, not
changed, since the copies share it), and the section's ``process`` hook reads it
(:func:`section.section_settings`): the Enabled axis turns acceleration on or off for the cell (an "Off"
cell is stock A1111), and a Precision, Device or Step caching axis (the interval: 1 is off) accelerates the
cell with that value.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from ov_accelerate_sd.step_cache import INTERVALS

from . import host
from .backend_bridge import BackendUnavailable, ov_backend
from .section import ENABLED, OVERRIDE_ATTR

logger = logging.getLogger(__name__)

AXIS_PREFIX = "[OpenVINO] "
ON, OFF = "On", "Off"
#: The Enabled axis' values, and what each means.
ENABLED_VALUES = {ON: True, OFF: False, "True": True, "False": False}


def _setter(key: str, parse: Callable[[str], Any]) -> Callable[[Any, Any, Any], None]:
    def apply(p: Any, value: Any, _values: Any) -> None:
        setattr(p, OVERRIDE_ATTR, {**(getattr(p, OVERRIDE_ATTR, None) or {}), key: parse(str(value).strip())})

    return apply


def _confirm(what: str, known: Callable[[], Sequence[str]]) -> Callable[[Any, Sequence[Any]], None]:
    def confirm(_p: Any, values: Sequence[Any]) -> None:
        allowed = list(known())
        wrong = [v for v in values if str(v).strip() not in allowed]
        if wrong:
            raise RuntimeError(f"{AXIS_PREFIX}{what}: unknown value(s) {wrong}; choose from {allowed}")

    return confirm


def _parse_enabled(text: str) -> bool:
    if text not in ENABLED_VALUES:
        raise ValueError(f"{AXIS_PREFIX}Enabled takes {ON} or {OFF}, got {text!r}")
    return ENABLED_VALUES[text]


def axes(extension: Any) -> list[tuple[str, Callable[..., Any], Callable[[], list[str]], Callable[..., None]]]:
    """(label, apply, choices, confirm) of each axis."""
    precisions = list(ov_backend.PRECISIONS)
    intervals = [str(n) for n in INTERVALS]

    def devices() -> list[str]:
        try:
            names = extension.device_names()
        except BackendUnavailable:
            names = ["CPU"]
        return [*names, "AUTO"]

    return [
        (AXIS_PREFIX + "Enabled", _setter(ENABLED, _parse_enabled), lambda: [ON, OFF],
         _confirm("Enabled", lambda: list(ENABLED_VALUES))),
        (AXIS_PREFIX + "Precision", _setter("precision", str), lambda: precisions,
         _confirm("Precision", lambda: precisions)),
        (AXIS_PREFIX + "Device", _setter("device", str), devices, _confirm("Device", devices)),
        (AXIS_PREFIX + "Step caching", _setter("step_cache", int), lambda: intervals,
         _confirm("Step caching", lambda: intervals)),
    ]


def find_xyz_module() -> Any | None:
    """The module A1111 loaded from its ``scripts/xyz_grid.py`` (None when it is not loaded)."""
    for data in getattr(host.scripts(), "scripts_data", []):
        module = getattr(data, "module", None)
        if module is not None and str(getattr(data, "path", "")).endswith("xyz_grid.py") \
                and hasattr(module, "axis_options") and hasattr(module, "AxisOption"):
            return module
    return None


def register_axes(extension: Any) -> int:
    """Add the axes to X/Y/Z plot (once; the ``before_ui`` callback runs again on a UI reload). Returns how
    many were added."""
    module = find_xyz_module()
    if module is None:
        logger.info("Accelerate with OpenVINO: X/Y/Z plot is not loaded: no [OpenVINO] axes")
        return 0
    existing = {getattr(option, "label", None) for option in module.axis_options}
    added = 0
    for label, apply, choices, confirm in axes(extension):
        if label in existing:
            continue
        module.axis_options.append(module.AxisOption(label, str, apply, choices=choices, confirm=confirm))
        added += 1
    return added
