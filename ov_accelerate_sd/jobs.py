"""A job's lines, ``generate``'s and ``batch``'s: the fields, the rules of their values, a job file read and checked.

Owns :data:`RULES` (what every value a user gives a render must be, written once: the command line's option types
(:func:`option`), the job file's lines and the library's ``GenerationJob`` check with it and say the same thing),
:data:`JOB_FIELDS` (the fields a job line may set, their types, and the command-line option each one defaults from:
:func:`line_defaults`),
:class:`JobLine` (one line, every field resolved), :func:`read_job_lines` (a JSONL file, one JSON object a line, or a
plain prompts file, one prompt a line) and :class:`BadLine` (what is wrong with a line and where). A line's
``fingerprint`` is what a resumed run compares: the resolved fields, the random seed of a ``seed: -1`` line excepted
(the run's manifest keeps the seed it drew).

Imports neither torch nor OpenVINO: a bad value or a job file with a bad line is refused at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ov_backend.precision import PRECISIONS

logger = logging.getLogger(__name__)

#: The largest seed (the WebUI's: a 32-bit unsigned integer); -1 asks for a random one.
MAX_SEED = 2**32 - 1
#: The smallest width or height: the WebUI's sliders start there, and a latent of fewer than 8 cells is not a picture.
MIN_SIZE = 64


@dataclass(frozen=True)
class Rule:
    """What a value of one field must be."""

    holds: Callable[[Any], bool]
    text: str
    """What would be right, after "must be"."""
    unknown_name: bool = False
    """The value is a name from a list (a precision): "unknown precision 'fp8'; valid: ..." rather than "must be"."""

    def problem(self, name: str, value: Any) -> str | None:
        """What is wrong with ``value`` of field ``name`` ("width 100 must be ..."), or None when it holds."""
        if self.holds(value):
            return None
        if self.unknown_name:
            return f"unknown {name} {value!r}; valid: {self.text}"
        return f"{name} {value} must be {self.text}"


_AT_LEAST_1 = Rule(lambda v: v >= 1, "at least 1")
_SIZE = Rule(lambda v: v >= MIN_SIZE and v % 8 == 0, f"a multiple of 8 and at least {MIN_SIZE} (e.g. 512, 768)")

#: The fields a render takes, by the name the job file and ``GenerationJob`` give them.
RULES: dict[str, Rule] = {
    "width": _SIZE,
    "height": _SIZE,
    "steps": _AT_LEAST_1,
    "batch_size": _AT_LEAST_1,
    "batch_count": _AT_LEAST_1,
    "clip_skip": _AT_LEAST_1,
    "step_cache": _AT_LEAST_1,
    "cfg_scale": Rule(lambda v: math.isfinite(v) and v >= 0.0, "a finite number >= 0 (e.g. 7)"),
    "denoising_strength": Rule(lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "seed": Rule(lambda v: -1 <= v <= MAX_SEED, f"-1 (random) or in 0..{MAX_SEED}"),
    "precision": Rule(lambda v: v in PRECISIONS, ", ".join(PRECISIONS), unknown_name=True),
    # the command line's shape of step caching (StepCacheSettings checks the library's)
    "step_cache_depth": _AT_LEAST_1,
    "step_cache_start": _AT_LEAST_1,
    "step_cache_end": Rule(lambda v: v >= 0, "at least 0"),
}


def check_fields(fields: Mapping[str, Any], sampler_name: Callable[[str], str] | None = None) -> dict[str, Any]:
    """``fields`` checked against :data:`RULES` (the ones it has), with the sampler's canonical name when
    ``sampler_name`` is given.

    Raises:
        ValueError: the first field that is wrong: "width 100 must be a multiple of 8 and at least 64 (e.g. 512, 768)".
    """
    checked = dict(fields)
    for name, rule in RULES.items():
        if name in checked:
            problem = rule.problem(name, checked[name])
            if problem is not None:
                raise ValueError(problem)
    if sampler_name is not None and "sampler" in checked:
        checked["sampler"] = sampler_name(checked["sampler"])
    return checked


def option(name: str, convert: Callable[[str], Any] = int) -> Callable[[str], Any]:
    """An argparse ``type`` for the option of field ``name``: the text converted, then checked by its rule
    (argparse says "argument --width: 100 must be a multiple of 8 ...")."""
    rule = RULES[name]
    kind = "an integer" if convert is int else "a number"

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        if not rule.holds(value):
            raise argparse.ArgumentTypeError(f"{text} must be {rule.text}")
        return value

    parse.__name__ = name  # argparse names the type in its own messages
    return parse


@dataclass(frozen=True)
class FieldSpec:
    """One field a job line may set."""

    kind: str
    """"text", "integer", "number" or "path": what the JSON value must be."""
    option: str
    """The command-line option whose value a line without the field takes."""
    help: str


#: The fields of a job line, in the order the docs list them.
JOB_FIELDS: dict[str, FieldSpec] = {
    "prompt": FieldSpec("text", "--prompt", "the prompt (WebUI syntax); required unless --prompt gives one"),
    "negative_prompt": FieldSpec("text", "--negative-prompt", "the negative prompt"),
    "seed": FieldSpec("integer", "--seed", "-1: random (drawn once, kept in the manifest); image i gets seed + i"),
    "width": FieldSpec("integer", "--width", f"a multiple of 8, at least {MIN_SIZE}"),
    "height": FieldSpec("integer", "--height", f"a multiple of 8, at least {MIN_SIZE}"),
    "steps": FieldSpec("integer", "--steps", "sampling steps, at least 1"),
    "sampler": FieldSpec("text", "--sampler", "a WebUI sampler name, e.g. 'DPM++ 2M Karras'"),
    "cfg_scale": FieldSpec("number", "--cfg-scale", "classifier-free guidance scale, >= 0"),
    "batch_size": FieldSpec("integer", "--batch-size", "images rendered together"),
    "batch_count": FieldSpec("integer", "--batch-count", "batches rendered one after the other"),
    "checkpoint": FieldSpec("path", "--checkpoint", "a WebUI checkpoint; relative to the job file's folder"),
    "precision": FieldSpec("text", "--precision", f"one of {', '.join(PRECISIONS)}"),
    "step_cache": FieldSpec("integer", "--step-cache", "step caching interval, 1 (off) to any N"),
    "init_image": FieldSpec("path", "--init-image", "img2img: the image to start from; relative to the job file"),
    "denoising_strength": FieldSpec("number", "--denoising-strength", "img2img: in (0, 1]"),
    "clip_skip": FieldSpec("integer", "--clip-skip", "stop the text encoder this many layers before its last"),
}


def option_values(args: Any) -> dict[str, Any]:
    """Every job field's value as the command line's arguments give it (from the option :data:`JOB_FIELDS` names;
    None where the option has no default)."""
    return {name: getattr(args, spec.option.lstrip("-").replace("-", "_")) for name, spec in JOB_FIELDS.items()}


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

    values = option_values(args)
    for name, problem_of in (("checkpoint", checkpoint_problem), ("init_image", image_problem)):
        path = values[name]
        problem = problem_of(path) if path is not None else None
        if problem is not None:
            parser.error(f"{JOB_FIELDS[name].option} {path}: {problem}")
        values[name] = str(path.resolve()) if path is not None else ""
    try:
        values["sampler"] = sampler_spec(args.sampler).name
    except ValueError as exc:
        parser.error(f"argument --sampler: {exc}")
    demo = args.checkpoint is None
    size = DEMO_SIZE if demo else 512
    values.update(prompt=values["prompt"] or "", width=values["width"] or size, height=values["height"] or size,
                  steps=values["steps"] or (DEMO_STEPS if demo else 20))
    return values


@dataclass(frozen=True)
class JobLine:
    """One line of a job, every field resolved (the line's own value, else the command line's)."""

    number: int
    """The line's number in the file, from 1."""
    prompt: str
    negative_prompt: str
    seed: int
    """As written: -1 asks for a random seed, which the run draws once and keeps."""
    width: int
    height: int
    steps: int
    sampler: str
    """The sampler's canonical WebUI name."""
    cfg_scale: float
    batch_size: int
    batch_count: int
    checkpoint: str
    """An absolute path; "" for the demo model."""
    precision: str
    step_cache: int
    init_image: str
    """An absolute path; "" for txt2img."""
    denoising_strength: float
    clip_skip: int

    @property
    def images(self) -> int:
        return self.batch_size * self.batch_count

    def fields(self) -> dict[str, Any]:
        """The resolved fields (what a manifest records), without the line number."""
        values = dataclasses.asdict(self)
        values.pop("number")
        return values

    @property
    def fingerprint(self) -> str:
        """A digest of the resolved fields: a resumed run's line must have the same one."""
        text = json.dumps(self.fields(), sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]

    @property
    def setup(self) -> tuple[str, str, int]:
        """What a change of costs a model load or a new compile: (checkpoint, precision, step caching)."""
        return self.checkpoint, self.precision, self.step_cache


