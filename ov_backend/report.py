"""What a compile did (partitions, what stayed in PyTorch and why, times, cache use) and a backend's counters."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from ov_backend.files import format_bytes


@dataclass
class PartitionReport:
    """One OpenVINO partition of a graph.

    Attributes:
        name: the partition's name in the graph ("fused_0", or "graph" for a whole-graph model).
        ops: how many aten ops it holds.
        cache_hit: its converted model came from the disk cache.
        convert_seconds: time to convert it (0 on a cache hit).
        compile_seconds: time OpenVINO took to compile it for the device.
        in_openvino: False when its conversion or compile failed and it runs in PyTorch.
        reused: the model converted for an earlier shape or earlier weights was compiled again (no conversion).
        weights_changed: the weights changed in place since the conversion, and the model that reads
            them from the tensors was compiled again (see :mod:`ov_backend.weight_binding`).
        execution_devices: the devices OpenVINO actually runs it on (what "AUTO" chose).
        precision: the inference precision the plugin uses ("f32", "bf16", ...).
        quantized: the model is the INT8 one (weights and activations at 8 bits, see :mod:`ov_backend.quantize`).
        quantize_seconds: time NNCF took to quantize it (0 when it came from the cache or was quantized earlier).
        calibration_samples: how many recorded calls it was calibrated on (0 when it came from the cache).
        all_shapes: it is the model compiled with dynamic shapes that serves every input shape (see
            ``BackendSettings.shared_shapes``); ``reused``: it was compiled for an earlier shape.
        replaced: how many models compiled for one shape each it replaced when it was compiled (their
            shapes run it from then on).
        borrowed: the model for all shapes is another graph's, captured from the same code and run with
            the same weights (see :class:`ov_backend.variants.SharedModels`): nothing compiled.
        compressed: its weights were compressed to 8 bits before the compile (precision "int8-weights", see
            :mod:`ov_backend.compress`).
    """

    name: str
    ops: int
    cache_hit: bool = False
    convert_seconds: float = 0.0
    compile_seconds: float = 0.0
    in_openvino: bool = True
    reused: bool = False
    weights_changed: bool = False
    execution_devices: tuple[str, ...] = ()
    precision: str = ""
    quantized: bool = False
    quantize_seconds: float = 0.0
    calibration_samples: int = 0
    all_shapes: bool = False
    replaced: int = 0
    borrowed: bool = False
    compressed: bool = False


@dataclass
class CompileReport:
    """The result of compiling one graph for one input signature.

    Attributes:
        graph: a name for the graph ("graph 0" ...).
        signature: the input shapes and dtypes.
        route: "static" (traced for this signature), "dynamic" (one conversion, reshaped per
            shape), "eager" (all of it in PyTorch) or "int8" (quantizing a float model).
        device: the OpenVINO device.
        partitions: the OpenVINO partitions.
        fallback_ops: op name -> why it ran in PyTorch.
        warnings: fallbacks of whole partitions or graphs, with their reasons.
        trace_seconds: time to trace the graph to aten ops.
        calibrating: at precision "int8", with no INT8 model yet: how many calls run at float and are
            recorded for calibration before quantizing (0 otherwise).
        not_int8: at precision "int8": why the graph runs at float and will not be quantized for these weights
            (NNCF failed, or its work would not fit in memory); "" otherwise.
    """

    graph: str
    signature: str
    route: str
    device: str
    partitions: list[PartitionReport] = field(default_factory=list)
    fallback_ops: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    trace_seconds: float = 0.0
    calibrating: int = 0
    not_int8: str = ""

    @property
    def quantized(self) -> bool:
        """The variant runs an INT8 model."""
        return any(p.quantized and p.in_openvino for p in self.partitions)

    @property
    def convert_seconds(self) -> float:
        return sum(p.convert_seconds for p in self.partitions)

    @property
    def compile_seconds(self) -> float:
        return sum(p.compile_seconds for p in self.partitions)

    @property
    def cache_hit(self) -> bool:
        """Every partition's model came from the disk cache."""
        return bool(self.partitions) and all(p.cache_hit for p in self.partitions)

    @property
    def fully_in_openvino(self) -> bool:
        return self.route != "eager" and not self.fallback_ops and all(p.in_openvino for p in self.partitions)

    @property
    def precisions(self) -> tuple[str, ...]:
        """The inference precisions of the OpenVINO partitions."""
        found = {p.precision for p in self.partitions if p.in_openvino and p.precision}
        if self.quantized:
            found.add("int8")
        if any(p.compressed and p.in_openvino for p in self.partitions):
            found.add("int8-weights")
        return tuple(sorted(found))

    @property
    def execution_devices(self) -> tuple[str, ...]:
        """Every device the OpenVINO partitions run on."""
        return tuple(sorted({d for p in self.partitions if p.in_openvino for d in p.execution_devices}))

    def summary(self) -> str:
        """One line for logs and status panels."""
        in_ov = sum(1 for p in self.partitions if p.in_openvino)
        parts = [
            f"{self.graph} {self.signature}: {self.route} on {self.device}"
            + (f" (ran on {', '.join(self.execution_devices)}"
               + (f", {'/'.join(self.precisions)}" if self.precisions else "") + ")"
               if self.execution_devices else ""),
            f"{in_ov} OpenVINO partition(s)",
            f"trace {self.trace_seconds:.2f}s, convert {self.convert_seconds:.2f}s, "
            f"compile {self.compile_seconds:.2f}s",
            ("conversion reused for the new weights" if any(p.weights_changed for p in self.partitions)
             else "conversion reused") if self.partitions and all(p.reused for p in self.partitions)
            else "cache hit" if self.cache_hit else "cache miss",
        ]
        if any(p.borrowed for p in self.partitions):
            parts.append("the compiled model for all shapes of another graph of the same code and weights")
        elif any(p.all_shapes for p in self.partitions):
            replaced = sum(p.replaced for p in self.partitions)
            parts.append("one compiled model for all shapes"
                         + (f" (replaces {replaced} compiled for one shape each)" if replaced else ""))
        quantized = [p for p in self.partitions if p.quantized]
        if self.route == "int8":
            parts = [f"{self.graph} {self.signature}: INT8 quantization"]
            parts += [f"calibrated on {p.calibration_samples} recorded call(s), quantized in {p.quantize_seconds:.1f}s"
                      for p in quantized]
        elif quantized:
            parts.append("INT8 model" + (" from the cache" if self.cache_hit else ""))
        if self.calibrating:
            parts.append(f"INT8: runs at float while {self.calibrating} call(s) are recorded for calibration")
        if self.fallback_ops:
            parts.append("in PyTorch: " + ", ".join(f"{op} ({why})" for op, why in sorted(self.fallback_ops.items())))
        if self.warnings:
            parts.append("fallbacks: " + "; ".join(self.warnings))
        return "; ".join(parts)


