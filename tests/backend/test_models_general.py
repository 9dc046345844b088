"""Not only Stable Diffusion: a quantized model keeps its quantize/dequantize ops in OpenVINO."""

from __future__ import annotations

import pytest
import torch

from ov_backend import OVBackend


def _quantized_model():
    pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
    x86 = pytest.importorskip("torchao.quantization.pt2e.quantizer.x86_inductor_quantizer")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 14 * 14, 10)).eval()
    x = torch.randn(2, 3, 16, 16)
    exported = torch.export.export(model, (x,)).module()
    quantizer = x86.X86InductorQuantizer()
    quantizer.set_global(x86.get_default_x86_inductor_quantization_config())
    prepared = pt2e.prepare_pt2e(exported, quantizer)
    for _ in range(4):
        prepared(torch.randn(2, 3, 16, 16))
    return pt2e.convert_pt2e(prepared, fold_quantize=False), x


#: OpenVINO runs the int8 ops natively where PyTorch simulates them in float; results may
#: differ by a few quantization steps of the output.
QUANTIZED_TOLERANCE = 0.02


def test_pt2e_quantized_model_runs_its_qdq_ops_in_openvino():
    quantized, x = _quantized_model()
    ops = {str(n.target) for n in quantized.graph.nodes if n.op == "call_function"}
    assert any("quantize_per_tensor" in op for op in ops)
    backend = OVBackend({"config": {"INFERENCE_PRECISION_HINT": "f32"}})
    with torch.no_grad():
        expected = quantized(x)
        got = torch.compile(quantized, backend=backend)(x)
    assert (got - expected).abs().max().item() <= QUANTIZED_TOLERANCE * expected.abs().max().item()
    (report,) = backend.reports
    assert report.fully_in_openvino, report.summary()
    assert len(report.partitions) == 1
