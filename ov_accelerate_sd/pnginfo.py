"""The WebUI's infotext ("parameters" PNG text chunk): writing, parsing and saving PNGs with it.

Format, as A1111 writes it and its PNG Info tab reads it::

    <prompt, any number of lines>
    Negative prompt: <negative prompt>        (omitted when empty)
    Steps: 20, Sampler: Euler a, CFG scale: 7, Seed: 1, Size: 512x512, Model hash: ..., ...

A value containing a comma, colon or newline is written as a JSON string.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from .files import atomic_path

logger = logging.getLogger(__name__)

PNG_KEY = "parameters"
_PARAM = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')
_NEGATIVE = "Negative prompt:"


def quote(value: Any) -> str:
    """A value as the WebUI writes it in the parameters line."""
    text = str(value)
    if "," not in text and "\n" not in text and ":" not in text:
        return text
    return json.dumps(text, ensure_ascii=False)


def format_infotext(prompt: str, negative_prompt: str, params: Mapping[str, Any]) -> str:
    """The infotext of one image; ``params`` in the order they should appear (None values skipped)."""
    line = ", ".join(f"{k}: {quote(v)}" for k, v in params.items() if v is not None and v != "")
    text = prompt
    if negative_prompt:
        text += f"\n{_NEGATIVE} {negative_prompt}"
    return f"{text}\n{line}"


def parse_infotext(text: str) -> dict[str, str]:
    """Parse an infotext: "Prompt", "Negative prompt" and every parameter, as strings."""
    lines = text.strip().split("\n")
    params: dict[str, str] = {}
    last = lines[-1] if lines else ""
    found = _PARAM.findall(last)
    if len(found) >= 3:
        lines = lines[:-1]
        for key, value in found:
            value = value.strip()
            if value.startswith('"') and value.endswith('"'):
                value = json.loads(value)
            params[key.strip()] = value
    prompt, negative, in_negative = [], [], False
    for line in lines:
        if line.startswith(_NEGATIVE):
            in_negative = True
            line = line[len(_NEGATIVE):].strip()
        (negative if in_negative else prompt).append(line)
    return {"Prompt": "\n".join(prompt), "Negative prompt": "\n".join(negative), **params}


def save_png(image: Image.Image, path: str | os.PathLike, infotext: str) -> Path:
    """Write a PNG with the infotext, atomically (a killed run leaves no half-written file).

    The file gets the mode the umask gives new files (0644 under umask 022).

    Raises:
        OSError: the PNG could not be written (folder missing or not writable, disk full, ...).
    """
    path = Path(path)
    info = PngInfo()
    info.add_text(PNG_KEY, infotext)
    with atomic_path(path) as tmp:
        image.save(tmp, format="PNG", pnginfo=info)
    return path


def read_png_infotext(path: str | os.PathLike) -> str | None:
    """The "parameters" text of a PNG, or None."""
    with Image.open(path) as image:
        return image.info.get(PNG_KEY)
