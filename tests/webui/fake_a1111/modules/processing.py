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
* inpainting (img2img with ``mask``, "original" fill, no blur, whole picture): the latent mask blends
  the original latent into the prediction after each step and into the result; an inpainting
  checkpoint (``model.conditioning_key`` "hybrid", 9-channel UNet) gets the mask and the VAE-encoded
  masked image as ``c_concat``; the unmasked part of the result is pasted from the init image;
* the refiner: ``refiner_checkpoint`` / ``refiner_switch_at`` switch the model mid-sampling
  (``sd_samplers_common.apply_refiner`` -> ``sd_models.reload_model_weights``), after which the UNet,
  the conds and the VAE decode come from the new ``shared.sd_model``; ``p.sd_model`` is
  ``shared.sd_model``, and each batch starts with ``reload_model_weights()`` (back to the selected model);
* live previews: ``store_latent`` after each step (``sd_samplers_common``);
* one VAE decode per image (``decode_latent_batch``), infotext per image, batch count loop;
* A1111's NaN check (``devices.test_for_nans``): the sampled latent ("unet") and each decoded image ("vae");
* ``override_settings``: applied to ``opts`` before the generation; ``sd_model_checkpoint`` among them
  loads that checkpoint (``reload_model_weights``, with its ``model_loaded`` callbacks); the old values
  are put back afterwards when ``override_settings_restore_afterwards`` (the model itself changes back at
  the next generation's start, as in A1111);
* the always-on scripts' hooks (``p.scripts``: before_process, process, before_process_batch,
  process_batch, postprocess_batch, postprocess), each with its slice of ``p.script_args``;
* A1111's conditioning cache (``cached_c``/``cached_uc``, class attributes shared by every ``p``, filled
  by ``get_conds_with_caching``) when a test sets ``StableDiffusionProcessing.use_cond_cache``.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

from modules import devices, script_callbacks, sd_models, sd_samplers_common, shared
from modules.infotext_utils import quote

OPT_F = 8




class SdConditioning(list):
    """``prompt_parser.SdConditioning``: a list of prompts with the image size (SDXL uses it)."""

    def __init__(self, prompts: list[str], width: int, height: int, is_negative_prompt: bool = False) -> None:
        super().__init__(prompts)
        self.width, self.height, self.is_negative_prompt = width, height, is_negative_prompt


