"""Where the UNet, VAE and text encoder live in the model object A1111 has loaded.

Knows the LDM/sgm layout of A1111's models (SD1, SD2, SDXL) as a table; imports nothing from the
host. A model it cannot place (SD3, anything unknown) gets a reason, and the generation runs in plain PyTorch.
Forge's layout is :mod:`.forge`'s; :mod:`.hosts` says which one a WebUI uses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from ov_accelerate_sd.unet_split import UNetSplit

logger = logging.getLogger(__name__)

#: (family, part, paths), sorted. UNet and VAE: each path is a module whose ``forward`` is routed
#: ("a|b": a if present, else b). Text encoders: where A1111 keeps them; "x.*" means each module of the
#: list ``x`` that reads the prompt (sgm's ``input_key == "txt"``). What is routed inside a text encoder
#: is decided by what it is (:data:`TEXT_ENCODER_KINDS`), never by its position, and the combination
#: found must be one the family has (:data:`TEXT_ENCODER_SETS`).
TARGET_TABLE: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("sd1", "text_encoder", ("cond_stage_model",)),
    ("sd1", "unet", ("model.diffusion_model",)),
    ("sd1", "vae", ("first_stage_model.decoder", "first_stage_model.encoder")),
    ("sd2", "text_encoder", ("cond_stage_model",)),
    ("sd2", "unet", ("model.diffusion_model",)),
    ("sd2", "vae", ("first_stage_model.decoder", "first_stage_model.encoder")),
    ("sdxl", "text_encoder", ("conditioner.embedders.*",)),
    ("sdxl", "unet", ("model.diffusion_model",)),
    ("sdxl", "vae", ("first_stage_model.decoder", "first_stage_model.encoder")),
)


@dataclass(frozen=True)
class TextEncoderKind:
    """A kind of text encoder A1111 loads, and the part of it that is routed.

    The routed part starts below the token embedding (A1111's ``EmbeddingsWithFixes``, which splices in
    textual-inversion vectors from a Python attribute), so embeddings arrive as ordinary activations and
    a new embedding position or count never makes dynamo recompile.
    """

    name: str
    """Short name used in the tables, e.g. "clip"."""
    label: str
    """What a user calls it, for messages."""
    path: str
    """Module inside the (unwrapped) ldm/sgm embedder whose ``method`` is routed ("" = the embedder)."""
    method: str
    """The routed method."""
    varying_dims: tuple[tuple[int, tuple[int, ...]], ...]
    """Tensor rank -> dimensions of the routed call's inputs that change between generations (batch)."""


#: Sorted by name. "clip": transformers ``CLIPTextModel`` (SD1, SDXL's CLIP-L); A1111 calls the whole
#: model with ``output_hidden_states`` (CLIP skip), which passes it to ``text_model.encoder``; its input is
#: ``inputs_embeds`` (B, 77, C) and the causal mask (B, 1, 77, 77). "open_clip": ldm's
#: ``FrozenOpenCLIPEmbedder`` (SD2) and sgm's ``FrozenOpenCLIPEmbedder2`` (SDXL's OpenCLIP-bigG):
#: ``encode_with_transformer`` embeds the tokens and calls ``text_transformer_forward(x, attn_mask)``
#: with x in (77, B, C) layout and a fixed (77, 77) mask.
TEXT_ENCODER_KINDS: tuple[TextEncoderKind, ...] = (
    TextEncoderKind("clip", "CLIP", "transformer.text_model.encoder", "forward", ((3, (0,)), (4, (0,)))),
    TextEncoderKind("open_clip", "OpenCLIP", "", "text_transformer_forward", ((3, (1,)),)),
)

#: (family, text encoder kinds in the order A1111 has them, name of the layout), sorted. SDXL's refiner
#: (``sd_xl_refiner.yaml``) has only OpenCLIP-bigG; A1111 marks it ``is_sdxl`` like the base.
TEXT_ENCODER_SETS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("sd1", ("clip",), "SD 1.x"),
    ("sd2", ("open_clip",), "SD 2.x"),
    ("sdxl", ("clip", "open_clip"), "SDXL base"),
    ("sdxl", ("open_clip",), "SDXL refiner"),
)

FAMILIES: tuple[str, ...] = ("sd1", "sd2", "sdxl")


class UnsupportedModel(Exception):
    """The loaded model cannot be accelerated; the message says why and what to do."""


class Reason(str):
    """Why a call runs in PyTorch (:attr:`Target.check`'s answer), with the short name of what made it so for the
    infotext's note, e.g. "FreeU" (a plain ``str`` answer has none)."""

    short: str

    def __new__(cls, text: str, short: str = "") -> Reason:
        reason = super().__new__(cls, text)
        reason.short = short
        return reason


