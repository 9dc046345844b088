"""The WebUI's random numbers for a seed: the initial latent and the per-step noise after it.

Mirrors A1111's ``modules/rng.py`` (``ImageRNG``) with ``randn_source`` "CPU" (and what the
WebUI does on a CPU-only machine): image ``i`` of a batch gets its own CPU ``torch.Generator``
seeded with its seed; the first draw of shape ``(C, H/8, W/8)`` is its initial latent, and the
same generators then feed the sampler's noise (ancestral and SDE samplers), as A1111's
``ImageRNG.next()`` does. The initial latent is the unit-variance noise; the sampler scales it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

LATENT_CHANNELS = 4
LATENT_FACTOR = 8


def image_seeds(seed: int, batch_size: int, batch_index: int = 0) -> list[int]:
    """Seeds of the images of one batch, as the WebUI numbers them (seed + position)."""
    first = int(seed) + batch_index * batch_size
    return [first + i for i in range(batch_size)]


class ImageNoise:
    """Per-image generators of one batch; ``first()`` gives the initial latent."""

    def __init__(
        self, seeds: Sequence[int], width: int, height: int, channels: int = LATENT_CHANNELS
    ) -> None:
        self.seeds = [int(s) for s in seeds]
        self.shape = (channels, height // LATENT_FACTOR, width // LATENT_FACTOR)
        self.generators = [torch.Generator("cpu").manual_seed(s) for s in self.seeds]

    def first(self) -> torch.Tensor:
        """The initial latent noise, shape ``(batch, C, H/8, W/8)``, float32 on the CPU."""
        return torch.stack([torch.randn(self.shape, generator=g) for g in self.generators])


def initial_noise(
    seed: int, width: int, height: int, batch_size: int = 1, batch_index: int = 0
) -> torch.Tensor:
    """The latent the WebUI starts from for ``seed`` at this batch position and size."""
    return ImageNoise(image_seeds(seed, batch_size, batch_index), width, height).first()
