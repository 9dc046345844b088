"""What A1111's pipeline does around the model, with the script on: the refiner (a new model object,
or weights loaded into the same one), inpainting (latent mask; a 9-channel inpainting checkpoint with
``c_concat``), live previews decoded by the routed VAE, textual-inversion embeddings.

Runs after ``test_webui_generation.py``: the tiny checkpoints of seeds 0 and 7 come from the session's
disk cache.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np
import torch
from conftest import IMAGE_TOLERANCE, ROUNDED_IMAGE_TOLERANCE, load_family, make_p, max_pixel_diff
from PIL import Image

from ov_accelerate_webui.routing import is_routed

INIT_IMAGE = Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8))
MASK = Image.fromarray(np.tile((np.arange(64) >= 24).astype(np.uint8) * 255, (64, 1)))  # right part repainted


def routed_parts(model: Any) -> dict[str, bool]:
    clip = getattr(model.cond_stage_model, "wrapped", model.cond_stage_model).transformer
    return {
        "unet": is_routed(model.model.diffusion_model),
        "vae_decoder": is_routed(model.first_stage_model.decoder),
        "vae_encoder": is_routed(model.first_stage_model.encoder),
        "text_encoder": is_routed(clip.text_model.encoder),
    }


def record_steps(host: Any) -> list[tuple[Any, dict[str, bool], int]]:
    """(loaded model, which of its parts are routed, progress step) before each UNet step."""
    seen: list[tuple[Any, dict[str, bool], int]] = []
    host.callbacks.on_cfg_denoiser(
        lambda params: seen.append(
            (host.shared.sd_model, routed_parts(host.shared.sd_model), host.shared.state.sampling_step)
        )
    )
    return seen


def refiner(host: Any, config: str | None) -> Any:
    """A refiner checkpoint: the base's VAE and text encoder weights, the UNet of seed 7 (compiled by
    ``test_checkpoint_change``); ``config`` None: the base model's config."""
    from tiny_model import build_unet

    def build() -> Any:
        model = host.make_model(seed=0)
        model.model.diffusion_model.unet.load_state_dict(build_unet(7).state_dict())
        return model

    return host.sd_models.CheckpointInfo(
        str(host.tmp_path / "tiny-refiner.safetensors"),
        "f" * 64,
        config=config or host.shared.sd_model.used_config,
        factory=build,
    ).register()


def test_refiner_on_a_new_model_object_is_routed_and_both_models_restored(
    fake_host: Any, extension: Any, f32: Any
) -> None:
    info = refiner(fake_host, config="tiny-refiner-config")  # another config: A1111 builds a new model object
    kwargs = {"refiner_checkpoint": info.title, "refiner_switch_at": 0.5, "steps": 4}
    seen = record_steps(fake_host)
    baseline = fake_host.processing.process_images(make_p(fake_host, **kwargs))
    assert [m.sd_checkpoint_info.title for m, _r, _s in seen] == [fake_host.model.sd_checkpoint_info.title] * 2 + [
        info.title
    ] * 2
    seen.clear()

    processed = extension.run(make_p(fake_host, **kwargs), f32)

    models = list({id(m): m for m, _r, _s in seen}.values())
    assert [m.sd_checkpoint_info.title for m in models] == [fake_host.model.sd_checkpoint_info.title, info.title]
    assert all(all(r.values()) for _m, r, _s in seen), "base and refiner steps run through OpenVINO"
    assert not any(any(routed_parts(m).values()) for m in models), "both models restored"
    assert max_pixel_diff(processed, baseline) <= IMAGE_TOLERANCE
    assert "Refiner: tiny-refiner" in processed.infotexts[0]
    assert 'OpenVINO: "CPU, UNet+VAE+TE, f32"' in processed.infotexts[0]
    status = extension.last_status
    assert "tiny-refiner: switched to a new model object, routed" in status
    assert "tiny-refiner: model.diffusion_model (2 calls)" in status, status
    assert "tiny-refiner: first_stage_model.decoder (1 call)" in status, "the refiner's VAE decodes the image"
    # the base's UNet is idle after the switch: not mistaken for a UNet something else runs around its route
    assert not extension.last_run_report()["pytorch"] and "Ran in PyTorch" not in status, status


def test_refiner_loaded_into_the_same_model_object_never_runs_stale_weights(
    fake_host: Any, extension: Any, f32: Any
) -> None:
    settings = dataclasses.replace(f32, vae=False)
    info = refiner(fake_host, config=None)  # same config: A1111 loads the refiner's weights in place
    kwargs = {"refiner_checkpoint": info.title, "refiner_switch_at": 0.5, "steps": 4}
    without_refiner = fake_host.processing.process_images(make_p(fake_host, steps=4))
    seen = record_steps(fake_host)
    baseline = fake_host.processing.process_images(make_p(fake_host, **kwargs))
    assert len({id(m) for m, _r, _s in seen}) == 1 and max_pixel_diff(baseline, without_refiner) > IMAGE_TOLERANCE
    seen.clear()

    processed = extension.run(make_p(fake_host, **kwargs), settings)

    assert {id(m) for m, _r, _s in seen} == {id(fake_host.model)}
    assert all(r["unet"] and r["text_encoder"] for _m, r, _s in seen)
    assert max_pixel_diff(processed, baseline) <= IMAGE_TOLERANCE, "the refiner's weights, not the base's"
    assert not any(routed_parts(fake_host.model).values())
    assert "tiny-refiner loaded into the same model object" in extension.last_status
    again = extension.run(make_p(fake_host, **kwargs), settings)  # starts with the base weights loaded back
    assert max_pixel_diff(again, baseline) <= IMAGE_TOLERANCE


