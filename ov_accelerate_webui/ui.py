"""The panel of the script (gradio 3.41 in A1111, 4.40 in Forge) and the "OpenVINO" section of the Settings tab.

Controls are made from :data:`settings.FIELDS` (label, hint, default), so the order of ``ui()``'s
return value, of ``script_args`` and of the settings section is the dataclass field order. Element
ids and hover hints reach the JavaScript through one hidden JSON block (``CONFIG_CLASS``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ov_accelerate_sd.parts import PARTS
from ov_accelerate_sd.step_cache import StepCacheSettings

from . import host
from .backend_bridge import BackendUnavailable, ov_backend
from .infotext import expand_pasted
from .options import (
    CACHE_LIMIT_LABEL,
    CACHE_LIMIT_OPTION,
    ENABLE_ALWAYS_LABEL,
    ENABLE_ALWAYS_OPTION,
    KEEP_SIZES_LABEL,
    KEEP_SIZES_OPTION,
    PRECISION_LABELS,
    PREVIOUS_WEIGHTS_LABEL,
    PREVIOUS_WEIGHTS_OPTION,
    SECTION,
    STEP_CACHE_DEPTH_LABEL,
    STEP_CACHE_DEPTH_OPTION,
    STEP_CACHE_END_LABEL,
    STEP_CACHE_END_OPTION,
    STEP_CACHE_LABELS,
    STEP_CACHE_START_LABEL,
    STEP_CACHE_START_OPTION,
    WEIGHTS_IN_FILE_LABEL,
    WEIGHTS_IN_FILE_OPTION,
    option_key,
    panel_values,
    read_options,
)
from .precompile import precompile
from .settings import DEFAULTS, FIELD_NAMES, FIELDS, build_settings
from .status import to_html

logger = logging.getLogger(__name__)

#: A1111's element under the images that shows a generation's infotext and comments
#: (``modules/ui_common.py`` ``create_output_panel``). Every generation updates it, so its ``change``
#: event refreshes "Last run" and "Ready sizes" after each run without a poll (gradio 3.41 has no
#: event that fires when another extension's generation ends, and dropdown scripts get no hook after
#: ``run``); the same status is also in ``Processed.comments``, shown in that element.
RESULT_ELEM_ID = "html_info_{tab}"
#: The element beside it with the run's log ("Time taken", errors), which changes with every generation.
RESULT_LOG_ELEM_ID = "html_log_{tab}"
#: The JavaScript guard of that refresh (``javascript/openvino_accelerate.js``): it lets the call through only when
#: the text of the result elements changed since this panel last saw it. gradio 4 (Forge) fires an HTML
#: component's ``change`` at every update of the page (each event's progress re-renders the layout), so
#: unguarded, each refresh fired the next one: an endless stream of calls while the page was open.
RESULT_GUARD_JS = "() => ovAccelerate.whenResultChanged({key}, {ids})"

CONFIG_CLASS = "ov-accelerate-config"

#: Extra controls beyond the settings fields: element-id suffix -> (label, hover hint).
EXTRA_CONTROLS: dict[str, tuple[str, str]] = {
    "cache_size": ("Cache size", "Space the compiled models take on disk, against the limit in Settings -> OpenVINO."),
    "clear_cache": ("Clear cache", "Delete every compiled model in the cache folder (asks first)."),
    "precompile": ("Pre-compile", "Compile these sizes now, so a batch job starts at full speed."),
    "precompile_batch": ("Pre-compile batch size", "Batch size the sizes are compiled for."),
    "precompile_progress": ("Pre-compile progress", "What is being compiled."),
    "precompile_sizes": ("Sizes to pre-compile", "Comma-separated WIDTHxHEIGHT, e.g. 512x512, 768x512."),
    "ready": ("Ready sizes", "Sizes compiled for the loaded checkpoint: they start without a compile."),
    "refresh": ("Refresh", "Update the cache size, the ready sizes and the status."),
    "status": (
        "Last run",
        "What ran in OpenVINO, what fell back to PyTorch and why, times, cache hits, device.",
    ),
}


def _device_choices(extension: Any) -> list[tuple[str, str]]:
    try:
        return extension.device_choices()
    except BackendUnavailable:
        return [(DEFAULTS.device, DEFAULTS.device)]


def _label_for(device: str, choices: list[tuple[str, str]]) -> str:
    for label, name in choices:
        if name == device:
            return label
    return choices[0][0]


@dataclass(frozen=True)
class Panel:
    """The components of one tab's panel that other code needs."""

    args: list[Any]
    """The components whose values are ``run``'s args, in :data:`FIELD_NAMES` order."""
    status: Any
    """The "Last run" box."""
    ready: Any
    """The "Ready sizes" box."""
    tab: str
    """"txt2img" or "img2img"."""


