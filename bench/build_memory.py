"""``python -m bench.build_memory``: the resident memory of one component through its first compile and calls,
sampled every 50 ms, with the build's phases marked (docs/memory.md).

It answers "when, during a build, does the process hold what": the component's PyTorch weights (anonymous
memory), the weight file's pages (file-backed) and OpenVINO's packed copy (anonymous again). Example, the
full-size SDXL UNet at 1024x1024 with PyTorch's weights in a memory-mapped file::

    python -m bench.build_memory --component sdxl_unet --size 1024 --precision auto --weights-in-file

``--drop-seconds`` sets how often the weight file's pages leave the process while a model builds
(``ov_backend.weight_file.PACKING_DROP_SECONDS``), to compare with the default.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from bench.models import build_module, component, example_inputs

SAMPLE_SECONDS = 0.05
_FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
GIB = float(1 << 30)


def memory_now() -> dict[str, float]:
    """This process's resident memory in GiB: all, anonymous, file-backed, and its peak."""
    out: dict[str, float] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in _FIELDS:
            out[key] = int(value.split()[0]) * 1024 / GIB
    return out


class Timeline:
    """Samples :func:`memory_now` on a thread, and phase marks (the caller's and the backend's log lines)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.marks: list[tuple[float, str]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> Timeline:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.samples.append((self.now(), memory_now()))

    def now(self) -> float:
        return time.perf_counter() - self.start

    def _sample(self) -> None:
        while not self._done.wait(SAMPLE_SECONDS):
            self.samples.append((self.now(), memory_now()))

    def mark(self, what: str) -> None:
        self.marks.append((self.now(), what))

    def phases(self) -> list[dict[str, Any]]:
        """Per interval between marks: its end mark, and the sample with the most resident memory in it."""
        out: list[dict[str, Any]] = []
        begin = 0.0
        for at, what in [*self.marks, (float("inf"), "end")]:
            inside = [s for t, s in self.samples if begin <= t < at]
            if inside:
                top = max(inside, key=lambda s: s["VmRSS"])
                out.append({"until": what, "seconds": round(min(at, self.now()) - begin, 1),
                            **{f"max_{k}": round(v, 2) for k, v in top.items() if k != "VmHWM"}})
            begin = at
        return out


class _Marks(logging.Handler):
    def __init__(self, timeline: Timeline) -> None:
        super().__init__(logging.INFO)
        self.timeline = timeline

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("ov_backend"):
            self.timeline.mark(record.getMessage()[:160])


def run(component_name: str, size: int, precision: str, weights_in_file: bool,
        drop_seconds: float | None, calls: int, work: Path) -> dict[str, Any]:
    import ov_backend.weight_file as weight_file
    from ov_backend import OVBackend

    if drop_seconds is not None:
        weight_file.PACKING_DROP_SECONDS = drop_seconds
    with Timeline() as timeline:
        handler = _Marks(timeline)
        logging.getLogger("ov_backend").addHandler(handler)
        logging.getLogger("ov_backend").setLevel(logging.INFO)
        try:
            torch.manual_seed(0)
            module = build_module(component_name, False).eval()
            inputs = example_inputs(component_name, False, size)
            timeline.mark("PyTorch module built")
            options: dict[str, Any] = {"device": "CPU", "model_caching": False, "cache_dir": str(work),
                                       "precision": precision, "weights_in_file": weights_in_file}
            backend = OVBackend(options)
            original = backend.build_context.compile_model

            def compile_model(model: Any) -> Any:
                timeline.mark("OpenVINO compile_model starts")
                compiled = original(model)
                timeline.mark("OpenVINO compile_model ends")
                return compiled

            object.__setattr__(backend.build_context, "compile_model", compile_model)  # a frozen dataclass
            compiled = torch.compile(module, backend=backend)
            with torch.no_grad():
                for k in range(calls):
                    compiled(*inputs)
                    timeline.mark(f"call {k + 1} done")
        finally:
            logging.getLogger("ov_backend").removeHandler(handler)
    last = timeline.samples[-1][1]
    return {"component": component_name, "size": size, "precision": precision, "weights_in_file": weights_in_file,
            "drop_seconds": weight_file.PACKING_DROP_SECONDS, "peak_gib": round(last["VmHWM"], 2),
            "rss_after_gib": round(last["VmRSS"], 2), "phases": timeline.phases(), "stats": backend.stats()}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"{result['component']} at {result['size']}, {result['precision']}, weights in a file: "
             f"{result['weights_in_file']}, pages dropped every {result['drop_seconds']} s while building: "
             f"peak {result['peak_gib']} GiB, after {result['rss_after_gib']} GiB", "",
             "| phase, until | s | max RSS GiB | of it anonymous | of it file pages |", "|---|---|---|---|---|"]
    for p in result["phases"]:
        lines.append(f"| {p['until']} | {p['seconds']} | {p['max_VmRSS']} | {p['max_RssAnon']} | {p['max_RssFile']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.build_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--component", default="unet", help="a bench component (unet, sdxl_unet, vae_decoder, ...)")
    parser.add_argument("--size", type=int, default=512, help="image size in pixels (default 512)")
    parser.add_argument("--precision", default="auto", help="the backend's precision (default auto)")
    parser.add_argument("--weights-in-file", action="store_true", help="PyTorch's weights in a memory-mapped file")
    parser.add_argument("--drop-seconds", type=float, default=None,
                        help="how often the file's pages leave the process while building (default: the backend's)")
    parser.add_argument("--calls", type=int, default=2, help="calls after the compile (default 2)")
    parser.add_argument("--work-dir", type=Path, default=Path("build"),
                        help="where the weight file and the cache go (default build/; not a tmpfs: a weight file "
                             "there saves nothing)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    try:
        component(args.component)
    except ValueError as err:
        parser.error(str(err))
    args.work_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="build-memory-", dir=args.work_dir) as work:
        result = run(args.component, args.size, args.precision, args.weights_in_file, args.drop_seconds,
                     args.calls, Path(work))
    sys.stdout.write(markdown(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
