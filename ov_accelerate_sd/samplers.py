"""The WebUI's sampler names mapped to diffusers schedulers, as one sorted table.

Owns: ``SAMPLERS`` (A1111 name -> scheduler class, the noise schedule A1111 v1.10 walks for
that name, and the "Sampler" / "Schedule type" it writes in its infotext), ``make_scheduler``
and ``initial_latents`` (the latent a sampler starts from, in its scheduler's own space).

Names follow A1111 v1.10's ``get_sampler_and_scheduler``: a trailing "Karras" selects the Karras
schedule; without it the sampler's default applies, which in v1.10 is Karras for DPM++ 2M,
DPM++ SDE, DPM2 and DPM2 a, Exponential for DPM++ 2M SDE, and the model's own discrete sigmas
("Automatic", k-diffusion's ``get_sigmas``) for Euler, Euler a, Heun and LMS.

Where diffusers cannot follow the WebUI (stated in the report and the README):

- LCM: diffusers' LCM picks its timesteps from 50 "origin" steps differently from the WebUI's
  LCM denoiser (same first timestep and starting latent; later ones differ).
- DPM++ 2M SDE: the WebUI draws its noise from a Brownian tree seeded per image; diffusers'
  multistep solver draws Gaussian noise from the per-image generators (same schedule).
- img2img with PLMS or UniPC: the WebUI's timestep samplers noise the init latent one grid entry
  above the first evaluation and UniPC restarts its own time grid; only DDIM reproduces that.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers import LCMScheduler

from .ldm_schedulers import (
    LMSScheduler,
    WebUIDDIMScheduler,
    WebUIDPM2AncestralScheduler,
    WebUIDPM2Scheduler,
    WebUIDPMSolverMultistepScheduler,
    WebUIDPMSolverSDEScheduler,
    WebUIEulerAncestralScheduler,
    WebUIEulerScheduler,
    WebUIHeunScheduler,
    WebUIPLMSScheduler,
    WebUIUniPCScheduler,
)
from .schedules import ddim_timesteps, model_sigmas, webui_alphas_cumprod, webui_sigmas

logger = logging.getLogger(__name__)

SPACES = ("ddpm", "k", "vp")
_K = {"timestep_spacing": "linspace", "use_exponential_sigmas": True, "use_karras_sigmas": False}


@dataclass(frozen=True)
class SamplerSpec:
    """One WebUI sampler and how diffusers runs it."""

    name: str
    """The WebUI's name (also accepted on the command line)."""
    scheduler: type
    schedule: str = ""
    """k-diffusion samplers: "uniform", "karras" or "exponential"; "" for timestep samplers."""
    discard_penultimate: bool = False
    """The WebUI drops the next-to-last sigma (DPM2, DPM2 a)."""
    space: str = "k"
    """The scheduler's latent: "k" (x = noise * sigma, k-diffusion's own), "vp" (x / sqrt(sigma^2 + 1),
    a k-diffusion sampler on a variance-preserving scheduler) or "ddpm" (a timestep sampler: unit noise)."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Arguments on top of the model's scheduler config."""
    infotext_sampler: str = ""
    """"Sampler" as WebUI v1.10 writes it (the name without the schedule type)."""
    schedule_type: str = ""
    """"Schedule type" in the infotext ("" when the WebUI writes none)."""


def _k(name: str, scheduler: type, schedule: str, sampler: str, **options: Any) -> SamplerSpec:
    label = "Automatic" if schedule == "uniform" else schedule.capitalize()
    space = options.pop("space", "k")
    kwargs = {**_K, **options.pop("kwargs", {})}
    return SamplerSpec(name, scheduler, schedule, options.pop("discard", False), space, kwargs, sampler, label)


_2M_SDE = {"algorithm_type": "sde-dpmsolver++"}

# Sorted by name; a test checks order, duplicates, the schedules against the names, and that each one runs.
SAMPLERS: tuple[SamplerSpec, ...] = (
    SamplerSpec("DDIM", WebUIDDIMScheduler, space="ddpm", infotext_sampler="DDIM"),
    _k("DPM++ 2M", WebUIDPMSolverMultistepScheduler, "karras", "DPM++ 2M", space="vp"),
    _k("DPM++ 2M Karras", WebUIDPMSolverMultistepScheduler, "karras", "DPM++ 2M", space="vp"),
    _k("DPM++ 2M SDE", WebUIDPMSolverMultistepScheduler, "exponential", "DPM++ 2M SDE", space="vp", kwargs=_2M_SDE),
    _k("DPM++ 2M SDE Karras", WebUIDPMSolverMultistepScheduler, "karras", "DPM++ 2M SDE", space="vp",
       kwargs=_2M_SDE),
    _k("DPM++ SDE", WebUIDPMSolverSDEScheduler, "karras", "DPM++ SDE"),
    _k("DPM++ SDE Karras", WebUIDPMSolverSDEScheduler, "karras", "DPM++ SDE"),
    _k("DPM2", WebUIDPM2Scheduler, "karras", "DPM2", discard=True),
    _k("DPM2 Karras", WebUIDPM2Scheduler, "karras", "DPM2", discard=True),
    _k("DPM2 a", WebUIDPM2AncestralScheduler, "karras", "DPM2 a", discard=True),
    _k("Euler", WebUIEulerScheduler, "uniform", "Euler"),
    _k("Euler a", WebUIEulerAncestralScheduler, "uniform", "Euler a"),
    _k("Heun", WebUIHeunScheduler, "uniform", "Heun"),
    SamplerSpec("LCM", LCMScheduler, space="vp", kwargs={"timestep_spacing": "leading"}, infotext_sampler="LCM",
                schedule_type="Automatic"),
    _k("LMS", LMSScheduler, "uniform", "LMS"),
    _k("LMS Karras", LMSScheduler, "karras", "LMS"),
    SamplerSpec("PLMS", WebUIPLMSScheduler, space="ddpm", kwargs={"skip_prk_steps": True}, infotext_sampler="PLMS"),
    SamplerSpec("UniPC", WebUIUniPCScheduler, space="ddpm",
                kwargs={"solver_order": 3, "solver_type": "bh1", "final_sigmas_type": "sigma_min",
                        "lower_order_final": True, "timestep_spacing": "linspace"},
                infotext_sampler="UniPC", schedule_type="Automatic"),
)

