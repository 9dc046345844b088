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
import math
import re
import threading
import time
from typing import Any

import numpy as np
import pytest
from PIL import Image

from .webui import CHECKPOINT_A, CHECKPOINT_B, SCRIPT_NAME, Result, WebUI, encode_image, psnr

MIN_PSNR = 40.0
F32_ARGS = ["CPU", True, True, True, "Full precision (f32)", True, ""]
INT8_ARGS = ["CPU", True, True, True, "INT8 UNet (calibrated on your first generation; needs NNCF)", True, ""]
#: INT8 UNet against stock f32 A1111, same seed, on the tier's tiny models. Measured 29.5 dB on an AMD EPYC
#: Zen 4 (VNNI: 8-bit weights); CPUs without VNNI get 7-bit weights, about 1.7x the output error on the backend's
#: INT8 test model (about 4.6 dB less), hence the bound
INT8_MIN_PSNR = 22.0
W8_ARGS = ["CPU", True, True, True, "8-bit weights (least memory: UNet and text encoder; computes at Automatic)",
           True, ""]
#: 8-bit weights against stock f32 A1111, same seed, on the tier's tiny models: measured 41.2 dB on an AMD EPYC Zen 4
#: (computing at bf16); the f32 paths measure 80-90 dB, a 5% error in the UNet's output about 32 dB
W8_MIN_PSNR = 35.0
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


def assert_no_pytorch_copy_held(webui: WebUI, status: dict[str, Any]) -> None:
    """After an accelerated generation, PyTorch's copy of the routed weights is in the extension's weight file
    and none of its pages is in the WebUI's memory: as the status says it, and as the WebUI process's own memory
    map showed it when the status was read (a stock generation after it reads them back, as it should)."""
    weights = status["pytorch_weights_in_file"]
    assert weights["bytes"] > 0 and weights["resident_bytes"] == 0, status["status"]
    assert "in a memory-mapped file, 0 B of it in memory after the generation" in status["status"], status["status"]
    mapped, resident = status["weight_file_pages"]
    assert mapped >= weights["bytes"] and resident == 0, (mapped, resident)


def test_script_is_listed_with_its_arguments(webui: WebUI) -> None:
    assert SCRIPT_NAME in webui.get("/sdapi/v1/scripts")["txt2img"]
    assert SCRIPT_NAME in webui.get("/sdapi/v1/scripts")["img2img"]
    info = next(s for s in webui.get("/sdapi/v1/script-info") if s["name"] == SCRIPT_NAME and not s["is_img2img"])
    assert len(info["args"]) == len(F32_ARGS) + 1  # (step caching, not sent by these tests: off)
    log = webui.log_text()
    assert "OpenVINO acceleration is unavailable" not in log
    assert "Error loading script" not in log, webui.log_tail()


def test_txt2img_matches_stock(webui: WebUI) -> None:
    stock, fast = run_both(webui, request("a lighthouse on a cliff, (dramatic sky:1.2)"))
    assert_matches(webui, "txt2img (first accelerated generation)", stock, fast)
    assert 'OpenVINO: "CPU, UNet+VAE+TE, f32"' in fast.infotexts[0]
    assert np.std(stock.images[0]) > 5  # a picture, not a flat field
    # dynamo captured each part whole, and saved the captures for the next start (see the restart test)
    assert fast.status["captures_made"] >= 3 and fast.status["capture_seconds"] > 0, fast.status["status"]
    assert fast.status["captures_saved"] == fast.status["captures_made"], fast.status["status"]
    assert "all saved for the next start" in fast.status["status"], fast.status["status"]


@pytest.mark.parametrize(("part", "relative_std"), [("unet", 0.05), ("vae", 0.1), ("te", 1.0)])
def test_the_comparison_would_catch_a_wrong_part(webui: WebUI, part: str, relative_std: float) -> None:
    """An error in one routed part's output (added to the accelerated part) fails the bound. The tiny model's
    picture is far less sensitive to its text encoder than to its UNet or VAE, so that error is larger."""
    payload = request(f"a harbour at dawn, {part}")
    stock = webui.generate(payload)
    wrong = webui.generate(accelerated(perturbed(request(f"a harbour at dawn, {part}"), part, relative_std)))
    assert_ran_in_openvino(webui.status())
    value = min_psnr(stock, wrong)
    webui.record(f"perturbed {part} output by {relative_std:.0%}", value)
    assert value < MIN_PSNR


