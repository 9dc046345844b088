"""Fake ``modules.sd_models``: checkpoints, loading a (tiny) checkpoint into ``shared.sd_model``, and
``reload_model_weights`` as A1111 v1.10.1 switches checkpoints (refiner, hires checkpoint, back to the
selected model at the start of each batch):

* the checkpoint already loaded: nothing happens;
* another one already in memory (``opts.sd_checkpoints_limit`` > 1): it becomes ``shared.sd_model``,
  with no ``model_loaded`` callback;
* room for one more model in memory: a new model object is built and loaded;
* otherwise the current model object is reused: with the same config its weights are loaded in place
  (``undo_hijack``, ``load_state_dict``, ``hijack``, then ``model_loaded``); with another config it is
  sent to the trash (to the meta device) and a new model object is built.

A checkpoint "file" is a :class:`CheckpointInfo` with a ``factory`` that builds the model it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from modules import script_callbacks, sd_hijack, shared


class CheckpointInfo:
    """Mirrors the fields extensions read from ``sd_checkpoint_info``; ``config`` is the model config
    (A1111 compares it with ``sd_model.used_config``), ``factory`` builds the model from the "file"."""

    def __init__(
        self, filename: str, sha256: str, config: str | None = None, factory: Callable[[], Any] | None = None
    ) -> None:
        self.filename = filename
        self.name = filename.rsplit("/", 1)[-1]
        self.name_for_extra = self.name.rsplit(".", 1)[0]
        self.model_name = self.name_for_extra
        self.sha256 = sha256
        self.shorthash = sha256[:10]
        self.title = f"{self.name} [{self.shorthash}]"
        self.short_title = f"{self.name_for_extra} [{self.shorthash}]"
        self.config = config
        self.factory = factory

    def register(self) -> CheckpointInfo:
        checkpoints_list[self.title] = self
        for alias in (self.title, self.name, self.name_for_extra, self.short_title, self.sha256, self.shorthash):
            checkpoint_aliases[alias] = self
        return self


checkpoints_list: dict[str, CheckpointInfo] = {}
checkpoint_aliases: dict[str, CheckpointInfo] = {}


class SdModelData:
    """``sd_models.model_data``: the active model and the models kept in memory (most recent first)."""

    def __init__(self) -> None:
        self.sd_model: Any = None
        self.loaded_sd_models: list[Any] = []

    def set_sd_model(self, v: Any, already_loaded: bool = False) -> None:
        self.sd_model = v
        shared.sd_model = v
        if v in self.loaded_sd_models:
            self.loaded_sd_models.remove(v)
        if v is not None:
            self.loaded_sd_models.insert(0, v)


model_data = SdModelData()


class SkipWritingToConfig:
    """Context manager: a checkpoint loaded inside does not become ``opts.sd_model_checkpoint``."""

    skip = False
    previous = None

    def __enter__(self) -> SkipWritingToConfig:
        self.previous = SkipWritingToConfig.skip
        SkipWritingToConfig.skip = True
        return self

    def __exit__(self, *args: Any) -> None:
        SkipWritingToConfig.skip = self.previous


def get_closet_checkpoint_match(search_string: str) -> CheckpointInfo | None:
    if not search_string:
        return None
    found = checkpoint_aliases.get(search_string)
    if found is not None:
        return found
    matches = sorted((info for info in checkpoints_list.values() if search_string in info.title), key=lambda x: x.title)
    return matches[0] if matches else None


def select_checkpoint() -> CheckpointInfo:
    return checkpoint_aliases[shared.opts.sd_model_checkpoint]


def send_model_to_trash(m: Any) -> None:
    m.to(device="meta")


def load_model(model: Any, checkpoint_info: CheckpointInfo) -> Any:
    """Make ``model`` (built from ``checkpoint_info``) the loaded model, as A1111's ``load_model`` does
    after building it: hijack, ``set_sd_model``, the selected checkpoint, the ``model_loaded`` callbacks."""
    if checkpoint_info.factory is None:
        seed, cls = model.seed, type(model)
        checkpoint_info.factory = lambda: cls(seed=seed)
    checkpoint_info.config = checkpoint_info.config or type(model).__name__
    checkpoint_info.register()
    _set_checkpoint(model, checkpoint_info)
    model.used_config = checkpoint_info.config
    sd_hijack.model_hijack.hijack(model)
    model.eval()
    model_data.set_sd_model(model)
    if not SkipWritingToConfig.skip:
        shared.opts.data["sd_model_checkpoint"] = checkpoint_info.title
    script_callbacks.model_loaded_callback(model)
    return model


def _set_checkpoint(model: Any, checkpoint_info: CheckpointInfo) -> None:
    model.sd_checkpoint_info = checkpoint_info
    model.sd_model_hash = checkpoint_info.shorthash
    model.sd_model_checkpoint = checkpoint_info.filename


def load_model_weights(model: Any, checkpoint_info: CheckpointInfo) -> None:
    """Read the checkpoint's weights into ``model`` in place (``load_state_dict``), as A1111 does."""
    model.load_state_dict(checkpoint_info.factory().state_dict())
    _set_checkpoint(model, checkpoint_info)


