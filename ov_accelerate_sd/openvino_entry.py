"""The "OpenVINO" entry of an image's infotext, e.g. ``OpenVINO: "CPU, UNet+VAE+TE, f32"``: on which device,
which parts and at which precision the image was made, written the same by the command line and the WebUI
adapter, so an image of either pastes back into the WebUI's panel (the adapter reads the entry back).

Three slots joined by ", ": the OpenVINO device as the user named it; the short names of the parts that
ran in OpenVINO (:data:`PART_NAMES`, in ``PARTS`` order), joined by "+", or :data:`NO_PARTS`; the precision's
name (``ov_backend.PRECISIONS``). A note the run adds (e.g. "UNet in PyTorch") follows after
:data:`NOTE_SEPARATOR`. Imports nothing heavy.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from .parts import PARTS

logger = logging.getLogger(__name__)

#: The infotext key.
ENTRY_KEY = "OpenVINO"
#: Part name -> its short name in the entry (and in the WebUI's status).
PART_NAMES: dict[str, str] = dict(zip(PARTS, ("UNet", "VAE", "TE"), strict=True))
#: The parts slot when no part ran in OpenVINO.
NO_PARTS = "none"
#: Separates the entry from a note the run added.
NOTE_SEPARATOR = "; "
#: How many slots the entry has (device, parts, precision).
SLOTS = 3
#: The optional slot after them, written when the UNet ran with step caching (its interval).
STEP_CACHE_SLOT = "step cache {}"


def format_entry(device: str, parts: Iterable[str], precision: str, notes: Sequence[str] = (),
                 step_cache: int = 1) -> str:
    """The entry's value: ``device`` (e.g. "CPU"), the ``parts`` that ran in OpenVINO (names of ``PARTS``, any
    order), the ``precision``'s name (e.g. "f32"), the step caching interval when the UNet ran in OpenVINO with
    it (``step_cache`` > 1, e.g. "step cache 3"), then each of ``notes``."""
    chosen = set(parts)
    names = "+".join(PART_NAMES[part] for part in PARTS if part in chosen) or NO_PARTS
    cached = ", " + STEP_CACHE_SLOT.format(step_cache) if step_cache > 1 and "unet" in chosen else ""
    return f"{device}, {names}, {precision}{cached}" + "".join(NOTE_SEPARATOR + note for note in notes)


def split_step_cache(entry: str) -> tuple[str, int | None]:
    """(the entry without its step caching slot, the interval written there: 1 when there is none, None when
    the slot names no whole number > 1)."""
    head, sep, last = entry.rpartition(", ")
    prefix = STEP_CACHE_SLOT.format("")
    if not sep or not last.startswith(prefix):
        return entry, 1
    value = last[len(prefix):]
    return head, int(value) if value.isdigit() and int(value) > 1 else None
