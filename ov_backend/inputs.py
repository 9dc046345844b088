"""What a dynamo graph's inputs are, and the signature a call is compiled for.

Owns: telling weights, derived sizes and user inputs apart (:func:`classify_inputs`), the
signature of a call's user inputs (:func:`signature`, :func:`signature_text`), and
:class:`GraphInputs`, the facts about one graph's inputs and outputs that the builds need:
which inputs are symbolic or Python numbers baked into each model, how to rebuild the graph's
full argument list, and the graph as a function of its user tensors with the weights closed over.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ov_backend import weights

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class InputKind:
    """What one dynamo graph input is.

    Attributes:
        kind: "weight", "derived" (a size of another input) or "user".
        base: for "derived": the index of the input it is a size of.
        dim: for "derived": which dimension.
        prop: for "derived": "size", "stride" or "storage_offset".
        name: where dynamo found it, e.g. "L['self']._modules['conv']._parameters['weight']".
    """

    kind: str
    base: int = -1
    dim: int = 0
    prop: str = "size"
    name: str = ""


def classify_inputs(gm: torch.fx.GraphModule) -> list[InputKind]:
    """Tell weights, derived sizes and user inputs apart from dynamo's graph-argument sources (or, for a
    graph captured ahead of time, which carries no sources, from its placeholders: see
    :func:`_classify_without_sources`)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sources = [getattr(n.meta.get("grapharg"), "source", None) for n in placeholders]
    if placeholders and all(s is None for s in sources):
        return _classify_without_sources(placeholders)
    by_source = {s.name: i for i, s in enumerate(sources) if s is not None}
    kinds: list[InputKind] = []
    for source in sources:
        name = source.name if source is not None else ""
        if name and weights.is_weight_source(name):
            kinds.append(InputKind("weight", name=name))
            continue
        prop = getattr(source, "prop", None)
        base = getattr(source, "base", None)
        if prop is not None and base is not None and base.name in by_source:
            kinds.append(InputKind("derived", by_source[base.name], int(getattr(source, "idx", 0) or 0),
                                   str(getattr(prop, "name", "SIZE")).lower()))
            continue
        kinds.append(InputKind("user"))
    return kinds


def _classify_without_sources(placeholders: Sequence[torch.fx.Node]) -> list[InputKind]:
    """The kinds of a graph's inputs from its placeholders alone (torch's ahead-of-time capture keeps no
    graph-argument sources): a weight's placeholder is named after its source
    (``l_self_modules_conv_parameters_weight_``), and a symbolic size that is a dimension of a user
    tensor input is derived from it."""
    values = [n.meta.get("example_value") for n in placeholders]
    is_weight = [isinstance(v, torch.Tensor) and weights.is_weight_placeholder(n.name)
                 for n, v in zip(placeholders, values)]
    dims: dict[Any, tuple[int, int]] = {}
    for index, value in enumerate(values):
        if isinstance(value, torch.Tensor) and not is_weight[index]:
            for dim, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt):
                    dims.setdefault(size.node.expr, (index, dim))
    kinds: list[InputKind] = []
    for node, value, weight in zip(placeholders, values, is_weight):
        if weight:
            kinds.append(InputKind("weight", name=node.name))
        elif isinstance(value, torch.SymInt) and value.node.expr in dims:
            base, dim = dims[value.node.expr]
            kinds.append(InputKind("derived", base, dim, "size"))
        else:
            kinds.append(InputKind("user"))
    return kinds


def signature(values: Sequence[Any], scalar_tensors: frozenset[int] = frozenset()) -> tuple[Any, ...]:
    """The signature a call is compiled for: each user input's shape and dtype, or its value."""
    sig: list[Any] = []
    for pos, v in enumerate(values):
        if pos in scalar_tensors:  # an unspecialised Python number dynamo passes as a 0-d tensor
            sig.append(v.item())
        elif isinstance(v, torch.Tensor):
            sig.append((tuple(v.shape), str(v.dtype).replace("torch.", "")))
        else:
            sig.append(v if isinstance(v, (int, float, bool)) else repr(v))
    return tuple(sig)


