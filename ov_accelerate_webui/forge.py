"""Forge as a host: where its model keeps the UNet, VAE and text encoders, and how its UNet is put on the route.

Forge (and Forge Neo, which keeps the same ``backend/`` design) loads a checkpoint into a ``ForgeDiffusionEngine``
whose ``forge_objects`` hold one patcher per part: ``unet`` (a ``UnetPatcher`` whose ``model`` is a ``KModel``
around ``diffusion_model``, an LDM-shaped UNet), ``vae`` (``first_stage_model`` with an LDM-shaped ``encoder`` and
``decoder``) and ``clip`` (``cond_stage_model`` with one transformers CLIP text model per encoder: ``clip_l``,
``clip_g``, SD 2's ``clip_h``). Nothing here imports Forge: its objects are read by their attribute names, and
its modules are found in ``sys.modules`` through :mod:`.host` (the attention).

The UNet goes through Forge's own patch point: before every sampling (each batch, the hires pass, img2img) the
section's ``process_before_every_sampling`` hook clones the batch's UnetPatcher and sets a UNet function wrapper
on the clone (:meth:`ForgeHost.route_for_sampling`); the wrapper routes the UNet's forward for the length of each
sampling call only. The patcher is the batch's own copy, so nothing of it outlives the batch, whatever ends it.

A UNet call runs in OpenVINO only when it is the UNet's own work (:mod:`.forge_unet`: what a call may carry, what
the compiled function is given, and step caching's split of Forge's UNet).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from . import host
from .forge_unet import ForgeSplit, unet_check, unet_forward, unet_inputs
from .hosts import Attention
from .model_parts import Target, UnsupportedModel, flagged_family, kind_of, lookup, text_encoder_target
from .routing import Route, describe, routed

logger = logging.getLogger(__name__)

#: (family, part, paths from ``forge_objects``), sorted. Text encoders: the names of ``clip.cond_stage_model``'s
#: encoders the family has, in each layout Forge loads (:data:`TEXT_ENCODER_SETS`).
TARGET_TABLE: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("sd1", "unet", ("unet.model.diffusion_model",)),
    ("sd1", "vae", ("vae.first_stage_model.decoder", "vae.first_stage_model.encoder")),
    ("sd2", "unet", ("unet.model.diffusion_model",)),
    ("sd2", "vae", ("vae.first_stage_model.decoder", "vae.first_stage_model.encoder")),
    ("sdxl", "unet", ("unet.model.diffusion_model",)),
    ("sdxl", "vae", ("vae.first_stage_model.decoder", "vae.first_stage_model.encoder")),
)

#: Where Forge keeps the text encoders, from ``forge_objects``.
TEXT_ENCODERS = "clip.cond_stage_model"

#: (family, encoder names, layout), sorted: the text encoders Forge loads for each family (``sd15.py``,
#: ``sd20.py``, ``sdxl.py``: the SDXL refiner has OpenCLIP-bigG alone).
TEXT_ENCODER_SETS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("sd1", ("clip_l",), "SD 1.x"),
    ("sd2", ("clip_h",), "SD 2.x"),
    ("sdxl", ("clip_g",), "SDXL refiner"),
    ("sdxl", ("clip_g", "clip_l"), "SDXL base"),
)

#: (part, Forge module, its attention function, Forge's fused one in ``backend.attention``: the first name found, Forge
#: main's then Forge Neo's), sorted: the attention each routed part runs while routed (``backend/attention.py`` picks
#: them once, at import, and the modules keep what it picked).
ATTENTION_SWAPS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("unet", "backend.nn.unet", "attention_function", ("attention_pytorch",)),
    ("vae", "backend.nn.vae", "attention_function_single_head_spatial",
     ("pytorch_attention_single_head_spatial", "pytorch_attention_vae")),
)

#: Forge's (and Forge Neo's) attention functions by name, for the status.
ATTENTION_NAMES: dict[str, str] = {
    "attention_basic": "basic", "attention_split": "split", "attention_sub_quad": "sub-quadratic",
    "attention_xformers": "xformers", "normal_attention_single_head_spatial": "split", "normal_attention_vae": "slice",
    "xformers_attention_single_head_spatial": "xformers", "xformers_attention_vae": "xformers",
}


def model_family(model: Any) -> str:
    """"sd1", "sd2" or "sdxl" for a Forge model.

    Raises:
        UnsupportedModel: no model, or another family (Flux, SD3, Chroma, ...), named.
    """
    if model is None:
        raise UnsupportedModel("No checkpoint is loaded. Load an SD 1.x, SD 2.x or SDXL checkpoint.")
    if getattr(model, "forge_objects", None) is None:
        raise UnsupportedModel(f"This model ({type(model).__name__}) has no forge_objects: it is not a model Forge "
                               "loaded. This image was made in plain PyTorch.")
    family = flagged_family(model)
    if family is None:
        raise UnsupportedModel(
            f"This checkpoint ({kind_of(model)}) is not supported: in Forge, Accelerate with OpenVINO handles SD 1.x, "
            "SD 2.x and SDXL; other families run in plain PyTorch. This image was made in plain PyTorch.")
    return family


def find_text_encoders(objects: Any, family: str) -> list[Target]:
    """The routed part of each text encoder in Forge's ``clip.cond_stage_model``.

    Raises:
        UnsupportedModel: an encoder of an unknown kind, or not a set Forge loads for ``family``.
    """
    holder = lookup(objects, TEXT_ENCODERS)
    named = sorted(name for name, _child in holder.named_children()) if isinstance(holder, nn.Module) else []
    targets, unknown = [], []
    for name in named:
        path = f"{TEXT_ENCODERS}.{name}"
        match = text_encoder_target(lookup(objects, path), path)
        if match is None or match[0].name != "clip":
            unknown.append(f"{name} ({type(lookup(objects, path)).__name__})")
        else:
            targets.append(match[1])
    layouts = [(names, layout) for f, names, layout in TEXT_ENCODER_SETS if f == family]
    if not unknown and any(tuple(named) == names for names, _layout in layouts):
        return targets
    expected = " or ".join(f"{' + '.join(names)} ({layout})" for names, layout in layouts)
    found = ", ".join(unknown) or ", ".join(named) or "none"
    raise UnsupportedModel(f"The text encoders of this {family} checkpoint in Forge ({found}) are not a layout "
                           f"Forge loads for it: expected {expected}. This image was made in plain PyTorch.")


def find_targets(model: Any, parts: tuple[str, ...]) -> list[Target]:
    """The modules to route for ``parts`` of Forge's ``model``, in table order (text encoders last).

    Raises:
        UnsupportedModel: another family, or a part not where Forge keeps it.
    """
    family = model_family(model)
    objects = model.forge_objects
    targets: list[Target] = []
    for row_family, part, paths in TARGET_TABLE:
        if row_family != family or part not in parts:
            continue
        for path in paths:
            module = lookup(objects, path)
            if not isinstance(module, nn.Module):
                raise UnsupportedModel(f"The {part} of this {family} checkpoint was not found where Forge keeps it "
                                       f"(forge_objects.{path}). This image was made in plain PyTorch.")
            if part == "unet":
                targets.append(Target(part, path, module, check=unet_check, inputs=unet_inputs, compiled=unet_forward,
                                      split=ForgeSplit, per_call=True))
            else:
                targets.append(Target(part, path, module))
    if "text_encoder" in parts:
        targets.extend(find_text_encoders(objects, family))
    for target in targets:
        settle_grad_flags(target.module)
    return targets


def settle_grad_flags(module: nn.Module) -> None:
    """Clear ``requires_grad`` on ``module``'s parameters. Forge builds its modules with the flag set (PyTorch's
    default) and computes under inference mode, where it means nothing; its LoRA loader sets new weights without
    it, and dynamo's guards check the flag: the first LoRA would make dynamo capture every routed method again (a
    conversion instead of a compile). The values are untouched."""
    for param in module.parameters():
        if param.requires_grad:
            param.requires_grad_(False)


class ForgeAttention:
    """Context manager: while the UNet and the VAE are routed, their attention is Forge's scaled-dot-product one.

    On the CPU, Forge picks sub-quadratic attention for the UNet (slices whose count depends on the sizes, which
    OpenVINO cannot convert with dynamic shapes) and split attention for the VAE (which asks psutil for the free
    memory on each call, where dynamo breaks the graph). Forge's ``attention_pytorch`` and
    ``pytorch_attention_single_head_spatial`` are the same math in one fused call. The user's choice is put back
    when the generation ends, whatever ended it.
    """

    def __init__(self, parts: tuple[str, ...]) -> None:
        self.parts = parts
        self.replaced: str | None = None
        self._saved: list[tuple[Any, str, Any, Any]] = []

    def __enter__(self) -> ForgeAttention:
        attention = host.imported_module("backend.attention")
        names = []
        for part, module_name, attribute, fused_names in ATTENTION_SWAPS:
            module = host.imported_module(module_name)
            current = getattr(module, attribute, None)
            fused = next((getattr(attention, n) for n in fused_names if hasattr(attention, n)), None)
            if part not in self.parts or current is None or fused is None or current is fused:
                continue
            self._saved.append((module, attribute, current, fused))
            setattr(module, attribute, fused)
            name = getattr(current, "__name__", "")
            names.append(ATTENTION_NAMES.get(name, name) + ("" if part == "unet" else f" in the {part.upper()}"))
        if names:
            self.replaced = ", and ".join(names)
            logger.info("Accelerate with OpenVINO: scaled dot product attention in place of %s for this generation",
                        self.replaced)
        return self

    def ensure(self) -> None:
        for module, attribute, _current, fused in self._saved:
            if getattr(module, attribute) is not fused:
                setattr(module, attribute, fused)

    def __exit__(self, *exc: object) -> None:
        for module, attribute, current, _fused in reversed(self._saved):
            setattr(module, attribute, current)
        self._saved = []


def _wrapper(routes: tuple[Route, ...], previous: Callable[..., Any] | None) -> Callable[..., Any]:
    """Forge's UNet function wrapper: the sampling call with ``routes`` in place (after ``previous``, a wrapper
    another extension set, which then runs around the routed UNet). A closure, never an object: Forge deep-copies
    a patcher's options on every clone, and a function is copied as itself."""

    def openvino_unet(apply_model: Callable[..., Any], call: dict[str, Any]) -> Any:
        with routed(routes):
            if previous is not None:
                return previous(apply_model, call)
            return apply_model(call["input"], call["timestep"], **call["c"])

    return openvino_unet


