"""Builds the real-host tier's tiny SD-1.5-shaped checkpoints, their LDM configs and LoRAs of each kind.

Run by the test bed's Python (the WebUI's venv, with the WebUI's ``repositories/`` importable), never
by the project's own venv: the checkpoints are made by instantiating LDM's own classes from a small
LDM config, so the WebUI loads them with its own code through the ``<name>.yaml`` placed beside each
checkpoint (A1111 reads a config found there instead of guessing one from the weights).

Usage: ``python make_models.py <webui folder> <data dir> <HF snapshot of CLIP-L's tokenizer>``.
Writes into ``<data dir>/models``: ``Stable-diffusion/ovtest-tiny-{a,b}.{safetensors,yaml}``,
``Lora/ovtest-{lora,locon,loha,lokr}.safetensors``, the tiny CLIP text model's folder ``ovtest-clip/`` and a
random TAESD decoder, ``VAE-taesd/taesd_decoder.pth`` (the WebUI would download the trained one on first use of
Settings -> VAE -> TAESD; offline it must be there). Then ``make_models_sdxl_sd2.py`` (beside this file) adds the
tiny SDXL base and refiner, SD 2.x v-prediction checkpoint, SDXL LoRA and SDXL approximate VAE.

Random weights are made non-degenerate the way a trained model is: LDM zero-initialises every
ResBlock's last conv and every transformer's output projection (the UNet would return 0 whatever the
prompt), and a fresh CLIP ends in a LayerNorm of weight 1, bias 0 (conditioning mean ~1e-9, which
A1111's emphasis step divides by). Both are re-initialised, and the result is checked
(:func:`random_ldm_model`, which ``.ci/build_testbed.py`` also uses for the bench's full-size SD 1.5
checkpoints). Importing this file runs nothing: the LDM code is imported once :func:`use_webui_ldm` has
put the WebUI's copy on ``sys.path``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

CLIP_CONFIG = {
    "model_type": "clip_text_model",
    "architectures": ["CLIPTextModel"],
    "vocab_size": 49408,
    "hidden_size": 64,
    "intermediate_size": 256,
    "projection_dim": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-05,
    "attention_dropout": 0.0,
    "dropout": 0.0,
    "initializer_range": 0.02,
    "initializer_factor": 1.0,
    "bos_token_id": 49406,
    "eos_token_id": 49407,
    "pad_token_id": 1,
    "torch_dtype": "float32",
    "transformers_version": "4.30.2",
}


def use_webui_ldm(webui: str) -> None:
    """Make the WebUI's LDM code importable as the WebUI does: its stable-diffusion repository first on
    ``sys.path``, and ``pytorch_lightning.utilities.distributed`` (which LDM imports, gone from the
    WebUI's pytorch_lightning) as ``rank_zero``."""
    sys.path[:0] = [os.path.join(webui, "repositories", "stable-diffusion-stability-ai")]
    import pytorch_lightning.utilities.rank_zero

    sys.modules.setdefault("pytorch_lightning.utilities.distributed", pytorch_lightning.utilities.rank_zero)


def random_ldm_model(model_config: Any, seed: int) -> tuple[Any, Any]:
    """An LDM ``LatentDiffusion`` of random weights for ``model_config`` (the ``model`` node of an LDM
    config), made non-degenerate and checked; returns it with the generator that drew its text encoder's
    LayerNorm affines (its next draws are the caller's). Needs :func:`use_webui_ldm` first.

    LDM zero-initialises the last conv of every UNet ResBlock and each transformer's output projection
    (the UNet would return 0 whatever the prompt): those get PyTorch's default init. A fresh CLIP text
    encoder ends in LayerNorms of weight 1 and bias 0 (the conditioning's mean is ~1e-9, which A1111's
    emphasis divides by: NaN): they get a random affine. The order of random draws is fixed, so a seed
    always gives the same weights."""
    import torch
    import transformers
    from ldm.util import instantiate_from_config

    # No weights exist offline: the CLIP text model is built from its config (random init).
    transformers.CLIPTextModel.from_pretrained = classmethod(
        lambda cls, name, *a, **k: cls(transformers.CLIPTextConfig.from_pretrained(name))
    )
    torch.manual_seed(seed)
    model = instantiate_from_config(model_config)
    unet = model.model.diffusion_model
    projections = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Linear)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in unet.modules():
            if isinstance(m, projections) and not m.weight.any():
                m.reset_parameters()
        encoder = model.cond_stage_model
        encoder.device = "cpu"
        for m in encoder.transformer.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=gen))
                m.bias.copy_(0.1 + 0.1 * torch.randn(m.bias.shape, generator=gen))
        z = model.get_learned_conditioning(["", "a lighthouse", "(a red car:1.3)", "blurry"])
        means = z.mean(dim=(1, 2))
        eps = unet(torch.randn(2, 4, 8, 8), torch.tensor([500, 500]), z[1:3])
    assert means.abs().min() > 0.02 and z.isfinite().all(), f"conditioning means too close to 0: {means}"
    assert eps.isfinite().all() and eps.std() > 0.05, f"UNet output std {eps.std()}"
    assert not any(isinstance(m, projections) and not m.weight.any() for m in unet.modules())
    print(  # noqa: T201 (run by the test bed; its output is read on failure)
        f"seed {seed}: conditioning means {[round(float(m), 3) for m in means]}, UNet eps std {float(eps.std()):.3f}"
    )
    return model, gen


