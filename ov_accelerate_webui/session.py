"""One generation with routing: follows A1111 when it switches the model during ``process_images``.

A1111 v1.10.1 changes ``shared.sd_model`` inside ``process_images``: the refiner
(``sd_samplers_common.apply_refiner`` -> ``sd_models.reload_model_weights``) mid-sampling, a hires
checkpoint for the second pass, and the selected model again at the start of each batch. Depending on
the settings the switch builds a new model object (another config, or ``sd_checkpoints_limit`` > 1) or
loads the new weights into the same modules. :class:`RoutingSession` is told about the loaded model
after each possible switch (``model_loaded`` callback, and before every UNet step through the
``cfg_denoiser`` callback) and routes every module object it has not routed yet; weights loaded into
modules that are already routed are the backend's business (it notices them and never runs stale
weights). Everything it routed is restored when the ``with`` block ends, whatever ended it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

from ov_accelerate_sd.openvino_entry import PART_NAMES

from .accelerator import Accelerator, PreparedRun
from .controlnet import ControlUnit, control_targets
from .model_parts import Target, UnsupportedModel, checkpoint_key
from .routing import describe, foreign, routed
from .session_report import BLOCKS_UNCACHED, BYPASSED, SessionReport, reached
from .unet_blocks import block_targets, blocks_blocked, patched_inside

logger = logging.getLogger(__name__)


def _is_unet_forward(entry: Any, route: Any) -> bool:
    return entry.part == "unet" and route.method == "forward"


def model_name(model: Any) -> str:
    """The checkpoint's short name (A1111 ``name_for_extra``), e.g. "sd_xl_refiner_1.0"."""
    info = getattr(model, "sd_checkpoint_info", None)
    return str(getattr(info, "name_for_extra", None) or checkpoint_key(model))