def init_image(width: int = 64, height: int = 64) -> Image.Image:
    """A smooth colour picture (an img2img start that is not noise)."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height) + 64], axis=-1)
    return Image.fromarray(rgb.astype(np.uint8))


def assert_matches(
    webui: WebUI, what: str, stock: Result, fast: Result, parts: tuple[str, ...] = ("UNet", "VAE", "TE")
) -> None:
    assert_ran_in_openvino(fast.status, parts)
    assert_no_pytorch_copy_held(webui, fast.status)
    value = min_psnr(stock, fast)
    webui.record(what, value, fast)
    assert value >= MIN_PSNR, f"{what}: {value:.1f} dB\n{fast.status['status']}"


def test_img2img_matches_stock(webui: WebUI) -> None:
    payload = request("a watercolour of a fox", init_images=[encode_image(init_image())], denoising_strength=0.6)
    stock, fast = run_both(webui, payload, "img2img")
    assert_matches(webui, "img2img", stock, fast)


def test_inpainting_matches_stock(webui: WebUI) -> None:
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (16, 16, 48, 48))
    payload = request("a red door in a wall", init_images=[encode_image(init_image())], mask=encode_image(mask),
                      denoising_strength=0.75, mask_blur=0, inpainting_fill=1, inpaint_full_res=False)
    stock, fast = run_both(webui, payload, "img2img")
    assert_matches(webui, "inpainting", stock, fast)
    # outside the mask the picture is the start image's, inside it is new: the mask reached the pipeline
    start = np.asarray(init_image(), dtype=np.float64)
    outside = np.abs(fast.images[0][:8] - start[:8]).mean()
    assert outside < np.abs(fast.images[0][20:44, 20:44] - start[20:44, 20:44]).mean()


def test_hires_fix_second_pass_is_accelerated(webui: WebUI) -> None:
    payload = request("a castle in the fog", enable_hr=True, hr_scale=1.5, hr_upscaler="Latent",
                      hr_second_pass_steps=2, denoising_strength=0.5)
    stock, fast = run_both(webui, payload)
    assert fast.images[0].shape == (96, 96, 3)
    assert_matches(webui, "hires fix", stock, fast)
    unet_calls = sum(n for label, n in fast.status["calls"].items() if "diffusion_model" in label)
    assert unet_calls >= payload["steps"] + 2, fast.status["calls"]  # both passes ran through OpenVINO


def test_batch_size_times_batch_count(webui: WebUI) -> None:
    stock, fast = run_both(webui, request("a bowl of fruit", batch_size=2, n_iter=2))
    assert len(fast.images) == 4
    assert_matches(webui, "batch size 2 x count 2", stock, fast)
    assert min(psnr(fast.images[0], other) for other in fast.images[1:]) < 30  # four different pictures


def test_unet_attention_is_one_fused_attention_in_openvino_and_the_webuis_choice_stays(webui: WebUI) -> None:
    """On a CPU A1111's "Automatic" attention is InvokeAI, whose slicing OpenVINO cannot convert with dynamic
    shapes at full size: while the UNet is routed its attention is A1111's own "sdp" forward, and stock
    generations before and after keep the WebUI's choice."""
    payload = perturbed(request("a tram in the rain"), "attention", 0.0)
    before = webui.generate(payload)
    fast = webui.generate(accelerated(dict(payload, override_settings=dict(payload["override_settings"],
                                                                             sdxl_crop_top=next(_unique)))))
    fast.status = webui.status()
    after = webui.generate(dict(payload, override_settings=dict(payload["override_settings"], sdxl_crop_top=0)))
    assert "ovtest attention: split_cross_attention_forward_invokeAI" in before.infotexts[0]
    assert "ovtest attention: scaled_dot_product_attention_forward" in fast.infotexts[0]
    assert "ovtest attention: split_cross_attention_forward_invokeAI" in after.infotexts[0]
    assert "in place of InvokeAI" in fast.status["status"], fast.status["status"]
    assert psnr(before.images[0], after.images[0]) == math.inf
    assert_matches(webui, "UNet attention fused (stock: InvokeAI)", before, fast)


