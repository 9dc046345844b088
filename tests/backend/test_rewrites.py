"""A projection split along its features runs as one projection per section, with the same results.

Every transformer block of an SD UNet has a GEGLU (``proj(x).chunk(2, -1)``, then ``a * gelu(b)``);
OpenVINO's CPU plugin copied the whole projection for the split with a reference kernel. The backend
rewrites it into two projections that read their rows of the weight (``ov_backend.rewrites``). These
tests pin down that the results stay the eager ones, that a weight changed in place (a LoRA) reaches
both sections, that the model stored on disk holds the rewrite and no weights, and that the rewrite
leaves alone what it cannot prove to be the same computation.
"""

from __future__ import annotations

import gc

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest
import torch

from ov_backend.rewrites import fold_weight_splits, for_compiling, share_weight_sections, split_projections

from .conftest import F32_ATOL, F32_RTOL, f32_backend

F32 = {"INFERENCE_PRECISION_HINT": "f32"}


class FeedForward(torch.nn.Module):
    """A diffusion transformer's feed-forward: a GEGLU projection, then the output projection."""

    def __init__(self, dim: int = 16, inner: int = 24, bias: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(dim, inner * 2, bias=bias)
        self.out = torch.nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, gate = self.proj(x).chunk(2, dim=-1)
        return self.out(hidden * torch.nn.functional.gelu(gate))


def call(compiled, model, tokens: int) -> torch.Tensor:
    x = torch.randn(2, tokens, 16)
    torch._dynamo.maybe_mark_dynamic(x, 1)
    with torch.no_grad():
        got = compiled(x)
        torch.testing.assert_close(got, model(x), atol=F32_ATOL, rtol=F32_RTOL)
    return got


def stored_models(backend) -> list[ov.Model]:
    core = ov.Core()
    return [core.read_model(str(e.path / "model.xml")) for e in backend.cache.entries()
            if (e.path / "model.xml").is_file()]  # (not the compiled blobs beside them)


def splits_of_projections(model: ov.Model) -> int:
    return sum(1 for op in model.get_ordered_ops() if op.get_type_name() in ("VariadicSplit", "Split")
               and op.input_value(0).get_node().get_type_name() in ("Add", "MatMul"))


@pytest.mark.parametrize("bias", [True, False])
def test_a_split_projection_runs_as_two_and_gives_the_eager_result(tmp_path, bias):
    model = FeedForward(bias=bias).eval()
    backend = f32_backend(tmp_path, model_caching=True)
    compiled = torch.compile(model, backend=backend)
    call(compiled, model, 7)
    call(compiled, model, 12)
    assert backend.stats()["eager_calls"] == 0 and backend.stats()["ov_calls"] == 2
    stored = stored_models(backend)
    assert stored, "the converted model was stored"
    for m in stored:
        matmuls = [op for op in m.get_ordered_ops() if op.get_type_name() == "MatMul"]
        assert splits_of_projections(m) == 0 and len(matmuls) == 3
        # the weights are not in the file: the sections read them through a split of the weight input
        assert all(op.input_value(1).get_node().get_type_name() in ("VariadicSplit", "Parameter") for op in matmuls)


def test_without_the_rewrite_the_split_stays_and_the_results_are_the_same(tmp_path):
    model = FeedForward().eval()
    backend = f32_backend(tmp_path, model_caching=True, rewrites=[])
    compiled = torch.compile(model, backend=backend)
    call(compiled, model, 7)
    call(compiled, model, 12)
    stored = stored_models(backend)
    assert stored and all(splits_of_projections(m) == 1 for m in stored)


def test_a_weight_changed_in_place_reaches_both_sections(tmp_path):
    """A LoRA writes into the projection's weight; the next call computes with the new values."""
    model = FeedForward().eval()
    compiled = torch.compile(model, backend=f32_backend(tmp_path))
    before = call(compiled, model, 9)
    with torch.no_grad():
        model.proj.weight.add_(torch.randn_like(model.proj.weight) * 0.2)
        model.proj.bias.mul_(-1.0)
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        got = compiled(x)
        torch.testing.assert_close(got, model(x), atol=F32_ATOL, rtol=F32_RTOL)
    assert not torch.allclose(got, before)


def projection(weight: np.ndarray, bias: np.ndarray | None, axis: int = -1, tokens: int = 5,
               weight_input: bool = False) -> tuple[ov.Model, list[np.ndarray]]:
    """``split(x @ weight.T + bias, axis)`` in halves, then ``a * gelu(b)``, as an OpenVINO model (the
    weight as a model input of dynamic shape with ``weight_input``); returns it and its input values."""
    x = ops.parameter([2, tokens, weight.shape[1]], np.float32, name="x")
    params, values = [x], [np.random.default_rng(0).standard_normal((2, tokens, weight.shape[1]), np.float32)]
    if weight_input:
        w = ops.parameter(ov.PartialShape([-1, -1]), np.float32, name="w")
        params.append(w)
        values.append(weight)
    else:
        w = ops.constant(weight)
    out = ops.matmul(x, w, False, True)
    if bias is not None:
        out = ops.add(out, ops.constant(bias))
    length = out.get_output_partial_shape(0)[axis].get_length() if axis != -1 else weight.shape[0]
    halves = ops.variadic_split(out, ops.constant(np.int64(axis)), ops.constant(np.array([length // 2] * 2)))
    result = ops.multiply(halves.output(0), ops.gelu(halves.output(1), "erf"))
    return ov.Model([result], params), values


def run(model: ov.Model, values: list[np.ndarray]) -> np.ndarray:
    return ov.Core().compile_model(model.clone(), "CPU", F32)(values)[0]


def test_the_rewrite_gives_the_same_values():
    rng = np.random.default_rng(1)
    model, values = projection(rng.standard_normal((12, 8), np.float32), rng.standard_normal(12, np.float32))
    want = run(model, values)
    assert split_projections(model) == 1 and splits_of_projections(model) == 0
    np.testing.assert_allclose(run(model, values), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["broadcast bias", "bias per token", "not the feature axis", "read elsewhere",
                                  "weight shape unknown"])
def test_what_the_rewrite_cannot_prove_the_same_is_left_alone(case):
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((12, 8), np.float32)
    bias = {"broadcast bias": rng.standard_normal(1, np.float32),
            "bias per token": rng.standard_normal((5, 1), np.float32)}.get(case, rng.standard_normal(12, np.float32))
    if case == "weight shape unknown":
        bias = None  # (the CPU plugin cannot compile a bias after a weight input of dynamic shape)
    model, values = projection(weight, bias, axis=1 if case == "not the feature axis" else -1,
                               tokens=6 if case == "not the feature axis" else 5,
                               weight_input=case == "weight shape unknown")
    if case == "read elsewhere":  # the whole projection is also an output
        split = next(op for op in model.get_ordered_ops() if op.get_type_name() == "VariadicSplit")
        model.add_outputs([split.input_value(0)])
    want = run(model, values)
    assert split_projections(model) == 0
    np.testing.assert_allclose(run(model, values), want, rtol=1e-6, atol=1e-6)


def test_a_weight_input_of_known_shape_is_split_and_binds_later():
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((12, 8), np.float32)
    model, values = projection(weight, None, weight_input=True)
    want = run(model, values)
    assert split_projections(model, [v.shape for v in values]) == 1
    np.testing.assert_allclose(run(model, values), want, rtol=1e-6, atol=1e-6)
    assert split_projections(model, [(2, 5, 8)]) == 0  # shapes that do not name every input: nothing


def test_folding_the_weight_splits_leaves_constants_and_the_values():
    rng = np.random.default_rng(4)
    model, values = projection(rng.standard_normal((12, 8), np.float32), rng.standard_normal(12, np.float32))
    want = run(model, values)
    assert split_projections(model) == 1
    assert fold_weight_splits(model) == 2  # the weight's split and the bias's
    matmuls = [op for op in model.get_ordered_ops() if op.get_type_name() == "MatMul"]
    assert [op.input_value(1).get_node().get_type_name() for op in matmuls] == ["Constant", "Constant"]
    np.testing.assert_allclose(run(model, values), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rewrite", [fold_weight_splits, share_weight_sections])
def test_a_bf16_constant_stays_bf16(rewrite):
    """Folded into copies or shared as pieces of its memory, a bf16 weight's sections are its bf16 values."""
    bits = np.arange(24, dtype=np.uint16).reshape(6, 4) + 0x3F80  # bf16 patterns around 1.0
    weight = ov.op.Constant(ov.Tensor(bits, [6, 4], ov.Type.bf16))
    halves = ops.variadic_split(weight, ops.constant(np.int64(0)), ops.constant(np.array([2, 4])))
    model = ov.Model([ops.convert(halves.output(i), ov.Type.f32) for i in range(2)], [])
    assert rewrite(model) == 1
    sections = [result.input_value(0).get_node().input_value(0).get_node() for result in model.get_results()]
    assert [op.get_output_element_type(0) for op in sections] == [ov.Type.bf16, ov.Type.bf16]
    assert [op.get_data().view(np.uint16).tolist() for op in sections] == [bits[:2].tolist(), bits[2:].tolist()]


def test_a_bound_weight_compiles_from_its_own_memory_in_sections(tmp_path):
    """The device gets each section as a constant reading its piece of the weight (no copy folded at compile);
    the model kept for later compiles keeps its split, and the values are the same."""
    rng = np.random.default_rng(5)
    weight, bias = rng.standard_normal((12, 8), np.float32), rng.standard_normal(12, np.float32)
    model, values = projection(weight, bias)
    want = run(model, values)
    assert split_projections(model) == 1
    source = next(op for op in model.get_ordered_ops() if op.get_type_name() == "VariadicSplit"
                  and op.input_value(0).get_node().get_output_shape(0) == [12, 8]).input_value(0).get_node()
    start, end = source.get_data().ctypes.data, source.get_data().ctypes.data + weight.nbytes
    compiled = for_compiling(model)
    assert compiled is not model and splits_of_constants(model) == 2 and splits_of_constants(compiled) == 0
    sections = [op.input_value(1).get_node() for op in compiled.get_ordered_ops() if op.get_type_name() == "MatMul"]
    assert [op.get_type_name() for op in sections] == ["Constant", "Constant"]
    addresses = sorted(op.get_data().ctypes.data for op in sections)
    assert addresses == [start, start + weight.nbytes // 2] and addresses[-1] < end
    del model, source
    gc.collect()  # the sections keep the weight's memory alive without the model
    np.testing.assert_allclose(ov.Core().compile_model(compiled, "CPU", F32)(values)[0], want, rtol=1e-6, atol=1e-6)
    assert for_compiling(compiled) is compiled  # nothing left to share


def test_a_split_of_a_constant_across_its_memory_is_left_to_the_device():
    """Sections along the second axis of a matrix are not pieces of its memory: the split stays."""
    rng = np.random.default_rng(6)
    weight = rng.standard_normal((8, 12), np.float32)
    x = ops.parameter([2, 5, 8], np.float32, name="x")
    halves = ops.variadic_split(ops.constant(weight), ops.constant(np.int64(1)), ops.constant(np.array([6, 6])))
    model = ov.Model([ops.multiply(ops.matmul(x, halves.output(0), False, False),
                                   ops.matmul(x, halves.output(1), False, False))], [x])
    assert for_compiling(model) is model and share_weight_sections(model) == 0


def splits_of_constants(model: ov.Model) -> int:
    return sum(1 for op in model.get_ordered_ops() if op.get_type_name() == "VariadicSplit"
               and op.input_value(0).get_node().get_type_name() == "Constant")


class NormBlock(torch.nn.Module):
    """A UNet's or a VAE's resnet opening: group norm, SiLU, convolution."""

    def __init__(self, channels: int = 64, groups: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.GroupNorm(groups, channels)
        with torch.no_grad():  # (a fresh norm is the identity affine: give it a scale and a bias of its own)
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.nn.functional.silu(self.norm(x)))


def group_norms(model: ov.Model) -> int:
    return sum(1 for op in model.get_ordered_ops() if op.get_type_name() == "GroupNormalization")


def test_a_group_norm_runs_as_reductions_and_gives_the_eager_result(tmp_path):
    model = NormBlock().eval()
    backend = f32_backend(tmp_path, model_caching=True)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for size in (16, 24):  # a second size: the same model, its spatial sizes dynamic
            x = torch.randn(2, 64, size, size) * 3 + 1
            torch.testing.assert_close(compiled(x), model(x), atol=F32_ATOL, rtol=F32_RTOL)
    assert backend.stats()["eager_calls"] == 0
    stored = stored_models(backend)
    assert stored and all(group_norms(m) == 0 for m in stored)
    # without the rewrite, the group norm stays one op
    torch._dynamo.reset()
    without = f32_backend(tmp_path / "without", model_caching=True, rewrites=["split_projections"])
    with torch.no_grad():
        torch.compile(model, backend=without)(torch.randn(2, 64, 16, 16))
    kept = stored_models(without)
    assert kept and all(group_norms(m) == 1 for m in kept)


@pytest.mark.parametrize("shape", [(1, 320, 64, 64), (2, 128, 96, 96)])
def test_a_group_norm_as_reductions_is_the_same_bytes_on_any_number_of_threads(shape):
    """The CPU plugin's own group norm kernel splits a group's sums between its threads (its results differ in
    the last bit between 1 and 2 threads): batch workers on 1 thread rendered other pictures than one process
    on 2. The rewritten model sums each group in one order, whatever the thread count."""
    from ov_backend.rewrites import group_norm_reductions

    norm = NormBlock(shape[1]).norm.eval()
    x = torch.randn(shape) * 3 + 1
    model = ov.convert_model(norm, example_input=(x,))
    assert group_norms(model) == 1
    assert group_norm_reductions(model) == 1 and group_norms(model) == 0
    core = ov.Core()
    outs = {threads: core.compile_model(model, "CPU", {**F32, "INFERENCE_NUM_THREADS": threads})(x.numpy())[0]
            for threads in (1, 2, 4, 8)}
    assert all(np.array_equal(outs[threads], outs[1]) for threads in outs)
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(outs[1]), norm(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_group_norm_is_rewritten_and_normalized_at_f32(dtype):
    """A group norm of 16-bit data (a half-precision module given to the backend): the reductions run at f32, as
    the op itself computes, and the result comes back in the data's type (a bf16 constant for epsilon failed the
    model's validation)."""
    from ov_backend.rewrites import group_norm_reductions

    class Half(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = NormBlock(64).norm.to(dtype)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(x.to(dtype)).float()

    x = torch.randn(2, 64, 16, 16) * 3 + 1
    model = ov.convert_model(Half().eval(), example_input=(x,))
    norm = next(op for op in model.get_ordered_ops() if op.get_type_name() == "GroupNormalization")
    assert norm.get_output_element_type(0) == {torch.float16: ov.Type.f16, torch.bfloat16: ov.Type.bf16}[dtype]
    core = ov.Core()
    want = core.compile_model(model.clone(), "CPU", F32)(x.numpy())[0]
    assert group_norm_reductions(model) == 1 and group_norms(model) == 0
    got = core.compile_model(model, "CPU", F32)(x.numpy())[0]
    tolerance = {torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    np.testing.assert_allclose(got, want, atol=tolerance, rtol=tolerance)
