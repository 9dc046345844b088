"""Whole images: the standalone pipeline, split into its model calls and everything else.

Runs in a worker process: builds SD 1.5 ``Components`` from the same random weights as the
component benchmark, routes them through ov_backend with the SD layer's ``Accelerator``
(exactly what ``python -m ov_backend generate`` does), renders one warm-up image (it
compiles every part) and then one timed txt2img image with N steps. Forward hooks time every
text-encoder, UNet and VAE-decoder call; the rest of the wall time (sampler, prompt
parsing, noise, post-processing, guards) is "everything else".
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

PROMPT = "a photograph of an astronaut riding a horse, highly detailed"
NEGATIVE = "blurry, low quality"


@dataclass(frozen=True)
class ImageTask:
    """One whole-image measurement.

    Attributes:
        quick: small models.
        weights: component name -> weights file ("unet", "vae_decoder", "text_encoder").
        steps: sampler steps of the timed image.
        size: image width and height in pixels.
        precision: "auto" or "f32".
        cache_dir: the backend's cache folder (caching stays off: the warm-up image compiles).
        log_level: logging level of the worker.
    """

    quick: bool
    weights: dict[str, Path]
    steps: int
    size: int
    precision: str
    cache_dir: Path
    log_level: int = logging.WARNING


class _PartTimer:
    """Forward pre/post hooks that add up the wall time and calls of named modules."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._started: dict[int, float] = {}
        self._handles: list[Any] = []

    def watch(self, part: str, module: torch.nn.Module) -> None:
        def pre(mod: torch.nn.Module, args: Any) -> None:
            self._started[id(mod)] = time.perf_counter()

        def post(mod: torch.nn.Module, args: Any, out: Any) -> None:
            self.seconds[part] += time.perf_counter() - self._started.pop(id(mod))
            self.calls[part] += 1

        self._handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _components(task: ImageTask) -> Any:
    from bench import models
    from ov_accelerate_sd.loader import Components
    from ov_accelerate_sd.tokenizer import clip_tokenizer

    config = models.family_configs("sd1", task.quick)
    unet = models.load_module("unet", task.quick, task.weights["unet"]).unet
    vae = models.load_module("vae_decoder", task.quick, task.weights["vae_decoder"]).vae
    encoder = models.load_module("text_encoder", task.quick, task.weights["text_encoder"]).encoder
    tokenizers = [clip_tokenizer(spec["pad_token"]) for spec in config["text_encoders"]]
    return Components("sd1", config, unet, vae, [encoder], tokenizers, dict(config["scheduler"]))


def image_main(task: ImageTask, conn: Connection) -> None:
    """Entry of the whole-image worker: answers with the split of the timed image."""
    logging.basicConfig(level=task.log_level, format="[image worker] %(levelname)s %(name)s: %(message)s")
    try:
        from bench.worker import peak_rss_bytes
        from ov_accelerate_sd.accelerate import Accelerator
        from ov_accelerate_sd.pipeline import GenerationJob, Generator
        from ov_accelerate_sd.settings import build_sd_settings

        components = _components(task)
        settings = build_sd_settings({"precision": task.precision, "model_caching": False,
                                      "cache_dir": str(task.cache_dir)})
        accelerator = Accelerator(components, settings).apply()
        generator = Generator(components)
        timer = _PartTimer()
        timer.watch("text_encoder", components.text_encoders[0])
        timer.watch("unet", components.unet)
        timer.watch("vae_decoder", components.vae.decoder)
        job = GenerationJob(PROMPT, NEGATIVE, steps=task.steps, width=task.size, height=task.size, seed=1,
                            sampler="Euler").validated()
        start = time.perf_counter()
        generator.run_batch(dataclasses.replace(job, steps=1), 0)
        warmup = time.perf_counter() - start
        timer.reset()
        start = time.perf_counter()
        images = generator.run_batch(job, 0)
        total = time.perf_counter() - start
        timer.remove()
        parts = {part: {"seconds": timer.seconds[part], "calls": timer.calls[part]} for part in
                 ("text_encoder", "unet", "vae_decoder")}
        other = total - sum(p["seconds"] for p in parts.values())
        conn.send(("ok", {"steps": task.steps, "size": task.size, "precision": task.precision,
                          "sampler": job.sampler, "warmup_image_seconds": warmup, "image_seconds": total,
                          "parts": parts, "other_seconds": other, "other_fraction": other / total,
                          "image_size": list(images[0].image.size), "backend_stats": accelerator.stats(),
                          "peak_rss_bytes": peak_rss_bytes()}))
    except Exception:  # report any failure to the coordinator
        conn.send(("error", traceback.format_exc()))
