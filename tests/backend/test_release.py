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


def test_a_reset_backend_drops_what_its_graphs_built_though_dynamo_still_holds_them():
    """Dynamo keeps the functions it compiled (and through them the backend's graphs) in the traced module's
    globals after ``torch.compiler.reset()``: a reset backend must not leave its compiled and converted models in
    memory through them (a checkpoint of another config reset it on every switch, and each switch kept them all).
    ``compiled_models`` counts what the graphs hold; the OpenVINO models themselves must be gone."""
    import gc
    import weakref

    import openvino as ov

    def openvino_models() -> list:
        gc.collect()
        return [o for o in gc.get_objects() if type(o) in (ov.CompiledModel, ov.Model)]

    before = {id(o) for o in openvino_models()}  # (other tests' backends may still hold theirs)
    model = small_cnn().eval()
    backend = OVBackend({"model_caching": False, "precision": "f32"})
    compiled = torch.compile(model, backend=backend, dynamic=True)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        want = model(x)
        compiled(x)
    graphs = list(backend._graphs)  # what dynamo keeps referencing after its reset
    assert backend.compiled_models() == 1 and sum(g.models_held() for g in graphs) == 1
    built = [weakref.ref(o) for o in openvino_models() if id(o) not in before]
    assert built

    torch.compiler.reset()  # resets the backend too (and the test's next compile starts clean)
    backend.reset()
    gc.collect()

    assert backend.compiled_models() == 0 and sum(g.models_held() for g in graphs) == 0
    assert [r for r in built if r() is not None] == [], "OpenVINO models outlived the reset"
    with torch.no_grad():  # the reset backend compiles again, right
        torch.testing.assert_close(torch.compile(model, backend=backend, dynamic=True)(x), want, rtol=F32_RTOL,
                                   atol=F32_ATOL)
    assert backend.compiled_models() == 1
