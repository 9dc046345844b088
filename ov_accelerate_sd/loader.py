"""A WebUI single-file checkpoint -> diffusers components, offline; and the reverse, for writing.

Owns: the shipped family configs (``configs/*.json``), building empty diffusers/transformers
modules from them (on the meta device, then filled with ``assign=True`` so nothing is
initialised twice), filling them through ``ldm_layout``, an optional separate VAE file, the
SD 2.x prediction-type probe (for files that do not say), and ``save_webui_checkpoint`` (the
demo model and the tests write their tiny models in the WebUI's layout with it; their configs travel in the
safetensors metadata, which overrides the shipped ones).
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from safetensors.torch import save_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from ov_backend.files import atomic_path

from . import ldm_config, ldm_layout
from .checkpoint import METADATA_CONFIG_KEY, Checkpoint, CheckpointError, load_state_dict, read_checkpoint
from .tokenizer import clip_tokenizer

logger = logging.getLogger(__name__)


def family_config(family: str) -> dict[str, Any]:
    """The shipped component configs of a family ("sd1", "sd2", "sdxl")."""
    text = resources.files(__package__).joinpath("configs", f"{family}.json").read_text(encoding="utf-8")
    return json.loads(text)


@dataclass
class Components:
    """The diffusers/transformers modules of one checkpoint, plus what generation needs to know."""

    family: str
    config: dict[str, Any]
    unet: UNet2DConditionModel
    vae: AutoencoderKL
    text_encoders: list[torch.nn.Module]
    tokenizers: list[Any]
    scheduler_config: dict[str, Any]
    path: str = ""


def _empty(factory: Any) -> Any:
    with torch.device("meta"):
        return factory()


def _assign(module: torch.nn.Module, state: dict[str, torch.Tensor], what: str, path: str) -> None:
    expected = module.state_dict()
    for key, tensor in state.items():
        if key in expected and tuple(expected[key].shape) != tuple(tensor.shape):
            raise CheckpointError(
                path, f"{what} tensor {key} has shape {tuple(tensor.shape)}, the {what} expects "
                f"{tuple(expected[key].shape)} (a variant of the family we do not support?)"
            )
    result = module.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in result.missing_keys if not k.endswith("position_ids")]
    if missing:
        raise CheckpointError(path, f"{what}: {len(missing)} tensor(s) missing, e.g. {missing[:3]}")
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if tensor.is_meta:
            raise CheckpointError(path, f"{what}: {name} was not filled from the checkpoint")


def _text_encoder(
    spec: dict, state: dict[str, torch.Tensor], path: str, dtype: torch.dtype
) -> torch.nn.Module:
    cfg = CLIPTextConfig(**spec["config"])
    cls = CLIPTextModelWithProjection if spec.get("with_projection") else CLIPTextModel
    model = _empty(lambda: cls(cfg))
    try:
        weights = ldm_layout.text_encoder_from_ldm(state, model.state_dict().keys(), spec)
    except ldm_layout.ConversionError as exc:
        raise CheckpointError(path, str(exc)) from None
    weights["text_model.embeddings.position_ids"] = torch.arange(cfg.max_position_embeddings).unsqueeze(0)
    _assign(model, {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()},
            "text encoder", path)
    return model.eval()


def _vae(config: dict, state: dict, path: str, root: str, dtype: torch.dtype) -> AutoencoderKL:
    vae = _empty(lambda: AutoencoderKL(**config))
    try:
        weights = ldm_layout.vae_from_ldm(state, vae.state_dict().keys(), config, root)
    except ldm_layout.ConversionError as exc:
        raise CheckpointError(path, str(exc)) from None
    _assign(vae, {k: v.to(dtype) for k, v in weights.items()}, "VAE", path)
    return vae.eval()


def load_vae_file(path: str | os.PathLike, config: dict, dtype: torch.dtype = torch.float32) -> AutoencoderKL:
    """A separate WebUI VAE file (keys ``encoder.*``/``decoder.*``, or ``first_stage_model.*``)."""
    state, _ = load_state_dict(path)
    root = ldm_layout.VAE_ROOT if any(k.startswith(ldm_layout.VAE_ROOT) for k in state) else ""
    if root + "decoder.conv_in.weight" not in state:
        raise CheckpointError(path, "not a VAE: no 'decoder.conv_in.weight' tensor")
    return _vae(config, state, str(path), root, dtype)


PROBE_THRESHOLD = 0.5
"""Regression slope of the prediction on its input above which a model predicts the noise."""


@torch.no_grad()
def sd2_uses_v_prediction(unet: torch.nn.Module, timestep: int = 999, size: int = 8) -> bool:
    """Whether an SD 2.x UNet predicts v (velocity) rather than the noise, told from its weights.

    The probe: give the UNet a standard Gaussian latent at the noisiest training step (what it
    sees there, so the answer does not rest on out-of-distribution behaviour) and measure the
    least-squares slope of its output on its input, <out, x> / <x, x>.

    Why that works: at the last step x_t = a x0 + b eps with a ~ 0.07, b ~ 1 (SD's schedule).
    For data of any spread s the best epsilon prediction is b x_t / (a^2 s^2 + b^2): slope ~ 1
    (above 0.5 for s up to ~14). The best v = a eps - b x0 prediction has slope
    a b (1 - s^2) / (a^2 s^2 + b^2), at most a / b ~ 0.07. Trained models are close to these
    conditional means at that step, so the slope sits near 1 or near (or below) 0.

    Args:
        unet: a diffusers ``UNet2DConditionModel`` (or anything called the same way).
        timestep: the noisiest training timestep.
        size: latent height and width of the probe.
    """
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((1, unet.config.in_channels, size, size), generator=generator)
    x = x.to(device=unet.device, dtype=unet.dtype)
    context = torch.zeros((1, 77, unet.config.cross_attention_dim), device=unet.device, dtype=unet.dtype)
    out = unet(x, torch.tensor([timestep], device=unet.device), encoder_hidden_states=context).sample
    x, out = x.double(), out.double()
    slope = float((out * x).sum() / (x * x).sum())
    logger.info("SD 2.x prediction probe: slope %.3f (epsilon above %s)", slope, PROBE_THRESHOLD)
    return slope < PROBE_THRESHOLD


def load_components(
    checkpoint: str | os.PathLike | Checkpoint,
    vae_path: str | os.PathLike | None = None,
    prediction_type: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Components:
    """Build the diffusers components of a WebUI checkpoint, offline.

    Args:
        checkpoint: a path or an already read ``Checkpoint``.
        vae_path: optional separate VAE file replacing the checkpoint's VAE.
        prediction_type: "epsilon" or "v_prediction" to override detection.
        dtype: dtype of the weights in PyTorch.

    Raises:
        CheckpointError: the file cannot be read, or its tensors do not fit the family.
    """
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else read_checkpoint(checkpoint)
    config = family_config(ckpt.family)
    beside = ldm_config.yaml_beside(ckpt.path) if METADATA_CONFIG_KEY not in ckpt.metadata else None
    if METADATA_CONFIG_KEY in ckpt.metadata:
        config.update(json.loads(ckpt.metadata[METADATA_CONFIG_KEY]))
    elif beside is not None:  # the WebUI reads the config beside a checkpoint: so do we, where we can
        try:
            config = ldm_config.components_config(beside, config)
            logger.info("%s: the config beside it, %s", ckpt.path, beside)
        except ldm_config.UnsupportedConfig as exc:
            logger.info("%s; the shipped %s config is used", exc, ckpt.family)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(ckpt.path, f"cannot read the config beside it, {beside}: {exc}") from None
    state, path = ckpt.state_dict, ckpt.path

    unet = _empty(lambda: UNet2DConditionModel(**config["unet"]))
    try:
        unet_weights = ldm_layout.unet_from_ldm(state, unet.state_dict().keys(), config["unet"])
    except ldm_layout.ConversionError as exc:
        raise CheckpointError(path, str(exc)) from None
    _assign(unet, {k: v.to(dtype) for k, v in unet_weights.items()}, "UNet", path)
    unet.eval()

    vae = load_vae_file(vae_path, config["vae"], dtype) if vae_path else _vae(
        config["vae"], state, path, ldm_layout.VAE_ROOT, dtype
    )
    encoders = [_text_encoder(spec, state, path, dtype) for spec in config["text_encoders"]]
    tokenizers = [clip_tokenizer(spec["pad_token"]) for spec in config["text_encoders"]]

    scheduler_config = dict(config["scheduler"])
    if prediction_type:
        scheduler_config["prediction_type"] = prediction_type
    elif ckpt.prediction_type:
        scheduler_config["prediction_type"] = ckpt.prediction_type
    elif ckpt.family == "sd2" and METADATA_CONFIG_KEY not in ckpt.metadata:
        scheduler_config["prediction_type"] = "v_prediction" if sd2_uses_v_prediction(unet) else "epsilon"
    logger.info("%s: %s, prediction %s", path, ckpt.family, scheduler_config["prediction_type"])
    return Components(ckpt.family, config, unet, vae, encoders, tokenizers, scheduler_config, path)


def save_webui_checkpoint(
    path: str | os.PathLike,
    family: str,
    config: dict[str, Any],
    unet: UNet2DConditionModel,
    vae: AutoencoderKL,
    text_encoders: list[torch.nn.Module],
) -> Path:
    """Write diffusers components as a WebUI-layout ``.safetensors`` file, atomically.

    ``config`` (unet / vae / text_encoders / scheduler entries) is stored in the metadata so
    ``load_components`` rebuilds modules of the same shape.
    """
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    tensors.update(ldm_layout.unet_to_ldm(unet.state_dict(), config["unet"]))
    tensors.update(ldm_layout.vae_to_ldm(vae.state_dict(), config["vae"]))
    for spec, encoder in zip(config["text_encoders"], text_encoders):
        tensors.update(ldm_layout.text_encoder_to_ldm(encoder.state_dict(), spec))
    if family == "sd2" and config.get("scheduler", {}).get("prediction_type") == "v_prediction":
        tensors["v_pred"] = torch.zeros(())
    tensors = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    stored = {k: config[k] for k in ("unet", "vae", "text_encoders", "scheduler") if k in config}
    metadata = {METADATA_CONFIG_KEY: json.dumps(stored), "family": family}
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return path


def tiny_config(family: str = "sd1") -> dict[str, Any]:
    """A small config of a family's shape (for the demo model and tests): random weights, fast."""
    config = copy.deepcopy(family_config(family))
    unet = config["unet"]
    blocks = len(unet["block_out_channels"])
    width = 32
    unet["block_out_channels"] = [width] + [2 * width] * (blocks - 1)
    unet["layers_per_block"] = 1
    unet["norm_num_groups"] = 8
    unet["attention_head_dim"] = 8 if family == "sd1" else [2] * blocks
    if "transformer_layers_per_block" in unet:
        unet["transformer_layers_per_block"] = [1] * blocks
    text_width = 32
    for spec in config["text_encoders"]:
        spec["config"].update(hidden_size=text_width, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, projection_dim=text_width)
    unet["cross_attention_dim"] = text_width * len(config["text_encoders"])
    if family == "sdxl":
        unet["addition_time_embed_dim"] = 8
        unet["projection_class_embeddings_input_dim"] = 6 * 8 + text_width
    vae = config["vae"]
    vae["block_out_channels"] = [8, 16, 16, 16]
    vae["layers_per_block"] = 1
    vae["norm_num_groups"] = 8
    return config


def random_components(
    config: dict[str, Any], seed: int = 0
) -> tuple[UNet2DConditionModel, AutoencoderKL, list]:
    """Freshly initialised (random) UNet, VAE and text encoders for ``config``."""
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**config["unet"]).eval()
    vae = AutoencoderKL(**config["vae"]).eval()
    encoders = []
    for spec in config["text_encoders"]:
        cls = CLIPTextModelWithProjection if spec.get("with_projection") else CLIPTextModel
        encoders.append(cls(CLIPTextConfig(**spec["config"])).eval())
    return unet, vae, encoders
