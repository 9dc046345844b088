"""Loads ov_backend (and through it openvino) on first use, and explains what to do when it cannot.

The script must still appear in the dropdown when openvino is missing or broken, so nothing here
imports the backend at module import time.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

FIX_HINT = (
    "Restart the WebUI so that the extension's install.py can install it, or run in the WebUI's venv: "
    "python -m pip install openvino==2026.4.1 (with the installed packages as constraints, as install.py "
    "does)."
)


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


def load_backend() -> BackendApi:
    """Import ov_backend and return its API.

    Raises:
        BackendUnavailable: with the import error and the fix.
    """
    try:
        backend = importlib.import_module("ov_backend")
        devices = importlib.import_module("ov_backend.devices")
        cache = importlib.import_module("ov_backend.cache")
        return BackendApi(
            build_settings=backend.build_settings,
            backend_class=backend.OVBackend,
            list_devices=devices.list_devices,
            model_cache=cache.ModelCache,
        )
    except Exception as exc:  # ImportError, or a broken openvino raising anything at import
        message = (
            f"OpenVINO acceleration is unavailable: {type(exc).__name__}: {exc}. "
            f"Python {sys.version.split()[0]} at {sys.executable}. {FIX_HINT}"
        )
        logger.error("%s", message)
        raise BackendUnavailable(message) from exc
