"""The UNet sees what it sees in the WebUI: the timesteps of every sampler, the first input for a seed, img2img.

The expected values are computed here from first principles, independently of the code under test:
the model's betas -> alphas_cumprod (float64, as ldm) -> sigmas -> A1111 v1.10's schedule for the
sampler (k-diffusion ``get_sigmas``, Karras rho = 7, exponential; DPM2 without the next-to-last
sigma; DDIM/PLMS on ``range(0, 1000, 1000 // steps) + 1``; UniPC "time_uniform") -> the points at
which each k-diffusion sampler calls the model -> k-diffusion's ``sigma_to_t``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ov_accelerate_sd.loader import load_components
from ov_accelerate_sd.noise import initial_noise
from ov_accelerate_sd.pipeline import GenerationJob, Generator
from ov_accelerate_sd.samplers import SAMPLER_NAMES

STEPS = 3
T_TOLERANCE = 2e-3  # float32 (WebUI, us) vs float64 (here) interpolation of the timestep

_BETAS = np.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=np.float64) ** 2
ACP = np.cumprod(1.0 - _BETAS)
SIGMAS = np.sqrt((1 - ACP) / ACP)
LOG_SIGMAS = np.log(SIGMAS)


def sigma_to_t(sigma: float) -> float:
    return float(np.interp(math.log(sigma), LOG_SIGMAS, np.arange(1000)))


def t_to_sigma(t: float) -> float:
    return math.exp(float(np.interp(t, np.arange(1000), LOG_SIGMAS)))


def schedule(steps: int, kind: str, discard: bool = False) -> list[float]:
    n = steps + 1 if discard else steps
    lo, hi = SIGMAS[0], SIGMAS[-1]
    if kind == "uniform":
        out = [t_to_sigma(t) for t in np.linspace(999, 0, n)]
    elif kind == "karras":
        out = [(hi ** (1 / 7) + r * (lo ** (1 / 7) - hi ** (1 / 7))) ** 7 for r in np.linspace(0, 1, n)]
    else:
        out = list(np.exp(np.linspace(math.log(hi), math.log(lo), n)))
    out.append(0.0)
    return out[:-2] + out[-1:] if discard else out


def evaluations(sampler: str, s: list[float]) -> list[float]:
    """The sigmas at which k-diffusion's sampler calls the model (eta 1, s_churn 0)."""
    out = []
    for i in range(len(s) - 1):
        out.append(s[i])
        nxt = s[i + 1]
        if nxt == 0:
            continue
        if sampler == "Heun":
            out.append(nxt)
        elif sampler == "DPM2":
            out.append(math.exp((math.log(s[i]) + math.log(nxt)) / 2))
        elif sampler == "DPM2 a":
            up = min(nxt, math.sqrt(nxt**2 * (s[i] ** 2 - nxt**2) / s[i] ** 2))
            down = math.sqrt(nxt**2 - up**2)
            out.append(math.exp((math.log(s[i]) + math.log(down)) / 2))
        elif sampler == "DPM++ SDE":
            out.append(math.sqrt(s[i] * nxt))
    return out