@dataclass(frozen=True)
class Target:
    """One module whose ``forward`` is routed through OpenVINO."""

    part: str
    """"unet", "vae" or "text_encoder"."""
    path: str
    """Attribute path from the model object, e.g. "model.diffusion_model"."""
    module: nn.Module
    """The module itself (as loaded now)."""
    method: str = "forward"
    """The method of ``module`` that is routed ("forward", or e.g. "text_transformer_forward")."""
    varying_dims: tuple[tuple[int, tuple[int, ...]], ...] | None = None
    """Tensor rank -> dimensions that change between generations; None: the UNet/VAE default."""
    own_code: bool = False
    """Compile a copy of the method with its own code object (one of many modules of a class compiled apart,
    e.g. a UNet's blocks: ``ov_backend.CompiledMethod``'s ``own_code``)."""
    check: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], str] | None = None
    """Asked with (module, args, kwargs) before each routed call: why that call must run on the module's own method
    in PyTorch ("" when OpenVINO can run it), e.g. A1111's Token merging, or a Forge UNet patch."""
    inputs: Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]] | None = None
    """What the compiled method is given of a routed call that passed :attr:`check` (None: the call's own
    arguments), e.g. Forge's UNet call without its per-step bookkeeping."""
    compiled: Callable[..., Any] | None = None
    """A function of (module, *inputs) compiled in place of the method itself (None: the method), for a method that
    should not be traced as it is (Forge's UNet forward writes into a dict its caller passes)."""
    split: Callable[[nn.Module, int], UNetSplit] | None = None
    """How step caching splits this UNet at a depth (None: ``ov_accelerate_sd.unet_split.split_unet``, which knows
    LDM/SGM's and diffusers' UNets), e.g. Forge's own UNet."""
    per_call: bool = False
    """Routed for each sampling call by the host's own patch point (Forge's UNet function wrapper) instead of for
    the whole generation."""

    @property
    def label(self) -> str:
        """What the status shows: the path, with the method unless it is ``forward``."""
        return self.path if self.method == "forward" else f"{self.path}.{self.method}"


def model_family(model: Any) -> str:
    """ "sd1", "sd2" or "sdxl".

    Raises:
        UnsupportedModel: for a missing model or another architecture.
    """
    if model is None:
        raise UnsupportedModel("No checkpoint is loaded. Load an SD 1.x, SD 2.x or SDXL checkpoint.")
    if hasattr(model, "forge_objects"):
        raise UnsupportedModel(
            "This is Forge's model object, but the WebUI did not load Forge's modules_forge: Accelerate with "
            "OpenVINO cannot tell where its parts are. This image was made in plain PyTorch."
        )
    family = flagged_family(model)
    if family is None:
        raise UnsupportedModel(
            f"This checkpoint ({kind_of(model)}) is not supported: Accelerate with OpenVINO handles "
            "SD 1.x, SD 2.x and SDXL. This image was made in plain PyTorch."
        )
    return family


#: (family, the model's flag of it), in the order they are asked: A1111 and Forge mark SDXL's refiner ``is_sdxl`` too.
FAMILY_FLAGS: tuple[tuple[str, str], ...] = (("sdxl", "is_sdxl"), ("sd2", "is_sd2"), ("sd1", "is_sd1"))


def flagged_family(model: Any) -> str | None:
    """The family ``model`` flags itself as (A1111's and Forge's ``is_sd1``, ``is_sd2``, ``is_sdxl``), or None."""
    return next((family for family, flag in FAMILY_FLAGS if getattr(model, flag, False)), None)


def kind_of(model: Any) -> str:
    """What a model of another family is, for a message: "SD3", or its class ("Flux", "Chroma", ...)."""
    return "SD3" if getattr(model, "is_sd3", False) else type(model).__name__


def lookup(root: Any, path: str) -> Any:
    obj = root
    for name in path.split(".") if path else ():
        if name.isdigit():
            try:
                obj = obj[int(name)]
            except (IndexError, TypeError, KeyError):
                return None
        else:
            obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def _find_group(model: Any, part: str, group: str) -> Target | None:
    for path in group.split("|"):
        module = lookup(model, path)
        if isinstance(module, nn.Module):
            return Target(part=part, path=path, module=module,
                          check=token_merging_check if part == "unet" else None)
    return None


def _join(*names: str) -> str:
    return ".".join(n for n in names if n)


def text_encoder_target(embedder: Any, path: str) -> tuple[TextEncoderKind, Target] | None:
    """What ``embedder`` (at ``path``; inside A1111's prompt wrapper or not) is, and its routed part."""
    wrapped = getattr(embedder, "wrapped", None)
    inner, inner_path = (wrapped, _join(path, "wrapped")) if isinstance(wrapped, nn.Module) else (embedder, path)
    for kind in TEXT_ENCODER_KINDS:
        module = lookup(inner, kind.path)
        if isinstance(module, nn.Module) and callable(getattr(type(module), kind.method, None)):
            target = Target("text_encoder", _join(inner_path, kind.path), module, kind.method, kind.varying_dims)
            return kind, target
    return None


