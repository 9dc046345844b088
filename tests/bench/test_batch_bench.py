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

