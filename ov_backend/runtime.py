"""Running compiled OpenVINO models on torch tensors, from any number of threads."""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import openvino as ov
import torch

logger = logging.getLogger(__name__)

#: every live runner, for :func:`release_intermediate_memory`
_RUNNERS: weakref.WeakSet[OVRunner] = weakref.WeakSet()
_RUNNERS_LOCK = threading.Lock()

def _to_ov(t: torch.Tensor | int | float | bool) -> np.ndarray | ov.Tensor:
    if not isinstance(t, torch.Tensor):
        return np.asarray(t)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return ov.Tensor(t.view(torch.int16).numpy().view(np.uint16), list(t.shape), ov.Type.bf16)
    return t.numpy()


def _to_torch(value: ov.Tensor | np.ndarray, expected: torch.dtype | None) -> torch.Tensor:
    if isinstance(value, ov.Tensor):
        if value.element_type == ov.Type.bf16:
            raw = torch.from_numpy(np.array(value.data, copy=True).view(np.int16))
            out = raw.view(torch.bfloat16)
        else:
            out = torch.from_numpy(np.array(value.data, copy=True))
    else:
        out = torch.from_numpy(np.array(value, copy=False))
    if expected is not None and out.dtype != expected:
        out = out.to(expected)
    return out


class OVRunner:
    """A compiled model with a pool of inference requests, safe to call from several threads.

    Args:
        compiled: the compiled model.
        out_dtypes: the torch dtype each output must have (OpenVINO may narrow, e.g. i64 -> i32).
    """

    def __init__(self, compiled: ov.CompiledModel, out_dtypes: Sequence[torch.dtype | None] = ()) -> None:
        self.compiled = compiled
        self._outputs = list(compiled.outputs)
        self._out_dtypes = list(out_dtypes) or [None] * len(self._outputs)
        self._pool: queue.SimpleQueue[ov.InferRequest] = queue.SimpleQueue()
        self._busy = 0
        self._lock = threading.Lock()
        self._holds_memory = False
        with _RUNNERS_LOCK:
            _RUNNERS.add(self)

    def __call__(self, inputs: Sequence[torch.Tensor | int | float | bool]) -> list[torch.Tensor]:
        with self._lock:
            self._busy += 1
            self._holds_memory = True
        try:
            try:
                request = self._pool.get_nowait()
            except queue.Empty:
                request = self.compiled.create_infer_request()
            try:
                request.infer([_to_ov(t) for t in inputs], share_inputs=True, share_outputs=True)
                results = [_to_torch(request.get_tensor(out), dtype)
                           for out, dtype in zip(self._outputs, self._out_dtypes)]
            finally:
                self._pool.put(request)
        finally:
            with self._lock:
                self._busy -= 1
        return results

    def release_memory(self) -> bool:
        """Give back the memory its inference requests hold between calls (their intermediate tensors: for a
        UNet or a VAE at a large size, gigabytes), unless a call is running; the next call allocates it again.
        Returns whether anything was released."""
        with self._lock:
            if self._busy or not self._holds_memory:
                return False
            try:
                self.compiled.release_memory()
            except RuntimeError as err:  # a device that cannot: it keeps its memory
                logger.debug("release_memory: %s", err)
                return False
            self._holds_memory = False
            return True


def release_intermediate_memory() -> int:
    """:meth:`OVRunner.release_memory` of every live runner (e.g. at the end of a generation: what OpenVINO holds
    then is its weights, not a UNet's and a VAE's activations at the last size); returns how many released."""
    with _RUNNERS_LOCK:
        runners = list(_RUNNERS)
    return sum(r.release_memory() for r in runners)


class OVModule(torch.nn.Module):
    """Stands in a partitioned FX graph for one OpenVINO partition.

    Args:
        runner: runs the partition in OpenVINO.
        single: the partition returns one tensor rather than a tuple.
    """

    def __init__(self, runner: OVRunner, single: bool) -> None:
        super().__init__()
        self.runner = runner
        self.single = single

    def forward(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        outputs = self.runner(args)
        return outputs[0] if self.single else tuple(outputs)
