"""The backend is importable at generation time, when A1111 has taken the extension off ``sys.path``.

A1111 v1.10.1 puts an extension's folder first on ``sys.path`` only while it executes that extension's
``scripts/*.py`` and restores the previous list right after. The first milestone imported ``ov_backend``
lazily with a plain import and accelerated nothing in a real WebUI. These tests import packages
from a folder that is not on ``sys.path``; ``test_webui_host_fidelity.py`` loads the entry script from a
copy of the extension through the fake host's ``load_scripts`` (as A1111 does) and generates with it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ov_accelerate_webui.backend_bridge import import_sibling_package


def _write_package(root: Path, name: str, init: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(init)
    (root / name / "sub.py").write_text("VALUE = 42\n")


def test_sibling_package_and_its_submodules_import_without_sys_path(tmp_path: Path) -> None:
    name = "ovacc_test_sibling_ok"
    _write_package(tmp_path, name, "from . import sub\n")
    try:
        module = import_sibling_package(name, tmp_path)
        assert str(tmp_path) not in sys.path
        assert module.sub.VALUE == 42
        assert import_sibling_package(name, tmp_path) is module  # imported once
        import importlib

        assert importlib.import_module(f"{name}.sub").VALUE == 42
    finally:
        for key in [m for m in sys.modules if m.startswith(name)]:
            del sys.modules[key]


def test_a_package_that_fails_to_import_is_not_left_half_imported(tmp_path: Path) -> None:
    name = "ovacc_test_sibling_broken"
    _write_package(tmp_path, name, "raise ImportError('openvino is broken')\n")
    with pytest.raises(ImportError, match="openvino is broken"):
        import_sibling_package(name, tmp_path)
    assert name not in sys.modules
    with pytest.raises(ModuleNotFoundError, match="no_such_package"):
        import_sibling_package("no_such_package", tmp_path)
