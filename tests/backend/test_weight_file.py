"""PyTorch's copy of the weights in a memory-mapped file (``weights_in_file``, :mod:`ov_backend.weight_file`).

What a user relies on: the module gives the same results compiled or not, before and after its weights are
written in place (A1111's LoRA code); its tensors stay the same objects; after a compiled call no page of
the file is in the process (an independent reading: ``/proc/self/smaps``); where the weights cannot move,
they stay in memory and a WARNING says why.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import time
from pathlib import Path

import pytest
import torch

from ov_backend import OVBackend, WeightFile, weight_file
from ov_backend.weight_file import file_system_of

from .conftest import F32_ATOL, F32_RTOL, f32_backend

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")


def mapped_weight_rss() -> int:
    """Bytes of the process's pages in weight files (their names start with ``.ov-weights-``)."""
    total, inside = 0, False
    with open("/proc/self/smaps", encoding="utf-8") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                inside = ".ov-weights-" in line
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                               torch.nn.LayerNorm(256), torch.nn.Linear(256, 8)).eval()


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_compiled_weights_move_to_the_file_and_leave_the_process(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # the pages PyTorch reads stay until asked: the keeper thread waits an hour, idle or packing (a drop of its
    # own at the end of a build could come after the read below: flaky on a busy machine)
    monkeypatch.setattr(weight_file, "IDLE_DROP_SECONDS", 3600.0)
    monkeypatch.setattr(weight_file, "PACKING_DROP_SECONDS", 3600.0)
    model = mlp()
    params = list(model.parameters())
    backend = f32_backend(tmp_path, weights_in_file=True)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 64)
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(compiled(x), want, rtol=F32_RTOL, atol=F32_ATOL)
        assert list(model.parameters()) == params and all(a is b for a, b in zip(model.parameters(), params))
        assert all(backend.weight_file.holds(p) for p in params)
        assert backend.stats()["weights_moved_bytes"] == weight_bytes(model)
        assert mapped_weight_rss() == 0 and backend.weight_file.resident_bytes() == 0
        # PyTorch reads them from the file: the same values
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)
        assert mapped_weight_rss() > 0  # (the oracle sees the pages PyTorch read)
        backend.drop_resident_weights()
        assert mapped_weight_rss() == 0

        # A1111's LoRA code writes the weights in place: the next call follows, with a compile and no conversion
        converted = backend.stats()["convert_seconds"]
        model[0].weight.add_(0.05)
        changed = model(x)
        assert not torch.allclose(changed, want)
        torch.testing.assert_close(compiled(x), changed, rtol=F32_RTOL, atol=F32_ATOL)
        assert backend.stats()["convert_seconds"] == converted
        assert mapped_weight_rss() == 0
        # another shape: one more build, the pages leave again
        torch.testing.assert_close(compiled(torch.ones(7, 64)), model(torch.ones(7, 64)), rtol=F32_RTOL, atol=F32_ATOL)
        backend.drop_resident_weights()
        assert mapped_weight_rss() == 0
    assert any("memory-mapped file" in line for line in backend.stats_counter.snapshot().text_lines())


