"""Builds the Forge tier's cheap SD 1.5 checkpoints and their LoRA with Forge's own model classes.

Run by the Forge test bed's Python (``.ci/forge_testbed.py`` does, with Forge's folder as the working
directory), never by the project's venv. Usage::

    python make_models.py <Forge webui folder> <models folder>

Writes ``<models>/Stable-diffusion/ovtest-forge-sd15-{a,b}.safetensors`` and
``<models>/Lora/ovtest-forge-lora.safetensors``.

Why these load in Forge: Forge does not read a config beside a checkpoint. It picks the model family with
huggingface_guess from the state dict's keys and shapes (``SD15``: ``context_dim`` 768, ``model_channels``
320, convolutional ``proj_in``, no ADM input), builds the UNet from the shapes it found (levels, residual
blocks and transformer depths are read from the keys, so they may be fewer than SD 1.5's), and builds
CLIP-L and the VAE from its fixed configs in ``backend/huggingface/runwayml/stable-diffusion-v1-5``. So
the text encoder and the VAE here are full-size (123 M and 84 M parameters); the UNet keeps what the guess
fixes (320 channels, 768-wide context, 8 heads) and has two levels of 320 channels, one residual block per level
and one transformer per attention: 44 M parameters, a twentieth of SD 1.5's UNet, with SD 1.5's kinds of
layers (a downsampler, an upsampler, skip connections that change the channel count). Each checkpoint is
checked with huggingface_guess itself (the call Forge makes).

Random weights are made non-degenerate as ``tests/real_webui/make_models.py`` explains: any all-zero
projection (LDM/ComfyUI zero-initialise ResBlock output convs and transformer output projections; Forge's
classes do not, but a future version might) gets PyTorch's default init, CLIP's LayerNorms get a random
affine (a fresh CLIP ends in weight 1, bias 0: conditioning mean ~1e-9, which Forge's "original" emphasis
divides by), and the VAE decoder's last conv is scaled so that a typical latent decodes to mid-range pixels.
A seed always gives the same files.
"""

from __future__ import annotations

import os
import sys
from typing import Any

CHECKPOINTS = {"ovtest-forge-sd15-a.safetensors": 1, "ovtest-forge-sd15-b.safetensors": 2}
LORA = "ovtest-forge-lora.safetensors"
LORA_SEED = 7
LORA_RANK = 4
LORA_CHANGE = 0.5  # the spread of the LoRA's change of a weight, relative to the weight's own
SD15_REPO = os.path.join("backend", "huggingface", "runwayml", "stable-diffusion-v1-5")
# What huggingface_guess's detect_unet_config reads from the shapes (SD 1.5: channel_mult [1, 2, 4, 4],
# num_res_blocks [2] * 4, transformer_depth [1, 1, 1, 1, 1, 1, 0, 0]), plus SD15's unet_extra_config.
UNET_CONFIG: dict[str, Any] = {
    "in_channels": 4,
    "out_channels": 4,
    "model_channels": 320,
    "channel_mult": [1, 1],
    "num_res_blocks": [1, 1],
    "transformer_depth": [1, 1],
    "transformer_depth_output": [1, 1, 1, 1],
    "transformer_depth_middle": 1,
    "context_dim": 768,
    "use_linear_in_transformer": False,
    "use_spatial_transformer": True,
    "adm_in_channels": None,
    "num_heads": 8,
    "num_head_channels": -1,
}


def use_forge(webui: str) -> None:
    """Forge's own import set-up: its folder first on ``sys.path``, ``modules.paths`` adding
    ``repositories/huggingface_guess`` and ``packages_3rdparty``, and ``--always-cpu`` for ``backend.args``
    (``backend.memory_management`` picks the device at import)."""
    os.chdir(webui)
    sys.path.insert(0, webui)
    sys.argv[1:] = ["--always-cpu"]
    import modules.paths  # noqa: F401


