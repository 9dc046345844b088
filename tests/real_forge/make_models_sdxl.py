"""Builds the Forge tier's cheap SDXL base and refiner checkpoints with Forge's own model classes (``make_models.py``
does SD 1.5, ``make_models_sd2.py`` SD 2.x).

Run by the Forge test bed's Python, never by the project's venv. Usage::

    python make_models_sdxl.py <Forge webui folder> <models folder>

Writes ``<models>/Stable-diffusion/ovtest-forge-sdxl.safetensors``, ``ovtest-forge-sdxl-refiner.safetensors`` (the
refiner: OpenCLIP-bigG alone, as published, see :data:`REFINER_CONFIG`) and a random
``<models>/VAE-approx/vaeapprox-sdxl.pt`` (Forge's SDXL live previews would download the trained one). The refiner's
OpenCLIP-bigG is the base's, weight for weight, as in SDXL 1.0's published checkpoints (both froze the same
pretrained encoder).

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

from make_models import fp16_state, non_degenerate, scaled_vae, use_forge

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


def conditioning(encoders: list[Any], tokenizers: list[Any], gen: Any, shifted: tuple[Any, ...] = ()) -> Any:
    """Each encoder's position embedding (but those of the encoders in ``shifted``, done already) shifted so that its
    penultimate hidden state (what Forge's SDXL base and refiner condition on: clip skip 2, no final LayerNorm) has a
    mean of CONDITIONING_MEAN; the conditioning of four prompts (the encoders' states side by side), checked to be
    non-degenerate and to depend on the prompt."""
    import torch

    prompts = ["", "a lighthouse", "(a red car:1.3)", "blurry"]
    parts = []
    for encoder, tokenizer in zip(encoders, tokenizers):
        tokens = tokenizer(prompts, padding="max_length", max_length=77, return_tensors="pt").input_ids
        hidden = encoder(tokens, output_hidden_states=True).hidden_states[-2]
        if not any(encoder is done for done in shifted):
            encoder.text_model.embeddings.position_embedding.weight.add_(CONDITIONING_MEAN - hidden.mean())
        parts.append(encoder(tokens, output_hidden_states=True).hidden_states[-2])
    crossattn = torch.cat(parts, dim=2)
    means = torch.stack([part.mean(dim=(1, 2)) for part in parts])
    assert crossattn.isfinite().all() and means.abs().min() > 0.02, f"conditioning means too close to 0: {means}"
    assert (crossattn[1] - crossattn[3]).abs().mean() > 0.01, "the conditioning does not depend on the prompt"
    return crossattn


def build(seed: int, config: dict[str, Any], repo: str, encoders: dict[str, tuple[str, str]],
          built: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's tensors (fp16, the layout of SDXL's published base or refiner checkpoint): a UNet of
    ``config``, the text ``encoders`` ({``clip_l`` or ``clip_g``: its model's and its tokenizer's folder in ``repo``})
    and the VAE of Forge's fixed config ``repo``. An encoder already in ``built`` (kind: model) is that one, as the
    published refiner's OpenCLIP-bigG is the base's; each new one is added to ``built``."""
    import torch
    import transformers
    from backend.nn.unet import IntegratedUNet2DConditionModel
    from backend.nn.vae import IntegratedAutoencoderKL

    torch.manual_seed(seed)
    unet = IntegratedUNet2DConditionModel(**config)
    models, tokenizers = [], []
    for kind, names in encoders.items():
        folder, tokenizer = (os.path.join(repo, name) for name in names)
        model = transformers.CLIPTextModel if kind == "clip_l" else transformers.CLIPTextModelWithProjection
        models.append(built[kind] if kind in built else model(transformers.CLIPTextConfig.from_pretrained(folder)))
        tokenizers.append(transformers.CLIPTokenizer.from_pretrained(tokenizer))
    shifted = tuple(built.values())
    built.update(zip(encoders, models))
    vae = IntegratedAutoencoderKL.from_config(IntegratedAutoencoderKL.load_config(os.path.join(repo, "vae")))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        non_degenerate(unet, tuple(models), gen)
        crossattn = conditioning(models, tokenizers, gen, shifted)
        y = torch.randn(2, config["adm_in_channels"], generator=gen)
        eps = unet(torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([500.0, 500.0]), context=crossattn[1:3], y=y)
        image_std = scaled_vae(vae, gen)
    assert eps.isfinite().all() and eps.std() > 0.05, f"UNet output std {eps.std()}"
    parts = {"model.diffusion_model.": unet.state_dict(), "first_stage_model.": vae.state_dict()}
    for i, (kind, model) in enumerate(zip(encoders, models)):
        if kind == "clip_l":
            parts[f"conditioner.embedders.{i}.transformer."] = model.state_dict()
        else:
            parts[f"conditioner.embedders.{i}.model."] = open_clip_layout(model.state_dict(), 32)
    print(  # noqa: T201 (run by the test bed; its output is read on failure)
        f"{'+'.join(encoders)} seed {seed}: UNet {sum(p.numel() for p in unet.parameters()) / 1e6:.0f} M parameters, "
        f"UNet eps std {float(eps.std()):.3f}, image std {image_std:.3f}"
    )
    return fp16_state(parts)


REFINER = "ovtest-forge-sdxl-refiner.safetensors"
REFINER_SEED = 4
REFINER_REPO = os.path.join("backend", "huggingface", "stabilityai", "stable-diffusion-xl-refiner-1.0")
#: huggingface_guess's ``SDXLRefiner`` fixes ``model_channels`` 384, linear ``proj_in``, ``context_dim`` 1280, ADM input
#: 2560 and the input side's transformer depths ``[0, 0, 4, 4, 4, 4, 0, 0]`` (four levels of two residual blocks);
#: the rest is read from the shapes: 384 channels on every level, one transformer per output block of the two middle
#: levels and in the middle block here (0.13 B parameters, not 2.3 B).
REFINER_CONFIG: dict[str, Any] = {
    "in_channels": 4,
    "out_channels": 4,
    "model_channels": 384,
    "channel_mult": [1, 1, 1, 1],
    "num_res_blocks": [2, 2, 2, 2],
    "transformer_depth": [0, 0, 4, 4, 4, 4, 0, 0],
    "transformer_depth_output": [0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0],
    "transformer_depth_middle": 1,
    "context_dim": 1280,
    "use_linear_in_transformer": True,
    "use_spatial_transformer": True,
    "adm_in_channels": 2560,
    "num_classes": "sequential",
    "num_heads": -1,
    "num_head_channels": 64,
}
#: file name: (seed, UNet, Forge's fixed config folder, text encoders with their model's and tokenizer's folders, the
#: huggingface_guess class it must be taken for)
CHECKPOINTS: dict[str, tuple[int, dict[str, Any], str, dict[str, tuple[str, str]], str]] = {
    CHECKPOINT: (SEED, UNET_CONFIG, SDXL_REPO,
                 {"clip_l": ("text_encoder", "tokenizer"), "clip_g": ("text_encoder_2", "tokenizer_2")}, "SDXL"),
    REFINER: (REFINER_SEED, REFINER_CONFIG, REFINER_REPO, {"clip_g": ("text_encoder", "tokenizer")}, "SDXLRefiner"),
}


def check_guess(state: dict[str, Any], family: str, config: dict[str, Any]) -> None:
    """huggingface_guess (Forge's own family detection) takes the state dict for ``family``, with this UNet."""
    import huggingface_guess

    guess = huggingface_guess.guess(state)
    assert type(guess).__name__ == family, f"huggingface_guess sees {type(guess).__name__}, not {family}"
    found = {k: guess.unet_config.get(k) for k in config}
    assert found == config, f"huggingface_guess reads another UNet: {found}"


def main(webui: str, models: str) -> None:
    models = os.path.abspath(models)
    use_forge(os.path.abspath(webui))
    from safetensors.torch import save_file

    if not os.path.isfile(os.path.join(models, "VAE-approx", "vaeapprox-sdxl.pt")):
        write_vae_approx_sdxl(models)
    outs = [os.path.join(models, "Stable-diffusion", name) for name in CHECKPOINTS]
    if all(os.path.isfile(out) for out in outs):
        return
    built: dict[str, Any] = {}  # (both are made again: the refiner's bigG is the base's)
    for out, (seed, config, repo, encoders, family) in zip(outs, CHECKPOINTS.values()):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        state = build(seed, config, repo, encoders, built)
        check_guess(state, family, config)
        save_file(state, out + ".part")
        os.replace(out + ".part", out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
