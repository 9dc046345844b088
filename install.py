"""Installs what "Accelerate with OpenVINO" needs into the WebUI's venv, without moving any WebUI pin.

A1111 runs this file at every start (``python install.py`` with the WebUI root on ``PYTHONPATH``).
Every installed distribution is passed to pip as a constraint (``name==version``), so pip can add
openvino and its own dependencies but cannot upgrade or downgrade anything the WebUI pinned. The
result is checked afterwards: a moved version or an openvino that does not import is reported with
the fix, and the script's panel shows the same problem at load.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from importlib import metadata
from typing import Any

logger = logging.getLogger("openvino_accelerate.install")

#: Distribution -> exact version the extension needs (tested next to the WebUI's pins). xxhash (no
#: dependencies) fingerprints new weights, a checkpoint or a LoRA, ten times faster than sha256.
REQUIREMENTS: dict[str, str] = {"openvino": "2026.4.1", "xxhash": "4.1.0"}
#: Modules that must import after installing (checked in a fresh interpreter).
IMPORT_CHECKS: tuple[str, ...] = ("openvino", "xxhash")
#: Installed the same way, but only the INT8 precision needs them: a failure is a warning, and INT8 then
#: says what to install. nncf 3.4.0 adds packages to A1111 v1.10.1's venv but moves none of its pins.
OPTIONAL_REQUIREMENTS: dict[str, str] = {"nncf": "3.4.0"}
OPTIONAL_IMPORT_CHECKS: tuple[str, ...] = ("nncf",)


def normalize(name: str) -> str:
    """PEP 503 name: "Open_Clip.Torch" -> "open-clip-torch"."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_versions() -> dict[str, str]:
    """Normalized name -> version of every distribution in this interpreter's environment."""
    versions: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and dist.version:
            versions[normalize(name)] = dist.version
    return versions


def missing(requirements: Mapping[str, str], installed: Mapping[str, str]) -> dict[str, str]:
    """Requirements that are absent or at another version."""
    return {name: version for name, version in requirements.items() if installed.get(normalize(name)) != version}


def constraint_lines(installed: Mapping[str, str], installing: Mapping[str, str]) -> list[str]:
    """``name==version`` for every installed distribution except those being installed, sorted."""
    skip = {normalize(name) for name in installing}
    return sorted(f"{name}=={version}" for name, version in installed.items() if name not in skip)


def moved_versions(
    before: Mapping[str, str], after: Mapping[str, str], installing: Mapping[str, str]
) -> dict[str, tuple[str, str | None]]:
    """Distributions (other than those being installed) whose version changed or that disappeared."""
    skip = {normalize(name) for name in installing}
    return {
        name: (version, after.get(name))
        for name, version in before.items()
        if name not in skip and after.get(name) != version
    }


def import_problems(modules: tuple[str, ...]) -> list[str]:
    """Modules that fail to import in a fresh interpreter, with the error's last line."""
    problems = []
    for module in modules:
        result = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["unknown error"])[-1]
            problems.append(f"'import {module}' fails: {last}")
    return problems


def install(
    launch: Any,
    requirements: Mapping[str, str] = REQUIREMENTS,
    versions: Any = installed_versions,
    check_imports: Any = import_problems,
    imports: tuple[str, ...] = IMPORT_CHECKS,
) -> list[str]:
    """Install what is missing with ``launch.run_pip`` under constraints; return the problems found.

    Args:
        launch: A1111's ``launch`` module (``run_pip(args, desc)``).
        requirements: name -> exact version.
        versions: returns the installed versions (called before and after).
        check_imports: returns problems of importing the required modules.
        imports: the modules ``check_imports`` is asked about.
    """
    before = versions()
    todo = missing(requirements, before)
    if not todo:
        return []
    fd, path = tempfile.mkstemp(prefix="openvino-accelerate-constraints-", suffix=".txt")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write("\n".join(constraint_lines(before, todo)) + "\n")
        specs = " ".join(f'"{name}=={version}"' for name, version in sorted(todo.items()))
        launch.run_pip(f'install {specs} -c "{path}"', f"Accelerate with OpenVINO requirements ({specs})")
    except Exception as exc:  # run_pip raises RuntimeError with pip's output
        return [f"pip could not install {sorted(todo)}: {exc}"]
    finally:
        os.unlink(path)
    after = versions()
    problems = [
        f"{name} is {after.get(normalize(name))} after installing, expected {version}"
        for name, version in missing(requirements, after).items()
    ]
    problems += [
        f"{name} moved from {old} to {new} (a WebUI pin changed)"
        for name, (old, new) in sorted(moved_versions(before, after, todo).items())
    ]
    return problems + check_imports(imports)


def main() -> int:
    """Entry point when A1111 runs this file."""
    logging.basicConfig(level=logging.INFO, format="[Accelerate with OpenVINO] %(message)s")
    import launch  # A1111's launch module, importable because the WebUI root is on PYTHONPATH

    problems = install(launch)
    for problem in problems:
        logger.error("%s", problem)
    if problems:
        logger.error(
            "Fix: in the WebUI's venv run: python -m pip install %s -c <pip freeze of the venv>; "
            "the script's panel shows this problem too.",
            " ".join(f"{n}=={v}" for n, v in REQUIREMENTS.items()),
        )
        return 1
    for problem in install(launch, OPTIONAL_REQUIREMENTS, imports=OPTIONAL_IMPORT_CHECKS):
        logger.warning("%s; only the INT8 precision needs it (the others work without it)", problem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
