"""CLIP tokenizer files derived locally from open_clip's BPE table, with no hub access.

Owns: finding ``bpe_simple_vocab_16e6.txt.gz`` inside the installed open_clip package without
importing it (open_clip needs torchvision), writing the ``vocab.json`` / ``merges.txt`` pair
that transformers' ``CLIPTokenizer`` reads, and building the tokenizers. The files are written
once per folder, atomically.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import os
from pathlib import Path

from transformers import CLIPTokenizer
from transformers.models.clip.tokenization_clip import bytes_to_unicode

from ov_backend.files import atomic_path

from .paths import user_cache_dir

logger = logging.getLogger(__name__)

BPE_FILE = "bpe_simple_vocab_16e6.txt.gz"
VOCAB_SIZE = 49408
_MERGES = 49152 - 256 - 2


class TokenizerError(RuntimeError):
    """The BPE table needed to build the CLIP tokenizer is missing."""


def find_bpe_file() -> Path:
    """Locate open_clip's BPE table without importing open_clip.

    Raises:
        TokenizerError: open_clip is not installed, or the file is missing from it.
    """
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(
            "the CLIP tokenizer is derived from open_clip's BPE table, but open_clip is not installed: "
            "pip install --no-deps open-clip-torch==2.20.0"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BPE_FILE
    if not path.is_file():
        raise TokenizerError(f"{path} is missing from the open_clip package")
    return path


def build_vocab(merges: list[str]) -> dict[str, int]:
    """The token -> id table of CLIP's BPE vocabulary, from its merge rules.

    The ids are a fixed layout the text encoders' embeddings were trained on: the 256 byte
    symbols (in the byte-to-printable-character order of GPT-2's BPE, here taken from
    transformers), the same symbols as word ends ("</w>"), one token per merge rule in file
    order, then the start and end tokens.
    """
    symbols = list(bytes_to_unicode().values())
    tokens = [*symbols, *(symbol + "</w>" for symbol in symbols)]
    tokens += [merge.replace(" ", "") for merge in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {token: index for index, token in enumerate(tokens)}


def _write_atomic(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def tokenizer_files(folder: str | os.PathLike | None = None) -> Path:
    """Write (once) ``vocab.json`` and ``merges.txt`` into ``folder`` and return it."""
    folder = Path(folder) if folder is not None else user_cache_dir() / "clip_tokenizer"
    vocab_path, merges_path = folder / "vocab.json", folder / "merges.txt"
    if vocab_path.is_file() and merges_path.is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    lines = gzip.open(find_bpe_file()).read().decode("utf-8").split("\n")
    merges = lines[1 : _MERGES + 1]
    vocab = build_vocab(merges)
    if len(vocab) != VOCAB_SIZE:
        raise TokenizerError(f"derived vocabulary has {len(vocab)} tokens, expected {VOCAB_SIZE}")
    _write_atomic(merges_path, "#version: 0.2\n" + "\n".join(merges) + "\n")
    _write_atomic(vocab_path, json.dumps(vocab, ensure_ascii=False))
    logger.info("wrote CLIP tokenizer files to %s", folder)
    return folder


def clip_tokenizer(
    pad_token: str = "<|endoftext|>", folder: str | os.PathLike | None = None
) -> CLIPTokenizer:
    """A CLIP tokenizer (77 tokens) padding with ``pad_token`` ("!" for OpenCLIP encoders)."""
    files = tokenizer_files(folder)
    return CLIPTokenizer(
        str(files / "vocab.json"), str(files / "merges.txt"), pad_token=pad_token, model_max_length=77
    )