def diffusers_attention_names(config: dict[str, Any]) -> dict[str, str]:
    """{LDM prefix of a transformer (``input_blocks.1.1``): its diffusers name (``down_blocks.0.attentions.0``)}
    for a UNet of ``config``, worked out from the LDM layout (input block 0 is the first conv, each level's
    residual blocks follow, then a downsampler; each output level has one block more), not read from Forge."""
    names = {"middle_block.1": "mid_block.attentions.0"}
    block = 1
    depths = iter(config["transformer_depth"])
    for level, count in enumerate(config["num_res_blocks"]):
        for i in range(count):
            if next(depths):
                names[f"input_blocks.{block}.1"] = f"down_blocks.{level}.attentions.{i}"
            block += 1
        block += 1  # the downsampler (none after the last level; the count stops there anyway)
    block = 0
    depths_out = iter(config["transformer_depth_output"])
    for up_level, count in enumerate(reversed(config["num_res_blocks"])):
        for i in range(count + 1):
            if next(depths_out):
                names[f"output_blocks.{block}.1"] = f"up_blocks.{up_level}.attentions.{i}"
            block += 1
    return names


def non_degenerate(unet: Any, encoders: tuple[Any, ...], gen: Any) -> None:
    """Any all-zero projection of ``unet`` gets PyTorch's default init; every LayerNorm of the text ``encoders``
    a random affine (weight 1 + 0.1 N, bias 0.1 + 0.1 N, drawn from ``gen`` in module order)."""
    import torch

    projections = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Linear)
    with torch.no_grad():
        for m in unet.modules():
            if isinstance(m, projections) and not m.weight.any():
                m.reset_parameters()
        for encoder in encoders:
            for m in encoder.modules():
                if isinstance(m, torch.nn.LayerNorm):
                    m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=gen))
                    m.bias.copy_(0.1 + 0.1 * torch.randn(m.bias.shape, generator=gen))


