"""The always-on "OpenVINO" section: accelerates whatever generation runs, with any dropdown script.

A1111 runs one dropdown script per generation; an always-visible script (``show`` returns
``AlwaysVisible``) gets hooks in every generation instead, also in each ``process_images`` call a dropdown
script makes (X/Y/Z plot, Prompts from file, SD upscale, Loopback ...). The section's controls are the
panel's (one settings table) after an *Enable* checkbox; its arguments are ``[enabled, *FIELD_NAMES]``.

Its title, :data:`SECTION_TITLE`, differs from the dropdown entry's: A1111's API finds a script of
``alwayson_scripts`` by its title among all scripts, and a section titled like the dropdown entry could be
found as the dropdown script (which the API refuses there).

Over the API (``alwayson_scripts``, an argument list A1111 never splices into other scripts'), the list is
read by :func:`section_settings`: positional in that order, or one object of named values.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from . import host
from .extension import Extension
from .generation import comment_on
from .infotext import SECTION_PASTE_KEY, infotext_fields, paste_field_names
from .options import panel_values, read_options
from .settings import FIELD_NAMES, build_settings
from .ui import Panel, bind_refresh_after_generation, build_panel

logger = logging.getLogger(__name__)

SECTION_TITLE = "OpenVINO"
"""The section's title: its accordion's label, and its name in ``alwayson_scripts``."""
ENABLED = "enabled"
"""The name of the first argument (the Enable checkbox) in the named form of the arguments."""
ARG_NAMES: tuple[str, ...] = (ENABLED, *FIELD_NAMES)
#: Attribute of ``p`` where the X/Y/Z plot axes put their values for one cell (see :mod:`.xyz_axes`).
OVERRIDE_ATTR = "openvino_accelerate_override"


def section_settings(args: Sequence[Any], override: Mapping[str, Any] | None, device_names: Sequence[str] | None):
    """The settings of one generation from the section's arguments and an X/Y/Z cell's values.

    Args:
        args: the section's arguments: ``[enabled, device, unet, vae, text_encoder, precision, model_caching,
            cache_dir]``; missing trailing values take the defaults (Enable: off). Or a mapping of those
            names (any subset) in the first place; the values after it are then ignored.
        override: an X/Y/Z cell's values ("enabled", "precision", "device"); a cell that sets the precision
            or device but not "enabled" is accelerated.
        device_names: the devices OpenVINO sees (None: not checked).

    Returns:
        (settings, "") when the generation is accelerated, (None, why not) when it is not.

    Raises:
        ValueError: an argument of the wrong type or an unknown value, with what would be right.
    """
    if args and isinstance(args[0], Mapping):  # the named form (A1111 fills the other slots with defaults)
        values = dict(args[0])
    elif len(args) > len(ARG_NAMES):
        raise ValueError(f"the {SECTION_TITLE} section takes at most {len(ARG_NAMES)} arguments "
                         f"({', '.join(ARG_NAMES)}), got {len(args)}")
    else:
        values = dict(zip(ARG_NAMES, args))
    unknown = sorted(set(values) - set(ARG_NAMES))
    if unknown:
        raise ValueError(f"unknown {SECTION_TITLE} section argument(s) {unknown}; known: {list(ARG_NAMES)}")
    enabled = values.pop(ENABLED, False)
    if not isinstance(enabled, bool):
        raise ValueError(f"the {SECTION_TITLE} section's first argument ({ENABLED!r}) must be true or false, "
                         f"got {enabled!r}")
    cell = dict(override or {})
    if ENABLED in cell:
        enabled = bool(cell.pop(ENABLED))
        why = "[OpenVINO] Enabled: Off in the X/Y/Z plot"
    else:
        enabled = enabled or bool(cell)
        why = f"the {SECTION_TITLE} section is not enabled"
    values.update(cell)
    # checked even when off: a wrong value is said at once
    settings = build_settings(panel_values(values), device_names)
    return (settings, "") if enabled else (None, why)


def make_section_class(extension: Extension) -> type:
    """A ``modules.scripts.Script`` subclass for the always-on section, bound to ``extension``."""
    base = host.scripts().Script

    class OpenVINOSection(base):  # type: ignore[misc, valid-type]
        """The "OpenVINO" accordion of txt2img and img2img."""

        panel: Panel | None = None

        def title(self) -> str:
            return SECTION_TITLE

        def show(self, is_img2img: bool) -> Any:
            return host.scripts().AlwaysVisible

        def ui(self, is_img2img: bool) -> list[Any]:
            gr = host.gradio()
            with gr.Accordion(SECTION_TITLE, open=False, elem_id=self.elem_id("accordion")):
                enabled = gr.Checkbox(
                    label="Enable: run this generation's UNet, VAE and text encoder in OpenVINO, with any script",
                    value=lambda: read_options().enable_always,
                    elem_id=self.elem_id(ENABLED),
                )
                self.panel = build_panel(self, extension, is_img2img)
            components = dict(zip(FIELD_NAMES, self.panel.args))
            self.infotext_fields = [(enabled, SECTION_PASTE_KEY), *infotext_fields(components)]
            self.paste_field_names = [SECTION_PASTE_KEY, *paste_field_names()]
            return [enabled, *self.panel.args]

        def after_component(self, component: Any, **kwargs: Any) -> None:
            bind_refresh_after_generation(self.panel, component, kwargs.get("elem_id"), extension)

        def setup(self, p: Any, *args: Any) -> None:
            extension.begin_job(p)

        def process(self, p: Any, *args: Any) -> None:
            if extension.dropdown_active():  # the dropdown entry runs this generation: not twice
                logger.info("Accelerate with OpenVINO: the dropdown script runs this generation; the %s section "
                            "leaves it to it", SECTION_TITLE)
                return
            try:
                settings, why = section_settings(args, getattr(p, OVERRIDE_ATTR, None), extension.known_devices())
            except ValueError as exc:  # A1111 logs and ignores what a hook raises: say it where the user looks
                why = f"not used for this image: {exc}"
                message = f"Accelerate with OpenVINO: {why}"
                logger.warning("%s", message)
                comment_on(p, message)
                extension.section_process(p, None, why, error=True)
                return
            extension.section_process(p, settings, why)

        def process_before_every_sampling(self, p: Any, *args: Any, **kwargs: Any) -> None:
            # every generation's, the dropdown entry's too (the WebUI calls this hook on always-on scripts only)
            extension.before_sampling(p)

        def postprocess(self, p: Any, processed: Any, *args: Any) -> None:
            extension.section_postprocess(p, processed)

    return OpenVINOSection
