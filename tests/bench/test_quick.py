"""The benchmark harness on small models: every variant runs and gives a finite result, files are written.

These are smoke tests of ``python -m bench --quick``: they assert no time.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from bench import build_settings
from bench.__main__ import main
from bench.settings import DEFAULT_VARIANTS


def _run(tmp_path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "results"
    assert main(["--quick", "--out", str(out), "--name", "smoke", *args]) == 0
    json_path, md_path = out / "smoke.json", out / "smoke.md"
    assert json_path.is_file() and md_path.is_file()
    return json.loads(json_path.read_text(encoding="utf-8")), md_path.read_text(encoding="utf-8")


@pytest.mark.slow
def test_quick_run_measures_every_variant(tmp_path):
    results, table = _run(tmp_path, "--components", "text_encoder", "--only", "components")
    variants = results["components"]["text_encoder"]["variants"]
    assert list(variants) == list(DEFAULT_VARIANTS)
    for name, record in variants.items():
        assert record["errors"] == [], name
        assert len(record["times"]) == 2, name
        assert record["finite"] is True, name
        assert math.isfinite(record["rel_l2_vs_eager"]), name
        assert record["cold_first_call_seconds"] > 0, name
        assert record["peak_rss_bytes"] > 0, name
        if name.startswith(("stock/", "ov_backend/")):
            assert record["warm_first_call_seconds"] > 0, name
        assert f"| {name} |" in table, name
    for name in ("ov_backend/auto", "ov_backend/f32"):
        cold, warm = variants[name]["cold_first_call_split"], variants[name]["warm_first_call_split"]
        assert cold["build"] > 0 and cold["convert"] > 0 and cold["run"] > 0, name
        assert warm["cache_hits"] >= 1 and warm["convert"] == 0 and warm["trace"] == 0, name
        assert f"| {name} | warm cache |" in table
    # f32 inference on OpenVINO matches eager fp32 closely; bf16 ("auto") only roughly
    assert variants["ov_backend/f32"]["rel_l2_vs_eager"] < 1e-4
    assert variants["ov_backend/auto"]["rel_l2_vs_eager"] < 0.1


@pytest.mark.slow
def test_quick_new_resolutions_and_whole_image(tmp_path):
    results, table = _run(tmp_path, "--only", "resolutions", "image", "--resolutions", "8x8", "12x8",
                          "--image-steps", "1")
    records = results["resolutions"]["records"]
    assert [r["latent"] for r in records] == [[8, 8], [12, 8]]
    assert all(r["finite"] for r in records)
    assert "New resolutions" in table
    image = results["image"]
    assert "error" not in image, image.get("error")
    assert {part: rec["calls"] > 0 for part, rec in image["parts"].items()} == {
        "text_encoder": True, "unet": True, "vae_decoder": True}
    assert image["image_seconds"] >= sum(rec["seconds"] for rec in image["parts"].values())
    assert "Whole image" in table


def test_settings_reject_bad_values():
    with pytest.raises(ValueError, match="unknown component"):
        build_settings({"components": ["unet", "controlnet"]})
    with pytest.raises(ValueError, match="must include 'eager'"):
        build_settings({"variants": ["static/auto"]})
    with pytest.raises(ValueError, match="unknown precision"):
        build_settings({"variants": ["eager", "static/fp16"]})
    with pytest.raises(ValueError, match="the third part is 'plain' .*, 'file' .* or no-<rewrite>"):
        build_settings({"variants": ["eager", "static/auto/plain"]})
    with pytest.raises(ValueError, match="the third part is 'plain' .*, 'file' .* or no-<rewrite>"):
        build_settings({"variants": ["eager", "ov_dynamic/auto/fast"]})
    with pytest.raises(ValueError, match="group_norm_reductions"):
        build_settings({"variants": ["eager", "ov_dynamic/auto/no-such_rewrite"]})
    with pytest.raises(ValueError, match="int8-weights is a precision of"):
        build_settings({"variants": ["eager", "static/int8-weights"]})
    chosen = ["eager", "ov_dynamic/int8/plain", "ov_dynamic/int8-weights/file",
              "ov_dynamic/auto/no-group_norm_reductions"]
    assert build_settings({"variants": chosen}).variants == tuple(chosen)
    with pytest.raises(ValueError, match="unknown benchmark setting"):
        build_settings({"round": 3})
    assert build_settings({"quick": True}).size == 64
    assert build_settings({"variants": ["static/f32", "eager"]}).variants == ("eager", "static/f32")


@pytest.mark.slow
def test_quick_dynamic_variant_takes_the_webuis_route(tmp_path):
    """ov_dynamic marks batch, height and width dynamic before the first call, as the WebUI adapter does:
    its UNet is converted once with dynamic shapes (the "dynamic" route), and matches ov_backend's result."""
    results, table = _run(tmp_path, "--components", "unet", "--only", "components", "--variants", "eager",
                          "ov_backend/f32", "ov_dynamic/f32", "ov_dynamic/f32/plain", "ov_shared/f32", "static/f32")
    variants = results["components"]["unet"]["variants"]
    dynamic = variants["ov_dynamic/f32"]
    assert dynamic["errors"] == [] and dynamic["finite"] is True
    assert any(": dynamic on CPU" in r for r in dynamic["info"]["reports"]), dynamic["info"]
    assert not any(": dynamic on CPU" in r for r in variants["ov_backend/f32"]["info"]["reports"])
    assert dynamic["rel_l2_vs_eager"] < 1e-4
    assert "| ov_dynamic/f32 |" in table
    # ov_shared: the same route with one model compiled with dynamic shapes (ov_dynamic's is per shape)
    shared = variants["ov_shared/f32"]
    assert shared["errors"] == [] and shared["rel_l2_vs_eager"] < 1e-4
    assert all("one compiled model for all shapes" in r for r in shared["info"]["reports"]), shared["info"]
    assert not any("one compiled model for all shapes" in r for r in dynamic["info"]["reports"])
    assert "| ov_shared/f32 |" in table
    # without the backend's graph rewrites: the same route and result
    plain = variants["ov_dynamic/f32/plain"]
    assert plain["errors"] == [] and plain["rel_l2_vs_eager"] < 1e-4
    assert any(": dynamic on CPU" in r for r in plain["info"]["reports"]), plain["info"]
    assert "| ov_dynamic/f32/plain |" in table