class ForgeHost:
    """Forge main (lllyasviel/stable-diffusion-webui-forge) and Forge Neo."""

    name = "Forge"

    def find_targets(self, model: Any, parts: tuple[str, ...]) -> list[Target]:
        return find_targets(model, parts)

    def stand_in(self, model: Any) -> bool:
        # None, or Forge's FakeInitialModel: Forge loads the selected checkpoint at the first generation
        return getattr(model, "forge_objects", None) is None

    def attention(self, parts: tuple[str, ...]) -> Attention:
        return ForgeAttention(parts)

    def install_load_hook(self, extension: Any) -> Callable[[], None] | None:
        """The checkpoint load (:mod:`.forge_load`) and the LoRA merge (:mod:`.forge_lora`) into the weight file."""
        from . import forge_load, forge_lora

        undo = [one for one in (forge_load.install(extension), forge_lora.install(extension)) if one is not None]
        if not undo:
            return None

        def uninstall() -> None:
            for one in undo:
                one()

        return uninstall

    def route_for_sampling(self, p: Any, routes: Sequence[Route]) -> str:
        if not routes:
            return ""
        objects = getattr(getattr(p, "sd_model", None), "forge_objects", None)
        patcher = getattr(objects, "unet", None)
        unet = getattr(getattr(patcher, "model", None), "diffusion_model", None)
        mine = tuple(r for r in routes if r.module is unet)
        if not mine or not hasattr(patcher, "clone"):
            return (f"the UNet Forge samples with ({type(unet).__name__}) is not the one routed for this generation"
                    if unet is not None else "Forge's forge_objects.unet has no UNet to route")
        clone = patcher.clone()
        previous = clone.model_options.get("model_function_wrapper")
        clone.set_model_unet_function_wrapper(_wrapper(mine, previous))
        objects.unet = clone
        if previous is not None:
            logger.info("Accelerate with OpenVINO: the UNet runs in OpenVINO inside %s's UNet function wrapper",
                        describe(previous))
        return ""
