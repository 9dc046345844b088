"""Settings -> OpenVINO -> "Keep PyTorch's copy of the accelerated weights in a file on disk" (default on): the routed
parts' weights move into the backend's weight file at their first compile, and the status says so; turned
off, they stay in memory and no file is made. Either way the picture is the same."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

from conftest import IMAGE_TOLERANCE, make_p, max_pixel_diff

from ov_accelerate_webui.options import WEIGHTS_IN_FILE_OPTION


def files_of(extension: Any) -> tuple[int, int | None]:
    return extension.accelerator().backends.weights_in_files()


def test_on_by_default_the_weights_move_and_the_status_says_so(fake_host: SimpleNamespace, extension: Any,
                                                                f32: Any) -> None:
    unet = fake_host.shared.sd_model.model.diffusion_model
    params = list(unet.parameters())
    plain = fake_host.processing.process_images(make_p(fake_host))
    processed = extension.run(make_p(fake_host), f32)
    assert max_pixel_diff(plain, processed) <= IMAGE_TOLERANCE
    size, resident = files_of(extension)
    assert size >= sum(p.numel() * p.element_size() for p in params) and resident == 0
    assert all(a is b for a, b in zip(unet.parameters(), params))  # the same tensors, now reading the file
    assert "in a memory-mapped file, 0 B of it in memory after the generation" in extension.last_status
    again = fake_host.processing.process_images(make_p(fake_host))  # stock reads them from the file
    assert max_pixel_diff(plain, again) == 0


def test_turned_off_nothing_moves(fake_host: SimpleNamespace, extension: Any, f32: Any) -> None:
    setattr(fake_host.shared.opts, WEIGHTS_IN_FILE_OPTION, False)
    try:
        plain = fake_host.processing.process_images(make_p(fake_host))
        processed = extension.run(make_p(fake_host), f32)
    finally:
        setattr(fake_host.shared.opts, WEIGHTS_IN_FILE_OPTION, True)
    assert max_pixel_diff(plain, processed) <= IMAGE_TOLERANCE
    assert files_of(extension) == (0, 0)
    assert "memory-mapped file" not in extension.last_status


def test_between_generations_openvino_holds_no_intermediate_memory(fake_host: SimpleNamespace, extension: Any,
                                                                    f32: Any) -> None:
    """At the end of a generation the compiled models give back their inference requests' intermediate tensors
    (a VAE at 1024x1024 f32: 3 GiB); the next generation allocates them again and makes the same picture."""
    from ov_backend import runtime

    first = extension.run(make_p(fake_host), f32)
    runners = list(runtime._RUNNERS)
    assert runners and not any(r._holds_memory for r in runners)
    again = extension.run(make_p(fake_host), f32)
    assert max_pixel_diff(first, again) == 0
    assert not any(r._holds_memory for r in runtime._RUNNERS)


def _load_other(fake_host: SimpleNamespace, seed: int = 7) -> Any:
    """A1111 loads another checkpoint (a new model object; its ``model_loaded`` callbacks run)."""
    info = fake_host.sd_models.CheckpointInfo(str(fake_host.tmp_path / f"other-{seed}.safetensors"), f"{seed}" * 64)
    return fake_host.sd_models.load_model(fake_host.make_model(seed=seed), info)


def _unet_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.model.diffusion_model.parameters())


def test_after_an_accelerated_generation_a_loaded_checkpoint_moves_into_the_file_at_its_load(
        fake_host: SimpleNamespace, extension: Any, f32: Any) -> None:
    """The request after a checkpoint load starts with one copy of each weight (SDXL at f32: without this it
    started with A1111's 12.9 GiB model beside its build): the weights the last generation routed move as the
    checkpoint loads, the generation moves nothing more, says what moved at the load, and makes stock's picture."""
    unet_only = dataclasses.replace(f32, vae=False, text_encoder=False)
    extension.run(make_p(fake_host), unet_only)
    before = files_of(extension)[0]

    other = _load_other(fake_host)

    params = list(other.model.diffusion_model.parameters())
    now = extension.last_run_report()["weights_in_file_now"]
    assert now["bytes"] >= before + _unet_bytes(other) and now["resident_bytes"] == 0, now
    weight_file = extension.accelerator().backends.weight_file(unet_only.backend_choice("unused"))
    assert all(weight_file.holds(p) for p in params)
    assert not any(weight_file.holds(p) for p in other.first_stage_model.parameters())  # not routed: stays
    stock = fake_host.processing.process_images(make_p(fake_host, model=other))  # PyTorch reads the file
    processed = extension.run(make_p(fake_host, model=other), unet_only)
    assert max_pixel_diff(stock, processed) <= IMAGE_TOLERANCE
    assert files_of(extension)[0] == now["bytes"], "the generation moved nothing more"
    assert all(a is b for a, b in zip(other.model.diffusion_model.parameters(), params))
    assert "At the checkpoint load (other-7.safetensors" in extension.last_status, extension.last_status
    assert "moved into the weight file" in extension.last_status
    again = extension.run(make_p(fake_host, model=other), unet_only)
    assert "At the checkpoint load" not in extension.last_status  # said once
    assert max_pixel_diff(again, processed) == 0


def test_nothing_moves_at_a_load_before_acceleration_is_used_or_with_the_file_off(
        fake_host: SimpleNamespace, extension: Any, f32: Any) -> None:
    extension.accelerator()  # (the panel makes it to show the cache's size)
    _load_other(fake_host, seed=3)
    assert files_of(extension) == (0, 0), "a user who has not used acceleration keeps A1111's model as it is"

    unet_only = dataclasses.replace(f32, vae=False, text_encoder=False)
    extension.run(make_p(fake_host), unet_only)
    before = files_of(extension)
    setattr(fake_host.shared.opts, WEIGHTS_IN_FILE_OPTION, False)
    try:
        other = _load_other(fake_host, seed=5)
    finally:
        setattr(fake_host.shared.opts, WEIGHTS_IN_FILE_OPTION, True)
    assert files_of(extension) == before
    weight_file = extension.accelerator().backends.weight_file(unet_only.backend_choice("unused"))
    assert not any(weight_file.holds(p) for p in other.parameters())


def test_enable_for_every_generation_moves_the_panel_parts_at_the_first_load(
        fake_host: SimpleNamespace, extension: Any, tmp_path: Any) -> None:
    """With Settings -> OpenVINO -> "Enable for every generation", the WebUI's first load moves the weights of the
    parts the panel's defaults route, before any generation; the first accelerated picture is still stock's."""
    from ov_accelerate_webui.options import ENABLE_ALWAYS_OPTION, option_key

    setattr(fake_host.shared.opts, ENABLE_ALWAYS_OPTION, True)
    setattr(fake_host.shared.opts, option_key("cache_dir"), str(tmp_path / "cache"))
    try:
        other = _load_other(fake_host, seed=9)
    finally:
        setattr(fake_host.shared.opts, ENABLE_ALWAYS_OPTION, False)
    size, resident = files_of(extension)
    routed = sum(p.numel() * p.element_size() for m in (other.model.diffusion_model, other.first_stage_model)
                 for p in m.parameters())
    assert size >= routed and resident == 0, (size, routed)


def test_a_load_writes_the_routed_weights_from_the_checkpoint_straight_into_the_file(
        fake_host: SimpleNamespace, extension: Any, f32: Any) -> None:
    """What the load hook does inside A1111's ``load_state_dict`` (the real WebUI's tier measures the memory): the
    model's parameters still on the meta device, the routed parts' weights are written from the checkpoint's
    float16 tensors into the weight file at f32, bit for bit what ``.float()`` gives, and taken out of the state
    dict; what is not routed is left for A1111 to load."""
    import torch

    unet_only = dataclasses.replace(f32, vae=False, text_encoder=False)
    extension.run(make_p(fake_host), unet_only)  # acceleration in use
    source = fake_host.make_model(seed=9)
    state_dict = {k: v.half() for k, v in source.state_dict().items()}
    want = {k: v.float() for k, v in state_dict.items()}
    with torch.device("meta"):
        model = fake_host.make_model(seed=9)
    from ov_accelerate_webui.weights_at_load import fill_weights

    result = fill_weights(extension.accelerator(), model, state_dict, torch.float32, None, str(fake_host.tmp_path))
    unet = dict(model.model.diffusion_model.named_parameters())
    assert result is not None and result.moved_bytes == sum(p.numel() * 4 for p in unet.values())
    weight_file = extension.accelerator().backends.weight_file(unet_only.backend_choice("unused"))
    for name, param in unet.items():
        key = f"model.diffusion_model.{name}"
        assert weight_file.holds(param) and param.dtype == torch.float32 and key not in state_dict
        assert torch.equal(param, want[key]), key
    assert all(p.is_meta for p in model.first_stage_model.parameters())  # not routed: A1111 loads it
    assert all(f"first_stage_model.{n}" in state_dict for n, _ in model.first_stage_model.named_parameters())


def test_the_load_hook_wraps_a1111s_load_while_in_use_and_goes_when_the_script_unloads(
        fake_host: SimpleNamespace, extension: Any, f32: Any, monkeypatch: Any) -> None:
    """``weights_at_load.install`` around a ``load_model_weights`` of A1111 v1.10.1's signature and order
    (``model.load_state_dict(state_dict, strict=False)``, then ``model.float()`` with ``--no-half``)."""
    import torch

    from ov_accelerate_webui import weights_at_load

    seen: list[Any] = []

    def a1111_load_model_weights(model: Any, checkpoint_info: Any, state_dict: Any, timer: Any) -> None:
        model.load_state_dict(state_dict, strict=False)
        seen.append(set(state_dict))  # (what was written into the file left the state dict)
        model.float()

    monkeypatch.setattr(fake_host.sd_models, "load_model_weights", a1111_load_model_weights)
    monkeypatch.setattr(fake_host.shared.cmd_opts, "no_half", True, raising=False)
    uninstall = weights_at_load.install(extension)
    assert uninstall is not None
    try:
        def load(seed: int) -> tuple[Any, dict[str, Any]]:
            state_dict = {k: v.half() for k, v in fake_host.make_model(seed=seed).state_dict().items()}
            want = {k: v.float() for k, v in state_dict.items()}
            with torch.device("meta"):
                model = fake_host.make_model(seed=seed)
            fake_host.sd_models.load_model_weights(model, None, state_dict, None)
            return model, want

        model, _ = load(4)  # acceleration not in use yet: A1111's own load, every key left to it
        assert any(k.startswith("model.diffusion_model.") for k in seen[-1])
        assert all(p.is_meta for p in model.model.diffusion_model.parameters())

        unet_only = dataclasses.replace(f32, vae=False, text_encoder=False)
        extension.run(make_p(fake_host), unet_only)
        model, want = load(5)
        assert not any(k.startswith("model.diffusion_model.") for k in seen[-1])  # written into the file instead
        assert "load_state_dict" not in model.__dict__  # the model's own method again
        weight_file = extension.accelerator().backends.weight_file(unet_only.backend_choice("unused"))
        for name, param in model.model.diffusion_model.named_parameters():
            assert weight_file.holds(param) and torch.equal(param, want[f"model.diffusion_model.{name}"]), name

        fake_host.shared.cmd_opts.no_half = False  # A1111 would halve the weights after reading them: its own load
        load(6)
        assert any(k.startswith("model.diffusion_model.") for k in seen[-1])
    finally:
        uninstall()
    assert fake_host.sd_models.load_model_weights is a1111_load_model_weights


def test_a_load_a1111_makes_that_will_not_fit_is_warned_about_before_it_fills_memory(
        fake_host: SimpleNamespace, extension: Any, monkeypatch: Any, caplog: Any) -> None:
    """Acceleration not in use: A1111 loads the model as it does. When its f32 model is larger than the memory
    available (the machine's or its cgroup's), a WARNING says so before the load, with what would load it in less;
    the load itself goes on unchanged."""
    import logging

    import torch

    import ov_backend.memory
    from ov_accelerate_webui import weights_at_load

    loaded: list[Any] = []
    monkeypatch.setattr(fake_host.sd_models, "load_model_weights",
                        lambda model, info, state_dict, timer: loaded.append(model.load_state_dict(state_dict)))
    monkeypatch.setattr(fake_host.shared.cmd_opts, "no_half", True, raising=False)
    state_dict = fake_host.make_model(seed=3).state_dict()
    f32_bytes = sum(t.numel() * 4 for t in state_dict.values() if t.is_floating_point())
    info = SimpleNamespace(title="big.safetensors [0123456789]", filename="/models/big.safetensors")
    uninstall = weights_at_load.install(extension)
    assert uninstall is not None
    try:
        for available, warned in ((f32_bytes * 2, False), (f32_bytes // 2, True)):
            monkeypatch.setattr(ov_backend.memory, "system_memory",
                                lambda available=available: ov_backend.memory.SystemMemory(1 << 34, available))
            caplog.clear()
            model = fake_host.make_model(seed=4)
            with caplog.at_level(logging.WARNING):
                fake_host.sd_models.load_model_weights(model, info, dict(state_dict), None)
            said = [r.getMessage() for r in caplog.records if "needs about" in r.getMessage()]
            assert bool(said) == warned, said
            for key, value in state_dict.items():  # A1111's own load, as before
                assert torch.equal(model.state_dict()[key], value), key
        assert "loading big.safetensors [0123456789] as A1111 does" in said[0]
        assert "Enable for every generation" in said[0] and "8-bit weights" in said[0]
        assert len(loaded) == 2
    finally:
        uninstall()


def test_forges_load_writes_the_routed_parts_into_the_file_and_leaves_the_rest_to_forge(
        fake_host: SimpleNamespace, extension: Any, f32: Any, monkeypatch: Any) -> None:
    """``forge_load.install`` around a ``load_state_dict`` of Forge main's signature (``backend/state_dict.py``: a
    non-strict load that prints the missing keys not in ``ignore_errors``), called by its loader's name for it, on
    parts named as Forge's classes and built at f32 before the load, from a float16 checkpoint."""
    import sys
    import types

    import torch
    from torch import nn

    from ov_accelerate_webui import forge_load

    missing_printed: list[list[str]] = []

    def forge_load_state_dict(model: Any, sd: Any, ignore_errors: Any = (), log_name: Any = None,
                              ignore_start: Any = None) -> None:
        missing, _unexpected = model.load_state_dict(sd, strict=False)
        missing_printed.append([k for k in missing if k not in ignore_errors])

    class LazyLinear(nn.Module):
        """Forge's ``operations.ForgeOperations.Linear``: no weight until its load, a ``dummy`` for its precision."""

        def __init__(self, in_features: int, out_features: int) -> None:
            super().__init__()
            self.shape = (out_features, in_features)
            self.dummy = nn.Parameter(torch.empty(1))
            self.weight = None
            self.bias = None

        def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
            if hasattr(self, "dummy"):
                for name in ("weight", "bias"):
                    if prefix + name in state_dict:
                        setattr(self, name, nn.Parameter(state_dict[prefix + name].to(self.dummy)))
                del self.dummy
            else:
                super()._load_from_state_dict(state_dict, prefix, *args)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(x, self.weight, self.bias)

    loader = types.ModuleType("backend.loader")
    loader.load_state_dict = forge_load_state_dict
    monkeypatch.setitem(sys.modules, "backend.loader", loader)
    unet_class = type("IntegratedUNet2DConditionModel", (nn.Sequential,), {})
    vae_class = type("IntegratedAutoencoderKL", (nn.Module,), {})

    def load(part: str, seed: int) -> tuple[nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        torch.manual_seed(seed)
        if part == "unet":
            model = unet_class(nn.Conv2d(4, 8, 3), nn.GroupNorm(2, 8), LazyLinear(6, 8))
            shapes = {**{k: v.shape for k, v in model.state_dict().items() if "dummy" not in k},
                      "2.weight": (8, 6), "2.bias": (8,)}
        else:
            model = vae_class()
            model.decoder, model.encoder, model.quant_conv = nn.Conv2d(4, 3, 1), nn.Conv2d(3, 8, 1), nn.Conv2d(8, 8, 1)
            shapes = {k: v.shape for k, v in model.state_dict().items()}
        state_dict = {k: torch.randn(shape).half() for k, shape in shapes.items()}
        want = {k: v.float() for k, v in state_dict.items()}
        loader.load_state_dict(model, state_dict, ignore_errors=["logit_scale"])
        return model, state_dict, want

    uninstall = forge_load.install(extension)
    assert uninstall is not None
    try:
        model, state_dict, want = load("unet", 1)  # acceleration not in use yet: Forge's own load
        assert state_dict.keys() == want.keys() and missing_printed[-1] == []
        assert model.state_dict().keys() == want.keys()  # (the lazy layer made its weight and bias)
        assert all(torch.equal(p, want[k]) for k, p in model.state_dict().items())

        unet_only = dataclasses.replace(f32, vae=False, text_encoder=False)
        extension.run(make_p(fake_host), unet_only)
        model, state_dict, want = load("unet", 2)
        weight_file = extension.accelerator().backends.weight_file(unet_only.backend_choice("unused"))
        assert not state_dict and missing_printed[-1] == []  # written into the file; not listed as missing
        assert dict(model.named_parameters()).keys() == want.keys()  # the lazy layer's weight and bias too
        assert torch.equal(model[2](torch.ones(1, 6)), nn.functional.linear(torch.ones(1, 6), want["2.weight"],
                                                                              want["2.bias"]))
        for name, param in model.named_parameters():
            assert weight_file.holds(param) and param.dtype == torch.float32 and not param.requires_grad, name
            assert torch.equal(param, want[name]), name
        assert "straight into the weight file" in extension.accelerator().pop_load_notes()[-1]

        def no_file(items: Any, wrap: Any = None) -> Any:
            from ov_backend import MoveResult

            result = MoveResult()
            result.keep("no room on the disk (a stand-in)", 1)
            return None, result

        monkeypatch.setattr(weight_file, "fill", no_file)
        model, state_dict, want = load("unet", 4)  # the file cannot be made: Forge's own load, the lazy layer too
        assert state_dict.keys() == want.keys() and missing_printed[-1] == []
        assert all(torch.equal(p, want[k]) for k, p in model.state_dict().items()) and not hasattr(model[2], "dummy")
        monkeypatch.delattr(weight_file, "fill")

        vae, state_dict, want = load("vae", 3)  # not routed: Forge loads it
        assert state_dict.keys() == want.keys()
        assert not any(weight_file.holds(p) for p in vae.parameters())
        assert all(torch.equal(p, want[k]) for k, p in vae.state_dict().items())
    finally:
        uninstall()
    assert loader.load_state_dict is forge_load_state_dict
