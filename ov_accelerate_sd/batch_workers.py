"""``--workers N``: a batch job rendered by N processes on one machine, each on its own share of the cores.

:class:`ProcessPool` (the pool interface of :mod:`.pool`) starts the processes of a :class:`~.pool.WorkerPlan`:
each pinned to its cores, OpenVINO and PyTorch told to use that many threads, one :class:`~.render.Renderer`
each, kept for every batch it gets, so it loads and compiles once; the disk cache is shared, so only the first
worker to build a model converts it. Workers only render: the process that runs the command saves every image.
A worker that dies (killed, out of memory) takes nothing with it: the batches it had are given to a new pool; a
worker that fails the same way again and again stops the run with the reason.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from .pool import WorkerPlan, WorkerResults
from .render import Renderer, RenderOptions, RenderResult, RenderTask

logger = logging.getLogger(__name__)

#: Times the pool is started again after a worker died before the run gives up.
MAX_RESTARTS = 3


class _InWorker:
    """The state of one worker process (each process has its own copy of this class)."""

    renderer: Renderer | None = None
    stop: Any = None
    number = 0


def _start(options: RenderOptions, stop: Any, slots: tuple[tuple[int, ...], ...], counter: Any) -> None:
    """A worker's start: its cores, its threads, its renderer; Ctrl-C is the parent's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with counter.get_lock():
        index = counter.value
        counter.value += 1
    cores = slots[index % len(slots)]
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    import torch

    from .console import out

    torch.set_num_threads(len(cores))
    _InWorker.number = index + 1
    _InWorker.stop = stop
    _InWorker.renderer = Renderer(dataclasses.replace(options, threads=len(cores)),
                                  lambda text: out(f"worker {index + 1}: {text}"))


def _render(task: RenderTask) -> RenderResult:
    """One batch in a worker."""
    renderer = _InWorker.renderer
    assert renderer is not None
    return renderer.result(task, renderer.render(task, None, _InWorker.stop.is_set), _InWorker.number)


class ProcessPool(WorkerResults):
    """N worker processes rendering batches (see the module's docstring).

    Args:
        options: what every line shares.
        plan: how many workers and their cores.
        say: a line of text for the user.
    """

    def __init__(self, options: RenderOptions, plan: WorkerPlan, say: Callable[[str], None]) -> None:
        super().__init__()
        self.options = options
        self.plan = plan
        self._say = say
        self._context = multiprocessing.get_context("spawn")
        self._stop = self._context.Event()

    def _pool(self) -> cf.ProcessPoolExecutor:
        counter = self._context.Value("i", 0)
        return cf.ProcessPoolExecutor(self.plan.workers, mp_context=self._context, initializer=_start,
                                      initargs=(self.options, self._stop, self.plan.core_sets, counter))

    def run(self, tasks: list[RenderTask], on_result: Callable[[RenderResult], None], should_stop: Callable[[], bool],
            on_error: Callable[[RenderTask, BaseException], bool]) -> None:
        """Render every task (the pool interface of :mod:`.pool`).

        Raises:
            Interrupted: stopped on request (what finished was handed to ``on_result``).
            RuntimeError: workers kept dying (the pool was started again ``MAX_RESTARTS`` times).
        """
        from .pipeline import Interrupted

        left = dict(enumerate(tasks))
        while left:
            pool = self._pool()
            futures = {pool.submit(_render, task): key for key, task in left.items()}
            broken: BaseException | None = None
            interrupted = False
            try:
                pending = set(futures)
                while pending:
                    finished, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
                    if should_stop() and not self._stop.is_set():
                        self._stop.set()
                    for future in finished:
                        key = futures[future]
                        try:
                            result = future.result()
                        except BrokenProcessPool as exc:
                            broken = exc
                            continue
                        except Interrupted:
                            interrupted = True
                            del left[key]
                            continue
                        except Exception as exc:  # a batch's own error: the caller decides
                            task = left.pop(key)
                            if not on_error(task, exc):
                                raise
                            continue
                        self.keep(result)
                        del left[key]
                        on_result(result)
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
            if interrupted or self._stop.is_set():
                raise Interrupted("stopped on request")
            if broken is not None and left:
                self.restarts += 1
                if self.restarts > MAX_RESTARTS:
                    raise RuntimeError(f"worker processes ended unexpectedly {self.restarts} times ({broken}); "
                                       f"{len(left)} batch(es) not rendered. Run the same command again to resume, "
                                       "with fewer --workers if memory ran short")
                self._say(f"a worker process ended unexpectedly ({broken}); {len(left)} batch(es) it and the "
                          "others had not finished go to new workers")

    def close(self) -> None:
        """Nothing to release: each run's processes end with it."""