@dataclass(frozen=True)
class Stats:
    """A backend's counters at one moment (:meth:`StatsCounter.snapshot`), or summed over a run.

    ``compile_seconds`` is all the time spent getting graphs ready (tracing, conversion or cache
    load, OpenVINO compile); ``trace_seconds``, ``convert_seconds`` and ``ov_compile_seconds`` split
    it. ``run_seconds`` is time spent in calls of ready graphs. Dynamo's own capture is in neither.
    ``quantize_seconds`` (part of ``compile_seconds``) is NNCF's time making INT8 models; ``quantized``
    counts them. ``hash_seconds`` (part of ``compile_seconds`` too) is the time spent fingerprinting new
    weights: a graph's first call, and each in-place change (a LoRA, a checkpoint loaded into the model).
    ``capture_seconds`` is dynamo's capture where its owner measures it (capturing ahead of time, or
    loading a saved capture: see :mod:`ov_backend.portable`), apart from ``compile_seconds``;
    ``captures_made``, ``captures_saved`` and ``captures_loaded`` count those. ``released`` counts compiled
    models released (see ``OVBackend.start_window``); ``kept_previous`` those of the previous weights a
    release left in memory (``BackendSettings.previous_weights``); ``released_stale`` (part of
    ``released``) those released from graphs not called since their weights changed (e.g. a long
    prompt's capture of the UNet after a LoRA change), where the previous weights' models are not kept.
    ``weights_moved_bytes`` counts bytes of PyTorch weights moved into a memory-mapped file before their
    first conversion (``BackendSettings.weights_in_file``, :mod:`ov_backend.weight_file`), in
    ``weights_move_seconds`` (part of ``compile_seconds``); ``weights_kept_bytes`` those that stayed in
    memory beside OpenVINO's copy (the backend's ``weights_kept`` says why). ``cache_pruned`` and
    ``cache_pruned_bytes`` count the disk cache's entries removed to keep it under its limit
    (``BackendSettings.cache_max_bytes``), ``cache_prune_errors`` those that could not be removed.

    :meth:`as_dict` is the mapping ``OVBackend.stats()`` returns; :meth:`text_lines` and :meth:`report_json`
    render a run's counters for a status text and a status report.
    """

    compile_seconds: float = 0.0
    trace_seconds: float = 0.0
    convert_seconds: float = 0.0
    ov_compile_seconds: float = 0.0
    run_seconds: float = 0.0
    ov_calls: int = 0
    eager_calls: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    compiles: int = 0
    released: int = 0
    released_stale: int = 0
    kept_previous: int = 0
    quantize_seconds: float = 0.0
    quantized: int = 0
    hash_seconds: float = 0.0
    capture_seconds: float = 0.0
    captures_made: int = 0
    captures_saved: int = 0
    captures_loaded: int = 0
    weights_moved_bytes: int = 0
    weights_move_seconds: float = 0.0
    weights_kept_bytes: int = 0
    cache_pruned: int = 0
    cache_pruned_bytes: int = 0
    cache_prune_errors: int = 0

    @classmethod
    def from_mapping(cls, values: Mapping[str, float]) -> Stats:
        """The counters in ``values`` (e.g. ``OVBackend.stats()``, or a difference or sum of them); keys that
        name no counter are left out, counters missing are 0."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in values.items() if key in names})

    def as_dict(self) -> dict[str, float]:
        """Counter name -> value, in field order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def report_json(self) -> dict[str, float]:
        """The counters a run's status report gives (calls, cache hits, compile and run time, releases,
        captures)."""
        return {key: getattr(self, key) for key in REPORTED_STATS}

    def text_lines(self) -> list[str]:
        """A run's counters as status lines: compile and run time, calls, cache hits, captures, releases."""
        hashed = self.hash_seconds
        lines = [
            f"Compile {self.compile_seconds:.1f} s"
            + (f" ({hashed:.1f} s of it fingerprinting new weights)" if hashed >= 0.05 else "")
            + f", run {self.run_seconds:.1f} s; "
            f"{int(self.ov_calls)} OpenVINO calls, {int(self.eager_calls)} PyTorch "
            f"calls; cache hits {int(self.cache_hits)}."
        ]
        lines.extend(self.capture_lines())
        released = int(self.released)
        if released:
            lines.append(
                f"Released {released} compiled model(s) no call of this generation used (other sizes, weights or "
                "precisions), to keep memory down (using one again compiles it again)."
            )
        stale = int(self.released_stale)
        if stale:
            lines.append(
                f"Of them, {stale} belonged to parts not called since their weights changed (e.g. a long prompt's "
                "UNet after a LoRA or checkpoint change): the setting for the weights used before says not to "
                "keep them."
            )
        moved = int(self.weights_moved_bytes)
        if moved:
            lines.append(
                f"Moved {format_bytes(moved)} of PyTorch's weights into a memory-mapped file in "
                f"{self.weights_move_seconds:.1f} s: OpenVINO's copy is the one in memory (PyTorch reads the file "
                "when it needs them)."
            )
        if int(self.weights_kept_bytes):
            lines.append(
                f"{format_bytes(self.weights_kept_bytes)} of PyTorch's weights stay in memory beside OpenVINO's copy "
                "(see the log for why)."
            )
        pruned = int(self.cache_pruned)
        if pruned or int(self.cache_prune_errors):
            lines.append(
                f"Disk cache: removed {pruned} least recently used entries ({format_bytes(self.cache_pruned_bytes)}) "
                "to stay under its limit"
                + (f"; {int(self.cache_prune_errors)} could not be removed (see the log)" if self.cache_prune_errors
                   else "") + "."
            )
        kept = int(self.kept_previous)
        if kept:
            lines.append(
                f"Kept {kept} compiled model(s) of the weights used before (the previous checkpoint, or the model "
                "before a LoRA change) while memory allows: going back to them compiles nothing."
            )
        return lines

    def capture_lines(self) -> list[str]:
        """What PyTorch's graph capture (dynamo tracing the model's Python code) cost, when it was measured:
        captured now and saved for the next start, or loaded from the disk cache."""
        made, loaded = int(self.captures_made), int(self.captures_loaded)
        if not made and not loaded:
            return []
        what = []
        if made:
            saved = int(self.captures_saved)
            what.append(f"{made} captured (dynamo tracing the model's code), "
                        + ("all" if saved == made else f"{saved} of them") + " saved for the next start")
        if loaded:
            what.append(f"{loaded} loaded from the disk cache instead of tracing again")
        return [f"Graph capture {self.capture_seconds:.1f} s: " + "; ".join(what) + "."]


#: The counters a run's status report gives (:meth:`Stats.report_json`), in its order.
REPORTED_STATS = ("ov_calls", "eager_calls", "cache_hits", "compile_seconds", "convert_seconds", "run_seconds",
                  "released", "released_stale", "kept_previous", "capture_seconds", "captures_made",
                  "captures_saved", "captures_loaded", "weights_moved_bytes", "weights_move_seconds",
                  "weights_kept_bytes", "cache_pruned", "cache_pruned_bytes", "cache_prune_errors")


class StatsCounter:
    """A backend's counters across calls (thread-safe); :meth:`snapshot` reads them as a :class:`Stats`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = Stats().as_dict()

    def add(self, **amounts: float) -> None:
        """Add to the counters named (a name that is no counter of :class:`Stats` raises KeyError)."""
        with self._lock:
            for key, amount in amounts.items():
                self._values[key] += amount

    def snapshot(self) -> Stats:
        with self._lock:
            return Stats(**self._values)

    def reset(self) -> None:
        with self._lock:
            self._values = Stats().as_dict()
