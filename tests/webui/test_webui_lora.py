"""A1111's built-in Lora extension with routed parts (``ov_accelerate_webui.lora``), against a stand-in of its
``networks`` module that works as the real one does: ``forward`` of the torch.nn layer classes replaced at
class level, LoRA written into the weights in place when the wanted networks change (restored from a backup
first), or computed in the forward in "functional" mode.

The oracle is A1111's own pipeline with the same stand-in and no routing.
"""

from __future__ import annotations

import sys
import threading
import weakref
import zlib
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import IMAGE_TOLERANCE, make_p, max_pixel_diff
from torch import nn

from ov_accelerate_webui import host
from ov_accelerate_webui.compiled_route import CompiledRoute
from ov_accelerate_webui.lora import FUNCTIONAL_REASON, LORA_CLASSES, LoraHook


def _delta(layer: nn.Linear) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(layer.network_layer_name.encode()))
    return torch.randn(layer.weight.shape, generator=gen) * 3 * float(layer.network_weights_backup.abs().mean())


def loras(*strengths: float) -> list[SimpleNamespace]:
    """``loaded_networks`` as the Lora extension holds it: one network object per ``<lora:...>`` tag."""
    return [SimpleNamespace(name="lora", te_multiplier=s, unet_multiplier=s, dyn_dim=None) for s in strengths]


