"""The WebUI's prompt syntax and conditioning: weights, BREAK, 75-token chunks, padded negative.

Owns: ``parse_prompt_attention`` (``(word)`` x1.1, ``[word]`` /1.1, ``(word:1.3)``, ``\\(``
escapes, ``BREAK``), the chunking of tokens into 75-token chunks (moving the words after the
last comma into the next chunk when it is within 20 tokens, as the WebUI does), and
``PromptEncoder``, which runs each chunk through the text encoder(s), applies the weights with
the WebUI's mean restoration, concatenates the chunks, and pads the shorter of prompt and
negative prompt with empty-prompt chunks so both have the same length.

The parser is written from the syntax: a scanner turns the prompt into tokens (text, literal,
opening bracket, closing bracket with an optional explicit weight); every piece of text
remembers the groups that were open when it was read; a group gets its factor when it closes
(or at the end, if it never does), and a piece's weight is the product of its groups' factors
in the order the groups closed. That order is the WebUI's, so the weights match it bit for bit
(checked against the WebUI's own parser by ``tests/sd/test_prompts.py``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

CHUNK_LENGTH = 75
COMMA_BACKTRACK = 20
ROUND_FACTOR = 1.1
SQUARE_FACTOR = 1 / 1.1
BREAK_MARK = ("BREAK", -1.0)

_FACTORS = {"(": ROUND_FACTOR, "[": SQUARE_FACTOR}
_PAIRS = {")": "(", "]": "["}
_ESCAPABLE = frozenset("()[]\\")
_SPECIAL = frozenset("()[]\\:")
_BREAK_WORD = "BREAK"


# -- scanning ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Token:
    """One lexical unit of a prompt.

    ``kind`` is "text" (plain words; may hold BREAK), "literal" (an escaped character, never a
    BREAK), "open" or "close". A closer keeps its source in ``text`` for when nothing is open
    and it has to be read as plain text; ``number`` is the explicit weight of ``:1.2)``.
    """

    kind: str
    text: str
    bracket: str = ""
    number: str | None = None


def _explicit_weight(text: str, colon: int) -> tuple[int, str] | None:
    """``:<spaces><sign><digits and dots><spaces>)`` at ``colon``: (end, number) or None."""
    pos, size = colon + 1, len(text)
    while pos < size and text[pos].isspace():
        pos += 1
    first = pos
    if pos < size and text[pos] in "+-":
        pos += 1
    digits = pos
    while pos < size and (text[pos] == "." or text[pos].isdecimal()):
        pos += 1
    if pos == digits:
        return None
    number = text[first:pos]
    while pos < size and text[pos].isspace():
        pos += 1
    if pos < size and text[pos] == ")":
        return pos + 1, number
    return None


def _scan(text: str) -> Iterator[_Token]:
    pos, size = 0, len(text)
    while pos < size:
        char = text[pos]
        if char == "\\":
            following = text[pos + 1 : pos + 2]
            if following in _ESCAPABLE and following:
                yield _Token("literal", following)
                pos += 2
            else:  # a backslash that escapes nothing is dropped, as in the WebUI
                yield _Token("literal", "")
                pos += 1
        elif char in _FACTORS:
            yield _Token("open", char, bracket=char)
            pos += 1
        elif char in _PAIRS:
            yield _Token("close", char, bracket=_PAIRS[char])
            pos += 1
        elif char == ":":
            found = _explicit_weight(text, pos)
            if found is None:
                yield _Token("text", ":")
                pos += 1
            else:
                end, number = found
                yield _Token("close", text[pos:end], bracket="(", number=number)
                pos = end
        else:
            end = pos + 1
            while end < size and text[end] not in _SPECIAL:
                end += 1
            yield _Token("text", text[pos:end])
            pos = end


def _is_word_char(char: str) -> bool:
    return char.isalnum() or char == "_"


def _split_at_breaks(run: str) -> list[str]:
    """Cut a run of plain text at each whole-word ``BREAK``, dropping the spaces around it."""
    parts: list[str] = []
    kept_from = look_from = 0
    while (found := run.find(_BREAK_WORD, look_from)) != -1:
        after = found + len(_BREAK_WORD)
        look_from = found + 1
        if (found > 0 and _is_word_char(run[found - 1])) or (after < len(run) and _is_word_char(run[after])):
            continue
        cut = found
        while cut > kept_from and run[cut - 1].isspace():
            cut -= 1
        while after < len(run) and run[after].isspace():
            after += 1
        parts.append(run[kept_from:cut])
        kept_from = look_from = after
    parts.append(run[kept_from:])
    return parts


# -- weighing ---------------------------------------------------------------------------------


@dataclass(eq=False)
class _Group:
    """A bracket group: its factor and when it closed (its place in the multiplication order)."""

    bracket: str
    factor: float
    closed_as: int = -1


@dataclass
class _Piece:
    text: str
    sign: float
    groups: tuple[_Group, ...]

    def weight(self) -> float:
        value = self.sign
        for group in sorted(self.groups, key=lambda g: g.closed_as):
            value *= group.factor
        return value


def _close(token: _Token, open_groups: list[_Group], source: str) -> _Group | None:
    """The innermost open group of the token's kind, now closed; None when none is open."""
    for index in range(len(open_groups) - 1, -1, -1):
        if open_groups[index].bracket == token.bracket:
            group = open_groups.pop(index)
            if token.number is not None:
                try:
                    group.factor = float(token.number)
                except ValueError:
                    raise ValueError(
                        f"prompt weight {token.number!r} in {token.text!r} is not a number "
                        f"(write it like (word:1.2)); prompt: {source!r}"
                    ) from None
            return group
    return None


