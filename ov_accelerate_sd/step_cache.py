"""Step caching for the UNet (DeepCache: Ma, Fang, Wang, CVPR 2024): full steps and shallow steps.

A UNet's deep features change slowly between adjacent denoising steps. On a *full* step the whole UNet
runs and the feature entering its last ``depth`` output blocks is kept; on the *shallow* steps between,
only the first ``depth`` input blocks and the last ``depth`` output blocks run, on that kept feature (their
skip connections are their own, fresh; :mod:`.unet_split` splits a UNet's forward so). Owns:

- :class:`StepCacheSettings`: the interval (a full step every N sampler steps; 1 is off), the depth and
  the full steps kept at the start and the end of sampling, and the schedule that follows from them;
- :class:`StepCacheRun`: one generation's state: the sampler step, the features kept at the last full
  step, and which calls ran full or shallow and why.

A feature is reused only by a call of the same UNet module, weights, input size, prompt (the context's
values) and extra conditioning (SDXL's ``y``) as the full call that made it, on a step the schedule marks
shallow; anything else runs the full UNet. Knows torch only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ov_backend.weights import version_of

from .unet_split import StepCacheUnsupported

logger = logging.getLogger(__name__)

#: The intervals a user picks from (1: off).
INTERVALS: tuple[int, ...] = (1, 2, 3, 4)


@dataclass(frozen=True)
class StepCacheSettings:
    """How step caching runs. Defaults: off."""

    interval: int = 1
    """A full UNet step every ``interval`` sampler steps, shallow steps between; 1: off (every step full)."""
    depth: int = 2
    """How many of the UNet's input blocks (and as many of its last output blocks) a shallow step runs;
    the rest is the cached branch. SD 1.x/2.x have 12 input blocks, SDXL 9."""
    full_start: int = 2
    """Sampler steps at the start that always run the full UNet (the first one at least: nothing is cached
    yet)."""
    full_end: int = 1
    """Sampler steps at the end that always run the full UNet."""

    def __post_init__(self) -> None:
        for name, low in (("interval", 1), ("depth", 1), ("full_start", 1), ("full_end", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"step caching {name} must be a whole number >= {low}, got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.interval > 1

    def full_step(self, step: int, steps: int | None) -> bool:
        """Whether sampler step ``step`` (from 0) of ``steps`` runs the full UNet (``steps`` None: unknown,
        then only the start's full steps are kept)."""
        if not self.enabled or step < self.full_start:
            return True
        if steps is not None and step >= steps - self.full_end:
            return True
        return (step - self.full_start) % self.interval == self.interval - 1

    def schedule(self, steps: int) -> str:
        """The schedule over ``steps`` sampler steps: ``F`` for a full step, ``s`` for a shallow one."""
        return "".join("F" if self.full_step(i, steps) else "s" for i in range(steps))


# --- one generation's state ------------------------------------------------------------------------


def weights_version(module: torch.nn.Module) -> tuple[int, int]:
    """What changes when ``module``'s weights are written (in place: a LoRA, a checkpoint loaded into it)
    or replaced: the sum of its parameters' in-place versions, and of their storage addresses."""
    versions = addresses = 0
    for p in module.parameters():
        versions += version_of(p)
        addresses += p.data_ptr()
    return versions, addresses


@dataclass
class _Kept:
    """A feature kept by a full call, with what a shallow call must share with it to use it."""

    module: Any
    weights: tuple[int, int]
    shape: tuple[int, ...]
    context: Any
    extra: Any
    feature: torch.Tensor


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(a, b)))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a is b or a == b


