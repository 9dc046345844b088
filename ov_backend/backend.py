"""The torch.compile backend: :class:`OVBackend` instances and the named ``ov_backend`` entry.

``torch.compile(m, backend=OVBackend(settings))`` keeps every compiled graph, report and
counter in that instance (``reset()`` drops them). ``torch.compile(m, backend="ov_backend",
options={...})`` builds an instance for each captured graph from the options.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import openvino as ov
import torch

from ov_backend import cache_limit, devices, memory_guard, rewrites
from ov_backend.cache import ModelCache
from ov_backend.compiled import CompiledGraph
from ov_backend.compress import compress_weights
from ov_backend.context import BuildContext
from ov_backend.inputs import GraphFacts, InputKind, classify_inputs
from ov_backend.ops import decomposition_table
from ov_backend.portable import PortableGraph
from ov_backend.precision import COMPRESSED_PRECISIONS
from ov_backend.report import CompileReport, StatsCounter
from ov_backend.settings import PREVIOUS_WEIGHTS, BackendSettings, build_settings
from ov_backend.variants import SharedModels, UseWindow
from ov_backend.weight_file import WeightFile, WeightHome
from ov_backend.weights import DigestMemo

logger = logging.getLogger(__name__)

def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class OVBackend:
    """A torch.compile backend on OpenVINO, holding its compiled graphs and reports.

    Args:
        settings: a :class:`BackendSettings`, or an options mapping validated by
            :func:`build_settings`.
        weight_file: with ``weights_in_file``, the :class:`~ov_backend.weight_file.WeightFile` weights move
            into, shared with other backends that compile the same modules (default: one of this backend's
            own, in ``cache_dir``/weights).
        cache: the :class:`ModelCache` of ``cache_dir``, shared with other backends of this process that use the
            same folder, so that none prunes an entry another one uses (default: one of this backend's own).
    """

    def __init__(self, settings: BackendSettings | Mapping[str, Any] | None = None,
                 weight_file: WeightFile | None = None, cache: ModelCache | None = None) -> None:
        self.settings = settings if isinstance(settings, BackendSettings) else build_settings(settings)
        self.core = devices.shared_core()
        if cache is not None and cache.root != self.settings.cache_dir:
            raise ValueError(f"the cache given is in {cache.root}, the cache_dir is {self.settings.cache_dir}")
        self.cache = cache if cache is not None else ModelCache(self.settings.cache_dir)
        self.stats_counter = StatsCounter()
        self.versions = {"openvino": ov.get_version(), "torch": torch.__version__,
                         "ov_backend": _version("sd-webui-openvino-accelerate")}
        #: per-tensor weight digests, shared by every graph of this backend: each weight is hashed
        #: once while it stays unchanged (cleared by reset())
        self.digests = DigestMemo()
        self._lock = threading.Lock()
        self._reports: list[CompileReport] = []
        self._graphs: list[CompiledGraph] = []
        #: where weights move before their first conversion (None: they stay where they are)
        self.weight_file = (weight_file or WeightFile(self.settings.cache_dir / "weights")) \
            if self.settings.weights_in_file else None
        #: what compiled graphs see of this backend (compile_model is looked up here, so that a
        #: subclass's override is used)
        self.build_context = BuildContext(self.settings, self.core, self.cache, self.stats_counter,
                                          compile_model=self.compile_model, add_report=self.add_report,
                                          digests=self.digests, versions=self.versions, window=UseWindow(),
                                          shared=SharedModels(), release_stale=self._release_stale,
                                          weights=WeightHome(self.weight_file, self.stats_counter)
                                          if self.weight_file is not None else None)

    def memory_shortage(self, weights: Sequence[torch.Tensor]) -> str | None:
        """Why models compiled from ``weights`` (any tensors of their shapes and dtypes: meta tensors do) by this
        backend would not fit in the memory available now, or None: the check every build makes first
        (:mod:`ov_backend.memory_guard`), for a caller that wants to know before it loads them. None as well with
        ``check_memory`` off."""
        if not self.settings.check_memory:
            return None
        hint = memory_guard.device_hint(self.core, self.settings.device)
        return memory_guard.build_shortage(weights, self.settings.precision, self.settings.compile_config, hint)

    # -- dynamo entry -------------------------------------------------------------------------
    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        kinds = classify_inputs(gm)
        if self.settings.aot_autograd:
            return self._through_aot(gm, example_inputs, kinds)
        return self.load_graph(gm, GraphFacts.read(gm, example_inputs, kinds))

    def load_graph(self, gm: torch.fx.GraphModule, facts: GraphFacts) -> PortableGraph:
        """The compiled graph for ``gm`` (its OpenVINO models built on its calls), able to save itself
        with torch's ahead-of-time capture: dynamo's entry, and how a saved capture is loaded (see
        :mod:`ov_backend.portable`)."""
        return PortableGraph(self._register(CompiledGraph(gm, facts, self.build_context, self._next_name())),
                             gm, facts)

    def _next_name(self) -> str:
        with self._lock:
            return f"graph {len(self._graphs)}"

    def _register(self, graph: CompiledGraph) -> CompiledGraph:
        with self._lock:
            self._graphs.append(graph)
        return graph

    def _through_aot(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                     kinds: list[InputKind]) -> Callable[..., Any]:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def forward_compiler(fw_gm: torch.fx.GraphModule, fw_inputs: Sequence[Any]) -> Callable[..., Any]:
            if len(fw_inputs) == len(kinds):
                fw_kinds = [k if k.kind == "weight" else InputKind("user") for k in kinds]
            else:
                logger.info("AOTAutograd changed the graph inputs (%d -> %d); weights are passed per call",
                            len(kinds), len(fw_inputs))
                fw_kinds = [InputKind("user")] * len(fw_inputs)
            graph = self._register(CompiledGraph(fw_gm, GraphFacts.read(fw_gm, fw_inputs, fw_kinds),
                                                 self.build_context, self._next_name()))
            return make_boxed_func(graph)

        def backward_compiler(bw_gm: torch.fx.GraphModule, bw_inputs: Sequence[Any]) -> Callable[..., Any]:
            logger.info("ov_backend runs backward graphs in PyTorch")
            return make_boxed_func(bw_gm)

        return aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler,
                            decompositions=decomposition_table(self.settings.decompositions))(gm, example_inputs)

    # -- services for compiled graphs (lent through self.build_context) -------------------------------
    def compile_model(self, model: ov.Model | Path) -> ov.CompiledModel:
        """Compile for the configured device.

        ``model`` is a converted model, or the ``model.xml`` of a cache entry. With caching on,
        OpenVINO keeps the compiled blob (its CACHE_DIR) for a cache entry's file, which it finds
        again by path: a second process imports the blob instead of compiling, several times
        faster for a full UNet on the CPU (``docs/backend-builds.md``). An in-memory model gets
        OpenVINO's blob cache only on devices other than the CPU, where compiling costs minutes:
        OpenVINO hashes the whole model (gigabytes) to find its blob, which costs more than the
        CPU's compile.
        """
        config = self.settings.compile_config
        if self.settings.precision in COMPRESSED_PRECISIONS:
            # 8-bit weights: a compressed copy of the float model, compiled in memory (OpenVINO's blob cache finds
            # a model by its file, which holds the float one)
            model = compress_weights(self.core.read_model(str(model)) if isinstance(model, Path) else model,
                                     self.weight_file.arrays if self.weight_file is not None else None)
        from_file = isinstance(model, Path)
        if self.settings.model_caching and "CACHE_DIR" not in config and (from_file or not self.settings.on_cpu):
            try:
                self.cache.blob_dir.mkdir(parents=True, exist_ok=True)
                config["CACHE_DIR"] = str(self.cache.blob_dir)
            except OSError as err:
                logger.warning("OpenVINO blob cache %s is not usable (%s); compiling without it",
                               self.cache.blob_dir, err)
        if not from_file:
            return self.core.compile_model(rewrites.for_compiling(model), self.settings.device, config)
        try:
            return self.core.compile_model(str(model), self.settings.device, config)
        except RuntimeError as err:
            if "CACHE_DIR" not in config:
                raise
            logger.warning("OpenVINO could not compile %s with its blob cache (%s); compiling without it",
                           model, err)
            config.pop("CACHE_DIR")
            return self.core.compile_model(str(model), self.settings.device, config)

    def calibrate(self) -> int:
        """At precision "int8": quantize now every graph whose calls were recorded at float, without
        waiting for ``calibration_samples`` calls (e.g. at the end of a generation); returns how many
        models were quantized. Each takes NNCF about two float calls per recorded call."""
        with self._lock:
            graphs = list(self._graphs)
        return sum(graph.calibrate() for graph in graphs)

    def watch_int8(self, callback: Callable[[str, bool], bool] | None) -> None:
        """At precision "int8": ``callback(key, quantized)`` is called on every call of a graph, with the cache key
        of the graph's INT8 model for the call's weights, and whether the call runs that model (False: it runs at
        float, the model not made yet). For a float call it returns whether the call's inputs are recorded for the
        model's calibration; it may raise, to stop the call before anything is recorded or run (the exception
        reaches the caller). An owner so chooses which calls calibrate a model (a batch job: the first batch, in
        the job's order, that runs it). None (the default): every float call is recorded, up to
        ``calibration_samples``."""
        self.build_context.int8_watch.callback = callback

    def start_window(self, previous_weights: str | None = None) -> None:
        """Start a use window: from now on, a graph that builds a model first releases its compiled
        models that no call used since this point (see :class:`ov_backend.variants.UseWindow`).

        An owner that starts a window per unit of work (a generation) keeps in memory only the
        compiled models that work uses; one that never does keeps every model it compiled.
        ``previous_weights`` ("auto", "keep" or "release"): the settings' ``previous_weights`` for this
        window (e.g. a user's choice read per generation); None keeps the settings' own.

        Raises:
            ValueError: ``previous_weights`` is none of those.
        """
        if previous_weights is not None and previous_weights not in PREVIOUS_WEIGHTS:
            raise ValueError(f"previous_weights must be one of {', '.join(PREVIOUS_WEIGHTS)}, got {previous_weights!r}")
        self.build_context.window.start(previous_weights)

    def stop_windows(self) -> None:
        """Keep every compiled model again (no release until the next :meth:`start_window`)."""
        self.build_context.window.stop()

    def _release_stale(self, asking: CompiledGraph) -> int:
        """Release the compiled models of every graph but ``asking`` whose weights changed since its last
        call (see :meth:`CompiledGraph.release_if_stale`); returns how many were released."""
        with self._lock:
            graphs = [g for g in self._graphs if g is not asking]
        return sum(g.release_if_stale() for g in graphs)

    def drop_resident_weights(self) -> None:
        """With ``weights_in_file``: take the weight file's pages out of the process (e.g. after a
        generation in which PyTorch read weights: a LoRA written, a part run in PyTorch). Always safe:
        what reads them next reads them from the file."""
        if self.weight_file is not None:
            self.weight_file.drop_resident()

    def enforce_cache_limit(self, keep: Iterable[str] = ()) -> None:
        """Prune the disk cache to ``cache_max_bytes``, keeping the entries in use and ``keep`` (done after every
        build; e.g. for a store of the owner's own, such as a saved capture). Never raises for the files."""
        self.build_context.enforce_cache_limit(keep)

    def cache_usage(self) -> cache_limit.CacheUsage:
        """The disk cache's size against its limit (0: none), and what of it this process uses; a cache that is
        off or unreadable counts as empty."""
        limit = self.build_context.cache_limit() if self.settings.model_caching else 0
        try:
            return cache_limit.cache_usage(self.cache, limit)
        except OSError as err:
            logger.warning("could not measure the OpenVINO cache %s: %s", self.cache.root, err)
            return cache_limit.CacheUsage(0, limit, 0)

    def add_report(self, report: CompileReport) -> None:
        """Keep ``report`` (the report sink of this backend's compiled graphs)."""
        with self._lock:
            self._reports.append(report)

    # -- public state -----------------------------------------------------------------------------
    @property
    def reports(self) -> list[CompileReport]:
        """Every compile this backend did, oldest first."""
        with self._lock:
            return list(self._reports)

    def compiled_models(self) -> int:
        """How many compiled OpenVINO models this backend's graphs hold in memory now (what a use window releases;
        converted models kept for a later compile are not counted)."""
        with self._lock:
            graphs = list(self._graphs)
        return sum(graph.models_held() for graph in graphs)

    def stats(self) -> dict[str, float]:
        """The counters by name (the fields of :class:`ov_backend.report.Stats`): compile_seconds (with
        trace_seconds, convert_seconds, ov_compile_seconds, quantize_seconds, hash_seconds), run_seconds,
        ov_calls, eager_calls, cache_hits, cache_misses, compiles, released (compiled models released, see
        start_window), kept_previous (models of the previous weights a release kept), captures, cache_pruned and
        cache_pruned_bytes (disk cache entries removed to stay under ``cache_max_bytes``; :meth:`cache_usage` gives
        the size against the limit).
        ``stats_counter.snapshot()`` gives them as a :class:`~ov_backend.report.Stats`."""
        return self.stats_counter.snapshot().as_dict()

    def reset(self) -> None:
        """Drop compiled graphs (and every model they built), reports, counters and weight digests.

        ``torch._dynamo.reset()`` calls this on every backend it used, so that nothing compiled
        outlives dynamo's own caches.
        """
        with self._lock:
            graphs, self._graphs = self._graphs, []
            self._reports.clear()
        for graph in graphs:  # (dynamo may still reference them: what they built goes now)
            graph.dispose()
        self.build_context.shared.clear()
        self.stats_counter.reset()
        self.digests.clear()


def ov_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
               options: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """The named backend: ``torch.compile(m, backend="ov_backend", options={...})``."""
    return OVBackend(build_settings(options))(gm, example_inputs)
