"""Where ov_backend's time goes against the static model, in one process.

``python -m bench.compare --component unet --precision auto`` converts the component both
ways and separates the two possible causes of a gap:

* the graph: ov_backend's converted model (read back from its disk cache) and the static
  model are compiled alike and timed by OpenVINO alone (numpy in, numpy out), interleaved;
  their op histograms and, with ``--perf-counts``, the plugin's per-op-type times are
  compared;
* the per-call path: the same ov_backend model called through ``torch.compile`` (dynamo
  guards, the backend's weight check and tensor conversions) against its raw OpenVINO call.

Full-size models need one process's worth of memory for two compiled copies of the weights.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import torch

from bench import models

logger = logging.getLogger("bench.compare")


def op_histogram(model: ov.Model) -> collections.Counter[str]:
    """How many ops of each type a model holds (Parameters, Results and Constants excluded)."""
    skip = {"Parameter", "Result", "Constant"}
    return collections.Counter(op.get_type_name() for op in model.get_ordered_ops() if op.get_type_name() not in skip)


def perf_by_type(request: ov.InferRequest) -> dict[str, float]:
    """Milliseconds per executed node type of the last inference (needs ``PERF_COUNT``)."""
    totals: dict[str, float] = collections.defaultdict(float)
    for info in request.profiling_info:
        if info.status == info.Status.EXECUTED:
            totals[f"{info.node_type} ({info.exec_type})"] += info.real_time.total_seconds() * 1e3
    return dict(totals)


def input_order(model: ov.Model) -> list[int]:
    """For each model input, the index of the user input it takes.

    The FX route names inputs ``argN_1`` after the traced function's N-th argument, and a
    partition takes its inputs in order of first use (the UNet uses the timestep first), so
    the order can differ from the call's; other models take them in call order.
    """
    order = []
    for position, port in enumerate(model.inputs):
        found = re.fullmatch(r"arg(\d+)_1", port.get_any_name()) if port.get_names() else None
        order.append(int(found.group(1)) if found else position)
    return order


def _raw_call(compiled: ov.CompiledModel, order: Sequence[int]
              ) -> tuple[ov.InferRequest, Callable[[Sequence[np.ndarray]], None]]:
    request = compiled.create_infer_request()

    def call(arrays: Sequence[np.ndarray]) -> None:
        request.infer([arrays[i] for i in order], share_inputs=True, share_outputs=True)

    return request, call


def _median_ms(times: list[float]) -> str:
    return f"{1e3 * statistics.median(times):9.1f} ms (min {1e3 * min(times):.1f}, max {1e3 * max(times):.1f})"


def compare(component: str, precision: str, quick: bool, size: int, rounds: int, work: Path,
            perf_counts: bool) -> dict[str, Any]:
    """Convert both ways, time the three paths interleaved; returns the numbers (also logged)."""
    from ov_backend import ModelCache, OVBackend

    config = {"INFERENCE_PRECISION_HINT": "f32"} if precision == "f32" else {}
    module = models.load_module(component, quick, models.ensure_weights(component, quick, work / "weights"))
    inputs = models.example_inputs(component, quick, size)
    arrays = [t.numpy() for t in inputs]
    core = ov.Core()

    cache_dir = Path(tempfile.mkdtemp(prefix="compare-cache-", dir=work))
    backend = OVBackend({"model_caching": True, "cache_dir": str(cache_dir), "config": config})
    compiled_fn = torch.compile(module, backend=backend)
    start = time.perf_counter()
    with torch.no_grad():
        compiled_fn(*inputs)
    logger.info("ov_backend first call %.1f s: %s", time.perf_counter() - start,
                "; ".join(r.summary() for r in backend.reports))
    entries = [e for e in ModelCache(cache_dir).entries() if (e.path / "model.xml").is_file()]
    if len(entries) != 1:
        raise RuntimeError(f"expected one cached model (the whole graph), found {len(entries)}: "
                           f"{[e.description for e in entries]}")
    ovb_model = core.read_model(str(entries[0].path / "model.xml"))
    ovb_model = ovb_model.clone()  # detached from the files: the cache folder is removed below
    shutil.rmtree(cache_dir, ignore_errors=True)

    start = time.perf_counter()
    with torch.no_grad():
        static_model = ov.convert_model(module, example_input=tuple(inputs))
    logger.info("static conversion %.1f s", time.perf_counter() - start)

    hist_ovb, hist_static = op_histogram(ovb_model), op_histogram(static_model)
    diff = {k: (hist_ovb.get(k, 0), hist_static.get(k, 0)) for k in sorted(set(hist_ovb) | set(hist_static))
            if hist_ovb.get(k, 0) != hist_static.get(k, 0)}
    logger.info("ops: ov_backend %d, static %d; differing types (ov_backend, static): %s",
                sum(hist_ovb.values()), sum(hist_static.values()), diff)

    run_config = {**config, **({"PERF_COUNT": True} if perf_counts else {})}
    logger.info("ov_backend model inputs: %s",
                [(port.get_any_name(), str(port.get_partial_shape())) for port in ovb_model.inputs])
    ovb_request, ovb_raw = _raw_call(core.compile_model(ovb_model, "CPU", run_config), input_order(ovb_model))
    static_request, static_raw = _raw_call(core.compile_model(static_model, "CPU", run_config),
                                           list(range(len(inputs))))
    del ovb_model, static_model

    def through_torch_compile(_: Sequence[np.ndarray]) -> None:
        with torch.no_grad():
            compiled_fn(*inputs)

    paths: dict[str, Callable[[Sequence[np.ndarray]], None]] = {
        "static model, raw OpenVINO": static_raw,
        "ov_backend model, raw OpenVINO": ovb_raw,
        "ov_backend through torch.compile": through_torch_compile,
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    cpu: dict[str, list[float]] = {name: [] for name in paths}
    for call in paths.values():  # warm-up
        call(arrays)
    for round_index in range(rounds):
        names = list(paths)
        names = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in names:
            wall, proc = time.perf_counter(), time.process_time()
            paths[name](arrays)
            times[name].append(time.perf_counter() - wall)
            cpu[name].append(time.process_time() - proc)
    for name in paths:
        logger.info("%-34s %s, CPU %.1f ms", name, _median_ms(times[name]), 1e3 * statistics.median(cpu[name]))
    result: dict[str, Any] = {"component": component, "precision": precision, "ops_differing": diff,
                              "ops_total": {"ov_backend": sum(hist_ovb.values()), "static": sum(hist_static.values())},
                              "times": times, "cpu_times": cpu, "backend_stats": backend.stats()}
    if perf_counts:
        result["perf_ms"] = {"ov_backend": perf_by_type(ovb_request), "static": perf_by_type(static_request)}
        ovb_ms, static_ms = result["perf_ms"]["ov_backend"], result["perf_ms"]["static"]
        keys = sorted(set(ovb_ms) | set(static_ms), key=lambda k: -max(ovb_ms.get(k, 0), static_ms.get(k, 0)))
        logger.info("plugin time per node type, one call: ov_backend %.1f ms, static %.1f ms",
                    sum(ovb_ms.values()), sum(static_ms.values()))
        for key in keys[:25]:
            logger.info("  %-60s ov_backend %8.1f ms   static %8.1f ms", key, ovb_ms.get(key, 0.0),
                        static_ms.get(key, 0.0))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--component", default="unet", choices=models.COMPONENT_NAMES)
    p.add_argument("--precision", default="auto", choices=("auto", "f32"))
    p.add_argument("--quick", action="store_true", help="small model")
    p.add_argument("--size", type=int, default=None, help="image size in pixels (default 512; quick 64)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--perf-counts", action="store_true", help="per-op-type times from the CPU plugin")
    p.add_argument("--work-dir", default=None, help="weights and caches (default: a temporary folder)")
    p.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="ov-compare-"))
    size = args.size or (64 if args.quick else 512)
    try:
        result = compare(args.component, args.precision, args.quick, size, args.rounds, work, args.perf_counts)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
