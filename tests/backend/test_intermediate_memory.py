"""Between calls, a compiled model's inference requests hold its intermediate tensors (a VAE decoder at
1024x1024 f32: 3 GiB). ``release_intermediate_memory`` gives them back when no call runs (the WebUI does at the
end of a generation); the next call allocates them again and gives the same result."""

from __future__ import annotations

import ctypes
import os
import threading

import pytest
import torch

from ov_backend.runtime import OVRunner, release_intermediate_memory

from .conftest import f32_backend

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc/self/status (Linux)")


def rss_bytes() -> int:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in open("/proc/self/status", encoding="utf-8"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def wide_convs() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(4, 64, 3, padding=1), torch.nn.SiLU(),
                               torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.SiLU(),
                               torch.nn.Conv2d(64, 4, 3, padding=1)).eval()


def test_released_between_calls_and_the_next_call_gives_the_same(tmp_path) -> None:
    model = wide_convs()
    compiled = torch.compile(model, backend=f32_backend(tmp_path))
    x = torch.randn(1, 4, 512, 512)  # each 64-channel activation: 64 MiB
    with torch.no_grad():
        first = compiled(x)
        holding = rss_bytes()
        assert release_intermediate_memory() >= 1
        released = rss_bytes()
        assert holding - released >= 64 << 20, (holding, released)
        assert release_intermediate_memory() == 0  # nothing held since: nothing to do
        torch.testing.assert_close(compiled(x), first, rtol=0, atol=0)


def test_a_runner_in_a_call_keeps_its_memory() -> None:
    import openvino as ov

    param = ov.opset13.parameter([1, 8], ov.Type.f32)
    compiled = ov.Core().compile_model(ov.Model([ov.opset13.relu(param)], [param]), "CPU")
    runner = OVRunner(compiled)
    runner([torch.ones(1, 8)])
    entered, leave = threading.Event(), threading.Event()
    real = runner.compiled

    class Slow:  # a call that is still running when the release comes
        def create_infer_request(self):
            entered.set()
            leave.wait(30)
            return real.create_infer_request()

    runner._pool.get_nowait()  # (its one request is taken, so the call makes a new one)
    runner.compiled = Slow()
    worker = threading.Thread(target=runner, args=([torch.ones(1, 8)],))
    worker.start()
    assert entered.wait(30)
    assert runner.release_memory() is False
    leave.set()
    worker.join(30)
    runner.compiled = real
    assert runner.release_memory() is True