def ddim_grid(steps: int) -> list[int]:
    return [min(t + 1, 999) for t in range(0, 1000, 1000 // steps)]


def expected_timesteps(name: str, steps: int) -> list[float]:
    base = name.removesuffix(" Karras")
    if base == "DDIM":
        return [float(t) for t in ddim_grid(steps)[:0:-1]]
    if base == "PLMS":
        grid = ddim_grid(steps)[::-1]
        return [float(t) for t in grid[:2] + grid[1:-1]]
    if base == "UniPC":
        return list(np.linspace(999, 0, steps + 1)[:-1])
    kind = {"DPM++ 2M": "karras", "DPM++ SDE": "karras", "DPM2": "karras", "DPM2 a": "karras",
            "DPM++ 2M SDE": "exponential"}.get(base, "uniform")
    if name.endswith(" Karras"):
        kind = "karras"
    s = schedule(steps, kind, discard=base.startswith("DPM2"))
    return [sigma_to_t(x) for x in evaluations(base, s)]


@pytest.fixture(scope="module")
def sd1(tiny_checkpoints: dict) -> Generator:
    return Generator(load_components(tiny_checkpoints["sd1"][0]))


Calls = list[tuple[torch.Tensor, float]]


def _unet_calls(generator: Generator, job: GenerationJob, images: list | None = None) -> Calls:
    seen: Calls = []

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        t = args[1] if len(args) > 1 else kwargs["timestep"]
        seen.append((args[0].detach().clone(), float(torch.as_tensor(t).flatten()[0])))

    handle = generator.components.unet.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        out = generator.run_batch(job, 0)
    finally:
        handle.remove()
    if images is not None:
        images.extend(out)
    return seen


# LCM: diffusers' LCM spaces its timesteps over the 50 origin steps differently (see samplers.py).
EXACT = [n for n in SAMPLER_NAMES if n != "LCM"]


@pytest.mark.parametrize("name", EXACT)
def test_unet_sees_the_webui_timesteps_and_first_latent(sd1: Generator, name: str) -> None:
    """Also: every sampler name runs to an image whose infotext names it."""
    job = GenerationJob("a cat", steps=STEPS, sampler=name, width=64, height=64, seed=21, cfg_scale=1.0).validated()
    images: list = []
    calls = _unet_calls(sd1, job, images)
    assert len(images) == 1 and images[0].image.size == (64, 64)
    assert f"Sampler: {name.replace(' Karras', '')}," in images[0].infotext
    got = [t for _, t in calls]
    want = expected_timesteps(name, STEPS)
    assert len(got) == len(want), (got, want)
    assert np.allclose(got, want, rtol=0, atol=T_TOLERANCE), (got, want)
    noise = initial_noise(21, 64, 64)
    if name in ("DDIM", "PLMS", "UniPC"):
        first = noise
    else:
        s0 = SIGMAS[-1]
        first = noise * s0 / math.sqrt(s0**2 + 1)
    assert torch.allclose(calls[0][0], first, rtol=1e-5, atol=1e-5)


def test_lcm_starts_where_the_webui_starts(sd1: Generator) -> None:
    job = GenerationJob("a cat", steps=4, sampler="LCM", width=64, height=64, seed=5, cfg_scale=1.0).validated()
    images: list = []
    calls = _unet_calls(sd1, job, images)
    s0 = SIGMAS[-1]
    assert calls[0][1] == 999.0 and len(calls) == 4 and "Sampler: LCM," in images[0].infotext
    assert torch.allclose(calls[0][0], initial_noise(5, 64, 64) * s0 / math.sqrt(s0**2 + 1), atol=1e-5)


def _init_latent(sd1: Generator, job: GenerationJob) -> torch.Tensor:
    return sd1._init_latents(job, 1)


@pytest.mark.parametrize(("name", "strength"), [("Euler", 0.5), ("DPM++ 2M", 0.75), ("Heun", 0.3), ("DDIM", 0.5)])
def test_img2img_starts_at_the_webui_sigma_with_the_webui_noise(sd1: Generator, name: str, strength: float) -> None:
    from PIL import Image

    steps = 6
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    job = GenerationJob("a cat", steps=steps, sampler=name, width=64, height=64, seed=8, cfg_scale=1.0,
                        init_image=image, denoising_strength=strength).validated()
    calls = _unet_calls(sd1, job)
    x0, noise = _init_latent(sd1, job), initial_noise(8, 64, 64)
    t_enc = int(min(strength, 0.999) * steps)
    if name == "DDIM":
        grid = ddim_grid(steps)
        a = ACP[grid[t_enc]]
        first = x0 * math.sqrt(a) + noise * math.sqrt(1 - a)
        want = [float(t) for t in grid[t_enc - 1:0:-1]]
    else:
        base = "karras" if name == "DPM++ 2M" else "uniform"
        s = schedule(steps, base)[steps - t_enc - 1:]
        first = (x0 + noise * s[0]) / math.sqrt(s[0] ** 2 + 1)
        want = [sigma_to_t(x) for x in evaluations(name, s)]
    got = [t for _, t in calls]
    assert np.allclose(got, want, rtol=0, atol=T_TOLERANCE), (got, want)
    assert torch.allclose(calls[0][0], first, rtol=1e-4, atol=1e-4)
