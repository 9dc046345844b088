"""The ``generate`` command: arguments -> jobs -> PNG files, with progress and a summary.

Everything a user can get wrong is checked before the model loads (argparse message, exit 2).
"""

from __future__ import annotations

import argparse
import logging
import re
import time
from pathlib import Path
from typing import Any

from .cli import EXIT_INTERRUPTED, StopRequest, _err, _out

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


def _validate(parser: argparse.ArgumentParser, args: Any) -> tuple[list, Any, Path | None]:
    """Jobs, SD settings and the checkpoint path (None for the demo), or exit 2."""
    from PIL import Image, UnidentifiedImageError

    from .demo import DEMO_SIZE, DEMO_STEPS
    from .pipeline import GenerationJob
    from .settings import build_sd_settings

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
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a folder")
    options: dict[str, Any] = {
        "device": args.device, "precision": args.precision, "model_caching": not args.no_cache,
        "accelerate": [p for p in ("text_encoder", "unet", "vae") if p not in args.pytorch],
    }
    if args.cache_dir is not None:
        options["cache_dir"] = str(args.cache_dir)
    settings = build_sd_settings(options)
    if settings.accelerate:
        from ov_backend import build_settings

        try:
            build_settings(settings.to_backend_options())
        except ValueError as exc:
            parser.error(str(exc))
    size = DEMO_SIZE if args.demo else 512
    jobs = []
    for prompt in _prompts(parser, args):
        job = GenerationJob(
            prompt=prompt, negative_prompt=args.negative_prompt,
            steps=args.steps or (DEMO_STEPS if args.demo else 20), cfg_scale=args.cfg_scale,
            sampler=args.sampler, width=args.width or size, height=args.height or size, seed=args.seed,
            batch_size=args.batch_size, batch_count=args.batch_count, init_image=init_image,
            denoising_strength=args.denoising_strength, clip_skip=args.clip_skip,
        )
        try:
            jobs.append(job.validated())
        except ValueError as exc:
            parser.error(str(exc))
    return jobs, settings, args.checkpoint


def run_generate(parser: argparse.ArgumentParser, args: Any) -> int:
    """Run ``generate``; returns the exit code (0, or 130 when stopped with Ctrl-C)."""
    jobs, settings, checkpoint = _validate(parser, args)
    from tqdm import tqdm

    from .accelerate import Accelerator
    from .checkpoint import CheckpointError, file_hash
    from .demo import demo_checkpoint
    from .loader import load_components
    from .pipeline import Generator, Interrupted
    from .pnginfo import save_png

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
        accelerator.apply()
    parts = "+".join(settings.accelerate) or "none"
    generator = Generator(components, Path(checkpoint).stem, file_hash(checkpoint), {
        "OpenVINO device": settings.device if settings.accelerate else None,
        "OpenVINO precision": settings.precision if settings.accelerate else None,
        "OpenVINO parts": parts,
    })
    load_seconds = time.perf_counter() - started
    _out(f"loaded {checkpoint} ({components.family}) in {load_seconds:.1f}s; OpenVINO on "
         f"{settings.device} for: {parts}")

    args.out.mkdir(parents=True, exist_ok=True)
    number = _next_number(args.out)
    total = sum(job.images for job in jobs)
    saved: list[Path] = []
    run_started = time.perf_counter()
    interrupted = False
    with StopRequest() as stop:
        try:
            for job_index, job in enumerate(jobs):
                for batch in range(job.batch_count):
                    label = f"image {len(saved) + 1}-{len(saved) + job.batch_size}/{total}"
                    if job.batch_size == 1:
                        label = f"image {len(saved) + 1}/{total}"
                    bar = tqdm(total=job.steps, desc=label, unit="step", leave=False)

                    def on_step(step: int, steps: int, bar: Any = bar) -> None:
                        bar.total = steps
                        bar.n = step
                        bar.refresh()

                    try:
                        images = generator.run_batch(job, batch, on_step, lambda: stop.requested)
                    finally:
                        bar.close()
                    for item in images:
                        path = save_png(item.image, args.out / f"{number:05d}-{item.seed}.png", item.infotext)
                        number += 1
                        saved.append(path)
                        _out(f"[{len(saved)}/{total}] job {job_index + 1}, seed {item.seed}: {path} "
                             f"({item.seconds:.2f}s)")
        except Interrupted:
            interrupted = True
    run_seconds = time.perf_counter() - run_started
    stats = accelerator.stats()
    compile_seconds = float(stats.get("compile_seconds", 0.0))
    if args.verbose and accelerator.backend is not None:
        for report in accelerator.backend.reports:
            _err(report.summary())
    per_image = run_seconds / len(saved) if saved else 0.0
    _out(f"{len(saved)} image(s) in {args.out}: load {load_seconds:.1f}s, compile {compile_seconds:.1f}s, "
         f"run {max(run_seconds - compile_seconds, 0.0):.1f}s, {per_image:.2f}s per image "
         f"(OpenVINO calls {int(stats.get('ov_calls', 0))}, PyTorch calls {int(stats.get('eager_calls', 0))}, "
         f"cache hits {int(stats.get('cache_hits', 0))})")
    if interrupted:
        _err(f"stopped by Ctrl-C: kept {len(saved)} of {total} image(s)")
        return EXIT_INTERRUPTED
    return 0
