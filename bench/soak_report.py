"""The files of a ``python -m bench soak`` run: ``<stem>.json`` (every record and bound), ``<stem>.md`` (the bounds,
a summary and a row per request) and ``<stem>.png`` (the WebUI's RSS and the compiled models held per request)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from bench.webui_report import run_header, testbed_label

logger = logging.getLogger(__name__)

MIB = float(1 << 20)


def header(config: Any, command: str, note: str | None) -> dict[str, Any]:
    """What the results file says about the run before any number."""
    return {
        **run_header(command, note),
        "settings": {"model": config.model, "requests": config.requests, "minutes": config.minutes,
                     "seed": config.seed, "sizes": ["x".join(map(str, s)) for s in config.sizes],
                     "new_size_every": config.new_size_every, "size_step": config.size_step,
                     "steps": config.steps, "precision": config.precision,
                     "sample_every": config.sample_every, "previous_weights": config.previous_weights,
                     "stock": config.stock, "stock_baseline": config.stock_baseline,
                     "sampler": "Euler", "testbed": testbed_label(Path(config.testbed))},
    }


def _num(value: Any, fmt: str = "{:.1f}") -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return fmt.format(value)


def _verdict(passed: bool | None) -> str:
    return {True: "pass", False: "**FAIL**", None: "n/a"}[passed]


def _what(r: dict[str, Any]) -> str:
    what = r["kind"]
    if r.get("route") == "section" or r["kind"] in ("prompts", "xyz"):
        what += " (section)"
    if r.get("partner"):
        what += f" + {r['partner']['size']} x{r['partner']['batch_size']}"
    return what


def markdown(results: dict[str, Any]) -> str:
    s, machine, records = results["settings"], results["machine"], results.get("records", [])
    options = results.get("options", {})
    lines = [f"# Soak: {'the tier' + chr(39) + 's tiny models' if s['model'] == 'tiny' else 'full-size SD 1.5'} "
             "in the real WebUI", "",
             f"- Command: `{results['command']}` (started {results['started']})",
             f"- Commit: the WebUI ran the extension at {results.get('extension_commit', '?')} "
             f"({results['extension_source']}); the bench ran from {machine.get('git_commit', '?')}",
             f"- CPU: {machine.get('Model name', '?')}, {machine.get('cpus')} logical CPUs; OpenVINO CPU device: "
             f"{results['cpu'].get('openvino_device')}",
             f"- Memory: {machine.get('memory_gib')} GiB, {results['available_gib_at_start']} GiB available at the "
             f"start; 1-minute load average at the start {results['load_average_at_start']:.1f}",
             f"- Stream: seed {s['seed']}, size pool {', '.join(s['sizes'])}, a new size every "
             f"{s['new_size_every']} requests after the warm-up (by {s['size_step']} px), Euler {s['steps']} steps, "
             "the extension at "
             + (f"{s['precision']}; every {s['sample_every']}th request (and the first of each kind) against stock"
              if not s.get("stock") else "**off** (stock A1111's own curve for the stream; nothing compared)"),
             f"- Settings -> OpenVINO: keep every compiled size {options.get('openvino_keep_all_sizes')}, previous "
             f"weights' models {options.get('openvino_previous_weights')}",
             f"- WebUI start {_num(results.get('start_seconds'))} s; RSS of its process tree after the start "
             f"{_num(results.get('after_start', {}).get('rss_gib'), '{:.2f}')} GiB"]
    baseline = (results.get("stock_baseline") or {}).get("records") or []
    if baseline:
        lines.append(f"- Stock baseline: the same stream with the extension off, in a WebUI process of its own "
                     f"before the run: RSS {_num(baseline[0].get('rss_gib'), '{:.2f}')} -> "
                     f"{_num(baseline[-1].get('rss_gib'), '{:.2f}')} GiB over {len(baseline)} requests "
                     "(the grey curve)")
    if results.get("note"):
        lines.append(f"- Note: {results['note']}")
    if records:
        last = records[-1]
        lines.append(f"- {len(records)} requests in {_num(last.get('elapsed_seconds', 0) / 60)} minutes, "
                     f"{sum(r.get('images') or 0 for r in records)} images; peak RSS "
                     f"{_num(max(r.get('peak_gib') or 0 for r in records), '{:.2f}')} GiB")
    lines += ["", "## Bounds", "", "| bound | rule | measured | verdict |", "|---|---|---|---|"]
    for b in results.get("bounds", []):
        lines.append(f"| {b['name']} | {b['rule']} | {b['measured']} | {_verdict(b['passed'])} |")
    if results.get("picture"):
        lines += ["", f"![RSS and compiled models per request]({results['picture']})"]
    lines += ["", "## Requests", "",
              "Memory after each request: RSS of the WebUI's process tree, peak = its Python process's VmHWM. Held: "
              "compiled OpenVINO models the extension holds (status route). Cache: the disk cache's size. Compiles, "
              "conversion seconds, OpenVINO and PyTorch calls: the status route's last run (a pair's second "
              "client's). PSNR: lowest against stock, same request and seed. W: warm-up; N: a size never seen.", "",
              "| # | request | size | batch x count | LoRA | ckpt | s | images | RSS GiB | peak GiB | held | "
              "cache MiB | compiles | conv. s | OV calls | PT calls | PSNR dB | error |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        flags = ("W" if r.get("warmup") else "") + ("N" if r.get("new_size") else "")
        lines.append(
            f"| {r['index']}{' ' + flags if flags else ''} | {_what(r)} | {r['size']} | {r['batch_size']} x "
            f"{r['n_iter']} | {_num(r.get('lora'), '{:g}') if r.get('lora') is not None else 'off'} | "
            f"{'B' if r.get('checkpoint') else 'A'} | {_num(r.get('seconds'))} | {r.get('images', '—')}/"
            f"{r['expected_images']} | {_num(r.get('rss_gib'), '{:.2f}')} | {_num(r.get('peak_gib'), '{:.2f}')} | "
            f"{_num(r.get('compiled_models'), '{}')} | {_num((r.get('cache_bytes') or 0) / MIB)} | "
            f"{_num(r.get('compiles'), '{:g}')} | {_num(r.get('convert_seconds'))} | "
            f"{_num(r.get('ov_calls'), '{:g}')} | {_num(r.get('eager_calls'), '{:g}')} | {_num(r.get('psnr'))} | "
            f"{(r.get('error') or '').splitlines()[0][:80] if r.get('error') else ''} |")
    return "\n".join(lines) + "\n"


def draw(results: dict[str, Any], path: Path) -> bool:
    """The RSS curve (and peak) with the compiled models held, per request; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError as err:
        logger.warning("no RSS picture: matplotlib is not importable (%s)", err)
        return False
    records = results.get("records", [])
    x = [r["index"] for r in records]
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=100)
    ax.plot(x, [r.get("rss_gib") for r in records], marker=".", label="RSS of the WebUI (GiB)")
    ax.plot(x, [r.get("peak_gib") for r in records], linestyle="--", label="peak RSS, VmHWM (GiB)")
    baseline = (results.get("stock_baseline") or {}).get("records") or []
    if baseline:
        ax.plot([r["index"] for r in baseline], [r.get("rss_gib") for r in baseline], color="grey", marker=".",
                label="RSS, extension off (stock)")
    warm = [r["index"] for r in records if r.get("warmup")]
    if warm:
        ax.axvline(max(warm) + 0.5, color="grey", linestyle=":", label="end of the warm-up")
    ax.set_xlabel("request")
    ax.set_ylabel("GiB")
    ax.set_ylim(bottom=0)
    held = ax.twinx()
    held.step(x, [r.get("compiled_models") for r in records], where="post", color="tab:green",
              label="compiled models held")
    held.set_ylabel("compiled models held")
    held.set_ylim(bottom=0, top=max([r.get("compiled_models") or 0 for r in records] + [1]) + 1)
    held.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    lines = ax.get_legend_handles_labels()
    more = held.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right", fontsize=8)
    ax.set_title(f"Soak, {results['settings']['model']}: {len(records)} requests")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write(results: dict[str, Any], out: Path, stem: str, picture: bool = True) -> list[Path]:
    """``<out>/<stem>.json``, ``.md`` and (``picture``) ``.png``; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    if picture and draw(results, out / f"{stem}.png"):
        results["picture"] = f"{stem}.png"
        paths.append(out / f"{stem}.png")
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
    md_path.write_text(markdown(results), encoding="utf-8")
    return [json_path, md_path, *paths]
