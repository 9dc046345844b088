"""Releasing the compiled models of one compiled function (its owner runs that part otherwise now)."""

from __future__ import annotations

import torch

from ov_backend import OVBackend
from ov_backend.graph_runs import GraphCollector, GraphRunCounter

from .conftest import F32_ATOL, F32_RTOL, small_cnn


def test_a_collector_releases_its_functions_compiled_models_and_the_next_call_compiles_again():
    model = small_cnn().eval()
    backend = OVBackend({"model_caching": False, "precision": "f32"})
    collector = GraphCollector(GraphRunCounter(backend))
    other = GraphCollector(GraphRunCounter(backend))
    compiled = torch.compile(model, backend=collector, dynamic=True)
    compiled_other = torch.compile(small_cnn().eval(), backend=other, dynamic=True)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        want = model(x)
        compiled(x)
        compiled_other(x)
        converted = backend.stats()["convert_seconds"]
        assert backend.stats()["compiles"] == 2

        assert collector.release() == 1
        assert collector.release() == 0  # nothing left to release
        assert backend.stats()["released"] == 1
        compiled_other(x)  # the other function's model stayed: no compile
        assert backend.stats()["compiles"] == 2

        torch.testing.assert_close(compiled(x), want, rtol=F32_RTOL, atol=F32_ATOL)
    stats = backend.stats()
    assert stats["compiles"] == 3 and stats["convert_seconds"] == converted  # compiled again, not converted
