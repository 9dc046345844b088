"""Graph rewrites of a converted model that make the same computation faster to run.

:func:`split_projections`: a projection whose output is split along its features (a GEGLU's
``proj(x).chunk(2, -1)`` in every transformer block of an SD UNet) becomes one projection per
section. The CPU plugin runs such a split with a reference kernel that copies the whole output
(its share of a UNet call: ``bench/results/int8-profile-amx-2026-11-24.md``, ``docs/benchmarks.md``);
two projections of half the width cost what one did, and each feeds its consumer directly. The
weights are not copied: each projection reads its rows of the weight through a split of the weight
itself (a weight that is a model input stays one, so a model stored without its weights still binds
them).

:func:`for_compiling` gives the device each section of a bound weight as a constant that reads its piece
of the weight's memory: left to the device, the split would be folded into copies of the weights at
every compile, costing compile time and memory (``docs/backend-builds.md``). The model kept for
later compiles and the disk cache keeps the split.

:func:`fold_weight_splits` folds the weight splits that remain into constants, for tools that look for
a projection's weight as a constant (NNCF's quantizer).

:func:`group_norm_reductions`: each group norm becomes the reductions it stands for, whose sums do not
depend on the number of threads (the CPU plugin's own group norm kernel's do): a picture is then the same
bytes on 1 thread or 64, so a batch job's workers render what one process would.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence

import numpy as np
import openvino as ov
import openvino.opset13 as ops

logger = logging.getLogger(__name__)

#: what each rewrite is called in cache keys (a model converted without it is another model)
REWRITES = ("split_projections", "group_norm_reductions")


def apply(model: ov.Model, names: Sequence[str] = REWRITES,
          input_shapes: Sequence[Sequence[int]] | None = None) -> dict[str, int]:
    """Apply the rewrites named in ``names`` (of :data:`REWRITES`) to ``model`` in place; returns how often
    each rewrote it. ``input_shapes``: the shape of each model input, where the model's own are dynamic."""
    done = {}
    if "split_projections" in names:
        done["split_projections"] = split_projections(model, input_shapes)
    if "group_norm_reductions" in names:
        done["group_norm_reductions"] = group_norm_reductions(model)
    return done


def _constant_ints(value: ov.Output) -> list[int] | None:
    node = value.get_node()
    if node.get_type_name() != "Constant":
        return None
    return [int(v) for v in np.asarray(node.get_data()).reshape(-1)]


def _static_shape(value: ov.Output, input_shapes: dict[str, list[int]]) -> list[int] | None:
    """The shape of ``value``, from the model, or for a model input of dynamic shape from ``input_shapes``."""
    shape = value.get_partial_shape()
    if shape.is_static:
        return [int(d) for d in shape.to_shape()]
    node = value.get_node()
    known = input_shapes.get(node.get_friendly_name()) if node.get_type_name() == "Parameter" else None
    return known if known is not None and shape.compatible(ov.PartialShape(known)) else None


def _is_weight(value: ov.Output) -> bool:
    return value.get_node().get_type_name() in ("Constant", "Parameter")


