"""A batch job's lines: reading a job file, checking every line before anything renders, the images it plans.

Owns :data:`JOB_FIELDS` (the fields a job line may set, their types, and the command-line option each one
defaults from), :class:`JobLine` (one line, every field resolved), :func:`read_job_lines` (a JSONL file, one
JSON object a line, or a plain prompts file, one prompt a line) and :class:`BadLine` (what is wrong with a line
and where). A line's ``fingerprint`` is what a resumed run compares: the resolved fields, the random seed of a
``seed: -1`` line excepted (the run's manifest keeps the seed it drew).

Imports neither torch nor OpenVINO: a job file with a bad line is refused at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ov_backend.precision import PRECISIONS

from .rules import MIN_SIZE, check_fields

logger = logging.getLogger(__name__)


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
