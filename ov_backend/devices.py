"""OpenVINO devices: which are present, their full names, and the one rule of valid device strings.

:func:`check_device` is the device rule of every layer: the backend's settings, the SD layer (through
them) and the WebUI adapter's panel and API all call it, so a device string is accepted or refused the
same way everywhere.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import openvino as ov

logger = logging.getLogger(__name__)

#: Device prefixes that take a comma-separated list of devices after the colon.
MULTI_DEVICE_PREFIXES: tuple[str, ...] = ("AUTO", "BATCH", "HETERO", "MULTI")


@dataclass(frozen=True)
class DeviceInfo:
    """One device OpenVINO sees.

    Attributes:
        name: the name ``compile_model`` takes, e.g. "GPU.0".
        full_name: the marketing name, e.g. "Intel(R) Arc(TM) A770 Graphics".
        capabilities: the device's OPTIMIZATION_CAPABILITIES, e.g. ("FP32", "BF16").
    """

    name: str
    full_name: str
    capabilities: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """"GPU.0: Intel(R) Arc(TM) A770 Graphics"."""
        return f"{self.name}: {self.full_name}" if self.full_name else self.name


@functools.cache
def shared_core() -> ov.Core:
    """The process's OpenVINO core, made on first use: every backend compiles with it and the device
    queries ask it (a core loads each device's plugin once, on first use)."""
    return ov.Core()


def available_devices(core: ov.Core | None = None) -> list[str]:
    """The device names in ``openvino.Core().available_devices``."""
    return list((core or shared_core()).available_devices)


def device_info(core: ov.Core | None = None) -> list[DeviceInfo]:
    """Every available device with its full name and capabilities."""
    core = core or shared_core()
    found = []
    for name in core.available_devices:
        try:
            full_name = str(core.get_property(name, "FULL_DEVICE_NAME"))
        except RuntimeError as err:  # a plugin that cannot answer still lists its device
            logger.warning("OpenVINO device %s did not report its name: %s", name, err)
            full_name = ""
        try:
            caps = tuple(str(c) for c in core.get_property(name, "OPTIMIZATION_CAPABILITIES"))
        except RuntimeError:
            caps = ()
        found.append(DeviceInfo(name=name, full_name=full_name, capabilities=caps))
    return found


def list_devices(core: ov.Core | None = None) -> list[tuple[str, str]]:
    """``[(name, full_name)]`` for every available device."""
    return [(d.name, d.full_name) for d in device_info(core)]


def _known(part: str, available: list[str]) -> bool:
    generic = {name.split(".", 1)[0] for name in available}
    return part in available or part in generic


def unknown_device_parts(device: str, available: list[str]) -> str | None:
    """The first part of ``device`` that names no available device, or None if all do.

    "AUTO" alone is always valid; "HETERO:GPU,CPU", "MULTI:...", "AUTO:..." and "BATCH:..."
    need each listed device to be available (a generic name such as "GPU" matches "GPU.0").
    """
    if device == "AUTO":
        return None
    prefix, sep, rest = device.partition(":")
    if sep and prefix in MULTI_DEVICE_PREFIXES:
        parts = [p.strip() for p in rest.split(",")]
        if not parts or any(not p for p in parts):
            return device
        for part in parts:
            name = part.split("(", 1)[0]  # BATCH:GPU(4)
            if not _known(name, available):
                return part
        return None
    return None if _known(device, available) else device


def check_device(device: object, available: Sequence[str]) -> str:
    """``device`` stripped, if it names available devices; otherwise a ValueError listing them.

    The rule: a name in ``available`` ("GPU.0"), a generic name of one ("GPU" for "GPU.0"), "AUTO",
    or "AUTO:" / "HETERO:" / "MULTI:" / "BATCH:" followed by a comma-separated list of such names
    ("BATCH:GPU(4)" takes a batch size in parentheses). These are the names OpenVINO's
    ``compile_model`` takes.

    Raises:
        ValueError: not a string, empty, or a part that names no available device (named, with the
            available devices).
    """
    if not isinstance(device, str) or not device.strip():
        raise ValueError(f"option 'device' must be a device name, got {device!r}")
    device = device.strip()
    problem = unknown_device_parts(device, list(available))
    if problem:
        raise ValueError(
            f"unknown OpenVINO device {problem!r} in {device!r}; available devices: "
            f"{', '.join(available) or 'none'} (also AUTO, a generic name such as GPU for GPU.0, "
            f"and {'/'.join(p + ':' for p in MULTI_DEVICE_PREFIXES)} lists of them)"
        )
    return device
