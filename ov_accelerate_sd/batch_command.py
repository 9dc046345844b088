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
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ov_backend.files import format_bytes

from .batch_jobs import JobLine, read_job_lines, resolve_line
from .cli import EXIT_INTERRUPTED, StopRequest, _err, _out
from .parts import PARTS

logger = logging.getLogger(__name__)

#: Bad lines listed in full before "... and N more".
SHOWN_BAD_LINES = 20


def _checkpoint_problem(path: Path) -> str | None:
    from .checkpoint import CheckpointError, check_checkpoint_file

    try:
        check_checkpoint_file(path)
    except CheckpointError as exc:
        return exc.reason
    return None


def _image_problem(path: Path) -> str | None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img.verify()
    except FileNotFoundError:
        return "no such file"
    except (OSError, UnidentifiedImageError) as exc:
        return f"cannot read the image ({exc})"
    return None


def _defaults(parser: argparse.ArgumentParser, args: Any) -> dict[str, Any]:
    """Every job field's value from the command line."""
    from .demo_checkpoint import DEMO_SIZE, DEMO_STEPS
    from .samplers import sampler_spec

    checkpoint = ""
    if args.checkpoint is not None:
        problem = _checkpoint_problem(args.checkpoint)
        if problem is not None:
            parser.error(f"--checkpoint {args.checkpoint}: {problem}")
        checkpoint = str(args.checkpoint.resolve())
    init_image = ""
    if args.init_image is not None:
        problem = _image_problem(args.init_image)
        if problem is not None:
            parser.error(f"--init-image {args.init_image}: {problem}")
        init_image = str(args.init_image.resolve())
    try:
        sampler = sampler_spec(args.sampler).name
    except ValueError as exc:
        parser.error(f"argument --sampler: {exc}")
    demo = args.checkpoint is None
    size = DEMO_SIZE if demo else 512
    return {
        "prompt": args.prompt or "", "negative_prompt": args.negative_prompt, "seed": args.seed,
        "width": args.width or size, "height": args.height or size,
        "steps": args.steps or (DEMO_STEPS if demo else 20), "sampler": sampler, "cfg_scale": args.cfg_scale,
        "batch_size": args.batch_size, "batch_count": args.batch_count, "checkpoint": checkpoint,
        "precision": args.precision, "step_cache": args.step_cache, "init_image": init_image,
        "denoising_strength": args.denoising_strength, "clip_skip": args.clip_skip,
    }


def _check_loras(line: JobLine, lora_dirs: list[Path], listings: dict[tuple[str, ...], set[str]]) -> None:
    """ValueError when a ``<lora:...>`` tag of the line's prompt is malformed or names no file. ``listings`` keeps
    each folder set's LoRA names, so a job of many lines lists its folders once."""
    from .lora import find_lora, lora_files, parse_prompt_loras, webui_lora_dirs

    _, refs = parse_prompt_loras(line.prompt)
    if not refs:
        return
    folders = lora_dirs or (webui_lora_dirs(line.checkpoint) if line.checkpoint else [])
    key = tuple(map(str, folders))
    if key not in listings:
        listings[key] = set(lora_files(folders))
    for ref in refs:
        if ref.name not in listings[key]:
            find_lora(ref.name, folders)  # raises, saying what is there


def read_job(parser: argparse.ArgumentParser, args: Any) -> list[JobLine]:
    """The job's lines, every one checked (exit 2 on a bad one, unless ``--skip-bad``)."""
    from .samplers import sampler_spec

    defaults = _defaults(parser, args)
    json_lines = args.jobs is not None
    path: Path = args.jobs if json_lines else args.prompts_file
    if json_lines and path.suffix.lower() != ".jsonl":
        parser.error(f"{path}: a job file is JSONL (one JSON object a line) and ends in .jsonl; for a plain list "
                     "of prompts, one a line, use --prompts-file")

    listings: dict[tuple[str, ...], set[str]] = {}

    def resolve(number: int, values: Any) -> JobLine:
        line = resolve_line(number, values, defaults, path.absolute().parent,
                            lambda name: sampler_spec(name).name, _checkpoint_problem, _image_problem)
        _check_loras(line, args.lora_dir, listings)
        return line

    try:
        lines, bad = read_job_lines(path, json_lines, resolve)
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"{path}: cannot read the job file ({getattr(exc, 'strerror', None) or exc})")
    if bad:
        for item in bad[:SHOWN_BAD_LINES]:
            _err(f"{path}:{item.number}: {item.reason}")
        if len(bad) > SHOWN_BAD_LINES:
            _err(f"... and {len(bad) - SHOWN_BAD_LINES} more bad line(s)")
        if not args.skip_bad:
            parser.error(f"{len(bad)} bad line(s) in {path} (listed above); nothing was rendered. Fix them, or "
                         "add --skip-bad to render the other lines")
        _err(f"skipping {len(bad)} bad line(s) (--skip-bad)")
    if not lines:
        parser.error(f"{path} has no job to render")
    return lines