def test_pages_pytorch_reads_leave_the_process_on_their_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between accelerated generations PyTorch may run the whole model from the file (stock A1111, a fallback):
    the pages it reads leave the process within about IDLE_DROP_SECONDS, without any call, and the values stay."""
    monkeypatch.setattr(weight_file, "IDLE_DROP_SECONDS", 0.1)
    model = mlp()
    backend = f32_backend(tmp_path, weights_in_file=True)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 64)
    with torch.no_grad():
        want = model(x)
        compiled(x)
        assert mapped_weight_rss() == 0
        for _ in range(3):
            torch.testing.assert_close(model(x), want, rtol=0, atol=0)  # read from the file, in PyTorch
            deadline = time.monotonic() + 30
            while mapped_weight_rss() > 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert mapped_weight_rss() == 0


def test_without_the_option_nothing_moves(tmp_path: Path) -> None:
    model = mlp()
    backend = f32_backend(tmp_path)
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(2, 64))
    assert backend.weight_file is None and backend.stats()["weights_moved_bytes"] == 0
    assert not list((tmp_path / "cache").glob("weights/*"))


def test_a_file_system_in_memory_keeps_the_weights_where_they_are_and_says_why(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    if file_system_of(Path("/dev/shm")) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    model = mlp()
    shm = Path("/dev/shm") / f"ov-test-{os.getpid()}"
    backend = OVBackend({"precision": "f32", "cache_dir": str(shm), "weights_in_file": True})
    x = torch.randn(3, 64)
    caplog.set_level(logging.WARNING)
    with torch.no_grad():
        want = model(x)
        got = torch.compile(model, backend=backend)(x)
    torch.testing.assert_close(got, want, rtol=F32_RTOL, atol=F32_ATOL)
    stats = backend.stats()
    assert stats["weights_moved_bytes"] == 0 and stats["weights_kept_bytes"] == weight_bytes(model)
    assert any("stay in memory" in r.getMessage() and "tmpfs" in r.getMessage() for r in caplog.records)
    assert not any(backend.weight_file.holds(p) for p in model.parameters())


def test_a_tensor_a_build_saw_before_never_moves(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # a converted model may read its memory: moving it would free what the model reads
    seen, fresh = torch.randn(1000), torch.randn(1000)
    weights = WeightFile(tmp_path / "weights")
    address = seen.data_ptr()
    weights.take([seen])  # moved: it was never seen
    assert weights.holds(seen) and seen.data_ptr() != address
    seen.set_(torch.randn(1000).untyped_storage())  # replaced after its build (as `param.data = ...` does)
    result = weights.take([seen, fresh])
    assert not weights.holds(seen) and weights.holds(fresh)
    assert result.kept_bytes == {"read by a model converted before it could move": 4000}
    assert result.moved_bytes == 4000
    # place (a checkpoint's weights as A1111 loads them): the same rule, and nothing is remembered
    later = torch.randn(1000)
    placed = weights.place([seen, later])
    assert not weights.holds(seen) and weights.holds(later)
    assert placed.kept_bytes == {"read by a model converted before it could move": 4000}
    again = torch.randn(1000)
    weights.place([again])
    assert weights.take([again]).moved_bytes == 0 and weights.holds(again)  # (already in the file)


def test_views_and_tensors_sharing_memory_stay(tmp_path: Path) -> None:
    base = torch.randn(10, 10)
    weights = WeightFile(tmp_path / "weights")
    result = weights.move([base[2:], base, torch.randn(3)])
    assert set(result.kept_bytes) == {"a view of a larger tensor"} and result.moved_bytes == 12


def test_a_file_is_closed_once_its_tensors_are_gone(tmp_path: Path) -> None:
    weights = WeightFile(tmp_path / "weights")
    tensors = [torch.randn(256, 256) for _ in range(3)]
    values = [t.clone() for t in tensors]
    weights.move(tensors)
    assert weights.file_bytes() >= 3 * 256 * 256 * 4
    assert all(torch.equal(t, v) for t, v in zip(tensors, values))
    assert not list((tmp_path / "weights").iterdir())  # unlinked once mapped: nothing is left on disk
    del tensors
    gc.collect()
    weights.drop_resident()
    assert weights.file_bytes() == 0


def rss_anon() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def test_moved_tensors_leave_the_process_even_from_the_c_heap(tmp_path: Path) -> None:
    # tensors below glibc's mmap threshold live in its heap: freed, their pages stay until the heap is trimmed
    tensors = [torch.full((64, 1024), float(i)) for i in range(400)]  # 256 KiB each, 100 MiB
    before = rss_anon()
    WeightFile(tmp_path / "weights").move(tensors)
    gc.collect()
    assert before - rss_anon() > 80 << 20, (before, rss_anon())
    assert all(float(t[0, 0]) == i for i, t in enumerate(tensors))


def test_settings_take_a_boolean_for_the_option() -> None:
    from ov_backend import build_settings

    assert build_settings({"weights_in_file": "yes"}).weights_in_file is True
    with pytest.raises(ValueError, match="weights_in_file.*boolean"):
        build_settings({"weights_in_file": "sometimes"})


def test_fill_writes_each_source_converted_into_the_file_one_at_a_time(tmp_path: Path) -> None:
    torch.manual_seed(0)
    sources = {f"w{i}": torch.randn(128, 96 + i).half() for i in range(4)}
    order: list[str] = []

    def source(key: str) -> torch.Tensor:
        order.append(key)
        return sources.pop(key)  # the caller's only reference goes as each tensor is written

    want = {k: v.float() for k, v in sources.items()}
    home = WeightFile(tmp_path)
    tensors, result = home.fill([(want[k].shape, torch.float32, lambda k=k: source(k)) for k in want])
    assert tensors is not None and order == list(want) and not sources
    assert home.resident_bytes() == 0  # written, then out of the process: the data is in the file
    for t, (key, value) in zip(tensors, want.items()):
        assert home.holds(t) and t.dtype == torch.float32
        assert torch.equal(t, value), key  # bit for bit what .float() gives
    assert result.moved_bytes == sum(v.numel() * 4 for v in want.values()) and not result.kept_bytes


def test_fill_with_no_file_calls_no_source_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weight_file, "file_system_of", lambda path: "tmpfs")
    called: list[int] = []
    tensors, result = WeightFile(tmp_path).fill([((4, 4), torch.float32, lambda: called.append(1) or torch.ones(4, 4))])
    assert tensors is None and not called
    assert any("tmpfs" in why for why in result.kept_bytes)


def test_fill_refuses_a_source_of_another_shape_and_hands_out_nothing(tmp_path: Path) -> None:
    home = WeightFile(tmp_path)
    with pytest.raises(ValueError, match=r"shape \(3, 4\) for a tensor of shape \(4, 4\)"):
        home.fill([((4, 4), torch.float32, lambda: torch.ones(4, 4)),
                   ((4, 4), torch.float32, lambda: torch.ones(3, 4))])
    assert home.file_bytes() == 0


def test_fill_of_empty_tensors_makes_no_file_and_still_wraps_them(tmp_path: Path) -> None:
    home = WeightFile(tmp_path)
    tensors, result = home.fill([((0, 4), torch.float32, lambda: torch.ones(0, 4))], wrap=torch.nn.Parameter)
    assert tensors is not None and isinstance(tensors[0], torch.nn.Parameter) and tensors[0].shape == (0, 4)
    assert result.moved_bytes == 0 and home.file_bytes() == 0


_HELD_AT_EXIT = """
import sys, threading, time, torch
from ov_backend import WeightFile
from ov_backend.weights import DigestMemo

