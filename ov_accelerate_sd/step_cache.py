"""Step caching for the UNet (DeepCache: Ma, Fang, Wang, CVPR 2024): full steps and shallow steps.

A UNet's deep features change slowly between adjacent denoising steps. On a *full* step the whole UNet
runs and the feature entering its last ``depth`` output blocks is kept; on the *shallow* steps between,
only the first ``depth`` input blocks and the last ``depth`` output blocks run, on that kept feature (their
skip connections are their own, fresh). Owns:

- :class:`StepCacheSettings`: the interval (a full step every N sampler steps; 1 is off), the depth and
  the full steps kept at the start and the end of sampling, and the schedule that follows from them;
- :func:`split_unet`: a UNet's forward split in two methods, ``full`` (the output and the feature) and
  ``shallow`` (the output from the feature), for the LDM and SGM ``UNetModel`` (what the WebUI loads) and
  diffusers' ``UNet2DConditionModel`` (the command line's). Each takes the UNet as its first argument, so a
  backend compiles it with the UNet's live weights (a LoRA written into them is seen), and the split keeps
  no reference to the UNet (a model the WebUI replaces is freed as before);
- :class:`StepCacheRun`: one generation's state: the sampler step, the features kept at the last full
  step, and which calls ran full or shallow and why.

A feature is reused only by a call of the same UNet module, weights, input size, prompt (the context's
values) and extra conditioning (SDXL's ``y``) as the full call that made it, on a step the schedule marks
shallow; anything else runs the full UNet. Knows torch only.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ov_backend.weights import version_of

logger = logging.getLogger(__name__)

#: The intervals a user picks from (1: off).
INTERVALS: tuple[int, ...] = (1, 2, 3, 4)


class StepCacheUnsupported(ValueError):
    """A UNet that step caching cannot split (named, with why)."""


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


# --- the split -----------------------------------------------------------------------------------


class UNetSplit(torch.nn.Module):
    """A UNet's forward in two methods (see the module docstring), for UNets of one layout: made from one, it
    runs any UNet of the same architecture passed to its methods.

    Subclasses give the UNet's own embedding, its flat lists of input and output layers (each maps
    ``(h, emb, context)`` to ``h``; output layer ``j`` takes the skip of input layer ``n - 1 - j``), the
    middle block and the head."""

    def __init__(self, unet: torch.nn.Module, depth: int) -> None:
        super().__init__()
        self.depth = depth
        self.kind = type(unet).__name__

    def check_depth(self, inputs: int, outputs: int) -> None:
        """Check that the UNet has one skip per output layer and that :attr:`depth` fits it; records
        :attr:`layers`."""
        if inputs != outputs:
            raise StepCacheUnsupported(f"{self.kind} has {inputs} input and {outputs} output blocks: "
                                       "step caching needs one skip connection per output block")
        if not 1 <= self.depth < inputs:
            raise StepCacheUnsupported(f"step caching depth {self.depth} does not fit {self.kind}: "
                                       f"its input blocks are 1 to {inputs - 1} deep")
        self._layers = inputs

    # the UNet kind's own parts
    def begin(self, unet: Any, x: torch.Tensor, timesteps: Any, context: Any,
              kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
        """(h, emb, context) before the first input layer."""
        raise NotImplementedError

    def input_layer(self, unet: Any, index: int, h: Any, emb: Any, context: Any, skips: list[Any]) -> Any:
        raise NotImplementedError

    def middle(self, unet: Any, h: Any, emb: Any, context: Any) -> Any:
        raise NotImplementedError

    def output_layer(self, unet: Any, index: int, h: Any, emb: Any, context: Any, skips: list[Any]) -> Any:
        """Output layer ``index``: pops its skip from ``skips``."""
        raise NotImplementedError

    def end(self, unet: Any, h: Any, x: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    @property
    def layers(self) -> int:
        """How many input (and output) layers the UNet has (set by :meth:`check_depth`)."""
        return self._layers

    # the two methods a backend compiles
    def full(self, unet: Any, x: torch.Tensor, timesteps: Any = None, context: Any = None,
             **kwargs: Any) -> tuple[Any, Any]:
        """``unet``'s output for its arguments, and the feature a shallow step starts from."""
        h, emb, context = self.begin(unet, x, timesteps, context, kwargs)
        skips: list[Any] = []
        for index in range(self.layers):
            h = self.input_layer(unet, index, h, emb, context, skips)
            skips.append(h)
        h = self.middle(unet, h, emb, context)
        cut = self.layers - self.depth
        feature = h
        for index in range(self.layers):
            if index == cut:
                feature = h
            h = self.output_layer(unet, index, h, emb, context, skips)
        return self.end(unet, h, x, kwargs), feature

    def shallow(self, unet: Any, x: torch.Tensor, timesteps: Any = None, context: Any = None, *,
                feature: torch.Tensor, **kwargs: Any) -> Any:
        """``unet``'s output from ``feature`` (kept by :meth:`full` for the same size, prompt and weights)."""
        h, emb, context = self.begin(unet, x, timesteps, context, kwargs)
        skips: list[Any] = []
        for index in range(self.depth):
            h = self.input_layer(unet, index, h, emb, context, skips)
            skips.append(h)
        h = feature
        for index in range(self.layers - self.depth, self.layers):
            h = self.output_layer(unet, index, h, emb, context, skips)
        return self.end(unet, h, x, kwargs)


