"""A WebUI checkpoint's own LDM config (``<name>.yaml`` beside it), as component configs of this layer.

The WebUI reads a config found beside a checkpoint instead of guessing one from the weights; a checkpoint
of an unusual shape (a fine-tune with another width, a test model) loads only with it. Owns
:func:`yaml_beside` and :func:`components_config`, which turns an SD 1.x LDM config
(``ldm.models.diffusion.ddpm.LatentDiffusion`` with ``openaimodel.UNetModel``, ``AutoencoderKL`` and
``FrozenCLIPEmbedder``) into the family config's form (``configs/sd1.json``): the UNet's widths, levels with
attention, blocks and heads, the VAE's, the noise schedule and prediction type, and the text encoder's
from the CLIP folder the config names (a Hugging Face name keeps the shipped CLIP-L). Another kind of
config (SD 2.x's OpenCLIP, SDXL's ``sgm``) is not read: :class:`UnsupportedConfig` says so, and the caller
keeps the shipped config of the family.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_LATENT_DIFFUSION = "ldm.models.diffusion.ddpm.LatentDiffusion"
_UNET = "ldm.modules.diffusionmodules.openaimodel.UNetModel"
_CLIP = "ldm.modules.encoders.modules.FrozenCLIPEmbedder"
#: CLIP text config fields read from a CLIP folder's config.json.
_CLIP_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "max_position_embeddings", "hidden_act", "projection_dim", "layer_norm_eps")


class UnsupportedConfig(ValueError):
    """A config this module does not read (what it is, and why)."""


def yaml_beside(checkpoint: str | os.PathLike) -> Path | None:
    """The config the WebUI would read for ``checkpoint`` (``<stem>.yaml`` beside it), or None."""
    path = Path(checkpoint).with_suffix(".yaml")
    return path if path.is_file() else None


def _clip_config(version: str, base: dict[str, Any]) -> dict[str, Any]:
    folder = Path(version)
    if not (folder / "config.json").is_file():
        return base  # a hub name (openai/clip-vit-large-patch14): the shipped CLIP-L
    found = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    found = found.get("text_config", found)
    return {**base, **{k: found[k] for k in _CLIP_FIELDS if k in found}}


def components_config(path: str | os.PathLike, family_config: dict[str, Any]) -> dict[str, Any]:
    """The component configs an SD 1.x LDM config describes, over ``family_config`` (the shipped sd1 one).

    Raises:
        UnsupportedConfig: not an SD 1.x LDM config (named).
        OSError, ValueError: the file cannot be read or parsed.
    """
    import yaml

    with open(path, encoding="utf-8") as f:
        model = (yaml.safe_load(f) or {}).get("model", {})
    params = model.get("params", {})
    unet_node, vae_node = params.get("unet_config", {}), params.get("first_stage_config", {})
    cond = params.get("cond_stage_config", {})
    kinds = (model.get("target"), unet_node.get("target"), cond.get("target"))
    if kinds != (_LATENT_DIFFUSION, _UNET, _CLIP):
        raise UnsupportedConfig(f"{path}: {' / '.join(str(k) for k in kinds)} is not an SD 1.x LDM config "
                                "(LatentDiffusion, UNetModel, FrozenCLIPEmbedder)")
    u, ddconfig = unet_node["params"], vae_node["params"]["ddconfig"]
    config = copy.deepcopy(family_config)
    widths = [u["model_channels"] * m for m in u["channel_mult"]]
    attention = [2**i in u.get("attention_resolutions", []) for i in range(len(widths))]
    heads = u.get("num_heads", -1)
    if heads in (-1, None):  # num_head_channels given instead
        heads = [w // u["num_head_channels"] for w in widths]
    depth = u.get("transformer_depth", 1)
    config["unet"].update(
        block_out_channels=widths, layers_per_block=u["num_res_blocks"],
        down_block_types=["CrossAttnDownBlock2D" if a else "DownBlock2D" for a in attention],
        up_block_types=["CrossAttnUpBlock2D" if a else "UpBlock2D" for a in reversed(attention)],
        cross_attention_dim=u["context_dim"], attention_head_dim=heads,
        use_linear_projection=bool(u.get("use_linear_in_transformer", False)),
        in_channels=u.get("in_channels", 4), out_channels=u.get("out_channels", 4),
    )
    if depth != 1:
        config["unet"]["transformer_layers_per_block"] = depth
    config["vae"].update(
        block_out_channels=[ddconfig["ch"] * m for m in ddconfig["ch_mult"]],
        down_block_types=["DownEncoderBlock2D"] * len(ddconfig["ch_mult"]),
        up_block_types=["UpDecoderBlock2D"] * len(ddconfig["ch_mult"]),
        layers_per_block=ddconfig["num_res_blocks"], latent_channels=ddconfig["z_channels"],
        scaling_factor=float(params.get("scale_factor", config["vae"]["scaling_factor"])),
    )
    encoder = config["text_encoders"][0]
    encoder["config"] = _clip_config(str(cond.get("params", {}).get("version", "")), encoder["config"])
    config["scheduler"].update(
        beta_start=float(params.get("linear_start", config["scheduler"]["beta_start"])),
        beta_end=float(params.get("linear_end", config["scheduler"]["beta_end"])),
        num_train_timesteps=int(params.get("timesteps", config["scheduler"]["num_train_timesteps"])),
        prediction_type="v_prediction" if params.get("parameterization") == "v" else "epsilon",
    )
    return config
