"""The shared-shape build: one model compiled for all shapes of a set of weights.

Under ``BackendSettings.shared_shapes``, the model the dynamic build converted is compiled once with
its dynamic shapes kept and serves every signature of those weights, in place of a model compiled
per shape; a graph that dynamo captured again from the same code borrows it from the graph that
compiled it (:class:`~ov_backend.variants.SharedModels`).
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import openvino as ov

from ov_backend.build.target import BuildTarget
from ov_backend.report import CompileReport, PartitionReport
from ov_backend.runtime import OVRunner
from ov_backend.variants import FOR_ALL_SHAPES, Variant, WeightSet, borrowed_variant

logger = logging.getLogger(__name__)


def running(runner: OVRunner, compiled_for: str) -> Variant:
    """A signature's variant on the dynamic build that runs ``runner``: its own model
    (:data:`FOR_ONE_SHAPE`) or the weights set's model for all shapes (:data:`FOR_ALL_SHAPES`, which
    goes with the last variant running it). Released with the window rules either way."""
    return Variant(lambda user: tuple(runner(user)), in_openvino=True, releasable=True, compiled_for=compiled_for)


class SharedShapes:
    """The models for all shapes of one graph.

    Args:
        target: the graph.
    """

    def __init__(self, target: BuildTarget) -> None:
        self.target = target
        #: why OpenVINO could not compile this graph's model for all shapes (then it compiles per shape)
        self.failed: str | None = None

    def shares(self, sig: tuple[Any, ...], store: WeightSet, recapture: bool = False) -> bool:
        """Whether ``sig`` runs the weights set's model for all shapes (``BackendSettings.shared_shapes``):
        it exists already, or "always", or under "auto" on the CPU a model compiled for another shape is
        still held (the caller released those no call used in the current use window), or this graph
        re-captures code another graph built for these weights (``recapture``, see
        :class:`~ov_backend.variants.SharedModels`)."""
        mode = self.target.context.settings.shared_shapes
        if mode == "never" or self.failed:
            return False
        if mode == "always" or store.all_shapes is not None:
            return True
        return self.target.context.settings.on_cpu and (
            recapture or any(key != sig for key in store.one_shape_variants()))

    def for_all_shapes(self, base: ov.Model, store: WeightSet, part: PartitionReport, report: CompileReport,
                       share_key: str | None) -> Variant | None:
        """A variant that runs the model compiled with dynamic shapes, compiling it on first use (and
        lending it to the backend's other graphs under ``share_key``); the models compiled per shape
        for these weights go then, their shapes run it too (no build when they come back). None if
        OpenVINO cannot compile it (remembered: this graph compiles per shape from then on)."""
        runner = store.all_shapes
        if runner is None:
            try:
                compiled = self.target.context.compile(base, part)
            except RuntimeError as err:
                self.failed = str(err)
                report.warnings.append(f"compile for all shapes failed: {err}")
                logger.warning("%s: OpenVINO could not compile the model with dynamic shapes (%s); compiling "
                               "it for each shape instead", self.target.name, err)
                return None
            runner = store.all_shapes = OVRunner(compiled, self.target.inputs.output_dtypes())
            if share_key is not None:
                self.target.context.shared.lend(share_key, runner)
            per_shape = store.one_shape_variants()
            for key in per_shape:
                store.variants[key] = running(runner, FOR_ALL_SHAPES)
            part.replaced = len(per_shape)
            if per_shape:
                gc.collect()
                logger.info("%s: one model compiled for all shapes replaces %d compiled for one shape each",
                            self.target.name, len(per_shape))
        else:
            part.reused = True
        part.all_shapes = True
        report.route = "dynamic"
        report.partitions.append(part)
        logger.info("OpenVINO %s %s", "compiled" if part.compile_seconds else "reused", report.summary())
        return running(runner, FOR_ALL_SHAPES)

    def borrowed(self, share_key: str, part: PartitionReport, report: CompileReport) -> Variant | None:
        """A variant running the model for all shapes that another graph of the backend compiled from
        the same code and weights, if that graph still holds it (see
        :class:`~ov_backend.variants.SharedModels`). Only a weak reference is kept: when the owner
        releases the model, the signature is built again."""
        ref = self.target.context.shared.borrow(share_key)
        if ref is None:
            return None
        part.reused = part.all_shapes = part.borrowed = True
        report.route = "dynamic"
        report.partitions.append(part)
        logger.info("OpenVINO reused %s", report.summary())
        return borrowed_variant(ref, self.target.name)
