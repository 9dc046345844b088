"""Generation with the WebUI's conventions: txt2img and img2img, batches, seeds, infotext.

Owns: ``GenerationJob`` (one validated request), ``Generator`` (diffusers pipelines built from
loaded ``Components``; the prompt is encoded here with the WebUI's weighting and chunking, the
initial latent is the WebUI's noise for the seed, the sampler comes from the WebUI's name),
step callbacks for progress, and stopping after the current step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import (
    StableDiffusionImg2ImgPipeline,
    StableDiffusionPipeline,
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLPipeline,
)
from PIL import Image

from .jobs import MAX_SEED, check_fields
from .loader import Components
from .noise import ImageNoise, image_seeds
from .pnginfo import format_infotext
from .prompts import PromptEncoder
from .samplers import img2img_strength, initial_latents, make_scheduler, sampler_spec
from .step_cache import StepCacheRun

logger = logging.getLogger(__name__)

StepCallback = Callable[[int, int], None]


class _WebUIGuidance:
    """Classifier-free guidance at every CFG scale, as the WebUI does it.

    The WebUI denoises with both the prompt and the negative prompt at any scale and combines
    them as ``uncond + cfg * (cond - uncond)``: CFG 0 is the unconditional prediction, CFG 1 the
    conditional one, 0.5 half way. diffusers skips the unconditional pass when the scale is at
    most 1, which would give the conditional prediction for every scale in [0, 1].
    """

    @property
    def do_classifier_free_guidance(self) -> bool:
        return True


class _Txt2Img(_WebUIGuidance, StableDiffusionPipeline):
    pass


class _Img2Img(_WebUIGuidance, StableDiffusionImg2ImgPipeline):
    pass


class _XLTxt2Img(_WebUIGuidance, StableDiffusionXLPipeline):
    pass


class _XLImg2Img(_WebUIGuidance, StableDiffusionXLImg2ImgPipeline):
    pass


class Interrupted(Exception):
    """Generation stopped on request after the current step; nothing of the batch was kept."""


@dataclass(frozen=True)
class GenerationJob:
    """One request: a prompt and how to render it (``batch_count`` batches of ``batch_size``)."""

    prompt: str
    negative_prompt: str = ""
    steps: int = 20
    cfg_scale: float = 7.0
    """Classifier-free guidance scale, >= 0: ``uncond + cfg_scale * (cond - uncond)`` (0: unconditional)."""
    sampler: str = "Euler a"
    width: int = 512
    height: int = 512
    seed: int = -1
    """-1 picks a random seed; image i of the job gets seed + i, as in the WebUI."""
    batch_size: int = 1
    batch_count: int = 1
    init_image: Image.Image | None = None
    """img2img when set: resized to width x height."""
    denoising_strength: float = 0.75
    clip_skip: int = 1

    def validated(self) -> GenerationJob:
        """Check every field; return a copy with the seed resolved.

        Raises:
            ValueError: what is wrong and what would be right.
        """
        sampler_spec(self.sampler)
        check_fields({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        seed = self.seed if self.seed != -1 else random.randrange(MAX_SEED)
        return dataclasses.replace(self, seed=seed)

    @property
    def images(self) -> int:
        return self.batch_size * self.batch_count


@dataclass(frozen=True)
class GeneratedImage:
    """One finished image with its seed and infotext."""

    image: Image.Image
    seed: int
    infotext: str
    seconds: float
    """Wall time of its batch divided by the batch size."""


class Generator:
    """Renders ``GenerationJob``s with diffusers pipelines over ``components``.

    Args:
        components: loaded modules (possibly routed through ov_backend by ``Accelerator``).
        model_name: "Model" in the infotext (the checkpoint's file name without extension).
        model_hash: "Model hash" in the infotext.
        extra_params: more infotext entries (the OpenVINO ones), appended in order.
        step_cache: the routed UNet's step caching state (``Accelerator.step_cache``): told when each
            sampling begins and ends and which sampler step the UNet's calls belong to.
        lora_dirs: the folders ``<lora:name:weight>`` in a prompt is looked up in (the WebUI's ``models/Lora``);
            a prompt's LoRAs are written into the weights before its batch (``lora.LoraWeights``: a change of
            LoRA is a change of weights in place, which a routed part compiles for) and taken out when a prompt
            has none.
    """

    def __init__(
        self,
        components: Components,
        model_name: str = "",
        model_hash: str = "",
        extra_params: dict[str, Any] | None = None,
        step_cache: StepCacheRun | None = None,
        lora_dirs: Sequence[str | os.PathLike] = (),
    ) -> None:
        from .lora import LoraWeights

        self.components = components
        self.lora_dirs = tuple(lora_dirs)
        self.loras = LoraWeights(components)
        self.step_cache = step_cache
        self.model_name = model_name
        self.model_hash = model_hash
        self.extra_params = dict(extra_params or {})
        c = components
        scheduler = make_scheduler("Euler", c.scheduler_config)
        if c.family == "sdxl":
            self.txt2img = _XLTxt2Img(
                vae=c.vae, text_encoder=c.text_encoders[0], text_encoder_2=c.text_encoders[1],
                tokenizer=c.tokenizers[0], tokenizer_2=c.tokenizers[1], unet=c.unet, scheduler=scheduler,
                add_watermarker=False,
            )
            self.img2img = _XLImg2Img(**self.txt2img.components)
        else:
            self.txt2img = _Txt2Img(
                vae=c.vae, text_encoder=c.text_encoders[0], tokenizer=c.tokenizers[0], unet=c.unet,
                scheduler=scheduler, safety_checker=None, feature_extractor=None, requires_safety_checker=False,
            )
            self.img2img = _Img2Img(**self.txt2img.components, requires_safety_checker=False)
        for pipe in (self.txt2img, self.img2img):
            pipe.set_progress_bar_config(disable=True)

    def prompt_encoder(self, clip_skip: int = 1) -> PromptEncoder:
        c = self.components
        return PromptEncoder(c.tokenizers, c.text_encoders, c.config["text_encoders"], clip_skip)

    def use_loras(self, prompt: str) -> str:
        """Write the LoRAs of ``prompt``'s tags into the weights (none: the original weights); returns the prompt
        without its tags, as it is encoded.

        Raises:
            LoraError: a LoRA is not found, cannot be read or does not fit the model.
            ValueError: a tag is malformed.
        """
        from .lora import parse_prompt_loras

        text, refs = parse_prompt_loras(prompt)
        if self.loras.apply(refs, self.lora_dirs):
            logger.info("LoRA now: %s", ", ".join(a.ref.name for a in self.loras.applied) or "none")
        return text

    def infotext(self, job: GenerationJob, seed: int) -> str:
        spec = sampler_spec(job.sampler)
        params: dict[str, Any] = {
            "Steps": job.steps,
            "Sampler": spec.infotext_sampler,
            "Schedule type": spec.schedule_type or None,
            "CFG scale": job.cfg_scale,
            "Seed": seed,
            "Size": f"{job.width}x{job.height}",
            "Model hash": self.model_hash or None,
            "Model": self.model_name or None,
            "Denoising strength": job.denoising_strength if job.init_image is not None else None,
            "Clip skip": job.clip_skip if job.clip_skip > 1 else None,
        }
        params.update(self.loras.infotext())
        params.update(self.extra_params)
        return format_infotext(job.prompt, job.negative_prompt, params)

    def _init_latents(self, job: GenerationJob, batch: int) -> torch.Tensor:
        """The init image's latent: resized with Lanczos ("Just resize"), scaled to [-1, 1], encoded.

        The WebUI takes ``posterior.sample()``, whose noise comes from torch's global random
        state, which no seed controls; the mean (``mode()``) is the reproducible value it scatters
        around (the VAE's posterior deviation is tiny).
        """
        vae = self.components.vae
        image = job.init_image.convert("RGB").resize((job.width, job.height), Image.LANCZOS)
        pixels = self.txt2img.image_processor.preprocess(image, height=job.height, width=job.width)
        with torch.no_grad():
            latents = vae.encode(pixels.to(vae.dtype)).latent_dist.mode() * vae.config.scaling_factor
        return latents.repeat(batch, 1, 1, 1)

    @torch.no_grad()
    def run_batch(
        self,
        job: GenerationJob,
        batch_index: int,
        on_step: StepCallback | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[GeneratedImage]:
        """Render batch ``batch_index`` of a validated job.

        Args:
            on_step: called as ``on_step(step, total)`` after every sampler step.
            should_stop: polled after every step; True stops after that step.

        Raises:
            Interrupted: ``should_stop`` returned True; the batch is dropped.
        """
        start = time.perf_counter()
        batch = job.batch_size
        seeds = image_seeds(job.seed, batch, batch_index)
        prompt = self.use_loras(job.prompt)
        encoder = self.prompt_encoder(job.clip_skip)
        cond, uncond = encoder.encode_pair(prompt, job.negative_prompt)
        noise = ImageNoise(seeds, job.width, job.height, self.components.unet.config.in_channels)
        stopped = False

        def step_end(pipe: Any, step: int, timestep: Any, tensors: dict) -> dict:
            nonlocal stopped
            if self.step_cache is not None:  # diffusers' loop runs ``order`` UNet calls per sampler step
                order = int(getattr(pipe.scheduler, "order", 1) or 1)
                self.step_cache.at_step((step + 1) // order, -(-int(pipe.num_timesteps) // order))
            if on_step is not None:
                on_step(step + 1, int(getattr(pipe, "num_timesteps", job.steps) or job.steps))
            if should_stop is not None and should_stop():
                stopped = True
                pipe._interrupt = True
            return tensors

        kwargs: dict[str, Any] = {
            "prompt_embeds": cond.embeds.repeat(batch, 1, 1),
            "negative_prompt_embeds": uncond.embeds.repeat(batch, 1, 1),
            "num_inference_steps": job.steps,
            "guidance_scale": job.cfg_scale,
            "output_type": "latent",
            "callback_on_step_end": step_end,
        }
        if self.components.family == "sdxl":
            kwargs["pooled_prompt_embeds"] = cond.pooled.repeat(batch, 1)
            kwargs["negative_pooled_prompt_embeds"] = uncond.pooled.repeat(batch, 1)
        scheduler = make_scheduler(job.sampler, self.components.scheduler_config, seeds)
        if job.init_image is None:
            pipe = self.txt2img
            latents = initial_latents(job.sampler, noise.first(), job.steps, scheduler)
            kwargs.update(width=job.width, height=job.height, latents=latents, generator=noise.generators)
        else:
            # The pipeline draws the first noise of each image's generator (the WebUI's img2img noise)
            # and adds it at the WebUI's starting sigma.
            pipe = self.img2img
            strength = img2img_strength(job.sampler, job.steps, job.denoising_strength)
            kwargs.update(image=self._init_latents(job, batch), strength=strength, generator=noise.generators)
            if self.components.family == "sdxl":
                kwargs.update(original_size=(job.height, job.width), target_size=(job.height, job.width))
        pipe.scheduler = scheduler
        if self.step_cache is not None:
            self.step_cache.begin(None)
        try:
            latents = pipe(**kwargs).images
        finally:
            if self.step_cache is not None:
                self.step_cache.end()
        if stopped:
            raise Interrupted(f"stopped during batch {batch_index + 1} of {job.batch_count}")
        vae = self.components.vae
        decoded = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        images = pipe.image_processor.postprocess(decoded, output_type="pil")
        seconds = (time.perf_counter() - start) / batch
        return [GeneratedImage(img, seed, self.infotext(job, seed), seconds) for img, seed in zip(images, seeds)]
