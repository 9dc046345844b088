"""8-bit weights (precision ``"int8-weights"``, :mod:`ov_backend.compress`): the compiled model's weights at 8 bits,
its results close to PyTorch's, a weight changed in place followed."""

from __future__ import annotations

import logging
from pathlib import Path

import openvino as ov
import pytest
import torch

from ov_backend import OVBackend
from ov_backend.compress import compress_weights


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256),
                               torch.nn.LayerNorm(256), torch.nn.Linear(256, 64)).eval()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def weight_types(model: ov.Model) -> dict[str, int]:
    """Element type -> elements, over the model's constants of more than 1024 elements."""
    found: dict[str, int] = {}
    for op in model.get_ordered_ops():
        if op.get_type_name() == "Constant":
            n = 1
            for d in op.get_output_shape(0):
                n *= int(d)
            if n > 1024:
                key = op.get_output_element_type(0).get_type_name()
                found[key] = found.get(key, 0) + n
    return found


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_weights_of_a_converted_model_become_8_bit(dynamic: bool) -> None:
    model = mlp()
    x = torch.randn(4, 256)
    kwargs = {"input": [ov.PartialShape([-1, 256])]} if dynamic else {}
    with torch.no_grad():
        converted = ov.convert_model(torch.fx.symbolic_trace(model) if not dynamic else model, example_input=x,
                                     **kwargs)
        want = model(x)
    compressed = compress_weights(converted)
    types = weight_types(compressed)
    weights = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert types.get("u8", 0) == weights, types
    assert weight_types(converted).get("u8", 0) == 0  # the float model stays as it was (a copy is compressed)
    got = torch.from_numpy(ov.Core().compile_model(compressed, "CPU",
                                                   {"INFERENCE_PRECISION_HINT": "f32"})(x.numpy())[0])
    error = relative_error(got, want)
    assert 0 < error < 0.02, error


def test_the_same_weights_as_openvinos_own_compression(tmp_path: Path) -> None:
    """An independent oracle: NNCF's INT8_ASYM weight compression of the same model gives the same 8-bit
    weights (up to a rounding step in a few elements) and results as close to PyTorch's."""
    nncf = pytest.importorskip("nncf")
    model = mlp()
    x = torch.randn(4, 256)
    with torch.no_grad():
        converted = ov.convert_model(model, example_input=x)
        want = model(x)
    ours = compress_weights(converted)
    theirs = nncf.compress_weights(converted.clone(), mode=nncf.CompressWeightsMode.INT8_ASYM)

    def eight_bit(m: ov.Model) -> list:
        return sorted((op.get_data() for op in m.get_ordered_ops() if op.get_type_name() == "Constant"
                       and op.get_output_element_type(0) == ov.Type.u8 and op.get_data().size > 1024),
                      key=lambda a: a.shape)

    for a, b in zip(eight_bit(ours), eight_bit(theirs), strict=True):
        assert a.shape == b.shape
        assert (a.astype(int) - b.astype(int)).__abs__().max() <= 1

    def run(m: ov.Model) -> torch.Tensor:
        return torch.from_numpy(ov.Core().compile_model(m, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(x.numpy())[0])

    assert relative_error(run(ours), want) < 1.5 * relative_error(run(theirs), want) + 1e-4


def test_the_backend_compiles_8_bit_weights_and_follows_a_weight_changed_in_place(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = mlp()
    backend = OVBackend({"precision": "int8-weights", "cache_dir": str(tmp_path / "cache")})
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 256)
    caplog.set_level(logging.INFO, logger="ov_backend.compress")
    with torch.no_grad():
        want = model(x)
        assert relative_error(compiled(x), want) < 0.03
        model[0].weight.mul_(-1)  # as a LoRA written in place
        changed = model(x)
        assert relative_error(compiled(x), changed) < 0.03
    assert backend.stats()["eager_calls"] == 0 and backend.stats()["ov_calls"] == 2
    lines = [r.getMessage() for r in caplog.records if "compressed the weights to 8 bits" in r.getMessage()]
    assert len(lines) == 2, lines  # each compile compressed the weights it was compiled from
    eight, total = (int(v) for v in lines[0].split(": ")[1].split(" weight")[0].split(" of "))
    assert eight >= 0.99 * total, lines[0]


def test_the_8_bit_weights_can_live_in_a_weight_file_and_leave_the_process(tmp_path: Path) -> None:
    """The CPU plugin keeps the 8-bit constants alive beside its packed copy of them: written into a weight file
    (``WeightFile.arrays``), they leave the process once packed, give the same results, are not counted as
    PyTorch's weights, and the file goes when the compiled model does."""
    import gc

    import numpy as np

    from ov_backend import WeightFile

    model = mlp(1)
    x = torch.randn(4, 256)
    with torch.no_grad():
        converted = ov.convert_model(torch.fx.symbolic_trace(model), example_input=x)
    weight_file = WeightFile(tmp_path / "weights")
    in_file = compress_weights(converted, weight_file.arrays)
    in_memory = compress_weights(converted)
    eight_bit = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert weight_types(in_file).get("u8", 0) == eight_bit
    assert weight_file.file_bytes(arrays=True) >= eight_bit and weight_file.file_bytes() == 0
    core = ov.Core()
    config = {"INFERENCE_PRECISION_HINT": "f32"}
    compiled = core.compile_model(in_file, "CPU", config)
    del in_file
    got = compiled(x.numpy())[0]
    want = core.compile_model(in_memory, "CPU", config)(x.numpy())[0]
    np.testing.assert_array_equal(got, want)
    assert weight_file.resident_bytes(arrays=True) > 0  # written, and read by the plugin's packing
    weight_file.drop_resident()
    assert weight_file.file_bytes(arrays=True) >= eight_bit, "the plugin keeps its constants: the file stays"
    assert weight_file.resident_bytes(arrays=True) == 0
    np.testing.assert_array_equal(compiled(x.numpy())[0], want)
    del compiled
    gc.collect()
    weight_file.drop_resident()
    assert weight_file.file_bytes(arrays=True) == 0, "the file is closed once nothing reads it"
