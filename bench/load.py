"""``python -m bench load``: the memory of a checkpoint load in the real WebUI, A1111's own against the load into the
weight file (acceleration in use).

For each model (the test bed's full-size random SD 1.5, a full-size random SDXL base made once by
``bench/make_sdxl.py``), a WebUI of its own starts on the tier's tiny checkpoint and switches to the full-size one
twice: with Settings -> OpenVINO -> "Keep PyTorch's copy ... in a file" off (acceleration takes no part: A1111's
load) and with "Enable for every generation" on (the routed parts' weights go from the checkpoint file into the
weight file, ``docs/memory.md``), each in a WebUI started afresh. During each switch the WebUI process's
memory is read every 5 ms from ``/proc``: its anonymous memory (``RssAnon``: what only swap can take from it) and
its resident memory (``VmRSS``, file pages included), and its ``VmHWM`` is started again before the switch
(``clear_refs``), so the peak is the load's own. Reported: the peaks, what is left after the load, and seconds.

    python -m bench load [--models sd15 sdxl] [--out bench/results] [--name NAME]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.report import machine
from bench.webui_host import GIB, BenchWebUI, Sampler
from bench.webui_rows import SDXL_CHECKPOINT  # the SDXL file ``bench webui --model sdxl`` makes
from tests.real_webui.webui import CHECKPOINT_A, testbed_root

logger = logging.getLogger(__name__)

MODELS = {"sd15": "sd15-random.safetensors", "sdxl": SDXL_CHECKPOINT}
MODES = {
    "A1111's load": {"openvino_weights_in_file": False, "openvino_enable_always": False},
    "into the weight file": {"openvino_weights_in_file": True, "openvino_enable_always": True},
}


def measure_switch(ui: BenchWebUI, checkpoint: str) -> dict[str, float]:
    """Switch to ``checkpoint``, reading the WebUI's memory every 5 ms; GiB and seconds."""
    ui.reset_peak()
    sampler = Sampler(ui, interval=0.005)
    before = sampler.reading()
    sampler.start()
    try:
        seconds = ui.switch_checkpoint(checkpoint)
    finally:
        sampler.stop()
    after = sampler.reading()
    return {"seconds": seconds, "anon_before": before["RssAnon"] / GIB, "anon_peak": sampler.anon_peak / GIB,
            "anon_after": after["RssAnon"] / GIB, "rss_peak": max(sampler.rss_peak, after["VmHWM"]) / GIB,
            "rss_after": after["VmRSS"] / GIB}


class MemoryLimit:
    """A memory cgroup of the bench's own with a hard limit (the cgroup v1 memory controller, else cgroup v2), the
    machine's memory as a laptop of that size has it: the bench's own process joins it before it starts the WebUI,
    so the WebUI is in it from its start (and the bench's few hundred MB are counted too), page cache included;
    the kernel reclaims that cache, or kills, before the group passes the limit. Needs write access to the cgroup
    file system (root in a container)."""

    def __init__(self, limit_bytes: int) -> None:
        v1 = Path("/sys/fs/cgroup/memory")
        self.v1 = (v1 / "memory.limit_in_bytes").exists()
        root = v1 if self.v1 else Path("/sys/fs/cgroup")
        self.path = root / f"ov-bench-load-{os.getpid()}-{int(time.time())}"
        self.path.mkdir()
        if self.v1:
            (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        else:
            (self.path / "memory.max").write_text(str(limit_bytes))
            if (self.path / "memory.swap.max").exists():
                (self.path / "memory.swap.max").write_text("0")
        self.limit = limit_bytes

    def enter(self) -> None:
        """This process joins the group (the processes it starts from now on are in it too)."""
        self.home = self._current()
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def leave(self) -> None:
        """This process goes back to the group it was in."""
        (self.home / "cgroup.procs").write_text(str(os.getpid()))

    def _current(self) -> Path:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, where = line.split(":", 2)
            if (self.v1 and "memory" in controllers.split(",")) or (not self.v1 and controllers == ""):
                return self.path.parent / where.lstrip("/")
        return self.path.parent

    def peak_bytes(self) -> int | None:
        name = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        name = "memory.oom_control" if self.v1 else "memory.events"
        for line in (self.path / name).read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def close(self) -> None:
        for _ in range(50):  # the group goes once its processes have (the WebUI is stopped first)
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)
        logger.warning("the cgroup %s is still there (a process in it?)", self.path)


