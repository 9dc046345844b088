"""Compiled parts of the loaded checkpoint: which backend and compiled forward belongs to which module.

One :class:`Accelerator` lives as long as the extension (created by the script entry point and reset
on script unload). It keeps, for the checkpoints of the last generation (the
selected one, and a refiner or hires checkpoint that A1111 switched to during it), one ov_backend
instance per backend setting and one compiled forward per routed module object, so the next generation
starts at full speed. The backend itself notices weight changes (LoRA, a new VAE, a refiner loaded into
the same modules) and shapes; this object notices a checkpoint the last generation did not use and
drops what belonged to the others. All methods are thread-safe.

Every routed call is checked: if dynamo ran it without any compiled graph (it gave up on the function,
e.g. after its recompile limit, and runs it in plain PyTorch from then on), the call is counted with the
reason, and the run's status and a WARNING say so.

Sizes: the dimensions that change between generations (:data:`VARYING_DIMS`: batch, latent height and
width, prompt length) are marked dynamic on the first call, so dynamo hands the backend one graph with
symbolic sizes from the start. Each new size is then compiled once, and a size seen before is found
again without a compile. (Left to dynamo's automatic dynamic shapes, the first size would be compiled
twice: once static, and once more in the symbolic graph that later shadows it.)
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import CodeType
from typing import Any

import torch

from .backend_bridge import BackendApi
from .graph_runs import GraphRunCounter, why_eager
from .model_parts import Target, checkpoint_key, find_targets
from .routing import Route
from .settings import PART_LABELS, AccelerateSettings

logger = logging.getLogger(__name__)

BackendKey = tuple[str, bool, str, tuple[tuple[str, str], ...]]

#: Tensor rank -> dimensions that vary between generations: 1-D timesteps and 2-D token ids or
#: SDXL's ``y`` (batch); 3-D UNet context (batch, prompt length in 77-token chunks); 4-D latents and
#: images (batch, height, width). Channels and the 77 tokens of a chunk never change.
VARYING_DIMS: dict[int, tuple[int, ...]] = {1: (0,), 2: (0,), 3: (0, 1), 4: (0, 2, 3)}


def mark_varying_dims(
    args: Sequence[Any], kwargs: dict[str, Any], dims: Mapping[int, tuple[int, ...]] = VARYING_DIMS
) -> None:
    """Mark ``dims`` (rank -> dimensions; default :data:`VARYING_DIMS`) of the tensor arguments as dynamic
    for dynamo (sizes of 1 stay static)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            for dim in dims.get(value.dim(), ()):
                if value.shape[dim] > 1:
                    torch._dynamo.maybe_mark_dynamic(value, dim)


def backend_key(options: dict[str, Any]) -> BackendKey:
    """A hashable key of the backend options that change a compiled model."""
    return (
        str(options["device"]),
        bool(options["model_caching"]),
        str(options["cache_dir"]),
        tuple(sorted((str(k), str(v)) for k, v in options["config"].items())),
    )