def reuse_model_from_already_loaded(sd_model: Any, checkpoint_info: CheckpointInfo) -> Any:
    if sd_model is not None and sd_model.sd_checkpoint_info.filename == checkpoint_info.filename:
        return sd_model
    already_loaded = None
    for loaded in list(reversed(model_data.loaded_sd_models)):
        if loaded.sd_checkpoint_info.filename == checkpoint_info.filename:
            already_loaded = loaded
            continue
        if len(model_data.loaded_sd_models) > shared.opts.sd_checkpoints_limit > 0:
            model_data.loaded_sd_models.remove(loaded)
            send_model_to_trash(loaded)
    if already_loaded is not None:
        model_data.set_sd_model(already_loaded, already_loaded=True)
        if not SkipWritingToConfig.skip:
            shared.opts.data["sd_model_checkpoint"] = already_loaded.sd_checkpoint_info.title
        return model_data.sd_model
    if shared.opts.sd_checkpoints_limit > 1 and len(model_data.loaded_sd_models) < shared.opts.sd_checkpoints_limit:
        model_data.sd_model = None
        load_model(checkpoint_info.factory(), checkpoint_info)
        return model_data.sd_model
    if model_data.loaded_sd_models:
        sd_model = model_data.loaded_sd_models.pop()
        model_data.sd_model = sd_model
        return sd_model
    return None


def reload_model_weights(sd_model: Any = None, info: CheckpointInfo | None = None, forced_reload: bool = False) -> Any:
    """Make ``info`` (default: the selected checkpoint) the loaded model, as A1111 v1.10.1 does."""
    checkpoint_info = info or select_checkpoint()
    sd_model = sd_model or model_data.sd_model
    if sd_model is not None and sd_model.sd_model_checkpoint == checkpoint_info.filename and not forced_reload:
        return sd_model
    sd_model = reuse_model_from_already_loaded(sd_model, checkpoint_info)
    if not forced_reload and sd_model is not None and sd_model.sd_checkpoint_info.filename == checkpoint_info.filename:
        return sd_model
    if sd_model is not None:
        sd_hijack.model_hijack.undo_hijack(sd_model)
    if sd_model is None or checkpoint_info.config != sd_model.used_config:
        if sd_model is not None:
            send_model_to_trash(sd_model)
        model_data.sd_model = None
        return load_model(checkpoint_info.factory(), checkpoint_info)
    load_model_weights(sd_model, checkpoint_info)
    sd_hijack.model_hijack.hijack(sd_model)
    script_callbacks.model_loaded_callback(sd_model)
    model_data.set_sd_model(sd_model)
    if not SkipWritingToConfig.skip:
        shared.opts.data["sd_model_checkpoint"] = checkpoint_info.title
    return sd_model
