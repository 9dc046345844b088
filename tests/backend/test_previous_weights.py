"""Going back to weights used before, and captures of the same code, compile nothing.

Two things a WebUI user does every day cost a full compile of the UNet each (seconds on a CPU, and
1.7 GB of memory for SD 1.5 at bf16): switching back to the checkpoint used before (A1111 loads it
into the same modules, in place), and a prompt longer than 75 tokens (A1111 calls the UNet at batch 1
instead of 2, and dynamo captures the same code again). These tests pin down that the previous
weights' models stay while memory allows (``previous_weights``), that a second capture of the same
code borrows the first one's model for all shapes, and that every result is still the eager one.
"""

from __future__ import annotations

import pytest
import torch

from ov_backend import variants
from ov_backend.graph_runs import GraphCollector, GraphRunCounter
from ov_backend.memory import SystemMemory, system_memory

from .conftest import F32_ATOL, F32_RTOL, f32_backend
from .test_weight_binding import Block


def run(compiled, model, batch: int, height: int, width: int = 8) -> torch.Tensor:
    """A call whose height and width may vary (batch not marked, as A1111's CFG batch of 2)."""
    x = torch.randn(batch, 4, height, width)
    for dim in (2, 3):
        torch._dynamo.maybe_mark_dynamic(x, dim)
    with torch.no_grad():
        got = compiled(x)
        torch.testing.assert_close(got, model(x), atol=F32_ATOL, rtol=F32_RTOL)
    return got


