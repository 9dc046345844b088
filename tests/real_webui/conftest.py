"""The real-host tier: a real AUTOMATIC1111 WebUI v1.10.1 (CPU, offline) with the extension cloned into
its ``extensions/`` folder, driven over HTTP and in headless Chromium.

Needs the test bed (``bash .ci/testbed``, which ``.ci/test`` runs); without it every test here is
skipped with the reason. One WebUI process serves the whole module; tests that restart it say so.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from .controlnet import controlnet_missing, prepare_controlnet_webui
from .webui import CHECKPOINT_A, WebUI, testbed_ready, testbed_root

PERTURB_EXTENSION = Path(__file__).with_name("ovtest-perturb")
OPEN_CLIP_EXTENSION = Path(__file__).with_name("ovtest-open-clip")  # the SDXL and SD 2.x models' tiny OpenCLIP


def usable_testbed() -> Path:
    """The test bed's folder; skips (fails with ``OV_REAL_WEBUI=require``) when there is none."""
    root = testbed_root()
    if not testbed_ready(root):
        message = f"no WebUI test bed in {root}: run `bash .ci/testbed` (or set A1111_ROOT)"
        if os.environ.get("OV_REAL_WEBUI") == "require":
            pytest.fail(message)
        pytest.skip(message)
    hidden = [part for part in root.resolve().parts if part.startswith(".")]
    if hidden:  # gradio 3.41 refuses files under a dot folder: the WebUI's own scripts would not load
        pytest.fail(f"the test bed {root} is inside a hidden folder ({hidden[0]}): the WebUI's gradio refuses to "
                    "serve files from there (its page scripts get 403); build it elsewhere (A1111_ROOT)")
    return root


@pytest.fixture(scope="session")
def webui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebUI]:
    root = usable_testbed()
    data = tmp_path_factory.mktemp("webui-data")
    ui = WebUI(root, data, tmp_path_factory.mktemp("webui-logs"))
    ui.prepare([PERTURB_EXTENSION, OPEN_CLIP_EXTENSION])
    ui.start()
    try:
        yield ui
    finally:
        ui.stop()


@pytest.fixture
def checkpoint(webui: WebUI, request: pytest.FixtureRequest) -> Iterator[str]:
    """The checkpoint of the test's parameter, loaded through the options (as the dropdown does), and the
    tier's SD 1.5-shaped checkpoint back afterwards. ``CLIP_stop_at_last_layers`` is written to the options
    first, so that A1111 restores it after each request that overrides it."""
    name = request.param
    webui.call("/sdapi/v1/options", {"sd_model_checkpoint": name, "CLIP_stop_at_last_layers": 1})
    try:
        yield name
    finally:
        webui.call("/sdapi/v1/options", {"sd_model_checkpoint": CHECKPOINT_A})


@pytest.fixture(scope="module")
def webui_controlnet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebUI]:
    """A second WebUI, with sd-webui-controlnet beside this project (and ovtest-perturb), started with
    ``--skip-install`` on the bed's full-size random SD 1.5 checkpoint (see ``controlnet.py``). The session's
    ``webui`` never gets ControlNet."""
    root = usable_testbed()
    missing = controlnet_missing(root)
    if missing:
        if os.environ.get("OV_REAL_WEBUI") == "require":
            pytest.fail(missing)
        pytest.skip(missing)
    ui = WebUI(root, tmp_path_factory.mktemp("webui-controlnet-data"), tmp_path_factory.mktemp("webui-controlnet-logs"))
    prepare_controlnet_webui(ui, [PERTURB_EXTENSION])
    ui.start()
    try:
        yield ui
    finally:
        ui.stop()