def test_long_prompt_with_emphasis_and_break(webui: WebUI) -> None:
    """A prompt longer than its negative prompt: A1111 runs the UNet at a batch of 1 for each (their
    conditionings differ in length). Nothing is converted again (it was a whole capture and conversion
    of the UNet, about a minute at full size): torch guards this UNet's batch on being more than 1, so the
    batch of 1 is captured once more, to the same graph, whose converted model the cache holds."""
    webui.generate(accelerated(request("a city at night")))  # the UNet at a batch of 2, at this size
    words = ", ".join(f"(detail {i}:1.{i % 5 + 1})" if i % 3 == 0 else f"[thing {i}]" for i in range(60))
    stock, fast = run_both(webui, request(f"a city at night, {words} BREAK neon lights"))
    assert_matches(webui, "long prompt (3 chunks), emphasis, BREAK", stock, fast)
    assert fast.status["convert_seconds"] == 0, fast.status["status"]
    assert fast.status["captures_made"] <= 1, fast.status["status"]
    # its two calls per step, one per length, run one UNet compiled for all shapes (one copy of the weights):
    # compiled for this capture, or the first capture's, borrowed when that one holds a model for all shapes
    assert "compiled model for all shapes" in fast.status["status"], fast.status["status"]


def test_second_and_third_resolution_and_back_without_a_conversion(webui: WebUI) -> None:
    """By default a generation keeps in memory the compiled models it uses: the size of the generation
    before the last is released, and going back to it is a compile, never a conversion."""
    for i, (width, height) in enumerate([(96, 64), (64, 96), (96, 64)]):
        stock, fast = run_both(webui, request(f"a mountain lake, view {i}", width=width, height=height))
        assert fast.images[0].shape == (height, width, 3)
        assert_matches(webui, f"{width}x{height}" + (" (again)" if i == 2 else ""), stock, fast)
        if i > 0:
            assert fast.status["released"] > 0, fast.status["status"]  # the previous size's models
            assert "Released" in fast.status["status"], fast.status["status"]
    assert fast.status["convert_seconds"] == 0, fast.status["status"]


def test_keep_every_size_option_makes_a_return_free_of_compiles(webui: WebUI) -> None:
    """The Settings tab's "keep every compiled size" (here through the options API): a size seen
    before never compiles again; on the CPU one model compiled for all sizes serves them from the
    second size on (not one copy of the weights per size)."""
    webui.call("/sdapi/v1/options", {"openvino_keep_all_sizes": True})
    statuses = []
    try:
        for i, (width, height) in enumerate([(64, 96), (96, 96), (64, 96)]):
            stock, fast = run_both(webui, request(f"a forest path, view {i}", width=width, height=height))
            assert_matches(webui, f"{width}x{height} (all sizes kept)" + (" (again)" if i == 2 else ""), stock, fast)
            assert fast.status["released"] == 0, fast.status["status"]
            statuses.append(fast.status["status"])
        # the size before (an earlier test's, still held) or the first one here is replaced by the model
        # for all shapes when the next size comes
        assert any("one compiled model for all shapes (replaces" in s for s in statuses[:2]), statuses
    finally:
        webui.call("/sdapi/v1/options", {"openvino_keep_all_sizes": False})
    assert fast.status["compiles"] == 0, fast.status["status"]  # a size seen before never recompiles


def test_api_script_args_followed_by_another_always_on_script(webui: WebUI) -> None:
    payload = perturbed(request("a ship at sea"), "", 0.0)  # the other script is present, with its own args
    stock, fast = run_both(webui, payload)
    assert_matches(webui, "API with another always-on script", stock, fast)


def test_checkpoint_switch_and_back(webui: WebUI) -> None:
    """The UNet, the VAE decoder and the text encoder are converted with their weights as inputs, so the
    disk cache's entries of the first checkpoint serve the second (a new model object here: each tiny
    checkpoint has its own .yaml): the switch compiles them, it does not convert them. Acceleration being in
    use, the second checkpoint's weights move into the weight file as A1111 loads it, so the request after the
    load starts with one copy of them (the status says so) and moves nothing itself."""
    webui.generate(accelerated(request("a train in the snow, before the switch")))  # the first one's entries
    try:
        webui.call("/sdapi/v1/options", {"sd_model_checkpoint": CHECKPOINT_B})
        loaded = webui.status()
        in_file = loaded["weights_in_file_now"]["bytes"]
        assert in_file > 0 and loaded["weight_file_pages"][0] >= in_file, loaded
        stock, fast = run_both(webui, request("a train in the snow"))
        assert "ovtest-tiny-b" in fast.infotexts[0]
        assert_matches(webui, "checkpoint switch", stock, fast)
        assert "At the checkpoint load (ovtest-tiny-b" in fast.status["status"], fast.status["status"]
        assert fast.status["weights_moved_bytes"] == 0, fast.status["status"]
        dynamic = [line for line in fast.status["status"].splitlines() if ": dynamic on" in line]
        assert len(dynamic) == 3, fast.status["status"]  # the UNet's graph, the VAE decoder's, the text encoder's
        assert all("cache hit" in line or "conversion reused" in line for line in dynamic), fast.status["status"]
    finally:
        webui.call("/sdapi/v1/options", {"sd_model_checkpoint": CHECKPOINT_A})
    stock, fast = run_both(webui, request("a train in the snow, again"))
    assert "ovtest-tiny-a" in fast.infotexts[0]
    assert_matches(webui, "switch back", stock, fast)