@pytest.mark.skipif(importlib.util.find_spec("nncf") is None, reason="nncf is not installed")
def test_quick_int8_variant_calibrates_in_its_first_call_and_runs_quantized(tmp_path):
    """ov_dynamic/int8 runs beside ov_dynamic/auto (one group): its first call records its calibration calls
    on the graph the timed calls use and quantizes, so every timed call runs the INT8 model."""
    results, table = _run(tmp_path, "--components", "unet", "--only", "components", "--variants", "eager",
                          "ov_dynamic/auto", "ov_dynamic/int8")
    int8 = results["components"]["unet"]["variants"]["ov_dynamic/int8"]
    assert int8["errors"] == [] and int8["finite"] is True
    reports = int8["info"]["reports"]
    assert sum(": INT8 quantization; calibrated on 4 recorded call(s)" in r for r in reports) == 1, reports
    assert "INT8 model" in reports[-1] and "int8" in reports[-1], reports
    assert int8["info"]["stats"]["quantized"] == 1
    assert int8["cold_first_call_split"]["quantize"] > 0
    assert int8["rel_l2_vs_eager"] < 0.2  # random-weight quick UNet: see tests/backend/test_int8.py for the bound
    assert "| ov_dynamic/int8 |" in table and "| quantize |" in table


@pytest.mark.slow
def test_quick_step_cache_variants_run_the_full_and_the_shallow_call(tmp_path):
    results, table = _run(tmp_path, "--components", "unet", "--only", "components", "--variants", "eager",
                          "ov_full/f32", "ov_shallow/f32")
    variants = results["components"]["unet"]["variants"]
    for name in ("ov_full/f32", "ov_shallow/f32"):
        assert variants[name]["errors"] == [], name
        # on the feature of the same inputs, the shallow call gives the full UNet's output
        assert variants[name]["rel_l2_vs_eager"] < 1e-4, name
        assert f"| {name} |" in table


@pytest.mark.slow
def test_quick_step_cache_images(tmp_path):
    from bench.step_cache import main as step_cache_main

    out = tmp_path / "results"
    assert step_cache_main(["--quick", "--samplers", "Euler a", "--intervals", "2", "--precision", "f32",
                            "--out", str(out), "--name", "sc"]) == 0
    results = json.loads((out / "sc.json").read_text(encoding="utf-8"))
    plain, cached = results["images"]
    assert (plain["interval"], cached["interval"]) == (1, 2)
    assert cached["schedule"] == "FFsFsF" and cached["shallow_calls"] == 2 and cached["full_calls"] == 4
    assert len(cached["errors"]) == 2 and all(0 < e < 10 for _step, e in cached["errors"])
    assert 10 < cached["psnr"] < 200
    table = (out / "sc.md").read_text(encoding="utf-8")
    assert "| Euler a | 2 | `FFsFsF` |" in table and "Relative L2 error" in table
