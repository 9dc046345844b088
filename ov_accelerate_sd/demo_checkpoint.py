"""The demo checkpoint: a small SD-1.5-shaped model with random weights, in the WebUI's layout.

Built once under the per-user cache folder, so the first command on a fresh machine can run
the whole standalone path (load a WebUI checkpoint, route it through OpenVINO, write PNGs)
without downloading anything. Its images are noise: the weights are random. Importing this
module loads nothing heavy (the command line reads its sizes while checking arguments).
"""

from __future__ import annotations

import logging
from pathlib import Path

from .paths import user_cache_dir

logger = logging.getLogger(__name__)

DEMO_FILE = "demo-sd15-tiny-random.safetensors"
DEMO_SIZE = 128
DEMO_STEPS = 8


def demo_checkpoint(folder: str | Path | None = None) -> Path:
    """Path of the demo checkpoint, written first if missing."""
    path = Path(folder) if folder is not None else user_cache_dir() / "demo"
    path = path / DEMO_FILE
    if not path.is_file():
        from .loader import random_components, save_webui_checkpoint, tiny_config

        config = tiny_config("sd1")
        unet, vae, encoders = random_components(config, seed=1234)
        save_webui_checkpoint(path, "sd1", config, unet, vae, encoders)
        logger.info("wrote the demo checkpoint (random weights) to %s", path)
    return path
