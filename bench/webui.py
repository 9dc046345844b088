"""``python -m bench webui``: stock A1111 against the extension, in the real WebUI of the test bed.

One run starts the real AUTOMATIC1111 WebUI v1.10.1 of the test bed (``A1111_ROOT``) in an isolated data
folder with the extension cloned into ``extensions/``, on the full-size SD 1.5 random-weight checkpoints
the test bed made (``--tiny``: the real-host tier's tiny models, the CI smoke test), and runs the
scenario of :data:`ROWS` first stock, then accelerated at each precision, in the same process; then it
restarts the WebUI and times the first accelerated generation with the warm disk cache. Each row notes
the request's seconds, seconds per sampling step from A1111's own progress, what the extension's status
route says about the run (compile and run seconds, compiles, cache hits), and the resident memory of the
WebUI's process. The tables are written by :mod:`bench.webui_report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from bench import webui_report
from bench.webui_host import BenchWebUI, write_kohya_lora
from ov_backend.memory import system_memory
from ov_backend.settings import PREVIOUS_WEIGHTS
from tests.real_webui.webui import (
    CHECKPOINT_A,
    CHECKPOINT_B,
    EXTENSION_NAME,
    SCRIPT_NAME,
    psnr,
    testbed_ready,
    testbed_root,
)

logger = logging.getLogger(__name__)

FULL_CHECKPOINTS = ("sd15-random.safetensors", "sd15-random-b.safetensors")
FULL_LORA = "bench-lora-sd15"
TINY_LORA = "ovtest-lora"  # written by tests/real_webui/make_models.py
PRECISION_KEYS = ("auto", "f32", "int8")


class Row(NamedTuple):
    """One request of the scenario."""

    key: str
    label: str
    size: int
    """Index into the settings' sizes."""
    batch: bool
    """At the settings' batch size (else 1)."""
    checkpoint: int
    """0: the first checkpoint, 1: the second."""
    lora: float | None
    """The LoRA's weight in the prompt; None: no LoRA."""
    long_prompt: bool = False
    """A prompt of two 75-token chunks: A1111 runs the UNet at a batch of 1 for the prompt and for the
    negative prompt apart (their conditionings differ in length)."""
    prompts_job: int = 0
    """A job of this many prompts through A1111's "Prompts from file or textbox" script (one
    ``process_images`` call each), accelerated by the always-on section; 0: a plain request through the
    dropdown entry."""


ROWS: tuple[Row, ...] = (
    Row("first", "first generation", 0, False, 0, None),
    Row("again", "same size again", 0, False, 0, None),
    Row("batch", "batch size {batch}", 0, True, 0, None),
    Row("size2", "second size {size}", 1, False, 0, None),
    Row("size3", "third size {size}", 2, False, 0, None),
    Row("back", "back to {size}", 0, False, 0, None),
    Row("long", "long prompt (UNet at batch 1)", 0, False, 0, None, long_prompt=True),
    Row("switch", "checkpoint switch", 0, False, 1, None),
    Row("switch_back", "switch back", 0, False, 0, None),
    Row("lora", "LoRA added (weight 1)", 0, False, 0, 1.0),
    Row("lora_change", "LoRA weight 1 -> 0.5", 0, False, 0, 0.5),
    Row("prompts_file", "Prompts from file: a job of 4 prompts (section)", 0, False, 0, None, prompts_job=4),
)
#: The always-on section's title (its name in ``alwayson_scripts``).
SECTION_TITLE = "OpenVINO"
PROMPTS_SCRIPT = "prompts from file or textbox"
RESTART = Row("restart", "first generation after a restart (warm cache)", 0, False, 0, None)


