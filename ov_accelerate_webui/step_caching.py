"""Step caching in the WebUI: where A1111's sampling is, and what a run's step caching did.

The caching itself (the UNet's split, the schedule, what a kept feature may be reused for) is the SD layer's
(``ov_accelerate_sd.step_cache``); the UNet's route runs it (``compiled_route.make_forward``). Here: the
sampler step of each UNet evaluation, read from A1111's denoiser in the ``cfg_denoiser`` callback, and the
facts and the line of the status.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ov_accelerate_sd.step_cache import StepCacheRun

logger = logging.getLogger(__name__)


def sampler_step(step_cache: StepCacheRun, params: Any) -> None:
    """Tell ``step_cache`` (a ``StepCacheRun``) which sampler step the UNet calls after the ``cfg_denoiser``
    callback's ``params`` belong to. A1111's denoiser counts its evaluations (``step``, from 0 at the start of
    each sampling: each batch, each hires pass) and makes ``total_steps`` of them for ``steps`` sampler steps
    (twice as many for second-order samplers, Heun, DPM2...); without a denoiser, the callback's
    ``sampling_step``."""
    denoiser = getattr(params, "denoiser", None)
    evaluations = getattr(denoiser, "step", None)
    steps = getattr(denoiser, "steps", None) or getattr(params, "total_sampling_steps", None)
    if not isinstance(evaluations, int):
        evaluations, total = int(getattr(params, "sampling_step", 0) or 0), steps
    else:
        total = getattr(denoiser, "total_steps", None) or steps
    step = evaluations * steps // total if steps and total else evaluations
    if evaluations == 0:
        step_cache.begin(steps)
    else:
        step_cache.at_step(step, steps)


def step_cache_facts(run: StepCacheRun | None, session: Any) -> dict[str, Any]:
    """The status route's facts of a run's step caching (empty when it was off)."""
    if run is None:
        return {}
    off = session.step_cache_off()
    sc = run.settings
    return {"interval": sc.interval, "depth": sc.depth, "full_start": sc.full_start, "full_end": sc.full_end,
            "full_calls": run.full_calls, "shallow_calls": run.shallow_calls, "full_on_shallow_steps":
            dict(run.forced_full), "unsupported": off}


def step_cache_line(facts: dict[str, Any]) -> str:
    """The status's line on step caching."""
    text = (f"Step caching every {facts['interval']} steps (depth {facts['depth']}): {facts['full_calls']} full and "
            f"{facts['shallow_calls']} shallow UNet call(s) in OpenVINO")
    if facts["full_on_shallow_steps"]:
        text += "; full on a cached step: " + ", ".join(
            f"{n} ({why})" for why, n in facts["full_on_shallow_steps"].items())
    if facts["unsupported"]:
        text += "; not cached: " + "; ".join(f"{label}: {why}" for label, why in facts["unsupported"].items())
    return text


def merged_facts(facts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The step caching facts of several generations: the last one's settings, its calls summed."""
    if not facts:
        return {}
    merged = {**facts[-1], "full_calls": 0, "shallow_calls": 0, "full_on_shallow_steps": {}, "unsupported": {}}
    for one in facts:
        merged["full_calls"] += one["full_calls"]
        merged["shallow_calls"] += one["shallow_calls"]
        merged["unsupported"].update(one["unsupported"])
        for why, n in one["full_on_shallow_steps"].items():
            merged["full_on_shallow_steps"][why] = merged["full_on_shallow_steps"].get(why, 0) + n
    return merged