def input_signature(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple:
    """Shapes and dtypes of the tensor arguments of one call."""
    items = list(args) + [kwargs[k] for k in sorted(kwargs)]
    return tuple((tuple(x.shape), str(x.dtype)) for x in items if isinstance(x, torch.Tensor))


@dataclass
class _Compiled:
    part: str
    label: str
    module_ref: weakref.ReferenceType
    compiled: Callable[..., Any]
    counter: GraphRunCounter
    varying_dims: Mapping[int, tuple[int, ...]] = field(default_factory=lambda: VARYING_DIMS)
    code: CodeType | None = None
    seen: set[tuple] = field(default_factory=set)
    calls: int = 0
    eager_calls: int = 0
    """Calls dynamo ran without a compiled graph (plain PyTorch)."""
    eager_reason: str = ""


@dataclass(frozen=True)
class PreparedRun:
    """What one generation routes, and where its status comes from."""

    routes: tuple[Route, ...]
    backend: Any
    first_report: int
    settings: AccelerateSettings
    checkpoint: str
    stats_before: dict[str, float]
    entries: tuple[_Compiled, ...] = ()
    """The compiled forward behind each route (their call counters tell which routes ran)."""
    calls_before: tuple[int, ...] = ()
    """Calls of each entry before the run."""
    eager_before: tuple[int, ...] = ()
    """Calls of each entry that ran in plain PyTorch before the run."""
    key: BackendKey = ("", False, "", ())
    """The backend options key of ``backend``."""


class Accelerator:
    """Owns compiled models across generations; :meth:`reset` drops them."""

    def __init__(self, api: BackendApi, notify: Callable[[str | None], None] | None = None) -> None:
        """Args:
        api: the loaded ov_backend API.
        notify: called with "OpenVINO: compiling ..." before a call with a new input signature
            and with None after it (the WebUI shows it in its progress text).
        """
        self.api = api
        self._notify = notify or (lambda text: None)
        self._lock = threading.RLock()
        self._checkpoints: set[str] = set()
        self._backends: dict[BackendKey, Any] = {}
        self._counters: dict[BackendKey, GraphRunCounter] = {}
        self._compiled: dict[tuple[BackendKey, str], list[_Compiled]] = {}

    def prepare(self, model: Any, settings: AccelerateSettings, default_cache_dir: str) -> PreparedRun:
        """Find the parts of ``model`` to accelerate and get (or make) their compiled forwards.

        Raises:
            UnsupportedModel: the model cannot be accelerated.
            ValueError: the backend rejected the settings (e.g. an unknown device).
        """
        targets = find_targets(model, settings.parts)
        options = settings.backend_options(default_cache_dir)
        key = backend_key(options)
        ckpt = checkpoint_key(model)
        with self._lock:
            if ckpt not in self._checkpoints:
                if self._checkpoints:
                    logger.info(
                        "checkpoint changed (%s -> %s): dropping compiled models in memory",
                        ", ".join(sorted(self._checkpoints)),
                        ckpt,
                    )
                self._drop_all()
                self._checkpoints = {ckpt}
            backend = self._backends.get(key)
            if backend is None:
                backend = self.api.backend_class(self.api.build_settings(options))
                self._backends[key] = backend
            return self._prepared(model, targets, key, backend, settings)

    def extend(self, run: PreparedRun, model: Any) -> PreparedRun:
        """The routes of ``model``, another model A1111 switched to during ``run`` (a refiner, a hires
        checkpoint, the selected model again): same backend, nothing dropped.

        Raises:
            UnsupportedModel: the model cannot be accelerated.
        """
        targets = find_targets(model, run.settings.parts)
        with self._lock:
            self._checkpoints.add(checkpoint_key(model))
            return self._prepared(model, targets, run.key, run.backend, run.settings)

    def _prepared(
        self, model: Any, targets: list[Target], key: BackendKey, backend: Any, settings: AccelerateSettings
    ) -> PreparedRun:
        entries = [self._entry(key, backend, t) for t in targets]
        routes = tuple(Route(t.module, self._make_forward(e), t.label, t.method) for t, e in zip(targets, entries))
        return PreparedRun(
            routes=routes,
            backend=backend,
            first_report=len(getattr(backend, "reports", ())),
            settings=settings,
            checkpoint=checkpoint_key(model),
            stats_before=dict(backend.stats()),
            entries=tuple(entries),
            calls_before=tuple(e.calls for e in entries),
            eager_before=tuple(e.eager_calls for e in entries),
            key=key,
        )

    def _entry(self, key: BackendKey, backend: Any, target: Target) -> _Compiled:
        entries = self._compiled.setdefault((key, target.label), [])
        entry = next((e for e in entries if e.module_ref() is target.module), None)
        if entry is None:
            if entries:
                logger.info("%s is a new module object: compiling it too", target.label)
            counter = self._counters.get(key)
            if counter is None or counter.backend is not backend:
                counter = self._counters[key] = GraphRunCounter(backend)
            compiled = torch.compile(getattr(target.module, target.method), backend=counter)
            function = getattr(type(target.module), target.method, None)
            entry = _Compiled(
                part=target.part,
                label=target.label,
                module_ref=weakref.ref(target.module),
                compiled=compiled,
                counter=counter,
                varying_dims=dict(target.varying_dims) if target.varying_dims is not None else VARYING_DIMS,
                code=getattr(function, "__code__", None),
            )
            entries.append(entry)
        return entry

    def keep_only(self, runs: Sequence[PreparedRun]) -> None:
        """Drop compiled forwards of module objects that none of ``runs`` routed (models A1111 replaced)."""
        used = {id(e) for run in runs for e in run.entries}
        with self._lock:
            for label_key, entries in list(self._compiled.items()):
                entries[:] = [e for e in entries if id(e) in used]
                if not entries:
                    del self._compiled[label_key]

    def _make_forward(self, entry: _Compiled) -> Callable[..., Any]:
        lock, notify = self._lock, self._notify
        label = PART_LABELS[entry.part]

        def call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            before = entry.counter.graphs_run()
            result = entry.compiled(*args, **kwargs)
            if entry.counter.graphs_run() == before:  # dynamo ran it without a compiled graph
                reason = why_eager(entry.code)
                with lock:
                    entry.eager_calls += 1
                    entry.eager_reason = reason
            return result

        def forward(*args: Any, **kwargs: Any) -> Any:
            signature = input_signature(args, kwargs)
            with lock:
                new = signature not in entry.seen
                entry.calls += 1
            if not new:
                return call(args, kwargs)
            mark_varying_dims(args, kwargs, entry.varying_dims)
            shapes = "x".join(str(d) for d in signature[0][0]) if signature else "?"
            notify(f"OpenVINO: compiling {label} ({entry.label}) for input {shapes} ...")
            try:
                result = call(args, kwargs)
            finally:
                notify(None)
            with lock:
                entry.seen.add(signature)
            return result

        return forward

    def _drop_all(self) -> None:
        compiled_any = bool(self._compiled)
        for backend in self._backends.values():
            reset = getattr(backend, "reset", None)
            if reset is not None:
                reset()
        self._backends.clear()
        self._counters.clear()
        self._compiled.clear()
        if compiled_any:
            # dynamo keeps each compiled variant on the function's code object, shared by every module
            # object and backend; variants of dropped backends would count towards its recompile limit
            # (8 per function), after which dynamo runs the function in PyTorch for the rest of the
            # process. torch offers no per-function reset: reset it all (other torch.compile users in the
            # process compile again on their next call).
            logger.info("dropping dynamo's compiled variants with the compiled models (torch.compiler.reset)")
            torch.compiler.reset()

    def reset(self) -> None:
        """Drop every compiled model in memory (the disk cache stays)."""
        with self._lock:
            self._drop_all()
            self._checkpoints = set()

    def forget_unless(self, model: Any) -> None:
        """Drop compiled models unless ``model``'s checkpoint is one the last generation used (on model load)."""
        with self._lock:
            if self._checkpoints and checkpoint_key(model) not in self._checkpoints:
                logger.info("model changed: dropping compiled models of %s", ", ".join(sorted(self._checkpoints)))
                self._drop_all()
                self._checkpoints = set()

    def backend_settings(self) -> list[Any]:
        """Settings objects of the live backends (what the panel's choices became)."""
        with self._lock:
            return [getattr(backend, "settings", None) for backend in self._backends.values()]

    def compiled_paths(self) -> list[str]:
        """Paths of modules that have a compiled forward now (for the panel and tests)."""
        with self._lock:
            return sorted({label for (_key, label), entries in self._compiled.items() if entries})

    def reports_since(self, run: PreparedRun) -> list[Any]:
        """The compile reports the backend produced during ``run``."""
        with self._lock:
            return list(getattr(run.backend, "reports", ())[run.first_report :])

    def calls_since(self, run: PreparedRun) -> dict[str, int]:
        """Route label -> how many times it was called during ``run`` (0: routed but never called)."""
        with self._lock:
            return {e.label: e.calls - before for e, before in zip(run.entries, run.calls_before)}

    def eager_since(self, run: PreparedRun) -> dict[str, tuple[int, str]]:
        """Route label -> (calls dynamo ran in plain PyTorch during ``run``, why), for routes that had any."""
        with self._lock:
            return {
                e.label: (e.eager_calls - before, e.eager_reason)
                for e, before in zip(run.entries, run.eager_before)
                if e.eager_calls > before
            }

    def stats_since(self, run: PreparedRun) -> dict[str, float]:
        """Backend counters (compile/run seconds, calls, cache hits) accumulated during ``run``."""
        with self._lock:
            now = dict(run.backend.stats())
        return {k: v - run.stats_before.get(k, 0) for k, v in now.items() if isinstance(v, (int, float))}
