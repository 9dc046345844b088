"""Fake ``modules.scripts``: the Script base class (elem_id as in A1111 v1.10.1)."""

from __future__ import annotations

import re
from typing import Any

AlwaysVisible = object()


class Script:
    """Mirrors the parts of A1111's Script used by dropdown scripts."""

    name = None
    filename = None
    args_from = 0
    args_to = 0
    alwayson = False
    is_txt2img = False
    is_img2img = False
    tabname = None
    infotext_fields = None
    paste_field_names = None

    def title(self) -> str:
        raise NotImplementedError()

    def ui(self, is_img2img: bool) -> Any:
        pass

    def show(self, is_img2img: bool) -> Any:
        return True

    def run(self, p: Any, *args: Any) -> Any:
        pass

    def after_component(self, component: Any, **kwargs: Any) -> None:
        """Called after each gradio component is created while the tab is built (``kwargs`` as given)."""

    def elem_id(self, item_id: str) -> str:
        need_tabname = self.show(True) == self.show(False)
        tabkind = "img2img" if self.is_img2img else "txt2img"
        tabname = f"{tabkind}_" if need_tabname else ""
        title = re.sub(r"[^a-z_0-9]", "", re.sub(r"\s", "_", self.title().lower()))
        return f"script_{tabname}{title}_{item_id}"


class ScriptRunner:
    """Mirrors ``modules.scripts.ScriptRunner`` for dropdown scripts: ``setup_ui`` lays the scripts' ``ui()``
    components out after the dropdown (``inputs[0]``, the 1-based index of the chosen script), each
    script gets ``args_from``/``args_to``; ``run(p, *args)`` calls the chosen script with its slice.
    Each script's ``infotext_fields`` and ``paste_field_names``, set in its ``ui()``, are collected."""

    def __init__(self, is_img2img: bool = False) -> None:
        self.is_img2img = is_img2img
        self.scripts: list[Script] = []
        self.selectable_scripts: list[Script] = []
        self.inputs: list[Any] = [None]
        self.infotext_fields: list[tuple[Any, Any]] = []
        self.paste_field_names: list[str] = []

    def add(self, script_class: type) -> Script:
        script = script_class()
        script.is_img2img, script.is_txt2img = self.is_img2img, not self.is_img2img
        script.tabname = "img2img" if self.is_img2img else "txt2img"
        visibility = script.show(self.is_img2img)
        if visibility is AlwaysVisible:
            script.alwayson = True
        elif visibility:
            self.selectable_scripts.append(script)
        self.scripts.append(script)
        return script

    def setup_ui(self) -> list[Any]:
        for script in self.selectable_scripts:
            controls = script.ui(self.is_img2img) or []
            if script.infotext_fields is not None:  # read after ui(), as create_script_ui_inner does
                self.infotext_fields += script.infotext_fields
            if script.paste_field_names is not None:
                self.paste_field_names += script.paste_field_names
            script.args_from = len(self.inputs)
            self.inputs.extend(controls)
            script.args_to = len(self.inputs)
        return self.inputs

    def title_index(self, name: str) -> int:
        titles = [s.title().lower() for s in self.selectable_scripts]
        return titles.index(name.lower())

    def after_component(self, component: Any, **kwargs: Any) -> None:
        for script in self.scripts:
            script.after_component(component, **kwargs)

    def run(self, p: Any, *args: Any) -> Any:
        script_index = args[0]
        if not script_index:
            return None
        script = self.selectable_scripts[script_index - 1]
        return script.run(p, *args[script.args_from : script.args_to])


scripts_txt2img = ScriptRunner(is_img2img=False)
scripts_img2img = ScriptRunner(is_img2img=True)