def img2img(host: Any, **kwargs: Any) -> Any:
    params = {"prompt": "a tiny cat", "seed": 3, "steps": 2, "width": 64, "height": 64, "denoising_strength": 0.8}
    return host.processing.StableDiffusionProcessingImg2Img(init_images=[INIT_IMAGE], mask=MASK, **{**params, **kwargs})


def test_inpainting_with_a_normal_and_a_9_channel_inpainting_checkpoint(
    fake_host: Any, extension: Any, f32: Any
) -> None:
    kept = np.asarray(INIT_IMAGE)[:, :16]
    concat: list[int] = []
    for family in ("sd1", "sd1-inpainting"):
        model = fake_host.model if family == "sd1" else load_family(fake_host, family)
        concat.clear()
        fake_host.callbacks.on_cfg_denoiser(lambda params: concat.append(params.image_cond.shape[1]))
        baseline = fake_host.processing.process_images(img2img(fake_host))
        seen = record_steps(fake_host)

        processed = extension.run(img2img(fake_host), f32)

        assert concat[0] == 5 and model.model.diffusion_model.in_channels == (9 if family != "sd1" else 4)
        assert seen and all(all(r.values()) for _m, r, _s in seen), family
        assert not any(routed_parts(model).values())
        assert max_pixel_diff(processed, baseline) <= IMAGE_TOLERANCE, family
        assert np.array_equal(np.asarray(processed.images[0])[:, :16], kept), "the unmasked part is kept"
        encodes = 2 if family == "sd1-inpainting" else 1  # the init image, and the masked image for c_concat
        assert f"first_stage_model.encoder ({encodes} call" in extension.last_status
        fake_host.callbacks.clear_callbacks()


def test_live_previews_decoded_by_the_routed_vae_and_progress_per_step(
    fake_host: Any, extension: Any, f32: Any
) -> None:
    shared, state = fake_host.shared, fake_host.shared.state
    shared.opts.show_progress_type, shared.opts.show_progress_every_n_steps = "Full", 1
    previews: list[Any] = []
    original_assign = state.assign_current_image
    state.assign_current_image = lambda image: (previews.append(image), original_assign(image))
    settings = dataclasses.replace(f32, text_encoder=False)

    def poll_from_another_thread(params: Any) -> None:  # what /internal/progress does while sampling runs
        thread = threading.Thread(target=state.set_current_image)
        thread.start()
        thread.join()

    results = {}
    for mode in ("generation thread", "progress thread"):
        shared.parallel_processing_allowed = mode == "progress thread"  # False: decoded in store_latent
        fake_host.callbacks.clear_callbacks()
        if mode == "progress thread":
            fake_host.callbacks.on_cfg_denoiser(poll_from_another_thread)
        for run in ("plain", "routed"):
            previews.clear()
            seen = record_steps(fake_host)
            state.begin()
            p = make_p(fake_host, steps=3, batch_size=2)
            processed = fake_host.processing.process_images(p) if run == "plain" else extension.run(p, settings)
            results[mode, run] = ([np.asarray(i, dtype=np.int16) for i in previews], processed, seen)
        (plain, plain_images, _), (routed, routed_images, seen) = results[mode, "plain"], results[mode, "routed"]
        assert len(routed) == len(plain) >= 2, mode
        width = 128 if mode == "progress thread" else 64  # a grid of the batch's 2 samples, or the first
        assert all(a.shape == (64, width, 3) for a in routed), mode
        assert max(int(np.abs(a - b).max()) for a, b in zip(plain, routed)) <= ROUNDED_IMAGE_TOLERANCE, mode
        assert max_pixel_diff(routed_images, plain_images) <= IMAGE_TOLERANCE
        assert [s for _m, _r, s in seen] == [0, 1, 2], "progress moves on every step"
        assert all(r["vae_decoder"] for _m, r, _s in seen)
    decodes = 2 * len(results["progress thread", "routed"][0]) + 2  # each preview decodes the 2 samples
    assert f"first_stage_model.decoder ({decodes} calls)" in extension.last_status
    assert not any(routed_parts(fake_host.model).values())


