"""Builds the real-host tier's tiny SDXL base, SDXL refiner and SD 2.x v-prediction checkpoints, an SDXL LoRA and
the approximate VAE of SDXL's live previews.

Run by :func:`make_models.main` in the test bed's Python. As for the SD 1.5-shaped models, each checkpoint is
made by the WebUI's own classes (sgm's ``DiffusionEngine`` and ``GeneralConditioner``, LDM's
``LatentDiffusion``) from a shrunken copy of the config the WebUI itself would pick (sgm's
``configs/inference/sd_xl_base.yaml`` and ``sd_xl_refiner.yaml``, LDM's ``v2-inference-v.yaml``), written beside
the checkpoint as ``<name>.yaml``. Each keeps its architecture's kinds: SDXL base has a CLIP-L-like
``FrozenCLIPEmbedder`` (the tier's tiny CLIP, ``ovtest-clip/``) and an OpenCLIP ``FrozenOpenCLIPEmbedder2``,
the refiner the OpenCLIP one only (with the aesthetic score), SD 2.x an OpenCLIP ``FrozenOpenCLIPEmbedder``
and ``parameterization: "v"``. A small open_clip architecture, ``ovtest-open-clip-tiny`` (in
``ovtest-open-clip/model_configs/``), stands in for OpenCLIP-bigG and -H: the tier's extension
``ovtest-open-clip`` registers it in the WebUI as this script registers it here, and open_clip builds it
offline (no pretrained weights are asked for; the WebUI loads the checkpoint's).

Writes into ``<data dir>/models``: ``Stable-diffusion/ovtest-{sdxl-base,sdxl-refiner,sd2-v}.{safetensors,yaml}``,
``Lora/ovtest-sdxl-lora.safetensors`` and ``VAE-approx/vaeapprox-sdxl.pt`` (a random one of the layout of
the WebUI's ``sd_vae_approx.VAEApprox``: without it an SDXL live preview would download the trained one).
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import make_models
from vae_approx import write_vae_approx_sdxl

OPEN_CLIP_CONFIGS = Path(__file__).resolve().with_name("ovtest-open-clip") / "model_configs"
OPEN_CLIP_ARCH = "ovtest-open-clip-tiny"
OPEN_CLIP_WIDTH = 64  # text_cfg.width of OPEN_CLIP_ARCH
OPEN_CLIP_EMBED_DIM = 64  # its embed_dim: the pooled output's size
VECTOR_OUTDIM = 32  # each ConcatTimestepEmbedderND's outdim (256 in the WebUI's configs)
PROMPTS = ["", "a lighthouse", "(a red car:1.3)", "blurry"]


def use_webui_sgm(webui: str) -> None:
    """After :func:`make_models.use_webui_ldm`: sgm importable (the WebUI's generative-models repository) and the
    tiny open_clip architecture registered."""
    sys.path.append(os.path.join(webui, "repositories", "generative-models"))
    import open_clip

    open_clip.add_model_config(OPEN_CLIP_CONFIGS)


def _load(path: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path))


def _shrink_vae(first_stage: dict) -> None:
    first_stage["params"]["ddconfig"].update(ch=32, ch_mult=[1, 1, 1, 1], num_res_blocks=1)


def sdxl_config(webui: str, clip_dir: str, refiner: bool) -> dict:
    """sgm's SDXL base (or refiner) config, its kinds kept, at a few thousandths of its size."""
    name = "sd_xl_refiner.yaml" if refiner else "sd_xl_base.yaml"
    config = _load(os.path.join(webui, "repositories", "generative-models", "configs", "inference", name))
    params = config["model"]["params"]
    embedders = params["conditioner_config"]["params"]["emb_models"]
    vector = OPEN_CLIP_EMBED_DIM  # the OpenCLIP embedder's pooled output, then each size/crop/score embedding
    for embedder in embedders:
        target = embedder["target"].rsplit(".", 1)[-1]
        if target == "FrozenCLIPEmbedder":  # CLIP-L: its penultimate layer's hidden states
            embedder["params"].update(version=clip_dir, layer_idx=make_models.CLIP_CONFIG["num_hidden_layers"] - 1)
        elif target == "FrozenOpenCLIPEmbedder2":
            embedder["params"].update(arch=OPEN_CLIP_ARCH, version=None)
        elif target == "ConcatTimestepEmbedderND":
            embedder["params"]["outdim"] = VECTOR_OUTDIM
            vector += VECTOR_OUTDIM * (1 if embedder["input_key"] == "aesthetic_score" else 2)
        else:
            raise AssertionError(f"{name}: an embedder this recipe does not know: {embedder['target']}")
    unet = params["network_config"]["params"]
    unet.update(adm_in_channels=vector, model_channels=32, num_res_blocks=1, num_head_channels=16)
    if refiner:  # one transformer per level, OpenCLIP's width given for each level
        unet.update(channel_mult=[1, 2, 2], transformer_depth=1, context_dim=[OPEN_CLIP_WIDTH] * 3)
    else:  # deeper towards the middle; CLIP-L's and OpenCLIP's widths side by side
        unet.update(channel_mult=[1, 2, 2], transformer_depth=[1, 1, 2],
                    context_dim=make_models.CLIP_CONFIG["hidden_size"] + OPEN_CLIP_WIDTH)
    _shrink_vae(params["first_stage_config"])
    return config


def sd2_v_config(webui: str) -> dict:
    """LDM's SD 2.x v-prediction config (OpenCLIP-H, ``parameterization: "v"``) at a few thousandths of its size."""
    path = os.path.join(webui, "repositories", "stable-diffusion-stability-ai", "configs", "stable-diffusion",
                        "v2-inference-v.yaml")
    config = _load(path)
    params = config["model"]["params"]
    assert params["parameterization"] == "v", path
    params["unet_config"]["params"].update(
        model_channels=32, attention_resolutions=[2, 1], num_res_blocks=1, channel_mult=[1, 2, 2],
        num_head_channels=16, context_dim=OPEN_CLIP_WIDTH, use_fp16=False,  # the WebUI sets it as --no-half says
    )
    params["cond_stage_config"]["params"].update(arch=OPEN_CLIP_ARCH, version=None)
    _shrink_vae(params["first_stage_config"])
    return config


def _text_encoders(model: Any) -> list[Any]:
    """The prompt-reading embedders: sgm's (``input_key`` "txt") or LDM's one ``cond_stage_model``."""
    conditioner = getattr(model, "conditioner", None)
    if conditioner is None:
        return [model.cond_stage_model]
    return [e for e in conditioner.embedders if getattr(e, "input_key", None) == "txt"]


def _position_embedding(encoder: Any) -> Any:
    if hasattr(encoder, "transformer"):  # transformers' CLIP
        return encoder.transformer.text_model.embeddings.position_embedding.weight
    return encoder.model.positional_embedding


def conditioning(model: Any, prompts: list[str], size: int = 64) -> tuple[Any, Any]:
    """(cross-attention conditioning, vector conditioning or None) of ``prompts`` as the WebUI asks for them."""
    import torch

    if not hasattr(model, "conditioner"):
        return model.get_learned_conditioning(prompts), None
    n = len(prompts)
    batch = {
        "txt": prompts,
        "original_size_as_tuple": torch.tensor([[size, size]] * n, dtype=torch.float32),
        "crop_coords_top_left": torch.zeros(n, 2),
        "target_size_as_tuple": torch.tensor([[size, size]] * n, dtype=torch.float32),
        "aesthetic_score": torch.full((n, 1), 6.0),
    }
    out = model.conditioner(batch)
    return out["crossattn"], out["vector"]


def random_model(config: dict, seed: int) -> Any:
    """The model of ``config`` (sgm or LDM) with random weights, made non-degenerate as
    :func:`make_models.random_ldm_model` makes SD 1.5's, and checked; its VAE decoder's last conv is scaled so a
    typical latent decodes to mid-range pixels.

    Besides LDM's and sgm's zero-initialised UNet projections and the text encoders' plain LayerNorms, SDXL's
    conditioning comes from hidden states no LayerNorm follows (CLIP-L's and OpenCLIP's penultimate layers),
    whose mean a fresh model keeps near 0 (A1111's emphasis divides by it): each text encoder's position
    embedding is shifted by one number, chosen so that the mean of its conditioning is 0.3. LayerNorms remove
    such a shift, so every layer computes what it did, and the residual stream carries the shift to each
    layer's output (SD 2.x's conditioning ends in a LayerNorm: there its random affine decides the mean)."""
    import torch
    import transformers
    from ldm.util import instantiate_from_config
    from omegaconf import OmegaConf

    transformers.CLIPTextModel.from_pretrained = classmethod(
        lambda cls, name, *a, **k: cls(transformers.CLIPTextConfig.from_pretrained(name))
    )
    config = copy.deepcopy(config)
    ddconfig = config["model"]["params"]["first_stage_config"]["params"]["ddconfig"]
    if ddconfig.get("attn_type") == "vanilla-xformers":  # the WebUI builds it so without xformers
        ddconfig["attn_type"] = "vanilla"
    torch.manual_seed(seed)
    model = instantiate_from_config(OmegaConf.create(config).model)
    unet = model.model.diffusion_model
    projections = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Linear)
    gen = torch.Generator().manual_seed(seed)
    encoders = _text_encoders(model)
    with torch.no_grad():
        for m in unet.modules():
            if isinstance(m, projections) and not m.weight.any():
                m.reset_parameters()
        for encoder in encoders:
            encoder.device = "cpu"
            for m in encoder.modules():
                if isinstance(m, torch.nn.LayerNorm):
                    m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=gen))
                    m.bias.copy_(0.1 + 0.1 * torch.randn(m.bias.shape, generator=gen))
        widths = [_width(e) for e in encoders]
        crossattn, _ = conditioning(model, PROMPTS)
        for encoder, part in zip(encoders, torch.split(crossattn, widths, dim=2)):
            _position_embedding(encoder).add_(0.3 - part.mean())
        crossattn, vector = conditioning(model, PROMPTS)
        means = torch.stack([part.mean(dim=(1, 2)) for part in torch.split(crossattn, widths, dim=2)])
        kwargs = {} if vector is None else {"y": vector[1:3]}
        eps = unet(torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([500, 500]), crossattn[1:3], **kwargs)
        vae = model.first_stage_model
        latent = torch.randn(1, 4, 8, 8, generator=gen) / model.scale_factor
        vae.decoder.conv_out.weight.mul_(0.5 / vae.decode(latent).std())
        vae.decoder.conv_out.bias.zero_()
        image = ((vae.decode(torch.randn(1, 4, 8, 8, generator=gen) / model.scale_factor) + 1) / 2).clamp(0, 1)
    assert crossattn.isfinite().all() and means.abs().min() > 0.02, f"conditioning means too close to 0: {means}"
    assert (crossattn[1] - crossattn[3]).abs().mean() > 0.01, "the conditioning does not depend on the prompt"
    assert eps.isfinite().all() and eps.std() > 0.05, f"UNet output std {eps.std()}"
    assert not any(isinstance(m, projections) and not m.weight.any() for m in unet.modules())
    clipped = float(((image <= 0) | (image >= 1)).float().mean())
    assert 0.05 < float(image.std()) and clipped < 0.5, f"decoded image std {image.std()}, clipped {clipped}"
    print(  # noqa: T201 (run by the test bed; its output is read on failure)
        f"seed {seed}: conditioning means {[[round(float(m), 3) for m in row] for row in means]}, "
        f"UNet eps std {float(eps.std()):.3f}, image std {float(image.std()):.3f} ({clipped:.0%} clipped)"
    )
    return model


