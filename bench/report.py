"""Summaries of raw results, and the JSON and markdown files.

Ratios are speed ratios (higher is faster): "vs eager" is the eager median of the same
group's rounds divided by the variant's median; "vs static" is the static model's median
at the same precision divided by the variant's median (the goal for ov_backend is >= 0.97).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Any

from bench import variants
from ov_backend.memory import system_memory

logger = logging.getLogger(__name__)

GIB = float(1 << 30)


def machine() -> dict[str, Any]:
    """CPU model and core counts, memory, OS, and the library versions."""
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpus": os.cpu_count()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
        for line in lscpu.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "CPU family", "Model", "Core(s) per socket", "Socket(s)",
                               "Thread(s) per core", "Flags"):
                value = value.strip()
                if key.strip() == "Flags":
                    value = " ".join(f for f in value.split() if f.startswith(("avx512_bf16", "amx", "avx512f")))
                info[key.strip()] = value
    except (OSError, subprocess.SubprocessError) as err:
        logger.info("lscpu unavailable: %s", err)
    if "Model name" in info and "CPU family" in info:  # a VM's EPYC names no generation: Zen 3, 4 and 5 alike
        info["Model name"] += f" (family {info['CPU family']}, model {info.get('Model', '?')})"
    try:
        root = Path(__file__).resolve().parent.parent
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=False).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "ov_backend", "bench"],
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
        info["git_commit"] = commit + (" (ov_backend or bench modified)" if dirty else "")
    except (OSError, subprocess.SubprocessError) as err:
        logger.info("git unavailable: %s", err)
    memory = system_memory()
    if memory is not None:
        info["memory_gib"] = round(memory.total / (1 << 30), 1)
    import diffusers
    import openvino
    import torch
    import transformers

    from ov_backend.quantize import onednn_isa_cap

    cap = onednn_isa_cap()
    if cap:  # oneDNN (and OpenVINO's CPU plugin with it) runs only kernels up to this ISA: an emulation
        info["onednn_isa_cap"] = cap
    info["versions"] = {"torch": torch.__version__, "openvino": openvino.get_version(),
                        "diffusers": diffusers.__version__, "transformers": transformers.__version__}
    return info


def isa_cap_note(info: dict[str, Any]) -> str:
    """ " oneDNN capped at AVX2 (...)" when the run emulated an older CPU's kernels, else ""."""
    cap = info.get("onednn_isa_cap")
    if not cap:
        return ""
    return (f" oneDNN capped at {cap} (ONEDNN_MAX_CPU_ISA={cap}): OpenVINO's CPU plugin ran only kernels up to "
            f"{cap} on this CPU, an emulation of such a CPU's kernels, not such a CPU.")


def machine_line(info: dict[str, Any], device: str) -> str:
    """The machine a single-model profile ran on, in one line (CPU, flags, OpenVINO's name for it, versions)."""
    return (f"Machine: {info.get('Model name', '?')}, {info.get('cpus')} CPUs, {info.get('memory_gib')} GiB; "
            f"{info.get('Flags', '')}; OpenVINO CPU \"{device}\"; openvino {info['versions']['openvino']}, "
            f"torch {info['versions']['torch']}; commit {info.get('git_commit', '?')}.{isa_cap_note(info)}")


def add_profile_arguments(parser: Any, name: str) -> None:
    """The options every single-model profile takes: ``--quick``, ``--size``, ``--rounds``, ``--work-dir``,
    ``--out`` and ``--name`` (default ``name``)."""
    parser.add_argument("--quick", action="store_true", help="small model")
    parser.add_argument("--size", type=int, default=None, help="image size in pixels (default 512; quick 64)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--work-dir", required=True, help="weights (kept for the next run)")
    parser.add_argument("--out", required=True, help="writes <name>.md and <name>.json here")
    parser.add_argument("--name", default=name)


def write_profile(result: dict[str, Any], text: str, out: Path, name: str) -> None:
    """``<out>/<name>.md`` (``text``) and ``<out>/<name>.json`` (``result``) of a single-model profile."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text, encoding="utf-8")
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    logger.info("wrote %s.md and .json", out / name)


def _stats(times: list[float]) -> dict[str, float] | None:
    if not times:
        return None
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "n": len(times)}


def summarize(component: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per variant with medians, ratios, first calls, RSS and L2 difference."""
    records = component["variants"]
    eager_by_group = {g: statistics.median(t) for g, t in records.get("eager", {}).get("times_by_group", {}).items()
                      if t}
    static = {variants.parse_variant(v).precision: _stats(r["times"]) for v, r in records.items()
              if variants.parse_variant(v).kind == "static"}
    rows = []
    for name, record in records.items():
        spec = variants.parse_variant(name)
        stats = _stats(record["times"])
        row: dict[str, Any] = {"variant": name, "stats": stats, "errors": record.get("errors", [])}
        if stats is not None:
            groups = record.get("times_by_group", {})
            group = next(iter(groups), None) if spec.kind != "eager" else None
            eager = eager_by_group.get(group) if group else None
            if spec.kind == "eager":
                row["vs_eager"] = 1.0
            elif eager:
                row["vs_eager"] = eager / stats["median"]
            # an int8 variant is compared with the float ceiling it runs beside (static at auto)
            ceiling = (static.get("auto" if spec.precision == "int8" else spec.precision)
                       if spec.kind != "eager" else None)
            if ceiling:
                row["vs_static"] = ceiling["median"] / stats["median"]
        cpu = record.get("cpu_times")
        row["cpu_median"] = statistics.median(cpu) if cpu else None
        for key in ("cold_first_call_seconds", "warm_first_call_seconds", "peak_rss_bytes", "rel_l2_vs_eager",
                    "finite"):
            row[key] = record.get(key)
        rows.append(row)
    return rows


