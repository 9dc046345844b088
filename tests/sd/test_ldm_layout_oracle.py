"""Checkpoint conversion checked against diffusers' own single-file converters (the oracle).

``ov_accelerate_sd.ldm_layout`` has one table per component, used both to read WebUI files and to write
the tiny test checkpoints, so a test that writes with it and reads back with it cannot see a wrong
row (``norm1`` <-> ``norm2``, OpenCLIP's q/k order, ...). Here diffusers 0.31's
``diffusers.loaders.single_file_utils`` converters, written independently for the same LDM/sgm layout,
read the same files:

- write direction: the files our writer makes, read by diffusers, give back the modules' exact tensors;
- read direction: an LDM-layout file whose every tensor is fresh random data, read by diffusers and by
  our loader, gives identical tensors under identical names.

Also the SD 2.x prediction-type probe, the path real SD 2.x files (no ``v_pred`` key, no metadata)
take: checked on ideal denoisers of a Gaussian data distribution, whose outputs are closed-form.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from diffusers import UNet2DConditionModel
from diffusers.loaders import single_file_utils as diffusers_single_file
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ov_accelerate_sd import loader
from ov_accelerate_sd.checkpoint import METADATA_CONFIG_KEY
from ov_accelerate_sd.loader import (
    load_components,
    random_components,
    save_webui_checkpoint,
    sd2_uses_v_prediction,
    tiny_config,
)
from ov_accelerate_sd.schedules import webui_alphas_cumprod

FAMILIES = ("sd1", "sd2", "sdxl")


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, tuple]]:
    """Like the session's tiny checkpoints, but no two tensors alike: fresh init leaves every norm at
    ones and every bias at zero, and a swap between two such tensors would go unseen."""
    folder = tmp_path_factory.mktemp("distinct")
    generator = torch.Generator().manual_seed(3)
    made = {}
    for family in FAMILIES:
        config = tiny_config(family)
        modules = random_components(config, seed=7)
        unet, vae, encoders = modules
        with torch.no_grad():
            for module in (unet, vae, *encoders):
                for tensor in module.parameters():
                    tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.1)
        made[family] = (save_webui_checkpoint(folder / f"{family}.safetensors", family, config, *modules), modules)
    return made


def _diffusers_reads(
    state: Mapping[str, torch.Tensor], config: Mapping, encoders: list[torch.nn.Module]
) -> dict[str, dict[str, torch.Tensor]]:
    """What diffusers' converters make of a WebUI-layout state dict: component -> state dict."""
    out = {
        "unet": diffusers_single_file.convert_ldm_unet_checkpoint(dict(state), dict(config["unet"])),
        "vae": diffusers_single_file.convert_ldm_vae_checkpoint(dict(state), dict(config["vae"])),
    }
    for index, (spec, encoder) in enumerate(zip(config["text_encoders"], encoders)):
        if spec["layout"] == "hf_clip":
            read = diffusers_single_file.convert_ldm_clip_checkpoint(dict(state))
        else:
            read = diffusers_single_file.convert_open_clip_checkpoint(encoder, dict(state), prefix=spec["ldm_prefix"])
        out[f"text_encoder_{index}"] = read
    return out


def _assert_same(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], what: str) -> None:
    got = {k: v for k, v in got.items() if not k.endswith("position_ids")}
    want = {k: v for k, v in want.items() if not k.endswith("position_ids")}
    assert sorted(got) == sorted(want), f"{what}: names differ: {sorted(set(got) ^ set(want))[:6]}"
    wrong = [k for k in want if got[k].shape != want[k].shape or not torch.equal(got[k], want[k])]
    assert not wrong, f"{what}: {len(wrong)} tensor(s) differ, e.g. {wrong[:6]}"


def _file_config(path: Path) -> dict:
    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()[METADATA_CONFIG_KEY])


@pytest.mark.parametrize("family", FAMILIES)
def test_diffusers_reads_our_written_checkpoint_as_the_original_modules(tiny_checkpoints: dict, family: str) -> None:
    path, (unet, vae, encoders) = tiny_checkpoints[family]
    read = _diffusers_reads(load_file(str(path)), _file_config(path), encoders)
    _assert_same(read["unet"], unet.state_dict(), "UNet")
    _assert_same(read["vae"], vae.state_dict(), "VAE")
    for index, encoder in enumerate(encoders):
        _assert_same(read[f"text_encoder_{index}"], encoder.state_dict(), f"text encoder {index}")


