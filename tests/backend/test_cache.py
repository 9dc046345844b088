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