def split_projections(model: ov.Model, input_shapes: Sequence[Sequence[int]] | None = None) -> int:
    """Rewrite in place each ``split(matmul(x, W) [+ b], last axis)`` into one ``matmul(x, W_i) [+ b_i]``
    per section; returns how many splits were rewritten.

    Only where that is the same computation whatever the tensors hold: the split's axis is a constant,
    and its section sizes are constants or static, ``W`` and ``b`` are weights (constants or model inputs,
    e.g. a weight bound later) whose shapes are known (``input_shapes``: the shape of each model input, in
    order, for inputs of dynamic shape), the
    sections add up to ``W``'s output features, ``b`` has one value per feature, and nothing else reads
    the projection's output.
    """
    parameters = model.get_parameters()
    shapes = ({p.get_friendly_name(): [int(d) for d in shape] for p, shape in zip(parameters, input_shapes)}
              if input_shapes is not None and len(input_shapes) == len(parameters) else {})
    rewritten = 0
    for split in model.get_ordered_ops():
        kind = split.get_type_name()
        if kind not in ("VariadicSplit", "Split"):
            continue
        data = split.input_value(0)
        rank = data.get_partial_shape().rank
        axis = _constant_ints(split.input_value(1))
        if rank.is_dynamic or axis is None or len(axis) != 1 or axis[0] not in (-1, rank.get_length() - 1):
            continue
        producer, bias = data.get_node(), None
        if producer.get_type_name() == "Add":
            first, second = producer.input_value(0), producer.input_value(1)
            product, bias = (first, second) if _is_weight(second) else (second, first)
            if not _is_weight(bias):
                continue
        else:
            product = data
        matmul = product.get_node()
        if matmul.get_type_name() != "MatMul" or not _is_weight(matmul.input_value(1)):
            continue
        if bias is not None and len(product.get_target_inputs()) != 1:
            continue  # the whole projection is read elsewhere too: splitting it would compute it twice
        readers = [target.get_node() for target in data.get_target_inputs()]
        shape_readers = [node for node in readers if node.get_type_name() == "ShapeOf"]
        if len(readers) - len(shape_readers) != 1 or (shape_readers and not data.get_partial_shape().is_static):
            continue  # as above; a static shape read elsewhere (a TorchScript chunk's sizes) becomes a constant
        attributes = matmul.get_attributes()
        weight = matmul.input_value(1)
        weight_shape = _static_shape(weight, shapes)
        if weight_shape is None or len(weight_shape) != 2:
            continue
        weight_axis = 0 if attributes["transpose_b"] else 1
        features = weight_shape[weight_axis]
        if kind == "VariadicSplit":
            lengths = _constant_ints(split.input_value(2))
            if lengths is None:  # sizes computed in the graph (a TorchScript chunk): the outputs' if static
                last = [split.get_output_partial_shape(i)[rank.get_length() - 1]
                        for i in range(split.get_output_size())]
                lengths = [d.get_length() for d in last] if all(d.is_static for d in last) else None
        else:
            parts = int(split.get_attributes()["num_splits"])
            lengths = [features // parts] * parts if parts and features % parts == 0 else None
        if not lengths or any(n <= 0 for n in lengths) or sum(lengths) != features:
            continue
        if bias is not None:
            bias_shape = _static_shape(bias, shapes)
            if bias_shape is None or not bias_shape or bias_shape[-1] != features \
                    or any(d != 1 for d in bias_shape[:-1]):
                continue
        for reader in shape_readers:
            shape = np.array([int(d) for d in data.get_partial_shape().to_shape()],
                             dtype=reader.get_output_element_type(0).to_dtype())
            reader.output(0).replace(ops.constant(shape).output(0))
        sizes = ops.constant(np.array(lengths, dtype=np.int64))
        weights = ops.variadic_split(weight, ops.constant(np.int64(weight_axis)), sizes)
        biases = ops.variadic_split(bias, ops.constant(np.int64(-1)), sizes) if bias is not None else None
        for i in range(len(lengths)):
            section = ops.matmul(matmul.input_value(0), weights.output(i), attributes["transpose_a"],
                                 attributes["transpose_b"])
            section.set_friendly_name(f"{matmul.get_friendly_name()}/section{i}")
            out = ops.add(section, biases.output(i)) if biases is not None else section
            split.output(i).replace(out.output(0))
        rewritten += 1
    if rewritten:
        model.validate_nodes_and_infer_types()
        logger.debug("split %d projection(s) by their output sections", rewritten)
    return rewritten


def group_norm_reductions(model: ov.Model) -> int:
    """Rewrite in place each ``GroupNormalization`` into the reductions it stands for; returns how many.

    The CPU plugin's own GroupNormalization kernel splits the sums of a group between its threads: its
    result differs in the last bit from one thread count to another (measured on SD UNet and VAE shapes from
    (2, 1280, 8, 8) to (1, 128, 512, 512), 1 to 64 threads), and through a sampler's steps a picture by 1/255
    on many pixels (45 dB on full-size SD 1.5 between one process on 2 threads and two workers of 1).
    ``ReduceMean`` over a group sums each group on one thread: the same bytes on 1 to 64 threads, and as fast
    (``docs/benchmarks.md``, "Graph rewrites").

    For data of shape (N, C, ...) in G groups: ``x`` as (N, G, -1), ``d = x - mean(x)``,
    ``d / sqrt(mean(d * d) + eps)`` as (N, C, ...), times the scale and plus the bias of each channel:
    PyTorch's ``group_norm``, the variance computed from the deviations as its own kernel does. Data of a
    16-bit type is normalized at f32 (as the op itself computes it) and converted back.
    """
    f32 = ov.Type.f32
    rewritten = 0
    for norm in model.get_ordered_ops():
        if norm.get_type_name() != "GroupNormalization":
            continue
        data, scale, bias = (norm.input_value(i) for i in range(3))
        rank = data.get_partial_shape().rank
        if rank.is_dynamic or rank.get_length() < 2:
            continue
        attributes = norm.get_attributes()
        groups, epsilon = int(attributes["num_groups"]), float(attributes["epsilon"])
        kind = data.get_element_type()

        def at_f32(value: ov.Output) -> ov.Output:
            return value if value.get_element_type() == f32 else ops.convert(value, f32).output(0)

        grouped = ops.reshape(at_f32(data), ops.constant(np.array([0, groups, -1], dtype=np.int64)),
                              special_zero=True)
        axis = ops.constant(np.array([2], dtype=np.int64))
        deviation = ops.subtract(grouped, ops.reduce_mean(grouped, axis, keep_dims=True))
        variance = ops.reduce_mean(ops.multiply(deviation, deviation), axis, keep_dims=True)
        normed = ops.divide(deviation, ops.sqrt(ops.add(variance, ops.constant(np.float32(epsilon)))))
        shaped = ops.reshape(normed, ops.shape_of(data), special_zero=False)
        per_channel = ops.constant(np.array([-1] + [1] * (rank.get_length() - 2), dtype=np.int64))
        out = ops.add(ops.multiply(shaped, ops.reshape(at_f32(scale), per_channel, special_zero=False)),
                      ops.reshape(at_f32(bias), per_channel, special_zero=False))
        if kind != f32:
            out = ops.convert(out, kind)
        out.set_friendly_name(norm.get_friendly_name())
        norm.output(0).replace(out.output(0))
        rewritten += 1
    if rewritten:
        model.validate_nodes_and_infer_types()
        logger.debug("wrote %d group norm(s) as reductions", rewritten)
    return rewritten


def _constant_array(constant: ov.Node) -> np.ndarray:
    """A constant's values as numpy holds them (bf16 as its 16-bit patterns)."""
    data = constant.get_data()
    return data.view(np.uint16) if constant.get_output_element_type(0) == ov.Type.bf16 else data


def _constant_split(split: ov.Node) -> tuple[ov.Node, int, list[int]] | None:
    """For a split of a constant along one constant axis into sections of constant sizes: the constant, the
    axis (counted from the first) and the sizes; else None."""
    if split.get_type_name() != "VariadicSplit" or split.input_value(0).get_node().get_type_name() != "Constant":
        return None
    constant = split.input_value(0).get_node()
    shape = [int(d) for d in constant.get_output_shape(0)]
    axis, lengths = _constant_ints(split.input_value(1)), _constant_ints(split.input_value(2))
    if not shape or axis is None or len(axis) != 1 or lengths is None or any(n < 0 for n in lengths):
        return None  # (a size of -1, "the rest", is not taken either)
    index = axis[0] % len(shape)
    return (constant, index, lengths) if sum(lengths) == shape[index] else None


def _sections(data: np.ndarray, axis: int, lengths: Sequence[int]) -> list[np.ndarray]:
    """Views of ``data``'s sections of ``lengths`` along ``axis``."""
    bounds = np.cumsum([0, *lengths])
    index = [slice(None)] * data.ndim
    views = []
    for i in range(len(lengths)):
        index[axis] = slice(int(bounds[i]), int(bounds[i + 1]))
        views.append(data[tuple(index)])
    return views


def fold_weight_splits(model: ov.Model) -> int:
    """Replace in place each split of a constant by constants (copies of its sections); returns how many."""
    folded = 0
    for split in model.get_ordered_ops():
        found = _constant_split(split)
        if found is None:
            continue
        constant, axis, lengths = found
        element = constant.get_output_element_type(0)
        for i, section in enumerate(_sections(_constant_array(constant), axis, lengths)):
            # a tensor of its own (a constant made from a numpy array's memory would outlive it)
            values = ov.Tensor(element, list(section.shape))
            values.data.view(section.dtype)[...] = section
            split.output(i).replace(ov.op.Constant(values).output(0))
        folded += 1
    if folded:
        model.validate_nodes_and_infer_types()
    return folded


def _aliasing_array(constant: ov.Node) -> np.ndarray:
    """A numpy array over a constant's memory that OpenVINO accepts for a constant sharing memory (it
    takes only writable arrays; a constant's own data is read-only) and that keeps the constant, and so
    the memory it reads, alive (bf16 as its 16-bit patterns)."""
    data = _constant_array(constant)
    memory = (ctypes.c_char * data.nbytes).from_address(data.ctypes.data)
    memory.owner = constant  # type: ignore[attr-defined]  (the array's base keeps the constant)
    return np.frombuffer(memory, dtype=data.dtype).reshape(data.shape)


def _split_in_pieces(split: ov.Node) -> tuple[ov.Node, int, list[int]] | None:
    """:func:`_constant_split` where each section is one piece of the constant's memory (every dimension
    before the axis has one element)."""
    found = _constant_split(split)
    if found is None or any(int(d) != 1 for d in found[0].get_output_shape(0)[:found[1]]):
        return None
    return found


def share_weight_sections(model: ov.Model) -> int:
    """Replace in place each split of a constant whose sections are each one piece of its memory (a
    projection's weight split by :func:`split_projections`, once the weight is bound) by constants that
    read those pieces: no copy, where the device would otherwise fold the split into copies when it
    compiles (memory and compile time for each). The new constants keep the old
    one, and so the memory it reads, alive. Returns how many splits were replaced.

    For models about to be compiled only: a model given to the disk cache must keep its splits (the
    cache stores no weight, and recognizes a weight by its whole memory)."""
    shared = 0
    for split in model.get_ordered_ops():
        found = _split_in_pieces(split)
        if found is None:
            continue
        constant, axis, lengths = found
        element = constant.get_output_element_type(0)
        try:
            data = _aliasing_array(constant)
        except (RuntimeError, TypeError, ValueError):  # a type numpy cannot view: left to the device
            continue
        # views of ``data``: through their base they keep the constant alive
        for i, section in enumerate(_sections(data, axis, lengths)):
            values = ov.Tensor(section, list(section.shape), element) if element == ov.Type.bf16 else section
            split.output(i).replace(ov.op.Constant(values, shared_memory=True).output(0))
        shared += 1
    if shared:
        model.validate_nodes_and_infer_types()
    return shared


def for_compiling(model: ov.Model) -> ov.Model:
    """``model``, or where it splits a constant into pieces of its memory, a copy that reads the pieces
    (:func:`share_weight_sections`): what to give a device to compile. ``model`` itself is left as it was."""
    if not any(_split_in_pieces(op) is not None for op in model.get_ordered_ops()):
        return model
    copy = model.clone()
    share_weight_sections(copy)
    return copy
