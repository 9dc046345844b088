"""``--workers N``: a batch job rendered by N processes on one machine, each on its own share of the cores.

Owns :func:`plan_workers` (how many workers fit: the cores, and the memory each one holds, estimated before
any starts; an N that does not fit is refused with the N that would) and :class:`WorkerPool` (the processes:
each pinned to its cores, OpenVINO and PyTorch told to use that many threads, one :class:`BatchRenderer` each,
kept for every batch it gets, so it loads and compiles once; the disk cache is shared, so only the first worker
to build a model converts it). The process that runs the command keeps the manifest and writes every PNG:
workers only render. A worker that dies (killed, out of memory) takes nothing with it: the batches it had are
given to a new pool; a worker that fails the same way again and again stops the run with the reason.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ov_backend.files import format_bytes

from .batch_render import BatchRenderer, RenderOptions, summed

logger = logging.getLogger(__name__)

#: Cores a worker gets when ``--workers auto`` chooses: OpenVINO's CPU plugin reaches most of a core's speed on
#: a Stable Diffusion UNet with 4 threads a stream; fewer threads a worker gives more workers, each slower.
AUTO_CORES_PER_WORKER = 4
#: Times the pool is started again after a worker died before the run gives up.
MAX_RESTARTS = 3
#: Bytes a worker holds beside the weights: the interpreter, torch, OpenVINO, a batch's activations.
WORKER_OVERHEAD = 1 << 30
#: Bytes per parameter a worker holds at its peak: PyTorch's f32 copy as the checkpoint loads (4; it moves into
#: the weight file as OpenVINO builds) and, beside what is left of it, OpenVINO's compiled copy, by precision
#: (f32 counted at every CPU's worst: a CPU without bf16 compiles *Automatic* at f32). The WebUI's whole
#: process at f32 on full-size SD 1.5 peaked at 7.1 GiB, 1.07 billion parameters (docs/memory.md). INT8 adds NNCF's
#: quantization (its statistics model compiled beside the float one): a worker of ``bench batch --precision int8``
#: on SD 1.5 peaked at 9.3 GiB (bench/results/batch-sd15-int8-zen4-2026-11-28.md).
_BYTES_PER_PARAMETER = {"f32": 6.0, "auto": 6.0, "int8": 9.0, "int8-weights": 5.0}


def usable_cores() -> list[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def checkpoint_parameters(path: str) -> int:
    """The number of values in a checkpoint (from a safetensors header; else its file size over 2)."""
    import math

    from .checkpoint import CheckpointError, safetensors_header

    if path.lower().endswith(".safetensors"):
        try:
            return sum(math.prod(int(n) for n in info.get("shape", [])) for info in
                       safetensors_header(Path(path))[1].values())
        except CheckpointError:
            pass
    return os.path.getsize(path) // 2


def worker_bytes(models: Iterable[tuple[str, str]]) -> int:
    """What one worker may hold at its peak, for the largest of ``models`` ((checkpoint path, precision))."""
    return max((int(checkpoint_parameters(path) * _BYTES_PER_PARAMETER.get(precision, 6.0)) for path, precision
                in models), default=0) + WORKER_OVERHEAD


@dataclass(frozen=True)
class WorkerPlan:
    """How many workers run, on which cores, and why."""

    workers: int
    core_sets: tuple[tuple[int, ...], ...]
    per_worker_bytes: int
    reason: str


def _split(cores: Sequence[int], workers: int) -> tuple[tuple[int, ...], ...]:
    share, extra = divmod(len(cores), workers)
    sets, start = [], 0
    for i in range(workers):
        size = share + (1 if i < extra else 0)
        sets.append(tuple(cores[start:start + size]))
        start += size
    return tuple(sets)


def plan_workers(requested: int | None, per_worker: int, available: int | None, cores: Sequence[int],
                 batches: int) -> WorkerPlan:
    """How many workers to start.

    Args:
        requested: the user's N; None: choose (``--workers auto``).
        per_worker: bytes one worker may hold (:func:`worker_bytes`).
        available: bytes of memory available now (None: unknown, not limited).
        cores: the cores the run may use.
        batches: batches to render (no more workers than that).

    Raises:
        ValueError: ``requested`` does not fit the cores or the memory, with the number that would.
    """
    fit = max(1, available // per_worker) if available is not None else len(cores)
    memory = f"{format_bytes(per_worker)} each, {format_bytes(available)} available" if available else \
        f"{format_bytes(per_worker)} each"
    if requested is None:
        workers = max(1, min(len(cores) // AUTO_CORES_PER_WORKER, fit, batches))
        reason = (f"auto: {workers} of {len(cores)} core(s) at up to {AUTO_CORES_PER_WORKER} a worker, memory for "
                  f"{fit} ({memory})")
    else:
        if requested > len(cores):
            raise ValueError(f"--workers {requested}: this run may use {len(cores)} core(s), and a worker needs "
                             f"one of its own; --workers {len(cores)} or fewer would run")
        if available is not None and requested * per_worker > available:
            raise ValueError(f"--workers {requested} would hold about {format_bytes(requested * per_worker)} "
                             f"({memory}): the machine would swap or the kernel end the run. --workers {fit} "
                             "fits, or use --precision int8-weights for less memory a worker")
        workers = max(1, min(requested, batches))
        reason = f"{workers} requested" + (f" (only {batches} batch(es) to render)" if workers < requested else "")
    return WorkerPlan(workers, _split(cores, workers), per_worker, reason)


class _InWorker:
    """The state of one worker process (each process has its own copy of this class)."""

    renderer: BatchRenderer | None = None
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

    torch.set_num_threads(len(cores))
    _InWorker.number = index + 1
    _InWorker.stop = stop
    from .cli import _out

    _InWorker.renderer = BatchRenderer(dataclasses.replace(options, threads=len(cores)),
                                       lambda text: _out(f"worker {index + 1}: {text}"))


def _render(task: tuple[Any, int, int]) -> tuple[list[Any], int, dict[str, float]]:
    """One batch in a worker: its images, the worker's number and its counters so far."""
    line, seed, batch = task
    renderer = _InWorker.renderer
    assert renderer is not None
    images = renderer.render(line, seed, batch, None, _InWorker.stop.is_set)
    stats = renderer.stats()
    stats["loads"], stats["load_seconds"] = renderer.loads, renderer.load_seconds
    return images, _InWorker.number, stats


