"""Compiled graphs that outlive the process: what torch's ahead-of-time capture saves of them.

dynamo's capture of a graph (tracing the Python code, with symbolic sizes: about 14 s for a full SD 1.5
UNet on two cores) is redone in every process. torch's ``torch.compile(...).aot_compile`` captures once
and saves the result (the guards, the bytecode that calls the graph, and the graph's compiled function)
if that function can serialise itself: :class:`PortableGraph` is such a function for a
:class:`~ov_backend.compiled.CompiledGraph`. It saves the captured graph without its example values and
weights (the weights are inputs of every call), with the :class:`~ov_backend.inputs.GraphFacts` the
build routes need. Loading it builds a new ``CompiledGraph`` through the backend in charge
(:func:`loading`): its OpenVINO models come from that backend's disk cache as before, since the graph's
code, and so the cache key, is the same.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import pickle
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch._dynamo.aot_compile import AOTCompilePickler
from torch._dynamo.aot_compile_types import SerializableCallable
from torch._dynamo.guards import GuardsStatePickler

from ov_backend.files import atomic_path

logger = logging.getLogger(__name__)

#: Version of what :meth:`PortableGraph.serialize_compile_artifacts` writes.
PORTABLE_FORMAT = 1

#: loader(gm, facts) -> the callable a loaded capture runs for ``gm`` (see :func:`loading`)
_Loader = Callable[[torch.fx.GraphModule, Any], Callable[..., Any]]
_LOADER: contextvars.ContextVar[_Loader | None] = contextvars.ContextVar("ov_backend_portable_loader", default=None)


class NotPortableError(RuntimeError):
    """A saved graph cannot be loaded here (another format, or no backend to load it with)."""


def dumps_graph(gm: torch.fx.GraphModule) -> bytes:
    """``gm`` pickled without its nodes' metadata (put back afterwards: ``gm`` is left as it was).

    dynamo's metadata holds fake tensors, a shape environment and references to the weights; what the
    builds need of it is in the graph's GraphFacts."""
    from torch.fx._graph_pickler import GraphPickler, Options

    saved = [(node, node.meta) for node in gm.graph.nodes]
    try:
        for node, _ in saved:
            node.meta = {}
        return GraphPickler.dumps(gm, Options(ops_filter=None))
    finally:
        for node, meta in saved:
            node.meta = meta


def loads_graph(data: bytes) -> torch.fx.GraphModule:
    """A graph pickled by :func:`dumps_graph`, with its code generated again."""
    from torch._subclasses import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    gm = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
    if not isinstance(gm, torch.fx.GraphModule):
        raise NotPortableError(f"a saved graph holds a {type(gm).__name__}, not a GraphModule")
    gm.recompile()
    return gm


@contextlib.contextmanager
def loading(loader: _Loader) -> Iterator[None]:
    """Within the block, a saved :class:`PortableGraph` is loaded by ``loader(gm, facts)``, which returns
    the callable the loaded capture runs (e.g. a backend's new compiled graph for ``gm``)."""
    token = _LOADER.set(loader)
    try:
        yield
    finally:
        _LOADER.reset(token)


class PortableGraph(SerializableCallable):
    """The function dynamo runs for one captured graph, able to save itself with the capture.

    Args:
        run: what a call runs (the compiled graph, possibly wrapped, e.g. counting its runs).
        gm: the captured graph.
        facts: what the builds need of its inputs and outputs (a :class:`~ov_backend.inputs.GraphFacts`).
    """

    def __init__(self, run: Callable[..., Any], gm: torch.fx.GraphModule, facts: Any) -> None:
        self.run = run
        self.gm = gm
        self.facts = facts

    def __call__(self, *args: Any) -> Any:
        return self.run(*args)

    def __getattr__(self, name: str) -> Any:
        # what wrappers find on the compiled graph (e.g. "graph", "release_compiled")
        if name in ("run", "gm", "facts"):
            raise AttributeError(name)
        return getattr(self.run, name)

    def rewrap(self, run: Callable[..., Any]) -> PortableGraph:
        """The same graph, running ``run`` (a wrapper of this one's function)."""
        return PortableGraph(run, self.gm, self.facts)

    @classmethod
    def serialize_compile_artifacts(cls, fn: PortableGraph) -> bytes:
        return pickle.dumps({"format": PORTABLE_FORMAT, "graph": dumps_graph(fn.gm), "facts": fn.facts})

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> PortableGraph:
        state = pickle.loads(data)  # noqa: S301  (our own cache file, written by serialize_compile_artifacts)
        if not isinstance(state, dict) or state.get("format") != PORTABLE_FORMAT:
            raise NotPortableError("a saved graph of another format")
        loader = _LOADER.get()
        if loader is None:
            raise NotPortableError("a saved graph is loaded outside ov_backend.portable.loading()")
        gm = loads_graph(state["graph"])
        loaded = loader(gm, state["facts"])
        return loaded if isinstance(loaded, PortableGraph) else PortableGraph(loaded, gm, state["facts"])


