"""SDXL and SD 2.x in the real WebUI, as regression guards: SDXL txt2img, SDXL with the refiner switching in
mid-generation, SDXL with a LoRA, and SD 2.x v-prediction txt2img, each against stock A1111 at f32 with every
text encoder, the UNet and the VAE called through OpenVINO.

The checkpoints (``make_models_sdxl_sd2.py``) are made by the WebUI's own sgm and LDM classes from shrunken
copies of its configs: SDXL base has CLIP-L's and OpenCLIP's kinds of text encoder, the refiner OpenCLIP's
only, SD 2.x OpenCLIP's with v-prediction. Stock A1111's own pictures show first that each model renders a
picture that depends on the prompt, and that the refiner and the LoRA each move the picture well past the
comparison bound, so a part left out or run on the wrong weights would fail the comparison.

A1111 keeps the last prompt's conditioning (see ``test_real_webui.py``): here ``sdxl_crop_top`` is part of the
conditioning itself, so every request gets a new value of ``CLIP_stop_at_last_layers`` instead, which is in
the conditioning-cache key but unused by these models (SDXL's CLIP-L layer is the config's unless
``sdxl_clip_l_skip`` is on; OpenCLIP's is its ``layer``).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from PIL import Image

from .test_real_webui import (
    MIN_PSNR,
    _in_background,
    _wait_for,
    accelerated,
    assert_ran_in_openvino,
    min_psnr,
    perturbed,
)
from .test_real_webui import request as new_request
from .webui import Result, WebUI, decode_image

SDXL_BASE = "ovtest-sdxl-base.safetensors"
SDXL_REFINER = "ovtest-sdxl-refiner.safetensors"
SD2_V = "ovtest-sd2-v.safetensors"
SDXL_LORA = "ovtest-sdxl-lora"
#: Routed text encoders of each checkpoint, as the status labels them: A1111 wraps each of SDXL's embedders
#: (``conditioner.embedders.N``) and SD 2.x's one (``cond_stage_model``) in its prompt wrapper.
TEXT_ENCODERS = {
    SDXL_BASE: ("conditioner.embedders.0.wrapped.transformer.text_model.encoder",
                "conditioner.embedders.1.wrapped.text_transformer_forward"),
    SDXL_REFINER: ("conditioner.embedders.0.wrapped.text_transformer_forward",),
    SD2_V: ("cond_stage_model.wrapped.text_transformer_forward",),
}
UNET, VAE = "model.diffusion_model", "first_stage_model.decoder"
_clip_skips = itertools.cycle([1, 2])


def fresh(payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` with a conditioning-cache key unlike the previous request's (see the module docstring) and
    SDXL's crop at the top left for every request."""
    overrides = dict(payload.get("override_settings") or {})
    overrides.update(sdxl_crop_top=0, sdxl_crop_left=0, CLIP_stop_at_last_layers=next(_clip_skips))
    return dict(payload, override_settings=overrides)


def generate(webui: WebUI, payload: dict[str, Any], fast: bool = False) -> Result:
    """Stock's picture for ``payload`` or, with ``fast``, the accelerated one with the extension's status."""
    if not fast:
        return webui.generate(fresh(payload))
    result = webui.generate(accelerated(fresh(payload)))
    result.status = webui.status()
    return result


def stock_and_fast(webui: WebUI, payload: dict[str, Any]) -> tuple[Result, Result]:
    return generate(webui, payload), generate(webui, payload, fast=True)


def note_status(webui: WebUI, what: str, status: dict[str, Any]) -> None:
    """The accelerated run's status text, in ``sdxl-sd2-status.txt`` in the test's log folder."""
    with open(webui.log_dir / "sdxl-sd2-status.txt", "a") as f:
        f.write(f"== {what}\n{status['status']}\n")


def parts(checkpoint: str, vae: bool = True) -> tuple[str, ...]:
    """Labels of ``checkpoint``'s routed parts: its UNet, its VAE decoder (unless ``vae`` is False), its text
    encoders."""
    return (UNET, *((VAE,) if vae else ()), *TEXT_ENCODERS[checkpoint])


def assert_every_part_in_openvino(status: dict[str, Any], expected: dict[str, tuple[str, ...]]) -> None:
    """Each of ``expected``'s parts (checkpoint -> labels) called through OpenVINO; nothing ran in PyTorch.
    After a switch during the run the status names the parts of each checkpoint switched to ("ovtest-sdxl-refiner:
    ..."); the generation's own model, the first of ``expected`` (the one A1111 loads for the request, also when it
    loads it inside the request before sampling), is named plainly or by its checkpoint."""
    assert_ran_in_openvino(status, ("UNet", "VAE"))
    called = [label for label, n in status["calls"].items() if n > 0]
    for i, (checkpoint, labels) in enumerate(expected.items()):
        prefix = f"{checkpoint.rsplit('.', 1)[0]}: " if len(expected) > 1 else ""
        for label in labels:
            assert any(c.endswith(label) and (c.startswith(prefix) or (i == 0 and ": " not in c)) for c in called), \
                f"{checkpoint}: {label} not called in OpenVINO: {status['calls']}"