def _width(encoder: Any) -> int:
    return int(_position_embedding(encoder).shape[-1])


def write_sdxl_lora(model: Any, models: str) -> None:
    """A rank-4 kohya LoRA for the tiny SDXL base (``ovtest-sdxl-lora``), named as kohya names SDXL LoRAs: the
    UNet's attention projections (``lora_unet_`` + sgm's module path), CLIP-L's attention projections
    (``lora_te1_``) and OpenCLIP's MLPs and attention output projections (``lora_te2_``, in the Hugging Face names
    A1111's Lora extension maps to OpenCLIP's ``resblocks``)."""
    import torch

    layers = [
        (f"lora_unet_{n.replace('.', '_')}", m)
        for n, m in model.model.diffusion_model.named_modules()
        if isinstance(m, torch.nn.Linear) and (n.split(".")[-1] in ("to_q", "to_k", "to_v") or n.endswith("to_out.0"))
    ]
    clip, open_clip = _text_encoders(model)
    layers += [
        (f"lora_te1_{n.replace('.', '_')}", m)
        for n, m in clip.transformer.named_modules()
        if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "out_proj")
    ]
    hf_names = {"mlp.c_fc": "mlp_fc1", "mlp.c_proj": "mlp_fc2", "attn.out_proj": "self_attn_out_proj"}
    for i, block in enumerate(open_clip.model.transformer.resblocks):
        layers += [(f"lora_te2_text_model_encoder_layers_{i}_{hf}", block.get_submodule(path))
                   for path, hf in hf_names.items()]
    gen = torch.Generator().manual_seed(17)
    tensors: dict[str, torch.Tensor] = {}
    rank = 4
    for key, m in layers:
        tensors[f"{key}.lora_down.weight"] = torch.randn(rank, m.in_features, generator=gen) / m.in_features**0.5
        scale = 0.6 * float(m.weight.std())
        tensors[f"{key}.lora_up.weight"] = torch.randn(m.out_features, rank, generator=gen) * scale
        tensors[f"{key}.alpha"] = torch.tensor(float(rank))
    make_models.save_lora(tensors, models, "ovtest-sdxl-lora", len(layers))


def main(webui: str, models: str, clip_dir: str) -> None:
    """Everything this module writes (see its docstring); :func:`make_models.use_webui_ldm` has run."""
    from omegaconf import OmegaConf
    from safetensors.torch import save_file

    use_webui_sgm(webui)
    write_vae_approx_sdxl(models)
    folder = os.path.join(models, "Stable-diffusion")
    for name, seed, config in (
        ("ovtest-sdxl-base", 21, sdxl_config(webui, clip_dir, refiner=False)),
        ("ovtest-sdxl-refiner", 22, sdxl_config(webui, clip_dir, refiner=True)),
        ("ovtest-sd2-v", 23, sd2_v_config(webui)),
    ):
        model = random_model(config, seed)
        with open(os.path.join(folder, name + ".yaml"), "w") as f:
            f.write(OmegaConf.to_yaml(OmegaConf.create(config)))
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, os.path.join(folder, name + ".safetensors.part"))
        os.replace(os.path.join(folder, name + ".safetensors.part"), os.path.join(folder, name + ".safetensors"))
        if name == "ovtest-sdxl-base":
            write_sdxl_lora(model, models)
