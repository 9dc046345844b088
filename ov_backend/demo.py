"""``python -m ov_backend demo``: compile a small CNN with ov_backend and compare it with PyTorch."""

from __future__ import annotations

import argparse
import logging
import time

import torch

from ov_backend.backend import OVBackend
from ov_backend.devices import device_info

logger = logging.getLogger(__name__)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.GroupNorm(4, 16), torch.nn.SiLU(),
        torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(16, 10),
    ).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ov_backend")
    parser.add_argument("command", choices=["demo"], help="demo: compile a small CNN and compare with PyTorch")
    parser.add_argument("--device", default="CPU")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("torch", "torch._dynamo"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logger.info("OpenVINO devices: %s", ", ".join(d.label for d in device_info()))
    try:
        backend = OVBackend({"device": args.device, "config": {"INFERENCE_PRECISION_HINT": "f32"}})
    except ValueError as err:
        parser.error(str(err))
    model = _model()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for size in (32, 48, 64):
            x = torch.randn(2, 3, size, size)
            start = time.perf_counter()
            got = compiled(x)
            seconds = time.perf_counter() - start
            diff = (got - model(x)).abs().max().item()
            logger.info("input %dx%d: first call %.2fs, max |OpenVINO - PyTorch| = %.2e", size, size, seconds, diff)
    for report in backend.reports:
        logger.info("%s", report.summary())
    logger.info("stats: %s", backend.stats())
    return 0
