"""Step caching's split of Forge's UNet (``ov_accelerate_webui.forge_unet.ForgeSplit``) on a small stand-in.

The stand-in keeps what the split relies on in Forge main's ``backend/nn/unet.py`` (dfdcbab6): a module-level
``timestep_embedding``, ``time_embed``, ``input_blocks``/``middle_block``/``output_blocks`` called with
``(h, emb, context, transformer_options[, output_shape])``, blocks that write into ``transformer_options``, an
upsampler sized by the next skip's shape, and ``out``. The real Forge runs the split in ``tests/real_forge``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ov_accelerate_sd.step_cache import StepCacheRun, StepCacheSettings
from ov_accelerate_sd.unet_split import StepCacheUnsupported
from ov_accelerate_webui import forge_unet


def timestep_embedding(timesteps: torch.Tensor, dim: int, max_period: int = 10000,
                       repeat_only: bool = False) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
    args = timesteps[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class Block(nn.Module):
    """A ``TimestepEmbedSequential``'s call shape: a convolution fed the embedding and the context."""

    def __init__(self, cin: int, cout: int, resize: str = "") -> None:
        super().__init__()
        self.conv, self.emb, self.ctx, self.resize = nn.Conv2d(cin, cout, 3, padding=1), nn.Linear(8, cout), \
            nn.Linear(6, cout), resize

    def forward(self, x: torch.Tensor, emb: torch.Tensor, context: Any = None, transformer_options: Any = None,
                output_shape: Any = None) -> torch.Tensor:
        transformer_options["transformer_index"] = transformer_options.get("transformer_index", 0) + 1
        h = self.conv(x) + self.emb(emb)[:, :, None, None] + self.ctx(context.mean(1))[:, :, None, None]
        if self.resize == "down":
            return F.avg_pool2d(h, 2)
        if self.resize == "up":
            return F.interpolate(h, size=output_shape[-2:] if output_shape is not None else None,
                                 scale_factor=None if output_shape is not None else 2.0)
        return h


class ForgeShapedUNet(nn.Module):
    """Forge's ``IntegratedUNet2DConditionModel.forward`` without its patch hooks, on three levels."""

    def __init__(self, num_classes: int | None = None) -> None:
        super().__init__()
        self.model_channels, self.num_classes = 8, num_classes
        self.time_embed = nn.Sequential(nn.Linear(8, 8), nn.SiLU())
        if num_classes is not None:
            self.label_emb = nn.Linear(num_classes, 8)
        self.input_blocks = nn.ModuleList([Block(4, 8), Block(8, 8, "down"), Block(8, 8)])
        self.middle_block = Block(8, 8)
        self.output_blocks = nn.ModuleList([Block(16, 8), Block(16, 8, "up"), Block(16, 8)])
        self.out = nn.Sequential(nn.GroupNorm(4, 8), nn.Conv2d(8, 4, 1))

    def forward(self, x: torch.Tensor, timesteps: Any = None, context: Any = None, y: Any = None, control: Any = None,
                transformer_options: Any = None, **kwargs: Any) -> torch.Tensor:
        options = {} if transformer_options is None else transformer_options
        emb = self.time_embed(timestep_embedding(timesteps, self.model_channels).to(x.dtype))
        if self.num_classes is not None:
            emb = emb + self.label_emb(y)
        hs, h = [], x
        for module in self.input_blocks:
            h = module(h, emb, context, options)
            hs.append(h)
        h = self.middle_block(h, emb, context, options)
        for module in self.output_blocks:
            h = torch.cat([h, hs.pop()], dim=1)
            h = module(h, emb, context, options, hs[-1].shape if hs else None)
        return self.out(h).type(x.dtype)


def inputs(batch: int = 2, size: int = 9, labels: int | None = None) -> tuple[Any, ...]:
    torch.manual_seed(0)
    y = torch.randn(batch, labels) if labels else None
    return torch.randn(batch, 4, size, size), torch.tensor([999.0, 500.0][:batch]), torch.randn(batch, 5, 6), y


@pytest.mark.parametrize("labels", [None, 3])
@pytest.mark.parametrize("depth", [1, 2])
def test_the_full_method_is_forges_forward_and_shallow_from_its_feature_gives_the_same(
        labels: int | None, depth: int) -> None:
    unet = ForgeShapedUNet(labels).eval()
    x, t, c, y = inputs(size=9, labels=labels)  # an odd size: the upsampler takes the skip's shape
    extra = {"y": y} if labels else {}
    split = forge_unet.ForgeSplit(unet, depth)
    with torch.no_grad():
        expected = forge_unet.unet_forward(unet, x, t, c, y)
        output, feature = split.full(unet, x, t, c, **extra)
        shallow = split.shallow(unet, x, t, c, feature=feature, **extra)
    assert torch.equal(output, expected)
    assert torch.equal(shallow, expected)  # the same inputs: the kept feature is exactly what the deep part gave
    assert feature.shape[1] == 8


def test_a_shallow_call_reuses_the_kept_feature_for_the_next_step() -> None:
    unet = ForgeShapedUNet().eval()
    x, t, c, _ = inputs()
    split = forge_unet.ForgeSplit(unet, 1)
    run = StepCacheRun(StepCacheSettings(interval=2, depth=1, full_start=1, full_end=0))
    run.begin(4)
    with torch.no_grad():
        first = run.call(unet, (x,), {"timesteps": t, "context": c},
                         lambda kind, a, kw: getattr(split, kind)(unet, *a, **kw))
        run.at_step(1)
        later = x + 0.1
        second = run.call(unet, (later,), {"timesteps": t, "context": c},
                          lambda kind, a, kw: getattr(split, kind)(unet, *a, **kw))
        whole = forge_unet.unet_forward(unet, later, t, c)
    assert run.full_calls == 1 and run.shallow_calls == 1
    assert torch.equal(first, forge_unet.unet_forward(unet, x, t, c))
    assert not torch.equal(second, whole)  # the deep part is the first step's
    assert torch.allclose(second, whole, atol=1.0)


def test_a_module_that_is_not_forges_unet_is_refused_with_the_reason() -> None:
    with pytest.raises(StepCacheUnsupported, match="has no input_blocks"):
        forge_unet.ForgeSplit(nn.Linear(2, 2), 1)
    with pytest.raises(StepCacheUnsupported, match="depth 3 does not fit"):
        forge_unet.ForgeSplit(ForgeShapedUNet(), 3)
    other = ForgeShapedUNet()
    other.output_blocks = nn.ModuleList([nn.Conv2d(16, 8, 1) for _ in range(3)])  # blocks of another signature
    with pytest.raises(StepCacheUnsupported, match=r"blocks \(Conv2d\) do not take transformer_options and "
                                                   "output_shape as Forge's do"):
        forge_unet.ForgeSplit(other, 1)


def test_the_forge_unet_target_splits_with_forges_split() -> None:
    from test_webui_forge_host import engine  # (this folder is on the path: its test modules are not a package)

    from ov_accelerate_webui import forge

    unet = next(t for t in forge.find_targets(engine(), ("unet",)) if t.part == "unet")
    assert unet.split is forge_unet.ForgeSplit