class LdmSplit(UNetSplit):
    """The ``UNetModel`` of LDM (SD 1.x/2.x) and SGM (SDXL), as the WebUI loads them.

    The embedding and the concatenation of the skips are looked up in the UNet's own module at each call,
    so they are whatever that module's ``forward`` uses then (the WebUI replaces both: a cast of the
    timestep embedding and a concatenation that resizes a skip of another size)."""

    def __init__(self, unet: torch.nn.Module, depth: int) -> None:
        super().__init__(unet, depth)
        for name in ("input_blocks", "middle_block", "output_blocks", "out", "time_embed", "model_channels"):
            if not hasattr(unet, name):
                raise StepCacheUnsupported(f"{type(unet).__name__} has no {name}: not an LDM/SGM UNetModel")
        if getattr(unet, "predict_codebook_ids", False):
            raise StepCacheUnsupported("a UNet that predicts codebook ids is not a Stable Diffusion UNet")
        self.check_depth(len(unet.input_blocks), len(unet.output_blocks))
        self.source_module = sys.modules[type(unet).__module__]
        missing = [name for name in ("th", "timestep_embedding") if not hasattr(self.source_module, name)]
        if missing:  # LDM-shaped, but another implementation whose blocks may take other arguments
            raise StepCacheUnsupported(f"{type(unet).__name__} is not LDM/SGM's UNetModel (its module "
                                       f"{self.source_module.__name__} has no {' or '.join(missing)}): step caching "
                                       "does not split it")

    def begin(self, unet: Any, x: torch.Tensor, timesteps: Any, context: Any,
              kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
        emb = unet.time_embed(self.source_module.timestep_embedding(timesteps, unet.model_channels,
                                                                    repeat_only=False))
        if getattr(unet, "num_classes", None) is not None:
            emb = emb + unet.label_emb(kwargs["y"])
        dtype = getattr(unet, "dtype", None)  # LDM's runs its blocks at its own dtype; SGM's has none
        h = x.type(dtype) if isinstance(dtype, torch.dtype) else x
        return h, emb, context

    def input_layer(self, unet: Any, index: int, h: Any, emb: Any, context: Any, skips: list[Any]) -> Any:
        return unet.input_blocks[index](h, emb, context)

    def middle(self, unet: Any, h: Any, emb: Any, context: Any) -> Any:
        return unet.middle_block(h, emb, context)

    def output_layer(self, unet: Any, index: int, h: Any, emb: Any, context: Any, skips: list[Any]) -> Any:
        h = self.source_module.th.cat([h, skips.pop()], dim=1)
        return unet.output_blocks[index](h, emb, context)

    def end(self, unet: Any, h: Any, x: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        return unet.out(h.type(x.dtype))


class DiffusersSplit(UNetSplit):
    """diffusers' ``UNet2DConditionModel`` as Stable Diffusion 1.x/2.x/SDXL use it (the command line's).

    Its down blocks' (resnet, attention) pairs and downsamplers are the input layers, its up blocks'
    pairs the output layers (an up block's upsampler belongs to its last pair), as in LDM's layout. The
    call keeps the UNet's signature; options an SD pipeline does not pass (masks, ControlNet or adapter
    residuals, GLIGEN, FreeU, class labels) are refused."""

    def __init__(self, unet: torch.nn.Module, depth: int) -> None:
        super().__init__(unet, depth)
        config = unet.config
        refused = {
            "class embeddings": getattr(unet, "class_embedding", None) is not None,
            "an encoder projection": getattr(unet, "encoder_hid_proj", None) is not None,
            "centered inputs": bool(config.get("center_input_sample", False)),
            f"addition embedding {config.get('addition_embed_type')!r}":
                config.get("addition_embed_type") not in (None, "text_time"),
            "FreeU": any(getattr(block, "s1", None) is not None for block in unet.up_blocks),
        }
        unfit = [name for name, found in refused.items() if found]
        if unfit:
            raise StepCacheUnsupported(f"step caching does not take a UNet with {', '.join(unfit)}")
        # (down block, layer in it): block -1 is conv_in, layer -1 the block's downsampler
        self._inputs: list[tuple[int, int]] = [(-1, 0)]
        for b, block in enumerate(unet.down_blocks):
            self._inputs += [(b, i) for i in range(len(block.resnets))]
            if getattr(block, "downsamplers", None):
                self._inputs.append((b, -1))
        self._outputs = [(b, i) for b, block in enumerate(unet.up_blocks) for i in range(len(block.resnets))]
        self.check_depth(len(self._inputs), len(self._outputs))

    def begin(self, unet: Any, x: torch.Tensor, timesteps: Any, context: Any,
              kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
        unknown = {k for k, v in kwargs.items() if v is not None} - {"added_cond_kwargs", "timestep_cond",
                                                                        "return_dict", "cross_attention_kwargs"}
        if unknown or kwargs.get("cross_attention_kwargs"):
            raise StepCacheUnsupported(f"step caching does not take the UNet's {sorted(unknown) or 'attention kwargs'}")
        emb = unet.time_embedding(unet.get_time_embed(sample=x, timestep=timesteps), kwargs.get("timestep_cond"))
        extra = unet.get_aug_embed(emb=emb, encoder_hidden_states=context,
                                   added_cond_kwargs=kwargs.get("added_cond_kwargs") or {})
        if extra is not None:
            emb = emb + extra
        if unet.time_embed_act is not None:
            emb = unet.time_embed_act(emb)
        return x, emb, context

    def input_layer(self, unet: Any, index: int, h: Any, emb: Any, context: Any, skips: list[Any]) -> Any:
        b, i = self._inputs[index]
        if b < 0:
            return unet.conv_in(h)
        block = unet.down_blocks[b]
        if i < 0:
            for down in block.downsamplers:
                h = down(h)
            return h
        h = block.resnets[i](h, emb)
        if getattr(block, "attentions", None):
            h = block.attentions[i](h, encoder_hidden_states=context, return_dict=False)[0]
        return h

    def middle(self, unet: Any, h: Any, emb: Any, context: Any) -> Any:
        block = unet.mid_block
        if getattr(block, "has_cross_attention", False):
            return block(h, emb, encoder_hidden_states=context)
        return block(h, emb)

    def output_layer(self, unet: Any, index: int, h: Any, emb: Any, context: Any, skips: list[Any]) -> Any:
        b, i = self._outputs[index]
        block = unet.up_blocks[b]
        h = torch.cat([h, skips.pop()], dim=1)
        h = block.resnets[i](h, emb)
        if getattr(block, "attentions", None):
            h = block.attentions[i](h, encoder_hidden_states=context, return_dict=False)[0]
        if i == len(block.resnets) - 1 and getattr(block, "upsamplers", None):
            # as diffusers does: the next skip's size, only when a latent size is not a multiple of the
            # UNet's overall upscale (else the upsamplers double)
            # (skips[0], conv_in's output, has the latent's size)
            factor = 2 ** unet.num_upsamplers
            size = skips[-1].shape[2:] if any(d % factor for d in skips[0].shape[2:]) else None
            for up in block.upsamplers:
                h = up(h, size)
        return h

    def end(self, unet: Any, h: Any, x: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        if unet.conv_norm_out is not None:
            h = unet.conv_act(unet.conv_norm_out(h))
        return unet.conv_out(h)


def split_unet(unet: torch.nn.Module, depth: int) -> UNetSplit:
    """``unet``'s forward split at ``depth`` (see :class:`UNetSplit`).

    Raises:
        StepCacheUnsupported: not a UNet step caching knows, or ``depth`` does not fit it (said why).
    """
    if hasattr(unet, "input_blocks"):
        return LdmSplit(unet, depth)
    if hasattr(unet, "down_blocks") and hasattr(unet, "up_blocks"):
        return DiffusersSplit(unet, depth)
    raise StepCacheUnsupported(f"step caching knows LDM/SGM and diffusers UNets, not {type(unet).__name__}")


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
