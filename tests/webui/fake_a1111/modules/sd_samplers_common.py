"""Fake ``modules.sd_samplers_common``: live previews (``store_latent``, latents to preview images) and
``apply_refiner``, as in A1111 v1.10.1.

A preview with ``opts.show_progress_type == "Full"`` is decoded by ``shared.sd_model.decode_first_stage``
(the model's VAE), one sample at a time; "Approx cheap" is a fixed linear map of the latent channels.
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from modules import sd_models, shared

approximation_indexes = {"Full": 0, "Approx NN": 1, "Approx cheap": 2, "TAESD": 3}

#: "Approx cheap": latent channels -> RGB (a fixed map; A1111 uses one fitted per model family).
CHEAP_COEFFS = torch.tensor([[0.3, 0.2, 0.2], [0.2, 0.3, 0.1], [-0.2, 0.1, 0.3], [-0.2, -0.2, -0.4]])


def samples_to_images_tensor(sample: torch.Tensor, approximation: int | None = None, model: Any = None) -> Any:
    """Latents (B, 4, h, w) -> images (B, 3, H, W) in [-1, 1]."""
    if approximation is None:
        approximation = approximation_indexes.get(shared.opts.show_progress_type, 0)
    if approximation != 0:  # the approximations A1111 has ("Approx NN", TAESD) stand in as the cheap one
        return torch.einsum("bchw,cr->brhw", sample, CHEAP_COEFFS)
    model = model if model is not None else shared.sd_model
    return model.decode_first_stage(sample)


def single_sample_to_image(sample: torch.Tensor, approximation: int | None = None) -> torch.Tensor:
    x_sample = samples_to_images_tensor(sample.unsqueeze(0), approximation)[0] * 0.5 + 0.5
    x_sample = torch.clamp(x_sample, min=0.0, max=1.0)
    return (255.0 * x_sample.permute(1, 2, 0)).to(dtype=torch.uint8)


def sample_to_image(samples: torch.Tensor, index: int = 0, approximation: int | None = None) -> Image.Image:
    return Image.fromarray(single_sample_to_image(samples[index], approximation).numpy())


def samples_to_image_grid(samples: torch.Tensor, approximation: int | None = None) -> Image.Image:
    tiles = [single_sample_to_image(sample, approximation).numpy() for sample in samples]
    width = sum(t.shape[1] for t in tiles)
    grid = Image.new("RGB", (width, tiles[0].shape[0]))
    for i, tile in enumerate(tiles):
        grid.paste(Image.fromarray(tile), (i * tile.shape[1], 0))
    return grid


def store_latent(decoded: torch.Tensor) -> None:
    state = shared.state
    state.current_latent = decoded
    opts = shared.opts
    if (
        opts.live_previews_enable
        and opts.show_progress_every_n_steps > 0
        and state.sampling_step % opts.show_progress_every_n_steps == 0
        and not shared.parallel_processing_allowed
    ):
        state.assign_current_image(sample_to_image(decoded))


def apply_refiner(p: Any, step: int, total_steps: int) -> bool:
    """Switch to ``p.refiner_checkpoint_info`` once ``refiner_switch_at`` of the steps are done (A1111's
    "switch by sampling steps"): load it with ``SkipWritingToConfig`` and compute the conds anew."""
    completed_ratio = step / total_steps
    refiner_switch_at = p.refiner_switch_at
    refiner_checkpoint_info = p.refiner_checkpoint_info
    if refiner_switch_at is not None and completed_ratio < refiner_switch_at:
        return False
    if refiner_checkpoint_info is None or shared.sd_model.sd_checkpoint_info == refiner_checkpoint_info:
        return False
    if getattr(p, "enable_hr", False) and not p.is_hr_pass:  # opts.hires_fix_refiner_pass: "second pass"
        return False
    p.extra_generation_params["Refiner"] = refiner_checkpoint_info.short_title
    p.extra_generation_params["Refiner switch at"] = refiner_switch_at
    with sd_models.SkipWritingToConfig():
        sd_models.reload_model_weights(info=refiner_checkpoint_info)
    p.setup_conds()
    return True
