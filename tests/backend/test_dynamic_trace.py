"""The dynamic route's conversion: one symbolic trace, with torch.export where that trace cannot serve."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ov_backend import convert
from ov_backend.ops import decomposition_table

from .conftest import F32_ATOL, F32_RTOL, f32_backend


class TinyUNet(torch.nn.Module):
    """What the dynamic route meets in a Stable Diffusion UNet: a strided convolution, group norm,
    cross-attention to a context of any length (scaled dot product attention), nearest upsampling by
    a scale factor and a skip connection."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv_in = torch.nn.Conv2d(4, 16, 3, padding=1)
        self.down = torch.nn.Conv2d(16, 16, 3, padding=1, stride=2)
        self.norm = torch.nn.GroupNorm(4, 16)
        self.q = torch.nn.Linear(16, 16)
        self.kv = torch.nn.Linear(12, 32)
        self.conv_out = torch.nn.Conv2d(32, 4, 3, padding=1)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        skip = self.conv_in(x)
        h = self.norm(self.down(skip))
        b, c, height, width = h.shape
        tokens = h.flatten(2).transpose(1, 2)
        q = self.q(tokens).view(b, -1, 2, 8).transpose(1, 2)
        k, v = self.kv(context).view(b, -1, 2, 16).transpose(1, 2).chunk(2, dim=-1)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, height * width, c)
        h = h + attended.transpose(1, 2).reshape(b, c, height, width)
        h = F.interpolate(h, scale_factor=2.0, mode="nearest")
        return self.conv_out(torch.cat([h, skip], dim=1))


def _no_export(*args, **kwargs):
    raise AssertionError("the graph was exported with torch.export: the one-trace conversion did not serve")


def test_one_symbolic_trace_serves_every_size(backend, monkeypatch):
    """Sizes, batches and context lengths after the first cost a compile, never a trace or an export; the
    results are PyTorch's."""
    monkeypatch.setattr(torch.export, "export", _no_export)
    model = TinyUNet().eval()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for batch, size, tokens in ((2, 16, 7), (2, 24, 7), (3, 16, 12), (4, 8, 5)):
            x, context = torch.randn(batch, 4, size, size), torch.randn(batch, tokens, 12)
            for dim in (0, 2, 3):
                torch._dynamo.maybe_mark_dynamic(x, dim)
            for dim in (0, 1):
                torch._dynamo.maybe_mark_dynamic(context, dim)
            torch.testing.assert_close(compiled(x, context), model(x, context), atol=F32_ATOL, rtol=F32_RTOL)
    assert [r.route for r in backend.reports] == ["dynamic"] * 4
    converted = [r for r in backend.reports if r.convert_seconds > 0]
    assert len(converted) == 1, [r.summary() for r in backend.reports]
    assert backend.stats()["eager_calls"] == 0


def _kept_whole(gm: torch.fx.GraphModule) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def test_the_trace_keeps_attention_and_upsampling_whole_and_sizes_symbolic():
    """OpenVINO fuses scaled dot product attention and upsampling it gets whole; the sizes stay symbols."""
    model = TinyUNet().eval()
    gm = convert.trace_dynamic(model, [torch.randn(2, 4, 16, 16), torch.randn(2, 7, 12)], [(0, 2, 3), (0, 1)],
                               decomposition_table())
    targets = _kept_whole(gm)
    assert "aten.scaled_dot_product_attention.default" in targets
    assert "aten.upsample_nearest2d.vec" in targets
    placeholders = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    assert [isinstance(size, torch.SymInt) for size in placeholders[0].shape] == [True, False, True, True]
    assert [isinstance(size, torch.SymInt) for size in placeholders[1].shape] == [True, True, False]


class SizeBranch(torch.nn.Module):
    """Code that branches on a size's value: a trace can only serve the example's size."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == 8:
            return x * 2
        return x + 1


def test_a_size_fixed_while_tracing_is_refused_and_exported_instead(monkeypatch):
    with pytest.raises(convert.ConversionError, match="fixed dynamic sizes"):
        convert.trace_dynamic(SizeBranch(), [torch.randn(2, 8)], [(1,)], decomposition_table())
    exports: list[int] = []
    real_export = torch.export.export

    def counted(*args, **kwargs):
        exports.append(1)
        return real_export(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    model = convert.convert_dynamic(SizeBranch(), [torch.randn(2, 8)], [(1,)], decomposition_table())
    assert exports == [1]
    assert len(model.inputs) == 1


class WidthBranch(torch.nn.Module):
    """Layers around a branch on the input's width."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = torch.nn.Linear(8, 16)
        self.outer = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inner(x))
        if x.shape[1] == 8:
            h = h * 2
        return self.outer(torch.relu(h)) + x


