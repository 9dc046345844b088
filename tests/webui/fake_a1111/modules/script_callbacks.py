"""Fake ``modules.script_callbacks``: the registries and the calls the host makes."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

callback_map: dict[str, list[Callable[..., Any]]] = {
    "callbacks_ui_settings": [],
    "callbacks_model_loaded": [],
    "callbacks_script_unloaded": [],
    "callbacks_app_started": [],
    "callbacks_cfg_denoiser": [],
    "callbacks_infotext_pasted": [],
    "callbacks_before_ui": [],
}


class CFGDenoiserParams:
    """Mirrors A1111's CFGDenoiserParams (the fields tests use)."""

    def __init__(
        self,
        x: Any,
        sigma: Any,
        text_cond: Any,
        text_uncond: Any,
        sampling_step: int,
        total_sampling_steps: int,
        image_cond: Any = None,
    ) -> None:
        self.x, self.sigma, self.text_cond, self.text_uncond = x, sigma, text_cond, text_uncond
        self.sampling_step, self.total_sampling_steps = sampling_step, total_sampling_steps
        self.image_cond = image_cond


def clear_callbacks() -> None:
    for callbacks in callback_map.values():
        callbacks.clear()


def on_ui_settings(callback: Callable[[], None]) -> None:
    callback_map["callbacks_ui_settings"].append(callback)


def on_model_loaded(callback: Callable[[Any], None]) -> None:
    callback_map["callbacks_model_loaded"].append(callback)


def on_script_unloaded(callback: Callable[[], None]) -> None:
    callback_map["callbacks_script_unloaded"].append(callback)


def on_app_started(callback: Callable[[Any, Any], None]) -> None:
    callback_map["callbacks_app_started"].append(callback)


def on_cfg_denoiser(callback: Callable[[CFGDenoiserParams], None]) -> None:
    callback_map["callbacks_cfg_denoiser"].append(callback)


def on_infotext_pasted(callback: Callable[[str, dict[str, Any]], None]) -> None:
    callback_map["callbacks_infotext_pasted"].append(callback)


def on_before_ui(callback: Callable[[], None]) -> None:
    callback_map["callbacks_before_ui"].append(callback)


def before_ui_callback() -> None:
    for c in callback_map["callbacks_before_ui"]:
        c()


def ui_settings_callback() -> None:
    for c in callback_map["callbacks_ui_settings"]:
        c()


def model_loaded_callback(sd_model: Any) -> None:
    for c in callback_map["callbacks_model_loaded"]:
        c(sd_model)


def script_unloaded_callback() -> None:
    for c in callback_map["callbacks_script_unloaded"]:
        c()


def infotext_pasted_callback(infotext: str, params: dict[str, Any]) -> None:
    """As A1111: each callback may change ``params``; an exception is reported and the paste goes on."""
    for c in callback_map["callbacks_infotext_pasted"]:
        try:
            c(infotext, params)
        except Exception:
            traceback.print_exc()


def cfg_denoiser_callback(params: CFGDenoiserParams) -> None:
    for c in callback_map["callbacks_cfg_denoiser"]:
        c(params)
