"""One dynamo graph, compiled per input signature and per set of weights.

Owns :class:`CompiledGraph`, what the backend returns to dynamo. On each call it checks the
weights (cheap, :mod:`ov_backend.variants`), picks the variant built for the call's input
signature or has one built (:mod:`ov_backend.build`), runs it, and counts the call; an
OpenVINO model that fails at run time is replaced by the graph in PyTorch (WARNING, or
:class:`OpenVINOFallbackError` when ``strict``).

The graph sees its backend only through a :class:`~ov_backend.context.BuildContext`.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from typing import Any

import torch

from ov_backend.build import GraphBuilder
from ov_backend.context import BuildContext
from ov_backend.inputs import GraphFacts, GraphInputs, signature, signature_text
from ov_backend.quantize import CallStopped
from ov_backend.variants import ModelReleased, WeightSet, WeightVariants, keep_previous_weights

logger = logging.getLogger(__name__)


class CompiledGraph:
    """The callable dynamo runs in place of one captured graph.

    Args:
        gm: the captured graph.
        facts: what its inputs and outputs are (:meth:`ov_backend.inputs.GraphFacts.read`).
        context: what the backend lends (settings, OpenVINO core, cache, counters, report sink).
        name: a name for logs and reports.
    """

    def __init__(self, gm: torch.fx.GraphModule, facts: GraphFacts, context: BuildContext, name: str) -> None:
        self.gm = gm
        self.name = name
        self.context = context
        self.inputs = GraphInputs(gm, facts)
        self._lock = threading.RLock()
        self._weights, self._builder = self._new_state()
        #: (weights fingerprint, signature) -> the use window of its last call
        self._last_used: dict[tuple[str, Any], int] = {}
        #: weights fingerprint -> the use window of its last call
        self._weights_used: dict[str, int] = {}

    def _new_state(self) -> tuple[WeightVariants, GraphBuilder]:
        """What the graph builds into: its weight sets (compiled models by weights and signature) and its builder
        (the converted models)."""
        context = self.context
        weights = WeightVariants(self.inputs, self.name, context.digests, self._lock,
                                 on_hash=lambda s: context.stats.add(compile_seconds=s, hash_seconds=s),
                                 hashing=context.weights.packing if context.weights is not None else nullcontext)
        return weights, GraphBuilder(context, self.inputs, self.name)

    def dispose(self) -> None:
        """Drop every model this graph built, compiled and converted, and the weights they hold: its backend was
        reset. Dynamo keeps the functions it compiled in the globals of the traced code's module after its own
        reset, and through them this graph: without this, each reset (e.g. a checkpoint of another architecture
        or config) would leave its models in memory for the rest of the process. A call after it builds again."""
        with self._lock:
            self._weights, self._builder = self._new_state()
            self._last_used.clear()
            self._weights_used.clear()

    def _release_unused(self, fingerprint: str) -> None:
        """Before a build for the weights ``fingerprint``: release compiled models no call used in the
        current window, but those of the previous weights (the latest other fingerprint) that their
        last window used, while ``previous_weights`` says to keep them (lock held). Where it says not
        to, the backend's other graphs not called since their weights changed release theirs too."""
        window = self.context.window
        if not window.releasing:
            return
        keep_previous = keep_previous_weights(self._previous_weights_mode())
        unused = {key for key, last in self._last_used.items() if last < window.current}
        others = [fp for fp in self._weights_used if fp != fingerprint]
        if unused and others:
            previous = max(others, key=self._weights_used.__getitem__)
            last = self._weights_used[previous]
            kept = {key for key in unused if key[0] == previous and self._last_used[key] == last}
            if kept and keep_previous:
                unused -= kept
                self.context.stats.add(kept_previous=len(kept))
                logger.info("%s: keeping %d compiled model(s) of the previous weights (%s): going back to them "
                            "compiles nothing", self.name, len(kept), previous[:12])
        self._release(unused, "no call used since the current use window began")
        if not keep_previous:
            # one not called since its weights changed (e.g. a long prompt's capture of the UNet after a LoRA
            # or checkpoint change) holds models of weights that are gone, as this graph's previous ones
            self.context.release_stale(self)

    def _previous_weights_mode(self) -> str:
        """``previous_weights`` now: the current use window's, else the settings'."""
        return self.context.window.previous_weights or self.context.settings.previous_weights

    def release_if_stale(self) -> int:
        """Release every compiled model of this graph if its weights changed (or were freed) since its last
        call, keeping the converted models; returns how many were released. A graph busy in another
        thread is left alone (0)."""
        if not self._lock.acquire(blocking=False):
            return 0
        try:
            if not self._last_used or not self._weights.stale():
                return 0
            released = self._release(set(self._last_used), "its weights changed and it was not called since")
            self.context.stats.add(released_stale=released)
            return released
        finally:
            self._lock.release()

    def models_held(self) -> int:
        """How many compiled OpenVINO models this graph holds now (for every set of weights it keeps)."""
        return self._weights.models_held()

    def release_compiled(self) -> int:
        """Release every compiled model of this graph that it can compile again from what it keeps (the
        converted or quantized models stay), e.g. when its owner runs this part at another precision now;
        returns how many were released. A graph busy building in another thread is left alone (0)."""
        if not self._lock.acquire(blocking=False):
            return 0
        try:
            return self._release(set(self._last_used), "its owner runs this part otherwise now")
        finally:
            self._lock.release()

    def _release(self, unused: set[tuple[str, Any]], why: str) -> int:
        """Release the releasable variants ``(fingerprint, signature)`` in ``unused`` (lock held)."""
        if not unused:
            return 0
        for key in unused:
            del self._last_used[key]
        left = {fp for fp, _ in self._last_used}
        for fp in [fp for fp in self._weights_used if fp not in left]:
            del self._weights_used[fp]
        released = self._weights.release(unused)
        if released:
            self.context.stats.add(released=released)
            logger.info("%s: released %d compiled model(s): %s", self.name, released, why)
        return released

    def _variant(self, sig: Any, user_values: Any, weight_values: Any) -> tuple[str, WeightSet, Any, bool]:
        """The weights' fingerprint and weight set, and the variant for ``sig`` (built if missing, or if
        the model it borrowed is gone), and whether it was built now."""
        built = False
        fp, store = self._weights.current(weight_values)
        variant = store.variants.get(sig)
        if variant is None or not variant.usable:
            with self._lock:
                fp, store = self._weights.current(weight_values)
                variant = store.variants.get(sig)
                if variant is None or not variant.usable:
                    self._release_unused(fp)
                    home = self.context.weights
                    if home is not None and home.before_build(weight_values):
                        self._weights.moved(weight_values)  # same values at new addresses: same fingerprint
                    with home.packing() if home is not None else nullcontext():
                        variant = self._builder.build(sig, user_values, weight_values, store, fp)
                    store.variants[sig] = variant
                    built = True
        window = self.context.window.current
        self._last_used[(fp, sig)] = self._weights_used[fp] = window
        return fp, store, variant, built

    def _run(self, variant: Any, built: bool, user_values: Any) -> Any:
        """Run ``variant``; its first run after a build packs the model's weights (OpenVINO's copy is made), while
        the weight file's pages leave the process."""
        home = self.context.weights
        with home.packing() if built and home is not None else nullcontext():
            return variant.run(user_values)

    def __call__(self, *args: Any) -> Any:
        weight_values, user_values = self.inputs.split(args)
        sig = signature(user_values, self.inputs.scalar_tensors)
        fp, store, variant, built = self._variant(sig, user_values, weight_values)
        start = time.perf_counter()
        try:
            try:
                result = self._run(variant, built, user_values)
            except ModelReleased:  # its owner released the borrowed model after the check: build again
                with self._lock:
                    if store.variants.get(sig) is variant:
                        del store.variants[sig]
                fp, store, variant, built = self._variant(sig, user_values, weight_values)
                result = self._run(variant, built, user_values)
        except CallStopped as stopped:  # the owner's INT8 watch stopped the call: no failure of OpenVINO
            raise stopped.error from None
        except Exception as err:  # OpenVINO runtime errors come as RuntimeError and others
            if not variant.in_openvino:
                raise
            self.context.fail(f"{self.name} {signature_text(sig)}: OpenVINO inference failed ({err})", err)
            with self._lock:
                store.variants[sig] = variant = self._builder.eager(weight_values)
            result = variant.run(user_values)
        self.context.stats.add(run_seconds=time.perf_counter() - start,
                               **({"ov_calls": 1} if variant.in_openvino else {"eager_calls": 1}))
        calibrating = variant.calibration is not None and variant.calibration.full
        del variant  # quantizing releases the float model: this frame must not keep it alive
        if calibrating:
            self.calibrate()  # at precision "int8": enough calls recorded, quantize now
        return result

    def calibrate(self) -> int:
        """At precision "int8": quantize the models whose calls were recorded (for the current weights);
        returns how many were quantized. Their next calls run the INT8 models."""
        with self._lock:
            store = self._weights.current_store()
            return self._builder.quantize(store) if store is not None else 0