def _num(value: float | None, fmt: str = "{:.2f}") -> str:
    return "—" if value is None else fmt.format(value)


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def component_table(name: str, component: dict[str, Any]) -> str:
    """The markdown table of one component."""
    lines = [f"### {name}: {component['description']}", "",
             f"Inputs: {', '.join('x'.join(map(str, s)) or 'scalar' for s in component['input_shapes'])}", "",
             "| variant | median s/call | min | max | CPU s/call | vs eager | vs static | cold first call s "
             "| warm-cache first call s | peak RSS GiB | rel. L2 vs eager |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in summarize(component):
        stats = row["stats"] or {}
        rss = row["peak_rss_bytes"] / GIB if row["peak_rss_bytes"] else None
        l2 = row["rel_l2_vs_eager"]
        failed = " (failed: see JSON)" if row["errors"] and not stats else ""
        lines.append(
            f"| {row['variant']}{failed} | {_num(stats.get('median'), '{:.3f}')} | {_num(stats.get('min'), '{:.3f}')} "
            f"| {_num(stats.get('max'), '{:.3f}')} | {_num(row['cpu_median'], '{:.2f}')} "
            f"| {_ratio(row.get('vs_eager'))} | {_ratio(row.get('vs_static'))} "
            f"| {_num(row['cold_first_call_seconds'], '{:.1f}')} | {_num(row['warm_first_call_seconds'], '{:.1f}')} "
            f"| {_num(rss)} | {_num(l2, '{:.1e}')} |")
    split = first_call_split_table(component)
    if split:
        lines += ["", split]
    loads = component.get("load_average_per_round") or []
    if loads:
        lines += ["", f"1-minute load average at the start of each round: {', '.join(f'{x:.1f}' for x in loads)}"]
    return "\n".join(lines)


def first_call_split_table(component: dict[str, Any]) -> str:
    """Where ov_backend's first calls went, cold and with a warm cache; "" when not measured.

    The cache can only remove the build (tracing, conversion, compiling); dynamo's capture and
    the first inference are paid by every process.
    """
    rows = []
    for name, record in component["variants"].items():
        cold, warm = record.get("cold_first_call_split"), record.get("warm_first_call_split")
        for label, split, total in (("cold", cold, record.get("cold_first_call_seconds")),
                                    ("warm cache", warm, record.get("warm_first_call_seconds"))):
            if split and total:
                rows.append(f"| {name} | {label} | {total:.1f} | {split['capture']:.1f} | {split['build']:.1f} "
                            f"| {split['trace']:.1f} | {split['convert']:.1f} | {split['ov_compile']:.1f} "
                            f"| {split.get('quantize', 0.0):.1f} | {split['run']:.1f} |")
        if cold and warm and cold["build"] > 0:
            warm_total, cold_total = record.get("warm_first_call_seconds"), record.get("cold_first_call_seconds")
            whole = _num(warm_total / cold_total if warm_total and cold_total else None)
            rows.append(f"| {name} | warm/cold | {whole} | | {warm['build'] / cold['build']:.2f} | | | | | |")
    if not rows:
        return ""
    return "\n".join(["First calls of ov_backend, split (seconds): capture is dynamo reading the Python code "
                      "(every process pays it); build is what the disk cache saves (trace, convert, OpenVINO "
                      "compile, INT8 quantization, cache reads and writes, weight hashing); run is the first "
                      "inference (at int8: with the float calls recorded for calibration).", "",
                      "| variant | process | first call | capture | build | trace | convert | OV compile | quantize "
                      "| run |",
                      "|---|---|---|---|---|---|---|---|---|---|", *rows])


def short_report(text: str, keep: int = 4) -> str:
    """A backend report line with long input signatures shortened to their tensors and a scalar count.

    ``torch.compile(dynamic=True)`` turns hundreds of Python floats (norm epsilons, scales) into
    graph inputs, and each is part of the signature.
    """
    head, sep, rest = text.partition(" (")
    signature, sep2, tail = rest.partition("): ")
    if not sep or not sep2:
        return text
    items = signature.split(", ")
    if len(items) <= keep:
        return text
    tensors = [i for i in items if "[" in i]
    return f"{head} ({', '.join(tensors)}, +{len(items) - len(tensors)} Python scalars): {tail}"


def resolutions_table(result: dict[str, Any]) -> str:
    """The markdown table of the new-shape measurement."""
    if "error" in result:
        return f"### New resolutions\n\nFailed: {result['error'].splitlines()[-1]}"
    how = "torch.compile(dynamic=True)" if result.get("dynamic") else "torch.compile default (dynamic=None)"
    lines = [f"### New resolutions: {result['component']} through ov_backend ({result['precision']}, {how}), "
             "one process, caching off",
             "", "| call order | latent | image | first call s | second call s |", "|---|---|---|---|---|"]
    for number, rec in enumerate(result["records"], 1):
        lines.append(f"| {number} | {rec['latent'][0]}x{rec['latent'][1]} | {rec['image'][0]}x{rec['image'][1]} "
                     f"| {rec['first_call_seconds']:.1f} | {rec['second_call_seconds']:.2f} |")
    reports = result.get("info", {}).get("reports", [])
    if reports:
        lines += ["", "Backend reports:", ""] + [f"- {short_report(r)}" for r in reports]
    return "\n".join(lines)


def image_table(result: dict[str, Any], components: dict[str, Any]) -> str:
    """The markdown table of the whole-image split, against the sum of the static parts."""
    if "error" in result:
        return f"### Whole image\n\nFailed: {result['error'].splitlines()[-1]}"
    precision = result["precision"]
    static_key = f"static/{precision}"
    lines = [f"### Whole image: {result['size']}x{result['size']}, {result['steps']} steps ({result['sampler']}), "
             f"ov_backend {precision}, standalone pipeline", "",
             "| part | calls | seconds | share of the image | static model, same calls |", "|---|---|---|---|---|"]
    total, static_sum, complete = result["image_seconds"], 0.0, True
    for part, rec in result["parts"].items():
        times = components.get(part, {}).get("variants", {}).get(static_key, {}).get("times")
        static = rec["calls"] * statistics.median(times) if times else None
        if static is None:
            complete = False
        else:
            static_sum += static
        lines.append(f"| {part} | {rec['calls']} | {rec['seconds']:.2f} | {100 * rec['seconds'] / total:.1f} % "
                     f"| {_num(static)} |")
    lines.append(f"| everything else | | {result['other_seconds']:.2f} | {100 * result['other_fraction']:.1f} % | |")
    lines.append(f"| **image** | | **{total:.2f}** | 100 % | {_num(static_sum if complete else None)} |")
    lines += ["", f"Warm-up image (1 step, compiles every part): {result['warmup_image_seconds']:.1f} s."]
    return "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    """The whole markdown report."""
    m = results["machine"]
    lines = ["# Benchmark results", "",
             f"Machine: {m.get('Model name', '?')}, {m.get('cpus')} CPUs "
             f"({m.get('Core(s) per socket', '?')} cores per socket x {m.get('Socket(s)', '?')} socket, "
             f"{m.get('Thread(s) per core', '?')} thread per core), {m.get('memory_gib', '?')} GiB; "
             f"{m.get('Flags', '')}; " + ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items()) + "."
             + isa_cap_note(m), "",
             f"Command: `{results['command']}` ({results['wall_seconds'] / 60:.1f} min), "
             f"at commit {m.get('git_commit', '?')}.", "",
             "Per-call times are medians of the interleaved rounds (min and max beside); ratios are speed "
             "ratios (higher is faster): vs eager against PyTorch eager fp32 in the same rounds, vs static "
             "against the static OpenVINO model at the same precision. \"auto\" lets the CPU plugin choose "
             "the inference precision (bf16 on this CPU); CPU s/call is the median CPU time of the worker "
             "process per call, all threads (less sensitive than wall time to other processes on the cores, "
             "though spinning threads count); peak RSS is each variant's own process, its "
             "PyTorch weights included (mapped from one file shared by all processes).", ""]
    if results.get("note"):
        lines += [results["note"], ""]
    for name, component in results["components"].items():
        lines += [component_table(name, component), ""]
    if "resolutions" in results:
        lines += [resolutions_table(results["resolutions"]), ""]
    if "image" in results:
        lines += [image_table(results["image"], results["components"]), ""]
    return "\n".join(lines)


def write(results: dict[str, Any], out: Path, stem: str) -> tuple[Path, Path]:
    """Write ``stem.json`` (raw results and summaries) and ``stem.md`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for component in results["components"].values():
        component["summary"] = summarize(component)
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
    md_path.write_text(markdown(results), encoding="utf-8")
    return json_path, md_path
