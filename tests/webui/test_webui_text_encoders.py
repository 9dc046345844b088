"""Text encoders: found by what they are (the SDXL refiner has only OpenCLIP), routed below the token
embedding (textual-inversion vectors arrive as activations: no recompile per embedding position or
count), CLIP skip, and a routed module that dynamo gives up on is reported, never run silently in PyTorch.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import torch
from conftest import IMAGE_TOLERANCE, make_p, max_pixel_diff
from transformers.models.clip.modeling_clip import CLIPEncoder

from ov_accelerate_webui.model_parts import (
    FAMILIES,
    TARGET_TABLE,
    TEXT_ENCODER_KINDS,
    TEXT_ENCODER_SETS,
    UnsupportedModel,
    find_targets,
)

SD1_ENCODER = "cond_stage_model.wrapped.transformer.text_model.encoder"

#: Embedding "<ti3>" (3 vectors) and "<ti1>" (1 vector) at different positions and counts. The fake
#: tokenizer makes one token per character; a chunk holds 75.
TI_PROMPTS = (
    "<ti3> cat",
    "a <ti3> cat",
    "a tiny cat <ti3>",
    "<ti3><ti3> cat",
    "<ti1> cat <ti3>",
    "<ti1><ti1><ti1> cat",
    "cat " * 17 + "<ti3>",  # at the end of the first chunk
    "x" * 73 + "<ti3>",  # does not fit: moves to the second chunk
    "a cat " * 15 + "<ti1> and <ti3>",  # inside the second chunk
    "<ti3> " * 5,
    "<ti1>",
)


def test_tables_are_sorted_unique_and_name_known_kinds() -> None:
    assert list(TARGET_TABLE) == sorted(TARGET_TABLE) and len({r[:2] for r in TARGET_TABLE}) == len(TARGET_TABLE)
    names = [kind.name for kind in TEXT_ENCODER_KINDS]
    assert names == sorted(set(names))
    assert list(TEXT_ENCODER_SETS) == sorted(TEXT_ENCODER_SETS)
    assert {family for family, _kinds, _name in TEXT_ENCODER_SETS} == set(FAMILIES)
    assert all(set(kinds) <= set(names) for _family, kinds, _name in TEXT_ENCODER_SETS)
    assert {row[0] for row in TARGET_TABLE} == set(FAMILIES)


def test_text_encoders_found_by_what_they_are_and_a_missing_one_is_named(fake_host: Any) -> None:
    from tiny_model import TinySDXL, TinySDXLRefiner

    refiner = TinySDXLRefiner(seed=0)
    assert refiner.is_sdxl
    assert [t.label for t in find_targets(refiner, ("text_encoder",))] == [
        "conditioner.embedders.0.text_transformer_forward"
    ]
    base = TinySDXL(seed=0)
    base.conditioner.embedders = torch.nn.ModuleList([base.conditioner.embedders[1], base.conditioner.embedders[0]])
    assert [t.method for t in find_targets(base, ("text_encoder",))] == ["text_transformer_forward", "forward"]

    del base.conditioner.embedders[0]  # CLIP-L without OpenCLIP-bigG: no SDXL checkpoint looks like that
    with pytest.raises(UnsupportedModel, match=r"CLIP at conditioner\.embedders\.0.*OpenCLIP \(SDXL refiner\)"):
        find_targets(base, ("unet", "text_encoder"))
    assert [t.part for t in find_targets(base, ("unet", "vae"))] == ["unet", "vae", "vae"]


def _generate(host: Any, extension: Any, settings: Any, prompt: str, routed: bool) -> tuple[torch.Tensor, Any]:
    conds: list[torch.Tensor] = []
    host.callbacks.clear_callbacks()
    host.callbacks.on_cfg_denoiser(lambda params: conds.append(params.text_cond.clone()))
    p = make_p(host, prompt=prompt, steps=1)
    processed = extension.run(p, settings) if routed else host.processing.process_images(p)
    return conds[0], processed


def _compiles(extension: Any, host: Any, settings: Any) -> int:
    accelerator = extension.accelerator()
    accelerator.prepare(host.shared.sd_model, settings, "unused")
    return int(accelerator.backends.stats()["compiles"])


def test_textual_inversion_at_many_positions_matches_and_never_recompiles(
    fake_host: Any, extension: Any, f32: Any
) -> None:
    from modules import sd_hijack
    from modules.textual_inversion.textual_inversion import Embedding

    settings = dataclasses.replace(f32, unet=False, vae=False)
    db = sd_hijack.model_hijack.embedding_db
    for name, count, seed in (("<ti3>", 3, 1), ("<ti1>", 1, 2)):
        db.register_embedding(Embedding(torch.randn(count, 32, generator=torch.Generator().manual_seed(seed)), name))
    _generate(fake_host, extension, settings, "a cat", routed=True)  # compiles the text encoder
    compiled = _compiles(extension, fake_host, settings)
    assert compiled >= 1

    for prompt in TI_PROMPTS:
        plain_c, plain_img = _generate(fake_host, extension, settings, prompt, routed=False)
        routed_c, routed_img = _generate(fake_host, extension, settings, prompt, routed=True)
        torch.testing.assert_close(routed_c, plain_c, atol=1e-4, rtol=1e-4, msg=prompt)
        assert max_pixel_diff(routed_img, plain_img) <= IMAGE_TOLERANCE, prompt
        status = extension.last_status
        assert "No new compile: compiled models reused." in status and "Not accelerated" not in status, status
        assert f"{SD1_ENCODER} (" in status
    assert _compiles(extension, fake_host, settings) == compiled, "no compile for any embedding position or count"


@pytest.mark.parametrize("clip_skip", [1, 2])
def test_clip_skip_matches_pytorch(fake_host: Any, extension: Any, f32: Any, clip_skip: int) -> None:
    settings = dataclasses.replace(f32, unet=False, vae=False)
    fake_host.shared.opts.CLIP_stop_at_last_layers = clip_skip
    plain_c, plain_img = _generate(fake_host, extension, settings, "a tiny cat", routed=False)
    routed_c, routed_img = _generate(fake_host, extension, settings, "a tiny cat", routed=True)
    torch.testing.assert_close(routed_c, plain_c, atol=1e-4, rtol=1e-4)
    assert max_pixel_diff(routed_img, plain_img) <= IMAGE_TOLERANCE
    assert f"{SD1_ENCODER} (2 calls)" in extension.last_status
    assert "Not accelerated" not in extension.last_status
    if clip_skip == 2:  # the layer before the last one really is a different conditioning
        fake_host.shared.opts.CLIP_stop_at_last_layers = 1
        assert not torch.allclose(_generate(fake_host, extension, settings, "a tiny cat", False)[0], plain_c)


class OwnCodeEncoder(CLIPEncoder):
    """CLIP's encoder with a ``forward`` code object of its own: dynamo's recompile limit, once reached,
    holds for a code object until ``torch.compiler.reset()``; the forced case leaves CLIPEncoder's alone."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return super().forward(*args, **kwargs)


