"""The dropdown Script "Accelerate with OpenVINO": a thin class over :class:`extension.Extension`."""

from __future__ import annotations

import logging
from typing import Any

from . import host
from .extension import Extension
from .infotext import TITLE, infotext_fields, paste_field_names
from .options import panel_values
from .settings import FIELD_NAMES, from_ui_args
from .ui import Panel, bind_refresh_after_generation, build_panel

logger = logging.getLogger(__name__)

__all__ = ["TITLE", "make_script_class"]


def make_script_class(extension: Extension) -> type:
    """A ``modules.scripts.Script`` subclass bound to ``extension`` (A1111 instantiates it per tab)."""
    base = host.scripts().Script

    class AccelerateWithOpenVINO(base):  # type: ignore[misc, valid-type]
        """Runs A1111's own pipeline with the UNet, VAE and text encoder in OpenVINO."""

        panel: Panel | None = None

        def title(self) -> str:
            return TITLE

        def show(self, is_img2img: bool) -> bool:
            return True

        def ui(self, is_img2img: bool) -> list[Any]:
            self.panel = build_panel(self, extension, is_img2img)
            # Read by A1111 after ui(): pasting an infotext sets these controls (see infotext.py).
            self.infotext_fields = infotext_fields(dict(zip(FIELD_NAMES, self.panel.args)))
            self.paste_field_names = paste_field_names()
            return self.panel.args

        def after_component(self, component: Any, **kwargs: Any) -> None:
            bind_refresh_after_generation(self.panel, component, kwargs.get("elem_id"), extension)

        def run(self, p: Any, *args: Any) -> Any:
            settings = from_ui_args(args, extension.known_devices(), read=panel_values)
            return extension.run(p, settings)

    return AccelerateWithOpenVINO
