"""``--ray ADDRESS``: a batch job rendered by the workers of a Ray cluster. The only module that imports Ray.

Ray runs the workers; this module only says what they are: :class:`RenderWorker`, a Ray actor holding one
:class:`~.render.Renderer` (it loads and compiles once, then renders every batch it gets; each node's disk cache
is warm from its second run), with ``num_cpus`` of the node's cores and OpenVINO told to use as many threads.
How many workers, and how many CPUs each, is planned as ``--workers`` plans a machine (:func:`plan_on`): without
``--ray-cpus-per-worker``, up to 4 a worker, fewer when the nodes have fewer. :class:`RayPool` is the pool
interface of :mod:`.pool`. The driver (the process that runs the command) keeps the manifest and writes every
PNG: a worker sends back its images, so the output folder need not be shared.

Fault tolerance is Ray's own: actors are created with ``max_restarts`` and ``max_task_retries``, so a worker
process or node that dies is started again (on another node if its own is gone) and the batch it had is run
again there; the driver writes each image once, when its batch first comes back. What the nodes need: this
project and its requirements installed, and the checkpoints, LoRA files and init images at the paths the job
names (a shared folder, or the same files on every node); see ``docs/batch.md``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from .pool import WorkerPlan, WorkerResults, plan_workers
from .render import Renderer, RenderOptions, RenderResult, RenderTask

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
    """The body of a Ray worker: a renderer."""

    def __init__(self, options: RenderOptions, number: int) -> None:
        self.number = number
        self.renderer = Renderer(options, lambda text: logger.warning("worker %d: %s", number, text))
        self._stop = False

    def render(self, task: RenderTask) -> RenderResult:
        self._stop = False
        return self.renderer.result(task, self.renderer.render(task, None, lambda: self._stop), self.number)

    def stop(self) -> None:
        """Stop the batch running now after its current step (called on a second thread of the actor)."""
        self._stop = True


def connect(address: str) -> Any:
    """The ``ray`` module, connected to the cluster at ``address``.

    Raises:
        ImportError: Ray is not installed (with how to install it).
        ConnectionError: no cluster at ``address``.
    """
    ray = import_ray()
    try:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                 log_to_driver=True, ignore_reinit_error=True)
    except (ConnectionError, getattr(ray.exceptions, "AuthenticationError", ConnectionError)) as exc:
        raise ConnectionError(f"--ray {address}: no Ray cluster answered ({str(exc).splitlines()[0]}). Start "
                              "one with 'ray start --head'; to reach one that uses token authentication by "
                              "its address, set RAY_AUTH_MODE=token with the cluster's token in "
                              "~/.ray/auth_token or RAY_AUTH_TOKEN (docs/batch.md)") from None
    return ray


def plan_on(ray: Any, address: str, requested: int | None, cpus_per_worker: int | None, per_worker_bytes: int,
            batches: int) -> WorkerPlan:
    """The workers the connected cluster holds, planned as ``--workers`` plans a machine's (``pool.plan_workers``)
    over its live nodes' CPUs; ValueError (Ray shut down) when none fits."""
    nodes = [int(node.get("Resources", {}).get("CPU", 0)) for node in ray.nodes() if node.get("Alive")]
    memory = int(ray.cluster_resources().get("memory", 0))
    try:
        return plan_workers(requested, per_worker_bytes, memory or None, list(range(sum(nodes))), batches,
                            nodes=nodes, cores_per_worker=cpus_per_worker)
    except ValueError as exc:
        ray.shutdown()
        raise ValueError(f"--ray {address}: {exc}") from None


class RayPool(WorkerResults):
    """The job's workers on a Ray cluster (the pool interface of :mod:`.pool`).

    Args:
        ray: the ``ray`` module, connected (:func:`connect`).
        address: the cluster's address, as the user gave it.
        options: what every line shares.
        plan: the workers (:func:`plan_on`): how many, and the CPUs (``num_cpus``, OpenVINO's threads) of each;
            Ray places a worker only where its ``per_worker_bytes`` of memory are free.
        say: a line of text for the user.
    """

    def __init__(self, ray: Any, address: str, options: RenderOptions, plan: WorkerPlan,
                 say: Callable[[str], None]) -> None:
        super().__init__()
        self.ray = ray
        self.count = plan.workers
        cpus = plan.cores_per_worker
        actor = ray.remote(num_cpus=cpus, memory=plan.per_worker_bytes, max_restarts=MAX_RESTARTS,
                           max_task_retries=MAX_RESTARTS, max_concurrency=2)(RenderWorker)
        # Ray gives a worker a number of CPUs, not which ones: OpenVINO's own pinning would put every worker's
        # threads on the same first cores of the node (measured: each worker at half speed), so it is off.
        options = dataclasses.replace(options, threads=cpus, cpu_pinning=False)
        self.actors = [actor.remote(options, i + 1) for i in range(self.count)]
        self._say = say
        total = int(ray.cluster_resources().get("CPU", 0))
        say(f"Ray cluster at {address}: {total} CPU(s), {plan.reason}")

    def run(self, tasks: list[RenderTask], on_result: Callable[[RenderResult], None], should_stop: Callable[[], bool],
            on_error: Callable[[RenderTask, BaseException], bool]) -> None:
        """Render every task on the workers, one batch a worker at a time (the pool interface of :mod:`.pool`).

        Raises:
            Interrupted: stopped on request (what finished was handed to ``on_result``).
            RuntimeError: a batch failed on every retry (its worker kept dying).
        """
        from .pipeline import Interrupted

        ray = self.ray
        queue = list(reversed(tasks))
        tries: dict[int, int] = {}  # a task's id -> how often its worker was lost under it
        running: dict[Any, tuple[int, RenderTask]] = {}
        idle = list(range(self.count))
        stopping = False
        while queue or running:
            while idle and queue and not stopping:
                number = idle.pop()
                task = queue.pop()
                running[self.actors[number].render.remote(task)] = (number, task)
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
                    result = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    # The worker's process or its whole node was lost under the batch: Ray retries it on a worker
                    # it starts again (max_task_retries), but a batch in flight when a node goes comes back as
                    # "unavailable, may or may not have run": nothing of it was written here, so it runs again.
                    tries[id(task)] = tries.get(id(task), 0) + 1
                    if tries[id(task)] > MAX_RESTARTS or stopping:
                        raise RuntimeError(f"a Ray worker was lost {tries[id(task)]} times running line "
                                           f"{task.line.number} ({str(exc).splitlines()[0]}); run the same command "
                                           "again to resume") from None
                    self._say(f"worker {number + 1} was lost running line {task.line.number} "
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
                self.keep(result)
                on_result(result)
        if stopping:
            raise Interrupted("stopped on request")

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)
        self.ray.shutdown()
