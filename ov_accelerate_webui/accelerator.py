"""Compiled parts of the loaded checkpoint: which backend and compiled forward belongs to which module.

One :class:`Accelerator` lives as long as the extension (created by the script entry point and reset
on script unload). It keeps, for the checkpoints of the last generation (the
selected one, and a refiner or hires checkpoint that A1111 switched to during it), one ov_backend
instance per backend setting and one compiled forward per routed module object, so the next generation
starts at full speed. The backend itself notices weight changes (LoRA, a new VAE, a refiner loaded into
the same modules) and shapes; this object notices a checkpoint the last generation did not use and
drops what belonged to the others. All methods are thread-safe.

Every routed call is checked (:mod:`.compiled_route`): a call dynamo ran without a compiled graph is
counted with the reason; at automatic precision, a non-finite output from finite inputs moves the route to
its f32 build for as long as its compiled forward lives (:mod:`.finite_guard`); a call whose work the WebUI
changed in a way OpenVINO does not take (Token merging) runs in PyTorch. The run's status says each.

"""

from __future__ import annotations

import dataclasses
import logging
import threading
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ov_accelerate_sd.backends import BackendChoice, Backends, Mark
from ov_accelerate_sd.parts import VARYING_DIMS
from ov_accelerate_sd.step_cache import StepCacheRun, StepCacheSettings

from .backend_bridge import BackendApi
from .compiled_route import CompiledRoute, compile_route, f32_route, make_forward
from .finite_guard import F32Switch
from .hosts import Host, detect
from .lora import LoraChange, LoraHook
from .model_parts import Target, checkpoint_key
from .routing import Route, mark_ours
from .settings import AccelerateSettings

if TYPE_CHECKING:
    from ov_backend import CompileReport, OVBackend

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class PreparedRun:
    """What one generation routes, and where its status comes from."""

    routes: tuple[Route, ...]
    settings: AccelerateSettings
    choice: BackendChoice
    """The backend the user chose (the parts run under ``choice.for_part``)."""
    checkpoint: str
    mark: Mark
    """The backends' reports and counters as the run began."""
    entries: tuple[CompiledRoute, ...] = ()
    """The compiled forward behind each route (their call counters tell which routes ran)."""
    calls_before: tuple[int, ...] = ()
    """Calls of each entry before the run."""
    eager_before: tuple[int, ...] = ()
    """Calls of each entry that ran in plain PyTorch before the run."""
    pytorch_before: tuple[int, ...] = ()
    """Calls of each entry run on the module's own method (``compiled_route.make_forward``'s bypass) before
    the run."""
    f32_choice: BackendChoice | None = None
    """The backend of the f32 builds of routes that overflow; None when the run is at f32 already."""
    f32_before: tuple[bool, ...] = ()
    """Whether each entry ran at f32 before the run."""
    released_other: int = 0
    """Compiled models of builds for other options released as the run began."""
    step_cache: StepCacheRun | None = None
    """The UNet's step caching in this run (None: off); the caller tells it where sampling is."""


#: How a run's compiled models are kept (see :meth:`Accelerator.prepare`).
WINDOW_NEW, WINDOW_CONTINUE, WINDOW_OFF = "new", "continue", "off"


