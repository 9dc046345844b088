"""The extension inside a real AUTOMATIC1111 WebUI v1.10.1: every acceleration path against stock A1111.

Each accelerated picture is compared with stock A1111's picture for the same request and seed, at f32:
PSNR >= :data:`MIN_PSNR` dB, and the extension's status route must show the parts really ran in
OpenVINO. ``test_the_comparison_would_catch_a_wrong_part`` shows the bound is not vacuous: a small error
in any one part's output moves the picture below it.

A1111 keeps the last prompt's conditioning: a request whose conditioning key equals the previous one's
never runs the text encoder. Every request therefore gets its own ``sdxl_crop_top`` override (part of
that key, unused by SD 1.x models), so stock and accelerated runs of one prompt both encode it.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from .webui import SCRIPT_NAME, Result, WebUI, psnr

MIN_PSNR = 40.0
F32_ARGS = ["CPU", True, True, True, "Full precision (f32)", True, ""]
_unique = itertools.count(1)


def request(prompt: str, **kwargs: Any) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "prompt": prompt,
        "negative_prompt": "blurry, low quality",
        "seed": 4321,
        "steps": 3,
        "width": 64,
        "height": 64,
        "sampler_name": "Euler",
        "cfg_scale": 5,
        "batch_size": 1,
        "n_iter": 1,
        "save_images": False,
        "send_images": True,
    }
    payload.update(kwargs)
    overrides = dict(payload.get("override_settings") or {})
    overrides["sdxl_crop_top"] = next(_unique)  # a new conditioning-cache key (see the module docstring)
    payload["override_settings"] = overrides
    return payload


def accelerated(payload: dict[str, Any], args: list[Any] | None = None) -> dict[str, Any]:
    return dict(payload, script_name=SCRIPT_NAME, script_args=list(args or F32_ARGS))


def perturbed(payload: dict[str, Any], part: str, relative_std: float) -> dict[str, Any]:
    return dict(payload, alwayson_scripts={"ovtest perturb": {"args": [part, relative_std]}})


def run_both(ui: WebUI, payload: dict[str, Any], kind: str = "txt2img") -> tuple[Result, Result]:
    """(stock, accelerated) for one request; the accelerated run's status is attached to it."""
    stock = ui.generate(
        dict(payload, override_settings=dict(payload["override_settings"], sdxl_crop_top=next(_unique))), kind
    )
    fast = ui.generate(accelerated(payload), kind)
    fast.status = ui.status()
    return stock, fast


def min_psnr(a: Result, b: Result) -> float:
    assert len(a.images) == len(b.images), (len(a.images), len(b.images))
    return min(psnr(x, y) for x, y in zip(a.images, b.images))


def assert_ran_in_openvino(status: dict[str, Any], parts: tuple[str, ...] = ("UNet", "VAE", "TE")) -> None:
    assert status["accelerated"], status["status"]
    assert status["eager_calls"] == 0 and not status["eager"] and not status["fallback_ops"], status["status"]
    assert status["ov_calls"] > 0, status["status"]
    called = " ".join(label for label, n in status["calls"].items() if n > 0)
    labels = {"UNet": "diffusion_model", "VAE": "first_stage_model", "TE": "cond_stage_model"}
    for part in parts:
        assert labels[part] in called, f"{part} was not called through OpenVINO: {status['calls']}"


def test_script_is_listed_with_its_arguments(webui: WebUI) -> None:
    assert SCRIPT_NAME in webui.get("/sdapi/v1/scripts")["txt2img"]
    assert SCRIPT_NAME in webui.get("/sdapi/v1/scripts")["img2img"]
    info = next(s for s in webui.get("/sdapi/v1/script-info") if s["name"] == SCRIPT_NAME and not s["is_img2img"])
    assert len(info["args"]) == len(F32_ARGS)
    log = webui.log_text()
    assert "OpenVINO acceleration is unavailable" not in log
    assert "Error loading script" not in log, webui.log_tail()


def test_txt2img_matches_stock(webui: WebUI) -> None:
    stock, fast = run_both(webui, request("a lighthouse on a cliff, (dramatic sky:1.2)"))
    assert_ran_in_openvino(fast.status)
    assert min_psnr(stock, fast) >= MIN_PSNR
    assert 'OpenVINO: "CPU, UNet+VAE+TE, f32"' in fast.infotexts[0]
    assert np.std(stock.images[0]) > 5  # a picture, not a flat field


@pytest.mark.parametrize(("part", "relative_std"), [("unet", 0.05), ("vae", 0.1), ("te", 0.25)])
def test_the_comparison_would_catch_a_wrong_part(webui: WebUI, part: str, relative_std: float) -> None:
    """A small error in one routed part's output (here added to the accelerated part) fails the bound."""
    payload = request(f"a harbour at dawn, {part}")
    stock = webui.generate(payload)
    wrong = webui.generate(accelerated(perturbed(request(f"a harbour at dawn, {part}"), part, relative_std)))
    assert_ran_in_openvino(webui.status())
    value = min_psnr(stock, wrong)
    webui.record(f"perturbed {part} output by {relative_std:.0%}", value)
    assert value < MIN_PSNR
