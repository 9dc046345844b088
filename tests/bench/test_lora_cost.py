"""``python -m bench.lora_cost`` on the small UNet: every projection the branches target gets one, the model
with branches computes the plain model's output plus the branches' (zero factors: the same output), and the
files name the machine. It asserts no time."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.lora_cost import backend_model, main, with_low_rank_branches

pytestmark = pytest.mark.slow


def test_branches_with_zero_factors_change_nothing_and_others_do(tmp_path):
    model, inputs, backend = backend_model("unet", True, 64, tmp_path)
    branched, count = with_low_rank_branches(model, 4, 16)
    assert count > 10
    factors = branched.get_parameters()[len(inputs):]
    assert len(factors) == 2 * count
    plain = backend.compile_model(model)(inputs)[0]
    compiled = backend.compile_model(branched)

    def moved(value: float) -> float:  # relative L2 distance from the plain model's output
        fill = [np.full(p.get_partial_shape().to_shape(), value, np.float32) for p in factors]
        return float(np.linalg.norm(compiled([*inputs, *fill])[0] - plain) / np.linalg.norm(plain))

    # at bf16 the added branches change how the plugin fuses and rounds: about 1% on AVX-512 BF16
    assert moved(0.0) < 0.04
    assert moved(0.3) > 0.2


def test_quick_run_writes_the_costs(tmp_path, capsys):
    out = tmp_path / "results"
    assert main(["--quick", "--rounds", "2", "--rank", "4", "--work-dir", str(tmp_path / "work"), "--out", str(out),
                 "--name", "c"]) == 0
    result = json.loads((out / "c.json").read_text(encoding="utf-8"))
    table = (out / "c.md").read_text(encoding="utf-8")
    assert result["branches"] > 10 and len(result["times"]["plain"]) == len(result["times"]["branches"]) == 2
    assert result["plain_s"] > 0 and result["branches_s"] > 0 and len(result["compile_seconds"]) == 2
    assert result["device"] and "python -m bench.lora_cost --quick" in table
    assert "| compile after a weight change" in table and "rank-4 branch" in table
    with pytest.raises(SystemExit):
        main(["--quick", "--rank", "0", "--work-dir", str(tmp_path), "--out", str(out)])
    assert "--rank and --rounds must be at least 1" in capsys.readouterr().err
