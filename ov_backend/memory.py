"""How much memory the machine has, and how much of it is available now.

The backend keeps compiled models of the weights used before (another checkpoint, a LoRA removed)
only while memory is plentiful (``BackendSettings.previous_weights``): users run Stable Diffusion
on machines where an extra compiled UNet (gigabytes: ``docs/backend.md``) can decide between a fast switch
back and the out-of-memory killer. Read on Linux from ``/proc/meminfo`` and on Windows from
``GlobalMemoryStatusEx``; elsewhere unknown.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class SystemMemory:
    """Bytes of physical memory: in total, and available to a process now without swapping."""

    total: int
    available: int


def _linux() -> SystemMemory | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
    except (OSError, ValueError, IndexError):
        return None
    if "MemTotal" not in fields or "MemAvailable" not in fields:
        return None
    return SystemMemory(fields["MemTotal"], fields["MemAvailable"])


def _windows() -> SystemMemory | None:
    class _Status(ctypes.Structure):
        _fields_ = [("dwLength", ctypes.c_ulong), ("dwMemoryLoad", ctypes.c_ulong),
                    ("ullTotalPhys", ctypes.c_ulonglong), ("ullAvailPhys", ctypes.c_ulonglong),
                    ("ullTotalPageFile", ctypes.c_ulonglong), ("ullAvailPageFile", ctypes.c_ulonglong),
                    ("ullTotalVirtual", ctypes.c_ulonglong), ("ullAvailVirtual", ctypes.c_ulonglong),
                    ("ullAvailExtendedVirtual", ctypes.c_ulonglong)]

    status = _Status()
    status.dwLength = ctypes.sizeof(_Status)
    if not ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):  # type: ignore[attr-defined]
        return None
    return SystemMemory(int(status.ullTotalPhys), int(status.ullAvailPhys))


def system_memory() -> SystemMemory | None:
    """The machine's memory now, or None where it cannot be read."""
    if sys.platform.startswith("linux"):
        return _linux()
    if sys.platform == "win32":
        return _windows()
    return None
