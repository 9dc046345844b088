"""Backend settings: one frozen, validated object built from user options.

Owns the option names (the documented set of openvino's stock ``torch.compile`` backend, plus
``precision``, ``strict`` and ``min_partition_ops``), their defaults, the deprecated environment variables read
as defaults, and the validation of every value. Change a settings object with :func:`dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ov_backend import devices, ops, quantize
from ov_backend.cache_limit import DEFAULT_CACHE_MAX_BYTES
from ov_backend.files import user_cache_root
from ov_backend.precision import DEFAULT_PRECISION, NNCF_PRECISIONS, PRECISION_CONFIG, PRECISIONS
from ov_backend.rewrites import REWRITES

logger = logging.getLogger(__name__)

ENV_DEVICE = "OPENVINO_TORCH_BACKEND_DEVICE"
ENV_MODEL_CACHING = "OPENVINO_TORCH_MODEL_CACHING"
ENV_CACHE_DIR = "OPENVINO_TORCH_CACHE_DIR"

#: See BackendSettings.min_partition_ops. An OpenVINO island costs a hand-over per call, so islands of
#: cheap elementwise ops on small tensors run faster in PyTorch, while a single small convolution still
#: runs faster in OpenVINO (measured: ``docs/backend-builds.md``). A count of ops cannot tell the two
#: apart, so the default keeps every partition in OpenVINO, as before.
DEFAULT_MIN_PARTITION_OPS = 1
#: At precision "int8": calls recorded at float before a graph is quantized (each costs about one call of
#: the float model again while NNCF gathers statistics).
DEFAULT_CALIBRATION_SAMPLES = 8
#: See BackendSettings.shared_shapes.
SHARED_SHAPES: tuple[str, ...] = ("auto", "always", "never")
#: See BackendSettings.previous_weights.
PREVIOUS_WEIGHTS: tuple[str, ...] = ("auto", "keep", "release")

SCHEDULING_PROPERTIES = frozenset({
    "INFERENCE_NUM_THREADS", "ENABLE_CPU_PINNING", "NUM_STREAMS", "PERFORMANCE_HINT",
    "PERFORMANCE_HINT_NUM_REQUESTS", "ENABLE_HYPER_THREADING", "SCHEDULING_CORE_TYPE",
})
"""Compile properties that decide how many threads run and where, not what a model computes (the rewrites
make the pictures the same at any thread count: ``tests/sd/test_batch.py``)."""

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def default_cache_dir() -> Path:
    """The per-user cache folder for compiled models (never the working directory)."""
    return user_cache_root() / "ov_backend"


@dataclass(frozen=True)
class BackendSettings:
    """How the backend converts, compiles and runs graphs.

    Attributes:
        device: OpenVINO device: a name in ``openvino.Core().available_devices``, a generic
            name such as "GPU", "AUTO", or "HETERO:a,b" / "MULTI:a,b" / "AUTO:a,b".
        model_caching: store converted models under ``cache_dir`` and reuse them across processes.
        cache_dir: folder of the on-disk cache.
        cache_max_bytes: the disk cache's size limit in bytes; 0 means no limit. After every store (a converted
            model, and a build's blobs and saved captures) the least recently used entries are removed until the
            cache holds at most this, except the entries this process uses (:mod:`ov_backend.cache_limit`).
        config: the user's own properties for ``openvino.Core.compile_model`` (string keys and values);
            :attr:`compile_config` adds those of ``precision``.
        precision: a name in :data:`ov_backend.precision.PRECISION_CONFIG`.
        decompositions: extra aten ops to decompose before conversion.
        disabled_ops: aten ops forced to run in PyTorch.
        aot_autograd: trace through AOTAutograd before conversion.
        strict: raise instead of falling back to PyTorch when OpenVINO cannot take a graph.
        min_partition_ops: a partition with fewer aten ops runs in PyTorch (as Torch-TensorRT's
            ``min_block_size``), reported with a WARNING (``strict`` does not raise for it): a tiny
            OpenVINO island between PyTorch ops can cost more in hand-over than it saves. Python
            ``getitem`` and size arithmetic are not counted. 1 sends every partition to OpenVINO.
        calibration_samples: at ``precision="int8"``, how many calls of a graph run at float and are
            recorded before it is quantized (fewer if the owner calls ``OVBackend.calibrate()`` first).
        shared_shapes: on the dynamic build (a graph converted once for every shape), whether one model
            compiled with dynamic shapes serves every shape instead of one model compiled per shape.
            A compiled model holds its own copy of the weights in the device's layout (gigabytes for a
            full UNet), so one per shape costs that much per shape held; one for all shapes never
            compiles again for a new shape, and on the CPU may cost more per call, depending on the CPU
            (``docs/backend.md``, "One model for all shapes"; ``bench/results/bench-shared-*``).
            "auto": on the CPU at float precisions, per shape until a graph needs a second shape while
            the first one's model is still in use (in the current use window, or at all when windows
            are off), then one for all shapes, until the calls of a use window no longer need it;
            "always"; "never". Under "auto", devices other than the CPU compile per shape
            (GPU plugins compile dynamic shapes slowly, NPUs need static ones). INT8 models are always
            compiled per shape.
        previous_weights: with use windows (``OVBackend.start_window``), whether a graph keeps the
            compiled models its previous weights (another checkpoint loaded into the same modules, the
            weights before a LoRA) used in their last window, so that going back to them costs no
            compile. Only the latest other set of weights is kept, and only the models its last window
            used; older ones, and other sizes, go as before. "auto": kept while at least a third of the
            machine's memory is available (:mod:`ov_backend.memory`; ``docs/backend.md``, "The weights
            used before", says which machines have that), released otherwise or where memory cannot be read;
            "keep"; "release".
        rewrites: the graph rewrites (:mod:`ov_backend.rewrites`) applied to each converted model, by
            name (default: all of :data:`ov_backend.rewrites.REWRITES`); each computes the same values,
            faster or in the same bytes on any thread count, and an empty list converts the graph as the
            frontend gives it.
        weights_in_file: before a graph's first conversion, move the data of its weight tensors into a
            memory-mapped file in ``cache_dir``/weights (unlinked once mapped), so that the process holds
            one copy of each weight, OpenVINO's, instead of PyTorch's beside it: the tensors keep their
            identity and values and PyTorch reads them from the file when it needs them
            (:mod:`ov_backend.weight_file`; ``docs/memory.md``). It changes the storage of the tensors
            of the module being compiled. Linux only; where the folder is in memory (tmpfs) or the disk
            has no room, the weights stay in memory and the log says why.
        check_memory: before a build, estimate what the compiled model will hold and compare it with the
            memory available (the process's cgroup limit included); short of it, run the graph in PyTorch with
            a WARNING that says so (``strict`` raises), until the next use window looks again, instead of
            swapping or thrashing the machine (:mod:`ov_backend.memory_guard`).
    """

    device: str = "CPU"
    model_caching: bool = False
    cache_dir: Path = field(default_factory=default_cache_dir)
    cache_max_bytes: int = DEFAULT_CACHE_MAX_BYTES
    config: tuple[tuple[str, str], ...] = ()
    precision: str = DEFAULT_PRECISION
    decompositions: tuple[str, ...] = ()
    disabled_ops: tuple[str, ...] = ()
    aot_autograd: bool = False
    strict: bool = False
    min_partition_ops: int = DEFAULT_MIN_PARTITION_OPS
    calibration_samples: int = DEFAULT_CALIBRATION_SAMPLES
    shared_shapes: str = "auto"
    previous_weights: str = "auto"
    rewrites: tuple[str, ...] = REWRITES
    weights_in_file: bool = False
    check_memory: bool = True

    def __post_init__(self) -> None:
        # checked here, not only in build_settings, so that dataclasses.replace(settings, precision=...) is
        # checked too
        _with_precision(self.precision, self.config)

    @property
    def compile_config(self) -> dict[str, str]:
        """The properties ``compile_model`` gets: ``config`` and those of ``precision``."""
        return dict(_with_precision(self.precision, self.config))

    @property
    def on_cpu(self) -> bool:
        """Whether the device is the CPU ("CPU", or "CPU.0" and the like)."""
        return self.device.split(".")[0] == "CPU"

    def conversion_key(self) -> dict[str, Any]:
        """The settings that change a model as converted, before a device compiles it (cache keys)."""
        return {
            "decompositions": list(self.decompositions),
            "disabled_ops": list(self.disabled_ops),
            "aot_autograd": self.aot_autograd,
            "rewrites": list(self.rewrites),
        }

    def result_key(self) -> dict[str, Any]:
        """The settings that change what a compiled model computes (used in cache keys)."""
        return {"device": self.device, "config": sorted(self.compile_config.items()), **self.conversion_key()}

    def quantized_key(self) -> dict[str, Any]:
        """The settings that change an INT8 model as quantized (cache keys): :meth:`result_key` less the
        properties that only place the device's threads (:data:`SCHEDULING_PROPERTIES`). The entry is an
        ``ov.Model``, compiled with the whole config wherever it is loaded, so one process on every core and
        workers of one pinned thread each share it."""
        config = [(k, v) for k, v in sorted(self.compile_config.items()) if k not in SCHEDULING_PROPERTIES]
        return {**self.result_key(), "config": config}


OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(BackendSettings))


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"option {name!r} must be a boolean (True/False), got {value!r}")


def _as_count(name: str, value: Any, minimum: int, meaning: str) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"option {name!r} must be a whole number >= {minimum} ({meaning}), got {value!r}")
    return value


def _as_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if isinstance(value, str) and value.strip().lower() in choices:
        return value.strip().lower()
    raise ValueError(f"option {name!r} must be one of {list(choices)}, got {value!r}")


def _env_defaults() -> dict[str, Any]:
    found: dict[str, Any] = {}
    for var, key in ((ENV_DEVICE, "device"), (ENV_MODEL_CACHING, "model_caching"),
                     (ENV_CACHE_DIR, "cache_dir")):
        value = os.environ.get(var)
        if value is None:
            continue
        warnings.warn(
            f"the environment variable {var} is deprecated; pass options={{{key!r}: ...}} instead",
            DeprecationWarning,
            stacklevel=3,
        )
        found[key] = value
    return found


def _check_device(device: Any) -> str:
    return devices.check_device(device, devices.available_devices())


def _check_config(config: Any) -> tuple[tuple[str, str], ...]:
    if config is None:
        return ()
    if not isinstance(config, Mapping):
        raise ValueError(f"option 'config' must be a dict of OpenVINO properties, got {type(config).__name__}")
    items = []
    for key, value in config.items():
        if not isinstance(key, str):
            raise ValueError(f"option 'config' keys must be strings, got {key!r}")
        items.append((key, value if isinstance(value, str) else str(value)))
    return tuple(sorted(items))


def _check_precision(precision: Any) -> Any:
    if precision in NNCF_PRECISIONS:
        problem = quantize.nncf_problem()
        if problem is not None:
            raise ValueError(f"option 'precision' {precision!r}: {problem}")
    return precision


def _with_precision(precision: Any, config: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    if precision not in PRECISION_CONFIG:
        raise ValueError(f"option 'precision' must be one of {list(PRECISIONS)}, got {precision!r}")
    merged = dict(config)
    for key, value in PRECISION_CONFIG[precision].items():
        if merged.setdefault(key, value) != value:
            raise ValueError(f"option 'precision' {precision!r} sets {key}={value}, but 'config' sets "
                             f"{key}={merged[key]}; give one of them")
    return tuple(sorted(merged.items()))


def _check_ops(name: str, values: Any, *, known: frozenset[str] | None) -> tuple[str, ...]:
    if values is None:
        return ()
    if isinstance(values, str):
        values = [values]
    names = []
    for value in values:
        op_name = ops.op_name(value)
        if known is not None and op_name not in known:
            raise ValueError(
                f"option {name!r}: unknown op {value!r}; use an aten overload name such as "
                f"'aten.convolution.default' (see ov_backend.ops.SUPPORTED_OPS)"
            )
        if known is None and ops.resolve_op(op_name) is None:
            raise ValueError(f"option {name!r}: {value!r} is not an aten op")
        names.append(op_name)
    return tuple(sorted(set(names)))


def _check_rewrites(values: Any) -> tuple[str, ...]:
    if values is None:
        return REWRITES
    if isinstance(values, str):
        values = [values] if values.strip() else []
    if not isinstance(values, (list, tuple, set, frozenset)):
        raise ValueError(f"option 'rewrites' must be a list of rewrite names (some of {list(REWRITES)}, "
                         f"or [] for none), got {values!r}")
    unknown = [v for v in values if v not in REWRITES]
    if unknown:
        raise ValueError(f"option 'rewrites': unknown rewrite(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(REWRITES)} ([] applies none)")
    return tuple(name for name in REWRITES if name in values)


def build_settings(options: Mapping[str, Any] | BackendSettings | None = None) -> BackendSettings:
    """Build validated settings from ``torch.compile(..., options=...)``.

    The deprecated environment variables OPENVINO_TORCH_BACKEND_DEVICE,
    OPENVINO_TORCH_MODEL_CACHING and OPENVINO_TORCH_CACHE_DIR are read here as defaults;
    explicit options win.

    Args:
        options: option name -> value, or settings to validate again.

    Returns:
        The frozen settings.

    Raises:
        ValueError: an unknown option key, device, precision, op name or a value of the wrong kind
            (``min_partition_ops`` below 1, or not a whole number).
    """
    if isinstance(options, BackendSettings):
        options = {**{f.name: getattr(options, f.name) for f in dataclasses.fields(options)},
                   "config": dict(options.config)}
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise ValueError(
            f"unknown ov_backend option(s): {', '.join(map(repr, unknown))}; "
            f"valid options: {', '.join(OPTION_NAMES)}"
        )
    merged = {**_env_defaults(), **{k: v for k, v in options.items() if v is not None}}
    cache_dir = merged.get("cache_dir")
    return BackendSettings(
        device=_check_device(merged.get("device", "CPU")),
        model_caching=_as_bool("model_caching", merged.get("model_caching", False)),
        cache_dir=Path(cache_dir).expanduser() if cache_dir not in (None, "") else default_cache_dir(),
        cache_max_bytes=_as_count("cache_max_bytes", merged.get("cache_max_bytes", DEFAULT_CACHE_MAX_BYTES),
                                  minimum=0, meaning="the disk cache's size limit in bytes; 0 for no limit"),
        config=_check_config(merged.get("config")),
        precision=_check_precision(merged.get("precision", DEFAULT_PRECISION)),
        decompositions=_check_ops("decompositions", merged.get("decompositions"), known=None),
        disabled_ops=_check_ops("disabled_ops", merged.get("disabled_ops"), known=ops.SUPPORTED_OPS),
        aot_autograd=_as_bool("aot_autograd", merged.get("aot_autograd", False)),
        calibration_samples=_as_count("calibration_samples",
                                      merged.get("calibration_samples", DEFAULT_CALIBRATION_SAMPLES), minimum=1,
                                      meaning="calls recorded at float before an INT8 model is quantized"),
        strict=_as_bool("strict", merged.get("strict", False)),
        shared_shapes=_as_choice("shared_shapes", merged.get("shared_shapes", "auto"), SHARED_SHAPES),
        previous_weights=_as_choice("previous_weights", merged.get("previous_weights", "auto"), PREVIOUS_WEIGHTS),
        rewrites=_check_rewrites(merged.get("rewrites")),
        weights_in_file=_as_bool("weights_in_file", merged.get("weights_in_file", False)),
        check_memory=_as_bool("check_memory", merged.get("check_memory", True)),
        min_partition_ops=_as_count("min_partition_ops", merged.get("min_partition_ops", DEFAULT_MIN_PARTITION_OPS),
                                    minimum=1, meaning="partitions with fewer aten ops run in PyTorch; "
                                                       "1 sends every partition to OpenVINO"),
    )