def run_model(model: str, work: Path, limit_gib: float | None = None) -> list[dict[str, Any]]:
    testbed = testbed_root()
    folder = testbed / "webui" / "models" / "Stable-diffusion"
    checkpoint = MODELS[model]
    ui = BenchWebUI(testbed, work / model / "data", work / model / "logs", CHECKPOINT_A)
    (work / model / "logs").mkdir(parents=True, exist_ok=True)
    ui.prepare([])
    if not (folder / checkpoint).is_file():
        logger.warning("making %s (a full-size random SDXL base, fp16, about 7 GB; minutes)", folder / checkpoint)
        subprocess.run([str(ui.python), str(Path(__file__).with_name("make_sdxl.py")), str(folder / checkpoint), "1"],
                       cwd=ui.webui, env=ui.env(), check=True)
    ui.link_checkpoints([folder / checkpoint])
    rows = []
    for mode, options in MODES.items():  # a WebUI started afresh for each: no model of an earlier load left over
        group = MemoryLimit(int(limit_gib * GIB)) if limit_gib is not None else None
        record: dict[str, Any] = {"model": model, "checkpoint": checkpoint, "mode": mode}
        if group is not None:
            group.enter()
            record["limit_gib"] = limit_gib
        try:
            ui.start()
            ui.call("/sdapi/v1/options", {"sd_model_checkpoint": CHECKPOINT_A, **options})
            try:
                record.update(measure_switch(ui, checkpoint))
            except (OSError, RuntimeError) as exc:  # the WebUI was killed (out of memory under the limit)
                if group is None:
                    raise
                record["error"] = f"{type(exc).__name__}: {exc}"
            if group is not None:
                record["group_peak_gib"] = (group.peak_bytes() or 0) / GIB
                record["oom_kills"] = group.oom_kills()
                record["alive"] = ui.process is not None and ui.process.poll() is None
            logger.info("%s", record)
            rows.append(record)
        finally:
            ui.stop()
            if group is not None:
                group.leave()
                group.close()
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    limited = any("limit_gib" in r for r in rows)
    lines = ["| model | load | anonymous memory: peak growth GiB | left after GiB | RSS peak GiB (file pages too) "
             "| RSS after GiB | seconds |" + (" limit GiB | the group's peak GiB (page cache too) | WebUI |"
                                              if limited else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|---|" if limited else "")]
    for r in rows:
        if "error" in r:
            cells = "| - | - | - | - | - |"
        else:
            cells = (f"| {r['anon_peak'] - r['anon_before']:.2f} | {r['anon_after'] - r['anon_before']:.2f} | "
                     f"{r['rss_peak']:.2f} | {r['rss_after']:.2f} | {r['seconds']:.1f} |")
        extra = ""
        if limited:
            fate = "alive" if r.get("alive") else f"killed ({r.get('oom_kills', 0)} out-of-memory kill(s))"
            extra = f" {r.get('limit_gib', '-')} | {r.get('group_peak_gib', 0):.2f} | {fate} |"
        lines.append(f"| {r['model']} | {r['mode']} {cells}{extra}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench load", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["sd15"])
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--name", default=None, help="file name of the results (default load-<date>)")
    p.add_argument("--work-dir", type=Path, default=Path("build/bench-load"))
    p.add_argument("--memory-limit-gib", type=float, default=None,
                   help="run each WebUI in a memory cgroup of this size from its start (needs root)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = [row for model in args.models for row in run_model(model, args.work_dir, args.memory_limit_gib)]
    name = args.name or f"load-{time.strftime('%Y-%m-%d')}"
    args.out.mkdir(parents=True, exist_ok=True)
    info = machine()
    cpu = f"{info.get('Model name', '?')}, {info.get('Flags') or 'no AVX-512'}, {info.get('memory_gib')} GiB"
    header = {"cpu": cpu, "machine": info, "date": time.strftime("%Y-%m-%d"), "models": args.models}
    (args.out / f"{name}.json").write_text(json.dumps({**header, "rows": rows}, indent=2) + "\n", encoding="utf-8")
    lines = [f"# A checkpoint load's memory: A1111's own against the load into the weight file ({cpu})", "",
             "`python -m bench load` (bench/load.py): a WebUI of its own per model switches from the tiny checkpoint "
             "to the full-size one, once with the weight file off (A1111's load), once with *Enable for every "
             "generation* on, each in a WebUI started afresh; the WebUI process's memory read every 5 ms during "
             "each switch. Growth is from just "
             "before the switch (the tiny model loaded).", "", *table(rows), ""]
    (args.out / f"{name}.md").write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))  # noqa: T201 (the bench's report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