@pytest.mark.parametrize("family", FAMILIES)
def test_we_read_a_webui_file_as_diffusers_does(tiny_checkpoints: dict, family: str, tmp_path: Path) -> None:
    """Every tensor of the file replaced by fresh random data: a swapped row moves data to a wrong name."""
    source, (_, _, encoders) = tiny_checkpoints[family]
    generator = torch.Generator().manual_seed(5)
    state = {
        k: torch.randn(v.shape, generator=generator, dtype=torch.float32).to(v.dtype) if v.is_floating_point() else v
        for k, v in load_file(str(source)).items()
    }
    with safe_open(str(source), "pt") as f:
        metadata = f.metadata()
    path = tmp_path / f"random-{family}.safetensors"
    save_file(state, str(path), metadata=metadata)

    ours = load_components(path)
    want = _diffusers_reads(state, _file_config(path), encoders)
    _assert_same(ours.unet.state_dict(), want["unet"], "UNet")
    _assert_same(ours.vae.state_dict(), want["vae"], "VAE")
    for index, encoder in enumerate(ours.text_encoders):
        _assert_same(encoder.state_dict(), want[f"text_encoder_{index}"], f"text encoder {index}")


def test_hand_written_names_of_a_resnet_and_an_open_clip_block(tiny_checkpoints: dict) -> None:
    """The LDM names diffusers' converter and ours agree on, for the rows the review found untested."""
    sd1 = load_file(str(tiny_checkpoints["sd1"][0]))
    unet = tiny_checkpoints["sd1"][1][0].state_dict()
    resnet = "model.diffusion_model.input_blocks.1.0."
    assert torch.equal(sd1[resnet + "in_layers.0.weight"], unet["down_blocks.0.resnets.0.norm1.weight"])
    assert torch.equal(sd1[resnet + "out_layers.0.weight"], unet["down_blocks.0.resnets.0.norm2.weight"])
    sd2 = load_file(str(tiny_checkpoints["sd2"][0]))
    clip = tiny_checkpoints["sd2"][1][2][0].state_dict()
    qkv = sd2["cond_stage_model.model.transformer.resblocks.1.attn.in_proj_weight"]
    layer = "text_model.encoder.layers.1.self_attn."
    assert torch.equal(qkv, torch.cat([clip[layer + f"{n}_proj.weight"] for n in "qkv"]))


# -- SD 2.x: epsilon or v-prediction, from the weights ------------------------------------------------


def _ideal_prediction(kind: str, data_std: float, alphas_cumprod: torch.Tensor) -> callable:
    """The exact conditional mean a perfect model of ``kind`` returns when the data are N(0, data_std^2).

    With x_t = a x0 + b eps (a^2 = alphas_cumprod[t], b^2 = 1 - a^2) both x0 and eps are Gaussian given x_t:
    E[x0 | x_t] = a s^2 x_t / (a^2 s^2 + b^2), E[eps | x_t] = b x_t / (a^2 s^2 + b^2), and v = a eps - b x0.
    """

    def forward(sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor, **_: object):
        ab = alphas_cumprod[int(torch.as_tensor(timestep).reshape(-1)[0])].double()
        a, b, s2 = ab.sqrt(), (1 - ab).sqrt(), data_std**2
        x = sample.double()
        x0, eps = a * s2 * x / (a * a * s2 + b * b), b * x / (a * a * s2 + b * b)
        out = eps if kind == "epsilon" else a * eps - b * x0
        return SimpleNamespace(sample=out.to(sample.dtype))

    return forward


class _IdealUNet(torch.nn.Module):
    def __init__(self, kind: str, data_std: float, alphas_cumprod: torch.Tensor) -> None:
        super().__init__()
        self.config = SimpleNamespace(in_channels=4, cross_attention_dim=16)
        self.dtype, self.device = torch.float32, torch.device("cpu")
        self._forward = _ideal_prediction(kind, data_std, alphas_cumprod)

    def forward(self, *args: object, **kwargs: object) -> SimpleNamespace:
        return self._forward(*args, **kwargs)


SD2_ALPHAS = webui_alphas_cumprod(loader.family_config("sd2")["scheduler"])


@pytest.mark.parametrize("data_std", [0.3, 1.0, 4.0])
@pytest.mark.parametrize("kind", ["epsilon", "v_prediction"])
def test_probe_tells_ideal_epsilon_and_v_models_apart(kind: str, data_std: float) -> None:
    unet = _IdealUNet(kind, data_std, SD2_ALPHAS)
    assert sd2_uses_v_prediction(unet) == (kind == "v_prediction")


@pytest.mark.parametrize("kind", ["epsilon", "v_prediction"])
def test_sd2_file_without_marker_is_probed(
    tiny_checkpoints: dict, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real SD 2.x file: no ``v_pred`` key and none of our metadata; the family's shipped config applies."""
    config = tiny_config("sd2")
    state = {k: v for k, v in load_file(str(tiny_checkpoints["sd2"][0])).items() if k != "v_pred"}
    path = tmp_path / "plain-sd2.safetensors"
    save_file(state, str(path))
    monkeypatch.setattr(loader, "family_config", lambda family: copy.deepcopy(config))
    ideal = _ideal_prediction(kind, 1.0, SD2_ALPHAS)
    monkeypatch.setattr(UNet2DConditionModel, "forward", lambda self, *args, **kwargs: ideal(*args, **kwargs))
    assert load_components(path).scheduler_config["prediction_type"] == kind
    assert load_components(path, prediction_type="epsilon").scheduler_config["prediction_type"] == "epsilon"