@dataclass(frozen=True)
class WebUIBenchSettings:
    """What one run measures (defaults block = the field defaults)."""

    tiny: bool = False
    """The real-host tier's tiny models (minutes) instead of the full-size SD 1.5 checkpoints."""
    precisions: tuple[str, ...] = ("auto",)
    """Accelerated runs, in order: "auto" (what users run), "f32" and/or "int8" (the INT8 UNet: its first
    generation, a checkpoint switch and each LoRA change calibrate and quantize)."""
    steps: int = 4
    """Sampling steps per request (Euler); at least 3 for a seconds-per-step reading."""
    sizes: tuple[tuple[int, int], ...] = ((512, 512), (512, 384), (384, 512))
    """(width, height): the first size, a second and a third."""
    batch: int = 4
    """The batch size of the "batch" row."""
    rows: tuple[str, ...] = ()
    """The requests to measure, by key (e.g. ``("first", "again")``; "restart" for the restart phase), in the
    scenario's order, stock and each precision; empty: all of them."""
    testbed: Path = Path()
    """The test bed's root (``A1111_ROOT``)."""
    out: Path = Path("bench/results")
    """Folder of the JSON and markdown results."""
    name: str = ""
    """File name stem of the results; empty: ``webui-<date>`` (``webui-tiny-<date>`` with ``tiny``)."""
    work_dir: Path | None = None
    """The WebUI's data folder and logs; None: a temporary folder, removed at the end."""
    min_available_gib: float = 18.0
    """Refuse to start with less memory available (the accelerated WebUI reached 14-19 GB)."""
    previous_weights: str = ""
    """The extension's setting for the compiled models of the weights used before a change ("auto", "keep",
    "release"), set before the accelerated requests; empty: the WebUI's (default "auto")."""


TINY_SIZES = ((64, 64), (96, 64), (64, 96))