def ldm_config(webui: str, clip_dir: str) -> dict:
    """SD 1.5's layout (LDM classes, crossattn conditioning, 8x VAE) at a few thousandths of its size."""
    from omegaconf import OmegaConf

    base = OmegaConf.to_container(OmegaConf.load(os.path.join(webui, "configs", "v1-inference.yaml")))
    params = base["model"]["params"]
    params["unet_config"]["params"].update(
        model_channels=32,
        attention_resolutions=[1, 2],
        num_res_blocks=1,
        channel_mult=[1, 2],
        num_heads=2,
        context_dim=CLIP_CONFIG["hidden_size"],
    )
    params["first_stage_config"]["params"]["ddconfig"].update(ch=32, ch_mult=[1, 1, 1, 1], num_res_blocks=1)
    params["cond_stage_config"]["params"] = {"version": clip_dir}
    return base


def write_clip_folder(clip_dir: str, clip_snapshot: str) -> None:
    os.makedirs(clip_dir, exist_ok=True)
    for name in ("vocab.json", "merges.txt", "special_tokens_map.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(clip_snapshot, name), os.path.join(clip_dir, name))
    with open(os.path.join(clip_dir, "config.json"), "w") as f:
        json.dump(CLIP_CONFIG, f, indent=2)


def build(seed: int, config: dict) -> tuple[dict[str, Any], Any]:
    """A tiny checkpoint's tensors and its model: :func:`random_ldm_model`, then the VAE decoder scaled."""
    import torch
    from omegaconf import OmegaConf

    model, gen = random_ldm_model(OmegaConf.create(config)["model"], seed)
    with torch.no_grad():
        # Scale the decoder's last conv so a typical latent decodes to mid-range pixels (not all clipped).
        vae = model.first_stage_model
        out = vae.decode(torch.randn(1, 4, 8, 8, generator=gen) / model.scale_factor)
        vae.decoder.conv_out.weight.mul_(0.5 / out.std())
        vae.decoder.conv_out.bias.zero_()
        image = ((vae.decode(torch.randn(1, 4, 8, 8, generator=gen) / model.scale_factor) + 1) / 2).clamp(0, 1)
    clipped = float(((image <= 0) | (image >= 1)).float().mean())
    assert 0.05 < float(image.std()) and clipped < 0.5, f"decoded image std {image.std()}, clipped {clipped}"
    print(f"seed {seed}: image std {float(image.std()):.3f} ({clipped:.0%} clipped)")  # noqa: T201
    return {k: v.contiguous() for k, v in model.state_dict().items()}, model


def _lora_layers(model: Any, convolutions: bool = False) -> list[tuple[str, Any]]:
    """(kohya name, module) of every attention projection of the UNet and every projection of the text
    encoder (and with ``convolutions``, every convolution of the UNet's residual blocks), named as A1111's
    Lora extension looks them up."""
    import torch

    names = [
        (f"lora_unet_{n.replace('.', '_')}", m)
        for n, m in model.model.diffusion_model.named_modules()
        if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in ("to_q", "to_k", "to_v") or n.endswith("to_out.0")
        or convolutions and isinstance(m, torch.nn.Conv2d) and (n.endswith("in_layers.2") or n.endswith("out_layers.3"))
    ]
    names += [
        (f"lora_te_{n.replace('.', '_')}", m)
        for n, m in model.cond_stage_model.transformer.named_modules()
        if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "out_proj")
    ]
    return names


