"""The static build's partitions: one graph traced for one signature, partitioned, each partition converted.

Owns :class:`PartitionedBuild`: tracing (a graph that cannot be traced runs in PyTorch), the retry
loop (ops the OpenVINO frontend reports it cannot convert are left to PyTorch and the graph is
partitioned again), converting and compiling each partition (from the cache when it holds it),
and the whole-graph cache key for a graph that is one partition. Every partition that stays in
PyTorch is in the compile report with its reason and logged as a WARNING, or raises when
``strict`` (see :meth:`ov_backend.context.BuildContext.fail`); partitions with fewer ops than
``min_partition_ops`` stay in PyTorch by the user's choice (WARNING, no raise).
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openvino as ov
import torch

from ov_backend import convert, weights
from ov_backend.build.target import BuildTarget
from ov_backend.inputs import output_dtype
from ov_backend.ops import OpenVINOSupport, node_op_name
from ov_backend.report import CompileReport, PartitionReport
from ov_backend.runtime import OVModule, OVRunner
from ov_backend.variants import Variant, eager_variant

logger = logging.getLogger(__name__)

#: How many times a graph is partitioned: after each, ops the frontend could not convert go to PyTorch.
MAX_ATTEMPTS = 3


class PartitionedBuild:
    """One static build of a graph for one signature.

    Args:
        target: the graph, its cache keys and decompositions.
        report: the compile report to fill.
    """

    def __init__(self, target: BuildTarget, report: CompileReport) -> None:
        self.target = target
        self.report = report
        #: the converted model of a graph that is one partition (its inputs and outputs are the graph's)
        self.whole_model: ov.Model | None = None

    def run(self, user_values: Sequence[Any], weight_values: Sequence[torch.Tensor], fingerprint: str,
            whole_key: str | None) -> Variant:
        """Trace, partition and convert; ``whole_key`` names the graph's cache entry (None: no cache)."""
        report, target = self.report, self.target
        scalars = {pos: v for pos, v in enumerate(user_values)
                   if not isinstance(v, torch.Tensor) or pos in target.inputs.scalar_tensors}
        tensors = [v for pos, v in enumerate(user_values) if pos not in scalars]
        start = time.perf_counter()
        try:
            traced = convert.trace_static(target.inputs.closure(weight_values, scalars), tensors, target.decompositions)
        except Exception as err:  # tracing can fail in many ways (data-dependent control flow, ...)
            report.route = "eager"
            report.warnings.append(f"could not trace the graph: {err}")
            target.context.fail(f"{target.name} {report.signature}: could not trace the graph "
                                f"({type(err).__name__}: {err})", err)
            return eager_variant(target.inputs, weight_values)
        report.trace_seconds = time.perf_counter() - start
        unconvertible: set[str] = set()
        earlier_warnings = list(report.warnings)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            support = OpenVINOSupport(target.context.settings.disabled_ops, unconvertible)
            graph, names = convert.partition(traced, support)
            report.fallback_ops = dict(support.rejected)
            report.partitions = []
            report.warnings = list(earlier_warnings)
            leave_out: set[str] = set()
            # a graph that is one partition is cached under the graph's own key: the next process
            # finds it without tracing
            order = whole_graph_order(graph, names) if not support.rejected else None
            covers = order is not None and target.inputs.outputs_are_tensors()
            small = {name: aten_op_count(graph.get_submodule(name)) for name in names}
            small = {name: ops for name, ops in small.items() if ops < target.context.settings.min_partition_ops}
            for name in names:
                if name in small:
                    report.partitions.append(PartitionReport(name, ops=small[name], in_openvino=False))
                    continue
                outcome = self._convert_and_compile(graph, name, fingerprint, whole_key if covers else None,
                                                    order if covers else None)
                if not (isinstance(outcome, convert.ConversionError) and outcome.unconverted):
                    continue
                # ops the partition holds can be left to PyTorch by partitioning again
                held = ops_in(graph, name, outcome.unconverted) - unconvertible
                if held and attempt < MAX_ATTEMPTS:
                    leave_out = held
                    break
                self._keep_in_pytorch(name, outcome, (
                    f"still refused after partitioning {MAX_ATTEMPTS} times" if held
                    else "it holds no op of that name to leave to PyTorch"))
            if not leave_out:
                self._keep_small_in_pytorch(small)
                break
            unconvertible |= leave_out
            traced = convert.trace_static(target.inputs.closure(weight_values, scalars), tensors,
                                          target.decompositions)
        if report.fallback_ops:
            target.context.fail(f"{target.name} {report.signature}: ops left in PyTorch: "
                                + ", ".join(f"{op} ({why})" for op, why in sorted(report.fallback_ops.items())))
        in_ov = any(p.in_openvino for p in report.partitions)
        if not in_ov:
            report.route = "eager"
        logger.info("OpenVINO compiled %s", report.summary())
        scalar_free = graph

        def run(user: Sequence[Any]) -> Any:
            return scalar_free(*[v for pos, v in enumerate(user) if pos not in scalars])

        return Variant(run, in_openvino=in_ov)

    def _keep_small_in_pytorch(self, small: dict[str, int]) -> None:
        """Partitions under ``min_partition_ops`` run in PyTorch: reported, with a WARNING.

        The user's policy, not a failure: ``strict`` does not raise for it.
        """
        if not small:
            return
        limit = self.target.context.settings.min_partition_ops
        listed = ", ".join(f"{name} ({ops} op{'s' if ops != 1 else ''})" for name, ops in small.items())
        self.report.warnings.append(f"fewer ops than min_partition_ops={limit}: {listed}")
        logger.warning("%s %s: partitions with fewer ops than min_partition_ops=%d: %s; running them in PyTorch",
                       self.target.name, self.report.signature, limit, listed)

    def _keep_in_pytorch(self, name: str, err: convert.ConversionError, why: str) -> None:
        """Partition ``name`` runs in PyTorch: reported, with a WARNING (or raise when strict)."""
        self.report.warnings.append(f"{name}: {err} ({why})")
        self.target.context.fail(f"{self.target.name} {self.report.signature}: partition {name} could not be "
                                 f"converted ({err}; {why})", err)

    def _convert_and_compile(self, graph: torch.fx.GraphModule, name: str, fingerprint: str,
                             key: str | None = None, whole: list[int] | None = None) -> convert.ConversionError | None:
        """Convert and compile partition ``name`` and put it in ``graph`` (cached under ``key``); ``whole``:
        the partition is the whole graph, and this is the partition output each graph output is; its
        converted model, with its outputs in the graph's order, is kept in :attr:`whole_model`.

        Returns the error of a conversion the frontend refused for unconverted ops, which the caller
        handles (partition again, or keep the partition in PyTorch); other failures are reported
        here. None: in OpenVINO, or a failure already reported.
        """
        context = self.target.context
        report = self.report
        sub = graph.get_submodule(name)
        part = PartitionReport(name, ops=aten_op_count(sub))
        report.partitions.append(part)
        # hashing the constants costs time: only for the disk cache
        if key is None and context.settings.model_caching:
            key = self.target.keys.partition(
                name, fingerprint, sub.code, weights.fingerprint(list(sub.buffers()), context.digests),
                [repr(n.meta.get("val")) for n in sub.graph.nodes if n.op == "placeholder"])
        reordered = whole is not None and whole != list(range(len(whole)))
        # a whole-graph entry holds the outputs in the graph's order, not the partition's: only the
        # whole-graph build reads it (here it is converted again)
        model: ov.Model | Path | None = context.cache_file(key) if key and not reordered else None
        part.cache_hit = model is not None
        if model is None:
            start = time.perf_counter()
            try:
                model = convert.convert_partition(sub, context.settings.rewrites)
            except convert.ConversionError as err:
                part.in_openvino = False
                if err.unconverted:
                    return err
                report.warnings.append(f"{name}: {err}")
                context.fail(f"{self.target.name} {report.signature}: partition {name} could not be converted ({err})",
                             err)
                return err
            part.convert_seconds = time.perf_counter() - start
            graph_model = model
            if whole is not None:
                if reordered:  # the graph's outputs in its own order: the model stands for the graph as it is
                    results = model.get_results()
                    graph_model = ov.Model([results[k] for k in whole], model.get_parameters(),
                                           model.get_friendly_name())
                self.whole_model = graph_model
            if key:
                # compiled from its cache file, OpenVINO's blob is found again by the next process
                stored = context.cache_store(key, graph_model, f"{self.target.name} {name} {report.signature}")
                if not reordered:
                    model = stored or model
        try:
            compiled = context.compile(model, part)
        except RuntimeError as err:
            part.in_openvino = False
            report.warnings.append(f"{name}: compile failed: {err}")
            context.fail(f"{self.target.name} {report.signature}: partition {name} could not be compiled ({err})", err)
            return None
        outputs = next(n for n in sub.graph.nodes if n.op == "output").args[0]
        out_nodes = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        single = not isinstance(outputs, (tuple, list))
        setattr(graph, name, OVModule(OVRunner(compiled, [output_dtype(o) for o in out_nodes]), single))
        graph.recompile()
        return None


