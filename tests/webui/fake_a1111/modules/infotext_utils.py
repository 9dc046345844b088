"""Fake ``modules.infotext_utils``: reading an infotext back into the UI, with A1111 v1.10.1's behaviour.

Written from what the real module does, not from its code. ``parse_generation_parameters`` reads the
text as the WebUI's PNG Info tab does: the SD layer's reader (``ov_accelerate_sd.pnginfo``, checked
against the real ``parse_generation_parameters`` in tests/sd/test_pnginfo.py), with a ``WxH`` value
split into "<key>-1" / "<key>-2", and without the defaults A1111 adds for keys that are missing.
``paste`` does what the paste button does: the ``on_infotext_pasted`` callbacks see the parsed dict,
then every ``(component, key)`` of the tab's paste fields gets ``key(params)`` (a callable key) or
``params[key]``, converted to the type of the component's current value (a number for an int, as the
WebUI's sliders take it; the text "False" is False); no value, or one that does not convert, leaves the
component as it is (``gr.update()``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gradio as gr

from modules import script_callbacks
from ov_accelerate_sd.pnginfo import parse_infotext
from ov_accelerate_sd.pnginfo import quote as _quote

type_of_gr_update = type(gr.update())

#: tab name -> {"init_img": ..., "fields": [(component, key), ...], "override_settings_component": ...}
paste_fields: dict[str, dict[str, Any]] = {}


def quote(text: Any) -> Any:
    """A value as the WebUI writes it after "key: " (JSON-quoted only when it holds ',', ':' or a newline)."""
    quoted = _quote(text)
    return text if quoted == str(text) else quoted


def _size(value: str) -> tuple[str, str] | None:
    width, sep, height = value.partition("x")
    return (width, height) if sep and width.isdigit() and height.isdigit() and width.isascii() else None


def parse_generation_parameters(x: str) -> dict[str, Any]:
    parsed = parse_infotext(x)
    prompt, negative = parsed.pop("Prompt"), parsed.pop("Negative prompt")
    res: dict[str, Any] = {}
    for key, value in parsed.items():
        size = _size(value)
        if size is None:
            res[key] = value
        else:
            res[f"{key}-1"], res[f"{key}-2"] = size
    res["Prompt"], res["Negative prompt"] = prompt, negative
    return res


def add_paste_fields(
    tabname: str, init_img: Any, fields: list[tuple[Any, Any]], override_settings_component: Any = None
) -> None:
    paste_fields[tabname] = {
        "init_img": init_img,
        "fields": fields,
        "override_settings_component": override_settings_component,
    }


def _as_bool(value: Any) -> bool:
    return False if value == "False" else bool(value)


#: The component value's type -> how a pasted value is converted to it.
_CONVERTERS: dict[type, Callable[[Any], Any]] = {bool: _as_bool, int: float}


def _update(component: Any, value: Any) -> Any:
    if value is None:
        return gr.update()
    if isinstance(value, type_of_gr_update):
        return value
    kind = type(component.value)
    try:
        return gr.update(value=_CONVERTERS.get(kind, kind)(value))
    except (TypeError, ValueError):
        return gr.update()


def _value(key: Any, params: dict[str, Any]) -> Any:
    if not callable(key):
        return params.get(key)
    try:
        return key(params)
    except Exception:  # a script's reader that fails leaves its component unchanged, as in the WebUI
        return None


def paste(fields: list[tuple[Any, Any]], prompt: str) -> list[Any]:
    """What the paste button gives for the infotext ``prompt``: one gradio update per field."""
    params = parse_generation_parameters(prompt)
    script_callbacks.infotext_pasted_callback(prompt, params)
    return [_update(component, _value(key, params)) for component, key in fields]


def send_fields(source_tabname: str, tabname: str, paste_field_names: list[str]) -> tuple[list[Any], list[Any]]:
    """The (inputs, outputs) a "Send to <tabname>" button under ``source_tabname``'s images copies
    (``connect_paste_params_buttons``: A1111's own names plus the scripts' ``paste_field_names``)."""
    names = ["Prompt", "Negative prompt", "Steps", "Face restoration", *paste_field_names]
    inputs = [field for field, name in paste_fields[source_tabname]["fields"] if name in names]
    outputs = [field for field, name in paste_fields[tabname]["fields"] if name in names]
    return inputs, outputs


def connect_paste(
    button: Any, fields: list[tuple[Any, Any]], input_comp: Any, override_settings_component: Any, tabname: str
) -> None:
    outputs = [x[0] for x in fields]
    button.click(fn=lambda prompt: paste(fields, prompt), inputs=[input_comp], outputs=outputs, show_progress=False)
