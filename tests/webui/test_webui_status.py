"""The status's graph-capture line: what dynamo's capture cost, and whether it was saved or loaded."""

from __future__ import annotations

from ov_accelerate_webui.status import capture_lines


def test_no_line_when_no_capture_was_measured() -> None:
    assert capture_lines({"compile_seconds": 2.0}) == []


def test_captures_made_and_all_saved() -> None:
    line = capture_lines({"capture_seconds": 14.2, "captures_made": 3, "captures_saved": 3})
    assert line == ["Graph capture 14.2 s: 3 captured (dynamo tracing the model's code), all saved for the next "
                    "start."]


def test_a_capture_not_saved_is_said() -> None:
    line = capture_lines({"capture_seconds": 14.2, "captures_made": 3, "captures_saved": 2})[0]
    assert "3 captured" in line and "2 of them saved for the next start" in line


def test_captures_loaded_from_the_disk_cache() -> None:
    line = capture_lines({"capture_seconds": 0.9, "captures_loaded": 3})[0]
    assert line == "Graph capture 0.9 s: 3 loaded from the disk cache instead of tracing again."
