"""One dynamo graph, compiled per input signature and per set of weights.

:class:`CompiledGraph` is what the backend returns to dynamo. On each call it checks the
weights (cheap), picks the model compiled for the call's input signature, or builds one:

* a symbolic-shape graph (dynamo's second shape onward) is converted once with its dynamic
  dimensions kept, then reshaped and compiled for each new signature;
* otherwise the graph is traced for the signature, partitioned and converted.

Whatever OpenVINO cannot take runs in PyTorch with a WARNING, or raises when ``strict``.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import openvino as ov
import torch

from ov_backend import convert, weights
from ov_backend.cache import make_key
from ov_backend.ops import OpenVINOSupport, decomposition_table, node_op_name
from ov_backend.report import CompileReport, PartitionReport
from ov_backend.runtime import OVModule, OVRunner

if TYPE_CHECKING:
    from ov_backend.backend import OVBackend

logger = logging.getLogger(__name__)

#: How many sets of weights (e.g. LoRA combinations) keep compiled models in memory per graph.
MAX_WEIGHT_VARIANTS = 2


class OpenVINOFallbackError(RuntimeError):
    """OpenVINO could not take a graph and the ``strict`` setting forbids running it in PyTorch."""


@dataclass(frozen=True)
class InputKind:
    """What one dynamo graph input is.

    Attributes:
        kind: "weight", "derived" (a size of another input) or "user".
        base: for "derived": the index of the input it is a size of.
        dim: for "derived": which dimension.
        prop: for "derived": "size", "stride" or "storage_offset".
        name: where dynamo found it, e.g. "L['self']._modules['conv']._parameters['weight']".
    """

    kind: str
    base: int = -1
    dim: int = 0
    prop: str = "size"
    name: str = ""


def classify_inputs(gm: torch.fx.GraphModule) -> list[InputKind]:
    """Tell weights, derived sizes and user inputs apart from dynamo's graph-argument sources."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sources = [getattr(n.meta.get("grapharg"), "source", None) for n in placeholders]
    by_source = {s.name: i for i, s in enumerate(sources) if s is not None}
    kinds: list[InputKind] = []
    for source in sources:
        name = source.name if source is not None else ""
        if name and weights.is_weight_source(name):
            kinds.append(InputKind("weight", name=name))
            continue
        prop = getattr(source, "prop", None)
        base = getattr(source, "base", None)
        if prop is not None and base is not None and base.name in by_source:
            kinds.append(InputKind("derived", by_source[base.name], int(getattr(source, "idx", 0) or 0),
                                   str(getattr(prop, "name", "SIZE")).lower()))
            continue
        kinds.append(InputKind("user"))
    return kinds


def _signature(values: Sequence[Any], scalar_tensors: frozenset[int] = frozenset()) -> tuple[Any, ...]:
    sig: list[Any] = []
    for pos, v in enumerate(values):
        if pos in scalar_tensors:  # an unspecialised Python number dynamo passes as a 0-d tensor
            sig.append(v.item())
        elif isinstance(v, torch.Tensor):
            sig.append((tuple(v.shape), str(v.dtype).replace("torch.", "")))
        else:
            sig.append(v if isinstance(v, (int, float, bool)) else repr(v))
    return tuple(sig)


def _signature_text(sig: tuple[Any, ...]) -> str:
    parts = []
    for item in sig:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], tuple):
            parts.append(f"{item[1]}[{','.join(map(str, item[0]))}]")
        else:
            parts.append(str(item))
    return "(" + ", ".join(parts) + ")"


class _Variant:
    """How one signature runs: a partitioned graph, a single OpenVINO model, or eager PyTorch."""

    def __init__(self, run: Callable[[Sequence[Any]], Any], in_openvino: bool) -> None:
        self.run = run
        self.in_openvino = in_openvino