def keep_picture(webui: WebUI, name: str, result: Result) -> None:
    """The first picture of ``result`` as ``pictures/<name>.png`` in the test's log folder, to look at."""
    folder = webui.log_dir / "pictures"
    folder.mkdir(exist_ok=True)
    Image.fromarray(result.images[0].astype(np.uint8)).save(folder / f"{name}.png")


def assert_sane(webui: WebUI, what: str, picture: Result, other_prompt: Result) -> None:
    """Stock's picture is a picture (not a flat field) that another prompt changes past the bound."""
    keep_picture(webui, f"{what}, stock", picture)
    keep_picture(webui, f"{what}, stock, another prompt", other_prompt)
    assert np.std(picture.images[0]) > 5, f"{what}: a flat picture"
    value = min_psnr(picture, other_prompt)
    webui.record(f"{what}: stock, another prompt", value)
    assert value < MIN_PSNR, f"{what}: the prompt hardly changes stock's picture ({value:.1f} dB)"


def check_txt2img(webui: WebUI, checkpoint: str, what: str) -> None:
    stock, fast = stock_and_fast(webui, new_request("a lighthouse on a cliff, (dramatic sky:1.2)"))
    assert checkpoint.split(".")[0] in fast.infotexts[0]
    assert_sane(webui, what, stock, generate(webui, new_request("a bowl of fruit on a table")))
    assert_every_part_in_openvino(fast.status, {checkpoint: parts(checkpoint)})
    note_status(webui, what, fast.status)
    value = min_psnr(stock, fast)
    webui.record(f"{what}: accelerated vs stock", value, fast)
    assert value >= MIN_PSNR, f"{what}: {value:.1f} dB\n{fast.status['status']}"


@pytest.mark.parametrize("checkpoint", [SDXL_BASE], indirect=True)
def test_sdxl_txt2img_matches_stock(webui: WebUI, checkpoint: str) -> None:
    check_txt2img(webui, checkpoint, "SDXL txt2img")


@pytest.mark.parametrize("checkpoint", [SDXL_BASE], indirect=True)
@pytest.mark.parametrize(("part", "relative_std"), [("unet", 0.05), ("vae", 0.1), ("te0", 2.0), ("te1", 2.0)])
def test_the_sdxl_comparison_would_catch_a_wrong_part(webui: WebUI, checkpoint: str, part: str,
                                                       relative_std: float) -> None:
    """An error in one routed part's output (added to the accelerated part's) moves SDXL's picture below the
    bound, as it does SD 1.5's (``test_real_webui.py``): the UNet's, the VAE decoder's, CLIP-L's or OpenCLIP's.
    The tiny model's picture is far less sensitive to its text encoders than to its UNet or VAE: noise of their
    output's own spread moves it to 38.7 dB (CLIP-L) and 40.7 dB (OpenCLIP), so their error here is twice that
    (about 33-35 dB); another prompt moves it to 28.6 dB."""
    payload = new_request(f"a harbour at dawn, {part}")
    stock = generate(webui, payload)
    wrong = generate(webui, perturbed(payload, part, relative_std), fast=True)
    assert_every_part_in_openvino(wrong.status, {SDXL_BASE: parts(SDXL_BASE)})
    value = min_psnr(stock, wrong)
    webui.record(f"SDXL: perturbed {part} output by {relative_std:.0%}", value)
    assert value < MIN_PSNR


@pytest.mark.parametrize("checkpoint", [SD2_V], indirect=True)
def test_sd2_v_prediction_txt2img_matches_stock(webui: WebUI, checkpoint: str) -> None:
    check_txt2img(webui, checkpoint, "SD 2.x v-prediction txt2img")


