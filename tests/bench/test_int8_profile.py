"""``python -m bench.int8_profile`` on the small UNet: the INT8 model really runs 8-bit kernels, the
attention is found and split out, and the files name the machine. It asserts no time."""

from __future__ import annotations

import json

import pytest

from bench.int8_profile import bound_if_rest_2x, main

pytestmark = pytest.mark.slow


def test_quick_profile_splits_out_the_attention(tmp_path):
    out = tmp_path / "results"
    assert main(["--quick", "--samples", "2", "--rounds", "2", "--work-dir", str(tmp_path / "work"),
                 "--out", str(out), "--name", "p"]) == 0
    result = json.loads((out / "p.json").read_text(encoding="utf-8"))
    table = (out / "p.md").read_text(encoding="utf-8")
    float_run, int8_run = result["float"], result["int8"]
    # the quantized model runs integer kernels, the float one none
    assert any("i8" in kind.lower() or "u8" in kind.lower() for kind in int8_run["by_type_ms"]), int8_run
    assert not any("i8" in kind.lower() for kind in float_run["by_type_ms"]), float_run
    for run in (float_run, int8_run):
        assert 0 < run["attention_ms"] < run["profiled_ms"], run
        assert run["median_s"] > 0
    assert result["bound_if_rest_2x"] > 0 and result["speedup"] > 0
    assert 0 < float_run["matmul_ms"] < float_run["profiled_ms"] - float_run["attention_ms"], float_run
    assert len(result["times"]["float"]) == len(result["times"]["int8"]) == 2
    assert result["device"] and "python -m bench.int8_profile --quick" in table
    assert "| of it attention ms (share) |" in table


def test_bad_counts_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--quick", "--samples", "0", "--work-dir", str(tmp_path), "--out", str(tmp_path)])
    assert "--samples and --rounds must be at least 1" in capsys.readouterr().err


def test_the_bound_keeps_what_the_quantizer_keeps_at_float():
    """The bound of the AVX2 profile (oneDNN capped, README): the attention and, without VNNI, the matmuls
    stay as they are; everything else at half its float time."""
    assert bound_if_rest_2x(7955.6, 1755.9, 1760.8, 1460.0, matmuls_at_float=True) == pytest.approx(1.423, abs=1e-3)
    assert bound_if_rest_2x(7955.6, 1755.9, 1760.8, 1460.0, matmuls_at_float=False) == pytest.approx(1.637, abs=1e-3)
    assert bound_if_rest_2x(100.0, 100.0, 90.0, 0.0, matmuls_at_float=False) is None  # all of it attention
