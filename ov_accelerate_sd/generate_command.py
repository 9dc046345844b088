"""The ``generate`` command: arguments -> a one-line-per-prompt job -> PNG files, with progress and a summary.

``generate`` renders as ``batch`` does (:mod:`.job_args`: the prompts become job lines; :class:`~.pool.LocalPool`
and its :class:`~.render.Renderer`), into numbered files rather than a resumable folder. Everything a user can get
wrong is checked before the model loads (argparse message, exit 2), the output folder included. A PNG that still
cannot be saved is reported (file and reason) and the run goes on with the next image; the exit code is then 1.

The summary keeps the first batch apart (:class:`~.progress.Progress`): it holds every part's first call
(dynamo's capture and OpenVINO's compile), so the steady-state numbers (s/it, seconds per image) come from the
steps and batches after it.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import re
import time
from pathlib import Path
from typing import Any

from ov_backend.files import format_bytes

from .console import EXIT_INTERRUPTED, err, out
from .job_args import render_options, resolver
from .jobs import MAX_SEED, line_defaults

logger = logging.getLogger(__name__)

_NUMBERED = re.compile(r"^(\d{5})-")


def _prompts(parser: argparse.ArgumentParser, args: Any) -> list[str]:
    if args.prompts_file is not None:
        try:
            lines = args.prompts_file.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            parser.error(f"--prompts-file {args.prompts_file}: {exc.strerror or exc}")
        prompts = [line.strip() for line in lines if line.strip()]
        if not prompts:
            parser.error(f"--prompts-file {args.prompts_file} has no prompts (one per line)")
        return prompts
    if args.prompt is None:
        if args.demo:
            return ["a photo of a cat sitting on a windowsill, (masterpiece:1.2)"]
        parser.error("one of --prompt or --prompts-file is required")
    return [args.prompt]


def _next_number(folder: Path) -> int:
    numbers = [int(m.group(1)) for p in folder.glob("*.png") if (m := _NUMBERED.match(p.name))]
    return max(numbers, default=-1) + 1


def out_folder_problem(folder: Path) -> str | None:
    """Why PNGs could not be written into ``folder`` (created if missing), or None if they can."""
    target = folder.absolute()
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    prefix = "" if existing == target else "cannot be created: "
    if not existing.is_dir():
        return f"{prefix}{existing} is not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{prefix}{existing} is not writable"
    return None


def _tasks(parser: argparse.ArgumentParser, args: Any) -> tuple[list[Any], Any]:
    """The job's tasks (a line a prompt, its seed drawn when -1) and the render options, or exit 2.

    Files, prompts and the output folder are checked first, before torch and OpenVINO load.
    """
    from .render import tasks_of

    if args.checkpoint is not None and not args.checkpoint.is_file():
        parser.error(f"--checkpoint {args.checkpoint}: no such file")
    prompts = _prompts(parser, args)
    problem = out_folder_problem(args.out)
    if problem is not None:
        parser.error(f"--out {args.out}: {problem}")
    defaults = line_defaults(parser, args)  # (the sampler's name: torch loads)
    resolve = resolver(args, defaults, Path.cwd(), require_prompt=False)
    lines = []
    for number, prompt in enumerate(prompts, start=1):
        try:
            lines.append(resolve(number, {"prompt": prompt}))
        except ValueError as exc:
            parser.error(str(exc))
    options = render_options(parser, args, lines)
    seeds = [(line, line.seed if line.seed != -1 else random.randrange(MAX_SEED)) for line in lines]
    return list(tasks_of(seeds)), options


def run_generate(parser: argparse.ArgumentParser, args: Any) -> int:
    """Run ``generate``; returns the exit code: 0, 1 when a PNG could not be saved, 130 after Ctrl-C."""
    tasks, options = _tasks(parser, args)
    from dataclasses import replace

    from .checkpoint import CheckpointError
    from .lora import LoraError
    from .pool import LocalPool, run_until_stopped
    from .progress import Progress
    from .render import Renderer, checkpoint_of
    from .unet_split import StepCacheUnsupported

    started = time.perf_counter()
    if args.checkpoint is None:
        out(f"demo checkpoint (random weights, its images are noise): {checkpoint_of(tasks[0].line)}")
    renderer = Renderer(replace(options, order=tuple(tasks)), out)
    try:
        renderer.use(tasks[0].line)
    except CheckpointError as exc:
        parser.error(str(exc))
    except StepCacheUnsupported as exc:
        parser.error(f"--step-cache: {exc}")
    load_seconds = time.perf_counter() - started

    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        err(f"error: cannot create --out {args.out}: {exc.strerror or exc}")
        return 1
    number = _next_number(args.out)
    total = sum(task.line.batch_size for task in tasks)
    progress = Progress(total)
    saved: list[Path] = []

    def label(task: Any) -> str:
        done = progress.rendered + progress.failed
        size = task.line.batch_size
        return f"image {done + 1}/{total}" if size == 1 else f"image {done + 1}-{done + size}/{total}"

    def save(result: Any) -> None:
        nonlocal number
        for item in result.images:
            path = args.out / f"{number:05d}-{item.seed}.png"
            number += 1
            if not progress.save(item, path):
                continue
            saved.append(path)
            out(f"[{progress.rendered + progress.failed}/{total}] job {result.task.line.number}, seed {item.seed}: "
                f"{path} ({item.seconds:.2f}s)")

    def stop_on_lora(task: Any, exc: BaseException) -> bool:
        if isinstance(exc, LoraError):
            parser.error(f"job {task.line.number}: {exc}")
        return False

    interrupted = run_until_stopped(LocalPool(renderer, label, progress), tasks, save, stop_on_lora)
    stats = renderer.stats()
    if args.verbose:
        for report in renderer.reports():
            err(report)
    pruned = int(stats.get("cache_pruned", 0))
    usage = renderer.cache_usage()
    if usage is not None and (pruned or usage.over_limit or args.verbose):
        out(f"disk cache: {usage.text()}"
            + (f"; removed {pruned} least recently used entries "
               f"({format_bytes(stats.get('cache_pruned_bytes', 0))})" if pruned else ""))
    accelerated = bool(options.accelerate)
    out(f"{len(saved)} image(s) in {args.out}: load {load_seconds:.1f}s, "
        f"{progress.describe(stats if accelerated else None)} "
        f"(OpenVINO calls {int(stats.get('ov_calls', 0))}, PyTorch calls {int(stats.get('eager_calls', 0))}, "
        f"cache hits {int(stats.get('cache_hits', 0))})")
    step_cache = renderer.step_cache_text()
    if step_cache is not None:
        out(step_cache)
    eager = renderer.eager_report()
    if eager:
        err(f"warning: {eager}")
    renderer.close()
    if progress.failed:
        err(f"error: {progress.failed} image(s) could not be saved in {args.out}")
    if interrupted:
        err(f"stopped by Ctrl-C: kept {len(saved)} of {total} image(s)")
        return EXIT_INTERRUPTED
    return 1 if progress.failed else 0
