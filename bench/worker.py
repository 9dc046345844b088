"""The worker processes: one variant of one component per process.

A worker maps the component's weights, prepares its variant, times the first call (cold:
conversion and compile included, or warm when the disk cache is already filled) and then
serves the coordinator's requests over a pipe: ``run`` (one timed call: wall and CPU
seconds of the process, all its threads), ``output`` (save
the last output for the L2 comparison) and ``quit`` (answers with the process's peak RSS).
Workers are forked from a ``forkserver`` that imported the heavy libraries once
(:data:`PRELOAD`) and did nothing else, so each worker is a clean process whose
``ru_maxrss`` is its own (the imported libraries included, as in any fresh process).

Two more tasks run whole in a worker: :func:`resolutions_task` (first-call times of a new
input shape through ov_backend) and the whole-image split (:mod:`bench.image`).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import multiprocessing
import os
import resource
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: Imported once by the fork server, so each worker starts without paying for them again.
#: ``openvino.torch`` is not among them: only the stock variant's workers import it.
PRELOAD: tuple[str, ...] = (
    "torch", "openvino", "numpy", "diffusers.models.autoencoders.autoencoder_kl",
    "diffusers.models.unets.unet_2d_condition", "transformers.models.clip.modeling_clip", "ov_backend",
    "bench.models", "bench.variants", "bench.worker", "bench.image",
)


@dataclass(frozen=True)
class WorkerTask:
    """What a worker process does.

    Attributes:
        component: component name.
        variant: variant name (see :func:`bench.variants.parse_variant`).
        quick: small models.
        weights: the component's weights file.
        inputs: the example inputs file.
        cache_dir: disk cache folder for the cacheable variants.
        caching: use the disk cache.
        log_level: logging level of the worker.
    """

    component: str
    variant: str
    quick: bool
    weights: Path
    inputs: Path
    cache_dir: Path
    caching: bool = True
    log_level: int = logging.WARNING


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``ru_maxrss`` is in KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def resident_bytes() -> dict[str, int]:
    """Current VmRSS and its anonymous and file-backed parts (Linux; empty elsewhere)."""
    found: dict[str, int] = {}
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile"):
                    found[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return found


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise), so idle workers stay small."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _configure_logging(level: int) -> None:
    logging.basicConfig(level=level, format=f"[worker {os.getpid()}] %(levelname)s %(name)s: %(message)s")


def _timed(call: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    with torch.no_grad():
        out = call(*inputs)
    return time.perf_counter() - start, out


def variant_main(task: WorkerTask, conn: Connection) -> None:
    """Entry of a variant worker (runs in the child process)."""
    _configure_logging(task.log_level)
    try:
        from bench import models, variants

        spec = variants.parse_variant(task.variant)
        start = time.perf_counter()
        module = models.load_module(task.component, task.quick, task.weights)
        inputs = models.load_inputs(task.inputs)
        load_seconds = time.perf_counter() - start
        start = time.perf_counter()
        prepared = variants.prepare(spec, module, inputs, task.cache_dir, task.caching)
        if spec.kind == "static":
            del module  # the compiled model holds its own weights; the static route needs no PyTorch module
        first, out = _timed(prepared.call, inputs)
        first_call = time.perf_counter() - start
        release_free_memory()
        split = prepared.split() if prepared.split is not None else None
        if split is not None:  # what is neither building nor running is dynamo capturing the graph
            split["capture"] = max(0.0, first_call - split["build"] - split["run"])
        conn.send(("ready", {"load_seconds": load_seconds, "first_call_seconds": first_call,
                             "first_call_split": split, "first_infer_seconds": first, "info": prepared.info,
                             "resident_after_first_call": resident_bytes()}))
    except Exception:  # report any failure to the coordinator instead of dying silently
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        command, arg = conn.recv()
        try:
            if command == "run":
                cpu = time.process_time()
                seconds, out = _timed(prepared.call, inputs)
                conn.send(("ok", (seconds, time.process_time() - cpu)))
            elif command == "output":
                torch.save(out.detach().clone(), arg)
                conn.send(("ok", {"finite": bool(torch.isfinite(out).all()), "shape": list(out.shape),
                                  "dtype": str(out.dtype).replace("torch.", "")}))
            elif command == "quit":
                info = prepared.finish() if prepared.finish is not None else {}
                conn.send(("ok", {"peak_rss_bytes": peak_rss_bytes(), "info": info}))
                return
            else:
                conn.send(("error", f"unknown command {command!r}"))
        except Exception:  # keep serving: the coordinator decides what a failed call means
            conn.send(("error", traceback.format_exc()))


class WorkerError(RuntimeError):
    """A worker process failed; the message holds its traceback."""


class Worker:
    """The coordinator's handle on one worker process.

    Args:
        target: the function the child runs, ``target(task, conn)``.
        task: its task.
        label: a name for logs and errors.
    """

    def __init__(self, target: Callable[[Any, Connection], None], task: Any, label: str) -> None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when the server starts (first worker)
        self.label = label
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=target, args=(task, child), name=f"bench {label}", daemon=True)
        self._process.start()
        child.close()

    def receive(self, timeout: float | None = None) -> Any:
        """The worker's next answer.

        Raises:
            WorkerError: the worker reported an error, died, or said nothing within ``timeout``.
        """
        if not self._conn.poll(timeout):
            raise WorkerError(f"{self.label}: no answer within {timeout} s")
        try:
            status, value = self._conn.recv()
        except EOFError as err:
            self._process.join(5)
            raise WorkerError(f"{self.label}: the worker died (exit code {self._process.exitcode})") from err
        if status == "error":
            raise WorkerError(f"{self.label}: {value}")
        return value

    def ask(self, command: str, arg: Any = None, timeout: float | None = None) -> Any:
        """Send a command and wait for its answer."""
        self._conn.send((command, arg))
        return self.receive(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Wait for the process to end; terminate it if it does not."""
        self._process.join(timeout)
        if self._process.is_alive():
            logger.warning("%s: worker did not exit; terminating it", self.label)
            self._process.terminate()
            self._process.join(10)
        self._conn.close()


