"""Routing: swap a module's ``forward`` (or another method) for an accelerated one, and always put the
original back.

The swap is an instance attribute, which ``nn.Module.__call__`` (and any ``module.method(...)`` call)
finds before the class method; restoring deletes it again (or puts back an instance attribute that
another extension had set).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

logger = logging.getLogger(__name__)

_MISSING = object()
#: The attribute that marks a callable as one of this extension's routed methods.
OURS = "_openvino_accelerate_route"


def mark_ours(function: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``function`` as a routed method of this extension (see :func:`foreign`); returns it."""
    setattr(function, OURS, True)
    return function


def foreign(module: nn.Module, method: str = "forward") -> Any | None:
    """The instance-level ``method`` another extension set on ``module`` (None: none, ours, or the class's own
    method bound to the module, which is what an extension leaves when it puts back what it found, e.g.
    ControlNet's ``UnetHook.restore``)."""
    value = module.__dict__.get(method)
    if value is None or getattr(value, OURS, False):
        return None
    if getattr(value, "__self__", None) is module and getattr(value, "__func__", None) is getattr(
            type(module), method, None):
        return None
    return value


def describe(function: Any) -> str:
    """Who ``function`` belongs to, as far as can be told: its name and the WebUI extension whose folder its
    code is in (else the file), e.g. "Hook.forward (extension sd-webui-controlnet)"."""
    target = getattr(function, "__func__", function)
    code = getattr(target, "__code__", None)
    where = code.co_filename if code is not None else ""
    name = getattr(target, "__qualname__", None) or type(function).__name__
    extension = re.search(r"[\\/]extensions(?:-builtin)?[\\/]([^\\/]+)[\\/]", where)
    return f"{name} ({'extension ' + extension.group(1) if extension else where or 'origin unknown'})"


@dataclass(frozen=True)
class Route:
    """One module and the callable that replaces one of its methods while routed."""

    module: nn.Module
    forward: Callable[..., Any]
    label: str = ""
    """What is routed, for the status, e.g. "model.diffusion_model"."""
    method: str = "forward"
    """The method that is replaced ("forward", or e.g. "encode_with_transformer")."""
    per_call: bool = False
    """Put in place for each sampling call by the host's patch point (``model_parts.Target.per_call``), not for the
    whole generation."""


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
