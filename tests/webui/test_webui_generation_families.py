"""SD 2.x and SDXL checkpoints (A1111's layouts, see ``fake_a1111/tiny_model.py``): every part is routed
and actually called through OpenVINO, restored afterwards, images match PyTorch at f32, infotext.

Runs after ``test_webui_generation.py``: SD2's UNet and VAE are SD1's (same seeded builders), so they
come from the session's disk cache.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from conftest import IMAGE_TOLERANCE, load_family, make_p, max_pixel_diff

from ov_accelerate_webui.routing import is_routed

#: (module path from the model, routed method) of each part A1111 calls, per family.
ROUTED = {
    "sd2": [
        ("model.diffusion_model", "forward"),
        ("first_stage_model.decoder", "forward"),
        ("first_stage_model.encoder", "forward"),
        ("cond_stage_model.wrapped", "text_transformer_forward"),
    ],
    "sdxl": [
        ("model.diffusion_model", "forward"),
        ("first_stage_model.decoder", "forward"),
        ("first_stage_model.encoder", "forward"),
        ("conditioner.embedders.0.wrapped.transformer.text_model.encoder", "forward"),
        ("conditioner.embedders.1.wrapped", "text_transformer_forward"),
    ],
}


def _module(model: Any, path: str) -> Any:
    for name in path.split("."):
        model = model[int(name)] if name.isdigit() else getattr(model, name)
    return model


def routed_state(model: Any, family: str) -> list[bool]:
    return [is_routed(_module(model, path), method) for path, method in ROUTED[family]]


@pytest.mark.parametrize("family", ["sd2", "sdxl"])
def test_family_routed_called_restored_and_matches(fake_host: Any, extension: Any, f32: Any, family: str) -> None:
    model = load_family(fake_host, family)
    seen: list[list[bool]] = []
    fake_host.callbacks.on_cfg_denoiser(lambda params: seen.append(routed_state(model, family)))
    baseline = fake_host.processing.process_images(make_p(fake_host, model, negative_prompt=""))
    assert seen and not any(any(s) for s in seen)
    seen.clear()

    processed = extension.run(make_p(fake_host, model, negative_prompt=""), f32)

    assert seen and all(all(s) for s in seen), seen
    assert not any(routed_state(model, family))
    assert max_pixel_diff(processed, baseline) <= IMAGE_TOLERANCE
    assert 'OpenVINO: "CPU, UNet+VAE+TE, f32"' in processed.infotexts[0]
    status = extension.last_status
    for path, method in ROUTED[family]:  # what A1111 calls went through OpenVINO (the encoder: img2img only)
        label = path if method == "forward" else f"{path}.{method}"
        calls = re.search(re.escape(label) + r" \((\d+) calls?\)", status)
        assert (calls is not None) == (path != "first_stage_model.encoder"), status
