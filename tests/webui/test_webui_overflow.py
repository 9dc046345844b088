"""Low precision that overflows is caught: at automatic precision a routed part whose output is not finite
is run again at f32 (and stays at f32), with a WARNING and a status line; a part that is not finite at f32
either is the model's own NaN and is not retried.

No CPU here overflows for real (bf16 has f32's range; f16 inference is a GPU thing), so the backend the
extension loads is ov_backend wrapped by :class:`Overflowing`: the graphs it compiles at automatic
precision put an inf into the outputs one part makes (picked by their shape), as f16 does when an
activation passes 65504. Its f32 builds are the real ones.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import IMAGE_TOLERANCE, make_p, max_pixel_diff, pixels

from ov_accelerate_webui import Loaded
from ov_accelerate_webui.extension import Extension
from ov_accelerate_webui.settings import build_settings

Hit = Callable[[torch.Tensor], bool]


def unet_output(t: torch.Tensor) -> bool:
    """The UNet's prediction: (B, 4, h, w) (the VAE decoder makes 3 channels, its encoder 8)."""
    return t.dim() == 4 and t.shape[1] == 4


def text_encoder_output(t: torch.Tensor) -> bool:
    """CLIP's hidden states: (B, 77, C)."""
    return t.dim() == 3


class Overflowing:
    """ov_backend's backend whose graphs overflow (one inf in each output ``hit`` picks) at automatic
    precision, or at every precision with ``also_f32``; counts the runs of such graphs per precision."""

    def __init__(self, settings: Any, inner: Callable[..., Any], hit: Hit, also_f32: bool, runs: dict,
                 weight_file: Any = None, cache: Any = None) -> None:
        self._inner = inner(settings, weight_file=weight_file, cache=cache)
        self.settings = self._inner.settings
        self.precision = self.settings.precision
        self._hit, self._runs = hit, runs
        self._poison = self.precision != "f32" or also_f32

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        compiled = self._inner(gm, example_inputs)

        def run(*args: Any) -> Any:
            out = compiled(*args)
            if not any(isinstance(t, torch.Tensor) and self._hit(t) for t in out):
                return out
            self._runs[self.precision] = self._runs.get(self.precision, 0) + 1
            if not self._poison:
                return out
            poisoned = []
            for t in out:
                if isinstance(t, torch.Tensor) and self._hit(t):
                    t = t.clone()
                    t.view(-1)[0] = math.inf
                poisoned.append(t)
            return type(out)(poisoned)

        return run

    @property
    def reports(self) -> list[Any]:
        return self._inner.reports

    def stats(self) -> dict[str, float]:
        return self._inner.stats()

    def reset(self) -> None:
        self._inner.reset()

    def start_window(self, previous_weights: str | None = None) -> None:
        self._inner.start_window(previous_weights)

    def stop_windows(self) -> None:
        self._inner.stop_windows()

    def calibrate(self) -> int:
        return self._inner.calibrate()


@pytest.fixture
def overflowing(fake_host: SimpleNamespace, backend_api: Any) -> Iterator[Callable[..., tuple[Extension, dict]]]:
    """Makes an extension on the fake host whose backend overflows in the outputs ``hit`` picks; returns it
    and the per-precision run counts of those graphs."""
    made: list[Extension] = []

    def make(hit: Hit, also_f32: bool = False) -> tuple[Extension, dict]:
        runs: dict[str, int] = {}

        def backend_class(settings: Any, weight_file: Any = None, cache: Any = None) -> Overflowing:
            return Overflowing(settings, backend_api.backend_class, hit, also_f32, runs, weight_file, cache)

        api = dataclasses.replace(backend_api, backend_class=backend_class)
        ext = Extension(load_api=lambda: api)
        Loaded(extension=ext, script_class=object, section_class=object).register_callbacks()
        made.append(ext)
        return ext, runs

    yield make
    for ext in made:
        ext.unload()


def auto_settings(cache_dir: Any, **parts: bool) -> Any:
    return build_settings({"precision": "auto", "cache_dir": str(cache_dir), **parts})


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_unet_overflow_is_rebuilt_at_f32_once(
    fake_host: SimpleNamespace, overflowing: Any, shared_cache_dir: Any, caplog: pytest.LogCaptureFixture
) -> None:
    only_unet = {"vae": False, "text_encoder": False}
    plain = fake_host.processing.process_images(make_p(fake_host))
    ext, runs = overflowing(unet_output)
    caplog.set_level(logging.INFO)

    first = ext.run(make_p(fake_host), auto_settings(shared_cache_dir, **only_unet))

    assert all(px.max() > 0 for px in pixels(first))
    assert max_pixel_diff(first, plain) <= IMAGE_TOLERANCE
    assert runs == {"auto": 1, "f32": 2}, "one overflow at auto, then every UNet call at f32"
    warned = [w for w in warnings_of(caplog) if "inf/NaN at automatic precision" in w]
    assert len(warned) == 1 and "UNet (model.diffusion_model)" in warned[0], warnings_of(caplog)
    line = "Rebuilt at f32 in this run: UNet (model.diffusion_model: output not finite at automatic precision"
    assert line in ext.last_status and line in first.comments, ext.last_status

    caplog.clear()
    second = ext.run(make_p(fake_host), auto_settings(shared_cache_dir, **only_unet))

    assert max_pixel_diff(second, first) == 0
    assert runs == {"auto": 1, "f32": 4}, "the next generation runs the f32 build, without a check at auto"
    assert not [w for w in warnings_of(caplog) if "automatic precision" in w]
    assert "At f32 since an earlier run: UNet (model.diffusion_model" in ext.last_status, ext.last_status
    assert "Rebuilt at f32" not in ext.last_status
    assert "compiled models reused" in ext.last_status, "nothing was compiled again"