def fake_networks(opts: Any) -> ModuleType:
    """A stand-in for ``extensions-builtin/Lora/networks.py`` (one LoRA on every named Linear;
    ``loaded_networks`` holds network objects with their strengths)."""
    networks = ModuleType("networks")
    networks.loaded_networks = []
    networks.originals = SimpleNamespace(**{f"{n}_forward": getattr(nn, n).forward for n in LORA_CLASSES})

    def backup(layer: nn.Module) -> None:
        if getattr(layer, "network_weights_backup", None) is None:
            layer.network_weights_backup = layer.weight.detach().clone()

    def network_apply_weights(layer: nn.Module) -> None:
        if getattr(layer, "network_layer_name", None) is None or not isinstance(layer, nn.Linear):
            return
        wanted = tuple((n.name, n.te_multiplier, n.unet_multiplier) for n in networks.loaded_networks)
        if getattr(layer, "network_current_names", ()) == wanted:
            return
        backup(layer)
        with torch.no_grad():
            layer.weight.copy_(layer.network_weights_backup)
            for _name, _te, strength in wanted:
                layer.weight.add_(strength * _delta(layer))
        layer.network_current_names = wanted

    def patched(name: str) -> Any:
        original = getattr(networks.originals, f"{name}_forward")

        def network_forward(self: nn.Module, x: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(opts, "lora_functional", False) and name != "MultiheadAttention":
                if (not networks.loaded_networks or getattr(self, "network_layer_name", None) is None
                    or not isinstance(self, nn.Linear)):
                    return original(self, x, *args, **kwargs)
                backup(self)
                with torch.no_grad():
                    self.weight.copy_(self.network_weights_backup)
                self.network_current_names = ()
                y = original(self, x)
                return y + sum(n.unet_multiplier * nn.functional.linear(x, _delta(self))
                               for n in networks.loaded_networks)
            network_apply_weights(self)
            return original(self, x, *args, **kwargs)

        network_forward.__name__ = f"network_{name}_forward"
        return network_forward

    networks.network_apply_weights = network_apply_weights
    for name in LORA_CLASSES:
        setattr(networks, f"network_{name}_forward", patched(name))
    return networks


@pytest.fixture
def networks(fake_host: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The stand-in loaded as A1111 loads the Lora extension: class forwards patched, layer names assigned."""
    opts = fake_host.shared.opts
    monkeypatch.setitem(opts.data, "lora_functional", False)  # as the Lora extension registers it
    module = fake_networks(opts)
    monkeypatch.setitem(sys.modules, "networks", module)
    for name in LORA_CLASSES:
        monkeypatch.setattr(getattr(nn, name), "forward", getattr(module, f"network_{name}_forward"))
    model = fake_host.shared.sd_model
    for root in (model.model, model.cond_stage_model):
        for name, layer in root.named_modules():
            layer.network_layer_name = name.replace(".", "_")
    yield module


def _patched_now(networks: ModuleType) -> bool:
    return all(getattr(nn, n).__dict__["forward"] is getattr(networks, f"network_{n}_forward") for n in LORA_CLASSES)


def test_lora_and_each_change_of_it_match_stock(fake_host: Any, networks: ModuleType, extension: Any, f32: Any
                                                ) -> None:
    without = fake_host.processing.process_images(make_p(fake_host))
    for strengths in ([1.0], [0.5], [], [1.0]):
        networks.loaded_networks[:] = loras(*strengths)
        stock = fake_host.processing.process_images(make_p(fake_host))
        if strengths:  # the LoRA moves the picture well past the tolerance
            assert max_pixel_diff(stock, without) > 4 * IMAGE_TOLERANCE
        networks.loaded_networks[:] = loras(0.25)  # the weights hold another LoRA when the accelerated run starts
        fake_host.processing.process_images(make_p(fake_host, steps=1))
        networks.loaded_networks[:] = loras(*strengths)
        fast = extension.run(make_p(fake_host), f32)
        assert max_pixel_diff(stock, fast) <= IMAGE_TOLERANCE, strengths
        report = extension.last_run_report()
        assert report["eager_calls"] == 0 and not report["eager"] and report["ov_calls"] > 0, report["status"]
        assert _patched_now(networks)
        # the status says the LoRA changed for the routed parts, and what that cost
        expected = "lora:" + format(strengths[0], "g") if strengths else "none"
        assert report["lora_changes"] and set(report["lora_changes"].values()) == {expected}, report
        assert "LoRA changed:" in report["status"] and "Cost:" in report["status"]
        # how long the Lora extension took to write the new weights is its own figure, not the backend's
        assert report["lora_write_seconds"] > 0, report
        assert "A1111's Lora extension wrote the new weights in" in report["status"], report["status"]
    fast = extension.run(make_p(fake_host, prompt="the same LoRA again"), f32)
    assert not extension.last_run_report()["lora_changes"]  # unchanged: nothing reported
    assert extension.last_run_report()["lora_write_seconds"] == 0


def test_functional_mode_runs_routed_parts_in_pytorch_and_says_why(
    fake_host: Any, networks: ModuleType, extension: Any, f32: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(fake_host.shared.opts.data, "lora_functional", True)
    networks.loaded_networks[:] = loras(1.0)
    stock = fake_host.processing.process_images(make_p(fake_host))
    fast = extension.run(make_p(fake_host), f32)
    assert max_pixel_diff(stock, fast) == 0
    report = extension.last_run_report()
    assert report["eager"] and all(e["why"] == FUNCTIONAL_REASON for e in report["eager"].values()), report
    assert "Not accelerated, ran in plain PyTorch" in report["status"] and "lora_functional" in report["status"]
    networks.loaded_networks[:] = []  # no network loaded: functional mode changes nothing, it is accelerated
    stock = fake_host.processing.process_images(make_p(fake_host))
    fast = extension.run(make_p(fake_host), f32)
    assert max_pixel_diff(stock, fast) <= IMAGE_TOLERANCE
    assert not extension.last_run_report()["eager"]


def _entry(module: nn.Module) -> CompiledRoute:
    return CompiledRoute(part="unet", label="layer", module_ref=weakref.ref(module),
                         compiled=None)  # type: ignore[arg-type]  # (the hook reads the module only)


def test_class_forwards_are_original_during_the_call_and_put_back_after_it_even_on_errors(
    networks: ModuleType,
) -> None:
    layer = nn.Linear(4, 4)
    layer.network_layer_name = "layer"
    hook = LoraHook(threading.RLock())
    seen: list[bool] = []

    def compiled(x: torch.Tensor) -> torch.Tensor:
        seen.append(all(getattr(nn, n).__dict__["forward"] is getattr(networks.originals, f"{n}_forward")
                        for n in LORA_CLASSES))
        if x.sum() < 0:
            raise ValueError("boom")
        return inner(x)

    inner = hook.wrap(lambda x: nn.functional.linear(x, layer.weight, layer.bias), _entry(layer))
    outer = hook.wrap(compiled, _entry(layer))
    networks.loaded_networks[:] = loras(1.0)
    x = torch.ones(1, 4)
    out = outer(x)
    expected = nn.functional.linear(x, layer.network_weights_backup + _delta(layer), layer.bias)
    torch.testing.assert_close(out, expected)  # the LoRA was written in before the call
    assert seen == [True] and _patched_now(networks)  # nested calls: put back once, by the outer one
    with pytest.raises(ValueError, match="boom"):
        outer(-x)
    assert seen == [True, True] and _patched_now(networks)
    with pytest.raises(KeyboardInterrupt):
        hook.wrap(lambda x: (_ for _ in ()).throw(KeyboardInterrupt), _entry(layer))(x)
    assert _patched_now(networks)


def test_another_patch_on_top_of_the_lora_extension_is_left_alone(networks: ModuleType,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    theirs = lambda self, x: networks.network_Linear_forward(self, x)  # noqa: E731
    monkeypatch.setattr(nn.Linear, "forward", theirs)
    layer = nn.Linear(2, 2)
    during = []
    hook = LoraHook(threading.RLock())
    hook.wrap(lambda: during.append((nn.Linear.__dict__["forward"], nn.Conv2d.__dict__["forward"])),
              _entry(layer))()
    assert during == [(theirs, networks.originals.Conv2d_forward)]
    assert nn.Linear.__dict__["forward"] is theirs and nn.Conv2d.__dict__["forward"] is networks.network_Conv2d_forward


def test_no_lora_extension_no_change(fake_host: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "networks", raising=False)
    assert host.lora_networks() is None
    monkeypatch.setitem(sys.modules, "networks", ModuleType("networks"))  # another extension's module
    assert host.lora_networks() is None
    forward = nn.Linear.forward
    layer = nn.Linear(2, 2)
    assert LoraHook(threading.RLock()).wrap(lambda: nn.Linear.forward, _entry(layer))() is forward


def test_the_status_says_how_much_of_the_compile_was_fingerprinting_new_weights() -> None:
    from ov_accelerate_webui.settings import AccelerateSettings
    from ov_accelerate_webui.status import run_status

    routed = {"model.diffusion_model": 4}
    # a LoRA change: the new weights' fingerprint is part of what the backend spent getting ready
    stats = {"compile_seconds": 2.9, "hash_seconds": 0.4, "run_seconds": 24.0}
    text = run_status(AccelerateSettings(), routed, [], stats)
    assert "Compile 2.9 s (0.4 s of it fingerprinting new weights), run 24.0 s;" in text, text
    # nothing hashed (the same weights again): no such note
    text = run_status(AccelerateSettings(), routed, [], {"compile_seconds": 0.0, "run_seconds": 24.0})
    assert "Compile 0.0 s, run 24.0 s;" in text and "fingerprinting" not in text, text


def test_the_lora_extensions_copy_of_the_weights_moves_into_the_weight_file(
        fake_host: Any, networks: ModuleType, extension: Any, f32: Any) -> None:
    """The Lora extension keeps a copy of every layer's weights to restore them from (stock A1111 holds it in
    memory: a whole UNet's worth); with the weight file on, it moves there once written, says so, and a change of
    strength (restored from that copy) and the LoRA's removal still make stock's picture."""
    without = extension.run(make_p(fake_host), f32)
    networks.loaded_networks[:] = loras(1.0)
    extension.run(make_p(fake_host), f32)
    layers = [m for m in fake_host.shared.sd_model.model.modules()
              if isinstance(m, nn.Linear) and getattr(m, "network_weights_backup", None) is not None]
    assert layers
    weight_file = extension.accelerator().backends.weight_file(f32.backend_choice("unused"))
    assert all(weight_file.holds(m.network_weights_backup) for m in layers)
    status = extension.last_status
    assert "Its copy of the original weights (" in status and "moved into the weight file" in status, status
    networks.loaded_networks[:] = loras(0.5)
    stock = fake_host.processing.process_images(make_p(fake_host))
    fast = extension.run(make_p(fake_host), f32)
    assert max_pixel_diff(stock, fast) <= IMAGE_TOLERANCE
    assert "Its copy of the original weights" not in extension.last_status  # moved once
    networks.loaded_networks[:] = []
    assert max_pixel_diff(extension.run(make_p(fake_host), f32), without) <= IMAGE_TOLERANCE


def test_copies_a_stock_generations_lora_left_move_into_the_file_before_the_first_build(
        fake_host: Any, networks: ModuleType, extension: Any, f32: Any) -> None:
    """A stock generation with a LoRA, then an accelerated one without it: the Lora extension's copy of every
    weight (kept after it restored them) moves into the weight file at the UNet's first call, before its build,
    though the LoRA set did not change for the accelerated route; the picture is stock's without the LoRA."""
    networks.loaded_networks[:] = []
    without = fake_host.processing.process_images(make_p(fake_host))
    networks.loaded_networks[:] = loras(1.0)
    fake_host.processing.process_images(make_p(fake_host))  # stock: the copies are made, in memory
    layers = [m for m in fake_host.shared.sd_model.model.modules()
              if isinstance(m, nn.Linear) and getattr(m, "network_weights_backup", None) is not None]
    assert layers
    networks.loaded_networks[:] = []
    fast = extension.run(make_p(fake_host), f32)
    weight_file = extension.accelerator().backends.weight_file(f32.backend_choice("unused"))
    assert all(weight_file.holds(m.network_weights_backup) for m in layers)
    assert max_pixel_diff(fast, without) <= IMAGE_TOLERANCE


def test_the_lora_extensions_copies_move_a_chunk_at_a_time_as_they_are_made(
        fake_host: Any, networks: ModuleType, extension: Any, f32: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Lora extension copies every layer's weights as it first writes them: a whole part's worth, which with
    its own copy and OpenVINO's would not fit where only the accelerated model does. Memory never holds more than
    a chunk of those copies (and one layer's) outside the weight file; at the end all of them are in it, and the
    picture is stock's."""
    from ov_accelerate_webui import lora

    chunk = 16 << 10
    monkeypatch.setattr(lora, "BACKUP_CHUNK_BYTES", chunk)
    weight_file = extension.accelerator().backends.weight_file(f32.backend_choice("unused"))
    model = fake_host.shared.sd_model
    layers = [m for m in model.model.diffusion_model.modules() if isinstance(m, nn.Linear)]
    largest = max(m.weight.numel() * m.weight.element_size() for m in layers)
    assert sum(m.weight.numel() * m.weight.element_size() for m in layers) > 4 * chunk  # several chunks
    outside: list[int] = []
    apply = networks.network_apply_weights

    def apply_and_look(layer: nn.Module) -> None:
        apply(layer)
        outside.append(sum(t.numel() * t.element_size() for t in lora.lora_backups(layers)
                           if not weight_file.holds(t)))

    monkeypatch.setattr(networks, "network_apply_weights", apply_and_look)
    networks.loaded_networks[:] = loras(1.0)
    fast = extension.run(make_p(fake_host), f32)
    assert outside and max(outside) <= chunk + largest, (max(outside), chunk, largest)
    assert all(weight_file.holds(t) for t in lora.lora_backups(layers))
    stock = fake_host.processing.process_images(make_p(fake_host))  # (the weights as the LoRA left them)
    assert max_pixel_diff(stock, fast) <= IMAGE_TOLERANCE
