"""Weights changed in place cost a compile, not a conversion; use windows bound what stays compiled."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest
import torch

from ov_backend import OVBackend
from ov_backend.weight_binding import WeightBoundModel
from ov_backend.weights import digests

from .conftest import F32_ATOL, F32_RTOL, f32_backend


class Block(torch.nn.Module):
    """A conv, a layer norm and two linear layers: the kinds of weights a LoRA and a checkpoint change."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(4, 16, 3, padding=1)
        self.norm = torch.nn.LayerNorm(16)
        self.q = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).permute(0, 2, 3, 1)
        h = self.out(torch.nn.functional.silu(self.q(self.norm(h))))
        return h.permute(0, 3, 1, 2)


def call(compiled, model, height: int, width: int) -> torch.Tensor:
    x = torch.randn(2, 4, height, width)
    for dim in (0, 2, 3):
        torch._dynamo.maybe_mark_dynamic(x, dim)
    with torch.no_grad():
        got = compiled(x)
        torch.testing.assert_close(got, model(x), atol=F32_ATOL, rtol=F32_RTOL)
    return got


def test_lora_like_change_is_compiled_from_the_converted_model(backend):
    model = Block().eval()
    compiled = torch.compile(model, backend=backend)
    call(compiled, model, 8, 8)
    assert backend.reports[-1].route == "dynamic"
    converted = backend.stats()["convert_seconds"]
    assert converted > 0
    hashed = backend.stats()["hash_seconds"]
    assert 0 < hashed <= backend.stats()["compile_seconds"]  # fingerprinting the weights is part of the build
    original = model.q.weight.detach().clone()
    with torch.no_grad():
        model.q.weight.add_(torch.randn_like(model.q.weight))  # A1111's LoRA: an in-place write
    call(compiled, model, 8, 8)  # the picture of the new weights (compared with eager inside)
    assert backend.stats()["hash_seconds"] > hashed  # the new weights were fingerprinted, and that is counted
    report = backend.reports[-1]
    assert [p.weights_changed for p in report.partitions] == [True]
    assert "conversion reused for the new weights" in report.summary()
    assert backend.stats()["convert_seconds"] == converted
    call(compiled, model, 12, 8)  # a new size with the new weights: a reshape, still no conversion
    assert backend.stats()["convert_seconds"] == converted
    compiles = backend.stats()["compiles"]
    with torch.no_grad():
        model.q.weight.copy_(original)  # the LoRA removed: the models of the first weights are kept
    call(compiled, model, 8, 8)
    assert backend.stats()["compiles"] == compiles


def test_a_checkpoint_loaded_in_place_or_never_seen_converts_nothing(backend, tmp_path):
    """Every weight changes (A1111 loads another checkpoint into the same modules). The graph was
    converted with the weights as inputs, so its model holds nothing of them (not the layer norm's
    weight, which the frontend reshapes, nor a norm of ones, which it would drop): compiling it again
    gives the new checkpoint's picture, and its one cache entry serves a checkpoint the next process
    has never seen."""
    from ov_backend import OVBackend

    options = {"precision": "f32", "model_caching": True, "cache_dir": str(tmp_path / "cache")}
    model, other, third = Block().eval(), Block().eval(), Block().eval()
    torch.manual_seed(5)
    for p in [*other.parameters(), *third.parameters()]:
        torch.nn.init.normal_(p)
    first = OVBackend(options)
    compiled = torch.compile(model, backend=first)
    call(compiled, model, 8, 8)
    converted = first.stats()["convert_seconds"]
    assert first.reports[-1].route == "dynamic" and converted > 0
    with torch.no_grad():
        model.load_state_dict(other.state_dict())  # copy_ into the same tensors, the norm's too
    call(compiled, model, 8, 8)  # the picture of the new weights (compared with eager inside)
    assert first.stats()["convert_seconds"] == converted
    assert "conversion reused for the new weights" in first.reports[-1].summary()
    entries = [e for e in first.cache.entries() if "dynamic" in e.description]
    assert len(entries) == 1  # one entry for both checkpoints: it names no weights
    assert entries[0].any_weights  # (the panel counts it for every checkpoint, not the one that made it)

    torch._dynamo.reset()  # the next process, a third checkpoint: read from the cache, not converted
    second = OVBackend(options)
    call(torch.compile(third, backend=second), third, 8, 8)
    assert second.reports[-1].cache_hit and second.stats()["convert_seconds"] == 0

    torch._dynamo.reset()  # another precision: the model as converted is the same (its key has no device)
    other_precision = OVBackend(dict(options, precision="auto"))
    with torch.no_grad():
        x = torch.randn(2, 4, 8, 8)
        for dim in (0, 2, 3):
            torch._dynamo.maybe_mark_dynamic(x, dim)
        got, want = torch.compile(third, backend=other_precision)(x), third(x)
        assert float((got - want).norm() / want.norm()) < 0.03  # bf16 where the CPU has it
    assert other_precision.reports[-1].cache_hit and other_precision.stats()["convert_seconds"] == 0


