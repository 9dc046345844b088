"""The machine line of every bench report says when oneDNN's kernels were capped to emulate an older CPU
(``ONEDNN_MAX_CPU_ISA``), so that an emulated figure is never read as the CPU's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.report import isa_cap_note, machine


def test_an_isa_cap_is_recorded_and_named(monkeypatch):
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    info = machine()
    assert info["onednn_isa_cap"] == "AVX2"
    note = isa_cap_note(info)
    assert "oneDNN capped at AVX2 (ONEDNN_MAX_CPU_ISA=AVX2)" in note and "emulation" in note


def test_no_cap_no_note(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    info = machine()
    assert "onednn_isa_cap" not in info and isa_cap_note(info) == ""


def test_the_webui_results_name_no_folder_of_the_machine(tmp_path):
    from pathlib import Path

    from bench.webui_report import testbed_label

    checkout = Path(__file__).resolve().parents[2]
    assert testbed_label(checkout / "build" / "a1111-testbed") == str(Path("build") / "a1111-testbed")
    assert testbed_label(tmp_path / "a1111") == "$A1111_ROOT"


def fake_test_bed(bed):
    """The files that make a folder count as a test bed (``testbed_ready``), empty."""
    for name in ("webui/launch.py", "venv/bin/python",
                 "hf-home/hub/models--openai--clip-vit-large-patch14/snapshots/x/vocab.json"):
        (bed / name).parent.mkdir(parents=True, exist_ok=True)
        (bed / name).write_text("")
    return bed


def test_a_relative_test_bed_is_taken_from_where_the_bench_started(tmp_path, monkeypatch):
    # the WebUI runs in its own folder: "build/a1111-testbed" given from the checkout must still name it there
    from bench.webui import build_settings

    bed = fake_test_bed(tmp_path / "bed")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("A1111_ROOT", "bed")
    assert build_settings({}).testbed == bed
    assert build_settings({"testbed": "bed"}).testbed == bed


def test_a_new_size_is_also_compared_by_what_it_adds_to_its_run():
    # a short run makes a second size's whole request large against the cold one; what it adds is compared too
    from bench.webui_report import goals

    def row(key, seconds, run):
        return {"mode": "auto", "key": key, "seconds": seconds, "run_seconds": run}

    results = {"settings": {"precisions": ["auto"]},
               "rows": [row("first", 60.0, 20.0), row("size2", 20.0, 16.0)], "phases": []}
    lines = goals(results)
    whole = next(x for x in lines if x.startswith("| second size / cold first generation |"))
    added = next(x for x in lines if x.startswith("| second size / cold first generation, seconds above the run |"))
    assert "0.33x" in whole and "0.10x" in added  # 20/60, and (20-16)/(60-20)
    assert any("depend on the step count" in x for x in lines)


def test_the_previous_weights_setting_is_checked_and_named(tmp_path, monkeypatch):
    from bench.webui import build_settings

    bed = fake_test_bed(tmp_path / "bed")
    monkeypatch.setenv("A1111_ROOT", str(bed))
    assert build_settings({"previous_weights": "release"}).previous_weights == "release"
    assert build_settings({}).previous_weights == ""
    with pytest.raises(ValueError, match="previous_weights must be auto or keep or release, got 'sometimes'"):
        build_settings({"previous_weights": "sometimes"})


def test_chosen_rows_bring_the_rows_they_are_measured_against(tmp_path, monkeypatch):
    # a step caching row is compared with the uncached "again", the restart with the cold "first" (whose run
    # also fills the disk cache the restart reads)
    from bench.webui_rows import build_settings

    monkeypatch.setenv("A1111_ROOT", str(fake_test_bed(tmp_path / "bed")))
    assert build_settings({"rows": ("cache3",)}).rows == ("again", "cache3")
    assert build_settings({"rows": ("restart", "cache2")}).rows == ("first", "again", "cache2", "restart")


def test_the_sdxl_model_runs_at_its_sizes_without_the_rows_it_cannot_take(tmp_path, monkeypatch):
    from bench.webui_rows import NOT_SDXL, build_settings

    monkeypatch.setenv("A1111_ROOT", str(fake_test_bed(tmp_path / "bed")))
    config = build_settings({"model": "sdxl"})
    assert config.sizes[0] == (1024, 1024) and config.rows and not set(config.rows) & set(NOT_SDXL)
    assert build_settings({"model": "sdxl", "sizes": ((768, 768), (768, 512), (512, 768))}).sizes[0] == (768, 768)
    with pytest.raises(ValueError, match="with model sdxl only first, again, .*got first, lora"):
        build_settings({"model": "sdxl", "rows": ("first", "lora")})
    with pytest.raises(ValueError, match="model must be sd15 or sdxl"):
        build_settings({"model": "sd3"})
    with pytest.raises(ValueError, match="model must be"):
        build_settings({"model": "sdxl", "tiny": True})


def test_the_step_caching_table_compares_with_the_same_precisions_uncached_request():
    from bench.webui_report import step_cache_lines

    def row(key, interval, seconds, s_per_it, **extra):
        return {"mode": "auto", "key": key, "label": key, "step_cache_interval": interval, "seconds": seconds,
                "s_per_it": s_per_it, "compile_seconds": 0.0, **extra}

    rows = [row("again", 1, 300.0, 15.0, psnr_vs_stock=84.0),
            row("cache3", 3, 200.0, 10.0, psnr_vs_uncached=47.6, psnr_vs_stock=47.5,
                step_cache={"full_calls": 8, "shallow_calls": 12})]
    lines = step_cache_lines(rows, ["auto"])
    cached = next(x for x in lines if x.startswith("| auto | cache3 |"))
    assert [c.strip() for c in cached.strip("|").split("|")] == [
        "auto", "cache3", "3", "200.0", "1.50x", "10.00", "1.50x", "8", "12", "0.0", "47.6", "47.5"]
    assert step_cache_lines(rows[:1], ["auto"]) == []  # no step caching row: no table


def fake_forge_bed(bed):
    """The files that make a folder count as a Forge test bed (``forge_testbed_ready``), empty."""
    from tests.real_forge.forge import MODELS

    for name in ("webui/launch.py", "venv/bin/python", *(f"webui/models/{model}" for model in MODELS)):
        (bed / name).parent.mkdir(parents=True, exist_ok=True)
        (bed / name).write_text("")
    return bed


def test_the_forge_webui_runs_on_its_own_bed_the_rows_it_can_take(tmp_path, monkeypatch):
    # --webui forge: Forge's bed ($FORGE_ROOT), the same scenario without a second checkpoint, a LoRA, A1111's Token
    # merging, the Prompts-from-file job or step caching; the restart kept
    from bench.webui_rows import NOT_FORGE, build_settings

    monkeypatch.setenv("A1111_ROOT", str(fake_test_bed(tmp_path / "a1111")))
    monkeypatch.setenv("FORGE_ROOT", str(fake_forge_bed(tmp_path / "forge")))
    config = build_settings({"webui": "forge"})
    assert config.testbed == tmp_path / "forge" and config.sizes[0] == (512, 512) and config.steps == 4
    assert config.rows[:2] == ("first", "again") and "restart" in config.rows and not set(config.rows) & set(NOT_FORGE)
    assert build_settings({"webui": "forge", "rows": ("again",)}).rows == ("again",)
    assert build_settings({}).testbed == tmp_path / "a1111" and build_settings({}).webui == "a1111"
    with pytest.raises(ValueError, match="with webui forge only first, again, .*got first, lora"):
        build_settings({"webui": "forge", "rows": ("first", "lora")})
    sdxl = build_settings({"webui": "forge", "model": "sdxl", "enable_always": True, "accelerated_only": True})
    assert sdxl.sizes[0] == (1024, 1024) and not set(sdxl.rows) & set(NOT_FORGE), sdxl
    assert build_settings({"webui": "forge", "model": "sdxl", "session": True}).session
    with pytest.raises(ValueError, match="webui forge runs the session with model sdxl only"):
        build_settings({"webui": "forge", "session": True})
    with pytest.raises(ValueError, match="webui must be a1111 or forge, got 'comfy'"):
        build_settings({"webui": "comfy"})
    monkeypatch.setenv("FORGE_ROOT", str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="no Forge test bed in .*nothing: .* set FORGE_ROOT"):
        build_settings({"webui": "forge"})


def test_a_forge_report_names_forge_and_its_stock_arithmetic():
    from bench.webui_report import markdown, testbed_label

    assert testbed_label(Path("/elsewhere/forge"), "FORGE_ROOT") == "$FORGE_ROOT"

    def row(mode, key, seconds, s_per_it, **extra):
        return {"mode": mode, "key": key, "label": key, "size": "512x512", "batch": 1, "seconds": seconds,
                "s_per_it": s_per_it, **extra}

    settings = {"webui": "forge", "tiny": False, "model": "sd15", "precisions": ["auto"], "steps": 4,
                "sizes": ["512x512", "512x384", "384x512"], "batch": 4, "rows": ["first", "again"], "sampler": "Euler",
                "cfg_scale": 7, "testbed": "build/forge-testbed"}
    results = {"command": "python -m bench webui --webui forge", "started": "now", "note": None,
               "machine": {"Model name": "AMD EPYC (family 25, model 17)", "cpus": 2}, "cpu": {"AVX2": True},
               "available_gib_at_start": 20.0, "load_average_at_start": 0.1, "extension_source": "git clone",
               "settings": settings, "phases": [],
               "rows": [row("stock", "first", 40.0, 8.0), row("stock", "again", 36.0, 8.0),
                        row("auto", "first", 120.0, 3.0, psnr_vs_stock=44.0),
                        row("auto", "again", 14.0, 2.0, psnr_vs_stock=44.5)]}
    table = markdown(results)
    assert table.startswith("# Real WebUI benchmark: stock Forge (main at dfdcbab6) vs Accelerate with OpenVINO "
                            "(full-size SD 1.5)")
    assert "against stock Forge's (PyTorch on the CPU, `--always-cpu`" in table
    assert "| first size, batch 1 | 8.00 | 2.00 | 4.00x |" in table
    assert "stock A1111 v1.10.1" in markdown({**results, "settings": {**settings, "webui": "a1111"}})


def test_a_row_not_at_the_precision_chosen_is_named_with_why():
    """At "int8" with NNCF's work too large for the memory, the UNet runs at float: the report says so beside the
    row's figures, from the status line (or, in a status made before that line existed, the graph's report)."""
    from bench.webui_report import not_as_chosen_lines

    why = "not enough memory to quantize it to INT8: it needs about 15.6 GiB and 15.4 GiB is available"
    rows = [
        {"mode": "int8", "label": "first generation",
         "status": f"OpenVINO (CPU, int8) on CPU: unet\nNot at INT8: the UNet runs at float in OpenVINO instead, "
                   f"because of {why}.\n  graph 1: ..."},
        {"mode": "int8", "label": "same size again",
         "status": f"OpenVINO\n  graph 1 (x): dynamic; fallbacks: INT8 quantization failed earlier ({why}); it runs at "
                   "float"},
        {"mode": "auto", "label": "first generation", "status": "OpenVINO (CPU, auto)\nNothing fell back to PyTorch."},
    ]
    lines = not_as_chosen_lines(rows)
    assert lines[:3] == ["", "## Not at the precision chosen", ""]
    assert lines[3].startswith("- int8 / first generation: Not at INT8: the UNet runs at float") and why in lines[3]
    assert lines[4].startswith("- int8 / same size again: INT8 quantization failed earlier (") and why in lines[4]
    assert len(lines) == 5 and not not_as_chosen_lines(rows[2:])
