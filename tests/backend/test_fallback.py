"""What OpenVINO cannot take runs in PyTorch with a WARNING; strict raises instead."""

from __future__ import annotations

import logging

import pytest
import torch

from ov_backend import OpenVINOFallbackError, OVBackend, convert
from ov_backend.ops import node_op_name

from .conftest import F32_ATOL, F32_RTOL, small_cnn


def test_disabled_op_runs_in_pytorch_and_is_reported(caplog):
    backend = OVBackend({"disabled_ops": ["aten.convolution.default"],
                         "config": {"INFERENCE_PRECISION_HINT": "f32"}})
    model = small_cnn()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(1, 3, 16, 16)
    with caplog.at_level(logging.WARNING, logger="ov_backend"), torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=F32_ATOL, rtol=F32_RTOL)
    (report,) = backend.reports
    assert report.fallback_ops == {"aten.convolution.default": "disabled by the disabled_ops option"}
    assert len(report.partitions) >= 2 and all(p.in_openvino for p in report.partitions)
    assert "aten.convolution.default" in report.summary()
    assert any("aten.convolution.default" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def _failing_convert(sub, *rewrite_names):
    raise convert.ConversionError("forced failure for the test")


def test_conversion_failure_falls_back_with_warning(monkeypatch, caplog):
    monkeypatch.setattr(convert, "convert_partition", _failing_convert)
    backend = OVBackend({"config": {"INFERENCE_PRECISION_HINT": "f32"}})
    model = small_cnn()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(1, 3, 16, 16)
    with caplog.at_level(logging.WARNING, logger="ov_backend"), torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=0, rtol=0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("forced failure for the test" in w and "PyTorch" in w for w in warnings)
    assert backend.reports[0].route == "eager"
    assert backend.stats()["eager_calls"] == 1 and backend.stats()["ov_calls"] == 0


def test_strict_raises(monkeypatch):
    monkeypatch.setattr(convert, "convert_partition", _failing_convert)
    backend = OVBackend({"strict": True})
    compiled = torch.compile(small_cnn(), backend=backend)
    with pytest.raises(OpenVINOFallbackError, match="forced failure for the test"), torch.no_grad():
        compiled(torch.randn(1, 3, 16, 16))


def test_weights_left_on_the_meta_device_are_named():
    class WithMetaBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.register_buffer("position_ids", torch.arange(5, device="meta"))

        def forward(self, x):
            return self.emb(self.position_ids) + x

    compiled = torch.compile(WithMetaBuffer().eval(), backend=OVBackend())
    with pytest.raises(ValueError, match=r"position_ids.*meta device"), torch.no_grad():
        compiled(torch.ones(5, 4))


class _Chain(torch.nn.Module):
    """Two runs of elementwise ops with ``abs`` between them (disable it to get two partitions)."""

    def forward(self, x):
        y = torch.relu(torch.tanh(torch.exp(torch.cos(torch.sin(x * 0.5)))))
        return torch.neg(torch.sigmoid(torch.abs(y) + 1.0))


def _node_names(sub):
    return [node_op_name(n) for n in sub.graph.nodes if n.op == "call_function"]


def _failing_on_sin(report_op):
    """A converter whose frontend reports ``report_op(partition ops)`` unconvertible in the partition holding sin."""
    real = convert.convert_partition

    def fake(sub, *rewrite_names):
        names = _node_names(sub)
        if "aten.sin.default" in names:
            raise convert.ConversionError("forced: no conversion rule", [report_op(names)])
        return real(sub, *rewrite_names)

    return fake


_MADE_UP = {
    # each retry leaves the reported op to PyTorch, and the frontend reports the next one, until no retry is left
    "a new op every time": lambda names: names[-1],
    # an op the partition does not hold: a new partitioning cannot leave it out
    "an op not in the partition": lambda names: "aten.made_up_for_the_test.default",
}


@pytest.mark.parametrize("case", sorted(_MADE_UP))
def test_partition_the_frontend_keeps_rejecting_runs_in_pytorch_with_warning(monkeypatch, caplog, case):
    monkeypatch.setattr(convert, "convert_partition", _failing_on_sin(_MADE_UP[case]))
    backend = OVBackend({"disabled_ops": ["aten.abs.default"], "config": {"INFERENCE_PRECISION_HINT": "f32"}})
    model = _Chain()
    x = torch.randn(2, 8)
    with caplog.at_level(logging.WARNING, logger="ov_backend"), torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x), atol=F32_ATOL, rtol=F32_RTOL)
    (report,) = backend.reports
    failed = [p for p in report.partitions if not p.in_openvino]
    assert len(failed) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"partition {failed[0].name}" in w and "forced: no conversion rule" in w and "PyTorch" in w
               for w in warnings), warnings
    assert any(failed[0].name in w for w in report.warnings)
    # the partition after abs is converted, reported and run in OpenVINO
    assert [p.in_openvino for p in report.partitions] == [False, True]
    assert backend.stats()["ov_calls"] == 1


@pytest.mark.parametrize("case", sorted(_MADE_UP))
def test_partition_the_frontend_keeps_rejecting_raises_when_strict(monkeypatch, case):
    monkeypatch.setattr(convert, "convert_partition", _failing_on_sin(_MADE_UP[case]))
    compiled = torch.compile(_Chain(), backend=OVBackend({"strict": True}))
    with pytest.raises(OpenVINOFallbackError, match="forced: no conversion rule"), torch.no_grad():
        compiled(torch.randn(2, 8))


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_partitions_under_min_partition_ops_run_in_pytorch_with_warning(caplog):
    # _Chain's partitions: mul sin cos exp tanh relu (6 ops) | abs in PyTorch | add sigmoid neg (3 ops)
    backend = OVBackend({"disabled_ops": ["aten.abs.default"], "min_partition_ops": 4,
                         "config": {"INFERENCE_PRECISION_HINT": "f32"}})
    model = _Chain()
    x = torch.randn(2, 8)
    with caplog.at_level(logging.WARNING, logger="ov_backend"), torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x), atol=F32_ATOL, rtol=F32_RTOL)
    (report,) = backend.reports
    assert [(p.ops, p.in_openvino) for p in report.partitions] == [(6, True), (3, False)]
    small = report.partitions[1].name
    assert any("min_partition_ops=4" in w and f"{small} (3 ops)" in w for w in report.warnings)
    assert any("min_partition_ops=4" in w and f"{small} (3 ops)" in w and "PyTorch" in w for w in _warnings(caplog))
    assert not report.fully_in_openvino


def test_graph_under_min_partition_ops_runs_in_pytorch_even_when_strict(caplog, tmp_path):
    """A user's policy, not a failure: strict does not raise; a cached whole-graph model is not used either."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()).eval()  # addmm (or linear) + relu
    x = torch.randn(3, 8)
    options = {"strict": True, "model_caching": True, "cache_dir": str(tmp_path),
               "config": {"INFERENCE_PRECISION_HINT": "f32"}}
    first = OVBackend(options)
    with torch.no_grad():
        torch.compile(model, backend=first)(x)
    assert first.reports[0].fully_in_openvino  # and cached as one whole-graph model
    torch._dynamo.reset()
    backend = OVBackend({**options, "min_partition_ops": 5})
    with caplog.at_level(logging.WARNING, logger="ov_backend"), torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x), atol=0, rtol=0)
    (report,) = backend.reports
    assert report.route == "eager" and not any(p.in_openvino for p in report.partitions)
    assert any("min_partition_ops=5" in w for w in _warnings(caplog))
    assert backend.stats()["eager_calls"] == 1 and backend.stats()["ov_calls"] == 0
