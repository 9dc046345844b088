"""ov_backend: a torch.compile backend on OpenVINO.

``import ov_backend`` registers the backend name, so that
``torch.compile(model, backend="ov_backend", options={"device": "CPU"})`` works; the
``torch_dynamo_backends`` entry point does the same for an installed package without the
import. ``torch.compile(model, backend=OVBackend(settings))`` keeps the compiled models,
reports and counters in an object its owner can inspect and reset.
"""

from __future__ import annotations

from torch._dynamo.backends.registry import list_backends, register_backend

from ov_backend.backend import BACKEND_NAME, OVBackend, ov_backend
from ov_backend.cache import CacheEntry, ModelCache
from ov_backend.compiled import OpenVINOFallbackError
from ov_backend.devices import DeviceInfo, device_info, list_devices
from ov_backend.report import CompileReport, PartitionReport
from ov_backend.settings import BackendSettings, build_settings

__all__ = [
    "BACKEND_NAME",
    "BackendSettings",
    "CacheEntry",
    "CompileReport",
    "DeviceInfo",
    "ModelCache",
    "OVBackend",
    "OpenVINOFallbackError",
    "PartitionReport",
    "build_settings",
    "device_info",
    "list_devices",
    "ov_backend",
]

if BACKEND_NAME not in list_backends(exclude_tags=()):
    register_backend(name=BACKEND_NAME)(ov_backend)
