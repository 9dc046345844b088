"""Fake ``modules.ui``: one generation tab built in A1111 v1.10.1's order, for panel tests.

The prompt row with the Generate button comes first, then the always-on scripts of the sections before
the scripts, the scripts (always-on ones of no section, dropdown ``script_list`` and each dropdown
script's ``ui()``), the always-on scripts of the "scripts" section, then the output panel
(``generation_info_<tab>``, ``html_info_<tab>``, ``html_log_<tab>``, see ``ui_common.create_output_panel``).
While it is built, gradio's ``IOComponent.__init__`` is patched as ``modules/scripts.py`` does, so each script's
``after_component(component, **kwargs)`` sees every component. Generate runs ``modules.txt2img``'s
body: a processing object, ``runner.run(p, *args)`` or ``process_images(p)``, and returns the info
JSON, the infotext and comments as HTML (what ``html_info`` shows), and a log line.

The tools row's paste button (``#<tab>_tools #paste``, "Read generation parameters") reads the infotext
in the prompt box into the tab's paste fields: the prompt, the scripts' ``infotext_fields`` and the
Script dropdown, which ``ScriptRunner.setup_ui`` sets from the "Script" key (``infotext_utils``). The
scripts' panels are always shown here (A1111 hides those of the scripts not chosen).
"""

from __future__ import annotations

import contextlib
import html
import time
from collections.abc import Iterator
from typing import Any

import gradio as gr

from modules import infotext_utils, processing, scripts, shared


@contextlib.contextmanager
def component_hooks(runner: scripts.ScriptRunner) -> Iterator[None]:
    original = gr.components.IOComponent.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        runner.after_component(self, **kwargs)

    gr.components.IOComponent.__init__ = init
    try:
        yield
    finally:
        gr.components.IOComponent.__init__ = original


#: A1111's UI categories laid out before the "scripts" one (``shared_items.ui_reorder_categories``, the
#: ones always-on scripts use): their always-on scripts' controls come before the dropdown's in ``inputs``.
UI_SECTIONS_BEFORE_SCRIPTS = ("sampler", "dimensions", "cfg", "seed")


def plaintext_to_html(text: str) -> str:
    return "<p>" + "<br>\n".join(html.escape(x) for x in text.split("\n")) + "</p>"


def generate(runner: scripts.ScriptRunner, prompt: str, *args: Any) -> tuple[str, str, str]:
    """``modules.txt2img.txt2img`` (steps and size small)."""
    start = time.perf_counter()
    p = processing.StableDiffusionProcessingTxt2Img(
        sd_model=shared.sd_model, prompt=prompt, seed=1, steps=1, width=64, height=64, do_not_save_samples=True
    )
    p.scripts, p.script_args = runner, args
    processed = runner.run(p, *args) or processing.process_images(p)
    info = plaintext_to_html(processed.info) + plaintext_to_html(processed.comments)
    return processed.js(), info, plaintext_to_html(f"Time taken: {time.perf_counter() - start:.2f} sec.")


def create_tab(runner: scripts.ScriptRunner) -> gr.Blocks:
    tab = "img2img" if runner.is_img2img else "txt2img"
    with component_hooks(runner), gr.Blocks(analytics_enabled=False) as demo:
        prompt = gr.Textbox(label="Prompt", elem_id=f"{tab}_prompt", lines=3)
        submit = gr.Button("Generate", elem_id=f"{tab}_generate")
        with gr.Row(elem_id=f"{tab}_tools"):
            paste = gr.Button("\u2199\ufe0f", elem_id="paste")
        runner.prepare_ui()
        for section in UI_SECTIONS_BEFORE_SCRIPTS:  # always-on scripts placed in these sections
            runner.setup_ui_for_section(section)
        titles = [s.title() for s in runner.selectable_scripts]
        dropdown = gr.Dropdown(
            label="Script", elem_id="script_list", choices=["None", *titles], value=titles[0], type="index"
        )
        inputs = runner.setup_ui()
        inputs[0] = dropdown
        runner.setup_ui_for_section("scripts")  # after the dropdown scripts' controls, as in A1111
        runner.infotext_fields.append((dropdown, lambda x: gr.update(value=x.get("Script", "None"))))
        fields = [(prompt, "Prompt"), *runner.infotext_fields]
        infotext_utils.add_paste_fields(tab, None, fields)
        infotext_utils.connect_paste(paste, fields, prompt, None, tab)
        generation_info = gr.Textbox(visible=False, elem_id=f"generation_info_{tab}")
        html_info = gr.HTML(elem_id=f"html_info_{tab}")
        html_log = gr.HTML(elem_id=f"html_log_{tab}")
        submit.click(
            lambda *a: generate(runner, *a),
            inputs=[prompt, *inputs],
            outputs=[generation_info, html_info, html_log],
        )
    return demo