def test_checkpoint_override_in_the_request(webui: WebUI) -> None:
    payload = request("a bridge over a river", override_settings={"sd_model_checkpoint": CHECKPOINT_B},
                      override_settings_restore_afterwards=True)
    stock, fast = run_both(webui, payload)
    assert "ovtest-tiny-b" in fast.infotexts[0] and "ovtest-tiny-b" in stock.infotexts[0]
    assert_matches(webui, "override_settings checkpoint", stock, fast)


def _in_background(webui: WebUI, payload: dict[str, Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def work() -> None:
        try:
            out["result"] = webui.generate(payload)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            out["error"] = exc

    thread = threading.Thread(target=work)
    thread.start()
    return thread, out


def _wait_for(predicate: Any, timeout: float = 300) -> Any:
    t0 = time.time()
    while time.time() - t0 < timeout:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out")


def test_skip_and_interrupt_mid_batch_leave_nothing_patched(webui: WebUI) -> None:
    reference = request("a quiet street")
    before = webui.generate(reference)
    # a batch count with room to spare: a busy 2-core machine can answer the progress polls a job or two late
    thread, out = _in_background(webui, accelerated(request("a busy market", steps=30, n_iter=8)))
    _wait_for(lambda: webui.get("/sdapi/v1/progress?skip_current_image=true")["state"]["sampling_step"] >= 2)
    webui.call("/sdapi/v1/skip", {})
    _wait_for(lambda: webui.get("/sdapi/v1/progress?skip_current_image=true")["state"]["job_no"] >= 1)
    _wait_for(lambda: webui.get("/sdapi/v1/progress?skip_current_image=true")["state"]["sampling_step"] >= 2)
    webui.call("/sdapi/v1/interrupt", {})
    thread.join(600)
    assert "error" not in out, out.get("error")
    assert 1 <= len(out["result"].images) < 8  # stopped inside the batch count
    after = webui.generate(dict(reference, override_settings=dict(reference["override_settings"], sdxl_crop_top=0)))
    assert psnr(before.images[0], after.images[0]) == math.inf  # stock after == stock before: nothing left patched
    stock, fast = run_both(webui, request("a quiet street, later"))
    assert_matches(webui, "after Skip and Interrupt", stock, fast)


def test_live_preview_during_an_accelerated_generation(webui: WebUI) -> None:
    webui.call("/sdapi/v1/options", {"live_previews_enable": True, "show_progress_every_n_steps": 1,
                                      "live_preview_content": "Prompt"})
    try:
        payload = request("a field of sunflowers", steps=40)
        thread, out = _in_background(webui, accelerated(payload))
        preview = _wait_for(lambda: webui.get("/sdapi/v1/progress?skip_current_image=false").get("current_image"))
        thread.join(600)
        assert "error" not in out, out.get("error")
        assert len(preview) > 100  # a picture, decoded during sampling
        fast = out["result"]
        fast.status = webui.status()
        stock = webui.generate(dict(payload, override_settings=dict(payload["override_settings"], sdxl_crop_top=-1)))
        assert_matches(webui, "with live previews", stock, fast)
    finally:
        webui.call("/sdapi/v1/options", {"live_previews_enable": False})


def stock_then_accelerated(webui: WebUI, payload: dict[str, Any],
                           args: list[Any]) -> tuple[Result, Result, dict[str, Any]]:
    """Stock's picture for ``payload`` (its text encoder run anew), then the dropdown entry's with ``args``, and its
    status, which must show every part called through OpenVINO."""
    stock = webui.generate(dict(payload, override_settings=dict(payload["override_settings"],
                                                                sdxl_crop_top=next(_unique))))
    fast = webui.generate(accelerated(payload, args))
    status = webui.status()
    assert_ran_in_openvino(status)
    return stock, fast, status


def test_int8_unet_calibrates_on_the_first_generation_then_runs_quantized(webui: WebUI) -> None:
    """INT8: the first generation runs the UNet at float while its steps are recorded, and the UNet is
    quantized (NNCF, installed by install.py) at its end; the next generation runs the INT8 model."""
    payload = request("a red barn in a field, int8", steps=4)
    stock, first, status = stock_then_accelerated(webui, payload, INT8_ARGS)
    text = status["status"]
    assert "INT8: runs at float while 8 call(s) are recorded for calibration" in text, text
    assert "INT8 quantization; calibrated on 4 recorded call(s)" in text, text  # 4 steps, cond+uncond batched
    assert 'OpenVINO: "CPU, UNet+VAE+TE, int8"' in first.infotexts[0]
    webui.record("INT8 precision, calibrating run (UNet at float)", min_psnr(stock, first))

    again = webui.generate(accelerated(dict(payload, override_settings=dict(payload["override_settings"],
                                                                            sdxl_crop_top=next(_unique))), INT8_ARGS))
    status = webui.status()
    assert_ran_in_openvino(status)
    assert "int8" in status["status"] and "INT8 model" in status["status"], status["status"]
    assert "INT8 quantization" not in status["status"], status["status"]
    quality = min_psnr(stock, again)
    webui.record("INT8 UNet vs stock f32", quality)
    assert quality >= INT8_MIN_PSNR, quality
    assert np.std(again.images[0]) > 5

    # at another precision the INT8 UNet (and the VAE and text encoder at auto) are released, not kept in
    # memory beside the new builds
    webui.generate(accelerated(dict(payload, override_settings=dict(payload["override_settings"],
                                                                    sdxl_crop_top=next(_unique)))))
    status = webui.status()
    assert_ran_in_openvino(status)
    assert re.search(r"Released \d+ compiled model\(s\) .*precisions", status["status"]), status["status"]


def test_eight_bit_weights_make_a_picture_close_to_stock_and_say_so(webui: WebUI) -> None:
    """8-bit weights: the UNet's and text encoder's weights compressed to 8 bits,
    computing at Automatic; the VAE at Automatic. The picture stays close to stock f32's, the status and the
    infotext say what ran, and PyTorch's copy stays in the weight file."""
    stock, fast, status = stock_then_accelerated(webui, request("a red barn in a field, 8-bit weights", steps=4),
                                                 W8_ARGS)
    assert_no_pytorch_copy_held(webui, status)
    assert 'OpenVINO: "CPU, UNet+VAE+TE, int8-weights"' in fast.infotexts[0]
    compiled = [line for line in status["status"].splitlines() if "OpenVINO partition" in line]
    assert sum("int8-weights" in line for line in compiled) >= 2, status["status"]  # the UNet and the text encoder
    assert any("int8-weights" not in line for line in compiled), status["status"]  # the VAE
    quality = min_psnr(stock, fast)
    webui.record("8-bit weights vs stock f32", quality)
    assert quality >= W8_MIN_PSNR, quality
    assert np.std(fast.images[0]) > 5


def test_restart_with_a_warm_cache(webui: WebUI) -> None:
    """Last: restarts the WebUI. Compiled models come back from the disk cache, not from a conversion."""
    webui.stop()
    webui.start()
    stock, fast = run_both(webui, request("a lighthouse on a cliff, after a restart"))
    assert_matches(webui, "after a restart (warm cache)", stock, fast)
    assert fast.status["cache_hits"] > 0, fast.status["status"]
    # dynamo did not trace the parts again: their captures came from the disk cache
    assert fast.status["captures_loaded"] >= 3 and fast.status["captures_made"] == 0, fast.status["status"]
    assert "loaded from the disk cache instead of tracing again" in fast.status["status"], fast.status["status"]
    # the INT8 UNet quantized before the restart comes from the disk cache: no calibration
    webui.generate(accelerated(request("a red barn in a field, after a restart", steps=4), INT8_ARGS))
    status = webui.status()["status"]
    assert "INT8 model from the cache" in status and "recorded for calibration" not in status, status
