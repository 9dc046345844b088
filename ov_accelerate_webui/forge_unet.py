"""Forge's UNet call: what of a call OpenVINO can run, what the compiled function is given, and how step caching
splits Forge's UNet.

Forge's extensions change the UNet's work through a call's ``control`` (its integrated ControlNet) and
``transformer_options`` (patches such as FreeU, Kohya HRFix, SAG, PAG, Token merging), whose Python a compiled
graph would not follow: such a call runs in PyTorch and the status names what changed it (:func:`unet_check`). Every
other call gets only the UNet's inputs (:func:`unet_inputs`) and runs :func:`unet_forward` compiled, or, with step
caching, :class:`ForgeSplit`'s methods. Nothing here imports Forge: the UNet's module is found from its class.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ov_accelerate_sd.unet_split import StepCacheUnsupported, UNetSplit

from .model_parts import Reason
from .routing import describe

logger = logging.getLogger(__name__)

#: Keys of a UNet call's ``transformer_options`` that only describe the call (Forge's sampler and UNet write them
#: as it runs: which rows are cond and uncond, the sigmas, the block being run): they change nothing it computes.
BOOKKEEPING: frozenset[str] = frozenset({
    "block", "block_index", "cond_indices", "cond_mark", "cond_or_uncond", "n_heads", "original_shape", "sigmas",
    "transformer_index", "uncond_indices",
})

#: The UNet's own inputs (``IntegratedUNet2DConditionModel.forward``); ``control`` and ``transformer_options`` are
#: Forge's hooks into its work.
UNET_INPUTS: tuple[str, ...] = ("x", "timesteps", "context", "y")

#: What Forge passes into a UNet call besides its inputs: its integrated ControlNet's residuals (``control``) and the
#: ControlNet they came from (``control_model``, passed along by ``sampling_function``), and the patches' options.
HOOKS: tuple[str, ...] = ("control", "control_model", "transformer_options")

#: (where a patch's code lives, what Forge calls it), sorted: Forge's built-in UNet patches, by their folder or file.
PATCH_OWNERS: tuple[tuple[str, str], ...] = (
    ("sd_forge_controlllite", "ControlLLLite"),
    ("sd_forge_controlnet", "ControlNet"),
    ("sd_forge_dynamic_thresholding", "Dynamic Thresholding"),
    ("sd_forge_freeu", "FreeU"),
    ("sd_forge_ipadapter", "IP-Adapter"),
    ("sd_forge_kohya_hrfix", "Kohya HRFix"),
    ("sd_forge_latent_modifier", "Latent Modifier"),
    ("sd_forge_multidiffusion", "MultiDiffusion"),
    ("sd_forge_perturbed_attention", "PAG (Perturbed Attention Guidance)"),
    ("sd_forge_sag", "SAG (Self-Attention Guidance)"),
    ("sd_forge_stylealign", "StyleAlign"),
    ("tomesd", "Token merging"),
)

def _callables(value: Any) -> Iterator[Any]:
    """Every callable inside ``value`` (a patch, or lists and dicts of them)."""
    if callable(value) and not isinstance(value, type):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _callables(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _callables(item)


def patch_owner(function: Any) -> str:
    """Who a UNet patch belongs to: Forge's name for a built-in (e.g. "FreeU"), else where its code is."""
    where = describe(function)
    return next((name for folder, name in PATCH_OWNERS if folder in where), where)


def _patch_names(options: dict[str, Any]) -> list[tuple[str, str]]:
    """What changes the UNet's work in a call's ``transformer_options``: (its owner, with what it patches), e.g.
    ("FreeU", "FreeU (output_block_patch)")."""
    found: dict[str, set[str]] = {}
    for key, value in options.items():
        if key in BOOKKEEPING or not value:
            continue
        kinds = value.items() if key in ("patches", "patches_replace") and isinstance(value, dict) else [(key, value)]
        for kind, patches in kinds:
            owners = [patch_owner(f) for f in _callables(patches)] or [f"transformer option {key!r}"]
            for owner in owners:
                found.setdefault(owner, set()).add(str(kind))
    return [(owner, f"{owner} ({', '.join(sorted(kinds))})") for owner, kinds in sorted(found.items())]


