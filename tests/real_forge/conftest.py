"""The Forge tier: a real Forge (main at dfdcbab6, CPU, offline) with the extension cloned into its ``extensions/``
folder, driven over HTTP.

Needs the Forge test bed (``bash .ci/testbed``, which ``.ci/test`` runs); without it every test here is skipped
with the reason, or fails when the bed is required (``OV_REAL_FORGE=require``, which ``.ci/test`` sets when it
built the bed; unset, ``OV_REAL_WEBUI=require`` requires it too). The API-only modules share one Forge process;
the browser tests get one with its UI.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from .forge import Forge, forge_testbed_ready, forge_testbed_root


def usable_forge_testbed() -> Path:
    """The Forge bed's folder; skips (fails when required) when there is none."""
    root = forge_testbed_root()
    if not forge_testbed_ready(root):
        message = f"no Forge test bed in {root}: run `bash .ci/testbed` (or set FORGE_ROOT)"
        if os.environ.get("OV_REAL_FORGE", os.environ.get("OV_REAL_WEBUI")) == "require":
            pytest.fail(message)
        pytest.skip(message)
    return root


def started_forge(tmp_path_factory: pytest.TempPathFactory, name: str, ui: bool) -> Iterator[Forge]:
    """A Forge of its own data folder (``name``), started on the tier's SD 1.5 checkpoint with this project cloned
    into its extensions/, stopped afterwards."""
    root = usable_forge_testbed()
    forge = Forge(root, tmp_path_factory.mktemp(f"{name}-data"), tmp_path_factory.mktemp(f"{name}-logs"), ui=ui)
    forge.prepare([])
    forge.start()
    try:
        yield forge
    finally:
        forge.stop()


@pytest.fixture(scope="package")
def forge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Forge]:
    """Forge, API only, one process for the tier's modules (stock Forge's, then the extension's: a start and a
    checkpoint load less); stopped after the tier, so the A1111 tier that runs next in CI gets the memory."""
    yield from started_forge(tmp_path_factory, "forge", ui=False)


@pytest.fixture(scope="module")
def forge_ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Forge]:
    """Forge with its UI (for the browser tests of one module)."""
    yield from started_forge(tmp_path_factory, "forge-ui", ui=True)
