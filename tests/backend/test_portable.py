"""A capture saved by one process runs in the next without dynamo tracing again, and is refused when
what it traced changed (the source, or a function it called)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ov_backend import OVBackend, portable

NET = textwrap.dedent('''
    import torch

    SCALE = 0.5


    def act(x):
        return torch.nn.functional.silu(x)


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x):
            h = act(self.conv(x)).permute(0, 2, 3, 1)
            return self.lin(h).permute(0, 3, 1, 2) * SCALE
''')

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    sys.path.insert(0, sys.argv[1])
    import tinynet
    from ov_backend import OVBackend, portable

    mode, path, cache, change = sys.argv[2:6]
    exec(change)
    net = tinynet.Net().eval()
    backend = OVBackend({"model_caching": True, "cache_dir": cache, "precision": "f32"})
    with torch.no_grad():
        if mode == "save":
            cap = portable.capture(net.forward, (torch.randn(2, 4, 16, 16),), {}, backend, {4: (0, 2, 3)})
            cap.save(path)
        else:
            try:
                cap = portable.load_capture(path, backend.load_graph)
            except portable.NotPortableError as err:
                print(json.dumps({"refused": str(err)}))
                sys.exit(0)
        matches = {}
        for h, w in ((16, 16), (8, 24)):
            x = torch.randn(2, 4, h, w)
            matches[f"{h}x{w}"] = cap.matches(net, x)
            if matches[f"{h}x{w}"]:
                torch.testing.assert_close(cap(net, x), net(x), atol=1e-4, rtol=1e-4)
    print(json.dumps({"matches": matches, "stats": backend.stats()}))
''')


def run(tmp_path: Path, mode: str, change: str = "") -> dict:
    (tmp_path / "tinynet.py").write_text(NET) if not (tmp_path / "tinynet.py").exists() else None
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), mode, str(tmp_path / "net.capture"),
                           str(tmp_path / "cache"), change], capture_output=True, text=True, cwd=repo,
                          timeout=600, env={**__import__("os").environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("portable")
    return folder, run(folder, "save")


def test_a_saved_capture_runs_in_a_new_process_from_the_disk_cache(saved: tuple[Path, dict]) -> None:
    folder, first = saved
    assert first["matches"] == {"16x16": True, "8x24": True}  # one capture, symbolic sizes
    assert first["stats"]["convert_seconds"] > 0
    again = run(folder, "load")
    assert again["matches"] == {"16x16": True, "8x24": True}  # (outputs compared with PyTorch's inside)
    assert again["stats"]["ov_calls"] == 2 and again["stats"]["eager_calls"] == 0
    assert again["stats"]["cache_hits"] >= 1 and again["stats"]["convert_seconds"] == 0  # nothing converted


def test_a_capture_is_refused_when_the_source_it_traced_changed(saved: tuple[Path, dict]) -> None:
    folder, _ = saved
    original = (folder / "tinynet.py").read_text()
    try:
        (folder / "tinynet.py").write_text(original.replace("* SCALE", "* SCALE * 2"))
        result = run(folder, "load")
    finally:
        (folder / "tinynet.py").write_text(original)
    assert "tinynet" in result["refused"] and "changed" in result["refused"]


def test_a_capture_does_not_match_when_a_function_it_called_was_replaced(saved: tuple[Path, dict]) -> None:
    folder, _ = saved
    result = run(folder, "load", "tinynet.act = lambda x: torch.relu(x)")
    assert result["matches"] == {"16x16": False, "8x24": False}


def test_a_graph_backend_cannot_save_is_not_captured(tmp_path: Path) -> None:
    net = torch.nn.Linear(4, 4)
    with pytest.raises(Exception, match="SerializableCallable"):
        portable.capture(net.forward, (torch.randn(2, 4),), {}, lambda gm, example: gm.forward)
    backend = OVBackend({"model_caching": True, "cache_dir": str(tmp_path), "precision": "f32"})
    (tmp_path / "bad.capture").write_bytes(b"not a capture")
    with pytest.raises(Exception):  # noqa: B017  (whatever unpickling raises: the caller captures again)
        portable.load_capture(tmp_path / "bad.capture", backend.load_graph)


def test_a_global_the_capture_read_is_checked_live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch checks guards on globals against a copy made at capture or load; a module-level name rebound
    afterwards must stop the capture from matching."""
    (tmp_path / "tinynet.py").write_text(NET)
    monkeypatch.syspath_prepend(str(tmp_path))
    import tinynet

    net = tinynet.Net().eval()
    backend = OVBackend({"precision": "f32"})
    x = torch.randn(2, 4, 16, 16)
    with torch.no_grad():
        cap = portable.capture(net.forward, (x,), {}, backend, {4: (0, 2, 3)})
        assert cap.matches(net, x)
        monkeypatch.setattr(tinynet, "SCALE", 0.25)
        assert not cap.matches(net, x)
        monkeypatch.setattr(tinynet, "SCALE", 0.5)
        assert cap.matches(net, x)
        torch.testing.assert_close(cap(net, x), net(x), atol=1e-4, rtol=1e-4)


