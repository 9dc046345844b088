"""Unit tests: settings, tokenizer files, sampler table, WebUI noise, infotext (prompts: test_prompts.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from PIL import Image

from ov_accelerate_sd.noise import ImageNoise, image_seeds, initial_noise
from ov_accelerate_sd.pnginfo import format_infotext, parse_infotext, read_png_infotext, save_png
from ov_accelerate_sd.samplers import SAMPLER_NAMES, SAMPLERS, make_scheduler, sampler_spec
from ov_accelerate_sd.settings import build_sd_settings
from ov_accelerate_sd.tokenizer import VOCAB_SIZE, clip_tokenizer

# -- settings ---------------------------------------------------------------------------------


def test_settings_defaults_and_backend_choice() -> None:
    settings = build_sd_settings({"precision": "f32", "cache_dir": "/x", "accelerate": "unet,vae"})
    assert settings.accelerate == ("unet", "vae")
    from ov_backend import build_settings

    backend = build_settings(settings.backend_choice().options())
    assert (backend.device, backend.model_caching, str(backend.cache_dir)) == ("CPU", True, "/x")
    assert backend.compile_config == {"INFERENCE_PRECISION_HINT": "f32"}
    assert build_settings(build_sd_settings().backend_choice().options()).compile_config == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.device = "GPU"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"devise": "CPU"}, "unknown SD setting(s) ['devise']"),
        ({"precision": "fp8"}, "precision must be one of"),
        ({"accelerate": ["unet", "refiner"]}, "unknown part(s) to accelerate ['refiner']"),
        ({"prediction_type": "x"}, "prediction_type"),
    ],
)
def test_settings_reject_bad_values(options: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        build_sd_settings(options)
    assert message in str(info.value)


# -- tokenizer --------------------------------------------------------------------------------


def test_tokenizer_matches_clip_ids(tmp_path: Path) -> None:
    tokenizer = clip_tokenizer(folder=tmp_path)
    assert len(tokenizer) == VOCAB_SIZE
    ids = tokenizer("a photo of an astronaut riding a horse").input_ids
    assert ids == [49406, 320, 1125, 539, 550, 18376, 6765, 320, 4558, 49407]
    assert tokenizer.pad_token_id == 49407
    assert clip_tokenizer("!", folder=tmp_path).pad_token_id == 0
    assert (tmp_path / "vocab.json").is_file() and (tmp_path / "merges.txt").is_file()


# -- samplers ---------------------------------------------------------------------------------


def test_sampler_table_sorted_unique_and_complete() -> None:
    names = [s.name for s in SAMPLERS]
    assert names == sorted(names)
    assert len({n.lower() for n in names}) == len(names)
    for required in ("Euler a", "Euler", "DPM++ 2M", "DPM++ 2M Karras", "DPM++ SDE Karras", "DDIM", "LMS",
                     "Heun", "UniPC", "LCM"):
        assert required in SAMPLER_NAMES


def test_unknown_sampler_lists_valid_ones() -> None:
    with pytest.raises(ValueError) as info:
        sampler_spec("Euler b")
    assert "unknown sampler 'Euler b'" in str(info.value) and "DPM++ 2M Karras" in str(info.value)
    assert sampler_spec("euler A").name == "Euler a"


def test_dpmpp_2m_defaults_to_karras() -> None:
    """v1.10: a sampler's default schedule applies without " Karras" (the schedules of every name are
    checked by behaviour in test_webui_schedules.py: timesteps, whole trajectories)."""
    base = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}
    karras = make_scheduler("DPM++ 2M Karras", base)
    karras.set_timesteps(5)
    plain = make_scheduler("DPM++ 2M", base)
    plain.set_timesteps(5)
    assert torch.equal(karras.sigmas, plain.sigmas)


# -- noise ------------------------------------------------------------------------------------


def test_initial_noise_is_webui_cpu_randn_per_seed() -> None:
    want = torch.randn((4, 8, 12), generator=torch.Generator("cpu").manual_seed(1234))
    got = initial_noise(1234, width=96, height=64)
    assert got.shape == (1, 4, 8, 12)
    assert torch.equal(got[0], want)


def test_noise_batch_position_and_size() -> None:
    batch = initial_noise(10, 64, 64, batch_size=3, batch_index=1)
    assert image_seeds(10, 3, 1) == [13, 14, 15]
    for i, seed in enumerate((13, 14, 15)):
        assert torch.equal(batch[i], initial_noise(seed, 64, 64)[0])


def test_generators_continue_after_the_first_draw() -> None:
    noise = ImageNoise([5], 64, 64)
    noise.first()
    after = torch.randn((4, 8, 8), generator=noise.generators[0])
    reference = torch.Generator("cpu").manual_seed(5)
    torch.randn((4, 8, 8), generator=reference)
    assert torch.equal(after, torch.randn((4, 8, 8), generator=reference))


# -- infotext ---------------------------------------------------------------------------------


def test_infotext_round_trip_through_png(tmp_path: Path) -> None:
    text = format_infotext("a (cat:1.2), sitting\nsecond line", "blurry, bad", {
        "Steps": 20, "Sampler": "DPM++ 2M", "Schedule type": "Karras", "CFG scale": 7.0, "Seed": 42,
        "Size": "512x768", "Model hash": "01fc8e974a", "Model": "my model", "OpenVINO device": "CPU",
        "Skipped": None, "Note": 'has "quotes", commas: and colons',
    })
    assert text.splitlines()[-1].startswith("Steps: 20, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 7.0")
    path = save_png(Image.new("RGB", (8, 8)), tmp_path / "x.png", text)
    assert list(tmp_path.iterdir()) == [path]
    parsed = parse_infotext(read_png_infotext(path))
    assert parsed["Prompt"] == "a (cat:1.2), sitting\nsecond line"
    assert parsed["Negative prompt"] == "blurry, bad"
    assert parsed["Seed"] == "42" and parsed["Size"] == "512x768" and parsed["Model hash"] == "01fc8e974a"
    assert parsed["Note"] == 'has "quotes", commas: and colons'
    assert "Skipped" not in parsed
