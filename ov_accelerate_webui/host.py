"""The one door to the host application: every import of A1111's ``modules.*`` and of gradio.

Imports are made when a function is called, never when this module is imported, so the rest of
the package (and its tests) can be imported without a WebUI. Nothing here keeps state.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)


def _module(name: str) -> ModuleType:
    return importlib.import_module(name)


def gradio() -> ModuleType:
    """The ``gradio`` package the WebUI runs (3.41.2 on A1111 v1.10.1)."""
    return _module("gradio")


def scripts() -> ModuleType:
    """``modules.scripts`` (Script base class, AlwaysVisible)."""
    return _module("modules.scripts")


def processing() -> ModuleType:
    """``modules.processing`` (process_images, Processed, the processing classes)."""
    return _module("modules.processing")


def shared() -> ModuleType:
    """``modules.shared`` (opts, state, sd_model, OptionInfo)."""
    return _module("modules.shared")


def script_callbacks() -> ModuleType:
    """``modules.script_callbacks``."""
    return _module("modules.script_callbacks")


def process_images(p: Any) -> Any:
    """Run A1111's native pipeline on ``p``."""
    return processing().process_images(p)


def state() -> Any:
    """``shared.state``: progress, interrupt flags, textinfo."""
    return shared().state


def opts() -> Any:
    """``shared.opts``."""
    return shared().opts


def option(key: str, default: Any) -> Any:
    """A WebUI option, or ``default`` when it is not registered (yet)."""
    return getattr(opts(), key, default)


def add_option(key: str, default: Any, label: str, section: tuple[str, str], **kwargs: Any) -> None:
    """Register one option in the Settings tab (call from an ``on_ui_settings`` callback)."""
    sh = shared()
    sh.opts.add_option(key, sh.OptionInfo(default, label, section=section, **kwargs))


def loaded_model() -> Any:
    """``shared.sd_model`` (may be None before the first model load)."""
    return getattr(shared(), "sd_model", None)


def models_path() -> str:
    """The WebUI's models folder (``modules.paths.models_path``)."""
    return str(_module("modules.paths").models_path)


def default_cache_dir() -> str:
    """Default folder of the compiled-model cache: ``<models>/openvino_cache``."""
    return os.path.join(models_path(), "openvino_cache")


def queue_lock() -> Any:
    """The lock A1111 holds while a generation runs (``modules.call_queue.queue_lock``)."""
    return _module("modules.call_queue").queue_lock


def lora_networks() -> ModuleType | None:
    """The built-in Lora extension's ``networks`` module (``extensions-builtin/Lora``), or None when that
    extension is not loaded (disabled, or another host such as Forge whose Lora works differently).

    It is looked up in ``sys.modules``, never imported: importing it would load the extension.
    """
    module = sys.modules.get("networks")
    if module is None or not all(hasattr(module, n) for n in ("network_apply_weights", "loaded_networks", "originals")):
        return None
    return module


def txt2img_processing(**kwargs: Any) -> Any:
    """A ``StableDiffusionProcessingTxt2Img`` for the loaded model (used by pre-compile)."""
    return processing().StableDiffusionProcessingTxt2Img(sd_model=loaded_model(), **kwargs)


def imported_class(module_name: str, name: str) -> type | None:
    """Class ``name`` of module ``module_name`` if that module is imported already (never imports it)."""
    module = sys.modules.get(module_name)
    cls = getattr(module, name, None) if module is not None else None
    return cls if isinstance(cls, type) else None


def attention_optimizers() -> tuple[list[Any], Any]:
    """(A1111's available cross-attention optimizations, the one applied now), from ``modules.sd_hijack``;
    ([], None) in a host without them."""
    module = sys.modules.get("modules.sd_hijack")
    if module is None:
        return [], None
    return list(getattr(module, "optimizers", []) or []), getattr(module, "current_optimizer", None)


def sd_models() -> ModuleType | None:
    """``modules.sd_models`` if it is imported already (never imports it), else None."""
    return sys.modules.get("modules.sd_models")


def no_half() -> bool:
    """Whether the WebUI was started with ``--no-half`` (its models at f32, not float16)."""
    return bool(getattr(getattr(shared(), "cmd_opts", None), "no_half", False))


def load_precision_change() -> str | None:
    """What A1111's checkpoint load will do to the weights' precision after reading them, when it is more than
    ``model.float()`` (``--no-half``): the reason a load cannot write them at f32 as they are read; None with
    ``--no-half`` and neither fp8 nor channels-last."""
    cmd_opts = getattr(shared(), "cmd_opts", None)
    if not no_half():
        return "without --no-half A1111 converts the weights to float16 after reading them"
    if getattr(cmd_opts, "opt_channelslast", False):
        return "--opt-channelslast copies the weights after they load"
    devices = sys.modules.get("modules.devices")
    if getattr(devices, "fp8", False):
        return "FP8 weight storage converts the weights after they load"
    return None


def is_forge() -> bool:
    """Whether the WebUI is Forge (or Forge Neo): it imports its ``modules_forge`` package as it starts."""
    return "modules_forge" in sys.modules


def imported_module(name: str) -> ModuleType | None:
    """Module ``name`` if the WebUI imported it already (never imports it), e.g. Forge's ``backend.nn.unet``."""
    return sys.modules.get(name)
