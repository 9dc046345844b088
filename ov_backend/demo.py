"""``python -m ov_backend demo``: compile a small CNN with ov_backend and compare it with PyTorch.

The command line parses the arguments and configures logging; ``run_demo`` does the work and
hands each line of its output to the ``write`` callable it is given.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from ov_backend.backend import OVBackend
from ov_backend.devices import device_info

logger = logging.getLogger(__name__)

INPUT_SIZES = (32, 48, 64)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.GroupNorm(4, 16), torch.nn.SiLU(),
        torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(16, 10),
    ).eval()


def run_demo(device: str, write: Callable[[str], None], verbose: bool = False) -> float:
    """Compile a small CNN on ``device``, run it at three input sizes and compare with PyTorch.

    Args:
        device: OpenVINO device name ("CPU", "GPU.0", ...).
        write: receives each output line.
        verbose: also write each compile report.

    Returns:
        The largest difference between OpenVINO's and PyTorch's outputs.

    Raises:
        ValueError: unknown device (the message lists the available ones).
    """
    backend = OVBackend({"device": device, "config": {"INFERENCE_PRECISION_HINT": "f32"}})
    write(f"OpenVINO devices: {', '.join(d.label for d in device_info())}")
    model = _model()
    compiled = torch.compile(model, backend=backend)
    worst = 0.0
    with torch.no_grad():
        for size in INPUT_SIZES:
            x = torch.randn(2, 3, size, size)
            start = time.perf_counter()
            got = compiled(x)
            seconds = time.perf_counter() - start
            diff = (got - model(x)).abs().max().item()
            worst = max(worst, diff)
            write(f"input {size}x{size}: first call {seconds:.2f}s, max |OpenVINO - PyTorch| = {diff:.2e}")
    if verbose:
        for report in backend.reports:
            write(report.summary())
    stats = backend.stats()
    write("stats: " + ", ".join(f"{k} {v:g}" for k, v in stats.items()))
    return worst
