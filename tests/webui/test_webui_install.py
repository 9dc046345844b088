"""install.py: pins every installed package as a constraint, installs only what is missing, checks the result."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
WEBUI_PINS = {"numpy": "1.26.2", "safetensors": "0.4.2", "huggingface-hub": "0.36.2", "gradio": "3.41.2"}


@pytest.fixture
def installer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("openvino_accelerate_install", ROOT / "install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeLaunch:
    """A1111's ``launch`` as install.py sees it; run_pip records the call and 'installs'."""

    def __init__(self, env: dict[str, str], result: dict[str, str]) -> None:
        self.env, self.result, self.calls = env, result, []
        self.constraints: list[str] = []

    def run_pip(self, command: str, desc: str | None = None, live: bool = False) -> str:
        self.calls.append(command)
        path = re.search(r'-c "([^"]+)"', command).group(1)
        self.constraints = Path(path).read_text().split()
        self.env.clear()
        self.env.update(self.result)
        return ""


def test_constraints_pin_everything_installed_except_what_is_installed(installer: ModuleType) -> None:
    installed = {**WEBUI_PINS, "openvino": "2024.6.0"}
    lines = installer.constraint_lines(installed, {"OpenVINO": "2026.4.1"})
    assert lines == sorted(f"{n}=={v}" for n, v in WEBUI_PINS.items())
    assert installer.normalize("Open_Clip.Torch") == "open-clip-torch"


def test_nothing_to_do_when_installed(installer: ModuleType) -> None:
    env = {**WEBUI_PINS, "openvino": "2026.4.1", "xxhash": "4.1.0"}
    launch = FakeLaunch(env, env)
    assert installer.install(launch, versions=lambda: dict(env), check_imports=lambda m: []) == []
    assert launch.calls == []


def test_installs_missing_with_constraints_and_accepts_clean_result(installer: ModuleType) -> None:
    env = dict(WEBUI_PINS)
    launch = FakeLaunch(env, {**WEBUI_PINS, "openvino": "2026.4.1", "openvino-telemetry": "2025.2.0",
                              "xxhash": "4.1.0"})
    problems = installer.install(launch, versions=lambda: dict(env), check_imports=lambda m: [])
    assert problems == []
    assert launch.calls and launch.calls[0].startswith('install "openvino==2026.4.1" "xxhash==4.1.0" -c ')
    assert sorted(launch.constraints) == sorted(f"{n}=={v}" for n, v in WEBUI_PINS.items())


def test_reports_a_moved_pin_and_a_failed_import(installer: ModuleType) -> None:
    env = dict(WEBUI_PINS)
    launch = FakeLaunch(env, {**WEBUI_PINS, "numpy": "2.1.0", "openvino": "2026.4.1", "xxhash": "4.1.0"})
    problems = installer.install(
        launch, versions=lambda: dict(env), check_imports=lambda m: ["'import openvino' fails: ImportError: x"]
    )
    assert "numpy moved from 1.26.2 to 2.1.0 (a WebUI pin changed)" in problems
    assert "'import openvino' fails: ImportError: x" in problems


def test_reports_pip_failure(installer: ModuleType) -> None:
    class Failing:
        def run_pip(self, command: str, desc: Any = None) -> str:
            raise RuntimeError("Couldn't install openvino: no matching distribution")

    problems = installer.install(Failing(), versions=lambda: dict(WEBUI_PINS), check_imports=lambda m: [])
    assert problems and "no matching distribution" in problems[0]


def test_installed_versions_reads_this_venv(installer: ModuleType) -> None:
    versions = installer.installed_versions()
    assert versions["gradio"] == "3.41.2" and versions["openvino"] == "2026.4.1" and versions["xxhash"] == "4.1.0"
    assert installer.import_problems(installer.IMPORT_CHECKS) == []
    assert installer.import_problems(("no_such_module_xyz",))[0].startswith("'import no_such_module_xyz' fails")


def test_nncf_is_optional_a_failure_to_install_it_is_a_warning(installer, monkeypatch, caplog) -> None:
    calls = []

    def fake_install(launch, requirements=installer.REQUIREMENTS, **kwargs):
        calls.append(dict(requirements))
        return [] if requirements is installer.REQUIREMENTS else ["pip could not install ['nncf']: offline"]

    monkeypatch.setattr(installer, "install", fake_install)
    monkeypatch.setitem(__import__("sys").modules, "launch", object())
    assert installer.main() == 0
    assert calls == [{"openvino": "2026.4.1", "xxhash": "4.1.0"}, {"nncf": "3.4.0"}]
    assert "only the INT8 precision needs it" in caplog.text

    calls.clear()
    monkeypatch.setattr(installer, "install", lambda launch, requirements=None, **kw: calls.append(1) or ["broken"])
    assert installer.main() == 1 and calls == [1]  # openvino failed: nncf is not tried
