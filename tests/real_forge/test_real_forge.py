"""Stock Forge on the tier's cheap SD 1.5 checkpoints, and the extension inside it, over HTTP.

The first half shows the bed is a sound reference: stock Forge's picture is not flat, is the same for the same
request, and moves with the prompt, the seed, a LoRA and the checkpoint (so a later comparison of the extension's
picture with stock Forge's can catch a wrong part). The second half shows the extension loads in Forge: its
dropdown entry and its section are listed, and a generation through the dropdown entry returns a picture.
Acceleration is not asserted here yet (``forge.assert_accelerated`` holds what it will check).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.real_webui.webui import SCRIPT_NAME, Result, psnr

from .forge import CHECKPOINT_A, CHECKPOINT_B, LORA, SDXL_CHECKPOINT, SECTION_NAME, Forge

SEED = 4321
# Measured on these checkpoints (64x64, 3 Euler steps, CFG 5): another prompt 26.5 dB, another seed 10.6 dB,
# the LoRA 21.5 dB, the other checkpoint 9.4 dB; on SDXL another prompt 30.7 dB, another seed 10.2 dB. The same
# request twice is identical (inf).
MOVED_BELOW_DB = 40.0


def request(prompt: str, **kwargs: Any) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "prompt": prompt,
        "negative_prompt": "blurry, low quality",
        "seed": SEED,
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
    return payload


def one_image(result: Result) -> Any:
    assert len(result.images) == 1, len(result.images)
    return result.images[0]


@pytest.fixture(scope="module")
def base(forge: Forge) -> Any:
    """Stock Forge's picture of the reference request on CHECKPOINT_A."""
    return one_image(forge.generate(request("a lighthouse on a cliff, (dramatic sky:1.2)")))


def test_stock_picture_is_sane(forge: Forge, base: Any) -> None:
    assert base.shape == (64, 64, 3)
    assert base.std() > 10 and 20 < base.mean() < 235, (base.mean(), base.std())  # neither flat nor saturated
    again = one_image(forge.generate(request("a lighthouse on a cliff, (dramatic sky:1.2)")))
    assert psnr(again, base) == math.inf
    prompt = psnr(one_image(forge.generate(request("a red car in the rain"))), base)
    seed = psnr(one_image(forge.generate(request("a lighthouse on a cliff, (dramatic sky:1.2)", seed=SEED + 1))),
                base)
    forge.record("forge stock: another prompt", prompt)
    forge.record("forge stock: another seed", seed)
    assert prompt < MOVED_BELOW_DB and seed < MOVED_BELOW_DB, (prompt, seed)


def test_lora_moves_the_picture_and_leaves_no_trace(forge: Forge, base: Any) -> None:
    assert LORA in [lora["name"] for lora in forge.get("/sdapi/v1/loras")]
    with_lora = forge.generate(request(f"a lighthouse on a cliff, (dramatic sky:1.2) <lora:{LORA}:1>"))
    assert f'"{LORA}: ' in with_lora.infotexts[0], with_lora.infotexts[0]  # "Lora hashes" names it
    moved = psnr(one_image(with_lora), base)
    forge.record("forge stock: the LoRA", moved)
    assert moved < MOVED_BELOW_DB, moved
    after = one_image(forge.generate(request("a lighthouse on a cliff, (dramatic sky:1.2)")))
    assert psnr(after, base) == math.inf  # Forge put the weights back


def test_checkpoint_switch(forge: Forge, base: Any) -> None:
    forge.call("/sdapi/v1/options", {"sd_model_checkpoint": CHECKPOINT_B})
    try:
        other = forge.generate(request("a lighthouse on a cliff, (dramatic sky:1.2)"))
    finally:
        forge.call("/sdapi/v1/options", {"sd_model_checkpoint": CHECKPOINT_A})
    assert "Model: ovtest-forge-sd15-b" in other.infotexts[0], other.infotexts[0]
    moved = psnr(one_image(other), base)
    forge.record("forge stock: the other checkpoint", moved)
    assert moved < MOVED_BELOW_DB, moved
    back = one_image(forge.generate(request("a lighthouse on a cliff, (dramatic sky:1.2)")))
    assert psnr(back, base) == math.inf


def test_sdxl_picture_is_sane(forge: Forge) -> None:
    """Forge's SDXL path (two text encoders, the pooled output and size embedding as the UNet's ADM input, the
    SDXL approximate VAE of live previews) on the bed's cheap SDXL checkpoint."""
    forge.call("/sdapi/v1/options", {"sd_model_checkpoint": SDXL_CHECKPOINT})
    try:
        first = forge.generate(request("a lighthouse on a cliff, (dramatic sky:1.2)"))
        base = one_image(first)
        prompt = psnr(one_image(forge.generate(request("a red car in the rain"))), base)
        seed = psnr(one_image(forge.generate(request("a lighthouse on a cliff, (dramatic sky:1.2)", seed=SEED + 1))),
                    base)
    finally:
        forge.call("/sdapi/v1/options", {"sd_model_checkpoint": CHECKPOINT_A})
    assert "Model: ovtest-forge-sdxl" in first.infotexts[0], first.infotexts[0]
    assert base.std() > 10 and 20 < base.mean() < 235, (base.mean(), base.std())
    forge.record("forge stock SDXL: another prompt", prompt)
    forge.record("forge stock SDXL: another seed", seed)
    assert prompt < MOVED_BELOW_DB and seed < MOVED_BELOW_DB, (prompt, seed)


def test_extension_is_listed(forge: Forge) -> None:
    scripts = forge.get("/sdapi/v1/scripts")
    for kind in ("txt2img", "img2img"):
        assert SCRIPT_NAME in scripts[kind], scripts[kind]
        assert SECTION_NAME in scripts[kind], scripts[kind]
    log = forge.log_text()
    assert "Error loading script" not in log, forge.log_tail()
    assert "Error running install.py" not in log, forge.log_tail()


def test_dropdown_entry_returns_a_picture(forge: Forge, base: Any) -> None:
    info = next(s for s in forge.get("/sdapi/v1/script-info") if s["name"] == SCRIPT_NAME and not s["is_img2img"])
    defaults = [arg["value"] for arg in info["args"]]
    result = forge.generate(dict(request("a lighthouse on a cliff, (dramatic sky:1.2)"), script_name=SCRIPT_NAME,
                                 script_args=defaults))
    image = one_image(result)
    assert image.shape == base.shape and image.std() > 10, image.std()
    status = forge.status()
    assert isinstance(status.get("status"), str) and status["status"], status
    forge.record(f"forge: the dropdown entry's picture against stock ({status['status'][:80]!r})", psnr(image, base),
                 Result(result.images, result.info, result.seconds, status))
