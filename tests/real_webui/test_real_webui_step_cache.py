"""Step caching (DeepCache) in the real WebUI: the schedule counted in A1111's sampler steps, reset for each
sampling (batch count, hires pass), the picture against the uncached one, the infotext and the status."""

from __future__ import annotations

from typing import Any

import pytest

from .test_real_webui import F32_ARGS, _unique, accelerated, assert_ran_in_openvino, min_psnr, request
from .test_real_webui import request as new_request
from .test_real_webui_sdxl_sd2 import SDXL_BASE, SDXL_REFINER, fresh
from .test_real_webui_sdxl_sd2 import generate as sdxl_generate
from .webui import WebUI

#: The picture at interval 2 against the uncached one, same seed, f32, on the tier's tiny random models
#: (random weights: their deep features are not slow like a trained model's; see docs/step-cache.md).
MIN_PSNR_INTERVAL_2 = 20.0


def _run(webui: WebUI, payload: dict[str, Any], interval: int) -> Any:
    # (a new conditioning-cache key: the text encoder runs in each run)
    payload = dict(payload, override_settings=dict(payload["override_settings"], sdxl_crop_top=next(_unique)))
    result = webui.generate(accelerated(payload, [*F32_ARGS, interval]))
    result.status = webui.status()
    return result


@pytest.mark.parametrize("sampler", ["Euler a", "DPM++ 2M", "Heun"])
def test_step_caching_follows_the_samplers_steps_and_stays_close_to_the_uncached_picture(
        webui: WebUI, sampler: str) -> None:
    payload = request("a red lighthouse on a cliff", steps=10, sampler_name=sampler)
    plain = _run(webui, payload, 1)
    assert not plain.status["step_cache"], plain.status["status"]
    cached = _run(webui, payload, 2)
    assert_ran_in_openvino(cached.status)
    facts = cached.status["step_cache"]
    # 10 sampler steps at interval 2 (first 2 and last 1 full): F F s F s F s F s F. Heun evaluates the UNet
    # twice per step (once on its last step): both calls of a step are full or both shallow
    evaluations = 2 if sampler == "Heun" else 1
    assert facts["shallow_calls"] == 4 * evaluations, cached.status["status"]
    assert facts["full_calls"] == 6 * evaluations - (1 if sampler == "Heun" else 0), cached.status["status"]
    assert not facts["full_on_shallow_steps"] and not facts["unsupported"], cached.status["status"]
    assert "Step caching every 2 steps (depth 2): " in cached.status["status"]
    assert 'OpenVINO: "CPU, UNet+VAE+TE, f32, step cache 2"' in cached.infotexts[0]
    difference = min_psnr(plain, cached)
    webui.record(f"step caching every 2 steps, {sampler}, against uncached", difference, cached)
    assert MIN_PSNR_INTERVAL_2 <= difference < 80, difference  # close, and the shallow steps did change it
    # a generation runs the UNet one way: the whole UNet's compiled model (its own copy of the weights) went
    # when step caching's took over, and theirs go when it is off again, which compiles and converts nothing new
    assert cached.status["released"] >= 1, cached.status["status"]
    again = _run(webui, payload, 1)
    assert again.status["released"] >= 2 and again.status["convert_seconds"] == 0, again.status["status"]
    assert min_psnr(plain, again) >= 80


def test_step_caching_restarts_for_each_batch_and_the_hires_pass(webui: WebUI) -> None:
    payload = request("a castle in the fog", steps=6, n_iter=2, batch_size=2, enable_hr=True, hr_scale=1.5,
                      hr_upscaler="Latent", hr_second_pass_steps=6, denoising_strength=0.5)
    cached = _run(webui, payload, 3)
    assert_ran_in_openvino(cached.status)
    facts = cached.status["step_cache"]
    # each of the 2 batches samples twice (first pass, then hires pass), each from a full step:
    # 6 steps at interval 3: F F s s F F -> 2 shallow per sampling; the hires pass runs 6 steps (denoising 0.5)
    assert facts["shallow_calls"] == 2 * 2 * 2, cached.status["status"]
    assert not facts["full_on_shallow_steps"], cached.status["status"]
    assert len(cached.images) == 4 and cached.images[0].shape == (96, 96, 3)


@pytest.mark.parametrize("checkpoint", [SDXL_BASE], indirect=True)
def test_sdxl_step_caching_with_the_refiner_taking_over(webui: WebUI, checkpoint: str) -> None:
    """SGM's UNet splits as LDM's does; the refiner's UNet, another module, starts from a full step of its own."""
    payload = new_request("a castle in the fog", steps=10, refiner_checkpoint=SDXL_REFINER, refiner_switch_at=0.5)
    plain = sdxl_generate(webui, payload, fast=True)
    cached = webui.generate(accelerated(fresh(payload), [*F32_ARGS, 2]))
    status = webui.status()
    assert 'step cache 2"' in cached.infotexts[0], cached.infotexts[0]
    facts = status["step_cache"]
    assert facts["shallow_calls"] >= 4 and not facts["unsupported"], status["status"]
    # no feature of the base's UNet reaches the refiner's: had the switch fallen on a cached step, that call
    # would have run full for this reason
    assert set(facts["full_on_shallow_steps"]) <= {"no full step of this UNet yet in this sampling"}, \
        status["status"]
    difference = min_psnr(plain, cached)
    webui.record("SDXL with the refiner, step caching every 2 steps, against uncached", difference)
    assert MIN_PSNR_INTERVAL_2 <= difference < 80, difference
