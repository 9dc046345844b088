"""The disk cache: reuse across processes, weights in the key, damaged entries, listing and pruning."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from ov_backend import ModelCache, OVBackend

from .conftest import F32_ATOL, F32_RTOL, small_cnn

_CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[3])
import ov_backend
from conftest import small_cnn
backend = ov_backend.OVBackend({"model_caching": True, "cache_dir": sys.argv[1],
                                "config": {"INFERENCE_PRECISION_HINT": "f32"}})
model = small_cnn(int(sys.argv[2]))
x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    out = torch.compile(model, backend=backend)(x)
    ref = model(x)
r = backend.reports[0]
print(json.dumps({"hit": r.cache_hit, "convert": r.convert_seconds, "trace": r.trace_seconds,
                  "diff": (out - ref).abs().max().item()}))
"""


def _child(cache_dir: Path, seed: int) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(cache_dir), str(seed), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_process_loads_from_cache(tmp_path):
    first = _child(tmp_path, seed=0)
    second = _child(tmp_path, seed=0)
    assert first["hit"] is False and first["convert"] > 0, first
    assert second["hit"] is True and second["convert"] == 0, second
    assert second["trace"] == 0, second  # a graph that is one partition is found without tracing it
    assert second["diff"] < F32_ATOL, second
    entries = ModelCache(tmp_path).entries()
    assert any(not e.key.startswith("blobs/") for e in entries)


def test_same_architecture_other_weights_never_share(tmp_path):
    _child(tmp_path, seed=0)
    other = _child(tmp_path, seed=1)
    assert other["hit"] is False  # a different checkpoint of the same architecture
    assert other["diff"] < F32_ATOL
    models = [e for e in ModelCache(tmp_path).entries() if not e.key.startswith("blobs/")]
    assert len(models) == 2


def _compile_once(cache_dir: Path) -> OVBackend:
    """Compile and run once; dynamo's reset afterwards also resets the backend, so report on a copy."""
    backend = OVBackend({"model_caching": True, "cache_dir": str(cache_dir),
                         "config": {"INFERENCE_PRECISION_HINT": "f32"}})
    model = small_cnn()
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x), atol=F32_ATOL, rtol=F32_RTOL)
    done = OVBackend(backend.settings)
    for report in backend.reports:
        done.add_report(report)
    done.stats_counter.add(**backend.stats())
    torch._dynamo.reset()
    return done


