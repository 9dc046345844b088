"""A1111's built-in Lora extension around routed calls: LoRA weights as stock A1111 has them, and compiled
graphs that never contain the extension's code.

The Lora extension (``extensions-builtin/Lora``) replaces ``forward`` of ``torch.nn.Linear``, ``Conv2d``,
``GroupNorm``, ``LayerNorm`` and ``MultiheadAttention`` at class level. Each replacement first calls
``networks.network_apply_weights(layer)``, which, when the wanted networks (names and strengths) differ from
the ones in the layer's weights, restores the layer's backed-up weights and writes the LoRA-modified ones in
place; then it calls the original ``forward``. Traced by dynamo, that Python (module globals, in-place
weight writes, an option read) ends up inside the compiled graph, which then neither follows a LoRA change
nor converts cleanly.

:class:`LoraHook` wraps each routed method so that, before the compiled call, the extension's weights are
put in place eagerly in every layer of the routed module the extension handles (what stock A1111's
forwards would do during the call; nothing when nothing changed), and during the compiled call the class
``forward`` methods are the originals the extension saved (``networks.originals``), so dynamo traces plain
torch layers. Whatever was on the classes is put back afterwards, on exceptions too. The backend notices
the in-place weight changes (it checks the weights' version counters on every call) and builds or reuses
the models for those weights.

The extension's "functional" mode (``lora_functional``, "use old method ..."), computes LoRA in each
layer's forward instead of changing weights; with networks loaded, a routed call then runs in plain PyTorch
(counted as such, so the run's status and a WARNING say why).

Before it first writes a LoRA into a layer, the Lora extension keeps a copy of the layer's weights (and bias) to
restore them from: every layer it names, a whole copy of the UNet's and the text encoders' weights (full-size
SD 1.5 at f32: 4.4 GiB measured in stock A1111; SDXL: about 12 GiB by its weights' size), which stock A1111 holds
in memory for as long as the checkpoint is loaded. With the weight file on, :class:`LoraHook` moves those copies
into it once written (``ov_backend.WeightFile.place``): A1111 reads them back from the file when it restores the
weights.

The class ``forward`` methods are process-wide: while a routed call runs, a layer called by another thread
outside any routed call gets no LoRA. A1111 runs one generation at a time (``queue_lock``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import host
from .backend_bridge import ov_backend
from .compiled_route import CompiledRoute

if TYPE_CHECKING:
    from ov_backend import CompileReport

logger = logging.getLogger(__name__)

#: The torch.nn classes whose ``forward`` the Lora extension replaces (``lora_patches.LoraPatches``),
#: by the names it uses (``networks.network_<name>_forward``, ``originals.<name>_forward``).
LORA_CLASSES: tuple[str, ...] = ("Conv2d", "GroupNorm", "LayerNorm", "Linear", "MultiheadAttention")

FUNCTIONAL_REASON = (
    "A1111's Lora option \"use old method\" (lora_functional) computes LoRA inside each layer's forward, "
    "which a compiled graph cannot follow; turn it off in Settings > Compatibility to accelerate with LoRA"
)


def lora_layers(module: nn.Module) -> list[nn.Module]:
    """The layers of ``module`` whose forward the Lora extension replaces, in module order.

    The output projection of a ``MultiheadAttention`` is left out: its parent changes its weights (and its
    own forward is never called).
    """
    classes = tuple(getattr(nn, name) for name in LORA_CLASSES)
    layers = [m for m in module.modules() if isinstance(m, classes)]
    inner = {id(m.out_proj) for m in layers if isinstance(m, nn.MultiheadAttention)}
    return [m for m in layers if id(m) not in inner]


def _plain_forwards(networks: ModuleType) -> list[tuple[type, Any]]:
    """Put the original ``forward`` back on each class whose ``forward`` is the Lora extension's; returns
    (class, what was there) for each one changed."""
    saved: list[tuple[type, Any]] = []
    originals = networks.originals
    for name in LORA_CLASSES:
        cls = getattr(nn, name)
        current = cls.__dict__.get("forward")
        patched = getattr(networks, f"network_{name}_forward", None)
        original = getattr(originals, f"{name}_forward", None)
        if current is None or original is None or current is original:
            continue
        if current is not patched:  # someone else patched on top of the Lora extension: left as it is
            logger.debug("%s.forward is neither the Lora extension's nor the original: left in place", name)
            continue
        saved.append((cls, current))
        cls.forward = original
    return saved


def lora_backups(layers: list[nn.Module]) -> list[torch.Tensor]:
    """The Lora extension's copies of the layers' weights and biases (``network_weights_backup``, a tuple for a
    ``MultiheadAttention``, and ``network_bias_backup``)."""
    found: list[torch.Tensor] = []
    for layer in layers:
        for name in ("network_weights_backup", "network_bias_backup"):
            value = getattr(layer, name, None)
            found.extend(t for t in (value if isinstance(value, tuple) else (value,)) if isinstance(t, torch.Tensor))
    return found


#: The Lora extension's new weight copies are moved into the weight file each time this many bytes of them wait.
BACKUP_CHUNK_BYTES = 256 << 20


class _BackupMover:
    """Collects layers whose Lora extension copies are new, and hands them to ``move`` (``(bytes, seconds)`` back)
    each time :data:`BACKUP_CHUNK_BYTES` of copies not yet in the file (``held``) wait, and at :meth:`finish`."""

    def __init__(self, move: Callable[[list[nn.Module]], tuple[int, float]],
                 held: Callable[[torch.Tensor], bool]) -> None:
        self._move, self._held = move, held
        self._layers: list[nn.Module] = []
        self._waiting = 0
        self.moved, self.seconds = 0, 0.0

    def add(self, layer: nn.Module) -> None:
        waiting = sum(t.numel() * t.element_size() for t in lora_backups([layer]) if not self._held(t))
        if not waiting:
            return
        self._layers.append(layer)
        self._waiting += waiting
        if self._waiting >= BACKUP_CHUNK_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self._layers:
            moved, seconds = self._move(self._layers)
            self.moved, self.seconds = self.moved + moved, self.seconds + seconds
        self._layers, self._waiting = [], 0

    def finish(self) -> tuple[int, float]:
        self._flush()
        return self.moved, self.seconds


def _weight_versions(layers: list[nn.Module]) -> tuple[int, ...]:
    """In-place write counters of the layers' parameters (they move when the Lora extension writes weights)."""
    return tuple(p._version for layer in layers for p in layer.parameters(recurse=False))


