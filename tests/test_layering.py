"""Imports point one way, down: backend <- SD layer <- WebUI adapter."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


HOST = {"modules", "gradio", "launch", "ov_accelerate_webui"}


def test_backend_knows_only_torch_and_openvino():
    for path, names in _imports("ov_backend").items():
        if path.endswith("__main__.py"):
            continue  # the CLI entry may dispatch lazily to the SD layer
        assert not names & (HOST | {"diffusers", "transformers", "ov_accelerate_sd"}), path


def test_sd_layer_knows_no_webui():
    for path, names in _imports("ov_accelerate_sd").items():
        assert not names & HOST, path


def test_the_webui_adapter_uses_only_the_backends_public_api():
    """The adapter reaches the backend through ``ov_backend``'s public names (``backend_bridge.ov_backend``),
    never by a module path in a string, nor by a submodule."""
    import re

    import ov_backend

    assert set(ov_backend.__all__) == set(ov_backend._EXPORTS) | {"BACKEND_NAME"}
    used: set[str] = set()
    for path in sorted((ROOT / "ov_accelerate_webui").glob("*.py")):
        source = path.read_text()
        assert not re.search(r"""import_module\(\s*f?["']ov_backend""", source), path.name
        assert not re.search(r"^\s*(from|import) ov_backend\.", source, re.M), path.name
        used |= set(re.findall(r"\bov_backend\.(\w+)", source))
    assert used, "the adapter uses no backend name: the check reads nothing"
    assert used <= set(ov_backend.__all__), used - set(ov_backend.__all__)


def test_importing_the_backend_or_the_adapter_loads_no_openvino():
    """The WebUI lists the script even where openvino cannot be imported: the adapter's modules and the
    backend's package (its name registered with dynamo) load OpenVINO only when a backend is made."""
    import subprocess
    import sys

    code = ("import sys; import ov_backend, ov_backend.precision, ov_accelerate_webui.extension, "
            "ov_accelerate_webui.xyz_axes, ov_accelerate_sd.backends; print(sorted(m for m in sys.modules "
            "if m.split('.')[0] == 'openvino'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_only_the_cluster_module_imports_ray():
    """Ray is an optional extra: the backend, the WebUI adapter and the rest of the SD layer never import it."""
    users = {path for package in ("ov_backend", "ov_accelerate_sd", "ov_accelerate_webui")
             for path, names in _imports(package).items() if "ray" in names}
    assert users == {"ov_accelerate_sd/batch_ray.py"}


def _sibling_imports(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` -> the modules of the package it imports (at the top or inside a function)."""
    graph: dict[str, set[str]] = {}
    for path in (ROOT / package).glob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        graph[path.stem] = names
    return graph


def test_the_sd_layers_modules_import_each_other_in_no_cycle():
    """The command line's modules do not import each other (``cli`` and the commands share ``console``)."""
    graph = _sibling_imports("ov_accelerate_sd")
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        for other in sorted(graph.get(module, ())):
            assert state.get(other) != 1, " -> ".join([*path, module, other])
            if other in graph and other not in state:
                walk(other, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [])
