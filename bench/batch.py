"""``python -m bench batch``: one seeded job of images by each way of running it: images a minute and memory.

Modes (``--modes``; each runs alone, one after the other, the job the same):

- ``cli``: ``python -m ov_backend batch`` in one process;
- ``workers2``: the same with ``--workers 2``;
- ``ray2``: a local Ray cluster started for the mode (``ray start --head``, every core), two workers of half the
  cores each (``--ray-cpus-per-worker``);
- ``stock_api``: the test bed's A1111 v1.10.1, stock, one ``/sdapi/v1/txt2img`` request a line, as its users
  script it;
- ``section_api``: the same WebUI with this extension's OpenVINO section enabled in each request.

Each mode is timed from its start (the WebUI's start and checkpoint load included, a command's model load and
compiles included) to its last image: images a minute over the whole job, and after its first image (the
steady rate a long job tends to). Memory: the machine's memory in use (MemTotal - MemAvailable) above its
level before the mode, sampled four times a second: every process of the mode, Ray's daemons and workers
included. Pictures: each mode's against the ``cli`` mode's (PSNR; stock's tells how far the command line's
pictures are from A1111's own on this model). ``--tiny`` runs the command-line modes on the demo model (the
CI smoke test).
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
MODES = ("cli", "workers2", "ray2", "stock_api", "section_api")
WEBUI_MODES = ("stock_api", "section_api")
#: with the WebUI's weights in some (its mean restoration sums over the whole conditioning: a thread count
#: that changed that sum would show here)
PROMPTS = ("a lighthouse on a cliff at (dusk:1.3)", "a red fox in fresh snow", "a bowl of ramen, [studio light]",
           "an old tram in a ((rainy)) street", "a cottage garden in summer", "a sailing boat on a calm lake",
           "a portrait of an astronaut, (oil painting:0.8)", "a mountain village at night")
FULL_CHECKPOINT = "sd15-random.safetensors"


class MemoryWatch:
    """The machine's memory in use above its level at the start, at its highest, sampled on a thread."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.base = self._used()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _used() -> int:
        fields = {}
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                name, value = line.split(":", 1)
                fields[name] = int(value.split()[0]) * 1024
        return fields["MemTotal"] - fields["MemAvailable"]

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._used() - self.base)

    def stop(self) -> float:
        """The highest memory in use above the start, GiB."""
        self._stop.set()
        self._thread.join()
        return round(self.peak / (1 << 30), 2)


def job_lines(images: int, size: int, steps: int, precision: str) -> list[dict[str, Any]]:
    return [{"prompt": PROMPTS[i % len(PROMPTS)], "seed": 1000 + i, "width": size, "height": size, "steps": steps,
             "sampler": "Euler a", "cfg_scale": 7, "precision": precision} for i in range(images)]


