"""Which FX nodes OpenVINO takes: op names, the supported-op set, and decompositions.

The table itself is data in :mod:`ov_backend.op_table`; this module turns names into torch op
objects and answers "may this node go to OpenVINO?" for the partitioner.
"""

from __future__ import annotations

import importlib
import logging
import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.fx.passes.operator_support import OperatorSupportBase

from ov_backend.op_table import PYTHON_OPS, SUPPORTED_OP_NAMES

logger = logging.getLogger(__name__)

SUPPORTED_OPS: frozenset[str] = frozenset(SUPPORTED_OP_NAMES) | frozenset(PYTHON_OPS)

#: aten ops decomposed before conversion because OpenVINO has no direct translation for them
#: (or the decomposition converts to a faster graph). Sorted; checked by tests.
DEFAULT_DECOMPOSITIONS: tuple[str, ...] = (
    "aten._native_batch_norm_legit_functional.default",
    "aten.addcmul.default",
    "aten.channel_shuffle.default",
    "aten.glu.default",
    "aten.hardsigmoid.default",
    "aten.hardswish.default",
    "aten.im2col.default",
    "aten.linspace.default",
    "aten.logit.default",
    "aten.mish.default",
    "aten.native_dropout.default",
    "aten.rrelu_with_noise.default",
    "aten.softplus.default",
)

_NAMESPACE_MODULES = {"quantized_decomposed": "torch.ao.quantization.fx._decomposed"}


def op_name(target: Any) -> str:
    """The canonical name of an FX call target or a user-given op name.

    "torch.ops.aten.add.Tensor", "aten.add.Tensor" and ``torch.ops.aten.add.Tensor`` all give
    "aten.add.Tensor"; ``operator.getitem`` gives "_operator.getitem".
    """
    if isinstance(target, str):
        name = target.strip()
        return name[len("torch.ops."):] if name.startswith("torch.ops.") else name
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::', 1)[-1]}.{target._overloadname}"
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__name__', repr(target))}"


def resolve_op(name: str) -> torch._ops.OpOverload | torch._ops.OpOverloadPacket | None:
    """The torch op a name refers to ("aten.add.Tensor" or the packet "aten.add"), or None."""
    parts = name.split(".")
    if len(parts) not in (2, 3):
        return None
    namespace = parts[0]
    if namespace in _NAMESPACE_MODULES:
        importlib.import_module(_NAMESPACE_MODULES[namespace])
    try:
        packet = getattr(getattr(torch.ops, namespace), parts[1])
        return getattr(packet, parts[2]) if len(parts) == 3 else packet
    except (AttributeError, RuntimeError):
        return None


def decomposition_table(extra: Iterable[str] = ()) -> dict[Any, Callable[..., Any]]:
    """The decompositions applied while tracing: the defaults plus ``extra`` op names."""
    from torch._decomp import get_decompositions

    wanted = []
    for name in (*DEFAULT_DECOMPOSITIONS, *extra):
        op = resolve_op(name)
        if op is not None:
            wanted.append(op)
    return get_decompositions(wanted)


_PYTHON_TARGETS = {
    operator.add: "_operator.add",
    operator.floordiv: "_operator.floordiv",
    operator.getitem: "_operator.getitem",
    operator.mul: "_operator.mul",
    operator.neg: "_operator.neg",
    operator.sub: "_operator.sub",
}


def node_op_name(node: torch.fx.Node) -> str:
    """The op name of a ``call_function`` node."""
    return _PYTHON_TARGETS.get(node.target) or op_name(node.target)


class OpenVINOSupport(OperatorSupportBase):
    """Says which nodes go to OpenVINO, and records why the others stay in PyTorch.

    Args:
        disabled: op names forced to PyTorch.
        unconvertible: op names the frontend failed on earlier in this compile.
    """

    def __init__(self, disabled: Iterable[str] = (), unconvertible: Iterable[str] = ()) -> None:
        self.disabled = frozenset(disabled)
        self.unconvertible = frozenset(unconvertible)
        self.rejected: dict[str, str] = {}

    def reason(self, name: str) -> str | None:
        """Why ``name`` stays in PyTorch, or None if OpenVINO takes it."""
        if name in self.disabled:
            return "disabled by the disabled_ops option"
        if name in self.unconvertible:
            return "the OpenVINO frontend could not convert it"
        if name not in SUPPORTED_OPS:
            return "not supported by the OpenVINO PyTorch frontend"
        return None

    def is_node_supported(self, submodules: Any, node: torch.fx.Node) -> bool:
        if node.op != "call_function":
            return False
        name = node_op_name(node)
        why = self.reason(name)
        if why is not None:
            self.rejected[name] = why
            return False
        return True