def build_panel(script: Any, extension: Any, is_img2img: bool) -> Panel:
    """Build the panel in the script's accordion."""
    gr = host.gradio()
    defaults = dataclasses.asdict(read_options().panel)
    choices = _device_choices(extension)
    labels = [label for label, _name in choices]
    ids = {name: script.elem_id(name) for name in (*FIELD_NAMES, *EXTRA_CONTROLS)}
    hints = {f.metadata["label"]: f.metadata["hint"] for f in FIELDS}
    hints.update({label: hint for label, hint in EXTRA_CONTROLS.values()})
    config = {"ids": ids, "hints": hints, "tab": "img2img" if is_img2img else "txt2img"}
    fields: dict[str, Any] = {}
    meta = {f.name: f.metadata for f in FIELDS}

    with gr.Group(elem_id=script.elem_id("panel"), elem_classes=["ov-accelerate-panel"]):
        gr.HTML(f'<div class="{CONFIG_CLASS}" hidden data-config="{_attr(json.dumps(config))}"></div>')
        try:
            extension.api()
        except BackendUnavailable as exc:
            gr.HTML(to_html(str(exc), "error"), elem_id=script.elem_id("unavailable"))
        fields["device"] = gr.Dropdown(
            label=meta["device"]["label"],
            choices=labels,
            value=_label_for(str(defaults["device"]), choices),
            elem_id=ids["device"],
        )
        with gr.Row():
            for name in PARTS:
                fields[name] = gr.Checkbox(label=meta[name]["label"], value=bool(defaults[name]), elem_id=ids[name])
        fields["precision"] = gr.Radio(
            label=meta["precision"]["label"],
            choices=list(PRECISION_LABELS.values()),
            value=PRECISION_LABELS[defaults["precision"]],
            elem_id=ids["precision"],
        )
        fields["step_cache"] = gr.Radio(
            label=meta["step_cache"]["label"],
            choices=list(STEP_CACHE_LABELS.values()),
            value=STEP_CACHE_LABELS[defaults["step_cache"]],
            elem_id=ids["step_cache"],
        )
        with gr.Row():
            fields["model_caching"] = gr.Checkbox(
                label=meta["model_caching"]["label"],
                value=bool(defaults["model_caching"]),
                elem_id=ids["model_caching"],
            )
            fields["cache_dir"] = gr.Textbox(
                label=meta["cache_dir"]["label"],
                value=defaults["cache_dir"],
                placeholder=host.default_cache_dir(),
                elem_id=ids["cache_dir"],
            )
        with gr.Row():
            cache_size = gr.Textbox(
                label=EXTRA_CONTROLS["cache_size"][0],
                interactive=False,
                value=lambda: _safe(lambda: extension.cache_size_text(str(defaults["cache_dir"])), ""),
                elem_id=ids["cache_size"],
            )
            clear = gr.Button(EXTRA_CONTROLS["clear_cache"][0], elem_id=ids["clear_cache"])
            refresh = gr.Button(EXTRA_CONTROLS["refresh"][0], elem_id=ids["refresh"])
        confirmed = gr.Checkbox(value=False, visible=False)
        with gr.Row():
            sizes = gr.Textbox(
                label=EXTRA_CONTROLS["precompile_sizes"][0], value="512x512", elem_id=ids["precompile_sizes"]
            )
            batch = gr.Number(
                label=EXTRA_CONTROLS["precompile_batch"][0],
                value=1,
                precision=0,
                elem_id=ids["precompile_batch"],
            )
            precompile = gr.Button(EXTRA_CONTROLS["precompile"][0], elem_id=ids["precompile"])
        progress = gr.Textbox(
            label=EXTRA_CONTROLS["precompile_progress"][0],
            interactive=False,
            elem_id=ids["precompile_progress"],
        )
        ready = gr.Textbox(
            label=EXTRA_CONTROLS["ready"][0],
            interactive=False,
            lines=2,
            value=lambda: _safe(extension.ready_sizes_text),
            elem_id=ids["ready"],
        )
        status = gr.Textbox(
            label=EXTRA_CONTROLS["status"][0],
            interactive=False,
            lines=4,
            value=lambda: extension.last_status,
            elem_id=ids["status"],
        )

    args = [fields[name] for name in FIELD_NAMES]
    handlers = PanelHandlers(extension)
    clear.click(
        handlers.clear_cache,
        inputs=[fields["cache_dir"], confirmed],
        outputs=[cache_size],
        **_event_js(gr, "ovAccelerate.confirmClear"),
    )
    refresh.click(handlers.refresh, inputs=[fields["cache_dir"]], outputs=[cache_size, ready, status])
    outputs = [progress, ready]
    start_compile = f"(...a) => ovAccelerate.startCompile(a, {len(outputs)}, {json.dumps(ids['precompile_progress'])})"
    precompile.click(
        handlers.precompile,
        inputs=[sizes, batch, *args],
        outputs=outputs,
        **_event_js(gr, start_compile),
    )
    return Panel(args=args, status=status, ready=ready, tab=config["tab"])


