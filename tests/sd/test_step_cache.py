"""Step caching (DeepCache): the UNet's split, the schedule, what a cached feature may be reused for, and the
command line's ``--step-cache`` through OpenVINO."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ov_accelerate_sd.cli import main
from ov_accelerate_sd.loader import random_components, tiny_config
from ov_accelerate_sd.openvino_entry import format_entry, split_step_cache
from ov_accelerate_sd.pnginfo import parse_infotext, read_png_infotext
from ov_accelerate_sd.settings import build_sd_settings
from ov_accelerate_sd.step_cache import StepCacheRun, StepCacheSettings
from ov_accelerate_sd.unet_split import StepCacheUnsupported, split_unet


def _unet_call(family: str, unet: torch.nn.Module, size: tuple[int, int], seed: int = 0) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, unet.config.in_channels, *size, generator=g)
    context = torch.randn(2, 77, unet.config.cross_attention_dim, generator=g)
    kwargs: dict = {}
    if family == "sdxl":
        pooled = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim
        kwargs["added_cond_kwargs"] = {"text_embeds": torch.randn(2, pooled, generator=g),
                                       "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]] * 2)}
    return (x, torch.tensor([700.0, 700.0]), context), kwargs


@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_full_and_shallow_give_the_unets_own_output_at_every_depth_and_size(family: str) -> None:
    """The split is the UNet's own computation: the full call is bit-identical to ``forward``, and a shallow
    call on the feature of the same step too (so what a shallow step changes is only the feature's age)."""
    unet = random_components(tiny_config(family), seed=7)[0]
    layers = split_unet(unet, 1).layers
    with torch.no_grad():
        for size in ((8, 8), (8, 12), (6, 10)):  # (6, 10): not a multiple of the UNet's downscale
            args, kwargs = _unet_call(family, unet, size)
            own = unet(args[0], args[1], encoder_hidden_states=args[2], **kwargs).sample
            for depth in range(1, layers):
                split = split_unet(unet, depth)
                out, feature = split.full(unet, *args, **kwargs)
                assert torch.equal(out, own), (size, depth)
                assert torch.equal(split.shallow(unet, *args, feature=feature, **kwargs), own), (size, depth)
            # a feature from another step gives another output: the shallow call does use it
            later, _ = _unet_call(family, unet, size, seed=1)
            _, old_feature = split_unet(unet, 2).full(unet, later[0], *args[1:], **kwargs)
            assert not torch.equal(split_unet(unet, 2).shallow(unet, *args, feature=old_feature, **kwargs), own)


def test_a_depth_that_does_not_fit_and_a_unet_it_does_not_know_are_refused() -> None:
    unet = random_components(tiny_config("sd1"), seed=7)[0]
    layers = split_unet(unet, 1).layers
    with pytest.raises(StepCacheUnsupported, match=f"depth {layers} does not fit .* 1 to {layers - 1} deep"):
        split_unet(unet, layers)
    with pytest.raises(StepCacheUnsupported, match="not Linear"):
        split_unet(torch.nn.Linear(2, 2), 1)


@pytest.mark.parametrize(("settings", "schedule"), [
    (StepCacheSettings(), "F" * 10),
    (StepCacheSettings(interval=2), "FFsFsFsFsF"),
    (StepCacheSettings(interval=3), "FFssFssFsF"),
    (StepCacheSettings(interval=4, full_start=1, full_end=0), "FsssFsssFs"),
    (StepCacheSettings(interval=3, full_start=3, full_end=3), "FFFssFsFFF"),
])
def test_the_schedule_keeps_full_steps_at_the_start_and_the_end(settings: StepCacheSettings, schedule: str) -> None:
    assert settings.schedule(10) == schedule


@pytest.mark.parametrize(("fields", "message"), [
    ({"interval": 0}, "interval must be a whole number >= 1, got 0"),
    ({"depth": 0}, "depth must be a whole number >= 1"),
    ({"full_start": 0}, "full_start must be a whole number >= 1"),
    ({"full_end": -1}, "full_end must be a whole number >= 0"),
    ({"interval": 2.5}, "got 2.5"),
    ({"interval": True}, "got True"),
])
def test_settings_that_make_no_schedule_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        StepCacheSettings(**fields)


def test_sd_settings_take_an_interval_or_the_fields() -> None:
    assert build_sd_settings({"step_cache": 3}).step_cache == StepCacheSettings(interval=3)
    assert build_sd_settings({"step_cache": {"interval": 2, "depth": 3}}).step_cache.depth == 3
    with pytest.raises(ValueError, match="step_cache must be"):
        build_sd_settings({"step_cache": "fast"})


def test_the_entry_names_step_caching_only_when_the_unet_ran_with_it() -> None:
    assert format_entry("CPU", ["unet", "vae"], "f32", step_cache=3) == "CPU, UNet+VAE, f32, step cache 3"
    assert format_entry("CPU", ["vae"], "f32", step_cache=3) == "CPU, VAE, f32"
    assert format_entry("CPU", ["unet"], "auto", ["note"], step_cache=1) == "CPU, UNet, auto; note"
    assert split_step_cache("CPU, UNet, f32, step cache 4") == ("CPU, UNet, f32", 4)
    assert split_step_cache("CPU, UNet, f32") == ("CPU, UNet, f32", 1)
    assert split_step_cache("CPU, UNet, f32, step cache x") == ("CPU, UNet, f32", None)


class _Recorder:
    """Runs the split eagerly and records which kind each call ran."""

    def __init__(self, split: torch.nn.Module, unet: torch.nn.Module) -> None:
        self.split, self.unet, self.kinds = split, unet, []

    def __call__(self, kind: str, args: tuple, kwargs: dict):
        self.kinds.append(kind)
        return getattr(self.split, kind)(self.unet, *args, **kwargs)


def test_a_feature_is_reused_only_for_the_same_unet_weights_size_and_prompt() -> None:
    unet = random_components(tiny_config("sd1"), seed=7)[0]
    split = split_unet(unet, 2)
    run = StepCacheRun(StepCacheSettings(interval=3, full_start=1, full_end=0))  # F s s F s s ...
    record = _Recorder(split, unet)
    args, kwargs = _unet_call("sd1", unet, (8, 8))
    with torch.no_grad():
        run.call(unet, args, kwargs, record)  # no sampling yet: full, nothing kept
        assert record.kinds == ["full"] and not run._kept
        run.begin(10)
        run.call(unet, args, kwargs, record)  # step 0: full, kept
        run.at_step(1)
        run.call(unet, args, kwargs, record)  # shallow on the kept feature
        other_size, _ = _unet_call("sd1", unet, (8, 12))
        run.call(unet, other_size, kwargs, record)  # another size: full
        other_prompt = (args[0], args[1], args[2] + 1)
        run.call(unet, other_prompt, kwargs, record)  # another prompt: full
        with torch.no_grad():
            unet.conv_in.bias.add_(0.1)  # a LoRA written in place
        run.call(unet, args, kwargs, record)  # new weights: full
        run.at_step(2)
        run.call(unet, args, kwargs, record)  # the features just kept (new weights): shallow
        assert record.kinds == ["full", "full", "shallow", "full", "full", "full", "shallow"]
        assert run.forced_full == {"another input size than at the last full step": 1,
                                   "another prompt or conditioning than at the last full step": 1,
                                   "the UNet's weights changed since its last full step": 1}
        run.begin(10)  # the next image: nothing reused
        run.at_step(1)
        run.call(unet, args, kwargs, record)
        assert record.kinds[-1] == "full"
        assert run.forced_full["no full step of this UNet yet in this sampling"] == 1
        run.end()
        run.call(unet, args, kwargs, record)
        assert record.kinds[-1] == "full" and not run._kept
    assert run.shallow_calls == 2 and run.full_calls == 7
    assert "2 shallow UNet call(s)" in run.describe()


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.float64)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def test_the_command_line_caches_steps_through_openvino(tmp_path: Path, sd1_checkpoint: Path, capsys) -> None:
    """``--step-cache 2``: the UNet's full and shallow calls both run in OpenVINO, the image is written with the
    interval in its OpenVINO entry, and it is close to, not equal to, the uncached image.

    The two calls take the routed UNet as an argument; their dynamo captures are saved all the same, and the
    next process loads them instead of tracing the UNet again, and makes the same image."""
    common = ["generate", "--checkpoint", str(sd1_checkpoint), "--prompt", "a red cat", "--seed", "3",
              "--steps", "8", "--width", "64", "--height", "64", "--precision", "f32", "--cache-dir",
              str(tmp_path / "cache"), "--pytorch", "vae", "--pytorch", "text_encoder"]  # (fewer compiles)
    assert main([*common, "--out", str(tmp_path / "plain")]) == 0
    capsys.readouterr()
    assert main([*common, "--step-cache", "2", "--out", str(tmp_path / "cached")]) == 0
    out = capsys.readouterr().out
    # 8 steps at interval 2, first 2 and last 1 full: F F s F s F s F
    assert "step caching every 2 steps (depth 2, full steps: first 2, last 1): 5 full and 3 shallow" in out
    assert "PyTorch calls 0" in out
    assert "2 captured and saved for the next run" in out, out  # the full and the shallow call
    (plain,) = (tmp_path / "plain").glob("*.png")
    (cached,) = (tmp_path / "cached").glob("*.png")
    assert parse_infotext(read_png_infotext(cached))["OpenVINO"] == "CPU, UNet, f32, step cache 2"
    difference = _psnr(_pixels(plain), _pixels(cached))
    assert 20 < difference < 200, difference

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "ov_backend", *common, "--step-cache", "2", "--out",
                           str(tmp_path / "again")], capture_output=True, text=True, cwd=root, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-3000:]
    (summary,) = (line for line in done.stdout.splitlines() if " image(s) in " in line)
    assert "2 loaded from the cache" in summary and "captured" not in summary, done.stdout
    assert "PyTorch calls 0" in summary
    (again,) = (tmp_path / "again").glob("*.png")
    assert np.array_equal(_pixels(cached), _pixels(again))


def test_step_caching_needs_the_unet_in_openvino(capsys, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["generate", "--demo", "--step-cache", "2", "--pytorch", "unet", "--out", str(tmp_path / "o")])
    assert stop.value.code == 2
    assert "cannot go with --pytorch unet" in capsys.readouterr().err
