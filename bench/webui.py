"""``python -m bench webui``: stock A1111 (or Forge) against the extension, in the real WebUI of the test bed.

One run starts the real AUTOMATIC1111 WebUI v1.10.1 of the test bed (``A1111_ROOT``) in an isolated data
folder with the extension cloned into ``extensions/``, on the full-size SD 1.5 random-weight checkpoints
the test bed made (``--tiny``: the real-host tier's tiny models, the CI smoke test), and runs the
scenario of :data:`ROWS` first stock, then accelerated at each precision, in the same process; then it
restarts the WebUI and times the first accelerated generation with the warm disk cache. Each row notes
the request's seconds, seconds per sampling step from A1111's own progress, what the extension's status
route says about the run (compile and run seconds, compiles, cache hits), and the resident memory of the
WebUI's process. The tables are written by :mod:`bench.webui_report`. ``--webui forge`` runs the same scenario
(the rows Forge can take) on the Forge test bed (``FORGE_ROOT``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import webui_report
from bench.webui_host import BenchForge, BenchWebUI, write_kohya_lora
from bench.webui_rows import (
    FULL_CHECKPOINTS,
    FULL_LORA,
    MODELS,
    PRECISION_KEYS,
    PROMPTS_SCRIPT,
    RESTART,
    ROWS,
    SDXL_CHECKPOINT,
    SDXL_CHECKPOINT_B,
    SDXL_LORA,
    SECTION_TITLE,
    TINY_LORA,
    WEBUIS,
    Row,
    WebUIBenchSettings,
    build_settings,
    parse_size,
)
from ov_backend.memory import system_memory
from ov_backend.settings import PREVIOUS_WEIGHTS
from tests.real_forge import forge
from tests.real_webui.webui import CHECKPOINT_A, CHECKPOINT_B, EXTENSION_NAME, SCRIPT_NAME, psnr, testbed_root

logger = logging.getLogger(__name__)

__all__ = ["RESTART", "ROWS", "Row", "WebUIBenchSettings", "build_settings", "main"]


def script_args(precision: str, step_cache: int = 1) -> list[Any]:
    """``script_args`` of the extension's script: its defaults at the given precision and step caching interval,
    in ``ui()`` order."""
    from ov_accelerate_webui.settings import DEFAULTS, FIELD_NAMES

    chosen = dataclasses.replace(DEFAULTS, precision=precision, step_cache=step_cache)
    return [getattr(chosen, name) for name in FIELD_NAMES]


class Scenario:
    """Runs the rows against one WebUI and collects the records."""

    def __init__(self, config: WebUIBenchSettings, ui: BenchWebUI, checkpoints: tuple[str, str], lora: str,
                 progress: Callable[[dict[str, Any]], None]) -> None:
        self.config, self.ui, self.checkpoints, self.lora = config, ui, checkpoints, lora
        self.results: dict[str, Any] = {"rows": [], "phases": []}
        self.progress = progress
        self.current = 0
        #: the first image per (mode, request), for the accelerated images' PSNR
        self._pictures: dict[tuple[str, str], Any] = {}

    def payload(self, row: Row) -> dict[str, Any]:
        width, height = self.config.sizes[row.size]
        # a new prompt per request within a mode (so the text encoder runs), the same one for the same request in
        # every mode (so each accelerated image can be compared with stock's); a row with a reference repeats its
        prompt = f"a lighthouse on a cliff at dusk, take {row.reference or row.key}"
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
        seconds = self.ui.switch_checkpoint(self.checkpoints[index])
        self.current = index
        return seconds

    def forget_conditioning(self) -> None:
        """An untimed tiny stock request with a prompt no row uses.

        A1111 keeps the last request's conditioning and reuses it for the same prompt and checkpoint: without
        this, a mode's first request repeats the previous mode's last one (in a run of a few rows) and the
        text encoder is skipped there, so its first build would land in a later row.
        """
        payload = {"prompt": "an untimed request between modes", "seed": 1, "steps": 1, "width": 64, "height": 64,
                   "sampler_name": "Euler", "batch_size": 1, "n_iter": 1, "save_images": False, "send_images": False}
        if self.config.enable_always:  # (the section would accelerate it at the panel's defaults)
            payload["alwayson_scripts"] = {SECTION_TITLE: {"args": [False]}}
        self.ui.generate(payload)

    def run_row(self, row: Row, mode: str, process: int) -> bool:
        """One request; False when the WebUI is gone (the rest of the run cannot be measured)."""
        width, height = self.config.sizes[row.size]
        record: dict[str, Any] = {"key": row.key, "mode": mode, "process": process,
                                  "label": row.label.format(batch=self.config.batch, size=f"{width}x{height}"),
                                  "size": f"{width}x{height}", "batch": self.config.batch if row.batch else 1,
                                  "reference": row.reference, "step_cache_interval": row.step_cache}
        try:
            record["load_seconds"] = self.switch(row.checkpoint)
            payload = self.payload(row)
            if mode != "stock" and row.prompts_job:
                payload["alwayson_scripts"] = {SECTION_TITLE: {"args": [True, *script_args(mode, row.step_cache)]}}
            elif mode != "stock":
                payload.update(script_name=SCRIPT_NAME, script_args=script_args(mode, row.step_cache))
            peak_reset = self.ui.reset_peak()  # the request's own peak, without the load's
            if row.token_merging:  # (an override_settings of an option never set is not restored by A1111)
                self.ui.call("/sdapi/v1/options", {"token_merging_ratio": row.token_merging})
            try:
                timed = self.ui.timed_generate(payload)
            finally:
                if row.token_merging:
                    self.ui.call("/sdapi/v1/options", {"token_merging_ratio": 0.0})
            if peak_reset:
                record["request_peak"] = self.ui.memory()["peak"]
            record["rss_timeline"] = timed.timeline
            record.update(seconds=timed.seconds, s_per_it=timed.s_per_it, s_per_it_from_progress=timed.from_progress,
                          steps=timed.steps, images=timed.images)
            self._pictures.setdefault((mode, row.key), timed.picture)
            reference = row.reference or row.key
            for field, against in (("psnr_vs_stock", ("stock", reference)), ("psnr_vs_uncached", (mode, reference))):
                picture = self._pictures.get(against)
                if mode != "stock" and against != (mode, row.key) and picture is not None and \
                        timed.picture is not None and picture.shape == timed.picture.shape:
                    record[field] = psnr(timed.picture, picture)
            if mode != "stock":
                status = self.ui.status()
                record.update({k: status.get(k) for k in ("accelerated", "compiles", "compile_seconds",
                                                          "convert_seconds", "released", "kept_previous", "run_seconds",
                                                          "cache_hits", "ov_calls", "eager_calls",
                                                          "lora_write_seconds", "generations", "step_cache")})
                record["status"] = status.get("status", "")
                record["pytorch_parts"] = sorted(status.get("pytorch") or {})
        except (AssertionError, OSError, RuntimeError) as err:
            record["error"] = str(err)[:2000]
            logger.warning("%s / %s failed: %s", mode, row.key, str(err)[:300])
        record.update(self.ui.memory(), peak_seen=self.ui.peak_seen, least_available_gib=self.ui.least_available)
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
        memory = self.ui.memory()
        self.results["phases"].append({"mode": mode, "process": process, **memory, "cache_bytes": size,
                                       "cache_files": files, "life_peak": max(self.ui.life_peak, memory["peak"])})
        self.progress(self.results)

    def run(self) -> dict[str, Any]:
        if self.config.enable_always:  # before the start: the WebUI's first load already moves the weights
            config = self.ui.data_dir / "config.json"
            options = json.loads(config.read_text()) if config.is_file() else {}
            config.write_text(json.dumps({**options, "openvino_enable_always": True}, indent=2))
        self.ui.start()
        self.switch(1)  # untimed: A1111 hashes a checkpoint on its first load; both files end in the page cache
        self.switch(0)
        self.phase_end("started", 1)
        chosen = self.config.rows
        alive = True
        if self.config.previous_weights:
            self.ui.call("/sdapi/v1/options", {"openvino_previous_weights": self.config.previous_weights})
        if self.config.weights_in_file:
            self.ui.call("/sdapi/v1/options", {"openvino_weights_in_file": self.config.weights_in_file == "on"})
        for mode in (() if self.config.accelerated_only else ("stock",)) + tuple(self.config.precisions):
            if mode != "stock":
                self.forget_conditioning()
            for row in ROWS:
                # stock has no step caching: its picture for those rows is their reference's
                if (not chosen or row.key in chosen) and (mode != "stock" or row.step_cache == 1):
                    alive = alive and self.run_row(row, mode, 1)
            self.phase_end(mode, 1)
        if not alive or (chosen and RESTART.key not in chosen):
            return self.results
        self.ui.stop()
        self.current = 0
        self.ui.start()
        self.phase_end("restarted (its checkpoint loaded)", 2)
        for mode in self.config.precisions:
            if self.run_row(RESTART, mode, 2):
                self.phase_end(f"{mode} after restart", 2)
        return self.results


def prepare(config: WebUIBenchSettings, work: Path) -> tuple[BenchWebUI, tuple[str, str], str]:
    """The isolated WebUI: models, LoRA, the extension cloned from this checkout."""
    testbed = Path(config.testbed)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    if config.webui == "forge":  # the Forge bed links every model it has, the A1111 bed's full-size SD 1.5 too
        checkpoint = forge.CHECKPOINT_A if config.tiny else SDXL_CHECKPOINT if config.model == "sdxl" \
            else forge.FULL_CHECKPOINT
        ui = BenchForge(testbed, work / "data", work / "logs", checkpoint)
        ui.prepare([])
        if config.model == "sdxl":  # the A1111 bed's (its sgm makes them, once), linked
            a1111 = BenchWebUI(testbed_root(), work / "a1111-data", work / "logs", SDXL_CHECKPOINT)
            names = (SDXL_CHECKPOINT, SDXL_CHECKPOINT_B) if config.session else (SDXL_CHECKPOINT,)
            made = [a1111.testbed / "webui" / "models" / "Stable-diffusion" / name for name in names]
            for path, seed in zip(made, ("1", "2"), strict=False):
                if not path.is_file():
                    logger.warning("making %s (a full-size random SDXL base, fp16, about 7 GB; minutes)", path)
                    subprocess.run([str(a1111.python), str(Path(__file__).with_name("make_sdxl.py")), str(path), seed],
                                   cwd=a1111.webui, env=a1111.env(), check=True)
            ui.link_checkpoints(made)
            if config.session:  # the session's switch and LoRA (Forge's loader reads kohya's format)
                lora = ui.data_dir / "models" / "Lora" / f"{SDXL_LORA}.safetensors"
                if not lora.is_file():
                    logger.info("wrote %s (%d layers)", lora, write_kohya_lora(made[0], lora))
                return ui, (SDXL_CHECKPOINT, SDXL_CHECKPOINT_B), SDXL_LORA
        if not (ui.data_dir / "models" / "Stable-diffusion" / checkpoint).is_file():
            raise FileNotFoundError(f"{checkpoint} is not in the Forge bed's models: build the A1111 bed's full-size "
                                    "model, then the Forge bed (bash .ci/testbed)")
        return ui, (checkpoint, checkpoint), forge.LORA
    if config.tiny:
        ui = BenchWebUI(testbed, work / "data", work / "logs", CHECKPOINT_A)
        ui.prepare([])  # builds the tiny checkpoints and their LoRA
        return ui, (CHECKPOINT_A, CHECKPOINT_B), TINY_LORA
    folder = testbed / "webui" / "models" / "Stable-diffusion"
    if config.model == "sdxl":
        ui = BenchWebUI(testbed, work / "data", work / "logs", SDXL_CHECKPOINT)
        ui.prepare([])  # the tiny models too: SDXL's live preview reads their approximate VAE
        second = (SDXL_CHECKPOINT_B,) if config.session else ()  # the session's switch: a second SDXL base
        for name, seed in zip((SDXL_CHECKPOINT, *second), ("1", "2"), strict=False):
            if not (folder / name).is_file():
                logger.warning("making %s (a full-size random SDXL base, fp16, about 7 GB; minutes)", folder / name)
                subprocess.run([str(ui.python), str(Path(__file__).with_name("make_sdxl.py")), str(folder / name),
                                seed], cwd=ui.webui, env=ui.env(), check=True)
        ui.link_checkpoints([folder / name for name in (SDXL_CHECKPOINT, *second)])
        if not config.session:
            return ui, (SDXL_CHECKPOINT, SDXL_CHECKPOINT), ""
        lora = ui.data_dir / "models" / "Lora" / f"{SDXL_LORA}.safetensors"
        if not lora.is_file():
            logger.info("wrote %s (%d layers)", lora, write_kohya_lora(folder / SDXL_CHECKPOINT, lora))
        return ui, (SDXL_CHECKPOINT, SDXL_CHECKPOINT_B), SDXL_LORA
    ui = BenchWebUI(testbed, work / "data", work / "logs", FULL_CHECKPOINTS[0])
    ui.prepare([])
    builder = Path(__file__).resolve().parents[1] / ".ci" / "build_testbed.py"
    for name in FULL_CHECKPOINTS[1:]:  # the test bed makes the first; the bench its second, once
        if not (folder / name).is_file():
            logger.warning("making %s (a full-size random SD 1.5, the test bed's recipe at seed 2; a minute)",
                           folder / name)
            subprocess.run([str(ui.python), str(builder), "worker", "checkpoint", str(folder / name), "2"],
                           cwd=ui.webui, env={**ui.env(), "PYTHONWARNINGS": "ignore"}, check=True)
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
    p.add_argument("--webui", choices=WEBUIS,
                   help="the WebUI measured (default a1111; forge: the Forge test bed, $FORGE_ROOT or "
                        "build/forge-testbed, on the A1111 bed's full-size SD 1.5 linked there, without the rows of a "
                        "second checkpoint, a LoRA, Token merging, Prompts from file or step caching)")
    p.add_argument("--tiny", action="store_true", help="the real-host tier's tiny models (CI smoke test, minutes)")
    p.add_argument("--model", choices=MODELS,
                   help="the full-size model (default sd15; sdxl: a random SDXL base the bench makes once, "
                        "sizes 1024x1024 1024x768 768x1024, no checkpoint switch or LoRA rows)")
    p.add_argument("--precisions", nargs="+", choices=PRECISION_KEYS, help="accelerated runs (default: auto)")
    p.add_argument("--steps", type=int, help="sampling steps per request (default 4)")
    p.add_argument("--sizes", nargs=3, type=parse_size, metavar="WxH",
                   help="first, second and third size (default 512x512 512x384 384x512; tiny 64x64 96x64 64x96)")
    p.add_argument("--batch", type=int, help="batch size of the batch row (default 4)")
    p.add_argument("--rows", nargs="+", metavar="KEY",
                   help="only these requests, stock and accelerated (" + " ".join(r.key for r in (*ROWS, RESTART))
                   + "; default: all)")
    p.add_argument("--testbed", type=Path, help="the test bed (default $A1111_ROOT or build/a1111-testbed; "
                                                  "forge: $FORGE_ROOT or build/forge-testbed)")
    p.add_argument("--out", type=Path, help="folder of the results (default bench/results)")
    p.add_argument("--name", help="file name stem (default webui-<date>, webui-tiny-<date>; forge: webui-forge-...)")
    p.add_argument("--work-dir", type=Path, help="keep the WebUI's data folder and logs here (default: temporary)")
    p.add_argument("--min-available-gib", type=float,
                   help="refuse to start with less available memory (default 18; tiny 0)")
    p.add_argument("--previous-weights", choices=PREVIOUS_WEIGHTS,
                   help="the extension's setting for the previous checkpoint's or LoRA's compiled models "
                        "(default: the WebUI's, auto)")
    p.add_argument("--weights-in-file", choices=("on", "off"),
                   help="the extension's setting for PyTorch's copy of the accelerated weights: in a memory-mapped "
                        "file (on) or in memory beside OpenVINO's (off) (default: the WebUI's, on)")
    p.add_argument("--enable-always", action="store_true",
                   help="Settings -> OpenVINO -> Enable for every generation on from the WebUI's start (with "
                        "--accelerated-only): the weights move into the file as the checkpoint loads")
    p.add_argument("--accelerated-only", action="store_true",
                   help="no stock requests: the WebUI process's peak RSS (VmHWM) is then the accelerated requests' own "
                        "(after stock's, it is at least stock's); the stock columns stay empty")
    p.add_argument("--note", help="a sentence printed above the tables (e.g. what else ran on the machine)")
    p.add_argument("-v", "--verbose", action="store_true", help="log each row as it is measured")
    return p


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = {"webui": args.webui, "tiny": args.tiny, "model": args.model,
               "precisions": tuple(args.precisions) if args.precisions else None,
               "steps": args.steps, "sizes": tuple(args.sizes) if args.sizes else None, "batch": args.batch,
               "rows": tuple(args.rows) if args.rows else None,
               "testbed": args.testbed, "out": args.out, "name": args.name, "work_dir": args.work_dir,
               "min_available_gib": args.min_available_gib, "previous_weights": args.previous_weights,
               "weights_in_file": args.weights_in_file, "accelerated_only": args.accelerated_only,
               "enable_always": args.enable_always or None}
    try:
        config = build_settings(options)
    except ValueError as err:
        _parser().error(str(err))
    if available_gib() < config.min_available_gib:
        _parser().error(f"{available_gib():.1f} GiB available, {config.min_available_gib:g} needed "
                        "(--min-available-gib lowers it)")
    host = "forge-" if config.webui == "forge" else ""
    stem = config.name or f"webui-{host}{'tiny-' if config.tiny else ''}" + time.strftime("%Y-%m-%d")
    header = webui_report.header(config, "python -m bench webui " + shlex.join(argv), args.note)
    work = Path(config.work_dir).absolute() if config.work_dir else Path(tempfile.mkdtemp(prefix="bench-webui-"))

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
