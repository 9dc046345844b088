"""The results of ``python -m bench webui``: the header (machine, commit, command) and the markdown tables.

Times are wall-clock seconds of one request each (one run, stock and accelerated in the same WebUI
process, so ratios are within one run); "x stock" is accelerated / stock (below 1 is faster), "speed-up"
is stock s/it / accelerated s/it. Seconds per step come from the WebUI's progress (A1111's, which Forge keeps) and
leave out the first two steps, where a new shape compiles.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from bench import report
from ov_backend.memory import system_memory

logger = logging.getLogger(__name__)

#: What the report calls each WebUI the bench drives (``WebUIBenchSettings.webui``): its name, its version, and how
#: it computes its stock pictures (the reference of the PSNR table)
WEBUIS = {"a1111": ("A1111", "v1.10.1", "PyTorch f32: `--no-half --precision full`"),
          "forge": ("Forge", "(main at dfdcbab6)", "PyTorch on the CPU, `--always-cpu`: UNet and VAE in f32, the text "
                    "encoder's weights in fp16 as Forge loads them")}
#: Rows of the seconds-per-step table: (row key, label).
S_PER_IT_ROWS = (("again", "first size, batch 1"), ("batch", "first size, batch {batch}"),
                 ("size2", "second size, batch 1"), ("size3", "third size, batch 1"))


def cpu_summary() -> dict[str, Any]:
    """Model name, the instruction sets that decide OpenVINO's precision, and OpenVINO's name for the CPU."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError as err:
        logger.info("no /proc/cpuinfo: %s", err)
    summary: dict[str, Any] = {
        "AVX2": "avx2" in flags, "AVX-512": "avx512f" in flags,
        "AMX": any(f.startswith("amx") for f in flags),
        "BF16": sorted(f for f in flags if "bf16" in f) or False,
    }
    try:
        import openvino

        summary["openvino_device"] = openvino.Core().get_property("CPU", "FULL_DEVICE_NAME")
    except (ImportError, RuntimeError) as err:
        summary["openvino_device"] = f"unknown ({err})"
    return summary


def run_header(command: str, note: str | None) -> dict[str, Any]:
    """What a results file says about the run's circumstances before any number (the machine, the CPU, the
    memory and load at the start, where the extension came from); ``bench soak`` shares it."""
    memory = system_memory()
    return {
        "command": command, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "note": note,
        "machine": report.machine(), "cpu": cpu_summary(),
        "available_gib_at_start": round(memory.available / (1 << 30), 1) if memory is not None else None,
        "load_average_at_start": os.getloadavg()[0],
        "extension_source": "working tree" if os.environ.get("OV_REAL_WEBUI_SOURCE") == "worktree"
        else "git clone of the checkout's HEAD",
    }


def header(config: Any, command: str, note: str | None) -> dict[str, Any]:
    """What the results file says about the run before any number."""
    return {
        **run_header(command, note),
        "settings": {"webui": config.webui, "tiny": config.tiny, "model": config.model,
                     "precisions": list(config.precisions), "steps": config.steps,
                     "sizes": ["x".join(map(str, s)) for s in config.sizes], "batch": config.batch,
                     "rows": list(config.rows), "sampler": "Euler", "cfg_scale": 7,
                     "testbed": testbed_label(Path(config.testbed), "FORGE_ROOT" if config.webui == "forge"
                                              else "A1111_ROOT"), "previous_weights": config.previous_weights,
                     "weights_in_file": config.weights_in_file, "enable_always": config.enable_always},
    }


def testbed_label(testbed: Path, variable: str = "A1111_ROOT") -> str:
    """The test bed as the results name it: relative to the checkout when inside it (``build/a1111-testbed``),
    else the environment variable that names it, ``$A1111_ROOT`` (``$FORGE_ROOT``: ``variable``; a results file
    names no folder of the machine it ran on)."""
    try:
        return str(testbed.resolve().relative_to(Path(__file__).resolve().parents[1]))
    except ValueError:
        return f"${variable}"