def _text_encoder_candidates(model: Any, where: str) -> list[tuple[str, Any]]:
    """(path, module) of each text encoder at ``where`` (a path, or "x.*": the prompt readers of list x)."""
    if not where.endswith(".*"):
        module = lookup(model, where)
        return [(where, module)] if module is not None else []
    base = where[:-2]
    modules = lookup(model, base)
    if modules is None:
        return []
    return [(f"{base}.{i}", m) for i, m in enumerate(modules) if getattr(m, "input_key", None) == "txt"]


def find_text_encoders(model: Any, family: str) -> list[Target]:
    """The routed part of each text encoder of ``model``, found by what it is.

    Raises:
        UnsupportedModel: when a text encoder is of an unknown kind, or the text encoders found are not a
            combination A1111 loads for ``family`` (e.g. one is missing).
    """
    wheres = [w for f, part, paths in TARGET_TABLE if f == family and part == "text_encoder" for w in paths]
    found: list[tuple[str, str, Target | None]] = []  # (kind name or class name, path, target)
    for where in wheres:
        for path, embedder in _text_encoder_candidates(model, where):
            match = text_encoder_target(embedder, path)
            found.append((match[0].name, path, match[1]) if match else (type(embedder).__name__, path, None))
    kinds = tuple(name for name, _path, _target in found)
    layouts = [(expected, name) for f, expected, name in TEXT_ENCODER_SETS if f == family]
    if any(sorted(kinds) == sorted(expected) for expected, _name in layouts):
        return [target for _name, _path, target in found if target is not None]
    labels = {kind.name: kind.label for kind in TEXT_ENCODER_KINDS}
    seen = ", ".join(f"{labels.get(name, name)} at {path}" for name, path, _target in found)
    expected = " or ".join(f"{' + '.join(labels[k] for k in kinds)} ({name})" for kinds, name in layouts)
    raise UnsupportedModel(
        f"The text encoders of this {family} checkpoint ({seen or 'none found at ' + ', '.join(wheres)}) are "
        f"not a layout A1111 loads for it: expected {expected}. This image was made in plain PyTorch."
    )


def find_targets(model: Any, parts: tuple[str, ...]) -> list[Target]:
    """The modules to route for ``parts`` in ``model``, in table order.

    Raises:
        UnsupportedModel: when the family is unknown or a requested part cannot be found.
    """
    family = model_family(model)
    targets: list[Target] = []
    for row_family, part, groups in TARGET_TABLE:
        if row_family != family or part not in parts:
            continue
        if part == "text_encoder":
            targets.extend(find_text_encoders(model, family))
            continue
        for group in groups:
            target = _find_group(model, part, group)
            if target is None:
                raise UnsupportedModel(
                    f"The {part} of this {family} checkpoint was not found where A1111 keeps it "
                    f"({group.replace('|', ' or ')}). This image was made in plain PyTorch."
                )
            targets.append(target)
    return targets


def checkpoint_label(model: Any) -> str:
    """The loaded checkpoint as A1111 names it in its dropdown ("name.safetensors [hash]")."""
    title = getattr(getattr(model, "sd_checkpoint_info", None), "title", None)
    return str(title) if title else checkpoint_key(model)


def checkpoint_key(model: Any) -> str:
    """Identity of the loaded checkpoint: its file and hash (A1111 ``sd_checkpoint_info``)."""
    info = getattr(model, "sd_checkpoint_info", None)
    filename = getattr(info, "filename", None) or type(model).__name__
    digest = getattr(model, "sd_model_hash", None) or getattr(info, "sha256", None) or ""
    return f"{filename} [{digest}]"


def token_merging(unet: Any) -> str:
    """Why ``unet`` must run in PyTorch now, or "": A1111's Token merging (Settings -> Optimizations) patches
    it with tomesd for a generation (its forward pre-hook and ``ToMeBlock`` classes, removed afterwards),
    whose token gathers and scatters OpenVINO cannot convert (they would fall back op by op, break dynamo's
    graph at every block and use up its recompile limit)."""
    info = getattr(unet, "_tome_info", None)
    if not isinstance(info, dict) or not info.get("hooks"):
        return ""
    ratio = (info.get("args") or {}).get("ratio")
    return (f"Token merging is on (ratio {ratio}, Settings -> Optimizations): tomesd rewrites the UNet's "
            "transformer blocks with token scatters OpenVINO cannot convert; set the ratio to 0 to run it in OpenVINO")


def token_merging_check(unet: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """:func:`token_merging` as a :attr:`Target.check` of A1111's UNet."""
    return token_merging(unet)
