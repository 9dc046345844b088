"""Only ``host.py`` reaches A1111's ``modules`` and gradio; the entry point stays a handful of lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ov_accelerate_webui"
HOST_ONLY = ("modules", "gradio")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_only_host_imports_the_webui_and_gradio() -> None:
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name != "host.py":
            assert not _imports(path) & set(HOST_ONLY), path.name
    source = (PACKAGE / "host.py").read_text()
    assert '_module("modules.scripts")' in source and '_module("gradio")' in source


def test_modules_are_small_and_documented() -> None:
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), path.name
        assert len(path.read_text().splitlines()) < 400, path.name
        assert "logger = logging.getLogger(__name__)" in path.read_text(), path.name
    entry = (ROOT / "scripts" / "openvino_accelerate.py").read_text().splitlines()
    assert len([line for line in entry if line.strip()]) <= 8
