"""The parts of a Stable Diffusion model that can run through OpenVINO: the one list of every layer.

The SD layer's settings and ``--pytorch`` choices, and the WebUI adapter's panel, settings and
infotext all take the names and their order from :data:`PARTS`. The order is the one a user sees
(the panel's checkboxes, the infotext's "UNet+VAE+TE"): by the share of a generation's time.
Imports nothing, so the adapter and the command line read it without loading torch or OpenVINO.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

#: Part names, in the order they are shown and written.
PARTS: tuple[str, ...] = ("unet", "vae", "text_encoder")

#: Tensor rank -> the dimensions of a part's inputs that change between generations, marked dynamic so
#: that one capture and one converted model serve every size: 1-D timesteps and 2-D token ids or SDXL's
#: ``y`` (batch); 3-D UNet context (batch, prompt length in 77-token chunks); 4-D latents and images
#: (batch, height, width). Channels and the 77 tokens of a chunk never change.
VARYING_DIMS: dict[int, tuple[int, ...]] = {1: (0,), 2: (0,), 3: (0, 1), 4: (0, 2, 3)}


def in_order(parts: object) -> tuple[str, ...]:
    """``parts`` (names, or one comma-separated string) without repeats, in :data:`PARTS` order.

    Raises:
        ValueError: an unknown part (named, with the known ones).
    """
    if isinstance(parts, str):
        parts = parts.split(",")
    names = {str(p).strip() for p in parts} - {""}  # type: ignore[attr-defined]
    unknown = sorted(names - set(PARTS))
    if unknown:
        raise ValueError(f"unknown part(s) to accelerate {unknown}; valid: {list(PARTS)}")
    return tuple(p for p in PARTS if p in names)
