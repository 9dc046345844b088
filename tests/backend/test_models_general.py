"""Not only Stable Diffusion: a quantized model keeps its quantize/dequantize ops in OpenVINO.

OpenVINO runs a PT2E-quantized graph's convolutions and matmuls with oneDNN's int8 kernels
(u8 activations times s8 weights, summed in 32 bits). With VNNI (AVX512-VNNI, AVX-VNNI) or
AMX each product reaches the 32-bit sum exactly. Without it (AVX2-only CPUs such as AMD Zen 3,
AVX-512 CPUs before Cascade Lake) the kernels sum pairs of products in saturating 16 bits
(``vpmaddubsw``): 255 * 127 * 2 does not fit, so full-range 8-bit activations and weights can
overflow. That is a property of the hardware the user's model runs on, and the quantizer
documents the remedy: ``reduce_range=True`` (7-bit activations) on CPUs without VNNI. The test
quantizes as a user on its CPU should, and then asks OpenVINO for the same integers as
PyTorch's own quantize/dequantize reference kernels. (OpenVINO's int8 path takes 8-bit
quantization only: with 7-bit activations it runs those layers in f32, right but not faster.)

The AVX2 case is also run on a CPU with VNNI: a child process with oneDNN capped at AVX2
(``ONEDNN_MAX_CPU_ISA``), checked to have run AVX2 kernels.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import openvino as ov
import pytest
import torch

from ov_backend import OVBackend

ROOT = Path(__file__).resolve().parents[2]

#: oneDNN's CPU ISA caps (``ONEDNN_MAX_CPU_ISA``) without VNNI: their int8 kernels saturate.
NO_VNNI_ISA_CAPS = frozenset({"SSE41", "AVX", "AVX2", "AVX512_CORE"})

#: CPU features whose int8 dot products sum u8 x s8 products exactly in 32 bits.
EXACT_INT8_FEATURES = ("avx512_vnni", "avx_vnni", "amx_int8")

#: OpenVINO and PyTorch compute the same integers; a value within float rounding of a half step
#: may still round to neighbouring integers on the two sides. Allowed: this many steps of the
#: last layer's input (each moves an output by at most scale * the largest weight of the layer).
#: Measured on this model: a 16-bit overflow costs about 125 steps, one weight rounded the other
#: way about 9.
ALLOWED_INPUT_STEPS = 2


def _isa_cap() -> str | None:
    """oneDNN's ISA cap in this process, upper case (oneDNN reads ONEDNN_ first, then DNNL_)."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return cap.strip().upper() if cap else None


def _int8_products_exact() -> bool:
    """True where oneDNN's int8 kernels cannot overflow: VNNI or AMX, and not capped below it."""
    if _isa_cap() in NO_VNNI_ISA_CAPS:
        return False
    capabilities = torch.cpu.get_capabilities()
    return any(capabilities.get(feature, False) for feature in EXACT_INT8_FEATURES)


def _attr(module: torch.nn.Module, target: str) -> torch.Tensor:
    """The tensor a ``get_attr`` node names (a parameter, buffer or plain attribute)."""
    return functools.reduce(getattr, target.split("."), module)


def _put_weights_on_their_grid(quantized: torch.fx.GraphModule) -> None:
    """Replace each quantized float weight by its int8 value times its scale (torch's own kernels).

    These are the values ``convert_pt2e(fold_quantize=True)`` stores as int8; OpenVINO's
    frontend cannot take such folded weights yet, so the weights stay float with their
    quantize/dequantize pair, on the grid. Off the grid, PyTorch rounds a weight sitting on a
    half step (the largest weight of a channel does, as the symmetric scale is max/127.5)
    to even and OpenVINO's FakeQuantize may round it the other way: a legitimate one-step
    difference that is not what this test is about.
    """
    q_ops = torch.ops.quantized_decomposed
    for node in quantized.graph.nodes:
        if node.target is not q_ops.quantize_per_channel.default or node.args[0].op != "get_attr":
            continue
        weight, scale, zero_point = (_attr(quantized, str(arg.target)) for arg in node.args[:3])
        args = node.args[3:]
        with torch.no_grad():
            ints = q_ops.quantize_per_channel(weight, scale, zero_point, *args)
            weight.copy_(q_ops.dequantize_per_channel(ints, scale, zero_point, *args))


