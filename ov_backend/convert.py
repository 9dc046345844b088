"""From an FX graph to OpenVINO models: tracing, partitioning and frontend conversion.

Two conversions, both through openvino's public PyTorch frontend:

* static: the graph is traced to aten ops for one input signature with the weights as
  constants (:func:`trace_static`), split into OpenVINO-supported partitions
  (:func:`partition`), and each partition is converted (:func:`convert_partition`);
* dynamic: the whole graph is traced once with its symbolic dimensions kept dynamic
  (:func:`trace_dynamic`; ``torch.export`` where that fails) and converted once
  (:func:`convert_dynamic`); each input shape then costs only a reshape and a compile.

Every converted model goes through :mod:`ov_backend.rewrites` (the same computation, faster to run).
"""

from __future__ import annotations

import logging
import operator
import re
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import openvino as ov
import torch
import torch._dynamo.convert_frame
from openvino.frontend import FrontEndManager, OpConversionFailure
from openvino.frontend.pytorch.fx_decoder import TorchFXPythonDecoder
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner

from ov_backend import rewrites
from ov_backend.ops import OpenVINOSupport, node_op_name
from ov_backend.portable import sizes_may_be_one

logger = logging.getLogger(__name__)

def build_lock() -> AbstractContextManager[Any]:
    """Dynamo's compile lock (re-entrant), held while a graph is traced, partitioned and converted.

    FX tracing patches ``torch.nn.Module.__call__`` process-wide, and FX graph surgery uses
    torch.fx's process-wide node-metadata state; holding the lock dynamo compiles under keeps
    another thread's dynamo compile from seeing either.
    """
    lock = getattr(torch._dynamo.convert_frame, "compile_lock", None)
    return lock if lock is not None else nullcontext()


_UNCONVERTED = re.compile(r"No conversion rule found for operations:\s*(.+)")