def render_options(parser: argparse.ArgumentParser, args: Any) -> Any:
    """The options every line shares, checked (an unknown device exits 2 before any model loads)."""
    from .batch_render import RenderOptions

    if args.vae is not None and not args.vae.is_file():
        parser.error(f"--vae {args.vae}: no such file")
    options = RenderOptions(
        device=args.device, accelerate=tuple(p for p in PARTS if p not in args.pytorch),
        model_caching=not args.no_cache, cache_dir=str(args.cache_dir) if args.cache_dir is not None else None,
        cache_max_bytes=args.cache_max_size, vae=str(args.vae) if args.vae is not None else None,
        step_cache_depth=args.step_cache_depth, step_cache_start=args.step_cache_start,
        step_cache_end=args.step_cache_end, lora_dirs=tuple(str(d) for d in args.lora_dir),
    )
    try:
        settings = options.settings("auto", args.step_cache)
        if settings.step_cache.enabled and "unet" not in settings.accelerate:
            parser.error("--step-cache caches the UNet's steps in OpenVINO: it cannot go with --pytorch unet")
        if settings.accelerate:
            from ov_backend import build_settings

            build_settings(settings.backend_choice().options())
    except ValueError as exc:
        parser.error(str(exc))
    return options


@dataclass
class Progress:
    """Images done, images a minute and time left, from the images this run rendered."""

    total: int
    done_before: int
    clock: Callable[[], float] = time.perf_counter

    def __post_init__(self) -> None:
        self.started = self.clock()
        self.rendered = 0
        self.failed = 0

    @property
    def per_minute(self) -> float | None:
        elapsed = self.clock() - self.started
        return self.rendered * 60.0 / elapsed if self.rendered and elapsed > 0 else None

    def left_text(self) -> str:
        rate = self.per_minute
        left = self.total - self.done_before - self.rendered - self.failed
        if rate is None:
            return ""
        minutes = left / rate
        when = f"{minutes * 60:.0f}s" if minutes < 1 else f"{minutes:.1f} min" if minutes < 60 else \
            f"{minutes / 60:.1f} h"
        return f"{rate:.2f} images/min, {when} left" if left else f"{rate:.2f} images/min"


def _workers(parser: argparse.ArgumentParser, args: Any, lines: list[JobLine], batches: int,
              renderer: Any) -> Any:
    """The worker plan of ``--workers`` (None: render in this process)."""
    from ov_backend.memory import system_memory

    from .batch_workers import plan_workers, usable_cores, worker_bytes

    if args.workers in (None, "1"):
        return None
    models = {(renderer.checkpoint_path(line), line.precision) for line in lines}
    memory = system_memory()
    try:
        plan = plan_workers(None if args.workers == "auto" else int(args.workers), worker_bytes(models),
                            memory.available if memory is not None else None, usable_cores(), batches)
    except ValueError as exc:
        parser.error(str(exc))
    return plan if plan.workers > 1 else None


def _cluster(parser: argparse.ArgumentParser, args: Any, lines: list[JobLine], options: Any, renderer: Any) -> Any:
    """The Ray cluster of ``--ray`` (exit 2 without Ray, or when no cluster answers)."""
    from .batch_workers import worker_bytes

    try:
        from .batch_ray import RayCluster

        models = {(renderer.checkpoint_path(line), line.precision) for line in lines}
        workers = int(args.workers) if args.workers not in (None, "auto") else None
        return RayCluster(args.ray, options, args.ray_cpus_per_worker, workers, worker_bytes(models), _out)
    except (ImportError, ConnectionError, ValueError) as exc:
        parser.error(str(exc))