def network_set(networks: ModuleType) -> tuple[tuple[str, float, float], ...]:
    """The loaded networks as (name, text-encoder strength, UNet strength)."""
    return tuple(
        (str(getattr(n, "name", "?")), float(getattr(n, "te_multiplier", 1.0)),
         float(getattr(n, "unet_multiplier", 1.0)))
        for n in networks.loaded_networks
    )


def describe_networks(wanted: tuple[tuple[str, float, float], ...]) -> str:
    """E.g. "ovtest-lora:0.5", "a:1, b:0.8 (TE 0.5)" or "none"."""
    if not wanted:
        return "none"
    items = []
    for name, te, unet in wanted:
        items.append(f"{name}:{unet:g}" + (f" (TE {te:g})" if te != unet else ""))
    return ", ".join(items)


@dataclass(frozen=True)
class LoraChange:
    """A routed part whose LoRA set or strengths changed, as its call saw it."""

    label: str
    networks: str
    """What is applied now (:func:`describe_networks`)."""
    write_seconds: float
    """How long the Lora extension took to write the part's new weights (stock A1111 does the same work)."""
    backup_bytes: int = 0
    """Bytes of the Lora extension's copies of the part's weights moved into the weight file with this change."""
    backup_seconds: float = 0.0
    """How long moving them took."""


def changes_line(changes: list[LoraChange], reports: list[CompileReport]) -> str:
    """The status line for LoRA changes in a run: which parts got new weights, how long A1111's Lora
    extension took to write them, and what the backend did."""
    now: dict[str, str] = {}
    for change in changes:
        now[change.label] = change.networks
    written = sum(change.write_seconds for change in changes)
    rebuilt = [r for r in reports if r.partitions]
    convert = sum(r.convert_seconds for r in rebuilt)
    compile_ = sum(r.compile_seconds for r in rebuilt)
    hits = sum(1 for r in rebuilt if r.cache_hit)
    cost = (
        f"the backend built {len(rebuilt)} model(s) for new weights or sizes: convert {convert:.1f} s, "
        f"compile {compile_:.1f} s, {hits} from the disk cache; no part ran in PyTorch for it"
        if rebuilt
        else "compiled models for these weights were reused (no conversion, no compile)"
    )
    quantized = [r for r in reports if r.route == "int8" and r.quantized]
    if quantized:
        seconds = sum(p.quantize_seconds for r in quantized for p in r.partitions)
        cost += (f"; the INT8 UNet ran at float for these weights and was quantized again on this generation's "
                 f"steps ({seconds:.1f} s; kept in the disk cache for these weights)")
    elif any(r.calibrating for r in reports):
        cost += "; the INT8 UNet runs at float for these weights until it is quantized again"
    parts = "; ".join(f"{label} -> {networks}" for label, networks in now.items())
    backups = sum(change.backup_bytes for change in changes)
    kept = (f" Its copy of the original weights ({ov_backend.format_bytes(backups)}) moved into the weight file in "
            f"{sum(change.backup_seconds for change in changes):.1f} s (stock A1111 keeps it in memory)."
            if backups else "")
    return (f"LoRA changed: {parts}. A1111's Lora extension wrote the new weights in {written:.1f} s (as it does "
            f"without OpenVINO).{kept} Cost: {cost}.")