def _quantized_model(reduce_range: bool) -> tuple[torch.fx.GraphModule, torch.Tensor]:
    """A conv + linear model quantized by PT2E with the x86 quantizer's default config."""
    pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
    x86 = pytest.importorskip("torchao.quantization.pt2e.quantizer.x86_inductor_quantizer")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 14 * 14, 10)).eval()
    x = torch.randn(2, 3, 16, 16)
    exported = torch.export.export(model, (x,)).module()
    quantizer = x86.X86InductorQuantizer()
    quantizer.set_global(x86.get_default_x86_inductor_quantization_config(reduce_range=reduce_range))
    prepared = pt2e.prepare_pt2e(exported, quantizer)
    for _ in range(4):
        prepared(torch.randn(2, 3, 16, 16))
    quantized = pt2e.convert_pt2e(prepared, fold_quantize=False)
    _put_weights_on_their_grid(quantized)
    return quantized, x


def _tolerance(quantized: torch.fx.GraphModule) -> float:
    """ALLOWED_INPUT_STEPS steps of the last linear layer's quantized input, in output units."""
    (linear,) = [n for n in quantized.graph.nodes if n.target is torch.ops.aten.linear.default]
    act_dequant, weight_dequant = linear.args[:2]
    act_scale = float(act_dequant.args[1])
    weight = _attr(quantized, str(weight_dequant.args[0].args[0].target))  # on its grid: dequantized
    return ALLOWED_INPUT_STEPS * act_scale * weight.abs().max().item()


class _RecordingBackend(OVBackend):
    """The backend, keeping the compiled models so the test can see which kernels ran."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.compiled: list[ov.CompiledModel] = []

    def compile_model(self, model: ov.Model | Path) -> ov.CompiledModel:
        compiled = super().compile_model(model)
        self.compiled.append(compiled)
        return compiled


def _kernels(compiled: list[ov.CompiledModel]) -> list[tuple[str, str, str]]:
    """(layer type, oneDNN/OpenVINO primitive, runtime precision) of each executed layer."""
    found = []
    for model in compiled:
        for op in model.get_runtime_model().get_ordered_ops():
            info = op.get_rt_info()
            found.append(tuple(info[key].astype(str) if key in info else ""
                               for key in ("layerType", "primitiveType", "runtimePrecision")))
    return found


def test_pt2e_quantized_model_runs_its_qdq_ops_in_openvino():
    exact = _int8_products_exact()
    quantized, x = _quantized_model(reduce_range=not exact)
    ops = {str(n.target) for n in quantized.graph.nodes if n.op == "call_function"}
    assert any("quantize_per_tensor" in op for op in ops)
    backend = _RecordingBackend({"config": {"INFERENCE_PRECISION_HINT": "f32"}})
    with torch.no_grad():
        expected = quantized(x)  # PyTorch's quantize/dequantize reference kernels
        got = torch.compile(quantized, backend=backend)(x)
    (report,) = backend.reports
    assert report.fully_in_openvino, report.summary()
    assert len(report.partitions) == 1
    kernels = _kernels(backend.compiled)
    error, tolerance = (got - expected).abs().max().item(), _tolerance(quantized)
    assert error <= tolerance, (f"max error {error:.3g} > {tolerance:.3g} ({ALLOWED_INPUT_STEPS} input steps); "
                                f"reduce_range={not exact}, ISA cap {_isa_cap()}, kernels {kernels}")
    if exact:  # full-range 8-bit: the int8 kernels ran, and exactly
        assert {(layer, precision) for layer, _, precision in kernels if layer in ("Convolution", "FullyConnected")} \
            == {("Convolution", "u8"), ("FullyConnected", "u8")}, kernels
    if _isa_cap() == "AVX2":  # the cap took effect
        primitives = [primitive for _, primitive, _ in kernels]
        assert any("avx2" in p for p in primitives), primitives
        assert not any("avx512" in p or "amx" in p for p in primitives), primitives


@pytest.mark.slow
@pytest.mark.skipif(_isa_cap() is not None, reason="already under an ISA cap")
@pytest.mark.skipif(not torch.cpu.get_capabilities().get("avx2", False), reason="the CPU has no AVX2")
def test_pt2e_quantized_model_on_an_avx2_only_cpu():
    """The test above in a process whose oneDNN kernels are capped at AVX2 (no VNNI)."""
    pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
    env = {k: v for k, v in os.environ.items() if k not in ("DNNL_MAX_CPU_ISA", "PYTEST_ADDOPTS")}
    env["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    test = f"{Path(__file__).relative_to(ROOT)}::test_pt2e_quantized_model_runs_its_qdq_ops_in_openvino"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]
