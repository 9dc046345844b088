"""The benchmarked Stable Diffusion components: configs, random weights, example inputs.

Owns the table of components (:data:`COMPONENTS`), the call wrappers that give each a
tensors-in, tensor-out ``forward`` (the same module goes to every variant), building them
with random weights from the SD layer's shipped family configs (full size) or from small
configs (``--quick``), and the weights/inputs files the worker processes share: the parent
builds and saves once, every worker maps the same file (``torch.load(mmap=True)``), so the
PyTorch weights are built once and their pages are shared between processes.
Nothing is downloaded.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

WEIGHTS_SEED = 1234
INPUTS_SEED = 4321


class UNetCall(torch.nn.Module):
    """``UNet2DConditionModel`` as (sample, timestep, encoder_hidden_states) -> noise prediction."""

    def __init__(self, unet: torch.nn.Module) -> None:
        super().__init__()
        self.unet = unet

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor,
                encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        return self.unet(sample, timestep, encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]


class SDXLUNetCall(torch.nn.Module):
    """SDXL's UNet, with its added conditions (pooled text embeddings, size/crop ids) as inputs."""

    def __init__(self, unet: torch.nn.Module) -> None:
        super().__init__()
        self.unet = unet

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                text_embeds: torch.Tensor, time_ids: torch.Tensor) -> torch.Tensor:
        return self.unet(sample, timestep, encoder_hidden_states=encoder_hidden_states,
                         added_cond_kwargs={"text_embeds": text_embeds, "time_ids": time_ids},
                         return_dict=False)[0]


class VAEDecoderCall(torch.nn.Module):
    """``AutoencoderKL.decode``: latent -> image."""

    def __init__(self, vae: torch.nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latent, return_dict=False)[0]


