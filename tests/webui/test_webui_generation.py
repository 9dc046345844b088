"""Generation through the script against the fake host: routing, restore, images, infotext, weights."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from conftest import IMAGE_TOLERANCE, make_p, max_pixel_diff

from ov_accelerate_webui.routing import is_routed


def routed_modules(model: Any) -> dict[str, bool]:
    return {
        "unet": is_routed(model.model.diffusion_model),
        "vae_decoder": is_routed(model.first_stage_model.decoder),
        "vae_encoder": is_routed(model.first_stage_model.encoder),
        "text_encoder": is_routed(model.cond_stage_model.wrapped.transformer.text_model.encoder),
    }


def test_routed_during_process_images_and_restored_after(fake_host: Any, extension: Any, f32: Any) -> None:
    seen: list[dict[str, bool]] = []
    fake_host.callbacks.on_cfg_denoiser(lambda params: seen.append(routed_modules(fake_host.model)))
    baseline = fake_host.processing.process_images(make_p(fake_host))
    assert seen and not any(any(s.values()) for s in seen)
    seen.clear()

    processed = extension.run(make_p(fake_host), f32)

    assert seen and all(all(s.values()) for s in seen), seen
    assert not any(routed_modules(fake_host.model).values())
    assert max_pixel_diff(processed, baseline) <= IMAGE_TOLERANCE
    assert "OpenVINO" in processed.comments and "model.diffusion_model" in processed.comments
    assert extension.last_status in processed.comments
    assert 'OpenVINO: "CPU, UNet+VAE+TE, f32"' in processed.infotexts[0]


def test_restored_after_exception(fake_host: Any, extension: Any, f32: Any) -> None:
    def boom(params: Any) -> None:
        if params.sampling_step == 1:
            raise RuntimeError("sampler failed")

    fake_host.callbacks.on_cfg_denoiser(boom)
    with pytest.raises(RuntimeError, match="sampler failed"):
        extension.run(make_p(fake_host), f32)
    assert not any(routed_modules(fake_host.model).values())


def test_restored_after_interrupt(fake_host: Any, extension: Any, f32: Any) -> None:
    state = fake_host.shared.state

    def interrupt(params: Any) -> None:
        state.interrupt()

    fake_host.callbacks.on_cfg_denoiser(interrupt)
    processed = extension.run(make_p(fake_host, steps=3), f32)
    assert state.sampling_step == 0 and len(processed.images) == 1
    assert not any(routed_modules(fake_host.model).values())


def test_lora_style_in_place_weight_change_is_picked_up(fake_host: Any, extension: Any, f32: Any) -> None:
    f32 = dataclasses.replace(f32, vae=False, text_encoder=False)  # the UNet is what changes (and costs)
    first = extension.run(make_p(fake_host), f32)
    unet = fake_host.model.model.diffusion_model.unet
    with torch.no_grad():  # what A1111's networks do: change Linear/Conv weights in place
        for module in unet.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.shape[0] == module.weight.shape[1]:
                module.weight.add_(0.3 * torch.randn_like(module.weight))
    baseline = fake_host.processing.process_images(make_p(fake_host))
    assert max_pixel_diff(baseline, first) > IMAGE_TOLERANCE, "the weight change must change the image"

    second = extension.run(make_p(fake_host), f32)
    assert max_pixel_diff(second, baseline) <= IMAGE_TOLERANCE


def test_checkpoint_change(fake_host: Any, extension: Any, f32: Any) -> None:
    f32 = dataclasses.replace(f32, vae=False, text_encoder=False)  # one part shows it; each compile costs
    extension.run(make_p(fake_host), f32)
    other = fake_host.sd_models.load_model(
        fake_host.make_model(seed=7), fake_host.sd_models.CheckpointInfo(str(fake_host.tmp_path / "b.ckpt"), "b" * 64)
    )
    baseline = fake_host.processing.process_images(make_p(fake_host, model=other))

    processed = extension.run(make_p(fake_host, model=other), f32)

    assert max_pixel_diff(processed, baseline) <= IMAGE_TOLERANCE
    assert not any(routed_modules(fake_host.model).values()) and not any(routed_modules(other).values())


@pytest.mark.parametrize("available", [0.5, 0.2])
def test_a_checkpoint_loaded_in_place_keeps_the_routes(fake_host: Any, extension: Any, tmp_path: Any,
                                                       monkeypatch: Any, available: float) -> None:
    """A1111 loads a checkpoint of the same architecture into the model it has: nothing is captured again,
    each checkpoint's picture is stock's, and going back to the first is never a conversion: with memory
    to spare (half of it available) the first checkpoint's compiled models stayed and nothing compiles;
    short of memory (a fifth) they went, and it is a compile of the model converted before."""
    from ov_accelerate_webui.settings import build_settings
    from ov_backend import memory, variants

    monkeypatch.setattr(variants, "system_memory", lambda: memory.SystemMemory(16 << 30, int(available * (16 << 30))))

    settings = build_settings({"precision": "f32", "vae": False, "text_encoder": False,
                               "cache_dir": str(tmp_path / "cache")})
    sd_models = fake_host.sd_models
    info_a = fake_host.model.sd_checkpoint_info
    first = extension.run(make_p(fake_host), settings)
    accelerator = extension.accelerator()
    run = accelerator.prepare(fake_host.model, settings, "unused", window="continue")
    backend = accelerator.backend_of(run, "unet")
    graphs = len(backend.reports)
    info_b = sd_models.CheckpointInfo(str(tmp_path / "same-arch.ckpt"), "c" * 64, config=info_a.config,
                                      factory=lambda: fake_host.make_model(seed=11)).register()

    model = sd_models.reload_model_weights(info=info_b)
    assert model is fake_host.model, "the fake host loads a same-config checkpoint in place, as A1111 does"
    baseline = fake_host.processing.process_images(make_p(fake_host))
    assert max_pixel_diff(baseline, first) > IMAGE_TOLERANCE, "another checkpoint, another picture"
    switched = extension.run(make_p(fake_host), settings)
    assert max_pixel_diff(switched, baseline) <= IMAGE_TOLERANCE
    assert accelerator.backend_of(accelerator.prepare(model, settings, "unused", window="continue"), "unet") is backend

    kept = extension.last_run_report()
    assert ("Kept " in kept["status"]) == (available > 1 / 3), kept["status"]

    sd_models.reload_model_weights(info=info_a)
    back = extension.run(make_p(fake_host), settings)
    assert max_pixel_diff(back, first) <= IMAGE_TOLERANCE
    report = extension.last_run_report()
    assert report["convert_seconds"] == 0, report["status"]  # from the disk cache, or the model converted before
    assert len(backend.reports) > graphs  # the second checkpoint's compile
    if available > 1 / 3:
        assert report["compiles"] == 0 and "No new compile" in report["status"], report["status"]
    else:
        assert report["compiles"] > 0, report["status"]


def test_unchecked_parts_stay_in_pytorch(fake_host: Any, extension: Any, f32: Any) -> None:
    seen: list[dict[str, bool]] = []
    fake_host.callbacks.on_cfg_denoiser(lambda params: seen.append(routed_modules(fake_host.model)))
    settings = dataclasses.replace(f32, vae=False, text_encoder=False)
    processed = extension.run(make_p(fake_host), settings)
    assert seen[0] == {"unet": True, "vae_decoder": False, "vae_encoder": False, "text_encoder": False}
    assert 'OpenVINO: "CPU, UNet, f32"' in processed.infotexts[0]


@pytest.mark.parametrize("kind", ["forge", "sd3"])
def test_unsupported_model_gets_message_and_still_generates(
    fake_host: Any, extension: Any, f32: Any, kind: str
) -> None:
    model = fake_host.model
    if kind == "forge":
        model.forge_objects = object()
    else:
        model.is_sd1, model.is_sd3 = False, True
    baseline = fake_host.processing.process_images(make_p(fake_host))

    processed = extension.run(make_p(fake_host), f32)

    assert max_pixel_diff(processed, baseline) == 0
    assert "plain PyTorch" in processed.comments
    assert ("Forge" if kind == "forge" else "SD3") in processed.comments
    assert "OpenVINO" not in processed.infotexts[0]


def test_backend_missing_gets_message_and_still_generates(fake_host: Any, f32: Any) -> None:
    from ov_accelerate_webui.backend_bridge import BackendUnavailable
    from ov_accelerate_webui.extension import Extension

    def missing() -> Any:
        raise BackendUnavailable("OpenVINO acceleration is unavailable: No module named 'openvino'. Restart ...")

    processed = Extension(load_api=missing).run(make_p(fake_host), f32)
    assert len(processed.images) == 1 and "No module named 'openvino'" in processed.comments