def test_a_model_made_from_the_weights_values_is_never_stored_for_other_weights(tmp_path, monkeypatch):
    """When the weights cannot stay inputs (here: the converted model would not take them back), they are
    converted as constants; such a model (this block's norm of ones is dropped from it) is stored under
    its weights' fingerprint, never under the key that serves any weights."""
    from ov_backend import OVBackend
    from ov_backend.build import dynamic

    monkeypatch.setattr(dynamic, "name_weight_inputs", lambda *args: None)
    options = {"precision": "f32", "model_caching": True, "cache_dir": str(tmp_path / "cache")}
    model = Block().eval()
    first = OVBackend(options)
    call(torch.compile(model, backend=first), model, 8, 8)
    assert first.reports[-1].route == "dynamic"
    torch._dynamo.reset()  # the next process, other weights (a norm that is not ones)
    other = Block().eval()
    torch.manual_seed(3)
    for p in other.parameters():
        torch.nn.init.normal_(p)
    second = OVBackend(options)
    call(torch.compile(other, backend=second), other, 8, 8)  # its own picture (compared with eager inside)
    assert not second.reports[-1].cache_hit
    assert not any(e.any_weights for e in second.cache.entries())  # each entry is its weights' own


@pytest.mark.parametrize("change", ["norm", "conv bias", "replaced tensor"])
def test_any_weight_change_gives_the_new_weights(backend, change):
    """Whatever the model shares with the tensors or copied, the result is that of the weights now."""
    model = Block().eval()
    compiled = torch.compile(model, backend=backend)
    before = call(compiled, model, 8, 8)
    with torch.no_grad():
        if change == "norm":
            model.norm.weight.mul_(-2.0)
        elif change == "conv bias":
            model.conv.bias.add_(1.0)
        else:
            model.out.weight = torch.nn.Parameter(torch.randn_like(model.out.weight))
    after = call(compiled, model, 8, 8)
    assert not torch.allclose(before, after)


@pytest.fixture
def per_shape(tmp_path) -> OVBackend:
    """A backend that compiles one model per shape (see test_shared_shapes for the shared model)."""
    return f32_backend(tmp_path, shared_shapes="never")


def test_a_use_window_releases_what_it_did_not_call(per_shape):
    backend = per_shape
    model = Block().eval()
    compiled = torch.compile(model, backend=backend)
    backend.start_window()
    call(compiled, model, 8, 8)
    call(compiled, model, 12, 8)  # two sizes in one window: both kept
    assert backend.stats()["released"] == 0
    backend.start_window()
    call(compiled, model, 8, 8)
    call(compiled, model, 16, 8)  # the 12x8 model was not called in this window: released first
    assert backend.stats()["released"] == 1
    converted, compiles = backend.stats()["convert_seconds"], backend.stats()["compiles"]
    backend.start_window()
    call(compiled, model, 12, 8)  # back to it: compiled again from the converted model
    assert backend.stats()["compiles"] == compiles + 1
    assert backend.stats()["convert_seconds"] == converted
    assert backend.stats()["released"] == 3  # 8x8 and 16x8, unused in this window


