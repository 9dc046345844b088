"""The UNet's attention while it runs through OpenVINO: one fused scaled-dot-product attention.

A1111 picks a cross-attention optimization for PyTorch's memory (Settings -> Optimizations; on a CPU its
"Automatic" is InvokeAI). InvokeAI, Doggettx and sub-quadratic cut attention into slices whose count
depends on the tensor sizes and the free memory: a graph of that is a loop of small products, and its
slice count takes ``max()`` of a symbolic size, which OpenVINO cannot convert with dynamic shapes, so each
resolution would be converted on its own. OpenVINO plans its own memory and fuses attention, so while the
UNet is routed its ``CrossAttention.forward`` is A1111's own "sdp" forward (the same math: softmax(QK^T/√d)V,
hypernetworks applied as in the others). The user's choice is put back when the generation ends, whatever
ended it, so PyTorch runs (and stock generations) keep it.
"""

from __future__ import annotations

import logging
from typing import Any

from . import host

logger = logging.getLogger(__name__)

#: A1111's optimizations that already are one scaled-dot-product attention call.
FUSED = ("sdp", "sdp-no-mem")


class FusedAttention:
    """Context manager: within the block the UNet's attention classes use A1111's "sdp" forward.

    ``replaced`` is the name of the optimization replaced (e.g. "InvokeAI"), or None when nothing was
    (already scaled dot product, or a host without A1111's optimizations). A1111 applies the user's
    choice again when it loads a model (``sd_hijack`` on a checkpoint switch inside the generation):
    :meth:`ensure`, called before each UNet step, sets the fused forward again.
    """

    def __init__(self) -> None:
        self.replaced: str | None = None
        self._saved: list[tuple[type, Any]] = []
        self._fused: list[tuple[type, Any]] = []

    def __enter__(self) -> FusedAttention:
        optimizers, current = host.attention_optimizers()
        sdp = next((o for o in optimizers if getattr(o, "name", None) == "sdp"), None)
        classes = _present(("ldm.modules.attention", "sgm.modules.attention"), "CrossAttention")
        current_name = getattr(current, "name", None) if current is not None else "None"
        if sdp is None or not classes or current_name in FUSED:
            return self
        saved = [(cls, cls.__dict__.get("forward")) for cls in classes]
        others = _other_attributes(classes)
        try:
            sdp.apply()
            fused = [(cls, cls.__dict__.get("forward")) for cls in classes]
        finally:
            _put_back(others)  # "sdp" also replaces the VAE's AttnBlock: that stays the user's choice
            _put_back(saved)
        self._saved, self._fused, self.replaced = saved, fused, str(current_name)
        logger.info("Accelerate with OpenVINO: the routed UNet's attention is scaled dot product in place of %s "
                    "for this generation", self.replaced)
        self.ensure()
        return self

    def ensure(self) -> None:
        """Set the fused forward again where something replaced it since."""
        for cls, forward in self._fused:
            if cls.__dict__.get("forward") is not forward:
                cls.forward = forward

    def __exit__(self, *exc: object) -> None:
        _put_back(self._saved)
        self._saved, self._fused = [], []


def _present(module_names: tuple[str, ...], name: str) -> list[type]:
    return [cls for cls in (host.imported_class(m, name) for m in module_names) if cls is not None]


def _other_attributes(classes: list[type]) -> list[tuple[Any, Any]]:
    """``forward`` of the VAE attention blocks the "sdp" optimization also sets."""
    blocks = _present(("ldm.modules.diffusionmodules.model", "sgm.modules.diffusionmodules.model"), "AttnBlock")
    return [(cls, cls.__dict__.get("forward")) for cls in blocks if cls not in classes]


def _put_back(saved: list[tuple[Any, Any]]) -> None:
    for cls, forward in saved:
        if forward is None:
            if "forward" in cls.__dict__:
                delattr(cls, "forward")
        else:
            cls.forward = forward
