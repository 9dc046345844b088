"""A LoRA file's tensors -> the weight changes of our diffusers/transformers modules, as A1111 computes them.

Owns: the kohya name of every module a LoRA may change and which multiplier it takes
(``LoraTargets``), grouping a file's tensors by layer (``group_layers``), and each layer's
weight change (``layer_delta``) for the kinds A1111 v1.10.1's built-in Lora extension loads:
LoRA/LoCon (``lora_up``/``lora_down``, optional ``lora_mid``), LoHa (``hada_*``), LoKr
(``lokr_*``) and full differences (``diff``/``diff_b``), with its scale (``scale``, else
alpha / rank, else 1), its ``bias`` and ``dora_scale`` terms and the multiplier.

Kohya names, as A1111 resolves them:

* UNet: ``lora_unet_`` + the WebUI's LDM module path (``input_blocks_1_1_..._attn1_to_q``; the
  path comes from ``ldm_layout``), or + the diffusers path for the blocks A1111 converts
  (``conv_in``, ``conv_out``, ``time_embedding``, ``down_blocks``, ``mid_block``, ``up_blocks``).
* A CLIP-L (``hf_clip``) encoder: ``lora_te_text_model_encoder_layers_*`` (one encoder) and
  ``lora_te1_text_model_*`` (the first encoder: SD 1.x, SDXL).
* An OpenCLIP encoder (SD 2.x ``lora_te_``, SDXL ``lora_te2_``), written with transformers
  names: only ``mlp_fc1``, ``mlp_fc2`` and ``self_attn_{q,k,v,out}_proj`` of the encoder layers
  match; A1111 writes q, k, v and out into one ``MultiheadAttention``, and only when all four
  are in the file (``Target.qkv_set``). Layers the WebUI has but our encoder drops (SD 2.x's
  last, whose output no one reads) are ``unused``.

Deltas are computed in float32 (A1111 computes LoHa/LoKr/full in the file's dtype, which for
half-precision files also rounds the weight it adds to).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from . import ldm_layout
from .loader import Components

logger = logging.getLogger(__name__)

TEXT_ENCODER = "te"
UNET = "unet"
KINDS = ("LoRA/LoCon", "LoHa", "LoKr", "full (diff)")
#: Diffusers-named UNet modules A1111 converts to its LDM names (``convert_diffusers_name_to_compvis``).
_DIFFUSERS_UNET = ("conv_in", "conv_out", "time_embedding.", "down_blocks.", "mid_block.", "up_blocks.")
_OPEN_CLIP_MODULE = re.compile(r"text_model\.encoder\.layers\.\d+\.(mlp\.fc[12]|self_attn\.(q|k|v|out)_proj)")


class LoraError(ValueError):
    """A LoRA that cannot be found, read or applied to this model; the message says why."""


@dataclass(frozen=True)
class Target:
    """A module whose weight a LoRA layer changes."""

    name: str
    """Where it is, for messages: ``unet.down_blocks.0...`` or ``te1.text_model...``."""
    module: torch.nn.Module
    part: str
    """``TEXT_ENCODER`` or ``UNET``: which multiplier of the tag applies."""
    qkv_set: str | None = None
    """OpenCLIP attention: the attention it belongs to (A1111 applies q, k, v, out together or not at all)."""


def _flat(path: str) -> str:
    return path.replace(".", "_")


def _weighted_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every submodule holding a ``weight`` parameter of its own."""
    return [(n, m) for n, m in model.named_modules() if n and "weight" in dict(m.named_parameters(recurse=False))]


