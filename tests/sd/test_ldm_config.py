"""The LDM config beside a checkpoint (as the WebUI reads it), turned into this layer's component configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ov_accelerate_sd.ldm_config import UnsupportedConfig, components_config, yaml_beside
from ov_accelerate_sd.loader import family_config

TINY_SD1 = """
model:
  target: ldm.models.diffusion.ddpm.LatentDiffusion
  params:
    linear_start: 0.001
    linear_end: 0.02
    timesteps: 1000
    scale_factor: 0.2
    unet_config:
      target: ldm.modules.diffusionmodules.openaimodel.UNetModel
      params:
        in_channels: 4
        out_channels: 4
        model_channels: 32
        attention_resolutions: [2, 4]
        num_res_blocks: 1
        channel_mult: [1, 2, 2]
        num_heads: 2
        context_dim: 64
    first_stage_config:
      target: ldm.models.autoencoder.AutoencoderKL
      params:
        ddconfig: {z_channels: 4, ch: 16, ch_mult: [1, 2], num_res_blocks: 1}
    cond_stage_config:
      target: ldm.modules.encoders.modules.FrozenCLIPEmbedder
      params:
        version: {clip}
"""


def test_an_sd1_ldm_config_gives_the_widths_levels_heads_and_clip_it_names(tmp_path: Path) -> None:
    clip = tmp_path / "clip"
    clip.mkdir()
    (clip / "config.json").write_text(json.dumps({"hidden_size": 64, "intermediate_size": 256,
                                                  "num_hidden_layers": 2, "num_attention_heads": 2}))
    (tmp_path / "m.safetensors").write_bytes(b"")
    (tmp_path / "m.yaml").write_text(TINY_SD1.replace("{clip}", str(clip)))
    assert yaml_beside(tmp_path / "m.safetensors") == tmp_path / "m.yaml"
    assert yaml_beside(tmp_path / "other.safetensors") is None
    config = components_config(tmp_path / "m.yaml", family_config("sd1"))
    unet = config["unet"]
    assert unet["block_out_channels"] == [32, 64, 64] and unet["layers_per_block"] == 1
    # attention at downsampling factors 2 and 4: the second and third levels, not the first
    assert unet["down_block_types"] == ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"]
    assert unet["up_block_types"] == ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"]
    assert unet["cross_attention_dim"] == 64 and unet["attention_head_dim"] == 2
    assert config["vae"]["block_out_channels"] == [16, 32] and config["vae"]["scaling_factor"] == 0.2
    assert config["text_encoders"][0]["config"]["hidden_size"] == 64
    assert config["text_encoders"][0]["config"]["vocab_size"] == 49408  # kept from CLIP-L
    assert config["scheduler"]["beta_start"] == 0.001 and config["scheduler"]["beta_end"] == 0.02


def test_a_hub_name_keeps_clip_l_and_another_kind_of_config_is_named(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(TINY_SD1.replace("{clip}", "openai/clip-vit-large-patch14"))
    config = components_config(tmp_path / "a.yaml", family_config("sd1"))
    assert config["text_encoders"][0]["config"]["hidden_size"] == 768
    (tmp_path / "xl.yaml").write_text("model:\n  target: sgm.models.diffusion.DiffusionEngine\n")
    with pytest.raises(UnsupportedConfig, match="sgm.models.diffusion.DiffusionEngine"):
        components_config(tmp_path / "xl.yaml", family_config("sd1"))
