"""A run's progress and summary, one type for ``generate`` and ``batch``: images, batches, steps and time.

:class:`Progress` counts the images (done before, rendered, failed: images a minute and time left) and times the
batches a run renders in its own process (:meth:`Progress.batch_started`, :meth:`Progress.step`,
:meth:`Progress.batch_done` or :meth:`Progress.batch_dropped`). The first batch is the warm-up (each part's first
call: dynamo's capture and OpenVINO's compile); s/it is the mean time between consecutive steps of a batch (the
time before a batch's first step, prompt encoding and in the first batch the UNet's first call, is left out), and
seconds per image come from the kept batches after the first. A batch dropped by Ctrl-C adds its steps to s/it
but no image.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .console import err

logger = logging.getLogger(__name__)


class Progress:
    """Images and timings of a run, from a clock (``time.perf_counter`` unless given).

    Args:
        total: the images of the whole job.
        done_before: the images a resumed job found done.
    """

    def __init__(self, total: int = 0, done_before: int = 0, clock: Callable[[], float] = time.perf_counter) -> None:
        self.total = total
        self.done_before = done_before
        self.clock = clock
        self.started = clock()
        self.rendered = 0
        self.failed = 0
        self._batch_start = 0.0
        self._last_step: float | None = None
        self.batches = 0
        self.first_batch_seconds: float | None = None
        self.step_seconds = 0.0
        self.step_intervals = 0
        self.steady_seconds = 0.0
        self.steady_images = 0

    # images

    @property
    def per_minute(self) -> float | None:
        elapsed = self.clock() - self.started
        return self.rendered * 60.0 / elapsed if self.rendered and elapsed > 0 else None

    def left_text(self) -> str:
        """"2.00 images/min, 2.0 min left" ("" before the first image)."""
        rate = self.per_minute
        left = self.total - self.done_before - self.rendered - self.failed
        if rate is None:
            return ""
        minutes = left / rate
        when = f"{minutes * 60:.0f}s" if minutes < 1 else f"{minutes:.1f} min" if minutes < 60 else \
            f"{minutes / 60:.1f} h"
        return f"{rate:.2f} images/min, {when} left" if left else f"{rate:.2f} images/min"

    def save(self, item: Any, path: Path, then: Callable[[], None] | None = None) -> bool:
        """Write ``item`` (a ``GeneratedImage``) as a PNG with its infotext at ``path`` and run ``then`` (e.g. the
        manifest's record): counted rendered, or failed with the error said (the run goes on)."""
        from .pnginfo import save_png

        try:
            save_png(item.image, path, item.infotext)
            if then is not None:
                then()
        except OSError as exc:
            self.failed += 1
            err(f"error: could not save {path}: {exc.strerror or exc}")
            return False
        self.rendered += 1
        return True

    # batches rendered in this process

    def batch_started(self) -> None:
        self._batch_start = self.clock()
        self._last_step = None

    def step(self) -> None:
        now = self.clock()
        if self._last_step is not None:
            self.step_seconds += now - self._last_step
            self.step_intervals += 1
        self._last_step = now

    def _batch_ended(self) -> float:
        seconds = self.clock() - self._batch_start
        self.batches += 1
        if self.batches == 1:
            self.first_batch_seconds = seconds
        return seconds

    def batch_done(self, images: int) -> None:
        seconds = self._batch_ended()
        if self.batches > 1:
            self.steady_seconds += seconds
            self.steady_images += images

    def batch_dropped(self) -> None:
        self._batch_ended()

    @property
    def seconds_per_step(self) -> float | None:
        return self.step_seconds / self.step_intervals if self.step_intervals else None

    @property
    def seconds_per_image(self) -> float | None:
        """Per kept image after the first batch; None when there is none."""
        return self.steady_seconds / self.steady_images if self.steady_images else None

    def describe(self, stats: dict[str, float] | None) -> str:
        """"first batch 7.1s (first calls: graph capture 9.1s, 3 captured and saved for the next run;
        OpenVINO compile 5.2s), then 0.21 s/it, ...".

        Args:
            stats: the backend's counters, None when no part runs through it.
        """
        if self.first_batch_seconds is None:
            return "no batch finished"
        text = f"first batch {self.first_batch_seconds:.1f}s"
        if stats is not None:
            text += f" (first calls: {capture_text(stats)}OpenVINO compile {stats.get('compile_seconds', 0.0):.1f}s)"
        steady = []
        if self.seconds_per_step is not None:
            steady.append(f"{self.seconds_per_step:.2f} s/it")
        if self.seconds_per_image is not None:
            steady.append(f"{self.seconds_per_image:.2f}s per image after the first batch")
        return text + (", then " + ", ".join(steady) if steady else "")


def capture_text(stats: dict[str, float]) -> str:
    """What the parts' graph capture (dynamo tracing their code) cost: "graph capture 9.1s, 3 captured and
    saved for the next run; " or "graph capture 0.9s, 3 loaded from the cache; " ("" when not measured)."""
    made, saved, loaded = (int(stats.get(k, 0)) for k in ("captures_made", "captures_saved", "captures_loaded"))
    what = []
    if made:
        what.append(f"{made} captured" + (" and saved for the next run" if saved == made else f", {saved} saved"))
    if loaded:
        what.append(f"{loaded} loaded from the cache")
    return f"graph capture {stats.get('capture_seconds', 0.0):.1f}s, {', '.join(what)}; " if what else ""
