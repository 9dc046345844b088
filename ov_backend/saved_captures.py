"""dynamo's capture of a module's method, saved in the disk cache so that the next process skips it.

On a warm start the OpenVINO models come from the disk cache, but dynamo still traces the Python
code again to find the graphs, which for a full UNet costs more than the compiles. With torch's
ahead-of-time capture (:mod:`ov_backend.portable`), :class:`SavedCaptures` captures a module's method
once, saves the capture beside the models, and a later process loads it, much faster than tracing,
instead (figures: ``docs/backend.md``, "First call" and "Saved captures"). The WebUI adapter and
the command line use it for every part they route.

What keeps a saved capture honest:
- its key names what was traced: the module's class, the method's code and source, the extension's and
  torch's versions, and the form of the call (tensor ranks, dtypes and devices; not the sizes: a
  capture's symbolic sizes serve any size, 1 included, see :func:`portable.sizes_may_be_one`, and where
  torch guarded one on being more than 1, the other capture is saved beside it as a variant);
- on load, the source of every function the capture traced must be unchanged, and on each call dynamo's
  saved guards must hold, and so must the functions and classes its identity guards named (compared by
  name and code location, as identities differ between processes).
Anything else, or any failure to capture whole (a graph break), load or save, runs the call as before
(``torch.compile`` capturing in this process), with the reason logged. A module class defined inside another
(Forge's layers, ``ForgeOperations.Linear``...) has its type guards checked by its name, as the identities are
(:func:`portable.named_by_path`); one defined inside a function is seen before any tracing: no name finds it again,
torch cannot save a guard on its type, so such a method is not captured at all, rather than traced twice
(:func:`unsavable_module_type`).

While capturing, the methods a module's own ``__dict__`` replaces are set aside (:func:`routes_set_aside`):
the routed method of the module itself, and any such replacement on a module passed to the method (step
caching's split takes the routed UNet). They close over the caller's objects, which torch cannot save with
the guards; where the traced code calls one, dynamo guards on its absence, and that capture is dropped.

A capture file is a pickle, like torch's own compile caches: the cache folder must be as trusted as the
extension's code.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ov_backend import portable
from ov_backend.cache import ModelCache

logger = logging.getLogger(__name__)



def _source_hash(function: Any) -> str:
    try:
        return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return ""


def call_form(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple:
    """What distinguishes calls that need different captures: each argument's kind, and for tensors the
    rank, dtype and device."""
    def form(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", value.dim(), str(value.dtype), value.device.type)
        if value is None or isinstance(value, (bool, int, float, str)):
            return (type(value).__name__, value if not isinstance(value, float) else None)
        return (type(value).__name__,)

    return (tuple(form(a) for a in args), tuple((k, form(kwargs[k])) for k in sorted(kwargs)),
            torch.is_grad_enabled())


def modules_in(value: Any) -> list[torch.nn.Module]:
    """The modules among a call's arguments (in tuples, lists and dicts too), each once."""
    found: dict[int, torch.nn.Module] = {}

    def walk(item: Any) -> None:
        if isinstance(item, torch.nn.Module):
            found.setdefault(id(item), item)
        elif isinstance(item, (tuple, list)):
            for each in item:
                walk(each)
        elif isinstance(item, Mapping):
            for each in item.values():
                walk(each)

    walk(value)
    return list(found.values())


def unsavable_module_type(modules: Iterable[torch.nn.Module]) -> type | None:
    """The first class, among ``modules`` and everything under them, that a saved capture could not name: one
    defined inside a function (its ``__qualname__`` has ``<locals>``), or nested where its name does not find it.
    Dynamo guards on the type of the modules whose code it traces, and torch refuses to save such a guard, only
    once the whole trace is done (and then traces again through torch.compile). A class nested in another class
    (Forge's ``ForgeOperations.Linear``) is named by its path (:func:`portable.named_by_path`)."""
    for top in modules:
        for module in top.modules():
            cls = type(module)
            if cls.__qualname__ != cls.__name__ and not portable.named_by_path(cls):
                return cls
    return None


def overrides(module: torch.nn.Module) -> list[str]:
    """The names under which ``module``'s own ``__dict__`` replaces a method of its class (a routed
    ``forward``, another library's hook)."""
    cls = type(module)
    return [name for name, value in vars(module).items()
            if callable(value) and inspect.isroutine(inspect.getattr_static(cls, name, None))]


