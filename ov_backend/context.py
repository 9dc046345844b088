"""What building a graph needs from its backend, and the fallback policy.

Owns :class:`BuildContext`, the narrow view of an :class:`ov_backend.backend.OVBackend` that a
compiled graph gets: settings, the OpenVINO core, the model cache, the counters, the compile
function and the report sink. On top of them it owns the cache look-ups and stores (counted as
hits and misses; the keys are made by :mod:`ov_backend.build.keys`), compiling a model into a
partition report, and :meth:`fail`: the fallback policy (a WARNING with the reason, or
:class:`OpenVINOFallbackError` when ``strict``). While a build runs (:meth:`BuildContext.using_cache`) it
notes the cache entries the build loads or stores and the blobs OpenVINO writes for it, so that what the build
makes holds them (:mod:`ov_backend.cache_limit`), and :meth:`BuildContext.enforce_cache_limit` prunes afterwards.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openvino as ov

from ov_backend import cache_limit
from ov_backend.cache import ModelCache
from ov_backend.precision import COMPRESSED_PRECISIONS
from ov_backend.quantize import CalibrationWatch
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
        building: per thread, the cache keys the build running in it loaded, stored or had OpenVINO write.
        int8_watch: at precision "int8": which float calls are recorded for calibration (the backend's owner
            says, :meth:`ov_backend.backend.OVBackend.watch_int8`).
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
    building: threading.local = field(default_factory=threading.local)
    int8_watch: CalibrationWatch = field(default_factory=CalibrationWatch)

    @contextmanager
    def using_cache(self) -> Iterator[list[str]]:
        """Collect, into the list given, the cache entries the build in this block (on this thread) loads, stores
        or has OpenVINO write its blobs for (an outer block gets those of an inner one too)."""
        outer = getattr(self.building, "keys", None)
        self.building.keys = keys = []
        try:
            yield keys
        finally:
            self.building.keys = outer
            if outer is not None:
                outer.extend(keys)

    def _used(self, key: str) -> None:
        keys = getattr(self.building, "keys", None)
        if keys is not None:
            keys.append(key)

    def hold(self, keys: Iterable[str], *holders: Any) -> None:
        """The cache entries ``keys`` are in use while any of ``holders`` (None ones skipped) lives."""
        keys = list(keys)
        if keys:
            for holder in holders:
                if holder is not None:
                    self.cache.holds.hold(keys, holder)

    def enforce_cache_limit(self, keep: Iterable[str] = ()) -> None:
        """Prune the disk cache to :meth:`cache_limit` (see :func:`ov_backend.cache_limit.enforce`),
        keeping the entries in use and ``keep``; never raises for the files."""
        limit = self.cache_limit()
        if self.settings.model_caching and limit:
            cache_limit.enforce(self.cache, limit, self.stats.add, keep)

    def cache_limit(self) -> int:
        """The disk cache's size limit in bytes (0: none): the shared cache's own if set, else the settings'."""
        return self.cache.max_bytes if self.cache.max_bytes is not None else self.settings.cache_max_bytes

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
        if model is not None:
            self._used(key)
        return model

    def cache_file(self, key: str) -> Path | None:
        """The checked ``model.xml`` of the entry cached under ``key``, or None (a hit or a miss)."""
        if not self.settings.model_caching:
            return None
        path = self.cache.model_file(key)
        self.stats.add(**({"cache_hits": 1} if path is not None else {"cache_misses": 1}))
        if path is not None:
            self._used(key)
        return path

    def cache_store(self, key: str, model: ov.Model, description: str, any_weights: bool = False) -> Path | None:
        """Store ``model`` under ``key`` (``any_weights``: see :meth:`ModelCache.store`); returns its
        ``model.xml``, or None when not stored."""
        if not self.settings.model_caching:
            return None
        entry = self.cache.store(key, model, description, any_weights)
        if entry is None:
            return None
        self._used(key)
        return entry / "model.xml"

    def _blob_names(self) -> set[str] | None:
        """The files in OpenVINO's blob folder now (None: caching off); an unreadable folder has none."""
        if not self.settings.model_caching:
            return None
        try:
            return set(os.listdir(self.cache.blob_dir))
        except OSError:
            return set()

    def compile(self, model: ov.Model | Path, part: PartitionReport) -> ov.CompiledModel:
        """Compile ``model`` for the device, noting the time, devices and precision in ``part``."""
        start = time.perf_counter()
        blobs = self._blob_names()
        compiled = self.compile_model(model)
        if blobs is not None:
            for name in (self._blob_names() or set()) - blobs:  # written for this model by OpenVINO
                self._used(f"{self.cache.blob_dir.name}/{name}")
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
