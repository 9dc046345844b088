"""Forge's LoRA merge into the weight file (``ov_accelerate_webui/forge_lora.py``), on a stand-in of Forge main's
``backend/patcher/lora.py``: ``LoraLoader.refresh`` (under ``torch.inference_mode``) backs each changed weight up
and sets the parameter ``merge_lora_to_weight`` makes, looked up as a module global at each call."""

from __future__ import annotations

import dataclasses
import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import make_p
from torch import nn


def _forge_lora_module() -> types.ModuleType:
    module = types.ModuleType("backend.patcher.lora")

    def merge_lora_to_weight(patches: Any, weight: torch.Tensor, key: str = "online_lora",
                             computation_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (weight.to(computation_dtype) + sum(patches)).to(weight.dtype)

    class LoraLoader:
        def __init__(self, model: nn.Module) -> None:
            self.model = model
            self.backup: dict[str, torch.Tensor] = {}

        @torch.inference_mode()
        def refresh(self, lora_patches: dict[str, list[torch.Tensor]], offload_device: Any = "cpu",
                    force_refresh: bool = False) -> None:
            for key, weight in self.backup.items():
                parent, _, name = key.rpartition(".")
                setattr(self.model.get_submodule(parent), name, weight)
            self.backup = {}
            for key, patches in lora_patches.items():
                parent, _, name = key.rpartition(".")
                layer = self.model.get_submodule(parent)
                weight = getattr(layer, name)
                self.backup[key] = weight.to(device=offload_device)
                merged = module.merge_lora_to_weight(patches, weight, key, computation_dtype=torch.float32)
                setattr(layer, name, nn.Parameter(merged, requires_grad=False))

    module.merge_lora_to_weight = merge_lora_to_weight
    module.LoraLoader = LoraLoader
    return module


def test_forges_merged_lora_weights_go_into_the_weight_file_a_chunk_at_a_time(
        fake_host: SimpleNamespace, extension: Any, f32: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from ov_accelerate_webui import forge_lora

    lora = _forge_lora_module()
    monkeypatch.setitem(sys.modules, "backend.patcher.lora", lora)
    own_merge, own_refresh = lora.merge_lora_to_weight, lora.LoraLoader.refresh
    torch.manual_seed(0)
    model = nn.Module()  # Forge's KModel: the UNet is its diffusion_model
    model.diffusion_model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    originals = {k: v.detach().clone() for k, v in model.state_dict().items()}
    patches = {f"diffusion_model.{i}.weight": [torch.full_like(originals[f"diffusion_model.{i}.weight"], 0.5)]
               for i in range(3)}
    loader = lora.LoraLoader(model)
    uninstall = forge_lora.install(extension)
    assert uninstall is not None
    try:
        loader.refresh(patches)  # acceleration not in use yet: Forge's own merge, in memory
        assert all(torch.equal(model.get_parameter(k), originals[k] + 0.5) for k in patches)
        unet_only = dataclasses.replace(f32, vae=False, text_encoder=False)
        extension.run(make_p(fake_host), unet_only)
        weight_file = extension.accelerator().backends.weight_file(unet_only.backend_choice("unused"))
        assert not any(weight_file.holds(model.get_parameter(k)) for k in patches)

        monkeypatch.setattr(forge_lora, "CHUNK_BYTES", 2 * 8 * 8 * 4)  # two weights a chunk: a flush mid-refresh
        flushed: list[int] = []
        place = weight_file.place
        monkeypatch.setattr(weight_file, "place", lambda tensors: (flushed.append(len(tensors)), place(tensors))[1])
        loader.refresh({k: [p[0] * 2] for k, p in patches.items()})
        assert flushed == [2, 1]  # two as the third merges, the last at the refresh's end
        for key in patches:
            param = model.get_parameter(key)
            assert weight_file.holds(param) and not param.requires_grad, key
            assert torch.equal(param, originals[key] + 1.0), key
        assert all(not weight_file.holds(w) or torch.equal(w, originals[k]) for k, w in loader.backup.items())
        notes = extension.accelerator().pop_load_notes()
        assert any(n.startswith("Forge's LoRA: 640 B of merged weights went into the weight file") for n in notes), \
            notes

        loader.refresh({})  # the LoRA off: the backups come back, the merged copies go with their file
        assert all(torch.equal(model.get_parameter(k), originals[k]) for k in patches)

        monkeypatch.setattr(extension.accelerator(), "load_target", lambda *a: None)  # the file off: in memory
        loader.refresh(patches)
        assert not any(weight_file.holds(model.get_parameter(k)) for k in patches)
    finally:
        uninstall()
    assert lora.merge_lora_to_weight is own_merge and lora.LoraLoader.refresh is own_refresh
