"""Whether a new compiled model fits in the memory the machine has left, before it is built.

A compiled model holds OpenVINO's own copy of its weights in the plugin's layout: as large as the weights
at f32, half at bf16/f16. Building one that does not fit does not fail: the machine swaps, or, with no swap,
thrashes until the kernel's out-of-memory killer ends the process (a full SDXL UNet at f32 on a 23.5 GiB
machine froze it for minutes, ``docs/memory.md``). So before a build the backend compares what the model
will hold (:func:`build_bytes`) with what is available (:func:`ov_backend.memory.system_memory`, a memory
limit of the process's cgroup included) and, short of it, runs the graph in PyTorch with the reason
(:func:`shortage`), until the next use window looks again.

The estimate is the compiled weights at the inference precision, plus a margin for the compile's own work
(:data:`MARGIN`, :data:`MARGIN_BYTES`). Pages of weights in a memory-mapped file
(:mod:`ov_backend.weight_file`) are not counted: the kernel drops them when memory runs short.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import openvino as ov
import torch

from ov_backend.files import format_bytes
from ov_backend.memory import SystemMemory, system_memory
from ov_backend.precision import COMPRESSED_PRECISIONS

logger = logging.getLogger(__name__)

#: Share of the compiled weights added for what compiling takes beside them (measured below 10% on SD parts).
MARGIN = 0.10
#: Bytes added to every estimate: the plugin's working buffers, the graph's activations.
MARGIN_BYTES = 256 << 20
#: Bytes per element of the compiled weights, by inference precision (8-bit weights: the compressed constant
#: and the plugin's packed copy of it, for a matmul's weights; see :func:`build_bytes` for the others).
_ELEMENT_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "int8-weights": 2}
#: What NNCF's INT8 quantization (:func:`ov_backend.quantize.quantize`) adds to the process, in times the model's
#: float weights at f32: it compiles a statistics model at f32 (a copy of every weight in the plugin's layout) and
#: keeps rescaled copies of the projections it smooths. Measured 1.54x on SD 1.5's UNet (0.86 B parameters: 4.9 GiB
#: above the 3.2 GiB of its f32 weights, AMD EPYC Zen 4, NNCF 3.4.0); full-size SDXL's UNet in Forge grew past the
#: 23.5 GiB machine (docs/memory.md).
QUANTIZE_FACTOR = 1.6


def inference_precision(settings_precision: str, config: dict[str, str], default_hint: str | None) -> str:
    """The precision the plugin will compute at: the config's ``INFERENCE_PRECISION_HINT``, else the device's
    default (``default_hint``, e.g. "bf16" on a CPU with AMX or AVX-512 BF16), else f32."""
    if settings_precision in COMPRESSED_PRECISIONS:
        return "int8-weights"
    hint = config.get("INFERENCE_PRECISION_HINT") or default_hint or "f32"
    return str(hint).lower() if str(hint).lower() in _ELEMENT_BYTES else "f32"


def build_bytes(weight_values: Sequence[torch.Tensor], precision: str, float_precision: str = "f32") -> int:
    """Bytes a model compiled from these weights at ``precision`` is expected to add to the process. With 8-bit
    weights only matmuls' (2-D) weights are compressed (``ov_backend.compress``): the others, convolutions', are
    packed at the device's float precision, ``float_precision`` (bf16 on a CPU with AMX or AVX-512 BF16, else
    f32)."""
    per = _ELEMENT_BYTES.get(precision, 4)
    per_float = _ELEMENT_BYTES.get(float_precision, 4) if float_precision != "int8-weights" else 4

    def size(t: torch.Tensor) -> int:
        if not t.is_floating_point():
            return t.element_size()
        if precision == "int8-weights" and t.dim() != 2:
            return min(per_float, t.element_size())
        return min(per, t.element_size())

    weights = sum(t.numel() * size(t) for t in weight_values)
    return int(weights * (1 + MARGIN)) + MARGIN_BYTES


def shortage(needed: int, memory: SystemMemory | None = None, compressed: int | None = None,
             what: str = "compile it") -> str | None:
    """Why a build that adds ``needed`` bytes should not start now, or None (it fits, or memory is unknown).
    ``compressed``: what the build would need with 8-bit weights, named when it would fit; ``what``: the work."""
    memory = memory if memory is not None else system_memory()
    if memory is None or needed <= memory.available:
        return None
    why = (f"not enough memory to {what}: it needs about {format_bytes(needed)} and "
           f"{format_bytes(memory.available)} is available")
    if compressed is not None and compressed <= memory.available:
        why += f" (with 8-bit weights, precision 'int8-weights', it would need about {format_bytes(compressed)})"
    return why


def device_hint(core: object, device: str) -> str:
    """The device's own inference precision (its ``INFERENCE_PRECISION_HINT``: "bf16" on a CPU with AMX or
    AVX-512 BF16, else "f32"); "f32" where the device does not report one."""
    try:
        hint = core.get_property(device, "INFERENCE_PRECISION_HINT")  # type: ignore[attr-defined]
    except RuntimeError:  # not every device reports it
        return "f32"
    return hint.to_string() if hasattr(hint, "to_string") else str(hint)


def build_shortage(weight_values: Sequence[torch.Tensor], settings_precision: str, config: dict[str, str],
                   default_hint: str | None, memory: SystemMemory | None = None) -> str | None:
    """:func:`shortage` for a model compiled from ``weight_values`` at the precision the settings and the device
    give (:func:`inference_precision`), naming 8-bit weights when they would fit."""
    precision = inference_precision(settings_precision, config, default_hint)
    floats = inference_precision("auto", config, default_hint)  # what the uncompressed weights are packed at
    compressed = None if precision == "int8-weights" else build_bytes(weight_values, "int8-weights", floats)
    return shortage(build_bytes(weight_values, precision, floats), memory, compressed=compressed)


def quantize_bytes(model: ov.Model) -> int:
    """Bytes NNCF's quantization of ``model`` is expected to add to the process (:data:`QUANTIZE_FACTOR` times its
    float constants at f32, plus the margin): its weights may live in a file or in PyTorch's tensors, the copies
    NNCF's statistics model makes do not."""
    elements = sum(op.get_byte_size() // max(1, op.get_element_type().size) for op in model.get_ordered_ops()
                   if op.get_type_name() == "Constant" and op.get_element_type().is_real())
    return int(elements * 4 * QUANTIZE_FACTOR) + MARGIN_BYTES


def quantize_shortage(model: ov.Model, memory: SystemMemory | None = None) -> str | None:
    """Why ``model`` should not be quantized to INT8 now (NNCF's work would not fit in the memory available), or
    None. The graph then stays at float: NNCF short of memory would push the process into the kernel's
    out-of-memory killer, the WebUI with it."""
    why = shortage(quantize_bytes(model), memory, what="quantize it to INT8")
    if why is None:
        return None
    return why + " (8-bit weights, precision 'int8-weights', need no quantization pass)"