@contextlib.contextmanager
def routes_set_aside(entries: Iterable[tuple[Any, str]]) -> Iterator[None]:
    """Within the block, each ``(module, name)`` of ``entries`` has no ``name`` in its own ``__dict__``
    (its class's method shows through); afterwards, whatever happens, the entries taken are put back.

    A capture is made this way: torch saves with the guards the plain attributes of every module the traced
    code reads, and a routed method there is a closure over the caller's objects (an OpenVINO ``Core``),
    which cannot be pickled. The replaced method is the route, not what is captured: where the traced code
    called it, dynamo guards on its absence, so the capture does not match a call with it in place (and
    that call runs through torch.compile)."""
    taken: list[tuple[Any, str, Any]] = []
    try:
        for module, name in entries:
            if name in vars(module):
                taken.append((module, name, vars(module).pop(name)))
        yield
    finally:
        for module, name, value in reversed(taken):
            vars(module)[name] = value


def variant_key(key: str, variant: int) -> str:
    """The file key of one of the captures saved for a form of call (the first one is the form's key)."""
    return key if variant == 0 else f"{key}-{variant}"


class SavedCaptures:
    """The saved captures of one module method, per form of call.

    Args:
        source: the method (a bound method of the module), as it was before being replaced.
        attribute: the name the module's method is replaced under (in the module's own ``__dict__``).
        backend: what the captured graphs run through (a ``GraphCollector``, so releases still reach them).
        cache_dir: the backend's cache folder, or None when it does not cache (then nothing is saved).
        varying: tensor rank -> the dimensions marked dynamic.
        versions: what else the key must name (the extension's and torch's versions).
        record: called with the time a capture or load took (``capture_seconds``) and what it was
            (``captures_made=1``, ``captures_saved=1`` or ``captures_loaded=1``), e.g. a backend's
            ``stats_counter.add``.
        cache: the backend's :class:`ModelCache` of ``cache_dir`` (default: one of its own): the capture files
            loaded or saved here are in use (never pruned) while this object lives.
        saved: called with the capture's cache key after a capture is saved (e.g. the backend's
            ``enforce_cache_limit``).
    """

    def __init__(self, source: Callable[..., Any], attribute: str, backend: Any, cache_dir: Path | None,
                 varying: Mapping[int, tuple[int, ...]], versions: Mapping[str, str],
                 record: Callable[..., None] = lambda **amounts: None, cache: ModelCache | None = None,
                 saved: Callable[[list[str]], None] = lambda keep: None) -> None:
        self.source = source
        self.saved = saved
        self.attribute = attribute
        self.record = record
        self.backend = backend
        self.varying = varying
        self.cache = None if cache_dir is None else cache if cache is not None and cache.root == cache_dir \
            else ModelCache(cache_dir)
        function = getattr(source, "__func__", None)
        self.module = getattr(source, "__self__", None)
        #: why this route runs without captures (None: it uses them)
        self.off: str | None = None
        if function is None or self.module is None:
            self.off = "the method is not a plain method of the module"
        self._base = {
            "class": f"{type(self.module).__module__}.{type(self.module).__qualname__}",
            "method": f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', '')}",
            "source": _source_hash(function), **versions,
        }
        #: call form -> the captures made or loaded for it, in this process
        self._captures: dict[tuple, list[Any]] = {}
        #: call form -> the variants of its key loaded (or tried) or saved, in this process
        self._tried: dict[tuple, set[int]] = {}
        self._lock = threading.Lock()

    @classmethod
    def of(cls, source: Callable[..., Any], attribute: str, graphs: Any, backend: Any,
           varying: Mapping[int, tuple[int, ...]]) -> SavedCaptures:
        """The saved captures of ``source`` for ``backend`` (an ``OVBackend``): in its cache folder when it
        caches, counted in its stats; ``graphs`` is what the captured graphs run through (``backend``
        itself, or a wrapper of it such as a ``GraphRunCounter``)."""
        settings = backend.settings
        return cls(source, attribute, graphs, settings.cache_dir if settings.model_caching else None, varying,
                   getattr(backend, "versions", None) or {"torch": torch.__version__},
                   getattr(getattr(backend, "stats_counter", None), "add", lambda **amounts: None),
                   cache=getattr(backend, "cache", None),
                   saved=getattr(backend, "enforce_cache_limit", lambda keep: None))

    def key(self, form: tuple) -> str:
        """The file key of the captures of one form of call (see :func:`call_form`)."""
        payload = json.dumps({**self._base, "form": form}, sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()[:40]

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any], fallback: Callable[..., Any]) -> Any:
        """Run the call with its capture, or with ``fallback`` (torch.compile's function) when it has none.

        Either way a symbolic size dynamo makes also serves calls where it is 1
        (:func:`portable.sizes_may_be_one`)."""
        with portable.sizes_may_be_one():
            found = self.find(args, kwargs)
            return found(self.module, *args, **kwargs) if found is not None else fallback(*args, **kwargs)

    def find(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any | None:
        """The capture that runs this call (loaded or made now), or None: then torch.compile runs it.

        A form of call keeps every capture made for it (e.g. one per value of a global the code reads, such
        as A1111's CLIP skip, or a batch of 1 where torch guarded a symbolic size on being more than 1), up
        to dynamo's recompile limit, each saved as a variant of the form's key; a later process loads the
        variants one by one until one matches."""
        if self.off is not None:
            return None
        form = call_form(args, kwargs)
        with self._lock:
            known = self._captures.setdefault(form, [])
            found = next((c for c in known if c.matches(self.module, *args, **kwargs)), None)
            if found is not None:
                return found
            key = self.key(form)
            tried = self._tried.setdefault(form, set())
            limit = self.limit()
            for variant in range(limit):
                if variant in tried:
                    continue
                tried.add(variant)
                loaded = self._load(variant_key(key, variant))
                if loaded is not None:
                    known.append(loaded)
                    if loaded.matches(self.module, *args, **kwargs):
                        return loaded
            if len(known) >= limit:
                return None
            return self._capture(key, known, tried, args, kwargs)

    @staticmethod
    def limit() -> int:
        """How many captures a form of call keeps: dynamo's recompile limit."""
        return getattr(torch._dynamo.config, "recompile_limit", None) or 8

    def _load(self, key: str) -> Any | None:
        if self.cache is None:
            return None
        path = self.cache.capture_file(key)
        if not path.is_file():
            return None
        start = time.perf_counter()
        try:
            loaded = portable.load_capture(path, self.backend.load_graph)
        except Exception as err:  # another torch, changed sources, a damaged file: capture again
            logger.info("not using the saved capture %s: %s", path.name, err)
            return None
        seconds = time.perf_counter() - start
        self.record(capture_seconds=seconds, captures_loaded=1)
        path.touch()  # (its last use, for the cache's pruning)
        self.cache.holds.hold([f"{path.parent.name}/{path.name}"], self)
        logger.info("loaded the saved capture of %s in %.1f s (dynamo's tracing skipped)", self._base["method"],
                    seconds)
        return loaded

    def _capture(self, key: str, known: list[Any], tried: set[int], args: tuple[Any, ...],
                 kwargs: Mapping[str, Any]) -> Any | None:
        unsavable = unsavable_module_type([self.module, *modules_in((args, kwargs))])
        if unsavable is not None:  # known before tracing: the trace would be thrown away
            self.off = (f"torch cannot save its guard on {unsavable.__module__}.{unsavable.__qualname__}, a class "
                        "its name does not find again (one defined inside a function)")
            logger.info("%s runs through torch.compile without a saved capture: %s", self._base["method"], self.off)
            return None
        start = time.perf_counter()
        # the module's own __dict__ holds the replacement, and so may a module passed to the method (e.g. a
        # routed UNet given to a split of its forward): the caller's objects (e.g. a backend), which torch
        # would save with the guards, so they are set aside while capturing (see routes_set_aside)
        try:
            with routes_set_aside([(self.module, self.attribute), *(
                    (module, name) for module in modules_in((args, kwargs)) for name in overrides(module))]):
                made = portable.capture(self.source, args, dict(kwargs), self.backend, dict(self.varying))
        except Exception as err:  # a graph break, a guard torch cannot save: torch.compile as before
            first_line = (str(err).splitlines() or [""])[0][:200]
            self.off = f"it cannot be captured whole ({type(err).__name__}: {first_line})"
            logger.info("%s runs through torch.compile without a saved capture: %s", self._base["method"], self.off)
            return None
        finally:
            self.record(capture_seconds=time.perf_counter() - start)
        self.record(captures_made=1)
        if not made.matches(self.module, *args, **kwargs):
            # e.g. the code calls a method set aside while capturing: every capture would be the same
            self.off = "its capture does not hold for the call it was made for (does the code call a method " \
                       "that a module's own __dict__ replaces?)"
            logger.info("%s runs through torch.compile without a saved capture: %s", self._base["method"], self.off)
            return None
        known.append(made)
        if self.cache is not None:
            # the first variant with no file (none of them matched this call), else the last one
            variant = next((v for v in range(self.limit())
                            if not self.cache.capture_file(variant_key(key, v)).is_file()), self.limit() - 1)
            tried.add(variant)
            path = self.cache.capture_file(variant_key(key, variant))
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                made.save(path)
                self.record(captures_saved=1)
                entry = f"{path.parent.name}/{path.name}"
                self.cache.holds.hold([entry], self)
                self.saved([entry])
            except Exception as err:  # a full disk, an object torch cannot save: used in this process only
                logger.warning("could not save the capture of %s to %s (%s); the next process traces it again",
                               self._base["method"], path, err)
        return made