def bind_refresh_after_generation(panel: Panel | None, component: Any, elem_id: str | None, extension: Any) -> bool:
    """If ``component`` is the tab's result element (:data:`RESULT_ELEM_ID`), refresh the panel's
    "Last run" and "Ready sizes" whenever a generation changes it or the log beside it (:data:`RESULT_GUARD_JS`).
    Call from ``Script.after_component``.

    Returns:
        True when the refresh was bound.
    """
    if panel is None or elem_id != RESULT_ELEM_ID.format(tab=panel.tab):
        return False
    watched = [RESULT_ELEM_ID.format(tab=panel.tab), RESULT_LOG_ELEM_ID.format(tab=panel.tab)]
    guard = RESULT_GUARD_JS.format(key=json.dumps(panel.status.elem_id), ids=json.dumps(watched))
    component.change(
        PanelHandlers(extension).after_generation,
        inputs=[],
        outputs=[panel.status, panel.ready],
        show_progress="hidden",
        **_event_js(host.gradio(), guard),
    )
    return True


class PanelHandlers:
    """Event handlers of the panel's buttons (plain functions of values, testable without gradio)."""

    def __init__(self, extension: Any) -> None:
        self.extension = extension

    def clear_cache(self, folder: str, confirmed: bool) -> str:
        """Clear the disk cache if the user confirmed in the dialog."""
        return _safe(lambda: self.extension.clear_cache(folder, bool(confirmed)))

    def refresh(self, folder: str) -> tuple[str, str, str]:
        """New cache size, ready sizes and last status."""
        return (
            _safe(lambda: self.extension.cache_size_text(folder)),
            _safe(self.extension.ready_sizes_text),
            self.extension.last_status,
        )

    def after_generation(self) -> tuple[str, str]:
        """Last status and ready sizes (after a generation)."""
        return self.extension.last_status, _safe(self.extension.ready_sizes_text)

    def precompile(self, sizes: str, batch: float, *args: Any) -> Iterator[tuple[str, str]]:
        """Compile the sizes; yields (progress, ready sizes) while it runs."""
        try:
            settings = build_settings(panel_values(dict(zip(FIELD_NAMES, args))))
            for line in precompile(self.extension, sizes, int(batch or 1), settings):
                yield line, self.extension.ready_sizes_text()
        except (ValueError, BackendUnavailable) as exc:
            yield f"Failed: {exc}", _safe(self.extension.ready_sizes_text)


