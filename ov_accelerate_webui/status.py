"""Plain-text and HTML status shown after a run."""

from __future__ import annotations

import html
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from .backend_bridge import ov_backend
from .finite_guard import F32Switch
from .settings import AccelerateSettings

if TYPE_CHECKING:
    from ov_backend import CompileReport

logger = logging.getLogger(__name__)


def _calls(count: int) -> str:
    return "not called" if count == 0 else f"{count} call" + ("s" if count != 1 else "")


def run_status(
    settings: AccelerateSettings,
    routed: Mapping[str, int],
    reports: Iterable[CompileReport],
    stats: dict[str, float],
    switches: Sequence[str] = (),
    eager: Mapping[str, tuple[int, str]] | None = None,
    f32: Mapping[str, tuple[F32Switch, bool]] | None = None,
    attention: str | None = None,
    pytorch: Mapping[str, tuple[int, str]] | None = None,
) -> str:
    """What ran in OpenVINO, what fell back to PyTorch and why, compile vs run time, cache hits, device.

    Args:
        settings: the run's settings.
        routed: label of each routed module -> how many times it was called during the run.
        reports: the backend's compile reports made during the run.
        stats: the backend's counters accumulated during the run.
        switches: what happened when A1111 switched the model during the run (refiner, hires checkpoint).
        eager: label of a routed module -> (calls torch.compile ran in plain PyTorch, why).
        f32: label of a routed module that ran at f32 at automatic precision -> (why, whether it switched
            during this run).
        attention: the WebUI's cross-attention optimization the routed UNet's attention replaced by one
            scaled-dot-product attention (None: none replaced).
        pytorch: label of a routed module -> (calls run in PyTorch on its own method, why): work that
            something else in the WebUI changed in a way OpenVINO does not take.
    """
    reports = list(reports)
    devices = sorted({r.device for r in reports}) or [settings.device]
    parts = ", ".join(f"{label} ({_calls(count)})" for label, count in routed.items())
    lines = [f"OpenVINO ({settings.infotext()}) on {', '.join(devices)}: {parts or 'nothing routed'}."]
    if attention:
        lines.append(
            f"Attention in the UNet: scaled dot product, fused by OpenVINO, in place of {attention} (the "
            "WebUI's choice for PyTorch, kept for it)."
        )
    not_int8 = dict.fromkeys(report.not_int8 for report in reports if report.not_int8)
    if not_int8:  # the first line names the precision chosen (only the UNet is quantized): say where it did not hold
        lines.append("Not at INT8: the UNet runs at float in OpenVINO instead, because of " + "; ".join(not_int8)
                     + ".")
    if switches:
        lines.append("Model switches during the generation: " + "; ".join(switches) + ".")
    if eager:
        lines.append(ov_backend.describe_eager(eager, routed))
    for label, (count, why) in (pytorch or {}).items():
        lines.append(f"Ran in PyTorch, not OpenVINO: {label} ({_calls(count)}): {why}.")
    lines.extend(f32_lines(f32 or {}))
    lines.extend(ov_backend.Stats.from_mapping(stats).text_lines())
    fallbacks: dict[str, str] = {}
    for report in reports:
        fallbacks.update(report.fallback_ops)
        lines.append(f"  {report.summary()}")
    if fallbacks:
        lines.append("Ran in PyTorch: " + "; ".join(f"{op} ({reason})" for op, reason in sorted(fallbacks.items())))
    else:
        lines.append(
            "No new compile: compiled models reused."
            if not reports
            else "No op of the graphs compiled in this run fell back to PyTorch."
            if eager or pytorch
            else "Nothing fell back to PyTorch."
        )
    return "\n".join(lines)


def capture_lines(stats: Mapping[str, float]) -> list[str]:
    """What PyTorch's graph capture (dynamo tracing the model's Python code) cost in the run, when it was
    measured: captured now and saved for the next start, or loaded from the disk cache."""
    return ov_backend.Stats.from_mapping(stats).capture_lines()


def f32_lines(f32: Mapping[str, tuple[F32Switch, bool]]) -> list[str]:
    """Status lines for routes that ran at f32 in a run at automatic precision: those rebuilt at f32
    during the run, then those at f32 since an earlier run."""
    lines = []
    for new, head in ((True, "Rebuilt at f32 in this run"), (False, "At f32 since an earlier run")):
        items = [f"{why.part} ({label}: {why.describe()})" for label, (why, now) in f32.items() if now == new]
        if items:
            lines.append(f"{head}: " + "; ".join(items) + ".")
    return lines


def to_html(text: str, kind: str = "info") -> str:
    """Text -> an HTML block for the panel; ``kind`` is "info", "warning" or "error"."""
    body = "<br>".join(html.escape(line) for line in text.splitlines())
    return f'<div class="ov-accelerate-status ov-accelerate-{kind}">{body}</div>'


def cache_line(cache: Mapping[str, int], pruned: int) -> list[str]:
    """The status line on the disk cache's size against its limit: when entries were pruned, or when the entries in
    use alone are over it."""
    if not cache:
        return []
    usage = ov_backend.CacheUsage(cache["cache_bytes"], cache["cache_limit_bytes"], cache["cache_in_use_bytes"])
    if not pruned and not usage.over_limit:
        return []
    return [f"Disk cache: {usage.text()}."]


def weights_line(weights_in_file: tuple[int, int | None]) -> list[str]:
    """The status line on PyTorch's weights in files (none when no weight is in a file)."""
    size, resident = weights_in_file
    if not size:
        return []
    return [f"PyTorch's copy of the accelerated weights: {ov_backend.format_bytes(size)} in a memory-mapped file"
            + (f", {ov_backend.format_bytes(resident)} of it in memory after the generation." if resident is not None
               else ".")]