def test_a_module_dynamo_gives_up_on_is_reported_not_run_silently(
    fake_host: Any, extension: Any, f32: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module that cannot be captured ahead of time (e.g. a graph break) runs through torch.compile, whose
    recompile limit applies; past it, the calls run in PyTorch and the status says so."""
    from ov_backend import portable

    def cannot(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a graph break (stand-in)")

    monkeypatch.setattr(portable, "capture", cannot)
    settings = dataclasses.replace(f32, unet=False, vae=False)
    encoder = fake_host.model.cond_stage_model.wrapped.transformer.text_model.encoder
    encoder.__class__ = OwnCodeEncoder
    opts = fake_host.shared.opts
    with torch._dynamo.config.patch(recompile_limit=1), caplog.at_level(logging.WARNING):
        _generate(fake_host, extension, settings, "a tiny cat", routed=True)  # CLIP skip 1: compiled
        assert "Not accelerated" not in extension.last_status
        opts.CLIP_stop_at_last_layers = 2  # a second variant of the encoder: over the limit of 1
        plain_c, plain_img = _generate(fake_host, extension, settings, "a tiny cat", routed=False)
        caplog.clear()
        routed_c, routed_img = _generate(fake_host, extension, settings, "a tiny cat", routed=True)

    torch.testing.assert_close(routed_c, plain_c)
    assert max_pixel_diff(routed_img, plain_img) == 0, "it ran in PyTorch: the same image"
    expected = f"Not accelerated, ran in plain PyTorch: {SD1_ENCODER} (2 of 2 calls: torch.compile gave up on it"
    assert expected in extension.last_status and "recompile limit (1" in extension.last_status
    assert expected in routed_img.comments
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "OpenVINO" in r.getMessage()]
    assert any(expected in message for message in warnings), warnings

    extension.accelerator().reset()  # what a checkpoint change does: drops dynamo's variants too
    with torch._dynamo.config.patch(recompile_limit=1):
        _generate(fake_host, extension, settings, "a tiny cat", routed=True)
    assert "Not accelerated" not in extension.last_status, "compiled again"
