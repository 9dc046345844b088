"""sd-webui-controlnet in stock AUTOMATIC1111 v1.10.1: the test bed's random ControlNet is live.

Comparing OpenVINO with stock A1111 under ControlNet means something only if stock's picture depends on the
ControlNet. These checks run stock A1111 alone (no OpenVINO) in a WebUI with ControlNet (``webui_controlnet``,
see ``controlnet.py``), on the bed's full-size random SD 1.5 checkpoint with the random ControlNet made by
``make_controlnet.py`` (module "none", white shapes on black as the control image): a unit at weight 1 moves
the picture far below the tier's 40 dB match, the same request gives the same picture again, weight 0.5 is
another picture again, and ControlNet's own X/Y/Z weight axis makes the cells the single requests make. Then
the same through OpenVINO (a unit turned off again, through OpenVINO, against stock without ControlNet: no
stale control).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image

from .controlnet import (
    CONTROLNET_AXES,
    CONTROLNET_CHECKPOINT,
    CONTROLNET_SCRIPT,
    control_image,
    controlnet_model_name,
    controlnet_unit,
    controlnet_xyz_args,
    with_controlnet,
)
from .test_real_webui import MIN_PSNR, accelerated, assert_ran_in_openvino, min_psnr, request
from .test_real_webui_section import fresh, with_section
from .webui import SCRIPT_NAME, Result, WebUI, psnr

#: The label of ControlNet's networks in the status route's calls.
CONTROL_ROUTE = "controlnet.control_model"
#: A unit at weight 1 must move stock's picture below this (the tier matches pictures at ``MIN_PSNR``).
MOVED_BELOW = 30.0
#: The request of every check (64x64, 3 steps, a fixed seed).
PAYLOAD = request("a lighthouse on a cliff")


class Stock:
    """Stock pictures of :data:`PAYLOAD` without ControlNet (weight None) and with one unit at a weight, each
    made once for the module."""

    def __init__(self, ui: WebUI, model: str) -> None:
        self.ui, self.model = ui, model
        self.made: dict[float | None, Result] = {}

    def __call__(self, weight: float | None) -> Result:
        if weight not in self.made:
            unit = None if weight is None else controlnet_unit(self.model, weight=weight)
            payload = PAYLOAD if unit is None else with_controlnet(PAYLOAD, unit)
            self.made[weight] = self.ui.generate(fresh(payload))
        return self.made[weight]


@pytest.fixture(scope="module")
def model(webui_controlnet: WebUI) -> Iterator[str]:
    """The random ControlNet's name, with the SD 1.5 checkpoint loaded (selected through the options, as the
    dropdown does; the WebUI started on it) and put back afterwards."""
    ui = webui_controlnet
    before = ui.get("/sdapi/v1/options")["sd_model_checkpoint"]
    ui.call("/sdapi/v1/options", {"sd_model_checkpoint": CONTROLNET_CHECKPOINT})
    try:
        yield controlnet_model_name(ui)
    finally:
        ui.call("/sdapi/v1/options", {"sd_model_checkpoint": before})


@pytest.fixture(scope="module")
def stock(webui_controlnet: WebUI, model: str) -> Stock:
    return Stock(webui_controlnet, model)


def test_controlnet_is_loaded_with_the_random_model_and_its_axes(webui_controlnet: WebUI, model: str) -> None:
    ui = webui_controlnet
    log = ui.log_text()
    assert "Error loading script" not in log and "Traceback" not in log, ui.log_tail()
    assert "OpenVINO acceleration is unavailable" not in log
    info = ui.get("/sdapi/v1/script-info")
    controlnet = next(s for s in info if s["name"] == CONTROLNET_SCRIPT.lower() and not s["is_img2img"])
    assert controlnet["is_alwayson"], controlnet
    assert SCRIPT_NAME in ui.get("/sdapi/v1/scripts")["txt2img"]  # this project beside it
    assert model.startswith("ovtest-controlnet-sd15 ["), model
    xyz = next(s for s in info if s["name"] == "x/y/z plot" and not s["is_img2img"])
    axes = next(a for a in xyz["args"] if a["label"] == "X type")["choices"]
    assert set(CONTROLNET_AXES.values()) <= set(axes), [a for a in axes if "ControlNet" in a]


def test_a_unit_moves_the_picture(webui_controlnet: WebUI, stock: Stock) -> None:
    """(That the same request gives the same picture again is shown by the X/Y/Z test below: its cells, other
    jobs, are bit-identical to the single requests' pictures.)"""
    ui = webui_controlnet
    none, first = stock(None), stock(1.0)
    assert 'ControlNet 0: "Module: none, Model: ovtest-controlnet-sd15' in first.infotexts[0], first.infotexts[0]
    moved = min_psnr(none, first)
    ui.record(f"stock: ControlNet at weight 1 vs without (WebUI start {ui.start_seconds:.0f} s; a generation "
              f"{none.seconds:.1f} s without, {first.seconds:.1f} s with)", moved)
    assert moved < MOVED_BELOW
    assert np.std(first.images[0]) > 5  # a picture, not a flat (or NaN-black) field


def test_weight_half_is_a_picture_of_its_own(webui_controlnet: WebUI, stock: Stock) -> None:
    ui = webui_controlnet
    none, half, full = stock(None), stock(0.5), stock(1.0)
    half_full, half_none = min_psnr(half, full), min_psnr(half, none)
    ui.record("stock: ControlNet at weight 0.5 vs 1", half_full)
    ui.record("stock: ControlNet at weight 0.5 vs without", half_none)
    assert half_full < MIN_PSNR and half_none < MIN_PSNR
    assert half_none > min_psnr(full, none)  # half the control moves the picture less


def test_controlnet_weight_axis_of_the_xyz_plot(webui_controlnet: WebUI, stock: Stock) -> None:
    """ControlNet's ``[ControlNet] Weight`` axis over a unit of the request (at another weight): one cell per
    weight, each the picture of that weight's single request, bit for bit (so stock is deterministic: another
    job gives the same picture again)."""
    ui = webui_controlnet
    xyz = dict(PAYLOAD, script_name="x/y/z plot", script_args=controlnet_xyz_args(ui, "weight", ["0.5", "1"]))
    grid = ui.generate(fresh(with_controlnet(xyz, controlnet_unit(stock.model, weight=0.2))))
    assert len(grid.images) == 1 + 2, len(grid.images)  # the grid and each cell
    half, full = grid.images[1], grid.images[2]
    ui.record(f"stock: X/Y/Z over [ControlNet] Weight, cell 0.5 vs cell 1 (the job {grid.seconds:.1f} s)",
              psnr(half, full))
    assert psnr(half, full) < MIN_PSNR
    assert psnr(half, stock(0.5).images[0]) == math.inf
    assert psnr(full, stock(1.0).images[0]) == math.inf
    assert "ControlNet 0:" in grid.infotexts[1] and "Weight: 0.5" in grid.infotexts[1], grid.infotexts[1]


# ---------------------------------------------------------------- through OpenVINO


def assert_controlnet_in_openvino(status: dict, steps: int, control_calls: int | range) -> None:
    """The whole job in OpenVINO: the UNet block by block under ControlNet's forward (one call per step), the
    ControlNet network (``control_calls`` calls), the VAE and the text encoder, nothing in PyTorch."""
    assert_ran_in_openvino(status)
    assert not status["pytorch"], status["pytorch"]
    assert status["calls"]["model.diffusion_model"] == steps, status["calls"]
    calls = status["calls"].get(CONTROL_ROUTE, 0)
    assert calls in control_calls if isinstance(control_calls, range) else calls == control_calls, status["calls"]
    assert "blocks ran in OpenVINO one by one" in status["status"], status["status"]
    assert "(extension sd-webui-controlnet)" in status["status"], status["status"]


@pytest.fixture(scope="module")
def first_accelerated(webui_controlnet: WebUI, stock: Stock) -> Result:
    """The module's first accelerated generation (a unit at weight 1: it compiles), its status attached; the
    tests after it that assert "compiles nothing" need it done."""
    ui = webui_controlnet
    fast = ui.generate(accelerated(fresh(with_controlnet(PAYLOAD, controlnet_unit(stock.model)))))
    fast.status = ui.status()
    return fast


def test_accelerated_with_controlnet_matches_stock_and_a_new_weight_compiles_nothing(
        webui_controlnet: WebUI, stock: Stock, first_accelerated: Result) -> None:
    ui = webui_controlnet
    fast, status = first_accelerated, first_accelerated.status
    assert_controlnet_in_openvino(status, PAYLOAD["steps"], PAYLOAD["steps"])
    assert 'OpenVINO: "CPU, UNet+VAE+TE, f32"' in fast.infotexts[0] and "in PyTorch" not in fast.infotexts[0]
    assert 'ControlNet 0: "Module: none' in fast.infotexts[0]
    value = min_psnr(stock(1.0), fast)
    ui.record(f"ControlNet at weight 1, accelerated vs stock (first: {status['compiles']} compiles, "
              f"{fast.seconds:.1f} s)", value)
    assert value >= MIN_PSNR
    half = ui.generate(accelerated(fresh(with_controlnet(PAYLOAD, controlnet_unit(stock.model, weight=0.5)))))
    status = ui.status()
    assert_controlnet_in_openvino(status, PAYLOAD["steps"], PAYLOAD["steps"])
    assert status["compiles"] == 0 and status.get("convert_seconds", 0) == 0, status["status"]
    value = min_psnr(stock(0.5), half)
    ui.record(f"ControlNet at weight 0.5, accelerated vs stock ({half.seconds:.1f} s)", value)
    assert value >= MIN_PSNR


def test_new_units_compile_nothing_and_a_unit_turned_off_leaves_no_stale_control(
        webui_controlnet: WebUI, stock: Stock, first_accelerated: Result) -> None:
    """A new control image, guidance range, control mode or a second unit compiles nothing (the first
    accelerated generation compiled); then, right after an accelerated job with units, a unit turned off runs
    the whole UNet and gives stock's picture without ControlNet: no stale control."""
    ui = webui_controlnet
    steps = PAYLOAD["steps"]
    other_image = control_image().transpose(Image.Transpose.ROTATE_90)
    changes = {
        "a new control image": ([controlnet_unit(stock.model, other_image)], steps),
        # ControlNet skips its network on the steps past the range's end
        "guidance end 0.2": ([controlnet_unit(stock.model, guidance_end=0.2)], range(1, steps)),
        "ControlNet is more important": ([controlnet_unit(stock.model, control_mode="ControlNet is more important")],
                                         steps),
        "a second unit": ([controlnet_unit(stock.model), controlnet_unit(stock.model, other_image, weight=0.5)],
                          2 * steps),
    }
    for what, (units, control_calls) in changes.items():
        reference = ui.generate(fresh(with_controlnet(PAYLOAD, *units))) if what == "a second unit" else None
        fast = ui.generate(accelerated(fresh(with_controlnet(PAYLOAD, *units))))
        status = ui.status()
        assert_controlnet_in_openvino(status, steps, control_calls)
        assert status["compiles"] == 0 and status.get("convert_seconds", 0) == 0, (what, status["status"])
        if reference is not None:
            value = min_psnr(reference, fast)
            ui.record("ControlNet, two units, accelerated vs stock", value)
            assert value >= MIN_PSNR

    # the job before this one ran two units through OpenVINO
    off = ui.generate(accelerated(fresh(with_controlnet(PAYLOAD, controlnet_unit(stock.model, enabled=False)))))
    status = ui.status()
    assert_ran_in_openvino(status)
    assert CONTROL_ROUTE not in status["calls"] and "one by one" not in status["status"], status["status"]
    assert status["calls"]["model.diffusion_model"] == PAYLOAD["steps"]
    value = min_psnr(stock(None), off)
    ui.record("ControlNet unit off again, accelerated vs stock without ControlNet", value)
    assert value >= MIN_PSNR


def test_controlnet_weight_axis_with_the_section(webui_controlnet: WebUI, stock: Stock) -> None:
    """ControlNet's own X/Y/Z axis, with the always-on section enabled: each cell through OpenVINO, as stock's."""
    ui = webui_controlnet
    xyz = dict(PAYLOAD, script_name="x/y/z plot", script_args=controlnet_xyz_args(ui, "weight", ["0.5", "1"]))
    grid = ui.generate(with_section(fresh(with_controlnet(xyz, controlnet_unit(stock.model, weight=0.2)))))
    status = ui.status()
    assert status["generations"] == 2 and status["plain_generations"] == 0, status["status"]
    assert status["calls"]["model.diffusion_model"] == 2 * PAYLOAD["steps"], status["calls"]
    assert status["calls"][CONTROL_ROUTE] == 2 * PAYLOAD["steps"] and not status["pytorch"], status["status"]
    assert len(grid.images) == 1 + 2, len(grid.images)
    half, full = psnr(grid.images[1], stock(0.5).images[0]), psnr(grid.images[2], stock(1.0).images[0])
    cells = min(half, full)
    ui.record(f"X/Y/Z over [ControlNet] Weight with the section, cells vs stock (0.5: {half:.1f} dB, 1: {full:.1f} dB)",
              cells)
    assert cells >= MIN_PSNR


def test_reference_only_runs_the_unet_in_pytorch_and_says_why(webui_controlnet: WebUI, stock: Stock) -> None:
    """Reference-only has no network: it writes attention banks from a reference pass of the UNet's original
    forward, by replacing its transformer blocks' forwards. The UNet then runs ControlNet's way, in PyTorch."""
    ui = webui_controlnet
    unit = controlnet_unit("None", module="reference_only")
    reference = ui.generate(fresh(with_controlnet(PAYLOAD, unit)))
    fast = ui.generate(accelerated(fresh(with_controlnet(PAYLOAD, unit))))
    status = ui.status()
    assert_ran_in_openvino(status, ("VAE", "TE"))
    assert status["calls"]["model.diffusion_model"] == 0, status["calls"]
    unet = status["pytorch"]["model.diffusion_model"]["why"]
    # (its reference pass calls our route, which then runs in PyTorch: a compiled graph would not follow the banks)
    assert "replaced methods inside it" in unet and "hacked_basic_transformer_inner_forward" in unet, unet
    kind = status["pytorch"]["ControlNet unit 1 (AttentionInjection)"]["why"]
    assert "type AttentionInjection" in kind, kind
    assert "UNet in PyTorch" in fast.infotexts[0] and "ControlNet unit 1 in PyTorch" in fast.infotexts[0]
    value = min_psnr(reference, fast)
    ui.record("ControlNet reference-only (UNet in PyTorch), accelerated vs stock", value)
    assert value >= MIN_PSNR
    assert min_psnr(reference, stock(None)) < MIN_PSNR  # the reference moved stock's picture
