"""Short of memory, a build does not start: the graph runs in PyTorch and says why (``check_memory``).

The last test runs a process under a real memory limit (a cgroup smaller than the build needs), as a WebUI in
a container or on a small laptop is: without the check, the compile pushes it past the limit and the kernel
ends it; with it, the image is still made, in PyTorch, and the warning says why.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

import ov_backend.memory_guard as memory_guard
from ov_backend import OpenVINOFallbackError
from ov_backend.memory import SystemMemory

from .conftest import F32_ATOL, F32_RTOL, f32_backend

GIB = 1 << 30


def wide(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 16)).eval()


def test_the_estimate_follows_the_inference_precision() -> None:
    weights = [torch.zeros(1000, 1000), torch.zeros(1000, dtype=torch.int64)]
    f32 = memory_guard.build_bytes(weights, "f32")
    bf16 = memory_guard.build_bytes(weights, "bf16")
    assert f32 - memory_guard.MARGIN_BYTES == pytest.approx((4e6 + 8e3) * 1.1, rel=1e-6)
    assert bf16 - memory_guard.MARGIN_BYTES == pytest.approx((2e6 + 8e3) * 1.1, rel=1e-6)
    # 8-bit weights: a matmul's weight counts its 8-bit constant and the plugin's copy; a convolution's stays at float
    conv = [torch.zeros(1000, 1000), torch.zeros(100, 10, 10, 10)]
    eight = memory_guard.build_bytes(conv, "int8-weights")
    assert eight - memory_guard.MARGIN_BYTES == pytest.approx((2e6 + 4e5) * 1.1, rel=1e-6)
    # ... packed at the device's float precision: half of that on a bf16 CPU
    eight_bf16 = memory_guard.build_bytes(conv, "int8-weights", "bf16")
    assert eight_bf16 - memory_guard.MARGIN_BYTES == pytest.approx((2e6 + 2e5) * 1.1, rel=1e-6)
    assert memory_guard.inference_precision("auto", {}, "bf16") == "bf16"
    assert memory_guard.inference_precision("f32", {"INFERENCE_PRECISION_HINT": "f32"}, "bf16") == "f32"
    assert memory_guard.shortage(10 * GIB, SystemMemory(16 * GIB, 12 * GIB)) is None
    why = memory_guard.shortage(10 * GIB, SystemMemory(16 * GIB, 3 * GIB))
    assert why == "not enough memory to compile it: it needs about 10.0 GiB and 3.0 GiB is available"
    why = memory_guard.shortage(10 * GIB, SystemMemory(16 * GIB, 3 * GIB), compressed=2 * GIB)
    assert why.endswith("(with 8-bit weights, precision 'int8-weights', it would need about 2.0 GiB)")


def test_short_of_memory_the_graph_runs_in_pytorch_and_the_next_window_looks_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    model = wide()
    backend = f32_backend(tmp_path)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 512)
    monkeypatch.setattr(memory_guard, "system_memory", lambda: SystemMemory(8 * GIB, 1 << 20))
    caplog.set_level(logging.WARNING)
    backend.start_window()
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(compiled(x), want, rtol=0, atol=0)  # PyTorch's own result
        compiled(x)
    stats = backend.stats()
    assert stats["eager_calls"] == 2 and stats["ov_calls"] == 0 and stats["compiles"] == 0
    assert any("not enough memory to compile it" in r.getMessage() for r in caplog.records)
    [report] = backend.reports
    assert report.route == "eager" and "not enough memory" in report.summary()

    monkeypatch.setattr(memory_guard, "system_memory", lambda: SystemMemory(8 * GIB, 8 * GIB))
    with torch.no_grad():
        compiled(x)  # the same window: still in PyTorch
        assert backend.stats()["eager_calls"] == 3
        backend.start_window()
        torch.testing.assert_close(compiled(x), want, rtol=F32_RTOL, atol=F32_ATOL)
    assert backend.stats()["ov_calls"] == 1 and backend.stats()["compiles"] == 1


def test_strict_raises_instead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = f32_backend(tmp_path, strict=True)
    monkeypatch.setattr(memory_guard, "system_memory", lambda: SystemMemory(8 * GIB, 1 << 20))
    with pytest.raises(Exception) as caught, torch.no_grad():
        torch.compile(wide(), backend=backend)(torch.randn(2, 512))
    chain = [caught.value, caught.value.__cause__, getattr(caught.value, "inner_exception", None)]
    assert any(isinstance(e, OpenVINOFallbackError) and "not enough memory" in str(e) for e in chain if e), chain


def test_the_check_can_be_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = f32_backend(tmp_path, check_memory=False)
    monkeypatch.setattr(memory_guard, "system_memory", lambda: SystemMemory(8 * GIB, 1 << 20))
    with torch.no_grad():
        torch.compile(wide(), backend=backend)(torch.randn(2, 512))
    assert backend.stats()["ov_calls"] == 1


CHILD = textwrap.dedent("""
    import logging, sys, torch
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    from ov_backend import OVBackend
    torch.manual_seed(0)
    # 24 x 4096 x 4096 f32: 1.5 GiB of weights, and as much again for OpenVINO's copy at f32
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(24)]).eval()
    x = torch.randn(2, 4096)
    backend = OVBackend({"precision": "f32", "cache_dir": sys.argv[1], "check_memory": sys.argv[2] == "on"})
    with torch.no_grad():
        want = model(x)
        got = torch.compile(model, backend=backend)(x)
    print("ov_calls", int(backend.stats()["ov_calls"]), "eager_calls", int(backend.stats()["eager_calls"]),
          "same", bool(torch.equal(got, want)), flush=True)
