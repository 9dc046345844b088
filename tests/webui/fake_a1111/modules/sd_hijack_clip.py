"""Fake ``modules.sd_hijack_clip``: A1111's prompt chunking around the transformers CLIP text encoders.

Mirrors v1.10.1: a prompt is parsed for emphasis (``(word:1.5)``, ``(word)``, ``[word]``, ``BREAK``;
the SD layer's ``parse_prompt_attention`` stands in for ``prompt_parser``'s) unless ``opts.emphasis`` is
"None", each token gets its piece's weight, a ``BREAK`` starts a new chunk; the tokens are split into
chunks of 75, each chunk gets start/end tokens (77, weight 1.0), ``encode_with_transformers`` is called
once per chunk, the emphasis is applied to its output ("Original", the default: each token's vector
times its weight, then the whole chunk rescaled by original mean / new mean; "No norm": without the
rescale; "Ignore": weights unused) and the results are concatenated along the token axis (77, 154, ...
tokens). Before each chunk's call ``hijack.fixes`` is set to the chunk's
textual-inversion fixes (offset in the chunk, Embedding); an embedding takes ``vectors`` placeholder
tokens and moves to the next chunk when it does not fit. SD1 calls ``wrapped.transformer(input_ids=...,
output_hidden_states=-CLIP_stop_at_last_layers)``; SDXL's CLIP-L calls it with
``output_hidden_states=layer == "hidden"``. Tokens are derived from characters (no tokenizer files):
one character is one token.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import torch
from torch import nn

from modules import shared
from ov_accelerate_sd.prompts import parse_prompt_attention

PromptChunkFix = namedtuple("PromptChunkFix", ["offset", "embedding"])


class PromptChunk:
    """75 tokens (77 with start and end), their weights and the textual-inversion fixes inside them."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.multipliers: list[float] = []
        self.fixes: list[PromptChunkFix] = []