# -- captures: torch's ahead-of-time capture of a function, saved and loaded ------------------------------
#: Guard kinds torch cannot save: they compare object identities, which differ in every process. The
#: capture keeps, in their place, a description of each object (:func:`describe`), compared on load.
IDENTITY_GUARDS = ("DICT_VERSION", "NN_MODULE", "ID_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "MODULE_MATCH",
                   "CLOSURE_MATCH", "WEAKREF_ALIVE", "BUILTIN_MATCH")
#: Of those, the ones that name Python modules and builtins: the same name is the same object.
_BY_NAME = ("MODULE_MATCH", "BUILTIN_MATCH", "DICT_VERSION", "WEAKREF_ALIVE")
CAPTURE_FORMAT = 1


def describe(value: Any) -> str:
    """What a guard's object is, comparable across processes: a constant by its value, a function by its
    module, qualified name and code location, a class by module and name, anything else by its type."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return f"= {value!r}"
    code = getattr(value, "__code__", None)
    if code is not None:
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}@{code.co_filename}:" \
               f"{code.co_firstlineno}"
    if isinstance(value, type):
        return f"class {value.__module__}.{value.__qualname__}"
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    module = getattr(value, "__module__", None)
    if isinstance(name, str) and isinstance(module, str):
        return f"{module}.{name}"
    return f"instance of {type(value).__module__}.{type(value).__qualname__}"


class _ModuleGlobals(dict):
    """A function's globals as dynamo's guard names read them: ``G['__import_a_dot_b']`` is module a.b,
    ``G['__builtins_dict___0']`` the builtins."""

    def __missing__(self, key: str) -> Any:
        import builtins
        import sys

        if key.startswith("__builtins_dict___"):
            return builtins.__dict__
        if key.startswith("__import_"):
            module = sys.modules.get(key[len("__import_"):].replace("_dot_", "."))
            if module is not None:
                return module
        raise KeyError(key)


_GLOBAL_NAME = re.compile(r"G\['([A-Za-z_][A-Za-z0-9_]*)'\]")


class Capture:
    """One function captured ahead of time: dynamo's guards and bytecode and the compiled graph.

    ``matches(*args, **kwargs)`` says whether a call may run it (the saved guards, and the objects the
    identity guards and the guards on globals name described as at the capture, read live); calling it
    runs the call.
    """

    def __init__(self, function: Any, identities: dict[str, tuple[str, str]], module: str) -> None:
        self.function = function  # torch._dynamo.aot_compile.AOTCompiledFunction
        self.identities = identities
        #: the name of the Python module whose globals the captured function reads
        self.module = module
        self.function.disable_guard_check()  # (matches() checks them once per call)
        #: the names to read on each call, compiled once
        self._live = [(compile(name, "<guard>", "eval"), described)
                      for name, (kind, described) in identities.items() if kind not in _BY_NAME]
        #: the module globals torch's guards read: a loaded capture's guards read them in a copy of the
        #: module's globals made on loading, which :meth:`matches` brings up to date first (else a capture
        #: for another value of a global, such as A1111's CLIP skip, never matches after a restart)
        self._global_names = [m.group(1) for m in (_GLOBAL_NAME.fullmatch(name) for name in identities) if m]

    def matches(self, *args: Any, **kwargs: Any) -> bool:
        try:
            scope, live = getattr(getattr(self.function, "fn", None), "__globals__", None), _globals_of(self.module)
            if scope is not None and scope is not live:
                scope.update({name: live[name] for name in self._global_names if name in live})
            f_locals = self.function.prepare_f_locals(*args, **kwargs)
            if not self.function._artifacts.guard_manager.check(f_locals):
                return False
            names = {**f_locals, "G": _ModuleGlobals(_globals_of(self.module))}
            for code, described in self._live:
                if describe(eval(code, {"__builtins__": __builtins__}, names)) != described:  # noqa: S307
                    return False
        except Exception as err:  # a name that no longer resolves, arguments of another form: not this capture
            logger.debug("a capture of %s does not match this call: %s", self.module, err)
            return False
        return True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)

    def save(self, path: Any) -> None:
        """Write the capture to ``path`` (whole or not at all)."""
        from torch._dynamo import aot_compile

        with _pickling_by_code():
            body = aot_compile.AOTCompiledFunction.serialize(self.function).serialized_data
        # globals the bytecode reads beyond torch's own: the module's own names are found there on load
        # (or the load fails and the caller captures again); modules dynamo installed under names of its
        # own (e.g. "___module_collections_<id>_c0") are saved by module name
        installed = _globals_of(self.module)
        env = self.function._artifacts.runtime_env
        modules = {name: installed[name].__name__ for name in env.external_refs
                   if name not in env.import_sources and inspect.ismodule(installed.get(name))}
        data = pickle.dumps({"format": CAPTURE_FORMAT, "torch": torch.__version__, "identities": self.identities,
                             "module": self.module, "modules": modules, "function": body})
        with atomic_path(path) as tmp:  # (a failed write leaves nothing behind)
            tmp.write_bytes(data)


_SAVE_LOCK = threading.RLock()


def _importable_as_itself(function: Any) -> bool:
    """Whether pickle can save ``function`` by name: its module's attribute of its qualified name is it."""
    import sys

    found: Any = sys.modules.get(getattr(function, "__module__", None) or "")
    for part in getattr(function, "__qualname__", "").split("."):
        found = getattr(found, part, None)
    return found is function


