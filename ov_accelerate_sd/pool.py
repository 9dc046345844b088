"""Where a job's batches render: one interface for this process, worker processes and a Ray cluster.

A pool renders :class:`~.render.RenderTask`\\ s and hands each :class:`~.render.RenderResult` back, in the process
that runs the command, as it comes (that process saves every image; a pool writes no file). Every pool has:

- ``run(tasks, on_result, should_stop, on_error)``: render every task. ``should_stop`` is polled; True stops every
  renderer after its current step (``Interrupted``). ``on_error(task, exc)`` gets a batch's own error and returns
  True to go on with the others. A dead worker is the pool's business: its batches render again.
- ``stats()``, ``reports()``, ``eager_report()``: every renderer's counters summed, compile reports (a worker's
  prefixed with its number), and what ran in plain PyTorch.
- ``restarts`` (times workers were started again) and ``close()``.

:class:`LocalPool` is this process (``generate``, and ``batch`` without ``--workers``); ``batch_workers.ProcessPool``
and ``batch_ray.RayPool`` the others. :func:`plan_workers` sizes the last two alike: how many workers fit the
cores (a machine's, or a cluster's nodes') and the memory each holds, estimated before any starts.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ov_backend.files import format_bytes

from .render import Renderer, RenderResult, RenderTask, summed

logger = logging.getLogger(__name__)

#: Cores a worker gets when the plan chooses: OpenVINO's CPU plugin reaches most of a core's speed on a Stable
#: Diffusion UNet with 4 threads a stream; fewer threads a worker gives more workers, each slower.
AUTO_CORES_PER_WORKER = 4
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
    """How many workers run, on which cores (a cluster's: how many CPUs each), and why."""

    workers: int
    core_sets: tuple[tuple[int, ...], ...]
    per_worker_bytes: int
    reason: str

    @property
    def cores_per_worker(self) -> int:
        return min(len(cores) for cores in self.core_sets)


def _split(cores: Sequence[int], workers: int) -> tuple[tuple[int, ...], ...]:
    share, extra = divmod(len(cores), workers)
    sets, start = [], 0
    for i in range(workers):
        size = share + (1 if i < extra else 0)
        sets.append(tuple(cores[start:start + size]))
        start += size
    return tuple(sets)


def plan_workers(requested: int | None, per_worker: int, available: int | None, cores: Sequence[int],
                 batches: int, nodes: Sequence[int] | None = None, cores_per_worker: int | None = None) -> WorkerPlan:
    """How many workers to start.

    Args:
        requested: the user's N; None: choose.
        per_worker: bytes one worker may hold (:func:`worker_bytes`).
        available: bytes of memory available now (None: unknown, not limited).
        cores: the cores the run may use (a cluster: its CPUs, numbered).
        batches: batches to render (no more workers than that).
        nodes: a cluster's CPUs by node (None: one machine): a worker's cores are all on one node.
        cores_per_worker: a cluster worker's CPUs as the user gave them (None: up to ``AUTO_CORES_PER_WORKER``,
            fewer when no node has that many).

    Raises:
        ValueError: ``requested`` does not fit the cores or the memory, with the number that would.
    """
    fit = max(1, available // per_worker) if available is not None else len(cores)
    memory = f"{format_bytes(per_worker)} each, {format_bytes(available)} available" if available else \
        f"{format_bytes(per_worker)} each"
    if nodes is not None:
        size = cores_per_worker or max(1, min(AUTO_CORES_PER_WORKER, max(nodes, default=1)))
        by_cores = sum(n // size for n in nodes)
        if by_cores < 1 or (available is not None and available < per_worker):
            raise ValueError(f"the cluster has {len(cores)} CPU(s) ({', '.join(map(str, nodes))} a node) and "
                             f"{format_bytes(available or 0)} for tasks; a worker needs {size} CPU(s) on one node "
                             f"and about {format_bytes(per_worker)}")
        if requested is not None and requested > min(by_cores, fit):
            raise ValueError(f"--workers {requested}: the cluster holds {min(by_cores, fit)} worker(s) of {size} "
                             f"CPU(s) and about {format_bytes(per_worker)} each ({len(cores)} CPU(s), "
                             f"{format_bytes(available or 0)} for tasks)")
        workers = max(1, min(requested or min(by_cores, fit), batches))
        reason = (f"{workers} worker(s) of {size} CPU(s)" + ("" if cores_per_worker else " (chosen from the nodes)")
                  + f", memory for {fit} ({memory})")
        return WorkerPlan(workers, tuple(tuple(cores[i * size:(i + 1) * size]) for i in range(workers)), per_worker,
                          reason)
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


def run_until_stopped(pool: Any, tasks: list[RenderTask], on_result: Callable[[RenderResult], None],
                      on_error: Callable[[RenderTask, BaseException], bool]) -> bool:
    """Render ``tasks`` in ``pool``, the first Ctrl-C asking it to stop after the current step; True when it did."""
    from .console import StopRequest
    from .pipeline import Interrupted

    with StopRequest() as stop:
        try:
            pool.run(tasks, on_result, lambda: stop.requested, on_error)
        except Interrupted:
            return True
    return False


class WorkerResults:
    """What a pool of workers keeps of their results: each worker's last counters, reports and PyTorch report."""

    def __init__(self) -> None:
        self.restarts = 0
        self._last: dict[int, RenderResult] = {}

    def keep(self, result: RenderResult) -> None:
        self._last[result.worker] = result

    def stats(self) -> dict[str, float]:
        """Every worker's counters, summed."""
        return summed(result.stats for result in self._last.values())

    def reports(self) -> list[str]:
        """Every worker's compile reports, each with its worker's number."""
        return [f"worker {number}: {report}" for number, result in sorted(self._last.items())
                for report in result.reports]

    def eager_report(self) -> str | None:
        """What ran in plain PyTorch, by worker (None: nothing)."""
        found = [f"worker {number}: {result.eager}" for number, result in sorted(self._last.items()) if result.eager]
        return "; ".join(found) or None


class LocalPool:
    """The tasks rendered in this process, one after the other, each with a progress bar of its steps.

    Args:
        renderer: renders every task.
        label: a task's progress bar's label.
        progress: times the batches and their steps (optional).
    """

    restarts = 0

    def __init__(self, renderer: Renderer, label: Callable[[RenderTask], str], progress: Any = None) -> None:
        self.renderer = renderer
        self._label = label
        self._progress = progress

    def run(self, tasks: list[RenderTask], on_result: Callable[[RenderResult], None], should_stop: Callable[[], bool],
            on_error: Callable[[RenderTask, BaseException], bool]) -> None:
        from tqdm import tqdm

        from .pipeline import Interrupted

        progress = self._progress
        for task in tasks:
            bar = tqdm(total=task.line.steps, desc=self._label(task), unit="step", leave=False)

            def on_step(step: int, steps: int, bar: Any = bar) -> None:
                if progress is not None:
                    progress.step()
                bar.total = steps
                bar.n = step
                bar.refresh()

            if progress is not None:
                progress.batch_started()
            try:
                images = self.renderer.render(task, on_step, should_stop)
            except Interrupted:
                if progress is not None:
                    progress.batch_dropped()
                raise
            except Exception as exc:
                if not on_error(task, exc):
                    raise
                continue
            finally:
                bar.close()
            if progress is not None:
                progress.batch_done(len(images))
            on_result(RenderResult(task, images))  # (its counters and reports: stats(), reports())

    def stats(self) -> dict[str, float]:
        stats = self.renderer.stats()
        stats["loads"], stats["load_seconds"] = self.renderer.loads, self.renderer.load_seconds
        return stats

    def reports(self) -> list[str]:
        return self.renderer.reports()

    def eager_report(self) -> str | None:
        return self.renderer.eager_report()

    def close(self) -> None:
        self.renderer.close()
