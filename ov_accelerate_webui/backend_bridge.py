"""Loads ov_backend (and through it openvino) on first use, and explains what to do when it cannot.

The script must still appear in the dropdown when openvino is missing or broken, so nothing here
imports the backend at module import time.

A1111 puts an extension's folder on ``sys.path`` only while it executes that extension's scripts and
restores the previous ``sys.path`` right after, so at generation time a plain ``import ov_backend``
fails with ModuleNotFoundError. The backend is therefore imported from this extension's own folder by
location (:func:`import_sibling_package`), without touching ``sys.path``.

The adapter uses the backend's public API (the names in its ``__all__``) through :data:`ov_backend`: for type
checkers the package itself, at run time a stand-in that imports it this way on first use.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

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
    backend_class: Callable[..., Any]
    """``ov_backend.OVBackend``: settings (and ``weight_file=``) -> backend instance usable with torch.compile."""
    list_devices: Callable[[], list[tuple[str, str]]]
    """``ov_backend.list_devices``: [(name, full name)]."""
    model_cache: Callable[[str], Any]
    """``ov_backend.ModelCache``: folder -> cache object (entries, total_bytes, clear, prune)."""


class _LoadedOnUse:
    """``ov_backend`` imported from this extension's folder when one of its names is first used."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(import_sibling_package("ov_backend"), name)


if TYPE_CHECKING:
    import ov_backend
else:
    #: The backend's public API. Using a name raises ModuleNotFoundError, or whatever importing openvino
    #: raises when it is broken (:func:`load_backend` turns that into BackendUnavailable with the fix).
    ov_backend = _LoadedOnUse()


def load_backend() -> BackendApi:
    """Import ov_backend and return its API.

    Raises:
        BackendUnavailable: with the import error and the fix.
    """
    try:
        return BackendApi(
            build_settings=ov_backend.build_settings,
            backend_class=ov_backend.OVBackend,
            list_devices=ov_backend.list_devices,
            model_cache=ov_backend.ModelCache,
        )
    except Exception as exc:  # ImportError, or a broken openvino raising anything at import
        message = (
            f"OpenVINO acceleration is unavailable: {type(exc).__name__}: {exc}. "
            f"Python {sys.version.split()[0]} at {sys.executable}. {FIX_HINT}"
        )
        logger.error("%s", message)
        raise BackendUnavailable(message) from exc
