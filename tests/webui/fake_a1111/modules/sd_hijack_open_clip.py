"""Fake ``modules.sd_hijack_open_clip``: A1111's wrappers of the open_clip text encoders (SD2, SDXL-G).

As in v1.10.1 they call ``wrapped.encode_with_transformer(tokens)`` per 77-token chunk; open_clip
pads with 0 after the end token.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from modules.sd_hijack_clip import FrozenCLIPEmbedderWithCustomWordsBase


class FrozenOpenCLIPEmbedderWithCustomWords(FrozenCLIPEmbedderWithCustomWordsBase):
    """SD2: ``cond_stage_model`` wrapping ldm's ``FrozenOpenCLIPEmbedder``."""

    def __init__(self, wrapped: nn.Module, hijack: Any) -> None:
        vocab = wrapped.model.vocab_size
        super().__init__(wrapped, hijack, vocab, id_start=vocab - 2, id_end=vocab - 1, id_pad=0)

    def encode_with_transformers(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.wrapped.encode_with_transformer(tokens)


class FrozenOpenCLIPEmbedder2WithCustomWords(FrozenCLIPEmbedderWithCustomWordsBase):
    """SDXL's OpenCLIP-bigG (``conditioner.embedders[1]``) wrapping sgm's ``FrozenOpenCLIPEmbedder2``."""

    def __init__(self, wrapped: nn.Module, hijack: Any) -> None:
        vocab = wrapped.model.vocab_size
        super().__init__(wrapped, hijack, vocab, id_start=vocab - 2, id_end=vocab - 1, id_pad=0)

    def encode_with_transformers(self, tokens: torch.Tensor) -> torch.Tensor:
        d = self.wrapped.encode_with_transformer(tokens)
        z = d[self.wrapped.layer]
        pooled = d.get("pooled")
        if pooled is not None:
            z.pooled = pooled
        return z
