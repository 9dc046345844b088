"""The ``batch`` command: a job file -> PNGs in an output folder, resumable, with progress and a summary.

Every line is checked before anything renders (its number and what is wrong; ``--skip-bad`` lists the bad
ones and renders the rest). The folder's manifest (:mod:`.batch_manifest`) says what is done: running the same
command again renders only what is missing, with the same seeds, so an image is the same whether the job ran
in one go or was stopped and resumed. Lines render grouped by model setup (checkpoint, precision, step
caching), in file order within a group, so a job that mixes checkpoints loads each once.

Exit codes: 0 done; 1 an image could not be saved; 2 a bad argument or a bad line (nothing rendered); 130
stopped by Ctrl-C (what was saved stays; the same command resumes).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

from ov_backend.files import format_bytes

from .console import EXIT_INTERRUPTED, err, out
from .job_args import render_options, resolver
from .jobs import JobLine, line_defaults, read_job_lines

logger = logging.getLogger(__name__)

#: Bad lines listed in full before "... and N more".
SHOWN_BAD_LINES = 20


def read_job(parser: argparse.ArgumentParser, args: Any) -> list[JobLine]:
    """The job's lines, every one checked (exit 2 on a bad one, unless ``--skip-bad``)."""
    defaults = line_defaults(parser, args)
    json_lines = args.jobs is not None
    path: Path = args.jobs if json_lines else args.prompts_file
    if json_lines and path.suffix.lower() != ".jsonl":
        parser.error(f"{path}: a job file is JSONL (one JSON object a line) and ends in .jsonl; for a plain list "
                     "of prompts, one a line, use --prompts-file")
    try:
        lines, bad = read_job_lines(path, json_lines, resolver(args, defaults, path.absolute().parent))
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"{path}: cannot read the job file ({getattr(exc, 'strerror', None) or exc})")
    if bad:
        for item in bad[:SHOWN_BAD_LINES]:
            err(f"{path}:{item.number}: {item.reason}")
        if len(bad) > SHOWN_BAD_LINES:
            err(f"... and {len(bad) - SHOWN_BAD_LINES} more bad line(s)")
        if not args.skip_bad:
            parser.error(f"{len(bad)} bad line(s) in {path} (listed above); nothing was rendered. Fix them, or "
                         "add --skip-bad to render the other lines")
        err(f"skipping {len(bad)} bad line(s) (--skip-bad)")
    if not lines:
        parser.error(f"{path} has no job to render")
    return lines


def make_pool(parser: argparse.ArgumentParser, args: Any, lines: list[JobLine], options: Any, tasks: int) -> Any:
    """The pool the job renders in: this process, ``--workers`` processes or a ``--ray`` cluster's workers, sized
    by the same plan (exit 2 when the request does not fit, without Ray, or when no cluster answers)."""
    from ov_backend.memory import system_memory

    from .pool import LocalPool, plan_workers, usable_cores, worker_bytes
    from .render import Renderer, checkpoint_of

    requested = int(args.workers) if args.workers not in (None, "auto") else None
    if args.ray and tasks:
        from .batch_ray import RayPool, connect, plan_on

        try:
            per_worker = worker_bytes({(checkpoint_of(line), line.precision) for line in lines})
            ray = connect(args.ray)
            return RayPool(ray, args.ray, options, plan_on(ray, args.ray, requested, args.ray_cpus_per_worker,
                                                           per_worker, tasks), out)
        except (ImportError, ConnectionError, ValueError) as exc:
            parser.error(str(exc))
    if args.workers not in (None, "1") and not args.ray:
        memory = system_memory()
        try:
            plan = plan_workers(requested, worker_bytes({(checkpoint_of(line), line.precision) for line in lines}),
                                memory.available if memory is not None else None, usable_cores(), tasks)
        except ValueError as exc:
            parser.error(str(exc))
        if plan.workers > 1:
            from .batch_workers import ProcessPool

            out(f"{plan.workers} workers ({plan.reason})")
            return ProcessPool(options, plan, out)
    return LocalPool(Renderer(options, out), lambda task: f"line {task.line.number}")


