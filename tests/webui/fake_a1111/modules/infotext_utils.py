"""Fake ``modules.infotext_utils``: reading an infotext back into the UI, as A1111 v1.10.1 does.

``parse_generation_parameters`` splits the text as the real one does (the prompt lines, "Negative
prompt:", the last line of ``key: value`` pairs with JSON-quoted values), without A1111's defaults for
keys it adds when missing. ``paste`` is the body of ``connect_paste``'s ``paste_func``: the
``on_infotext_pasted`` callbacks run on the parsed dict, then each ``(component, key)`` of the tab's
paste fields gets ``key(params)`` if ``key`` is callable, else ``params[key]``, converted to the type
of the component's initial value; a missing value leaves the component unchanged (``gr.update()``).
"""

from __future__ import annotations

import json
import re
from typing import Any

import gradio as gr

from modules import script_callbacks

re_param = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')
re_imagesize = re.compile(r"^(\d+)x(\d+)$")
type_of_gr_update = type(gr.update())

#: tab name -> {"init_img": ..., "fields": [(component, key), ...], "override_settings_component": ...}
paste_fields: dict[str, dict[str, Any]] = {}


def quote(text: Any) -> Any:
    if "," not in str(text) and "\n" not in str(text) and ":" not in str(text):
        return text
    return json.dumps(text, ensure_ascii=False)


def unquote(text: str) -> str:
    if len(text) == 0 or text[0] != '"' or text[-1] != '"':
        return text
    try:
        return json.loads(text)
    except Exception:
        return text


def parse_generation_parameters(x: str) -> dict[str, Any]:
    res: dict[str, Any] = {}
    prompt, negative_prompt, done_with_prompt = "", "", False
    *lines, lastline = x.strip().split("\n")
    if len(re_param.findall(lastline)) < 3:
        lines.append(lastline)
        lastline = ""
    for line in lines:
        line = line.strip()
        if line.startswith("Negative prompt:"):
            done_with_prompt = True
            line = line[16:].strip()
        if done_with_prompt:
            negative_prompt += ("" if negative_prompt == "" else "\n") + line
        else:
            prompt += ("" if prompt == "" else "\n") + line
    for k, v in re_param.findall(lastline):
        if v and v[0] == '"' and v[-1] == '"':
            v = unquote(v)
        m = re_imagesize.match(v)
        if m is not None:
            res[f"{k}-1"], res[f"{k}-2"] = m.group(1), m.group(2)
        else:
            res[k] = v
    res["Prompt"], res["Negative prompt"] = prompt, negative_prompt
    return res


def add_paste_fields(
    tabname: str, init_img: Any, fields: list[tuple[Any, Any]], override_settings_component: Any = None
) -> None:
    paste_fields[tabname] = {
        "init_img": init_img,
        "fields": fields,
        "override_settings_component": override_settings_component,
    }


def paste(fields: list[tuple[Any, Any]], prompt: str) -> list[Any]:
    """What ``paste_func`` returns for the infotext ``prompt``: one gradio update per field."""
    params = parse_generation_parameters(prompt)
    script_callbacks.infotext_pasted_callback(prompt, params)
    res: list[Any] = []
    for output, key in fields:
        if callable(key):
            try:
                v = key(params)
            except Exception:
                v = None
        else:
            v = params.get(key, None)
        if v is None:
            res.append(gr.update())
        elif isinstance(v, type_of_gr_update):
            res.append(v)
        else:
            try:
                valtype = type(output.value)
                if valtype is bool and v == "False":
                    val = False
                elif valtype is int:
                    val = float(v)
                else:
                    val = valtype(v)
                res.append(gr.update(value=val))
            except Exception:
                res.append(gr.update())
    return res


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
