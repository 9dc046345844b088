"""8-bit weights: a converted model's weights compressed with NNCF before it is compiled.

The precision ``"int8-weights"`` (:data:`ov_backend.precision.COMPRESSED_PRECISIONS`) keeps each matmul's and
convolution's weights at 8 bits (asymmetric, one scale and zero point per output channel), which the CPU
plugin unpacks inside its kernels; the computation stays at the device's float precision, as at ``"auto"``.
A compiled model then holds about a quarter of its f32 weights' bytes (half of bf16's), for a small loss of
quality (``docs/memory.md`` measures both). Unlike ``"int8"`` nothing is calibrated: the first call runs
the compressed model.

The converted model stays at float (it reads the PyTorch tensors, :mod:`ov_backend.weight_binding`): each
compile compresses a copy, so a weight changed in place (a LoRA) is compressed anew, never stale.
"""

from __future__ import annotations

import logging
import time

import openvino as ov
import openvino.opset13 as ops

from ov_backend.quantize import QuantizationError, nncf_problem
from ov_backend.rewrites import fold_weight_splits, share_weight_sections

logger = logging.getLogger(__name__)


def compress_weights(model: ov.Model) -> ov.Model:
    """A copy of ``model`` with 8-bit weights (NNCF's ``INT8_ASYM`` weight compression, every weighted op).

    Raises:
        QuantizationError: NNCF is missing or failed.
    """
    problem = nncf_problem()
    if problem is not None:
        raise QuantizationError(problem.replace("INT8 needs", "8-bit weights need"))
    start = time.perf_counter()
    try:
        import nncf

        model = model.clone()
        # NNCF finds a projection's weight as a constant, not behind a split
        share_weight_sections(model)
        fold_weight_splits(model)
        _transposed_weights_as_matmul_attributes(model)
        level = logging.getLogger("nncf").level
        nncf.set_log_level(logging.ERROR)  # (its per-model table of bit widths)
        try:
            compressed = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
        finally:
            nncf.set_log_level(level or logging.INFO)
    except Exception as err:  # NNCF raises many kinds; the float model stays as it was
        raise QuantizationError(f"NNCF could not compress the weights: {type(err).__name__}: {err}") from err
    eight, total = _eight_bit_share(compressed)
    logger.info("compressed the weights to 8 bits in %.1fs: %d of %d weight elements", time.perf_counter() - start,
                eight, total)
    return compressed


def _transposed_weights_as_matmul_attributes(model: ov.Model) -> int:
    """``MatMul(x, Transpose(W, [.., 1, 0]))`` -> ``MatMul(x, W, transpose_b=not transpose_b)``, where ``W`` is a
    constant (``aten.t`` of a linear layer's weight, as the static trace gives it): NNCF compresses a matmul's
    weight only where it is the constant itself. No data is copied. Returns how many were rewritten."""
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