class FrozenCLIPEmbedderWithCustomWordsBase(nn.Module):
    """Chunks of 75 tokens, each padded to 77 and encoded; ``forward(texts)`` -> (B, 77 * chunks, C)."""

    chunk_length = 75

    def __init__(
        self, wrapped: nn.Module, hijack: Any, vocab_size: int, id_start: int, id_end: int, id_pad: int
    ) -> None:
        super().__init__()
        self.wrapped = wrapped
        self.hijack = hijack
        self.vocab_size = vocab_size
        self.id_start, self.id_end, self.id_pad = id_start, id_end, id_pad
        self.input_key = getattr(wrapped, "input_key", "txt")
        self.is_trainable = False
        self.legacy_ucg_val = None
        self.ucg_rate = 0.0

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [[(ord(ch) * 7 + i) % (self.vocab_size - 3) + 1 for i, ch in enumerate(t)] for t in texts]

    def tokenize_line(self, line: str) -> list[PromptChunk]:
        chunks: list[PromptChunk] = []
        chunk = PromptChunk()

        def next_chunk() -> None:
            nonlocal chunk
            to_add = self.chunk_length - len(chunk.tokens)
            chunk.tokens = [self.id_start, *chunk.tokens, *([self.id_end] * (to_add + 1))]
            chunk.multipliers = [1.0, *chunk.multipliers, *([1.0] * (to_add + 1))]
            chunks.append(chunk)
            chunk = PromptChunk()

        parsed = parse_prompt_attention(line) if shared.opts.emphasis != "None" else [(line, 1.0)]
        for piece, weight in parsed:
            if piece == "BREAK" and weight == -1:
                next_chunk()
                continue
            for text, embedding in self.hijack.embedding_db.split(piece):
                if embedding is None:
                    for token in self.tokenize([text])[0]:
                        if len(chunk.tokens) == self.chunk_length:
                            next_chunk()
                        chunk.tokens.append(token)
                        chunk.multipliers.append(weight)
                    continue
                if len(chunk.tokens) + embedding.vectors > self.chunk_length:
                    next_chunk()
                chunk.fixes.append(PromptChunkFix(len(chunk.tokens), embedding))
                chunk.tokens += [0] * embedding.vectors
                chunk.multipliers += [weight] * embedding.vectors
        if chunk.tokens or not chunks:
            next_chunk()
        return chunks

    def empty_chunk(self) -> PromptChunk:
        chunk = PromptChunk()
        chunk.tokens = [self.id_start] + [self.id_end] * (self.chunk_length + 1)
        chunk.multipliers = [1.0] * (self.chunk_length + 2)
        return chunk

    def forward(self, texts: list[str]) -> Any:
        batch_chunks = [self.tokenize_line(t) for t in texts]
        zs = []
        for i in range(max(len(c) for c in batch_chunks)):
            batch_chunk = [chunks[i] if i < len(chunks) else self.empty_chunk() for chunks in batch_chunks]
            self.hijack.fixes = [x.fixes for x in batch_chunk]
            zs.append(self.process_tokens([x.tokens for x in batch_chunk], [x.multipliers for x in batch_chunk]))
        if getattr(self.wrapped, "return_pooled", False):
            return torch.hstack(zs), zs[0].pooled
        return torch.hstack(zs)

    def process_tokens(
        self, remade_batch_tokens: list[list[int]], batch_multipliers: list[list[float]]
    ) -> torch.Tensor:
        tokens = torch.asarray(remade_batch_tokens)
        if self.id_end != self.id_pad:  # SD2/SDXL-G: pad with id_pad after the first end token
            for pos, row in enumerate(remade_batch_tokens):
                tokens[pos, row.index(self.id_end) + 1 :] = self.id_pad
        z = self.encode_with_transformers(tokens)
        pooled = getattr(z, "pooled", None)
        z = apply_emphasis(z, torch.asarray(batch_multipliers, dtype=z.dtype), shared.opts.emphasis)
        if pooled is not None:
            z.pooled = pooled
        return z

    def encode_with_transformers(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def apply_emphasis(z: torch.Tensor, multipliers: torch.Tensor, emphasis: str) -> torch.Tensor:
    """A chunk's encoder output ``z`` (B, 77, C) weighted by ``multipliers`` (B, 77) as ``emphasis`` says."""
    if emphasis in ("None", "Ignore"):
        return z
    weighted = z * multipliers[..., None]
    if emphasis == "No norm":
        return weighted
    return weighted * (z.mean() / weighted.mean())  # "Original": the mean over the whole chunk kept


class FrozenCLIPEmbedderWithCustomWords(FrozenCLIPEmbedderWithCustomWordsBase):
    """SD1: ``cond_stage_model`` after A1111's hijack; ``wrapped.transformer`` is a CLIPTextModel."""

    def __init__(self, wrapped: nn.Module, hijack: Any) -> None:
        config = wrapped.transformer.config
        super().__init__(
            wrapped, hijack, config.vocab_size, config.bos_token_id, config.eos_token_id, config.eos_token_id
        )

    def encode_with_transformers(self, tokens: torch.Tensor) -> torch.Tensor:
        clip_skip = shared.opts.CLIP_stop_at_last_layers
        outputs = self.wrapped.transformer(input_ids=tokens, output_hidden_states=-clip_skip)
        if clip_skip > 1:
            z = outputs.hidden_states[-clip_skip]
            return self.wrapped.transformer.text_model.final_layer_norm(z)
        return outputs.last_hidden_state


class FrozenCLIPEmbedderForSDXLWithCustomWords(FrozenCLIPEmbedderWithCustomWords):
    """SDXL's CLIP-L (``conditioner.embedders[0]``): the hidden state of ``wrapped.layer_idx``."""

    def encode_with_transformers(self, tokens: torch.Tensor) -> torch.Tensor:
        outputs = self.wrapped.transformer(input_ids=tokens, output_hidden_states=self.wrapped.layer == "hidden")
        if self.wrapped.layer == "last":
            return outputs.last_hidden_state
        return outputs.hidden_states[self.wrapped.layer_idx]
