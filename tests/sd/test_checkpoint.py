"""Loading WebUI checkpoints: round trip, family detection, and the errors for bad files."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ov_accelerate_sd.checkpoint import CheckpointError, detect_family, read_checkpoint
from ov_accelerate_sd.ldm_layout import unet_rules, vae_rules
from ov_accelerate_sd.loader import family_config, load_components


@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_checkpoint_loads_back_with_equal_weights(tiny_checkpoints: dict, family: str) -> None:
    path, (unet, vae, encoders) = tiny_checkpoints[family]
    components = load_components(path)
    assert components.family == family
    pairs = [(unet, components.unet), (vae, components.vae)] + list(zip(encoders, components.text_encoders))
    for original, loaded in pairs:
        want, got = original.state_dict(), loaded.state_dict()
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(want[key], got[key]), key


def test_written_file_uses_the_webui_key_names(tiny_checkpoints: dict) -> None:
    keys = set(load_file(str(tiny_checkpoints["sd1"][0])))
    for key in (
        "model.diffusion_model.input_blocks.0.0.weight",
        "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight",
        "model.diffusion_model.input_blocks.1.0.in_layers.2.weight",
        "model.diffusion_model.middle_block.1.proj_in.weight",
        "model.diffusion_model.out.2.weight",
        "model.diffusion_model.time_embed.0.weight",
        "first_stage_model.decoder.mid.attn_1.q.weight",
        "first_stage_model.encoder.down.0.downsample.conv.weight",
        "first_stage_model.decoder.up.3.upsample.conv.weight",
        "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight",
    ):
        assert key in keys, key
    sd2 = set(load_file(str(tiny_checkpoints["sd2"][0])))
    assert "cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight" in sd2
    sdxl = set(load_file(str(tiny_checkpoints["sdxl"][0])))
    assert "conditioner.embedders.1.model.text_projection" in sdxl
    assert "model.diffusion_model.label_emb.0.0.weight" in sdxl


@pytest.mark.parametrize(
    ("family", "diffusers_key", "webui_key"),
    [
        ("sd1", "down_blocks.0.downsamplers.0.conv.weight", "input_blocks.3.0.op.weight"),
        ("sd1", "down_blocks.3.resnets.1.conv2.bias", "input_blocks.11.0.out_layers.3.bias"),
        ("sd1", "up_blocks.0.upsamplers.0.conv.weight", "output_blocks.2.1.conv.weight"),
        ("sd1", "up_blocks.1.upsamplers.0.conv.weight", "output_blocks.5.2.conv.weight"),
        ("sd1", "up_blocks.3.attentions.2.proj_out.weight", "output_blocks.11.1.proj_out.weight"),
        ("sd1", "mid_block.resnets.1.time_emb_proj.weight", "middle_block.2.emb_layers.1.weight"),
        ("sdxl", "down_blocks.2.attentions.1.transformer_blocks.9.ff.net.2.weight",
         "input_blocks.8.1.transformer_blocks.9.ff.net.2.weight"),
        ("sdxl", "up_blocks.0.upsamplers.0.conv.weight", "output_blocks.2.2.conv.weight"),
        ("sdxl", "up_blocks.2.resnets.2.conv_shortcut.weight", "output_blocks.8.0.skip_connection.weight"),
    ],
)
def test_full_size_unet_names_match_webui_files(family: str, diffusers_key: str, webui_key: str) -> None:
    """Names as they are in real SD 1.5 / SDXL base files (layers_per_block 2)."""
    assert unet_rules(family_config(family)["unet"]).map(diffusers_key) == webui_key


def test_full_size_vae_names_match_webui_files() -> None:
    rules = vae_rules(family_config("sd1")["vae"])
    assert rules.map("decoder.up_blocks.0.resnets.0.conv1.weight") == "decoder.up.3.block.0.conv1.weight"
    assert rules.map("decoder.up_blocks.2.upsamplers.0.conv.bias") == "decoder.up.1.upsample.conv.bias"
    assert rules.map("encoder.down_blocks.1.resnets.0.conv_shortcut.weight") == (
        "encoder.down.1.block.0.nin_shortcut.weight"
    )
    assert rules.map("encoder.mid_block.attentions.0.to_out.0.weight") == "encoder.mid.attn_1.proj_out.weight"


@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_family_detected_from_keys(tiny_checkpoints: dict, family: str) -> None:
    checkpoint = read_checkpoint(tiny_checkpoints[family][0])
    assert checkpoint.family == family
    assert detect_family("x", checkpoint.state_dict) == family


def test_sd2_v_prediction_marker(tiny_checkpoints: dict) -> None:
    components = load_components(tiny_checkpoints["sd2"][0])
    assert components.scheduler_config["prediction_type"] == "v_prediction"
    assert load_components(tiny_checkpoints["sd1"][0]).scheduler_config["prediction_type"] == "epsilon"


def _error(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(path)
    assert str(path) in str(info.value)
    return info.value.reason


def test_not_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"PK\x03\x04 this is a zip, not safetensors" * 10)
    assert "not a safetensors file" in _error(path)


def test_truncated(tmp_path: Path, sd1_checkpoint: Path) -> None:
    path = tmp_path / "cut.safetensors"
    data = sd1_checkpoint.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert _error(path).startswith("truncated")


def test_no_unet_keys(tmp_path: Path) -> None:
    path = tmp_path / "lora.safetensors"
    save_file({"lora_unet_down.weight": torch.zeros(2, 2)}, str(path))
    assert "no UNet keys" in _error(path)


def test_unsupported_family(tmp_path: Path) -> None:
    path = tmp_path / "inpaint.safetensors"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(8, 9, 3, 3)}, str(path))
    assert "unsupported family" in _error(path)


class _Evil:
    def __reduce__(self) -> tuple:
        return (print, ("code ran",))


def test_pickle_needing_more_than_weights_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {"x": torch.zeros(1)}, "extra": _Evil()}, path)
    reason = _error(path)
    assert reason.startswith("refused") and "weights_only" in reason


def test_plain_ckpt_is_read_with_weights_only(tmp_path: Path, sd1_checkpoint: Path) -> None:
    path = tmp_path / "model.ckpt"
    torch.save({"state_dict": load_file(str(sd1_checkpoint)), "global_step": 1}, path)
    assert read_checkpoint(path).family == "sd1"


def test_not_a_pickle(tmp_path: Path) -> None:
    path = tmp_path / "broken.ckpt"
    path.write_bytes(pickle.dumps([1, 2, 3])[:5])
    assert "not a PyTorch checkpoint" in _error(path) or "refused" in _error(path)


def test_separate_vae_file(tmp_path: Path, tiny_checkpoints: dict) -> None:
    path, _ = tiny_checkpoints["sd1"]
    state = load_file(str(path))
    vae = {k[len("first_stage_model."):]: v + 1 for k, v in state.items() if k.startswith("first_stage_model.")}
    vae_path = tmp_path / "other.vae.safetensors"
    save_file(vae, str(vae_path))
    components = load_components(path, vae_path=vae_path)
    got = components.vae.state_dict()["decoder.conv_in.weight"]
    assert torch.equal(got, vae["decoder.conv_in.weight"])
