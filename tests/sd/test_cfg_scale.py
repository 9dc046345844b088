"""CFG scale as the WebUI applies it: ``uncond + cfg * (cond - uncond)`` for every cfg >= 0.

Oracles: with the negative prompt equal to the prompt, guidance at any scale returns the
conditional prediction, and with the prompt equal to the negative prompt the unconditional one
(both through the guided path every diffusers version takes for a scale above 1). One Euler step
to sigma 0 is affine in the model's prediction, so the latent at scale c must be
``latent(0) + c * (latent(1) - latent(0))``.
"""

from __future__ import annotations

import pytest
import torch

from ov_accelerate_sd.loader import load_components
from ov_accelerate_sd.pipeline import GenerationJob, Generator
from ov_accelerate_sd.samplers import make_scheduler

PROMPT, NEGATIVE = "a red cat on a windowsill", "blurry, dark"
SIZE = 64


@pytest.fixture(scope="module")
def sd1(tiny_checkpoints: dict) -> Generator:
    return Generator(load_components(tiny_checkpoints["sd1"][0]))


def _latent(gen: Generator, prompt: str, negative: str, cfg: float, mode: str) -> torch.Tensor:
    """One Euler step from a fixed latent, through the pipelines ``Generator`` renders with."""
    cond, uncond = gen.prompt_encoder().encode_pair(prompt, negative)
    start = torch.randn(1, 4, SIZE // 8, SIZE // 8, generator=torch.Generator().manual_seed(3))
    kwargs = {"prompt_embeds": cond.embeds, "negative_prompt_embeds": uncond.embeds, "guidance_scale": cfg,
              "num_inference_steps": 1, "output_type": "latent"}
    if mode == "txt2img":
        pipe = gen.txt2img
        kwargs.update(latents=start, width=SIZE, height=SIZE)
    else:
        pipe = gen.img2img
        kwargs.update(image=start, strength=1.0, generator=torch.Generator().manual_seed(5))
    pipe.scheduler = make_scheduler("Euler", gen.components.scheduler_config)
    with torch.no_grad():
        return pipe(**kwargs).images


@pytest.mark.parametrize("mode", ["txt2img", "img2img"])
def test_cfg_follows_the_webui_formula_below_and_above_1(sd1: Generator, mode: str) -> None:
    unconditional = _latent(sd1, NEGATIVE, NEGATIVE, 7.0, mode)
    conditional = _latent(sd1, PROMPT, PROMPT, 7.0, mode)
    gap = float((conditional - unconditional).abs().max())
    assert gap > 1e-2, "the prompts must lead to different predictions for this test to mean anything"
    tolerance = gap * 1e-3
    for cfg in (0.0, 0.25, 0.5, 1.0, 1.5, 4.0):
        expected = unconditional + cfg * (conditional - unconditional)
        got = _latent(sd1, PROMPT, NEGATIVE, cfg, mode)
        assert float((got - expected).abs().max()) < tolerance, f"cfg {cfg}"


@pytest.mark.parametrize("cfg", [-1.0, float("nan"), float("inf")])
def test_cfg_must_be_finite_and_not_negative(cfg: float) -> None:
    with pytest.raises(ValueError, match=r"cfg_scale \S+ must be a finite number >= 0"):
        GenerationJob(prompt="x", cfg_scale=cfg).validated()
