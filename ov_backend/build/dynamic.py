"""The dynamic build: a symbolic-shape graph converted once, reshaped and compiled per signature.

A graph dynamo captured with symbolic sizes (its second shape onward) is converted once with its
dynamic dimensions kept and the weights as inputs, then the weights are bound as constants that read
the tensors; the model is reshaped and compiled for each new signature. When the weights change in
place (a LoRA, another checkpoint), the model is compiled again instead of converted anew
(:mod:`ov_backend.weight_binding`), and its cache entry, which holds no weights, serves any weights.
A graph whose dynamic conversion fails (remembered, in the disk cache too) goes the static build.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import openvino as ov
import torch

from ov_backend import convert, weights
from ov_backend.build.int8 import Int8Builds
from ov_backend.build.shared_shapes import SharedShapes, running
from ov_backend.build.target import BuildTarget
from ov_backend.files import format_bytes
from ov_backend.report import CompileReport, PartitionReport
from ov_backend.runtime import OVRunner
from ov_backend.variants import FOR_ONE_SHAPE, Variant, WeightSet
from ov_backend.weight_binding import WeightBoundModel, attach_weights, bindable, name_weight_inputs, weightless_copy

logger = logging.getLogger(__name__)


class DynamicBuilds:
    """The dynamic builds of one graph.

    Args:
        target: the graph (``target.inputs.dynamic_dims`` set), its cache keys and decompositions.
        shared: the graph's models for all shapes.
        int8: the graph's INT8 models, at precision "int8" (else None).
    """

    def __init__(self, target: BuildTarget, shared: SharedShapes, int8: Int8Builds | None) -> None:
        self.target = target
        self.shared = shared
        self.int8 = int8
        self._converted: WeightBoundModel | None = None
        #: why this graph's dynamic conversion failed or cannot work (a property of the graph: never tried again)
        self.failed: str | None = None
        self._failure_looked_up = False
        inputs = target.inputs
        min_max = convert.symbolic_min_max(inputs.gm) if inputs.dynamic_dims is not None else []
        if min_max:
            self.failed = f"symbolic max/min of sizes ({', '.join(min_max[:3])}): no OpenVINO rule"
            logger.info("%s: %s; each input shape is converted on its own (static build)", target.name, self.failed)

    def build(self, sig: tuple[Any, ...], user_values: Sequence[Any], weight_values: Sequence[torch.Tensor],
              store: WeightSet, fingerprint: str, report: CompileReport) -> Variant | None:
        """The variant for ``sig``, or None when the graph goes the static build for it."""
        dims = self.target.inputs.dynamic_dims
        assert dims is not None
        context = self.target.context
        part = PartitionReport("graph", ops=self.target.inputs.op_count)
        if not self._failure_looked_up and context.settings.model_caching:
            self._failure_looked_up = True  # once per graph: a failure found later is remembered in memory
            self.failed = context.cache.failure(self.target.keys.dynamic_failure(sig))
            if self.failed is not None:
                logger.info("%s: its dynamic conversion failed in an earlier process (%s); each shape goes the "
                            "static build", self.target.name, self.failed.splitlines()[0])
        if self.failed is not None:
            return None  # the graph, not its weights, made it fail: each shape goes the static build

        share_key, recapture = None, False
        if self.int8 is None and context.settings.shared_shapes != "never" and not self.shared.failed:
            # the model for all shapes of these weights, under a key another capture of the same code finds
            share_key = self.target.keys.all_shapes(sig, fingerprint)
            recapture = context.shared.join(share_key, self.target.name)
            if store.all_shapes is None and self.shared.shares(sig, store, recapture):
                borrowed = self.shared.borrowed(share_key, part, report)
                if borrowed is not None:
                    return borrowed
        weight_free = all(bindable(t) for t in weight_values)
        key = self.target.keys.dynamic(sig, fingerprint, weights_as_inputs=weight_free)
        base = store.dynamic_model
        if base is None:
            # weights changed in place (a LoRA, a checkpoint loaded into the same modules): the model
            # converted earlier reads the tensors themselves, so compiling it again is enough
            base, changed = self._reusable_model(weight_values)
            if base is not None:
                part.reused, part.weights_changed = True, changed
                store.dynamic_model = base
                assert self._converted is not None
                if changed and context.settings.model_caching and not self._converted.weights_were_inputs:
                    # a model with the weights baked in (made from their values): stored for these weights
                    # too (no weights in it), so the next process finds them
                    context.cache_store(self.target.keys.dynamic(sig, fingerprint, weights_as_inputs=False),
                                        weightless_copy(base, weight_values),
                                        f"{self.target.name} dynamic {report.signature}")
        if base is None:
            base = context.cache_load(key)
            if base is not None:
                base = attach_weights(base, weight_values)
                if base is None:
                    logger.warning("%s: the cached model does not fit the graph's weights; converting again",
                                   self.target.name)
                else:
                    self._remember_converted(base, weight_values, weight_free)
            part.cache_hit = base is not None
            if base is None:
                start = time.perf_counter()
                try:
                    base, weight_free = self._convert(user_values, weight_values, dims, weight_free, key, report)
                except convert.ConversionError as err:
                    report.warnings.append(f"dynamic conversion failed: {err}")
                    logger.warning("%s: could not convert with dynamic shapes (%s); converting each input "
                                   "shape separately instead (remembered for this graph)", self.target.name, err)
                    self.failed = str(err)
                    if context.settings.model_caching:
                        context.cache.note_failure(self.target.keys.dynamic_failure(sig), str(err))
                    return None
                part.convert_seconds = time.perf_counter() - start
                converted = self._remember_converted(base, weight_values, weight_free)
                if context.settings.model_caching and not weight_free:
                    # the weights the model reads from the tensors are not written: the entry is the
                    # graph and the few constants the conversion made itself, under these weights' key
                    stored = weightless_copy(base, weight_values) if converted.shared_bytes else base
                    context.cache_store(self.target.keys.dynamic(sig, fingerprint, weights_as_inputs=False), stored,
                                        f"{self.target.name} dynamic {report.signature}")
            store.dynamic_model = base
        elif not part.reused:
            part.reused = True
        int8_key = None
        if self.int8 is not None:
            int8_key = self.target.keys.dynamic_int8(sig, fingerprint)
            quantized = self.int8.model(store, None, int8_key, part)
            if quantized is not None:
                base = quantized
        if int8_key is None and self.shared.shares(sig, store, recapture):
            variant = self.shared.for_all_shapes(base, store, part, report, share_key)
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
                           self.target.name, err)
            return None
        report.route = "dynamic"
        report.partitions.append(part)
        runner = OVRunner(compiled, self.target.inputs.output_dtypes())
        logger.info("OpenVINO compiled %s", report.summary())
        variant = running(runner, FOR_ONE_SHAPE)
        if self.int8 is not None and int8_key is not None:
            variant = (self.int8.watched(variant, int8_key) if part.quantized
                       else self.int8.recording(variant, store, None, base, int8_key, report, list))
        return variant

    def _convert(self, user_values: Sequence[Any], weight_values: Sequence[torch.Tensor],
                 dims: Sequence[Sequence[int]], weight_free: bool, key: str,
                 report: CompileReport) -> tuple[ov.Model, bool]:
        """Convert with dynamic shapes; returns the model (weights bound) and whether the weights were its
        inputs.

        With ``weight_free``, the weights are inputs of the conversion: no constant of the model is made
        from their values (the frontend would otherwise copy some, e.g. a layer norm's weight reshaped,
        and drop others, e.g. a norm of ones), so the model follows any weight changed in place, and its
        cache entry (written here, before the weights are bound) holds no weights at all. Otherwise,
        or if the frontend cannot take them as inputs, they are constants of the conversion."""
        target = self.target
        if weight_free:
            try:
                model = convert.convert_dynamic(target.inputs.taking_weights(), [*user_values, *weight_values],
                                                [*dims, *([()] * len(weight_values))], target.decompositions,
                                                target.context.settings.rewrites)
            except convert.ConversionError as err:
                logger.info("%s: could not convert with the weights as inputs (%s); converting with them as "
                            "constants", target.name, str(err).splitlines()[0])
            else:
                named = name_weight_inputs(model, len(user_values), len(weight_values))
                if named is not None:
                    stored = target.context.cache_store(key, named, f"{target.name} dynamic {report.signature}",
                                                        any_weights=True)
                    bound = attach_weights(named, weight_values)
                    if bound is not None:
                        return bound, True
                    if stored is not None:
                        target.context.cache.clear([key])
                logger.info("%s: the model converted with the weights as inputs did not take them back; "
                            "converting with them as constants", target.name)
        return convert.convert_dynamic(target.inputs.closure(weight_values, {}), user_values, dims,
                                       target.decompositions, target.context.settings.rewrites), False

    def _remember_converted(self, base: ov.Model, weight_values: Sequence[torch.Tensor],
                            weights_were_inputs: bool = False) -> WeightBoundModel:
        converted = self._converted = WeightBoundModel(
            base, weight_values, weights.digests(weight_values, self.target.context.digests), weights_were_inputs)
        logger.info("%s: the converted model reads %s of weights from the PyTorch tensors and holds copies of %s",
                    self.target.name, format_bytes(converted.shared_bytes), format_bytes(converted.copied_bytes))
        return converted

    def _reusable_model(self, weight_values: Sequence[torch.Tensor]) -> tuple[ov.Model | None, bool]:
        """The model converted earlier, if compiling it now gives exactly these weights, and whether the
        weights changed since its conversion."""
        converted = self._converted
        if converted is None:
            return None, False
        changed = converted.check(weight_values, weights.digests(weight_values, self.target.context.digests))
        if changed is not None:
            if changed:
                logger.info("%s: weights changed in place; compiling the model converted before (no conversion)",
                            self.target.name)
            return converted.model, changed
        self._converted = None  # other tensors, or a weight it holds a copy of changed: it is of no more use
        return None, False
