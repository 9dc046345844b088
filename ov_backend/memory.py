"""How much memory the machine has, and how much of it is available now.

The backend keeps compiled models of the weights used before (another checkpoint, a LoRA removed)
only while memory is plentiful (``BackendSettings.previous_weights``): users run Stable Diffusion
on machines where an extra compiled UNet (gigabytes: ``docs/backend.md``) can decide between a fast switch
back and the out-of-memory killer, and builds a model only where it fits (:mod:`ov_backend.memory_guard`).
Read on Linux from ``/proc/meminfo`` and, where the process runs under a memory limit (a container, a
systemd slice: cgroup v1 or v2), from that limit less the group's use; on Windows from
``GlobalMemoryStatusEx``; elsewhere unknown.
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from pathlib import Path

#: cgroup v1 reports "no limit" as a huge number; anything above this is no limit.
_NO_LIMIT = 1 << 60


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


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text(encoding="ascii").splitlines()
    except OSError:
        return {}
    return {parts[0]: int(parts[1]) for parts in (line.split() for line in lines) if len(parts) == 2
            and parts[1].isdigit()}


def _cgroup_paths() -> tuple[str | None, str | None]:
    """The process's cgroup v1 memory path and its cgroup v2 path (from ``/proc/self/cgroup``)."""
    v1 = v2 = None
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) != 3:
                    continue
                if parts[0] == "0" and parts[1] == "":
                    v2 = parts[2]
                elif "memory" in parts[1].split(","):
                    v1 = parts[2]
    except OSError:
        pass
    return v1, v2


def _cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes the process's memory cgroup may still take (its limit, or the lowest of its parents', less what the
    group uses that the kernel cannot simply drop: its file cache that no process maps counts as free, as the
    machine's ``MemAvailable`` counts page cache; a weight file's pages, dropped from the process after each build,
    are such cache); None when no limit applies or none can be read."""
    v1, v2 = _cgroup_paths()
    if v1 is not None:
        folder = root / "memory" / v1.lstrip("/")
        stat = _stat(folder / "memory.stat")
        limit = stat.get("hierarchical_memory_limit") or _read_int(folder / "memory.limit_in_bytes")
        usage = _read_int(folder / "memory.usage_in_bytes")
        if limit is not None and limit < _NO_LIMIT and usage is not None:
            cache = stat.get("total_cache", stat.get("cache", 0))
            mapped = stat.get("total_mapped_file", stat.get("mapped_file", 0))
            return max(0, limit - (usage - max(0, cache - mapped)))
    if v2 is not None:
        for base in (root, root / "unified"):
            folder = base / v2.lstrip("/")
            if not (folder / "memory.current").exists():
                continue
            usage = _read_int(folder / "memory.current")
            limits = []
            walk = folder
            while True:
                value = _read_int(walk / "memory.max")  # "max" (no limit) reads as None
                if value is not None:
                    limits.append(value)
                if walk == base:
                    break
                walk = walk.parent
            if limits and usage is not None:
                stat = _stat(folder / "memory.stat")
                unmapped = max(0, stat.get("file", 0) - stat.get("file_mapped", 0))
                return max(0, min(limits) - (usage - unmapped))
    return None


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
        found = _linux()
        room = _cgroup_room() if os.path.exists("/proc/self/cgroup") else None
        if found is not None and room is not None and room < found.available:
            return SystemMemory(found.total, room)
        return found
    if sys.platform == "win32":
        return _windows()
    return None
