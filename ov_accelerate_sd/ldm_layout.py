"""Key layout conversion between WebUI (LDM/sgm) checkpoints and diffusers/transformers modules.

Owns one table per component, written from the diffusers side: every parameter name of the
diffusers module maps to exactly one name in the WebUI file (plus a reshape where the layouts
differ). The same table reads a checkpoint into diffusers modules and writes diffusers modules
out as a WebUI-style checkpoint (used by the demo model and the tests).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

UNET_ROOT = "model.diffusion_model."
VAE_ROOT = "first_stage_model."

_UNET_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
_VAE_RESNET = {"conv_shortcut": "nin_shortcut"}
_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
_VAE_ATTENTION_LINEARS = ("to_q", "to_k", "to_v", "to_out.0")


class ConversionError(ValueError):
    """The checkpoint's tensors do not fit the component they should fill."""


@dataclass(frozen=True)
class _Rules:
    """Prefix rules: diffusers module prefix -> (LDM prefix, renames of the rest of the path)."""

    prefixes: dict[str, tuple[str, Mapping[str, str]]] = field(default_factory=dict)

    def add(self, diffusers: str, ldm: str, renames: Mapping[str, str] | None = None) -> None:
        self.prefixes[diffusers + "."] = (ldm + ".", renames or {})

    def map(self, key: str) -> str:
        parts = key.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:cut]) + "."
            rule = self.prefixes.get(prefix)
            if rule is not None:
                ldm_prefix, renames = rule
                module, _, param = key[len(prefix):].rpartition(".")
                module = renames.get(module, module)
                return ldm_prefix + (f"{module}.{param}" if module else param)
        return key


def unet_rules(config: Mapping) -> _Rules:
    """The UNet table for a diffusers ``UNet2DConditionModel`` config."""
    rules = _Rules()
    rules.add("time_embedding.linear_1", "time_embed.0")
    rules.add("time_embedding.linear_2", "time_embed.2")
    rules.add("add_embedding.linear_1", "label_emb.0.0")
    rules.add("add_embedding.linear_2", "label_emb.0.2")
    rules.add("conv_in", "input_blocks.0.0")
    rules.add("conv_norm_out", "out.0")
    rules.add("conv_out", "out.2")
    layers = config.get("layers_per_block", 2)
    down = config["down_block_types"]
    n = 1
    for i, kind in enumerate(down):
        for j in range(layers):
            rules.add(f"down_blocks.{i}.resnets.{j}", f"input_blocks.{n}.0", _UNET_RESNET)
            if kind.startswith("CrossAttn"):
                rules.add(f"down_blocks.{i}.attentions.{j}", f"input_blocks.{n}.1")
            n += 1
        if i < len(down) - 1:
            rules.add(f"down_blocks.{i}.downsamplers.0.conv", f"input_blocks.{n}.0.op")
            n += 1
    rules.add("mid_block.resnets.0", "middle_block.0", _UNET_RESNET)
    rules.add("mid_block.attentions.0", "middle_block.1")
    rules.add("mid_block.resnets.1", "middle_block.2", _UNET_RESNET)
    up = config["up_block_types"]
    n = 0
    for i, kind in enumerate(up):
        attn = kind.startswith("CrossAttn")
        for j in range(layers + 1):
            rules.add(f"up_blocks.{i}.resnets.{j}", f"output_blocks.{n}.0", _UNET_RESNET)
            if attn:
                rules.add(f"up_blocks.{i}.attentions.{j}", f"output_blocks.{n}.1")
            if j == layers and i < len(up) - 1:
                rules.add(f"up_blocks.{i}.upsamplers.0.conv", f"output_blocks.{n}.{2 if attn else 1}.conv")
            n += 1
    return rules


def vae_rules(config: Mapping) -> _Rules:
    """The VAE table for a diffusers ``AutoencoderKL`` config."""
    rules = _Rules()
    blocks = len(config["block_out_channels"])
    layers = config.get("layers_per_block", 2)
    for side in ("encoder", "decoder"):
        rules.add(f"{side}.conv_norm_out", f"{side}.norm_out")
        rules.add(f"{side}.mid_block.resnets.0", f"{side}.mid.block_1", _VAE_RESNET)
        rules.add(f"{side}.mid_block.resnets.1", f"{side}.mid.block_2", _VAE_RESNET)
        rules.add(f"{side}.mid_block.attentions.0", f"{side}.mid.attn_1", _VAE_ATTENTION)
    for i in range(blocks):
        for j in range(layers):
            rules.add(f"encoder.down_blocks.{i}.resnets.{j}", f"encoder.down.{i}.block.{j}", _VAE_RESNET)
        if i < blocks - 1:
            rules.add(f"encoder.down_blocks.{i}.downsamplers.0.conv", f"encoder.down.{i}.downsample.conv")
        ldm = blocks - 1 - i
        for j in range(layers + 1):
            rules.add(f"decoder.up_blocks.{i}.resnets.{j}", f"decoder.up.{ldm}.block.{j}", _VAE_RESNET)
        if i < blocks - 1:
            rules.add(f"decoder.up_blocks.{i}.upsamplers.0.conv", f"decoder.up.{ldm}.upsample.conv")
    return rules


def _is_vae_attention_linear(key: str) -> bool:
    return ".mid_block.attentions.0." in key and key.rsplit(".", 1)[0].endswith(_VAE_ATTENTION_LINEARS)


