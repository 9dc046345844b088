"""``python -m bench soak``: hours of batch requests against the real WebUI of the test bed, bounded.

One run starts the real AUTOMATIC1111 WebUI v1.10.1 of the test bed in an isolated data folder with the
extension installed (as ``bench webui`` does, :mod:`bench.webui_host`), then sends the seeded stream of
:mod:`bench.soak_plan` over the HTTP API: txt2img and img2img at sizes repeated and new, batch size 1-4 and batch
count above 1, Prompts from file and X/Y/Z through the always-on section, the LoRA on, off and at another weight,
the second checkpoint and back, an Interrupt inside a batch count (also run against stock), two clients at once.
After each request it reads the WebUI's resident memory (its process tree), the status route (compiled models
held, compiles, conversions, OpenVINO and PyTorch calls, the disk cache's size and limit when the extension
reports them) and the cache folder on disk; a sample of requests is run again with the extension off, same
request and seed, for the PSNR against stock. :mod:`bench.soak_bounds` decides the bounds and
:mod:`bench.soak_report` writes JSON, markdown and the RSS curve (PNG).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from bench import soak_bounds, soak_report
from bench.soak_plan import MODELS, PRECISIONS, Request, SoakSettings, build_settings, requests
from bench.webui import available_gib, extension_commit, prepare, script_args
from bench.webui_host import BenchWebUI
from bench.webui_rows import PROMPTS_SCRIPT, SECTION_TITLE, WebUIBenchSettings, parse_size
from tests.real_webui.webui import SCRIPT_NAME, encode_image, psnr

logger = logging.getLogger(__name__)

XYZ_SCRIPT = "x/y/z plot"
KEEP_SIZES_OPTION = "openvino_keep_all_sizes"
PREVIOUS_WEIGHTS_OPTION = "openvino_previous_weights"
#: Status route fields copied into each accelerated request's record
STATUS_FIELDS = ("compiles", "cache_hits", "captures_made", "convert_seconds", "compile_seconds", "ov_calls",
                 "eager_calls", "released", "kept_previous", "generations")


def init_image(width: int, height: int, seed: int) -> str:
    """A seeded picture for img2img (smooth colour fields and noise), as base64 PNG."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    base = np.stack([np.sin(x * rng.uniform(2, 8)), np.cos(y * rng.uniform(2, 8)), np.sin((x + y) * 3)], -1)
    pixels = np.clip((base * 0.5 + 0.5) * 200 + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    return encode_image(Image.fromarray(pixels))


class Soak:
    """Sends the stream to one WebUI and records each request."""

    def __init__(self, config: SoakSettings, ui: BenchWebUI, checkpoints: tuple[str, str], lora: str,
                 progress: Callable[[dict[str, Any]], None]) -> None:
        self.config, self.ui, self.checkpoints, self.lora = config, ui, checkpoints, lora
        self.progress = progress
        self.current = 0
        self.results: dict[str, Any] = {"records": [], "options": {}}
        self._xyz_steps: int | None = None
        self._unique = 0
        self._stock_interrupt_done = False

    # --- payloads ------------------------------------------------------------------------------------------
    def _key(self) -> int:
        """A new conditioning-cache key per call: A1111 reuses the last prompt's conditioning, which would skip
        the text encoder of a stock run right after the same accelerated request (``sdxl_crop_top`` is part of
        that key and unused by SD 1.x)."""
        self._unique += 1
        return self._unique

    def payload(self, req: Request, accelerated: bool) -> dict[str, Any]:
        prompt = req.prompt + (f" <lora:{self.lora}:{req.lora:g}>" if req.lora is not None and self.lora else "")
        payload: dict[str, Any] = {
            "prompt": prompt, "negative_prompt": "blurry, low quality", "seed": req.seed, "steps": req.steps,
            "width": req.width, "height": req.height, "sampler_name": "Euler", "cfg_scale": 6,
            "batch_size": req.batch_size, "n_iter": req.n_iter, "save_images": False, "send_images": True,
            "override_settings": {"sdxl_crop_top": self._key()}}
        if req.kind == "img2img":
            payload.update(init_images=[init_image(req.width, req.height, req.seed)], denoising_strength=0.6)
        if req.kind == "prompts":
            lines = "\n".join(f"{prompt}, variation {i}" for i in range(req.lines))
            payload.update(script_name=PROMPTS_SCRIPT, script_args=[False, False, "start", lines])
        elif req.kind == "xyz":
            values = ",".join(str(req.steps + i) for i in range(req.cells))
            payload.update(script_name=XYZ_SCRIPT, script_args=[self.xyz_steps_axis(), values, [], 0, "", [], 0, "",
                                                                 [], True, True, False, False, False, False, False,
                                                                 0, False])
        if accelerated:
            args = script_args(self.config.precision)
            if req.route == "section" or req.kind in ("prompts", "xyz"):
                payload["alwayson_scripts"] = {SECTION_TITLE: {"args": [True, *args]}}
            else:
                payload.update(script_name=SCRIPT_NAME, script_args=args)
        return payload

    def xyz_steps_axis(self) -> int:
        """The index of X/Y/Z's "Steps" axis (read once from the WebUI's script-info)."""
        if self._xyz_steps is None:
            info = next(s for s in self.ui.get("/sdapi/v1/script-info") if s["name"] == XYZ_SCRIPT and
                        not s["is_img2img"])
            arg = next(a for a in info["args"] if a["label"] == "X type")
            self._xyz_steps = arg["choices"].index("Steps")
        return self._xyz_steps

    @staticmethod
    def endpoint(req: Request) -> str:
        return "img2img" if req.kind == "img2img" else "txt2img"

    # --- one request -----------------------------------------------------------------------------------------
    def switch(self, index: int) -> float | None:
        if index == self.current:
            return None
        seconds = self.ui.switch_checkpoint(self.checkpoints[index])
        self.current = index
        return seconds

    def run_request(self, req: Request) -> dict[str, Any]:
        record: dict[str, Any] = {
            "index": req.index, "kind": req.kind, "size": req.size, "batch_size": req.batch_size,
            "n_iter": req.n_iter, "lora": req.lora, "checkpoint": req.checkpoint, "route": req.route,
            "warmup": req.warmup, "new_size": req.new_size, "expected_images": req.expected_images}
        if req.partner is not None:
            record["partner"] = {"size": req.partner.size, "batch_size": req.partner.batch_size,
                                 "route": req.partner.route}
        t0 = time.time()
        try:
            record["load_seconds"] = self.switch(req.checkpoint)
            if req.kind == "interrupt":
                self.run_interrupt(req, record)
            elif req.kind == "pair":
                self.run_pair(req, record)
            else:
                result = self.ui.generate(self.payload(req, not self.config.stock), self.endpoint(req))
                record["images"] = len(result.images)
                if req.sample and not self.config.stock:
                    record["psnr"] = self.against_stock(req, result.images)
        except (AssertionError, OSError, RuntimeError, ValueError, KeyError) as err:
            record["error"] = str(err)[:2000]
            logger.warning("request %d (%s) failed: %s", req.index, req.kind, str(err)[:300])
        record["seconds"] = time.time() - t0
        self.measure(record)
        if self.ui.process is None or self.ui.process.poll() is not None:
            record["error"] = record.get("error", "") + f"\nthe WebUI exited:\n{self.ui.log_tail(30)}"
        return record

    def measure(self, record: dict[str, Any]) -> None:
        """Memory, the status route and the disk cache after a request."""
        record.update(self.ui.tree_memory())
        try:
            status = self.ui.get("/openvino-accelerate/v1/status")
        except (AssertionError, OSError) as err:
            record.setdefault("error", f"status route: {err}")
            return
        record["compiled_models"] = status.get("compiled_models")
        record.update({k: status.get(k) for k in STATUS_FIELDS})
        on_disk, files = self.ui.cache_size()
        record["cache_disk_bytes"], record["cache_files"] = on_disk, files
        # the extension's own reading and limit, where it reports them; else the folder's size on disk
        record["cache_bytes"] = status.get("cache_bytes", on_disk)
        record["cache_limit_bytes"] = status.get("cache_limit_bytes")

    def against_stock(self, req: Request, images: list[np.ndarray]) -> float | None:
        """The lowest PSNR of the request's pictures against stock's for the same request and seed.

        img2img draws the init image's latent with torch's global generator before seeding it, so its picture
        depends on the request before: stock runs right after the accelerated request, and the accelerated one
        runs again right after stock, so both follow the same request."""
        stock = self.ui.generate(self.payload(req, False), self.endpoint(req)).images
        if req.kind == "img2img":
            images = self.ui.generate(self.payload(req, True), self.endpoint(req)).images
        if len(stock) != len(images) or not images:
            raise RuntimeError(f"stock returned {len(stock)} images, the extension {len(images)}")
        return min(psnr(a, b) for a, b in zip(images, stock))

    def run_interrupt(self, req: Request, record: dict[str, Any]) -> None:
        images, jobs = self.interrupted(self.payload(req, not self.config.stock), self.endpoint(req))
        info: dict[str, Any] = {"images": images, "jobs": jobs, "expected": self.begun(req, jobs)}
        if not self._stock_interrupt_done and not self.config.stock:  # what stock returns for the same Interrupt
            self._stock_interrupt_done = True
            stock_images, stock_jobs = self.interrupted(self.payload(req, False), self.endpoint(req))
            info.update(stock_images=stock_images, stock_jobs=stock_jobs, stock_expected=self.begun(req, stock_jobs))
        record["interrupt"] = info
        record["images"] = images

    @staticmethod
    def begun(req: Request, jobs: tuple[int, int]) -> list[int]:
        """The image counts an Interrupt sent between A1111's progress readings ``jobs`` (its batch, 0-based, before
        and after) may return: the batches done and the one it stopped, ``batch_size * (job + 1)``. After the
        Interrupt A1111 still moves its batch number on (``state.nextjob``) before it stops, and a batch may end
        between the reading and the Interrupt: hence a range, never the whole batch count unless it ended first."""
        return [req.batch_size * (job + 1) for job in range(jobs[0], jobs[1] + 1)]

    def interrupted(self, payload: dict[str, Any], kind: str) -> tuple[int, tuple[int, int]]:
        """Send ``payload``, interrupt it once its second batch has sampled a step; (images returned, A1111's batch
        number (0-based) read just before and just after the Interrupt)."""
        out: dict[str, Any] = {}
        thread = threading.Thread(target=self._send, args=(payload, kind, out), daemon=True)
        thread.start()
        t0, jobs = time.time(), (-1, -1)
        while thread.is_alive() and time.time() - t0 < 600:
            state = self.ui.get("/sdapi/v1/progress?skip_current_image=true")["state"]
            if state.get("job_count", 0) > 0 and state.get("job_no", 0) >= 1 and state.get("sampling_step", 0) >= 1:
                self.ui.call("/sdapi/v1/interrupt", {})
                after = self.ui.get("/sdapi/v1/progress?skip_current_image=true")["state"].get("job_no", 0)
                jobs = (int(state["job_no"]), max(int(state["job_no"]), int(after)))
                break
            time.sleep(0.05)
        thread.join(1800)
        if "error" in out:
            raise RuntimeError(f"interrupted request: {out['error']}")
        if jobs[0] < 0:
            raise RuntimeError("the request ended before its second batch began: nothing was interrupted")
        return len(out["result"].images), jobs

    def _send(self, payload: dict[str, Any], kind: str, out: dict[str, Any]) -> None:
        try:
            out["result"] = self.ui.generate(payload, kind)
        except (AssertionError, OSError, RuntimeError, ValueError, KeyError) as err:
            out["error"] = str(err)[:2000]

    def run_pair(self, req: Request, record: dict[str, Any]) -> None:
        """Two clients at once (A1111 queues them): both must get all their images."""
        assert req.partner is not None
        outs: list[dict[str, Any]] = [{}, {}]
        on = not self.config.stock
        threads = [threading.Thread(target=self._send, args=(self.payload(r, on), self.endpoint(r), out), daemon=True)
                   for r, out in zip((req, req.partner), outs)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(1800)
        errors = [out["error"] for out in outs if "error" in out]
        if errors:
            raise RuntimeError("; ".join(errors))
        record["images"] = sum(len(out["result"].images) for out in outs)

    # --- the run ---------------------------------------------------------------------------------------------
    def stream(self) -> Iterator[Request]:
        t0 = time.time()
        for number, req in enumerate(requests(self.config), start=1):
            if self.config.requests and number > self.config.requests:
                return
            if self.config.minutes and time.time() - t0 > self.config.minutes * 60:
                return
            yield req

    def run(self, stock: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The stream against a started WebUI; ``stock``: the records of the stock baseline, for the bounds."""
        self.ui.start()
        self.results["start_seconds"] = self.ui.start_seconds
        self.results["after_start"] = self.ui.tree_memory()
        if self.config.previous_weights:
            self.ui.call("/sdapi/v1/options", {PREVIOUS_WEIGHTS_OPTION: self.config.previous_weights})
        options = self.ui.get("/sdapi/v1/options")
        self.results["options"] = {KEEP_SIZES_OPTION: bool(options.get(KEEP_SIZES_OPTION, False)),
                                   PREVIOUS_WEIGHTS_OPTION: options.get(PREVIOUS_WEIGHTS_OPTION, "auto")}
        t0 = time.time()
        for req in self.stream():
            record = self.run_request(req)
            record["elapsed_seconds"] = time.time() - t0
            logger.info("%3d %-9s %-8s %s", req.index, req.kind, req.size,
                        {k: record.get(k) for k in ("seconds", "images", "expected_images", "rss_gib",
                                                    "compiled_models", "psnr", "error")})
            self.results["records"].append(record)
            self.progress(self.results)
            if self.ui.process is None or self.ui.process.poll() is not None:
                break
        if self.ui.process is not None and self.ui.process.poll() is None:
            self.switch(0)  # (a WebUI started again on this data folder starts where this run did)
        self.results["bounds"] = [b.as_dict() for b in self.bounds(stock)]
        return self.results

    def bounds(self, stock: list[dict[str, Any]] | None) -> list[soak_bounds.Bound]:
        options = self.results["options"]
        return soak_bounds.evaluate(self.results["records"], keep_all_sizes=bool(options.get(KEEP_SIZES_OPTION)),
                                    previous_weights=str(options.get(PREVIOUS_WEIGHTS_OPTION) or "auto"),
                                    precision=self.config.precision, stock=stock)


def prepare_soak(config: SoakSettings, work: Path) -> tuple[BenchWebUI, tuple[str, str], str]:
    """The isolated WebUI (as ``bench webui`` makes it): models, LoRA, the extension installed."""
    bench = WebUIBenchSettings(tiny=config.model == "tiny", testbed=config.testbed)
    return prepare(bench, work)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, help="sd15 (default: the test bed's full-size checkpoints) or tiny")
    p.add_argument("--requests", type=int, help="stop after this many requests (default 40 without --minutes)")
    p.add_argument("--minutes", type=float, help="start no request after this many minutes")
    p.add_argument("--seed", type=int, help="seed of the stream of requests (default 1)")
    p.add_argument("--sizes", nargs="+", type=parse_size, metavar="WxH",
                   help="the size pool (default 512x512 512x384 384x512; tiny 64x64 96x64 64x96)")
    p.add_argument("--new-size-every", type=int, help="after the warm-up, a size never seen every N requests "
                                                      "(default 8; 0: never)")
    p.add_argument("--size-step", type=int, help="a new size differs from a pool size by multiples of this many "
                                                 "pixels (default 64; 8: any size)")
    p.add_argument("--steps", type=int, help="sampling steps per request (default 4)")
    p.add_argument("--precision", choices=PRECISIONS, help="the extension's precision (default f32: the pictures "
                                                           "must match stock's at 40 dB)")
    p.add_argument("--sample-every", type=int, help="compare every Nth request with stock (default 4)")
    p.add_argument("--stock", action="store_true", help="the extension off for every request: stock A1111's own "
                                                        "curve for the same stream")
    p.add_argument("--stock-baseline", action="store_true",
                   help="first the same stream with the extension off (a WebUI process of its own): stock's RSS curve "
                        "beside the run's, and the bound on the extension's growth beyond stock's")
    p.add_argument("--previous-weights", choices=("auto", "keep", "release"),
                   help="Settings -> OpenVINO's choice for the previous weights' models (default: the WebUI's)")
    p.add_argument("--testbed", type=Path, help="the test bed (default $A1111_ROOT or build/a1111-testbed)")
    p.add_argument("--out", type=Path, help="folder of the results (default bench/results)")
    p.add_argument("--name", help="file name stem (default soak-<model>-<date>)")
    p.add_argument("--work-dir", type=Path, help="keep the WebUI's data folder and logs here (default: temporary)")
    p.add_argument("--min-available-gib", type=float, help="refuse to start with less (default 10; tiny 0)")
    p.add_argument("--note", help="a sentence printed above the tables")
    p.add_argument("-v", "--verbose", action="store_true", help="log each request")
    return p


def run_soak(config: SoakSettings, command: str, note: str | None = None) -> dict[str, Any]:
    """Run the soak and write its results; returns them (``bounds`` among them)."""
    stem = config.name or f"soak-{config.model}-" + time.strftime("%Y-%m-%d")
    header = soak_report.header(config, command, note)
    work = Path(config.work_dir) if config.work_dir else Path(tempfile.mkdtemp(prefix="bench-soak-"))

    def write(results: dict[str, Any]) -> None:
        soak_report.write({**header, **results}, Path(config.out), stem, picture=False)

    ui = None
    try:
        ui, checkpoints, lora = prepare_soak(config, work)
        header["extension_commit"] = extension_commit(ui)
        stock = None
        if config.stock_baseline:  # the same stream, extension off, in a WebUI process of its own
            baseline = Soak(dataclasses.replace(config, stock=True), ui, checkpoints, lora, lambda r: None).run()
            stock = baseline["records"]
            header["stock_baseline"] = {"records": stock, "after_start": baseline["after_start"]}
            ui.stop()
        results = Soak(config, ui, checkpoints, lora, write).run(stock)
    finally:
        if ui is not None:
            ui.stop()
        if config.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    results = {**header, **results}
    results["paths"] = [str(p) for p in soak_report.write(results, Path(config.out), stem)]
    return results


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = {"model": args.model, "requests": args.requests, "minutes": args.minutes, "seed": args.seed,
               "sizes": tuple(args.sizes) if args.sizes else None, "new_size_every": args.new_size_every,
               "size_step": args.size_step,
               "steps": args.steps, "precision": args.precision, "sample_every": args.sample_every,
               "previous_weights": args.previous_weights, "stock": args.stock or None,
               "stock_baseline": args.stock_baseline or None, "testbed": args.testbed,
               "out": args.out,
               "name": args.name, "work_dir": args.work_dir, "min_available_gib": args.min_available_gib}
    try:
        config = build_settings(options)
    except ValueError as err:
        _parser().error(str(err))
    if available_gib() < config.min_available_gib:
        _parser().error(f"{available_gib():.1f} GiB available, {config.min_available_gib:g} needed "
                        "(--min-available-gib lowers it)")
    results = run_soak(config, "python -m bench soak " + shlex.join(argv), args.note)
    sys.stdout.write(soak_report.markdown(results) + "\nWrote " + ", ".join(results["paths"]) + "\n")
    return 0 if not soak_bounds.failed([soak_bounds.Bound(**b) for b in results["bounds"]]) else 1
