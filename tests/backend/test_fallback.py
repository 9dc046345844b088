"""What OpenVINO cannot take runs in PyTorch with a WARNING; strict raises instead."""

from __future__ import annotations

import logging

import pytest
import torch

from ov_backend import OpenVINOFallbackError, OVBackend, convert

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


def _failing_convert(sub):
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
