"""Loads ov_backend (and through it openvino) on first use, and explains what to do when it cannot.

The script must still appear in the dropdown when openvino is missing or broken, so nothing here
imports the backend at module import time.

A1111 puts an extension's folder on ``sys.path`` only while it executes that extension's scripts and
restores the previous ``sys.path`` right after, so at generation time a plain ``import ov_backend``
fails with ModuleNotFoundError. The backend is therefore imported from this extension's own folder by
location (:func:`import_sibling_package`), without touching ``sys.path``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

FIX_HINT = (
    "Restart the WebUI so that the extension's install.py can install it, or run in the WebUI's venv: "
    "python -m pip install openvino==2026.4.1 (with the installed packages as constraints, as install.py "
    "does)."
)


#: The extension's root folder, which holds ``ov_backend`` beside this package.
EXTENSION_ROOT = Path(__file__).resolve().parent.parent


def import_sibling_package(name: str, root: Path = EXTENSION_ROOT) -> ModuleType:
    """Import the top-level package ``name`` from ``root``, whether or not ``root`` is on ``sys.path``.

    A package already in ``sys.modules`` is returned as is. Once the package is imported, its
    submodules (``name.x``) import normally through the package's ``__path__``.

    Raises:
        ModuleNotFoundError: ``root`` holds no package ``name``.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.machinery.PathFinder.find_spec(name, [str(root)])
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r} in {root}", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


class BackendUnavailable(Exception):
    """ov_backend or openvino cannot be imported; the message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class BackendApi:
    """The parts of ov_backend the adapter uses."""

    build_settings: Callable[[dict[str, Any]], Any]
    """``ov_backend.build_settings``: options dict -> validated backend settings."""
    backend_class: Callable[[Any], Any]
    """``ov_backend.OVBackend``: settings -> backend instance usable with torch.compile."""
    list_devices: Callable[[], list[tuple[str, str]]]
    """``ov_backend.devices.list_devices``: [(name, full name)]."""
    model_cache: Callable[[str], Any]
    """``ov_backend.cache.ModelCache``: folder -> cache object (entries, total_bytes, clear, prune)."""


def backend_module(name: str) -> ModuleType:
    """The module ``ov_backend.<name>`` of this extension's own copy of the backend.

    Raises:
        ModuleNotFoundError, or whatever importing openvino raises when it is broken.
    """
    import_sibling_package("ov_backend")
    return importlib.import_module(f"ov_backend.{name}")


def load_backend() -> BackendApi:
    """Import ov_backend and return its API.

    Raises:
        BackendUnavailable: with the import error and the fix.
    """
    try:
        backend = import_sibling_package("ov_backend")
        return BackendApi(
            build_settings=backend.build_settings,
            backend_class=backend.OVBackend,
            list_devices=backend_module("devices").list_devices,
            model_cache=backend_module("cache").ModelCache,
        )
    except Exception as exc:  # ImportError, or a broken openvino raising anything at import
        message = (
            f"OpenVINO acceleration is unavailable: {type(exc).__name__}: {exc}. "
            f"Python {sys.version.split()[0]} at {sys.executable}. {FIX_HINT}"
        )
        logger.error("%s", message)
        raise BackendUnavailable(message) from exc