weights, memo = WeightFile(sys.argv[1]), DigestMemo()
tensors = [torch.ones(64, 64) for _ in range(4)]
weights.take(tensors)
for t in tensors:
    memo.remember(t, b"digest")
held = threading.Event()

def hold() -> None:  # a daemon thread frozen at the exit while it holds both locks
    with weights._lock, memo._lock:
        held.set()
        time.sleep(3600)

threading.Thread(target=hold, daemon=True).start()
held.wait()
del tensors[:2]  # their weak references' callbacks run now, on this thread
print("dropped", flush=True)
cycle = [tensors]  # the rest go in the exit's last collection
cycle.append(cycle)
del tensors, cycle
"""


def test_a_weak_reference_callback_never_waits_for_a_lock_another_thread_holds(tmp_path: Path) -> None:
    """At the interpreter's exit, daemon threads are frozen where they stand: the weight file's page keeper could
    hold the file's lock, and the exit's last collection called a callback that waited for it (the batch command
    hung after its last image). A tensor that goes while another thread holds the lock is forgotten later."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _HELD_AT_EXIT, str(tmp_path / "weights")], cwd=root,
                          env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["dropped"]


def test_what_was_forgotten_while_the_lock_was_held_goes_at_the_next_take(tmp_path: Path) -> None:
    import threading

    weights = WeightFile(tmp_path / "weights")
    first, second = torch.ones(8, 8), torch.ones(8, 8)
    weights.take([first, second])
    gone = id(first)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with weights._lock:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    del first  # its callback cannot take the lock now: it leaves the removal for later
    assert gone in weights._seen and len(weights._forget_later) == 1
    release.set()
    holder.join()
    weights.take([second])
    assert gone not in weights._seen and len(weights._forget_later) == 0