def _by_code(pickler: Any, obj: Any) -> Any:
    """How ``pickler`` (one of torch's) saves a function that its name no longer reaches (e.g. the original
    ``UNetModel.forward`` that A1111's ``sd_unet`` keeps in a closure after replacing it on the class): by
    its code, module and closure, as torch saves nested functions (loaded, a new function of the same
    code); torch's own way otherwise (for such a function: not at all, or as a missing value)."""
    if inspect.isfunction(obj) and "<locals>" not in obj.__qualname__ and not _importable_as_itself(obj):
        return type(pickler)._unpickle_nested_function, (obj.__code__, obj.__module__, obj.__qualname__,
                                                          obj.__defaults__, obj.__closure__)
    return NotImplemented


class _ByCodePickler(AOTCompilePickler):
    """torch's pickler of a capture, with :func:`_by_code`."""

    def reducer_override(self, obj: Any) -> Any:
        found = _by_code(self, obj)
        return super().reducer_override(obj) if found is NotImplemented else found


class _ByCodeGuardsPickler(GuardsStatePickler):
    """torch's pickler of a capture's guards, with :func:`_by_code`."""

    def reducer_override(self, obj: Any) -> Any:
        found = _by_code(self, obj)
        return super().reducer_override(obj) if found is NotImplemented else found


@contextlib.contextmanager
def _pickling_by_code() -> Iterator[None]:
    """Within the block, torch pickles captures and their guards with :func:`_by_code` (its code looks the
    pickler classes up by name when it pickles)."""
    from torch._dynamo import aot_compile, guards

    with _SAVE_LOCK:
        plain = aot_compile.AOTCompilePickler, guards.GuardsStatePickler
        aot_compile.AOTCompilePickler, guards.GuardsStatePickler = _ByCodePickler, _ByCodeGuardsPickler
        try:
            yield
        finally:
            aot_compile.AOTCompilePickler, guards.GuardsStatePickler = plain


