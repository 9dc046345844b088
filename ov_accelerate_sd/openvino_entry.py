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


def format_entry(device: str, parts: Iterable[str], precision: str, notes: Sequence[str] = ()) -> str:
    """The entry's value: ``device`` (e.g. "CPU"), the ``parts`` that ran in OpenVINO (names of ``PARTS``, any
    order), the ``precision``'s name (e.g. "f32"), then each of ``notes``."""
    chosen = set(parts)
    names = "+".join(PART_NAMES[part] for part in PARTS if part in chosen) or NO_PARTS
    return f"{device}, {names}, {precision}" + "".join(NOTE_SEPARATOR + note for note in notes)
