"""The WebUI's noise levels: the model's discrete sigmas and the schedules its samplers walk.

Owns what A1111 v1.10 computes before a sampler runs (its behaviour, checked number by number in
``tests/sd/test_webui_schedules.py``). The timestep <-> sigma maps and the Karras / exponential
schedules follow k-diffusion's arithmetic (MIT, see NOTICE) so the UNet gets the same timesteps:

- ``webui_alphas_cumprod``: the model's cumulative alphas as ldm builds them (betas and their
  cumulative product in float64, stored as float32); diffusers multiplies in float32.
- ``sigma_to_t`` / ``t_to_sigma``: k-diffusion's continuous timestep <-> sigma maps
  (piecewise linear in log sigma), which decide the timestep the UNet is given.
- ``webui_sigmas``: the sigma sequence of a k-diffusion sampler for ``steps`` (with the final
  zero): "uniform" (``get_sigmas``: t evenly spaced from 999 to 0), "karras" (rho = 7 between
  the model's smallest and largest sigma) or "exponential", optionally without the
  next-to-last sigma (DPM2, DPM2 a).
- ``ddim_timesteps``: the timesteps A1111's DDIM and PLMS evaluate, in sampling order.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)

SCHEDULES: tuple[str, ...] = ("exponential", "karras", "uniform")
KARRAS_RHO = 7.0


def webui_alphas_cumprod(config: Mapping[str, Any]) -> torch.Tensor:
    """The model's ``alphas_cumprod`` as the WebUI's ldm/sgm models hold it (float32).

    Args:
        config: a diffusers scheduler config (``beta_start``, ``beta_end``, ``beta_schedule``,
            ``num_train_timesteps``).

    Raises:
        ValueError: a beta schedule the WebUI's models do not use.
    """
    steps = int(config.get("num_train_timesteps", 1000))
    start, end = float(config.get("beta_start", 0.00085)), float(config.get("beta_end", 0.012))
    schedule = config.get("beta_schedule", "scaled_linear")
    if schedule == "scaled_linear":
        betas = torch.linspace(start**0.5, end**0.5, steps, dtype=torch.float64) ** 2
    elif schedule == "linear":
        betas = torch.linspace(start, end, steps, dtype=torch.float64)
    else:
        raise ValueError(f"beta schedule {schedule!r} is not one the WebUI uses (scaled_linear, linear)")
    return torch.cumprod(1.0 - betas, dim=0).to(torch.float32)


def model_sigmas(alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """The model's discrete sigmas, ascending (index = training timestep)."""
    return ((1 - alphas_cumprod) / alphas_cumprod) ** 0.5


def t_to_sigma(t: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """k-diffusion's ``DiscreteSchedule.t_to_sigma``: log sigma interpolated linearly in t."""
    t = t.float()
    log_sigmas = sigmas.log()
    low, high, w = t.floor().long(), t.ceil().long(), t.frac()
    return ((1 - w) * log_sigmas[low] + w * log_sigmas[high]).exp()


def sigma_to_t(sigma: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """k-diffusion's ``DiscreteSchedule.sigma_to_t`` (not quantized): the UNet's timestep."""
    log_sigmas = sigmas.log()
    log_sigma = sigma.float().log()
    dists = log_sigma - log_sigmas[:, None]
    low = dists.ge(0).cumsum(dim=0).argmax(dim=0).clamp(max=log_sigmas.shape[0] - 2)
    w = ((log_sigmas[low] - log_sigma) / (log_sigmas[low] - log_sigmas[low + 1])).clamp(0, 1)
    return ((1 - w) * low + w * (low + 1)).view(sigma.shape)


def webui_sigmas(
    sigmas: torch.Tensor, steps: int, schedule: str = "uniform", discard_penultimate: bool = False
) -> torch.Tensor:
    """The sigmas a WebUI k-diffusion sampler steps through, ending with 0.

    Args:
        sigmas: the model's discrete sigmas (``model_sigmas``).
        steps: sampling steps.
        schedule: "uniform", "karras" or "exponential".
        discard_penultimate: computed for ``steps + 1`` and the next-to-last sigma dropped,
            as the WebUI does for DPM2 and DPM2 a.

    Raises:
        ValueError: an unknown schedule.
    """
    # DPM2 steps to the next sigma through a midpoint; the WebUI plans one step more and leaves out
    # the last nonzero sigma, so the final step goes from the second-to-last one straight to 0.
    n = steps + 1 if discard_penultimate else steps
    sigma_min, sigma_max = sigmas[0].item(), sigmas[-1].item()
    if schedule == "uniform":
        out = t_to_sigma(torch.linspace(len(sigmas) - 1, 0, n), sigmas)
    elif schedule == "karras":
        ramp = torch.linspace(0, 1, n)
        lo, hi = sigma_min ** (1 / KARRAS_RHO), sigma_max ** (1 / KARRAS_RHO)
        out = (hi + ramp * (lo - hi)) ** KARRAS_RHO
    elif schedule == "exponential":
        out = torch.linspace(math.log(sigma_max), math.log(sigma_min), n).exp()
    else:
        raise ValueError(f"unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    if discard_penultimate:
        out = out[:-1]
    return torch.cat([out, out.new_zeros(1)])


def ddim_timesteps(steps: int, train_steps: int = 1000) -> list[int]:
    """The timesteps A1111's DDIM and PLMS give the UNet, first to last.

    The WebUI builds ``range(0, 1000, 1000 // steps) + 1`` (clipped to 999) and evaluates every
    entry but the first, which only serves as the last step's target; so 20 steps are 19 UNet
    evaluations at 951, 901, ..., 51 (and the result sits at timestep 1).
    """
    ratio = max(train_steps // steps, 1)
    grid = [min(t + 1, train_steps - 1) for t in range(0, train_steps, ratio)]
    return grid[::-1]
