"""Fake ``modules.shared``: opts, OptionInfo, state, sd_model, cmd_opts."""

from __future__ import annotations

import types
from typing import Any

from modules import shared_state


class OptionInfo:
    """Mirrors A1111's OptionInfo constructor."""

    def __init__(
        self,
        default: Any = None,
        label: str = "",
        component: Any = None,
        component_args: Any = None,
        onchange: Any = None,
        section: Any = None,
        refresh: Any = None,
        comment_before: str = "",
        comment_after: str = "",
        infotext: Any = None,
        restrict_api: bool = False,
        category_id: Any = None,
    ) -> None:
        self.default, self.label, self.component = default, label, component
        self.component_args, self.section = component_args, section

    def info(self, info: str) -> OptionInfo:
        return self

    def needs_reload_ui(self) -> OptionInfo:
        return self


#: The options the fake pipeline reads, with A1111 v1.10.1's defaults.
DEFAULTS: dict[str, Any] = {
    "sd_model_checkpoint": None,
    "CLIP_stop_at_last_layers": 1,
    "emphasis": "Original",
    "sd_checkpoints_limit": 1,
    "inpainting_mask_weight": 1.0,
    "live_previews_enable": True,
    "show_progress_every_n_steps": 10,
    "show_progress_type": "Approx NN",
    "show_progress_grid": True,
    "live_preview_content": "Prompt",
    "sdxl_refiner_low_aesthetic_score": 2.5,
    "sdxl_refiner_high_aesthetic_score": 6.0,
}


class Options:
    """Mirrors ``shared.opts``: registered options read back as attributes."""

    def __init__(self) -> None:
        object.__setattr__(self, "data", dict(DEFAULTS))
        object.__setattr__(self, "data_labels", {})

    def add_option(self, key: str, info: OptionInfo) -> None:
        self.data_labels[key] = info
        self.data.setdefault(key, info.default)

    def __getattr__(self, item: str) -> Any:
        data = object.__getattribute__(self, "data")
        if item in data:
            return data[item]
        raise AttributeError(item)

    def __setattr__(self, key: str, value: Any) -> None:
        self.data[key] = value


opts = Options()
state = shared_state.State()
sd_model: Any = None
#: False with --lowvram/--medvram: live previews are then decoded in the generation thread.
parallel_processing_allowed = True
cmd_opts = types.SimpleNamespace(api=False, skip_install=False, disable_nan_check=False)
