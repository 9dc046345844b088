"""What building a graph needs from its backend, and the fallback policy.

Owns :class:`BuildContext`, the narrow view of an :class:`ov_backend.backend.OVBackend` that a
compiled graph gets: settings, the OpenVINO core, the model cache, the counters, the compile
function and the report sink. On top of them it owns the cache look-ups and stores (counted as
hits and misses; the keys are made by :mod:`ov_backend.build.keys`), compiling a model into a
partition report, and :meth:`fail`: the fallback policy (a WARNING with the reason, or
:class:`OpenVINOFallbackError` when ``strict``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openvino as ov

from ov_backend.cache import ModelCache
from ov_backend.precision import COMPRESSED_PRECISIONS
from ov_backend.report import CompileReport, PartitionReport, StatsCounter
from ov_backend.settings import BackendSettings
from ov_backend.variants import SharedModels, UseWindow
from ov_backend.weight_file import WeightHome
from ov_backend.weights import DigestMemo

logger = logging.getLogger(__name__)


class OpenVINOFallbackError(RuntimeError):
    """OpenVINO could not take a graph and the ``strict`` setting forbids running it in PyTorch."""


@dataclass(frozen=True)
class BuildContext:
    """Everything a compiled graph uses of its backend.

    Attributes:
        settings: the backend's settings.
        core: the OpenVINO core (reads cached models).
        cache: the on-disk model cache.
        stats: the backend's counters.
        compile_model: compiles a model, or a cache entry's ``model.xml``, for the device.
        add_report: receives each compile's report.
        digests: per-tensor weight digests shared by every graph.
        versions: library versions, part of every cache key.
        window: the backend's use windows (compiled models unused in the current one are released).
        shared: the compiled models for all shapes its graphs lend each other.
        release_stale: releases the compiled models of the backend's other graphs whose weights changed
            since their last call (argument: the graph asking, left alone); returns how many went.
        weights: where weights move before their first conversion (``BackendSettings.weights_in_file``).
    """

    settings: BackendSettings
    core: ov.Core
    cache: ModelCache
    stats: StatsCounter
    compile_model: Callable[[ov.Model | Path], ov.CompiledModel]
    add_report: Callable[[CompileReport], None]
    digests: DigestMemo
    versions: Mapping[str, str]
    window: UseWindow = field(default_factory=UseWindow)
    shared: SharedModels = field(default_factory=SharedModels)
    release_stale: Callable[[Any], int] = lambda asking: 0
    weights: WeightHome | None = None

    def fail(self, message: str, err: BaseException | None = None) -> None:
        """A visible fallback to PyTorch: a WARNING with ``message``, or raise when ``strict``.

        Raises:
            OpenVINOFallbackError: the settings are strict.
        """
        if self.settings.strict:
            raise OpenVINOFallbackError(message + " (strict mode: not running it in PyTorch)") from err
        logger.warning("%s; running it in PyTorch", message)

    def cache_load(self, key: str) -> ov.Model | None:
        """The converted model cached under ``key``, or None (counted as a hit or a miss)."""
        if not self.settings.model_caching:
            return None
        model = self.cache.load(key, self.core)
        self.stats.add(**({"cache_hits": 1} if model is not None else {"cache_misses": 1}))
        return model

    def cache_file(self, key: str) -> Path | None:
        """The checked ``model.xml`` of the entry cached under ``key``, or None (a hit or a miss)."""
        if not self.settings.model_caching:
            return None
        path = self.cache.model_file(key)
        self.stats.add(**({"cache_hits": 1} if path is not None else {"cache_misses": 1}))
        return path

    def cache_store(self, key: str, model: ov.Model, description: str, any_weights: bool = False) -> Path | None:
        """Store ``model`` under ``key`` (``any_weights``: see :meth:`ModelCache.store`); returns its
        ``model.xml``, or None when not stored."""
        if not self.settings.model_caching:
            return None
        entry = self.cache.store(key, model, description, any_weights)
        return entry / "model.xml" if entry is not None else None

    def compile(self, model: ov.Model | Path, part: PartitionReport) -> ov.CompiledModel:
        """Compile ``model`` for the device, noting the time, devices and precision in ``part``."""
        start = time.perf_counter()
        compiled = self.compile_model(model)
        part.compile_seconds = time.perf_counter() - start
        part.compressed = self.settings.precision in COMPRESSED_PRECISIONS
        self.stats.add(ov_compile_seconds=part.compile_seconds, compiles=1)
        for prop, attr in (("EXECUTION_DEVICES", "execution_devices"), ("INFERENCE_PRECISION_HINT", "precision")):
            try:
                value = compiled.get_property(prop)
            except RuntimeError:  # not every plugin reports every property
                continue
            if isinstance(value, ov.Type):
                value = value.to_string()
            setattr(part, attr, tuple(str(v) for v in value) if isinstance(value, list) else str(value))
        return compiled
