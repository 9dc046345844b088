"""diffusers schedulers that walk the noise levels and timesteps of the LDM and k-diffusion samplers.

Owns one subclass per diffusers scheduler the sampler table uses. Each keeps its parent's
update rule (so the diffusers pipelines run unchanged) and replaces what ``set_timesteps``
computes with what A1111 v1.10 computes (``schedules``):

- k-diffusion samplers (Euler, Euler a, LMS, Heun, DPM2, DPM2 a, DPM++ 2M / SDE / 2M SDE):
  the sigma sequence of ``webui_sigmas`` for the sampler's schedule; the UNet gets
  k-diffusion's continuous ``sigma_to_t`` of each sigma (not rounded). Schedulers that compute
  their sigmas through diffusers' ``_convert_to_exponential`` hook (the config sets
  ``use_exponential_sigmas``) get the WebUI's sigmas through it, so their own interleaving
  (Heun, DPM2, DPM++ SDE midpoints) follows; the others are overwritten after the fact.
- DDIM and PLMS: the WebUI's timestep grid (``ddim_timesteps``), one evaluation fewer than
  diffusers' "leading" spacing, and DDIM's step from each grid entry to the one below it.
- UniPC: the WebUI's "time_uniform" grid (t evenly spaced from 999 to 0, not rounded), its
  noise levels interpolated as its ``NoiseScheduleVP("discrete")`` does, ending at the
  model's smallest sigma.
- LMS: k-diffusion's linear multistep update (order 4, exact polynomial integration; diffusers'
  LMS needs scipy, which our venv need not have).

The schedule of an instance is set by ``configure`` (``make_scheduler`` does it).
"""

from __future__ import annotations

import logging
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
    PNDMScheduler,
    UniPCMultistepScheduler,
)
from diffusers.schedulers.scheduling_ddim import DDIMSchedulerOutput
from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteSchedulerOutput

from .schedules import ddim_timesteps, model_sigmas, sigma_to_t, webui_sigmas

logger = logging.getLogger(__name__)


class _WebUISigmas:
    """Mixin for k-diffusion samplers: the noise levels are the WebUI's for the schedule."""

    webui_schedule: str = "uniform"
    webui_discard_penultimate: bool = False
    _webui_steps: int = 0
    alphas_cumprod: torch.Tensor

    def configure(self, schedule: str, discard_penultimate: bool = False) -> None:
        """Walk the WebUI's ``schedule`` ("uniform", "karras", "exponential")."""
        self.webui_schedule = schedule
        self.webui_discard_penultimate = discard_penultimate

    def webui_sigmas(self) -> torch.Tensor:
        """The WebUI's sigmas for the last ``set_timesteps``, ending with 0."""
        return webui_sigmas(model_sigmas(self.alphas_cumprod), self._webui_steps, self.webui_schedule,
                            self.webui_discard_penultimate)

    def _convert_to_exponential(self, in_sigmas: Any, num_inference_steps: int) -> np.ndarray:
        # diffusers' hook between "sigmas of the spacing" and "timesteps of the sigmas".
        return self.webui_sigmas()[:-1].double().numpy()

    def set_timesteps(self, num_inference_steps: int, device: Any = None, *args: Any, **kwargs: Any) -> None:
        self._webui_steps = int(num_inference_steps)
        super().set_timesteps(num_inference_steps, device, *args, **kwargs)  # type: ignore[misc]
        self._after_set_timesteps(device)

    def _after_set_timesteps(self, device: Any) -> None:
        """Subclasses whose parent has no sigma hook overwrite the result here."""

    def _overwrite(self, device: Any, timesteps_only: bool = False) -> None:
        sigmas = self.webui_sigmas()
        if not timesteps_only:
            self.sigmas = sigmas
        self.timesteps = sigma_to_t(self.sigmas[:-1].float(), model_sigmas(self.alphas_cumprod)).to(device)


class WebUIEulerScheduler(_WebUISigmas, EulerDiscreteScheduler):
    """k-diffusion ``sample_euler``."""


class WebUIEulerAncestralScheduler(_WebUISigmas, EulerAncestralDiscreteScheduler):
    """k-diffusion ``sample_euler_ancestral`` (eta 1)."""

    def _after_set_timesteps(self, device: Any) -> None:
        self._overwrite(device)


class WebUIHeunScheduler(_WebUISigmas, HeunDiscreteScheduler):
    """k-diffusion ``sample_heun``."""


class WebUIDPM2Scheduler(_WebUISigmas, KDPM2DiscreteScheduler):
    """k-diffusion ``sample_dpm_2``."""


class WebUIDPM2AncestralScheduler(_WebUISigmas, KDPM2AncestralDiscreteScheduler):
    """k-diffusion ``sample_dpm_2_ancestral``."""


class WebUIDPMSolverSDEScheduler(_WebUISigmas, DPMSolverSDEScheduler):
    """k-diffusion ``sample_dpmpp_sde`` with the per-image Brownian tree."""


