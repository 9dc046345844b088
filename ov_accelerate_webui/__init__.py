"""Accelerate with OpenVINO: the AUTOMATIC1111 WebUI adapter.

The only package that imports A1111's ``modules`` and gradio (all through :mod:`.host`). The entry
point ``scripts/openvino_accelerate.py`` calls :func:`create_extension` and exposes its two Scripts: the
dropdown entry and the always-on section.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from . import host
from .extension import Extension

logger = logging.getLogger(__name__)

__all__ = ["Loaded", "create_extension"]


@dataclass(frozen=True)
class Loaded:
    """What the entry point needs: the runtime and the Script class bound to it."""

    extension: Extension
    script_class: type
    """The dropdown entry "Accelerate with OpenVINO"."""
    section_class: type
    """The always-on "OpenVINO" section."""

    def register_callbacks(self) -> None:
        """Register the A1111 callbacks (A1111 clears and re-runs them on reload)."""
        from .api import add_routes
        from .ui import add_settings_section, on_infotext_pasted
        from .xyz_axes import register_axes

        callbacks = host.script_callbacks()
        callbacks.on_ui_settings(lambda: add_settings_section(self.extension))
        callbacks.on_infotext_pasted(lambda infotext, params: on_infotext_pasted(self.extension, infotext, params))
        callbacks.on_model_loaded(self.extension.on_model_loaded)
        callbacks.on_cfg_denoiser(self.extension.on_cfg_denoiser)
        callbacks.on_script_unloaded(self.extension.unload)
        uninstall = self.extension.webui.install_load_hook(self.extension)
        if uninstall is not None:
            callbacks.on_script_unloaded(uninstall)
        callbacks.on_app_started(lambda _demo, app: add_routes(app, self.extension))
        callbacks.on_before_ui(lambda: register_axes(self.extension))


def create_extension() -> Loaded:
    """Create the extension's runtime and its Script classes."""
    from .script import make_script_class
    from .section import make_section_class

    extension = Extension()
    return Loaded(extension=extension, script_class=make_script_class(extension),
                  section_class=make_section_class(extension))
