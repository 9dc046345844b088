"""The UNet's blocks as routes of their own (``ov_accelerate_webui.unet_blocks``) and what stops them."""

from __future__ import annotations

from typing import Any

from torch import nn


class LdmLike(nn.Module):
    """The children an LDM/sgm ``UNetModel`` runs its work in."""

    def __init__(self, sdxl: bool = False) -> None:
        super().__init__()
        self.time_embed = nn.Sequential(nn.Linear(4, 8), nn.SiLU(), nn.Linear(8, 8))
        if sdxl:
            self.label_emb = nn.Sequential(nn.Linear(4, 8))
        self.input_blocks = nn.ModuleList([nn.Sequential(nn.Conv2d(4, 4, 1)) for _ in range(3)])
        self.middle_block = nn.Sequential(nn.Conv2d(4, 4, 1), nn.GroupNorm(2, 4))
        self.output_blocks = nn.ModuleList([nn.Sequential(nn.Conv2d(8, 4, 1)) for _ in range(3)])
        self.out = nn.Sequential(nn.SiLU(), nn.Conv2d(4, 4, 1))


def test_every_block_in_the_order_the_unet_runs_them() -> None:
    from ov_accelerate_webui.model_parts import Target
    from ov_accelerate_webui.unet_blocks import block_targets

    for sdxl in (False, True):
        unet = LdmLike(sdxl)
        targets = block_targets(Target("unet", "model.diffusion_model", unet))
        names = [t.path.removeprefix("model.diffusion_model.") for t in targets]
        assert names == ["time_embed", *(["label_emb"] if sdxl else []), "input_blocks.0", "input_blocks.1",
                         "input_blocks.2", "middle_block", "output_blocks.0", "output_blocks.1", "output_blocks.2",
                         "out"]
        assert all(t.own_code and t.part == "unet" and t.method == "forward" for t in targets)
        assert [t.module for t in targets][2] is unet.input_blocks[0 if sdxl else 1]
    assert block_targets(Target("unet", "x", nn.Linear(2, 2))) == []


def test_blocks_are_blocked_by_a_method_replaced_inside_them_and_say_by_whom() -> None:
    from ov_accelerate_webui.routing import mark_ours
    from ov_accelerate_webui.unet_blocks import blocks_blocked

    unet = LdmLike()
    assert blocks_blocked(unet) == ""
    unet.forward = lambda *a: None  # the UNet's own forward replaced: that is what block routes are for
    block = unet.middle_block
    block.forward = block.forward  # the class's method bound to it, as ControlNet puts it back: still the block
    unet.output_blocks[1].forward = mark_ours(lambda *a: None)  # one of ours
    assert blocks_blocked(unet) == ""

    def hacked_group_norm_forward(*a: Any) -> Any:
        return None

    block.forward = hacked_group_norm_forward
    why = blocks_blocked(unet)
    assert "Sequential.forward by" in why and "hacked_group_norm_forward" in why, why
    assert "has no input_blocks" in blocks_blocked(nn.Linear(2, 2))
