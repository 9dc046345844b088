"""INT8: a graph's float model quantized with NNCF, calibrated on the graph's own calls.

Owns :class:`Calibration` (the inputs of a graph's first calls at float precision, for one set of
weights), :class:`CalibrationWatch` (which of those calls the backend's owner lets record),
:func:`quantize` (NNCF's post-training quantization of the converted OpenVINO model: weights and activations
to 8 bits, the quality-sensitive edges kept at float), the NNCF check
(:func:`nncf_problem`) and :func:`calibration_key`, the part of an INT8 model's cache key that says how
it was quantized.

NNCF (``pip install nncf``) is the OpenVINO toolkit's quantizer; it is imported only when a model is
quantized, so the backend works without it at every other precision.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import openvino as ov
import torch

from ov_backend.rewrites import fold_weight_splits, share_weight_sections

logger = logging.getLogger(__name__)

#: The NNCF release the INT8 precision is built and tested with.
NNCF_REQUIREMENT = "nncf==3.4.0"
#: Ops whose weights NNCF quantizes; the first and the last of them in a model stay at float.
WEIGHTED_OPS = frozenset({"Convolution", "GroupConvolution", "MatMul"})
#: CPU flags with which u8 x s8 dot products are summed in 32 bits (no 16-bit saturation).
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
#: oneDNN ISA caps below VNNI (``ONEDNN_MAX_CPU_ISA``): its int8 kernels then saturate.
NO_VNNI_ISA_CAPS = frozenset({"SSE41", "AVX", "AVX2", "AVX512_CORE"})
#: Op types kept at float on CPUs without VNNI. oneDNN's int8 matmuls are slower than its f32 ones there;
#: and 8-bit inputs to the attention (NNCF quantizes its query and key) stop the CPU plugin fusing it into
#: one kernel: its matmuls and softmax run apart, slower than the fused f32 attention
#: (``docs/backend-builds.md``).
NO_VNNI_AT_FLOAT = ("MatMul", "ScaledDotProductAttention")


class QuantizationError(RuntimeError):
    """NNCF could not quantize a model (the graph then stays at float precision)."""


def nncf_problem() -> str | None:
    """Why INT8 cannot work in this Python (NNCF missing or at a version that fails to import), or None."""
    if importlib.util.find_spec("nncf") is None:
        return (f"INT8 needs NNCF, which is not installed in this Python ({sys.executable}): "
                f"install it with 'pip install {NNCF_REQUIREMENT}', or choose another precision")
    return None


def nncf_version() -> str:
    try:
        return importlib.metadata.version("nncf")
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def onednn_isa_cap() -> str | None:
    """oneDNN's CPU ISA cap, upper case ("AVX2"), from ``ONEDNN_MAX_CPU_ISA`` or its older name
    ``DNNL_MAX_CPU_ISA`` (oneDNN reads both); None when kernels are not capped."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return cap.strip().upper() if cap and cap.strip() else None


def exact_int8_dot_products() -> bool:
    """Whether this CPU's int8 kernels sum products in 32 bits (VNNI or AMX, and oneDNN not capped below).

    Without VNNI (AVX2-only CPUs, AVX-512 before Cascade Lake) oneDNN sums pairs of u8 x s8 products
    in saturating 16 bits, and full 8-bit weights can overflow: NNCF's overflow fix then quantizes
    weights to 7 bits. Where the CPU's flags cannot be read, this says False (the safe choice).
    """
    if onednn_isa_cap() in NO_VNNI_ISA_CAPS:
        return False
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    except OSError:
        return False
    return any(flag in flags for flag in VNNI_FLAGS)


def calibration_key(samples: int) -> dict[str, Any]:
    """What decides an INT8 model besides the graph and weights (part of its cache key)."""
    exact = exact_int8_dot_products()
    return {"nncf": nncf_version(), "samples": samples, "preset": "mixed", "model_type": "transformer",
            "edges_at_float": True, "overflow_fix": "disable" if exact else "enable", "matmuls_at_float": not exact,
            **({} if exact else {"at_float": list(NO_VNNI_AT_FLOAT)})}