def test_a_captured_graph_knows_its_weights_and_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph captured ahead of time carries no graph-argument sources: its weights are still told apart
    (built into each model, fingerprinted) and its symbolic sizes derived from the input, so a second size
    is a reshape of the one converted model, not a conversion."""
    (tmp_path / "tinynet.py").write_text(NET)
    monkeypatch.syspath_prepend(str(tmp_path))
    import tinynet

    net = tinynet.Net().eval()
    backend = OVBackend({"precision": "f32"})
    with torch.no_grad():
        cap = portable.capture(net.forward, (torch.randn(2, 4, 16, 16),), {}, backend, {4: (0, 2, 3)})
        kinds = [k.kind for k in cap.function._artifacts.compiled_fn.facts.kinds]
        assert kinds.count("weight") == 4 and kinds.count("derived") == 3 and kinds.count("user") == 1, kinds
        for h, w in ((16, 16), (8, 24)):
            x = torch.randn(2, 4, h, w)
            torch.testing.assert_close(cap(net, x), net(x), atol=1e-4, rtol=1e-4)
    first, second = backend.reports
    assert first.route == "dynamic" and "conversion reused" in second.summary(), second.summary()


def test_each_variant_of_a_call_keeps_its_capture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A global the code reads takes two values in turn (as A1111's CLIP skip does): each value is captured
    once, and going back and forth captures nothing more."""
    from ov_backend.saved_captures import SavedCaptures

    (tmp_path / "tinynet.py").write_text(NET)
    monkeypatch.syspath_prepend(str(tmp_path))
    import tinynet

    net = tinynet.Net().eval()
    backend = OVBackend({"precision": "f32", "model_caching": True, "cache_dir": str(tmp_path / "cache")})
    captures = SavedCaptures.of(net.forward, "forward", backend, backend, {4: (0, 2, 3)})
    x = torch.randn(2, 4, 16, 16)
    with torch.no_grad():
        for scale in (0.5, 0.25, 0.5, 0.25):
            monkeypatch.setattr(tinynet, "SCALE", scale)
            got = captures.call((x,), {}, lambda *a: pytest.fail("ran through torch.compile"))
            torch.testing.assert_close(got, net(x), atol=1e-4, rtol=1e-4)
    assert backend.stats()["captures_made"] == 2 and backend.stats()["captures_saved"] == 2

    torch._dynamo.reset()  # the next process: both variants are loaded, one after the other, as needed
    backend = OVBackend({"precision": "f32", "model_caching": True, "cache_dir": str(tmp_path / "cache")})
    captures = SavedCaptures.of(net.forward, "forward", backend, backend, {4: (0, 2, 3)})
    with torch.no_grad():
        for scale in (0.25, 0.5):
            monkeypatch.setattr(tinynet, "SCALE", scale)
            got = captures.call((x,), {}, lambda *a: pytest.fail("ran through torch.compile"))
            torch.testing.assert_close(got, net(x), atol=1e-4, rtol=1e-4)
    assert backend.stats()["captures_made"] == 0 and backend.stats()["captures_loaded"] == 2


#: As A1111's SpatialTransformer forward (its ``spatial_transformer_forward``): a 1x1 conv reads a permuted
#: view (channels-last strides), where torch's choice of the conv's memory format would guard the batch on
#: being more than 1 (Negative Guidance minimum sigma's late steps and a long prompt call A1111's UNet at a
#: batch of 1).
PERMUTED_NET = textwrap.dedent('''
    import torch


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.conv_in = torch.nn.Conv2d(4, 32, 3, padding=1)
            self.norm = torch.nn.GroupNorm(8, 32)
            self.proj_in = torch.nn.Conv2d(32, 32, 1)
            self.lin = torch.nn.Linear(32, 32)
            self.proj_out = torch.nn.Conv2d(32, 32, 1)
            self.conv_out = torch.nn.Conv2d(32, 4, 3, padding=1)

        def forward(self, x):
            x = self.conv_in(x)
            b, c, h, w = x.shape
            x_in = x
            x = self.proj_in(self.norm(x)).permute(0, 2, 3, 1).reshape(b, h * w, c)
            x = self.lin(x).view(b, h, w, c).permute(0, 3, 1, 2)
            return self.conv_out(self.proj_out(x) + x_in)
''')