@contextlib.contextmanager
def sizes_may_be_one() -> Iterator[None]:
    """Within the block, dynamo's symbolic sizes may be 1 (or 0), in the call traced and in later calls.

    dynamo makes a size of 1 static and assumes a symbolic size is at least 2, so a graph captured with a
    batch of 2 did not serve a batch of 1, nor the other way round: dynamo traced the code again, in
    another graph. A1111 runs the UNet at a batch of 1 whenever the prompt and the negative prompt differ
    in length (a prompt over 75 tokens) and on the late steps of "Negative Guidance minimum sigma": each was
    a second capture of the whole UNet. Two things make one capture serve both:

    - torch's size-oblivious reasoning on backed sizes: a batch of 1 is symbolic like any other;
    - convolutions traced with a contiguous output (:func:`_contiguous_convolutions`): torch picks a
      convolution's memory format from its input's strides, which for A1111's UNet (a convolution reading
      a permuted view, in its SpatialTransformer) guards every size of the input on being more than 1.
      The graph a backend gets has no strides: the format only decides the traced strides, and a graph
      run by OpenVINO computes the same values with either.

    Without torch's setting the block changes nothing.
    """
    from torch.fx.experimental import _config as config

    if not hasattr(config, "backed_size_oblivious"):
        yield
        return
    with config.patch(backed_size_oblivious=True), _contiguous_convolutions():
        yield


_CONV_FORMAT_LOCK = threading.Lock()
_conv_format_users = 0
_conv_format_plain: Callable[..., Any] | None = None


def _traced_conv_format(input_: torch.Tensor, weight: torch.Tensor, backend: Any) -> torch.memory_format:
    """torch's choice of a convolution's memory format, except contiguous for a traced input with symbolic
    sizes or strides (torch's choice reads them, and so guards them)."""
    if any(isinstance(v, torch.SymInt) for t in (input_, weight) for v in (*t.shape, *t.stride())):
        return torch.contiguous_format
    assert _conv_format_plain is not None
    return _conv_format_plain(input_, weight, backend)


@contextlib.contextmanager
def _contiguous_convolutions() -> Iterator[None]:
    """Within the block (in any thread: torch looks the function up when it traces a convolution), traced
    convolutions with symbolic sizes get a contiguous output; real convolutions are untouched."""
    global _conv_format_users, _conv_format_plain
    name = "_conv_determine_backend_memory_format"
    if not hasattr(torch._C, name):
        yield
        return
    with _CONV_FORMAT_LOCK:
        if _conv_format_users == 0:
            _conv_format_plain = getattr(torch._C, name)
            setattr(torch._C, name, _traced_conv_format)
        _conv_format_users += 1
    try:
        yield
    finally:
        with _CONV_FORMAT_LOCK:
            _conv_format_users -= 1
            if _conv_format_users == 0:
                setattr(torch._C, name, _conv_format_plain)


def mark_varying(tensor: torch.Tensor, dims: Mapping[int, tuple[int, ...]]) -> None:
    """Mark ``dims`` (tensor rank -> dimensions) of ``tensor`` as dynamic for dynamo, sizes of 1 included
    (they stay symbolic within :func:`sizes_may_be_one`)."""
    for dim in dims.get(tensor.dim(), ()):
        torch._dynamo.maybe_mark_dynamic(tensor, dim)


def named_by_path(cls: type) -> bool:
    """Whether ``cls`` is defined inside another class (``__qualname__`` a dotted path from its module that
    reaches it, e.g. Forge's ``ForgeOperations.Linear``), not in a function.

    torch refuses to save a guard on the type of such a class (it takes every nested class for one defined
    in a function, which a name cannot find again); :func:`capture` checks those guards itself, by the class's
    name, as torch checks a top-level class's on load."""
    return cls.__qualname__ != cls.__name__ and "<locals>" not in cls.__qualname__ and _importable_as_itself(cls)


def _type_by_path(entry: Any) -> bool:
    return entry.guard_type == "TYPE_MATCH" and entry.has_value and named_by_path(type(entry.value))


