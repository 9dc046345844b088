"""Fixtures for backend tests: an f32 backend (so results compare tightly with eager) and fresh dynamo state."""

from __future__ import annotations

import pytest
import torch

from ov_backend import OVBackend

#: f32 inference on OpenVINO's CPU plugin vs PyTorch eager fp32: reordered reductions only.
F32_ATOL = 1e-4
F32_RTOL = 1e-4


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def f32_backend(tmp_path, **options) -> OVBackend:
    """A backend at f32 with its cache under ``tmp_path``, and any other ``options``."""
    return OVBackend({"config": {"INFERENCE_PRECISION_HINT": "f32"}, "cache_dir": str(tmp_path / "cache"),
                      **options})


@pytest.fixture
def backend(tmp_path) -> OVBackend:
    return f32_backend(tmp_path)


def small_cnn(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.GroupNorm(2, 8), torch.nn.SiLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1, stride=2), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5),
    ).eval()
