"""PyTorch's copy of a checkpoint's weights moves into the weight file as A1111 loads it, when acceleration is in
use: the request after the load then starts with one copy of each weight in memory.

Without this, the weights moved at the request's first build, so the request began with A1111's whole model in
memory (full-size SDXL at f32: 12.9 GiB) and a compile on top of it. "In use" means the last generation since the
script was loaded was accelerated, or Settings -> OpenVINO -> "Enable for every generation" is on (then the
panel's defaults say which parts); with "Keep PyTorch's copy ... in a file" off nothing moves. A load never fails
because of this: what cannot move stays in memory, with the reason in the log, and moves (or not) at its first
build as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import host
from .accelerator import Accelerator
from .backend_bridge import BackendUnavailable, ov_backend
from .model_parts import UnsupportedModel, checkpoint_label
from .options import read_options
from .settings import AccelerateSettings

logger = logging.getLogger(__name__)


def in_use(existing: Accelerator | None, make: Callable[[], Accelerator]) -> tuple[Accelerator, Any] | None:
    """Whether a checkpoint loading now serves acceleration: (the accelerator, the panel's settings when no
    generation since the last reset says which parts), or None (weights in a file off, or acceleration not in
    use). ``existing``: the accelerator if one was made; ``make`` makes it (only with "Enable for every generation"
    on).

    Raises:
        BackendUnavailable: the accelerator could not be made.
    """
    options = read_options()
    if not options.weights_in_file:
        return None
    used = existing.used_settings() if existing is not None else None
    if used is None and not options.enable_always:
        return None
    return (existing if existing is not None else make()), (None if used is not None else options.panel)


def place(model: Any, existing: Accelerator | None, make: Callable[[], Accelerator]) -> Any:
    """After A1111 loaded ``model`` (its ``model_loaded`` callback, outside a generation): move the weights of the
    parts acceleration will route into the weight file (:func:`move_weights`); those the load wrote there
    already (:func:`install`) stay. Returns the ``ov_backend.MoveResult``, or None when nothing was to move."""
    if model is None:
        return None
    try:
        found = in_use(existing, make)
        if found is None:
            return None
        accelerator, settings = found
        return move_weights(accelerator, model, settings, host.default_cache_dir())
    except (BackendUnavailable, UnsupportedModel, ValueError, OSError) as exc:
        logger.warning("Accelerate with OpenVINO: the weights of %s stay in memory until their first compile: %s",
                       checkpoint_label(model), exc)
        return None


def fill_weights(accelerator: Accelerator, model: Any, state_dict: dict[str, Any], dtype: torch.dtype,
                 settings: AccelerateSettings | None, default_cache_dir: str) -> Any:
    """While A1111 loads ``model`` (its parameters still on the meta device, before ``load_state_dict``): write the
    weights of the parts the last generation routed (``settings``' when given) from ``state_dict`` into the weight
    file at ``dtype``, one tensor at a time, and make them the model's parameters. Each key written is taken out of
    ``state_dict``, so A1111's load leaves those parameters as they are (A1111's own copy of them at ``dtype`` never
    exists). Returns the ``ov_backend.MoveResult`` (None: nothing to write; then A1111 loads as before).

    Raises:
        UnsupportedModel: the model cannot be accelerated.
        ValueError: ov_backend refused the settings.
    """
    found = accelerator.load_target(settings, default_cache_dir)
    if found is None:
        return None
    settings, weight_file = found
    names = {id(m): name for name, m in model.named_modules()}
    modules = [(names[id(t.module)], t.module) for t in accelerator.host.find_targets(model, settings.parts)
               if id(t.module) in names]
    return fill_modules(accelerator, weight_file, settings, checkpoint_label(model), modules, state_dict, dtype,
                        lambda param: param.is_meta, default_cache_dir)[0]


def fill_modules(accelerator: Accelerator, weight_file: Any, settings: AccelerateSettings, label: str,
                 modules: Sequence[tuple[str, torch.nn.Module]], state_dict: dict[str, Any], dtype: torch.dtype | None,
                 pending: Callable[[torch.nn.Parameter], bool], default_cache_dir: str,
                 requires_grad: bool | None = None) -> tuple[Any, list[str]]:
    """Write the parameters of ``modules`` ((key prefix in ``state_dict``, module)) that ``pending`` accepts and
    ``state_dict`` holds at their shape into ``weight_file`` at ``dtype`` (None: each parameter's own), one at a time,
    each taken out of ``state_dict``, and make them the modules' parameters (``requires_grad``: None keeps each one's
    flag). Returns (the ``ov_backend.MoveResult``, or None with nothing to write; the keys written). ``label`` names
    the checkpoint in the log and the status; ``default_cache_dir`` is the WebUI's (for the memory check)."""
    slots: list[tuple[torch.nn.Module, str, torch.nn.Parameter, str]] = []
    seen: set[int] = set()
    for prefix, module in modules:
        for sub_name, sub in module.named_modules():
            for name, param in sub._parameters.items():
                if param is None or id(param) in seen or not pending(param):
                    continue
                seen.add(id(param))
                key = ".".join(part for part in (prefix, sub_name, name) if part)
                source = state_dict.get(key)
                if isinstance(source, torch.Tensor) and source.is_floating_point() \
                        and tuple(source.shape) == tuple(param.shape):
                    slots.append((sub, name, param, key))
    if not slots:
        return None, []
    check_room(accelerator, label, settings, [param for _, _, param, _ in slots], default_cache_dir)
    items = [(param.shape, dtype or param.dtype, lambda key=key: state_dict.pop(key)) for _, _, param, key in slots]
    grads = iter([param.requires_grad if requires_grad is None else requires_grad for _, _, param, _ in slots])
    tensors, result = weight_file.fill(items, wrap=lambda t: torch.nn.Parameter(t, requires_grad=next(grads)))
    size = ov_backend.format_bytes
    for why, nbytes in result.kept_bytes.items():
        logger.warning("Accelerate with OpenVINO: %s of weights load into memory as before: %s", size(nbytes), why)
    if tensors is None:
        return result, []
    for (module, name, _, _), tensor in zip(slots, tensors):
        module._parameters[name] = tensor
    kind = "PyTorch's copy" if dtype is None else f"PyTorch's {dtype} copy"
    note = (f"At the checkpoint load ({label}), {size(result.moved_bytes)} of weights went from "
            f"the checkpoint file straight into the weight file ({result.seconds:.1f} s): {kind} of them was never "
            "in memory.")
    logger.info("Accelerate with OpenVINO: %s", note)
    accelerator.add_load_note(note)
    return result, [key for _, _, _, key in slots]