SAMPLER_NAMES: tuple[str, ...] = tuple(s.name for s in SAMPLERS)
_BY_NAME = {s.name.lower(): s for s in SAMPLERS}


def sampler_spec(name: str) -> SamplerSpec:
    """Look up a WebUI sampler name (case-insensitive).

    Raises:
        ValueError: an unknown name, listing the valid ones.
    """
    spec = _BY_NAME.get(name.strip().lower())
    if spec is None:
        raise ValueError(f"unknown sampler {name!r}; valid samplers: {', '.join(SAMPLER_NAMES)}")
    return spec


def make_scheduler(name: str, base_config: Mapping[str, Any], seeds: Sequence[int] = ()) -> Any:
    """A fresh diffusers scheduler for a WebUI sampler name, on the WebUI's noise schedule.

    Args:
        name: WebUI sampler name.
        base_config: the model's scheduler config (betas, prediction type, ...).
        seeds: the seeds of the images in the batch (the Brownian noise of the SDE sampler is
            seeded per image from them, as the WebUI does).
    """
    spec = sampler_spec(name)
    config = {k: v for k, v in base_config.items() if not k.startswith("_")}
    config.update(spec.kwargs)
    if spec.scheduler is WebUIDPMSolverSDEScheduler and seeds:
        config["noise_sampler_seed"] = list(seeds) if len(seeds) > 1 else int(seeds[0])
    scheduler = spec.scheduler.from_config(config)
    # The WebUI's models hold alphas_cumprod computed in float64; diffusers multiplies in float32.
    scheduler.alphas_cumprod = webui_alphas_cumprod(config)
    if hasattr(scheduler, "configure"):
        scheduler.configure(spec.schedule, spec.discard_penultimate)
    return scheduler


def initial_latents(name: str, noise: torch.Tensor, steps: int, scheduler: Any) -> torch.Tensor:
    """What to hand a diffusers txt2img pipeline as ``latents`` so the sampler starts where the WebUI's does.

    The pipelines multiply ``latents`` by the scheduler's ``init_noise_sigma``. The WebUI starts
    its k-diffusion samplers from ``noise * sigmas[0]`` (the UNet then sees that times
    ``1 / sqrt(sigmas[0]^2 + 1)``), and its timestep samplers (DDIM, PLMS, UniPC) from the noise itself.

    Args:
        name: WebUI sampler name.
        noise: the WebUI's unit noise for the batch (``ImageNoise.first()``).
        steps: sampling steps.
        scheduler: the scheduler the pipeline will run (``make_scheduler``).
    """
    spec = sampler_spec(name)
    sigmas = model_sigmas(scheduler.alphas_cumprod)
    first = float(webui_sigmas(sigmas, steps, spec.schedule or "uniform", spec.discard_penultimate)[0])
    if spec.space == "k":
        start = first
    elif spec.space == "vp":
        start = first / (first**2 + 1) ** 0.5
    else:
        start = 1.0
    probe = make_scheduler(name, dict(scheduler.config))
    probe.set_timesteps(steps)
    return noise * (start / float(probe.init_noise_sigma))


def img2img_strength(name: str, steps: int, denoising_strength: float) -> float:
    """The ``strength`` that makes a diffusers img2img pipeline start at the WebUI's step.

    The WebUI (``setup_img2img_steps``, without "img2img_fix_steps") runs
    ``t_enc + 1`` of the ``steps`` k-diffusion steps, ``t_enc = int(min(strength, 0.999) * steps)``,
    starting from the init latent plus the noise times ``sigmas[steps - t_enc - 1]``; diffusers
    runs ``int(steps * strength)`` of them. DDIM evaluates grid entries ``t_enc - 1`` down to 1
    after noising to entry ``t_enc`` (``WebUIDDIMScheduler.add_noise``).
    """
    spec = sampler_spec(name)
    t_enc = int(min(denoising_strength, 0.999) * steps)
    if spec.space == "ddpm":  # evaluations start at grid entry t_enc - 1, counted from the top
        wanted = steps - len(ddim_timesteps(steps)) + t_enc
    else:
        wanted = t_enc + 1
    wanted = max(1, min(wanted, steps))
    return min((wanted + 0.5) / steps, 1.0)
