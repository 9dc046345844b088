"""The build routes of one graph: from a call's signature to a :class:`~ov_backend.variants.Variant`.

Owns :class:`GraphBuilder`, which picks the route and records it in a compile report:

* dynamic: a symbolic-shape graph (dynamo's second shape onward) is converted once with its
  dynamic dimensions kept and the weights as inputs, then the weights are bound as constants that
  read the tensors; it is reshaped and compiled for each new signature. When the weights change in
  place (a LoRA, another checkpoint), the model is compiled again instead of converting anew
  (:mod:`ov_backend.live`), and its cache entry, which holds no weights, serves any weights;
* whole-graph cache entry: a graph cached earlier as one model is compiled from the cache
  without tracing;
* static: the graph is traced for the signature, partitioned and converted
  (:mod:`ov_backend.partitions`).

Whatever OpenVINO cannot take runs in PyTorch with a WARNING, or raises when ``strict``.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openvino as ov
import torch

from ov_backend import convert, quantize, weights
from ov_backend.context import BuildContext
from ov_backend.files import format_bytes
from ov_backend.inputs import GraphInputs, signature_text
from ov_backend.live import WEIGHT_PARAMETER, LiveModel, attach_weights, bindable, name_weight_inputs, weightless_copy
from ov_backend.ops import decomposition_table, node_op_name
from ov_backend.partitions import StaticBuild
from ov_backend.precision import QUANTIZED_PRECISIONS
from ov_backend.report import CompileReport, PartitionReport
from ov_backend.runtime import OVRunner
from ov_backend.variants import (
    ALL_SHAPES_MODEL,
    FOR_ALL_SHAPES,
    FOR_ONE_SHAPE,
    Variant,
    borrowed_variant,
    eager_variant,
)

logger = logging.getLogger(__name__)

#: the key, in a weights set's variants, of the model converted with dynamic shapes
DYNAMIC_MODEL = "__dynamic_model__"


def _weightless(xml: Path) -> bool:
    """Whether a cached ``model.xml`` was stored without its weights (:func:`weightless_copy`)."""
    try:
        return WEIGHT_PARAMETER in xml.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


@dataclass(frozen=True)
class Slot:
    """A key, in a weights set's variants, of what INT8 keeps there (``signature`` None: dynamic shapes)."""

    kind: str  # "int8 model" or "calibration"
    signature: tuple[Any, ...] | None


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
        self._live: LiveModel | None = None
        #: why this graph's dynamic conversion failed or cannot work (a property of the graph: never tried again)
        self._dynamic_failed: str | None = None
        self._failure_looked_up = False
        #: why OpenVINO could not compile this graph's model for all shapes (then it compiles per shape)
        self._sharing_failed: str | None = None
        min_max = convert.symbolic_min_max(inputs.gm) if inputs.dynamic_dims is not None else []
        if min_max:
            self._dynamic_failed = f"symbolic max/min of sizes ({', '.join(min_max[:3])}): no OpenVINO rule"
            logger.info("%s: %s; each input shape is converted on its own (static route)", name, self._dynamic_failed)
        #: per signature, the static route's model of the whole graph (one partition), if it reads the weights
        self._static_live: dict[tuple[Any, ...], LiveModel] = {}
        self._decomp = decomposition_table(context.settings.decompositions)
        #: the settings ask for INT8 models (calibrated on this graph's first calls)
        self._int8 = context.settings.precision in QUANTIZED_PRECISIONS
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
                return self._build_static(sig, user_values, weight_values, fingerprint, report, variants)
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
        if not self._failure_looked_up and context.settings.model_caching:
            self._failure_looked_up = True  # once per graph: a failure found later is remembered in memory
            self._dynamic_failed = context.cache.failure(self._dynamic_failure_key(sig))
            if self._dynamic_failed is not None:
                logger.info("%s: its dynamic conversion failed in an earlier process (%s); each shape goes the "
                            "static route", self.name, self._dynamic_failed.splitlines()[0])
        if self._dynamic_failed is not None:
            return None  # the graph, not its weights, made it fail: each shape goes the static route

        def dynamic_key(free: bool) -> str:
            # converted with the weights as inputs (see _convert_dynamic), a model holds nothing of them:
            # one entry serves every checkpoint and LoRA of this graph, so its key names no weights
            return context.key("dynamic", [(len(s[0]), s[1]) for s in sig], None if free else fingerprint,
                               {"graph": self._graph_code, "dims": dims, "weights": "inputs" if free else "baked"},
                               for_device=False)

        share_key, recapture = None, False
        if not self._int8 and context.settings.shared_shapes != "never" and not self._sharing_failed:
            # the model for all shapes of these weights, under a key another capture of the same code finds
            share_key = context.key("dynamic for all shapes", [(len(s[0]), s[1]) for s in sig], fingerprint,
                                    {"graph": self._graph_code, "dims": dims})
            recapture = context.shared.join(share_key, self.name)
            if ALL_SHAPES_MODEL not in variants and self._shares_shapes(sig, variants, recapture):
                borrowed = self._borrowed(share_key, part, report)
                if borrowed is not None:
                    return borrowed
        weight_free = all(bindable(t) for t in weight_values)
        key = dynamic_key(weight_free)
        base = variants.get(DYNAMIC_MODEL)
        if base is None:
            # weights changed in place (a LoRA, a checkpoint loaded into the same modules): the model
            # converted earlier reads the tensors themselves, so compiling it again is enough
            base, changed = self._live_model(weight_values)
            if base is not None:
                part.reused, part.weights_changed = True, changed
                variants[DYNAMIC_MODEL] = base
                assert self._live is not None
                if changed and context.settings.model_caching and not self._live.weights_were_inputs:
                    # a model with the weights baked in (made from their values): stored for these weights
                    # too (no weights in it), so the next process finds them
                    context.cache_store(dynamic_key(False), weightless_copy(base, weight_values),
                                        f"{self.name} dynamic {report.signature}")
        if base is None:
            base = context.cache_load(key)
            if base is not None:
                base = attach_weights(base, weight_values)
                if base is None:
                    logger.warning("%s: the cached model does not fit the graph's weights; converting again",
                                   self.name)
                else:
                    self._remember_live(base, weight_values, weight_free)
            part.cache_hit = base is not None
            if base is None:
                start = time.perf_counter()
                try:
                    base, weight_free = self._convert_dynamic(user_values, weight_values, dims, weight_free,
                                                              key, report)
                except convert.ConversionError as err:
                    report.warnings.append(f"dynamic conversion failed: {err}")
                    logger.warning("%s: could not convert with dynamic shapes (%s); converting each input "
                                   "shape separately instead (remembered for this graph)", self.name, err)
                    self._dynamic_failed = str(err)
                    if context.settings.model_caching:
                        context.cache.note_failure(self._dynamic_failure_key(sig), str(err))
                    return None
                part.convert_seconds = time.perf_counter() - start
                live_model = self._remember_live(base, weight_values, weight_free)
                if context.settings.model_caching and not weight_free:
                    # the weights the model reads from the tensors are not written: the entry is the
                    # graph and the few constants the conversion made itself, under these weights' key
                    stored = weightless_copy(base, weight_values) if live_model.shared_bytes else base
                    context.cache_store(dynamic_key(False), stored, f"{self.name} dynamic {report.signature}")
            variants[DYNAMIC_MODEL] = base
        elif not part.reused:
            part.reused = True
        int8_key = None
        if self._int8:
            int8_key = context.key("int8", [(len(s[0]), s[1]) for s in sig], fingerprint,
                                   {"graph": self._graph_code, "dims": dims,
                                    **quantize.calibration_key(context.settings.calibration_samples)})
            quantized = self._int8_model(variants, None, int8_key, part)
            if quantized is not None:
                base = quantized
        if int8_key is None and self._shares_shapes(sig, variants, recapture):
            variant = self._for_all_shapes(base, variants, part, report, share_key)
            if variant is not None:
                return variant
        model = base.clone()
        try:
            # a reshape fails where the model holds a size the conversion fixed (to its example value)
            model.reshape({i: ov.PartialShape(list(s[0])) for i, s in enumerate(sig)})
            compiled = context.compile(model, part)
        except RuntimeError as err:
            report.warnings.append(f"reshape or compile failed: {err}")
            logger.warning("%s: OpenVINO could not reshape or compile the model for this shape (%s); tracing it",
                           self.name, err)
            return None
        report.route = "dynamic"
        report.partitions.append(part)
        runner = OVRunner(compiled, self.inputs.output_dtypes())
        logger.info("OpenVINO compiled %s", report.summary())
        variant = self._running(runner, FOR_ONE_SHAPE)
        if int8_key is not None and not part.quantized:
            variant = self._recording(variant, variants, None, base, int8_key, report, list)
        return variant

    def _shares_shapes(self, sig: tuple[Any, ...], variants: dict[Any, Any], recapture: bool = False) -> bool:
        """Whether ``sig`` runs the weights set's model for all shapes (``BackendSettings.shared_shapes``):
        it exists already, or "always", or under "auto" on the CPU a model compiled for another shape is
        still held (the caller released those no call used in the current use window), or this graph
        re-captures code another graph built for these weights (``recapture``, see
        :class:`~ov_backend.variants.SharedModels`)."""
        mode = self.context.settings.shared_shapes
        if mode == "never" or self._sharing_failed:
            return False
        if mode == "always" or ALL_SHAPES_MODEL in variants:
            return True
        return self.context.settings.device == "CPU" and (recapture or any(
            isinstance(v, Variant) and v.compiled_for == FOR_ONE_SHAPE and key != sig for key, v in variants.items()))

    def _for_all_shapes(self, base: ov.Model, variants: dict[Any, Any], part: PartitionReport,
                        report: CompileReport, share_key: str | None) -> Variant | None:
        """A variant that runs the model compiled with dynamic shapes, compiling it on first use (and
        lending it to the backend's other graphs under ``share_key``); the models compiled per shape
        for these weights go then, their shapes run it too (no build when they come back). None if
        OpenVINO cannot compile it (remembered: this graph compiles per shape from then on)."""
        runner = variants.get(ALL_SHAPES_MODEL)
        if runner is None:
            try:
                compiled = self.context.compile(base, part)
            except RuntimeError as err:
                self._sharing_failed = str(err)
                report.warnings.append(f"compile for all shapes failed: {err}")
                logger.warning("%s: OpenVINO could not compile the model with dynamic shapes (%s); compiling "
                               "it for each shape instead", self.name, err)
                return None
            runner = variants[ALL_SHAPES_MODEL] = OVRunner(compiled, self.inputs.output_dtypes())
            if share_key is not None:
                self.context.shared.lend(share_key, runner)
            per_shape = [key for key, v in variants.items()
                         if isinstance(v, Variant) and v.compiled_for == FOR_ONE_SHAPE]
            for key in per_shape:
                variants[key] = self._running(runner, FOR_ALL_SHAPES)
            part.replaced = len(per_shape)
            if per_shape:
                gc.collect()
                logger.info("%s: one model compiled for all shapes replaces %d compiled for one shape each",
                            self.name, len(per_shape))
        else:
            part.reused = True
        part.all_shapes = True
        report.route = "dynamic"
        report.partitions.append(part)
        logger.info("OpenVINO %s %s", "compiled" if part.compile_seconds else "reused", report.summary())
        return self._running(runner, FOR_ALL_SHAPES)

    def _borrowed(self, share_key: str, part: PartitionReport, report: CompileReport) -> Variant | None:
        """A variant running the model for all shapes that another graph of the backend compiled from
        the same code and weights, if that graph still holds it (see
        :class:`~ov_backend.variants.SharedModels`). Only a weak reference is kept: when the owner
        releases the model, the signature is built again."""
        ref = self.context.shared.borrow(share_key)
        if ref is None:
            return None
        part.reused = part.all_shapes = part.borrowed = True
        report.route = "dynamic"
        report.partitions.append(part)
        logger.info("OpenVINO reused %s", report.summary())
        return borrowed_variant(ref, self.name)

    @staticmethod
    def _running(runner: OVRunner, compiled_for: str) -> Variant:
        """A signature's variant on the dynamic route that runs ``runner``: its own model
        (:data:`FOR_ONE_SHAPE`) or the weights set's model for all shapes (:data:`FOR_ALL_SHAPES`, which
        goes with the last variant running it). Released with the window rules either way."""
        return Variant(lambda user: tuple(runner(user)), in_openvino=True, releasable=True,
                       compiled_for=compiled_for)

    def _convert_dynamic(self, user_values: Sequence[Any], weight_values: Sequence[torch.Tensor],
                         dims: Sequence[Sequence[int]], weight_free: bool, key: str,
                         report: CompileReport) -> tuple[ov.Model, bool]:
        """Convert with dynamic shapes; returns the model (weights bound) and whether the weights were its
        inputs.

        With ``weight_free``, the weights are inputs of the conversion: no constant of the model is made
        from their values (the frontend would otherwise copy some, e.g. a layer norm's weight reshaped,
        and drop others, e.g. a norm of ones), so the model follows any weight changed in place, and its
        cache entry (written here, before the weights are bound) holds no weights at all. Otherwise,
        or if the frontend cannot take them as inputs, they are constants of the conversion."""
        if weight_free:
            try:
                model = convert.convert_dynamic(self.inputs.taking_weights(), [*user_values, *weight_values],
                                                [*dims, *([()] * len(weight_values))], self._decomp,
                                                self.context.settings.rewrites)
            except convert.ConversionError as err:
                logger.info("%s: could not convert with the weights as inputs (%s); converting with them as "
                            "constants", self.name, str(err).splitlines()[0])
            else:
                named = name_weight_inputs(model, len(user_values), len(weight_values))
                if named is not None:
                    stored = self.context.cache_store(key, named, f"{self.name} dynamic {report.signature}",
                                                      any_weights=True)
                    bound = attach_weights(named, weight_values)
                    if bound is not None:
                        return bound, True
                    if stored is not None:
                        self.context.cache.clear([key])
                logger.info("%s: the model converted with the weights as inputs did not take them back; "
                            "converting with them as constants", self.name)
        return convert.convert_dynamic(self.inputs.closure(weight_values, {}), user_values, dims, self._decomp,
                                       self.context.settings.rewrites), False

    def _dynamic_failure_key(self, sig: tuple[Any, ...]) -> str:
        """The key under which a failed dynamic conversion of this graph is remembered (no weights in it)."""
        return self.context.key("dynamic-failure", [(len(s[0]), s[1]) for s in sig], None,
                                {"graph": self._graph_code, "dims": self.inputs.dynamic_dims})

    def _remember_live(self, base: ov.Model, weight_values: Sequence[torch.Tensor],
                       weights_were_inputs: bool = False) -> LiveModel:
        live = self._live = LiveModel(base, weight_values, weights.digests(weight_values, self.context.digests),
                                      weights_were_inputs)
        logger.info("%s: the converted model reads %s of weights from the PyTorch tensors and holds copies of %s",
                    self.name, format_bytes(live.shared_bytes), format_bytes(live.copied_bytes))
        return live

    def _live_model(self, weight_values: Sequence[torch.Tensor]) -> tuple[ov.Model | None, bool]:
        """The model converted earlier, if compiling it now gives exactly these weights, and whether the
        weights changed since its conversion."""
        live = self._live
        if live is None:
            return None, False
        changed = live.check(weight_values, weights.digests(weight_values, self.context.digests))
        if changed is not None:
            if changed:
                logger.info("%s: weights changed in place; compiling the model converted before (no conversion)",
                            self.name)
            return live.model, changed
        self._live = None  # other tensors, or a weight it holds a copy of changed: it is of no more use
        return None, False

    # -- static route ---------------------------------------------------------------------------------
    def _build_static(self, sig: tuple[Any, ...], user_values: Sequence[Any],
                      weight_values: Sequence[torch.Tensor], fingerprint: str, report: CompileReport,
                      variants: dict[Any, Any]) -> Variant:
        if not self._int8 or not self.inputs.outputs_are_tensors():
            return self._build_static_float(sig, user_values, weight_values, fingerprint, report)
        int8_key = self.context.key("int8", sig, fingerprint, {
            "graph": self._graph_code, "min_partition_ops": self.context.settings.min_partition_ops,
            **quantize.calibration_key(self.context.settings.calibration_samples)})
        part = PartitionReport("graph", ops=self.inputs.op_count)
        quantized = self._int8_model(variants, sig, int8_key, part)
        if quantized is not None:
            variant = self._whole_graph_variant(quantized, part, report)
            if variant is not None:
                return variant
        variant = self._build_static_float(sig, user_values, weight_values, fingerprint, report)
        model = self._whole_model(sig, fingerprint, weight_values)
        if model is None or not variant.in_openvino:
            report.warnings.append("INT8 needs the graph as one OpenVINO model; it runs at float")
            logger.warning("%s %s: INT8 needs the graph as one OpenVINO model (it was partitioned); it runs at "
                           "float", self.name, report.signature)
            return variant
        baked = self.inputs.scalar_tensors
        return self._recording(variant, variants, sig, model, int8_key, report,
                               lambda user: [v for pos, v in enumerate(user)
                                             if isinstance(v, torch.Tensor) and pos not in baked])

    def _whole_model(self, sig: tuple[Any, ...], fingerprint: str,
                     weight_values: Sequence[torch.Tensor]) -> ov.Model | None:
        """The float model of the whole graph for ``sig``, if the static route made or found one."""
        live = self._static_live.get(sig)
        if live is not None:
            return live.model
        if not self.context.settings.model_caching:
            return None
        whole_key = self.context.key("whole", sig, fingerprint, {
            "graph": self._graph_code, "min_partition_ops": self.context.settings.min_partition_ops})
        xml = self.context.cache.model_file(whole_key)
        return self._read_whole(xml, weight_values) if xml is not None else None

    def _read_whole(self, xml: Path, weight_values: Sequence[torch.Tensor]) -> ov.Model | None:
        """A whole-graph entry read back, its weights attached when it was stored without them (a model
        with its weights has no weight parameters: attaching leaves it as it is)."""
        return attach_weights(self.context.core.read_model(str(xml)), weight_values)

    def _build_static_float(self, sig: tuple[Any, ...], user_values: Sequence[Any],
                            weight_values: Sequence[torch.Tensor], fingerprint: str, report: CompileReport) -> Variant:
        context = self.context
        whole_key = None
        if context.settings.model_caching and self.inputs.outputs_are_tensors():
            # whether the graph is one partition depends on min_partition_ops
            whole_key = context.key("whole", sig, fingerprint, {
                "graph": self._graph_code, "min_partition_ops": context.settings.min_partition_ops})
            cached = self._from_whole_graph_entry(whole_key, report, weight_values)
            if cached is not None:
                return cached
        live = self._static_live.get(sig)
        if live is not None:
            changed = live.check(weight_values, weights.digests(weight_values, context.digests))
            if changed is not None:
                part = PartitionReport("graph", ops=self.inputs.op_count, reused=True, weights_changed=changed)
                if changed and whole_key is not None:
                    # stored for these weights too, without the weights it reads from the tensors (a text
                    # encoder's 0.5 GB is not written again for each LoRA), so the next process finds the
                    # graph without tracing it
                    stored = weightless_copy(live.model, weight_values) if live.shared_bytes else live.model
                    context.cache_store(whole_key, stored, f"{self.name} whole {report.signature}")
                variant = self._whole_graph_variant(live.model, part, report)
                if variant is not None:
                    return variant
            del self._static_live[sig]
        build = StaticBuild(context, self.inputs, self.name, self._decomp, report)
        variant = build.run(user_values, weight_values, fingerprint, whole_key)
        if build.whole_model is not None:
            live = self._static_live[sig] = LiveModel(build.whole_model, weight_values,
                                                      weights.digests(weight_values, context.digests))
            # compiled again from the kept model when it is needed after a release
            variant.releasable = variant.in_openvino and live.shared_bytes > 0
        return variant

    def _from_whole_graph_entry(self, key: str, report: CompileReport,
                                weight_values: Sequence[torch.Tensor]) -> Variant | None:
        """A variant from a cached model of the whole graph, with no tracing at all; None if absent.

        An entry with its weights compiles from its file (OpenVINO's blob cache finds it again); one stored
        without them (after a weight change) gets these weights attached and compiles in memory."""
        xml = self.context.cache_file(key)
        if xml is None:
            return None
        part = PartitionReport("graph", ops=self.inputs.op_count, cache_hit=True)
        if not _weightless(xml):
            return self._whole_graph_variant(xml, part, report)
        model = self._read_whole(xml, weight_values)
        if model is None:
            logger.warning("%s: the cached model of the whole graph does not fit its weights; tracing again",
                           self.name)
            return None
        return self._whole_graph_variant(model, part, report)

    def _whole_graph_variant(self, model: ov.Model | Path, part: PartitionReport,
                             report: CompileReport) -> Variant | None:
        """A variant from a model of the whole graph (its inputs are the graph's tensor inputs, scalars
        baked); None when it cannot be compiled."""
        try:
            compiled = self.context.compile(model, part)
        except RuntimeError as err:
            logger.warning("%s: the model of the whole graph could not be compiled (%s); converting again",
                           self.name, err)
            return None
        report.partitions.append(part)
        runner = OVRunner(compiled, self.inputs.output_dtypes())
        logger.info("OpenVINO compiled %s", report.summary())
        baked = self.inputs.scalar_tensors
        return Variant(lambda user: tuple(runner([v for pos, v in enumerate(user)
                                                  if isinstance(v, torch.Tensor) and pos not in baked])),
                       in_openvino=True, releasable=True)

    # -- INT8 -----------------------------------------------------------------------------------------
    def _int8_model(self, variants: dict[Any, Any], sig: tuple[Any, ...] | None, key: str,
                    part: PartitionReport) -> ov.Model | None:
        """The INT8 model for these weights (``sig`` None: with dynamic shapes): quantized earlier in this
        process, or from the disk cache; None when there is none yet. Marks ``part`` as quantized."""
        slot = Slot("int8 model", sig)
        model = variants.get(slot)
        part.reused = model is not None
        if model is None and self.context.settings.model_caching:
            model = self.context.cache_load(key)
            part.cache_hit = part.cache_hit or model is not None
        if model is None:
            return None
        variants[slot] = model
        part.quantized = True
        return model

    def _recording(self, variant: Variant, variants: dict[Any, Any], sig: tuple[Any, ...] | None,
                   model: ov.Model, key: str, report: CompileReport,
                   select: Callable[[Sequence[Any]], list[Any]]) -> Variant:
        """``variant`` (float) recording its calls' model inputs (``select(user)``) for calibration, until
        the graph quantizes ``model`` for these weights (see :meth:`quantize`)."""
        slot = Slot("calibration", sig)
        calibration = variants.get(slot)
        if calibration is None:
            calibration = variants[slot] = quantize.Calibration(self.context.settings.calibration_samples,
                                                                model, key, sig)
        if calibration.failed is not None:
            report.warnings.append(f"INT8 quantization failed earlier ({calibration.failed}); it runs at float")
            return variant
        report.calibrating = calibration.limit
        float_run = variant.run

        def run(user: Sequence[Any]) -> Any:
            tensors = select(user)
            if quantize.recordable(tensors):
                calibration.record(tensors)
            return float_run(user)

        return Variant(run, in_openvino=True, releasable=variant.releasable, calibration=calibration)

    def quantize(self, variants: dict[Any, Any]) -> int:
        """Quantize, with NNCF, every model of this weights set whose calls were recorded; returns how many.

        The INT8 model replaces the float one (the next call of each signature compiles it) and is stored
        in the disk cache under its key. A failure is reported and remembered: those weights stay at float.
        """
        done = 0
        # (a list of the calibrations only: one of all the items would keep the float models alive)
        pending = [calibration for slot, calibration in variants.items()
                   if isinstance(slot, Slot) and slot.kind == "calibration" and calibration.pending]
        for calibration in pending:
            sig = calibration.signature
            report = CompileReport(self.name, signature_text(sig) if sig is not None else "(dynamic shapes)", "int8",
                                   self.context.settings.device)
            part = PartitionReport("graph", ops=self.inputs.op_count, quantized=True,
                                   calibration_samples=len(calibration.samples))
            start = time.perf_counter()
            # the float models that recorded go first (a full SD 1.5 UNet's is ~2 GB at bf16): NNCF's
            # statistics model is compiled beside them; after a failure the next call compiles them again
            released = [key for key, value in variants.items()
                        if isinstance(value, Variant) and value.calibration is calibration and value.releasable]
            for key in released:
                del variants[key]
            if released:
                gc.collect()
            try:
                with convert.build_lock():
                    model = quantize.quantize(calibration.model, calibration.samples)
            except quantize.QuantizationError as err:
                calibration.failed = str(err)
                part.in_openvino = False
                report.warnings.append(f"INT8 quantization failed ({err}); it runs at float")
                logger.warning("%s: INT8 quantization failed (%s); it runs at float", self.name, err)
            else:
                calibration.done = True
                variants[Slot("int8 model", sig)] = model
                self.context.cache_store(calibration.key, model, f"{self.name} int8 {report.signature}")
                # the float variants left that recorded go: each signature's next call compiles the INT8 model
                for key, value in list(variants.items()):
                    if isinstance(value, Variant) and value.calibration is calibration:
                        del variants[key]
                done += 1
            part.quantize_seconds = time.perf_counter() - start
            calibration.samples = []
            report.partitions.append(part)
            self.context.stats.add(compile_seconds=part.quantize_seconds, quantize_seconds=part.quantize_seconds,
                                   quantized=1 if calibration.done else 0)
            self.context.add_report(report)
            logger.info("%s", report.summary())
        return done
