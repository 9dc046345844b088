"""The SD layer's backends: one per choice, the INT8-for-the-UNet rule, and a run's reports and counters."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from ov_accelerate_sd.backends import BackendChoice, Backends, part_precision
from ov_accelerate_sd.parts import PARTS

CHOICE = BackendChoice(device="CPU", precision="auto", model_caching=False, cache_dir=None)


def test_int8_is_for_the_unet_and_every_other_precision_for_every_part() -> None:
    assert [part_precision(part, "int8") for part in PARTS] == ["int8", "auto", "auto"]
    for precision in ("auto", "f32"):
        assert {part_precision(part, precision) for part in PARTS} == {precision}
    int8 = dataclasses.replace(CHOICE, precision="int8")
    assert int8.quantized and not CHOICE.quantized
    assert int8.for_part("vae") == CHOICE  # the VAE at INT8 runs on the "auto" backend, which it shares
    assert int8.for_part("unet") == int8


def test_one_backend_per_choice_made_from_its_options(tmp_path: Any) -> None:
    backends = Backends()
    choice = dataclasses.replace(CHOICE, cache_dir=str(tmp_path), precision="f32")
    backend = backends.backend(choice)
    assert backends.backend(dataclasses.replace(choice)) is backend  # equal choices: one backend
    assert backends.counter(choice).backend is backend
    assert backend.settings.precision == "f32" and backend.settings.cache_dir == tmp_path
    assert backends.existing(CHOICE) is None
    with pytest.raises(ValueError, match="unknown OpenVINO device"):
        backends.backend(dataclasses.replace(CHOICE, device="GPU.7"))
    assert backends.all() == [backend]


class Fake:
    """A backend with reports and counters only."""

    def __init__(self, choice: BackendChoice, weight_file: object = None) -> None:
        self.choice, self.reports, self.counts, self.was_reset, self.quantized = choice, [], {"ov_calls": 0.0}, False, 0

    def stats(self) -> dict[str, float]:
        return dict(self.counts)

    def calibrate(self) -> int:
        self.quantized += 1
        return 1

    def reset(self) -> None:
        self.was_reset = True


def test_a_runs_reports_and_counters_are_those_of_every_backend_since_it_began() -> None:
    backends = Backends(Fake)
    int8 = dataclasses.replace(CHOICE, precision="int8")
    unet, vae = backends.backend(int8.for_part("unet")), backends.backend(int8.for_part("vae"))
    unet.reports.append("unet before")
    unet.counts["ov_calls"] = 5
    mark = backends.mark()
    unet.reports.append("unet int8")
    unet.counts["ov_calls"] += 2
    vae.counts["ov_calls"] += 1
    f32 = backends.backend(dataclasses.replace(CHOICE, precision="f32"))  # made during the run: all of it counts
    f32.reports.append("vae f32")
    f32.counts["ov_calls"] = 3
    assert backends.reports_since(mark) == ["unet int8", "vae f32"]
    assert backends.stats_since(mark) == {"ov_calls": 6}
    assert backends.stats() == {"ov_calls": 11} and len(backends.reports()) == 3
    assert backends.calibrate(int8) == 1 and unet.quantized == 1 and vae.quantized == 0
    assert backends.calibrate(CHOICE) == 0
    backends.reset()
    assert unet.was_reset and vae.was_reset and f32.was_reset and backends.all() == []
    again = backends.backend(int8.for_part("unet"))  # made again after a reset: counted from zero, not from mark
    again.counts["ov_calls"] = 1
    again.reports.append("unet again")
    assert backends.stats_since(mark) == {"ov_calls": 1} and backends.reports_since(mark) == ["unet again"]


def test_the_command_line_routes_the_unet_at_int8_and_the_rest_at_auto(tmp_path: Any) -> None:
    pytest.importorskip("nncf")
    from types import SimpleNamespace

    from ov_accelerate_sd.accelerate import Accelerator
    from ov_accelerate_sd.settings import build_sd_settings

    class Part(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    vae = SimpleNamespace(decoder=Part(), encoder=Part())
    components = SimpleNamespace(unet=Part(), vae=vae, text_encoders=[Part()])
    settings = build_sd_settings({"precision": "int8", "cache_dir": str(tmp_path), "model_caching": False})
    accelerator = Accelerator(components, settings).apply()
    try:
        precisions = sorted(b.settings.precision for b in accelerator.backends.all())
        assert precisions == ["auto", "int8"]
    finally:
        accelerator.restore()
    assert accelerator.backends.all() == []


def test_eight_bit_weights_are_for_the_unet_and_the_text_encoders_not_the_vae() -> None:
    from ov_accelerate_sd.backends import part_precision

    assert [part_precision(part, "int8-weights") for part in ("unet", "text_encoder", "vae")] == [
        "int8-weights", "int8-weights", "auto"]
    assert [part_precision(part, "int8") for part in ("unet", "text_encoder", "vae")] == ["int8", "auto", "auto"]
    assert [part_precision(part, "f32") for part in ("unet", "text_encoder", "vae")] == ["f32"] * 3


def test_a_workers_threads_and_pinning_reach_the_plugins_config(tmp_path: Any) -> None:
    from ov_accelerate_sd.settings import build_sd_settings

    assert "config" not in CHOICE.options()  # by default the plugin chooses
    choice = build_sd_settings({"threads": 3, "cpu_pinning": False, "cache_dir": str(tmp_path)}).backend_choice()
    assert choice.options()["config"] == {"INFERENCE_NUM_THREADS": "3", "ENABLE_CPU_PINNING": "NO"}
    backend = Backends().backend(choice)  # ov_backend takes them as they are
    assert dict(backend.settings.config) == {"INFERENCE_NUM_THREADS": "3", "ENABLE_CPU_PINNING": "NO"}
    for bad in ({"threads": 0}, {"threads": True}, {"cpu_pinning": "no"}):
        with pytest.raises(ValueError):
            build_sd_settings(bad)


@pytest.mark.parametrize("quant_convs", [True, False])
def test_the_vaes_1x1_convolutions_are_routed_with_its_decoder_and_encoder(tmp_path: Any, quant_convs: bool) -> None:
    """diffusers' ``decode`` runs ``post_quant_conv`` before the decoder and ``encode`` ``quant_conv`` after the
    encoder: routed too, they run in OpenVINO (in PyTorch their sums followed its thread count). A VAE made
    without them has None there."""
    from types import SimpleNamespace

    from diffusers import AutoencoderKL

    from ov_accelerate_sd.accelerate import Accelerator
    from ov_accelerate_sd.settings import build_sd_settings

    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4,
                        use_quant_conv=quant_convs, use_post_quant_conv=quant_convs).eval()
    components = SimpleNamespace(unet=torch.nn.Identity(), vae=vae, text_encoders=[])
    settings = build_sd_settings({"accelerate": ["vae"], "cache_dir": str(tmp_path), "model_caching": False,
                                  "precision": "f32"})
    accelerator = Accelerator(components, settings)
    routed = [module for _, module in accelerator.targets()]
    expected = [vae.post_quant_conv, vae.decoder, vae.encoder, vae.quant_conv] if quant_convs \
        else [vae.decoder, vae.encoder]
    assert len(routed) == len(expected) and all(a is b for a, b in zip(routed, expected))
    image = torch.rand(1, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        want = vae.decode(vae.encode(image).latent_dist.mode()).sample
        accelerator.apply()
        try:
            got = vae.decode(vae.encode(image).latent_dist.mode()).sample
            assert accelerator.stats()["ov_calls"] == len(expected) and accelerator.stats()["eager_calls"] == 0
        finally:
            accelerator.restore()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
