"""Builds the Forge tier's cheap SD 2.x checkpoint (v-prediction, as SD 2.1 768) with Forge's own model classes.

Run by the Forge test bed's Python, never by the project's venv. Usage::

    python make_models_sd2.py <Forge webui folder> <models folder>

Writes ``<models>/Stable-diffusion/ovtest-forge-sd2-v.safetensors`` and its ``ovtest-forge-sd2-v.yaml``.

Why Forge loads it as SD 2.x: huggingface_guess's ``SD20`` fixes ``context_dim`` 1024, ``model_channels`` 320,
linear ``proj_in``, no ADM input and 64-channel attention heads; the levels, residual blocks and transformer depths
are read from the shapes (here four levels of 320 channels with two residual blocks, a transformer on the first
three, as SD 2.x has: 0.08 B parameters, not 0.87 B). OpenCLIP-H (full-size, 24 layers in OpenCLIP's names under
``cond_stage_model.model``, as SD 2.x checkpoints hold it; Forge's config runs the first 23, its conditioning ending in
the final LayerNorm) and the VAE come from Forge's fixed config
``backend/huggingface/stabilityai/stable-diffusion-2-1``.
Random weights are made non-degenerate as for SD 1.5 (``make_models.py``).

Why v-prediction: Forge main takes the prediction type from a ``.yaml`` beside the checkpoint
(``parameterization: v``, as SD 2.x 768 checkpoints are shipped and A1111's users keep them), else from
huggingface_guess, which it asks with no key prefix, so that a whole checkpoint always reads as epsilon
(``backend/loader.py``); the yaml is written beside this one, as a user would have it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from make_models import fp16_state, non_degenerate, scaled_vae, use_forge
from make_models_sdxl import open_clip_layout

CHECKPOINT = "ovtest-forge-sd2-v.safetensors"
SEED = 5
SD2_REPO = os.path.join("backend", "huggingface", "stabilityai", "stable-diffusion-2-1")
UNET_CONFIG: dict[str, Any] = {
    "in_channels": 4,
    "out_channels": 4,
    "model_channels": 320,
    "channel_mult": [1, 1, 1, 1],
    "num_res_blocks": [2, 2, 2, 2],
    "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0],
    "transformer_depth_output": [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1],
    "transformer_depth_middle": 1,
    "context_dim": 1024,
    "use_linear_in_transformer": True,
    "use_spatial_transformer": True,
    "adm_in_channels": None,
    "num_heads": -1,
    "num_head_channels": 64,
}
YAML = "model:\n  params:\n    parameterization: v\n"
OPEN_CLIP_LAYERS = 24


def build(seed: int) -> dict[str, Any]:
    """The checkpoint's tensors (fp16, the layout of SD 2.x's published checkpoints)."""
    import torch
    import transformers
    from backend.nn.unet import IntegratedUNet2DConditionModel
    from backend.nn.vae import IntegratedAutoencoderKL

    torch.manual_seed(seed)
    unet = IntegratedUNet2DConditionModel(**UNET_CONFIG)
    config = transformers.CLIPTextConfig.from_pretrained(os.path.join(SD2_REPO, "text_encoder"))
    config.num_hidden_layers, config.projection_dim = OPEN_CLIP_LAYERS, config.hidden_size  # OpenCLIP-H's own
    clip_h = transformers.CLIPTextModelWithProjection(config)
    vae = IntegratedAutoencoderKL.from_config(IntegratedAutoencoderKL.load_config(os.path.join(SD2_REPO, "vae")))
    tokenizer = transformers.CLIPTokenizer.from_pretrained(os.path.join(SD2_REPO, "tokenizer"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        non_degenerate(unet, (clip_h,), gen)
        tokens = tokenizer(["", "a lighthouse", "(a red car:1.3)", "blurry"], padding="max_length", max_length=77,
                           return_tensors="pt").input_ids
        text = clip_h.text_model
        z = text.final_layer_norm(text(tokens, output_hidden_states=True).hidden_states[-2])  # what Forge's 23 give
        means = z.mean(dim=(1, 2))
        eps = unet(torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([500.0, 500.0]), context=z[1:3])
        image_std = scaled_vae(vae, gen)
    assert z.isfinite().all() and means.abs().min() > 0.02, f"conditioning means too close to 0: {means}"
    assert (z[1] - z[3]).abs().mean() > 0.01, "the conditioning does not depend on the prompt"
    assert eps.isfinite().all() and eps.std() > 0.05, f"UNet output std {eps.std()}"
    assert (eps[0] - eps[1]).abs().mean() > 0.01 * eps.abs().mean(), "the UNet's output ignores the prompt"
    print(  # noqa: T201 (run by the test bed; its output is read on failure)
        f"SD 2 seed {seed}: UNet {sum(p.numel() for p in unet.parameters()) / 1e6:.0f} M parameters, conditioning "
        f"means {[round(float(m), 3) for m in means]}, UNet output std {float(eps.std()):.3f}, "
        f"image std {image_std:.3f}"
    )
    return fp16_state({"model.diffusion_model.": unet.state_dict(),
                       "cond_stage_model.model.": open_clip_layout(clip_h.state_dict(), OPEN_CLIP_LAYERS),
                       "first_stage_model.": vae.state_dict()})


def check_guess(state: dict[str, Any]) -> None:
    """huggingface_guess (Forge's own family detection) takes the state dict for SD 2.x, with this UNet."""
    import huggingface_guess
    from huggingface_guess import model_list

    guess = huggingface_guess.guess(state)
    assert type(guess) is model_list.SD20, f"huggingface_guess sees {type(guess).__name__}, not SD20"
    found = {k: guess.unet_config.get(k) for k in UNET_CONFIG}
    assert found == UNET_CONFIG, f"huggingface_guess reads another UNet: {found}"


def main(webui: str, models: str) -> None:
    models = os.path.abspath(models)
    use_forge(os.path.abspath(webui))
    from safetensors.torch import save_file

    out = os.path.join(models, "Stable-diffusion", CHECKPOINT)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(os.path.splitext(out)[0] + ".yaml", "w", encoding="utf-8") as f:
        f.write(YAML)
    if os.path.isfile(out):
        return
    state = build(SEED)
    check_guess(state)
    save_file(state, out + ".part")
    os.replace(out + ".part", out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