@pytest.mark.parametrize("net_source", [NET, PERMUTED_NET], ids=["plain", "permuted"])
def test_a_batch_of_one_converts_nothing_and_every_capture_is_saved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, net_source: str) -> None:
    """A1111 calls the UNet with a batch of 1 when a long prompt and its negative prompt differ in length,
    and on the late steps of Negative Guidance minimum sigma. After a call at a batch of 2 that converted
    the graph, a batch of 1 (and other sizes) converts nothing and captures nothing: the one capture serves
    it, the permuted net's too. The capture is saved: the next process captures nothing for either batch."""
    from ov_backend.saved_captures import SavedCaptures

    (tmp_path / "tinynet.py").write_text(net_source)
    sys.modules.pop("tinynet", None)  # (the other parameter's net)
    monkeypatch.syspath_prepend(str(tmp_path))
    import tinynet

    net = tinynet.Net().eval()
    no_compile = lambda *a: pytest.fail("ran through torch.compile")  # noqa: E731

    def backend_and_captures() -> tuple[OVBackend, SavedCaptures]:
        backend = OVBackend({"precision": "f32", "model_caching": True, "cache_dir": str(tmp_path / "cache")})
        return backend, SavedCaptures.of(net.forward, "forward", backend, backend, {4: (0, 2, 3)})

    def check(captures: SavedCaptures, *shapes: tuple[int, ...]) -> None:
        for shape in shapes:
            x = torch.randn(*shape)
            torch.testing.assert_close(captures.call((x,), {}, no_compile), net(x), atol=1e-4, rtol=1e-4)

    with torch.no_grad():
        backend, captures = backend_and_captures()
        check(captures, (2, 4, 16, 16))
        converted = backend.stats()["convert_seconds"]
        assert converted > 0
        check(captures, (1, 4, 16, 16), (1, 4, 8, 24), (3, 4, 16, 16))
        stats = backend.stats()
        assert stats["convert_seconds"] == converted, [r.summary() for r in backend.reports]
        assert stats["captures_made"] == 1, stats
        assert stats["captures_saved"] == stats["captures_made"]

        torch._dynamo.reset()  # the next process
        backend, captures = backend_and_captures()
        check(captures, (2, 4, 16, 16), (1, 4, 16, 16))
        stats = backend.stats()
        assert stats["captures_made"] == 0 and stats["captures_loaded"] >= 1 and stats["convert_seconds"] == 0, stats


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.nn.functional.silu(self.conv(x)).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class _Split(torch.nn.Module):
    """As step caching's split of a UNet: methods that take the (routed) module as an argument."""

    def blocks(self, net: _Blocks, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.silu(net.conv(x)).permute(0, 2, 3, 1)
        return net.lin(h).permute(0, 3, 1, 2) * 0.5

    def whole(self, net: _Blocks, x: torch.Tensor) -> torch.Tensor:
        return net(x) * 0.5


def _routed(net: _Blocks) -> Callable[..., Any]:
    """``net`` routed as the entry points route a module: its ``forward`` replaced in its own ``__dict__`` by
    a closure over the caller's objects, here an OpenVINO ``Core``, which cannot be pickled."""
    import openvino

    core = openvino.Core()
    with pytest.raises(TypeError, match="pickle"):
        pickle.dumps(core)

    def forward(x: torch.Tensor) -> torch.Tensor:
        assert core is not None
        return _Blocks.forward(net, x) + 1

    net.forward = forward
    return forward


def test_a_method_taking_a_routed_module_is_saved_and_loaded_with_the_module_routed(tmp_path: Path) -> None:
    """The module passed to the method is routed (its forward, in its own __dict__, holds an OpenVINO Core):
    the capture is saved all the same, and the next process, with the module routed again, loads it instead
    of tracing and computes the method's result; the route is left in place."""
    from ov_backend import CompiledMethod, GraphRunCounter

    net, split = _Blocks().eval(), _Split()
    route = _routed(net)

    def method() -> tuple[OVBackend, CompiledMethod]:
        backend = OVBackend({"precision": "f32", "model_caching": True, "cache_dir": str(tmp_path / "cache")})
        return backend, CompiledMethod(split.blocks, GraphRunCounter(backend), {4: (0, 2, 3)}, "blocks")

    with torch.no_grad():
        backend, compiled = method()
        for shape in ((2, 4, 16, 16), (1, 4, 8, 24)):
            x = torch.randn(*shape)
            got, eager = compiled.call((net, x), {})
            assert not eager
            torch.testing.assert_close(got, split.blocks(net, x), atol=1e-4, rtol=1e-4)
        stats = backend.stats()
        assert stats["captures_made"] == 1 and stats["captures_saved"] == 1, stats
        assert len(list((tmp_path / "cache").rglob("*.capture"))) == 1
        assert vars(net)["forward"] is route

        torch.compiler.reset()  # the next process
        backend, compiled = method()
        x = torch.randn(2, 4, 12, 20)
        got, eager = compiled.call((net, x), {})
        stats = backend.stats()
        assert stats["captures_made"] == 0 and stats["captures_loaded"] == 1 and not eager, stats
        torch.testing.assert_close(got, split.blocks(net, x), atol=1e-4, rtol=1e-4)
        assert vars(net)["forward"] is route


def test_a_method_calling_a_routed_module_runs_the_route(tmp_path: Path) -> None:
    """The routed method is set aside while capturing, but a method that calls it still runs it: its
    capture (of the class's forward) does not hold for the routed module, so torch.compile runs the call,
    and nothing is saved that a later process would trace again and again."""
    from ov_backend import CompiledMethod, GraphRunCounter

    net, split = _Blocks().eval(), _Split()
    _routed(net)
    backend = OVBackend({"precision": "f32", "model_caching": True, "cache_dir": str(tmp_path / "cache")})
    compiled = CompiledMethod(split.whole, GraphRunCounter(backend), {4: (0, 2, 3)}, "whole")
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 4, 16, 16)
            got, _eager = compiled.call((net, x), {})
            torch.testing.assert_close(got, (_Blocks.forward(net, x) + 1) * 0.5, atol=1e-4, rtol=1e-4)
    stats = backend.stats()
    assert stats["captures_made"] == 1 and stats["captures_saved"] == 0, stats
    assert not list((tmp_path / "cache").rglob("*.capture"))


