"""The backend's counters: a typed snapshot that renders a run's status lines and report fields."""

from __future__ import annotations

from ov_backend.report import Stats, StatsCounter


def test_the_counter_adds_by_name_and_snapshots_a_stats() -> None:
    counter = StatsCounter()
    counter.add(ov_calls=1, compile_seconds=0.5)
    counter.add(ov_calls=2)
    stats = counter.snapshot()
    assert stats.ov_calls == 3 and stats.compile_seconds == 0.5 and stats.eager_calls == 0
    assert stats.as_dict()["ov_calls"] == 3 and list(stats.as_dict())[:2] == ["compile_seconds", "trace_seconds"]
    counter.reset()
    assert counter.snapshot() == Stats()


def test_a_mapping_of_counters_is_read_back_ignoring_other_keys() -> None:
    stats = Stats.from_mapping({"released": 2, "run_seconds": 24.0, "not_a_counter": 1})
    assert stats.released == 2 and stats.run_seconds == 24.0 and stats.cache_hits == 0


def test_text_and_report_say_the_same_facts() -> None:
    stats = Stats(compile_seconds=2.9, hash_seconds=0.4, run_seconds=24.0, ov_calls=4, released=1, kept_previous=2)
    text = "\n".join(stats.text_lines())
    assert text.startswith("Compile 2.9 s (0.4 s of it fingerprinting new weights), run 24.0 s; 4 OpenVINO calls")
    assert "Released 1 compiled model(s)" in text and "Kept 2 compiled model(s)" in text and "Of them" not in text
    report = stats.report_json()
    assert report["ov_calls"] == 4 and report["released"] == 1 and report["kept_previous"] == 2
    assert "hash_seconds" not in report and "compiles" not in report