def signature_text(sig: tuple[Any, ...]) -> str:
    """A signature for logs and reports: "(float32[1,3,16,16], 2)"."""
    parts = []
    for item in sig:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], tuple):
            parts.append(f"{item[1]}[{','.join(map(str, item[0]))}]")
        else:
            parts.append(str(item))
    return "(" + ", ".join(parts) + ")"


def output_dtype(node: Any) -> torch.dtype | None:
    """The dtype of a graph output node's example value (None for non-tensors)."""
    if not isinstance(node, torch.fx.Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    return value.dtype if isinstance(value, torch.Tensor) else None


def still_symbolic(size: Any) -> bool:
    """Whether ``size`` (a dimension of a dynamo example value) is symbolic in the graph dynamo made.

    Dynamo may give a dimension a symbol and then fix it while it traces: its guards then hold the
    size to its example value (the graph runs for no other), and a trace with that dimension dynamic
    fixes it again. The tiny SD UNet at 64 pixels is one: its deepest level is 1x1, torch fixes sizes of
    1, and the skip connections' concatenations then fix the latent's height and width. (The symbol
    object stays in the example value; its expression, after dynamo's replacements, is the number.)
    """
    return isinstance(size, torch.SymInt) and not size.node.expr.is_number


@dataclass(frozen=True)
class GraphFacts:
    """What the builds need to know of a graph's inputs and outputs beyond the graph itself: read
    from dynamo's example values once, and kept with a saved capture (which holds no example values).

    Attributes:
        kinds: what each input is.
        symbolic: dynamo gave the graph symbolic sizes.
        scalar_tensors: positions (among user inputs) of Python numbers passed as 0-d tensors.
        dynamic_dims: for each user input, its symbolic dimensions; None when traced per signature.
        output_dtypes: each output's dtype name, or None for a non-tensor output.
    """

    kinds: tuple[InputKind, ...]
    symbolic: bool
    scalar_tensors: frozenset[int]
    dynamic_dims: tuple[tuple[int, ...], ...] | None
    output_dtypes: tuple[str | None, ...]

    @classmethod
    def read(cls, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], kinds: Sequence[InputKind]) -> GraphFacts:
        """The facts of ``gm`` from dynamo's example values (its placeholders' and outputs' metadata)."""
        kinds = tuple(kinds)
        user_index = [i for i, k in enumerate(kinds) if k.kind == "user"]
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # dynamo's fake example values carry the symbolic sizes; the real example inputs do not
        values = [n.meta.get("example_value", e) for n, e in zip(placeholders, example_inputs)]
        symbolic = any(isinstance(v, torch.SymInt) for v in values) or any(
            isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape) for v in values)
        # Python numbers dynamo did not specialise (e.g. a norm's eps with dynamic=True) arrive as
        # 0-d tensors the graph only reads with .item(): they are baked into each signature's model
        scalar_tensors = frozenset(
            pos for pos, i in enumerate(user_index)
            if isinstance(values[i], torch.Tensor) and values[i].dim() == 0 and placeholders[i].users
            and all(u.op == "call_method" and u.target == "item" for u in placeholders[i].users))
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        dtypes = tuple(output_dtype(o) for o in (out if isinstance(out, (tuple, list)) else [out]))
        output_dtypes = tuple(str(d).replace("torch.", "") if d is not None else None for d in dtypes)
        dims = None
        if symbolic and not scalar_tensors and None not in output_dtypes:
            found = [[d for d, size in enumerate(values[i].shape) if still_symbolic(size)]
                     if isinstance(values[i], torch.Tensor) else None for i in user_index]
            # a scalar input is baked per value: such a graph is traced per signature instead
            dims = None if any(d is None for d in found) else tuple(tuple(d) for d in found)
        return cls(kinds, symbolic, scalar_tensors, dims, output_dtypes)