def test_layers_of_a_class_nested_in_another_are_captured_saved_and_checked_by_name(tmp_path: Path) -> None:
    """Forge's layers are classes defined inside another (``ForgeOperations.Linear``), on whose type torch refuses
    to save a guard. The capture checks those guards itself, by the class's name: it is saved, a new process loads
    it and runs it without tracing, and a net of another layer class does not match it."""
    nested = NET.replace("self.lin = torch.nn.Linear(8, 4)", "self.lin = Operations.Linear(8, 4)").replace(
        "class Net(", "class Operations:\n    class Linear(torch.nn.Linear):\n        pass\n\n\nclass Net(")
    assert "Operations.Linear(8, 4)" in nested
    (tmp_path / "tinynet.py").write_text(nested)
    first = run(tmp_path, "save")
    assert first["matches"] == {"16x16": True, "8x24": True}
    assert first["stats"]["convert_seconds"] > 0
    again = run(tmp_path, "load")
    assert again["matches"] == {"16x16": True, "8x24": True}  # (outputs compared with PyTorch's inside)
    assert again["stats"]["ov_calls"] == 2 and again["stats"]["eager_calls"] == 0
    assert again["stats"]["convert_seconds"] == 0
    other = run(tmp_path, "load", "tinynet.Operations.Linear = type('Linear', (torch.nn.Linear,), {})")
    assert other["matches"] == {"16x16": False, "8x24": False}


def test_a_module_of_a_layer_class_made_in_a_function_is_not_traced_twice(tmp_path: Path) -> None:
    """torch refuses to save a guard on a class defined inside a function (no name finds it again), but only
    after tracing the whole method; such a method runs through torch.compile at once (one trace, not two), and
    says why it has no saved capture."""
    from ov_backend.saved_captures import SavedCaptures

    def layer_class() -> type:
        class Linear(torch.nn.Linear):
            pass
        return Linear

    linear = layer_class()
    net = torch.nn.Sequential(linear(4, 8), torch.nn.SiLU(), linear(8, 4)).eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        backend = OVBackend({"precision": "f32", "model_caching": True, "cache_dir": str(tmp_path / "cache")})
        captures = SavedCaptures.of(net.forward, "forward", backend, backend, {})
        got = captures.call((x,), {}, lambda *a: net(*a) * 1)
    torch.testing.assert_close(got, net(x))
    assert captures.off is not None and "layer_class.<locals>.Linear, a class its name does not find again" in \
        captures.off, captures.off
    assert backend.stats()["capture_seconds"] == 0 and backend.stats()["captures_made"] == 0
    assert not list((tmp_path / "cache").rglob("*.capture"))
