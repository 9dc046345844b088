"""Forge's LoRA merge into the weight file: the weights Forge's LoRA loader merges go into the weight file a chunk at a
time as it makes them, as A1111's Lora extension's copies do (:mod:`.lora`).

Forge applies a LoRA in ``backend/patcher/lora.py``: ``LoraLoader.refresh`` keeps each weight it changes as a backup
(on the CPU the weight itself: the weight file's copy when acceleration put it there) and sets a new parameter made by
``merge_lora_to_weight``, at f32, in memory. Every changed weight of the part is made before the part is sampled, so
memory held them all at once (full-size SDXL with a LoRA: the 8 GiB run was killed there). Wrapped here, while
acceleration is in use with *Keep PyTorch's copy ... in a file* on: each ``refresh`` notes the weights it merges, and
once they add up to :data:`CHUNK_BYTES` (and at its end) the new parameters move into the weight file, each keeping its
identity (``WeightFile.place``). A LoRA turned off puts the backups back; the merged copies then die with their file.
What cannot move stays in memory, with the reason in the log; a refresh never fails because of this.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from . import host
from .backend_bridge import BackendUnavailable, ov_backend
from .weights_at_load import in_use, wrap_loader

logger = logging.getLogger(__name__)

#: Merged weights held in memory before they move into the file.
CHUNK_BYTES = 256 << 20

_state = threading.local()


class Merging:
    """One ``LoraLoader.refresh`` under way: the keys of the weights merged and not yet in the file.

    Args:
        model: the model the loader changes (its parameters are found by key).
        weight_file: where they go.
        note: a line for the next generation's status.
    """

    def __init__(self, model: Any, weight_file: Any, note: Callable[[str], None]) -> None:
        self.model = model
        self.weight_file = weight_file
        self._note = note
        self._pending: list[str] = []
        self._pending_bytes = 0
        self.moved_bytes = 0
        self.seconds = 0.0
        self.kept: Counter[str] = Counter()

    def merged(self, key: str, nbytes: int) -> None:
        """``key``'s weight was merged (its new parameter is set once the loader gets it back)."""
        self._pending.append(key)
        self._pending_bytes += nbytes

    def ready(self) -> None:
        """Before the next merge: the pending parameters, all set by now, move when they add up to a chunk."""
        if self._pending_bytes >= CHUNK_BYTES:
            self.flush()

    def flush(self) -> None:
        """Move the pending parameters into the file."""
        params = [p for p in (_parameter(self.model, key) for key in self._pending) if p is not None]
        self._pending, self._pending_bytes = [], 0
        if not params:
            return
        result = self.weight_file.place(params)
        self.moved_bytes += result.moved_bytes
        self.seconds += result.seconds
        self.kept.update(result.kept_bytes)

    def say(self) -> None:
        """What moved and what stayed, in the log and the next generation's status."""
        lines = []
        if self.moved_bytes:
            lines.append(f"Forge's LoRA: {ov_backend.format_bytes(self.moved_bytes)} of merged weights went into the "
                         f"weight file as they were made ({self.seconds:.1f} s)")
        lines += [f"Forge's LoRA: {ov_backend.format_bytes(nbytes)} of merged weights stay in memory: {why}"
                  for why, nbytes in self.kept.items()]
        for line in lines:
            logger.info("Accelerate with OpenVINO: %s", line)
            self._note(line)


def _parameter(model: Any, key: str) -> Any:
    """The parameter at ``key`` (a dotted path) in ``model``, or None."""
    found = model
    for name in key.split("."):
        found = getattr(found, name, None)
        if found is None:
            return None
    return found


def _part(model: Any) -> str:
    """The part a Forge LoRA loader's model is: its UNet's wrapper has the ``diffusion_model``."""
    return "unet" if hasattr(model, "diffusion_model") else "text_encoder"


def weight_file_for(extension: Any, model: Any) -> tuple[Any, Any] | None:
    """The accelerator and the weight file a merge into ``model`` goes into, or None (weights in a file off,
    acceleration not in use, or the part not routed)."""
    try:
        found = in_use(extension.made_accelerator(), extension.accelerator)
        if found is None:
            return None
        accelerator, settings = found
        target = accelerator.load_target(settings, host.default_cache_dir())
    except BackendUnavailable as exc:
        logger.info("Accelerate with OpenVINO: Forge's merged LoRA weights stay in memory: %s", exc)
        return None
    if target is None or _part(model) not in target[0].parts:
        return None
    return accelerator, target[1]


def install(extension: Any) -> Callable[[], None] | None:
    """Wrap Forge's ``LoraLoader.refresh`` and the ``merge_lora_to_weight`` it calls. Returns what takes the wrappers
    out again; None where Forge's LoRA loader is not imported."""
    module = host.imported_module("backend.patcher.lora")
    loader = getattr(module, "LoraLoader", None) if module is not None else None
    if loader is None:
        return None

    def make_refresh(original: Callable[..., Any]) -> Callable[..., Any]:
        def refresh(self: Any, *args: Any, **kwargs: Any) -> Any:
            found = weight_file_for(extension, self.model)
            if found is None:
                return original(self, *args, **kwargs)
            accelerator, weight_file = found
            merging = _state.merging = Merging(self.model, weight_file, accelerator.add_load_note)
            start = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                _state.merging = None
                with torch.inference_mode():  # (Forge merges under it: its new weights are inference tensors)
                    merging.flush()
                merging.say()
                logger.debug("LoRA refresh with the weight file took %.1f s", time.perf_counter() - start)

        return refresh

    def make_merge(original: Callable[..., Any]) -> Callable[..., Any]:
        def merge_lora_to_weight(patches: Any, weight: Any, key: str = "online_lora", *args: Any, **kwargs: Any) -> Any:
            merging = getattr(_state, "merging", None)
            if merging is not None:
                merging.ready()
            merged = original(patches, weight, key, *args, **kwargs)
            if merging is not None:
                merging.merged(key, merged.numel() * merged.element_size())
            return merged

        return merge_lora_to_weight

    undo = [wrap_loader(loader, "refresh", make_refresh), wrap_loader(module, "merge_lora_to_weight", make_merge)]

    def uninstall() -> None:
        for one in undo:
            if one is not None:
                one()

    return uninstall
