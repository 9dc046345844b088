"""Step caching's benchmark: ``python -m bench step-cache``.

For each sampler, one image without step caching and one at each interval, through the command line's
pipeline (``ov_accelerate_sd``: the WebUI checkpoint loaded with diffusers, every part through OpenVINO at one
precision), same seed. Per image: wall time (without the audit's extra calls), the UNet's full and cached
calls and their seconds, the PSNR against the uncached image, and, per cached step, the relative L2 error
of the cached UNet output against the full UNet's on the same inputs (the audit: one more full call per
cached call, not counted in the time). A short warm-up image compiles each route first, so the times are of
compiled models.

The checkpoint's weights are random (the test bed's ``sd15-random.safetensors``, or the demo's with
``--quick``): their deep features need not change slowly between steps as a trained model's do, so the
errors and PSNRs are not those of a trained model (``docs/step-cache.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import resource
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench import report

logger = logging.getLogger(__name__)

DEFAULT_CHECKPOINT = "webui/models/Stable-diffusion/sd15-random.safetensors"
"""The full-size random SD 1.5 checkpoint of the test bed (``A1111_ROOT``, default ``build/a1111-testbed``)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench step-cache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, help="WebUI checkpoint (default: the test bed's sd15-random; "
                                                   "--quick: the demo checkpoint)")
    p.add_argument("--quick", action="store_true", help="the tiny demo checkpoint, 64x64, 6 steps (smoke test)")
    p.add_argument("--size", type=int, help="image size in pixels (default 512; quick 64)")
    p.add_argument("--steps", type=int, help="sampler steps (default 20; quick 6)")
    p.add_argument("--samplers", nargs="+", default=["Euler a", "DPM++ 2M"], help="WebUI sampler names")
    p.add_argument("--intervals", nargs="+", type=int, default=[2, 3, 4], help="step caching intervals (> 1)")
    p.add_argument("--precision", default="auto", help="auto, f32 or int8 (default auto)")
    p.add_argument("--depth", type=int, help="step caching depth (default: the setting's default)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-audit", dest="audit", action="store_false", help="skip the per-step error")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="folder of the JSON and markdown")
    p.add_argument("--name", default="step-cache", help="file name stem of the results")
    p.add_argument("--cache-dir", type=Path, help="OpenVINO disk cache (default: a temporary folder)")
    p.add_argument("--note", help="a sentence printed above the tables")
    return p


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * float(np.log10(255.0**2 / mse))


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run(args: argparse.Namespace, cache_dir: Path) -> dict[str, Any]:
    from ov_accelerate_sd.accelerate import Accelerator
    from ov_accelerate_sd.demo_checkpoint import demo_checkpoint
    from ov_accelerate_sd.loader import load_components
    from ov_accelerate_sd.pipeline import GenerationJob, Generator
    from ov_accelerate_sd.settings import build_sd_settings
    from ov_accelerate_sd.step_cache import StepCacheSettings

    checkpoint = args.checkpoint
    if checkpoint is None:
        checkpoint = demo_checkpoint() if args.quick else \
            Path(os.environ.get("A1111_ROOT", "build/a1111-testbed")) / DEFAULT_CHECKPOINT
    size = args.size or (64 if args.quick else 512)
    steps = args.steps or (6 if args.quick else 20)
    shape = StepCacheSettings() if args.depth is None else StepCacheSettings(depth=args.depth)
    components = load_components(checkpoint)
    results: dict[str, Any] = {"checkpoint": str(checkpoint), "family": components.family, "size": size,
                               "steps": steps, "precision": args.precision, "depth": shape.depth,
                               "full_start": shape.full_start, "full_end": shape.full_end, "images": []}

    def job(sampler: str, count: int) -> GenerationJob:
        return GenerationJob(prompt="a lighthouse on a cliff at sunset", negative_prompt="blurry", steps=count,
                             sampler=sampler, width=size, height=size, seed=args.seed).validated()

    def image(generator: Generator, sampler: str, count: int = steps) -> tuple[np.ndarray, float]:
        start = time.perf_counter()
        (made,) = generator.run_batch(job(sampler, count), 0)
        return np.asarray(made.image.convert("RGB")), time.perf_counter() - start

    base = {"device": "CPU", "precision": args.precision, "cache_dir": str(cache_dir)}
    plain: dict[str, np.ndarray] = {}
    accelerator = Accelerator(components, build_sd_settings(base)).apply()
    generator = Generator(components)
    image(generator, args.samplers[0], 1)  # compiles
    for sampler in args.samplers:
        pixels, seconds = image(generator, sampler)
        plain[sampler] = pixels
        results["images"].append({"sampler": sampler, "interval": 1, "seconds": seconds, "psnr": None,
                                  "full_calls": steps, "shallow_calls": 0})
        logger.info("%s uncached: %.1f s", sampler, seconds)
    accelerator.restore()

    cached = build_sd_settings({**base, "step_cache": dataclasses.replace(shape, interval=max(args.intervals))})
    accelerator = Accelerator(components, cached).apply()
    state = accelerator.step_cache
    generator = Generator(components, step_cache=state)
    image(generator, args.samplers[0], 4)  # compiles the full and the shallow call (4 steps: F F s F)
    for sampler in args.samplers:
        for interval in args.intervals:
            state.settings = dataclasses.replace(shape, interval=interval)
            state.audit, state.errors = args.audit, []
            state.full_calls = state.shallow_calls = 0
            state.seconds = {"full": 0.0, "shallow": 0.0}
            pixels, seconds = image(generator, sampler)
            seconds -= state.seconds.get("audit", 0.0)
            results["images"].append({
                "sampler": sampler, "interval": interval, "seconds": seconds, "psnr": _psnr(plain[sampler], pixels),
                "full_calls": state.full_calls, "shallow_calls": state.shallow_calls,
                "full_seconds": state.seconds["full"], "shallow_seconds": state.seconds["shallow"],
                "schedule": state.settings.schedule(steps), "errors": state.errors})
            logger.info("%s every %d: %.1f s", sampler, interval, seconds)
    accelerator.restore()
    results["peak_rss_gib"] = _peak_rss_gib()
    return results


