"""Fake ``modules.processing``: the processing classes, Processed and a ``process_images`` that drives the
model's text encoder, UNet and VAE the way A1111 v1.10.1's does:

* conds per batch (the text encoder once per 77-token chunk, see ``sd_hijack_clip``); SDXL conds are
  dicts and get the image size;
* a k-diffusion-like Euler loop whose CFG step runs cond and uncond in one UNet batch, or in two calls
  when their token counts differ (``opts.pad_cond_uncond`` off, the default); Interrupt and Skip stop
  the loop after the current step and the batch's latent is still decoded;
* txt2img hires fix (``sample_hr_pass``): first pass, latent upscaled ("Latent" upscaler, nearest),
  second pass at the new size, VAE decode at the new size;
* img2img (``init``): the init image resized to width x height, repeated to the batch size, VAE-encoded
  once; sampling starts from it with the denoising strength;
* one VAE decode per image (``decode_latent_batch``), infotext per image, batch count loop.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import torch
from PIL import Image

from modules import script_callbacks, shared

OPT_F = 8


def quote(text: Any) -> Any:
    """A1111's ``infotext_utils.quote``."""
    if "," not in str(text) and "\n" not in str(text) and ":" not in str(text):
        return text
    return json.dumps(text, ensure_ascii=False)


class SdConditioning(list):
    """``prompt_parser.SdConditioning``: a list of prompts with the image size (SDXL uses it)."""

    def __init__(self, prompts: list[str], width: int, height: int, is_negative_prompt: bool = False) -> None:
        super().__init__(prompts)
        self.width, self.height, self.is_negative_prompt = width, height, is_negative_prompt


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
        denoising_strength: float = 0.75,
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
        self.denoising_strength = denoising_strength
        self.extra_generation_params: dict[str, Any] = {}
        self.comments: dict[str, int] = {}
        self.sd_model_name = None
        self.sd_model_hash = None
        self.scripts = None
        self.script_args: list = []
        self.is_api = False
        for key, value in kwargs.items():
            setattr(self, key, value)

    def comment(self, text: str) -> None:
        self.comments[text] = 1

    def init(self, all_seeds: list[int]) -> None:
        pass

    def conds(self, model: Any, prompts: list[str], negative: bool, width: int, height: int) -> Any:
        batch = SdConditioning(prompts, width, height, is_negative_prompt=negative)
        if getattr(model, "is_sdxl", False):
            return model.get_learned_conditioning(batch, width=width, height=height)
        return model.get_learned_conditioning(batch)

    def sample(self, model: Any, seeds: list[int]) -> Any:
        raise NotImplementedError


