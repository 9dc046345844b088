"""The WebUI's infotext ("parameters" PNG text chunk): writing, parsing and saving PNGs with it.

Format, as A1111 writes it and its PNG Info tab reads it::

    <prompt, any number of lines>
    Negative prompt: <negative prompt>        (omitted when empty)
    Steps: 20, Sampler: Euler a, CFG scale: 7, Seed: 1, Size: 512x512, Model hash: ..., ...

A value containing a comma, colon or newline is written as a JSON string. Written from the
format as the WebUI's PNG Info tab reads it; ``tests/sd/test_pnginfo.py`` checks it against the
WebUI's own reader when the test bed is there.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from ov_backend.files import atomic_path

logger = logging.getLogger(__name__)

PNG_KEY = "parameters"
NEGATIVE_PREFIX = "Negative prompt:"
#: A last line with fewer "key: value" fields than this is read as part of the prompt (the WebUI's rule).
MIN_PARAMETER_FIELDS = 3
_NEEDS_QUOTES = frozenset(",:\n")
_KEY_PUNCTUATION = frozenset(" -/_")
_JSON = json.JSONDecoder()


def quote(value: Any) -> str:
    """``value`` as written in the parameters line: as is, or as a JSON string when it holds a
    character that would end the field or the line (comma, colon, newline)."""
    text = str(value)
    return json.dumps(text, ensure_ascii=False) if _NEEDS_QUOTES.intersection(text) else text


def format_infotext(prompt: str, negative_prompt: str, params: Mapping[str, Any]) -> str:
    """The infotext of one image; ``params`` in the order they should appear (None and "" skipped)."""
    fields = [f"{key}: {quote(value)}" for key, value in params.items() if value is not None and value != ""]
    head = [prompt] + ([f"{NEGATIVE_PREFIX} {negative_prompt}"] if negative_prompt else [])
    return "\n".join(head + [", ".join(fields)])


def _is_key(text: str) -> bool:
    """A parameter name: a letter, digit or underscore, then those, spaces, '-' or '/'."""
    return len(text) > 1 and (text[0].isalnum() or text[0] == "_") and all(
        c.isalnum() or c in _KEY_PUNCTUATION for c in text
    )


def _quoted_value(line: str, start: int) -> tuple[str, int] | None:
    """A JSON string starting at ``start`` that ends its field (comma or end of line): (text, end)."""
    try:
        value, end = _JSON.raw_decode(line, start)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, str) or not value or (end < len(line) and line[end] != ","):
        return None
    return value, end


def parameter_fields(line: str) -> list[tuple[str, str]]:
    """The ``key: value`` fields of a parameters line, in order; anything else on it is skipped.

    Fields are separated by commas; a value starting with a double quote is a JSON string and may
    hold commas and colons. A stretch without a valid ``key:`` (a bare flag) is passed over.
    """
    fields: list[tuple[str, str]] = []
    pos = 0
    while pos < len(line):
        next_comma = line.find(",", pos)
        field_end = len(line) if next_comma < 0 else next_comma
        colon = line.find(":", pos, field_end)
        key = line[pos:colon].strip() if colon >= 0 else ""
        if not _is_key(key):
            pos = field_end + 1
            continue
        value_start = colon + 1
        while value_start < len(line) and line[value_start].isspace():
            value_start += 1
        quoted = _quoted_value(line, value_start) if line.startswith('"', value_start) else None
        if quoted is not None:
            value, field_end = quoted
        else:
            value = line[value_start:field_end].strip()
        fields.append((key, value))
        pos = field_end + 1
    return fields


def parse_infotext(text: str) -> dict[str, str]:
    """Parse an infotext: "Prompt", "Negative prompt" and every parameter, as strings.

    The last line is the parameters line when it holds at least ``MIN_PARAMETER_FIELDS`` fields;
    the lines before it are the prompt, then, from a line starting "Negative prompt:", the
    negative prompt.
    """
    lines = text.strip().split("\n")
    fields = parameter_fields(lines[-1])
    if len(fields) >= MIN_PARAMETER_FIELDS:
        lines.pop()
    else:
        fields = []
    negative_at = next((i for i, line in enumerate(lines) if line.strip().startswith(NEGATIVE_PREFIX)), len(lines))
    prompt = [line.strip() for line in lines[:negative_at]]
    negative = [line.strip() for line in lines[negative_at:]]
    if negative:
        negative[0] = negative[0][len(NEGATIVE_PREFIX):].strip()
    return {"Prompt": "\n".join(prompt), "Negative prompt": "\n".join(negative), **dict(fields)}


def save_png(image: Image.Image, path: str | os.PathLike, infotext: str) -> Path:
    """Write a PNG with the infotext, atomically (a killed run leaves no half-written file).

    The file gets the mode the umask gives new files (0644 under umask 022).

    Raises:
        OSError: the PNG could not be written (folder missing or not writable, disk full, ...).
    """
    return write_png_bytes(png_bytes(image, infotext), path)


def png_bytes(image: Image.Image, infotext: str) -> bytes:
    """The PNG file :func:`save_png` writes, as bytes (a worker sends them to the process that saves them)."""
    import io

    info = PngInfo()
    info.add_text(PNG_KEY, infotext)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()


def write_png_bytes(data: bytes, path: str | os.PathLike) -> Path:
    """Write a PNG made by :func:`png_bytes`, atomically, as :func:`save_png` does.

    Raises:
        OSError: the file could not be written.
    """
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return path


def read_png_infotext(path: str | os.PathLike) -> str | None:
    """The "parameters" text of a PNG, or None."""
    with Image.open(path) as image:
        return image.info.get(PNG_KEY)