def check_room(accelerator: Accelerator, label: str, settings: AccelerateSettings, weights: Sequence[torch.Tensor],
               default_cache_dir: str) -> None:
    """Before a checkpoint's routed weights load: whether OpenVINO's compiled copy of them at the chosen precision
    will fit in the memory left (``OVBackend.memory_shortage``: the check each build makes, with 8-bit weights named
    when they would fit). Short of it, a WARNING and a note in the next status say so now, before the first
    generation runs them in PyTorch for want of memory."""
    choice = settings.backend_choice(default_cache_dir)
    try:
        why = accelerator.backends.backend(choice.for_part("unet")).memory_shortage(weights)
    except (RuntimeError, ValueError) as exc:  # the device or the settings: the first build will say
        logger.debug("no memory check at the load: %s", exc)
        return
    if why is None:
        return
    note = (f"{label} loaded, but its accelerated parts may not fit in memory at "
            f"{choice.precision}: {why}. Until they do, they run in PyTorch.")
    logger.warning("Accelerate with OpenVINO: %s", note)
    accelerator.add_load_note(note)


def move_weights(accelerator: Accelerator, model: Any, settings: AccelerateSettings | None,
                 default_cache_dir: str) -> Any:
    """After A1111 loaded ``model``: move the weights of the parts the last generation routed (``settings``' when
    given) that are still in memory into the weight file now, not at their first build; the tensors keep their
    identity and values. Returns the ``ov_backend.MoveResult``; None when the weights stay in memory
    (``weights_in_file`` off, or no settings and no generation since the last reset).

    Raises:
        UnsupportedModel: the model cannot be accelerated.
        ValueError: ov_backend refused the settings.
    """
    found = accelerator.load_target(settings, default_cache_dir)
    if found is None:
        return None
    settings, weight_file = found
    tensors: dict[int, torch.Tensor] = {}
    for target in accelerator.host.find_targets(model, settings.parts):
        for t in (*target.module.parameters(), *target.module.buffers()):
            tensors.setdefault(id(t), t)
    result = weight_file.place(list(tensors.values()))
    size = ov_backend.format_bytes
    if result.moved_bytes:
        note = (f"At the checkpoint load ({checkpoint_label(model)}), {size(result.moved_bytes)} of PyTorch's "
                f"weights moved into the weight file ({result.seconds:.1f} s), before this generation.")
        logger.info("Accelerate with OpenVINO: %s", note)
        accelerator.add_load_note(note)
    for why, nbytes in result.kept_bytes.items():
        logger.warning("Accelerate with OpenVINO: %s of PyTorch's weights stay in memory: %s", size(nbytes), why)
    return result


#: Marks our wrappers of the WebUIs' loaders (``modules.sd_models.load_model_weights``, Forge's ``load_state_dict``).
_OURS = "_ov_accelerate_load_hook"


def install(extension: Any) -> Callable[[], None] | None:
    """Wrap A1111's ``sd_models.load_model_weights`` so that, when acceleration is in use (see :func:`place`), the
    weights of the parts it routes go from the checkpoint file straight into the weight file as the model loads
    (:func:`fill_weights`) instead of into A1111's f32 model and then the file. Returns the function
    that takes the wrapper out again (on script unload); None where there is no ``sd_models``. ``extension``: the
    extension (its accelerator, made or not, for :func:`in_use`)."""
    return wrap_loader(host.sd_models(), "load_model_weights",
                       lambda original: _load_model_weights(extension, original))


