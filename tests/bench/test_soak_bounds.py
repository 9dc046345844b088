"""The soak's bounds decide right on synthetic runs: a growing RSS, a compiled model kept per new size, a lost
image, a wrong Interrupt count, a picture off stock and a cache over its limit each fail; flat runs pass. And the
stream of requests is the same for the same seed and covers what the issue asks for. No WebUI here."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from bench import soak_bounds
from bench.soak_plan import build_settings, requests


def run(n: int = 24, warmup: int = 6, rss: Any = None, held: Any = None, **extra: Any) -> list[dict[str, Any]]:
    """A synthetic run: flat RSS around 2 GiB with noise, 4 models held, every image returned."""
    noise = random.Random(0)
    records = []
    for i in range(n):
        records.append({"index": i + 1, "kind": "txt2img", "warmup": i < warmup, "images": 2, "expected_images": 2,
                        "rss_gib": rss(i) if rss else 2.0 + noise.uniform(-0.02, 0.02),
                        "compiled_models": held(i) if held else 4, "kept_previous": 0,
                        "cache_bytes": 100 << 20, "cache_limit_bytes": None, "psnr": 80.0, **extra})
    return records


def by_name(records: list[dict[str, Any]], **kwargs: Any) -> dict[str, soak_bounds.Bound]:
    return {b.name: b for b in soak_bounds.evaluate(records, **kwargs)}


def test_a_flat_run_passes_every_bound_it_can_decide() -> None:
    bounds = by_name(run())
    decided = {name: b.passed for name, b in bounds.items() if b.passed is not None}
    assert decided == {"rss_flat": True, "models_bounded": True, "no_errors": True, "no_image_lost": True,
                       "pictures_match": True}
    assert bounds["cache_under_limit"].passed is None and "no limit set" in bounds["cache_under_limit"].measured


def test_rss_growing_a_little_per_request_fails_and_the_warm_up_does_not_count() -> None:
    growing = by_name(run(n=40, rss=lambda i: 2.0 * 1.005**i))  # 0.5% a request: about 9% from half to half
    assert growing["rss_flat"].passed is False, growing["rss_flat"]
    # a big rise during the warm-up (first compiles) and flat after it: passes
    warm = by_name(run(n=40, warmup=8, rss=lambda i: 1.0 + 0.25 * i if i < 8 else 3.0))
    assert warm["rss_flat"].passed is True, warm["rss_flat"]
    # 4% over the first half's plateau: within the 5%
    step = by_name(run(n=40, warmup=8, rss=lambda i: 3.0 if i < 24 else 3.12))
    assert step["rss_flat"].passed is True
    assert by_name(run(n=40, warmup=8, rss=lambda i: 3.0 if i < 24 else 3.18))["rss_flat"].passed is False


def test_rss_is_compared_within_each_lora_and_checkpoint_state() -> None:
    """A LoRA on holds more than off at any time: a run that turns it on in its last half only did not grow; the
    same state growing between the halves did."""
    lora = run(n=40, warmup=8, rss=lambda i: 3.0 if i < 24 or i % 2 else 4.0)
    for i, record in enumerate(lora):
        record["lora"] = 1.0 if i >= 24 and not i % 2 else None
        record["checkpoint"] = 0
    bound = by_name(lora)["rss_flat"]
    assert bound.passed is True, bound
    assert "LoRA None, checkpoint 0: 3.000 -> 3.000 GiB" in bound.measured, bound.measured
    for i, record in enumerate(lora):  # off in both halves, and growing 10% there
        record["rss_gib"] = 3.3 if i >= 24 and record["lora"] is None else record["rss_gib"]
    assert by_name(lora)["rss_flat"].passed is False
    only_last = run(n=20, warmup=4)
    for i, record in enumerate(only_last):
        record["lora"] = 1.0 if i >= 12 else None
    assert by_name(only_last)["rss_flat"].passed is None  # no state in both halves: undecided


def test_growth_beyond_stocks_own_decides_the_extensions_share() -> None:
    stock = run(n=40, warmup=8, rss=lambda i: 1.0 + 0.005 * i)  # A1111 itself creeps: 10% from half to half
    same = run(n=40, warmup=8, rss=lambda i: 1.2 + 0.005 * i)  # the extension adds a constant
    more = run(n=40, warmup=8, rss=lambda i: 1.2 + 0.01 * i)  # the extension doubles the creep
    assert by_name(same)["rss_flat"].passed is False  # the absolute bound sees stock's own growth
    assert by_name(same, stock=stock)["rss_beyond_stock"].passed is True
    assert by_name(more, stock=stock)["rss_beyond_stock"].passed is False
    assert "rss_beyond_stock" not in by_name(same)  # decided only with a stock run


def test_one_compiled_model_more_per_new_size_fails_unless_every_size_is_kept() -> None:
    leak = run(n=30, held=lambda i: 4 + i // 4)  # one more every fourth request (a new size each time)
    assert by_name(leak)["models_bounded"].passed is False
    assert by_name(leak, keep_all_sizes=True)["models_bounded"].passed is None  # no bound promised
    # up and down within the first half's range (a LoRA's models kept, then released): passes
    wave = run(n=30, held=lambda i: 4 + (i % 3 == 0) * 2)
    assert by_name(wave)["models_bounded"].passed is True


def test_previous_weights_kept_fail_only_where_the_setting_says_release() -> None:
    records = run()
    records[10]["kept_previous"] = 3
    assert by_name(records, previous_weights="release")["previous_released"].passed is False
    assert by_name(records, previous_weights="keep")["previous_released"].passed is None
    assert by_name(run(), previous_weights="release")["previous_released"].passed is True


def test_the_cache_over_its_limit_fails() -> None:
    records = run(cache_limit_bytes=150 << 20)
    assert by_name(records)["cache_under_limit"].passed is True
    records[-1]["cache_bytes"] = 151 << 20
    assert by_name(records)["cache_under_limit"].passed is False


def test_errors_lost_images_and_pictures_off_stock_fail() -> None:
    records = run()
    records[3]["error"] = "HTTP 500"
    assert by_name(records)["no_errors"].passed is False
    records = run()
    records[5]["images"] = 1
    assert by_name(records)["no_image_lost"].passed is False
    records = run()
    records[7]["psnr"] = 32.0  # what 5% noise in the UNet's output gives on the tiny models
    assert by_name(records)["pictures_match"].passed is False
    assert by_name(records, precision="auto")["pictures_match"].passed is None


def test_an_interrupt_decides_against_stock() -> None:
    def interrupted(images: int, stock: int | None) -> list[dict[str, Any]]:
        records = run()
        info = {"images": images, "jobs": [1, 1], "expected": [2]}
        if stock is not None:
            info.update(stock_images=stock, stock_jobs=[1, 1], stock_expected=[2])
        records[10].update(kind="interrupt", interrupt=info, images=images, expected_images=3)
        return records

    assert by_name(interrupted(2, 2))["interrupt_as_stock"].passed is True
    assert by_name(interrupted(3, 2))["interrupt_as_stock"].passed is False
    assert by_name(interrupted(2, 3))["interrupt_as_stock"].passed is False  # stock itself not as expected
    assert by_name(interrupted(2, None))["interrupt_as_stock"].passed is None
    # A1111 moved its batch number on around the Interrupt: either count is stock's
    records = interrupted(3, 2)
    records[10]["interrupt"]["expected"] = [2, 3]
    assert by_name(records)["interrupt_as_stock"].passed is True
    # an interrupted request's short count is not a lost image
    assert by_name(interrupted(2, 2))["no_image_lost"].passed is True


def test_the_stream_is_reproducible_and_has_every_kind_of_request(tmp_path: Any) -> None:
    config = build_settings({"model": "tiny", "requests": 30, "testbed": tmp_path}, check_testbed=False)
    first = list(itertools.islice(requests(config), 40))
    assert first == list(itertools.islice(requests(config), 40))
    other = build_settings({"model": "tiny", "seed": 2, "testbed": tmp_path}, check_testbed=False)
    assert first != list(itertools.islice(requests(other), 40))
    kinds = {r.kind for r in first}
    assert kinds == {"txt2img", "img2img", "prompts", "xyz", "interrupt", "pair"}
    assert {r.lora for r in first} == {None, 1.0, 0.5}
    assert {r.checkpoint for r in first} == {0, 1}
    assert any(r.n_iter > 1 for r in first) and {r.batch_size for r in first} >= {1, 2, 3}
    assert {r.route for r in first} == {"script", "section"}
    warm = [r for r in first if r.warmup]
    assert {r.size for r in warm} == {"64x64", "96x64", "64x96"}
    new = [r for r in first if r.new_size]
    assert new and all(r.size not in {"64x64", "96x64", "64x96"} for r in new)
    assert len({r.size for r in new}) == len(new), "a new size is new once"
    assert next(r for r in first if r.kind == "xyz").expected_images == 3  # its grid and two cells


@pytest.mark.parametrize("options, message", [
    ({"model": "sdxl"}, "model must be sd15 or tiny"),
    ({"sizes": ((512, 500),)}, "multiples of 8"),
    ({"precision": "bf16"}, "precision must be one of"),
    ({"colour": "red"}, "unknown option(s) colour"),
])
def test_bad_settings_are_named(options: dict[str, Any], message: str, tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_settings({**options, "testbed": tmp_path}, check_testbed=False)
