"""Where an INT8 model's time goes against the float one: ``python -m bench.int8_profile``.

Converts the component once (``ov.convert_model``, static shapes: per call as fast as the backend's
graph, see ``bench.compare``), quantizes it with the backend's own NNCF settings
(``ov_backend.quantize.quantize``) on ``--samples`` varied copies of the example inputs
(``bench.variants.calibration_inputs``, as the ``int8`` bench variant does), compiles both at the
device's automatic precision with the plugin's per-node counters, times them interleaved, and lists
the plugin's time per node type.

It also splits out the attention (the nodes of ``scaled_dot_product_attention``: the CPU plugin fuses
each into one subgraph, or runs its matmuls and softmax apart): a softmax over tokens x tokens that
8-bit arithmetic barely speeds up. Its share of the float call bounds what INT8 can give for the whole
call: the report prints the speed-up the call would have if everything else ran twice as fast (the
peak gain of 8-bit over 16-bit dot products) and the attention as fast as it does at INT8; on CPUs
without VNNI, where the quantizer keeps the matmuls at float, with them at their float time.
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

import openvino as ov
import torch

from bench import models
from bench.compare import perf_by_type
from bench.report import add_profile_arguments, machine, machine_line, write_profile
from bench.variants import VariantSpec, calibration_inputs

logger = logging.getLogger("bench.int8_profile")

ATTENTION_MARK = "scaled_dot_product_attention"
#: the plugin's node types of matmuls (kept at float by the quantizer on CPUs without VNNI)
MATMUL_NODE_TYPES = frozenset({"FullyConnected", "MatMul"})


def attention_nodes(compiled: ov.CompiledModel) -> frozenset[str]:
    """The names of the plugin's nodes that run an attention's ops: a node it fused one into (a snippet
    subgraph, named after whichever of the fused ops it likes: the attention op on AMX, the transpose after
    it with oneDNN capped at AVX2) lists the attention among its original layers."""
    names = set()
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        original = info["originalLayersNames"].astype(str) if "originalLayersNames" in info else ""
        kind = info["layerType"].astype(str) if "layerType" in info else ""
        if ATTENTION_MARK in original or kind in ("ScaledDotProductAttention", "Softmax"):
            names.add(op.get_friendly_name())
    return frozenset(names)


def attention_and_matmul_ms(request: ov.InferRequest, attention: frozenset[str]) -> tuple[float, float]:
    """Milliseconds of the last inference (needs ``PERF_COUNT``) in the ``attention``'s nodes, and in
    matmuls and fully-connected layers outside it."""
    in_attention = in_matmuls = 0.0
    for i in request.profiling_info:
        if i.status != i.Status.EXECUTED:
            continue
        ms = i.real_time.total_seconds() * 1e3
        if i.node_name in attention:
            in_attention += ms
        elif i.node_type in MATMUL_NODE_TYPES:
            in_matmuls += ms
    return in_attention, in_matmuls


def bound_if_rest_2x(float_ms: float, float_attention_ms: float, int8_attention_ms: float, float_matmul_ms: float,
                     matmuls_at_float: bool) -> float | None:
    """The float call's time over the INT8 call's if every node INT8 can speed up ran twice as fast (the
    peak gain of 8-bit dot products over 16-bit ones, or over f32 ones with AVX2), the attention took what it
    takes at INT8, and, where the quantizer keeps them at float (no VNNI), the matmuls what they take at float."""
    kept = int8_attention_ms + (float_matmul_ms if matmuls_at_float else 0.0)
    rest = float_ms - float_attention_ms - (float_matmul_ms if matmuls_at_float else 0.0)
    return float_ms / (kept + rest / 2) if rest > 0 else None


def profile(component: str, quick: bool, size: int, samples: int, rounds: int, work: Path) -> dict[str, Any]:
    from ov_backend.quantize import exact_int8_dot_products, quantize

    module = models.load_module(component, quick, models.ensure_weights(component, quick, work / "weights"))
    inputs = models.example_inputs(component, quick, size)
    start = time.perf_counter()
    with torch.no_grad():
        model = ov.convert_model(module, example_input=tuple(inputs))
    convert_s = time.perf_counter() - start
    del module
    calibration = [[t.numpy() if isinstance(t, torch.Tensor) else t for t in calibration_inputs(inputs, k)]
                   for k in range(samples)]
    start = time.perf_counter()
    quantized = quantize(model, calibration)
    quantize_s = time.perf_counter() - start
    logger.info("converted in %.1f s, quantized on %d samples in %.1f s", convert_s, samples, quantize_s)

    core = ov.Core()
    arrays = [t.numpy() for t in inputs]
    # the device's automatic precision (f32 where oneDNN is capped below bf16, as on such a CPU)
    config = {"PERF_COUNT": True, **VariantSpec("static", "auto").config}
    compiled = {name: core.compile_model(m, "CPU", config) for name, m in (("float", model), ("int8", quantized))}
    attention = {name: attention_nodes(c) for name, c in compiled.items()}
    requests = {name: c.create_infer_request() for name, c in compiled.items()}
    del compiled
    del model, quantized
    for request in requests.values():  # warm-up: the plugin lays out the weights on the first inference
        request.infer(arrays)
    times: dict[str, list[float]] = {name: [] for name in requests}
    for round_index in range(rounds):
        order = list(requests) if round_index % 2 == 0 else list(reversed(requests))
        for name in order:
            start = time.perf_counter()
            requests[name].infer(arrays)
            times[name].append(time.perf_counter() - start)
    result: dict[str, Any] = {"component": component, "quick": quick, "size": size, "samples": samples,
                              "rounds": rounds, "convert_seconds": convert_s, "quantize_seconds": quantize_s,
                              "times": times, "machine": machine(),
                              "device": core.get_property("CPU", "FULL_DEVICE_NAME")}
    for name, request in requests.items():  # the counters of each model's last call
        by_type = perf_by_type(request)
        attention_time, matmul_time = attention_and_matmul_ms(request, attention[name])
        result[name] = {"median_s": statistics.median(times[name]), "profiled_ms": sum(by_type.values()),
                        "attention_ms": attention_time, "matmul_ms": matmul_time, "by_type_ms": by_type}
    f, q = result["float"], result["int8"]
    result["speedup"] = f["median_s"] / q["median_s"]
    result["matmuls_at_float"] = not exact_int8_dot_products()
    result["bound_if_rest_2x"] = bound_if_rest_2x(f["profiled_ms"], f["attention_ms"], q["attention_ms"],
                                                  f["matmul_ms"], result["matmuls_at_float"])
    return result


def markdown(result: dict[str, Any], command: str, top: int = 25) -> str:
    m = result["machine"]
    f, q = result["float"], result["int8"]
    lines = [
        f"# INT8 against float, per node type: {result['component']}",
        "",
        machine_line(m, result["device"]),
        "",
        f"Command: `{command}`. Model converted statically ({result['convert_seconds']:.1f} s), quantized "
        f"with the backend's NNCF settings on {result['samples']} varied copies of the inputs "
        f"({result['quantize_seconds']:.1f} s); both compiled at the CPU's automatic precision, "
        f"{result['rounds']} interleaved calls each, size {result['size']}.",
        "",
        "| | float (auto) | INT8 |",
        "|---|---|---|",
        f"| median s/call | {f['median_s']:.3f} | {q['median_s']:.3f} ({result['speedup']:.2f}x) |",
        f"| plugin's profiled ms | {f['profiled_ms']:.1f} | {q['profiled_ms']:.1f} |",
        f"| of it attention ms (share) | {f['attention_ms']:.1f} ({f['attention_ms'] / f['profiled_ms']:.0%}) | "
        f"{q['attention_ms']:.1f} ({q['attention_ms'] / q['profiled_ms']:.0%}) |",
        f"| of it the rest ms | {f['profiled_ms'] - f['attention_ms']:.1f} | "
        f"{q['profiled_ms'] - q['attention_ms']:.1f} "
        f"({(f['profiled_ms'] - f['attention_ms']) / max(q['profiled_ms'] - q['attention_ms'], 1e-9):.2f}x) |",
        "",
    ]
    if result["bound_if_rest_2x"] is not None:
        kept = (f", and the matmuls and fully-connected layers ({f['matmul_ms']:.1f} ms) at float, where the "
                f"quantizer keeps them without VNNI" if result["matmuls_at_float"] else "")
        lines += [f"If every other node ran twice as fast at INT8 as at float, the attention as it does at INT8{kept}, "
                  f"the call would be {result['bound_if_rest_2x']:.2f}x the float one.", ""]
    keys = sorted(set(f["by_type_ms"]) | set(q["by_type_ms"]),
                  key=lambda k: -max(f["by_type_ms"].get(k, 0.0), q["by_type_ms"].get(k, 0.0)))
    lines += ["| node type (kernel) | float ms | INT8 ms |", "|---|---|---|"]
    for key in keys[:top]:
        lines.append(f"| {key} | {f['by_type_ms'].get(key, 0.0):.1f} | {q['by_type_ms'].get(key, 0.0):.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m bench.int8_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--component", default="unet", choices=models.COMPONENT_NAMES)
    p.add_argument("--samples", type=int, default=4, help="calibration samples (default 4)")
    add_profile_arguments(p, "int8-profile")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.samples < 1 or args.rounds < 1:
        p.error("--samples and --rounds must be at least 1")
    size = args.size or (64 if args.quick else 512)
    result = profile(args.component, args.quick, size, args.samples, args.rounds, Path(args.work_dir))
    write_profile(result, markdown(result, "python -m bench.int8_profile " + " ".join(argv)), Path(args.out), args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