class GraphInputs:
    """One captured graph's inputs and outputs, as the builds see them.

    Args:
        gm: the captured graph.
        facts: what the builds need to know of its inputs and outputs (:meth:`GraphFacts.read`).
    """

    def __init__(self, gm: torch.fx.GraphModule, facts: GraphFacts) -> None:
        self.gm = gm
        self.facts = facts
        self.kinds = list(facts.kinds)
        self.weight_index = [i for i, k in enumerate(self.kinds) if k.kind == "weight"]
        self.user_index = [i for i, k in enumerate(self.kinds) if k.kind == "user"]
        self.symbolic = facts.symbolic
        self.scalar_tensors = facts.scalar_tensors
        #: for each user input, its symbolic dimensions; None when the graph is traced per signature
        self.dynamic_dims = [list(d) for d in facts.dynamic_dims] if facts.dynamic_dims is not None else None
        #: how many ops the graph holds (as a partition report counts them)
        self.op_count = sum(1 for n in gm.graph.nodes if n.op == "call_function")

    def outputs_are_tensors(self) -> bool:
        return None not in self.facts.output_dtypes

    def output_dtypes(self) -> list[torch.dtype | None]:
        return [getattr(torch, d) if d is not None else None for d in self.facts.output_dtypes]

    def split(self, args: Sequence[Any]) -> tuple[list[torch.Tensor], list[Any]]:
        """A call's arguments as (weights, user inputs)."""
        return [args[i] for i in self.weight_index], [args[i] for i in self.user_index]

    def full_args(self, user_values: Sequence[Any], weight_values: Sequence[torch.Tensor]) -> list[Any]:
        """The graph's argument list from its user inputs and weights (derived sizes computed)."""
        full: list[Any] = [None] * len(self.kinds)
        for i, v in zip(self.user_index, user_values):
            full[i] = v
        for i, v in zip(self.weight_index, weight_values):
            full[i] = v
        for i, k in enumerate(self.kinds):
            if k.kind == "derived":
                base = full[k.base]
                full[i] = (base.size(k.dim) if k.prop == "size" else base.stride(k.dim) if k.prop == "stride"
                           else base.storage_offset())
        return full

    def taking_weights(self) -> Callable[..., Any]:
        """``fn(*user tensors, *weights)`` running the graph: the weights as arguments, so that a
        conversion sees them as inputs (never as values it could copy or fold)."""
        count = len(self.user_index)

        def fn(*args: Any) -> Any:
            return self.gm(*self.full_args(list(args[:count]), list(args[count:])))

        return fn

    def check_loaded(self, weight_values: Sequence[torch.Tensor]) -> None:
        """Raise a ValueError naming the first weight on the meta device (it holds no data)."""
        for index, tensor in zip(self.weight_index, weight_values):
            if tensor.is_meta:
                raise ValueError(
                    f"{self.kinds[index].name or 'a weight'} is on the meta device (it holds no data); load "
                    f"real weights into the module (e.g. load_state_dict(..., assign=True) or .to_empty() and "
                    f"a state dict) before running it compiled")

    def closure(self, weight_values: Sequence[torch.Tensor], scalars: dict[int, Any]) -> Callable[..., Any]:
        """``fn(*user tensors)`` running the graph with these weights and scalar inputs baked in."""
        frozen = list(weight_values)
        tensor_slots = [pos for pos in range(len(self.user_index)) if pos not in scalars]

        def fn(*tensors: torch.Tensor) -> Any:
            user: list[Any] = [None] * len(self.user_index)
            for pos, t in zip(tensor_slots, tensors):
                user[pos] = t
            for pos, value in scalars.items():
                user[pos] = value
            return self.gm(*self.full_args(user, frozen))

        return fn
