"""Where the UNet, VAE and text encoder live in the model object A1111 has loaded.

Knows the LDM/sgm layout of A1111's models (SD1, SD2, SDXL) as a table; imports nothing from the
host. A model it cannot place (Forge's model object, SD3, anything unknown) gets a reason, and the
generation runs in plain PyTorch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch import nn

logger = logging.getLogger(__name__)

#: (family, part, candidate paths of the callable that is routed), sorted.
#: For each (family, part) every group is routed: SDXL has two text encoders, the VAE has an encoder
#: and a decoder. Alternatives for one role are listed in order of preference and separated by "|"
#: ("a|b": route a if present, else b). "path:method" routes that method instead of ``forward``:
#: A1111 encodes open_clip prompts with ``FrozenOpenCLIPEmbedder*.encode_with_transformer``, which
#: calls the resblocks one by one and never ``model.transformer.forward`` (ldm/sgm encoders/modules.py).
TARGET_TABLE: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("sd1", "text_encoder", ("cond_stage_model.wrapped.transformer|cond_stage_model.transformer",)),
    ("sd1", "unet", ("model.diffusion_model",)),
    ("sd1", "vae", ("first_stage_model.decoder", "first_stage_model.encoder")),
    (
        "sd2",
        "text_encoder",
        ("cond_stage_model.wrapped:encode_with_transformer|cond_stage_model:encode_with_transformer",),
    ),
    ("sd2", "unet", ("model.diffusion_model",)),
    ("sd2", "vae", ("first_stage_model.decoder", "first_stage_model.encoder")),
    (
        "sdxl",
        "text_encoder",
        (
            "conditioner.embedders.0.wrapped.transformer|conditioner.embedders.0.transformer",
            "conditioner.embedders.1.wrapped:encode_with_transformer|conditioner.embedders.1:encode_with_transformer",
        ),
    ),
    ("sdxl", "unet", ("model.diffusion_model",)),
    ("sdxl", "vae", ("first_stage_model.decoder", "first_stage_model.encoder")),
)

FAMILIES: tuple[str, ...] = ("sd1", "sd2", "sdxl")


class UnsupportedModel(Exception):
    """The loaded model cannot be accelerated; the message says why and what to do."""


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
    """The method of ``module`` that is routed ("forward", or e.g. "encode_with_transformer")."""

    @property
    def label(self) -> str:
        """What the status shows: the path, with the method unless it is ``forward``."""
        return self.path if self.method == "forward" else f"{self.path}.{self.method}"


def model_family(model: Any) -> str:
    """ "sd1", "sd2" or "sdxl".

    Raises:
        UnsupportedModel: for Forge's model object, a missing model, or another architecture.
    """
    if model is None:
        raise UnsupportedModel("No checkpoint is loaded. Load an SD 1.x, SD 2.x or SDXL checkpoint.")
    if hasattr(model, "forge_objects"):
        raise UnsupportedModel(
            "Forge's model object is not supported yet: Accelerate with OpenVINO works "
            "with AUTOMATIC1111 WebUI. This image was made in plain PyTorch."
        )
    for family, flag in (("sdxl", "is_sdxl"), ("sd2", "is_sd2"), ("sd1", "is_sd1")):
        if getattr(model, flag, False):
            return family
    kind = "SD3" if getattr(model, "is_sd3", False) else type(model).__name__
    raise UnsupportedModel(
        f"This checkpoint ({kind}) is not supported: Accelerate with OpenVINO handles "
        "SD 1.x, SD 2.x and SDXL. This image was made in plain PyTorch."
    )


def _lookup(root: Any, path: str) -> Any:
    obj = root
    for name in path.split("."):
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
    for candidate in group.split("|"):
        path, _, method = candidate.partition(":")
        method = method or "forward"
        module = _lookup(model, path)
        if isinstance(module, nn.Module) and callable(getattr(type(module), method, None)):
            return Target(part=part, path=path, module=module, method=method)
    return None


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
        for group in groups:
            target = _find_group(model, part, group)
            if target is None:
                raise UnsupportedModel(
                    f"The {part} of this {family} checkpoint was not found where A1111 keeps it "
                    f"({group.replace('|', ' or ')}). This image was made in plain PyTorch."
                )
            targets.append(target)
    return targets


def checkpoint_key(model: Any) -> str:
    """Identity of the loaded checkpoint: its file and hash (A1111 ``sd_checkpoint_info``)."""
    info = getattr(model, "sd_checkpoint_info", None)
    filename = getattr(info, "filename", None) or type(model).__name__
    digest = getattr(model, "sd_model_hash", None) or getattr(info, "sha256", None) or ""
    return f"{filename} [{digest}]"
