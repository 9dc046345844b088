"""ov_backend: a torch.compile backend on OpenVINO.

``import ov_backend`` makes the name usable, so that
``torch.compile(model, backend="ov_backend", options={"device": "CPU"})`` works: an installed package
is found by dynamo through its ``torch_dynamo_backends`` entry point, and a copy on ``sys.path`` (e.g. in
a WebUI extension's folder) registers the name when imported. ``torch.compile(model,
backend=OVBackend(settings))`` keeps the compiled models, reports and counters in an object its owner can
inspect and reset.

The public API is the names in ``__all__``; everything else is internal. They are loaded on first use
(PEP 562). ``python -m ov_backend`` imports this package before its ``__main__``: then (``sys.argv[0]``
is ``"-m"`` while Python locates the module) the name is not registered, so ``--help`` and argument
errors answer without loading torch or OpenVINO; the command line loads them when a command needs them.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

#: The name of the backend in ``torch.compile(..., backend=...)``.
BACKEND_NAME = "ov_backend"

#: public name -> the module that defines it
_EXPORTS = {
    # the backend
    "OVBackend": "ov_backend.backend",
    "ov_backend": "ov_backend.backend",
    "OpenVINOFallbackError": "ov_backend.context",
    # its settings
    "BackendSettings": "ov_backend.settings",
    "build_settings": "ov_backend.settings",
    "default_cache_dir": "ov_backend.settings",
    "PREVIOUS_WEIGHTS": "ov_backend.settings",
    "DEFAULT_PRECISION": "ov_backend.precision",
    "PRECISIONS": "ov_backend.precision",
    "QUANTIZED_PRECISIONS": "ov_backend.precision",
    # devices
    "DeviceInfo": "ov_backend.devices",
    "check_device": "ov_backend.devices",
    "device_info": "ov_backend.devices",
    "list_devices": "ov_backend.devices",
    # the disk cache and its files
    "CacheEntry": "ov_backend.cache",
    "CacheUsage": "ov_backend.cache_limit",
    "cache_usage": "ov_backend.cache_limit",
    "DEFAULT_CACHE_MAX_BYTES": "ov_backend.cache_limit",
    "ModelCache": "ov_backend.cache",
    "atomic_path": "ov_backend.files",
    "format_bytes": "ov_backend.files",
    # what ran: reports, graph runs, calls that ran in PyTorch
    "CompileReport": "ov_backend.report",
    "PartitionReport": "ov_backend.report",
    "Stats": "ov_backend.report",
    "EagerCalls": "ov_backend.graph_runs",
    "GraphCollector": "ov_backend.graph_runs",
    "GraphRunCounter": "ov_backend.graph_runs",
    "describe_eager": "ov_backend.graph_runs",
    "why_eager": "ov_backend.graph_runs",
    # routing a module's method: compiled, its captures saved, its sizes symbolic
    "CompiledMethod": "ov_backend.compiled_method",
    "input_signature": "ov_backend.compiled_method",
    "SavedCaptures": "ov_backend.saved_captures",
    "mark_varying": "ov_backend.portable",
    "sizes_may_be_one": "ov_backend.portable",
    # the machine's memory (its memory cgroup's limit counted)
    "SystemMemory": "ov_backend.memory",
    "system_memory": "ov_backend.memory",
    # PyTorch's copy of the weights in a memory-mapped file
    "MoveResult": "ov_backend.weight_file",
    "WeightFile": "ov_backend.weight_file",
}
__all__ = ["atomic_path", "BACKEND_NAME", "BackendSettings", "build_settings", "CacheEntry", "CacheUsage",
    "cache_usage", "check_device", "DEFAULT_CACHE_MAX_BYTES",
    "CompiledMethod", "CompileReport", "default_cache_dir", "DEFAULT_PRECISION", "describe_eager",
    "device_info", "DeviceInfo", "EagerCalls", "format_bytes", "GraphCollector", "GraphRunCounter",
    "input_signature", "list_devices", "mark_varying", "ModelCache", "MoveResult", "OpenVINOFallbackError",
    "ov_backend", "OVBackend", "PartitionReport", "PRECISIONS", "PREVIOUS_WEIGHTS", "QUANTIZED_PRECISIONS",
    "SavedCaptures", "sizes_may_be_one", "Stats", "system_memory", "SystemMemory", "WeightFile", "why_eager"]

if TYPE_CHECKING:  # the same names, for type checkers and editors
    from ov_backend.backend import OVBackend, ov_backend
    from ov_backend.cache import CacheEntry, ModelCache
    from ov_backend.cache_limit import DEFAULT_CACHE_MAX_BYTES, CacheUsage, cache_usage
    from ov_backend.compiled_method import CompiledMethod, input_signature
    from ov_backend.context import OpenVINOFallbackError
    from ov_backend.devices import DeviceInfo, check_device, device_info, list_devices
    from ov_backend.files import atomic_path, format_bytes
    from ov_backend.graph_runs import EagerCalls, GraphCollector, GraphRunCounter, describe_eager, why_eager
    from ov_backend.memory import SystemMemory, system_memory
    from ov_backend.portable import mark_varying, sizes_may_be_one
    from ov_backend.precision import DEFAULT_PRECISION, PRECISIONS, QUANTIZED_PRECISIONS
    from ov_backend.report import CompileReport, PartitionReport, Stats
    from ov_backend.saved_captures import SavedCaptures
    from ov_backend.settings import PREVIOUS_WEIGHTS, BackendSettings, build_settings, default_cache_dir
    from ov_backend.weight_file import MoveResult, WeightFile


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ov_backend' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


def _named_backend(gm: Any, example_inputs: Any, options: Any = None) -> Any:
    """The named backend, loaded on its first graph (``ov_backend.backend.ov_backend``): importing this package
    loads neither OpenVINO nor the backend's modules."""
    from ov_backend.backend import ov_backend

    return ov_backend(gm, example_inputs, options)


def _register_name() -> None:
    """Make the name ``"ov_backend"`` usable in ``torch.compile`` through torch's public registry.

    An installed package is found through its entry point: dynamo loads it, by importing this package,
    when the name is first looked up, and registers it itself (registering here too would clash). A copy
    without the entry point registers the name now. Registration needs dynamo's registry only, not its
    other backends.
    """
    from importlib.metadata import entry_points

    from torch._dynamo import register_backend

    if any(point.name == BACKEND_NAME for point in entry_points(group="torch_dynamo_backends")):
        return
    try:
        register_backend(compiler_fn=_named_backend, name=BACKEND_NAME)
    except AssertionError as err:  # dynamo's "duplicate name": registered before (or by another thread)
        if "duplicate" not in str(err):
            raise


if sys.argv[:1] != ["-m"]:
    _register_name()
