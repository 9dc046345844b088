"""Forge's checkpoint load into the weight file: the routed parts' weights go from the checkpoint file straight into
the weight file as Forge loads them, as :mod:`.weights_at_load` does in A1111.

Forge (``backend/loader.py``) builds each part of a checkpoint (the UNet, the VAE, each text encoder) at its storage
precision with its memory untouched (Forge's layers skip their initialisation), then copies the part's state dict into
it with ``backend.state_dict.load_state_dict``, which the loader calls by the name it imported. Wrapped here: before
Forge's copy, the parameters of the part's routed modules are written one at a time from the state dict (safetensors
maps the checkpoint file: its pages are the file's) into the weight file at the parameter's own precision, and become
the part's parameters; their keys leave the state dict, so Forge copies the rest and does not list them as missing.
Forge's ``Linear`` makes its weight only as it loads (:func:`lazy_layers`): it is given one first, to be written.
Forge's copy of them (a full-size SDXL UNet at f32: 10.3 GB) is never in memory.

When: acceleration is in use (:func:`.weights_at_load.in_use`: the last generation was accelerated, or *Enable for
every generation* is on) and *Keep PyTorch's copy ... in a file* is on. Forge loads the request's checkpoint inside
``process_images``, after the generation was prepared, so the first accelerated generation after Forge starts loads
into the file too. A load never fails because of this: what cannot go to the file loads as Forge loads it, with the
reason in the log, and moves at its first compile as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import host
from .backend_bridge import BackendUnavailable
from .model_parts import UnsupportedModel, lookup
from .weights_at_load import fill_modules, in_use, wrap_loader

logger = logging.getLogger(__name__)

#: (Forge's class of a part, the part, the routed modules' paths in it), sorted: what :mod:`.forge`'s targets route
#: of each part as Forge's loader builds it (``backend/nn/vae.py``, ``clip.py``, ``unet.py``).
COMPONENTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("IntegratedAutoencoderKL", "vae", ("decoder", "encoder")),
    ("IntegratedCLIP", "text_encoder", ("transformer.text_model.encoder",)),
    ("IntegratedUNet2DConditionModel", "unet", ("",)),
)


def fill_component(extension: Any, component: Any, state_dict: dict[str, Any]) -> list[str]:
    """Before Forge copies ``state_dict`` into ``component`` (a part its loader built): the routed modules' weights
    into the weight file, when acceleration is in use. Returns the keys written (taken out of ``state_dict``)."""
    row = next((r for r in COMPONENTS if r[0] == type(component).__name__), None)
    if row is None or not isinstance(state_dict, dict):
        return []
    _name, part, paths = row
    try:
        found = in_use(extension.made_accelerator(), extension.accelerator)
        if found is None:
            return []
        accelerator, settings = found
        target = accelerator.load_target(settings, host.default_cache_dir())
        if target is None or part not in target[0].parts:
            return []
        settings, weight_file = target
        modules = [(path, lookup(component, path) if path else component) for path in paths]
        missing = [path for path, module in modules if module is None]
        if missing:
            raise UnsupportedModel(f"{type(component).__name__} has no {', '.join(missing)}")
        lazy = [item for path, module in modules for item in lazy_layers(module, path, state_dict)]
        try:
            _result, keys = fill_modules(accelerator, weight_file, settings, loading_checkpoint(), modules,
                                         state_dict, None, lambda _param: True, host.default_cache_dir(),
                                         requires_grad=False)
        finally:
            for layer, dummy in lazy:
                if any(p.is_meta for p in layer.parameters(recurse=False)):  # not written: Forge's own load
                    layer.weight = layer.bias = None
                    layer.dummy = dummy
        return keys
    except (BackendUnavailable, UnsupportedModel, ValueError, OSError) as exc:
        logger.warning("Accelerate with OpenVINO: Forge's %s loads into memory as before: %s", part, exc)
        return []


def lazy_layers(module: nn.Module, prefix: str, state_dict: dict[str, Any]) -> list[tuple[nn.Module, Any]]:
    """Forge's ``Linear`` has no weight until its load: it holds a one-element ``dummy`` parameter (its precision)
    and makes ``weight`` and ``bias`` from the state dict in ``_load_from_state_dict``. Each such layer under
    ``module`` (keys under ``prefix``) gets them now, on the meta device at the dummy's precision, so that they are
    written into the weight file as the other parameters are; its dummy goes, as Forge's load removes it. Returns
    (layer, its dummy) of each, for the caller to put back where nothing was written."""
    changed = []
    for name, layer in module.named_modules():
        dummy = layer._parameters.get("dummy")
        if dummy is None or getattr(layer, "weight", None) is not None:
            continue
        key = ".".join(part for part in (prefix, name) if part)
        shapes = {attr: state_dict[f"{key}.{attr}"].shape for attr in ("weight", "bias")
                  if isinstance(state_dict.get(f"{key}.{attr}"), torch.Tensor)}
        if "weight" not in shapes:
            continue
        for attr, shape in shapes.items():
            empty = torch.empty(shape, dtype=dummy.dtype, device="meta")
            setattr(layer, attr, nn.Parameter(empty, requires_grad=False))
        del layer.dummy
        changed.append((layer, dummy))
    return changed


def loading_checkpoint() -> str:
    """The checkpoint Forge is loading, as its dropdown names it (``sd_models.model_data.forge_loading_parameters``)."""
    data = getattr(host.sd_models(), "model_data", None)
    parameters = getattr(data, "forge_loading_parameters", None)
    info = parameters.get("checkpoint_info") if isinstance(parameters, dict) else None
    return str(getattr(info, "title", None) or "the checkpoint Forge is loading")


def install(extension: Any) -> Callable[[], None] | None:
    """Wrap the ``load_state_dict`` Forge's loader calls (:func:`fill_component` first). Returns the function that
    takes the wrapper out again (on script unload); None where Forge's loader is not imported."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def load_state_dict(model: Any, sd: Any, *args: Any, **kwargs: Any) -> Any:
            filled = fill_component(extension, model, sd)
            if filled:
                ignored = list(args[0] if args else kwargs.get("ignore_errors") or [])
                args, kwargs = args[1:], dict(kwargs, ignore_errors=[*ignored, *filled])
            return original(model, sd, *args, **kwargs)

        return load_state_dict

    return wrap_loader(host.imported_module("backend.loader"), "load_state_dict", make)
