"""The UNet's attention while routed: A1111's own "sdp" forward in place of a slicing optimization, and the
WebUI's choice back afterwards whatever ended the generation. The real WebUI's version of this (with
A1111's InvokeAI and sdp) is ``tests/real_webui/test_real_webui.py``; here A1111's modules are stand-ins
with the same names and the same way of applying an optimization (class attributes)."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from ov_accelerate_webui.attention import FusedAttention


def invoke_forward(self: Any, x: Any) -> str:
    return "invokeai"


def sdp_forward(self: Any, x: Any) -> str:
    return "sdp"


def sdp_attnblock_forward(self: Any, x: Any) -> str:
    return "sdp block"


def user_attnblock_forward(self: Any, x: Any) -> str:
    return "user block"


@pytest.fixture
def a1111(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """ldm's CrossAttention and AttnBlock, and modules.sd_hijack with InvokeAI applied."""
    cross = type("CrossAttention", (), {"forward": invoke_forward})
    block = type("AttnBlock", (), {"forward": user_attnblock_forward})
    attention = ModuleType("ldm.modules.attention")
    attention.CrossAttention = cross  # type: ignore[attr-defined]
    model = ModuleType("ldm.modules.diffusionmodules.model")
    model.AttnBlock = block  # type: ignore[attr-defined]

    class Sdp:
        name = "sdp"

        def apply(self) -> None:
            cross.forward = sdp_forward
            block.forward = sdp_attnblock_forward

    invoke = SimpleNamespace(name="InvokeAI")
    hijack = ModuleType("modules.sd_hijack")
    hijack.optimizers = [invoke, Sdp()]  # type: ignore[attr-defined]
    hijack.current_optimizer = invoke  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ldm.modules.attention", attention)
    monkeypatch.setitem(sys.modules, "ldm.modules.diffusionmodules.model", model)
    monkeypatch.setitem(sys.modules, "modules.sd_hijack", hijack)
    return SimpleNamespace(cross=cross, block=block, hijack=hijack, invoke=invoke)


def test_the_unet_attention_is_sdp_inside_and_the_users_choice_after(a1111: SimpleNamespace) -> None:
    with FusedAttention() as fused:
        assert fused.replaced == "InvokeAI"
        assert a1111.cross().forward(None) == "sdp"
        assert a1111.block().forward(None) == "user block"  # the VAE's attention stays the user's choice
    assert a1111.cross.forward is invoke_forward
    assert a1111.block.forward is user_attnblock_forward


def test_an_error_or_interrupt_inside_puts_the_users_choice_back(a1111: SimpleNamespace) -> None:
    with pytest.raises(KeyboardInterrupt), FusedAttention():
        raise KeyboardInterrupt
    assert a1111.cross.forward is invoke_forward


def test_a_model_load_inside_the_generation_is_followed_by_ensure(a1111: SimpleNamespace) -> None:
    with FusedAttention() as fused:
        a1111.cross.forward = invoke_forward  # A1111's sd_hijack on a checkpoint switch applies InvokeAI again
        fused.ensure()
        assert a1111.cross().forward(None) == "sdp"
    assert a1111.cross.forward is invoke_forward


@pytest.mark.parametrize("chosen", ["sdp", "sdp-no-mem"])
def test_nothing_is_replaced_when_the_webui_already_uses_sdp(a1111: SimpleNamespace, chosen: str) -> None:
    a1111.hijack.current_optimizer = SimpleNamespace(name=chosen)
    with FusedAttention() as fused:
        assert fused.replaced is None
        assert a1111.cross.forward is invoke_forward  # untouched (the stand-in's function, not the real sdp)


def test_attention_optimization_none_is_replaced_too(a1111: SimpleNamespace) -> None:
    a1111.hijack.current_optimizer = None  # Settings -> Optimizations -> "None": A1111's plain attention
    with FusedAttention() as fused:
        assert fused.replaced == "None"
        assert a1111.cross().forward(None) == "sdp"
    assert a1111.cross.forward is invoke_forward


def test_a_host_without_a1111_optimizations_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "modules.sd_hijack", raising=False)
    with FusedAttention() as fused:
        assert fused.replaced is None
