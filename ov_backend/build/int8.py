"""The INT8 build: float calls recorded, then a model quantized with NNCF for each set of weights.

At precision "int8" a graph with no INT8 model yet runs at float (dynamic or static build) while its
first calls' inputs are recorded (:class:`~ov_backend.quantize.Calibration`); then the float model is
quantized, stored in the disk cache, and each signature's next call compiles the INT8 model. The
static build quantizes the whole graph as one model only: a graph partitioned runs at float.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import openvino as ov
import torch

from ov_backend import convert, memory_guard, quantize
from ov_backend.build.static import StaticBuilds
from ov_backend.build.target import BuildTarget
from ov_backend.inputs import signature_text
from ov_backend.report import CompileReport, PartitionReport
from ov_backend.variants import Variant, WeightSet
from ov_backend.weight_file import give_back_freed_memory

logger = logging.getLogger(__name__)


class Int8Builds:
    """The INT8 models of one graph.

    Args:
        target: the graph and its cache keys.
    """

    def __init__(self, target: BuildTarget) -> None:
        self.target = target

    def model(self, store: WeightSet, sig: tuple[Any, ...] | None, key: str, part: PartitionReport) -> ov.Model | None:
        """The INT8 model for these weights (``sig`` None: with dynamic shapes): quantized earlier in this
        process, or from the disk cache; None when there is none yet. Marks ``part`` as quantized."""
        model = store.int8_models.get(sig)
        part.reused = model is not None
        if model is None and self.target.context.settings.model_caching:
            model = self.target.context.cache_load(key)
            part.cache_hit = part.cache_hit or model is not None
        if model is None:
            return None
        store.int8_models[sig] = model
        part.quantized = True
        return model

    def recording(self, variant: Variant, store: WeightSet, sig: tuple[Any, ...] | None, model: ov.Model, key: str,
                  report: CompileReport, select: Callable[[Sequence[Any]], list[Any]]) -> Variant:
        """``variant`` (float) recording its calls' model inputs (``select(user)``) for calibration, until
        the graph quantizes ``model`` for these weights (see :meth:`quantize`)."""
        calibration = store.calibrations.get(sig)
        if calibration is None:
            calibration = store.calibrations[sig] = quantize.Calibration(
                self.target.context.settings.calibration_samples, model, key, sig)
        if calibration.failed is not None:
            report.warnings.append(f"INT8 quantization failed earlier ({calibration.failed}); it runs at float")
            report.not_int8 = calibration.failed
            return variant
        report.calibrating = calibration.limit
        float_run = variant.run
        watch = self.target.context.int8_watch

        def run(user: Sequence[Any]) -> Any:
            tensors = select(user)
            if quantize.recordable(tensors) and watch.records(key):
                calibration.record(tensors)
            return float_run(user)

        return Variant(run, in_openvino=True, releasable=variant.releasable, calibration=calibration)

    def watched(self, variant: Variant, key: str) -> Variant:
        """``variant``, which runs the INT8 model ``key``, telling the backend's owner of each call
        (:class:`~ov_backend.quantize.CalibrationWatch`)."""
        watch = self.target.context.int8_watch
        quantized_run = variant.run

        def run(user: Sequence[Any]) -> Any:
            watch.runs_quantized(key)
            return quantized_run(user)

        return variant.running(run)

    def static(self, sig: tuple[Any, ...], user_values: Sequence[Any], weight_values: Sequence[torch.Tensor],
               fingerprint: str, report: CompileReport, store: WeightSet, static: StaticBuilds) -> Variant:
        """The static build at precision "int8": the INT8 model of the whole graph if there is one, else the
        float build recording its calls (the whole graph as one model only: a partitioned one runs at float)."""
        int8_key = self.target.keys.static_int8(sig, fingerprint)
        part = PartitionReport("graph", ops=self.target.inputs.op_count)
        quantized = self.model(store, sig, int8_key, part)
        if quantized is not None:
            variant = static.whole_graph_variant(quantized, part, report)
            if variant is not None:
                return self.watched(variant, int8_key)
        variant = static.build(sig, user_values, weight_values, fingerprint, report)
        model = static.whole_model(sig, fingerprint, weight_values)
        if model is None or not variant.in_openvino:
            report.warnings.append("INT8 needs the graph as one OpenVINO model; it runs at float")
            logger.warning("%s %s: INT8 needs the graph as one OpenVINO model (it was partitioned); it runs at "
                           "float", self.target.name, report.signature)
            return variant
        baked = self.target.inputs.scalar_tensors
        return self.recording(variant, store, sig, model, int8_key, report,
                              lambda user: [v for pos, v in enumerate(user)
                                            if isinstance(v, torch.Tensor) and pos not in baked])

    def quantize(self, store: WeightSet) -> int:
        """Quantize, with NNCF, every model of this weights set whose calls were recorded; returns how many.

        The INT8 model replaces the float one (the next call of each signature compiles it) and is stored
        in the disk cache under its key. A failure is reported and remembered: those weights stay at float.
        """
        target = self.target
        done = 0
        # (a list of the calibrations only: one of all the items would keep the float models alive)
        pending = [calibration for calibration in store.calibrations.values() if calibration.pending]
        for calibration in pending:
            sig = calibration.signature
            report = CompileReport(target.name, signature_text(sig) if sig is not None else "(dynamic shapes)", "int8",
                                   target.context.settings.device)
            part = PartitionReport("graph", ops=target.inputs.op_count, quantized=True,
                                   calibration_samples=len(calibration.samples))
            start = time.perf_counter()
            # the float models that recorded go first (a full UNet's is gigabytes): NNCF's statistics model
            # is compiled beside them; after a failure the next call compiles them again
            released = [key for key, value in store.variants.items()
                        if value.calibration is calibration and value.releasable]
            for key in released:
                del store.variants[key]
            if released:
                gc.collect()
                give_back_freed_memory()
            try:
                short = self._short_of_memory(calibration.model)
                if short is not None:
                    raise quantize.QuantizationError(short)
                with convert.build_lock():
                    model = quantize.quantize(calibration.model, calibration.samples)
            except quantize.QuantizationError as err:
                calibration.failed = str(err)
                part.in_openvino = False
                report.warnings.append(f"INT8 quantization failed ({err}); it runs at float")
                report.not_int8 = str(err)
                logger.warning("%s: INT8 quantization failed (%s); it runs at float", target.name, err)
            else:
                calibration.done = True
                store.int8_models[sig] = model
                target.context.cache_store(calibration.key, model, f"{target.name} int8 {report.signature}")
                # the float variants left that recorded go: each signature's next call compiles the INT8 model
                for key, value in list(store.variants.items()):
                    if value.calibration is calibration:
                        del store.variants[key]
                done += 1
            part.quantize_seconds = time.perf_counter() - start
            calibration.samples = []
            report.partitions.append(part)
            target.context.stats.add(compile_seconds=part.quantize_seconds, quantize_seconds=part.quantize_seconds,
                                     quantized=1 if calibration.done else 0)
            target.context.add_report(report)
            logger.info("%s", report.summary())
        return done

    def _short_of_memory(self, model: ov.Model) -> str | None:
        """Why ``model`` should not be quantized now (NNCF's work would not fit in the memory available), or None
        (``BackendSettings.check_memory``, :func:`ov_backend.memory_guard.quantize_shortage`)."""
        if not self.target.context.settings.check_memory:
            return None
        return memory_guard.quantize_shortage(model)
