"""Fake ``modules.textual_inversion.textual_inversion``: embeddings and the database A1111 finds them in.

An :class:`Embedding` holds ``vec`` (a (tokens, width) tensor, or a dict of them per text encoder for
SDXL: "clip_l", "clip_g"). A1111 matches an embedding by its name's token ids in the prompt; the fake
tokenizer is per character, so the fake database finds names in the prompt text instead.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch


class Embedding:
    """Mirrors the fields A1111 reads (``vec``, ``name``, ``vectors``, ``checksum()``)."""

    def __init__(self, vec: Any, name: str) -> None:
        self.vec, self.name = vec, name
        first = next(iter(vec.values())) if isinstance(vec, dict) else vec
        self.vectors = int(first.shape[0])
        self.shape = int(first.shape[-1])

    def checksum(self) -> str:
        tensors = self.vec.values() if isinstance(self.vec, dict) else [self.vec]
        digest = hashlib.sha256(b"".join(t.detach().to(torch.float32).numpy().tobytes() for t in tensors))
        return digest.hexdigest()[:8]


class EmbeddingDatabase:
    """``word_embeddings``: name -> Embedding (A1111 loads them from ``embeddings/``)."""

    def __init__(self) -> None:
        self.word_embeddings: dict[str, Embedding] = {}

    def register_embedding(self, embedding: Embedding, model: Any = None) -> Embedding:
        self.word_embeddings[embedding.name] = embedding
        return embedding

    def clear(self) -> None:
        self.word_embeddings.clear()

    def split(self, text: str) -> list[tuple[str, Embedding | None]]:
        """``text`` as pieces of plain text and embeddings, in order (longest name first at a position)."""
        names = sorted(self.word_embeddings, key=len, reverse=True)
        pieces: list[tuple[str, Embedding | None]] = []
        start = pos = 0
        while pos < len(text):
            name = next((n for n in names if text.startswith(n, pos)), None)
            if name is None:
                pos += 1
                continue
            if pos > start:
                pieces.append((text[start:pos], None))
            pieces.append((name, self.word_embeddings[name]))
            pos = start = pos + len(name)
        if start < len(text):
            pieces.append((text[start:], None))
        return pieces
