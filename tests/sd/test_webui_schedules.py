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


# -- whole trajectories, with a denoiser whose answer is known -----------------------------------------
#
# For data x0 ~ N(0, S^2) per element, the ideal denoiser is linear: D(x, sigma) = x S^2 / (S^2 + sigma^2),
# and the ideal noise prediction of the UNet (input x / sqrt(sigma^2 + 1)) is eps = x sigma / (S^2 + sigma^2).
# Every deterministic sampler then maps the start latent to a multiple of it; the multiple is worked out
# below in float64 from the samplers' published update rules (Karras et al. 2022 Euler/Heun, k-diffusion's
# DPM2 and LMS, Lu et al. 2022 DPM-Solver++(2M), Song et al. 2020 DDIM with eta 0) on the WebUI's schedule.

S = 0.8


def _denoise(x: float, sigma: float) -> float:
    return x * S * S / (S * S + sigma * sigma)


def _lms_coefficient(sigmas: list[float], i: int, j: int, order: int) -> float:
    """Integral over [sigma_i, sigma_i+1] of the Lagrange basis polynomial of sigma_(i-j) on the last points."""
    nodes = [sigmas[i - k] for k in range(order)]
    basis = np.poly1d([1.0])
    for k, node in enumerate(nodes):
        if k != j:
            basis *= np.poly1d([1.0, -node]) / (nodes[j] - node)
    integral = basis.integ()
    return float(integral(sigmas[i + 1]) - integral(sigmas[i]))


def reference_multiple(sampler: str, s: list[float]) -> float:
    """The final latent over the start latent (``s[0]`` times the unit noise) for a k-diffusion sampler."""
    x = s[0]
    ds: list[float] = []
    old_denoised = None
    for i in range(len(s) - 1):
        sigma, nxt = s[i], s[i + 1]
        denoised = _denoise(x, sigma)
        d = (x - denoised) / sigma
        if sampler == "Euler" or (sampler in ("Heun", "DPM2") and nxt == 0):
            x = x + d * (nxt - sigma)
        elif sampler == "Heun":
            x2 = x + d * (nxt - sigma)
            d2 = (x2 - _denoise(x2, nxt)) / nxt
            x = x + (d + d2) / 2 * (nxt - sigma)
        elif sampler == "DPM2":
            mid = math.exp((math.log(sigma) + math.log(nxt)) / 2)
            x2 = x + d * (mid - sigma)
            x = x + (x2 - _denoise(x2, mid)) / mid * (nxt - sigma)
        elif sampler == "LMS":
            ds.append(d)
            order = min(i + 1, 4)
            x = x + sum(_lms_coefficient(s, i, j, order) * ds[-1 - j] for j in range(order))
        elif sampler == "DPM++ 2M":
            h = math.log(sigma) - math.log(nxt) if nxt > 0 else math.inf
            if old_denoised is None or nxt == 0:
                estimate = denoised
            else:
                r = (math.log(s[i - 1]) - math.log(sigma)) / h
                estimate = (1 + 1 / (2 * r)) * denoised - old_denoised / (2 * r)
            x = nxt / sigma * x + (1 - (nxt / sigma)) * estimate if nxt > 0 else estimate
            old_denoised = denoised
        else:
            raise AssertionError(sampler)
    return x


def reference_ddim_multiple(steps: int) -> float:
    """DDIM (eta 0) on the WebUI's grid, in the variance-preserving latent, from unit noise."""
    grid = ddim_grid(steps)
    x = 1.0
    for t, t_prev in zip(grid[:0:-1], grid[-2::-1]):
        a, a_prev = ACP[t], ACP[t_prev]
        sigma = math.sqrt((1 - a) / a)
        eps = x / math.sqrt(a) * sigma / (S * S + sigma * sigma)
        x0 = (x - math.sqrt(1 - a) * eps) / math.sqrt(a)
        x = math.sqrt(a_prev) * x0 + math.sqrt(1 - a_prev) * eps
    return x


def _ideal_unet_forward(self: torch.nn.Module, sample: torch.Tensor, timestep: torch.Tensor, *args: object,
                        **kwargs: object) -> object:
    from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

    sigma = t_to_sigma(float(torch.as_tensor(timestep).flatten()[0]))
    x = sample.double() * math.sqrt(sigma * sigma + 1)
    return UNet2DConditionOutput(sample=(x * sigma / (S * S + sigma * sigma)).to(sample.dtype))


TRAJECTORY_STEPS = 6
TRAJECTORIES = ["Euler", "Heun", "LMS", "LMS Karras", "DPM2", "DPM2 Karras", "DPM++ 2M", "DDIM"]


@pytest.mark.parametrize("name", TRAJECTORIES)
def test_whole_trajectory_with_the_ideal_gaussian_denoiser(
    sd1: Generator, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from diffusers import UNet2DConditionModel

    monkeypatch.setattr(UNet2DConditionModel, "forward", _ideal_unet_forward)
    vae = sd1.components.vae
    finals: list[torch.Tensor] = []
    original_decode = vae.decode

    def decode(latents: torch.Tensor, *args: object, **kwargs: object) -> object:
        finals.append(latents.double() * vae.config.scaling_factor)
        return original_decode(latents, *args, **kwargs)

    monkeypatch.setattr(vae, "decode", decode)
    job = GenerationJob("a cat", steps=TRAJECTORY_STEPS, sampler=name, width=64, height=64, seed=3,
                        cfg_scale=1.0).validated()
    sd1.run_batch(job, 0)
    noise = initial_noise(3, 64, 64).double()
    base = name.removesuffix(" Karras")
    if base == "DDIM":
        multiple = reference_ddim_multiple(TRAJECTORY_STEPS)
    else:
        kind = "karras" if name.endswith(" Karras") or base in ("DPM++ 2M", "DPM2") else "uniform"
        multiple = reference_multiple(base, schedule(TRAJECTORY_STEPS, kind, discard=base == "DPM2"))
    (final,) = finals
    assert torch.allclose(final, noise * multiple, rtol=2e-4, atol=1e-5), (
        float((final / noise).median()), multiple,
    )
