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