def parse_prompt_attention(text: str) -> list[tuple[str, float]]:
    """Split a prompt into (text, weight) pieces, adjacent equal weights joined.

    ``(x)`` multiplies by 1.1, ``[x]`` divides by 1.1, ``(x:0.8)`` multiplies by 0.8, ``\\(``,
    ``\\)``, ``\\[``, ``\\]`` and ``\\\\`` are literal characters. Round and square brackets
    pair up separately; a closer with nothing open is text, an opener never closed applies to
    the rest of the prompt. A whole-word uppercase ``BREAK`` outside brackets becomes the piece
    ``("BREAK", -1.0)`` (inside brackets its weight is scaled too, and it stays text, as in the
    WebUI). An empty prompt gives ``[("", 1.0)]``.

    >>> parse_prompt_attention("a (red:1.5) [cat]")
    [('a ', 1.0), ('red', 1.5), (' ', 1.0), ('cat', 0.9090909090909091)]

    Raises:
        ValueError: an explicit weight such as ``(word:1.2.3)`` is not a number.
    """
    pieces: list[_Piece] = []
    open_groups: list[_Group] = []
    closed = itertools.count()
    for token in _scan(text):
        if token.kind == "open":
            open_groups.append(_Group(token.bracket, _FACTORS[token.bracket]))
            continue
        if token.kind == "close":
            group = _close(token, open_groups, text)
            if group is not None:
                group.closed_as = next(closed)
                continue
        inside = tuple(open_groups)
        if token.kind == "literal":
            pieces.append(_Piece(token.text, 1.0, inside))
            continue
        for number, part in enumerate(_split_at_breaks(token.text)):
            if number:
                pieces.append(_Piece(BREAK_MARK[0], BREAK_MARK[1], inside))
            pieces.append(_Piece(part, 1.0, inside))
    # Groups never closed apply to the rest: round ones first, then square, each outermost first.
    for group in sorted(open_groups, key=lambda g: g.bracket != "("):
        group.closed_as = next(closed)
    if not pieces:
        return [("", 1.0)]
    weighed = [(piece.text, piece.weight()) for piece in pieces]
    return [
        ("".join(part for part, _ in run), weight)
        for weight, run in itertools.groupby(weighed, key=lambda item: item[1])
    ]


# -- chunks -----------------------------------------------------------------------------------


@dataclass
class Chunk:
    """77 token ids (start, 75 tokens or padding, end) and their weights."""

    tokens: list[int] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)