def test_without_windows_nothing_is_released(per_shape):
    backend = per_shape
    model = Block().eval()
    compiled = torch.compile(model, backend=backend)
    for height in (8, 12, 16, 8, 12):
        call(compiled, model, height, 8)
    assert backend.stats()["released"] == 0
    assert backend.stats()["compiles"] == 3


def _model_of(*constants: ov.Node) -> ov.Model:
    x = ops.parameter([4], np.float32, name="x")
    out = x
    for const in constants:
        out = ops.add(out, ops.reduce_sum(const, [0, 1], keep_dims=False)
                      if len(const.get_output_shape(0)) == 2 else const)
    return ov.Model([out], [x])


def _shared(t: torch.Tensor) -> ov.Node:
    return ops.constant(t.numpy(), shared_memory=True)


def test_weight_bound_model_rules():
    """The rules :class:`WeightBoundModel` applies, on a model built by hand."""
    shared_w = torch.randn(3, 4)
    copied_w = torch.randn(4)
    model = _model_of(_shared(shared_w), ops.constant(copied_w.numpy().copy()))
    ws = [shared_w, copied_w]
    bound = WeightBoundModel(model, ws, digests(ws))
    assert bound.shared_bytes == shared_w.numel() * 4 and bound.copied_bytes == copied_w.numel() * 4
    assert bound.serves(ws, digests(ws))
    shared_w.add_(1.0)  # read from the tensor: still serves
    assert bound.serves(ws, digests(ws))
    copied_w.add_(1.0)  # the model holds an older copy: does not
    assert not bound.serves(ws, digests(ws))
    assert not bound.serves([shared_w.clone(), copied_w], digests([shared_w.clone(), copied_w]))


def test_an_integer_constant_is_never_taken_for_a_copy_of_a_float_weight():
    """An SD UNet's 4-element output bias beside its 4-element shape and permutation constants."""
    bias = torch.randn(4)
    x = ops.parameter([1, 1, 1, 4], np.float32, name="x")
    permuted = ops.transpose(ops.add(x, _shared(bias)), ops.constant(np.array([0, 3, 1, 2], dtype=np.int64)))
    model = ov.Model([permuted], [x])
    bound = WeightBoundModel(model, [bias], digests([bias]))
    assert bound.shared_bytes == 16 and bound.copied_bytes == 0
    bias.add_(1.0)
    assert bound.serves([bias], digests([bias]))


def test_a_copy_with_a_shared_weights_element_count_makes_it_count_as_copied():
    """A constant derived from a weight (a transposed copy) would not follow it: same element count,
    so that weight must stay unchanged for the model to be reused."""
    w = torch.randn(3, 4)
    model = _model_of(_shared(w), ops.constant(w.t().contiguous().numpy()))
    bound = WeightBoundModel(model, [w], digests([w]))
    assert bound.shared_bytes == 0
    w.add_(1.0)
    assert not bound.serves([w], digests([w]))


