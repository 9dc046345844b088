"""What a LoRA weight change costs the UNet, and what applying LoRA at run time would cost instead:
``python -m bench.lora_cost``.

A1111's Lora extension writes the LoRA-modified weights into the model; the backend then compiles the
model it converted before with the new weights (no conversion): one compile, as for a new image size.
The other way, the one OpenVINO GenAI takes for its own pipelines, keeps the compiled model and feeds
each targeted projection a low-rank branch (``x @ down.T @ up.T``) whose factors are inputs, so a new
LoRA or strength is new input values, not a compile; every call then pays for the branches.

This bench measures both on the backend's own model of the UNet: it captures the model the backend
compiles (``torch.compile`` through :class:`ov_backend.OVBackend`), times compiles of it (what a weight
change costs), adds a rank-``--rank`` branch to every projection whose weight is a 2-D matrix of at least
``--min-features`` rows and columns (the layers an SD LoRA targets: attention, feed-forward, proj_in/out),
and times both models' calls interleaved. The report gives the per-call cost of the branches and the
number of sampling steps after which they cost more than the compile they save.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import torch

from bench import models
from bench.report import add_profile_arguments, machine, machine_line, write_profile

logger = logging.getLogger("bench.lora_cost")


def backend_model(component: str, quick: bool, size: int, work: Path) -> tuple[ov.Model, list[np.ndarray], Any]:
    """The model the backend compiles for the component's first call (weights bound), the call's inputs, and
    the backend (whose ``compile_model`` compiles as the backend does)."""
    from ov_backend import OVBackend

    captured: list[ov.Model] = []

    class Capturing(OVBackend):
        def compile_model(self, model: Any) -> ov.CompiledModel:
            if isinstance(model, ov.Model) and not captured:
                captured.append(model)
            return super().compile_model(model)

    module = models.load_module(component, quick, models.ensure_weights(component, quick, work / "weights"))
    inputs = models.example_inputs(component, quick, size)
    backend = Capturing({"model_caching": False})
    with torch.no_grad():
        torch.compile(module, backend=backend)(*inputs)
    torch._dynamo.reset()
    if not captured:
        raise RuntimeError(f"the backend compiled no model of {component}")
    return captured[0], [t.numpy() for t in inputs], backend


def with_low_rank_branches(model: ov.Model, rank: int, min_features: int) -> tuple[ov.Model, int]:
    """A copy of ``model`` where every MatMul whose second input is a 2-D constant matrix (possibly through a
    Transpose) of at least ``min_features`` rows and columns also adds ``x @ down.T @ up.T``, with ``down``
    ([rank, in]) and ``up`` ([out, rank]) new inputs after the model's own; returns it and the branch count."""
    copy = model.clone()
    added: list[ov.Node] = []
    for op in copy.get_ordered_ops():
        if op.get_type_name() != "MatMul":
            continue
        weight = op.input_value(1).get_node()
        if weight.get_type_name() == "Transpose":
            weight = weight.input_value(0).get_node()
        if weight.get_type_name() != "Constant":
            continue
        shape = list(weight.get_output_shape(0))
        if len(shape) != 2 or min(shape) < min_features:
            continue
        x = op.input_value(0)
        in_features = x.get_partial_shape()[-1].get_length()
        out_features = op.get_output_partial_shape(0)[-1].get_length()
        down = ov.op.Parameter(ov.Type.f32, ov.PartialShape([rank, in_features]))
        up = ov.op.Parameter(ov.Type.f32, ov.PartialShape([out_features, rank]))
        branch = ops.matmul(ops.matmul(x, down, False, True), up, False, True)
        consumers = list(op.output(0).get_target_inputs())
        total = ops.add(op.output(0), branch)
        for consumer in consumers:
            consumer.replace_source_output(total.output(0))
        added += [down, up]
    if added:
        copy.add_parameters(added)
        copy.validate_nodes_and_infer_types()
    return copy, len(added) // 2


def _compile(backend: Any, model: ov.Model) -> tuple[ov.CompiledModel, float]:
    start = time.perf_counter()
    compiled = backend.compile_model(model)
    return compiled, time.perf_counter() - start


