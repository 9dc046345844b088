"""Weights of a compiled graph: which graph inputs they are, when they change, what they hold.

Dynamo hands a module's parameters and buffers to the backend as graph inputs. The backend
bakes them into the OpenVINO model as constants, so it must notice when they change: a
:class:`WeightWatch` compares each tensor's identity, storage and version counter (bumped by
every in-place write, as A1111's LoRA code does) on every call, which costs microseconds; a
content fingerprint (:func:`fingerprint`) then names exactly those weights in cache keys.

Both hold weak references, so a tensor that was freed and replaced by a new one at the same
address is never mistaken for the old one. :class:`DigestMemo` remembers each tensor's digest
while it is unchanged, so the several graphs dynamo makes of one module (one per shape regime,
or per graph break) hash each weight once; each ``OVBackend`` owns one and clears it on ``reset()``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ov_backend.forget import ForgetLater

try:  # xxh3 reads weights several times faster than sha256 (docs/backend-builds.md)
    import xxhash
except ImportError:  # pragma: no cover - install.py and pyproject install it; sha256 keeps things right
    xxhash = None

logger = logging.getLogger(__name__)

#: The content hash of weights: its name is part of every fingerprint, so two processes that hash
#: differently never share a cache key (one finds nothing the other stored, never a wrong entry).
DIGEST = "xxh3_128" if xxhash is not None else "sha256"

_WEIGHT_SOURCE_MARKERS = ("_parameters", "_buffers")
_PARALLEL_HASH_BYTES = 64 << 20


def is_weight_source(source_name: str) -> bool:
    """Whether a dynamo source name ("L['self']._modules['c']._parameters['weight']") is a weight."""
    return any(marker in source_name for marker in _WEIGHT_SOURCE_MARKERS)


def is_weight_placeholder(node_name: str) -> bool:
    """Whether a graph placeholder dynamo named after its source ("l_self_modules_c_parameters_weight_")
    is a weight."""
    return any(f"_{marker.strip('_')}_" in node_name for marker in _WEIGHT_SOURCE_MARKERS)


_State = tuple["weakref.ref[torch.Tensor]", int, int]


def version_of(t: torch.Tensor) -> int:
    """``t``'s in-place version counter; -1 for an inference tensor (made under ``torch.inference_mode``, as Forge
    loads its weights), which has none: such a tensor is told apart only by its identity and storage (it can be
    written in place only inside inference mode, and Forge's LoRA loader sets new tensors instead)."""
    return -1 if t.is_inference() else t._version


def _state(t: torch.Tensor) -> _State:
    return (weakref.ref(t), t.data_ptr(), version_of(t))


def _same(t: torch.Tensor, state: _State) -> bool:
    return state[0]() is t and version_of(t) == state[2] and t.data_ptr() == state[1]


class WeightWatch:
    """Remembers the weights a model was built from and tells when they changed.

    Args:
        tensors: the weight tensors, in graph-input order.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._states = [_state(t) for t in tensors]

    def stale(self) -> bool:
        """True when any remembered tensor was freed or changed since (written in place, or its storage
        replaced): a model built from them no longer stands for the weights the tensors hold."""
        for state in self._states:
            t = state[0]()
            if t is None or not _same(t, state):
                return True
        return False

    def changed(self, tensors: Sequence[torch.Tensor]) -> bool:
        """True when any tensor differs from the remembered one (other object, storage or version)."""
        states = self._states
        if len(tensors) != len(states):
            return True
        for t, state in zip(tensors, states):
            if not _same(t, state):
                return True
        return False


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
    # a content hash, not a signature: weights are not chosen to collide (the cache is as trusted as the
    # code), and 128 bits make an accidental match as unlikely as sha256's
    h = xxhash.xxh3_128() if xxhash is not None else hashlib.sha256()
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(_tensor_bytes(t))
    return h.digest()


class DigestMemo:
    """Per-tensor digests, kept while the tensor lives and is unchanged (same storage and version)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[int, tuple[_State, bytes]] = {}
        self._forget_later = ForgetLater(self._lock)  # (a weak reference's callback never waits for the lock)

    def lookup(self, t: torch.Tensor, moved: bool = False) -> bytes | None:
        """The digest remembered for ``t`` while it is unchanged; with ``moved``, even if its storage or version
        changed since (its bytes moved unchanged to other memory: the caller knows they are the same)."""
        with self._lock:
            found = self._known.get(id(t))
        if found is not None and (found[0][0]() is t if moved else _same(t, found[0])):
            return found[1]
        return None

    def remember(self, t: torch.Tensor, digest: bytes) -> None:
        key = id(t)
        known = self._known

        def forget(ref: weakref.ref[torch.Tensor], key: int = key) -> None:
            def remove() -> None:
                entry = known.get(key)
                if entry is not None and entry[0][0] is ref:
                    del known[key]

            self._forget_later(remove)

        state = (weakref.ref(t, forget), t.data_ptr(), version_of(t))
        with self._lock:
            self._forget_later.drain()
            known[key] = (state, digest)

    def clear(self) -> None:
        """Forget every digest (the owner's reset)."""
        with self._lock:
            self._known.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._known)


def digests(tensors: Sequence[torch.Tensor], memo: DigestMemo | None = None) -> list[bytes]:
    """Each tensor's content digest (value, dtype and shape).

    Large sets are hashed on two threads (both hashes release the GIL on big buffers). With a
    ``memo``, tensors hashed before and unchanged since are not read again.
    """
    found: list[bytes | None] = [memo.lookup(t) if memo is not None else None for t in tensors]
    todo = [i for i, d in enumerate(found) if d is None]
    total = sum(tensors[i].numel() * tensors[i].element_size() for i in todo)
    if total >= _PARALLEL_HASH_BYTES and len(todo) > 1:
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="ov_backend_hash") as pool:
            fresh = list(pool.map(_digest, [tensors[i] for i in todo]))
    else:
        fresh = [_digest(tensors[i]) for i in todo]
    for i, d in zip(todo, fresh):
        found[i] = d
        if memo is not None:
            memo.remember(tensors[i], d)
    return [d for d in found if d is not None]


def fingerprint(tensors: Sequence[torch.Tensor], memo: DigestMemo | None = None) -> str:
    """A content hash of ``tensors`` (values, dtypes, shapes and order); see :func:`digests`."""
    h = hashlib.sha256(DIGEST.encode())
    for d in digests(tensors, memo):
        h.update(d)
    return h.hexdigest()[:40]