class VAEEncoderCall(torch.nn.Module):
    """``AutoencoderKL`` encoder and quant conv: image -> latent moments (mean and log-variance)."""

    def __init__(self, vae: torch.nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.vae.quant_conv(self.vae.encoder(image))


class TextEncoderCall(torch.nn.Module):
    """``CLIPTextModel``: token ids -> last hidden state."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_ids, return_dict=False)[0]


@dataclass(frozen=True)
class ComponentSpec:
    """One benchmarked component.

    Attributes:
        name: the component's name on the command line and in results.
        family: the SD family whose config it is built from ("sd1", "sdxl").
        part: "unet", "vae" or "text_encoder" (which config entry).
        batch: batch size of the example input (2 for the UNet: classifier-free guidance).
        description: what one call is, for the table.
    """

    name: str
    family: str
    part: str
    batch: int
    description: str


#: Sorted by name; tests check for duplicates.
COMPONENTS: tuple[ComponentSpec, ...] = (
    ComponentSpec("sdxl_unet", "sdxl", "unet", 2, "SDXL UNet, batch 2, latent 1/8 of the image"),
    ComponentSpec("text_encoder", "sd1", "text_encoder", 1, "CLIP ViT-L/14 text encoder, 1x77 tokens"),
    ComponentSpec("unet", "sd1", "unet", 2, "SD 1.5 UNet, batch 2, latent 1/8 of the image"),
    ComponentSpec("vae_decoder", "sd1", "vae", 1, "SD VAE decoder, latent -> image"),
    ComponentSpec("vae_encoder", "sd1", "vae", 1, "SD VAE encoder, image -> latent moments"),
)
COMPONENT_NAMES: tuple[str, ...] = tuple(c.name for c in COMPONENTS)


def component(name: str) -> ComponentSpec:
    """The spec of a component by name.

    Raises:
        ValueError: an unknown name (the known ones are listed).
    """
    for spec in COMPONENTS:
        if spec.name == name:
            return spec
    raise ValueError(f"unknown component {name!r}; known: {', '.join(COMPONENT_NAMES)}")


def _quick_config(family: str) -> dict[str, Any]:
    """A config of the family's shape, small enough that every variant converts in seconds."""
    from ov_accelerate_sd.loader import family_config

    config = copy.deepcopy(family_config(family))
    unet = config["unet"]
    # one level with cross-attention (down, mid and up blocks): torch.export of the new-shape
    # route costs seconds per level even on tiny models
    unet.update(block_out_channels=[16], layers_per_block=1, norm_num_groups=8,
                down_block_types=["CrossAttnDownBlock2D"], up_block_types=["CrossAttnUpBlock2D"])
    if family == "sdxl":
        unet.update(attention_head_dim=[2], transformer_layers_per_block=[1],
                    addition_time_embed_dim=8, projection_class_embeddings_input_dim=6 * 8 + 16)
        unet["cross_attention_dim"] = 32
    else:
        unet.update(attention_head_dim=2, cross_attention_dim=16)
    for spec in config["text_encoders"]:
        spec["config"].update(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=2, projection_dim=16)
    config["vae"].update(block_out_channels=[8, 16], layers_per_block=1, norm_num_groups=8,
                         down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2)
    return config


def family_configs(family: str, quick: bool) -> dict[str, Any]:
    """The component configs of a family: the SD layer's shipped ones, or small ones for ``quick``."""
    if quick:
        return _quick_config(family)
    from ov_accelerate_sd.loader import family_config

    return family_config(family)


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return dict(config["text_encoders"][0]["config"])


def build_module(name: str, quick: bool, *, meta: bool = False) -> torch.nn.Module:
    """The call wrapper of a component with freshly initialised (random) weights.

    Args:
        name: a component name.
        quick: small config instead of the full-size one.
        meta: build on the meta device (no memory; fill it with :func:`load_module`).
    """
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    spec = component(name)
    config = family_configs(spec.family, quick)
    factories: dict[str, Callable[[], torch.nn.Module]] = {
        "sdxl_unet": lambda: SDXLUNetCall(UNet2DConditionModel(**config["unet"])),
        "text_encoder": lambda: TextEncoderCall(CLIPTextModel(CLIPTextConfig(**_text_config(config)))),
        "unet": lambda: UNetCall(UNet2DConditionModel(**config["unet"])),
        "vae_decoder": lambda: VAEDecoderCall(AutoencoderKL(**config["vae"])),
        "vae_encoder": lambda: VAEEncoderCall(AutoencoderKL(**config["vae"])),
    }
    if meta:
        with torch.device("meta"):
            return factories[name]().eval()
    torch.manual_seed(WEIGHTS_SEED)
    return factories[name]().eval()


def example_inputs(name: str, quick: bool, size: int) -> tuple[torch.Tensor, ...]:
    """Deterministic example inputs of a component for an image of ``size`` x ``size`` pixels."""
    spec = component(name)
    config = family_configs(spec.family, quick)
    gen = torch.Generator().manual_seed(INPUTS_SEED)
    latent = size // 8
    if spec.part == "unet":
        unet = config["unet"]
        inputs: tuple[torch.Tensor, ...] = (
            torch.randn(spec.batch, unet["in_channels"], latent, latent, generator=gen),
            torch.tensor(981.0),
            torch.randn(spec.batch, 77, unet["cross_attention_dim"], generator=gen),
        )
        if spec.family == "sdxl":
            pooled = unet["projection_class_embeddings_input_dim"] - 6 * unet["addition_time_embed_dim"]
            inputs += (torch.randn(spec.batch, pooled, generator=gen),
                       torch.tensor([[size, size, 0, 0, size, size]] * spec.batch, dtype=torch.float32))
        return inputs
    if name == "vae_decoder":
        return (torch.randn(spec.batch, config["vae"]["latent_channels"], latent, latent, generator=gen),)
    if name == "vae_encoder":
        return (torch.rand(spec.batch, config["vae"]["in_channels"], size, size, generator=gen) * 2 - 1,)
    text = _text_config(config)
    ids = torch.randint(0, text["vocab_size"], (spec.batch, text["max_position_embeddings"]), generator=gen)
    ids[:, 0] = text["bos_token_id"]
    ids[:, -1] = text["eos_token_id"]
    return (ids,)


def weights_key(name: str, quick: bool) -> str:
    """Names the weights of a component (its config and seed), to reuse a saved file safely."""
    spec = component(name)
    text = json.dumps({"name": name, "config": family_configs(spec.family, quick), "seed": WEIGHTS_SEED,
                       "torch": torch.__version__}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def ensure_weights(name: str, quick: bool, folder: Path) -> Path:
    """The file holding a component's random weights under ``folder``, written first if missing."""
    path = folder / f"{name}-{'quick' if quick else 'full'}-{weights_key(name, quick)}.pt"
    if path.is_file():
        logger.info("%s: reusing weights %s", name, path)
        return path
    logger.info("%s: building random weights (%s size)", name, "quick" if quick else "full")
    module = build_module(name, quick)
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    _atomic_save({k: v.detach().contiguous() for k, v in tensors.items()}, path)
    return path


def save_inputs(inputs: tuple[torch.Tensor, ...], path: Path) -> Path:
    """Write example inputs for the workers."""
    _atomic_save(list(inputs), path)
    return path


def load_inputs(path: Path) -> tuple[torch.Tensor, ...]:
    """Read example inputs written by :func:`save_inputs`."""
    return tuple(torch.load(path, weights_only=True))


def _atomic_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_module(name: str, quick: bool, weights: Path) -> torch.nn.Module:
    """A component's call wrapper with its weights mapped from ``weights`` (no copy, shared pages)."""
    module = build_module(name, quick, meta=True)
    tensors = torch.load(weights, mmap=True, weights_only=True)
    for key, tensor in tensors.items():
        owner_name, _, leaf = key.rpartition(".")
        owner = module.get_submodule(owner_name)
        if leaf in owner._parameters:
            owner._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=tensor.is_floating_point())
        elif leaf in owner._buffers:
            owner._buffers[leaf] = tensor
        else:
            raise KeyError(f"{weights}: {key} is not a parameter or buffer of {name}")
    left = [k for k, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"{weights}: {len(left)} tensors of {name} not filled, e.g. {left[:3]}")
    return module.eval()