class Wide(Block):
    """The block with weights large enough that a copy of them would dominate a cache entry."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.q = torch.nn.Linear(16, 1024)
        self.out = torch.nn.Linear(1024, 4)


def test_the_disk_cache_stores_no_copy_of_the_weights_and_a_restart_follows_changes(tmp_path):
    from ov_backend import OVBackend

    options = {"precision": "f32", "model_caching": True, "cache_dir": str(tmp_path / "cache")}
    model = Wide().eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    first = OVBackend(options)
    call(torch.compile(model, backend=first), model, 8, 8)
    entries = [e for e in first.cache.entries() if "dynamic" in e.description]
    assert len(entries) == 1 and entries[0].size_bytes < weight_bytes / 4, (entries, weight_bytes)

    torch._dynamo.reset()  # a new process: dynamo captures again, the backend finds the entry
    second = OVBackend(options)
    compiled = torch.compile(model, backend=second)
    call(compiled, model, 8, 8)
    assert second.reports[-1].cache_hit and second.stats()["convert_seconds"] == 0
    with torch.no_grad():
        model.q.weight.mul_(-1.5)  # a LoRA after the restart: the loaded model reads the tensors too
    call(compiled, model, 8, 8)
    assert second.stats()["convert_seconds"] == 0
    assert [p.weights_changed for p in second.reports[-1].partitions] == [True]
    # the changed weights got their own (weightless) entry: a third process finds them on disk
    torch._dynamo.reset()
    third = OVBackend(options)
    call(torch.compile(model, backend=third), model, 8, 8)
    assert third.reports[-1].cache_hit and third.stats()["convert_seconds"] == 0
    assert all(e.size_bytes < weight_bytes / 4 for e in third.cache.entries() if "dynamic" in e.description)


def test_a_stored_model_that_does_not_fit_the_weights_is_converted_again(tmp_path):
    """Another graph's tensors (here: other shapes) never get attached to a stored model."""
    from ov_backend.weight_binding import attach_weights, weightless_copy

    model = Block().eval()
    weights = list(model.parameters())
    converted = _model_of(_shared(weights[4].detach()))
    stored = weightless_copy(converted, [w.detach() for w in weights])
    assert [p.get_friendly_name() for p in stored.get_parameters()][1:] == ["__ov_weight_4"]
    other = [w.detach() for w in weights]
    other[4] = torch.randn(3, 3)
    assert attach_weights(stored.clone(), other) is None
    attached = attach_weights(stored.clone(), [w.detach() for w in weights])
    assert attached is not None and len(attached.get_parameters()) == 1
    x = np.ones(4, np.float32)
    expected = x + weights[4].detach().sum().item()
    np.testing.assert_allclose(ov.Core().compile_model(attached, "CPU")(x)[0], expected, rtol=1e-5)


class Sliced(torch.nn.Module):
    """Python's max() and min() of a size, as A1111's InvokeAI attention slices its queries:
    ``torch.sym_max`` / ``torch.sym_min`` in the captured graph."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step = max(x.shape[1] // 4, 1)
        low = min(x.shape[1], 3)
        return self.lin(x) + self.lin(x[:, :step]).mean(dim=1, keepdim=True) + x[:, :low].mean(dim=1, keepdim=True)


def test_symbolic_max_and_min_of_sizes_go_the_static_route_without_an_export(backend, monkeypatch):
    """OpenVINO's frontend has no rule for torch.sym_max: such a graph is traced per shape at once."""
    from ov_backend import convert

    def no_export(*args, **kwargs):
        raise AssertionError("a graph with sym_max/sym_min must not be exported with dynamic shapes")

    monkeypatch.setattr(convert, "convert_dynamic", no_export)
    model = Sliced().eval()
    compiled = torch.compile(model, backend=backend)
    for tokens in (16, 12, 20):
        x = torch.randn(2, tokens, 8)
        torch._dynamo.maybe_mark_dynamic(x, 1)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), atol=F32_ATOL, rtol=F32_RTOL)
    assert {r.route for r in backend.reports} == {"static"}
    assert backend.stats()["eager_calls"] == 0 and backend.stats()["ov_calls"] == 3


