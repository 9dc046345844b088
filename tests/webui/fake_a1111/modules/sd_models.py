"""Fake ``modules.sd_models``: CheckpointInfo and loading a (tiny) checkpoint into ``shared.sd_model``."""

from __future__ import annotations

from typing import Any

from modules import script_callbacks, shared


class CheckpointInfo:
    """Mirrors the fields extensions read from ``sd_checkpoint_info``."""

    def __init__(self, filename: str, sha256: str) -> None:
        self.filename = filename
        self.name = filename.rsplit("/", 1)[-1]
        self.name_for_extra = self.name.rsplit(".", 1)[0]
        self.model_name = self.name_for_extra
        self.sha256 = sha256
        self.shorthash = sha256[:10]
        self.title = f"{self.name} [{self.shorthash}]"


def load_model(model: Any, checkpoint_info: CheckpointInfo) -> Any:
    """Make ``model`` the loaded model, as A1111 does after reading a checkpoint."""
    model.sd_checkpoint_info = checkpoint_info
    model.sd_model_hash = checkpoint_info.shorthash
    shared.sd_model = model
    shared.opts.data["sd_model_checkpoint"] = checkpoint_info.title
    script_callbacks.model_loaded_callback(model)
    return model
