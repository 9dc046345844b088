"""Whether dynamo ran a call with a compiled graph, or gave up and ran it in plain PyTorch.

dynamo falls back to plain PyTorch without raising: when a function reaches its recompile limit
(``torch._dynamo.config.recompile_limit``, 8 by default) every new kind of input runs uncompiled from
then on, and the only trace is one torch warning. Wrapping the backend in a :class:`GraphRunCounter`
counts the compiled graphs that ran in each thread; a call of a compiled function during which none ran
was not accelerated. :func:`why_eager` says why, :class:`EagerCalls` tallies such calls per label and
:func:`describe_eager` is the one sentence every entry point reports them with (the command line's
summary, the WebUI's status and log).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import CodeType
from typing import Any

import torch

from ov_backend.portable import PortableGraph

logger = logging.getLogger(__name__)

#: What :func:`why_eager` says lasts the fallback, unless the caller knows better (the WebUI does).
UNTIL_RESET = "until torch.compiler.reset() or the end of the process"


class GraphRunCounter:
    """The backend as torch.compile sees it: the same backend, with a count of the compiled graphs that
    ran in each thread. A call during which none ran was run by dynamo in plain PyTorch.

    Args:
        backend: an ``OVBackend`` (or another backend with ``reset()``).
    """

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._local = threading.local()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return self._counting(self.backend(gm, example_inputs))

    def load_graph(self, gm: torch.fx.GraphModule, facts: Any) -> Callable[..., Any]:
        """The backend's compiled graph for a saved capture's ``gm`` (see ``ov_backend.portable``), counted."""
        return self._counting(self.backend.load_graph(gm, facts))

    def _counting(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        local = self._local

        def run(*args: Any) -> Any:
            local.graphs = getattr(local, "graphs", 0) + 1
            return compiled(*args)

        run.graph = compiled  # type: ignore[attr-defined]  # (see GraphCollector)
        # a graph that can be saved with torch's ahead-of-time capture stays so
        return compiled.rewrap(run) if isinstance(compiled, PortableGraph) else run

    def graphs_run(self) -> int:
        """Compiled graphs that ran in this thread so far."""
        return getattr(self._local, "graphs", 0)

    def reset(self) -> None:
        """``torch._dynamo.reset()`` calls this on every backend it used."""
        self.backend.reset()


class GraphCollector:
    """The backend of one compiled function: ``backend`` (e.g. a :class:`GraphRunCounter`), keeping weak
    references to the graphs it compiled for that function, so that their compiled models can be
    released when the function's owner stops using it (see :meth:`release`)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._graphs: list[weakref.ref] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return self._collect(self.backend(gm, example_inputs))

    def load_graph(self, gm: torch.fx.GraphModule, facts: Any) -> Callable[..., Any]:
        """The backend's compiled graph for a saved capture's ``gm`` (see ``ov_backend.portable``), collected."""
        return self._collect(self.backend.load_graph(gm, facts))

    def _collect(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        graph = getattr(compiled, "graph", compiled)
        if hasattr(graph, "release_compiled"):
            self._graphs.append(weakref.ref(graph))
        return compiled

    def release(self) -> int:
        """Release the compiled models of this function's graphs (their next call compiles again, from the
        models the graphs keep); returns how many were released."""
        graphs = [g for g in (ref() for ref in self._graphs) if g is not None]
        self._graphs = [weakref.ref(g) for g in graphs]
        return sum(g.release_compiled() for g in graphs)

    def reset(self) -> None:
        """``torch._dynamo.reset()`` calls this on every backend it used."""
        self._graphs.clear()
        self.backend.reset()


def why_eager(code: CodeType | None, until: str = UNTIL_RESET) -> str:
    """Why dynamo ran a call of ``code`` in plain PyTorch, as far as dynamo tells.

    Args:
        code: the code object of the compiled function (dynamo keeps its variants there).
        until: how long the fallback lasts, in the caller's terms.
    """
    limit = getattr(torch._dynamo.config, "recompile_limit", None) or getattr(
        torch._dynamo.config, "cache_size_limit", None
    )
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        variants = len(_debug_get_cache_entry_list(code)) if code is not None else None
    except (ImportError, TypeError, RuntimeError):
        variants = None
    if limit is not None and variants is not None and variants >= limit:
        return (
            f"torch.compile gave up on it: dynamo's recompile limit ({limit} compiled variants of "
            f"{code.co_name}) is reached, so every new kind of input runs in PyTorch {until}"
        )
    return "torch.compile did not compile this call (see dynamo's warnings in the log)"


def describe_eager(eager: Mapping[str, tuple[int, str]], calls: Mapping[str, int]) -> str:
    """The report of calls that dynamo ran in plain PyTorch.

    Args:
        eager: label -> (calls run in PyTorch, why).
        calls: label -> all calls of that label (missing: the eager count).
    """
    items = [f"{label} ({count} of {calls.get(label, count)} calls: {why})" for label, (count, why) in eager.items()]
    return "Not accelerated, ran in plain PyTorch: " + "; ".join(items) + "."


class EagerCalls:
    """Calls of compiled functions, per label, and those dynamo ran in plain PyTorch (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: dict[str, int] = {}
        self.eager: dict[str, tuple[int, str]] = {}

    def watch(self, label: str, method: Any) -> Callable[..., Any]:
        """A forward that runs ``method`` (an ``ov_backend.CompiledMethod``), counting its calls under
        ``label``."""

        def call(*args: Any, **kwargs: Any) -> Any:
            result, ran_eager = method.call(args, kwargs)
            reason = method.why_eager() if ran_eager else ""
            with self._lock:
                self.calls[label] = self.calls.get(label, 0) + 1
                if ran_eager:
                    count = self.eager.get(label, (0, ""))[0]
                    self.eager[label] = (count + 1, reason)
            return result

        return call

    def report(self) -> str | None:
        """:func:`describe_eager` of the calls so far, or None when every call ran a compiled graph."""
        with self._lock:
            return describe_eager(self.eager, self.calls) if self.eager else None

    def clear(self) -> None:
        """Forget the calls so far."""
        with self._lock:
            self.calls.clear()
            self.eager.clear()
