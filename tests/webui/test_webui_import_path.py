"""The backend is importable at generation time, when A1111 has taken the extension off ``sys.path``.

A1111 v1.10.1 puts an extension's folder first on ``sys.path`` only while it executes that extension's
``scripts/*.py`` and restores the previous list right after. The first milestone imported ``ov_backend``
lazily with a plain import and accelerated nothing in a real WebUI. These tests load the entry script
from a copy of the extension the way A1111 does, with every other route to the project's packages
removed, and then import the backend as a generation would.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ov_accelerate_webui.backend_bridge import import_sibling_package

ROOT = Path(__file__).resolve().parents[2]
FAKE_HOST = Path(__file__).parent / "fake_a1111"

# Run in a child: drop the checkout and the editable install's finders, load the script as A1111's
# load_scripts() does (folder first on sys.path, then the old list back), then import the backend.
CHILD = textwrap.dedent(
    """
    import importlib.util, json, sys
    ext, checkout, fake_host = sys.argv[1:4]
    sys.path[:] = [p for p in sys.path if p not in ("", ".", checkout)] + [fake_host]
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()
                        and "editable" not in getattr(f, "__name__", "").lower()]
    packages = ("ov_backend", "ov_accelerate_sd", "ov_accelerate_webui")
    for name in [m for m in sys.modules if m.split(".")[0] in packages]:
        del sys.modules[name]
    saved = sys.path
    sys.path = [ext] + sys.path
    try:
        spec = importlib.util.spec_from_file_location("openvino_accelerate", ext + "/scripts/openvino_accelerate.py")
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
    finally:
        sys.path = saved
    before = list(sys.path)
    plain = importlib.util.find_spec("ov_backend")
    api = script.loaded.extension.api()
    import ov_backend
    print(json.dumps({
        "plain_import_possible": plain is not None,
        "backend_file": ov_backend.__file__,
        "devices": [name for name, _ in api.list_devices()],
        "sys_path_unchanged": sys.path == before,
    }))
    """
)


def test_backend_imports_at_generation_time_after_a1111_restored_sys_path(tmp_path: Path) -> None:
    ext = tmp_path / "extensions" / "sd-webui-openvino-accelerate"
    for part in ("scripts", "ov_accelerate_webui", "ov_accelerate_sd", "ov_backend"):
        shutil.copytree(ROOT / part, ext / part, ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(ext), str(ROOT), str(FAKE_HOST)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    report = json.loads(result.stdout.strip().splitlines()[-1])
    # The setting of the bug: nothing outside the extension's folder could find the backend...
    assert report["plain_import_possible"] is False
    # ...and yet the extension found its own copy, and left sys.path as A1111 set it.
    assert Path(report["backend_file"]).resolve().is_relative_to(ext.resolve())
    assert "CPU" in report["devices"]
    assert report["sys_path_unchanged"] is True


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
