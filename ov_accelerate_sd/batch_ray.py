"""``--ray ADDRESS``: a batch job rendered by the workers of a Ray cluster. The only module that imports Ray.

Ray runs the workers; this module only says what they are: :class:`RenderActor`, a Ray actor holding one
:class:`~.batch_render.BatchRenderer` (it loads and compiles once, then renders every batch it gets; each
node's disk cache is warm from its second run), with ``num_cpus`` of the node's cores and OpenVINO told to use
as many threads. The driver (the process that runs the command) keeps the manifest and writes every PNG: a
worker sends back its images as PNG bytes with their infotext, so the output folder need not be shared.

Fault tolerance is Ray's own: actors are created with ``max_restarts`` and ``max_task_retries``, so a worker
process or node that dies is started again (on another node if its own is gone) and the batch it had is run
again there; the driver writes each image once, when its batch first comes back. What the nodes need: this
project and its requirements installed, and the checkpoints, LoRA files and init images at the paths the job
names (a shared folder, or the same files on every node); see ``docs/batch.md``.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from typing import Any

from ov_backend.files import format_bytes

from .batch_render import BatchRenderer, RenderOptions, summed

logger = logging.getLogger(__name__)

#: How often Ray starts a dead worker again, and runs a batch again after its worker died, before giving up.
MAX_RESTARTS = 3
INSTALL_HINT = ("--ray needs Ray, an optional extra of this project: pip install -r requirements-ray.txt "
                "(or pip install '.[ray]')")


def import_ray() -> Any:
    """The ``ray`` module, or ImportError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return ray


class RenderWorker:
    """The body of a Ray worker: a renderer whose images leave as PNG bytes."""

    def __init__(self, options: RenderOptions, number: int) -> None:
        self.number = number
        self.renderer = BatchRenderer(options, lambda text: logger.warning("worker %d: %s", number, text))
        self._stop = False

    def render(self, line: Any, seed: int, batch: int) -> tuple[list[tuple[int, bytes, str, float]], dict[str, float]]:
        """A batch: [(seed, PNG bytes with the infotext, infotext, seconds)] and this worker's counters."""
        from .pnginfo import png_bytes

        self._stop = False
        made = self.renderer.render(line, seed, batch, None, lambda: self._stop)
        stats = self.renderer.stats()
        stats["loads"], stats["load_seconds"] = self.renderer.loads, self.renderer.load_seconds
        return [(item.seed, png_bytes(item.image, item.infotext), item.infotext, item.seconds) for item in made], stats

    def stop(self) -> None:
        """Stop the batch running now after its current step (called on a second thread of the actor)."""
        self._stop = True


class _Image:
    """An image as it came back from a worker, with what the driver's saving needs."""

    def __init__(self, seed: int, data: bytes, infotext: str, seconds: float) -> None:
        self.seed = seed
        self.data = data
        self.infotext = infotext
        self.seconds = seconds

    @property
    def image(self) -> Any:
        from PIL import Image

        return Image.open(io.BytesIO(self.data))


