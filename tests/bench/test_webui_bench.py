"""``python -m bench webui --tiny``: the real-WebUI benchmark on the real-host tier's tiny models.

A smoke test of the harness: every row of the scenario is measured stock and accelerated (a number in
every cell that has one), the accelerated runs really ran in OpenVINO, a second accelerated generation
at the same size compiles nothing, and going back to an earlier size converts nothing. It asserts no
time. Needs the WebUI test bed (``A1111_ROOT``; ``--webui forge``: the Forge bed, ``FORGE_ROOT``); skipped without
it.
"""

from __future__ import annotations

import json
import re

import pytest

from bench.__main__ import main
from bench.webui import RESTART, ROWS
from tests.real_forge.forge import forge_testbed_ready, forge_testbed_root
from tests.real_webui import webui as harness  # (its testbed_* names would be collected as tests)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not harness.testbed_ready(harness.testbed_root()),
                       reason=f"no WebUI test bed in {harness.testbed_root()}"),
]

NUMBER = r"\d+(?:\.\d+)?"


def test_tiny_run_measures_every_row(tmp_path):
    out = tmp_path / "results"
    assert main(["webui", "--tiny", "--out", str(out), "--name", "smoke", "--work-dir", str(tmp_path / "work")]) == 0
    results = json.loads((out / "smoke.json").read_text(encoding="utf-8"))
    table = (out / "smoke.md").read_text(encoding="utf-8")

    rows = {(r["mode"], r["key"]): r for r in results["rows"]}
    for row in ROWS:
        for mode in ("stock", "auto") if row.step_cache == 1 else ("auto",):  # stock has no step caching
            record = rows[(mode, row.key)]
            assert "error" not in record, record
            assert record["seconds"] > 0 and record["images"] == (row.prompts_job or record["batch"]), record
            assert record["peak"] > 0, record
            # the request's own peak (VmHWM started again before it): at most the process's, and seen in the
            # RSS sampled through the request
            assert 0 < record["request_peak"] <= record["peak"], record
            sampled = [rss for _, rss, _ in record["rss_timeline"]]  # (none in a tiny request shorter than a poll)
            assert max(sampled, default=0) <= record["request_peak"] + 0.01, record
    for row in (*ROWS, RESTART):
        record = rows[("auto", row.key)]
        assert record["accelerated"] and record["ov_calls"] > 0 and record["eager_calls"] == 0, record["status"]
        # the fallback row (Token merging) runs the UNet in PyTorch, reading its weights back from the file
        in_pytorch = ["model.diffusion_model"] if row.key == "fallback" else []
        assert record["pytorch_parts"] == in_pytorch, (row.key, record["status"])
    assert rows[("auto", "again")]["compiles"] == 0, rows[("auto", "again")]["status"]
    # back to the first size after two others: its compiled models were released (each generation keeps
    # what it uses), so it is a compile of the model converted before, never a conversion
    assert rows[("auto", "back")]["convert_seconds"] == 0, rows[("auto", "back")]["status"]
    assert rows[("auto", "size3")]["released"] > 0, rows[("auto", "size3")]["status"]
    # a long prompt runs the UNet at a batch of 1: the model converted for a batch of 2 serves it
    assert rows[("auto", "long")]["convert_seconds"] == 0, rows[("auto", "long")]["status"]
    assert rows[("auto", "restart")]["cache_hits"] > 0, rows[("auto", "restart")]["status"]
    assert rows[("auto", "first")]["compiles"] > 0 and rows[("auto", "first")]["compile_seconds"] > 0
    # the Prompts-from-file job went through the always-on section: one status for its 4 generations
    assert rows[("auto", "prompts_file")]["generations"] == 4, rows[("auto", "prompts_file")]["status"]
    # every accelerated image is compared with stock's for the same request (at auto: bf16 where the CPU has it)
    for row in (*ROWS, RESTART):
        assert rows[("auto", row.key)]["psnr_vs_stock"] > 25, (row.key, rows[("auto", row.key)].get("psnr_vs_stock"))
    assert "## Images against stock (PSNR dB)" in table
    assert "## Peak RSS of each request (GiB)" in table
    # step caching: shallow UNet calls on the cached steps, the image close to the same mode's uncached one
    assert ("stock", "cache2") not in rows
    for row in (r for r in ROWS if r.step_cache > 1):
        record = rows[("auto", row.key)]
        facts = record["step_cache"]
        assert facts["interval"] == row.step_cache and facts["shallow_calls"] > 0, record["status"]
        assert record["psnr_vs_uncached"] > 25, (row.key, record["psnr_vs_uncached"])
    assert rows[("auto", "cache2")]["compiles"] == 0, rows[("auto", "cache2")]["status"]
    line = next(x for x in table.splitlines() if x.startswith("| auto | step caching every 3 steps |"))
    assert len(re.findall(NUMBER, line)) >= 10, line

    # every request row of the table: stock seconds, accelerated seconds, ratio, compile seconds, peak RSS
    for row in (*ROWS, RESTART):
        label = rows[("auto", row.key)]["label"]
        line = next(x for x in table.splitlines() if x.startswith(f"| {label} |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert all(re.fullmatch(NUMBER + "x?", c) for c in cells[3:]), line
    for label in ("| first size, batch 1 |", "| first size, batch 4 |"):
        line = next(x for x in table.splitlines() if x.startswith(label))
        assert len(re.findall(NUMBER, line)) >= 4, line  # batch size, stock s/it, accelerated s/it, speed-up
    # a LoRA change is costed apart from the run: A1111's own weight writing, the extension's build
    for key in ("lora", "lora_change"):
        assert rows[("auto", key)]["lora_write_seconds"] > 0, rows[("auto", key)]["status"]
    line = next(x for x in table.splitlines() if x.startswith("| LoRA weight change / second size, seconds above"))
    assert re.search(NUMBER + "x", line), line
    assert re.search(r"auto: LoRA weight change \d+\.\d s above its run .* writing the weights \d+\.\d s\)", table)
    phases = {p["mode"]: p for p in results["phases"]}
    assert phases["auto"]["cache_files"] > 0 and phases["auto"]["cache_bytes"] > 0
    assert phases["auto"]["peak"] >= phases["stock"]["peak"] > 0
    assert results["cpu"]["openvino_device"] and results["machine"].get("Model name")
    assert "python -m bench webui --tiny" in table


def test_tiny_run_of_chosen_rows(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["webui", "--tiny", "--rows", "first", "reboot"])
    assert "rows: unknown request(s) reboot" in capsys.readouterr().err

    out = tmp_path / "results"
    assert main(["webui", "--tiny", "--rows", "first", "--out", str(out), "--name", "one",
                 "--work-dir", str(tmp_path / "work")]) == 0
    results = json.loads((out / "one.json").read_text(encoding="utf-8"))
    assert [(r["mode"], r["key"]) for r in results["rows"]] == [("stock", "first"), ("auto", "first")]
    assert all("error" not in r and r["peak"] > 0 for r in results["rows"])
    assert results["settings"]["rows"] == ["first"]
    # the accelerated request repeats stock's prompt right after it: A1111's cached conditioning must not
    # let it skip the text encoder, so its first request builds all three parts
    status = results["rows"][1]["status"]
    assert len([line for line in status.splitlines() if ": dynamic on" in line]) == 3, status
    table = (out / "one.md").read_text(encoding="utf-8")
    assert "| first generation |" in table and "| first generation after a restart" not in table


def test_tiny_run_with_enable_always_moves_the_weights_as_the_webui_loads(tmp_path, capsys):
    """``--enable-always``: Settings -> OpenVINO -> Enable for every generation is on from the WebUI's start, so
    its first checkpoint load moves the weights into the file; the first accelerated request moves nothing itself
    and its status says what moved at the load."""
    with pytest.raises(SystemExit):
        main(["webui", "--tiny", "--rows", "first", "--enable-always"])
    assert "enable_always needs accelerated_only" in capsys.readouterr().err

    out = tmp_path / "results"
    assert main(["webui", "--tiny", "--rows", "first", "--precisions", "f32", "--accelerated-only",
                 "--enable-always", "--out", str(out), "--name", "load", "--work-dir", str(tmp_path / "work")]) == 0
    results = json.loads((out / "load.json").read_text(encoding="utf-8"))
    first = results["rows"][0]
    assert first["mode"] == "f32" and "error" not in first and first["accelerated"], first
    assert "At the checkpoint load (ovtest-tiny-a" in first["status"], first["status"]
    assert "into a memory-mapped file in" not in first["status"], first["status"]  # (what a build's move says)
    assert "Enable for every generation: on" in (out / "load.md").read_text(encoding="utf-8")


@pytest.mark.skipif(not forge_testbed_ready(forge_testbed_root()),
                    reason=f"no Forge test bed in {forge_testbed_root()}")
def test_tiny_forge_run_measures_stock_forge_and_the_extension_in_one_process(tmp_path):
    """``--webui forge``: the same rows on Forge (its tier's SD 1.5 checkpoint), stock then accelerated in one Forge
    process, the accelerated requests in OpenVINO and their pictures compared with stock Forge's."""
    out = tmp_path / "results"
    assert main(["webui", "--webui", "forge", "--tiny", "--rows", "first", "again", "--out", str(out), "--name",
                 "forge", "--work-dir", str(tmp_path / "work")]) == 0
    results = json.loads((out / "forge.json").read_text(encoding="utf-8"))
    rows = {(r["mode"], r["key"]): r for r in results["rows"]}
    assert list(rows) == [("stock", "first"), ("stock", "again"), ("auto", "first"), ("auto", "again")]
    assert {r["process"] for r in results["rows"]} == {1}
    for key in ("first", "again"):
        record = rows[("auto", key)]
        assert record["accelerated"] and record["ov_calls"] > 0 and record["eager_calls"] == 0, record["status"]
        assert record["psnr_vs_stock"] > 25 and record["peak"] > 0 and rows[("stock", key)]["s_per_it"] > 0, record
    assert rows[("auto", "first")]["compiles"] > 0 and rows[("auto", "again")]["compiles"] == 0
    assert (out / "forge.md").read_text(encoding="utf-8").startswith("# Real WebUI benchmark: stock Forge")