class RoutingSession(SessionReport):
    """Routes the loaded model for one ``process_images`` call and every model A1111 switches to in it.

    Args:
        accelerator: owns the compiled forwards.
        first: the prepared routes of the model loaded when the generation started.
        model: that model.
        on_unsupported: called with (model name, reason) when a model switched to cannot be routed.
        control_units: the generation's ControlNet units (:func:`.controlnet.control_units`), asked before
            each sampling step.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        first: PreparedRun,
        model: Any,
        on_unsupported: Callable[[str, str], None] = lambda name, reason: None,
        control_units: Callable[[], list[ControlUnit]] = list,
    ) -> None:
        self.accelerator = accelerator
        self.first = first
        self.runs: list[PreparedRun] = [first]
        self._run_models: list[Any] = [weakref.ref(model) if model is not None else lambda: None]
        """The model object of each run (the UNet of the model loaded now is the one sampling calls)."""
        self.run_names: list[str] = [""]
        self.events: list[str] = []
        self._on_unsupported = on_unsupported
        self._lock = threading.RLock()
        self._stack = contextlib.ExitStack()
        self._routed: set[tuple[int, str]] = set()
        self._models: list[tuple[weakref.ReferenceType, str]] = []
        self.first_model = model
        #: route key -> what replaced its method: [why, calls of our route when first seen, steps seen, said]
        self._foreign: dict[tuple[int, str], list[Any]] = {}
        #: UNet route key -> [calls of our route at the first step seen, steps seen, said]: sampling steps that
        #: never call the routed forward, with nothing replacing it (something calls the class's own forward)
        self._bypassed: dict[tuple[int, str], list[Any]] = {}
        self._control_units = control_units
        #: UNet route key -> the routes of its blocks (another extension's forward calls them), who that forward
        #: is, and the UNet's own compiled route
        self._blocks: dict[tuple[int, str], tuple[PreparedRun, str, Any]] = {}
        #: routes the host puts in place for each sampling call (``Route.per_call``: Forge's UNet)
        self._per_call: list[Any] = []
        #: routes made during the generation that the status does not list one by one (a UNet's blocks)
        self._block_runs: list[PreparedRun] = []
        #: ControlNet unit -> [sampling steps it ran in PyTorch, why]
        self._control_pytorch: dict[str, list[Any]] = {}
        #: ``id`` of the runs of ControlNet networks (called on the steps of their guidance range only)
        self._control_runs: set[int] = set()
        self.notes: list[str] = []
        """What the status says besides the calls (e.g. a UNet that ran block by block)."""
        #: routes whose calls run otherwise until the generation ends (``held``, ``through_blocks``)
        self._held: list[Any] = []

    def __enter__(self) -> RoutingSession:
        self._stack.__enter__()
        try:
            self._route(self.first, self.first_model)
            if self.first.routes:  # (none: a stand-in for the model the WebUI loads inside the generation, see follow)
                self._models.append((weakref.ref(self.first_model), checkpoint_key(self.first_model)))
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            try:
                self._stack.__exit__(*exc)
            finally:
                for entry in self._held:
                    entry.held, entry.through_blocks = "", False
                self.accelerator.keep_only([*self.runs, *self._block_runs])

    def _route(self, run: PreparedRun, model: Any) -> None:
        new = [(r, e) for r, e in zip(run.routes, run.entries) if (id(r.module), r.method) not in self._routed]
        taken = []
        for route, entry in new:
            other = foreign(route.module, route.method)
            if other is None:
                taken.append(route)
                continue
            # another extension replaced the method before us (its process() ran first): routing over it would
            # drop its work from the picture, so the part runs its way (its blocks in OpenVINO when they can)
            why = f"another extension replaced its {route.method} before this generation: {describe(other)}"
            if _is_unet_forward(entry, route):
                blocked = self._route_blocks(run, model, route, entry, other)
                if not blocked:
                    continue
                why += f"; its blocks cannot run in OpenVINO one by one: {blocked}"
            self._foreign[(id(route.module), route.method)] = [why, reached(entry), 0, True]
            logger.warning("Accelerate with OpenVINO: %s (%s) runs in PyTorch: %s", PART_NAMES[entry.part],
                           entry.label, why)
            self._on_unsupported(PART_NAMES[entry.part], why)
        self._stack.enter_context(routed(tuple(r for r in taken if not r.per_call)))
        self._per_call.extend(r for r in taken if r.per_call)
        self._routed.update((id(r.module), r.method) for r, _e in new)

    def sampling_routes(self) -> tuple[Any, ...]:
        """The routes the host puts in place for each sampling call (``Route.per_call``), of every model routed."""
        with self._lock:
            return tuple(self._per_call)

    def _route_blocks(self, run: PreparedRun, model: Any, route: Any, entry: Any, other: Any) -> str:
        """Route the blocks of the UNet ``route`` whose forward ``other`` replaced: "" when they are routed (or
        were), else why not."""
        key = (id(route.module), route.method)
        if key in self._blocks:
            return ""
        blocked = blocks_blocked(route.module)
        inside = patched_inside(route.module)
        if inside:
            # the replacing forward may still call ours (ControlNet's reference-only does, for its reference
            # pass): a compiled graph would not follow the code inside the blocks, so such calls run in PyTorch
            entry.held = f"another extension replaced methods inside it ({inside}), which a compiled graph would " \
                         "not follow"
            self._held.append(entry)
        if blocked:
            return blocked
        targets = block_targets(Target(entry.part, entry.label, route.module))
        blocks = self.accelerator.routes_for(run, model, targets)
        self._stack.enter_context(routed(blocks.routes))
        entry.through_blocks = True  # (a call of the replacing forward's own, e.g. a wrapper: blocks in OpenVINO)
        self._held.append(entry)
        self._blocks[key] = (blocks, describe(other), entry)
        self._block_runs.append(blocks)
        released = entry.release()  # the whole UNet's compiled model is not called while its blocks are
        logger.info("Accelerate with OpenVINO: the UNet's forward (%s) was replaced by %s, which calls its blocks: "
                    "%d blocks routed one by one (%d compiled model(s) of the whole UNet released)", entry.label,
                    describe(other), len(targets), released)
        self.notes.append(f"UNet ({entry.label}): its forward was replaced by {describe(other)}; its "
                          f"{len(targets)} blocks ran in OpenVINO one by one, with that extension's work between "
                          "them in PyTorch.")
        if run.step_cache is not None and self.accelerator.on_uncached is not None:
            self.accelerator.on_uncached(entry, BLOCKS_UNCACHED)
        return ""

    def _route_control(self) -> None:
        """Route the ControlNet networks of the generation not routed yet; note the units that run in PyTorch."""
        units = self._control_units()
        for unit in units:
            if unit.network is None:
                name = f"ControlNet unit {unit.index + 1} ({unit.kind})"
                seen = self._control_pytorch.get(name)
                if seen is None:
                    self._control_pytorch[name] = [1, unit.why]
                    logger.warning("Accelerate with OpenVINO: %s runs in PyTorch: %s", name, unit.why)
                    self._on_unsupported(f"ControlNet unit {unit.index + 1}", unit.why)
                else:
                    seen[0] += 1
        targets = [t for t in control_targets(units) if (id(t.module), t.method) not in self._routed]
        if targets:
            model = self._run_models[0]()
            run = self.accelerator.routes_for(self.first, model, targets)
            self._route(run, model)
            self.runs.append(run)
            self.run_names.append("")
            self._run_models.append(self._run_models[0])
            self._control_runs.add(id(run))

    def observe(self, current: Any = None) -> None:
        """Before each sampling step: notice a routed method another extension replaced while the generation
        runs (e.g. ControlNet's hook, installed in its ``process``): a UNet's blocks are then routed one by
        one when they can be; else, from the next step on, whether the replacement calls the accelerated
        method (then the part still runs in OpenVINO) or not (then it runs in PyTorch: said at once, so the
        infotext's note is written before the images are). Route ControlNet's networks."""
        with self._lock:
            self._route_control()
            for run, model_ref in zip(self.runs, self._run_models):
                if id(run) in self._control_runs:
                    continue
                loaded = current is None or model_ref() is current  # (a switched-from model's UNet is idle)
                for route, entry in zip(run.routes, run.entries):
                    key = (id(route.module), route.method)
                    seen = self._foreign.get(key)
                    if seen is None:
                        other = foreign(route.module, route.method)
                        blocked = self._route_blocks(run, model_ref(), route, entry, other) \
                            if other is not None and _is_unet_forward(entry, route) else None
                        if other is not None and blocked != "":
                            why = (f"its {route.method} was replaced during the generation by {describe(other)}, "
                                   "which does not call the accelerated one")
                            if blocked:
                                why += f"; its blocks cannot run in OpenVINO one by one: {blocked}"
                            self._foreign[key] = [why, reached(entry), 1, False]
                        elif other is None and entry.part == "unet" and loaded:
                            self._check_called(key, entry)
                        continue
                    seen[2] += 1
                    if not seen[3] and reached(entry) == seen[1]:
                        seen[3] = True
                        logger.warning("Accelerate with OpenVINO: %s (%s) ran in PyTorch: %s",
                                       PART_NAMES[entry.part], entry.label, seen[0])
                        self._on_unsupported(PART_NAMES[entry.part], seen[0])

    def follow(self, model: Any) -> None:
        """Route ``model`` if it is a model (or holds module objects) this session has not routed yet. A new model
        object before any routed call replaces the generation's model (:meth:`_restart`)."""
        if model is None:
            return
        with self._lock:
            ckpt = checkpoint_key(model)
            for i, (ref, seen_ckpt) in enumerate(self._models):
                if ref() is model:
                    if seen_ckpt != ckpt:
                        self.events.append(f"{model_name(model)} loaded into the same model object")
                        self._models[i] = (ref, ckpt)
                        self._add(model, ckpt, note_new=False)
                    return
            if self._untouched():
                self._restart(model, ckpt)
                return
            self._models.append((weakref.ref(model), ckpt))
            self._add(model, ckpt, note_new=True)

    def _untouched(self) -> bool:
        """Whether nothing routed was called yet in this generation (one model routed, no call reached it)."""
        run = self.first
        return len(self.runs) == 1 and not self._blocks and all(
            e.calls == c and e.pytorch_calls == p for e, c, p in zip(run.entries, run.calls_before, run.pytorch_before))

    def _restart(self, model: Any, ckpt: str) -> None:
        """``model``, a new model object, was loaded before anything routed was called: the checkpoint the request
        asked for, which Forge loads inside ``process_images`` (and A1111 for an override of another architecture).
        The model the generation started with is put back and let go (the WebUI drops it), with what was compiled
        for it, as for a load between generations; ``model`` becomes the generation's model."""
        name = model_name(model)
        try:
            run = self.accelerator.extend(self.first, model, replace=True)
        except UnsupportedModel as exc:
            self.events.append(f"{name}: ran in plain PyTorch ({exc})")
            logger.warning("Accelerate with OpenVINO: %s, loaded for this generation: %s", name, exc)
            self._on_unsupported(name, str(exc))
            return
        self._stack.close()
        self._stack = contextlib.ExitStack()
        self._routed.clear()
        self._per_call.clear()
        self._foreign.clear()
        self._bypassed.clear()
        self.first, self.first_model, self.runs, self.run_names = run, model, [run], [""]
        self._run_models = [weakref.ref(model)]
        self._models = [(weakref.ref(model), ckpt)]
        logger.info("Accelerate with OpenVINO: %s loaded before sampling: routed in place of the generation's first "
                    "model", name)
        self._route(run, model)

    def _add(self, model: Any, ckpt: str, note_new: bool) -> None:
        name = model_name(model)
        try:
            run = self.accelerator.extend(self.first, model)
        except UnsupportedModel as exc:
            self.events.append(f"{name}: ran in plain PyTorch ({exc})")
            logger.warning("Accelerate with OpenVINO: %s, switched to during the generation: %s", name, exc)
            self._on_unsupported(name, str(exc))
            return
        fresh = [r for r in run.routes if (id(r.module), r.method) not in self._routed]
        self._route(run, model)
        if note_new:
            self.events.append(f"{name}: switched to a new model object, routed")
        elif fresh:
            self.events.append(f"{name}: {len(fresh)} new module(s) routed")
        if fresh or note_new:
            self.runs.append(run)
            self.run_names.append(name)
            self._run_models.append(weakref.ref(model))
        logger.info("Accelerate with OpenVINO: following the switch to %s (%s)", name, ckpt)

    def _check_called(self, key: tuple[int, str], entry: Any) -> None:
        """A UNet route still in place that no sampling step calls: something runs the class's own forward."""
        seen = self._bypassed.setdefault(key, [reached(entry), 0, False])
        seen[1] += 1
        if seen[1] >= 2 and not seen[2] and reached(entry) == seen[0]:
            seen[2] = True
            logger.warning("Accelerate with OpenVINO: UNet (%s) ran in PyTorch: %s", entry.label, BYPASSED)
            self._on_unsupported(PART_NAMES[entry.part], BYPASSED)

    def checkpoints(self) -> list[str]:
        """Checkpoint keys of every model this session routed."""
        with self._lock:
            return list(dict.fromkeys(ckpt for _ref, ckpt in self._models))
