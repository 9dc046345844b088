"""The build routes of one graph: from a call's signature to a :class:`~ov_backend.variants.Variant`.

Owns :class:`GraphBuilder`, which picks the route and records it in a compile report:

* dynamic: a symbolic-shape graph (dynamo's second shape onward) is converted once with its
  dynamic dimensions kept (cached), then reshaped and compiled for each new signature;
* whole-graph cache entry: a graph cached earlier as one model is compiled from the cache
  without tracing;
* static: the graph is traced for the signature, partitioned and converted
  (:mod:`ov_backend.partitions`).

Whatever OpenVINO cannot take runs in PyTorch with a WARNING, or raises when ``strict``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import openvino as ov
import torch

from ov_backend import convert
from ov_backend.context import BuildContext
from ov_backend.inputs import GraphInputs, signature_text
from ov_backend.ops import decomposition_table, node_op_name
from ov_backend.partitions import StaticBuild
from ov_backend.report import CompileReport, PartitionReport
from ov_backend.runtime import OVRunner
from ov_backend.variants import Variant, eager_variant

logger = logging.getLogger(__name__)

#: the key, in a weights set's variants, of the model converted with dynamic shapes (False: failed)
DYNAMIC_MODEL = "__dynamic_model__"


class GraphBuilder:
    """Builds the variants of one graph.

    Args:
        context: what the backend lends (settings, cache, counters, report sink).
        inputs: the graph's inputs and outputs.
        name: the graph's name for logs and reports.
    """

    def __init__(self, context: BuildContext, inputs: GraphInputs, name: str) -> None:
        self.context = context
        self.inputs = inputs
        self.name = name
        self._graph_code = inputs.gm.code
        self._decomp = decomposition_table(context.settings.decompositions)
        self._torch_op_count = sum(1 for n in inputs.gm.graph.nodes if n.op == "call_method" or (
            n.op == "call_function" and not node_op_name(n).startswith("_operator.")))

    def build(self, sig: tuple[Any, ...], user_values: Sequence[Any], weight_values: Sequence[torch.Tensor],
              variants: dict[Any, Any], fingerprint: str) -> Variant:
        """Build the variant for ``sig`` with these weights (whose fingerprint is ``fingerprint``).

        ``variants`` is the weights set's store: the dynamic route keeps its converted model there.
        The compile report goes to the context's report sink, the times to its counters.
        """
        context = self.context
        settings = context.settings
        report = CompileReport(self.name, signature_text(sig), "static", settings.device)
        start = time.perf_counter()
        try:
            with convert.build_lock():
                # a graph smaller than min_partition_ops goes the static route, whose partitions are counted
                if (self.inputs.dynamic_dims is not None and not settings.disabled_ops
                        and self._torch_op_count >= settings.min_partition_ops):
                    variant = self._build_dynamic(sig, user_values, weight_values, variants, fingerprint, report)
                    if variant is not None:
                        return variant
                return self._build_static(sig, user_values, weight_values, fingerprint, report)
        finally:
            context.stats.add(compile_seconds=time.perf_counter() - start, trace_seconds=report.trace_seconds,
                              convert_seconds=report.convert_seconds)
            context.add_report(report)

    def eager(self, weight_values: Sequence[torch.Tensor]) -> Variant:
        """The graph run in PyTorch with these weights."""
        return eager_variant(self.inputs, weight_values)

    # -- dynamic route --------------------------------------------------------------------------------
    def _build_dynamic(self, sig: tuple[Any, ...], user_values: Sequence[Any],
                       weight_values: Sequence[torch.Tensor], variants: dict[Any, Any], fingerprint: str,
                       report: CompileReport) -> Variant | None:
        dims = self.inputs.dynamic_dims
        assert dims is not None
        context = self.context
        part = PartitionReport("graph", ops=self.inputs.op_count)
        base = variants.get(DYNAMIC_MODEL)
        if base is None:
            key = context.key("dynamic", [(len(s[0]), s[1]) for s in sig], fingerprint,
                              {"graph": self._graph_code, "dims": dims})
            base = context.cache_load(key)
            part.cache_hit = base is not None
            if base is None:
                start = time.perf_counter()
                try:
                    base = convert.convert_dynamic(self.inputs.closure(weight_values, {}), user_values, dims)
                except convert.ConversionError as err:
                    report.warnings.append(f"dynamic conversion failed: {err}")
                    logger.warning("%s: could not convert with dynamic shapes (%s); converting each input "
                                   "shape separately instead", self.name, err)
                    variants[DYNAMIC_MODEL] = False
                    return None
                part.convert_seconds = time.perf_counter() - start
                context.cache_store(key, base, f"{self.name} dynamic {report.signature}")
            variants[DYNAMIC_MODEL] = base
        else:
            part.reused = base is not False
        if base is False:
            return None
        model = base.clone()
        model.reshape({i: ov.PartialShape(list(s[0])) for i, s in enumerate(sig)})
        try:
            compiled = context.compile(model, part)
        except RuntimeError as err:
            report.warnings.append(f"compile failed: {err}")
            logger.warning("%s: OpenVINO could not compile the reshaped model (%s); tracing this shape",
                           self.name, err)
            return None
        report.route = "dynamic"
        report.partitions.append(part)
        runner = OVRunner(compiled, self.inputs.output_dtypes())
        logger.info("OpenVINO compiled %s", report.summary())
        return Variant(lambda user: tuple(runner(user)), in_openvino=True)

    # -- static route ---------------------------------------------------------------------------------
    def _build_static(self, sig: tuple[Any, ...], user_values: Sequence[Any],
                      weight_values: Sequence[torch.Tensor], fingerprint: str, report: CompileReport) -> Variant:
        context = self.context
        whole_key = None
        if context.settings.model_caching and self.inputs.outputs_are_tensors():
            # whether the graph is one partition depends on min_partition_ops
            whole_key = context.key("whole", sig, fingerprint, {
                "graph": self._graph_code, "min_partition_ops": context.settings.min_partition_ops})
            cached = self._from_whole_graph_entry(whole_key, report)
            if cached is not None:
                return cached
        build = StaticBuild(context, self.inputs, self.name, self._decomp, report)
        return build.run(user_values, weight_values, fingerprint, whole_key)

    def _from_whole_graph_entry(self, key: str, report: CompileReport) -> Variant | None:
        """A variant from a cached model of the whole graph, with no tracing at all; None if absent."""
        xml = self.context.cache_file(key)
        if xml is None:
            return None
        part = PartitionReport("graph", ops=self.inputs.op_count, cache_hit=True)
        try:
            compiled = self.context.compile(xml, part)
        except RuntimeError as err:
            logger.warning("%s: the cached model could not be compiled (%s); converting again", self.name, err)
            return None
        report.partitions.append(part)
        runner = OVRunner(compiled, self.inputs.output_dtypes())
        logger.info("OpenVINO compiled %s", report.summary())
        baked = self.inputs.scalar_tensors
        return Variant(lambda user: tuple(runner([v for pos, v in enumerate(user)
                                                  if isinstance(v, torch.Tensor) and pos not in baked])),
                       in_openvino=True)
