"""8-bit weights: a converted model's weights compressed to 8 bits before it is compiled.

The precision ``"int8-weights"`` (:data:`ov_backend.precision.COMPRESSED_PRECISIONS`) keeps each matmul's
weights at 8 bits, asymmetric, with one scale and zero point per output channel; the CPU plugin unpacks them
inside its kernels, and the computation stays at the device's float precision, as at ``"auto"``. Those weights
then take a quarter of their f32 bytes (half of bf16's), for a small loss of quality (``docs/memory.md`` measures
both). Convolutions stay at float (:data:`COMPRESSED_OPS` says why). Unlike ``"int8"`` nothing is calibrated:
the first call runs the compressed model.

Each weight is compressed on its own, in the graph OpenVINO's weight compression (NNCF's ``INT8_ASYM``)
makes and the CPU plugin recognises: ``Convert(u8 weight) - Convert(u8 zero point)``, times an f16 scale,
converted to f32, into the matmul. Doing it here, one weight at a time, keeps the transient
memory to a layer's worth: NNCF's own pass held about as much again as the model while it ran (measured,
``docs/memory.md``), which on a full SDXL UNet is gigabytes.

The converted model stays at float (it reads the PyTorch tensors, :mod:`ov_backend.weight_binding`): each
compile compresses a copy, so a weight changed in place (a LoRA) is compressed anew, never stale.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from ov_backend.rewrites import fold_weight_splits, share_weight_sections

logger = logging.getLogger(__name__)

#: Weights with fewer elements stay at float (biases, norms, tiny projections: no memory to save).
MIN_ELEMENTS = 4096
#: The ops whose weights are compressed: matmuls only. The CPU plugin unpacks a matmul's 8-bit weights inside its
#: kernels, but folds a convolution's back to a float copy it keeps beside the 8-bit one: 16 3x3 convolutions
#: (0.22 GiB at f32) held 0.07 GiB more compressed than left at float and packed at bf16, where 16 linear layers
#: (0.25 GiB) held 0.25 GiB less (Zen 4, OpenVINO 2026.4.1; docs/memory.md).
COMPRESSED_OPS = ("MatMul",)


#: Where the 8-bit weights go: (bytes of each) -> a writable uint8 array of each size, or None to keep them in
#: memory (``ov_backend.WeightFile.arrays``: a file whose pages leave the process once the plugin packed them).
Storage = Callable[[Sequence[int]], "list[np.ndarray] | None"]


def compress_weights(model: ov.Model, storage: Storage | None = None) -> ov.Model:
    """A copy of ``model`` whose matmul weights are 8-bit (see the module's docstring).

    ``storage``: where the 8-bit weights are written (the plugin keeps them alive beside its packed copy of them;
    in a weight file, their pages leave the process). Default: OpenVINO's own memory.
    """
    start = time.perf_counter()
    model = model.clone()
    share_weight_sections(model)  # a projection's weight as a constant, not behind a split
    fold_weight_splits(model)
    _transposed_weights_as_matmul_attributes(model)
    chosen: dict[int, tuple[ov.Node, int, list[ov.Node]]] = {}  # a constant feeding several ops is compressed once
    for op in model.get_ordered_ops():
        if op.get_type_name() not in COMPRESSED_OPS:
            continue
        constant = op.input_value(1).get_node()
        if constant.get_type_name() != "Constant" or not constant.get_output_element_type(0).is_real():
            continue
        shape = constant.get_output_shape(0)
        axis = _channel_axis(op, len(shape))
        if axis is None or int(np.prod(list(shape))) < MIN_ELEMENTS:
            continue
        chosen.setdefault(id(constant), (constant, axis, []))[2].append(op)
    sizes = [int(np.prod(list(c.get_output_shape(0)))) for c, _axis, _ops in chosen.values()]
    buffers = storage(sizes) if storage is not None and sizes else None
    for i, (constant, axis, users) in enumerate(chosen.values()):
        replacement = _compressed(constant, axis, users[0].get_input_element_type(1),
                                  buffers[i] if buffers is not None else None)
        for op in users:
            op.input(1).replace_source_output(replacement)
    model.validate_nodes_and_infer_types()
    eight, total = _eight_bit_share(model)
    logger.info("compressed the weights to 8 bits in %.1fs: %d of %d weight elements%s", time.perf_counter() - start,
                eight, total, " (in a memory-mapped file)" if buffers is not None else "")
    return model


def _channel_axis(op: ov.Node, rank: int) -> int | None:
    """The axis of the weight's output channels (one scale each), or None when it has none to keep apart."""
    if rank < 2:
        return None
    return rank - 2 if op.get_attributes()["transpose_b"] else rank - 1


def _compressed(constant: ov.Node, axis: int, float_type: ov.Type, out: np.ndarray | None = None) -> ov.Output:
    """The 8-bit weight (written into ``out``, a uint8 array of its size, when given), its zero points and scales,
    and the subgraph that gives the float weight back."""
    w = np.asarray(constant.get_data(), dtype=np.float32)
    reduce = tuple(i for i in range(w.ndim) if i != axis)
    low = np.minimum(w.min(axis=reduce, keepdims=True), 0.0)
    high = np.maximum(w.max(axis=reduce, keepdims=True), 0.0)
    scale = (high - low) / 255.0
    scale[scale == 0] = 1.0
    zero = np.clip(np.round(-low / scale), 0, 255)
    q = np.clip(np.round(w / scale) + zero, 0, 255).astype(np.uint8)
    if out is not None:
        placed = out.reshape(q.shape)
        placed[...] = q
        del q
        packed = ops.constant(placed, dtype=ov.Type.u8, shared_memory=True)  # (it keeps ``out`` alive)
    else:
        packed = ops.constant(q, dtype=ov.Type.u8)
    scale16 = scale.astype(np.float16)
    scale16[scale16 == 0] = np.float16(np.finfo(np.float16).tiny)  # (a scale below f16's range)
    weight = ops.convert(packed, ov.Type.f16)
    zero_point = ops.convert(ops.constant(zero.astype(np.uint8), dtype=ov.Type.u8), ov.Type.f16)
    name = constant.get_friendly_name()
    shifted = ops.subtract(weight, zero_point, name=f"{name}/zero_point/subtract")
    unpacked = ops.multiply(shifted, ops.constant(scale16, dtype=ov.Type.f16), name=f"{name}/fq_weights")
    return ops.convert(unpacked, float_type, name=f"{name}/fq_weights/convert").output(0)


def _transposed_weights_as_matmul_attributes(model: ov.Model) -> int:
    """``MatMul(x, Transpose(W, [.., 1, 0]))`` -> ``MatMul(x, W, transpose_b=not transpose_b)``, where ``W`` is a
    constant (``aten.t`` of a linear layer's weight, as the static trace gives it), so that the weight is the
    matmul's own constant. No data is copied. Returns how many were rewritten."""
    done = 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "MatMul":
            continue
        weight = op.input_value(1)
        transpose = weight.get_node()
        if transpose.get_type_name() != "Transpose":
            continue
        source = transpose.input_value(0)
        perm = transpose.input_value(1).get_node()
        if source.get_node().get_type_name() != "Constant" or perm.get_type_name() != "Constant":
            continue
        order = [int(v) for v in perm.get_data().reshape(-1)]
        rank = len(order)
        if rank < 2 or order != [*range(rank - 2), rank - 1, rank - 2]:
            continue
        attributes = op.get_attributes()
        replacement = ops.matmul(op.input_value(0), source, bool(attributes["transpose_a"]),
                                 not bool(attributes["transpose_b"]))
        replacement.set_friendly_name(op.get_friendly_name())
        op.output(0).replace(replacement.output(0))
        done += 1
    if done:
        model.validate_nodes_and_infer_types()
    return done


def _eight_bit_share(model: ov.Model) -> tuple[int, int]:
    """(elements of 8-bit constants, elements of all constants of more than 1024 elements) in ``model``."""
    eight = total = 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Constant":
            continue
        n = 1
        for d in op.get_output_shape(0):
            n *= int(d)
        if n <= 1024:
            continue
        total += n
        if op.get_output_element_type(0) in (ov.Type.u8, ov.Type.i8):
            eight += n
    return eight, total
