"""The supported-op table and default decompositions are clean data."""

from __future__ import annotations

from ov_backend.op_table import PYTHON_OPS, SUPPORTED_OP_NAMES
from ov_backend.ops import DEFAULT_DECOMPOSITIONS, resolve_op


def test_tables_sorted_without_duplicates():
    for table in (SUPPORTED_OP_NAMES, PYTHON_OPS, DEFAULT_DECOMPOSITIONS):
        assert list(table) == sorted(table)
        assert len(set(table)) == len(table)


def test_every_name_is_a_real_torch_op():
    unknown = [name for name in (*SUPPORTED_OP_NAMES, *DEFAULT_DECOMPOSITIONS) if resolve_op(name) is None]
    assert unknown == []


def test_stable_diffusion_ops_are_supported():
    for name in ("aten.convolution.default", "aten.native_group_norm.default", "aten.addmm.default",
                 "aten._scaled_dot_product_flash_attention_for_cpu.default", "aten.upsample_nearest2d.default",
                 "aten.native_layer_norm.default", "aten.gelu.default", "aten.silu.default"):
        assert name in SUPPORTED_OP_NAMES