class LoraHook:
    """Makes routed calls see the Lora extension's weights but not its code (see the module docstring).

    Args:
        lock: the accelerator's lock (guards the routes' call counters).
        weight_file: gives the ``ov_backend.WeightFile`` the Lora extension's copies of the weights move into, or
            None to leave them in memory.
    """

    def __init__(self, lock: threading.RLock, weight_file: Callable[[], Any] | None = None) -> None:
        self._lock = lock
        self._weight_file = weight_file
        self._patch_lock = threading.Lock()
        self._depth = 0
        self._saved: list[tuple[type, Any]] = []
        self._changes: list[LoraChange] = []

    def take_changes(self) -> list[LoraChange]:
        """The routes whose LoRA set or strengths changed since the last call of this method; clears the list."""
        with self._lock:
            changes, self._changes = self._changes, []
        return changes

    @contextlib.contextmanager
    def plain_forwards(self, networks: ModuleType) -> Iterator[None]:
        """During the block, the torch.nn classes have their original ``forward`` (nested and concurrent
        blocks share one swap: the last to leave puts back what was there)."""
        with self._patch_lock:
            if self._depth == 0:
                self._saved = _plain_forwards(networks)
            self._depth += 1
        try:
            yield
        finally:
            with self._patch_lock:
                self._depth -= 1
                if self._depth == 0:
                    for cls, forward in reversed(self._saved):
                        cls.forward = forward
                    self._saved = []

    def wrap(self, forward: Callable[..., Any], entry: CompiledRoute) -> Callable[..., Any]:
        """``forward`` (the routed method of ``entry``'s module) with the Lora extension handled around it."""
        layers: list[nn.Module] | None = None

        def routed_call(*args: Any, **kwargs: Any) -> Any:
            nonlocal layers
            networks = host.lora_networks()
            module = entry.module_ref()
            if networks is None or networks.originals is None or module is None:
                return forward(*args, **kwargs)
            functional = bool(host.option("lora_functional", False))
            if functional and networks.loaded_networks:
                return self._plain_pytorch(entry, args, kwargs)
            first = layers is None
            if first:
                layers = lora_layers(module)
            wanted = network_set(networks)
            changed = wanted != entry.lora_applied
            before = _weight_versions(layers) if changed else ()
            start = time.perf_counter()
            # On a change, the Lora extension copies each layer's weights as it first writes them (every layer's,
            # a whole part's worth): the copies move into the weight file a chunk at a time as they are made, so
            # memory never holds them all. At the first call, so do the copies a stock generation left behind.
            weight_file = self._weight_file() if (changed or first) and self._weight_file is not None else None
            mover = _BackupMover(self._move_backups, weight_file.holds) if weight_file is not None else None
            for layer in layers:
                # functional mode without networks: stock A1111 changes weights in MultiheadAttention only
                if not functional or isinstance(layer, nn.MultiheadAttention):
                    networks.network_apply_weights(layer)
                if mover is not None:
                    mover.add(layer)
            moved = mover.finish() if mover is not None else (0, 0.0)
            if changed:
                written = time.perf_counter() - start - moved[1]
                with self._lock:
                    entry.lora_applied = wanted
                    if _weight_versions(layers) != before:  # the networks touch this part's layers
                        self._changes.append(LoraChange(entry.label, describe_networks(wanted), written, *moved))
            with self.plain_forwards(networks):
                return forward(*args, **kwargs)

        return routed_call

    def _move_backups(self, layers: list[nn.Module]) -> tuple[int, float]:
        """Move the Lora extension's new copies of ``layers``' weights into the weight file; (bytes, seconds)."""
        weight_file = self._weight_file() if self._weight_file is not None else None
        backups = lora_backups(layers) if weight_file is not None else []
        if not backups:
            return 0, 0.0
        result = weight_file.place(backups)
        if result.moved_bytes:
            logger.info("moved %s of the Lora extension's weight copies into the weight file in %.1f s",
                        ov_backend.format_bytes(result.moved_bytes), result.seconds)
        for why, nbytes in result.kept_bytes.items():
            logger.info("%s of the Lora extension's weight copies stay in memory: %s",
                        ov_backend.format_bytes(nbytes), why)
        return result.moved_bytes, result.seconds

    def _plain_pytorch(self, entry: CompiledRoute, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with self._lock:
            entry.calls += 1
            entry.eager_calls += 1
            entry.eager_reason = FUNCTIONAL_REASON
        source = entry.source  # the routed method as it was before routing (set on every route's entry)
        assert source is not None, entry.label
        return source(*args, **kwargs)
