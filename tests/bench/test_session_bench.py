"""``python -m bench session``'s plan and report (its end-to-end run needs the full-size models and root for the
memory cgroup: the bench itself, ``docs/benchmarks.md``)."""

from __future__ import annotations

from types import SimpleNamespace

from bench.session import Session, markdown
from bench.webui_rows import SESSION_ROWS


def test_stock_runs_unlimited_first_then_under_each_limit_before_the_precision_that_shares_it() -> None:
    session = Session.__new__(Session)
    session.config = SimpleNamespace(precisions=("int8-weights", "auto"))
    assert session.plan([8.0, 12.0]) == [("stock", None), ("stock", 8.0), ("int8-weights", 8.0), ("stock", 12.0),
                                         ("auto", 12.0)]
    assert session.plan([4.0, 4.0]) == [("stock", None), ("stock", 4.0), ("int8-weights", 4.0), ("auto", 4.0)]
    # stock last: its unlimited run, the largest, at the very end
    assert session.plan([8.0, 12.0], stock_last=True) == [("int8-weights", 8.0), ("auto", 12.0), ("stock", 8.0),
                                                          ("stock", 12.0), ("stock", None)]


def test_the_report_says_which_runs_lived_and_how_their_pictures_compare() -> None:
    rows = [{"mode": "stock", "limit_gib": None, "key": r.key, "label": r.label, "seconds": 10.0,
             "request_peak": 6.0} for r in SESSION_ROWS]
    rows += [{"mode": "auto", "limit_gib": 6.0, "key": r.key, "label": r.label, "seconds": 5.0, "request_peak": 3.0,
              "psnr_vs_stock": 44.0 + i / 10, "compiles": 2, "pytorch_parts": []} for i, r in enumerate(SESSION_ROWS)]
    rows.append({"mode": "stock", "limit_gib": 6.0, "key": "first", "label": "first generation",
                 "error": "Remote end closed connection without response"})
    sessions = [
        {"mode": "stock", "limit_gib": None, "requests": 6, "alive": True, "session_peak_gib": 10.26,
         "anon_peak_gib": 10.06, "failed": []},
        {"mode": "stock", "limit_gib": 6.0, "requests": 0, "alive": False, "error": "the WebUI exited with -9",
         "session_peak_gib": 0.0, "anon_peak_gib": 0.0, "failed": [], "group_peak_gib": 6.0, "oom_kills": 1},
        {"mode": "auto", "limit_gib": 6.0, "requests": 6, "alive": True, "session_peak_gib": 6.82,
         "anon_peak_gib": 3.32, "failed": [], "group_peak_gib": 6.0, "oom_kills": 0},
    ]
    results = {"settings": {"tiny": False, "model": "sd15", "steps": 4, "sizes": ["512x512", "512x384"],
                            "cfg_scale": 7, "testbed": "bed"},
               "command": "python -m bench session", "started": "now", "machine": {}, "cpu": {},
               "available_gib_at_start": 20.0, "load_average_at_start": 0.1, "extension_source": "clone",
               "rows": rows, "sessions": sessions}
    text = markdown(results)
    assert "| stock | none | yes | 6 of 6 | 10.26 | 10.06 | - | - | - |" in text
    assert "| stock | 6.0 | killed at its start | 0 of 6 | - | - | 6.00 | 1 | - |" in text
    assert "| auto | 6.0 | yes | 6 of 6 | 6.82 | 3.32 | 6.00 | 0 | 44.0 |" in text
    assert "Remote end closed connection without response" in text


def test_a_webui_that_did_not_start_is_recorded_by_its_exit_and_the_extensions_warning_only() -> None:
    from bench.session import why_not_started

    log = ("the WebUI exited with -9:\nLoading weights [9b] from /home/someone/models/a.safetensors\n"
           "WARNING:ov_accelerate_webui.weights_at_load:Accelerate with OpenVINO: loading a.safetensors [9b] as A1111 "
           "does needs about 4.0 GiB of memory, 3.3 GiB is available")
    kept = why_not_started(log)
    assert kept == ("the WebUI exited with -9:\nloading a.safetensors [9b] as A1111 does needs about 4.0 GiB of "
                    "memory, 3.3 GiB is available")
    assert "/home/" not in kept
