"""``python -m bench session``: a WebUI's whole session under a memory limit, stock A1111 against the extension.

A laptop user's session, each run in a WebUI started afresh on the test bed's real A1111 v1.10.1 (the full-size
SD 1.5 or SDXL random-weight checkpoints; ``--tiny``: the real-host tier's tiny ones): the WebUI's start with its
checkpoint load, the first generation, a second size, a LoRA on and off, a checkpoint switch and back
(:data:`SESSION_ROWS`). Stock runs it first without a limit (its pictures are the reference), then under each
limit; each precision runs it under its own limit (``--memory-limit-gib``, one per precision or one for all) in a
memory cgroup of the bench's own (``bench.load.MemoryLimit``: cgroup v1 or v2, no swap; needs root) that the
WebUI is in from its start. Accelerated runs start with Settings -> OpenVINO -> *Enable for every generation* on,
as a user short of memory would run it: the checkpoint loads go into the weight file (``docs/memory.md``).

Reported per run: whether the WebUI lived through it (the cgroup's out-of-memory kills), the WebUI process's peak
resident memory over its whole life (``VmHWM``, file pages included; kept across the per-request resets), the
peak of its anonymous memory (``RssAnon``, sampled every 0.1 s: what only swap could take from it), the cgroup's
own peak (page cache included, which the kernel reclaims before it kills), and per request its seconds, its own
peak and its picture against stock's (PSNR).

    python -m bench session --model sdxl --precisions int8-weights auto --memory-limit-gib 8 12 --steps 3
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import webui_report
from bench.load import MemoryLimit
from bench.webui import Scenario, extension_commit, prepare
from bench.webui_host import GIB, Sampler
from bench.webui_rows import MODELS, PRECISION_KEYS, SESSION_ROWS, build_settings, parse_size
from tests.real_webui.webui import psnr

logger = logging.getLogger(__name__)


def why_not_started(error: str) -> str:
    """What a results file keeps of a WebUI that did not start: the harness's first line ("the WebUI exited with
    -9:") and the extension's own lines from the log's tail (its warning before A1111's load), not the rest of the
    log (machine paths, library warnings)."""
    lines = error.splitlines()
    mark = "Accelerate with OpenVINO: "
    ours = [line.split(mark, 1)[1] for line in lines[1:] if mark in line]
    return "\n".join(lines[:1] + ours)


class Session(Scenario):
    """The session rows in a WebUI started afresh per (mode, limit)."""

    def plan(self, limits: Sequence[float | None], stock_last: bool = False) -> list[tuple[str, float | None]]:
        """Stock without a limit first (the reference pictures), then stock under each limit before the first
        precision that runs under it, then that precision. ``stock_last``: the precisions first, then stock under
        each limit, then stock without one (the accelerated pictures are compared with stock's at the end)."""
        runs: list[tuple[str, float | None]] = [("stock", None)]
        for precision, limit in zip(self.config.precisions, limits, strict=True):
            if limit is not None and ("stock", limit) not in runs:
                runs.append(("stock", limit))
            runs.append((precision, limit))
        if stock_last:
            runs = [run for run in runs if run[0] != "stock"] + [run for run in runs[1:] if run[0] == "stock"] + \
                [("stock", None)]
        return runs

    def run_session(self, mode: str, limit: float | None) -> dict[str, Any]:
        ui = self.ui
        shutil.rmtree(ui.cache_dir(), ignore_errors=True)  # a cold start, as a user's first session
        config = ui.data_dir / "config.json"
        options = json.loads(config.read_text()) if config.is_file() else {}
        options["openvino_enable_always"] = mode != "stock"
        config.write_text(json.dumps(options, indent=2))
        ui.checkpoint, self.current = self.checkpoints[0], 0
        record: dict[str, Any] = {"mode": mode, "limit_gib": limit, "requests": 0, "alive": False}
        group = MemoryLimit(int(limit * GIB)) if limit is not None else None
        sampler = Sampler(ui)
        first_row = len(self.results["rows"])
        try:
            if group is not None:
                group.enter()
            try:
                ui.start()
            finally:
                if group is not None:
                    group.leave()
            sampler.start()
            alive = True
            for row in SESSION_ROWS:
                alive = self.run_row(row, mode, 1)
                self.results["rows"][-1]["limit_gib"] = limit
                record["requests"] += "error" not in self.results["rows"][-1]
                if not alive:
                    break
            try:
                sampler.reading()
            except ProcessLookupError:
                pass
            record["alive"] = alive and ui.process is not None and ui.process.poll() is None
        except RuntimeError as err:  # the WebUI did not start: killed during its checkpoint load, under a limit
            record["error"] = why_not_started(str(err))
            logger.warning("%s (limit %s GiB): the WebUI did not start: %s", mode, limit, record["error"])
        finally:
            sampler.stop()
            record.update(session_peak_gib=max(sampler.hwm_peak / GIB, ui.life_peak),
                          anon_peak_gib=sampler.anon_peak / GIB)
            rows = self.results["rows"][first_row:]
            record["failed"] = [r["key"] for r in rows if "error" in r]
            ui.stop()
            if group is not None:
                record.update(group_peak_gib=(group.peak_bytes() or 0) / GIB, oom_kills=group.oom_kills())
                group.close()
        logger.info("session %s", record)
        return record

    def run_all(self, limits: Sequence[float | None], stock_last: bool = False) -> dict[str, Any]:
        self.results["sessions"] = []
        for mode, limit in self.plan(limits, stock_last):
            self.results["sessions"].append(self.run_session(mode, limit))
            self.compare_late()
            self.progress(self.results)
        return self.results

    def compare_late(self) -> None:
        """PSNR against stock for the accelerated requests that ran before stock's (``stock_last``)."""
        for record in self.results["rows"]:
            if record["mode"] == "stock" or record.get("psnr_vs_stock") is not None:
                continue
            mine = self._pictures.get((record["mode"], record["key"]))
            theirs = self._pictures.get(("stock", record.get("reference") or record["key"]))
            if mine is not None and theirs is not None and mine.shape == theirs.shape:
                record["psnr_vs_stock"] = psnr(mine, theirs)


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = [f"# A WebUI's whole session under a memory limit: {webui_report.model_title(s)}", "",
             *webui_report._machine_lines(results), "",
             "Each run is a WebUI started afresh (a cold disk cache): its start and checkpoint load, then "
             + ", ".join(row.label.format(size="", batch="").strip() for row in SESSION_ROWS)
             + ". Accelerated runs start with *Enable for every generation* on. Peak RSS is the WebUI process's "
             "VmHWM over its whole life (file pages included: the kernel can reclaim those); anonymous is RssAnon "
             "sampled every 0.1 s; the cgroup's peak counts the page cache too. No swap on this machine.", "",
             "| run | limit GiB | lived | requests done | peak RSS GiB | peak anonymous GiB | the cgroup's peak GiB "
             "| out-of-memory kills | lowest PSNR vs stock dB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for session in results.get("sessions", []):
        mine = [r for r in results["rows"]
                if r["mode"] == session["mode"] and r.get("limit_gib") == session["limit_gib"]]
        psnrs = [r["psnr_vs_stock"] for r in mine if r.get("psnr_vs_stock") is not None]
        lived = "yes" if session["alive"] else ("killed at its start" if "error" in session else "no")
        started = "error" not in session  # (a WebUI killed at its start was never sampled)
        lines.append(f"| {session['mode']} | {session['limit_gib'] or 'none'} | {lived} | {session['requests']} of "
                     f"{len(SESSION_ROWS)} | {_gib(session['session_peak_gib'] if started else None)} | "
                     f"{_gib(session['anon_peak_gib'] if started else None)} | "
                     f"{_gib(session.get('group_peak_gib'))} | {session.get('oom_kills', '-')} | "
                     f"{f'{min(psnrs):.1f}' if psnrs else '-'} |")
    lines += ["", "Per request (peak: the request's own VmHWM, reset before it):", "",
              "| run | limit GiB | request | seconds | peak RSS GiB | PSNR vs stock dB | compiles | note |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results.get("rows", []):
        note = (r.get("error") or "").splitlines()[0][:120] if r.get("error") else ""
        if r["mode"] != "stock" and r.get("pytorch_parts"):
            note = (note + " in PyTorch: " + ", ".join(r["pytorch_parts"])).strip()
        psnr = r.get("psnr_vs_stock")
        lines.append(f"| {r['mode']} | {r.get('limit_gib') or 'none'} | {r['label']} | {_gib(r.get('seconds'))} | "
                     f"{_gib(r.get('request_peak'))} | {'-' if psnr is None else f'{psnr:.1f}'} | "
                     f"{r.get('compiles', '-') if r['mode'] != 'stock' else '-'} | {note} |")
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench session", description=__doc__.split("\n\n")[0])
    p.add_argument("--webui", choices=("a1111", "forge"), default="a1111",
                   help="the WebUI measured (default a1111; forge: the Forge test bed, model sdxl)")
    p.add_argument("--tiny", action="store_true", help="the real-host tier's tiny models (minutes)")
    p.add_argument("--model", choices=MODELS, help="the full-size model (default sd15)")
    p.add_argument("--precisions", nargs="+", choices=PRECISION_KEYS, help="accelerated runs (default: auto)")
    p.add_argument("--memory-limit-gib", nargs="+", type=float, metavar="GIB",
                   help="a memory cgroup of this size per precision, in order (one value: for all); stock runs "
                        "under each too (needs root); default: no limit")
    p.add_argument("--steps", type=int, help="sampling steps per request (default 4)")
    p.add_argument("--sizes", nargs=2, type=parse_size, metavar="WxH",
                   help="the first and second size (default 512x512 512x384; sdxl 1024x1024 1024x768)")
    p.add_argument("--testbed", type=Path, help="the test bed (default $A1111_ROOT or build/a1111-testbed)")
    p.add_argument("--out", type=Path, help="folder of the results (default bench/results)")
    p.add_argument("--name", help="file name stem (default session-<model>-<date>)")
    p.add_argument("--work-dir", type=Path, help="keep the WebUI's data folder and logs here (default: temporary)")
    p.add_argument("--stock-last", action="store_true",
                   help="the accelerated runs first, stock's last (its unlimited run needs the most memory: other "
                        "work can share the machine until then); pictures are compared at the end")
    p.add_argument("--note", help="a sentence printed above the tables")
    return p


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    limits: list[float | None] = list(args.memory_limit_gib or [])
    precisions = tuple(args.precisions or ("auto",))
    if len(limits) == 1:
        limits *= len(precisions)
    if not limits:
        limits = [None] * len(precisions)
    if len(limits) != len(precisions) or any(limit is not None and limit <= 0 for limit in limits):
        _parser().error(f"--memory-limit-gib: one positive size for all precisions or one per precision "
                        f"({len(precisions)}), got {args.memory_limit_gib}")
    sizes = (*args.sizes, args.sizes[1]) if args.sizes else None  # (the settings' third size: unused)
    options = {"tiny": args.tiny, "model": args.model, "precisions": precisions, "steps": args.steps,
               "sizes": sizes, "testbed": args.testbed, "out": args.out, "name": args.name,
               "work_dir": args.work_dir, "min_available_gib": 0.0, "session": True, "webui": args.webui}
    try:
        config = build_settings(options)
    except ValueError as err:
        _parser().error(str(err))
    model = "tiny" if config.tiny else config.model
    host = "forge-" if config.webui == "forge" else ""
    stem = config.name or f"session-{host}{model}-{time.strftime('%Y-%m-%d')}"
    header = webui_report.header(config, "python -m bench session " + " ".join(argv), args.note)
    header["settings"]["sizes"] = header["settings"]["sizes"][:2]  # (the third is the webui bench's)
    # absolute: the WebUI runs in its own folder, where a relative data folder names another
    work = Path(config.work_dir).absolute() if config.work_dir else Path(tempfile.mkdtemp(prefix="bench-session-"))
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)

    def write(results: dict[str, Any]) -> None:
        full = {**header, **results}
        (out / f"{stem}.json").write_text(json.dumps(full, indent=1, default=str) + "\n", encoding="utf-8")
        (out / f"{stem}.md").write_text(markdown(full), encoding="utf-8")

    ui = None
    try:
        ui, checkpoints, lora = prepare(config, work)
        header["extension_commit"] = extension_commit(ui)
        results = Session(config, ui, checkpoints, lora, write).run_all(limits, args.stock_last)
    finally:
        if ui is not None:
            ui.stop()
        if config.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    write(results)
    print(markdown({**header, **results}))  # noqa: T201 (the bench's report)
    return 0 if all(s["alive"] for s in results["sessions"] if s["mode"] != "stock") else 1
