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
from collections.abc import Callable
from typing import Any

from . import host
from .accelerator import Accelerator
from .backend_bridge import BackendUnavailable
from .model_parts import UnsupportedModel, checkpoint_label
from .options import read_options

logger = logging.getLogger(__name__)


def place(model: Any, existing: Accelerator | None, make: Callable[[], Accelerator]) -> Any:
    """After A1111 loaded ``model`` (its ``model_loaded`` callback, outside a generation): move the weights of the
    parts acceleration will route into the weight file (``Accelerator.place_weights``). ``existing``: the
    accelerator if one was made; ``make`` makes it (only with "Enable for every generation" on). Returns the
    ``ov_backend.MoveResult``, or None when nothing was to move."""
    options = read_options()
    if not options.weights_in_file or model is None:
        return None
    used = existing.used_settings() if existing is not None else None
    if used is None and not options.enable_always:
        return None
    try:
        accelerator = existing if existing is not None else make()
        return accelerator.place_weights(model, None if used is not None else options.panel, host.default_cache_dir())
    except (BackendUnavailable, UnsupportedModel, ValueError, OSError) as exc:
        logger.warning("Accelerate with OpenVINO: the weights of %s stay in memory until their first compile: %s",
                       checkpoint_label(model), exc)
        return None