class ConversionError(RuntimeError):
    """The OpenVINO frontend could not convert a graph.

    Attributes:
        unconverted: op names the frontend reported as having no conversion rule.
    """

    def __init__(self, message: str, unconverted: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.unconverted = tuple(unconverted)


def trace_static(fn: Callable[..., Any], inputs: Sequence[torch.Tensor],
                 decompositions: dict[Any, Callable[..., Any]]) -> torch.fx.GraphModule:
    """Trace ``fn(*inputs)`` to an aten graph for exactly these input shapes.

    Tensors ``fn`` reaches through its closure (the weights) become constants of the graph.
    The trace runs on fake tensors (shapes only, no arithmetic: a full SD UNet traces in
    seconds instead of half a minute); a graph that needs real values while tracing (data-
    dependent control flow) is traced again with real tensors.
    """
    with build_lock(), torch.no_grad():
        try:
            return make_fx(fn, decomposition_table=decompositions, tracing_mode="fake",
                           _allow_non_fake_inputs=True)(*inputs)
        except Exception as err:  # fake tensors cannot answer data-dependent questions, among others
            logger.info("fake-tensor tracing failed (%s: %s); tracing with real tensors",
                        type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            return make_fx(fn, decomposition_table=decompositions, tracing_mode="real")(*inputs)


def _inline_constants(parent: torch.fx.GraphModule, call: torch.fx.Node) -> None:
    """Move ``get_attr`` arguments of a fused submodule into it, so weights stay constants."""
    sub = parent.get_submodule(str(call.target))
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    new_args = []
    for index, (arg, ph) in enumerate(zip(call.args, placeholders)):
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
            value = _get_attr(parent, str(arg.target))
            attr = f"_ov_const_{index}"
            if isinstance(value, torch.Tensor):
                sub.register_buffer(attr, value, persistent=False)
            else:
                setattr(sub, attr, value)
            with sub.graph.inserting_before(ph):
                node = sub.graph.get_attr(attr)
            node.meta = dict(ph.meta)
            ph.replace_all_uses_with(node)
            sub.graph.erase_node(ph)
        else:
            new_args.append(arg)
    call.args = tuple(new_args)
    sub.recompile()


def _order_inputs_as_graph(parent: torch.fx.GraphModule, call: torch.fx.Node) -> None:
    """Give a partition fed only by graph inputs those inputs in the graph's own order.

    The fuser orders a partition's inputs by first use; a whole-graph partition whose inputs are
    the graph's inputs in order can then stand for the whole graph (and be cached as such).
    """
    order = {n: i for i, n in enumerate(n for n in parent.graph.nodes if n.op == "placeholder")}
    args = list(call.args)
    if call.kwargs or len(set(args)) != len(args) or not all(isinstance(a, torch.fx.Node) and a in order
                                                             for a in args):
        return
    sub = parent.get_submodule(str(call.target))
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(args):
        return
    ranked = sorted(zip(args, placeholders), key=lambda pair: order[pair[0]])
    anchor: torch.fx.Node | None = None
    for _arg, ph in ranked:
        if anchor is None:
            head = next(iter(sub.graph.nodes))
            if head is not ph:
                head.prepend(ph)
        else:
            anchor.append(ph)
        anchor = ph
    call.args = tuple(arg for arg, _ph in ranked)
    sub.recompile()


def _get_attr(module: torch.nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def partition(gm: torch.fx.GraphModule, support: OpenVINOSupport) -> tuple[torch.fx.GraphModule, list[str]]:
    """Group supported nodes into ``fused_N`` submodules; returns the graph and their names.

    Weights used by a partition are moved into it as constants.
    """
    partitioner = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True)
    partitions = partitioner.propose_partitions()
    # a partition made only of python size arithmetic is not worth a model of its own
    partitions = [p for p in partitions
                  if any(not node_op_name(n).startswith("_operator.") for n in p.nodes)]
    fused = partitioner.fuse_partitions(partitions)
    names = []
    for node in list(fused.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("fused_"):
            _inline_constants(fused, node)
            _order_inputs_as_graph(fused, node)
            names.append(str(node.target))
    fused.graph.eliminate_dead_code()
    fused.delete_all_unused_submodules()
    fused.recompile()
    return fused, names


def _conversion_error(what: str, err: OpConversionFailure) -> ConversionError:
    """A ConversionError carrying the op names the frontend reported as having no conversion rule."""
    found = _UNCONVERTED.search(str(err))
    names = [n.strip() for n in found.group(1).split(",")] if found else []
    return ConversionError(f"OpenVINO could not convert {what}: {str(err).strip()}", names)


def _frontend_convert(decoder: TorchFXPythonDecoder) -> ov.Model:
    frontend = FrontEndManager().load_by_framework("pytorch")
    try:
        # keep ``decoder`` referenced until conversion ends: the frontend calls back into it
        return frontend.convert(frontend.load(decoder))
    except OpConversionFailure as err:
        raise _conversion_error("the graph", err) from err
    except (RuntimeError, TypeError, ValueError, KeyError) as err:
        raise ConversionError(f"OpenVINO could not convert the graph: {err}") from err


def convert_partition(sub: torch.fx.GraphModule, rewrite_names: Sequence[str] = rewrites.REWRITES) -> ov.Model:
    """Convert one partition (an FX graph of supported aten ops, constants inlined), then apply the
    rewrites named in ``rewrite_names`` (:mod:`ov_backend.rewrites`)."""
    decoder = TorchFXPythonDecoder(sub)
    model = _frontend_convert(decoder)
    del decoder
    rewrites.apply(model, rewrite_names)
    return model


def _dynamic_decompositions(
        decompositions: dict[Any, Callable[..., Any]]) -> tuple[dict[Any, Callable[..., Any]], dict[Any, Any]]:
    """The decompositions of a symbolic trace, and the composite ops it keeps whole.

    The frontend converts an exported program after decomposing it to core aten ops, except the ops it
    translates itself (its list: upsampling, scaled dot product attention, linear, ...); some of its
    translations need static sizes that core aten's decompositions avoid (``split`` along a dynamic
    dimension). A symbolic trace decomposes the same way, and also as ``decompositions`` (the static
    build's) says. Kept composite ops are mapped to torch's marker for "do not decompose".

    Raises:
        ImportError: this torch or openvino lacks what the trace relies on.
    """
    from openvino.frontend.pytorch.torchdynamo.export_decompositions import ops_to_not_decompose
    from torch._decomp import core_aten_decompositions
    from torch._export.utils import _special_op_to_preserve_cia
    from torch.export.exported_program import _collect_all_valid_cia_ops

    kept_ops = set(ops_to_not_decompose()) - set(decompositions)
    table = {op: fn for op, fn in core_aten_decompositions().items() if op not in kept_ops}
    table.update(decompositions)
    composites = set(_collect_all_valid_cia_ops())
    return table, {op: _special_op_to_preserve_cia for op in kept_ops if op in composites}


def _sums_as_additions(gm: torch.fx.GraphModule) -> None:
    """Rewrite ``torch.sym_sum`` (how a trace records a sum of several sizes) as chained additions, which
    the frontend converts (it has no rule for ``sym_sum``)."""
    sums = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.sym_sum]
    for node in sums:
        terms = list(node.args[0])
        with gm.graph.inserting_before(node):
            total = terms[0]
            for term in terms[1:]:
                total = gm.graph.call_function(operator.add, (total, term))
        node.replace_all_uses_with(total)
        gm.graph.erase_node(node)
    if sums:
        gm.recompile()


def trace_dynamic(fn: Callable[..., Any], inputs: Sequence[torch.Tensor], dynamic_dims: Sequence[Sequence[int]],
                  decompositions: dict[Any, Callable[..., Any]]) -> torch.fx.GraphModule:
    """Trace ``fn(*inputs)`` once to an aten graph in which ``dynamic_dims`` of each input stay symbolic.

    The trace runs on fake tensors with symbolic sizes, as torch.export's does, but straight to the ops
    the frontend converts (:func:`_dynamic_decompositions`). (torch.export, then the frontend's own
    decomposition pass over the exported program, traced a full-size UNet twice with symbolic sizes,
    several times longer than this one trace: ``docs/backend-builds.md``.) An example size of 1 stays symbolic (torch's
    size-oblivious reasoning, as within ``portable.sizes_may_be_one``): A1111 calls its text encoder at
    a batch of 1 first.

    Raises:
        ConversionError: the graph cannot be traced this way: a dimension meant to stay dynamic is
            empty in the example, or the trace fixed one (the code branched on its value);
            :func:`convert_dynamic` then exports instead.
    """
    try:
        from torch._dispatch.python import enable_python_dispatcher
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.export.exported_program import _override_composite_implicit_decomp
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

        table, kept = _dynamic_decompositions(decompositions)
    except ImportError as err:  # another torch or openvino than the pinned ones
        raise ConversionError(f"symbolic tracing is not available here: {err}") from err
    empty = [f"input {i} dimension {d}" for i, (tensor, dims) in enumerate(zip(inputs, dynamic_dims))
             for d in dims if tensor.shape[d] == 0]
    if empty:
        raise ConversionError(f"symbolic tracing cannot keep sizes of 0 dynamic ({', '.join(empty)})")
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    symbols = []
    try:
        # the composite ops' kernels are patched process-wide while the block runs: under dynamo's lock
        with build_lock(), torch.no_grad(), sizes_may_be_one(), mode, enable_python_dispatcher(), \
                _override_composite_implicit_decomp(kept):
            fakes = []
            for tensor, dims in zip(inputs, dynamic_dims):
                sizes = [DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(tensor.dim())]
                fakes.append(mode.from_tensor(tensor, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes)))
                symbols += [size.node.expr for size in fakes[-1].shape if isinstance(size, torch.SymInt)]
            gm = make_fx(fn, decomposition_table=table, tracing_mode="fake", _allow_non_fake_inputs=True)(*fakes)
    except Exception as err:  # fake tensors and symbolic sizes fail in many ways; all mean "export instead"
        raise ConversionError(f"symbolic tracing failed: {type(err).__name__}: {str(err).splitlines()[0]}") \
            from err
    if len(symbols) != sum(len(dims) for dims in dynamic_dims):
        raise ConversionError("symbolic tracing did not give every dynamic dimension a symbol")
    fixed = [f"{symbol}={env.replace(symbol)}" for symbol in symbols if env.replace(symbol).is_number]
    if fixed:
        raise ConversionError(f"symbolic tracing fixed dynamic sizes to their example values ({', '.join(fixed)})")
    _sums_as_additions(gm)
    return gm


def convert_dynamic(fn: Callable[..., Any], inputs: Sequence[torch.Tensor], dynamic_dims: Sequence[Sequence[int]],
                    decompositions: dict[Any, Callable[..., Any]],
                    rewrite_names: Sequence[str] = rewrites.REWRITES) -> ov.Model:
    """Convert ``fn`` once with the given dimensions of each input dynamic.

    The graph is traced once with symbolic sizes (:func:`trace_dynamic`) and converted; if that fails,
    it is exported with ``torch.export`` and the exported program converted (slower: two symbolic
    traces).

    Args:
        fn: takes exactly ``inputs``; weights reached through its closure become constants, weights
            among the inputs become parameters (static shapes: give them no dynamic dimension).
        inputs: example tensors.
        dynamic_dims: for each input, the dimensions to keep dynamic.
        decompositions: the static build's decomposition table (the one-trace conversion adds to it).
        rewrite_names: the rewrites (:mod:`ov_backend.rewrites`) applied to the converted model.

    Raises:
        ConversionError: export or conversion failed.
    """
    try:
        traced = trace_dynamic(fn, inputs, dynamic_dims, decompositions)
        decoder = TorchFXPythonDecoder(traced, dynamic_shapes=True)
        model = _frontend_convert(decoder)
        del decoder
        rewrites.apply(model, rewrite_names, [tuple(t.shape) for t in inputs])
        return model
    except ConversionError as err:
        # the frontend's summary lines ("-- No conversion rule found for ...", "-- Conversion is failed for
        # ...") say more than its first line
        summary = [line[3:] for line in str(err).splitlines() if line.startswith("-- ")]
        reason = "; ".join(summary) if summary else str(err).splitlines()[0]
        logger.info("converting with one symbolic trace failed (%s); exporting with torch.export instead", reason)
    from torch.export import Dim, export

    class _Wrapper(torch.nn.Module):
        def forward(self, *args: torch.Tensor) -> Any:
            return fn(*args)

    shapes = tuple({d: Dim.AUTO for d in dims} or None for dims in dynamic_dims)
    try:
        with build_lock(), torch.no_grad():
            program = export(_Wrapper(), tuple(inputs), dynamic_shapes=(shapes,), strict=False)
    except Exception as err:  # torch.export raises many kinds; all mean "cannot export"
        raise ConversionError(f"torch.export could not capture the graph: {type(err).__name__}: {err}") \
            from err
    try:
        model = ov.convert_model(program)
    except OpConversionFailure as err:
        raise _conversion_error("the exported graph", err) from err
    except Exception as err:  # the converter raises plain Exceptions for unsupported programs
        raise ConversionError(f"OpenVINO could not convert the exported graph: {err}") from err
    rewrites.apply(model, rewrite_names)
    return model


def symbolic_min_max(gm: torch.fx.GraphModule) -> list[str]:
    """The nodes of ``gm`` that take Python's ``max()`` / ``min()`` of symbolic sizes (``torch.sym_max`` /
    ``torch.sym_min``).

    OpenVINO's frontend has no rule for them, so such a graph cannot be converted with dynamic shapes:
    A1111's InvokeAI attention (its CPU default) slices its queries by ``max(tokens // div, 1)``. Found
    up front, the full-size UNet goes the static build at once instead of after a failed export of
    minutes. (Rewriting them into integer arithmetic the frontend takes does convert, but the full-size
    UNet's step then ran slower than the static build's in the real-WebUI benchmark:
    ``docs/backend-builds.md``.)
    """
    return [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target in (torch.sym_max, torch.sym_min)]
