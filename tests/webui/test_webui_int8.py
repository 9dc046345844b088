"""The INT8 precision through the script on the fake host: calibration at the end of the first generation,
the UNet only, LoRA-style weight changes, and a clear message without NNCF."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import pytest
import torch
from conftest import make_p

pytestmark = pytest.mark.skipif(importlib.util.find_spec("nncf") is None, reason="nncf is not installed")


@pytest.fixture
def int8(tmp_path: Any) -> Any:
    from ov_accelerate_webui.settings import build_settings

    return build_settings({"precision": "int8", "cache_dir": str(tmp_path / "cache")})


def test_a_weight_change_runs_at_float_and_is_quantized_again(fake_host: Any, extension: Any, int8: Any) -> None:
    int8 = dataclasses.replace(int8, vae=False, text_encoder=False)
    extension.run(make_p(fake_host, steps=2), int8)
    unet = fake_host.model.model.diffusion_model.unet
    with torch.no_grad():  # what A1111's networks do: change Linear/Conv weights in place
        for module in unet.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.shape[0] == module.weight.shape[1]:
                module.weight.add_(0.3 * torch.randn_like(module.weight))
    extension.run(make_p(fake_host, steps=2), int8)
    status = extension.last_status
    assert "recorded for calibration" in status and "INT8 quantization; calibrated on 2 recorded call(s)" in status, \
        status
    extension.run(make_p(fake_host, steps=2), int8)
    assert "INT8 model" in extension.last_status and "INT8 quantization" not in extension.last_status


def test_int8_without_nncf_makes_the_image_in_pytorch_and_says_what_to_install(
    fake_host: Any, extension: Any, int8: Any, monkeypatch: Any
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nncf" else real(name, *a))
    processed = extension.run(make_p(fake_host), int8)
    assert len(processed.images) == 1
    assert "INT8 needs NNCF" in processed.comments and "pip install nncf==3.4.0" in processed.comments
    assert "OpenVINO" not in processed.infotexts[0]


def test_short_of_memory_for_nncf_the_unet_stays_at_float_and_the_status_says_so_first(
    fake_host: Any, extension: Any, int8: Any, monkeypatch: Any
) -> None:
    """Quantizing needs about 1.6x the UNet's weights at f32 beside the WebUI (NNCF's statistics model): short of
    that, the image is still made, the UNet stays at float in OpenVINO, and the status says so under its first
    line (which names the chosen precision), at this generation and the next."""
    from ov_backend import memory_guard

    monkeypatch.setattr(memory_guard, "quantize_bytes", lambda model: 1 << 50)
    processed = extension.run(make_p(fake_host, steps=2), int8)
    assert len(processed.images) == 1
    status = extension.last_status
    line = "Not at INT8: the UNet runs at float in OpenVINO instead, because of not enough memory to quantize it"
    assert status.splitlines()[1].startswith(line), status
    assert "Nothing fell back to PyTorch." in status, status
    extension.run(make_p(fake_host, steps=2), int8)
    assert line in extension.last_status and "INT8 model" not in extension.last_status, extension.last_status


def test_precompile_does_not_calibrate_the_next_generation_does(fake_host: Any, extension: Any, int8: Any) -> None:
    """Pre-compile's 1-step runs are too few to calibrate on: they are recorded, and the next generation
    quantizes on them and its own steps."""
    from ov_accelerate_webui.settings import FIELD_NAMES
    from ov_accelerate_webui.ui import PanelHandlers

    args = [getattr(int8, name) for name in FIELD_NAMES]
    assert list(PanelHandlers(extension).precompile("64x64, 96x64", 1, *args))[-1][0] == "Ready: 64x64, 96x64."
    assert "INT8 quantization" not in extension.last_status
    extension.run(make_p(fake_host, steps=3), int8)
    assert "INT8 quantization; calibrated on 5 recorded call(s)" in extension.last_status, extension.last_status


def test_the_first_generation_calibrates_then_the_unet_runs_int8_and_switching_precision_releases_the_other(
    fake_host: Any, extension: Any, int8: Any, monkeypatch: Any
) -> None:
    """The first INT8 generation runs the UNet at float while its calls are recorded, and quantizes at its end;
    the next runs the INT8 UNet (the VAE and text encoder stay at auto). The UNet compiled at Automatic must not
    stay in memory beside the INT8 one (nor the other way round): switching releases it (its converted model
    stays, so going back costs a compile, not a conversion)."""
    import gc
    import weakref

    from ov_backend import runtime

    compiled_models: list[weakref.ref] = []
    init = runtime.OVRunner.__init__

    def tracked(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        compiled_models.append(weakref.ref(self.compiled))

    def alive() -> int:
        gc.collect()
        return sum(ref() is not None for ref in compiled_models)

    auto = dataclasses.replace(int8, precision="auto")
    monkeypatch.setattr(runtime.OVRunner, "__init__", tracked)
    extension.run(make_p(fake_host, steps=3), auto)
    at_auto = alive()  # UNet, VAE decoder and text encoder
    assert at_auto >= 3

    first = extension.run(make_p(fake_host, steps=3), int8)
    status = extension.last_status
    assert "INT8: runs at float while 8 call(s) are recorded for calibration" in status, status
    assert "INT8 quantization; calibrated on 3 recorded call(s)" in status, status
    assert 'OpenVINO: "CPU, UNet+VAE+TE, int8"' in first.infotexts[0]
    assert "Released 1 compiled model(s)" in status and "precisions" in status, status

    again = extension.run(make_p(fake_host, steps=3), int8)  # the INT8 UNet compiled: still one UNet in memory
    status = extension.last_status
    assert "INT8 model" in status and "INT8 quantization" not in status, status
    assert status.count("INT8 model") == 1, status  # only the UNet: the VAE and text encoder stay at auto
    assert extension.last_run_report()["ov_calls"] > 0
    assert len(again.images) == 1
    assert alive() == at_auto, status

    back = extension.run(make_p(fake_host, steps=3), auto)
    status = extension.last_status
    assert "Released 1 compiled model(s)" in status and "convert 0.00s" in status, status
    assert alive() == at_auto and len(back.images) == 1

    # another backend (f32): the release of the auto builds is reported in its run's status too
    extension.run(make_p(fake_host, steps=3), dataclasses.replace(int8, precision="f32"))
    assert "Released 3 compiled model(s)" in extension.last_status, extension.last_status
    assert alive() == at_auto