class StableDiffusionProcessingTxt2Img(StableDiffusionProcessing):
    def __init__(
        self,
        enable_hr: bool = False,
        hr_scale: float = 2.0,
        hr_upscaler: str = "Latent",
        hr_second_pass_steps: int = 0,
        hr_resize_x: int = 0,
        hr_resize_y: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.enable_hr, self.hr_scale, self.hr_upscaler = enable_hr, hr_scale, hr_upscaler
        self.hr_second_pass_steps, self.hr_resize_x, self.hr_resize_y = hr_second_pass_steps, hr_resize_x, hr_resize_y
        self.hr_upscale_to_x = self.hr_upscale_to_y = 0
        self.is_hr_pass = False

    def init(self, all_seeds: list[int]) -> None:
        if not self.enable_hr:
            return
        if self.hr_resize_x == 0 and self.hr_resize_y == 0:
            self.extra_generation_params["Hires upscale"] = self.hr_scale
            self.hr_upscale_to_x, self.hr_upscale_to_y = (
                int(self.width * self.hr_scale),
                int(self.height * self.hr_scale),
            )
        else:
            self.extra_generation_params["Hires resize"] = f"{self.hr_resize_x}x{self.hr_resize_y}"
            self.hr_upscale_to_x, self.hr_upscale_to_y = self.hr_resize_x, self.hr_resize_y
        self.extra_generation_params["Hires upscaler"] = self.hr_upscaler
        shared.state.job_count = shared.state.job_count * 2

    def sample(self, model: Any, seeds: list[int]) -> Any:
        shape = (4, self.height // OPT_F, self.width // OPT_F)
        samples = denoise(self, model, noise(seeds, shape), self.c, self.uc, self.steps, 1.0)
        if not self.enable_hr:
            return samples
        return self.sample_hr_pass(model, samples, seeds)

    def sample_hr_pass(self, model: Any, samples: torch.Tensor, seeds: list[int]) -> Any:
        if shared.state.interrupted:
            return samples
        self.is_hr_pass = True
        width, height = self.hr_upscale_to_x, self.hr_upscale_to_y
        samples = torch.nn.functional.interpolate(samples, size=(height // OPT_F, width // OPT_F), mode="nearest")
        shared.state.nextjob()
        hr_noise = noise(seeds, samples.shape[1:])
        hr_c = self.conds(model, self.prompts, False, width, height)
        hr_uc = self.conds(model, self.negative_prompts, True, width, height)
        steps = self.hr_second_pass_steps or self.steps
        samples = denoise(self, model, samples + hr_noise, hr_c, hr_uc, steps, self.denoising_strength)
        self.is_hr_pass = False
        return DecodedList(decode_latent_batch(model, samples))


class StableDiffusionProcessingImg2Img(StableDiffusionProcessing):
    def __init__(self, init_images: list | None = None, mask: Any = None, resize_mode: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.init_images = init_images or []
        self.image_mask, self.mask = mask, None
        self.resize_mode = resize_mode
        self.init_latent: torch.Tensor | None = None

    def init(self, all_seeds: list[int]) -> None:
        model = self.sd_model
        imgs = []
        for img in self.init_images:
            image = img.convert("RGB").resize((self.width, self.height))
            imgs.append(np.moveaxis(np.array(image).astype(np.float32) / 255.0, 2, 0))
        batch = np.expand_dims(imgs[0], 0).repeat(self.batch_size, 0) if len(imgs) == 1 else np.array(imgs)
        image = torch.from_numpy(batch)
        self.init_latent = model.get_first_stage_encoding(model.encode_first_stage(2.0 * image - 1.0))

    def sample(self, model: Any, seeds: list[int]) -> Any:
        x = noise(seeds, self.init_latent.shape[1:])
        return denoise(self, model, self.init_latent + x, self.c, self.uc, self.steps, self.denoising_strength)


class DecodedList(list):
    """What ``sample`` returns when it already decoded (``already_decoded`` in A1111)."""

    already_decoded = True


def noise(seeds: list[int], shape: Any) -> torch.Tensor:
    return torch.stack([torch.randn(tuple(shape), generator=torch.Generator().manual_seed(s)) for s in seeds])


def _cat(a: Any, b: Any) -> Any:
    if isinstance(a, dict):
        return {k: torch.cat([a[k], b[k]]) for k in a}
    return torch.cat([a, b])


def _tokens(c: Any) -> int:
    return (c["crossattn"] if isinstance(c, dict) else c).shape[1]


def denoise(p: Any, model: Any, x: torch.Tensor, cond: Any, uncond: Any, steps: int, strength: float) -> torch.Tensor:
    """Euler-like loop with CFG; stops after the current step on Interrupt or Skip (like A1111's
    ``InterruptedException``), returning the latent so far."""
    state = shared.state
    sigmas = torch.linspace(2.0, 0.0, steps + 1) * strength
    x = x * max(float(sigmas[0]), 1e-3) if strength >= 1.0 else x
    state.sampling_steps = steps
    for i in range(steps):
        if state.interrupted or state.skipped:
            break
        script_callbacks.cfg_denoiser_callback(script_callbacks.CFGDenoiserParams(x, sigmas[i], cond, uncond, i, steps))
        x_in = torch.cat([x, x]) / (1 + sigmas[i] ** 2) ** 0.5
        sigma_in = torch.full((x_in.shape[0],), float(sigmas[i]) * 100.0)
        if _tokens(cond) == _tokens(uncond):
            out = model.apply_model(x_in, sigma_in, _cat(cond, uncond))
        else:  # A1111 with pad_cond_uncond off: cond and uncond in separate UNet calls
            n = x.shape[0]
            out = torch.cat(
                [model.apply_model(x_in[:n], sigma_in[:n], cond), model.apply_model(x_in[n:], sigma_in[n:], uncond)]
            )
        denoised_c, denoised_u = out.chunk(2)
        denoised = denoised_u + p.cfg_scale * (denoised_c - denoised_u)
        x = x + (sigmas[i + 1] - sigmas[i]) * denoised * 0.1
        state.sampling_step = i + 1
        state.current_latent = x
    return x


def decode_latent_batch(model: Any, batch: torch.Tensor) -> list[torch.Tensor]:
    """One VAE decode per image, as A1111 does."""
    return [model.decode_first_stage(batch[i : i + 1])[0] for i in range(batch.shape[0])]


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

    def js(self) -> str:
        """The ``info`` JSON of the API response."""
        return json.dumps(
            {
                "prompt": self.prompt,
                "seed": self.seed,
                "all_seeds": self.all_seeds,
                "width": self.width,
                "height": self.height,
                "extra_generation_params": self.extra_generation_params,
                "infotexts": self.infotexts,
                "comments": self.comments,
            }
        )


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


def process_images(p: Any) -> Processed:
    """Runs the whole pipeline, as A1111's ``process_images`` does."""
    state = shared.state
    model = p.sd_model if p.sd_model is not None else shared.sd_model
    p.sd_model = model
    p.sd_model_name = model.sd_checkpoint_info.name_for_extra
    p.sd_model_hash = model.sd_model_hash
    seed = p.seed if p.seed != -1 else random.randrange(2**31)
    all_seeds = [seed + i for i in range(p.batch_size * p.n_iter)]
    state.job_count = p.n_iter
    images: list[Image.Image] = []
    infotexts: list[str] = []
    with torch.no_grad():
        p.init(all_seeds)
        for n in range(p.n_iter):
            p.iteration = n
            if state.skipped:
                state.skipped = False
            if state.interrupted or state.stopping_generation:
                break
            seeds = all_seeds[n * p.batch_size : (n + 1) * p.batch_size]
            p.prompts, p.negative_prompts = [p.prompt] * p.batch_size, [p.negative_prompt] * p.batch_size
            p.c = p.conds(model, p.prompts, False, p.width, p.height)
            p.uc = p.conds(model, p.negative_prompts, True, p.width, p.height)
            samples = p.sample(model, seeds)
            decoded = samples if getattr(samples, "already_decoded", False) else decode_latent_batch(model, samples)
            for i, s in enumerate(seeds):
                arr = ((decoded[i].clamp(-1, 1) + 1) * 127.5).permute(1, 2, 0).round().to(torch.uint8).numpy()
                images.append(Image.fromarray(arr))
                infotexts.append(create_infotext(p, p.prompt, s))
            state.nextjob()
    return Processed(
        p, images, seed=seed, info=infotexts[0] if infotexts else "", all_seeds=all_seeds, infotexts=infotexts
    )