class Accelerator:
    """Owns compiled models across generations; :meth:`reset` drops them."""

    def __init__(self, api: BackendApi, notify: Callable[[str | None], None] | None = None,
                 host: Host | None = None) -> None:
        """Args:
        api: the loaded ov_backend API.
        notify: called with "OpenVINO: compiling ..." before a call with a new input signature
            and with None after it (the WebUI shows it in its progress text).
        host: the WebUI (:mod:`.hosts`; None: the one running, ``hosts.detect()``): where the parts are.
        """
        self.host = host if host is not None else detect()
        """The WebUI the routed models belong to."""
        self._notify = notify or (lambda text: None)
        self._lock = threading.RLock()
        self._checkpoints: set[str] = set()
        def make(choice: BackendChoice, weight_file: Any) -> Any:
            settings = api.build_settings(choice.options())
            return api.backend_class(settings, weight_file=weight_file,
                                     cache=self.backends.model_cache(settings.cache_dir))

        self.backends = Backends(make)
        """One backend per choice of the user's (and per precision a part runs at), kept across generations."""
        self._compiled: dict[tuple[BackendChoice, str], list[CompiledRoute]] = {}
        self._lora = LoraHook(self._lock, lambda: self.backends.weight_file(self._last[1]) if self._last else None)
        self.on_pytorch: Callable[[CompiledRoute, str], None] | None = None
        """Told (route, why) when a routed call runs in PyTorch (set by the generation running)."""
        self.on_uncached: Callable[[CompiledRoute, str], None] | None = None
        """Told (route, why) when step caching cannot split a route's module (set by the generation running)."""
        #: the settings and backend of the last generation prepared (None: none since the last reset)
        self._last: tuple[AccelerateSettings, BackendChoice] | None = None
        #: what moved into the weight file at checkpoint loads since the last generation (its status says it)
        self._load_notes: list[str] = []

    def prepare(self, model: Any, settings: AccelerateSettings, default_cache_dir: str, window: str = WINDOW_NEW,
                previous_weights: str | None = None, step_cache: StepCacheSettings | None = None,
                weights_in_file: bool = True, cache_max_bytes: int | None = None) -> PreparedRun:
        """Find the parts of ``model`` to accelerate and get (or make) their compiled forwards.

        ``window``: :data:`WINDOW_NEW` (a generation of its own: compiled models it does not call are
        released when it builds another, see ``OVBackend.start_window``), :data:`WINDOW_CONTINUE` (part
        of the previous run's window: pre-compiling several sizes, so that all of them stay compiled) or
        :data:`WINDOW_OFF` (release nothing: the user keeps every size in memory). ``previous_weights``: the
        backend's ``previous_weights`` for a new window ("auto", "keep", "release"; None: the backend's own).
        ``step_cache``: how step caching runs (its depth and full steps; the interval is ``settings.step_cache``).
        ``weights_in_file``: PyTorch's copy of the weights moves into a memory-mapped file before their first compile
        (the backends' ``weights_in_file``). ``cache_max_bytes``: the disk cache's size limit (the backends'
        ``cache_max_bytes``; 0: none; None: the backend's default). ``model`` a stand-in for the checkpoint the WebUI
        loads inside ``process_images`` (``Host.stand_in``): nothing routed yet, the model the WebUI loads is routed
        then (:meth:`extend` with ``replace``).

        Raises:
            UnsupportedModel: the model cannot be accelerated.
            ValueError: the backend rejected the settings (e.g. an unknown device).
        """
        pending = self.host.stand_in(model)
        targets = [] if pending else self.host.find_targets(model, settings.parts)
        choice = dataclasses.replace(settings.backend_choice(default_cache_dir), weights_in_file=weights_in_file,
                                     cache_max_bytes=cache_max_bytes)
        f32_choice = dataclasses.replace(choice, precision="f32") if choice.precision != "f32" else None
        ckpt = checkpoint_key(model)
        with self._lock:
            self._last = (settings, choice)
            if ckpt not in self._checkpoints and not pending:
                self._switch_to(model, ckpt)
            for part in {t.part for t in targets} or settings.parts:
                self.backends.backend(choice.for_part(part))  # checks the settings before anything runs
            # a generation is a use window: compiled models it does not call are released when another
            # is built (another size, a LoRA change), so memory holds what this generation uses
            if window == WINDOW_NEW:
                self.backends.start_window(previous_weights)
            elif window == WINDOW_OFF:
                self.backends.stop_windows()
            shape = step_cache or StepCacheSettings()
            cache = StepCacheRun(dataclasses.replace(shape, interval=settings.step_cache)) \
                if settings.step_cache > 1 and settings.unet else None
            return self._prepared(model, targets, choice, settings, f32_choice, step_cache=cache)

    def calibrate(self, run: PreparedRun) -> int:
        """At INT8: quantize the UNet on the calls ``run`` recorded at float (the end of a generation);
        returns how many models were quantized."""
        if not run.choice.quantized:
            return 0
        with self._lock:
            self._notify("OpenVINO: quantizing the UNet to INT8 on this generation's steps (once per checkpoint "
                         "and LoRA set)")
            try:
                return self.backends.calibrate(run.choice)
            finally:
                self._notify(None)

    def extend(self, run: PreparedRun, model: Any, replace: bool = False) -> PreparedRun:
        """The routes of ``model``, another model the WebUI switched to during ``run`` (a refiner, a hires
        checkpoint, the selected model again): same backends, nothing dropped. ``replace``: ``model`` takes the
        place of ``run``'s model, loaded before any route was called (Forge loads the request's checkpoint inside
        ``process_images``): what was compiled for the old one is dropped, as for a load between generations.

        Raises:
            UnsupportedModel: the model cannot be accelerated.
        """
        targets = self.host.find_targets(model, run.settings.parts)
        with self._lock:
            if replace:
                self._switch_to(model, checkpoint_key(model))
            else:
                self._checkpoints.add(checkpoint_key(model))
            return self._prepared(model, targets, run.choice, run.settings, run.f32_choice, run.mark, run.step_cache)

    def routes_for(self, run: PreparedRun, model: Any, targets: list[Target]) -> PreparedRun:
        """Routes for more modules of ``model`` during ``run`` (a UNet's blocks, a ControlNet network), on
        ``run``'s backends, without step caching."""
        with self._lock:
            return self._prepared(model, targets, run.choice, run.settings, run.f32_choice, run.mark)

    def _prepared(self, model: Any, targets: list[Target], choice: BackendChoice, settings: AccelerateSettings,
                  f32_choice: BackendChoice | None, mark: Mark | None = None,
                  step_cache: StepCacheRun | None = None) -> PreparedRun:
        keys = {t.label: choice.for_part(t.part) for t in targets}
        released = self._release_other_builds(keys)  # (counted apart: the builds may be another backend's)
        entries = [self._entry(keys[t.label], t) for t in targets]
        routes = tuple(
            Route(t.module, self._make_forward(e, t, f32_choice, step_cache if t.part == "unet" else None), t.label,
                  t.method, t.per_call)
            for t, e in zip(targets, entries)
        )
        return PreparedRun(
            routes=routes,
            settings=settings,
            choice=choice,
            checkpoint=checkpoint_key(model),
            mark=mark if mark is not None else self.backends.mark(),
            released_other=released,
            entries=tuple(entries),
            calls_before=tuple(e.calls for e in entries),
            eager_before=tuple(e.eager_calls for e in entries),
            pytorch_before=tuple(e.pytorch_calls for e in entries),
            f32_choice=f32_choice,
            f32_before=tuple(e.f32 is not None for e in entries),
            step_cache=step_cache,
        )

    def _release_other_builds(self, keys: Mapping[str, BackendChoice]) -> int:
        """Release the compiled models of the routes' builds under other choices than ``keys`` (route label ->
        the choice it runs under now): e.g. the UNet at *Automatic* once a generation runs it at INT8, which
        would otherwise stay in memory beside it (a full SD 1.5 UNet: ~2 GB at bf16). Their converted models
        stay: going back costs a compile. Returns how many were released."""
        released = 0
        for (key, label), entries in self._compiled.items():
            if label in keys and key != keys[label]:
                released += sum(entry.release() for entry in entries)
        if released:
            logger.info("released %d compiled model(s) built for other options than this generation's", released)
        return released

    def _entry(self, choice: BackendChoice, target: Target) -> CompiledRoute:
        entries = self._compiled.setdefault((choice, target.label), [])
        entry = next((e for e in entries if e.module_ref() is target.module), None)
        if entry is None:
            if entries:
                logger.info("%s is a new module object: compiling it too", target.label)
            function = target.compiled or getattr(type(target.module), target.method, None)
            method = getattr(target.module, target.method)
            source = types.MethodType(target.compiled, target.module) if target.compiled is not None else method
            entry = compile_route(
                target.part, target.label, weakref.ref(target.module), source, self.backends.counter(choice),
                dict(target.varying_dims) if target.varying_dims is not None else VARYING_DIMS,
                getattr(function, "__code__", None), target.method, target.own_code,
                method if target.compiled is not None else None, target.split,
            )
            entries.append(entry)
        return entry

    def keep_only(self, runs: Sequence[PreparedRun]) -> None:
        """Drop compiled forwards of module objects that none of ``runs`` routed (models A1111 replaced)."""
        used = {id(e) for run in runs for e in run.entries}
        with self._lock:
            for label_key, entries in list(self._compiled.items()):
                entries[:] = [e for e in entries if id(e) in used]
                if not entries:
                    del self._compiled[label_key]

    def _make_forward(self, entry: CompiledRoute, target: Target, f32_choice: BackendChoice | None,
                      step_cache: StepCacheRun | None) -> Callable[..., Any]:
        f32_build = None if f32_choice is None else (lambda: f32_route(entry, self.backends.counter(f32_choice)))
        forward = make_forward(entry, self._lock, self._notify, f32_build, target.check,
                               lambda route, why: self.on_pytorch(route, why) if self.on_pytorch else None,
                               step_cache,
                               lambda route, why: self.on_uncached(route, why) if self.on_uncached else None,
                               target.inputs)
        return mark_ours(self._lora.wrap(forward, entry))

    def lora_changes(self) -> list[LoraChange]:
        """The routes whose LoRA changed since the last call (then cleared)."""
        return self._lora.take_changes()

    def _drop_all(self) -> None:
        compiled_any = bool(self._compiled)
        self.backends.reset()
        self._compiled.clear()
        if compiled_any:
            # dynamo keeps each compiled variant on the function's code object, shared by every module
            # object and backend; variants of dropped backends would count towards its recompile limit
            # (8 per function), after which dynamo runs the function in PyTorch for the rest of the
            # process. torch offers no per-function reset: reset it all (other torch.compile users in the
            # process compile again on their next call).
            logger.info("dropping dynamo's compiled variants with the compiled models (torch.compiler.reset)")
            torch.compiler.reset()

    def reset(self) -> None:
        """Drop every compiled model in memory (the disk cache stays)."""
        with self._lock:
            self._drop_all()
            self._checkpoints = set()
            self._last = None

    def forget_unless(self, model: Any) -> None:
        """On a model load: keep compiled models if ``model``'s checkpoint is one the last generation used, or
        if A1111 loaded the weights into the modules they route; drop them otherwise. Either way the load wrote
        weights into the weight files or left their pages behind: they leave the WebUI's memory."""
        with self._lock:
            ckpt = checkpoint_key(model)
            if self._checkpoints and ckpt not in self._checkpoints:
                self._switch_to(model, ckpt)
            self.backends.drop_resident_weights()

    def load_target(self, settings: AccelerateSettings | None,
                     default_cache_dir: str) -> tuple[AccelerateSettings, Any] | None:
        """The settings a checkpoint load serves (``settings``, else the last generation's) and their weight file;
        None when the weights stay in memory."""
        with self._lock:
            last = self._last
        if settings is not None:
            choice = settings.backend_choice(default_cache_dir)
        elif last is not None:
            settings, choice = last
        else:
            return None
        weight_file = self.backends.weight_file(choice)
        return None if weight_file is None else (settings, weight_file)

    def add_load_note(self, note: str) -> None:
        """A line for the next generation's status about a checkpoint load (:mod:`.weights_at_load`)."""
        with self._lock:
            self._load_notes.append(note)

    def used_settings(self) -> AccelerateSettings | None:
        """The settings of the last generation prepared since the last reset (None: none)."""
        return self._last[0] if self._last is not None else None

    def pop_load_notes(self) -> list[str]:
        """What moved into the weight file at checkpoint loads since the last call (for a generation's status)."""
        with self._lock:
            notes, self._load_notes = self._load_notes, []
            return notes

    def _switch_to(self, model: Any, ckpt: str) -> None:
        """Another checkpoint. A1111 loads a checkpoint of the same architecture into the model it has
        (``load_state_dict``, in place): the compiled routes then stay, dynamo captures nothing again,
        and the backend builds for the new weights (a compile of the model converted before when the
        conversion reads every changed weight from the tensors, else from the disk cache or a
        conversion); the old weights' compiled models are released by the next build. A new model
        object (another architecture, ``sd_checkpoints_limit`` > 1) drops everything, as before."""
        if self._checkpoints:
            kept = self._routes_within(model)
            logger.info(
                "checkpoint changed (%s -> %s): %s",
                ", ".join(sorted(self._checkpoints)),
                ckpt,
                "weights loaded into the routed modules: keeping their compiled routes"
                if kept
                else "dropping compiled models in memory",
            )
            if not kept:
                self._drop_all()
        self._checkpoints = {ckpt}

    def _routes_within(self, model: Any) -> bool:
        """Whether every compiled route's module is alive and part of ``model`` (and there is one)."""
        modules = [e.module_ref() for entries in self._compiled.values() for e in entries]
        if not modules or any(m is None for m in modules):
            return False
        walk = getattr(model, "modules", None)
        if walk is None:
            return False
        within = {id(m) for m in walk()}
        return all(id(m) in within for m in modules)

    def held_now(self) -> dict[str, Any]:
        """For the status route, not under this object's lock (a read during a compile does not wait): the compiled
        OpenVINO models held in memory now, and PyTorch's weights in files (bytes, and bytes in memory)."""
        size, resident = self.backends.weights_in_files()
        return {"compiled_models": self.backends.compiled_models(),
                "weights_in_file_now": {"bytes": size, "resident_bytes": resident}}

    def backend_of(self, run: PreparedRun, part: str) -> OVBackend:
        """The backend ``part`` runs on in ``run`` (a name of ``ov_accelerate_sd.parts.PARTS``)."""
        return self.backends.backend(run.choice.for_part(part))

    def reports_since(self, run: PreparedRun) -> list[CompileReport]:
        """The compile reports the backends (the one of f32 builds included) produced during ``run``."""
        return self.backends.reports_since(run.mark)

    def f32_since(self, run: PreparedRun) -> dict[str, tuple[F32Switch, bool]]:
        """Route label -> (why it runs at f32, whether it switched during ``run``), for routes of ``run`` that
        ran at f32 although it asked for automatic precision."""
        with self._lock:
            return {
                e.label: (e.f32_switch, not before)
                for e, before in zip(run.entries, run.f32_before)
                if e.f32_switch is not None
            }

    def stats_since(self, run: PreparedRun) -> dict[str, float]:
        """Backend counters (compile/run seconds, calls, cache hits) accumulated during ``run``."""
        result = self.backends.stats_since(run.mark)
        result["released"] = result.get("released", 0) + run.released_other
        return result