def test_truncated_entry_is_detected_and_rebuilt(tmp_path, caplog):
    _compile_once(tmp_path)
    (entry,) = [e for e in ModelCache(tmp_path).entries() if not e.key.startswith("blobs/")]
    binary = entry.path / "model.bin"
    binary.write_bytes(binary.read_bytes()[: binary.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="ov_backend"):
        backend = _compile_once(tmp_path)
    assert any("damaged" in r.getMessage() and "truncated" in r.getMessage() for r in caplog.records)
    assert backend.reports[0].cache_hit is False
    again = _compile_once(tmp_path)
    assert again.reports[0].cache_hit is True  # the rebuilt entry is good


def test_corrupted_entry_is_detected(tmp_path, caplog):
    _compile_once(tmp_path)
    (entry,) = [e for e in ModelCache(tmp_path).entries() if not e.key.startswith("blobs/")]
    binary = entry.path / "model.bin"
    data = bytearray(binary.read_bytes())
    data[len(data) // 2] ^= 0xFF
    binary.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="ov_backend"):
        backend = _compile_once(tmp_path)
    assert any("checksum" in r.getMessage() for r in caplog.records)
    assert backend.reports[0].cache_hit is False


def test_half_written_entry_is_never_trusted(tmp_path):
    """A process killed mid-write leaves only a temporary folder, which is not an entry."""
    cache = ModelCache(tmp_path)
    leftover = cache.models_dir / ".tmp-deadbeef-123456-xyz"
    leftover.mkdir(parents=True)
    (leftover / "model.xml").write_text("<net/>")
    assert cache.entries() == []
    # an entry folder without meta.json (written last) is rejected and removed
    key = "a" * 40
    (cache.models_dir / key).mkdir()
    (cache.models_dir / key / "model.xml").write_text("<net/>")
    import openvino as ov

    assert cache.load(key, ov.Core()) is None
    assert not (cache.models_dir / key).exists()


def test_list_clear_and_prune_lru(tmp_path):
    import openvino as ov

    core = ov.Core()
    cache = ModelCache(tmp_path)
    param = ov.opset13.parameter([1, 4], ov.Type.f32)
    for i, key in enumerate(["k1", "k2", "k3"]):
        const = ov.opset13.constant(torch.full((1, 4), float(i)).numpy())
        cache.store(key, ov.Model([ov.opset13.add(param, const)], [param], key), f"model {key}")
    old = time.time() - 100
    os.utime(cache.models_dir / "k1" / "meta.json", (old, old))
    os.utime(cache.models_dir / "k2" / "meta.json", (old + 50, old + 50))
    entries = cache.entries()
    assert [e.key for e in entries] == ["k3", "k2", "k1"]
    assert all(e.size_bytes > 0 for e in entries) and entries[0].description == "model k3"
    assert cache.load("k1", core) is not None  # a load counts as a use
    keep = sum(e.size_bytes for e in cache.entries() if e.key != "k2")
    removed = cache.prune(max_bytes=keep)
    assert removed == ["k2"]
    assert cache.clear(["k3"]) == ["k3"]
    assert [e.key for e in cache.entries()] == ["k1"]
    cache.clear()
    assert cache.entries() == [] and cache.total_bytes() == 0


def test_unwritable_cache_keeps_the_result(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="ov_backend"):
        backend = _compile_once(blocker / "cache")
    assert backend.stats()["ov_calls"] == 1
    assert any("could not write OpenVINO cache entry" in r.getMessage() for r in caplog.records)


# -- the size limit (BackendSettings.cache_max_bytes, ov_backend.cache_limit) ---------------------------------------

def _store_entries(cache: ModelCache, keys: list[str], age: float = 1000) -> None:
    """Store a small model under each key, the first the least recently used (``age`` seconds ago, then newer)."""
    import openvino as ov

    param = ov.opset13.parameter([1, 64], ov.Type.f32)
    for i, key in enumerate(keys):
        const = ov.opset13.constant(torch.full((1, 64), float(i)).numpy())
        cache.store(key, ov.Model([ov.opset13.add(param, const)], [param], key), f"model {key}")
        when = time.time() - age + i * 10
        os.utime(cache.models_dir / key / "meta.json", (when, when))


def _size(cache: ModelCache, key: str) -> int:
    return next(e.size_bytes for e in cache.entries() if e.key == key)


def test_prune_removes_least_recently_used_first_and_a_load_is_a_use(tmp_path):
    import openvino as ov

    from ov_backend.cache_limit import enforce

    cache = ModelCache(tmp_path)
    _store_entries(cache, ["k1", "k2", "k3", "k4"])
    assert cache.load("k1", ov.Core()) is not None  # the oldest, used now: the newest
    limit = _size(cache, "k1") + _size(cache, "k4") + 10
    counted: dict[str, float] = {}
    result = enforce(cache, limit, lambda **amounts: counted.update(amounts))
    assert result.removed == ("k2", "k3")
    assert sorted(e.key for e in cache.entries()) == ["k1", "k4"]
    assert result.total_bytes == sum(e.size_bytes for e in cache.entries()) <= limit
    assert counted == {"cache_pruned": 2, "cache_pruned_bytes": result.removed_bytes, "cache_prune_errors": 0}
    assert enforce(cache, 0).removed == ()  # 0: no limit
    assert len(cache.entries()) == 2


def test_entries_in_use_are_never_pruned_and_a_too_small_limit_warns_once(tmp_path, caplog):
    """A backend's compiled model holds its cache entry (and the blob OpenVINO wrote for it): a limit of one byte
    removes every other entry after the build, keeps those, says so once, and the output is right."""
    cache_dir = tmp_path / "cache"
    _store_entries(ModelCache(cache_dir), ["old1", "old2"])
    backend = OVBackend({"model_caching": True, "cache_dir": str(cache_dir), "cache_max_bytes": 1,
                         "config": {"INFERENCE_PRECISION_HINT": "f32"}})
    model = small_cnn()
    compiled = torch.compile(model, backend=backend)
    with caplog.at_level(logging.WARNING, logger="ov_backend"), torch.no_grad():
        for size in (16, 24):  # a second size: another build and store, over the limit again
            x = torch.randn(1, 3, size, size)
            torch.testing.assert_close(compiled(x), model(x), atol=F32_ATOL, rtol=F32_RTOL)
    left = {e.key for e in backend.cache.entries()}
    assert "old1" not in left and "old2" not in left
    assert left and left == backend.cache.holds.in_use()  # what the compiled graphs use, all kept
    assert any(k.startswith("models/") or not k.startswith(("blobs/", "captures/")) for k in left)
    warnings = [r for r in caplog.records if "over its limit" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    stats = backend.stats()
    assert stats["cache_pruned"] == 2 and stats["cache_pruned_bytes"] > 0 and stats["cache_prune_errors"] == 0
    usage = backend.cache_usage()
    assert usage.limit_bytes == 1 and usage.over_limit and usage.bytes == usage.in_use_bytes > 0
    assert "limit" in usage.text() and "in use" in usage.text()
    assert any("removed 2 least recently used entries" in line for line in
               __import__("ov_backend").Stats.from_mapping(stats).text_lines())
    # once nothing holds them (dynamo's caches dropped), they are the cache's to prune like any other
    del compiled
    torch._dynamo.reset()
    import gc

    gc.collect()
    assert backend.cache.holds.in_use() == set()
    backend.enforce_cache_limit()
    assert backend.cache.entries() == []


def test_pruning_never_touches_what_is_being_written(tmp_path):
    cache = ModelCache(tmp_path)
    _store_entries(cache, ["k1"])
    writing = cache.models_dir / ".tmp-k2-abcdef-xyz"  # a store in progress (here or in another process)
    writing.mkdir()
    (writing / "model.bin").write_bytes(b"x" * 4096)
    cache.capture_dir.mkdir()
    (cache.capture_dir / ".abc.capture.1234abcd.tmp").write_bytes(b"y" * 4096)  # atomic_path's temporary file
    from ov_backend.cache_limit import enforce

    result = enforce(cache, 1)
    assert result.removed == ("k1",)
    assert writing.is_dir() and (writing / "model.bin").stat().st_size == 4096
    assert (cache.capture_dir / ".abc.capture.1234abcd.tmp").is_file()


def test_errors_while_pruning_are_logged_and_never_fail_the_build(tmp_path, caplog, monkeypatch):
    """An entry that cannot be removed (permissions) is left with a WARNING; one another process removed first
    counts as gone; the compile runs and its result is right."""
    import shutil

    cache_dir = tmp_path / "cache"
    _store_entries(ModelCache(cache_dir), ["locked", "vanishing", "old"])
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if Path(path).name == "locked":
            raise PermissionError(13, "Permission denied", str(path))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    real_entries = ModelCache.entries

    def entries_then_another_process_prunes(self):
        found = real_entries(self)
        real_rmtree(self.models_dir / "vanishing", ignore_errors=True)  # a concurrent prune, after our listing
        return found

    monkeypatch.setattr(ModelCache, "entries", entries_then_another_process_prunes)
    backend = OVBackend({"model_caching": True, "cache_dir": str(cache_dir), "cache_max_bytes": 1,
                         "config": {"INFERENCE_PRECISION_HINT": "f32"}})
    model = small_cnn()
    x = torch.randn(1, 3, 16, 16)
    with caplog.at_level(logging.WARNING, logger="ov_backend"), torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x), atol=F32_ATOL, rtol=F32_RTOL)
    assert any("could not remove OpenVINO cache entry" in r.getMessage() and "locked" in r.getMessage()
               for r in caplog.records)
    stats = backend.stats()
    assert stats["cache_prune_errors"] == 1 and stats["cache_pruned"] == 2  # "vanishing" and "old"
    assert (cache_dir / "models" / "locked").is_dir() and not (cache_dir / "models" / "old").exists()
    assert stats["ov_calls"] == 1
