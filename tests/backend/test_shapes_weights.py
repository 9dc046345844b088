"""Shapes are compiled once and kept; weights changed after the compile are always used."""

from __future__ import annotations

import torch

from ov_backend import OVBackend

from .conftest import F32_ATOL, F32_RTOL, small_cnn


def test_twelve_shapes_all_in_openvino_and_kept(backend):
    model = small_cnn()
    compiled = torch.compile(model, backend=backend)
    sizes = [8 + 4 * i for i in range(12)]
    with torch.no_grad():
        for size in sizes:
            x = torch.randn(2, 3, size, size)
            torch.testing.assert_close(compiled(x), model(x), atol=F32_ATOL, rtol=F32_RTOL)
    stats = backend.stats()
    assert stats["ov_calls"] == 12 and stats["eager_calls"] == 0
    assert len(backend.reports) == 12
    # one conversion for the first shape, one dynamic conversion reused for every other shape
    converted = [r for r in backend.reports if not all(p.reused for p in r.partitions)]
    assert len(converted) == 2
    assert all(r.route == "dynamic" for r in backend.reports[1:])
    compiles = stats["compiles"]
    with torch.no_grad():
        for size in sizes[1:5]:
            compiled(torch.randn(2, 3, size, size))
    assert backend.stats()["compiles"] == compiles  # shapes seen before cost no compile
    with torch.no_grad():
        compiled(torch.randn(2, 3, sizes[0], sizes[0]))
    # dynamo now routes the very first shape to the dynamic graph: a compile, never a conversion
    assert backend.stats()["compiles"] <= compiles + 1
    assert all(p.reused for p in backend.reports[-1].partitions)


def test_in_place_weight_change_is_used(backend):
    model = small_cnn()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        before = compiled(x)
        original = model[0].weight.detach().clone()
        model[0].weight.add_(0.5)  # what A1111's LoRA code does: an in-place write
        after = compiled(x)
        torch.testing.assert_close(after, model(x), atol=F32_ATOL, rtol=F32_RTOL)
        assert not torch.allclose(before, after)
        compiles = backend.stats()["compiles"]
        model[0].weight.copy_(original)  # back to the first weights: reuses their model
        torch.testing.assert_close(compiled(x), before, atol=F32_ATOL, rtol=F32_RTOL)
        assert backend.stats()["compiles"] == compiles


def test_replaced_parameter_is_used(backend):
    model = small_cnn()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        compiled(x)
        model[7].weight = torch.nn.Parameter(torch.randn_like(model[7].weight))
        torch.testing.assert_close(compiled(x), model(x), atol=F32_ATOL, rtol=F32_RTOL)


def test_weight_check_sees_every_call_cheaply(tmp_path):
    """The per-call check compares identities and version counters, not contents."""
    from ov_backend.weights import WeightWatch

    tensors = [torch.randn(64, 64) for _ in range(500)]
    watch = WeightWatch(tensors)
    assert not watch.changed(tensors)
    tensors[123].mul_(1.0)
    assert watch.changed(tensors)
    assert not WeightWatch(tensors).changed(tensors)


def test_two_threads_one_module():
    """Two threads call one compiled module at once, with mixed shapes.

    The shapes are compiled first: torch's FX tracing sets process-wide state that makes a call
    of any compiled function in another thread fail while a trace runs (a torch limitation).
    """
    import threading

    backend = OVBackend({"config": {"INFERENCE_PRECISION_HINT": "f32"}})
    model = small_cnn()
    compiled = torch.compile(model, backend=backend)
    inputs = [torch.randn(2, 3, 16 if i % 3 else 24, 16 if i % 3 else 24) for i in range(8)]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
        compiled(inputs[0])
        compiled(inputs[1])
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def work(indices):
        try:
            start.wait()
            with torch.no_grad():
                for _ in range(5):
                    for i in indices:
                        results[i] = compiled(inputs[i])
        except BaseException as err:  # report in the main thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(range(k, 8, 2),)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for i, want in enumerate(expected):
        torch.testing.assert_close(results[i], want, atol=F32_ATOL, rtol=F32_RTOL)
    assert backend.stats()["eager_calls"] == 0


def test_dynamic_true_with_unspecialised_module_floats(backend):
    """With dynamic=True dynamo passes a norm's eps as a 0-d tensor read by .item(): baked, not eager."""

    class NormScale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
            self.norm = torch.nn.GroupNorm(2, 4)

        def forward(self, x):
            return self.norm(self.conv(x)) * 0.5

    model = NormScale().eval()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for size in (8, 9, 8):
            x = torch.randn(1, 4, size, size)
            torch.testing.assert_close(compiled(x), model(x), atol=F32_ATOL, rtol=F32_RTOL)
    stats = backend.stats()
    assert stats["eager_calls"] == 0 and stats["ov_calls"] == 3
    assert stats["compiles"] == 2
