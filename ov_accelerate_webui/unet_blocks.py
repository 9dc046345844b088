"""The UNet block by block: OpenVINO under another extension's UNet forward.

sd-webui-controlnet (and extensions built like it) replaces the UNet's ``forward`` for a generation with its
own, which computes its control and then runs the UNet's blocks one by one, adding the control between them.
The routed ``forward`` is then never called. Its blocks are: :func:`block_targets` routes each of them
(``time_embed``, SDXL's ``label_emb``, every ``input_blocks`` entry, ``middle_block``, every
``output_blocks`` entry, ``out``) for the rest of the generation, each compiled on its own, so the UNet's
work runs in OpenVINO whatever code calls its blocks, and that code (the control's additions, a few tensor
ops) stays in PyTorch.

It is only right when the blocks are still the blocks: :func:`blocks_blocked` says why not when something
replaced a method inside them (ControlNet's reference-only attention banks, its style-align or AdaIN group
norms, Token merging), and then the UNet runs the other extension's way, in PyTorch, as it says.
"""

from __future__ import annotations

import logging
from collections import Counter

from torch import nn

from .model_parts import Target, token_merging
from .routing import describe, foreign

logger = logging.getLogger(__name__)

#: The UNet's children that hold its work, in the order its forward runs them (A1111's LDM and sgm
#: ``UNetModel``); a ``ModuleList`` is routed entry by entry.
BLOCK_GROUPS: tuple[str, ...] = ("time_embed", "label_emb", "input_blocks", "middle_block", "output_blocks", "out")

#: Sizes that vary between calls of a block: the latent's (batch, height, width), the embedding's batch, the
#: prompt's (batch, tokens).
BLOCK_VARYING: tuple[tuple[int, tuple[int, ...]], ...] = ((2, (0,)), (3, (0, 1)), (4, (0, 2, 3)))


def block_targets(unet: Target) -> list[Target]:
    """A target for each block of the UNet ``unet`` routes (empty when the module has no LDM/sgm blocks)."""
    module = unet.module
    if not isinstance(getattr(module, "input_blocks", None), nn.ModuleList) or not isinstance(
            getattr(module, "output_blocks", None), nn.ModuleList):
        return []
    targets = []
    for group in BLOCK_GROUPS:
        child = getattr(module, group, None)
        if not isinstance(child, nn.Module):
            continue
        items = [(f"{group}.{i}", block) for i, block in enumerate(child)] if isinstance(child, nn.ModuleList) \
            else [(group, child)]
        targets.extend(Target(unet.part, f"{unet.path}.{name}", block, varying_dims=BLOCK_VARYING, own_code=True,
                              check=unet.check)
                       for name, block in items)
    return targets


def _replaced_methods(module: nn.Module) -> list[str]:
    """The methods of ``module`` something replaced on the object (not ours, and not the class's own method
    bound to it, which is what some extensions put back)."""
    found = []
    for name, value in vars(module).items():
        if callable(value) and not isinstance(value, nn.Module) and callable(getattr(type(module), name, None)) \
                and foreign(module, name) is not None:
            found.append(f"{type(module).__name__}.{name} by {describe(value)}")
    return found


def patched_inside(unet: nn.Module) -> str:
    """Which methods of the UNet's submodules another extension replaced ("" when none did)."""
    replaced = Counter(what for name, child in unet.named_modules() if name for what in _replaced_methods(child))
    return "; ".join(f"{what}{f' (on {n} modules)' if n > 1 else ''}" for what, n in replaced.items())


def blocks_blocked(unet: nn.Module) -> str:
    """Why the UNet's blocks cannot be routed one by one now ("" when they can)."""
    if not block_targets(Target("unet", "", unet)):
        return f"its class {type(unet).__name__} has no input_blocks/output_blocks to route one by one"
    merging = token_merging(unet)
    if merging:
        return merging
    inside = patched_inside(unet)
    return f"methods inside its blocks were replaced too ({inside}), which a compiled block would not follow" \
        if inside else ""