@dataclass(frozen=True)
class ResolutionsTask:
    """First-call times of new input shapes through ov_backend (UNet, one process).

    Attributes:
        component: a UNet component name.
        quick: small models.
        weights: the weights file.
        latents: (height, width) latent sizes, in call order.
        precision: "auto" or "f32".
        cache_dir: the backend's cache folder (caching stays off: every shape is cold).
        dynamic: compile with ``torch.compile(dynamic=True)`` (every dimension symbolic from the
            first call) instead of dynamo's default (static first, dynamic from the second shape).
        log_level: logging level of the worker.
    """

    component: str
    quick: bool
    weights: Path
    latents: tuple[tuple[int, int], ...]
    precision: str
    cache_dir: Path
    dynamic: bool = False
    log_level: int = logging.WARNING


def resolutions_main(task: ResolutionsTask, conn: Connection) -> None:
    """Entry of the resolutions worker: answers with one record per latent size."""
    _configure_logging(task.log_level)
    try:
        from bench import models, variants

        module = models.load_module(task.component, task.quick, task.weights)
        spec = variants.VariantSpec("ov_backend", task.precision)
        prepared = variants.prepare(spec, module, (), task.cache_dir, caching=False,
                                    dynamic=True if task.dynamic else None)
        base = models.example_inputs(task.component, task.quick, 64)
        records = []
        for height, width in task.latents:
            sample = torch.randn(base[0].shape[0], base[0].shape[1], height, width,
                                 generator=torch.Generator().manual_seed(models.INPUTS_SEED))
            inputs = (sample, *base[1:])
            first, out = _timed(prepared.call, inputs)
            second, _ = _timed(prepared.call, inputs)
            records.append({"latent": [height, width], "image": [height * 8, width * 8],
                            "first_call_seconds": first, "second_call_seconds": second,
                            "finite": bool(torch.isfinite(out).all())})
            logger.info("latent %dx%d: first call %.1f s, second %.2f s", height, width, first, second)
        info = prepared.finish() if prepared.finish is not None else {}
        conn.send(("ok", {"records": records, "info": info, "peak_rss_bytes": peak_rss_bytes()}))
    except Exception:  # report any failure to the coordinator
        conn.send(("error", traceback.format_exc()))