def unet_check(unet: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Why this call of Forge's UNet must run in PyTorch ("" when it is the UNet's own work): a ControlNet's
    residuals, a patch in its options, or an input OpenVINO's graph does not take; a :class:`.model_parts.Reason`
    whose short form names them for the infotext ("ControlNet", "FreeU", ...)."""
    reasons, names = [], []
    control = kwargs.get("control")
    if control:
        reasons.append("Forge's integrated ControlNet adds its residuals inside the UNet")
        names.append("ControlNet")
    options = kwargs.get("transformer_options") or {}
    patches = _patch_names(options) if isinstance(options, dict) else []
    if patches:
        reasons.append(f"{'; '.join(text for _, text in patches)} patch the UNet's blocks with Python code a compiled "
                       "graph would not follow")
        names.extend(owner for owner, _ in patches if owner not in names)
    extra = sorted(k for k, v in kwargs.items() if k not in (*UNET_INPUTS, *HOOKS) and v is not None)
    if extra or len(args) > 4:
        reasons.append(f"the UNet got inputs beyond its own ({', '.join(extra) or 'positional'})")
        names.append("other inputs")
    return Reason("; ".join(reasons), " + ".join(names)) if reasons else ""


def unet_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The UNet's own inputs of a call that passed :func:`unet_check`, as :func:`unet_forward` takes them: ``x``,
    ``timesteps``, ``context`` (and SDXL's ``y``)."""
    values = dict(zip(UNET_INPUTS, args))
    values.update((k, kwargs[k]) for k in UNET_INPUTS if k in kwargs)
    x = values.pop("x")
    return (x,), {k: v for k, v in values.items() if v is not None}


def unet_forward(unet: nn.Module, x: torch.Tensor, timesteps: torch.Tensor | None = None,
                 context: torch.Tensor | None = None, y: torch.Tensor | None = None) -> torch.Tensor:
    """What is compiled for Forge's UNet: its forward with ``transformer_options`` of its own. The forward writes
    its bookkeeping (the input's shape, the block it is in) into that dict; a dict from outside the graph would
    make those sizes outputs of it, and the graph would be converted for each size on its own."""
    return type(unet).forward(unet, x, timesteps, context, y, transformer_options={})



def _parameters(module: Any) -> set[str] | None:
    """The names ``module``'s forward takes (None: it takes any, or they cannot be read)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
        return None
    return {p.name for p in parameters}


class ForgeSplit(UNetSplit):
    """Forge's ``IntegratedUNet2DConditionModel`` (``backend/nn/unet.py``, LDM's layout) split for step caching.

    Its blocks take ``transformer_options`` (and the output blocks the next skip's shape, for the upsampler): each
    gets a dict of its own, as :func:`unet_forward` gives the whole forward, since a call that reaches here carries
    no patch (:func:`unet_check`). The timestep embedding is the one in the UNet's own module."""

    def __init__(self, unet: nn.Module, depth: int) -> None:
        super().__init__(unet, depth)
        for name in ("input_blocks", "middle_block", "output_blocks", "out", "time_embed", "model_channels"):
            if not hasattr(unet, name):
                raise StepCacheUnsupported(f"{type(unet).__name__} has no {name}: not Forge's LDM-shaped UNet")
        self.source_module = sys.modules[type(unet).__module__]
        if not hasattr(self.source_module, "timestep_embedding"):
            raise StepCacheUnsupported(f"{type(unet).__name__}'s module {self.source_module.__name__} has no "
                                       "timestep_embedding: not Forge's LDM-shaped UNet")
        self.check_depth(len(unet.input_blocks), len(unet.output_blocks))
        for blocks, wanted in ((unet.input_blocks, ("transformer_options",)),
                               (unet.output_blocks, ("transformer_options", "output_shape"))):
            taken = _parameters(blocks[0])
            if taken is not None and not set(wanted) <= taken:
                raise StepCacheUnsupported(f"{type(unet).__name__}'s blocks ({type(blocks[0]).__name__}) do not take "
                                           f"{' and '.join(wanted)} as Forge's do: step caching does not split it")

    def begin(self, unet: Any, x: torch.Tensor, timesteps: Any, context: Any,
              kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
        embedding = self.source_module.timestep_embedding(timesteps, unet.model_channels, repeat_only=False)
        emb = unet.time_embed(embedding.to(x.dtype))
        if getattr(unet, "num_classes", None) is not None:
            emb = emb + unet.label_emb(kwargs["y"])
        return x, emb, context

    def input_layer(self, unet: Any, index: int, h: Any, emb: Any, context: Any, skips: list[Any]) -> Any:
        return unet.input_blocks[index](h, emb, context, {})

    def middle(self, unet: Any, h: Any, emb: Any, context: Any) -> Any:
        return unet.middle_block(h, emb, context, {})

    def output_layer(self, unet: Any, index: int, h: Any, emb: Any, context: Any, skips: list[Any]) -> Any:
        h = torch.cat([h, skips.pop()], dim=1)
        return unet.output_blocks[index](h, emb, context, {}, skips[-1].shape if skips else None)

    def end(self, unet: Any, h: Any, x: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        return unet.out(h).type(x.dtype)