def test_text_encoder_overflow_never_reaches_the_conditioning_cache(
    fake_host: SimpleNamespace, overflowing: Any, shared_cache_dir: Any, caplog: pytest.LogCaptureFixture
) -> None:
    processing = fake_host.processing.StableDiffusionProcessing
    processing.use_cond_cache = True  # A1111's cached_c / cached_uc, filled by get_conds_with_caching
    plain = fake_host.processing.process_images(make_p(fake_host))
    plain_c, plain_uc = processing.cached_c[1], processing.cached_uc[1]
    processing.cached_c[:], processing.cached_uc[:] = [None, None], [None, None]
    ext, runs = overflowing(text_encoder_output)
    caplog.set_level(logging.INFO)

    processed = ext.run(make_p(fake_host), auto_settings(shared_cache_dir, unet=False, vae=False))

    cached_c, cached_uc = processing.cached_c[1], processing.cached_uc[1]
    assert bool(torch.isfinite(cached_c).all()) and bool(torch.isfinite(cached_uc).all())
    # f32 in OpenVINO is within 1e-6 of PyTorch here; bf16 (what automatic precision runs on this CPU) 2e-2
    assert torch.allclose(cached_c, plain_c, atol=1e-4) and torch.allclose(cached_uc, plain_uc, atol=1e-4)
    assert max_pixel_diff(processed, plain) <= IMAGE_TOLERANCE
    assert runs == {"auto": 1, "f32": 2}, "the negative prompt overflowed at auto; both prompts ran at f32"
    route = "cond_stage_model.wrapped.transformer.text_model.encoder"
    assert any(f"TE ({route})" in w for w in warnings_of(caplog)), warnings_of(caplog)
    assert f"Rebuilt at f32 in this run: TE ({route}: output not finite at automatic precision" in processed.comments


def test_a_part_not_finite_at_f32_either_is_not_retried(
    fake_host: SimpleNamespace, overflowing: Any, shared_cache_dir: Any, caplog: pytest.LogCaptureFixture
) -> None:
    ext, runs = overflowing(unet_output, also_f32=True)  # the model's own inf: at every precision
    fake_host.shared.cmd_opts.disable_nan_check = True  # else A1111's NaN check raises NansException
    settings = auto_settings(shared_cache_dir, text_encoder=False)
    caplog.set_level(logging.INFO)

    first = ext.run(make_p(fake_host), settings)

    assert len(first.images) == 1
    assert runs == {"auto": 1, "f32": 2}, "the first call once at f32, the second at f32 only: no retry loop"
    warned = [w for w in warnings_of(caplog) if "UNet (model.diffusion_model)" in w]
    assert len(warned) == 2 and "not finite at f32 either" in warned[1], warnings_of(caplog)
    expected = (
        "Rebuilt at f32 in this run: UNet (model.diffusion_model: output not finite at automatic precision nor "
        "at f32: the model's own NaN/inf, returned as is for A1111's NaN check)."
    )
    assert expected in ext.last_status.splitlines(), "only the UNet: the VAE got inf from it, not from bf16"

    caplog.clear()
    ext.run(make_p(fake_host), settings)

    assert runs == {"auto": 1, "f32": 4}
    assert not [w for w in warnings_of(caplog) if "UNet" in w], warnings_of(caplog)


def test_nothing_is_checked_at_f32(
    fake_host: SimpleNamespace, overflowing: Any, f32: Any, caplog: pytest.LogCaptureFixture
) -> None:
    ext, runs = overflowing(unet_output, also_f32=True)
    fake_host.shared.cmd_opts.disable_nan_check = True  # else A1111's NaN check raises NansException
    caplog.set_level(logging.INFO)

    ext.run(make_p(fake_host), dataclasses.replace(f32, vae=False, text_encoder=False))

    assert runs == {"f32": 2}
    assert not [w for w in warnings_of(caplog) if "UNet" in w], warnings_of(caplog)
    assert "f32 in this run" not in ext.last_status and "f32 since" not in ext.last_status
