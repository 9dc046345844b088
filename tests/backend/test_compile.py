"""Compiled vs eager: registration forms, general models and tiny Stable Diffusion parts."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

import ov_backend
from ov_backend import OVBackend, build_settings

from .conftest import F32_ATOL, F32_RTOL, small_cnn


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=F32_ATOL, rtol=F32_RTOL)


def test_named_backend_with_options():
    model = small_cnn()
    compiled = torch.compile(model, backend="ov_backend", options={"config": {"INFERENCE_PRECISION_HINT": "f32"}})
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        _close(compiled(x), model(x))


def test_named_backend_rejects_unknown_option():
    compiled = torch.compile(small_cnn(), backend="ov_backend", options={"bogus": 1})
    with pytest.raises(Exception, match="unknown ov_backend option"):
        compiled(torch.randn(1, 3, 8, 8))


def test_entry_point_declared():
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="torch_dynamo_backends")}
    assert names.get("ov_backend") == "ov_backend.backend:ov_backend"


def test_callable_form_takes_settings(backend):
    assert isinstance(backend.settings, ov_backend.BackendSettings)
    direct = OVBackend(build_settings({"config": {"INFERENCE_PRECISION_HINT": "f32"}}))
    model = small_cnn()
    compiled = torch.compile(model, backend=direct)
    x = torch.randn(1, 3, 12, 12)
    with torch.no_grad():
        _close(compiled(x), model(x))
    (report,) = direct.reports
    assert report.route == "static" and report.fully_in_openvino
    assert direct.stats()["ov_calls"] == 1 and direct.stats()["eager_calls"] == 0


def test_transformer_encoder(backend):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        _close(compiled(x), model(x))
    assert all(r.route != "eager" for r in backend.reports)


def test_aot_autograd_route(tmp_path):
    backend = OVBackend({"aot_autograd": True, "config": {"INFERENCE_PRECISION_HINT": "f32"}})
    model = small_cnn()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        _close(compiled(x), model(x))
    assert backend.stats()["ov_calls"] >= 1


def test_tiny_unet(backend):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=4, norm_num_groups=8).eval()
    compiled = torch.compile(unet, backend=backend)
    x, t, c = torch.randn(2, 4, 8, 8), torch.tensor([10, 10]), torch.randn(2, 7, 32)
    with torch.no_grad():
        _close(compiled(x, t, c).sample, unet(x, t, c).sample)
    assert backend.reports[-1].fully_in_openvino


def test_tiny_vae_decode_and_encode(backend):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8,
                        layers_per_block=1).eval()
    decode = torch.compile(vae.decode, backend=backend)
    encode = torch.compile(vae.encode, backend=backend)
    z = torch.randn(1, 4, 8, 8)
    img = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        _close(decode(z).sample, vae.decode(z).sample)
        _close(encode(img).latent_dist.mean, vae.encode(img).latent_dist.mean)


def test_tiny_clip_text_model(backend):
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    config = CLIPTextConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=77)
    clip = CLIPTextModel(config).eval()
    compiled = torch.compile(clip, backend=backend)
    ids = torch.randint(0, 100, (2, 77))
    with torch.no_grad():
        _close(compiled(ids).last_hidden_state, clip(ids).last_hidden_state)
    assert backend.reports[-1].fully_in_openvino


def test_config_reaches_the_plugin():
    model = small_cnn()
    x = torch.randn(1, 3, 12, 12)
    f32 = OVBackend({"config": {"INFERENCE_PRECISION_HINT": "f32"}})
    with torch.no_grad():
        torch.compile(model, backend=f32)(x)
    assert f32.reports[0].precisions == ("f32",)
    assert f32.reports[0].execution_devices == ("CPU",)
    assert "ran on CPU, f32" in f32.reports[0].summary()


def test_extra_decomposition_changes_what_reaches_openvino():
    """silu disabled: it stays in PyTorch; decomposed first: its parts all run in OpenVINO."""
    model = small_cnn()
    x = torch.randn(1, 3, 12, 12)
    disabled = OVBackend({"disabled_ops": ["aten.silu.default"]})
    with torch.no_grad():
        torch.compile(model, backend=disabled)(x)
    assert "aten.silu.default" in disabled.reports[0].fallback_ops
    torch._dynamo.reset()
    decomposed = OVBackend({"disabled_ops": ["aten.silu.default"], "decompositions": ["aten.silu.default"]})
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=decomposed)(x), model(x), atol=1e-2, rtol=1e-2)
    assert decomposed.reports[0].fallback_ops == {}


def test_name_works_without_import_through_the_entry_point():
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "m = torch.nn.Linear(4, 2).eval()\n"
            "out = torch.compile(m, backend='ov_backend')(torch.ones(1, 4))\n"
            "assert 'ov_backend' in sys.modules, 'the entry point was not used'\n"
            "print(float((out - m(torch.ones(1, 4))).abs().max()))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1]) < 1e-2