class CompiledGraph:
    """The callable dynamo runs in place of one captured graph.

    Args:
        gm: the captured graph.
        example_inputs: dynamo's example inputs (real weights, fake or real activations).
        kinds: what each input is (see :func:`classify_inputs`).
        backend: the owning backend (settings, OpenVINO core, cache, reports, stats).
        name: a name for logs and reports.
    """

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], kinds: Sequence[InputKind],
                 backend: OVBackend, name: str) -> None:
        self.gm = gm
        self.name = name
        self.backend = backend
        self.kinds = list(kinds)
        self.weight_index = [i for i, k in enumerate(self.kinds) if k.kind == "weight"]
        self.user_index = [i for i, k in enumerate(self.kinds) if k.kind == "user"]
        # dynamo's fake example values carry the symbolic sizes; the real example inputs do not
        values = [n.meta.get("example_value", e) for n, e in
                  zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs)]
        self.symbolic = any(isinstance(v, torch.SymInt) for v in values) or any(
            isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape) for v in values)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # Python numbers dynamo did not specialise (e.g. a norm's eps with dynamic=True) arrive as
        # 0-d tensors the graph only reads with .item(): they are baked into each signature's model
        self._scalar_tensors = frozenset(
            pos for pos, i in enumerate(self.user_index)
            if isinstance(values[i], torch.Tensor) and values[i].dim() == 0 and placeholders[i].users
            and all(u.op == "call_method" and u.target == "item" for u in placeholders[i].users))
        self._dynamic_dims = None if self._scalar_tensors else self._find_dynamic_dims(values)
        self._lock = threading.RLock()
        self._watch: weights.WeightWatch | None = None
        self._fingerprint: str | None = None
        self._by_weights: OrderedDict[str, dict[Any, Any]] = OrderedDict()
        self._graph_code = gm.code
        self._decomp = decomposition_table(backend.settings.decompositions)

    # -- inputs -----------------------------------------------------------------------------
    def _find_dynamic_dims(self, example_inputs: Sequence[Any]) -> list[list[int]] | None:
        """For each user input, its symbolic dimensions; None if the graph cannot be exported whole."""
        if not self.symbolic:
            return None
        dims: list[list[int]] = []
        for i in self.user_index:
            e = example_inputs[i]
            if not isinstance(e, torch.Tensor):
                return None  # a scalar input is baked per value: trace per signature instead
            dims.append([d for d, size in enumerate(e.shape) if isinstance(size, torch.SymInt)])
        outputs = next(n for n in self.gm.graph.nodes if n.op == "output").args[0]
        if not all(isinstance(o, torch.fx.Node) and isinstance(o.meta.get("example_value"), torch.Tensor)
                   for o in (outputs if isinstance(outputs, (tuple, list)) else [outputs])):
            return None
        return dims

    def _full_args(self, user_values: Sequence[Any], weight_values: Sequence[torch.Tensor]) -> list[Any]:
        full: list[Any] = [None] * len(self.kinds)
        for i, v in zip(self.user_index, user_values):
            full[i] = v
        for i, v in zip(self.weight_index, weight_values):
            full[i] = v
        for i, k in enumerate(self.kinds):
            if k.kind == "derived":
                base = full[k.base]
                full[i] = (base.size(k.dim) if k.prop == "size" else base.stride(k.dim) if k.prop == "stride"
                           else base.storage_offset())
        return full

    # -- call ---------------------------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        weight_values = [args[i] for i in self.weight_index]
        user_values = [args[i] for i in self.user_index]
        sig = _signature(user_values, self._scalar_tensors)
        variants = self._variants_for(weight_values)
        variant = variants.get(sig)
        if variant is None:
            with self._lock:
                variants = self._variants_for(weight_values)
                variant = variants.get(sig)
                if variant is None:
                    variant = self._build(sig, user_values, weight_values, variants)
                    variants[sig] = variant
        start = time.perf_counter()
        try:
            result = variant.run(user_values)
        except Exception as err:  # OpenVINO runtime errors come as RuntimeError and others
            if not variant.in_openvino:
                raise
            self._fail(f"{self.name} {_signature_text(sig)}: OpenVINO inference failed ({err})", err)
            with self._lock:
                variants[sig] = variant = self._eager_variant(weight_values)
            result = variant.run(user_values)
        self.backend.stats_counter.add(run_seconds=time.perf_counter() - start,
                               **({"ov_calls": 1} if variant.in_openvino else {"eager_calls": 1}))
        return result

    def _variants_for(self, weight_values: Sequence[torch.Tensor]) -> dict[Any, Any]:
        watch = self._watch
        if watch is not None and not watch.changed(weight_values) and self._fingerprint is not None:
            return self._by_weights[self._fingerprint]
        with self._lock:
            if self._watch is not None and not self._watch.changed(weight_values) and self._fingerprint:
                return self._by_weights[self._fingerprint]
            self._check_loaded(weight_values)
            start = time.perf_counter()
            fp = weights.fingerprint(weight_values, self.backend.digests)
            if self._watch is not None:
                logger.info("%s: weights changed (fingerprint %s, %.2fs); %s", self.name, fp[:12],
                            time.perf_counter() - start,
                            "reusing models built for them" if fp in self._by_weights else "will recompile")
            if fp not in self._by_weights:
                self._by_weights[fp] = {}
                while len(self._by_weights) > MAX_WEIGHT_VARIANTS:
                    self._by_weights.popitem(last=False)
            self._by_weights.move_to_end(fp)
            self._fingerprint = fp
            self._watch = weights.WeightWatch(weight_values)
            return self._by_weights[fp]

    def _check_loaded(self, weight_values: Sequence[torch.Tensor]) -> None:
        for index, tensor in zip(self.weight_index, weight_values):
            if tensor.is_meta:
                raise ValueError(
                    f"{self.kinds[index].name or 'a weight'} is on the meta device (it holds no data); load "
                    f"real weights into the module (e.g. load_state_dict(..., assign=True) or .to_empty() and "
                    f"a state dict) before running it compiled")

    # -- building -------------------------------------------------------------------------------
    def _fail(self, message: str, err: BaseException | None = None) -> None:
        if self.backend.settings.strict:
            raise OpenVINOFallbackError(message + " (strict mode: not running it in PyTorch)") from err
        logger.warning("%s; running it in PyTorch", message)

    def _eager_variant(self, weight_values: Sequence[torch.Tensor]) -> _Variant:
        frozen = list(weight_values)
        return _Variant(lambda user: self.gm(*self._full_args(user, frozen)), in_openvino=False)

    def _closure(self, weight_values: Sequence[torch.Tensor], scalars: dict[int, Any]) -> Callable[..., Any]:
        """``fn(*user tensors)`` running the graph with these weights and scalar inputs baked in."""
        frozen = list(weight_values)
        tensor_slots = [pos for pos in range(len(self.user_index)) if pos not in scalars]

        def fn(*tensors: torch.Tensor) -> Any:
            user: list[Any] = [None] * len(self.user_index)
            for pos, t in zip(tensor_slots, tensors):
                user[pos] = t
            for pos, value in scalars.items():
                user[pos] = value
            return self.gm(*self._full_args(user, frozen))

        return fn

    def _key(self, what: str, sig: Any, extra: dict[str, Any]) -> str:
        return make_key({"what": what, "signature": repr(sig), "weights": self._fingerprint,
                         "settings": self.backend.settings.result_key(), "versions": self.backend.versions,
                         **extra})

    def _build(self, sig: tuple[Any, ...], user_values: Sequence[Any], weight_values: Sequence[torch.Tensor],
               variants: dict[Any, Any]) -> _Variant:
        settings = self.backend.settings
        report = CompileReport(self.name, _signature_text(sig), "static", settings.device)
        start = time.perf_counter()
        try:
            with convert.build_lock():
                if self._dynamic_dims is not None and not settings.disabled_ops:
                    variant = self._build_dynamic(sig, user_values, weight_values, variants, report)
                    if variant is not None:
                        return variant
                return self._build_static(sig, user_values, weight_values, report)
        finally:
            self.backend.stats_counter.add(compile_seconds=time.perf_counter() - start,
                                           trace_seconds=report.trace_seconds,
                                           convert_seconds=report.convert_seconds)
            self.backend.add_report(report)

    def _compile(self, model: ov.Model | Path, part: PartitionReport) -> ov.CompiledModel:
        start = time.perf_counter()
        compiled = self.backend.compile_model(model)
        part.compile_seconds = time.perf_counter() - start
        self.backend.stats_counter.add(ov_compile_seconds=part.compile_seconds, compiles=1)
        for prop, attr in (("EXECUTION_DEVICES", "execution_devices"), ("INFERENCE_PRECISION_HINT", "precision")):
            try:
                value = compiled.get_property(prop)
            except RuntimeError:  # not every plugin reports every property
                continue
            if isinstance(value, ov.Type):
                value = value.to_string()
            setattr(part, attr, tuple(str(v) for v in value) if isinstance(value, list) else str(value))
        return compiled

    def _build_dynamic(self, sig: tuple[Any, ...], user_values: Sequence[Any],
                       weight_values: Sequence[torch.Tensor], variants: dict[Any, Any],
                       report: CompileReport) -> _Variant | None:
        assert self._dynamic_dims is not None
        part = PartitionReport("graph", ops=sum(1 for n in self.gm.graph.nodes if n.op == "call_function"))
        base = variants.get("__dynamic_model__")
        if base is None:
            key = self._key("dynamic", [(len(s[0]), s[1]) for s in sig], {"graph": self._graph_code,
                                                                          "dims": self._dynamic_dims})
            base = self.backend.cache_load(key)
            part.cache_hit = base is not None
            if base is None:
                start = time.perf_counter()
                try:
                    base = convert.convert_dynamic(self._closure(weight_values, {}), user_values,
                                                   self._dynamic_dims)
                except convert.ConversionError as err:
                    report.warnings.append(f"dynamic conversion failed: {err}")
                    logger.warning("%s: could not convert with dynamic shapes (%s); converting each input "
                                   "shape separately instead", self.name, err)
                    variants["__dynamic_model__"] = False
                    return None
                part.convert_seconds = time.perf_counter() - start
                self.backend.cache_store(key, base, f"{self.name} dynamic {report.signature}")
            variants["__dynamic_model__"] = base
        else:
            part.reused = base is not False
        if base is False:
            return None
        model = base.clone()
        model.reshape({i: ov.PartialShape(list(s[0])) for i, s in enumerate(sig)})
        try:
            compiled = self._compile(model, part)
        except RuntimeError as err:
            report.warnings.append(f"compile failed: {err}")
            logger.warning("%s: OpenVINO could not compile the reshaped model (%s); tracing this shape",
                           self.name, err)
            return None
        report.route = "dynamic"
        report.partitions.append(part)
        runner = OVRunner(compiled, [self._output_dtype(o) for o in self._outputs()])
        logger.info("OpenVINO compiled %s", report.summary())
        return _Variant(lambda user: tuple(runner(user)), in_openvino=True)

    def _outputs(self) -> list[torch.fx.Node]:
        out = next(n for n in self.gm.graph.nodes if n.op == "output").args[0]
        return list(out) if isinstance(out, (tuple, list)) else [out]

    @staticmethod
    def _output_dtype(node: torch.fx.Node) -> torch.dtype | None:
        value = node.meta.get("example_value", node.meta.get("val"))
        return value.dtype if isinstance(value, torch.Tensor) else None

    def _build_static(self, sig: tuple[Any, ...], user_values: Sequence[Any],
                      weight_values: Sequence[torch.Tensor], report: CompileReport) -> _Variant:
        settings = self.backend.settings
        scalars = {pos: v for pos, v in enumerate(user_values)
                   if not isinstance(v, torch.Tensor) or pos in self._scalar_tensors}
        tensors = [v for pos, v in enumerate(user_values) if pos not in scalars]
        whole_key = None
        if settings.model_caching and self._outputs_are_tensors():
            whole_key = self._key("whole", sig, {"graph": self._graph_code})
            cached = self._from_whole_graph_entry(whole_key, report)
            if cached is not None:
                return cached
        start = time.perf_counter()
        try:
            traced = convert.trace_static(self._closure(weight_values, scalars), tensors, self._decomp)
        except Exception as err:  # tracing can fail in many ways (data-dependent control flow, ...)
            report.route = "eager"
            report.warnings.append(f"could not trace the graph: {err}")
            self._fail(f"{self.name} {report.signature}: could not trace the graph ({type(err).__name__}: {err})",
                       err)
            return self._eager_variant(weight_values)
        report.trace_seconds = time.perf_counter() - start
        unconvertible: set[str] = set()
        for _attempt in range(3):
            support = OpenVINOSupport(settings.disabled_ops, unconvertible)
            graph, names = convert.partition(traced, support)
            report.fallback_ops = dict(support.rejected)
            report.partitions = []
            retry = False
            # a graph that is one partition is cached under the graph's own key: the next process
            # finds it without tracing
            covers = bool(whole_key) and not support.rejected and _covers_whole_graph(graph, names)
            for name in names:
                outcome = self._convert_and_compile(graph, name, report, whole_key if covers else None)
                if isinstance(outcome, convert.ConversionError) and outcome.unconverted:
                    new = {n for n in outcome.unconverted} - unconvertible
                    if new:
                        unconvertible |= {self._normalise(graph, name, op) for op in new}
                        retry = True
                        break
            if not retry:
                break
            traced = convert.trace_static(self._closure(weight_values, scalars), tensors, self._decomp)
        if report.fallback_ops:
            self._fail(f"{self.name} {report.signature}: ops left in PyTorch: "
                       + ", ".join(f"{op} ({why})" for op, why in sorted(report.fallback_ops.items())))
        in_ov = any(p.in_openvino for p in report.partitions)
        if not in_ov:
            report.route = "eager"
        logger.info("OpenVINO compiled %s", report.summary())
        scalar_free = graph

        def run(user: Sequence[Any]) -> Any:
            return scalar_free(*[v for pos, v in enumerate(user) if pos not in scalars])

        return _Variant(run, in_openvino=in_ov)

    @staticmethod
    def _normalise(graph: torch.fx.GraphModule, name: str, reported: str) -> str:
        """Map an op name the frontend reported ("aten.foo.default") to our node op name."""
        sub = graph.get_submodule(name)
        for node in sub.graph.nodes:
            if node.op == "call_function" and (node_op_name(node) == reported or str(node.target) == reported):
                return node_op_name(node)
        return reported

    def _outputs_are_tensors(self) -> bool:
        return all(isinstance(o, torch.fx.Node) and isinstance(o.meta.get("example_value"), torch.Tensor)
                   for o in self._outputs())

    def _from_whole_graph_entry(self, key: str, report: CompileReport) -> _Variant | None:
        """A variant from a cached model of the whole graph, with no tracing at all; None if absent."""
        xml = self.backend.cache_file(key)
        if xml is None:
            return None
        part = PartitionReport("graph", ops=sum(1 for n in self.gm.graph.nodes if n.op == "call_function"),
                               cache_hit=True)
        try:
            compiled = self._compile(xml, part)
        except RuntimeError as err:
            logger.warning("%s: the cached model could not be compiled (%s); converting again", self.name, err)
            return None
        report.partitions.append(part)
        runner = OVRunner(compiled, [self._output_dtype(o) for o in self._outputs()])
        logger.info("OpenVINO compiled %s", report.summary())
        baked = self._scalar_tensors
        return _Variant(lambda user: tuple(runner([v for pos, v in enumerate(user)
                                                   if isinstance(v, torch.Tensor) and pos not in baked])),
                        in_openvino=True)

    def _convert_and_compile(self, graph: torch.fx.GraphModule, name: str, report: CompileReport,
                             key: str | None = None) -> convert.ConversionError | None:
        sub = graph.get_submodule(name)
        part = PartitionReport(name, ops=sum(1 for n in sub.graph.nodes if n.op == "call_function"))
        report.partitions.append(part)
        # hashing the constants costs time: only for the disk cache
        if key is None and self.backend.settings.model_caching:
            key = self._key("partition", name, {
                "code": sub.code, "constants": weights.fingerprint(list(sub.buffers()), self.backend.digests),
                "inputs": [repr(n.meta.get("val")) for n in sub.graph.nodes if n.op == "placeholder"]})
        model: ov.Model | Path | None = self.backend.cache_file(key) if key else None
        part.cache_hit = model is not None
        if model is None:
            start = time.perf_counter()
            try:
                model = convert.convert_partition(sub)
            except convert.ConversionError as err:
                part.in_openvino = False
                if err.unconverted:
                    return err
                report.warnings.append(f"{name}: {err}")
                self._fail(f"{self.name} {report.signature}: partition {name} could not be converted ({err})",
                           err)
                return err
            part.convert_seconds = time.perf_counter() - start
            if key:
                # compiled from its cache file, OpenVINO's blob is found again by the next process
                model = self.backend.cache_store(key, model, f"{self.name} {name} {report.signature}") or model
        try:
            compiled = self._compile(model, part)
        except RuntimeError as err:
            part.in_openvino = False
            report.warnings.append(f"{name}: compile failed: {err}")
            self._fail(f"{self.name} {report.signature}: partition {name} could not be compiled ({err})", err)
            return None
        outputs = next(n for n in sub.graph.nodes if n.op == "output").args[0]
        out_nodes = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        dtypes = [self._output_dtype(o) if isinstance(o, torch.fx.Node) else None for o in out_nodes]
        single = not isinstance(outputs, (tuple, list))
        setattr(graph, name, OVModule(OVRunner(compiled, dtypes), single))
        graph.recompile()
        return None


def _covers_whole_graph(graph: torch.fx.GraphModule, names: Sequence[str]) -> bool:
    """True when one partition takes every graph input in order and gives every output in order."""
    if len(names) != 1:
        return False
    nodes = list(graph.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    calls = [n for n in nodes if n.op == "call_module"]
    if len(calls) != 1 or list(calls[0].args) != placeholders or calls[0].kwargs:
        return False
    call = calls[0]
    outputs = next(n for n in nodes if n.op == "output").args[0]
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    for position, out in enumerate(outputs):
        if out is call and len(outputs) == 1:
            continue
        if not (isinstance(out, torch.fx.Node) and out.op == "call_function" and out.target is operator.getitem
                and out.args[0] is call and out.args[1] == position):
            return False
    extra = [n for n in nodes
             if n.op == "call_function" and not (n.target is operator.getitem and n.args[0] is call)]
    return not extra