class WebUIDPMSolverMultistepScheduler(_WebUISigmas, DPMSolverMultistepScheduler):
    """k-diffusion ``sample_dpmpp_2m`` / ``sample_dpmpp_2m_sde``; diffusers rounds (or truncates)
    the timesteps to integers, the WebUI gives the UNet the continuous ones."""

    def _after_set_timesteps(self, device: Any) -> None:
        self._overwrite(device, timesteps_only=True)


class LMSScheduler(WebUIEulerScheduler):
    """k-diffusion's linear multistep sampler (order 4), with exact polynomial integration.

    Same noise levels and input scaling as Euler; only the update differs.
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


class WebUIDDIMScheduler(DDIMScheduler):
    """A1111's DDIM (eta 0): its timestep grid, each step going to the grid entry below."""

    def configure(self, schedule: str = "", discard_penultimate: bool = False) -> None:
        """Nothing to choose: DDIM has one grid."""

    def set_timesteps(self, num_inference_steps: int, device: Any = None) -> None:
        grid = ddim_timesteps(num_inference_steps, self.config.num_train_timesteps)
        self.num_inference_steps = num_inference_steps
        self._below = dict(zip(grid[:-1], grid[1:]))
        self.timesteps = torch.tensor(grid[:-1], dtype=torch.int64, device=device)

    def add_noise(self, original_samples: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """img2img: the WebUI noises the init latent one grid entry above the first evaluation."""
        above = {below: t for t, below in self._below.items()}
        up = torch.tensor([above.get(int(t), int(t)) for t in timesteps.flatten()], dtype=torch.int64)
        return super().add_noise(original_samples, noise, up)

    def step(  # type: ignore[override]
        self,
        model_output: torch.Tensor,
        timestep: int | torch.Tensor,
        sample: torch.Tensor,
        *args: Any,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> DDIMSchedulerOutput | tuple:
        t = int(timestep)
        a_t = float(self.alphas_cumprod[t])
        a_prev = float(self.alphas_cumprod[self._below[t]].double())
        if self.config.prediction_type == "v_prediction":
            eps = a_t**0.5 * model_output + (1 - a_t) ** 0.5 * sample
        else:
            eps = model_output
        pred_x0 = (sample - (1 - a_t) ** 0.5 * eps) / a_t**0.5
        prev = a_prev**0.5 * pred_x0 + (1 - a_prev) ** 0.5 * eps
        if not return_dict:
            return (prev, pred_x0)
        return DDIMSchedulerOutput(prev_sample=prev, pred_original_sample=pred_x0)


class WebUIPLMSScheduler(PNDMScheduler):
    """A1111's PLMS: the DDIM grid, a second evaluation at the first step (pseudo improved
    Euler), none at the grid's last entry."""

    def configure(self, schedule: str = "", discard_penultimate: bool = False) -> None:
        """Nothing to choose: PLMS has one grid."""

    def set_timesteps(self, num_inference_steps: int, device: Any = None) -> None:
        super().set_timesteps(num_inference_steps, device)
        grid = ddim_timesteps(num_inference_steps, self.config.num_train_timesteps)
        plms = grid[:2] + grid[1:-1] if len(grid) >= 2 else []
        self._below = dict(zip(grid[:-1], grid[1:]))
        self.prk_timesteps = np.array([], dtype=np.int64)
        self.plms_timesteps = np.array(plms, dtype=np.int64)
        self.timesteps = torch.tensor(plms, dtype=torch.int64, device=device)

    def _get_prev_sample(self, sample: torch.Tensor, timestep: int, prev_timestep: int, model_output: torch.Tensor
                         ) -> torch.Tensor:
        # diffusers steps by 1000 // steps; the WebUI by its (clipped) grid.
        t = min(int(timestep), self.config.num_train_timesteps - 1)
        return super()._get_prev_sample(sample, t, self._below.get(t, prev_timestep), model_output)


class WebUIUniPCScheduler(UniPCMultistepScheduler):
    """A1111's UniPC ("time_uniform" skip type, continuous timesteps)."""

    def configure(self, schedule: str = "", discard_penultimate: bool = False) -> None:
        """Nothing to choose: the WebUI's default skip type is used."""

    def set_timesteps(self, num_inference_steps: int, device: Any = None) -> None:
        super().set_timesteps(num_inference_steps, device)
        train = self.config.num_train_timesteps
        t = torch.linspace(train - 1, 0, num_inference_steps + 1, dtype=torch.float64)[:-1]
        log_acp = np.interp(t.numpy(), np.arange(train), np.log(self.alphas_cumprod.double().numpy()))
        sigmas = np.sqrt(np.exp(-log_acp) - 1.0)
        last = float(model_sigmas(self.alphas_cumprod)[0])
        self.sigmas = torch.from_numpy(np.append(sigmas, last).astype(np.float32))
        self.timesteps = t.float().to(device)
