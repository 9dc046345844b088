"""``python -m bench streams``: OpenVINO's own throughput mode (``NUM_STREAMS``, one process) against N processes
(the batch command's ``--workers N``), on the Stable Diffusion UNet, the cost of every sampling step.

The full-size SD 1.5 UNet (random weights, ``bench.models``; ``--quick``: the small one) is converted once to an
OpenVINO IR at one image size; each mode then compiles that IR in processes of its own and runs UNet calls
(batch 2: one sampling step of one image with classifier-free guidance) for ``--seconds``:

- ``latency``: one process, one stream on every core (what one ``batch`` process does);
- ``streams``: one process, ``NUM_STREAMS`` = N, N requests in flight (``AsyncInferQueue``);
- ``processes``: N processes at once, each pinned to its share of the cores with ``INFERENCE_NUM_THREADS`` to match
  (what ``--workers N`` does).

Reported per mode: UNet calls a second (all processes together; a step of an image each), against ``latency``,
each process's peak RSS and their sum. The mode with more calls a second is the one ``--workers`` should use.

    python -m bench streams [--quick] [--workers 2] [--size 512] [--seconds 60]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import resource
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def convert(ir: Path, quick: bool, size: int) -> None:
    """The UNet as an OpenVINO IR, its weights at f32 as PyTorch has them (not compressed to f16)."""
    import openvino as ov
    import torch

    from bench import models

    module = models.build_module("unet", quick)
    inputs = models.example_inputs("unet", quick, size)
    with torch.no_grad():
        model = ov.convert_model(module, example_input=inputs)
    ov.save_model(model, str(ir), compress_to_fp16=False)
    torch.save(list(inputs), ir.with_suffix(".inputs.pt"))


def _run(ir: str, config: dict[str, str], requests: int, seconds: float, cores: list[int] | None,
         out: Any) -> None:
    """One process: compile ``ir`` with ``config``, keep ``requests`` calls in flight for ``seconds`` (after one
    untimed warm-up call each), and put (calls, seconds, peak RSS bytes) on ``out``."""
    if cores is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    import openvino as ov
    import torch

    inputs = [t.numpy() for t in torch.load(Path(ir).with_suffix(".inputs.pt"), weights_only=True)]
    compiled = ov.Core().compile_model(ir, "CPU", config)
    queue = ov.AsyncInferQueue(compiled, requests)
    for _ in range(requests):  # warm-up: the first call packs the weights
        queue.start_async(inputs)
    queue.wait_all()
    done = 0

    def finished(_request: Any, _data: Any) -> None:
        nonlocal done
        done += 1

    queue.set_callback(finished)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        queue.start_async(inputs)  # blocks while every request is busy
    queue.wait_all()
    elapsed = time.perf_counter() - start
    out.put((done, elapsed, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))


def measure(ir: Path, mode: str, workers: int, seconds: float, cores: list[int]) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    if mode == "latency":
        plans = [({"PERFORMANCE_HINT": "LATENCY"}, 1, None)]
    elif mode == "streams":
        plans = [({"NUM_STREAMS": str(workers), "PERFORMANCE_HINT": "THROUGHPUT"}, workers, None)]
    else:
        share = [cores[i::workers] for i in range(workers)]
        plans = [({"INFERENCE_NUM_THREADS": str(len(mine)), "NUM_STREAMS": "1", "ENABLE_CPU_PINNING": "YES"}, 1, mine)
                 for mine in share]
    procs = [context.Process(target=_run, args=(str(ir), config, requests, seconds, mine, out))
             for config, requests, mine in plans]
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds * 20 + 1800) for _ in procs]
    for p in procs:
        p.join()
    calls = sum(done / elapsed for done, elapsed, _ in results)
    return {"mode": mode, "processes": len(procs), "calls_per_second": calls,
            "peak_rss_gib": [rss / (1 << 30) for _, _, rss in results],
            "peak_rss_sum_gib": sum(rss for _, _, rss in results) / (1 << 30)}


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench streams", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the small UNet (seconds)")
    p.add_argument("--workers", type=int, default=2, help="N: streams in one process, or processes (default 2)")
    p.add_argument("--size", type=int, default=512, help="image size in pixels (default 512; quick 64)")
    p.add_argument("--seconds", type=float, default=60.0, help="timed seconds per mode (default 60)")
    p.add_argument("--work-dir", type=Path, default=Path("build/bench-streams"))
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--name", default=None, help="file name of the results (default streams-<date>)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from bench.report import machine

    size = 64 if args.quick and args.size == 512 else args.size
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if args.workers < 1 or args.workers > len(cores):
        p.error(f"--workers must be between 1 and the {len(cores)} cores this process may use")
    ir = args.work_dir / f"unet-{'quick' if args.quick else 'full'}-{size}.xml"
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if not ir.is_file():
        logger.info("converting the UNet to %s", ir)
        context = multiprocessing.get_context("spawn")
        proc = context.Process(target=convert, args=(ir, args.quick, size))
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise SystemExit(f"the conversion failed (exit {proc.exitcode})")
    rows = []
    for mode in ("latency", "streams", "processes"):
        row = measure(ir, mode, args.workers, args.seconds, cores)
        logger.info("%s", row)
        rows.append(row)
    base = rows[0]["calls_per_second"]
    info = machine()
    cpu = f"{info.get('Model name', '?')}, {info.get('Flags') or 'no AVX-512'}, {len(cores)} cores"
    name = args.name or f"streams-{time.strftime('%Y-%m-%d')}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps({"cpu": cpu, "machine": info, "size": size, "quick": args.quick,
                                                       "workers": args.workers, "seconds": args.seconds,
                                                       "rows": rows}, indent=2) + "\n", encoding="utf-8")
    labels = {"latency": "one process, one stream (the `batch` command)",
              "streams": f"one process, NUM_STREAMS={args.workers}, {args.workers} requests in flight",
              "processes": f"{args.workers} processes pinned to their cores (`--workers {args.workers}`)"}
    lines = [f"# OpenVINO's throughput mode against {args.workers} processes: the UNet ({cpu})", "",
             f"`python -m bench streams {' '.join(argv)}` (bench/streams.py): the "
             f"{'small' if args.quick else 'full-size'} SD 1.5 UNet at {size}x{size}, batch 2 (a sampling step with "
             "CFG), one IR at f32 compiled at the CPU's "
             f"default precision, {args.seconds:g} s timed per mode after a warm-up call.", "",
             "| mode | UNet calls a second | against one process | peak RSS GiB (each process) |",
             "|---|---|---|---|"]
    for row in rows:
        each = ", ".join(f"{v:.2f}" for v in row["peak_rss_gib"])
        lines.append(f"| {labels[row['mode']]} | {row['calls_per_second']:.3f} | "
                     f"{row['calls_per_second'] / base:.2f}x | {each} |")
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))  # noqa: T201 (the bench's report)
    return 0
