"""Fake ``modules.processing``: the processing classes, Processed and a ``process_images`` that drives the
model's text encoder, UNet and VAE the way A1111's does (conds per prompt, CFG batch of cond+uncond,
a k-diffusion-like Euler loop with interrupt checks, one VAE decode per image, infotext)."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import torch
from PIL import Image

from modules import script_callbacks, shared


def quote(text: Any) -> Any:
    """A1111's ``infotext_utils.quote``."""
    if "," not in str(text) and "\n" not in str(text) and ":" not in str(text):
        return text
    return json.dumps(text, ensure_ascii=False)


class StableDiffusionProcessing:
    """The fields extensions use (see a1111-host.md)."""

    def __init__(
        self,
        sd_model: Any = None,
        outpath_samples: str = "",
        prompt: str = "",
        negative_prompt: str = "",
        seed: int = -1,
        subseed: int = -1,
        subseed_strength: float = 0,
        sampler_name: str = "Euler",
        scheduler: Any = None,
        batch_size: int = 1,
        n_iter: int = 1,
        steps: int = 3,
        cfg_scale: float = 7.0,
        width: int = 64,
        height: int = 64,
        do_not_save_samples: bool = False,
        do_not_save_grid: bool = False,
        override_settings: dict | None = None,
        enable_hr: bool = False,
        **kwargs: Any,
    ) -> None:
        self.sd_model = sd_model
        self.outpath_samples = outpath_samples
        self.prompt, self.negative_prompt = prompt, negative_prompt
        self.seed, self.subseed, self.subseed_strength = seed, subseed, subseed_strength
        self.sampler_name, self.scheduler = sampler_name, scheduler
        self.batch_size, self.n_iter, self.steps, self.cfg_scale = batch_size, n_iter, steps, cfg_scale
        self.width, self.height = width, height
        self.do_not_save_samples, self.do_not_save_grid = do_not_save_samples, do_not_save_grid
        self.override_settings = override_settings or {}
        self.enable_hr = enable_hr
        self.extra_generation_params: dict[str, Any] = {}
        self.comments: dict[str, int] = {}
        self.sd_model_name = None
        self.sd_model_hash = None
        self.scripts = None
        self.script_args: list = []
        for key, value in kwargs.items():
            setattr(self, key, value)

    def comment(self, text: str) -> None:
        self.comments[text] = 1

    def init_latent(self, model: Any, seeds: list[int]) -> torch.Tensor | None:
        return None


class StableDiffusionProcessingTxt2Img(StableDiffusionProcessing):
    pass


class StableDiffusionProcessingImg2Img(StableDiffusionProcessing):
    def __init__(
        self, init_images: list | None = None, denoising_strength: float = 0.75, mask: Any = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.init_images = init_images or []
        self.denoising_strength = denoising_strength
        self.mask = mask

    def init_latent(self, model: Any, seeds: list[int]) -> torch.Tensor | None:
        images = [
            np.asarray(img.convert("RGB").resize((self.width, self.height)), dtype=np.float32)
            for img in self.init_images
        ]
        batch = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2) / 127.5 - 1.0
        batch = batch[:1].repeat(len(seeds), 1, 1, 1)
        return model.get_first_stage_encoding(model.encode_first_stage(batch))


class Processed:
    """Mirrors A1111's Processed constructor."""

    def __init__(
        self,
        p: Any,
        images_list: list,
        seed: int = -1,
        info: str = "",
        subseed: Any = None,
        all_prompts: Any = None,
        all_negative_prompts: Any = None,
        all_seeds: Any = None,
        all_subseeds: Any = None,
        index_of_first_image: int = 0,
        infotexts: Any = None,
        comments: str = "",
    ) -> None:
        self.images = images_list
        self.prompt, self.negative_prompt = p.prompt, p.negative_prompt
        self.seed, self.info, self.width, self.height = seed, info, p.width, p.height
        self.all_prompts = all_prompts or [p.prompt]
        self.all_seeds = all_seeds or [seed]
        self.infotexts = infotexts or [info]
        self.comments = "".join(f"{comment}\n" for comment in p.comments)
        self.index_of_first_image = index_of_first_image
        self.extra_generation_params = p.extra_generation_params