def test_a_failed_dynamic_conversion_is_not_tried_again(tmp_path, monkeypatch):
    """It is a property of the graph: not retried for other weights, nor by the next process."""
    from ov_backend import OVBackend, convert

    tries: list[int] = []

    def refuse(*args, **kwargs):
        tries.append(1)
        raise convert.ConversionError("no rule for the test's op")

    monkeypatch.setattr(convert, "convert_dynamic", refuse)
    options = {"precision": "f32", "model_caching": True, "cache_dir": str(tmp_path / "cache")}
    model = Block().eval()
    first = OVBackend(options)
    compiled = torch.compile(model, backend=first)
    call(compiled, model, 8, 8)
    # tried once with the weights as inputs, once with them as constants
    assert first.reports[-1].route == "static" and len(tries) == 2
    with torch.no_grad():
        model.q.weight.add_(1.0)  # other weights
    call(compiled, model, 8, 8)
    call(compiled, model, 12, 8)  # another shape: static too
    assert len(tries) == 2
    assert "no rule for the test's op" in (tmp_path / "cache" / "conversion-failures.json").read_text()
    torch._dynamo.reset()
    second = OVBackend(options)
    call(torch.compile(model, backend=second), model, 16, 8)
    assert len(tries) == 2 and second.reports[-1].route == "static"
    first.cache.clear()
    assert not (tmp_path / "cache" / "conversion-failures.json").exists()


def _clip_encoder() -> torch.nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    config = CLIPTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2)
    return CLIPTextModel(config).eval().text_model.encoder


def _encode(compiled, encoder, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The encoder called as A1111 calls it (all hidden states: dynamo returns them in another order
    than the partition gives them); every output compared with eager."""
    with torch.no_grad():
        got = compiled(inputs_embeds=x, causal_attention_mask=mask, output_hidden_states=True)
        want = encoder(inputs_embeds=x, causal_attention_mask=mask, output_hidden_states=True)
    assert len(got.hidden_states) == len(want.hidden_states) == 4
    for g, w in zip((got.last_hidden_state, *got.hidden_states), (want.last_hidden_state, *want.hidden_states)):
        torch.testing.assert_close(g, w, atol=F32_ATOL, rtol=F32_RTOL)
    return got.hidden_states


def test_a_static_whole_graph_with_reordered_outputs_follows_a_weight_change_without_converting(tmp_path):
    """The text encoder at batch 1 (static route): one partition whose outputs dynamo orders differently
    from the graph's. It is kept as a whole-graph model in the graph's order, so a LoRA-like change is a
    compile, and a new process reads it from the disk cache without tracing."""
    from ov_backend import OVBackend

    options = {"precision": "f32", "model_caching": True, "cache_dir": str(tmp_path / "cache")}
    encoder = _clip_encoder()
    x, mask = torch.randn(1, 77, 32), torch.full((77, 77), float("-inf")).triu(1)[None, None]
    first = OVBackend(options)
    compiled = torch.compile(encoder, backend=first)
    _encode(compiled, encoder, x, mask)
    assert first.reports[-1].route == "static"
    converted = first.stats()["convert_seconds"]
    with torch.no_grad():
        encoder.layers[1].self_attn.q_proj.weight.add_(0.05)  # A1111's LoRA writes in place
        encoder.layers[2].mlp.fc1.weight.mul_(1.2)
    _encode(compiled, encoder, x, mask)
    assert first.stats()["convert_seconds"] == converted, first.reports[-1].summary()
    assert "conversion reused for the new weights" in first.reports[-1].summary()
    # the entry for the changed weights holds none of them (a text encoder's 0.5 GB not written per LoRA)
    weight_bytes = sum(p.numel() * p.element_size() for p in encoder.parameters())
    bins = {e.description.split()[2]: (e.path / "model.bin").stat().st_size for e in first.cache.entries()}
    assert bins["whole"] < weight_bytes / 4 < bins["fused_0"], (bins, weight_bytes)  # new weights: none stored

    torch._dynamo.reset()  # a new process: the weightless entry, in the graph's output order, these weights
    second = OVBackend(options)
    _encode(torch.compile(encoder, backend=second), encoder, x, mask)
    assert second.reports[-1].cache_hit and second.stats()["trace_seconds"] == 0