def run_cli(mode: str, lines: list[dict[str, Any]], checkpoint: Path, work: Path, cache: Path) -> dict[str, Any]:
    """One command-line mode: its seconds, when each image came, and the folder of its images."""
    jobs = work / "job.jsonl"
    jobs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = work / f"out-{mode}"
    args = [sys.executable, "-m", "ov_backend", "batch", str(jobs), "--checkpoint", str(checkpoint),
            "--cache-dir", str(cache), "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    cores = len(os.sched_getaffinity(0))
    ray_temp = None
    if mode == "workers2":
        args += ["--workers", "2"]
    if mode == "ray2":
        ray_temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
        subprocess.run([str(Path(sys.executable).with_name("ray")), "start", "--head", f"--num-cpus={cores}",
                        "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={ray_temp}"],
                       env=env, check=True, capture_output=True, timeout=600)
        args += ["--ray", "auto", "--ray-cpus-per-worker", str(max(1, cores // 2))]
    watch = MemoryWatch()
    began = time.perf_counter()
    came: list[float] = []
    try:
        proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        for row in proc.stdout:
            logger.info("%s: %s", mode, row.rstrip())
            if row.startswith("["):
                came.append(time.perf_counter() - began)
        stderr = proc.stderr.read() if proc.stderr else ""
        proc.wait()
    finally:
        peak = watch.stop()
        if ray_temp is not None:
            subprocess.run([str(Path(sys.executable).with_name("ray")), "stop", "--force"], env=env,
                           capture_output=True, timeout=600)
            shutil.rmtree(ray_temp, ignore_errors=True)
    if proc.returncode != 0:
        return {"mode": mode, "error": f"exit code {proc.returncode}: {stderr[-2000:]}"}
    images = sorted(str(p) for p in out.glob("*.png"))
    return {"mode": mode, "seconds": round(time.perf_counter() - began, 1), "came": came, "memory_gib": peak,
            "images": images, "sha256": files_digest(images)}


def files_digest(paths: Sequence[str]) -> str:
    """One SHA-256 over the files' bytes, in order (the PNGs, their infotext included): two runs that made the same
    files, by another commit say, give the same digest."""
    import hashlib

    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


def run_webui(mode: str, lines: list[dict[str, Any]], testbed: Path, work: Path) -> dict[str, Any]:
    """One WebUI mode: the WebUI started on the full-size checkpoint, one API request a line."""
    from bench.webui_host import BenchWebUI

    ui = BenchWebUI(testbed, work / "data", work / "logs", FULL_CHECKPOINT)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    ui.prepare([], tiny_models=False)
    ui.link_checkpoints([testbed / "webui" / "models" / "Stable-diffusion" / FULL_CHECKPOINT])
    out = work / f"out-{mode}"
    out.mkdir(parents=True, exist_ok=True)
    watch = MemoryWatch()
    began = time.perf_counter()
    came: list[float] = []
    try:
        ui.start()
        for i, line in enumerate(lines):
            payload = {"prompt": line["prompt"], "seed": line["seed"], "steps": line["steps"],
                       "width": line["width"], "height": line["height"], "sampler_name": "Euler a",
                       "cfg_scale": line["cfg_scale"], "batch_size": 1, "n_iter": 1}
            if mode == "section_api":
                payload["alwayson_scripts"] = {"OpenVINO": {"args": [{"enabled": True,
                                                                      "precision": line["precision"]}]}}
            response = ui.call("/sdapi/v1/txt2img", payload)
            came.append(time.perf_counter() - began)
            (out / f"{i:05d}.png").write_bytes(base64.b64decode(response["images"][0]))
        peak_rss = ui.memory()["peak"]
    finally:
        memory = watch.stop()
        ui.stop()
    return {"mode": mode, "seconds": round(time.perf_counter() - began, 1), "came": came, "memory_gib": memory,
            "webui_peak_rss_gib": round(peak_rss, 2), "images": sorted(str(p) for p in out.glob("*.png"))}


def _pixels(path: str) -> Any:
    import numpy as np
    from PIL import Image

    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"), dtype=np.float64)


def psnr(a: str, b: str) -> float:
    """The PSNR of two PNG files, each read once (inf when their pixels are identical)."""
    from tests.real_webui.webui import psnr as of_pixels

    return of_pixels(_pixels(a), _pixels(b))


#: Images a mode renders at once (its steady rate is counted after its first round of them).
PARALLEL = {"workers2": 2, "ray2": 2}


def summarize(result: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any]:
    came = [round(t, 1) for t in result.pop("came")]
    images, at_once = len(came), PARALLEL.get(result["mode"], 1)
    row = {**result, "count": images, "came": came, "at_once": at_once,
           "per_minute": round(images * 60 / result["seconds"], 2) if result["seconds"] else None,
           "first_image_seconds": came[0] if came else None,
           # after the first round (the first image of each worker: loads and compiles), until the last
           "per_minute_after_first": round((images - at_once) * 60 / (came[-1] - came[at_once - 1]), 2)
           if images > at_once and came[-1] > came[at_once - 1] else None}
    if reference is not None and result["mode"] != "cli" and "images" in reference:
        lowest = min((psnr(a, b) for a, b in zip(result["images"], reference["images"])), default=None)
        # (JSON has no infinity: identical pictures keep the report's 99.0 and say so)
        row["psnr_vs_cli"] = None if lowest is None else 99.0 if math.isinf(lowest) else round(lowest, 1)
        row["identical_to_cli"] = lowest is not None and math.isinf(lowest)
    return row


def markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    cpu = results["cpu"]
    lines = [f"# Batch job: images a minute and memory, by mode ({results['started'][:10]})", "",
             f"- Command: `{results['command']}`",
             f"- CPU: {results['machine'].get('Model name', '?')}, {results['machine'].get('cpus')} logical CPUs; "
             f"AVX-512 {'yes' if cpu.get('AVX-512') else 'no'}, AMX {'yes' if cpu.get('AMX') else 'no'}, "
             f"BF16 {' '.join(cpu['BF16']) if cpu.get('BF16') else 'no'}; memory "
             f"{results['machine'].get('memory_gib')} GiB, {results['available_gib_at_start']} available",
             f"- Job: {s['images']} images of {s['size']}x{s['size']}, {s['steps']} steps Euler a, CFG 7, seeds "
             f"1000..., precision {s['precision']}, model {s['model']}; the command-line modes share one disk "
             "cache, cold for the first of them; the WebUI modes start with a cold one of their own",
             "", "| mode | seconds | images/min (whole job) | first image (s) | images/min after the first round | "
             "memory in use, peak (GiB) | PSNR vs cli (dB, lowest) | PNG files' SHA-256 |",
             "|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        if "error" in row:
            lines.append(f"| {row['mode']} | error: {row['error'][:200]} | | | | | | |")
            continue
        lines.append(f"| {row['mode']} | {row['seconds']} | {row['per_minute']} | {row['first_image_seconds']} | "
                     f"{row['per_minute_after_first']} | {row['memory_gib']}"
                     + (f" (WebUI VmHWM {row['webui_peak_rss_gib']})" if "webui_peak_rss_gib" in row else "")
                     + f" | {'identical pixels' if row.get('identical_to_cli') else row.get('psnr_vs_cli', '-')} | "
                     f"{row.get('sha256', '-')} |")
    if results.get("note"):
        lines += ["", f"Note: {results['note']}"]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench batch", description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="the demo model, command-line modes only (CI smoke test)")
    p.add_argument("--modes", nargs="+", choices=MODES, help=f"default: {' '.join(MODES)} (tiny: cli workers2)")
    p.add_argument("--images", type=int, default=4, help="images in the job, one a line (default 4)")
    p.add_argument("--steps", type=int, help="sampling steps (default 8; tiny 2)")
    p.add_argument("--size", type=int, help="width and height (default 512; tiny 64)")
    p.add_argument("--precision", default="auto", help="the job's precision (default auto)")
    p.add_argument("--testbed", type=Path, help="the test bed (default $A1111_ROOT or build/a1111-testbed)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="folder of the results")
    p.add_argument("--name", help="file name stem (default batch-<date>, or batch-tiny-<date>)")
    p.add_argument("--note", help="a sentence printed under the table (e.g. what else ran on the machine)")
    p.add_argument("-v", "--verbose", action="store_true", help="log each line of each mode")
    return p


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from bench.webui_report import run_header

    modes = tuple(args.modes or (("cli", "workers2") if args.tiny else MODES))
    if args.tiny and set(modes) & set(WEBUI_MODES):
        _parser().error("--tiny runs the command-line modes only (the WebUI's tiny models have their own configs)")
    if "cli" not in modes:
        modes = ("cli", *modes)  # the pictures' reference
    testbed = args.testbed or Path(os.environ.get("A1111_ROOT", ROOT / "build" / "a1111-testbed"))
    steps, size = args.steps or (2 if args.tiny else 8), args.size or (64 if args.tiny else 512)
    if args.tiny:
        from ov_accelerate_sd.demo_checkpoint import demo_checkpoint

        checkpoint, model = demo_checkpoint(), "the demo model (tiny, random weights)"
    else:
        checkpoint = testbed / "webui" / "models" / "Stable-diffusion" / FULL_CHECKPOINT
        model = f"full-size SD 1.5, random weights ({FULL_CHECKPOINT}, the test bed's)"
        if not checkpoint.is_file():
            _parser().error(f"{checkpoint} is missing: build the test bed (.ci/testbed) first")
    lines = job_lines(args.images, size, steps, args.precision)
    header = run_header("python -m bench batch " + shlex.join(argv), args.note)
    header["settings"] = {"images": args.images, "size": size, "steps": steps, "precision": args.precision,
                          "model": model, "modes": list(modes)}
    work = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    rows: list[dict[str, Any]] = []
    try:
        cache = work / "cache"
        reference = None
        for mode in modes:
            folder = work / mode
            folder.mkdir()
            logger.warning("mode %s", mode)
            result = run_webui(mode, lines, testbed, folder) if mode in WEBUI_MODES else \
                run_cli(mode, lines, checkpoint, folder, cache)
            if "error" not in result:
                if mode == "cli":
                    reference = dict(result)
                rows.append(summarize(result, reference))
            else:
                rows.append(result)
        for row in rows:
            row.pop("images", None)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = {**header, "rows": rows}
    stem = args.name or ("batch-tiny-" if args.tiny else "batch-") + time.strftime("%Y-%m-%d")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    text = markdown(results)
    (args.out / f"{stem}.md").write_text(text)
    sys.stdout.write(text + f"\nWrote {args.out / stem}.json and .md\n")
    return 0 if not any("error" in r for r in rows) else 1