class StableDiffusionProcessing:
    """The fields extensions use (see a1111-host.md)."""

    cached_uc: list = [None, None]
    cached_c: list = [None, None]
    override_settings_restore_afterwards = True
    use_cond_cache = False
    """A1111 always caches the last prompts' conds (``opts.persistent_cond_cache``, on by default, keeps
    them across generations); the fake does only when this is set, so that tests counting text encoder
    calls per batch keep their meaning."""

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
        refiner_checkpoint: str | None = None,
        refiner_switch_at: float | None = None,
        **kwargs: Any,
    ) -> None:
        self.refiner_checkpoint, self.refiner_switch_at = refiner_checkpoint, refiner_switch_at
        self.refiner_checkpoint_info = None
        self.is_hr_pass = False
        self.mask = self.nmask = self.init_latent = None
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

    @property
    def sd_model(self) -> Any:
        """As in A1111: always the loaded model (the refiner while it runs); the setter does nothing."""
        return shared.sd_model

    @sd_model.setter
    def sd_model(self, value: Any) -> None:
        pass

    def close(self) -> None:
        """A1111 calls it when the request ends (``with closing(p)``), however it ends."""
        self.sampler = None

    def comment(self, text: str) -> None:
        self.comments[text] = 1

    def init(self, all_seeds: list[int]) -> None:
        pass

    def conds(self, model: Any, prompts: list[str], negative: bool, width: int, height: int) -> Any:
        batch = SdConditioning(prompts, width, height, is_negative_prompt=negative)
        if getattr(model, "is_sdxl", False):
            return model.get_learned_conditioning(batch, width=width, height=height)
        return model.get_learned_conditioning(batch)

    def get_conds_with_caching(self, prompts: list[str], negative: bool, cache: list) -> Any:
        """A1111's cache lookup: the cached conds when the parameters that make them are unchanged."""
        model = shared.sd_model
        params = (
            tuple(prompts),
            negative,
            self.steps,
            shared.opts.CLIP_stop_at_last_layers,
            model.sd_checkpoint_info,
            self.width,
            self.height,
        )
        if cache[0] is not None and cache[0] == params:
            return cache[1]
        cache[1] = self.conds(model, prompts, negative, self.width, self.height)
        cache[0] = params
        return cache[1]

    def setup_conds(self) -> None:
        """The conds of the current batch with the loaded model (again after a refiner switch)."""
        model = shared.sd_model
        if self.is_hr_pass:
            width, height = self.hr_upscale_to_x, self.hr_upscale_to_y
            self.hr_c = self.conds(model, self.prompts, False, width, height)
            self.hr_uc = self.conds(model, self.negative_prompts, True, width, height)
            return
        if self.use_cond_cache:
            self.uc = self.get_conds_with_caching(self.negative_prompts, True, StableDiffusionProcessing.cached_uc)
            self.c = self.get_conds_with_caching(self.prompts, False, StableDiffusionProcessing.cached_c)
            return
        self.c = self.conds(model, self.prompts, False, self.width, self.height)
        self.uc = self.conds(model, self.negative_prompts, True, self.width, self.height)

    def get_conds(self) -> tuple[Any, Any]:
        return (self.hr_c, self.hr_uc) if self.is_hr_pass else (self.c, self.uc)

    def txt2img_image_conditioning(self, x: torch.Tensor, width: int = 0, height: int = 0) -> torch.Tensor:
        model = shared.sd_model
        if model.model.conditioning_key in {"hybrid", "concat"}:  # inpainting models: all masked
            image = torch.zeros(x.shape[0], 3, height or self.height, width or self.width)
            conditioning = model.get_first_stage_encoding(model.encode_first_stage(image * 2 - 1))
            return torch.nn.functional.pad(conditioning, (0, 0, 0, 0, 1, 0), value=1.0)
        return x.new_zeros(x.shape[0], 5, 1, 1)

    def inpainting_image_conditioning(self, source_image: torch.Tensor, latent_image: torch.Tensor, image_mask: Any):
        """The mask and the VAE-encoded masked image, concatenated: ``c_concat`` of an inpainting UNet."""
        model = shared.sd_model
        if image_mask is not None:
            conditioning_mask = np.array(image_mask.convert("L")).astype(np.float32) / 255.0
            conditioning_mask = torch.round(torch.from_numpy(conditioning_mask[None, None]))
        else:
            conditioning_mask = source_image.new_ones(1, 1, *source_image.shape[-2:])
        weight = shared.opts.inpainting_mask_weight
        conditioning_image = torch.lerp(source_image, source_image * (1.0 - conditioning_mask), weight)
        conditioning_image = model.get_first_stage_encoding(model.encode_first_stage(conditioning_image))
        conditioning_mask = torch.nn.functional.interpolate(conditioning_mask, size=latent_image.shape[-2:])
        conditioning_mask = conditioning_mask.expand(conditioning_image.shape[0], -1, -1, -1)
        return torch.cat([conditioning_mask, conditioning_image], dim=1)

    def img2img_image_conditioning(self, source_image: torch.Tensor, latent_image: torch.Tensor, image_mask: Any):
        if shared.sd_model.model.conditioning_key in {"hybrid", "concat"}:
            return self.inpainting_image_conditioning(source_image, latent_image, image_mask)
        return latent_image.new_zeros(latent_image.shape[0], 5, 1, 1)

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
        self.hr_c = self.hr_uc = None

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
        x = noise(seeds, shape)
        samples = denoise(self, x, self.steps, 1.0, self.txt2img_image_conditioning(x))
        if not self.enable_hr:
            return samples
        return self.sample_hr_pass(shared.sd_model, samples, seeds)

    def sample_hr_pass(self, model: Any, samples: torch.Tensor, seeds: list[int]) -> Any:
        if shared.state.interrupted:
            return samples
        self.is_hr_pass = True
        width, height = self.hr_upscale_to_x, self.hr_upscale_to_y
        samples = torch.nn.functional.interpolate(samples, size=(height // OPT_F, width // OPT_F), mode="nearest")
        shared.state.nextjob()
        hr_noise = noise(seeds, samples.shape[1:])
        self.setup_conds()
        steps = self.hr_second_pass_steps or self.steps
        image_conditioning = self.txt2img_image_conditioning(samples, width, height)
        samples = denoise(self, samples + hr_noise, steps, self.denoising_strength, image_conditioning)
        self.is_hr_pass = False
        return DecodedList(decode_latent_batch(shared.sd_model, samples, check_for_nans=True))


class StableDiffusionProcessingImg2Img(StableDiffusionProcessing):
    def __init__(self, init_images: list | None = None, mask: Any = None, resize_mode: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.init_images = init_images or []
        self.image_mask, self.mask = mask, None
        self.overlay_images: list | None = None
        self.mask_for_overlay = None
        self.image_conditioning: torch.Tensor | None = None
        self.resize_mode = resize_mode
        self.init_latent: torch.Tensor | None = None

    def init(self, all_seeds: list[int]) -> None:
        model = self.sd_model
        image_mask = self.image_mask
        if image_mask is not None:  # create_binary_mask, resized as the image ("Inpaint area: Whole picture")
            image_mask = image_mask.convert("L").resize((self.width, self.height))
            self.mask_for_overlay = image_mask
            self.overlay_images = []
        imgs = []
        for img in self.init_images:
            image = img.convert("RGB").resize((self.width, self.height))
            if image_mask is not None:  # the part that is kept, pasted over the result
                overlay = Image.new("RGBa", (image.width, image.height))
                overlay.paste(image.convert("RGBA").convert("RGBa"), mask=ImageOps.invert(image_mask))
                self.overlay_images.append(overlay.convert("RGBA"))
            imgs.append(np.moveaxis(np.array(image).astype(np.float32) / 255.0, 2, 0))
        batch = np.expand_dims(imgs[0], 0).repeat(self.batch_size, 0) if len(imgs) == 1 else np.array(imgs)
        if len(imgs) == 1 and self.overlay_images is not None:
            self.overlay_images = self.overlay_images * self.batch_size
        image = torch.from_numpy(batch)
        self.init_latent = model.get_first_stage_encoding(model.encode_first_stage(2.0 * image - 1.0))
        if image_mask is not None:
            latmask = image_mask.convert("RGB").resize((self.init_latent.shape[3], self.init_latent.shape[2]))
            latmask = np.around(np.moveaxis(np.array(latmask, dtype=np.float32), 2, 0) / 255)[0]
            latmask = np.tile(latmask[None], (4, 1, 1))
            self.mask = torch.asarray(1.0 - latmask)
            self.nmask = torch.asarray(latmask)
        self.image_conditioning = self.img2img_image_conditioning(image * 2 - 1, self.init_latent, image_mask)

    def sample(self, model: Any, seeds: list[int]) -> Any:
        x = noise(seeds, self.init_latent.shape[1:])
        samples = denoise(self, self.init_latent + x, self.steps, self.denoising_strength, self.image_conditioning)
        if self.mask is not None:
            samples = samples * self.nmask + self.init_latent * self.mask
        return samples


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


def _condition(cond: Any, image_cond: torch.Tensor) -> dict:
    """CFGDenoiser's ``make_condition_dict``: text conds plus ``c_concat``."""
    if isinstance(cond, dict):
        return {**cond, "c_concat": [image_cond]}
    return {"c_crossattn": [cond], "c_concat": [image_cond]}


def denoise(p: Any, x: torch.Tensor, steps: int, strength: float, image_cond: torch.Tensor) -> torch.Tensor:
    """Euler-like loop with CFG, run as A1111's CFGDenoiser runs each step: Interrupt/Skip check, refiner
    switch (then the model and conds are the refiner's), ``cfg_denoiser`` callback, UNet on
    ``shared.sd_model``, mask blend, ``store_latent`` (live preview). Stops after the current step on
    Interrupt or Skip, returning the latent so far."""
    state = shared.state
    sigmas = torch.linspace(2.0, 0.0, steps + 1) * strength
    x = x * max(float(sigmas[0]), 1e-3) if strength >= 1.0 else x
    state.sampling_steps = steps
    for i in range(steps):
        if state.interrupted or state.skipped:
            break
        sd_samplers_common.apply_refiner(p, i, steps)
        cond, uncond = p.get_conds()
        model = shared.sd_model
        params = script_callbacks.CFGDenoiserParams(x, sigmas[i], cond, uncond, i, steps, image_cond)
        script_callbacks.cfg_denoiser_callback(params)
        x_in = torch.cat([x, x]) / (1 + sigmas[i] ** 2) ** 0.5
        sigma_in = torch.full((x_in.shape[0],), float(sigmas[i]) * 100.0)
        image_cond_in = torch.cat([image_cond, image_cond])
        n = x.shape[0]
        if _tokens(cond) == _tokens(uncond):
            out = model.apply_model(x_in, sigma_in, _condition(_cat(cond, uncond), image_cond_in))
        else:  # A1111 with pad_cond_uncond off: cond and uncond in separate UNet calls
            out = torch.cat(
                [
                    model.apply_model(x_in[:n], sigma_in[:n], _condition(cond, image_cond_in[:n])),
                    model.apply_model(x_in[n:], sigma_in[n:], _condition(uncond, image_cond_in[n:])),
                ]
            )
        denoised_c, denoised_u = out.chunk(2)
        denoised = denoised_u + p.cfg_scale * (denoised_c - denoised_u)
        if getattr(p, "mask", None) is not None:  # blend in the original latent (after)
            denoised = denoised * p.nmask + p.init_latent * p.mask
        sd_samplers_common.store_latent(denoised_c)  # live_preview_content "Prompt"
        x = x + (sigmas[i + 1] - sigmas[i]) * denoised
        state.sampling_step = i + 1
    return x


def decode_latent_batch(model: Any, batch: torch.Tensor, check_for_nans: bool = False) -> list[torch.Tensor]:
    """One VAE decode per image, as A1111 does (with ``check_for_nans``: the latent and each image checked)."""
    if check_for_nans:
        devices.test_for_nans(batch, "unet")
    decoded = []
    for i in range(batch.shape[0]):
        decoded.append(model.decode_first_stage(batch[i : i + 1])[0])
        if check_for_nans:
            devices.test_for_nans(decoded[-1], "vae")
    return decoded


class Processed:
    """Mirrors A1111's Processed constructor and ``js()`` (the ``info`` JSON of the API reply; it has no
    ``comments``: those reach the UI as ``Processed.comments`` only)."""

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
        self.seed, self.subseed, self.info = seed, -1 if subseed is None else subseed, info
        self.subseed_strength = p.subseed_strength
        self.width, self.height = p.width, p.height
        self.sampler_name, self.cfg_scale = p.sampler_name, p.cfg_scale
        self.steps, self.batch_size = p.steps, p.batch_size
        self.sd_model_name, self.sd_model_hash = p.sd_model_name, p.sd_model_hash
        self.denoising_strength = getattr(p, "denoising_strength", None)
        self.all_prompts = all_prompts or [p.prompt]
        self.all_negative_prompts = all_negative_prompts or [p.negative_prompt]
        self.all_seeds = all_seeds or [seed]
        self.all_subseeds = all_subseeds or [self.subseed]
        self.infotexts = infotexts or [info] * len(images_list)
        self.comments = "".join(f"{comment}\n" for comment in p.comments)
        self.index_of_first_image = index_of_first_image
        self.extra_generation_params = p.extra_generation_params
        self.clip_skip = shared.opts.CLIP_stop_at_last_layers
        conditioning_key = getattr(getattr(shared.sd_model, "model", None), "conditioning_key", None)
        self.is_using_inpainting_conditioning = conditioning_key in {"hybrid", "concat"}

    def js(self) -> str:
        """The ``info`` JSON of the API response: A1111 v1.10.1's keys (fields the fake does not model are
        null, as A1111 writes an unset one)."""
        obj = {
            "prompt": self.all_prompts[0],
            "all_prompts": self.all_prompts,
            "negative_prompt": self.all_negative_prompts[0],
            "all_negative_prompts": self.all_negative_prompts,
            "seed": self.seed,
            "all_seeds": self.all_seeds,
            "subseed": self.subseed,
            "all_subseeds": self.all_subseeds,
            "subseed_strength": self.subseed_strength,
            "width": self.width,
            "height": self.height,
            "sampler_name": self.sampler_name,
            "cfg_scale": self.cfg_scale,
            "steps": self.steps,
            "batch_size": self.batch_size,
            "restore_faces": False,
            "face_restoration_model": None,
            "sd_model_name": self.sd_model_name,
            "sd_model_hash": self.sd_model_hash,
            "sd_vae_name": None,
            "sd_vae_hash": None,
            "seed_resize_from_w": -1,
            "seed_resize_from_h": -1,
            "denoising_strength": self.denoising_strength,
            "extra_generation_params": self.extra_generation_params,
            "index_of_first_image": self.index_of_first_image,
            "infotexts": self.infotexts,
            "styles": [],
            "job_timestamp": None,
            "clip_skip": self.clip_skip,
            "is_using_inpainting_conditioning": self.is_using_inpainting_conditioning,
            "version": "v1.10.1",
        }
        return json.dumps(obj, default=lambda o: None)


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


def apply_overlay(image: Image.Image, index: int, overlays: list | None) -> Image.Image:
    if overlays is None or index >= len(overlays):
        return image
    image = image.convert("RGBA")
    image.alpha_composite(overlays[index])
    return image.convert("RGB")


def process_images(p: Any) -> Processed:
    """Runs the whole pipeline, as A1111's ``process_images`` does: ``override_settings`` around it."""
    if p.scripts is not None:
        p.scripts.before_process(p)
    opts = shared.opts
    stored_opts = {k: opts.data[k] for k in p.override_settings if k in opts.data}
    try:
        # An unknown checkpoint override is dropped; without one the selected model is loaded (back)
        if sd_models.checkpoint_aliases.get(p.override_settings.get("sd_model_checkpoint")) is None:
            p.override_settings.pop("sd_model_checkpoint", None)
            sd_models.reload_model_weights()
        for key, value in p.override_settings.items():
            opts.data[key] = value  # opts.set(..., run_callbacks=False)
            if key == "sd_model_checkpoint":
                sd_models.reload_model_weights()
        return process_images_inner(p)
    finally:
        if p.override_settings_restore_afterwards:
            for key, value in stored_opts.items():
                opts.data[key] = value


def process_images_inner(p: Any) -> Processed:
    state = shared.state
    if p.refiner_checkpoint not in (None, "", "None", "none"):
        p.refiner_checkpoint_info = sd_models.get_closet_checkpoint_match(p.refiner_checkpoint)
        if p.refiner_checkpoint_info is None:
            raise Exception(f"Could not find checkpoint with name {p.refiner_checkpoint}")
    model = shared.sd_model
    p.sd_model_name = model.sd_checkpoint_info.name_for_extra
    p.sd_model_hash = model.sd_model_hash
    seed = p.seed if p.seed != -1 else random.randrange(2**31)
    all_seeds = [seed + i for i in range(p.batch_size * p.n_iter)]
    state.job_count = p.n_iter
    images: list[Image.Image] = []
    infotexts: list[str] = []
    samples_255: list[np.ndarray] = []  # test-only: each image before 8-bit rounding (0..255 floats)
    if p.scripts is not None:
        p.scripts.process(p)
    with torch.no_grad():
        p.init(all_seeds)
        for n in range(p.n_iter):
            p.iteration = n
            if state.skipped:
                state.skipped = False
            if state.interrupted or state.stopping_generation:
                break
            sd_models.reload_model_weights()  # "model can be changed for example by refiner"
            seeds = all_seeds[n * p.batch_size : (n + 1) * p.batch_size]
            p.prompts, p.negative_prompts = [p.prompt] * p.batch_size, [p.negative_prompt] * p.batch_size
            batch_args = {"batch_number": n, "prompts": p.prompts, "seeds": seeds, "subseeds": seeds}
            if p.scripts is not None:
                p.scripts.before_process_batch(p, **batch_args)
            p.setup_conds()
            if p.scripts is not None:
                p.scripts.process_batch(p, **batch_args)
            samples = p.sample(shared.sd_model, seeds)
            if getattr(samples, "already_decoded", False):
                decoded = samples
            else:
                devices.test_for_nans(samples, "unet")
                decoded = decode_latent_batch(p.sd_model, samples, check_for_nans=True)
            if p.scripts is not None:
                p.scripts.postprocess_batch(p, decoded, batch_number=n)
            for i, s in enumerate(seeds):
                exact = ((decoded[i].float().clamp(-1, 1) + 1) * 127.5).permute(1, 2, 0)
                samples_255.append(exact.double().numpy())
                arr = exact.round().to(torch.uint8).numpy()
                images.append(apply_overlay(Image.fromarray(arr), i, getattr(p, "overlay_images", None)))
                infotexts.append(create_infotext(p, p.prompt, s))
            state.nextjob()
    processed = Processed(
        p, images, seed=seed, info=infotexts[0] if infotexts else "", all_seeds=all_seeds, infotexts=infotexts
    )
    processed.samples_255 = samples_255
    if p.scripts is not None:
        p.scripts.postprocess(p, processed)
    return processed
