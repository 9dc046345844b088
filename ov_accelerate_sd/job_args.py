"""What both commands check of a job before it renders: the LoRA files its prompts name, and the render options.

``generate`` and ``batch`` take the same render options (``cli._add_render_options``); each is the default of a job
line's field of the same name (:func:`.jobs.line_defaults`). ``generate``'s prompts become lines as a job file's would
(:func:`resolver`), so the two commands check a value the same way (:data:`.jobs.RULES`) and render through the same
:class:`~.render.Renderer`. Everything here answers before torch or OpenVINO loads, a checkpoint's header aside.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .jobs import JobLine, checkpoint_problem, image_problem, resolve_line
from .parts import PARTS

logger = logging.getLogger(__name__)


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
