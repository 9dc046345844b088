"""The coordinator of one graph's builds: from a call's signature to a :class:`~ov_backend.variants.Variant`.

:class:`GraphBuilder` picks the build for a signature and records it in a compile report: the dynamic
build (:mod:`ov_backend.build.dynamic`, with the shared-shape build of
:mod:`ov_backend.build.shared_shapes`) for a symbolic-shape graph, else, or when that fails, the static
build (:mod:`ov_backend.build.static`); at precision "int8" either records calls for the INT8 build
(:mod:`ov_backend.build.int8`). Whatever OpenVINO cannot take runs in PyTorch with a WARNING, or raises
when ``strict``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from ov_backend import convert, memory_guard
from ov_backend.build.dynamic import DynamicBuilds
from ov_backend.build.int8 import Int8Builds
from ov_backend.build.shared_shapes import SharedShapes
from ov_backend.build.static import StaticBuilds
from ov_backend.build.target import BuildTarget
from ov_backend.context import BuildContext
from ov_backend.inputs import GraphInputs, signature_text
from ov_backend.ops import node_op_name
from ov_backend.precision import QUANTIZED_PRECISIONS
from ov_backend.report import CompileReport
from ov_backend.variants import Variant, WeightSet, eager_variant


class GraphBuilder:
    """Builds the variants of one graph.

    Args:
        context: what the backend lends (settings, cache, counters, report sink).
        inputs: the graph's inputs and outputs.
        name: the graph's name for logs and reports.
    """

    def __init__(self, context: BuildContext, inputs: GraphInputs, name: str) -> None:
        #: the graph, its cache keys and decompositions: what every build of it shares
        self.target = target = BuildTarget.of(context, inputs, name)
        #: the settings ask for INT8 models (calibrated on this graph's first calls)
        self.int8 = Int8Builds(target) if context.settings.precision in QUANTIZED_PRECISIONS else None
        self.static = StaticBuilds(target)
        self.dynamic = DynamicBuilds(target, SharedShapes(target), self.int8)
        #: the device's own inference precision ("bf16", "f32", ...), read on the first memory check
        self._default_hint: str | None = None
        self._torch_op_count = sum(1 for n in inputs.gm.graph.nodes if n.op == "call_method" or (
            n.op == "call_function" and not node_op_name(n).startswith("_operator.")))

    def build(self, sig: tuple[Any, ...], user_values: Sequence[Any], weight_values: Sequence[torch.Tensor],
              store: WeightSet, fingerprint: str) -> Variant:
        """Build the variant for ``sig`` with these weights (whose fingerprint is ``fingerprint``).

        ``store`` is what the graph keeps for these weights: the builds keep their models there.
        The compile report goes to the context's report sink, the times to its counters.

        The disk cache entries the build loaded or stored (and the blobs OpenVINO wrote for it) are in use while
        the variant lives, and those of the dynamic build while ``store`` does (its converted model serves every
        shape); then the cache is pruned to its limit (:mod:`ov_backend.cache_limit`).
        """
        context = self.target.context
        with context.using_cache() as used:
            variant = self._build(sig, user_values, weight_values, store, fingerprint)
        if variant.in_openvino:
            context.hold(used, variant, store if variant.compiled_for is not None else None)
        context.enforce_cache_limit(keep=used)
        return variant

    def _build(self, sig: tuple[Any, ...], user_values: Sequence[Any], weight_values: Sequence[torch.Tensor],
               store: WeightSet, fingerprint: str) -> Variant:
        context = self.target.context
        settings = context.settings
        report = CompileReport(self.target.name, signature_text(sig), "static", settings.device)
        start = time.perf_counter()
        try:
            short = self._short_of_memory(weight_values)
            if short is not None:
                return self._in_pytorch_for_now(short, weight_values, report)
            with convert.build_lock():
                # a graph smaller than min_partition_ops goes the static build, whose partitions are counted
                if (self.target.inputs.dynamic_dims is not None and not settings.disabled_ops
                        and self._torch_op_count >= settings.min_partition_ops):
                    variant = self.dynamic.build(sig, user_values, weight_values, store, fingerprint, report)
                    if variant is not None:
                        return variant
                if self.int8 is None or not self.target.inputs.outputs_are_tensors():
                    return self.static.build(sig, user_values, weight_values, fingerprint, report)
                return self.int8.static(sig, user_values, weight_values, fingerprint, report, store, self.static)
        finally:
            context.stats.add(compile_seconds=time.perf_counter() - start, trace_seconds=report.trace_seconds,
                              convert_seconds=report.convert_seconds)
            context.add_report(report)

    def _short_of_memory(self, weight_values: Sequence[torch.Tensor]) -> str | None:
        """Why the model for these weights should not be built now (it would not fit in the memory left), or
        None (``BackendSettings.check_memory``, :mod:`ov_backend.memory_guard`)."""
        settings = self.target.context.settings
        if not settings.check_memory:
            return None
        if self._default_hint is None:
            self._default_hint = memory_guard.device_hint(self.target.context.core, settings.device)
        return memory_guard.build_shortage(weight_values, settings.precision, settings.compile_config,
                                           self._default_hint)

    def _in_pytorch_for_now(self, why: str, weight_values: Sequence[torch.Tensor], report: CompileReport) -> Variant:
        """The graph in PyTorch until the next use window, because ``why`` (a visible fallback)."""
        context = self.target.context
        report.route = "eager"
        report.warnings.append(f"{self.target.name}: {why}; runs in PyTorch until the next use window looks again")
        context.fail(f"{self.target.name} {report.signature}: {why}")
        window, started = context.window, context.window.current
        # the next use window (a generation) checks the memory again
        return eager_variant(self.target.inputs, weight_values, usable=lambda: window.current == started)

    def eager(self, weight_values: Sequence[torch.Tensor]) -> Variant:
        """The graph run in PyTorch with these weights."""
        return eager_variant(self.target.inputs, weight_values)

    def quantize(self, store: WeightSet) -> int:
        """At precision "int8": quantize the models of these weights whose calls were recorded; returns how
        many (see :meth:`Int8Builds.quantize`). The INT8 models stored are in use while ``store`` lives."""
        if self.int8 is None:
            return 0
        context = self.target.context
        with context.using_cache() as used:
            done = self.int8.quantize(store)
        context.hold(used, store)
        context.enforce_cache_limit(keep=used)
        return done
