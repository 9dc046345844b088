"""Many objects of one class compiled apart: a copy of the method per object keeps dynamo's recompile limit
(counted per code object) from sending the later ones to plain PyTorch."""

from __future__ import annotations

import torch
from torch import nn

from ov_backend import CompiledMethod, OVBackend
from ov_backend.graph_runs import GraphRunCounter

from .conftest import F32_ATOL, F32_RTOL


class Block(nn.Sequential):
    """Blocks of one class and different layouts, as a UNet's ``input_blocks`` are."""


def blocks(count: int) -> list[Block]:
    torch.manual_seed(0)
    return [Block(*[nn.Conv2d(4, 4, 3, padding=1) for _ in range(1 + i % 4)], *([nn.SiLU()] * (i // 4)))
            for i in range(count)]


def run_all(own_code: bool) -> tuple[list[bool], OVBackend]:
    backend = OVBackend({"model_caching": False, "precision": "f32"})
    counter = GraphRunCounter(backend)
    x = torch.randn(1, 4, 8, 8)
    eager = []
    with torch.no_grad():
        for block in blocks(12):
            method = CompiledMethod(block.forward, counter, {4: (0, 2, 3)}, own_code=own_code)
            result, ran_eager = method.call((x,), {})
            torch.testing.assert_close(result, block(x), rtol=F32_RTOL, atol=F32_ATOL)
            eager.append(ran_eager)
    return eager, backend


def test_a_copy_per_object_compiles_every_one_of_more_objects_than_the_recompile_limit() -> None:
    limit = torch._dynamo.config.recompile_limit
    assert limit < 12  # (the case this is about)
    eager, backend = run_all(own_code=True)
    assert not any(eager), eager
    assert backend.stats()["compiles"] == 12
    shared, _ = run_all(own_code=False)  # without the copies, the objects past the limit run in PyTorch
    assert any(shared[limit:]), shared
