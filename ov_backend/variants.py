"""The models one graph keeps: per set of weights, per input signature.

Owns :class:`Variant` (how one signature runs: OpenVINO or PyTorch), :class:`WeightSet` (what a
graph keeps for one set of weights) and :class:`WeightVariants`, the small LRU of weight sets (e.g.
LoRA combinations) that stay in memory. Noticing a
change of weights costs microseconds on each call (:class:`ov_backend.weights.WeightWatch`); only
a change hashes the weights' contents, whose fingerprint names the set in cache keys. Also owns
:class:`UseWindow` (what a unit of work keeps compiled) and :class:`SharedModels` (the compiled
models for all shapes that graphs of one backend lend each other).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from ov_backend import weights
from ov_backend.inputs import GraphInputs
from ov_backend.memory import system_memory

logger = logging.getLogger(__name__)

#: How many sets of weights (e.g. LoRA combinations) keep compiled models in memory per graph.
MAX_WEIGHT_VARIANTS = 2
#: ``Variant.compiled_for`` of a model compiled for its signature from the graph's dynamic conversion
FOR_ONE_SHAPE = "one shape"
#: ``Variant.compiled_for`` of a variant that runs the weights set's model for all shapes
#: (:attr:`WeightSet.all_shapes`)
FOR_ALL_SHAPES = "all shapes"
#: ``Variant.compiled_for`` of a variant that runs a model for all shapes another graph compiled and
#: lends (:class:`SharedModels`): it holds no model of its own
BORROWED = "borrowed"
#: ``BackendSettings.previous_weights`` "auto": the previous weights' models stay while at least this
#: share of the machine's memory is available
KEEP_PREVIOUS_MIN_AVAILABLE = 1 / 3


def keep_previous_weights(mode: str) -> bool:
    """Whether a graph keeps its previous weights' compiled models now (``BackendSettings.previous_weights``)."""
    if mode != "auto":
        return mode == "keep"
    memory = system_memory()
    return memory is not None and memory.available >= KEEP_PREVIOUS_MIN_AVAILABLE * memory.total


class UseWindow:
    """A backend's count of use windows (see :meth:`ov_backend.backend.OVBackend.start_window`).

    The owner starts a window per unit of work (the WebUI adapter: per generation). A compiled model
    no call used in the current window is released when its graph builds another, if the graph keeps
    the model it was compiled from (using it again costs a compile, never a conversion): memory holds
    the models the work at hand uses, and a size the work uses again is never compiled twice within
    it. Before the first window, or after :meth:`stop`, nothing is released.
    """

    def __init__(self) -> None:
        self.current = 0
        self.releasing = False
        #: ``BackendSettings.previous_weights`` for this window (the owner's choice per unit of work), or None:
        #: the settings' own
        self.previous_weights: str | None = None

    def start(self, previous_weights: str | None = None) -> None:
        """A new window: what the calls from now on do not use is released at the next build.
        ``previous_weights``: in place of the settings' ``previous_weights`` during this window."""
        self.current += 1
        self.releasing = True
        self.previous_weights = previous_weights

    def stop(self) -> None:
        """No more releasing (until the next :meth:`start`): every compiled model stays."""
        self.releasing = False


