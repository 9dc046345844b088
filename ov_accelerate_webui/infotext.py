"""The extension's entries in A1111's infotext (the image's "parameters") and their paste-back.

Each image made with OpenVINO records two entries:

- ``Script: Accelerate with OpenVINO``: when an infotext is pasted, A1111's ``ScriptRunner`` sets the
  Script dropdown from the "Script" key (``modules/scripts.py``, ``setup_ui``), as X/Y/Z plot writes it;
  with the dropdown, the script's panel is shown.
- ``OpenVINO: "CPU, UNet+VAE+TE, auto"``: the panel's settings, written and read by
  :func:`settings.format_infotext` / :func:`settings.parse_infotext` from the one table
  :data:`settings.INFOTEXT_ITEMS`.

Paste-back ("Read generation parameters", PNG Info's "Send to txt2img"): A1111 parses the text into a
dict (``infotext_utils.parse_generation_parameters``), runs the ``on_infotext_pasted`` callbacks on it,
then sets each component of ``Script.infotext_fields`` from its key. :func:`expand_pasted` (that
callback) splits the "OpenVINO" entry into one key per panel field ("OpenVINO device", "OpenVINO UNet",
...), the keys of :func:`infotext_fields`; the same names are :func:`paste_field_names`, which A1111's
"Send to img2img" copies from txt2img. As sd-webui-controlnet does for its compound entries.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ov_accelerate_sd.openvino_entry import ENTRY_KEY as OPENVINO_KEY
from ov_accelerate_sd.openvino_entry import NOTE_SEPARATOR

from .settings import INFOTEXT_ITEMS, AccelerateSettings, parse_infotext

logger = logging.getLogger(__name__)

TITLE = "Accelerate with OpenVINO"
"""The script's title: its name in the Script dropdown and the value of :data:`SCRIPT_KEY`."""
ENTRY_KEY = OPENVINO_KEY
"""The infotext key of the settings entry (the command line writes it too)."""
SCRIPT_KEY = "Script"
"""A1111's infotext key that selects the Script dropdown on paste."""
SECTION_PASTE_KEY = "OpenVINO section"
"""The infotext key written when the always-on section made the image (instead of ``Script``); pasted, it
sets the section's Enable checkbox."""
SECTION_MARK = "on"
"""Its value."""

#: Settings field -> the key its pasted value has in A1111's parsed parameters, e.g. "OpenVINO device".
PASTE_KEYS: dict[str, str] = {item.field: f"{ENTRY_KEY} {item.name}" for item in INFOTEXT_ITEMS}


def generation_params(settings: AccelerateSettings, notes: Sequence[str] = (), section: bool = False) -> dict[str, str]:
    """The entries for ``p.extra_generation_params``.

    Args:
        settings: the settings of the run.
        notes: what the run did differently, e.g. "refiner in PyTorch" (appended after "; ").
        section: the always-on section made the image (it marks itself, and leaves "Script" to the
            dropdown script that ran, if any); else the dropdown entry did.
    """
    entry = settings.infotext() + "".join(NOTE_SEPARATOR + note for note in notes)
    if section:
        return {ENTRY_KEY: entry, SECTION_PASTE_KEY: SECTION_MARK}
    return {SCRIPT_KEY: TITLE, ENTRY_KEY: entry}


#: Every key :func:`generation_params` may write (a generation the section leaves in PyTorch removes them).
WRITTEN_KEYS = (ENTRY_KEY, SECTION_PASTE_KEY)


def infotext_fields(components: Mapping[str, Any]) -> list[tuple[Any, str]]:
    """``Script.infotext_fields``: (panel component, parameter key) for each field in the infotext.

    Args:
        components: settings field name -> the panel's component of that field.
    """
    return [(components[field], key) for field, key in PASTE_KEYS.items()]


def paste_field_names() -> list[str]:
    """``Script.paste_field_names``: the keys "Send to img2img/inpaint" copies from the txt2img panel."""
    return list(PASTE_KEYS.values())


def expand_pasted(params: dict[str, Any], device_choices: Sequence[tuple[str, str]],
                  precision_labels: Mapping[str, str], step_cache_labels: Mapping[int, str],
                  section_default: bool = False) -> list[str]:
    """Split a pasted "OpenVINO" entry into :data:`PASTE_KEYS` entries of ``params`` (in place).

    A value that cannot be used is left out, so A1111 leaves that control as it is: a slot that cannot
    be read, or a device this machine does not have. An infotext written before the "Script" entry was
    (only "OpenVINO") still selects the script. The section's Enable is set as the image was made (on for
    an image the section made, off for one the dropdown entry made) and, for an image without an "OpenVINO"
    entry, to ``section_default`` (Settings -> OpenVINO -> "Enable for every generation").

    Args:
        params: A1111's parsed infotext (the ``on_infotext_pasted`` callback's second argument).
        device_choices: the panel's (label, device name) pairs; the device is pasted as its label.
        precision_labels: precision name -> the panel's label of it; the precision is pasted as its label.
        step_cache_labels: step caching interval -> the panel's label of it (pasted as its label).

    Returns:
        What could not be pasted, one sentence each (also logged as one WARNING).
    """
    text = params.get(ENTRY_KEY)
    by_section = params.get(SECTION_PASTE_KEY) == SECTION_MARK
    # the section's Enable as the image was made; an image that does not say: the user's default
    params[SECTION_PASTE_KEY] = by_section if isinstance(text, str) else section_default
    if not isinstance(text, str):
        return []
    values, problems = parse_infotext(text)
    if "device" in values:
        device = values.pop("device")
        label = next((label for label, name in device_choices if name == device), None)
        if label is None:
            available = [name for _label, name in device_choices]
            problems.append(f"device {device!r} is not available here (available: {available})")
        else:
            values["device"] = label
    if "precision" in values:
        values["precision"] = precision_labels[values["precision"]]
    if "step_cache" in values:
        values["step_cache"] = step_cache_labels[values["step_cache"]]
    for field, value in values.items():
        params[PASTE_KEYS[field]] = value
    if not by_section:
        params.setdefault(SCRIPT_KEY, TITLE)
    if problems:
        logger.warning(
            "Accelerate with OpenVINO: pasted %s: %r: %s; the panel keeps its current value for these",
            ENTRY_KEY,
            text,
            "; ".join(problems),
        )
    return problems
