"""Routing: swap a module's ``forward`` (or another method) for an accelerated one, and always put the
original back.

The swap is an instance attribute, which ``nn.Module.__call__`` (and any ``module.method(...)`` call)
finds before the class method; restoring deletes it again (or puts back an instance attribute that
another extension had set).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

logger = logging.getLogger(__name__)

_MISSING = object()


@dataclass(frozen=True)
class Route:
    """One module and the callable that replaces one of its methods while routed."""

    module: nn.Module
    forward: Callable[..., Any]
    label: str = ""
    """What is routed, for the status, e.g. "model.diffusion_model"."""
    method: str = "forward"
    """The method that is replaced ("forward", or e.g. "encode_with_transformer")."""


@contextlib.contextmanager
def routed(routes: Sequence[Route]) -> Iterator[None]:
    """Route every module for the duration of the ``with`` block; restore in reverse order afterwards.

    Restoring happens on normal exit, on an exception and on KeyboardInterrupt alike.
    """
    saved: list[tuple[nn.Module, str, Any]] = []
    try:
        for route in routes:
            saved.append((route.module, route.method, route.module.__dict__.get(route.method, _MISSING)))
            setattr(route.module, route.method, route.forward)
        yield
    finally:
        for module, method, previous in reversed(saved):
            if previous is _MISSING:
                module.__dict__.pop(method, None)
            else:
                setattr(module, method, previous)
        logger.debug("restored %d module(s)", len(saved))


def is_routed(module: nn.Module, method: str = "forward") -> bool:
    """True while ``module`` has an instance-level ``method`` (ours or another extension's)."""
    return method in module.__dict__
