"""The soak, short: ``python -m bench soak``'s own code against a real WebUI on the tier's tiny models.

First the stream with the extension off (stock's own curve, in a WebUI process of its own), then a few dozen
requests of the same seeded stream (txt2img and img2img at sizes repeated and new, batch size and batch
count, Prompts from file and X/Y/Z through the section, the LoRA on, off and at another weight, the second
checkpoint and back, an Interrupt also run against stock, two clients at once), with Settings -> OpenVINO's
"previous weights" at *release*, so that rule is decided too. Every bound the soak decides must hold: the RSS
after the warm-up grows no more than 5% of its plateau beyond stock's own growth for the same stream (A1111 itself
grows on the tiny models: 0.76 -> 1.01 GiB over 100 requests, measured, so the absolute bound of the soak,
``rss_flat``, is reported here, not asserted), compiled models not growing with new sizes, no previous weights'
model kept, no request failed, no image lost, the Interrupt as stock's, every sampled picture >= 40 dB against
stock. The disk cache's bound is decided when the extension reports a limit (``cache_limit_bytes``); until then
the report says "no limit set". ``tests/bench/test_soak_bounds.py`` shows each bound fails on a run that breaks it.

It starts a WebUI of its own (its own data folder), like ``bench webui``, twice; about 5-6 minutes on 2 cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.soak import run_soak
from bench.soak_plan import KINDS, build_settings

from .conftest import usable_testbed

#: Requests of the stream: the warm-up (9) and enough after it for two halves of RSS and compiled models
REQUESTS = 36
#: Bounds the run cannot leave undecided
DECIDED = ("rss_beyond_stock", "models_bounded", "previous_released", "no_errors", "no_image_lost",
           "interrupt_as_stock", "pictures_match")

pytestmark = pytest.mark.slow


def test_a_short_soak_stays_within_every_bound(tmp_path: Path) -> None:
    root = usable_testbed()
    config = build_settings({"model": "tiny", "requests": REQUESTS, "seed": 41, "previous_weights": "release",
                             "stock_baseline": True,
                             "testbed": root, "out": tmp_path / "results", "name": "soak",
                             "work_dir": tmp_path / "work"})
    results = run_soak(config, "tests/real_webui/test_real_webui_soak.py")
    bounds = {b["name"]: b for b in results["bounds"]}
    table = (tmp_path / "results" / "soak.md").read_text(encoding="utf-8")
    records = results["records"]

    assert len(records) == REQUESTS
    assert {r["kind"] for r in records} == set(KINDS)
    assert {r["lora"] for r in records} == {None, 1.0, 0.5} and {r["checkpoint"] for r in records} == {0, 1}
    assert any(r["new_size"] for r in records) and any(r["n_iter"] > 1 for r in records)
    for name in DECIDED:
        assert bounds[name]["passed"] is True, f"{name}: {bounds[name]['measured']}\n{table}"
    # the absolute bound (rss_flat) is reported, not asserted here: stock A1111's own creep on the tiny models (about
    # 1 MB a request, measured) is most of 5% of their 1 GiB plateau over a few dozen requests
    assert bounds["rss_flat"]["passed"] is not None
    cache = bounds["cache_under_limit"]
    if any(r.get("cache_limit_bytes") for r in records):
        assert cache["passed"] is True, cache
    else:
        assert cache["passed"] is None and "no limit set" in cache["measured"], cache
    # the accelerated requests really ran in OpenVINO, and the status route counted what they hold
    assert all(r["ov_calls"] > 0 and r["eager_calls"] == 0 for r in records), table
    assert all(r["compiled_models"] > 0 for r in records), table
    assert json.loads((tmp_path / "results" / "soak.json").read_text(encoding="utf-8"))["bounds"] == results["bounds"]
    assert (tmp_path / "results" / "soak.png").stat().st_size > 0