def model_title(settings: dict[str, Any]) -> str:
    if settings["tiny"] and settings.get("webui") == "forge":
        return "the Forge tier's SD 1.5 checkpoint: full-size CLIP and VAE, a small UNet"
    if settings["tiny"]:
        return "tiny test models"
    return "full-size SDXL base" if settings.get("model") == "sdxl" else "full-size SD 1.5"


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if value is None else fmt.format(value)


def _find(rows: list[dict[str, Any]], mode: str, key: str) -> dict[str, Any]:
    return next((r for r in rows if r["mode"] == mode and r["key"] == key), {})


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _machine_lines(results: dict[str, Any]) -> list[str]:
    machine, cpu, s = results["machine"], results["cpu"], results["settings"]
    isa = ", ".join(f"{k} {'yes' if v else 'no'}" if isinstance(v, bool) else f"{k} {' '.join(v)}"
                    for k, v in cpu.items() if k != "openvino_device")
    versions = ", ".join(f"{k} {v}" for k, v in machine.get("versions", {}).items())
    return [
        f"- Command: `{results['command']}` (started {results['started']})",
        f"- Commit: the WebUI ran the extension at {results.get('extension_commit', '?')} "
        f"({results['extension_source']}); the bench ran from {machine.get('git_commit', '?')}",
        f"- CPU: {machine.get('Model name', '?')}, {machine.get('cpus')} logical CPUs; {isa}; "
        f"OpenVINO CPU device: {cpu.get('openvino_device')}",
        f"- Memory: {machine.get('memory_gib')} GiB, {results['available_gib_at_start']} GiB available at the "
        f"start; 1-minute load average at the start {results['load_average_at_start']:.1f}",
        f"- Bench process: {versions}; the WebUI runs in the test bed's own venv ({s['testbed']})",
        f"- Requests: txt2img, Euler, {s['steps']} steps, CFG {s['cfg_scale']}, sizes {', '.join(s['sizes'])}, "
        f"a new prompt each time; {model_title(s)}{'' if s['tiny'] else ' (random weights)'}",
    ] + ([f"- The extension's setting for the previous weights' compiled models: {s['previous_weights']}"]
         if s.get("previous_weights") else []) + (
        [f"- PyTorch's copy of the accelerated weights in a memory-mapped file (the extension's setting): "
         f"{s['weights_in_file']}"] if s.get("weights_in_file") else []) + (
        ["- Settings -> OpenVINO -> Enable for every generation: on from the WebUI's start (the weights moved into "
         "the file as each checkpoint loaded)"] if s.get("enable_always") else []) + (
        [f"- Note: {results['note']}"] if results.get("note") else [])