def capture(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], backend: Any,
            dynamic: dict[int, tuple[int, ...]] | None = None) -> Capture:
    """Capture ``function`` (e.g. a module's bound ``forward``) for calls like ``function(*args, **kwargs)``
    through ``backend`` (whose graphs must be :class:`PortableGraph`), without running it.

    ``dynamic`` (tensor rank -> dimensions) marks sizes as symbolic (sizes of 1 too, within
    :func:`sizes_may_be_one`; outside it they stay static). The arguments are not marked
    themselves: stand-ins sharing their data are, so that dynamo's guards do not ask later calls for the
    marking.

    Raises:
        whatever dynamo raises when the function cannot be captured whole and saved (a graph break, a
        guard torch cannot save, a graph that is not a PortableGraph).
    """
    def stand_in(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        alias = value.detach().view_as(value) if not value.requires_grad else value.view_as(value)
        mark_varying(alias, dynamic or {})
        return alias

    identities: dict[str, tuple[str, str]] = {}

    def keep(entries: Any) -> list[bool]:
        kept = []
        for entry in entries:
            if _type_by_path(entry):  # checked here, as the identities are: torch would refuse to save it
                identities[f"type({entry.name})"] = (entry.guard_type, describe(type(entry.value)))
                kept.append(False)
                continue
            identity = entry.guard_type in IDENTITY_GUARDS or any(
                d in IDENTITY_GUARDS for d in entry.derived_guard_types)
            # torch checks a loaded capture's guards on globals against a copy of the globals made when it
            # was loaded or captured: they are checked on the live globals here too (a module-level name
            # rebound later, e.g. A1111's sd_unet.current_unet, would otherwise go unnoticed)
            if identity or (entry.is_global and entry.guard_type != "DUPLICATE_INPUT"):
                identities[entry.name] = (entry.guard_type, describe(entry.value) if entry.has_value else "")
            kept.append(not identity)
        return kept

    compiled = torch.compile(function, backend=backend, fullgraph=True, options={"guard_filter_fn": keep})
    # (the guards are pickled as they are built.) The sizes made symbolic are the marked ones only, whatever
    # the process captured before: dynamo's automatic dynamic shapes would make more of them symbolic in a
    # second capture of the function, and guard them on the stand-in's base, which no later call matches.
    no_automatic = torch._dynamo.config.patch(automatic_dynamic_shapes=False)
    with _pickling_by_code(), sizes_may_be_one(), no_automatic:
        aot = compiled.aot_compile((tuple(stand_in(a) for a in args), {k: stand_in(v) for k, v in kwargs.items()}))
    return Capture(aot, identities, getattr(function, "__func__", function).__module__)


def load_capture(path: Any, loader: _Loader) -> Capture:
    """The capture saved at ``path``, its graphs loaded by ``loader`` (see :func:`loading`).

    Raises:
        NotPortableError: the file is of another format or torch version, or the source of a function it
            traced changed since; OSError: it cannot be read.
    """
    import sys

    from torch._dynamo.aot_compile import AOTCompiledFunction

    with open(path, "rb") as fh:
        state = pickle.load(fh)  # noqa: S301  (our own cache file, written by Capture.save)
    if not isinstance(state, dict) or state.get("format") != CAPTURE_FORMAT:
        raise NotPortableError(f"{path} is not a capture of this version")
    if state.get("torch") != torch.__version__:
        raise NotPortableError(f"{path} was captured with torch {state.get('torch')}, not {torch.__version__}")
    module = state.get("module")
    if sys.modules.get(module) is None:
        raise NotPortableError(f"{path} is a capture of a function of {module}, which is not imported")
    import importlib

    f_globals = {**_globals_of(module), **{name: importlib.import_module(m) for name, m in state["modules"].items()}}
    with loading(loader):
        function = AOTCompiledFunction.deserialize(state["function"], f_globals=f_globals)
    for source in function.source_info().inlined_sources:
        traced = sys.modules.get(source.module)
        if traced is None or _source_checksum(traced, source.firstlineno, source.lastlineno) != source.checksum:
            raise NotPortableError(f"the source of {source.module} (lines {source.firstlineno}-"
                                   f"{source.lastlineno}) changed since the capture, or it is not imported")
    return Capture(function, state["identities"], module)


def _globals_of(module: str) -> dict[str, Any]:
    import sys

    return vars(sys.modules[module])


def _source_checksum(module: Any, first: int, last: int) -> str:
    from torch._dynamo.package import _get_sourcelines, _hash_source

    return _hash_source("".join(_get_sourcelines(module, first, last)))
