"""ov_backend: a torch.compile backend on OpenVINO.

``import ov_backend`` registers the backend name, so that
``torch.compile(model, backend="ov_backend", options={"device": "CPU"})`` works; the
``torch_dynamo_backends`` entry point does the same for an installed package without the
import. ``torch.compile(model, backend=OVBackend(settings))`` keeps the compiled models,
reports and counters in an object its owner can inspect and reset.

The names below are loaded on first use (PEP 562). ``python -m ov_backend`` imports this
package before its ``__main__``: then (``sys.argv[0]`` is ``"-m"`` while Python locates the
module) nothing is imported here, so ``--help`` and argument errors answer without loading
torch or OpenVINO; the command line loads them when a command needs them.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

_EXPORTS = {
    "BACKEND_NAME": "ov_backend.backend",
    "OVBackend": "ov_backend.backend",
    "ov_backend": "ov_backend.backend",
    "CacheEntry": "ov_backend.cache",
    "ModelCache": "ov_backend.cache",
    "OpenVINOFallbackError": "ov_backend.compiled",
    "DeviceInfo": "ov_backend.devices",
    "device_info": "ov_backend.devices",
    "list_devices": "ov_backend.devices",
    "CompileReport": "ov_backend.report",
    "PartitionReport": "ov_backend.report",
    "BackendSettings": "ov_backend.settings",
    "build_settings": "ov_backend.settings",
}
__all__ = sorted(_EXPORTS, key=str.lower)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ov_backend' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


def _register_name() -> None:
    """Register the backend name with dynamo, without loading dynamo's other backends.

    ``list_backends()`` imports every backend module dynamo ships (about a second) to answer;
    the registry's own dict answers at once. A name already there was registered before, or
    found through this package's ``torch_dynamo_backends`` entry point (dynamo loads that entry
    point by importing this package, and registers it itself).
    """
    from torch._dynamo.backends import registry

    from ov_backend.backend import BACKEND_NAME, ov_backend

    known = getattr(registry, "_BACKENDS", None)
    if known is None:  # a torch without the private dict: the public check, which loads every backend
        known = registry.list_backends(exclude_tags=())
    if BACKEND_NAME in known:
        return
    try:
        registry.register_backend(name=BACKEND_NAME)(ov_backend)
    except AssertionError as err:  # dynamo's "duplicate name": registered by another thread meanwhile
        if "duplicate" not in str(err):
            raise


if sys.argv[:1] != ["-m"]:
    _register_name()