def test_textual_inversion_embeddings_reach_the_compiled_text_encoder(fake_host: Any, extension: Any, f32: Any) -> None:
    from modules import sd_hijack
    from modules.textual_inversion.textual_inversion import Embedding

    settings = dataclasses.replace(f32, unet=False, vae=False)
    db = sd_hijack.model_hijack.embedding_db
    conds: list[torch.Tensor] = []
    fake_host.callbacks.on_cfg_denoiser(lambda params: conds.append(params.text_cond.clone()))

    def generate(prompt: str, routed: bool) -> tuple[torch.Tensor, Any]:
        conds.clear()
        p = make_p(fake_host, prompt=prompt)
        processed = extension.run(p, settings) if routed else fake_host.processing.process_images(p)
        return conds[0], processed

    results = {}
    for name, seed in (("first", 1), ("second", 2)):  # switching the embedding between generations
        vec = torch.randn(3, 32, generator=torch.Generator().manual_seed(seed))
        db.register_embedding(Embedding(vec, "<tiny-style>"))
        results[name, "plain"] = generate("a <tiny-style> cat", routed=False)
        results[name, "routed"] = generate("a <tiny-style> cat", routed=True)
    without = generate("a  cat", routed=True)[0]

    for name in ("first", "second"):
        (plain_c, plain_img), (routed_c, routed_img) = results[name, "plain"], results[name, "routed"]
        torch.testing.assert_close(routed_c, plain_c, atol=1e-4, rtol=1e-4)
        assert max_pixel_diff(routed_img, plain_img) <= IMAGE_TOLERANCE
        assert not torch.allclose(routed_c, without, atol=1e-3), "the embedding changes the conditioning"
    assert not torch.allclose(results["first", "routed"][0], results["second", "routed"][0], atol=1e-3)
    assert "cond_stage_model.wrapped.transformer.text_model.encoder (" in extension.last_status
    assert not any(routed_parts(fake_host.model).values())


def sdxl_routed(model: Any) -> list[bool]:
    """UNet, VAE decoder and each text encoder (found by what it is, as A1111 has them) routed?"""
    states = [is_routed(model.model.diffusion_model), is_routed(model.first_stage_model.decoder)]
    for embedder in model.conditioner.embedders:
        inner = getattr(embedder, "wrapped", embedder)
        if hasattr(inner, "transformer"):
            states.append(is_routed(inner.transformer.text_model.encoder))
        elif hasattr(inner, "text_transformer_forward"):
            states.append(is_routed(inner, "text_transformer_forward"))
    return states


def test_sdxl_refiner_with_only_openclip_routes_its_unet_vae_and_text_encoder(
    fake_host: Any, extension: Any, f32: Any
) -> None:
    from tiny_model import TinySDXLRefiner

    base = load_family(fake_host, "sdxl")
    info = fake_host.sd_models.CheckpointInfo(
        str(fake_host.tmp_path / "tiny-sdxl-refiner.safetensors"),
        "e" * 64,
        config="sd_xl_refiner.yaml",  # another config than the base's: A1111 builds a new model object
        factory=lambda: TinySDXLRefiner(seed=0),
    ).register()
    kwargs = {"refiner_checkpoint": info.title, "refiner_switch_at": 0.5, "steps": 4}
    seen: list[tuple[Any, list[bool]]] = []
    fake_host.callbacks.on_cfg_denoiser(
        lambda params: seen.append((fake_host.shared.sd_model, sdxl_routed(fake_host.shared.sd_model)))
    )
    baseline = fake_host.processing.process_images(make_p(fake_host, base, **kwargs))
    assert [len(r) for _m, r in seen] == [4, 4, 3, 3], "base: CLIP-L + OpenCLIP; refiner: OpenCLIP only"
    seen.clear()

    processed = extension.run(make_p(fake_host, **kwargs), f32)

    models = list({id(m): m for m, _r in seen}.values())
    assert [m.sd_checkpoint_info.title for m, _r in seen] == [models[0].sd_checkpoint_info.title] * 2 + [info.title] * 2
    assert models[0].is_sdxl and models[1].is_sdxl and isinstance(models[1], TinySDXLRefiner)
    assert all(all(r) for _m, r in seen), seen
    assert not any(any(sdxl_routed(m)) for m in models), "base and refiner restored"
    assert max_pixel_diff(processed, baseline) <= IMAGE_TOLERANCE
    assert 'OpenVINO: "CPU, UNet+VAE+TE, f32"' in processed.infotexts[0], "nothing ran in PyTorch"
    status = extension.last_status
    assert "tiny-sdxl-refiner: switched to a new model object, routed" in status, status
    assert "tiny-sdxl-refiner: model.diffusion_model (2 calls)" in status, status
    assert "tiny-sdxl-refiner: first_stage_model.decoder (1 call)" in status, status
    # the conds of the prompt and the negative prompt, computed anew at the switch
    assert "tiny-sdxl-refiner: conditioner.embedders.0.wrapped.text_transformer_forward (2 calls)" in status
    assert "Not accelerated" not in status and "plain PyTorch" not in status
