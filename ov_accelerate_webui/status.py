"""Plain-text and HTML status shown after a run, and the human-readable sizes of the cache."""

from __future__ import annotations

import html
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from .settings import AccelerateSettings

logger = logging.getLogger(__name__)


def format_bytes(size: int) -> str:
    """1536 -> "1.5 KiB"."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def run_status(
    settings: AccelerateSettings, routed_paths: Sequence[str], reports: Iterable[Any], stats: dict[str, float]
) -> str:
    """What ran in OpenVINO, what fell back to PyTorch and why, compile vs run time, cache hits, device."""
    reports = list(reports)
    devices = sorted({str(getattr(r, "device", settings.device)) for r in reports}) or [settings.device]
    lines = [
        f"OpenVINO ({settings.infotext()}) on {', '.join(devices)}: " f"{', '.join(routed_paths) or 'nothing routed'}."
    ]
    lines.append(
        f"Compile {stats.get('compile_seconds', 0.0):.1f} s, run {stats.get('run_seconds', 0.0):.1f} s; "
        f"{int(stats.get('ov_calls', 0))} OpenVINO calls, {int(stats.get('eager_calls', 0))} PyTorch "
        f"calls; cache hits {int(stats.get('cache_hits', 0))}."
    )
    fallbacks: dict[str, str] = {}
    for report in reports:
        fallbacks.update(getattr(report, "fallback_ops", {}) or {})
        summary = getattr(report, "summary", None)
        if summary is not None:
            lines.append(f"  {summary()}")
    if fallbacks:
        lines.append("Ran in PyTorch: " + "; ".join(f"{op} ({reason})" for op, reason in sorted(fallbacks.items())))
    else:
        lines.append("Nothing fell back to PyTorch." if reports else "No new compile: compiled models reused.")
    return "\n".join(lines)


def to_html(text: str, kind: str = "info") -> str:
    """Text -> an HTML block for the panel; ``kind`` is "info", "warning" or "error"."""
    body = "<br>".join(html.escape(line) for line in text.splitlines())
    return f'<div class="ov-accelerate-status ov-accelerate-{kind}">{body}</div>'
