"""Weights of a compiled graph: which graph inputs they are, when they change, what they hold.

Dynamo hands a module's parameters and buffers to the backend as graph inputs. The backend
bakes them into the OpenVINO model as constants, so it must notice when they change: a
:class:`WeightWatch` compares each tensor's identity, storage and version counter (bumped by
every in-place write, as A1111's LoRA code does) on every call, which costs microseconds; a
content fingerprint (:func:`fingerprint`) then names exactly those weights in cache keys.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

logger = logging.getLogger(__name__)

_WEIGHT_SOURCE_MARKERS = ("_parameters", "_buffers")
_PARALLEL_HASH_BYTES = 64 << 20


def is_weight_source(source_name: str) -> bool:
    """Whether a dynamo source name ("L['self']._modules['c']._parameters['weight']") is a weight."""
    return any(marker in source_name for marker in _WEIGHT_SOURCE_MARKERS)


def _state(t: torch.Tensor) -> tuple[int, int, int]:
    return (id(t), t.data_ptr(), t._version)


class WeightWatch:
    """Remembers the weights a model was built from and tells when they changed.

    Args:
        tensors: the weight tensors, in graph-input order.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._states = [_state(t) for t in tensors]

    def changed(self, tensors: Sequence[torch.Tensor]) -> bool:
        """True when any tensor differs from the remembered one (other object, storage or version)."""
        states = self._states
        if len(tensors) != len(states):
            return True
        for t, state in zip(tensors, states):
            if id(t) != state[0] or t._version != state[2] or t.data_ptr() != state[1]:
                return True
        return False

    def update(self, tensors: Sequence[torch.Tensor]) -> None:
        """Remember ``tensors`` as the current weights."""
        self._states = [_state(t) for t in tensors]


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return memoryview(t.view(torch.uint8).numpy())


def _digest(t: torch.Tensor) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(_tensor_bytes(t))
    return h.digest()


def fingerprint(tensors: Sequence[torch.Tensor]) -> str:
    """A content hash of ``tensors`` (values, dtypes, shapes and order).

    Large sets are hashed on two threads (hashlib releases the GIL on big buffers).
    """
    total = sum(t.numel() * t.element_size() for t in tensors)
    if total >= _PARALLEL_HASH_BYTES and len(tensors) > 1:
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="ov_backend_hash") as pool:
            digests = list(pool.map(_digest, tensors))
    else:
        digests = [_digest(t) for t in tensors]
    h = hashlib.blake2b(digest_size=20)
    for d in digests:
        h.update(d)
    return h.hexdigest()