def fp16_state(parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """{prefix: a module's state dict} as one checkpoint's tensors: prefixed, floating point ones in fp16,
    transformers' ``position_ids`` buffers left out (published checkpoints vary; Forge ignores them)."""
    return {prefix + key: (value.half() if value.is_floating_point() else value).contiguous()
            for prefix, state in parts.items() for key, value in state.items() if not key.endswith("position_ids")}


def scaled_vae(vae: Any, gen: Any) -> float:
    """The VAE decoder's last conv scaled so that a typical latent decodes to mid-range pixels; the decoded picture's
    spread, checked (not flat, mostly not clipped)."""
    import torch

    out = vae.decode(torch.randn(1, 4, 8, 8, generator=gen) / vae.scaling_factor)
    vae.decoder.conv_out.weight.mul_(0.5 / out.std())
    vae.decoder.conv_out.bias.zero_()
    image = ((vae.decode(torch.randn(1, 4, 8, 8, generator=gen) / vae.scaling_factor) + 1) / 2).clamp(0, 1)
    clipped = float(((image <= 0) | (image >= 1)).float().mean())
    assert 0.05 < float(image.std()) and clipped < 0.5, f"decoded image std {image.std()}, clipped {clipped}"
    return float(image.std())


def build(seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One checkpoint's tensors (fp16, LDM layout) and its modules (``unet``, ``clip``, ``vae``)."""
    import torch
    import transformers
    from backend.nn.unet import IntegratedUNet2DConditionModel
    from backend.nn.vae import IntegratedAutoencoderKL

    torch.manual_seed(seed)
    unet = IntegratedUNet2DConditionModel(**UNET_CONFIG)
    clip_config = transformers.CLIPTextConfig.from_pretrained(os.path.join(SD15_REPO, "text_encoder"))
    clip = transformers.CLIPTextModel(clip_config)
    vae = IntegratedAutoencoderKL.from_config(IntegratedAutoencoderKL.load_config(os.path.join(SD15_REPO, "vae")))
    tokenizer = transformers.CLIPTokenizer.from_pretrained(os.path.join(SD15_REPO, "tokenizer"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        non_degenerate(unet, (clip,), gen)
        prompts = ["", "a lighthouse", "(a red car:1.3)", "blurry"]
        tokens = tokenizer(prompts, padding="max_length", max_length=77, return_tensors="pt").input_ids
        z = clip(tokens).last_hidden_state
        means = z.mean(dim=(1, 2))
        x = torch.randn(2, 4, 8, 8, generator=gen)
        eps = unet(x, torch.tensor([500.0, 500.0]), context=z[1:3])
        image_std = scaled_vae(vae, gen)
    assert means.abs().min() > 0.02 and z.isfinite().all(), f"conditioning means too close to 0: {means}"
    assert eps.isfinite().all() and eps.std() > 0.05, f"UNet output std {eps.std()}"
    assert (eps[0] - eps[1]).abs().mean() > 0.01 * eps.abs().mean(), "the UNet's output ignores the prompt"
    state = fp16_state({"model.diffusion_model.": unet.state_dict(), "cond_stage_model.transformer.": clip.state_dict(),
                        "first_stage_model.": vae.state_dict()})
    unet_params = sum(p.numel() for p in unet.parameters())
    print(  # noqa: T201 (run by the test bed; its output is read on failure)
        f"seed {seed}: UNet {unet_params / 1e6:.1f} M parameters, conditioning means "
        f"{[round(float(m), 3) for m in means]}, UNet eps std {float(eps.std()):.3f}, "
        f"image std {image_std:.3f}"
    )
    return state, {"unet": unet, "clip": clip, "vae": vae}


def check_guess(state: dict[str, Any]) -> None:
    """huggingface_guess (Forge's own family detection) takes the state dict for SD 1.5, with this UNet."""
    import huggingface_guess
    from huggingface_guess import model_list

    guess = huggingface_guess.guess(state)
    assert type(guess) is model_list.SD15, f"huggingface_guess sees {type(guess).__name__}, not SD15"
    found = {k: guess.unet_config.get(k) for k in UNET_CONFIG}
    assert found == UNET_CONFIG, f"huggingface_guess reads another UNet: {found}"


def write_lora(modules: dict[str, Any], models: str) -> None:
    """A rank-4 kohya LoRA on every attention projection of the UNet (diffusers-style names, as kohya's
    trainer writes them: ``lora_unet_down_blocks_0_attentions_0_..._to_q``) and of the text encoder
    (``lora_te_text_model_encoder_layers_0_self_attn_q_proj``). Each changes every element of its weight by about
    ``LORA_CHANGE`` of the weight's own spread."""
    import torch
    from safetensors.torch import save_file

    renames = diffusers_attention_names(UNET_CONFIG)
    layers = []
    for name, m in modules["unet"].named_modules():
        if isinstance(m, torch.nn.Linear) and name.endswith((".to_q", ".to_k", ".to_v", ".to_out.0")):
            prefix = next(p for p in renames if name.startswith(p + "."))
            layers.append(("lora_unet_" + (renames[prefix] + name[len(prefix):]).replace(".", "_"), m))
    for name, m in modules["clip"].named_modules():
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "out_proj"):
            layers.append(("lora_te_" + name.replace(".", "_"), m))
    gen = torch.Generator().manual_seed(LORA_SEED)
    tensors = {}
    for key, m in layers:
        # each element of up @ down (alpha = rank: scale 1) has spread LORA_CHANGE * the weight's own
        tensors[f"{key}.lora_down.weight"] = torch.randn(LORA_RANK, m.in_features, generator=gen) / m.in_features**0.5
        tensors[f"{key}.lora_up.weight"] = torch.randn(m.out_features, LORA_RANK, generator=gen) * (
            LORA_CHANGE * float(m.weight.detach().std()) * (m.in_features / LORA_RANK) ** 0.5)
        tensors[f"{key}.alpha"] = torch.tensor(float(LORA_RANK))
    os.makedirs(os.path.join(models, "Lora"), exist_ok=True)
    out = os.path.join(models, "Lora", LORA)
    save_file({k: v.half().contiguous() for k, v in tensors.items()}, out + ".part")
    os.replace(out + ".part", out)
    unet_layers = sum(key.startswith("lora_unet_") for key, _ in layers)
    print(f"{LORA}: {unet_layers} UNet and {len(layers) - unet_layers} text encoder layers")  # noqa: T201


def main(webui: str, models: str) -> None:
    models = os.path.abspath(models)
    use_forge(os.path.abspath(webui))
    from safetensors.torch import save_file

    folder = os.path.join(models, "Stable-diffusion")
    os.makedirs(folder, exist_ok=True)
    for name, seed in CHECKPOINTS.items():
        out = os.path.join(folder, name)
        if os.path.isfile(out) and (seed != 1 or os.path.isfile(os.path.join(models, "Lora", LORA))):
            continue
        state, modules = build(seed)
        check_guess(state)
        save_file(state, out + ".part")
        os.replace(out + ".part", out)
        if seed == 1:
            write_lora(modules, models)


if __name__ == "__main__":
    main(*sys.argv[1:3])
