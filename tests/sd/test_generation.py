"""Generation on tiny models: conditioning shapes, every sampler, seeds, img2img, and OpenVINO vs PyTorch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ov_accelerate_sd.accelerate import Accelerator
from ov_accelerate_sd.loader import load_components
from ov_accelerate_sd.noise import initial_noise
from ov_accelerate_sd.pipeline import GenerationJob, Generator, Interrupted
from ov_accelerate_sd.settings import build_sd_settings

# Tolerance of OpenVINO (f32 precision hint) vs PyTorch on the tiny models, per 8-bit pixel value.
PIXEL_TOLERANCE = 3


@pytest.fixture(scope="module")
def sd1(tiny_checkpoints: dict) -> Generator:
    return Generator(load_components(tiny_checkpoints["sd1"][0]), "tiny", "0123456789")


def _pixels(images: list) -> np.ndarray:
    return np.stack([np.asarray(i.image).astype(np.int16) for i in images])


def test_long_prompt_chunks_and_padded_negative(sd1: Generator) -> None:
    encoder = sd1.prompt_encoder()
    long_prompt = ", ".join(["a red (house:1.3)"] * 40)
    cond, uncond = encoder.encode_pair(long_prompt, "blurry")
    assert cond.embeds.shape[1] == 77 * cond.chunks and cond.chunks >= 3
    assert uncond.embeds.shape == cond.embeds.shape
    empty = encoder.encode("").embeds
    assert torch.allclose(uncond.embeds[:, 77:154], empty)
    assert torch.allclose(uncond.embeds[:, :77], encoder.encode("blurry").embeds)
    swapped, _ = encoder.encode_pair("short", long_prompt)
    assert swapped.embeds.shape == cond.embeds.shape
    assert encoder.encode("a BREAK b").chunks == 2


def test_weights_change_the_conditioning(sd1: Generator) -> None:
    encoder = sd1.prompt_encoder()
    plain = encoder.encode("a cat").embeds
    assert not torch.allclose(plain, encoder.encode("a (cat:1.5)").embeds)
    assert torch.allclose(plain, encoder.encode("a (cat:1.0)").embeds)


def test_sdxl_conditioning_has_both_encoders_and_pooled(tiny_checkpoints: dict) -> None:
    generator = Generator(load_components(tiny_checkpoints["sdxl"][0]))
    cond, uncond = generator.prompt_encoder().encode_pair("a cat " * 60, "")
    assert cond.embeds.shape == (1, 154, 64) and uncond.embeds.shape == (1, 154, 64)
    assert cond.pooled.shape == (1, 32)


# Every sampler name runs: tests/sd/test_webui_schedules.py (with the timesteps the UNet sees).


def test_seeds_batches_and_determinism(sd1: Generator) -> None:
    job = GenerationJob("a cat", steps=2, width=64, height=64, seed=100, batch_size=2, batch_count=2).validated()
    first = sd1.run_batch(job, 0)
    second = sd1.run_batch(job, 1)
    assert [i.seed for i in first + second] == [100, 101, 102, 103]
    single = GenerationJob("a cat", steps=2, width=64, height=64, seed=102).validated()
    again = sd1.run_batch(single, 0)
    assert np.abs(_pixels(again)[0] - _pixels(second)[0]).max() <= 1
    assert "Seed: 102" in again[0].infotext and "Model hash: 0123456789" in again[0].infotext


def test_txt2img_starts_from_the_webui_latent(sd1: Generator) -> None:
    seen = []
    unet = sd1.components.unet
    hook = unet.register_forward_pre_hook(lambda m, args, kwargs: seen.append(args[0].clone()), with_kwargs=True)
    try:
        sd1.run_batch(GenerationJob("x", steps=1, sampler="Euler", width=64, height=64, seed=9,
                                    cfg_scale=1.0).validated(), 0)
    finally:
        hook.remove()
    scheduler = sd1.txt2img.scheduler
    expected = initial_noise(9, 64, 64) * scheduler.init_noise_sigma
    expected = expected / ((scheduler.sigmas[0] ** 2 + 1) ** 0.5)
    assert torch.allclose(seen[0], expected, atol=1e-5)


def test_img2img_uses_the_init_image(sd1: Generator) -> None:
    base = sd1.run_batch(GenerationJob("a cat", steps=2, width=64, height=64, seed=1).validated(), 0)[0]
    job = GenerationJob("a cat", steps=4, width=64, height=64, seed=1, init_image=base.image,
                        denoising_strength=0.25).validated()
    out = sd1.run_batch(job, 0)[0]
    assert "Denoising strength: 0.25" in out.infotext
    other = GenerationJob("a cat", steps=4, width=64, height=64, seed=1, init_image=base.image.rotate(90),
                          denoising_strength=0.25).validated()
    assert np.abs(_pixels([out]) - _pixels(sd1.run_batch(other, 0))).max() > 10


def test_stop_after_the_current_step(sd1: Generator) -> None:
    steps = []
    job = GenerationJob("a cat", steps=10, width=64, height=64, seed=1).validated()
    with pytest.raises(Interrupted):
        sd1.run_batch(job, 0, on_step=lambda s, n: steps.append(s), should_stop=lambda: len(steps) >= 2)
    assert steps == [1, 2]


def test_bad_job_values() -> None:
    with pytest.raises(ValueError, match="width 100 must be a multiple of 8 and at least 64"):
        GenerationJob("x", width=100).validated()
    with pytest.raises(ValueError, match="unknown sampler"):
        GenerationJob("x", sampler="nope").validated()


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_openvino_matches_pytorch(tiny_checkpoints: dict, tmp_path, family: str) -> None:
    pytest.importorskip("openvino")
    components = load_components(tiny_checkpoints[family][0])
    job = GenerationJob("a (cat:1.2) on a mat", "dog", steps=3, width=64, height=64, seed=11,
                        batch_size=2).validated()
    reference = _pixels(Generator(components).run_batch(job, 0))
    settings = build_sd_settings({"precision": "f32", "model_caching": False, "cache_dir": str(tmp_path)})
    accelerator = Accelerator(components, settings).apply()
    try:
        got = _pixels(Generator(components).run_batch(job, 0))
        stats = accelerator.stats()
    finally:
        accelerator.restore()
    assert stats["ov_calls"] > 0 and stats["eager_calls"] == 0
    assert np.abs(got - reference).max() <= PIXEL_TOLERANCE
    assert components.unet.forward.__func__ is type(components.unet).forward  # restored