def swap(model: Block, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Load ``values`` into the model in place (as A1111 loads a checkpoint); returns the ones replaced."""
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(values[k])
    return before


def other_weights(model: Block, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: torch.randn_like(v) * 0.3 for k, v in model.state_dict().items()}


def generation(backend, compiled, model, height: int = 8) -> None:
    """One unit of work, as the WebUI adapter runs it: a use window, the UNet at CFG batch 2."""
    backend.start_window()
    run(compiled, model, 2, height)


def switching(tmp_path, mode: str):
    backend = f32_backend(tmp_path, previous_weights=mode)
    model = Block().eval()
    compiled = torch.compile(model, backend=backend)
    generation(backend, compiled, model)  # checkpoint A
    a = swap(model, other_weights(model, 1))
    generation(backend, compiled, model)  # checkpoint B: a compile of its own
    assert backend.stats()["compiles"] == 2
    swap(model, a)
    generation(backend, compiled, model)  # back to A (compared with eager inside)
    return backend, model, compiled


def test_switching_back_to_the_previous_weights_compiles_nothing(tmp_path):
    backend, _, _ = switching(tmp_path, "keep")
    assert backend.stats()["compiles"] == 2 and backend.stats()["released"] == 0
    assert [r.graph for r in backend.reports] == ["graph 0", "graph 0"]


def test_release_compiles_the_previous_weights_again(tmp_path):
    backend, _, _ = switching(tmp_path, "release")
    assert backend.stats()["compiles"] == 3 and backend.stats()["released"] == 2  # A's at B, B's at A
    assert backend.stats()["convert_seconds"] > 0 and backend.reports[-1].convert_seconds == 0  # compile only


@pytest.mark.parametrize(("available_gib", "compiles"), [(12.0, 2), (6.0, 3)])
def test_auto_keeps_them_while_a_third_of_the_memory_is_available(tmp_path, monkeypatch, available_gib, compiles):
    gib = 1 << 30
    monkeypatch.setattr(variants, "system_memory", lambda: SystemMemory(24 * gib, int(available_gib * gib)))
    backend, _, _ = switching(tmp_path, "auto")
    assert backend.stats()["compiles"] == compiles


def test_auto_releases_where_memory_cannot_be_read(tmp_path, monkeypatch):
    monkeypatch.setattr(variants, "system_memory", lambda: None)
    backend, _, _ = switching(tmp_path, "auto")
    assert backend.stats()["compiles"] == 3


def test_only_the_latest_other_weights_and_only_what_their_last_window_used(tmp_path):
    backend = f32_backend(tmp_path, previous_weights="keep", shared_shapes="never")
    model = Block().eval()
    compiled = torch.compile(model, backend=backend)
    generation(backend, compiled, model, 8)
    generation(backend, compiled, model, 12)  # A at two sizes, in two windows
    a = swap(model, other_weights(model, 1))
    generation(backend, compiled, model, 12)  # B: A's 8-high model goes (its last window did not use it)
    assert backend.stats()["compiles"] == 3 and backend.stats()["released"] == 1
    swap(model, other_weights(model, 2))
    generation(backend, compiled, model, 12)  # C: B's model stays; A's goes (a graph keeps two sets of weights)
    assert backend.stats()["compiles"] == 4
    swap(model, a)
    generation(backend, compiled, model, 12)  # A again: compiled anew (no conversion)
    assert backend.stats()["compiles"] == 5 and backend.reports[-1].convert_seconds == 0


def test_a_second_capture_of_the_same_code_borrows_the_first_ones_model(tmp_path):
    backend = f32_backend(tmp_path, model_caching=False)
    collector = GraphCollector(GraphRunCounter(backend))
    model = Block().eval()
    compiled = torch.compile(model, backend=collector)
    backend.start_window()
    run(compiled, model, 2, 8)
    run(compiled, model, 2, 12)  # a second size: one model for all shapes
    assert backend.stats()["compiles"] == 2
    run(compiled, model, 1, 8)  # batch 1 (a long prompt in A1111): dynamo captures the code again
    run(compiled, model, 1, 16)
    graphs = [r.graph for r in backend.reports]
    assert graphs[-1] != graphs[0], "batch 1 is a second capture"
    assert backend.stats()["compiles"] == 2  # nothing compiled for it (compared with eager inside)
    borrowed = backend.reports[-2]
    assert [p.borrowed for p in borrowed.partitions] == [True]
    assert "another graph of the same code and weights" in borrowed.summary()


def test_a_second_capture_shares_from_its_first_shape_and_the_first_borrows_only_to_share(tmp_path):
    """The re-capture (batch 1: a long prompt's cond and uncond lengths) needs several shapes at once: one
    model for all shapes from its first call, lent. The first capture keeps its model for its one shape
    (faster per call on some CPUs, see ``shared_shapes``), and borrows the lent one only where it would
    share shapes itself: a second shape in the same window."""
    backend = f32_backend(tmp_path, model_caching=False)
    model = Block().eval()
    compiled = torch.compile(model, backend=backend)
    backend.start_window()
    run(compiled, model, 2, 8)  # one shape: a model compiled for it alone
    run(compiled, model, 1, 8)  # the re-capture: one model for all shapes at once
    assert backend.stats()["compiles"] == 2
    assert [p.all_shapes for p in backend.reports[-1].partitions] == [True]
    reports = len(backend.reports)
    run(compiled, model, 2, 8)  # the first capture's own model: nothing built
    assert len(backend.reports) == reports
    backend.start_window()
    run(compiled, model, 2, 16)  # a window with one shape of it: a model for that shape, as without a re-capture
    assert backend.stats()["compiles"] == 3 and not backend.reports[-1].partitions[0].borrowed
    run(compiled, model, 2, 12)  # a second shape in the window: the lent model, nothing compiled
    assert backend.stats()["compiles"] == 3 and backend.reports[-1].partitions[0].borrowed


def test_a_borrower_builds_its_own_model_once_the_owner_released_it(tmp_path):
    backend = f32_backend(tmp_path, model_caching=False)
    owner, borrower = GraphCollector(GraphRunCounter(backend)), GraphCollector(GraphRunCounter(backend))
    model = Block().eval()
    first, second = torch.compile(model, backend=owner), torch.compile(model, backend=borrower)
    run(first, model, 2, 8)
    run(first, model, 2, 12)
    run(second, model, 1, 8)
    assert backend.stats()["compiles"] == 2
    assert owner.release() == 1  # the model for all shapes: it was the owner's
    run(second, model, 1, 8)  # its borrowed model is gone: built again (compared with eager inside)
    assert backend.stats()["compiles"] == 3
    assert not backend.reports[-1].partitions[0].borrowed


def test_new_weights_borrow_nothing_of_the_old_ones(tmp_path):
    backend = f32_backend(tmp_path, model_caching=False)
    model = Block().eval()
    compiled = torch.compile(model, backend=backend)
    run(compiled, model, 2, 8)
    run(compiled, model, 2, 12)
    swap(model, other_weights(model, 1))
    run(compiled, model, 1, 8)  # another capture, other weights: its own model (eager's picture, inside)
    assert not backend.reports[-1].partitions[0].borrowed
    assert backend.stats()["compiles"] == 3


def long_prompt_then_new_weights(tmp_path, mode: str):
    """A long prompt (the batch of 1's capture) in one generation, then new weights in place (a LoRA, a
    checkpoint) and generations with short prompts only: the batch of 1's capture is not called again."""
    backend = f32_backend(tmp_path, previous_weights=mode, model_caching=False)
    model = Block().eval()
    compiled = torch.compile(model, backend=backend)
    backend.start_window()
    run(compiled, model, 2, 8)
    run(compiled, model, 1, 8)  # the re-capture: its own model for all shapes
    run(compiled, model, 1, 12)
    assert len({r.graph for r in backend.reports}) == 2 and backend.stats()["compiles"] == 2
    swap(model, other_weights(model, 1))
    generation(backend, compiled, model)  # the first capture builds for the new weights
    return backend, model, compiled


def test_a_capture_not_called_since_its_weights_changed_releases_its_models_with_the_previous_weights(tmp_path):
    backend, model, compiled = long_prompt_then_new_weights(tmp_path, "release")
    # the first capture's model of the old weights, and the re-capture's (of weights that are gone)
    assert backend.stats()["released"] == 2 and backend.stats()["compiles"] == 3
    assert backend.stats()["released_stale"] == 1
    run(compiled, model, 1, 8)  # a long prompt again: built for the new weights (eager's picture, inside)
    assert backend.stats()["compiles"] == 4 and backend.reports[-1].convert_seconds == 0


def test_where_the_previous_weights_stay_so_do_an_idle_captures_models(tmp_path):
    backend, model, compiled = long_prompt_then_new_weights(tmp_path, "keep")
    assert backend.stats()["released"] == 0 and backend.stats()["released_stale"] == 0


def test_a_window_can_choose_what_happens_to_the_previous_weights(tmp_path):
    # the owner's choice per unit of work (the WebUI's setting, read per generation) wins over the settings'
    backend = f32_backend(tmp_path, previous_weights="keep", model_caching=False)
    model = Block().eval()
    compiled = torch.compile(model, backend=backend)
    backend.start_window(previous_weights="release")
    run(compiled, model, 2, 8)
    run(compiled, model, 1, 8)
    swap(model, other_weights(model, 1))
    backend.start_window(previous_weights="release")
    run(compiled, model, 2, 8)
    assert backend.stats()["released"] == 2 and backend.stats()["released_stale"] == 1
    backend.start_window()  # none: the settings' "keep"
    swap(model, other_weights(model, 2))
    run(compiled, model, 2, 8)
    assert backend.stats()["released"] == 2 and backend.stats()["kept_previous"] == 1
    with pytest.raises(ValueError, match="previous_weights must be one of auto, keep, release, got 'sometimes'"):
        backend.start_window(previous_weights="sometimes")


class Decoder(Block):
    """Other code than :class:`Block` (dynamo captures it apart, as A1111's VAE beside its UNet)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x))


def test_a_graph_whose_weights_did_not_change_keeps_its_models(tmp_path):
    backend = f32_backend(tmp_path, previous_weights="release", model_caching=False)
    unet, vae = Block().eval(), Decoder().eval()
    compiled_unet, compiled_vae = torch.compile(unet, backend=backend), torch.compile(vae, backend=backend)
    backend.start_window()
    run(compiled_unet, unet, 2, 8)
    run(compiled_vae, vae, 2, 8)
    swap(unet, other_weights(unet, 1))  # a LoRA on the UNet only
    generation(backend, compiled_unet, unet)
    assert backend.stats()["released"] == 1  # the UNet's own model of the old weights, not the VAE's
    reports = len(backend.reports)
    run(compiled_vae, vae, 2, 8)
    assert len(backend.reports) == reports  # nothing built


def test_a_stale_watch_sees_writes_in_place_and_freed_tensors():
    from ov_backend.weights import WeightWatch

    a, b = torch.ones(3), torch.ones(2)
    watch = WeightWatch([a, b])
    assert not watch.stale()
    a.add_(1)
    assert watch.stale()
    watch = WeightWatch([a, b])
    del b
    assert watch.stale()


def test_the_machines_memory_is_read():
    memory = system_memory()
    assert memory is not None, "Linux and Windows say how much memory is available"
    assert 0 < memory.available <= memory.total


@pytest.mark.parametrize("value", ["sometimes", 1])
def test_an_unknown_previous_weights_value_says_what_is_valid(tmp_path, value):
    with pytest.raises(ValueError, match=r"option 'previous_weights' must be one of \['auto', 'keep', 'release'\]"):
        f32_backend(tmp_path, previous_weights=value)