def wrap_loader(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]],
                ) -> Callable[[], None] | None:
    """Put ``make(original)`` in place of ``owner.name`` (a WebUI's loader function; the original is the WebUI's own,
    not a wrapper a previous load of this script left there). Returns what puts the original back (if the wrapper is
    still there); None where ``owner`` has no ``name``."""
    original = getattr(owner, name, None) if owner is not None else None
    if original is None:
        return None
    while getattr(original, _OURS, None) is not None:  # a previous load of this script left its own (reload)
        original = getattr(original, _OURS)
    wrapper = make(original)
    setattr(wrapper, _OURS, original)
    setattr(owner, name, wrapper)

    def uninstall() -> None:
        if getattr(owner, name, None) is wrapper:
            setattr(owner, name, original)

    return uninstall


def _load_model_weights(extension: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """A1111's ``load_model_weights`` with the routed parts' weights written into the weight file (see
    :func:`install`)."""

    def load_model_weights(model: Any, checkpoint_info: Any, *args: Any, **kwargs: Any) -> Any:
        state_dict = args[0] if args else kwargs.get("state_dict")
        if model is None or not isinstance(state_dict, dict):
            return original(model, checkpoint_info, *args, **kwargs)
        try:
            found = in_use(extension.made_accelerator(), extension.accelerator)
        except BackendUnavailable as exc:
            logger.warning("Accelerate with OpenVINO: the checkpoint loads as A1111 loads it: %s", exc)
            found = None
        why = host.load_precision_change()
        if found is None or why is not None:
            if found is not None:
                logger.info("Accelerate with OpenVINO: the checkpoint loads as A1111 loads it, then its weights move "
                            "into the weight file: %s", why)
            warn_if_short(checkpoint_info, state_dict, why, in_use=found is not None)
            return original(model, checkpoint_info, *args, **kwargs)
        accelerator, settings = found
        model.load_state_dict = _filling_load(model, state_dict, accelerator, settings)
        try:
            return original(model, checkpoint_info, *args, **kwargs)
        finally:
            model.__dict__.pop("load_state_dict", None)

    return load_model_weights


def warn_if_short(checkpoint_info: Any, state_dict: dict[str, Any], precision_change: str | None,
                  in_use: bool) -> str | None:
    """Before A1111's own load of ``state_dict`` (not into the weight file): when the model it makes
    (its floating-point weights at f32 with ``--no-half``, else f16) is larger than the memory available now (the
    machine's, or its memory cgroup's limit less its use), a WARNING says so and what would load it in less, before
    A1111 fills the memory and the kernel kills the WebUI or the machine swaps. Returns the warning (None: it fits,
    or the memory cannot be read)."""
    try:
        memory = ov_backend.system_memory()
    except BackendUnavailable:
        return None
    if memory is None:
        return None
    size = 4 if host.no_half() else 2
    need = sum(t.numel() * size for t in state_dict.values() if isinstance(t, torch.Tensor) and t.is_floating_point())
    if need <= memory.available:
        return None
    gib = 1 << 30
    if in_use:
        fix = f"it cannot load into the weight file ({precision_change})"
    else:
        fix = ("with Settings -> OpenVINO -> \"Enable for every generation\" and \"Keep PyTorch's copy ... in a file\" "
               "on (and the WebUI started with --no-half), the accelerated parts' weights load straight into the "
               "weight file instead, and the precision \"8-bit weights\" keeps OpenVINO's copy of them small")
    name = getattr(checkpoint_info, "title", None) or getattr(checkpoint_info, "filename", None) or "the checkpoint"
    message = (f"loading {name} as A1111 does needs about {need / gib:.1f} GiB of memory, "
               f"{memory.available / gib:.1f} GiB is available: the WebUI may be killed for want of memory, or the "
               f"machine swap. {fix[0].upper()}{fix[1:]}.")
    logger.warning("Accelerate with OpenVINO: %s", message)
    return message


def _filling_load(model: Any, state_dict: dict[str, Any], accelerator: Accelerator,
                  settings: Any) -> Callable[..., Any]:
    """``model.load_state_dict`` for one load: first the routed parts' weights into the weight file (what cannot,
    with the reason in the log, is left to A1111), then A1111's own load of the rest."""
    def load_state_dict(sd: Any, *args: Any, **kwargs: Any) -> Any:
        model.__dict__.pop("load_state_dict", None)
        if sd is state_dict:
            try:
                fill_weights(accelerator, model, state_dict, torch.float32, settings, host.default_cache_dir())
            except (BackendUnavailable, UnsupportedModel, ValueError, OSError) as exc:
                logger.warning("Accelerate with OpenVINO: %s loads into memory as before: %s",
                               checkpoint_label(model), exc)
        return model.load_state_dict(sd, *args, **kwargs)

    return load_state_dict
