"""Builds the Forge tier's cheap SDXL checkpoint with Forge's own model classes (``make_models.py`` does SD 1.5).

Run by the Forge test bed's Python, never by the project's venv. Usage::

    python make_models_sdxl.py <Forge webui folder> <models folder>

Writes ``<models>/Stable-diffusion/ovtest-forge-sdxl.safetensors`` and a random
``<models>/VAE-approx/vaeapprox-sdxl.pt`` (Forge's SDXL live previews would download the trained one).

Why Forge loads it as SDXL: huggingface_guess's ``SDXL`` fixes ``model_channels`` 320, linear ``proj_in``,
``context_dim`` 2048, ADM input 2816 and the input side's transformer depths ``[0, 0, 2, 2, 10, 10]`` (two residual
blocks on each of three levels); the channel multipliers, the output side's and the middle block's depths are
read from the shapes and may differ. So the UNet here has SDXL's input side at 320 channels on every level, one
transformer per output block and in the middle: 0.16 B parameters, not 2.6 B. CLIP-L, OpenCLIP-bigG (0.69 B
parameters: most of the file) and the VAE are built from Forge's fixed SDXL configs
(``backend/huggingface/stabilityai/stable-diffusion-xl-base-1.0``) and saved in the layout of SDXL's published
checkpoint (CLIP-L in transformers' names under ``conditioner.embedders.0``, bigG in OpenCLIP's under
``conditioner.embedders.1.model``), so Forge's own conversion of them runs. Checked with huggingface_guess.

Random weights are made non-degenerate as for SD 1.5 (``make_models.py``), and, as the real-WebUI tier's SDXL
recipe explains, each text encoder's position embedding is shifted so that its conditioning (a hidden state no
LayerNorm follows: Forge's SDXL skips to the penultimate layer) has a mean of 0.3, away from the 0 Forge's
emphasis divides by.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from make_models import fp16_state, non_degenerate, use_forge

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "real_webui"))
from vae_approx import write_vae_approx_sdxl  # noqa: E402 (after this folder's make_models: appended, not first)

CHECKPOINT = "ovtest-forge-sdxl.safetensors"
SEED = 3
SDXL_REPO = os.path.join("backend", "huggingface", "stabilityai", "stable-diffusion-xl-base-1.0")
UNET_CONFIG: dict[str, Any] = {
    "in_channels": 4,
    "out_channels": 4,
    "model_channels": 320,
    "channel_mult": [1, 1, 1],
    "num_res_blocks": [2, 2, 2],
    "transformer_depth": [0, 0, 2, 2, 10, 10],
    "transformer_depth_output": [0, 0, 0, 1, 1, 1, 1, 1, 1],
    "transformer_depth_middle": 1,
    "context_dim": 2048,
    "use_linear_in_transformer": True,
    "use_spatial_transformer": True,
    "adm_in_channels": 2816,
    "num_classes": "sequential",
    "num_heads": -1,
    "num_head_channels": 64,
}
CONDITIONING_MEAN = 0.3


def open_clip_layout(state: dict[str, Any], layers: int) -> dict[str, Any]:
    """A transformers ``CLIPTextModelWithProjection`` state dict in OpenCLIP's names (SDXL checkpoints' bigG)."""
    import torch

    out = {
        "token_embedding.weight": state["text_model.embeddings.token_embedding.weight"],
        "positional_embedding": state["text_model.embeddings.position_embedding.weight"],
        "ln_final.weight": state["text_model.final_layer_norm.weight"],
        "ln_final.bias": state["text_model.final_layer_norm.bias"],
        "text_projection": state["text_projection.weight"].t().contiguous(),
    }
    renames = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
               "self_attn.out_proj": "attn.out_proj"}
    for i in range(layers):
        theirs, ours = f"text_model.encoder.layers.{i}.", f"transformer.resblocks.{i}."
        for name, new in renames.items():
            for kind in ("weight", "bias"):
                out[f"{ours}{new}.{kind}"] = state[f"{theirs}{name}.{kind}"]
        for kind in ("weight", "bias"):
            out[f"{ours}attn.in_proj_{kind}"] = torch.cat(
                [state[f"{theirs}self_attn.{p}_proj.{kind}"] for p in ("q", "k", "v")])
    assert len(out) == len([k for k in state if not k.endswith("position_ids")]) - 4 * layers, "a tensor was lost"
    return out


def build(seed: int) -> dict[str, Any]:
    """The checkpoint's tensors (fp16, the layout of SDXL's published checkpoint)."""
    import torch
    import transformers
    from backend.nn.unet import IntegratedUNet2DConditionModel
    from backend.nn.vae import IntegratedAutoencoderKL

    torch.manual_seed(seed)
    unet = IntegratedUNet2DConditionModel(**UNET_CONFIG)
    clip_l = transformers.CLIPTextModel(
        transformers.CLIPTextConfig.from_pretrained(os.path.join(SDXL_REPO, "text_encoder")))
    clip_g = transformers.CLIPTextModelWithProjection(
        transformers.CLIPTextConfig.from_pretrained(os.path.join(SDXL_REPO, "text_encoder_2")))
    vae = IntegratedAutoencoderKL.from_config(IntegratedAutoencoderKL.load_config(os.path.join(SDXL_REPO, "vae")))
    tokenizers = [transformers.CLIPTokenizer.from_pretrained(os.path.join(SDXL_REPO, name))
                  for name in ("tokenizer", "tokenizer_2")]
    gen = torch.Generator().manual_seed(seed)
    prompts = ["", "a lighthouse", "(a red car:1.3)", "blurry"]
    with torch.no_grad():
        non_degenerate(unet, (clip_l, clip_g), gen)
        parts = []
        for encoder, tokenizer in zip((clip_l, clip_g), tokenizers):
            tokens = tokenizer(prompts, padding="max_length", max_length=77, return_tensors="pt").input_ids
            hidden = encoder(tokens, output_hidden_states=True).hidden_states[-2]  # Forge's SDXL: clip skip 2
            encoder.text_model.embeddings.position_embedding.weight.add_(CONDITIONING_MEAN - hidden.mean())
            parts.append(encoder(tokens, output_hidden_states=True).hidden_states[-2])
        crossattn = torch.cat(parts, dim=2)
        means = torch.stack([part.mean(dim=(1, 2)) for part in parts])
        y = torch.randn(2, UNET_CONFIG["adm_in_channels"], generator=gen)
        eps = unet(torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([500.0, 500.0]), context=crossattn[1:3], y=y)
        out = vae.decode(torch.randn(1, 4, 8, 8, generator=gen) / vae.scaling_factor)
        vae.decoder.conv_out.weight.mul_(0.5 / out.std())
        vae.decoder.conv_out.bias.zero_()
        image = ((vae.decode(torch.randn(1, 4, 8, 8, generator=gen) / vae.scaling_factor) + 1) / 2).clamp(0, 1)
    clipped = float(((image <= 0) | (image >= 1)).float().mean())
    assert crossattn.isfinite().all() and means.abs().min() > 0.02, f"conditioning means too close to 0: {means}"
    assert (crossattn[1] - crossattn[3]).abs().mean() > 0.01, "the conditioning does not depend on the prompt"
    assert eps.isfinite().all() and eps.std() > 0.05, f"UNet output std {eps.std()}"
    assert 0.05 < float(image.std()) and clipped < 0.5, f"decoded image std {image.std()}, clipped {clipped}"
    state = fp16_state({"model.diffusion_model.": unet.state_dict(),
                        "conditioner.embedders.0.transformer.": clip_l.state_dict(),
                        "conditioner.embedders.1.model.": open_clip_layout(clip_g.state_dict(), 32),
                        "first_stage_model.": vae.state_dict()})
    print(  # noqa: T201 (run by the test bed; its output is read on failure)
        f"SDXL seed {seed}: UNet {sum(p.numel() for p in unet.parameters()) / 1e6:.0f} M parameters, conditioning "
        f"means {[[round(float(m), 3) for m in row] for row in means]}, UNet eps std {float(eps.std()):.3f}, "
        f"image std {float(image.std()):.3f} ({clipped:.0%} clipped)"
    )
    return state


def check_guess(state: dict[str, Any]) -> None:
    """huggingface_guess (Forge's own family detection) takes the state dict for SDXL, with this UNet."""
    import huggingface_guess
    from huggingface_guess import model_list

    guess = huggingface_guess.guess(state)
    assert type(guess) is model_list.SDXL, f"huggingface_guess sees {type(guess).__name__}, not SDXL"
    found = {k: guess.unet_config.get(k) for k in UNET_CONFIG}
    assert found == UNET_CONFIG, f"huggingface_guess reads another UNet: {found}"


def main(webui: str, models: str) -> None:
    models = os.path.abspath(models)
    use_forge(os.path.abspath(webui))
    from safetensors.torch import save_file

    if not os.path.isfile(os.path.join(models, "VAE-approx", "vaeapprox-sdxl.pt")):
        write_vae_approx_sdxl(models)
    out = os.path.join(models, "Stable-diffusion", CHECKPOINT)
    if os.path.isfile(out):
        return
    os.makedirs(os.path.dirname(out), exist_ok=True)
    state = build(SEED)
    check_guess(state)
    save_file(state, out + ".part")
    os.replace(out + ".part", out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
