"""Fixtures of the SD-layer tests: offline, CPU, tiny checkpoints written in the WebUI's layout."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Offline, and the derived tokenizer files / demo checkpoint go to a throw-away per-user folder, removed when the
# test process ends (the command-line processes the tests start have ended by then).
os.environ["HF_HUB_OFFLINE"] = "1"
if "XDG_CACHE_HOME" not in os.environ:
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="ov_sd_tests_cache_")
    atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, tuple]]:
    """family -> (checkpoint path, (unet, vae, text encoders) it was written from)."""
    from ov_accelerate_sd.loader import random_components, save_webui_checkpoint, tiny_config

    folder = tmp_path_factory.mktemp("checkpoints")
    made = {}
    for family in ("sd1", "sd2", "sdxl"):
        config = tiny_config(family)
        modules = random_components(config, seed=7)
        path = save_webui_checkpoint(folder / f"tiny-{family}.safetensors", family, config, *modules)
        made[family] = (path, modules)
    return made


@pytest.fixture(scope="session")
def sd1_checkpoint(tiny_checkpoints: dict) -> Path:
    return tiny_checkpoints["sd1"][0]
