"""The compared variants: how each turns a module into a callable, and what it reports.

* ``eager``: PyTorch eager fp32, the reference of every ratio and of the L2 difference;
* ``stock``: openvino's own ``torch.compile(backend="openvino")``, with ``aot_autograd``
  (this torch/openvino pair needs it); importing ``openvino.torch`` changes a global dynamo
  setting (``inline_inbuilt_nn_modules=False``), one more reason every variant has its own
  process;
* ``ov_backend``: our backend through ``torch.compile`` (an ``OVBackend`` instance);
* ``static``: ``openvino.convert_model(module, example_input=...)`` + ``Core.compile_model``,
  the ceiling: one model for exactly these input shapes, no per-call guard or bookkeeping.

* ``ov_full`` and ``ov_shallow`` (UNets only): step caching's two calls (``ov_accelerate_sd.step_cache``, at its
  default depth), each through ``ov_dynamic``'s route: the full UNet that also returns the deep feature, and
  the shallow UNet on a feature made once from the same inputs. Their ratio is what a cached step saves.

A backend variant named with a third part, ``/plain`` (``ov_dynamic/auto/plain``), converts without the
backend's graph rewrites (its option ``rewrites=[]``, see ``ov_backend.rewrites``): what they gain, measured
in the same run; with ``/no-<rewrite>`` (``ov_dynamic/auto/no-group_norm_reductions``), without that
one. With ``/file`` (``ov_dynamic/auto/file``) it keeps PyTorch's copy of the weights in a
memory-mapped file (its option ``weights_in_file``, see ``ov_backend.weight_file``): the memory it saves and
what it costs per call, measured in the same run.

The OpenVINO variants run at a precision: "auto" (no ``INFERENCE_PRECISION_HINT``: the CPU
plugin picks bf16 on CPUs that have it) or "f32"; ``ov_backend`` and ``ov_dynamic`` also at "int8"
(NNCF, see ``ov_backend.quantize``), and the backend kinds at "int8-weights" (``ov_backend.compress``): the
int8 variants' first call first runs :data:`INT8_CALIBRATION_CALLS` calls
at float on varied copies of the inputs (recorded for calibration), then quantizes, so the first
call's time includes what calibration costs.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: "ov_dynamic" is ov_backend with the inputs' varying dimensions marked dynamic before the first call,
#: as the WebUI adapter does: the route the WebUI's parts take (one conversion, a reshape and compile per
#: size); "ov_shared" is ov_dynamic with one model compiled with dynamic shapes for every size (the
#: backend's ``shared_shapes="always"``; under "auto" a part takes it when it needs two sizes at once)
KINDS: tuple[str, ...] = ("eager", "ov_backend", "ov_dynamic", "ov_shared", "static", "stock", "ov_full",
                          "ov_shallow")
#: step caching's calls of a UNet (see the module docstring)
STEP_CACHE_KINDS: frozenset[str] = frozenset({"ov_full", "ov_shallow"})
#: kinds run by ov_backend
BACKEND_KINDS: frozenset[str] = frozenset({"ov_backend", "ov_dynamic", "ov_shared"}) | STEP_CACHE_KINDS
PRECISIONS: tuple[str, ...] = ("auto", "f32", "int8", "int8-weights")
#: the third part of a backend variant's name that turns the backend's graph rewrites off
PLAIN = "plain"
#: the third part of a backend variant's name that keeps PyTorch's copy of the weights in a memory-mapped file
IN_FILE = "file"
#: the start of the third part of a backend variant's name that turns one graph rewrite off (``/no-<rewrite>``)
WITHOUT = "no-"
#: kinds that run at "int8"
INT8_KINDS: frozenset[str] = frozenset({"ov_backend", "ov_dynamic"}) | STEP_CACHE_KINDS
#: calls recorded (at float) before an int8 variant quantizes
INT8_CALIBRATION_CALLS = 4
#: oneDNN ISA caps (``ONEDNN_MAX_CPU_ISA``) without bf16 kernels
NO_BF16_ISA_CAPS = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI"})
#: kinds whose compiled models can come from a disk cache in a later process
CACHEABLE: frozenset[str] = BACKEND_KINDS | {"stock"}


@dataclass(frozen=True)
class VariantSpec:
    """One compared variant.

    Attributes:
        kind: one of :data:`KINDS`.
        precision: "auto" or "f32" for OpenVINO kinds; "fp32" for eager.
        rewrites: a backend kind applies the backend's graph rewrites (False: the ``/plain`` variant).
        weights_in_file: a backend kind keeps PyTorch's copy of the weights in a memory-mapped file (the ``/file``
            variant).
        without: the one graph rewrite a backend kind leaves out (the ``/no-<rewrite>`` variant), or "".
    """

    kind: str
    precision: str = "fp32"
    rewrites: bool = True
    weights_in_file: bool = False
    without: str = ""

    @property
    def name(self) -> str:
        if self.kind == "eager":
            return self.kind
        return (f"{self.kind}/{self.precision}" + ("" if self.rewrites else f"/{PLAIN}")
                + (f"/{IN_FILE}" if self.weights_in_file else "")
                + (f"/{WITHOUT}{self.without}" if self.without else ""))

    @property
    def config(self) -> dict[str, str]:
        """The OpenVINO compile properties of this precision.

        With oneDNN capped below AVX-512 BF16 (``ONEDNN_MAX_CPU_ISA=AVX2``, emulating an AVX2-only CPU on a
        newer one) every precision's float parts run at f32, as on such a CPU: OpenVINO's CPU plugin picks
        bf16 from the CPU's own flags, which kernels capped at AVX2 cannot run.
        """
        if self.precision == "f32" or os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in NO_BF16_ISA_CAPS:
            return {"INFERENCE_PRECISION_HINT": "f32"}
        return {}


def parse_variant(name: str) -> VariantSpec:
    """``"eager"``, ``"static/auto"``, ``"ov_backend/f32"``, ``"ov_dynamic/int8/plain"`` ... -> a spec.

    Raises:
        ValueError: an unknown kind, precision or third part, naming the valid ones.
    """
    kind, _, precision = name.partition("/")
    precision, _, variation = precision.partition("/")
    if kind not in KINDS:
        raise ValueError(f"unknown variant kind {kind!r} in {name!r}; known: {', '.join(KINDS)}")
    if kind == "eager":
        if precision not in ("", "fp32"):
            raise ValueError(f"eager runs in fp32 only, got {name!r}")
        return VariantSpec("eager")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} in {name!r}; use {kind}/auto or {kind}/f32")
    if precision == "int8-weights" and kind not in BACKEND_KINDS:
        raise ValueError(f"{name!r}: int8-weights is a precision of {', '.join(sorted(BACKEND_KINDS))} only")
    if precision == "int8" and kind not in INT8_KINDS:
        raise ValueError(f"{name!r}: int8 is a precision of {' and '.join(sorted(INT8_KINDS))} only")
    from ov_backend.rewrites import REWRITES

    without = variation[len(WITHOUT):] if variation.startswith(WITHOUT) else ""
    if variation and (variation not in (PLAIN, IN_FILE) and without not in REWRITES or kind not in BACKEND_KINDS):
        raise ValueError(f"{name!r}: the third part is {PLAIN!r} (no graph rewrites), {IN_FILE!r} (PyTorch's "
                         f"weights in a memory-mapped file) or {WITHOUT}<rewrite> (one of "
                         f"{', '.join(REWRITES)} left out), for {', '.join(sorted(BACKEND_KINDS))} only")
    return VariantSpec(kind, precision, rewrites=variation != PLAIN, weights_in_file=variation == IN_FILE,
                       without=without)


@dataclass
class Prepared:
    """A variant ready to call, and what it has to say about itself.

    Attributes:
        call: ``call(*inputs) -> tensor``.
        info: facts for the results (partitions, fallbacks, the precision the plugin chose).
        finish: collects the facts only known after calls (the backend's reports), or None.
        split: after the first call, the seconds it spent building models and running them
            (ov_backend only; the rest of the first call is dynamo capturing the graph), or None.
    """

    call: Callable[..., torch.Tensor]
    info: dict[str, Any] = field(default_factory=dict)
    finish: Callable[[], dict[str, Any]] | None = None
    split: Callable[[], dict[str, float]] | None = None


def _first_tensor(out: Any) -> torch.Tensor:
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out


def _eager(module: torch.nn.Module) -> Prepared:
    return Prepared(lambda *inputs: module(*inputs))


class _StockFallbackWatch(logging.Handler):
    """Catches the stock backend's silent hop to inductor (it logs it at DEBUG only)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "Failed in OpenVINO" in record.getMessage():
            self.messages.append(record.getMessage()[:500])


def _stock(module: torch.nn.Module, spec: VariantSpec, cache_dir: Path, caching: bool) -> Prepared:
    with warnings.catch_warnings():  # its import touches a deprecated dynamo flag and warns about it
        warnings.simplefilter("ignore", FutureWarning)
        import openvino.torch  # noqa: F401  (registers backend="openvino")

    stock_logger = logging.getLogger("openvino.frontend.pytorch.torchdynamo.backend")
    watch = _StockFallbackWatch()
    stock_logger.addHandler(watch)
    stock_logger.setLevel(logging.DEBUG)
    options: dict[str, Any] = {"device": "CPU", "aot_autograd": True, "config": spec.config}
    if caching:
        options.update(model_caching=True, cache_dir=str(cache_dir))
    compiled = torch.compile(module, backend="openvino", options=options)

    def finish() -> dict[str, Any]:
        return {"fell_back_to_inductor": list(watch.messages)}

    return Prepared(lambda *inputs: _first_tensor(compiled(*inputs)), {"options": options}, finish)


def mark_varying(inputs: Sequence[Any]) -> None:
    """Mark the dimensions that vary between generations dynamic, as the WebUI adapter does
    (``ov_accelerate_sd.parts.VARYING_DIMS``: the batch of every tensor, a context's tokens, height and
    width of 4-D ones; sizes of 1 too, symbolic while the call runs within
    ``ov_backend.portable.sizes_may_be_one``)."""
    from ov_accelerate_sd.parts import VARYING_DIMS
    from ov_backend.portable import mark_varying as mark

    for tensor in inputs:
        if isinstance(tensor, torch.Tensor):
            mark(tensor, VARYING_DIMS)


def calibration_inputs(inputs: Sequence[Any], k: int) -> list[Any]:
    """The ``k``-th varied copy of ``inputs`` an int8 variant calibrates on: each float tensor of more than
    one element scaled and given fresh noise (seeded by ``k``), like another step's latent; the rest as is."""
    g = torch.Generator().manual_seed(1000 + k)
    varied: list[Any] = []
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 1:
            noise = torch.randn(t.shape, generator=g, dtype=t.dtype)
            t = t * (0.6 + 0.2 * k) + noise * float(t.std()) * 0.5
        varied.append(t)
    return varied


class StepCacheCall(torch.nn.Module):
    """A UNet call wrapper's (``bench.models``) step caching call: the full one (its output) or the shallow one
    on the feature the full call keeps for ``inputs`` (held as a buffer)."""

    def __init__(self, call: torch.nn.Module, shallow: bool, inputs: Sequence[torch.Tensor]) -> None:
        from ov_accelerate_sd.step_cache import StepCacheSettings
        from ov_accelerate_sd.unet_split import split_unet

        super().__init__()
        self.call = call
        # the default depth (a small ``--quick`` UNet: as deep as it has)
        self.split = split_unet(call.unet, min(StepCacheSettings().depth, split_unet(call.unet, 1).layers - 1))
        self.shallow = shallow
        if shallow:
            with torch.no_grad():
                self.register_buffer("feature", self._full(*inputs)[1])

    @staticmethod
    def _arguments(inputs: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
        sample, timestep, context, *added = inputs
        kwargs = {"added_cond_kwargs": dict(zip(("text_embeds", "time_ids"), added))} if added else {}
        return (sample, timestep, context), kwargs

    def _full(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        args, kwargs = self._arguments(inputs)
        return self.split.full(self.call.unet, *args, **kwargs)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if not self.shallow:
            return self._full(*inputs)[0]
        args, kwargs = self._arguments(inputs)
        return self.split.shallow(self.call.unet, *args, feature=self.feature, **kwargs)


def _ov_backend(module: torch.nn.Module, spec: VariantSpec, cache_dir: Path, caching: bool,
                dynamic: bool | None, inputs: Sequence[torch.Tensor] = ()) -> Prepared:
    from ov_backend import OVBackend

    options: dict[str, Any] = {"device": "CPU", "model_caching": caching, "cache_dir": str(cache_dir),
                               "config": spec.config}
    if spec.precision == "int8":
        options.update(precision="int8", calibration_samples=INT8_CALIBRATION_CALLS)
    elif spec.precision == "int8-weights":
        options["precision"] = "int8-weights"
    # one shape per run: "auto" compiles ov_dynamic per shape, as a generation at one size does
    options["shared_shapes"] = "always" if spec.kind == "ov_shared" else "auto"
    if not spec.rewrites:
        options["rewrites"] = []
    elif spec.without:
        from ov_backend.rewrites import REWRITES

        options["rewrites"] = [name for name in REWRITES if name != spec.without]
    if spec.weights_in_file:
        options["weights_in_file"] = True
    backend = OVBackend(options)
    if spec.kind in STEP_CACHE_KINDS:
        module = StepCacheCall(module, spec.kind == "ov_shallow", inputs)
    compiled = torch.compile(module, backend=backend, dynamic=dynamic)
    marked = spec.kind in ("ov_dynamic", "ov_shared") or spec.kind in STEP_CACHE_KINDS
    calibrating = [spec.precision == "int8"]

    def call(*inputs: torch.Tensor) -> torch.Tensor:
        from ov_backend.portable import sizes_may_be_one

        with sizes_may_be_one() if marked else contextlib.nullcontext():
            if marked:
                mark_varying(inputs)
            if calibrating[0]:
                calibrating[0] = False
                for k in range(INT8_CALIBRATION_CALLS):
                    varied = calibration_inputs(inputs, k)
                    if marked:
                        mark_varying(varied)  # the same graph as the timed calls (else dynamo traces a static one)
                    compiled(*varied)
                backend.calibrate()  # no-op when the INT8 model came from the cache
            return _first_tensor(compiled(*inputs))

    def finish() -> dict[str, Any]:
        return {"reports": [r.summary() for r in backend.reports], "stats": backend.stats(),
                "fully_in_openvino": all(r.fully_in_openvino for r in backend.reports)}

    def split() -> dict[str, float]:
        stats = backend.stats()
        return {"build": stats["compile_seconds"], "trace": stats["trace_seconds"],
                "convert": stats["convert_seconds"], "ov_compile": stats["ov_compile_seconds"],
                "quantize": stats["quantize_seconds"], "run": stats["run_seconds"], "cache_hits": stats["cache_hits"]}

    return Prepared(call, {}, finish, split)


def _static(module: torch.nn.Module, spec: VariantSpec, inputs: Sequence[torch.Tensor]) -> Prepared:
    import openvino as ov

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # convert_model traces with TorchScript
        model = ov.convert_model(module, example_input=tuple(inputs))
    compiled = ov.Core().compile_model(model, "CPU", spec.config)
    del model
    gc.collect()
    request = compiled.create_infer_request()
    info = {"inference_precision": str(compiled.get_property("INFERENCE_PRECISION_HINT")),
            "performance_hint": str(compiled.get_property("PERFORMANCE_HINT")),
            "num_streams": str(compiled.get_property("NUM_STREAMS")),
            "inference_threads": str(compiled.get_property("INFERENCE_NUM_THREADS"))}

    def call(*args: torch.Tensor) -> torch.Tensor:
        request.infer([a.numpy() for a in args], share_inputs=True, share_outputs=True)
        return torch.from_numpy(request.get_output_tensor(0).data.copy())

    return Prepared(call, info)


def prepare(spec: VariantSpec, module: torch.nn.Module, inputs: Sequence[torch.Tensor], cache_dir: Path,
            caching: bool = True, dynamic: bool | None = None) -> Prepared:
    """Turn ``module`` into the variant's callable (lazily compiled ones compile on first call).

    Args:
        spec: the variant.
        module: the component's call wrapper.
        inputs: example inputs (the static variant converts for exactly these shapes).
        cache_dir: disk cache folder of the cacheable kinds.
        caching: store/reuse converted models in ``cache_dir`` (cacheable kinds only).
        dynamic: ``torch.compile``'s ``dynamic`` for ov_backend (None: dynamo's default, static
            first and dynamic from the second shape; True: every dimension symbolic from the start).
    """
    if spec.kind == "eager":
        return _eager(module)
    if spec.kind == "stock":
        return _stock(module, spec, cache_dir, caching)
    if spec.kind in BACKEND_KINDS:
        return _ov_backend(module, spec, cache_dir, caching, dynamic, inputs)
    return _static(module, spec, inputs)