def save_lora(tensors: dict[str, Any], models: str, name: str, layers: int) -> None:
    from safetensors.torch import save_file

    os.makedirs(os.path.join(models, "Lora"), exist_ok=True)
    save_file(tensors, os.path.join(models, "Lora", f"{name}.safetensors"))
    print(f"{name}: {layers} layers")  # noqa: T201


def write_lora(model: Any, models: str) -> None:
    """A rank-4 kohya LoRA (``ovtest-lora``) on the layers of :func:`_lora_layers`."""
    import torch

    gen = torch.Generator().manual_seed(7)
    tensors: dict[str, torch.Tensor] = {}
    names = _lora_layers(model)
    rank = 4
    for key, m in names:
        down = torch.randn(rank, m.in_features, generator=gen) / m.in_features**0.5
        up = torch.randn(m.out_features, rank, generator=gen) * (0.6 * float(m.weight.std()))
        tensors[f"{key}.lora_down.weight"] = down
        tensors[f"{key}.lora_up.weight"] = up
        tensors[f"{key}.alpha"] = torch.tensor(float(rank))
    save_lora(tensors, models, "ovtest-lora", len(names))


def write_lora_kinds(model: Any, models: str) -> None:
    """The other kinds A1111's Lora extension loads, each of which changes a weight by ``0.6 * its std`` per
    element, give or take: ``ovtest-locon`` (kohya LoRA on the residual blocks' 3x3 and 1x1 convolutions too),
    ``ovtest-loha`` (LyCORIS LoHa: the elementwise product of two rank-4 products) and ``ovtest-lokr`` (LyCORIS
    LoKr: the Kronecker product of a 4x4 matrix and a full one)."""
    import torch

    rank = 4
    gen = torch.Generator().manual_seed(11)
    locon: dict[str, torch.Tensor] = {}
    layers = _lora_layers(model, convolutions=True)
    for key, m in layers:
        scale = 0.6 * float(m.weight.std())
        if isinstance(m, torch.nn.Conv2d):
            fan_in = m.in_channels * m.kernel_size[0] * m.kernel_size[1]
            down = torch.randn(rank, m.in_channels, *m.kernel_size, generator=gen)
            locon[f"{key}.lora_down.weight"] = down / fan_in**0.5
            locon[f"{key}.lora_up.weight"] = torch.randn(m.out_channels, rank, 1, 1, generator=gen) * scale
        else:
            locon[f"{key}.lora_down.weight"] = torch.randn(rank, m.in_features, generator=gen) / m.in_features**0.5
            locon[f"{key}.lora_up.weight"] = torch.randn(m.out_features, rank, generator=gen) * scale
        locon[f"{key}.alpha"] = torch.tensor(float(rank))
    save_lora(locon, models, "ovtest-locon", len(layers))

    gen = torch.Generator().manual_seed(12)
    loha: dict[str, torch.Tensor] = {}
    layers = _lora_layers(model)
    for key, m in layers:
        for i, scale in ((1, 0.6 * float(m.weight.std())), (2, 1.0)):
            loha[f"{key}.hada_w{i}_a"] = torch.randn(m.out_features, rank, generator=gen) * scale
            loha[f"{key}.hada_w{i}_b"] = torch.randn(rank, m.in_features, generator=gen) / rank**0.5
        loha[f"{key}.alpha"] = torch.tensor(float(rank))
    save_lora(loha, models, "ovtest-loha", len(layers))

    gen = torch.Generator().manual_seed(13)
    lokr: dict[str, torch.Tensor] = {}
    for key, m in layers:
        assert m.out_features % 4 == 0 and m.in_features % 4 == 0, (key, m)
        lokr[f"{key}.lokr_w1"] = torch.randn(4, 4, generator=gen)
        lokr[f"{key}.lokr_w2"] = torch.randn(m.out_features // 4, m.in_features // 4, generator=gen) * (
            0.6 * float(m.weight.std()))
    save_lora(lokr, models, "ovtest-lokr", len(layers))


