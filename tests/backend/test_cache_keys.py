"""The cache keys stay those of earlier versions: existing users' disk cache entries are found again.

Each expected key is the recipe the builds spelled out before :mod:`ov_backend.build.keys` (kept here
verbatim): a change of any key makes existing cache entries of that kind unreachable.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ov_backend import quantize
from ov_backend.build.keys import GraphKeys
from ov_backend.cache import make_key
from ov_backend.settings import build_settings

VERSIONS = {"openvino": "2026.4.1", "torch": "2.13.0", "ov_backend": "0.1"}
SIG = (((2, 4, 8, 8), "torch.float32"), ((2, 77, 768), "torch.float16"))
CODE = "def forward(self, x):\n    return x + 1\n"
DIMS = [[0, 2, 3], [0, 1]]
FP = "f" * 40


def old_key(settings: Any, what: str, sig: Any, fingerprint: str | None, extra: dict[str, Any],
            for_device: bool = True) -> str:
    chosen = settings.result_key() if for_device else settings.conversion_key()
    return make_key({"what": what, "signature": repr(sig), "weights": fingerprint,
                     "settings": chosen, "versions": dict(VERSIONS), **extra})


def test_every_kind_of_key_is_the_recipe_of_earlier_versions() -> None:
    for settings in (build_settings({}), dataclasses.replace(build_settings({"precision": "int8"}), device="GPU"),
                     build_settings({"min_partition_ops": 3, "rewrites": []})):
        keys = GraphKeys(settings, VERSIONS, CODE, DIMS)
        ranks = [(len(s[0]), s[1]) for s in SIG]
        calibration = quantize.calibration_key(settings.calibration_samples)
        assert keys.dynamic(SIG, FP, weights_as_inputs=True) == old_key(
            settings, "dynamic", ranks, None, {"graph": CODE, "dims": DIMS, "weights": "inputs"}, for_device=False)
        assert keys.dynamic(SIG, FP, weights_as_inputs=False) == old_key(
            settings, "dynamic", ranks, FP, {"graph": CODE, "dims": DIMS, "weights": "baked"}, for_device=False)
        assert keys.dynamic_failure(SIG) == old_key(settings, "dynamic-failure", ranks, None,
                                                    {"graph": CODE, "dims": DIMS})
        assert keys.all_shapes(SIG, FP) == old_key(settings, "dynamic for all shapes", ranks, FP,
                                                   {"graph": CODE, "dims": DIMS})
        assert keys.dynamic_int8(SIG, FP) == old_key(settings, "int8", ranks, FP,
                                                     {"graph": CODE, "dims": DIMS, **calibration})
        assert keys.whole(SIG, FP) == old_key(settings, "whole", SIG, FP,
                                              {"graph": CODE, "min_partition_ops": settings.min_partition_ops})
        assert keys.static_int8(SIG, FP) == old_key(
            settings, "int8", SIG, FP, {"graph": CODE, "min_partition_ops": settings.min_partition_ops, **calibration})
        assert keys.partition("fused_0", FP, CODE, "c" * 40, ["FakeTensor(...)"]) == old_key(
            settings, "partition", "fused_0", FP, {"code": CODE, "constants": "c" * 40, "inputs": ["FakeTensor(...)"]})


def test_an_int8_key_leaves_out_where_the_threads_run_and_keeps_what_the_model_computes() -> None:
    """An INT8 entry is an ``ov.Model``, compiled with the whole config where it loads: one process on every core
    and workers of one pinned thread each find the same entry; a precision hint still makes another."""
    plain = build_settings({"precision": "int8"})
    placed = build_settings({"precision": "int8", "config": {"INFERENCE_NUM_THREADS": "1", "ENABLE_CPU_PINNING": "NO",
                                                              "NUM_STREAMS": "1", "PERFORMANCE_HINT": "LATENCY"}})
    hinted = build_settings({"precision": "int8", "config": {"INFERENCE_PRECISION_HINT": "f32"}})
    keys, placed_keys, hinted_keys = (GraphKeys(one, VERSIONS, CODE, DIMS) for one in (plain, placed, hinted))
    assert placed_keys.static_int8(SIG, FP) == keys.static_int8(SIG, FP)
    assert placed_keys.dynamic_int8(SIG, FP) == keys.dynamic_int8(SIG, FP)
    assert hinted_keys.static_int8(SIG, FP) != keys.static_int8(SIG, FP)
    assert hinted_keys.dynamic_int8(SIG, FP) != keys.dynamic_int8(SIG, FP)
    # a compiled float model keeps its whole config in its key
    assert placed_keys.whole(SIG, FP) != keys.whole(SIG, FP)
