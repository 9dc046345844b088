"""``python -m bench batch --tiny``: the batch benchmark's command-line modes on the demo model, a smoke test of the
harness (it asserts no time): each mode renders the whole job, the report has its rate, memory and pictures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.__main__ import main


@pytest.mark.slow
def test_tiny_run_reports_the_rate_and_memory_of_its_mode(tmp_path: Path) -> None:
    out = tmp_path / "results"
    # (--workers and --ray themselves are tested in tests/sd/test_batch.py; this is the harness)
    assert main(["batch", "--tiny", "--modes", "cli", "--images", "2", "--out", str(out), "--name", "smoke"]) == 0
    results = json.loads((out / "smoke.json").read_text())
    rows = {row["mode"]: row for row in results["rows"]}
    assert list(rows) == ["cli"]
    for row in rows.values():
        assert row["count"] == 2 and row["per_minute"] > 0 and row["memory_gib"] >= 0
        assert row["first_image_seconds"] <= row["seconds"]
    table = (out / "smoke.md").read_text()
    assert "| cli |" in table and "- CPU: " in table


def test_the_webui_modes_are_refused_with_the_tiny_model(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["batch", "--tiny", "--modes", "stock_api"])
    assert "--tiny runs the command-line modes only" in capsys.readouterr().err


def test_a_mode_whose_pictures_match_the_command_lines_is_reported_identical(tmp_path: Path) -> None:
    import numpy as np
    from PIL import Image

    from bench.batch import markdown, summarize

    def png(name: str, value: int) -> str:
        path = tmp_path / name
        pixels = np.full((8, 8, 3), 100, dtype=np.uint8)
        pixels[0, 0, 0] = value
        Image.fromarray(pixels).save(path)
        return str(path)

    reference = {"mode": "cli", "images": [png("a.png", 100), png("b.png", 100)]}
    same = summarize({"mode": "workers2", "came": [1.0, 2.0], "seconds": 2.0, "memory_gib": 1.0,
                      "images": [png("c.png", 100), png("d.png", 100)]}, reference)
    apart = summarize({"mode": "ray2", "came": [1.0, 2.0], "seconds": 2.0, "memory_gib": 1.0,
                       "images": [png("e.png", 100), png("f.png", 101)]}, reference)
    assert same["identical_to_cli"] and not apart["identical_to_cli"]
    assert 60 < apart["psnr_vs_cli"] < 99
    results = {"settings": {"images": 2, "size": 8, "steps": 1, "precision": "f32", "model": "m"}, "cpu": {},
               "started": "2026-11-28T00:00:00", "command": "c", "machine": {}, "available_gib_at_start": 1,
               "rows": [same, apart]}
    table = markdown(results)
    assert "| workers2 |" in table and "identical pixels" in table.split("| workers2 |")[1].splitlines()[0]
    assert f"| {apart['psnr_vs_cli']} |" in table.split("| ray2 |")[1].splitlines()[0]
