"""A job: the generations of one request (one press of Generate, one API call), and its status as a whole.

A dropdown script (X/Y/Z plot, Prompts from file, SD upscale, Loopback ...) may call ``process_images`` many times
in one request; the generations share compiled models, and the status route reports the job with each
generation's line in ``runs``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .finite_guard import F32Switch
from .generation import RunRecord, run_report
from .step_caching import merged_facts

logger = logging.getLogger(__name__)


@dataclass
class Job:
    """The generations of one request (one press of Generate, one API call)."""

    owner: int
    """``id`` of the request's ``p`` (the one A1111 closes at the end)."""
    records: list[RunRecord] = field(default_factory=list)
    plain: list[str] = field(default_factory=list)
    """Why each generation of the job that ran in plain PyTorch did (e.g. an X/Y/Z cell with OpenVINO off)."""
    stopped: str = ""
    """The status of a generation of the job that stopped with an error."""

    @property
    def started(self) -> bool:
        """Whether a generation of the job went through OpenVINO already (the next continues its window)."""
        return bool(self.records)

    def report(self) -> dict[str, Any] | None:
        """The status route's data for the job so far (None when nothing of it went through OpenVINO)."""
        if not self.records:
            return None
        if len(self.records) == 1 and not self.plain and not self.stopped:
            return run_report(self.records[0])
        merged = merge(self.records)
        merged.status = _job_header(self.records, self.plain) + "\n" + merged.text()
        if self.stopped:
            merged.status += "\n" + self.stopped
        report = run_report(merged)
        report.update(generations=len(self.records), plain_generations=len(self.plain),
                      runs=[r.summary() for r in self.records])
        return report


def merge(records: Sequence[RunRecord]) -> RunRecord:
    """One record for several generations: calls and counters summed, compile reports and events joined."""
    calls: dict[str, int] = {}
    eager: dict[str, tuple[int, str]] = {}
    stats: dict[str, float] = {}
    f32: dict[str, tuple[F32Switch, bool]] = {}
    pytorch: dict[str, tuple[int, str]] = {}
    for record in records:
        for label, (n, why) in record.pytorch.items():
            pytorch[label] = (pytorch.get(label, (0, why))[0] + n, why)
        for label, n in record.calls.items():
            calls[label] = calls.get(label, 0) + n
        for label, (n, why) in record.eager.items():
            eager[label] = (eager.get(label, (0, why))[0] + n, why)
        for key, value in record.stats.items():
            stats[key] = stats.get(key, 0) + value
        for label, (why, now) in record.f32.items():
            f32[label] = (why, now or f32.get(label, (why, False))[1])
    return RunRecord(
        settings=records[0].settings,
        calls=calls,
        eager=eager,
        stats=stats,
        reports=[report for record in records for report in record.reports],
        switches=list(dict.fromkeys(s for record in records for s in record.switches)),
        f32=f32,
        attention=next((r.attention for r in records if r.attention), None),
        lora_changes=[change for record in records for change in record.lora_changes],
        pytorch=pytorch,
        notes=list(dict.fromkeys(note for record in records for note in record.notes)),
        step_cache=merged_facts([r.step_cache for r in records if r.step_cache]),
        weights_in_file=records[-1].weights_in_file,
        cache=records[-1].cache,
    )


def _job_header(records: Sequence[RunRecord], plain: Sequence[str]) -> str:
    compiled = sum(1 for r in records if r.reports)
    settings = list(dict.fromkeys(r.settings.infotext() for r in records))
    line = (f"This job ran {len(records)} generation(s) through OpenVINO (a script's images: X/Y/Z plot cells, "
            f"prompts from a file, upscale tiles, loops); they shared the compiled models: "
            f"{sum(len(r.reports) for r in records)} compile(s) in all, in {compiled} generation(s); "
            f"{len(records) - compiled} compiled nothing.")
    if len(settings) > 1:
        line += " Settings used: " + "; ".join(settings) + " (the line below names the first)."
    if plain:
        reasons = list(dict.fromkeys(plain))
        line += f" {len(plain)} generation(s) of the job ran in plain PyTorch: " + "; ".join(reasons) + "."
    return line
