"""What makes the first call cheap: fake-tensor tracing, hashing each weight once, sampled file checks."""

from __future__ import annotations

import gc
import logging

import torch

from ov_backend import ModelCache, OVBackend, convert, weights
from ov_backend.cache import _file_digest
from ov_backend.ops import decomposition_table

from .conftest import F32_ATOL, F32_RTOL, small_cnn


def test_trace_runs_on_fake_tensors_and_keeps_weights_as_constants():
    model = small_cnn().eval()
    x = torch.randn(2, 3, 16, 16)
    traced = convert.trace_static(model, [x], decomposition_table(()))
    constants = {id(t) for t in traced.buffers()} | {id(getattr(traced, n.target)) for n in traced.graph.nodes
                                                      if n.op == "get_attr"}
    # the real weights themselves are the graph's constants (no copies, no fake tensors)
    assert {id(p) for p in model.parameters()} <= constants
    with torch.no_grad():
        torch.testing.assert_close(traced(x), model(x))


@torch.library.custom_op("ov_backend_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:  # an op with no fake (shape-only) implementation
    return x * 2


def test_op_without_fake_implementation_is_traced_with_real_tensors(caplog):
    x = torch.arange(3.0)
    with caplog.at_level(logging.INFO, logger="ov_backend"):
        traced = convert.trace_static(lambda t: _twice(t) + 1, [x], decomposition_table(()))
    assert any("tracing with real tensors" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(traced(x), x * 2 + 1)


def test_each_weight_is_hashed_once_while_unchanged(monkeypatch):
    reads: list[int] = []
    real_digest = weights._digest
    monkeypatch.setattr(weights, "_digest", lambda t: reads.append(id(t)) or real_digest(t))
    memo = weights.DigestMemo()
    tensors = [torch.randn(8, 8) for _ in range(4)]
    first = weights.fingerprint(tensors, memo)
    assert weights.fingerprint(tensors, memo) == first
    assert weights.fingerprint(tensors[:2], memo) == weights.fingerprint(tensors[:2])  # other graph, same weights
    assert len(reads) == 4 + 2  # the memo-less call above reads its two tensors again
    tensors[1].add_(1.0)  # an in-place write (a LoRA)
    changed = weights.fingerprint(tensors, memo)
    assert changed != first and len(reads) == 7
    assert changed == weights.fingerprint(tensors)


def test_weights_are_hashed_with_xxh3_and_each_hash_names_itself(monkeypatch):
    assert weights.DIGEST == "xxh3_128"  # xxhash is a requirement (pyproject, install.py): 10x sha256's speed
    big = torch.randn(20_000_000)  # 80 MB: over the two-thread threshold
    tensors = [torch.randn(3, 4), big]
    fast = weights.fingerprint(tensors)
    big[-1] += 1.0  # the last element of the large tensor
    assert weights.fingerprint(tensors) != fast
    big[-1] -= 1.0
    assert weights.fingerprint(tensors) == fast
    same_bytes = [tensors[0].reshape(4, 3), big]  # same bytes, other shape
    assert weights.fingerprint(same_bytes) != fast

    monkeypatch.setattr(weights, "xxhash", None)  # no xxhash: sha256, under another name
    monkeypatch.setattr(weights, "DIGEST", "sha256")
    slow = weights.fingerprint(tensors)
    assert slow != fast and len(slow) == len(fast)
    big[0] = 7.0
    assert weights.fingerprint(tensors) != slow


def test_a_freed_tensor_is_forgotten_and_never_mistaken_for_its_successor():
    memo = weights.DigestMemo()
    t = torch.zeros(16)
    weights.fingerprint([t], memo)
    assert len(memo) == 1
    del t
    gc.collect()
    assert len(memo) == 0
    u = torch.ones(16)  # may reuse the id and the address of the old tensor
    assert weights.fingerprint([u], memo) == weights.fingerprint([u])


def test_weight_watch_does_not_trust_a_new_tensor_at_an_old_address():
    t = torch.zeros(1024)
    watch = weights.WeightWatch([t])
    assert not watch.changed([t])
    del t
    gc.collect()
    assert watch.changed([torch.zeros(1024)])


def test_graphs_of_one_module_share_weight_digests(monkeypatch):
    """Dynamo's static and dynamic graphs of a module hash its weights once in all."""
    reads: list[int] = []
    real_digest = weights._digest
    monkeypatch.setattr(weights, "_digest", lambda t: reads.append(id(t)) or real_digest(t))
    model = small_cnn().eval()
    n_weights = len(list(model.parameters())) + len(list(model.buffers()))
    backend = OVBackend({"config": {"INFERENCE_PRECISION_HINT": "f32"}})
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for size in (16, 20, 24):
            x = torch.randn(1, 3, size, size)
            torch.testing.assert_close(compiled(x), model(x), atol=F32_ATOL, rtol=F32_RTOL)
    assert len(backend._graphs) >= 2
    assert len({i for i in reads}) == len(reads) == n_weights


def test_large_cache_files_are_checked_by_size_and_sampled_blocks(tmp_path):
    path = tmp_path / "model.bin"
    data = bytearray(torch.randint(0, 256, (80 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
                     .numpy().tobytes())
    path.write_bytes(bytes(data))
    digest = _file_digest(path)
    data[0] ^= 0xFF  # inside the first sampled block
    path.write_bytes(bytes(data))
    assert _file_digest(path) != digest
    data[0] ^= 0xFF
    path.write_bytes(bytes(data[:-1]))
    assert _file_digest(path) != digest
    path.write_bytes(bytes(data))
    assert _file_digest(path) == digest


def test_cache_entry_written_in_this_format_is_trusted_and_older_ones_are_not(tmp_path):
    import json

    backend = OVBackend({"model_caching": True, "cache_dir": str(tmp_path),
                         "config": {"INFERENCE_PRECISION_HINT": "f32"}})
    model = small_cnn().eval()
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(1, 3, 16, 16))
    (entry,) = [e for e in ModelCache(tmp_path).entries() if not e.key.startswith("blobs/")]
    meta = json.loads((entry.path / "meta.json").read_text())
    assert set(meta["files"]["model.bin"]) == {"size", "checksum"}
    assert ModelCache(tmp_path)._verify(entry.path) is None
    meta["format"] = 1
    (entry.path / "meta.json").write_text(json.dumps(meta))
    assert ModelCache(tmp_path)._verify(entry.path) == "unknown entry format"


def test_weight_digests_belong_to_the_backend_and_reset_clears_them():
    model = small_cnn().eval()
    backend = OVBackend({"precision": "f32"})
    other = OVBackend({"precision": "f32"})
    assert backend.digests is not other.digests
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(1, 3, 16, 16))
    assert len(backend.digests) == len(list(model.parameters())) + len(list(model.buffers()))
    assert len(other.digests) == 0
    backend.reset()
    assert len(backend.digests) == 0