def build_settings(options: dict[str, Any]) -> WebUIBenchSettings:
    """Validated settings from a dict; unknown keys and bad values raise ``ValueError`` naming them."""
    known = {f.name for f in dataclasses.fields(WebUIBenchSettings)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    values = {k: v for k, v in options.items() if v is not None}
    if values.get("tiny"):
        values.setdefault("sizes", TINY_SIZES)
        values.setdefault("min_available_gib", 0.0)
    # absolute: the WebUI runs in its own folder, where a path relative to here names nothing
    values["testbed"] = Path(values.get("testbed") or testbed_root()).absolute()
    config = WebUIBenchSettings(**values)
    bad = [p for p in config.precisions if p not in PRECISION_KEYS]
    if bad or not config.precisions:
        raise ValueError(f"precisions must be among {', '.join(PRECISION_KEYS)}, got {bad or 'none'}")
    if config.steps < 3:
        raise ValueError(f"steps must be at least 3 (seconds per step are read from steps 3 on), got {config.steps}")
    if len(config.sizes) != 3 or any(w % 8 or h % 8 or w <= 0 or h <= 0 for w, h in config.sizes):
        raise ValueError(f"sizes: three WxH with multiples of 8, got {config.sizes}")
    keys = [row.key for row in (*ROWS, RESTART)]
    unknown_rows = [key for key in config.rows if key not in keys]
    if unknown_rows:
        raise ValueError(f"rows: unknown request(s) {', '.join(unknown_rows)}; known: {', '.join(keys)}")
    if config.previous_weights and config.previous_weights not in PREVIOUS_WEIGHTS:
        raise ValueError(f"previous_weights must be {' or '.join(PREVIOUS_WEIGHTS)}, got {config.previous_weights!r}")
    if config.batch < 2:
        raise ValueError(f"batch must be at least 2, got {config.batch}")
    if not testbed_ready(Path(config.testbed)):
        raise ValueError(f"no WebUI test bed in {config.testbed}: build it (bash .ci/testbed) or set A1111_ROOT")
    return config


def parse_size(text: str) -> tuple[int, int]:
    width, sep, height = text.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit():
        raise argparse.ArgumentTypeError(f"a size is WIDTHxHEIGHT (e.g. 512x768), got {text!r}")
    return int(width), int(height)


def script_args(precision: str) -> list[Any]:
    """``script_args`` of the extension's script: its defaults at the given precision, in ``ui()`` order."""
    from ov_accelerate_webui.settings import DEFAULTS, FIELD_NAMES

    chosen = dataclasses.replace(DEFAULTS, precision=precision)
    return [getattr(chosen, name) for name in FIELD_NAMES]


class Scenario:
    """Runs the rows against one WebUI and collects the records."""

    def __init__(self, config: WebUIBenchSettings, ui: BenchWebUI, checkpoints: tuple[str, str], lora: str,
                 progress: Callable[[dict[str, Any]], None]) -> None:
        self.config, self.ui, self.checkpoints, self.lora = config, ui, checkpoints, lora
        self.results: dict[str, Any] = {"rows": [], "phases": []}
        self.progress = progress
        self.current = 0
        #: stock's first image per request, for the accelerated images' PSNR
        self._stock_pictures: dict[str, Any] = {}

    def payload(self, row: Row) -> dict[str, Any]:
        width, height = self.config.sizes[row.size]
        # a new prompt per request within a mode (so the text encoder runs), the same one for the same request in
        # every mode (so each accelerated image can be compared with stock's); the restart repeats the first
        prompt = f"a lighthouse on a cliff at dusk, take {'first' if row.key == 'restart' else row.key}"
        if row.long_prompt:
            prompt += ", " + ", ".join(f"detail {i}" for i in range(40))  # about 120 tokens
        if row.lora is not None:
            prompt += f" <lora:{self.lora}:{row.lora:g}>"
        payload = {"prompt": prompt, "negative_prompt": "blurry, low quality", "seed": 1234,
                   "steps": self.config.steps, "width": width, "height": height, "sampler_name": "Euler",
                   "cfg_scale": 7, "batch_size": self.config.batch if row.batch else 1, "n_iter": 1,
                   "save_images": False, "send_images": True}
        if row.prompts_job:
            lines = "\n".join(f"{prompt}, variation {i}" for i in range(row.prompts_job))
            payload.update(script_name=PROMPTS_SCRIPT, script_args=[False, False, "start", lines])
        return payload

    def switch(self, index: int) -> float | None:
        if index == self.current:
            return None
        t0 = time.time()
        self.ui.call("/sdapi/v1/options", {"sd_model_checkpoint": self.checkpoints[index]})
        self.current = index
        return time.time() - t0

    def forget_conditioning(self) -> None:
        """An untimed tiny stock request with a prompt no row uses.

        A1111 keeps the last request's conditioning and reuses it for the same prompt and checkpoint: without
        this, a mode's first request repeats the previous mode's last one (in a run of a few rows) and the
        text encoder is skipped there, so its first build would land in a later row.
        """
        self.ui.generate({"prompt": "an untimed request between modes", "seed": 1, "steps": 1, "width": 64,
                          "height": 64, "sampler_name": "Euler", "batch_size": 1, "n_iter": 1, "save_images": False,
                          "send_images": False})

    def run_row(self, row: Row, mode: str, process: int) -> bool:
        """One request; False when the WebUI is gone (the rest of the run cannot be measured)."""
        width, height = self.config.sizes[row.size]
        record: dict[str, Any] = {"key": row.key, "mode": mode, "process": process,
                                  "label": row.label.format(batch=self.config.batch, size=f"{width}x{height}"),
                                  "size": f"{width}x{height}", "batch": self.config.batch if row.batch else 1}
        try:
            record["load_seconds"] = self.switch(row.checkpoint)
            payload = self.payload(row)
            if mode != "stock" and row.prompts_job:
                payload["alwayson_scripts"] = {SECTION_TITLE: {"args": [True, *script_args(mode)]}}
            elif mode != "stock":
                payload.update(script_name=SCRIPT_NAME, script_args=script_args(mode))
            timed = self.ui.timed_generate(payload)
            record.update(seconds=timed.seconds, s_per_it=timed.s_per_it, s_per_it_from_progress=timed.from_progress,
                          steps=timed.steps, images=timed.images)
            if mode == "stock":
                self._stock_pictures[row.key] = timed.picture
            else:
                stock = self._stock_pictures.get("first" if row.key == "restart" else row.key)
                if stock is not None and timed.picture is not None and stock.shape == timed.picture.shape:
                    record["psnr_vs_stock"] = psnr(timed.picture, stock)
            if mode != "stock":
                status = self.ui.status()
                record.update({k: status.get(k) for k in ("accelerated", "compiles", "compile_seconds",
                                                          "convert_seconds", "released", "kept_previous", "run_seconds",
                                                          "cache_hits",
                                                          "ov_calls", "eager_calls", "lora_write_seconds",
                                                          "generations")})
                record["status"] = status.get("status", "")
        except (AssertionError, OSError, RuntimeError) as err:
            record["error"] = str(err)[:2000]
            logger.warning("%s / %s failed: %s", mode, row.key, str(err)[:300])
        record.update(self.ui.memory())
        logger.info("%s %-12s %s", mode, row.key, {k: record.get(k) for k in ("seconds", "s_per_it", "compile_seconds",
                                                                              "convert_seconds", "cache_hits",
                                                                              "released", "peak")})
        self.results["rows"].append(record)
        self.progress(self.results)
        alive = self.ui.process is not None and self.ui.process.poll() is None
        if not alive:
            record["error"] = record.get("error", "") + f"\nthe WebUI exited:\n{self.ui.log_tail(30)}"
        return alive

    def phase_end(self, mode: str, process: int) -> None:
        size, files = self.ui.cache_size()
        self.results["phases"].append({"mode": mode, "process": process, **self.ui.memory(), "cache_bytes": size,
                                       "cache_files": files})
        self.progress(self.results)

    def run(self) -> dict[str, Any]:
        self.ui.start()
        self.switch(1)  # untimed: A1111 hashes a checkpoint on its first load; both files end in the page cache
        self.switch(0)
        self.phase_end("started", 1)
        chosen = self.config.rows
        alive = True
        if self.config.previous_weights:
            self.ui.call("/sdapi/v1/options", {"openvino_previous_weights": self.config.previous_weights})
        for mode in ("stock", *self.config.precisions):
            if mode != "stock":
                self.forget_conditioning()
            for row in ROWS:
                if not chosen or row.key in chosen:
                    alive = alive and self.run_row(row, mode, 1)
            self.phase_end(mode, 1)
        if not alive or (chosen and RESTART.key not in chosen):
            return self.results
        self.ui.stop()
        self.current = 0
        self.ui.start()
        for mode in self.config.precisions:
            if self.run_row(RESTART, mode, 2):
                self.phase_end(f"{mode} after restart", 2)
        return self.results


def prepare(config: WebUIBenchSettings, work: Path) -> tuple[BenchWebUI, tuple[str, str], str]:
    """The isolated WebUI: models, LoRA, the extension cloned from this checkout."""
    testbed = Path(config.testbed)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    if config.tiny:
        ui = BenchWebUI(testbed, work / "data", work / "logs", CHECKPOINT_A)
        ui.prepare([])  # builds the tiny checkpoints and their LoRA
        return ui, (CHECKPOINT_A, CHECKPOINT_B), TINY_LORA
    ui = BenchWebUI(testbed, work / "data", work / "logs", FULL_CHECKPOINTS[0])
    ui.prepare([])
    folder = testbed / "webui" / "models" / "Stable-diffusion"
    ui.link_checkpoints([folder / name for name in FULL_CHECKPOINTS])
    lora = ui.data_dir / "models" / "Lora" / f"{FULL_LORA}.safetensors"
    if not lora.is_file():
        layers = write_kohya_lora(folder / FULL_CHECKPOINTS[0], lora)
        logger.info("wrote %s (%d layers)", lora, layers)
    return ui, FULL_CHECKPOINTS, FULL_LORA


def extension_commit(ui: BenchWebUI) -> str:
    """The commit the WebUI runs: the clone's HEAD (the checkout's working tree may differ from it)."""
    folder = ui.data_dir / "extensions" / EXTENSION_NAME
    head = subprocess.run(["git", "-C", str(folder), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip()
    return head or "working tree (no clone)"


def available_gib() -> float:
    memory = system_memory()
    return memory.available / (1 << 30) if memory is not None else 0.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench webui", description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="the real-host tier's tiny models (CI smoke test, minutes)")
    p.add_argument("--precisions", nargs="+", choices=PRECISION_KEYS, help="accelerated runs (default: auto)")
    p.add_argument("--steps", type=int, help="sampling steps per request (default 4)")
    p.add_argument("--sizes", nargs=3, type=parse_size, metavar="WxH",
                   help="first, second and third size (default 512x512 512x384 384x512; tiny 64x64 96x64 64x96)")
    p.add_argument("--batch", type=int, help="batch size of the batch row (default 4)")
    p.add_argument("--rows", nargs="+", metavar="KEY",
                   help="only these requests, stock and accelerated (" + " ".join(r.key for r in (*ROWS, RESTART))
                   + "; default: all)")
    p.add_argument("--testbed", type=Path, help="the test bed (default $A1111_ROOT or build/a1111-testbed)")
    p.add_argument("--out", type=Path, help="folder of the results (default bench/results)")
    p.add_argument("--name", help="file name stem (default webui-<date>, or webui-tiny-<date>)")
    p.add_argument("--work-dir", type=Path, help="keep the WebUI's data folder and logs here (default: temporary)")
    p.add_argument("--min-available-gib", type=float,
                   help="refuse to start with less available memory (default 18; tiny 0)")
    p.add_argument("--previous-weights", choices=PREVIOUS_WEIGHTS,
                   help="the extension's setting for the previous checkpoint's or LoRA's compiled models "
                        "(default: the WebUI's, auto)")
    p.add_argument("--note", help="a sentence printed above the tables (e.g. what else ran on the machine)")
    p.add_argument("-v", "--verbose", action="store_true", help="log each row as it is measured")
    return p


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = {"tiny": args.tiny, "precisions": tuple(args.precisions) if args.precisions else None,
               "steps": args.steps, "sizes": tuple(args.sizes) if args.sizes else None, "batch": args.batch,
               "rows": tuple(args.rows) if args.rows else None,
               "testbed": args.testbed, "out": args.out, "name": args.name, "work_dir": args.work_dir,
               "min_available_gib": args.min_available_gib, "previous_weights": args.previous_weights}
    try:
        config = build_settings(options)
    except ValueError as err:
        _parser().error(str(err))
    if available_gib() < config.min_available_gib:
        _parser().error(f"{available_gib():.1f} GiB available, {config.min_available_gib:g} needed "
                        "(--min-available-gib lowers it)")
    stem = config.name or ("webui-tiny-" if config.tiny else "webui-") + time.strftime("%Y-%m-%d")
    header = webui_report.header(config, "python -m bench webui " + shlex.join(argv), args.note)
    work = Path(config.work_dir) if config.work_dir else Path(tempfile.mkdtemp(prefix="bench-webui-"))

    def write(results: dict[str, Any]) -> tuple[Path, Path]:
        return webui_report.write({**header, **results}, Path(config.out), stem)

    ui = None
    try:
        ui, checkpoints, lora = prepare(config, work)
        header["extension_commit"] = extension_commit(ui)
        results = Scenario(config, ui, checkpoints, lora, write).run()
    finally:
        if ui is not None:
            ui.stop()
        if config.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    json_path, md_path = write(results)
    sys.stdout.write(webui_report.markdown({**header, **results}) + f"\nWrote {json_path} and {md_path}\n")
    return 0 if not any("error" in r for r in results["rows"]) else 1