class WorkerPool:
    """N worker processes rendering batches (see the module's docstring).

    Args:
        options: what every line shares.
        plan: how many workers and their cores.
        say: a line of text for the user.
    """

    def __init__(self, options: RenderOptions, plan: WorkerPlan, say: Callable[[str], None]) -> None:
        self.options = options
        self.plan = plan
        self._say = say
        self._context = multiprocessing.get_context("spawn")
        self._stop = self._context.Event()
        self.worker_stats: dict[int, dict[str, float]] = {}
        self.restarts = 0

    def _pool(self) -> cf.ProcessPoolExecutor:
        counter = self._context.Value("i", 0)
        return cf.ProcessPoolExecutor(self.plan.workers, mp_context=self._context, initializer=_start,
                                      initargs=(self.options, self._stop, self.plan.core_sets, counter))

    def stats(self) -> dict[str, float]:
        """Every worker's counters, summed."""
        return summed(self.worker_stats.values())

    def run(self, tasks: list[Any], on_result: Callable[[Any, list[Any]], None], should_stop: Callable[[], bool],
            on_error: Callable[[Any, BaseException], bool]) -> None:
        """Render every task ((line, seed, batch, ...) tuples), calling ``on_result(task, images)`` in this
        process as each finishes.

        Args:
            should_stop: polled twice a second; True asks every worker to stop after its current step.
            on_error: a task's error other than a dead worker; returns True to go on with the others.

        Raises:
            Interrupted: stopped on request (what finished was handed to ``on_result``).
            RuntimeError: workers kept dying (the pool was started again ``MAX_RESTARTS`` times).
        """
        from .pipeline import Interrupted

        left = dict(enumerate(tasks))
        while left:
            pool = self._pool()
            futures = {pool.submit(_render, task[:3]): (key, task) for key, task in left.items()}
            broken: BaseException | None = None
            interrupted = False
            try:
                pending = set(futures)
                while pending:
                    finished, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
                    if should_stop() and not self._stop.is_set():
                        self._stop.set()
                    for future in finished:
                        key, task = futures[future]
                        try:
                            images, number, stats = future.result()
                        except BrokenProcessPool as exc:
                            broken = exc
                            continue
                        except Interrupted:
                            interrupted = True
                            del left[key]
                            continue
                        except Exception as exc:  # a batch's own error: the caller decides
                            del left[key]
                            if not on_error(task, exc):
                                raise
                            continue
                        self.worker_stats[number] = stats
                        del left[key]
                        on_result(task, images)
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
