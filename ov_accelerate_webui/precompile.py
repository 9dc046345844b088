"""Pre-compile: parse the list of sizes, and the record of which sizes are ready per checkpoint."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from . import host

logger = logging.getLogger(__name__)

_SIZE = re.compile(r"^\s*(\d+)\s*[x×X*]\s*(\d+)\s*$")


@dataclass(frozen=True, order=True)
class Size:
    """One generation size that has been compiled."""

    width: int
    height: int
    batch_size: int

    def label(self) -> str:
        """E.g. "512x768 (batch 2)"."""
        return f"{self.width}x{self.height}" + (f" (batch {self.batch_size})" if self.batch_size != 1 else "")


def parse_sizes(text: str, batch_size: int) -> list[Size]:
    """ "512x512, 768x512" -> sizes; multiples of 8 from 64 to 4096.

    Raises:
        ValueError: naming the entry that is not "WIDTHxHEIGHT" or is out of range.
    """
    if int(batch_size) < 1:
        raise ValueError(f"Batch size must be at least 1, got {batch_size}")
    sizes: list[Size] = []
    for entry in filter(None, (e.strip() for e in re.split(r"[,;\n]", text or ""))):
        match = _SIZE.match(entry)
        if not match:
            raise ValueError(f"Size {entry!r} is not WIDTHxHEIGHT, e.g. 512x512")
        width, height = int(match.group(1)), int(match.group(2))
        for value in (width, height):
            if value % 8 or not 64 <= value <= 4096:
                raise ValueError(f"Size {entry!r}: width and height must be multiples of 8 between 64 and 4096")
        size = Size(width, height, int(batch_size))
        if size not in sizes:
            sizes.append(size)
    if not sizes:
        raise ValueError("Give at least one size, e.g. 512x512, 768x512")
    return sizes


class ReadySizes:
    """Which sizes ran accelerated with which settings, per checkpoint (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready: dict[tuple[str, str], set[Size]] = {}

    def add(self, checkpoint: str, settings_label: str, size: Size) -> None:
        """Record that ``size`` is compiled for this checkpoint and settings."""
        with self._lock:
            self._ready.setdefault((checkpoint, settings_label), set()).add(size)

    def for_checkpoint(self, checkpoint: str) -> dict[str, list[Size]]:
        """Settings label -> sorted sizes, for one checkpoint."""
        with self._lock:
            return {label: sorted(sizes) for (ckpt, label), sizes in self._ready.items() if ckpt == checkpoint}

    def clear(self) -> None:
        """Forget everything (model unloaded, memory released)."""
        with self._lock:
            self._ready.clear()


def precompile(extension: Any, sizes_text: str, batch_size: int, settings: Any) -> Iterator[str]:
    """Compile each size ahead of a batch job (a 1-step generation each, through ``extension``, the
    :class:`.extension.Extension`); yields progress lines.

    Raises:
        ValueError: for a malformed size list.
    """
    sizes = parse_sizes(sizes_text, batch_size)
    for number, size in enumerate(sizes, start=1):
        yield f"Compiling {size.label()} ({number}/{len(sizes)}) ..."
        p = host.txt2img_processing(
            prompt="",
            negative_prompt="",
            width=size.width,
            height=size.height,
            batch_size=size.batch_size,
            n_iter=1,
            steps=1,
            do_not_save_samples=True,
            do_not_save_grid=True,
        )
        with host.queue_lock():
            # one window: every size stays compiled; at INT8 its 1-step calls are recorded, and the next
            # generation calibrates on them and its own steps
            extension.run(p, settings, new_window=number == 1, calibrate=False)
    yield f"Ready: {', '.join(s.label() for s in sizes)}."
