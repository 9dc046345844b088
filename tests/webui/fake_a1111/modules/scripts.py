"""Fake ``modules.scripts``: the Script base class (elem_id as in A1111 v1.10.1), ``load_scripts`` and the
``ScriptRunner``.

``load_scripts(*extension_roots)`` executes each extension's ``scripts/*.py`` as A1111 v1.10.1 does: the
extension's folder is put first on ``sys.path`` only while its file runs, and the previous ``sys.path``
list is put back right after (so a package first imported later, at generation time, is not found
there); the callbacks are cleared first; every ``Script`` subclass in a module is recorded in
``scripts_data``; a file that fails to load is reported and skipped.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modules import script_callbacks

logger = logging.getLogger(__name__)

AlwaysVisible = object()


class Script:
    """Mirrors the parts of A1111's Script used by dropdown scripts."""

    name = None
    filename = None
    args_from = 0
    args_to = 0
    alwayson = False
    section = None
    """The UI section an always-on script's controls go to (None: just before the dropdown scripts')."""
    controls = None
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

    # The processing hooks: called for always-on scripts only, each with its slice of ``p.script_args``.
    def before_process(self, p: Any, *args: Any) -> None:
        pass

    def process(self, p: Any, *args: Any) -> None:
        pass

    def before_process_batch(self, p: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def process_batch(self, p: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def postprocess_batch(self, p: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def postprocess(self, p: Any, processed: Any, *args: Any) -> None:
        pass

    def elem_id(self, item_id: str) -> str:
        need_tabname = self.show(True) == self.show(False)
        tabkind = "img2img" if self.is_img2img else "txt2img"
        tabname = f"{tabkind}_" if need_tabname else ""
        title = re.sub(r"[^a-z_0-9]", "", re.sub(r"\s", "_", self.title().lower()))
        return f"script_{tabname}{title}_{item_id}"


@dataclass
class ScriptClassData:
    script_class: type
    path: str
    basedir: str
    module: Any


scripts_data: list[ScriptClassData] = []


def load_scripts(*extension_roots: str | Path) -> None:
    """Execute every ``scripts/*.py`` of each extension folder, as A1111's ``load_scripts`` does."""
    scripts_data.clear()
    script_callbacks.clear_callbacks()
    syspath = sys.path
    for root in extension_roots:
        for path in sorted(Path(root, "scripts").glob("*.py")):
            try:
                sys.path = [str(root), *sys.path]
                spec = importlib.util.spec_from_file_location(path.name, path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                for value in list(vars(module).values()):
                    if inspect.isclass(value) and issubclass(value, Script):
                        scripts_data.append(ScriptClassData(value, str(path), str(root), module))
            except Exception:
                logger.exception("Error loading script: %s", path.name)  # A1111 reports it and goes on
            finally:
                sys.path = syspath


class ScriptRunner:
    """Mirrors ``modules.scripts.ScriptRunner``. All scripts' ``ui()`` components go into one ``inputs``
    list, each script getting ``args_from``/``args_to``: ``inputs[0]`` is the dropdown (the 1-based index
    of the chosen script); ``setup_ui`` lays out the always-on scripts of no section, then the dropdown
    scripts; ``setup_ui_for_section`` the always-on scripts of a named section (the tab calls it for
    sections before and after the scripts, as A1111's ``ui.py`` does). ``run(p, *args)`` calls the chosen
    script with its slice; the processing hooks (``before_process``, ``process``, ...) call the always-on
    scripts, each with its slice of ``p.script_args``. Each script's ``infotext_fields`` and
    ``paste_field_names``, set in its ``ui()``, are collected."""

    def __init__(self, is_img2img: bool = False) -> None:
        self.is_img2img = is_img2img
        self.scripts: list[Script] = []
        self.selectable_scripts: list[Script] = []
        self.alwayson_scripts: list[Script] = []
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
            self.alwayson_scripts.append(script)
            self.scripts.append(script)
        elif visibility:
            self.selectable_scripts.append(script)
            self.scripts.append(script)
        return script

    def initialize_scripts(self, is_img2img: bool) -> None:
        """One instance of each class ``load_scripts`` found."""
        self.is_img2img = is_img2img
        self.scripts.clear()
        self.selectable_scripts.clear()
        self.alwayson_scripts.clear()
        for data in scripts_data:
            self.add(data.script_class).filename = data.path

    def prepare_ui(self) -> None:
        self.inputs = [None]

    def create_script_ui(self, script: Script) -> None:
        script.args_from = script.args_to = len(self.inputs)
        controls = script.ui(self.is_img2img)
        script.controls = controls
        if controls is None:
            return
        script.name = script.title().lower()
        if script.infotext_fields is not None:  # read after ui(), as create_script_ui_inner does
            self.infotext_fields += script.infotext_fields
        if script.paste_field_names is not None:
            self.paste_field_names += script.paste_field_names
        self.inputs.extend(controls)
        script.args_to = len(self.inputs)

    def setup_ui_for_section(self, section: str | None, scriptlist: list[Script] | None = None) -> None:
        for script in self.alwayson_scripts if scriptlist is None else scriptlist:
            if script.alwayson and script.section != section:
                continue
            self.create_script_ui(script)

    def setup_ui(self) -> list[Any]:
        self.setup_ui_for_section(None)
        self.setup_ui_for_section(None, self.selectable_scripts)
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

    def _hook(self, name: str, p: Any, *before: Any, **kwargs: Any) -> None:
        """Call ``name`` of each always-on script that has it, with its slice of ``p.script_args``."""
        for script in self.alwayson_scripts:
            if getattr(type(script), name) is getattr(Script, name):
                continue
            getattr(script, name)(p, *before, *p.script_args[script.args_from : script.args_to], **kwargs)

    def before_process(self, p: Any) -> None:
        self._hook("before_process", p)

    def process(self, p: Any) -> None:
        self._hook("process", p)

    def before_process_batch(self, p: Any, **kwargs: Any) -> None:
        self._hook("before_process_batch", p, **kwargs)

    def process_batch(self, p: Any, **kwargs: Any) -> None:
        self._hook("process_batch", p, **kwargs)

    def postprocess_batch(self, p: Any, images: Any, **kwargs: Any) -> None:
        self._hook("postprocess_batch", p, images=images, **kwargs)

    def postprocess(self, p: Any, processed: Any) -> None:
        self._hook("postprocess", p, processed)


scripts_txt2img = ScriptRunner(is_img2img=False)
scripts_img2img = ScriptRunner(is_img2img=True)