def test_a_size_dynamo_fixed_stays_static_and_the_graph_is_traced_once(backend, monkeypatch, caplog):
    """A dimension marked dynamic that dynamo fixed while capturing (its guards run the graph for that size
    alone) is static in the conversion: the one trace serves, with no failed trace and no export. (The tiny
    SD UNet at 64 pixels has a 1x1 level: torch fixes sizes of 1, and from them the latent's height and
    width; its first conversion took 23 s that way, 4 s now.)"""
    monkeypatch.setattr(torch.export, "export", _no_export)
    model = WidthBranch().eval()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad(), caplog.at_level("INFO", logger="ov_backend"):
        for batch in (2, 3):
            x = torch.randn(batch, 8)
            for dim in (0, 1):
                torch._dynamo.maybe_mark_dynamic(x, dim)
            torch.testing.assert_close(compiled(x), model(x), atol=F32_ATOL, rtol=F32_RTOL)
    assert [r.route for r in backend.reports] == ["dynamic", "dynamic"]
    assert len([r for r in backend.reports if r.convert_seconds > 0]) == 1, [r.summary() for r in backend.reports]
    assert "symbolic trace failed" not in caplog.text
    assert backend.stats()["eager_calls"] == 0


class Tokens(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.reshape(-1, 8)).view(x.shape[0], x.shape[1], 4)


def test_a_converted_model_that_cannot_take_a_shape_traces_that_shape(tmp_path, monkeypatch):
    """A model whose conversion fixed a size (here: every size) fails to reshape to another: that shape
    is traced for itself, and the result is right."""
    backend = f32_backend(tmp_path, shared_shapes="never")
    real = convert.convert_dynamic

    def sizes_fixed(fn, inputs, dynamic_dims, decompositions, *rewrite_names):
        return real(fn, inputs, [() for _ in dynamic_dims], decompositions, *rewrite_names)

    monkeypatch.setattr(convert, "convert_dynamic", sizes_fixed)
    model = Tokens().eval()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for batch in (2, 3):
            x = torch.randn(batch, 5, 8)
            torch._dynamo.maybe_mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), model(x), atol=F32_ATOL, rtol=F32_RTOL)
    assert [r.route for r in backend.reports] == ["dynamic", "static"]
    assert any("reshape or compile failed" in w for w in backend.reports[-1].warnings)
    assert backend.stats()["eager_calls"] == 0


def test_a_batch_of_one_stays_dynamic():
    """A1111 calls its text encoder at a batch of 1 first: that trace serves other batches too."""
    import numpy as np
    import openvino as ov

    model = TinyUNet().eval()
    gm = convert.trace_dynamic(model, [torch.randn(1, 4, 16, 16), torch.randn(1, 7, 12)], [(0, 2, 3), (0, 1)],
                               decomposition_table())
    batch = [n.meta["val"].shape[0] for n in gm.graph.nodes if n.op == "placeholder"]
    assert all(isinstance(size, torch.SymInt) for size in batch)
    openvino_model = convert.convert_dynamic(model, [torch.randn(1, 4, 16, 16), torch.randn(1, 7, 12)],
                                             [(0, 2, 3), (0, 1)], decomposition_table())
    for inputs in ((torch.randn(1, 4, 16, 16), torch.randn(1, 7, 12)),
                   (torch.randn(3, 4, 24, 8), torch.randn(3, 9, 12))):
        reshaped = openvino_model.clone()
        reshaped.reshape({i: ov.PartialShape(list(x.shape)) for i, x in enumerate(inputs)})
        compiled = ov.Core().compile_model(reshaped, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        with torch.no_grad():
            expected = model(*inputs).numpy()
        np.testing.assert_allclose(compiled([x.numpy() for x in inputs])[0], expected, atol=F32_ATOL, rtol=F32_RTOL)


class SizeSplit(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[1] // 2
        return x[:, :half] * 2 + x[:, half:]


def test_the_fallback_says_what_the_trace_could_not_do(monkeypatch, caplog):
    """When the one-trace conversion fails, the log names the frontend's reason, and export converts."""
    def no_rule(decoder):
        raise convert.ConversionError("OpenVINO could not convert the graph: Check 'false' failed\n"
                                      "Summary:\n-- Conversion is failed for: aten.test_op.default")

    monkeypatch.setattr(convert, "_frontend_convert", no_rule)
    with caplog.at_level("INFO", logger="ov_backend.convert"):
        model = convert.convert_dynamic(SizeSplit(), [torch.randn(2, 8)], [(1,)], decomposition_table())
    assert "Conversion is failed for: aten.test_op.default" in caplog.text
    assert "exporting with torch.export instead" in caplog.text
    assert len(model.inputs) == 1