class LoraTargets:
    """The kohya name of every module of ``components`` a LoRA may change (see the module docstring)."""

    def __init__(self, components: Components) -> None:
        self.family = components.family
        self.by_key: dict[str, Target] = {}
        self._unused: list[str] = []
        rules = ldm_layout.unet_rules(components.config["unet"])
        for name, module in _weighted_modules(components.unet):
            target = Target(f"unet.{name}", module, UNET)
            self.by_key["lora_unet_" + _flat(rules.map(name + ".weight").removesuffix(".weight"))] = target
            if name.startswith(_DIFFUSERS_UNET):
                self.by_key["lora_unet_" + _flat(name)] = target
        specs = components.config["text_encoders"]
        for index, (spec, encoder) in enumerate(zip(specs, components.text_encoders)):
            self._add_encoder(index, len(specs), spec, encoder)

    def _add_encoder(self, index: int, count: int, spec: Mapping, encoder: torch.nn.Module) -> None:
        where = f"te{index + 1}."
        if spec["layout"] == "hf_clip":
            for name, module in _weighted_modules(encoder):
                target = Target(where + name, module, TEXT_ENCODER)
                if index == 0 and name.startswith("text_model."):
                    self.by_key["lora_te1_" + _flat(name)] = target
                if count == 1 and name.startswith("text_model.encoder.layers."):
                    self.by_key["lora_te_" + _flat(name)] = target
            return
        prefix = "lora_te_" if count == 1 else f"lora_te{index + 1}_"
        for name, module in _weighted_modules(encoder):
            match = _OPEN_CLIP_MODULE.fullmatch(name)
            if match:
                qkv = name.rpartition(".")[0] if match.group(1).startswith("self_attn") else None
                self.by_key[prefix + _flat(name)] = Target(where + name, module, TEXT_ENCODER, qkv)
        layers = encoder.config.num_hidden_layers
        self._unused += [f"{prefix}text_model_encoder_layers_{n}_"
                         for n in range(layers, layers + int(spec.get("drop_last_layers", 0)))]

    def is_unused(self, key: str) -> bool:
        """A layer of the WebUI's text encoder our encoder leaves out because its output is never read."""
        return key.startswith(tuple(self._unused))


