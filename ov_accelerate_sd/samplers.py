"""The WebUI's sampler names mapped to diffusers schedulers, as one sorted table.

Owns: ``SAMPLERS`` (A1111 name -> scheduler class and arguments, plus the "Sampler" and
"Schedule type" the WebUI writes in its infotext), ``make_scheduler`` and a scipy-free LMS
scheduler (diffusers' LMS needs scipy, which the WebUI's venv has but ours need not).

k-diffusion samplers in the WebUI walk the noise levels from t=999 down to t=0, which is
diffusers' ``timestep_spacing="linspace"``; its DDIM takes every (1000 / steps)-th step
counted from 1, which is ``"leading"`` with ``steps_offset=1``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    DPMSolverSDEScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    HeunDiscreteScheduler,
    KDPM2AncestralDiscreteScheduler,
    KDPM2DiscreteScheduler,
    LCMScheduler,
    PNDMScheduler,
    UniPCMultistepScheduler,
)
from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteSchedulerOutput

logger = logging.getLogger(__name__)


class LMSScheduler(EulerDiscreteScheduler):
    """k-diffusion's linear multistep sampler (order 4), with exact polynomial integration.

    Same noise levels and input scaling as ``EulerDiscreteScheduler``; only the update differs.
    """

    _max_order = 4

    def set_timesteps(self, *args: Any, **kwargs: Any) -> None:
        super().set_timesteps(*args, **kwargs)
        self.derivatives: list[torch.Tensor] = []

    def _coefficient(self, order: int, i: int, j: int) -> float:
        sigmas = self.sigmas.double().cpu().numpy()
        poly = np.polynomial.Polynomial([1.0])
        for k in range(order):
            if k != j:
                poly *= np.polynomial.Polynomial([-sigmas[i - k], 1.0]) / (sigmas[i - j] - sigmas[i - k])
        integral = poly.integ()
        return float(integral(sigmas[i + 1]) - integral(sigmas[i]))

    def step(  # type: ignore[override]
        self,
        model_output: torch.Tensor,
        timestep: float | torch.Tensor,
        sample: torch.Tensor,
        generator: torch.Generator | None = None,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> EulerDiscreteSchedulerOutput | tuple:
        if self.step_index is None:
            self._init_step_index(timestep)
        i = self.step_index
        sigma = self.sigmas[i]
        if self.config.prediction_type == "v_prediction":
            denoised = model_output * (-sigma / (sigma**2 + 1) ** 0.5) + sample / (sigma**2 + 1)
        else:
            denoised = sample - sigma * model_output
        self.derivatives.append((sample - denoised) / sigma)
        if len(self.derivatives) > self._max_order:
            self.derivatives.pop(0)
        order = len(self.derivatives)
        coeffs = [self._coefficient(order, i, j) for j in range(order)]
        prev = sample + sum(c * d for c, d in zip(coeffs, reversed(self.derivatives)))
        self._step_index += 1
        if not return_dict:
            return (prev,)
        return EulerDiscreteSchedulerOutput(prev_sample=prev, pred_original_sample=denoised)


_K = {"timestep_spacing": "linspace"}
_KARRAS = {"timestep_spacing": "linspace", "use_karras_sigmas": True}


@dataclass(frozen=True)
class SamplerSpec:
    """One WebUI sampler and how diffusers runs it."""

    name: str
    """The WebUI's name (also accepted on the command line)."""
    scheduler: type
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Arguments on top of the model's scheduler config."""
    infotext_sampler: str = ""
    """"Sampler" as WebUI v1.10 writes it (the name without the schedule type)."""
    schedule_type: str = ""
    """"Schedule type" in the infotext ("" when the WebUI writes none)."""


# Sorted by name; a test checks order, duplicates and that each one runs.
SAMPLERS: tuple[SamplerSpec, ...] = (
    SamplerSpec("DDIM", DDIMScheduler, {"timestep_spacing": "leading"}, "DDIM"),
    SamplerSpec("DPM++ 2M", DPMSolverMultistepScheduler, _K, "DPM++ 2M", "Automatic"),
    SamplerSpec("DPM++ 2M Karras", DPMSolverMultistepScheduler, _KARRAS, "DPM++ 2M", "Karras"),
    SamplerSpec(
        "DPM++ 2M SDE", DPMSolverMultistepScheduler, {**_K, "algorithm_type": "sde-dpmsolver++"},
        "DPM++ 2M SDE", "Automatic",
    ),
    SamplerSpec(
        "DPM++ 2M SDE Karras", DPMSolverMultistepScheduler, {**_KARRAS, "algorithm_type": "sde-dpmsolver++"},
        "DPM++ 2M SDE", "Karras",
    ),
    SamplerSpec("DPM++ SDE", DPMSolverSDEScheduler, _K, "DPM++ SDE", "Automatic"),
    SamplerSpec("DPM++ SDE Karras", DPMSolverSDEScheduler, _KARRAS, "DPM++ SDE", "Karras"),
    SamplerSpec("DPM2", KDPM2DiscreteScheduler, _K, "DPM2", "Automatic"),
    SamplerSpec("DPM2 Karras", KDPM2DiscreteScheduler, _KARRAS, "DPM2", "Karras"),
    SamplerSpec("DPM2 a", KDPM2AncestralDiscreteScheduler, _K, "DPM2 a", "Automatic"),
    SamplerSpec("Euler", EulerDiscreteScheduler, _K, "Euler", "Automatic"),
    SamplerSpec("Euler a", EulerAncestralDiscreteScheduler, _K, "Euler a", "Automatic"),
    SamplerSpec("Heun", HeunDiscreteScheduler, _K, "Heun", "Automatic"),
    SamplerSpec("LCM", LCMScheduler, {"timestep_spacing": "leading"}, "LCM", "Automatic"),
    SamplerSpec("LMS", LMSScheduler, _K, "LMS", "Automatic"),
    SamplerSpec("LMS Karras", LMSScheduler, _KARRAS, "LMS", "Karras"),
    SamplerSpec("PLMS", PNDMScheduler, {"skip_prk_steps": True, "timestep_spacing": "leading"}, "PLMS"),
    SamplerSpec("UniPC", UniPCMultistepScheduler, {"timestep_spacing": "leading"}, "UniPC", "Automatic"),
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
    """A fresh diffusers scheduler for a WebUI sampler name.

    Args:
        name: WebUI sampler name.
        base_config: the model's scheduler config (betas, prediction type, ...).
        seeds: the seeds of the images in the batch (the Brownian noise of the SDE sampler is
            seeded per image from them, as the WebUI does).
    """
    spec = sampler_spec(name)
    config = {k: v for k, v in base_config.items() if not k.startswith("_")}
    config.update(spec.kwargs)
    if spec.scheduler is DPMSolverSDEScheduler and seeds:
        config["noise_sampler_seed"] = list(seeds) if len(seeds) > 1 else int(seeds[0])
    return spec.scheduler.from_config(config)