def _fill(
    model_keys: Iterable[str],
    source: Mapping[str, torch.Tensor],
    key_of: callable,
    what: str,
    transform: callable | None = None,
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    for key in model_keys:
        src = key_of(key)
        if src is None:
            continue
        if src not in source:
            missing.append(src)
            continue
        tensor = source[src]
        out[key] = transform(key, tensor) if transform else tensor
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ConversionError(f"{what}: {len(missing)} tensor(s) missing from the checkpoint: {shown}")
    return out


def unet_from_ldm(state_dict: Mapping[str, torch.Tensor], model_keys: Iterable[str], config: Mapping) -> dict:
    """Diffusers UNet state dict from a WebUI checkpoint."""
    rules = unet_rules(config)
    return _fill(model_keys, state_dict, lambda k: UNET_ROOT + rules.map(k), "UNet")


def vae_from_ldm(
    state_dict: Mapping[str, torch.Tensor], model_keys: Iterable[str], config: Mapping, root: str = VAE_ROOT
) -> dict:
    """Diffusers VAE state dict from a WebUI checkpoint (``root`` "" for a separate VAE file)."""
    rules = vae_rules(config)

    def reshape(key: str, tensor: torch.Tensor) -> torch.Tensor:
        if _is_vae_attention_linear(key) and key.endswith(".weight") and tensor.ndim == 4:
            return tensor[:, :, 0, 0]
        return tensor

    return _fill(model_keys, state_dict, lambda k: root + rules.map(k), "VAE", reshape)


def _hf_clip_key(prefix: str, state_dict: Mapping[str, torch.Tensor]) -> callable:
    legacy = not any(k.startswith(prefix + "text_model.") for k in state_dict)

    def key_of(key: str) -> str | None:
        if key.endswith("position_ids"):
            return None
        if legacy and key.startswith("text_model."):
            return prefix + key[len("text_model."):]
        return prefix + key

    return key_of


_OPEN_CLIP_LAYER = {
    "layer_norm1": "ln_1",
    "layer_norm2": "ln_2",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
    "self_attn.out_proj": "attn.out_proj",
}


def _open_clip_source(key: str) -> tuple[str, int | None]:
    """WebUI name of an open_clip tensor for a transformers CLIP key; the int is the q/k/v slot."""
    fixed = {
        "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
        "text_model.embeddings.position_embedding.weight": "positional_embedding",
        "text_model.final_layer_norm.weight": "ln_final.weight",
        "text_model.final_layer_norm.bias": "ln_final.bias",
        "text_projection.weight": "text_projection",
    }
    if key in fixed:
        return fixed[key], None
    rest = key[len("text_model.encoder.layers."):]
    index, _, inner = rest.partition(".")
    module, _, param = inner.rpartition(".")
    base = f"transformer.resblocks.{index}."
    for slot, name in enumerate(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")):
        if module == name:
            return base + f"attn.in_proj_{param}", slot
    return base + f"{_OPEN_CLIP_LAYER[module]}.{param}", None


def text_encoder_from_ldm(
    state_dict: Mapping[str, torch.Tensor], model_keys: Iterable[str], spec: Mapping
) -> dict[str, torch.Tensor]:
    """Transformers CLIP text model state dict from a WebUI checkpoint, for one encoder spec."""
    prefix = spec["ldm_prefix"]
    if spec["layout"] == "hf_clip":
        return _fill(model_keys, state_dict, _hf_clip_key(prefix, state_dict), "text encoder")
    out: dict[str, torch.Tensor] = {}
    missing = []
    for key in model_keys:
        if key.endswith("position_ids"):
            continue
        name, slot = _open_clip_source(key)
        tensor = state_dict.get(prefix + name)
        if tensor is None:
            missing.append(prefix + name)
            continue
        if slot is not None:
            tensor = tensor.chunk(3, dim=0)[slot]
        elif name == "text_projection":
            tensor = tensor.T
        out[key] = tensor.contiguous()
    if missing:
        raise ConversionError(
            f"text encoder: {len(missing)} tensor(s) missing from the checkpoint: {missing[:5]}"
        )
    return out


def unet_to_ldm(state_dict: Mapping[str, torch.Tensor], config: Mapping) -> dict[str, torch.Tensor]:
    """WebUI-layout tensors for a diffusers UNet state dict."""
    rules = unet_rules(config)
    return {UNET_ROOT + rules.map(k): v for k, v in state_dict.items()}


def vae_to_ldm(state_dict: Mapping[str, torch.Tensor], config: Mapping) -> dict[str, torch.Tensor]:
    """WebUI-layout tensors for a diffusers VAE state dict."""
    rules = vae_rules(config)
    out = {}
    for key, tensor in state_dict.items():
        if _is_vae_attention_linear(key) and key.endswith(".weight"):
            tensor = tensor[:, :, None, None]
        out[VAE_ROOT + rules.map(key)] = tensor
    return out


def text_encoder_to_ldm(state_dict: Mapping[str, torch.Tensor], spec: Mapping) -> dict[str, torch.Tensor]:
    """WebUI-layout tensors for a transformers CLIP text model state dict."""
    prefix = spec["ldm_prefix"]
    if spec["layout"] == "hf_clip":
        return {prefix + k: v for k, v in state_dict.items() if not k.endswith("position_ids")}
    out: dict[str, torch.Tensor] = {}
    qkv: dict[str, list] = {}
    for key, tensor in state_dict.items():
        if key.endswith("position_ids"):
            continue
        name, slot = _open_clip_source(key)
        if slot is not None:
            qkv.setdefault(prefix + name, [None, None, None])[slot] = tensor
        else:
            out[prefix + name] = tensor.T.contiguous() if name == "text_projection" else tensor
    for name, parts in qkv.items():
        out[name] = torch.cat(parts, dim=0)
    return out