def group_layers(state: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """A LoRA file's tensors by layer: ``lora_unet_x.lora_up.weight`` -> ``{"lora_unet_x": {"lora_up.weight": t}}``."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        base, _, part = key.partition(".")
        layers.setdefault(base, {})[part] = tensor
    return layers


def layer_kind(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The kind of a layer's tensors (one of ``KINDS``), tried in A1111's order; None when unsupported."""
    keys = tensors.keys()
    if {"lora_up.weight", "lora_down.weight"} <= keys or {"lora_A.weight", "lora_B.weight"} <= keys:
        return KINDS[0]
    if {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"} <= keys:
        return KINDS[1]
    if "weight" in keys:
        return None  # (IA)^3, which A1111 tries before LoKr
    if ("lokr_w1" in keys or {"lokr_w1_a", "lokr_w1_b"} <= keys) and (
        "lokr_w2" in keys or {"lokr_w2_a", "lokr_w2_b"} <= keys
    ):
        return KINDS[2]
    if "diff" in keys:
        return KINDS[3]
    return None


def _f32(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().to(torch.float32)


def _product(up: torch.Tensor, down: torch.Tensor, shape: list[int], rank: int | None = None) -> torch.Tensor:
    """``up @ down`` of the flattened factors (first ``rank`` components only), as ``shape``."""
    up, down = up.reshape(up.shape[0], -1), down.reshape(down.shape[0], -1)
    if rank is not None:
        up, down = up[:, :rank], down[:rank, :]
    return (up @ down).reshape(shape)


def _tucker(core: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """LyCORIS' CP/Tucker rebuild: ``W[o, i, k, l] = sum core[p, q, k, l] a[p, o] b[q, i]``."""
    return torch.einsum("pqkl,po,qi->oikl", core, a, b)


def _lora(w: Mapping[str, torch.Tensor], module: torch.nn.Module, dyn: int | None) -> tuple[torch.Tensor, list, int]:
    up = _f32(w.get("lora_up.weight", w.get("lora_B.weight")))
    down = _f32(w.get("lora_down.weight", w.get("lora_A.weight")))
    mid = _f32(w.get("lora_mid.weight"))
    if isinstance(module, torch.nn.Conv2d):
        down = down.reshape(down.shape[0], -1, 1, 1) if down.ndim == 2 else down
    elif isinstance(module, torch.nn.Linear):
        down = down.reshape(down.shape[0], -1)
    else:
        raise LoraError(f"a LoRA layer on a {type(module).__name__}, which A1111 does not accept")
    shape = [up.shape[0], down.shape[1]]
    if mid is not None:
        shape += mid.shape[2:]
        updown = torch.einsum("pqkl,op,qi->oikl", mid, up.reshape(up.shape[0], -1), down.reshape(down.shape[0], -1))
    else:
        shape += down.shape[2:]
        updown = _product(up, down, shape, dyn)
    return updown, shape, down.shape[0]


def _loha(w: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, list, int]:
    w1a, w1b, w2a, w2b = (_f32(w[k]) for k in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"))
    t1, t2 = _f32(w.get("hada_t1")), _f32(w.get("hada_t2"))
    if t1 is not None:
        shape = [w1a.shape[1], w1b.shape[1], *t1.shape[2:]]
        first = _tucker(t1, w1a, w1b)
    else:
        shape = [w1a.shape[0], w1b.shape[1], *w1b.shape[2:]]
        first = _product(w1a, w1b, shape)
    second = _tucker(t2, w2a, w2b) if t2 is not None else _product(w2a, w2b, shape)
    return first * second, shape, w1b.shape[0]


def _lokr(w: Mapping[str, torch.Tensor], weight: torch.Tensor) -> tuple[torch.Tensor, list, int | None]:
    w1 = _f32(w["lokr_w1"]) if "lokr_w1" in w else _f32(w["lokr_w1_a"]) @ _f32(w["lokr_w1_b"])
    if "lokr_w2" in w:
        w2 = _f32(w["lokr_w2"])
    elif "lokr_t2" in w:
        w2 = _tucker(_f32(w["lokr_t2"]), _f32(w["lokr_w2_a"]), _f32(w["lokr_w2_b"]))
    else:
        w2 = _f32(w["lokr_w2_a"]) @ _f32(w["lokr_w2_b"])
    shape = list(weight.shape) if weight.ndim == 4 else [w1.shape[0] * w2.shape[0], w1.shape[1] * w2.shape[1]]
    if w2.ndim == 4:
        w1 = w1[:, :, None, None]
    rank = w["lokr_w2_b"].shape[0] if "lokr_w2_b" in w else w["lokr_w1_b"].shape[0] if "lokr_w1_b" in w else None
    return torch.kron(w1, w2.contiguous()).reshape(shape), shape, rank


def _decompose(updown: torch.Tensor, weight: torch.Tensor, dora_scale: torch.Tensor) -> torch.Tensor:
    """DoRA: the changed weight's columns rescaled to the norms in ``dora_scale``, as a change of ``weight``."""
    merged = updown + weight
    columns = merged.shape[1]
    norm = merged.transpose(0, 1).reshape(columns, -1).norm(dim=1, keepdim=True)
    norm = norm.reshape(columns, *[1] * (weight.ndim - 1)).transpose(0, 1)
    return merged * (dora_scale / norm) - weight


def layer_delta(
    tensors: Mapping[str, torch.Tensor],
    module: torch.nn.Module,
    weight: torch.Tensor,
    multiplier: float,
    dyn_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The change of one layer's weight (and bias), as A1111's ``calc_updown`` + ``finalize_updown``.

    Args:
        tensors: the layer's tensors from the file (``group_layers``).
        module: the module the layer changes (its type decides how LoRA factors are read).
        weight: the module's current weight in float32 (DoRA and LoKr on convolutions read it).
        multiplier: the tag's text-encoder or UNet multiplier.
        dyn_dim: use only this many ranks of a LoRA (``<lora:name:te:unet:dyn>``).

    Returns:
        (change of the weight, shaped as ``weight`` when it has as many elements; change of the bias or None).

    Raises:
        LoraError: a kind A1111 does not load.
    """
    kind = layer_kind(tensors)
    if kind is None:
        raise LoraError(f"tensors {sorted(tensors)} are of a kind we do not apply (supported: {', '.join(KINDS)})")
    rank: int | None = None
    ex_bias = None
    if kind == KINDS[0]:
        updown, shape, rank = _lora(tensors, module, dyn_dim)
    elif kind == KINDS[1]:
        updown, shape, rank = _loha(tensors)
    elif kind == KINDS[2]:
        updown, shape, rank = _lokr(tensors, weight)
    else:
        updown, shape = _f32(tensors["diff"]), list(tensors["diff"].shape)
        ex_bias = _f32(tensors.get("diff_b"))
    bias = _f32(tensors.get("bias"))
    if bias is not None:
        updown = (updown.reshape(bias.shape) + bias).reshape(shape)
    if len(shape) == 4:
        updown = updown.reshape(shape)
    if updown.numel() == weight.numel():
        updown = updown.reshape(weight.shape)
    if ex_bias is not None:
        ex_bias = ex_bias * multiplier
    if "scale" in tensors:
        scale = tensors["scale"].item()
    elif rank is not None and "alpha" in tensors:
        scale = tensors["alpha"].item() / rank
    else:
        scale = 1.0
    updown = updown * scale
    if "dora_scale" in tensors:
        updown = _decompose(updown, weight, _f32(tensors["dora_scale"]))
    return updown * multiplier, ex_bias
