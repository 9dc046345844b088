"""The static build: a graph traced for one signature, partitioned and converted.

A graph cached earlier as one model is compiled from its cache entry without tracing. Otherwise it is
traced for the signature, partitioned and converted (:class:`~ov_backend.build.partitions.PartitionedBuild`);
when the whole graph became one model that reads the weights from the PyTorch tensors, that model is
kept, so that a change of weights in place costs a compile, not a trace.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openvino as ov
import torch

from ov_backend import weights
from ov_backend.build.partitions import PartitionedBuild
from ov_backend.build.target import BuildTarget
from ov_backend.report import CompileReport, PartitionReport
from ov_backend.runtime import OVRunner
from ov_backend.variants import Variant
from ov_backend.weight_binding import WEIGHT_PARAMETER, WeightBoundModel, attach_weights, weightless_copy

logger = logging.getLogger(__name__)


def _weightless(xml: Path) -> bool:
    """Whether a cached ``model.xml`` was stored without its weights (:func:`weightless_copy`)."""
    try:
        return WEIGHT_PARAMETER in xml.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


class StaticBuilds:
    """The static builds of one graph, per signature.

    Args:
        target: the graph, its cache keys and decompositions.
    """

    def __init__(self, target: BuildTarget) -> None:
        self.target = target
        #: per signature, the model of the whole graph (one partition), if it reads the weights
        self._kept: dict[tuple[Any, ...], WeightBoundModel] = {}

    def build(self, sig: tuple[Any, ...], user_values: Sequence[Any], weight_values: Sequence[torch.Tensor],
              fingerprint: str, report: CompileReport) -> Variant:
        """The variant for ``sig`` at float: from the whole graph's cache entry, the kept model of the whole
        graph, or traced and converted."""
        context = self.target.context
        whole_key = None
        if context.settings.model_caching and self.target.inputs.outputs_are_tensors():
            whole_key = self.target.keys.whole(sig, fingerprint)
            cached = self._from_whole_graph_entry(whole_key, report, weight_values)
            if cached is not None:
                return cached
        kept = self._kept.get(sig)
        if kept is not None:
            changed = kept.check(weight_values, weights.digests(weight_values, context.digests))
            if changed is not None:
                part = PartitionReport("graph", ops=self.target.inputs.op_count, reused=True, weights_changed=changed)
                if changed and whole_key is not None:
                    # stored for these weights too, without the weights it reads from the tensors (a text
                    # encoder's are not written again for each LoRA), so the next process finds the graph
                    # without tracing it
                    stored = weightless_copy(kept.model, weight_values) if kept.shared_bytes else kept.model
                    context.cache_store(whole_key, stored, f"{self.target.name} whole {report.signature}")
                variant = self.whole_graph_variant(kept.model, part, report)
                if variant is not None:
                    return variant
            del self._kept[sig]
        build = PartitionedBuild(self.target, report)
        variant = build.run(user_values, weight_values, fingerprint, whole_key)
        if build.whole_model is not None:
            kept = self._kept[sig] = WeightBoundModel(build.whole_model, weight_values,
                                                      weights.digests(weight_values, context.digests))
            # compiled again from the kept model when it is needed after a release
            variant.releasable = variant.in_openvino and kept.shared_bytes > 0
        return variant

    def whole_model(self, sig: tuple[Any, ...], fingerprint: str,
                    weight_values: Sequence[torch.Tensor]) -> ov.Model | None:
        """The float model of the whole graph for ``sig``, if the static build made or found one."""
        kept = self._kept.get(sig)
        if kept is not None:
            return kept.model
        if not self.target.context.settings.model_caching:
            return None
        xml = self.target.context.cache.model_file(self.target.keys.whole(sig, fingerprint))
        return self._read_whole(xml, weight_values) if xml is not None else None

    def _read_whole(self, xml: Path, weight_values: Sequence[torch.Tensor]) -> ov.Model | None:
        """A whole-graph entry read back, its weights attached when it was stored without them (a model
        with its weights has no weight parameters: attaching leaves it as it is)."""
        return attach_weights(self.target.context.core.read_model(str(xml)), weight_values)

    def _from_whole_graph_entry(self, key: str, report: CompileReport,
                                weight_values: Sequence[torch.Tensor]) -> Variant | None:
        """A variant from a cached model of the whole graph, with no tracing at all; None if absent.

        An entry with its weights compiles from its file (OpenVINO's blob cache finds it again); one stored
        without them (after a weight change) gets these weights attached and compiles in memory."""
        xml = self.target.context.cache_file(key)
        if xml is None:
            return None
        part = PartitionReport("graph", ops=self.target.inputs.op_count, cache_hit=True)
        if not _weightless(xml):
            return self.whole_graph_variant(xml, part, report)
        model = self._read_whole(xml, weight_values)
        if model is None:
            logger.warning("%s: the cached model of the whole graph does not fit its weights; tracing again",
                           self.target.name)
            return None
        return self.whole_graph_variant(model, part, report)

    def whole_graph_variant(self, model: ov.Model | Path, part: PartitionReport,
                            report: CompileReport) -> Variant | None:
        """A variant from a model of the whole graph (its inputs are the graph's tensor inputs, scalars
        baked); None when it cannot be compiled."""
        try:
            compiled = self.target.context.compile(model, part)
        except RuntimeError as err:
            logger.warning("%s: the model of the whole graph could not be compiled (%s); converting again",
                           self.target.name, err)
            return None
        report.partitions.append(part)
        runner = OVRunner(compiled, self.target.inputs.output_dtypes())
        logger.info("OpenVINO compiled %s", report.summary())
        baked = self.target.inputs.scalar_tensors
        return Variant(lambda user: tuple(runner([v for pos, v in enumerate(user)
                                                  if isinstance(v, torch.Tensor) and pos not in baked])),
                       in_openvino=True, releasable=True)