def measure(component: str, quick: bool, size: int, rank: int, min_features: int, rounds: int,
            work: Path) -> dict[str, Any]:
    model, inputs, backend = backend_model(component, quick, size, work)
    compile_seconds = []
    for _ in range(2):  # a weight change: the same model compiled again (the previous one released first)
        compiled, seconds = _compile(backend, model)
        compile_seconds.append(seconds)
        del compiled
    branched, count = with_low_rank_branches(model, rank, min_features)
    if not count:
        raise RuntimeError(f"no projection of {component} has a weight of at least {min_features} features")
    plain, _ = _compile(backend, model)
    lora, lora_compile = _compile(backend, branched)
    rng = np.random.default_rng(0)
    factors = [(rng.standard_normal(list(p.get_partial_shape().to_shape())) * 0.01).astype(np.float32)
               for p in branched.get_parameters()[len(inputs):]]
    requests = {"plain": (plain.create_infer_request(), inputs), "branches": (lora.create_infer_request(),
                                                                              [*inputs, *factors])}
    for request, feed in requests.values():
        request.infer(feed)  # the first inference lays out the weights
    times: dict[str, list[float]] = {name: [] for name in requests}
    for index in range(rounds):
        for name in (list(requests) if index % 2 == 0 else list(reversed(requests))):
            request, feed = requests[name]
            start = time.perf_counter()
            request.infer(feed)
            times[name].append(time.perf_counter() - start)
    plain_s, branches_s = statistics.median(times["plain"]), statistics.median(times["branches"])
    extra = branches_s - plain_s
    compile_s = statistics.median(compile_seconds)
    return {"component": component, "quick": quick, "size": size, "rank": rank, "min_features": min_features,
            "rounds": rounds, "branches": count, "compile_seconds": compile_seconds,
            "compile_with_branches_seconds": lora_compile, "times": times, "plain_s": plain_s,
            "branches_s": branches_s, "ratio": branches_s / plain_s,
            "break_even_steps": compile_s / extra if extra > 0 else None,
            "machine": machine(), "device": backend.core.get_property("CPU", "FULL_DEVICE_NAME")}


def markdown(result: dict[str, Any], command: str) -> str:
    m = result["machine"]
    compile_s = statistics.median(result["compile_seconds"])
    lines = [
        f"# A LoRA weight change: a compile, or low-rank branches on every call ({result['component']})",
        "",
        machine_line(m, result["device"]),
        "",
        f"Command: `{command}`. The backend's model of the component (size {result['size']}), compiled as the "
        f"backend compiles; {result['branches']} projections given a rank-{result['rank']} branch (weights of at "
        f"least {result['min_features']} features); {result['rounds']} interleaved calls each.",
        "",
        "| | seconds |",
        "|---|---|",
        f"| compile after a weight change (median of {len(result['compile_seconds'])}) | {compile_s:.2f} |",
        f"| compile of the model with branches (once; then a LoRA change is new inputs) | "
        f"{result['compile_with_branches_seconds']:.2f} |",
        f"| call, weights merged (median) | {result['plain_s']:.3f} |",
        f"| call, with the branches (median) | {result['branches_s']:.3f} ({result['ratio']:.3f}x) |",
        "",
    ]
    if result["break_even_steps"] is not None:
        lines.append(f"The branches cost {result['branches_s'] - result['plain_s']:.3f} s per call: after "
                     f"{result['break_even_steps']:.0f} calls (sampling steps, at CFG one call per step) with a LoRA "
                     f"they have cost more than the compile a weight change takes.")
    else:
        lines.append("The branches cost nothing measurable per call in this run.")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m bench.lora_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=32, help="rank of each branch (default 32)")
    p.add_argument("--min-features", type=int, default=None,
                   help="smallest side of a weight that gets a branch (default 320; quick 16)")
    add_profile_arguments(p, "lora-cost")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.rank < 1 or args.rounds < 1:
        p.error("--rank and --rounds must be at least 1")
    size = args.size or (64 if args.quick else 512)
    min_features = args.min_features or (16 if args.quick else 320)
    result = measure("unet", args.quick, size, args.rank, min_features, args.rounds, Path(args.work_dir))
    write_profile(result, markdown(result, "python -m bench.lora_cost " + " ".join(argv)), Path(args.out), args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