@dataclass(frozen=True)
class BadLine:
    """A line that cannot render: its number, its text (shortened) and what is wrong."""

    number: int
    text: str
    reason: str

    def describe(self) -> str:
        shown = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        return f"line {self.number}: {self.reason} (in: {shown})"


def _typed(name: str, value: Any) -> Any:
    """``value`` of field ``name`` if its JSON type fits, else ValueError saying what would be right."""
    kind = JOB_FIELDS[name].kind
    if kind in ("text", "path"):
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {json.dumps(value)}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {json.dumps(value)}")
    if kind == "integer":
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{name} must be a whole number, got {value}")
        return int(value)
    return float(value)


def _path(value: str, base: Path, name: str, check: Callable[[Path], str | None]) -> str:
    """An absolute path for ``value`` (relative to ``base``), or ValueError when ``check`` finds a problem."""
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = base / path
    problem = check(path)
    if problem is not None:
        raise ValueError(f"{name} {value}: {problem}")
    return str(path.resolve())


def resolve_line(
    number: int,
    values: Mapping[str, Any],
    defaults: Mapping[str, Any],
    base: Path,
    sampler_name: Callable[[str], str],
    checkpoint_problem: Callable[[Path], str | None],
    image_problem: Callable[[Path], str | None],
    require_prompt: bool = True,
) -> JobLine:
    """One line from its own values over the defaults.

    Args:
        number: the line's number in the file.
        values: the line's fields (JSON values).
        defaults: every field's value from the command line ("checkpoint" and "init_image" "" when not given).
        base: the folder relative paths in the line are read from.
        sampler_name: a sampler's canonical name, or ValueError naming the valid ones.
        checkpoint_problem: why a checkpoint path cannot load, or None.
        image_problem: why an init image cannot be read, or None.
        require_prompt: refuse an empty prompt (a job file's line without one is a mistake; ``generate``'s
            ``--prompt ""`` renders the unconditional picture, as the WebUI does).

    Raises:
        ValueError: what is wrong with the line and what would be right.
    """
    unknown = sorted(set(values) - set(JOB_FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}; valid fields: {', '.join(JOB_FIELDS)}")
    fields = {name: _typed(name, value) for name, value in values.items()}
    for name in ("checkpoint", "init_image"):
        if name in fields:
            fields[name] = _path(fields[name], base, name,
                                 checkpoint_problem if name == "checkpoint" else image_problem)
    resolved = {**defaults, **fields}
    if require_prompt and not resolved["prompt"].strip():
        raise ValueError("prompt is empty: give \"prompt\" in the line (or --prompt for every line)")
    return JobLine(number=number, **check_fields(resolved, sampler_name))


def read_job_lines(
    path: Path,
    json_lines: bool,
    resolve: Callable[[int, Mapping[str, Any]], JobLine],
) -> tuple[list[JobLine], list[BadLine]]:
    """Every line of a job file, checked: the good ones and the bad ones, in file order.

    Blank lines are skipped (their numbers still count, so a number names the line an editor shows).

    Args:
        path: the job file.
        json_lines: True: one JSON object a line; False: one prompt a line.
        resolve: a line's number and values -> the resolved line, or ValueError (see :func:`resolve_line`).

    Raises:
        OSError: the file cannot be read.
        UnicodeDecodeError: the file is not UTF-8.
    """
    good: list[JobLine] = []
    bad: list[BadLine] = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        text = raw.strip()
        if not text:
            continue
        try:
            if json_lines:
                try:
                    values = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno}); each line must be one "
                                     "JSON object, e.g. {\"prompt\": \"a red fox\", \"seed\": 1}") from None
                if not isinstance(values, dict):
                    raise ValueError(f"a line must be one JSON object, got {type(values).__name__}")
            else:
                values = {"prompt": text}
            good.append(resolve(number, values))
        except ValueError as exc:
            bad.append(BadLine(number, text, str(exc)))
    return good, bad