@pytest.mark.parametrize("checkpoint", [SDXL_BASE], indirect=True)
def test_sdxl_with_the_refiner_switching_mid_generation_matches_stock(webui: WebUI, checkpoint: str) -> None:
    """A1111 loads the refiner halfway through sampling (``refiner_switch_at``): its text encoder, UNet and VAE
    are routed through OpenVINO from there on, and the picture is stock's with the refiner."""
    text = "a castle in the fog"
    plain = generate(webui, new_request(text, steps=4))
    stock, fast = stock_and_fast(webui, new_request(text, steps=4, refiner_checkpoint=SDXL_REFINER,
                                                    refiner_switch_at=0.5))
    assert "ovtest-sdxl-refiner" in stock.infotexts[0], stock.infotexts[0]
    moved = min_psnr(plain, stock)
    webui.record("SDXL: stock with the refiner vs without", moved)
    assert moved < MIN_PSNR, f"the refiner does not move stock's picture ({moved:.1f} dB): the test would see nothing"
    # the base's VAE has nothing to decode: the refiner's decodes the picture
    expected = {SDXL_BASE: parts(SDXL_BASE, vae=False), SDXL_REFINER: parts(SDXL_REFINER)}
    assert_every_part_in_openvino(fast.status, expected)
    note_status(webui, "SDXL with the refiner", fast.status)
    switches = [line for line in fast.status["status"].splitlines() if line.startswith("Model switches")]
    assert switches and "ovtest-sdxl-refiner" in switches[0], fast.status["status"]
    value = min_psnr(stock, fast)
    webui.record("SDXL with the refiner from half-way: accelerated vs stock", value, fast)
    assert value >= MIN_PSNR, f"refiner: {value:.1f} dB\n{fast.status['status']}"


@pytest.mark.parametrize("checkpoint", [SDXL_BASE], indirect=True)
def test_sdxl_with_a_lora_matches_stock(webui: WebUI, checkpoint: str) -> None:
    """A kohya SDXL LoRA on the UNet and both text encoders (``lora_unet_``, ``lora_te1_``, ``lora_te2_``)."""
    text = "a stone bridge over a river"
    plain = generate(webui, new_request(text))
    stock, fast = stock_and_fast(webui, new_request(f"{text} <lora:{SDXL_LORA}:1>"))
    moved = min_psnr(plain, stock)
    webui.record("SDXL: stock with the LoRA vs without", moved)
    assert moved < MIN_PSNR, f"the LoRA does not move stock's picture ({moved:.1f} dB): the test would see nothing"
    assert_every_part_in_openvino(fast.status, {SDXL_BASE: parts(SDXL_BASE)})
    note_status(webui, "SDXL with a LoRA", fast.status)
    assert set(fast.status["lora_changes"].values()) == {f"{SDXL_LORA}:1"}, fast.status
    value = min_psnr(stock, fast)
    webui.record("SDXL with a LoRA: accelerated vs stock", value, fast)
    assert value >= MIN_PSNR, f"SDXL LoRA: {value:.1f} dB\n{fast.status['status']}"
    assert min_psnr(plain, generate(webui, new_request(text))) >= MIN_PSNR  # A1111's own weights again


@pytest.mark.parametrize("checkpoint", [SDXL_BASE], indirect=True)
def test_sdxl_live_previews_use_the_approximate_vae_offline(webui: WebUI, checkpoint: str) -> None:
    """Live previews of an accelerated SDXL generation by "Approx NN" (the default): A1111 reads
    ``VAE-approx/vaeapprox-sdxl.pt`` (``make_models_sdxl_sd2.py`` writes one; A1111 would download it). Its
    preview of a 64x64 picture is 16x16 (the full VAE's would be 64x64), and the picture is still stock's."""
    previews = {"live_previews_enable": True, "show_progress_every_n_steps": 1, "show_progress_type": "Approx NN",
                "live_preview_content": "Prompt"}
    before = {key: value for key, value in webui.get("/sdapi/v1/options").items() if key in previews}
    webui.call("/sdapi/v1/options", previews)
    try:
        payload = new_request("a field of sunflowers", steps=40)
        thread, out = _in_background(webui, accelerated(fresh(payload)))
        preview = _wait_for(lambda: webui.get("/sdapi/v1/progress?skip_current_image=false").get("current_image"))
        thread.join(600)
        assert "error" not in out, out.get("error")
        fast = out["result"]
        fast.status = webui.status()
        stock = generate(webui, payload)
    finally:
        webui.call("/sdapi/v1/options", before)
    assert decode_image(preview).shape == (16, 16, 3)
    assert "Downloading VAEApprox" not in webui.log_text()
    assert_every_part_in_openvino(fast.status, {SDXL_BASE: parts(SDXL_BASE)})
    note_status(webui, "SDXL with live previews", fast.status)
    value = min_psnr(stock, fast)
    webui.record("SDXL with live previews (Approx NN): accelerated vs stock", value, fast)
    assert value >= MIN_PSNR, f"SDXL with live previews: {value:.1f} dB\n{fast.status['status']}"