def _wrap(items: list[tuple[int, float]], comma_id: int | None) -> list[list[tuple[int, float]]]:
    """Lines of at most 75 tokens; a full line hands the words after a late comma to the next."""
    lines: list[list[tuple[int, float]]] = [[]]
    for token, weight in items:
        line = lines[-1]
        if len(line) == CHUNK_LENGTH:
            carried: list[tuple[int, float]] = []
            commas = [i for i, (t, _) in enumerate(line) if t == comma_id]
            if token != comma_id and commas and CHUNK_LENGTH - commas[-1] <= COMMA_BACKTRACK:
                carried = line[commas[-1] + 1 :]
                del line[commas[-1] + 1 :]
            lines.append(carried)
        lines[-1].append((token, weight))
    return lines


def chunk_tokens(
    pieces: Sequence[tuple[Sequence[int] | None, float]], start_id: int, end_id: int, comma_id: int | None
) -> list[Chunk]:
    """Group weighted token pieces into 75-token chunks framed by start/end tokens.

    Args:
        pieces: (token ids, weight) per parsed piece; ``None`` for the ids marks a BREAK, which
            ends the current chunk (an empty one too).
        start_id: the start-of-text id framing each chunk.
        end_id: the end-of-text id closing each chunk and filling it up to 77.
        comma_id: the id of ``,``; a full chunk whose last comma is within 20 tokens of its end
            hands the tokens after that comma to the next chunk. None: no such rule.

    Returns:
        At least one chunk; an empty prompt gives one chunk of padding.
    """
    segments: list[list[tuple[int, float]]] = [[]]
    for tokens, weight in pieces:
        if tokens is None:
            segments.append([])
        else:
            segments[-1].extend((token, weight) for token in tokens)
    if len(segments) > 1 and not segments[-1]:  # a trailing BREAK adds no chunk
        segments.pop()
    chunks = []
    for segment in segments:
        for line in _wrap(segment, comma_id):
            padding = CHUNK_LENGTH + 1 - len(line)
            tokens = [start_id] + [token for token, _ in line] + [end_id] * padding
            weights = [1.0] + [weight for _, weight in line] + [1.0] * padding
            chunks.append(Chunk(tokens, weights))
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
        words = [text for text, weight in parsed if (text, weight) != BREAK_MARK]
        ids = iter(tokenizer(words, truncation=False, add_special_tokens=False)["input_ids"] if words else [])
        pieces = [(None if (text, weight) == BREAK_MARK else next(ids), weight) for text, weight in parsed]
        comma = tokenizer.get_vocab().get(",</w>")
        return chunk_tokens(pieces, tokenizer.bos_token_id, tokenizer.eos_token_id, comma)

    def chunk_count(self, prompt: str) -> int:
        """How many chunks of 75 tokens ``prompt`` is encoded in (no encoder runs: the tokenizer's count)."""
        return len(self._chunks(self.tokenizers[0], prompt))

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
                tokens = _padded(chunk.tokens, tokenizer.eos_token_id, pad_id)
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
    mean = _mean(hidden)
    weighted = hidden * weights
    new_mean = _mean(weighted)
    if new_mean.abs() <= 1e-6 * _mean(weighted.abs()):
        return weighted
    return weighted * (mean / new_mean)


def _mean(values: torch.Tensor) -> torch.Tensor:
    """The mean of every element (a 0-d tensor of ``values``' dtype), the same whatever the number of threads.

    PyTorch's own ``mean()`` of a (1, 77, 768) tensor splits its sum by thread and differs in the last bit
    between 1 and 2 threads; the batch command's workers (1 thread each) then render other bytes than one
    process on every core. numpy sums a float64 copy on one thread, pairwise, in a fixed order.
    """
    exact = values.detach().to(device="cpu", dtype=torch.float64).numpy().mean()
    return torch.tensor(exact, dtype=values.dtype, device=values.device)


def _padded(tokens: list[int], end_id: int, pad_id: int) -> list[int]:
    """The ids after the first end token replaced by the pad id (SD2's OpenCLIP pads with 0).

    Like the WebUI, the first end token counts, even one the prompt itself produced.
    """
    if pad_id == end_id:
        return list(tokens)
    first_end = tokens.index(end_id)
    return tokens[: first_end + 1] + [pad_id] * (len(tokens) - first_end - 1)


def _pad(embeds: torch.Tensor, empty: torch.Tensor, count: int) -> torch.Tensor:
    return torch.cat([embeds] + [empty] * count, dim=1)
