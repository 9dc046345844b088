"""The WebUI's prompt syntax and conditioning: weights, BREAK, 75-token chunks, padded negative.

Owns: ``parse_prompt_attention`` (``(word)`` x1.1, ``[word]`` /1.1, ``(word:1.3)``, ``\\(``
escapes, ``BREAK``), the chunking of tokens into 75-token chunks (moving the words after the
last comma into the next chunk when it is within 20 tokens, as the WebUI does), and
``PromptEncoder``, which runs each chunk through the text encoder(s), applies the weights with
the WebUI's mean restoration, concatenates the chunks, and pads the shorter of prompt and
negative prompt with empty-prompt chunks so both have the same length.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

CHUNK_LENGTH = 75
COMMA_BACKTRACK = 20
ROUND_FACTOR = 1.1
SQUARE_FACTOR = 1 / 1.1

_ATTENTION = re.compile(
    r"""
\\\(|\\\)|\\\[|\\]|\\\\|\\|\(|\[|:\s*([+-]?[.\d]+)\s*\)|\)|]|[^\\()\[\]:]+|:
""",
    re.X,
)
_BREAK = re.compile(r"\s*\bBREAK\b\s*", re.S)
BREAK_MARK = ("BREAK", -1.0)


def parse_prompt_attention(text: str) -> list[tuple[str, float]]:
    """Split a prompt into (text, weight) pieces; ``BREAK`` becomes ("BREAK", -1.0).

    >>> parse_prompt_attention("a (red:1.5) [cat]")
    [('a ', 1.0), ('red', 1.5), (' ', 1.0), ('cat', 0.9090909090909091)]
    """
    res: list[list] = []
    round_open: list[int] = []
    square_open: list[int] = []

    def multiply_from(start: int, factor: float) -> None:
        for piece in res[start:]:
            piece[1] *= factor

    for match in _ATTENTION.finditer(text):
        token, weight = match.group(0), match.group(1)
        if token.startswith("\\"):
            res.append([token[1:], 1.0])
        elif token == "(":
            round_open.append(len(res))
        elif token == "[":
            square_open.append(len(res))
        elif weight is not None and round_open:
            multiply_from(round_open.pop(), float(weight))
        elif token == ")" and round_open:
            multiply_from(round_open.pop(), ROUND_FACTOR)
        elif token == "]" and square_open:
            multiply_from(square_open.pop(), SQUARE_FACTOR)
        else:
            for i, part in enumerate(_BREAK.split(token)):
                if i > 0:
                    res.append(list(BREAK_MARK))
                res.append([part, 1.0])
    for start in round_open:
        multiply_from(start, ROUND_FACTOR)
    for start in square_open:
        multiply_from(start, SQUARE_FACTOR)
    if not res:
        return [("", 1.0)]
    merged: list[list] = [res[0]]
    for piece in res[1:]:
        if piece[1] == merged[-1][1] and tuple(piece) != BREAK_MARK and tuple(merged[-1]) != BREAK_MARK:
            merged[-1][0] += piece[0]
        else:
            merged.append(piece)
    return [(t, float(w)) for t, w in merged]


@dataclass
class Chunk:
    """77 token ids (start, 75 tokens or padding, end) and their weights."""

    tokens: list[int] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)


def chunk_tokens(
    pieces: Sequence[tuple[Sequence[int], float]], start_id: int, end_id: int, comma_id: int | None
) -> list[Chunk]:
    """Group weighted token pieces into 75-token chunks framed by start/end tokens."""
    chunks: list[Chunk] = []
    chunk = Chunk()
    last_comma = -1

    def close(current: Chunk) -> None:
        missing = CHUNK_LENGTH - len(current.tokens)
        tokens = [start_id] + current.tokens + [end_id] * missing + [end_id]
        weights = [1.0] + current.weights + [1.0] * missing + [1.0]
        chunks.append(Chunk(tokens, weights))

    for tokens, weight in pieces:
        if weight == BREAK_MARK[1] and tokens is None:
            close(chunk)
            chunk, last_comma = Chunk(), -1
            continue
        for token in tokens:
            if token == comma_id:
                last_comma = len(chunk.tokens)
            elif (
                len(chunk.tokens) == CHUNK_LENGTH
                and last_comma != -1
                and len(chunk.tokens) - last_comma <= COMMA_BACKTRACK
            ):
                cut = last_comma + 1
                moved = Chunk(chunk.tokens[cut:], chunk.weights[cut:])
                close(Chunk(chunk.tokens[:cut], chunk.weights[:cut]))
                chunk, last_comma = moved, -1
            if len(chunk.tokens) == CHUNK_LENGTH:
                close(chunk)
                chunk, last_comma = Chunk(), -1
            chunk.tokens.append(token)
            chunk.weights.append(weight)
    if chunk.tokens or not chunks:
        close(chunk)
    return chunks


@dataclass(frozen=True)
class Conditioning:
    """Text conditioning of one prompt: (1, 77 * chunks, dim) and, for SDXL, the pooled vector."""

    embeds: torch.Tensor
    pooled: torch.Tensor | None = None

    @property
    def chunks(self) -> int:
        return self.embeds.shape[1] // (CHUNK_LENGTH + 2)


class PromptEncoder:
    """Encodes WebUI prompts with one or more CLIP text encoders (SDXL has two)."""

    def __init__(
        self,
        tokenizers: Sequence,
        text_encoders: Sequence[torch.nn.Module],
        specs: Sequence[Mapping],
        clip_skip: int = 1,
    ) -> None:
        self.tokenizers = list(tokenizers)
        self.text_encoders = list(text_encoders)
        self.specs = list(specs)
        self.clip_skip = max(1, int(clip_skip))

    def _chunks(self, tokenizer, prompt: str) -> list[Chunk]:
        parsed = parse_prompt_attention(prompt)
        texts = [t for t, w in parsed if (t, w) != BREAK_MARK]
        encoded = tokenizer(texts, truncation=False, add_special_tokens=False)["input_ids"] if texts else []
        ids = iter(encoded)
        pieces = [(None, w) if (t, w) == BREAK_MARK else (next(ids), w) for t, w in parsed]
        comma = tokenizer.get_vocab().get(",</w>")
        return chunk_tokens(pieces, tokenizer.bos_token_id, tokenizer.eos_token_id, comma)

    def _run(self, index: int, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        encoder, spec = self.text_encoders[index], self.specs[index]
        out = encoder(tokens, output_hidden_states=True)
        if spec.get("hidden_state") == "penultimate":
            hidden = out.hidden_states[-2]
        elif self.clip_skip > 1:
            hidden = out.hidden_states[-self.clip_skip]
            hidden = self._final_norm(encoder)(hidden)
        else:
            hidden = out.last_hidden_state
        pooled = out.text_embeds if spec.get("with_projection") else None
        return hidden, pooled

    @staticmethod
    def _final_norm(encoder: torch.nn.Module) -> torch.nn.Module:
        module = getattr(encoder, "_orig_mod", encoder)
        return module.text_model.final_layer_norm

    @torch.no_grad()
    def encode(self, prompt: str) -> Conditioning:
        """Conditioning of one prompt (weights applied, chunks concatenated)."""
        per_encoder = []
        pooled_first = None
        for index, tokenizer in enumerate(self.tokenizers):
            chunks = self._chunks(tokenizer, prompt)
            pad_id = tokenizer.pad_token_id
            outs = []
            for number, chunk in enumerate(chunks):
                tokens = list(chunk.tokens)
                if pad_id != tokenizer.eos_token_id:
                    end = tokens.index(tokenizer.eos_token_id)
                    tokens[end + 1 :] = [pad_id] * (len(tokens) - end - 1)
                hidden, pooled = self._run(index, torch.tensor([tokens]))
                weights = torch.tensor(chunk.weights, dtype=hidden.dtype).reshape(1, -1, 1)
                hidden = _apply_weights(hidden, weights)
                outs.append(hidden)
                if pooled is not None and number == 0:
                    pooled_first = pooled
            per_encoder.append(outs)
        counts = {len(outs) for outs in per_encoder}
        if len(counts) > 1:  # the tokenizers agree on ids, so this is a bug, not user input
            raise RuntimeError(f"text encoders split the prompt into different chunk counts {counts}")
        chunks = [torch.cat([outs[i] for outs in per_encoder], dim=-1) for i in range(counts.pop())]
        return Conditioning(torch.cat(chunks, dim=1), pooled_first)

    def encode_pair(self, prompt: str, negative: str) -> tuple[Conditioning, Conditioning]:
        """Prompt and negative prompt, the shorter padded with empty-prompt chunks."""
        cond, uncond = self.encode(prompt), self.encode(negative)
        if cond.chunks != uncond.chunks:
            empty = self.encode("").embeds
            if cond.chunks < uncond.chunks:
                cond = Conditioning(_pad(cond.embeds, empty, uncond.chunks - cond.chunks), cond.pooled)
            else:
                uncond = Conditioning(_pad(uncond.embeds, empty, cond.chunks - uncond.chunks), uncond.pooled)
        return cond, uncond


def _apply_weights(hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Scale token vectors by their weights, then restore the original mean (the WebUI's way).

    A mean of (almost) exactly zero, as a freshly initialised final LayerNorm gives, cannot be
    restored; the weighted vectors are then kept as they are instead of dividing by zero.
    """
    mean = hidden.mean()
    weighted = hidden * weights
    new_mean = weighted.mean()
    if new_mean.abs() <= 1e-6 * weighted.abs().mean():
        return weighted
    return weighted * (mean / new_mean)


def _pad(embeds: torch.Tensor, empty: torch.Tensor, count: int) -> torch.Tensor:
    return torch.cat([embeds] + [empty] * count, dim=1)