@dataclass
class StepCacheRun:
    """One generation's step caching: the sampler step, the features kept and what each call ran.

    The caller says when a sampling begins (:meth:`begin`: each image batch, each hires pass) and which
    sampler step a UNet call belongs to (:meth:`at_step`); :meth:`call` then runs the call full or shallow.
    """

    settings: StepCacheSettings
    step: int | None = None
    steps: int | None = None
    full_calls: int = 0
    shallow_calls: int = 0
    forced_full: dict[str, int] = field(default_factory=dict)
    """Why calls on shallow steps ran the full UNet, and how many."""
    seconds: dict[str, float] = field(default_factory=lambda: {"full": 0.0, "shallow": 0.0})
    """Time spent in full and in shallow calls."""
    audit: bool = False
    """Measure each shallow call against the full UNet on the same inputs (a full call more per shallow call,
    not timed; the shallow output is returned): :attr:`errors`. For the benchmark."""
    errors: list[tuple[int, float]] = field(default_factory=list)
    """(sampler step, relative L2 error of the shallow output against the full UNet's) of each audited call."""
    _kept: list[_Kept] = field(default_factory=list)

    def begin(self, steps: int | None) -> None:
        """A new sampling of ``steps`` sampler steps: nothing kept from before is reused."""
        self.steps = steps
        self.step = 0
        self._kept.clear()

    def at_step(self, step: int, steps: int | None = None) -> None:
        """The UNet calls that follow belong to sampler step ``step`` (from 0; of ``steps``, when known now)."""
        self.step = step
        if steps is not None:
            self.steps = steps

    def end(self) -> None:
        """Sampling is over: calls until the next :meth:`begin` run full, and the features are dropped."""
        self.step = None
        self._kept.clear()

    def call(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
             run: Callable[[str, tuple[Any, ...], dict[str, Any]], Any]) -> Any:
        """One call of the UNet ``module``, with its arguments: ``run(kind, args, kwargs)`` runs the split's
        method ``kind`` ("full" or "shallow", compiled by the caller) on ``module`` and returns its result."""
        x, context, extra = _unet_inputs(args, kwargs)
        weights = weights_version(module)
        shallow_step = self.step is not None and not self.settings.full_step(self.step, self.steps)
        if shallow_step:
            kept = self._find(module, weights, tuple(x.shape), context, extra)
            if kept is not None:
                self.shallow_calls += 1
                output = self._timed("shallow", run, args, {**kwargs, "feature": kept.feature})
                if self.audit:
                    start = time.perf_counter()
                    self._audit(output, run("full", args, kwargs)[0])
                    self.seconds["audit"] = self.seconds.get("audit", 0.0) + time.perf_counter() - start
                return output
            why = self._why_full(module, weights, tuple(x.shape))
            self.forced_full[why] = self.forced_full.get(why, 0) + 1
        output, feature = self._timed("full", run, args, kwargs)
        self.full_calls += 1
        if self.step is not None:
            # the weights as the call left them: its first call may have moved them into the backend's weight file
            # (same values, new storage: ov_backend.weight_file), which is no change of the feature's weights
            self._keep(_Kept(module, weights_version(module), tuple(x.shape), context, extra, feature))
        return output

    def _timed(self, kind: str, run: Callable[[str, tuple[Any, ...], dict[str, Any]], Any], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
        start = time.perf_counter()
        try:
            return run(kind, args, kwargs)
        finally:
            self.seconds[kind] += time.perf_counter() - start

    def _audit(self, shallow: Any, full: Any) -> None:
        a, b = _first(shallow).double(), _first(full).double()
        self.errors.append((self.step if self.step is not None else -1,
                            float((a - b).norm() / b.norm().clamp_min(1e-30))))

    def describe(self) -> str:
        """One line: the settings, and how many UNet calls ran full and shallow (and why shallow steps ran full)."""
        sc = self.settings
        text = (f"step caching every {sc.interval} steps (depth {sc.depth}, full steps: first {sc.full_start}, "
                f"last {sc.full_end}): {self.full_calls} full and {self.shallow_calls} shallow UNet call(s)")
        if self.forced_full:
            text += "; full on a shallow step: " + ", ".join(f"{n} ({why})" for why, n in self.forced_full.items())
        return text

    def _find(self, module: Any, weights: tuple[int, int], shape: tuple[int, ...], context: Any,
              extra: Any) -> _Kept | None:
        return next((k for k in self._kept if k.module is module and k.weights == weights and k.shape == shape
                     and _same(k.context, context) and _same(k.extra, extra)), None)

    def _why_full(self, module: Any, weights: tuple[int, int], shape: tuple[int, ...]) -> str:
        mine = [k for k in self._kept if k.module is module]
        if not mine:
            return "no full step of this UNet yet in this sampling"
        if all(k.weights != weights for k in mine):
            return "the UNet's weights changed since its last full step"
        if all(k.shape != shape for k in mine):
            return "another input size than at the last full step"
        return "another prompt or conditioning than at the last full step"

    def _keep(self, kept: _Kept) -> None:
        # one feature per module, size, prompt and conditioning: the latest full call's
        self._kept[:] = [k for k in self._kept if not (k.module is kept.module and k.shape == kept.shape
                                                       and _same(k.context, kept.context)
                                                       and _same(k.extra, kept.extra))]
        self._kept.append(kept)


def _first(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


def _unet_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, Any, Any]:
    """(latent, context, other conditioning) of a UNet call, LDM's or diffusers' signature."""
    x = args[0] if args else kwargs.get("x", kwargs.get("sample"))
    if not isinstance(x, torch.Tensor):
        raise StepCacheUnsupported("a UNet call without a latent tensor as its first argument")
    context = args[2] if len(args) > 2 else kwargs.get("context", kwargs.get("encoder_hidden_states"))
    extra = {k: v for k, v in kwargs.items() if k in ("y", "added_cond_kwargs", "timestep_cond")}
    return x, context, extra
