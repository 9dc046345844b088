"""``python -m bench streams --quick``: every mode runs and is reported (a benchmark harness run: marked ``bench``)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.streams import main


def test_each_mode_runs_the_unet_and_is_reported(tmp_path: Path) -> None:
    assert main(["--quick", "--seconds", "1", "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path),
                 "--name", "s"]) == 0
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["latency", "streams", "processes"]
    assert all(r["calls_per_second"] > 0 for r in rows)
    assert [r["processes"] for r in rows] == [1, 1, 2]
    text = (tmp_path / "s.md").read_text()
    assert "NUM_STREAMS=2" in text and "`--workers 2`" in text
