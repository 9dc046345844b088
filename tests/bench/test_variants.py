"""The bench's variant names (``bench/variants.py``), a unit test that runs in CI (``test_quick.py``, which also
checks them, is a bench-marked end-to-end file)."""

from __future__ import annotations

import pytest

from bench.variants import parse_variant


def test_a_variant_without_one_rewrite_names_it_and_keeps_the_others() -> None:
    spec = parse_variant("ov_dynamic/auto/no-group_norm_reductions")
    assert spec.rewrites and spec.without == "group_norm_reductions" and not spec.weights_in_file
    assert spec.name == "ov_dynamic/auto/no-group_norm_reductions"
    assert parse_variant("ov_dynamic/f32/plain").without == "" and not parse_variant("ov_dynamic/f32/plain").rewrites
    with pytest.raises(ValueError, match="no-<rewrite> .*split_projections, group_norm_reductions"):
        parse_variant("ov_dynamic/auto/no-such_rewrite")
    with pytest.raises(ValueError, match="for .*ov_backend.* only"):
        parse_variant("static/auto/no-group_norm_reductions")