def write_taesd_decoder(models: str) -> None:
    """A TAESD decoder of random weights, in the layout the WebUI's ``sd_vae_taesd.decoder()`` loads: a
    ``Sequential`` of 3x3 convs and residual blocks (three convs each) with three 2x upsamplings; only the
    modules with weights are built, at their indices. Its last conv is scaled so that the picture is not
    flat (at PyTorch's default init the output's spread is about 0.01 around 0, a black image)."""
    import torch

    def block() -> torch.nn.Module:
        body = torch.nn.Sequential(*(torch.nn.Conv2d(64, 64, 3, padding=1) if i % 2 == 0 else torch.nn.ReLU()
                                     for i in range(5)))
        return torch.nn.ModuleDict({"conv": body})

    torch.manual_seed(5)
    layers: dict[str, torch.nn.Module] = {"1": torch.nn.Conv2d(4, 64, 3, padding=1)}
    for start in (3, 8, 13):
        layers.update({str(start + i): block() for i in range(3)})
        layers[str(start + 4)] = torch.nn.Conv2d(64, 64, 3, padding=1, bias=False)
    layers["18"], layers["19"] = block(), torch.nn.Conv2d(64, 3, 3, padding=1)
    with torch.no_grad():
        layers["19"].weight.mul_(25.0)
        layers["19"].bias.fill_(0.5)
    state = {f"{index}.{key}": value for index, layer in layers.items() for key, value in layer.state_dict().items()}
    folder = os.path.join(models, "VAE-taesd")
    os.makedirs(folder, exist_ok=True)
    # the legacy format: the WebUI's safe unpickler refuses the newer zip entries (.format_version, ...)
    torch.save(state, os.path.join(folder, "taesd_decoder.pth"), _use_new_zipfile_serialization=False)


def main(webui: str, data_dir: str, clip_snapshot: str) -> None:
    from omegaconf import OmegaConf
    from safetensors.torch import save_file

    use_webui_ldm(webui)
    models = os.path.join(data_dir, "models")
    clip_dir = os.path.join(models, "ovtest-clip")
    write_clip_folder(clip_dir, clip_snapshot)
    write_taesd_decoder(models)
    config = ldm_config(webui, clip_dir)
    folder = os.path.join(models, "Stable-diffusion")
    os.makedirs(folder, exist_ok=True)
    for name, seed in (("ovtest-tiny-a", 1), ("ovtest-tiny-b", 2)):
        state, model = build(seed, config)
        with open(os.path.join(folder, name + ".yaml"), "w") as f:
            f.write(OmegaConf.to_yaml(OmegaConf.create(config)))
        save_file(state, os.path.join(folder, name + ".safetensors.part"))
        os.replace(os.path.join(folder, name + ".safetensors.part"), os.path.join(folder, name + ".safetensors"))
        if seed == 1:
            write_lora(model, models)
            write_lora_kinds(model, models)
    import make_models_sdxl_sd2  # beside this file, which runs as a script

    make_models_sdxl_sd2.main(webui, models, clip_dir)


if __name__ == "__main__":
    main(*sys.argv[1:4])
