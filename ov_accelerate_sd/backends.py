"""The backends a pipeline's parts run on: one ``OVBackend`` per backend settings, and which part runs at which.

Owns :class:`BackendChoice` (what a user chooses for the backend: device, precision, disk cache),
:func:`part_precision`, the one place of the rules that INT8 is for the UNet only and 8-bit weights for all but
the VAE (its calls are recorded at
float and quantized; the VAE and the text encoders run at the float default: they are a small part of a
generation's time, ``docs/int8.md``), and :class:`Backends`, which keeps one backend and its run counter per
settings, shared by every part and every run under those settings. The command line and the WebUI adapter
both route through it.

Imports ov_backend only when it is used: the WebUI lists its script even when openvino is missing.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ov_backend import CompileReport, GraphRunCounter, OVBackend

logger = logging.getLogger(__name__)


def part_precision(part: str, precision: str) -> str:
    """The precision ``part`` (a name of ``ov_accelerate_sd.parts.PARTS``) runs at when ``precision`` is chosen:
    a quantized precision is for the UNet, 8-bit weights for the UNet and the text encoders (most of the bytes:
    an SDXL's VAE holds 2% of them, and its pictures show weight noise first); the other parts run at the float
    default."""
    from ov_backend.precision import COMPRESSED_PRECISIONS, DEFAULT_PRECISION, QUANTIZED_PRECISIONS

    if precision in QUANTIZED_PRECISIONS:
        return precision if part == "unet" else DEFAULT_PRECISION
    if precision in COMPRESSED_PRECISIONS:
        return precision if part != "vae" else DEFAULT_PRECISION
    return precision


@dataclass(frozen=True)
class BackendChoice:
    """What the user chose for the backend; the key of a backend in :class:`Backends`."""

    device: str
    precision: str
    """A name of ``ov_backend.precision.PRECISIONS``."""
    model_caching: bool
    cache_dir: str | None
    """Folder of the disk cache; None: ov_backend's per-user default."""
    weights_in_file: bool = True
    """PyTorch's copy of the weights OpenVINO runs moves into a memory-mapped file (``cache_dir``/weights) before
    the first conversion, so memory holds one copy of each (``ov_backend`` option ``weights_in_file``)."""
    cache_max_bytes: int | None = dataclasses.field(default=None, compare=False)
    """The disk cache's size limit in bytes (``ov_backend`` option ``cache_max_bytes``; 0: no limit); None:
    ov_backend's default. Not part of the key: it is the folder's, set on the cache the backends share, so a
    new limit needs no new backend (nor a compile)."""
    threads: int | None = None
    """The threads OpenVINO runs each inference on (``INFERENCE_NUM_THREADS``); None: the plugin's choice (every
    core the process may use). A worker of a batch run sets its share of the cores."""
    cpu_pinning: bool | None = None
    """Whether the CPU plugin pins its threads to cores (``ENABLE_CPU_PINNING``); None: the plugin's default (it
    pins, within the cores the process may use). False where several processes share cores the plugin cannot
    tell apart (a Ray worker: each would pin its threads to the same first cores)."""
    shared_shapes: str | None = None
    """Whether one model compiled for every shape serves them (``ov_backend`` option ``shared_shapes``: "auto",
    "always", "never"); None: ov_backend's default ("auto", which depends on the shapes run before). A batch run
    takes "never": a size's picture then never depends on which sizes ran before it (a run resumed after a kill
    gives the same bytes as one run in one go)."""

    @property
    def quantized(self) -> bool:
        from ov_backend.precision import QUANTIZED_PRECISIONS

        return self.precision in QUANTIZED_PRECISIONS

    def for_part(self, part: str) -> BackendChoice:
        """The choice ``part`` runs under (see :func:`part_precision`)."""
        return dataclasses.replace(self, precision=part_precision(part, self.precision))

    def options(self) -> dict[str, Any]:
        """The options of ``ov_backend.build_settings``."""
        options: dict[str, Any] = {"device": self.device, "model_caching": self.model_caching,
                                   "precision": self.precision, "weights_in_file": self.weights_in_file}
        if self.cache_dir is not None:
            options["cache_dir"] = self.cache_dir
        if self.cache_max_bytes is not None:
            options["cache_max_bytes"] = self.cache_max_bytes
        if self.shared_shapes is not None:
            options["shared_shapes"] = self.shared_shapes
        config = {}
        if self.threads is not None:
            config["INFERENCE_NUM_THREADS"] = str(self.threads)
        if self.cpu_pinning is not None:
            config["ENABLE_CPU_PINNING"] = "YES" if self.cpu_pinning else "NO"
        if config:
            options["config"] = config
        return options


@dataclass(frozen=True)
class Mark:
    """The backends' reports and counters at one moment (:meth:`Backends.mark`)."""

    backends: dict[BackendChoice, OVBackend]
    """choice -> its backend (one made again after :meth:`Backends.reset` is another, counted from zero)."""
    reports: dict[BackendChoice, int]
    """choice -> how many compile reports its backend had."""
    stats: dict[BackendChoice, dict[str, float]]
    """choice -> its backend's counters."""

    def reports_of(self, choice: BackendChoice, backend: OVBackend) -> int:
        return self.reports.get(choice, 0) if self.backends.get(choice) is backend else 0

    def stats_of(self, choice: BackendChoice, backend: OVBackend) -> dict[str, float]:
        return self.stats.get(choice, {}) if self.backends.get(choice) is backend else {}


class Backends:
    """One ``OVBackend`` and its ``GraphRunCounter`` per :class:`BackendChoice`, made on first use (thread-safe).

    The backends of one cache folder share one ``ov_backend.WeightFile`` (the same module may be compiled by
    several: a part at f32 after an overflow at *Automatic*), so they agree on which weights moved, and one
    ``ov_backend.ModelCache``, so that none prunes an entry another one uses.

    Args:
        make: (choice, weight file or None) -> backend (default: ``OVBackend`` of the choice's options).
    """

    def __init__(self, make: Any = None) -> None:
        self._make = make
        self._lock = threading.RLock()  # (a make may ask for model_cache)
        self._counters: dict[BackendChoice, GraphRunCounter] = {}
        #: weights folder -> the file weights move into
        self._weight_files: dict[str, Any] = {}
        #: cache folder -> its ModelCache (what its backends use of it)
        self._caches: dict[str, Any] = {}

    def counter(self, choice: BackendChoice) -> GraphRunCounter:
        """The counting backend of ``choice`` (what ``torch.compile`` gets), made if it is new.

        Raises:
            ValueError: ov_backend refused the options (e.g. an unknown device).
        """
        with self._lock:
            counter = self._counters.get(choice)
            if counter is None:
                from ov_backend import GraphRunCounter, OVBackend, build_settings

                settings = build_settings(choice.options())
                weight_file = self._weight_file(settings)
                cache = self._model_cache(settings.cache_dir)
                make = self._make or (lambda c, w: OVBackend(settings, weight_file=w, cache=cache))
                backend = make(choice, weight_file)
                counter = self._counters[choice] = GraphRunCounter(backend)
            shared = getattr(counter.backend, "cache", None)
            if choice.cache_max_bytes is not None and shared is not None:
                shared.max_bytes = choice.cache_max_bytes  # the folder's limit, for every backend sharing it
            return counter

    def weight_file(self, choice: BackendChoice) -> Any:
        """The ``ov_backend.WeightFile`` the backends of ``choice``'s cache folder move weights into (made on first
        use), or None when ``choice`` keeps them in memory (``weights_in_file`` off).

        Raises:
            ValueError: ov_backend refused the options.
        """
        from ov_backend import build_settings

        with self._lock:
            return self._weight_file(build_settings(choice.options()))

    def _weight_file(self, settings: Any) -> Any:
        if not settings.weights_in_file:
            return None
        from ov_backend import WeightFile

        folder = str(settings.cache_dir / "weights")
        weight_file = self._weight_files.get(folder)
        if weight_file is None:
            weight_file = self._weight_files[folder] = WeightFile(settings.cache_dir / "weights")
        return weight_file

    def model_cache(self, folder: Any) -> Any:
        """The ``ov_backend.ModelCache`` of ``folder`` the backends of this object share (made on first use): a
        ``make`` given to the constructor passes it to its backends as ``cache=``."""
        with self._lock:
            return self._model_cache(folder)

    def _model_cache(self, folder: Any) -> Any:
        from pathlib import Path

        from ov_backend import ModelCache

        cache = self._caches.get(str(folder))
        if cache is None:
            cache = self._caches[str(folder)] = ModelCache(Path(folder))
        return cache

    def backend(self, choice: BackendChoice) -> OVBackend:
        """The backend of ``choice``, made if it is new (raises as :meth:`counter`)."""
        return self.counter(choice).backend

    def existing(self, choice: BackendChoice) -> OVBackend | None:
        """The backend of ``choice`` if one was made."""
        with self._lock:
            counter = self._counters.get(choice)
        return counter.backend if counter is not None else None

    def all(self) -> list[OVBackend]:
        return list(self._by_choice().values())

    def _by_choice(self) -> dict[BackendChoice, OVBackend]:
        with self._lock:
            return {choice: counter.backend for choice, counter in self._counters.items()}

    def calibrate(self, choice: BackendChoice) -> int:
        """At a quantized ``choice``: quantize the UNet's graphs now on the calls recorded so far; returns how many
        models were quantized."""
        backend = self.existing(choice.for_part("unet")) if choice.quantized else None
        return backend.calibrate() if backend is not None else 0

    def start_window(self, previous_weights: str | None = None) -> None:
        """Start a use window on every backend (``OVBackend.start_window``)."""
        for backend in self.all():
            backend.start_window(previous_weights)

    def stop_windows(self) -> None:
        for backend in self.all():
            backend.stop_windows()

    def drop_resident_weights(self) -> None:
        """Take the pages of PyTorch's weights in files out of the process (``OVBackend.drop_resident_weights``):
        at the end of a generation, after a LoRA write or a part run in PyTorch read them."""
        with self._lock:
            files = list(self._weight_files.values())
        for weight_file in files:
            weight_file.drop_resident()
        if files:
            from ov_backend.weight_file import give_back_freed_memory

            give_back_freed_memory()  # (what the generation freed in the C heap, e.g. its activations)

    def release_intermediate_memory(self) -> int:
        """Give back what the compiled models' inference requests hold between calls (``ov_backend.runtime``: a VAE
        decoder's intermediate tensors at 1024x1024 f32 are 3 GiB), at the end of a generation, when no call runs;
        the next call allocates it again. Returns how many compiled models released memory."""
        if not self._counters:
            return 0
        from ov_backend.runtime import release_intermediate_memory

        return release_intermediate_memory()

    def weights_in_files(self) -> tuple[int, int | None]:
        """Bytes of PyTorch's weights in files, and of their pages in the process now (None: unknown)."""
        with self._lock:
            files = list(self._weight_files.values())
        resident = [f.resident_bytes() for f in files]
        return sum(f.file_bytes() for f in files), None if None in resident else sum(r or 0 for r in resident)

    def cache_usage(self, choice: BackendChoice) -> Any:
        """The ``ov_backend.CacheUsage`` (size, limit, what the backends use of it) of the disk cache ``choice`` uses,
        measured now, under ``choice``'s limit; None when it has no backend yet or caches nothing. A folder that
        cannot be read counts as empty."""
        from ov_backend import CacheUsage, cache_usage

        backend = next((b for c, b in self._by_choice().items() if c.model_caching and choice.model_caching
                        and c.cache_dir == choice.cache_dir), None)
        if backend is None:
            return None
        settings = backend.settings
        cache = self.model_cache(settings.cache_dir)
        limit = cache.max_bytes if cache.max_bytes is not None else settings.cache_max_bytes  # (the folder's first)
        try:
            return cache_usage(cache, limit)
        except OSError as err:
            logger.warning("could not measure the OpenVINO cache %s: %s", settings.cache_dir, err)
            return CacheUsage(0, limit, 0)

    def compiled_models(self) -> int:
        """Compiled OpenVINO models every backend holds in memory now (``OVBackend.compiled_models``)."""
        return sum(backend.compiled_models() for backend in self.all())

    def mark(self) -> Mark:
        backends = self._by_choice()
        return Mark(backends, {c: len(b.reports) for c, b in backends.items()},
                    {c: dict(b.stats()) for c, b in backends.items()})

    def reports_since(self, mark: Mark) -> list[CompileReport]:
        """The compile reports every backend made since ``mark`` (a backend made since then: all of its)."""
        return [report for c, b in self._by_choice().items() for report in b.reports[mark.reports_of(c, b):]]

    def stats_since(self, mark: Mark) -> dict[str, float]:
        """The counters of every backend since ``mark``, summed (a backend made since then: all of its)."""
        total: dict[str, float] = {}
        for choice, backend in self._by_choice().items():
            before = mark.stats_of(choice, backend)
            for key, value in backend.stats().items():
                total[key] = total.get(key, 0) + value - before.get(key, 0)
        return total

    def reports(self) -> list[CompileReport]:
        """Every backend's compile reports."""
        return self.reports_since(Mark({}, {}, {}))

    def stats(self) -> dict[str, float]:
        """The counters of every backend, summed."""
        return self.stats_since(Mark({}, {}, {}))

    def reset(self) -> None:
        """Drop every backend's compiled graphs, reports and counters, and forget the backends."""
        with self._lock:
            counters, self._counters = self._counters, {}
        for counter in counters.values():
            counter.backend.reset()