def aten_op_count(sub: torch.fx.GraphModule) -> int:
    """How many ops a partition holds, not counting Python's ``getitem`` and size arithmetic."""
    return sum(1 for n in sub.graph.nodes if n.op == "call_function" and not node_op_name(n).startswith("_operator."))


def ops_in(graph: torch.fx.GraphModule, name: str, reported: Sequence[str]) -> set[str]:
    """The op names (as :func:`ov_backend.ops.node_op_name` gives them) of the nodes of partition
    ``name`` that the frontend reported ("aten.foo.default" or the target's own spelling)."""
    wanted = set(reported)
    sub = graph.get_submodule(name)
    return {node_op_name(node) for node in sub.graph.nodes
            if node.op == "call_function" and (node_op_name(node) in wanted or str(node.target) in wanted)}


def whole_graph_order(graph: torch.fx.GraphModule, names: Sequence[str]) -> list[int] | None:
    """When one partition takes every graph input in order and gives every output: which partition
    output each graph output is (dynamo may order them differently). None otherwise."""
    if len(names) != 1:
        return None
    nodes = list(graph.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    calls = [n for n in nodes if n.op == "call_module"]
    if len(calls) != 1 or list(calls[0].args) != placeholders or calls[0].kwargs:
        return None
    call = calls[0]
    outputs = next(n for n in nodes if n.op == "output").args[0]
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    if len(outputs) == 1 and outputs[0] is call:
        return [0]
    order = []
    for out in outputs:
        if not (isinstance(out, torch.fx.Node) and out.op == "call_function" and out.target is operator.getitem
                and out.args[0] is call and isinstance(out.args[1], int)):
            return None
        order.append(out.args[1])
    if sorted(order) != list(range(len(order))):
        return None  # an output given twice, or one the graph does not return
    extra = [n for n in nodes
             if n.op == "call_function" and not (n.target is operator.getitem and n.args[0] is call)]
    return None if extra else order