""")


def _cgroup_v1() -> Path | None:
    root = Path("/sys/fs/cgroup/memory")
    if not (root / "cgroup.procs").exists() or not os.access(root, os.W_OK):
        return None
    group = root / f"ov-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError:
        return None
    return group


def test_under_a_memory_limit_smaller_than_the_build_the_process_lives_and_says_why(tmp_path: Path) -> None:
    group = _cgroup_v1()
    if group is None:
        pytest.skip("cannot make a memory cgroup here (needs a writable cgroup v1 memory hierarchy)")
    try:
        # room for the model and PyTorch (about 1.9 GiB), not for OpenVINO's copy beside it
        (group / "memory.limit_in_bytes").write_text(str(int(2.6 * GIB)))
        (group / "memory.memsw.limit_in_bytes").exists() and (group / "memory.swappiness").write_text("0")
        script = tmp_path / "child.py"
        script.write_text(CHILD)

        def run(check: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$0" "$@"', sys.executable, str(script),
                 str(tmp_path / f"cache-{check}"), check],
                capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "2"})

        guarded = run("on")
        assert guarded.returncode == 0, guarded.stderr[-3000:]
        assert "ov_calls 0 eager_calls 1 same True" in guarded.stdout, guarded.stdout + guarded.stderr[-3000:]
        assert "not enough memory to compile it" in guarded.stderr, guarded.stderr[-3000:]
        unguarded = run("off")  # what the check prevents: the kernel ends the process (SIGKILL)
        assert unguarded.returncode != 0, unguarded.stdout
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                import time

                time.sleep(0.1)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_under_a_cgroup_limit_page_cache_no_process_maps_counts_as_available(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    """A group limited to 4 GiB that uses 3 GiB, 1.5 GiB of it page cache of which 0.5 GiB is mapped (a weight
    file's pages after a build are not): 2 GiB may still be taken, as the machine's MemAvailable counts cache."""
    from ov_backend import memory

    group = tmp_path / ("memory/job" if version == "v1" else "job")
    group.mkdir(parents=True)
    if version == "v1":
        (group / "memory.limit_in_bytes").write_text(str(4 * GIB))
        (group / "memory.usage_in_bytes").write_text(str(3 * GIB))
        (group / "memory.stat").write_text(f"total_cache {3 * GIB // 2}\ntotal_mapped_file {GIB // 2}\n"
                                           f"hierarchical_memory_limit {4 * GIB}\n")
        monkeypatch.setattr(memory, "_cgroup_paths", lambda: ("/job", None))
    else:
        (group / "memory.max").write_text(str(4 * GIB))
        (group / "memory.current").write_text(str(3 * GIB))
        (group / "memory.stat").write_text(f"anon {3 * GIB // 2}\nfile {3 * GIB // 2}\nfile_mapped {GIB // 2}\n")
        monkeypatch.setattr(memory, "_cgroup_paths", lambda: (None, "/job"))
    assert memory._cgroup_room(tmp_path) == 2 * GIB
