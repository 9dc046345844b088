"""Fixtures: the fake A1111 host in ``sys.modules``, a tiny loaded checkpoint, the backend API (the real
ov_backend)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

FAKE_HOST = Path(__file__).parent / "fake_a1111"
#: Largest per-pixel difference (0..255 scale) between an image made with OpenVINO at f32 and PyTorch's,
#: measured on the decoded image before 8-bit rounding (``Processed.samples_255`` of the fake host). On the
#: tiny models f32 differences measure below 0.001 (SD1, SDXL); scaling the UNet's output by 1.01 moves the
#: image by 0.9, by 1.05 by 4.5, so a 1% error in a routed UNet fails.
IMAGE_TOLERANCE = 0.05
#: The same for 8-bit images only (API replies): rounding can turn any difference into 1.
ROUNDED_IMAGE_TOLERANCE = 1


def _drop_fake_modules() -> None:
    for name in list(sys.modules):
        if name in ("modules", "tiny_model", "launch") or name.startswith("modules."):
            del sys.modules[name]


@contextlib.contextmanager
def _installed_host(tmp_path: Path) -> Iterator[SimpleNamespace]:
    _drop_fake_modules()
    sys.path.insert(0, str(FAKE_HOST))
    try:
        from modules import paths, processing, script_callbacks, scripts, sd_models, shared
        from tiny_model import MODELS, TinyLatentDiffusion

        paths.models_path = str(tmp_path / "models")
        model = TinyLatentDiffusion(seed=0)
        sd_models.load_model(model, sd_models.CheckpointInfo(str(tmp_path / "tiny-a.safetensors"), "a" * 64))
        yield SimpleNamespace(
            shared=shared,
            processing=processing,
            scripts=scripts,
            callbacks=script_callbacks,
            sd_models=sd_models,
            paths=paths,
            model=model,
            make_model=TinyLatentDiffusion,
            models=MODELS,
            tmp_path=tmp_path,
        )
        script_callbacks.clear_callbacks()
    finally:
        _drop_fake_modules()
        sys.path.remove(str(FAKE_HOST))


@pytest.fixture
def fake_host(tmp_path: Path) -> Iterator[SimpleNamespace]:
    """The fake ``modules`` package of A1111 v1.10.1, with a tiny SD1 checkpoint loaded."""
    with _installed_host(tmp_path) as host:
        yield host


@pytest.fixture(scope="module")
def session_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """Like ``fake_host``, for a whole test module: one WebUI session with many generations."""
    with _installed_host(tmp_path_factory.mktemp("session")) as host:
        yield host


@pytest.fixture(scope="session")
def backend_api() -> Any:
    """The backend API the extension uses in tests."""
    from ov_accelerate_webui.backend_bridge import load_backend

    return load_backend()


@pytest.fixture
def extension(fake_host: SimpleNamespace, backend_api: Any) -> Any:
    from ov_accelerate_webui import Loaded
    from ov_accelerate_webui.extension import Extension

    ext = Extension(load_api=lambda: backend_api)
    # model_loaded, cfg_denoiser, as A1111
    Loaded(extension=ext, script_class=object, section_class=object).register_callbacks()
    yield ext
    ext.unload()


@pytest.fixture(scope="session")
def shared_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One disk cache for the session: tests that compile the same tiny weights reuse its entries."""
    return tmp_path_factory.mktemp("ov_cache")


@pytest.fixture
def f32(shared_cache_dir: Path) -> Any:
    """Settings for tests comparing images: full precision, the session's disk cache."""
    from ov_accelerate_webui.settings import build_settings

    return build_settings({"precision": "f32", "cache_dir": str(shared_cache_dir)})


def make_p(host: SimpleNamespace, model: Any = None, **kwargs: Any) -> Any:
    """A txt2img processing object with small, fixed defaults."""
    params = {
        "prompt": "a tiny cat",
        "negative_prompt": "blurry",
        "seed": 1234,
        "steps": 2,
        "width": 64,
        "height": 64,
        "batch_size": 1,
        "do_not_save_samples": True,
        **kwargs,
    }
    return host.processing.StableDiffusionProcessingTxt2Img(sd_model=model or host.shared.sd_model, **params)


def pixels(processed: Any) -> list[np.ndarray]:
    return [np.asarray(img, dtype=np.int16) for img in processed.images]


def max_pixel_diff(a: Any, b: Any) -> float:
    """Largest per-pixel difference of two results' images, before 8-bit rounding (0..255 scale)."""
    exact_a, exact_b = getattr(a, "samples_255", None), getattr(b, "samples_255", None)
    assert exact_a and exact_b, "both results must come from the fake host's process_images"
    assert len(exact_a) == len(exact_b)
    return max(float(np.abs(x - y).max()) for x, y in zip(exact_a, exact_b))


def load_family(host: SimpleNamespace, family: str, seed: int = 0) -> Any:
    """Load a tiny checkpoint of ``family`` ("sd1", "sd2", "sdxl") as A1111 would."""
    model = host.models[family](seed=seed)
    info = host.sd_models.CheckpointInfo(str(host.tmp_path / f"tiny-{family}-{seed}.safetensors"), family[-1] * 64)
    return host.sd_models.load_model(model, info)
