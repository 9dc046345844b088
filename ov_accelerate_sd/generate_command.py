"""The ``generate`` command: arguments -> jobs -> PNG files, with progress and a summary.

Everything a user can get wrong is checked before the model loads (argparse message, exit 2),
the output folder included. A PNG that still cannot be saved is reported (file and reason) and
the run goes on with the next image; the exit code is then 1.

The summary keeps the first batch apart: it holds every part's first call (dynamo's capture and
OpenVINO's compile), so the steady-state numbers (s/it, seconds per image) come from the steps
and batches after it. A batch dropped by Ctrl-C adds its steps to s/it but no image.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ov_backend.files import format_bytes

from .cli import EXIT_INTERRUPTED, StopRequest, _err, _out
from .parts import PARTS

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


class RunTimes:
    """Timings of a run for its summary, from a clock (``time.perf_counter`` unless given).

    Call ``batch_started`` before a batch, ``step`` after each sampler step, then ``batch_done``
    with the images kept or ``batch_dropped``. The first batch is the warm-up (each part's first
    call: dynamo capture and OpenVINO compile); s/it is the mean time between consecutive steps
    of a batch (the time before a batch's first step, prompt encoding and in the first batch the
    UNet's first call, is left out), and seconds per image come from the kept batches after the
    first.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._batch_start = 0.0
        self._last_step: float | None = None
        self.batches = 0
        self.first_batch_seconds: float | None = None
        self.step_seconds = 0.0
        self.step_intervals = 0
        self.steady_seconds = 0.0
        self.steady_images = 0

    def batch_started(self) -> None:
        self._batch_start = self._clock()
        self._last_step = None

    def step(self) -> None:
        now = self._clock()
        if self._last_step is not None:
            self.step_seconds += now - self._last_step
            self.step_intervals += 1
        self._last_step = now

    def _batch_ended(self) -> float:
        seconds = self._clock() - self._batch_start
        self.batches += 1
        if self.batches == 1:
            self.first_batch_seconds = seconds
        return seconds

    def batch_done(self, images: int) -> None:
        seconds = self._batch_ended()
        if self.batches > 1:
            self.steady_seconds += seconds
            self.steady_images += images

    def batch_dropped(self) -> None:
        self._batch_ended()

    @property
    def seconds_per_step(self) -> float | None:
        return self.step_seconds / self.step_intervals if self.step_intervals else None

    @property
    def seconds_per_image(self) -> float | None:
        """Per kept image after the first batch; None when there is none."""
        return self.steady_seconds / self.steady_images if self.steady_images else None

    def describe(self, stats: dict[str, float] | None) -> str:
        """"first batch 7.1s (first calls: graph capture 9.1s, 3 captured and saved for the next run;
        OpenVINO compile 5.2s), then 0.21 s/it, ...".

        Args:
            stats: the backend's counters, None when no part runs through it.
        """
        if self.first_batch_seconds is None:
            return "no batch finished"
        text = f"first batch {self.first_batch_seconds:.1f}s"
        if stats is not None:
            text += f" (first calls: {capture_text(stats)}OpenVINO compile {stats.get('compile_seconds', 0.0):.1f}s)"
        steady = []
        if self.seconds_per_step is not None:
            steady.append(f"{self.seconds_per_step:.2f} s/it")
        if self.seconds_per_image is not None:
            steady.append(f"{self.seconds_per_image:.2f}s per image after the first batch")
        return text + (", then " + ", ".join(steady) if steady else "")


def capture_text(stats: dict[str, float]) -> str:
    """What the parts' graph capture (dynamo tracing their code) cost: "graph capture 9.1s, 3 captured and
    saved for the next run; " or "graph capture 0.9s, 3 loaded from the cache; " ("" when not measured)."""
    made, saved, loaded = (int(stats.get(k, 0)) for k in ("captures_made", "captures_saved", "captures_loaded"))
    what = []
    if made:
        what.append(f"{made} captured" + (" and saved for the next run" if saved == made else f", {saved} saved"))
    if loaded:
        what.append(f"{loaded} loaded from the cache")
    return f"graph capture {stats.get('capture_seconds', 0.0):.1f}s, {', '.join(what)}; " if what else ""


def _validate(parser: argparse.ArgumentParser, args: Any) -> tuple[list, Any, Path | None]:
    """Jobs, SD settings and the checkpoint path (None for the demo), or exit 2.

    Files, prompts and the output folder are checked first, before torch and OpenVINO load.
    """
    from PIL import Image, UnidentifiedImageError

    if args.checkpoint is not None and not args.checkpoint.is_file():
        parser.error(f"--checkpoint {args.checkpoint}: no such file")
    if args.vae is not None and not args.vae.is_file():
        parser.error(f"--vae {args.vae}: no such file")
    init_image = None
    if args.init_image is not None:
        try:
            with Image.open(args.init_image) as img:
                init_image = img.convert("RGB")
        except (OSError, UnidentifiedImageError) as exc:
            parser.error(f"--init-image {args.init_image}: cannot read the image ({exc})")
    prompts = _prompts(parser, args)
    problem = out_folder_problem(args.out)
    if problem is not None:
        parser.error(f"--out {args.out}: {problem}")

    from .lora import find_lora, parse_prompt_loras, webui_lora_dirs

    lora_dirs = args.lora_dir or (webui_lora_dirs(args.checkpoint) if args.checkpoint is not None else [])
    for prompt in prompts:
        try:
            for ref in parse_prompt_loras(prompt)[1]:
                find_lora(ref.name, lora_dirs)
        except ValueError as exc:
            parser.error(str(exc))

    from .demo_checkpoint import DEMO_SIZE, DEMO_STEPS
    from .pipeline import GenerationJob
    from .samplers import sampler_spec
    from .settings import build_sd_settings

    try:
        sampler = sampler_spec(args.sampler).name
    except ValueError as exc:
        parser.error(f"argument --sampler: {exc}")
    options: dict[str, Any] = {
        "device": args.device, "precision": args.precision, "model_caching": not args.no_cache,
        "cache_max_bytes": args.cache_max_size,
        "accelerate": [p for p in PARTS if p not in args.pytorch],
        "step_cache": {"interval": args.step_cache, "depth": args.step_cache_depth,
                       "full_start": args.step_cache_start, "full_end": args.step_cache_end},
    }
    if args.cache_dir is not None:
        options["cache_dir"] = str(args.cache_dir)
    try:
        settings = build_sd_settings(options)
    except ValueError as exc:
        parser.error(str(exc))
    if settings.step_cache.enabled and "unet" not in settings.accelerate:
        parser.error("--step-cache caches the UNet's steps in OpenVINO: it cannot go with --pytorch unet")
    if settings.accelerate:
        from ov_backend import build_settings

        try:
            build_settings(settings.backend_choice().options())
        except ValueError as exc:
            parser.error(str(exc))
    size = DEMO_SIZE if args.demo else 512
    jobs = []
    for prompt in prompts:
        job = GenerationJob(
            prompt=prompt, negative_prompt=args.negative_prompt,
            steps=args.steps or (DEMO_STEPS if args.demo else 20), cfg_scale=args.cfg_scale,
            sampler=sampler, width=args.width or size, height=args.height or size, seed=args.seed,
            batch_size=args.batch_size, batch_count=args.batch_count, init_image=init_image,
            denoising_strength=args.denoising_strength, clip_skip=args.clip_skip,
        )
        try:
            jobs.append(job.validated())
        except ValueError as exc:
            parser.error(str(exc))
    return jobs, settings, args.checkpoint


def run_generate(parser: argparse.ArgumentParser, args: Any) -> int:
    """Run ``generate``; returns the exit code: 0, 1 when a PNG could not be saved, 130 after Ctrl-C."""
    jobs, settings, checkpoint = _validate(parser, args)
    from tqdm import tqdm

    from .accelerate import Accelerator
    from .checkpoint import CheckpointError, file_hash
    from .demo_checkpoint import demo_checkpoint
    from .loader import load_components
    from .lora import LoraError, webui_lora_dirs
    from .openvino_entry import ENTRY_KEY, format_entry
    from .pipeline import Generator, Interrupted
    from .pnginfo import save_png
    from .step_cache import StepCacheUnsupported

    started = time.perf_counter()
    if checkpoint is None:
        checkpoint = demo_checkpoint()
        _out(f"demo checkpoint (random weights, its images are noise): {checkpoint}")
    try:
        components = load_components(checkpoint, vae_path=args.vae)
    except CheckpointError as exc:
        parser.error(str(exc))
    accelerator = Accelerator(components, settings)
    if settings.accelerate:
        try:
            accelerator.apply()
        except StepCacheUnsupported as exc:
            parser.error(f"--step-cache: {exc}")
    parts = "+".join(settings.accelerate) or "none"
    # the WebUI's own entry, so the image pastes back into its panel (no entry: made in PyTorch)
    entry = format_entry(settings.device, settings.accelerate, settings.precision,
                         step_cache=settings.step_cache.interval) if settings.accelerate else None
    generator = Generator(components, Path(checkpoint).stem, file_hash(checkpoint), {ENTRY_KEY: entry},
                          step_cache=accelerator.step_cache, lora_dirs=args.lora_dir or webui_lora_dirs(checkpoint))
    load_seconds = time.perf_counter() - started
    _out(f"loaded {checkpoint} ({components.family}) in {load_seconds:.1f}s; OpenVINO on "
         f"{settings.device} for: {parts}")

    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _err(f"error: cannot create --out {args.out}: {exc.strerror or exc}")
        return 1
    number = _next_number(args.out)
    total = sum(job.images for job in jobs)
    saved: list[Path] = []
    failed: list[Path] = []
    times = RunTimes()
    interrupted = False
    with StopRequest() as stop:
        try:
            for job_index, job in enumerate(jobs):
                for batch in range(job.batch_count):
                    done = len(saved) + len(failed)
                    label = f"image {done + 1}-{done + job.batch_size}/{total}"
                    if job.batch_size == 1:
                        label = f"image {done + 1}/{total}"
                    bar = tqdm(total=job.steps, desc=label, unit="step", leave=False)

                    def on_step(step: int, steps: int, bar: Any = bar) -> None:
                        times.step()
                        bar.total = steps
                        bar.n = step
                        bar.refresh()

                    times.batch_started()
                    try:
                        mark = accelerator.backends.mark()
                        images = generator.run_batch(job, batch, on_step, lambda: stop.requested)
                        # at INT8 each UNet graph is quantized on its first batch's calls alone (during the batch at
                        # calibration_samples calls, else at its end); the batch, which ran the UNet at float while
                        # it was recorded, renders again at INT8
                        accelerator.calibrate()
                        quantizing = [r for r in accelerator.backends.reports_since(mark) if r.route == "int8"]
                        if quantizing:
                            _out("INT8: " + "; ".join(r.summary() for r in quantizing)
                                 + "; the batch renders again at INT8")
                            images = generator.run_batch(job, batch, on_step, lambda: stop.requested)
                    except Interrupted:
                        times.batch_dropped()
                        raise
                    except LoraError as exc:
                        parser.error(f"job {job_index + 1}: {exc}")
                    finally:
                        bar.close()
                    times.batch_done(len(images))
                    for item in images:
                        path = args.out / f"{number:05d}-{item.seed}.png"
                        number += 1
                        try:
                            save_png(item.image, path, item.infotext)
                        except OSError as exc:
                            failed.append(path)
                            _err(f"error: could not save {path}: {exc.strerror or exc}")
                            continue
                        saved.append(path)
                        _out(f"[{len(saved) + len(failed)}/{total}] job {job_index + 1}, seed {item.seed}: {path} "
                             f"({item.seconds:.2f}s)")
        except Interrupted:
            interrupted = True
    stats = accelerator.stats()
    if args.verbose:
        for report in accelerator.backends.reports():
            _err(report.summary())
    pruned = int(stats.get("cache_pruned", 0))
    usage = accelerator.backends.cache_usage(settings.backend_choice()) if settings.accelerate else None
    if usage is not None and (pruned or usage.over_limit or args.verbose):
        _out(f"disk cache: {usage.text()}"
             + (f"; removed {pruned} least recently used entries "
                f"({format_bytes(stats.get('cache_pruned_bytes', 0))})" if pruned else ""))
    _out(f"{len(saved)} image(s) in {args.out}: load {load_seconds:.1f}s, "
         f"{times.describe(stats if settings.accelerate else None)} "
         f"(OpenVINO calls {int(stats.get('ov_calls', 0))}, PyTorch calls {int(stats.get('eager_calls', 0))}, "
         f"cache hits {int(stats.get('cache_hits', 0))})")
    if accelerator.step_cache is not None:
        _out(accelerator.step_cache.describe())
    eager = accelerator.eager_report()
    if eager:
        _err(f"warning: {eager}")
    if failed:
        _err(f"error: {len(failed)} image(s) could not be saved in {args.out}")
    if interrupted:
        _err(f"stopped by Ctrl-C: kept {len(saved)} of {total} image(s)")
        return EXIT_INTERRUPTED
    return 1 if failed else 0