def create_infotext(p: Any, prompt: str, seed: int) -> str:
    params = {
        "Steps": p.steps,
        "Sampler": p.sampler_name,
        "CFG scale": p.cfg_scale,
        "Seed": seed,
        "Size": f"{p.width}x{p.height}",
        "Model hash": p.sd_model_hash,
        "Model": p.sd_model_name,
        **p.extra_generation_params,
    }
    text = ", ".join(k if k == v else f"{k}: {quote(v)}" for k, v in params.items() if v is not None)
    return f"{prompt}\nNegative prompt: {p.negative_prompt}\n{text}"


def _sample(p: Any, model: Any, seeds: list[int], cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
    state = shared.state
    shape = (4, p.height // 8, p.width // 8)
    noise = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in seeds])
    sigmas = torch.linspace(2.0, 0.0, p.steps + 1)
    start = p.init_latent(model, seeds)
    x = noise * sigmas[0] if start is None else start + noise * sigmas[0] * p.denoising_strength
    state.sampling_steps = p.steps
    for i in range(p.steps):
        if state.interrupted or state.skipped:
            break
        script_callbacks.cfg_denoiser_callback(
            script_callbacks.CFGDenoiserParams(x, sigmas[i], cond, uncond, i, p.steps)
        )
        x_in = torch.cat([x, x])
        sigma_in = torch.full((x_in.shape[0],), float(sigmas[i]) * 100.0)
        if cond.shape[1] != uncond.shape[1]:  # A1111 pads the shorter cond with its last chunk
            length = max(cond.shape[1], uncond.shape[1])
            cond, uncond = (
                torch.cat([c, c[:, -77:].repeat(1, (length - c.shape[1]) // 77, 1)], 1) if c.shape[1] < length else c
                for c in (cond, uncond)
            )
        cond_in = torch.cat([cond, uncond])
        denoised_c, denoised_u = model.apply_model(x_in / (1 + sigmas[i] ** 2) ** 0.5, sigma_in, cond_in).chunk(2)
        denoised = denoised_u + p.cfg_scale * (denoised_c - denoised_u)
        x = x + (sigmas[i + 1] - sigmas[i]) * denoised * 0.1
        state.sampling_step = i + 1
        state.current_latent = x
    return x


def process_images(p: Any) -> Processed:
    """Runs the whole pipeline, as A1111's ``process_images`` does."""
    state = shared.state
    model = p.sd_model if p.sd_model is not None else shared.sd_model
    p.sd_model_name = model.sd_checkpoint_info.name_for_extra
    p.sd_model_hash = model.sd_model_hash
    seed = p.seed if p.seed != -1 else random.randrange(2**31)
    all_seeds = [seed + i for i in range(p.batch_size * p.n_iter)]
    state.job_count = p.n_iter
    images: list[Image.Image] = []
    infotexts: list[str] = []
    with torch.no_grad():
        for n in range(p.n_iter):
            if state.skipped:
                state.skipped = False
            if state.interrupted or state.stopping_generation:
                break
            seeds = all_seeds[n * p.batch_size : (n + 1) * p.batch_size]
            cond = model.get_learned_conditioning([p.prompt] * p.batch_size)
            uncond = model.get_learned_conditioning([p.negative_prompt] * p.batch_size)
            samples = _sample(p, model, seeds, cond, uncond)
            for i, s in enumerate(seeds):
                decoded = model.decode_first_stage(samples[i : i + 1])
                arr = ((decoded[0].clamp(-1, 1) + 1) * 127.5).permute(1, 2, 0).round().to(torch.uint8).numpy()
                images.append(Image.fromarray(arr))
                infotexts.append(create_infotext(p, p.prompt, s))
            state.nextjob()
    return Processed(
        p, images, seed=seed, info=infotexts[0] if infotexts else "", all_seeds=all_seeds, infotexts=infotexts
    )