def _event_js(gr: Any, source: str) -> dict[str, str]:
    """The keyword argument that gives an event listener its JavaScript: ``_js`` in gradio 3 (A1111), ``js`` from
    gradio 4 (Forge). Forge renames ``_js`` only on a component's events once the component is built, not yet in
    ``after_component``, where the refresh after a generation is bound."""
    major = int(str(gr.__version__).split(".")[0])
    return {"js" if major >= 4 else "_js": source}


def _safe(fn: Any, fallback: str | None = None) -> str:
    try:
        return fn()
    except (BackendUnavailable, OSError, ValueError) as exc:
        return fallback if fallback is not None else f"Unavailable: {exc}"


def _attr(text: str) -> str:
    return text.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;")


def on_infotext_pasted(extension: Any, infotext: str, params: dict[str, Any]) -> None:
    """A1111's ``on_infotext_pasted`` callback: put the "OpenVINO" entry's values under the keys of the
    panel's ``infotext_fields`` (see :func:`infotext.expand_pasted`); what cannot be pasted is also
    shown to the user as a gradio warning."""
    default = read_options().enable_always
    for problem in expand_pasted(params, _device_choices(extension), PRECISION_LABELS, STEP_CACHE_LABELS,
                                 section_default=default):
        host.gradio().Warning(f"Accelerate with OpenVINO: not pasted: {problem}")


def add_settings_section(extension: Any) -> None:
    """Register the "OpenVINO" settings section (call from ``on_ui_settings``)."""
    gr = host.gradio()
    choices = [name for _label, name in _device_choices(extension)]
    for f in FIELDS:
        kwargs: dict[str, Any] = {}
        default = getattr(DEFAULTS, f.name)
        if f.name == "device":
            kwargs = {"component": gr.Dropdown, "component_args": {"choices": choices}}
        elif f.name == "precision":
            kwargs = {"component": gr.Radio, "component_args": {"choices": list(PRECISION_LABELS.values())}}
            default = PRECISION_LABELS[default]
        elif f.name == "step_cache":
            kwargs = {"component": gr.Radio, "component_args": {"choices": list(STEP_CACHE_LABELS.values())}}
            default = STEP_CACHE_LABELS[default]
        label = f"{f.metadata['label']} (default of the panel)"
        host.add_option(option_key(f.name), default, label, SECTION, **kwargs)
    host.add_option(ENABLE_ALWAYS_OPTION, False, ENABLE_ALWAYS_LABEL, SECTION)
    host.add_option(KEEP_SIZES_OPTION, False, KEEP_SIZES_LABEL, SECTION)
    host.add_option(WEIGHTS_IN_FILE_OPTION, True, WEIGHTS_IN_FILE_LABEL, SECTION)
    host.add_option(CACHE_LIMIT_OPTION, ov_backend.DEFAULT_CACHE_MAX_BYTES / (1 << 30), CACHE_LIMIT_LABEL, SECTION,
                    component=gr.Number,
                    component_args={"minimum": 0, "precision": 1})
    shape = StepCacheSettings()
    for key, label, value, low in ((STEP_CACHE_DEPTH_OPTION, STEP_CACHE_DEPTH_LABEL, shape.depth, 1),
                                   (STEP_CACHE_START_OPTION, STEP_CACHE_START_LABEL, shape.full_start, 1),
                                   (STEP_CACHE_END_OPTION, STEP_CACHE_END_LABEL, shape.full_end, 0)):
        host.add_option(key, value, label, SECTION, component=gr.Slider,
                        component_args={"minimum": low, "maximum": 11, "step": 1})
    host.add_option(PREVIOUS_WEIGHTS_OPTION, "auto", PREVIOUS_WEIGHTS_LABEL, SECTION, component=gr.Radio,
                    component_args={"choices": list(ov_backend.PREVIOUS_WEIGHTS)})
