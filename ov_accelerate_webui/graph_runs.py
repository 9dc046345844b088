"""Whether dynamo ran a routed call with a compiled graph, or gave up and ran it in plain PyTorch.

dynamo falls back to plain PyTorch without raising: when a function reaches its recompile limit
(``torch._dynamo.config.recompile_limit``, 8 by default) every new kind of input runs uncompiled from
then on, and the only trace is one torch warning. The accelerator wraps each backend in a
:class:`GraphRunCounter`, which counts the compiled graphs that ran in each thread; a routed call during
which none ran was not accelerated, and the run's status and a WARNING say so.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from types import CodeType
from typing import Any

import torch

logger = logging.getLogger(__name__)


class GraphRunCounter:
    """The backend as torch.compile sees it: the same backend, with a count of the compiled graphs that ran
    in each thread. A routed call during which none ran was run by dynamo in plain PyTorch."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._local = threading.local()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        compiled = self.backend(gm, example_inputs)
        local = self._local

        def run(*args: Any) -> Any:
            local.graphs = getattr(local, "graphs", 0) + 1
            return compiled(*args)

        return run

    def graphs_run(self) -> int:
        """Compiled graphs that ran in this thread so far."""
        return getattr(self._local, "graphs", 0)

    def reset(self) -> None:
        """``torch._dynamo.reset()`` calls this on every backend it used."""
        reset = getattr(self.backend, "reset", None)
        if reset is not None:
            reset()


def why_eager(code: CodeType | None) -> str:
    """Why dynamo ran a call of ``code`` in plain PyTorch, as far as dynamo tells."""
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
            f"{code.co_name}) is reached, so every new kind of input runs in PyTorch until another checkpoint "
            "is loaded or the WebUI restarts"
        )
    return "torch.compile did not compile this call (see dynamo's warnings in the log)"