class RayCluster:
    """The job's workers on a Ray cluster.

    Args:
        address: "auto" (the running local instance), "ray://host:10001" or "host:6379".
        options: what every line shares.
        cpus_per_worker: the ``num_cpus`` of each worker (and OpenVINO's threads in it).
        workers: how many workers (None: as many as the cluster's CPUs and memory hold).
        per_worker_bytes: the memory a worker may hold (``batch_workers.worker_bytes``): Ray places a worker
            only where that much is free.
        say: a line of text for the user.

    Raises:
        ImportError: Ray is not installed (with how to install it).
        ConnectionError: no cluster at ``address``.
    """

    def __init__(self, address: str, options: RenderOptions, cpus_per_worker: int, workers: int | None,
                 per_worker_bytes: int, say: Callable[[str], None]) -> None:
        import dataclasses

        ray = self.ray = import_ray()
        try:
            ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                     log_to_driver=True, ignore_reinit_error=True)
        except (ConnectionError, getattr(ray.exceptions, "AuthenticationError", ConnectionError)) as exc:
            raise ConnectionError(f"--ray {address}: no Ray cluster answered ({str(exc).splitlines()[0]}). Start "
                                  "one with 'ray start --head'; to reach one that uses token authentication by "
                                  "its address, set RAY_AUTH_MODE=token with the cluster's token in "
                                  "~/.ray/auth_token or RAY_AUTH_TOKEN (docs/batch.md)") from None
        resources = ray.cluster_resources()
        cpus, memory = int(resources.get("CPU", 0)), int(resources.get("memory", 0))
        by_cpu = cpus // cpus_per_worker
        by_memory = memory // per_worker_bytes if memory else by_cpu
        if min(by_cpu, by_memory) < 1:
            ray.shutdown()
            raise ValueError(f"--ray {address}: the cluster has {cpus} CPU(s) and {format_bytes(memory)} for tasks; a "
                             f"worker needs {cpus_per_worker} CPU(s) (--ray-cpus-per-worker) and about "
                             f"{format_bytes(per_worker_bytes)}")
        if workers is not None and workers > min(by_cpu, by_memory):
            ray.shutdown()
            raise ValueError(f"--workers {workers}: the cluster holds {min(by_cpu, by_memory)} worker(s) of "
                             f"{cpus_per_worker} CPU(s) and about {format_bytes(per_worker_bytes)} each ({cpus} "
                             f"CPU(s), {format_bytes(memory)} for tasks)")
        self.count = workers or min(by_cpu, by_memory)
        actor = ray.remote(num_cpus=cpus_per_worker, memory=per_worker_bytes, max_restarts=MAX_RESTARTS,
                           max_task_retries=MAX_RESTARTS, max_concurrency=2)(RenderWorker)
        # Ray gives a worker a number of CPUs, not which ones: OpenVINO's own pinning would put every worker's
        # threads on the same first cores of the node (measured: each worker at half speed), so it is off.
        options = dataclasses.replace(options, threads=cpus_per_worker, cpu_pinning=False)
        self.actors = [actor.remote(options, i + 1) for i in range(self.count)]
        self.worker_stats: dict[int, dict[str, float]] = {}
        self._say = say
        say(f"Ray cluster at {address}: {cpus} CPU(s), {self.count} worker(s) of {cpus_per_worker} CPU(s)")

    def stats(self) -> dict[str, float]:
        """Every worker's counters, summed."""
        return summed(self.worker_stats.values())

    def run(self, tasks: list[Any], on_result: Callable[[Any, list[Any]], None], should_stop: Callable[[], bool],
            on_error: Callable[[Any, BaseException], bool]) -> None:
        """Render every task ((line, seed, batch, ...) tuples) on the workers, one batch a worker at a time,
        calling ``on_result(task, images)`` in this process as each comes back.

        Raises:
            Interrupted: stopped on request (what finished was handed to ``on_result``).
            RuntimeError: a batch failed on every retry (its worker kept dying).
        """
        from .pipeline import Interrupted

        ray = self.ray
        queue = list(reversed(tasks))
        tries: dict[int, int] = {}  # a task's id -> how often its worker was lost under it
        running: dict[Any, tuple[int, Any]] = {}
        idle = list(range(self.count))
        stopping = False
        while queue or running:
            while idle and queue and not stopping:
                number = idle.pop()
                task = queue.pop()
                line, seed, batch = task[:3]
                running[self.actors[number].render.remote(line, seed, batch)] = (number, task)
            if not running:
                break
            done, _ = ray.wait(list(running), num_returns=1, timeout=0.5)
            if should_stop() and not stopping:
                stopping = True
                for number, _ in running.values():
                    self.actors[number].stop.remote()
            for ref in done:
                number, task = running.pop(ref)
                idle.append(number)
                try:
                    images, stats = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    # The worker's process or its whole node was lost under the batch: Ray retries it on a worker
                    # it starts again (max_task_retries), but a batch in flight when a node goes comes back as
                    # "unavailable, may or may not have run": nothing of it was written here, so it runs again.
                    tries[id(task)] = tries.get(id(task), 0) + 1
                    if tries[id(task)] > MAX_RESTARTS or stopping:
                        raise RuntimeError(f"a Ray worker was lost {tries[id(task)]} times running line "
                                           f"{task[0].number} ({str(exc).splitlines()[0]}); run the same command "
                                           "again to resume") from None
                    self._say(f"worker {number + 1} was lost running line {task[0].number} "
                              f"({str(exc).splitlines()[0][:160]}); its batch runs again")
                    queue.append(task)
                    continue
                except ray.exceptions.RayTaskError as exc:
                    cause = exc.as_instanceof_cause()
                    if isinstance(cause, Interrupted) or isinstance(getattr(exc, "cause", None), Interrupted):
                        continue
                    if not on_error(task, getattr(exc, "cause", None) or cause):
                        raise
                    continue
                self.worker_stats[number] = stats
                on_result(task, [_Image(*item) for item in images])
        if stopping:
            raise Interrupted("stopped on request")

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)
        self.ray.shutdown()