def markdown(results: dict[str, Any]) -> str:
    """All tables of one run."""
    rows, phases, s = results.get("rows", []), results.get("phases", []), results["settings"]
    modes = s["precisions"]
    title = model_title(s)
    webui, version, arithmetic = WEBUIS[s.get("webui", "a1111")]
    lines = [f"# Real WebUI benchmark: stock {webui} {version} vs Accelerate with OpenVINO ({title})", "",
             *_machine_lines(results), "", "## Time per request (seconds)", "",
             "Each request once, in this order, stock first, then accelerated at each precision, in one WebUI "
             "process; the restart row is the first generation of a new process with the disk cache of the first "
             "(its stock number is stock's first generation after its start). Compile and cache hits are the "
             "extension's status route for that request; peak RSS is the WebUI process's VmHWM after it.", ""]
    head = "| request | size | batch | stock s |"
    rule = "|---|---|---|---|"
    for m in modes:
        head += f" {m} s | {m} x stock | {m} compile s | {m} compiles | {m} cache hits | {m} peak RSS GiB |"
        rule += "---|---|---|---|---|---|"
    lines += [head, rule]
    for key in dict.fromkeys(r["key"] for r in rows):  # the scenario's order
        first = next(r for r in rows if r["key"] == key)
        stock = _find(rows, "stock", first.get("reference") or key)
        line = f"| {first['label']} | {first['size']} | {first['batch']} | {_num(stock.get('seconds'))} |"
        for m in modes:
            r = _find(rows, m, key)
            failed = " (failed)" if "error" in r else ""
            ratio = _ratio(r.get("seconds"), stock.get("seconds"))
            line += (f" {_num(r.get('seconds'))}{failed} | {_num(ratio, '{:.2f}x')}"
                     f" | {_num(r.get('compile_seconds'))} | {_num(r.get('compiles'), '{}')} "
                     f"| {_num(r.get('cache_hits'), '{}')} | {_num(r.get('peak'), '{:.2f}')} |")
        lines.append(line)
    loads = [r for r in rows if r.get("load_seconds")]
    if loads:
        lines += ["", "Checkpoint loads (A1111's own, before the request): " + "; ".join(
            f"{r['mode']} {r['label']} {r['load_seconds']:.1f} s" for r in loads) + "."]
    lines += ["", "## Seconds per sampling step", "", "| request | stock s/it | "
              + " | ".join(f"{m} s/it | {m} speed-up" for m in modes) + " |",
              "|---|---|" + "---|---|" * len(modes)]
    def step(record: dict[str, Any]) -> str:
        mark = "" if record.get("s_per_it_from_progress", True) else " (r)"
        return _num(record.get("s_per_it"), "{:.2f}") + mark

    for key, label in S_PER_IT_ROWS:
        stock = _find(rows, "stock", key)
        cells = []
        for m in modes:
            record = _find(rows, m, key)
            speed = _ratio(stock.get("s_per_it"), record.get("s_per_it"))
            cells.append(f"{step(record)} | {_num(speed, '{:.2f}x')}")
        lines.append(f"| {label.format(batch=s['batch'])} | {step(stock)} | " + " | ".join(cells) + " |")
    lines += ["", "From the WebUI's progress (A1111's route, which Forge keeps), steps 3 on; (r): steps too fast to "
              "follow, the request's seconds / steps (text encoder, VAE and any compile included)."]
    lines += ["", "## Images against stock (PSNR dB)", "",
              f"Each accelerated image against stock {webui}'s ({arithmetic}) for the same request, prompt and "
              "seed. "
              "Random weights make noise, not pictures: the numbers say how far the arithmetic moved the pixels.", "",
              "| request | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for key in dict.fromkeys(r["key"] for r in rows if r["mode"] != "stock"):
        label = next(r["label"] for r in rows if r["key"] == key)
        lines.append(f"| {label} | " + " | ".join(_num(_find(rows, m, key).get("psnr_vs_stock")) for m in modes) + " |")
    lines += step_cache_lines(rows, modes)
    lines += request_peak_lines(rows, modes)
    lines += ["", "## Memory and disk cache", "",
              "| after | process | peak RSS GiB (VmHWM since the last request began) | the process's whole life so far "
              "(start, loads, every request) | RSS GiB | disk cache |", "|---|---|---|---|---|---|"]
    for p in phases:
        cache = f"{p['cache_bytes'] / (1 << 30):.2f} GiB in {p['cache_files']} files" if p["cache_files"] else "empty"
        life = _num(p.get("life_peak"), "{:.2f}")
        lines.append(f"| {p['mode']} | {p['process']} | {p['peak']:.2f} | {life} | {p['rss']:.2f} | {cache} |")
    lines += ["", "The whole session's peak of each kind of run, each in a WebUI of its own and under a memory limit: "
              "`python -m bench session`."]
    lines += ["", *goals(results)]
    lines += not_as_chosen_lines(rows)
    errors = [r for r in rows if "error" in r]
    if errors:
        lines += ["", "## Failures", ""] + [
            f"- {r['mode']} / {r['label']}: `{r['error'][:300]}` (during it: the WebUI's peak RSS "
            f"{_num(r.get('peak_seen'), '{:.2f}')} GiB, the machine's least available memory "
            f"{_num(r.get('least_available_gib'), '{:.2f}')} GiB)" for r in errors]
    return "\n".join(lines) + "\n"


def not_as_chosen_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The requests whose status says a part did not run at the precision the row is named after (at "int8": the
    UNet left at float, with why), so that no figure passes for what it is not."""
    found = []
    for r in rows:
        status = (r.get("status") or "").splitlines()
        said = [line for line in status if line.startswith("Not at INT8")]
        # (a status before that line was added: the graph's own report line)
        said = said or [line[line.index("INT8 quantization failed"):] for line in status
                        if "INT8 quantization failed" in line][:1]
        found += [(r, line) for line in said]
    if not found:
        return []
    return ["", "## Not at the precision chosen", ""] + [f"- {r['mode']} / {r['label']}: {line}" for r, line in found]


def request_peak_lines(rows: list[dict[str, Any]], modes: list[str]) -> list[str]:
    """Each request's own peak RSS: the WebUI's VmHWM started again (``clear_refs``) after the checkpoint
    load and before the request, read after it; against stock's for the same request."""
    if not any(r.get("request_peak") for r in rows):
        return []
    lines = ["", "## Peak RSS of each request (GiB)", "",
             "The WebUI's peak resident memory during the request alone: its VmHWM is started again from its RSS "
             "after the checkpoint load and before the request (`/proc/<pid>/clear_refs`), so neither the load's "
             "peak nor an earlier request's hides it.", "",
             "| request | stock | " + " | ".join(f"{m} | {m} / stock" for m in modes) + " |",
             "|---|---|" + "---|---|" * len(modes)]
    for key in dict.fromkeys(r["key"] for r in rows):
        first = next(r for r in rows if r["key"] == key)
        stock = _find(rows, "stock", first.get("reference") or key).get("request_peak")
        line = f"| {first['label']} | {_num(stock, '{:.2f}')} |"
        for m in modes:
            mine = _find(rows, m, key).get("request_peak")
            line += f" {_num(mine, '{:.2f}')} | {_num(_ratio(mine, stock), '{:.2f}x')} |"
        lines.append(line)
    return lines


def step_cache_lines(rows: list[dict[str, Any]], modes: list[str]) -> list[str]:
    """The step caching table: each cached request against the same mode's uncached one ("again")."""
    cached = [r for r in rows if r.get("step_cache_interval", 1) > 1 and r["mode"] in modes]
    if not cached:
        return []
    lines = ["", "## Step caching", "",
             "Each request with step caching against the same precision's uncached request at the same size, "
             "prompt and seed (\"same size again\"): whole-request seconds and seconds per step (A1111's progress, "
             "steps 3 on), the UNet's full and shallow calls (the status route), and the image's PSNR against the "
             "uncached one and against stock's. The first request with step caching builds its two models.", "",
             "| precision | request | interval | s | vs uncached | s/it | s/it vs uncached | full calls | "
             "shallow calls | compile s | PSNR vs uncached dB | PSNR vs stock dB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in modes:
        uncached = _find(rows, m, "again")
        if uncached:
            lines.append(f"| {m} | {uncached['label']} | 1 | {_num(uncached.get('seconds'))} | 1.00x | "
                         f"{_num(uncached.get('s_per_it'), '{:.2f}')} | 1.00x | | | "
                         f"{_num(uncached.get('compile_seconds'))} | — | {_num(uncached.get('psnr_vs_stock'))} |")
        for r in (r for r in cached if r["mode"] == m):
            facts = r.get("step_cache") or {}
            speed = _ratio(uncached.get("seconds"), r.get("seconds"))
            step_speed = _ratio(uncached.get("s_per_it"), r.get("s_per_it"))
            lines.append(f"| {m} | {r['label']} | {r['step_cache_interval']} | {_num(r.get('seconds'))} | "
                         f"{_num(speed, '{:.2f}x')} | {_num(r.get('s_per_it'), '{:.2f}')} | "
                         f"{_num(step_speed, '{:.2f}x')} | {_num(facts.get('full_calls'), '{}')} | "
                         f"{_num(facts.get('shallow_calls'), '{}')} | {_num(r.get('compile_seconds'))} | "
                         f"{_num(r.get('psnr_vs_uncached'))} | {_num(r.get('psnr_vs_stock'))} |")
    return lines


def goals(results: dict[str, Any]) -> list[str]:
    """The issue's targets, as ratios of this run's numbers."""
    rows, phases = results.get("rows", []), results.get("phases", [])
    peak = {p["mode"]: p["peak"] for p in phases}
    lines = ["## Against the targets", "", "| measure | " + " | ".join(results["settings"]["precisions"])
             + " | target |", "|---|" + "---|" * len(results["settings"]["precisions"]) + "---|"]

    def cold(m: str, key: str) -> float | None:
        return _ratio(_find(rows, m, key).get("seconds"), _find(rows, m, "first").get("seconds"))

    def above_run(m: str, key: str) -> float | None:
        # what a request costs beyond running its compiled models: compiles, dynamo's capture, A1111's own
        # work outside the models (e.g. its Lora extension writing weights); comparable across image sizes,
        # where the request's seconds are not (a 512x512 run is longer than a 512x384 one)
        row = _find(rows, m, key)
        return row["seconds"] - row["run_seconds"] if row.get("seconds") and row.get("run_seconds") else None

    measures = [
        ("peak RSS accelerated / stock (process 1)", lambda m: _ratio(peak.get(m), peak.get("stock")), "<= 1.6x"),
        ("peak RSS after a restart / stock", lambda m: _ratio(peak.get(f"{m} after restart"), peak.get("stock")),
         "<= 1.6x"),
        ("second size / cold first generation", lambda m: cold(m, "size2"), "<= 0.25x"),
        ("second size / cold first generation, seconds above the run",
         lambda m: _ratio(above_run(m, "size2"), above_run(m, "first")), "(<= 0.25x)"),
        ("third size / cold first generation", lambda m: cold(m, "size3"), "<= 0.25x"),
        ("warm restart / cold first generation", lambda m: cold(m, "restart"), "<= 0.3x"),
        ("switch back / cold first generation", lambda m: cold(m, "switch_back"), "<= 0.2x"),
        ("LoRA weight change / second size", lambda m: _ratio(_find(rows, m, "lora_change").get("seconds"),
                                                              _find(rows, m, "size2").get("seconds")), "<= 1x"),
        ("LoRA weight change / second size, seconds above the run", lambda m: _ratio(above_run(m, "lora_change"),
                                                                                   above_run(m, "size2")), "<= 1x"),
        ("LoRA weight change / second size, the extension's build seconds",
         lambda m: _ratio(_find(rows, m, "lora_change").get("compile_seconds"),
                          _find(rows, m, "size2").get("compile_seconds")), "<= 1x"),
    ]
    for label, fn, target in measures:
        lines.append(f"| {label} | " + " | ".join(_num(fn(m), "{:.2f}x") for m in results["settings"]["precisions"])
                     + f" | {target} |")
    costs = []
    for m in results["settings"]["precisions"]:
        lora, size2 = _find(rows, m, "lora_change"), _find(rows, m, "size2")
        lora_above, size2_above = above_run(m, "lora_change"), above_run(m, "size2")
        if lora_above is not None and size2_above is not None:
            costs.append(f"{m}: LoRA weight change {lora_above:.1f} s above its run (the extension's "
                         f"build {_num(lora.get('compile_seconds'))} s, A1111's Lora extension writing the weights "
                         f"{_num(lora.get('lora_write_seconds'))} s), second size {size2_above:.1f} s "
                         f"(build {_num(size2.get('compile_seconds'))} s)")
    if costs:
        lines += ["", "Seconds above the run: the request's seconds less the time in its compiled models' calls "
                  "(the request's own size and steps cancel out). " + "; ".join(costs) + "."]
    lines += ["", "The size targets compare whole requests, so they depend on the step count: the fewer the steps, "
              "the larger a request's own run against the cold generation's compiles. The row \"seconds above the "
              "run\" compares only what each request adds to running its models (its target in brackets: the "
              "issue sets it for whole requests)."]
    return lines


def write(results: dict[str, Any], out: Path, stem: str) -> tuple[Path, Path]:
    """``<out>/<stem>.json`` (every number and status text) and ``<out>/<stem>.md`` (the tables)."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
    md_path.write_text(markdown(results), encoding="utf-8")
    return json_path, md_path
