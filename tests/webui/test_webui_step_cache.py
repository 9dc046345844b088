"""Step caching in the adapter: the sampler step read from A1111's denoiser, the Settings-tab options, and a
UNet that step caching cannot split (the fake host's) running uncached, said in the status and the infotext."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import make_p, max_pixel_diff

from ov_accelerate_sd.step_cache import StepCacheRun, StepCacheSettings
from ov_accelerate_webui.options import STEP_CACHE_DEPTH_OPTION, STEP_CACHE_END_OPTION, read_options
from ov_accelerate_webui.step_caching import sampler_step


def _denoiser(evaluation: int, steps: int, total: int) -> SimpleNamespace:
    return SimpleNamespace(denoiser=SimpleNamespace(step=evaluation, steps=steps, total_steps=total),
                           sampling_step=0, total_sampling_steps=steps)


@pytest.mark.parametrize(("total", "expected"), [
    (10, list(range(10))),  # one evaluation per step (Euler, DPM++ 2M...)
    (20, [i // 2 for i in range(20)]),  # two (Heun, DPM2...): both evaluations of a step share it
])
def test_the_sampler_step_comes_from_the_denoisers_evaluations(total: int, expected: list[int]) -> None:
    run = StepCacheRun(StepCacheSettings(interval=2))
    seen = []
    for evaluation in range(total):
        sampler_step(run, _denoiser(evaluation, 10, total))
        seen.append(run.step)
    assert seen == expected and run.steps == 10
    sampler_step(run, _denoiser(0, 6, 6))  # the next sampling (a batch, the hires pass) starts again
    assert (run.step, run.steps) == (0, 6)
    # without a denoiser (another sampler's callback): the callback's own step
    sampler_step(run, SimpleNamespace(sampling_step=4, total_sampling_steps=6))
    assert run.step == 4


def test_settings_tab_options_shape_step_caching(fake_host: Any, caplog: pytest.LogCaptureFixture) -> None:
    fake_host.shared.opts.data.update({STEP_CACHE_DEPTH_OPTION: 3.0, STEP_CACHE_END_OPTION: 2})
    assert read_options().step_cache == StepCacheSettings(depth=3, full_end=2)
    fake_host.shared.opts.data[STEP_CACHE_DEPTH_OPTION] = 0
    assert read_options().step_cache == StepCacheSettings()
    assert "depth must be a whole number >= 1, got 0; step caching uses its defaults" in caplog.text


def test_a_unet_that_cannot_be_split_runs_uncached_and_says_so(fake_host: Any, extension: Any, f32: Any) -> None:
    plain = extension.run(make_p(fake_host, steps=4), f32)
    cached = extension.run(make_p(fake_host, steps=4), dataclasses.replace(f32, step_cache=2))
    assert max_pixel_diff(plain, cached) == 0  # every step ran the full UNet
    report = extension.last_run_report()
    assert report["step_cache"]["shallow_calls"] == 0 and report["step_cache"]["full_calls"] == 0
    (why,) = report["step_cache"]["unsupported"].values()
    assert "not LdmUNet" in why
    assert "not cached: model.diffusion_model: step caching knows" in report["status"]
    # the image records what ran: no step caching
    assert 'OpenVINO: "CPU, UNet+VAE+TE, f32; no step caching"' in cached.infotexts[0]
    assert "Accelerate with OpenVINO: no step caching: step caching knows" in cached.comments