def run_batch(parser: argparse.ArgumentParser, args: Any) -> int:
    """Run ``batch``; returns the exit code."""
    lines = read_job(parser, args)
    options = render_options(parser, args, lines)
    from dataclasses import replace

    from .batch_manifest import Manifest, ManifestError, planned_images
    from .checkpoint import CheckpointError
    from .lora import LoraError
    from .pool import run_until_stopped
    from .progress import Progress
    from .render import RenderTask, tasks_of
    from .unet_split import StepCacheUnsupported

    try:
        manifest = Manifest(args.out)
    except ManifestError as exc:
        parser.error(str(exc))
    except OSError as exc:
        parser.error(f"--out {args.out}: {exc.strerror or exc}")
    with manifest:
        changed = manifest.changed_lines(lines)
        if changed:
            for text in changed[:SHOWN_BAD_LINES]:
                err(text)
            parser.error(f"{len(changed)} line(s) differ from the job this folder's run began with (listed above; "
                         f"{args.out / 'manifest.jsonl'} records it); nothing was rendered. Restore them, or give "
                         "the changed job another --out")
        groups: dict[tuple[str, str, int], list[RenderTask]] = {}
        total = done_before = 0
        seeds = manifest.seeds(lines)
        for line in lines:
            images = planned_images(line, seeds[line.number])
            total += len(images)
            for batch in range(line.batch_count):
                missing = tuple(img for img in images if img.batch == batch and not manifest.done(img))
                done_before += line.batch_size - len(missing)
                if missing:
                    groups.setdefault(line.setup, []).append(RenderTask(line, seeds[line.number], batch, missing))
        tasks = [task for group in groups.values() for task in group]
        # every batch, rendered or not: at INT8 a graph calibrates on the job's first batch of it, wherever it renders
        options = replace(options, order=tasks_of((line, seeds[line.number]) for line in lines))
        pool = make_pool(parser, args, lines, options, len(tasks))
        progress = Progress(total, done_before)
        out(f"job: {len(lines)} line(s), {total} image(s); {done_before} already in {args.out}, "
            f"{total - done_before} to render")
        failed: list[str] = []

        def save(result: Any) -> None:
            task = result.task
            by_seed = {item.seed: item for item in result.images}
            for image in task.images:
                item = by_seed[image.seed]
                if not progress.save(item, args.out / image.file, lambda image=image: manifest.record(image)):
                    failed.append(image.file)
                    continue
                rate = progress.left_text()
                out(f"[{progress.done_before + progress.rendered}/{total}] line {task.line.number}, seed "
                    f"{image.seed}: {args.out / image.file} ({item.seconds:.2f}s)" + (f"; {rate}" if rate else ""))

        def line_failed(task: RenderTask, exc: BaseException) -> bool:
            if not isinstance(exc, (CheckpointError, StepCacheUnsupported, LoraError)):
                return False
            err(f"error: line {task.line.number}: {exc}")
            failed.extend(img.file for img in task.images)
            progress.failed += len(task.images)
            return True

        try:
            interrupted = run_until_stopped(pool, tasks, save, line_failed)
        finally:
            stats, reports, eager = pool.stats(), pool.reports(), pool.eager_report()
            pool.close()
    rate = progress.per_minute
    elapsed = time.perf_counter() - progress.started
    out(f"{progress.rendered} image(s) rendered into {args.out} in {elapsed:.1f}s"
        + (f" ({rate:.2f} images/min)" if rate else "")
        + (f", {done_before} already there" if done_before else "")
        + f"; {progress.done_before + progress.rendered} of {total} done. Model loads {int(stats.get('loads', 0))} "
        f"({stats.get('load_seconds', 0.0):.1f}s), OpenVINO conversions {int(stats.get('conversions', 0))}, compiles "
        f"{int(stats.get('compiles', 0))} ({stats.get('compile_seconds', 0.0):.1f}s), "
        f"OpenVINO calls {int(stats.get('ov_calls', 0))}, PyTorch calls {int(stats.get('eager_calls', 0))}, "
        f"cache hits {int(stats.get('cache_hits', 0))}"
        + (f", cache pruned {format_bytes(stats['cache_pruned_bytes'])}" if stats.get("cache_pruned_bytes") else "")
        + (f"; workers restarted {pool.restarts} time(s)" if pool.restarts else ""))
    if args.verbose:
        for report in reports:
            err(report)
    if eager:
        err(f"warning: {eager}")
    if failed:
        err(f"error: {len(failed)} image(s) not made; run the same command again to retry them")
    if interrupted:
        err(f"stopped by Ctrl-C: {progress.done_before + progress.rendered} of {total} image(s) done; run the "
            "same command again to resume")
        return EXIT_INTERRUPTED
    return 1 if failed else 0