class SharedModels:
    """Compiled models for all shapes that the graphs of one backend lend each other, by key.

    dynamo captures the same code again when a guard fails (A1111's UNet called at batch 1 for a
    prompt longer than 75 tokens, after batch 2): the captures convert to the same model, and with
    the same weights one compiled model serves them all (a full UNet's holds gigabytes, and
    compiling it costs seconds). The key names the graph's code, its dynamic dimensions, the
    weights' fingerprint and the settings that change a compiled model.

    Graphs that build under a key :meth:`join` it; one that joins after another is a re-capture, which
    needs several shapes at once (a long prompt's cond and uncond lengths), so it shares from its first
    shape. The graph that compiles a model for all shapes owns it and :meth:`lend` s it; the others
    borrow it where they would share shapes themselves, through a weak reference, so the model goes
    when its owner releases it (a borrower then builds its own).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[str, weakref.ref[Any]] = {}
        #: key -> the names of the graphs that built under it, first first
        self._members: dict[str, list[str]] = {}

    def join(self, key: str, graph: str) -> bool:
        """Count the graph named ``graph`` as building under ``key``; returns whether another graph built
        under it before this one did (this one is a re-capture of the same code and weights)."""
        with self._lock:
            members = self._members.setdefault(key, [])
            if graph not in members:
                members.append(graph)
            return members[0] != graph

    def lend(self, key: str, model: Any) -> None:
        """Offer ``model`` (held by its owner) under ``key``."""
        with self._lock:
            for k in [k for k, ref in self._models.items() if ref() is None]:
                del self._models[k]
            self._models[key] = weakref.ref(model)

    def borrow(self, key: str) -> weakref.ref[Any] | None:
        """A weak reference to the model lent under ``key``, if its owner still holds it."""
        with self._lock:
            ref = self._models.get(key)
        return ref if ref is not None and ref() is not None else None

    def clear(self) -> None:
        """Forget every member and lent model (the backend's graphs were dropped)."""
        with self._lock:
            self._models.clear()
            self._members.clear()


def borrowed_variant(ref: weakref.ref[Any], name: str) -> Variant:
    """A variant that runs the model for all shapes ``ref`` points to (another graph's, see
    :class:`SharedModels`): it holds none of its own, and is unusable once the owner released it."""

    def run(user: Sequence[Any]) -> Any:
        runner = ref()
        if runner is None:
            raise ModelReleased(f"{name}: the borrowed model was released")
        return tuple(runner(user))

    return Variant(run, in_openvino=True, releasable=True, compiled_for=BORROWED, usable=lambda: ref() is not None)


class ModelReleased(RuntimeError):
    """A borrowed model was released by its owner between the check and the call: build again."""


class Variant:
    """How one signature runs: a partitioned graph, a single OpenVINO model, or eager PyTorch.

    Args:
        run: takes the call's user inputs, returns the graph's outputs.
        in_openvino: whether any of it runs in OpenVINO.
        releasable: compiled from a converted model the graph keeps: releasing it costs only a compile
            when it is needed again (see :class:`UseWindow`).
        calibration: at precision "int8": the recording its calls add to (they run at float until the
            graph is quantized); None otherwise.
        compiled_for: :data:`FOR_ONE_SHAPE`, :data:`FOR_ALL_SHAPES` or :data:`BORROWED` on the dynamic
            build, else None.
        usable: for a borrowed model: whether its owner still holds it (else always usable).
    """

    def __init__(self, run: Callable[[Sequence[Any]], Any], in_openvino: bool, releasable: bool = False,
                 calibration: Any = None, compiled_for: str | None = None,
                 usable: Callable[[], bool] | None = None) -> None:
        self.run = run
        self.in_openvino = in_openvino
        self.releasable = releasable
        self.calibration = calibration
        self.compiled_for = compiled_for
        self._usable = usable

    @property
    def usable(self) -> bool:
        """False once the model it borrowed is gone (the graph builds the signature again)."""
        return self._usable is None or self._usable()

    def running(self, run: Callable[[Sequence[Any]], Any]) -> Variant:
        """This variant with another ``run`` (one wrapping this one's), the rest the same."""
        return Variant(run, self.in_openvino, self.releasable, self.calibration, self.compiled_for, self._usable)


def eager_variant(inputs: GraphInputs, weight_values: Sequence[torch.Tensor],
                  usable: Callable[[], bool] | None = None) -> Variant:
    """The graph run in PyTorch with these weights (``usable``: until it says False; always by default)."""
    frozen = list(weight_values)
    return Variant(lambda user: inputs.gm(*inputs.full_args(user, frozen)), in_openvino=False, usable=usable)


@dataclass(eq=False)
class WeightSet:
    """What one graph keeps for one set of weights.

    Attributes:
        variants: input signature -> how it runs.
        dynamic_model: the model converted with dynamic shapes (weights bound), reshaped and compiled for
            each signature; None on the static build or before the first dynamic build.
        all_shapes: the model compiled with dynamic shapes that serves every signature (an
            :class:`~ov_backend.runtime.OVRunner`, see ``BackendSettings.shared_shapes``); its variants are
            :data:`FOR_ALL_SHAPES`, and it goes with the last of them.
        int8_models: at precision "int8": signature (None: dynamic shapes) -> the INT8 model.
        calibrations: at precision "int8": signature (None: dynamic shapes) -> the recording of calls at
            float that the INT8 model is calibrated on (a :class:`~ov_backend.quantize.Calibration`).
    """

    variants: dict[Any, Variant] = field(default_factory=dict)
    dynamic_model: Any = None
    all_shapes: Any = None
    int8_models: dict[Any, Any] = field(default_factory=dict)
    calibrations: dict[Any, Any] = field(default_factory=dict)

    def one_shape_variants(self) -> list[Any]:
        """The signatures whose variant runs a model compiled for that signature alone (dynamic build)."""
        return [sig for sig, v in self.variants.items() if v.compiled_for == FOR_ONE_SHAPE]


class WeightVariants:
    """Variants by weights fingerprint, the last :data:`MAX_WEIGHT_VARIANTS` sets of weights kept.

    Args:
        inputs: the graph's inputs (to check that weights hold data).
        name: the graph's name, for logs.
        digests: the per-tensor digest memo shared by the backend's graphs.
        lock: the graph's lock (re-entrant), held while the current set changes.
        on_hash: called with the seconds each new set of weights took to fingerprint (part of the cost of
            getting a graph ready for them).
        hashing: the context the fingerprinting runs in (the backend's weight file drops the pages it reads:
            hashing reads every weight, a full SDXL's 12 GiB).
    """

    def __init__(self, inputs: GraphInputs, name: str, digests: weights.DigestMemo,
                 lock: threading.RLock, on_hash: Callable[[float], None] | None = None,
                 hashing: Callable[[], AbstractContextManager[Any]] = nullcontext) -> None:
        self._inputs = inputs
        self._name = name
        self._digests = digests
        self._lock = lock
        self._on_hash = on_hash
        self._hashing = hashing
        self._watch: weights.WeightWatch | None = None
        self._fingerprint: str | None = None
        self._by_weights: OrderedDict[str, WeightSet] = OrderedDict()

    def current(self, weight_values: Sequence[torch.Tensor]) -> tuple[str, WeightSet]:
        """The fingerprint of these weights and what was built for them (to fill)."""
        watch = self._watch
        fp = self._fingerprint
        if watch is not None and not watch.changed(weight_values) and fp is not None:
            return fp, self._by_weights[fp]
        with self._lock:
            if self._watch is not None and not self._watch.changed(weight_values) and self._fingerprint:
                return self._fingerprint, self._by_weights[self._fingerprint]
            self._inputs.check_loaded(weight_values)
            start = time.perf_counter()
            with self._hashing():
                fp = weights.fingerprint(weight_values, self._digests)
            seconds = time.perf_counter() - start
            if self._on_hash is not None:
                self._on_hash(seconds)
            if self._watch is not None:
                logger.info("%s: weights changed (fingerprint %s, %.2fs); %s", self._name, fp[:12], seconds,
                            "reusing models built for them" if fp in self._by_weights else "will recompile")
            if fp not in self._by_weights:
                self._by_weights[fp] = WeightSet()
                while len(self._by_weights) > MAX_WEIGHT_VARIANTS:
                    self._by_weights.popitem(last=False)
            self._by_weights.move_to_end(fp)
            self._fingerprint = fp
            self._watch = weights.WeightWatch(weight_values)
            return fp, self._by_weights[fp]

    def moved(self, weight_values: Sequence[torch.Tensor]) -> None:
        """The weights of the current set moved to other memory with their values unchanged
        (:mod:`ov_backend.weight_file`): watch them where they are now, under the same fingerprint and
        digests, without hashing them again."""
        with self._lock:
            known = [self._digests.lookup(t, moved=True) for t in weight_values]
            for t, digest in zip(weight_values, known):
                if digest is not None:
                    self._digests.remember(t, digest)
            self._watch = weights.WeightWatch(weight_values)

    def stale(self) -> bool:
        """Whether the weights of the last call changed since (or were freed): every model held was built for
        weights the tensors no longer hold (False before the first call)."""
        watch = self._watch
        return watch is not None and watch.stale()

    def current_store(self) -> WeightSet | None:
        """What was built for the weights the last call had (None before the first call)."""
        with self._lock:
            return self._by_weights.get(self._fingerprint) if self._fingerprint is not None else None

    def models_held(self) -> int:
        """How many compiled OpenVINO models the weight sets hold now, counted as :meth:`release` counts them (a
        variant of the model for all shapes holds none of its own, a borrowed one is its owner's). Safe to call
        while another thread builds: it reads copies (``list`` of a dict is atomic in CPython)."""
        held = 0
        for found in list(self._by_weights.values()):
            held += sum(v.in_openvino and v.compiled_for not in (FOR_ALL_SHAPES, BORROWED)
                        for v in list(found.variants.values()))
            held += found.all_shapes is not None
        return held

    def release(self, unused: set[tuple[str, Any]]) -> int:
        """Drop the releasable variants ``(fingerprint, signature)`` in ``unused``; returns how many.

        A weight set other than the current one left without a compiled model is forgotten whole
        (its converted model too: a model converted from tensors changed in place since is found
        again by the graph's builder, see :mod:`ov_backend.weight_binding`). Call with the graph's lock held.
        """
        dropped = 0
        for fp, sig in unused:
            found = self._by_weights.get(fp)
            variant = found.variants.get(sig) if found is not None else None
            if variant is not None and variant.releasable:
                del found.variants[sig]
                # a variant of the model for all shapes holds none of its own: counted when that goes;
                # a borrowed one is its owner's to count
                dropped += variant.compiled_for not in (FOR_ALL_SHAPES, BORROWED)
        for found in self._by_weights.values():
            # the model for all shapes goes with the last variant that ran it
            if found.all_shapes is not None and not any(
                    v.compiled_for == FOR_ALL_SHAPES for v in found.variants.values()):
                found.all_shapes = None
                dropped += 1
        for fp, found in list(self._by_weights.items()):
            if fp != self._fingerprint and not found.variants:
                del self._by_weights[fp]
        return dropped
