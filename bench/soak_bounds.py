"""The bounds a soak run must stay within, evaluated from its records (pure: no WebUI here).

Each record is one request's dict as ``bench.soak`` writes it: ``warmup``, ``error``, ``images``,
``expected_images``, ``rss_gib`` (VmRSS of the WebUI's process tree after the request), ``compiled_models``
(the status route's count), ``kept_previous``, ``cache_bytes`` / ``cache_limit_bytes``, ``psnr`` (sampled
requests), and for an Interrupt ``interrupt`` (the counts and the job it stopped in, accelerated and stock).
:func:`evaluate` returns one :class:`Bound` per rule; ``passed`` None means the run could not decide it (too
few requests, no limit set) and says why.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger(__name__)

#: After the warm-up, the last half's mean RSS may exceed the first half's by this share at most.
RSS_GROWTH = 0.05
#: Each sampled picture against stock's for the same request and seed, at f32.
MIN_PSNR = 40.0
#: Requests after the warm-up needed to compare two halves.
MIN_AFTER_WARMUP = 4


@dataclass(frozen=True)
class Bound:
    """One rule, what the run measured, and whether it held (None: not decided, ``measured`` says why)."""

    name: str
    rule: str
    measured: str
    passed: bool | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _halves(values: Sequence[float]) -> tuple[Sequence[float], Sequence[float]]:
    middle = len(values) // 2
    return values[:middle], values[middle:]


def _after_warmup(records: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in records if not r.get("warmup") and r.get(key) is not None]


def _state(record: Mapping[str, Any]) -> tuple[str, str]:
    """What the WebUI holds weights for after a request: its LoRA strength and checkpoint. A LoRA on holds more than
    off (its models, A1111's own state) at any time, which is no growth."""
    return str(record.get("lora")), str(record.get("checkpoint"))


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def rss_flat(records: Sequence[Mapping[str, Any]]) -> Bound:
    rule = (f"after the warm-up, the last half's mean RSS <= the first half's mean + {RSS_GROWTH:.0%}, compared within "
            "each state (LoRA strength, checkpoint) found in both halves")
    after = [r for r in records if not r.get("warmup") and r.get("rss_gib") is not None]
    if len(after) < MIN_AFTER_WARMUP:
        return Bound("rss_flat", rule, f"{len(after)} request(s) after the warm-up: too few", None)
    first, last = _halves(after)
    overall = (f"all requests {_mean([r['rss_gib'] for r in first]):.3f} -> {_mean([r['rss_gib'] for r in last]):.3f}"
               f" GiB (requests {len(first)} + {len(last)})")
    growths: list[tuple[float, str]] = []
    for state in sorted({_state(r) for r in first} & {_state(r) for r in last}):
        a = _mean([float(r["rss_gib"]) for r in first if _state(r) == state])
        b = _mean([float(r["rss_gib"]) for r in last if _state(r) == state])
        label = f"LoRA {state[0]}, checkpoint {state[1]}" if state != ("None", "None") else "all"
        growths.append((b / a - 1, f"{label}: {a:.3f} -> {b:.3f} GiB ({b / a - 1:+.1%})"))
    if not growths:
        return Bound("rss_flat", rule, f"no state in both halves; {overall}", None)
    worst = max(growths)[0]
    return Bound("rss_flat", rule, "; ".join(text for _g, text in growths) + f"; {overall}", worst <= RSS_GROWTH)


def _growth(records: Sequence[Mapping[str, Any]]) -> tuple[float, float] | None:
    """(first half's mean, last half's mean) of the RSS after the warm-up; None with too few requests."""
    series = _after_warmup(records, "rss_gib")
    if len(series) < MIN_AFTER_WARMUP:
        return None
    first, last = _halves(series)
    return sum(first) / len(first), sum(last) / len(last)


def rss_beyond_stock(records: Sequence[Mapping[str, Any]], stock: Sequence[Mapping[str, Any]]) -> Bound:
    """The extension's RSS growth less stock A1111's own for the same stream, against the 5% of the plateau: what
    the extension adds to a WebUI that itself grows (A1111 does, on the tiny models)."""
    rule = (f"after the warm-up, the RSS growth from half to half less stock's for the same stream <= {RSS_GROWTH:.0%} "
            "of the first half's mean")
    ours, theirs = _growth(records), _growth(stock)
    if ours is None or theirs is None:
        return Bound("rss_beyond_stock", rule, "too few requests after the warm-up (or no stock run)", None)
    beyond = (ours[1] - ours[0]) - (theirs[1] - theirs[0])
    measured = (f"{ours[1] - ours[0]:+.3f} GiB against stock's {theirs[1] - theirs[0]:+.3f}: {beyond:+.3f} GiB "
                f"({beyond / ours[0]:+.1%} of {ours[0]:.3f})")
    return Bound("rss_beyond_stock", rule, measured, beyond <= RSS_GROWTH * ours[0])


def models_bounded(records: Sequence[Mapping[str, Any]], keep_all_sizes: bool) -> Bound:
    rule = ("with Keep every compiled size off: after the warm-up, the compiled models held never exceed the "
            "first half's most (new sizes keep coming in both halves)")
    series = [int(v) for v in _after_warmup(records, "compiled_models")]
    warm = [int(r["compiled_models"]) for r in records if r.get("warmup") and r.get("compiled_models") is not None]
    if keep_all_sizes:
        return Bound("models_bounded", rule, f"Keep every compiled size is on: every size stays, no bound promised; "
                     f"held {min(series + warm, default=0)}-{max(series + warm, default=0)}", None)
    if len(series) < MIN_AFTER_WARMUP:
        return Bound("models_bounded", rule, f"{len(series)} request(s) after the warm-up: too few", None)
    first, last = _halves(series)
    return Bound("models_bounded", rule, f"warm-up most {max(warm, default=0)}; after it: first half most "
                 f"{max(first)}, last half most {max(last)} (last {series[-1]})", max(last) <= max(first))


def previous_released(records: Sequence[Mapping[str, Any]], previous_weights: str) -> Bound:
    rule = ("the previous LoRA's or checkpoint's compiled models are released as Settings -> OpenVINO says "
            "(release: none kept after a change)")
    kept = sum(int(r.get("kept_previous") or 0) for r in records)
    if previous_weights != "release":
        return Bound("previous_released", rule, f"setting {previous_weights or 'auto'}: kept {kept} model(s) of "
                     "previous weights over the run (bounded by models_bounded)", None)
    return Bound("previous_released", rule, f"setting release: kept {kept}", kept == 0)


def cache_under_limit(records: Sequence[Mapping[str, Any]]) -> Bound:
    rule = "the disk cache stays under its limit (the status route's cache_limit_bytes)"
    sizes = [int(r["cache_bytes"]) for r in records if r.get("cache_bytes") is not None]
    limits = [int(r["cache_limit_bytes"]) for r in records if r.get("cache_limit_bytes")]
    most = max(sizes, default=0)
    if not limits:
        return Bound("cache_under_limit", rule, f"no limit set; largest {most / 2**20:.1f} MiB", None)
    over = [(s, lim) for r in records if r.get("cache_limit_bytes") and r.get("cache_bytes") is not None
            for s, lim in [(int(r["cache_bytes"]), int(r["cache_limit_bytes"]))] if s > lim]
    return Bound("cache_under_limit", rule, f"largest {most / 2**20:.1f} MiB, limit {min(limits) / 2**20:.1f} MiB; "
                 f"{len(over)} request(s) over it", not over)


def no_errors(records: Sequence[Mapping[str, Any]]) -> Bound:
    failed = [r["index"] for r in records if r.get("error")]
    return Bound("no_errors", "no request fails", f"{len(failed)} of {len(records)} failed"
                 + (f" (requests {', '.join(map(str, failed[:10]))})" if failed else ""), not failed)


def no_image_lost(records: Sequence[Mapping[str, Any]]) -> Bound:
    counted = [r for r in records if r.get("kind") != "interrupt" and not r.get("error")]
    lost = [r["index"] for r in counted if r.get("images") != r.get("expected_images")]
    return Bound("no_image_lost", "images returned = batch size x batch count (X/Y/Z: cells + its grid)",
                 f"{len(lost)} of {len(counted)} request(s) short" + (f" (requests {lost[:10]})" if lost else ""),
                 not lost)


def interrupt_as_stock(records: Sequence[Mapping[str, Any]]) -> Bound:
    """An Interrupt inside a batch count returns the batches done and the one it stopped (A1111 decodes the
    latent where sampling stopped): ``batch_size * (job + 1)``, for stock as for the extension. ``expected`` and
    ``stock_expected`` are the counts the batch numbers read around the Interrupt allow."""
    rule = "an interrupted request returns what stock A1111 returns: batch size x (batches begun)"
    runs = [r["interrupt"] for r in records if r.get("kind") == "interrupt" and r.get("interrupt")]
    if not runs:
        return Bound("interrupt_as_stock", rule, "no Interrupt in the run", None)

    def allowed(expected: Any) -> list[int]:
        return list(expected) if isinstance(expected, list | tuple) else [expected]

    def text(images: int, expected: Any) -> str:
        return f"{images} of {'/'.join(map(str, allowed(expected)))}"

    stock = [i for i in runs if i.get("stock_images") is not None]
    wrong = [i for i in runs if i["images"] not in allowed(i["expected"])]
    stock_wrong = [i for i in stock if i["stock_images"] not in allowed(i["stock_expected"])]
    measured = (f"{len(runs)} interrupted: " + ", ".join(text(i["images"], i["expected"]) for i in runs)
                + "; stock: " + (", ".join(text(i["stock_images"], i["stock_expected"]) for i in stock) or "not run"))
    if not stock:  # what stock returns is unknown: only a wrong count decides
        return Bound("interrupt_as_stock", rule, measured, False if wrong else None)
    return Bound("interrupt_as_stock", rule, measured, not wrong and not stock_wrong)


def pictures_match(records: Sequence[Mapping[str, Any]], precision: str) -> Bound:
    rule = f"every sampled picture matches stock's for the same request and seed: >= {MIN_PSNR:g} dB (at f32)"
    values = [(r["index"], float(r["psnr"])) for r in records if r.get("psnr") is not None]
    if not values:
        return Bound("pictures_match", rule, "no picture compared", None)
    worst = min(values, key=lambda v: v[1])
    low = [i for i, v in values if v < MIN_PSNR]
    text = "inf" if math.isinf(worst[1]) else f"{worst[1]:.1f}"
    measured = f"{len(values)} compared; lowest {text} dB (request {worst[0]})" + (f"; below: {low}" if low else "")
    if precision != "f32":
        return Bound("pictures_match", rule, measured + f"; at {precision} the bound is f32's: not decided", None)
    return Bound("pictures_match", rule, measured, not low)


def evaluate(records: Sequence[Mapping[str, Any]], keep_all_sizes: bool = False, previous_weights: str = "",
             precision: str = "f32", stock: Sequence[Mapping[str, Any]] | None = None) -> list[Bound]:
    """Every bound of the run (``stock``: the records of the same stream with the extension off, if run)."""
    return [rss_flat(records), *([rss_beyond_stock(records, stock)] if stock is not None else []),
            models_bounded(records, keep_all_sizes), previous_released(records, previous_weights),
            cache_under_limit(records), no_errors(records), no_image_lost(records), interrupt_as_stock(records),
            pictures_match(records, precision)]


def failed(bounds: Sequence[Bound]) -> list[Bound]:
    return [b for b in bounds if b.passed is False]