class CallStopped(Exception):
    """The owner's :class:`CalibrationWatch` stopped a call: ``error`` is what it raised (the graph's caller gets
    it; it is no OpenVINO failure, so the graph does not fall back to PyTorch)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class CalibrationWatch:
    """What the owner of a backend says about the calls of its graphs at precision "int8" (see
    :meth:`ov_backend.backend.OVBackend.watch_int8`); nothing by default: every float call is recorded.

    The callback gets the INT8 model's cache key and whether the call runs that model (False: the call runs at
    float, for want of it, and its inputs can be recorded). For a float call it returns whether the call's inputs
    are recorded for the model's calibration, or raises to stop the call before anything is recorded or run.
    """

    def __init__(self) -> None:
        self.callback: Callable[[str, bool], bool] | None = None

    def records(self, key: str) -> bool:
        """Whether a float call of the graph whose INT8 model is ``key`` is recorded (may raise: see the class)."""
        callback = self.callback
        if callback is None:
            return True
        try:
            return bool(callback(key, False))
        except Exception as err:
            raise CallStopped(err) from err

    def runs_quantized(self, key: str) -> None:
        """A call runs the INT8 model ``key``."""
        callback = self.callback
        if callback is not None:
            try:
                callback(key, True)
            except Exception as err:
                raise CallStopped(err) from err


class Calibration:
    """The inputs of a graph's first calls at float precision, kept for quantizing (one set of weights).

    Args:
        samples: how many calls to record; the graph quantizes when it has them all (or earlier, when
            its owner asks, see :meth:`ov_backend.backend.OVBackend.calibrate`).
        model: the float model the calls ran (its inputs are the recorded tensors).
        key: the INT8 model's cache key.
        signature: the input signature the model is for; None for a model with dynamic shapes.
    """

    def __init__(self, samples: int, model: ov.Model, key: str, signature: tuple[Any, ...] | None) -> None:
        self.limit = samples
        self.model = model
        self.key = key
        self.signature = signature
        self.samples: list[list[np.ndarray]] = []
        #: why quantizing failed (the graph then stays at float for these weights), or None
        self.failed: str | None = None
        self.done = False
        self._lock = threading.Lock()

    @property
    def full(self) -> bool:
        return len(self.samples) >= self.limit

    @property
    def pending(self) -> bool:
        """Recorded calls wait for quantizing."""
        return bool(self.samples) and not self.done and self.failed is None

    def record(self, tensors: Sequence[torch.Tensor]) -> None:
        """Keep a copy of one call's model inputs (until :attr:`limit` calls are kept)."""
        with self._lock:
            if self.done or len(self.samples) >= self.limit:
                return
            self.samples.append([t.detach().to("cpu", copy=True).numpy() for t in tensors])


def recordable(tensors: Sequence[Any]) -> bool:
    """Whether calls with these inputs can be recorded (CPU tensors of a dtype numpy holds)."""
    return all(isinstance(t, torch.Tensor) and t.dtype not in (torch.bfloat16,) and not t.is_complex()
               for t in tensors)


def edge_layers(model: ov.Model) -> list[str]:
    """The first and the last weighted op (convolution or matmul) of ``model``, which stay at float.

    In a diffusion UNet they are the convolution that reads the latent and the one that writes the
    prediction: quantizing either costs more quality than the rest of the network together.
    """
    weighted = [op.get_friendly_name() for op in model.get_ordered_ops() if op.get_type_name() in WEIGHTED_OPS]
    return list(dict.fromkeys(weighted[:1] + weighted[-1:]))


def quantize(model: ov.Model, samples: Sequence[Sequence[np.ndarray]]) -> ov.Model:
    """``model`` with its weights and activations quantized to 8 bits, calibrated on ``samples``.

    NNCF's mixed preset (symmetric weights, asymmetric activations) for transformer-style models
    (SmoothQuant for the attention's matmuls, softmax at float); the first and last weighted op stay
    at float; bias correction is off (it needs many more samples than a generation gives). On CPUs
    without VNNI the weights are 7-bit (overflow fix), and matmuls and the attention stay at float (see
    :data:`NO_VNNI_AT_FLOAT`).

    Raises:
        QuantizationError: NNCF is missing or failed.
    """
    problem = nncf_problem()
    if problem is not None:
        raise QuantizationError(problem)
    if not samples:
        raise QuantizationError("no calibration samples were recorded")
    try:
        import nncf
        from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, OverflowFix

        exact = exact_int8_dot_products()
        model = model.clone()
        # NNCF finds a projection's weight as a constant, not behind a split: pieces of the weight's memory
        # where they are one piece each, else copies
        share_weight_sections(model)
        fold_weight_splits(model)
        return nncf.quantize(
            model,
            nncf.Dataset(list(samples)),
            preset=nncf.QuantizationPreset.MIXED,
            model_type=nncf.ModelType.TRANSFORMER,
            subset_size=len(samples),
            # without VNNI oneDNN's int8 matmul and fully-connected kernels are slower than its f32 ones,
            # while its int8 convolutions are faster (docs/backend-builds.md): there only the convolutions
            # are quantized, and the attention keeps float inputs (see NO_VNNI_AT_FLOAT)
            ignored_scope=nncf.IgnoredScope(names=edge_layers(model), types=[] if exact else list(NO_VNNI_AT_FLOAT),
                                            validate=False),
            advanced_parameters=AdvancedQuantizationParameters(overflow_fix=OverflowFix.DISABLE if exact
                                                               else OverflowFix.ENABLE,
                                                               disable_bias_correction=True),
        )
    except Exception as err:  # NNCF raises many kinds; each leaves the float model in place
        raise QuantizationError(f"NNCF could not quantize the model: {type(err).__name__}: {err}") from err
