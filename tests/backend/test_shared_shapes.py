"""One model compiled with dynamic shapes for every shape a graph needs at once (``shared_shapes``).

A compiled model holds its own copy of the weights in the device's layout, so a graph that keeps one
per shape holds that copy once per shape (a full SD 1.5 UNet at bf16: 1.7 GB each, e.g. a long prompt
in A1111 calls it at two shapes per step). These tests pin down when the shared model is made, what
it replaces, when it goes, and that every picture stays the eager one.
"""

from __future__ import annotations

import openvino as ov
import pytest
import torch

from ov_backend import OVBackend
from ov_backend.graph_runs import GraphCollector, GraphRunCounter

from .conftest import f32_backend as make_backend
from .test_weight_binding import Block, call


def shared(report) -> bool:
    return [p.all_shapes for p in report.partitions] == [True]


def sharing(tmp_path):
    """A Block compiled on a fresh backend, run at two shapes in one use window: its model is shared."""
    backend = make_backend(tmp_path)
    model = Block().eval()
    compiled = torch.compile(model, backend=backend)
    backend.start_window()
    call(compiled, model, 8, 8)
    call(compiled, model, 12, 8)
    assert shared(backend.reports[-1])
    return backend, model, compiled


def test_a_second_shape_while_the_first_is_in_use_compiles_one_model_for_both(tmp_path):
    backend, model, compiled = sharing(tmp_path)  # 8x8, then 12x8 in the same window
    first, second = backend.reports
    assert not shared(first)  # one shape: its own model; a second one: one model for all shapes
    assert "one compiled model for all shapes (replaces 1 compiled" in second.summary()
    assert backend.stats()["compiles"] == 2
    assert backend.stats()["released"] == 0  # the 8x8 model was replaced (the shared one serves 8x8), not unused
    converted = backend.stats()["convert_seconds"]
    call(compiled, model, 8, 8)  # the shape whose model it replaced runs it: nothing built
    assert len(backend.reports) == 2
    call(compiled, model, 16, 12)  # a new shape costs no compile
    assert backend.stats()["compiles"] == 2 and backend.stats()["convert_seconds"] == converted
    assert shared(backend.reports[-1]) and backend.reports[-1].compile_seconds == 0
    backend.start_window()
    call(compiled, model, 12, 8)  # a later window with shapes seen: the shared model, nothing built
    call(compiled, model, 8, 8)
    assert backend.stats()["compiles"] == 2 and len(backend.reports) == 3


def test_a_window_that_needs_one_shape_goes_back_to_a_model_for_it(tmp_path):
    backend, model, compiled = sharing(tmp_path)
    backend.start_window()
    call(compiled, model, 20, 8)  # unused in this window, the shared model goes: one model for this shape
    assert not shared(backend.reports[-1])
    assert backend.stats()["released"] == 1 and backend.stats()["compiles"] == 3
    call(compiled, model, 8, 8)  # and a second shape in this window shares again, replacing 20x8's
    assert shared(backend.reports[-1]) and backend.reports[-1].partitions[0].replaced == 1
    assert backend.stats()["released"] == 1 and backend.stats()["compiles"] == 4


def test_without_windows_the_second_shape_shares(tmp_path):
    backend = make_backend(tmp_path)
    model = Block().eval()
    compiled = torch.compile(model, backend=backend)
    for height in (8, 12, 16, 8, 12):
        call(compiled, model, height, 8)
    assert backend.stats()["compiles"] == 2 and backend.stats()["released"] == 0


def test_never_compiles_per_shape_and_always_compiles_once(tmp_path):
    per_shape = make_backend(tmp_path, shared_shapes="never")
    model = Block().eval()
    compiled = torch.compile(model, backend=per_shape)
    for height in (8, 12, 16):
        call(compiled, model, height, 8)
    assert per_shape.stats()["compiles"] == 3 and not any(shared(r) for r in per_shape.reports)
    torch._dynamo.reset()
    always = make_backend(tmp_path, shared_shapes="always")
    compiled = torch.compile(model, backend=always)
    for height in (8, 12, 16):
        call(compiled, model, height, 8)
    assert [r.route for r in always.reports] == ["dynamic"] * 3 and all(shared(r) for r in always.reports)
    assert always.stats()["compiles"] == 1 and always.stats()["released"] == 0


def test_other_devices_compile_per_shape_under_auto(tmp_path):
    backend = make_backend(tmp_path, device="AUTO")
    model = Block().eval()
    compiled = torch.compile(model, backend=backend)
    for height in (8, 12):
        call(compiled, model, height, 8)
    assert backend.stats()["compiles"] == 2 and not any(shared(r) for r in backend.reports)


def test_new_weights_get_their_own_models_and_the_picture_follows(tmp_path):
    backend, model, compiled = sharing(tmp_path)
    with torch.no_grad():
        model.q.weight.mul_(1.5)  # a LoRA: in place
    call(compiled, model, 12, 8)  # compared with eager inside: the new weights' picture
    report = backend.reports[-1]
    assert [p.weights_changed for p in report.partitions] == [True]
    assert not shared(report)  # the new weights' first shape: a model of its own
    call(compiled, model, 8, 8)
    assert shared(backend.reports[-1])


def test_a_model_for_all_shapes_that_does_not_compile_falls_back_to_one_per_shape(tmp_path, monkeypatch, caplog):
    real = OVBackend.compile_model

    def static_only(self, model):
        if isinstance(model, ov.Model) and model.is_dynamic():
            raise RuntimeError("this device needs static shapes")
        return real(self, model)

    monkeypatch.setattr(OVBackend, "compile_model", static_only)
    backend = make_backend(tmp_path, shared_shapes="always")
    model = Block().eval()
    compiled = torch.compile(model, backend=backend)
    for height in (8, 12, 16, 12):
        call(compiled, model, height, 8)
    dynamic = [r for r in backend.reports if r.route == "dynamic"]
    assert len(dynamic) == 3 and not any(shared(r) for r in dynamic)  # 8, 12 and 16 high
    assert "compile for all shapes failed: this device needs static shapes" in dynamic[0].warnings[0]
    assert not dynamic[1].warnings and not dynamic[2].warnings  # tried once per graph
    assert "compiling it for each shape instead" in caplog.text


def test_releasing_a_function_releases_its_model_for_all_shapes(tmp_path):
    backend = make_backend(tmp_path, model_caching=False)
    collector = GraphCollector(GraphRunCounter(backend))
    model = Block().eval()
    compiled = torch.compile(model, backend=collector)
    for height in (8, 12):
        call(compiled, model, height, 8)
    assert shared(backend.reports[-1])
    assert collector.release() == 1  # the shared model (its variants hold none of their own)
    assert collector.release() == 0
    call(compiled, model, 16, 8)  # compiled again, for this shape
    assert not shared(backend.reports[-1]) and backend.stats()["compiles"] == 3


@pytest.mark.parametrize("value", ["sometimes", 1, None.__class__])
def test_an_unknown_shared_shapes_value_says_what_is_valid(tmp_path, value):
    with pytest.raises(ValueError, match=r"option 'shared_shapes' must be one of \['auto', 'always', 'never'\]"):
        make_backend(tmp_path, shared_shapes=value)
