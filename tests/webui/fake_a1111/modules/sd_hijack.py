"""Fake ``modules.sd_hijack``: what A1111 v1.10.1 does to a model after loading it.

``model_hijack.hijack(m)`` wraps each text encoder's token embedding in :class:`EmbeddingsWithFixes`
and the text encoder in A1111's chunking wrapper (``sd_hijack_clip`` / ``sd_hijack_open_clip``);
``undo_hijack`` reverses it (``sd_models.reload_model_weights`` does both around an in-place load).
Textual-inversion vectors reach the model as in A1111: the chunking wrapper sets ``model_hijack.fixes``
(a Python attribute: per prompt, (offset, Embedding) pairs) right before calling the transformer, and
``EmbeddingsWithFixes.forward`` reads it, resets it to None and splices the vectors into the token
embeddings.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from modules import sd_hijack_clip, sd_hijack_open_clip
from modules.textual_inversion.textual_inversion import EmbeddingDatabase


class EmbeddingsWithFixes(nn.Module):
    """A1111's wrapper around a token embedding that splices in textual-inversion vectors."""

    def __init__(self, wrapped: nn.Module, embeddings: Any, textual_inversion_key: str = "clip_l") -> None:
        super().__init__()
        self.wrapped = wrapped
        self.embeddings = embeddings
        self.textual_inversion_key = textual_inversion_key

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        batch_fixes = self.embeddings.fixes
        self.embeddings.fixes = None

        inputs_embeds = self.wrapped(input_ids)

        if batch_fixes is None or len(batch_fixes) == 0 or max(len(x) for x in batch_fixes) == 0:
            return inputs_embeds

        vecs = []
        for fixes, tensor in zip(batch_fixes, inputs_embeds):
            for offset, embedding in fixes:
                vec = embedding.vec[self.textual_inversion_key] if isinstance(embedding.vec, dict) else embedding.vec
                emb = vec.to(inputs_embeds.dtype)
                emb_len = min(tensor.shape[0] - offset - 1, emb.shape[0])
                tensor = torch.cat([tensor[0 : offset + 1], emb[0:emb_len], tensor[offset + 1 + emb_len :]])
            vecs.append(tensor)

        return torch.stack(vecs)


class StableDiffusionModelHijack:
    """``sd_hijack.model_hijack``: ``fixes`` (set per chunk by the text encoder wrappers), embeddings."""

    fixes: Any = None

    def __init__(self) -> None:
        self.comments: list[str] = []
        self.extra_generation_params: dict[str, Any] = {}
        self.embedding_db = EmbeddingDatabase()

    def hijack(self, m: Any) -> None:
        conditioner = getattr(m, "conditioner", None)
        if conditioner is not None:  # SDXL (base: CLIP-L + OpenCLIP-bigG)
            text_cond_models = []
            for i, embedder in enumerate(conditioner.embedders):
                typename = type(embedder).__name__
                if typename == "FrozenCLIPEmbedder":
                    emb = embedder.transformer.text_model.embeddings
                    emb.token_embedding = EmbeddingsWithFixes(emb.token_embedding, self)
                    conditioner.embedders[i] = sd_hijack_clip.FrozenCLIPEmbedderForSDXLWithCustomWords(embedder, self)
                    text_cond_models.append(conditioner.embedders[i])
                if typename == "FrozenOpenCLIPEmbedder2":
                    embedder.model.token_embedding = EmbeddingsWithFixes(
                        embedder.model.token_embedding, self, textual_inversion_key="clip_g"
                    )
                    wrapper = sd_hijack_open_clip.FrozenOpenCLIPEmbedder2WithCustomWords
                    conditioner.embedders[i] = wrapper(embedder, self)
                    text_cond_models.append(conditioner.embedders[i])
            m.cond_stage_model = text_cond_models[0] if len(text_cond_models) == 1 else conditioner
        elif type(m.cond_stage_model).__name__ == "FrozenCLIPEmbedder":  # SD1
            emb = m.cond_stage_model.transformer.text_model.embeddings
            emb.token_embedding = EmbeddingsWithFixes(emb.token_embedding, self)
            m.cond_stage_model = sd_hijack_clip.FrozenCLIPEmbedderWithCustomWords(m.cond_stage_model, self)
        elif type(m.cond_stage_model).__name__ == "FrozenOpenCLIPEmbedder":  # SD2
            clip = m.cond_stage_model.model
            clip.token_embedding = EmbeddingsWithFixes(clip.token_embedding, self)
            m.cond_stage_model = sd_hijack_open_clip.FrozenOpenCLIPEmbedderWithCustomWords(m.cond_stage_model, self)

    def undo_hijack(self, m: Any) -> None:
        conditioner = getattr(m, "conditioner", None)
        if conditioner is not None:
            for i, embedder in enumerate(conditioner.embedders):
                if isinstance(embedder, sd_hijack_clip.FrozenCLIPEmbedderWithCustomWordsBase):
                    conditioner.embedders[i] = embedder.wrapped
            for embedder in conditioner.embedders:
                _unwrap_token_embedding(embedder)
            return
        if isinstance(m.cond_stage_model, sd_hijack_clip.FrozenCLIPEmbedderWithCustomWordsBase):
            m.cond_stage_model = m.cond_stage_model.wrapped
        _unwrap_token_embedding(m.cond_stage_model)

    def clear_comments(self) -> None:
        self.comments = []
        self.extra_generation_params = {}


def _unwrap_token_embedding(embedder: Any) -> None:
    transformer = getattr(embedder, "transformer", None)
    owner = transformer.text_model.embeddings if transformer is not None else getattr(embedder, "model", None)
    if owner is not None and isinstance(owner.token_embedding, EmbeddingsWithFixes):
        owner.token_embedding = owner.token_embedding.wrapped


model_hijack = StableDiffusionModelHijack()