def run_batch(parser: argparse.ArgumentParser, args: Any) -> int:
    """Run ``batch``; returns the exit code."""
    lines = read_job(parser, args)
    options = render_options(parser, args)
    from tqdm import tqdm

    from .batch_manifest import Manifest, ManifestError, planned_images
    from .batch_render import BatchRenderer
    from .batch_workers import WorkerPool
    from .checkpoint import CheckpointError
    from .lora import LoraError
    from .pipeline import Interrupted
    from .pnginfo import save_png, write_png_bytes
    from .step_cache import StepCacheUnsupported

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
                _err(text)
            parser.error(f"{len(changed)} line(s) differ from the job this folder's run began with (listed above; "
                         f"{args.out / 'manifest.jsonl'} records it); nothing was rendered. Restore them, or give "
                         "the changed job another --out")
        groups: dict[tuple[str, str, int], list[tuple[JobLine, int, int, list]]] = {}
        total = done_before = 0
        seeds = manifest.seeds(lines)
        for line in lines:
            seed = seeds[line.number]
            images = planned_images(line, seed)
            total += len(images)
            for batch in range(line.batch_count):
                missing = [img for img in images if img.batch == batch and not manifest.done(img)]
                done_before += line.batch_size - len(missing)
                if missing:
                    groups.setdefault(line.setup, []).append((line, seed, batch, missing))
        tasks = [task for group in groups.values() for task in group]
        # every line, rendered or not: at INT8 a graph calibrates on the job's first batch of it, wherever it renders
        options = replace(options, order=tuple((line, seeds[line.number]) for line in lines))
        renderer = BatchRenderer(options, _out)
        cluster = _cluster(parser, args, lines, options, renderer) if args.ray and tasks else None
        plan = _workers(parser, args, lines, len(tasks), renderer) if not args.ray else None
        progress = Progress(total, done_before)
        _out(f"job: {len(lines)} line(s), {total} image(s); {done_before} already in {args.out}, "
             f"{total - done_before} to render" + (f"; {plan.workers} workers ({plan.reason})" if plan else ""))
        failed: list[str] = []

        def save(task: tuple[JobLine, int, int, list], made: list[Any]) -> None:
            line, _, _, missing = task
            by_seed = {item.seed: item for item in made}
            for image in missing:
                item = by_seed[image.seed]
                try:
                    data = getattr(item, "data", None)  # a cluster's worker sends its PNG's bytes
                    if data is not None:
                        write_png_bytes(data, args.out / image.file)
                    else:
                        save_png(item.image, args.out / image.file, item.infotext)
                    manifest.record(image)
                except OSError as exc:
                    failed.append(image.file)
                    progress.failed += 1
                    _err(f"error: could not save {args.out / image.file}: {exc.strerror or exc}")
                    continue
                progress.rendered += 1
                rate = progress.left_text()
                _out(f"[{progress.done_before + progress.rendered}/{total}] line {line.number}, seed {image.seed}: "
                     f"{args.out / image.file} ({item.seconds:.2f}s)" + (f"; {rate}" if rate else ""))

        def line_failed(task: tuple[JobLine, int, int, list], exc: BaseException) -> bool:
            if not isinstance(exc, (CheckpointError, StepCacheUnsupported, LoraError)):
                return False
            _err(f"error: line {task[0].number}: {exc}")
            failed.extend(img.file for img in task[3])
            progress.failed += len(task[3])
            return True

        interrupted = False
        pool = cluster or (WorkerPool(options, plan, _out) if plan is not None else None)
        with StopRequest() as stop:
            try:
                if pool is not None:
                    pool.run(tasks, save, lambda: stop.requested, line_failed)
                for task in tasks if pool is None else []:
                    line, seed, batch, _ = task
                    bar = tqdm(total=line.steps, desc=f"line {line.number}", unit="step", leave=False)

                    def on_step(step: int, steps: int, bar: Any = bar) -> None:
                        bar.total = steps
                        bar.n = step
                        bar.refresh()

                    try:
                        made = renderer.render(line, seed, batch, on_step, lambda: stop.requested)
                    except (CheckpointError, StepCacheUnsupported, LoraError) as exc:
                        line_failed(task, exc)
                        continue
                    finally:
                        bar.close()
                    save(task, made)
            except Interrupted:
                interrupted = True
            finally:
                if cluster is not None:
                    cluster.close()
        eager = renderer.eager_report()
        stats = renderer.close() if pool is None else pool.stats()
    loads, load_seconds = (renderer.loads, renderer.load_seconds) if pool is None else \
        (int(stats.get("loads", 0)), stats.get("load_seconds", 0.0))
    rate = progress.per_minute
    elapsed = time.perf_counter() - progress.started
    _out(f"{progress.rendered} image(s) rendered into {args.out} in {elapsed:.1f}s"
         + (f" ({rate:.2f} images/min)" if rate else "")
         + (f", {done_before} already there" if done_before else "")
         + f"; {progress.done_before + progress.rendered} of {total} done. Model loads {loads} "
         f"({load_seconds:.1f}s), OpenVINO conversions {int(stats.get('conversions', 0))}, compiles "
         f"{int(stats.get('compiles', 0))} ({stats.get('compile_seconds', 0.0):.1f}s), "
         f"OpenVINO calls {int(stats.get('ov_calls', 0))}, PyTorch calls {int(stats.get('eager_calls', 0))}, "
         f"cache hits {int(stats.get('cache_hits', 0))}"
         + (f", cache pruned {format_bytes(stats['cache_pruned_bytes'])}" if stats.get("cache_pruned_bytes") else "")
         + (f"; workers restarted {pool.restarts} time(s)" if getattr(pool, "restarts", 0) else ""))
    if args.verbose:
        for report in renderer.reports:
            _err(report)
    if eager:
        _err(f"warning: {eager}")
    if failed:
        _err(f"error: {len(failed)} image(s) not made; run the same command again to retry them")
    if interrupted:
        _err(f"stopped by Ctrl-C: {progress.done_before + progress.rendered} of {total} image(s) done; run the "
             "same command again to resume")
        return EXIT_INTERRUPTED
    return 1 if failed else 0
