"""From the command line's arguments to what renders: every job line's defaults, the lines, the render options.

``generate`` and ``batch`` take the same render options (``cli._add_render_options``); each is the default of a
job line's field of the same name. ``generate``'s prompts become lines as a job file's would, so the two commands
check a value the same way (:mod:`.rules`) and render through the same :class:`~.render.Renderer`. Everything here
answers before torch or OpenVINO loads, a checkpoint's header and an init image aside.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .batch_jobs import JobLine, resolve_line
from .parts import PARTS

logger = logging.getLogger(__name__)


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a checkpoint that loads, or None."""
    from .checkpoint import CheckpointError, check_checkpoint_file

    try:
        check_checkpoint_file(path)
    except CheckpointError as exc:
        return exc.reason
    return None


def image_problem(path: Path) -> str | None:
    """Why ``path`` is not an image that reads, or None."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img.verify()
    except FileNotFoundError:
        return "no such file: cannot read the image"
    except (OSError, UnidentifiedImageError) as exc:
        return f"cannot read the image ({exc})"
    return None


def line_defaults(parser: argparse.ArgumentParser, args: Any) -> dict[str, Any]:
    """Every job field's value from the command line (exit 2 on a bad checkpoint, init image or sampler)."""
    from .demo_checkpoint import DEMO_SIZE, DEMO_STEPS
    from .samplers import sampler_spec

    files = {}
    for option, path, problem_of in (("--checkpoint", args.checkpoint, checkpoint_problem),
                                     ("--init-image", args.init_image, image_problem)):
        problem = problem_of(path) if path is not None else None
        if problem is not None:
            parser.error(f"{option} {path}: {problem}")
        files[option] = str(path.resolve()) if path is not None else ""
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
        "batch_size": args.batch_size, "batch_count": args.batch_count, "checkpoint": files["--checkpoint"],
        "precision": args.precision, "step_cache": args.step_cache, "init_image": files["--init-image"],
        "denoising_strength": args.denoising_strength, "clip_skip": args.clip_skip,
    }


class LoraCheck:
    """Whether the ``<lora:...>`` tags of a line's prompt name files (each folder set listed once a job)."""

    def __init__(self, lora_dirs: list[Path]) -> None:
        self._dirs = lora_dirs
        self._listings: dict[tuple[str, ...], set[str]] = {}

    def __call__(self, line: JobLine) -> JobLine:
        """``line``, or ValueError when a tag is malformed or names no file (saying what is there)."""
        from .lora import find_lora, lora_files, parse_prompt_loras, webui_lora_dirs

        _, refs = parse_prompt_loras(line.prompt)
        if not refs:
            return line
        folders = self._dirs or (webui_lora_dirs(line.checkpoint) if line.checkpoint else [])
        key = tuple(map(str, folders))
        if key not in self._listings:
            self._listings[key] = set(lora_files(folders))
        for ref in refs:
            if ref.name not in self._listings[key]:
                find_lora(ref.name, folders)  # raises, saying what is there
        return line


def resolver(args: Any, defaults: Mapping[str, Any], base: Path, require_prompt: bool = True) -> Any:
    """``resolve(number, values) -> JobLine`` for lines read from a file in ``base`` (ValueError: what is wrong)."""
    from .samplers import sampler_spec

    loras = LoraCheck(args.lora_dir)

    def resolve(number: int, values: Mapping[str, Any]) -> JobLine:
        return loras(resolve_line(number, values, defaults, base, lambda name: sampler_spec(name).name,
                                  checkpoint_problem, image_problem, require_prompt))

    return resolve


def render_options(parser: argparse.ArgumentParser, args: Any, lines: list[JobLine]) -> Any:
    """The options every line shares, checked with each setup of ``lines`` (an unknown device, INT8 without NNCF
    exit 2 before any model loads)."""
    from .render import RenderOptions

    if args.vae is not None and not args.vae.is_file():
        parser.error(f"--vae {args.vae}: no such file")
    options = RenderOptions(
        device=args.device, accelerate=tuple(p for p in PARTS if p not in args.pytorch),
        model_caching=not args.no_cache, cache_dir=str(args.cache_dir) if args.cache_dir is not None else None,
        cache_max_bytes=args.cache_max_size, vae=str(args.vae) if args.vae is not None else None,
        step_cache_depth=args.step_cache_depth, step_cache_start=args.step_cache_start,
        step_cache_end=args.step_cache_end, lora_dirs=tuple(str(d) for d in args.lora_dir),
    )
    for precision, step_cache in sorted({(line.precision, line.step_cache) for line in lines}):
        try:
            settings = options.settings(precision, step_cache)
            if settings.step_cache.enabled and "unet" not in settings.accelerate:
                parser.error("--step-cache caches the UNet's steps in OpenVINO: it cannot go with --pytorch unet")
            if settings.accelerate:
                from ov_backend import build_settings

                build_settings(settings.backend_choice().options())
        except ValueError as exc:
            parser.error(str(exc))
    return options
