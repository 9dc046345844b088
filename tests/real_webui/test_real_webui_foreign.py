"""Another extension's UNet patch in a real WebUI: never hidden by the status, the status route or the infotext.

The test-only extension ovtest-perturb (part "replace-unet") replaces the UNet's forward in its ``process``
with one that runs the class's forward, as sd-webui-controlnet's hook does. Through the dropdown entry, our
route is installed first and is then never called; through the section, the replacement is there first and
is left in place. Either way that forward calls the UNet's blocks, which then run in OpenVINO one by one: the
picture is stock's and the status says how the UNet ran and whose forward called its blocks. With part
"replace-unet-inner" a block's forward is replaced too (as ControlNet's reference-only does): the UNet then
runs in PyTorch, and the status names the replacement and its extension; the VAE and the text encoder stay
in OpenVINO either way.
"""

from __future__ import annotations

from typing import Any

import pytest

from .test_real_webui import MIN_PSNR, accelerated, assert_ran_in_openvino, min_psnr, request
from .test_real_webui_section import fresh, with_section
from .webui import WebUI


def replacing_unet(payload: dict[str, Any], part: str = "replace-unet") -> dict[str, Any]:
    scripts = dict(payload.get("alwayson_scripts") or {})
    scripts["ovtest perturb"] = {"args": [part, 0]}
    return dict(payload, alwayson_scripts=scripts)


def through(how: str, payload: dict[str, Any]) -> dict[str, Any]:
    return accelerated(payload) if how == "dropdown" else with_section(payload)


@pytest.mark.parametrize("how", ["dropdown", "section"])
def test_a_foreign_unet_forward_that_calls_the_blocks_runs_them_in_openvino(webui: WebUI, how: str) -> None:
    payload = request(f"a harbour crane at dawn, {how}", steps=4)
    stock = webui.generate(replacing_unet(fresh(payload)))
    fast = webui.generate(through(how, replacing_unet(fresh(payload))))
    status = webui.status()
    assert_ran_in_openvino(status)
    assert status["calls"]["model.diffusion_model"] == 4, status["calls"]  # (cond and uncond in one call per step)
    assert not status["pytorch"], status["pytorch"]
    assert "blocks ran in OpenVINO one by one" in status["status"], status["status"]
    assert "controlnet_like_forward (extension ovtest-perturb)" in status["status"], status["status"]
    assert "in PyTorch" not in fast.infotexts[0], fast.infotexts[0]
    value = min_psnr(stock, fast)
    webui.record(f"foreign UNet forward ({how}): the UNet's blocks in OpenVINO", value)
    assert value >= MIN_PSNR


@pytest.mark.parametrize(("how", "said"), [("dropdown", "was replaced during the generation by"),
                                           ("section", "another extension replaced its forward before")])
def test_a_foreign_unet_patch_inside_the_blocks_is_reported_not_hidden(webui: WebUI, how: str, said: str) -> None:
    payload = request(f"a harbour crane at night, {how}")
    stock = webui.generate(replacing_unet(fresh(payload), "replace-unet-inner"))
    fast = webui.generate(through(how, replacing_unet(fresh(payload), "replace-unet-inner")))
    status = webui.status()
    assert_ran_in_openvino(status, ("VAE", "TE"))
    assert status["calls"]["model.diffusion_model"] == 0, status["status"]
    unet = status["pytorch"]["model.diffusion_model"]
    assert said in unet["why"] and "controlnet_like_forward (extension ovtest-perturb)" in unet["why"], unet
    assert "group_norm_like_forward (extension ovtest-perturb)" in unet["why"], unet
    assert "Ran in PyTorch, not OpenVINO: model.diffusion_model" in status["status"], status["status"]
    assert "Attention in the UNet" not in status["status"] and "Nothing fell back" not in status["status"]
    assert "; UNet in PyTorch" in fast.infotexts[0], fast.infotexts[0]
    assert "ovtest-perturb" in webui.log_text()
    value = min_psnr(stock, fast)
    webui.record(f"foreign UNet patch inside the blocks ({how}): UNet in PyTorch, reported", value)
    assert value >= MIN_PSNR
    after = webui.generate(through(how, fresh(payload)))
    assert_ran_in_openvino(webui.status())  # the next generation without the patch: the UNet in OpenVINO again
    assert "UNet in PyTorch" not in after.infotexts[0]
