"""The rules of every value a user gives a render, written once.

The command line (each option's type), the job file (each line's fields) and the library
(``GenerationJob.validated``) check the same fields with the same :data:`RULES` and say the same thing when one
is wrong: the field, the value and what would be right. Imports neither torch nor OpenVINO, so the command line
answers a bad value before any model loads.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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
