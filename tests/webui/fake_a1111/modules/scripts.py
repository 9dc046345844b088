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

    def elem_id(self, item_id: str) -> str:
        need_tabname = self.show(True) == self.show(False)
        tabkind = "img2img" if self.is_img2img else "txt2img"
        tabname = f"{tabkind}_" if need_tabname else ""
        title = re.sub(r"[^a-z_0-9]", "", re.sub(r"\s", "_", self.title().lower()))
        return f"script_{tabname}{title}_{item_id}"
