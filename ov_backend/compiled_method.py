"""A module's method run through a backend: what every entry point (the command line, the WebUI) does to
route one method of a model through OpenVINO.

:class:`CompiledMethod` holds, for one bound method (e.g. a UNet's ``forward``):

- ``torch.compile`` of the method over the backend, its graphs collected (:class:`GraphCollector`) so that
  their compiled models can be released when the method's owner stops using them;
- dynamo's capture of the method saved in the disk cache (:class:`SavedCaptures`), so a later process
  skips the tracing;
- the sizes that vary between calls (tensor rank -> dimensions) marked dynamic on a call with a new kind
  of input, a size of 1 included (:func:`portable.sizes_may_be_one`);
- the check that a call ran a compiled graph: dynamo falls back to plain PyTorch without raising (its
  recompile limit), and :meth:`CompiledMethod.call` says so, with :meth:`why_eager` saying why.

What is the caller's own (which methods to route, what to do with a call run in PyTorch, a precision
rescue, LoRA) stays with the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from types import CodeType
from typing import Any

import torch

from ov_backend import portable
from ov_backend.graph_runs import UNTIL_RESET, GraphCollector, GraphRunCounter, why_eager
from ov_backend.saved_captures import SavedCaptures

logger = logging.getLogger(__name__)


def input_signature(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple:
    """The shapes and dtypes of a call's tensor arguments: what makes a call a new kind of input."""
    values = [*args, *(kwargs[k] for k in sorted(kwargs))]
    return tuple((tuple(v.shape), str(v.dtype)) for v in values if isinstance(v, torch.Tensor))


def with_own_code(method: Callable[..., Any]) -> Callable[..., Any]:
    """A function that calls ``method``, with a code object of its own.

    dynamo keeps a function's compiled variants on its code object, shared by every object of the class (and
    for a class of torch itself, e.g. ``nn.Sequential``, on the one wrapper torch.compile puts around any
    such method), and runs the function in PyTorch once that code has the recompile limit's number of
    variants: the blocks of one UNet (a dozen objects of a few classes) would exceed it. Compiling this
    function instead keeps each object's variants apart (dynamo traces through it into ``method``)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)

    call.__code__ = call.__code__.replace()  # (a new code object: functions made here share theirs)
    call.__qualname__ = getattr(method, "__qualname__", call.__qualname__)
    return call


class CompiledMethod:
    """One method of a module compiled through ``counter``'s backend.

    Args:
        source: the bound method as it was before being replaced (what is compiled and captured).
        counter: the backend, counting the compiled graphs that run.
        varying: tensor rank -> the dimensions that vary between calls (marked dynamic).
        attribute: the name the module's method is replaced under (set aside while capturing).
        code: the code object dynamo keeps the method's compiled variants on (default: the source's).
        own_code: compile a copy of the method with a code object of its own (:func:`with_own_code`), for a
            module whose class has many objects compiled apart; its captures are not saved (the saved key
            names the class's method, which the other objects share).
    """

    def __init__(self, source: Callable[..., Any], counter: GraphRunCounter,
                 varying: Mapping[int, tuple[int, ...]], attribute: str = "forward",
                 code: CodeType | None = None, own_code: bool = False) -> None:
        if own_code:
            source = with_own_code(source)
            code = source.__code__
        self.own_code = own_code
        self.source = source
        self.counter = counter
        self.varying = varying
        self.attribute = attribute
        self.graphs = GraphCollector(counter)
        self.compiled = torch.compile(source, backend=self.graphs)
        self.captures = SavedCaptures.of(source, attribute, self.graphs, counter.backend, varying)
        if own_code:
            self.captures.off = "a copy of its class's method, compiled apart from the class's other objects"
        self.code = code if code is not None else getattr(getattr(source, "__func__", source), "__code__", None)
        #: the input signatures (:func:`input_signature`) of the calls run so far
        self.seen: set[tuple] = set()

    @property
    def backend(self) -> Any:
        """The backend the method's graphs compile through (an ``OVBackend``)."""
        return self.counter.backend

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any], signature: tuple | None = None) -> tuple[Any, bool]:
        """Run one call: (its result, whether dynamo ran it in plain PyTorch, without a compiled graph).

        ``signature``: the call's :func:`input_signature`, when the caller has it already. On a signature
        not seen before, the varying sizes are marked dynamic for torch.compile (a saved capture takes the
        arguments unmarked, as its guards ask)."""
        if signature is None:
            signature = input_signature(args, kwargs)
        new_input = signature not in self.seen

        def through_torch_compile(*args: Any, **kwargs: Any) -> Any:
            if new_input:
                for value in (*args, *kwargs.values()):
                    if isinstance(value, torch.Tensor):
                        portable.mark_varying(value, self.varying)
            with portable.sizes_may_be_one():
                return self.compiled(*args, **kwargs)

        before = self.counter.graphs_run()
        result = self.captures.call(args, kwargs, through_torch_compile)
        self.seen.add(signature)
        return result, self.counter.graphs_run() == before

    def why_eager(self, until: str = UNTIL_RESET) -> str:
        """Why dynamo ran a call of this method in plain PyTorch (``until``: how long that lasts)."""
        return why_eager(self.code, until)

    def release(self) -> int:
        """Release the compiled models of this method's graphs (the next call compiles them again from the
        converted models); returns how many were released."""
        return self.graphs.release()