def markdown(results: dict[str, Any]) -> str:
    """The results as markdown: one table of images, one of the per-step errors."""
    lines = [f"# Step caching: {results['family']} at {results['size']}x{results['size']}, {results['steps']} steps, "
             f"{results['precision']}", "",
             f"Command: `{results['command']}`  ", report.machine_line(results["machine"], results["cpu"]) + "  ",
             f"Depth {results['depth']}; full steps kept: first {results['full_start']}, last {results['full_end']}. "
             f"Checkpoint: `{results['checkpoint']}` (random weights: see `docs/step-cache.md`). Peak RSS "
             f"{results['peak_rss_gib']:.2f} GiB.", ""]
    if results.get("note"):
        lines += [results["note"], ""]
    lines += ["| sampler | interval | schedule | s/image | vs uncached | s/step | full calls (s each) | "
              "cached calls (s each) | PSNR vs uncached dB |", "|---|---|---|---|---|---|---|---|---|"]
    plain = {r["sampler"]: r["seconds"] for r in results["images"] if r["interval"] == 1}
    for r in results["images"]:
        full = f"{r['full_calls']}" + (f" ({r['full_seconds'] / r['full_calls']:.2f})" if r.get("full_seconds") else "")
        shallow = f"{r['shallow_calls']}" + (
            f" ({r['shallow_seconds'] / r['shallow_calls']:.2f})" if r["shallow_calls"] else "")
        psnr = "—" if r["psnr"] is None else f"{r['psnr']:.1f}"
        lines.append(f"| {r['sampler']} | {r['interval']} | `{r.get('schedule', 'F' * results['steps'])}` | "
                     f"{r['seconds']:.1f} | {plain[r['sampler']] / r['seconds']:.2f}x | "
                     f"{r['seconds'] / results['steps']:.2f} | {full} | {shallow} | {psnr} |")
    audited = [r for r in results["images"] if r.get("errors")]
    if audited:
        lines += ["", "Relative L2 error of each cached step's UNet output against the full UNet on the same "
                  "inputs (step: error):", ""]
        for r in audited:
            errors = ", ".join(f"{step}: {error:.3f}" for step, error in r["errors"])
            lines.append(f"- {r['sampler']}, every {r['interval']}: max {max(e for _s, e in r['errors']):.3f}; "
                         f"{errors}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(argv)
    if any(n < 2 for n in args.intervals):
        _parser().error("--intervals: each interval must be 2 or more (1, uncached, always runs)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="bench-step-cache-") as temp:
        results = run(args, args.cache_dir or Path(temp))
    import openvino as ov

    results.update(command="python -m bench step-cache " + shlex.join(argv), machine=report.machine(),
                   cpu=str(ov.Core().get_property("CPU", "FULL_DEVICE_NAME")),
                   note=args.note, started=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")
    text = markdown(results)
    (args.out / f"{args.name}.md").write_text(text, encoding="utf-8")
    sys.stdout.write(text + f"\nWrote {args.out / args.name}.json and .md\n")
    return 0
