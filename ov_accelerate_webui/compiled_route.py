"""One routed module's compiled forward: what a routed call does around the compiled graph.

The :class:`~.accelerator.Accelerator` owns the compiled forwards and their backends; this module owns
a single call: it marks the sizes that vary between generations as dynamic on a new input signature,
notices a call dynamo ran without any compiled graph (counted with the reason), and at automatic
precision checks the output for inf and NaN (:mod:`.finite_guard`): a non-finite output from finite
inputs moves the route to its f32 build, which runs the same call again and whose result is returned.

The compiled method itself (torch.compile, the saved captures, the check that a call ran a compiled graph)
is the backend's :class:`ov_backend.CompiledMethod`, which the command line uses too.

Sizes: the dimensions that change between generations (``ov_accelerate_sd.parts.VARYING_DIMS``: batch, latent height and
width, prompt length) are marked dynamic on the first call, so dynamo hands the backend one graph with
symbolic sizes from the start, a batch of 1 included (the UNet's calls when a long prompt and its
negative prompt differ in length, and on Negative Guidance minimum sigma's late steps). Each new size is
then compiled once, and a size seen before is found again without a compile. (Left to dynamo's automatic dynamic
shapes, the first size would be compiled twice: once static, and once more in the symbolic graph that
later shadows it.)
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import CodeType
from typing import TYPE_CHECKING, Any

from ov_accelerate_sd.openvino_entry import PART_NAMES
from ov_accelerate_sd.step_cache import StepCacheRun
from ov_accelerate_sd.unet_split import StepCacheUnsupported, UNetSplit, split_unet

from .backend_bridge import ov_backend
from .finite_guard import F32Switch, all_finite

if TYPE_CHECKING:
    from ov_backend import CompiledMethod, GraphRunCounter

logger = logging.getLogger(__name__)

#: How long dynamo's giving up on a routed function lasts, as a WebUI user sees it.
EAGER_UNTIL = "until another checkpoint is loaded or the WebUI restarts"


@dataclass
class SplitBuild:
    """The UNet's step caching methods (``ov_accelerate_sd.step_cache``) at one depth, compiled through the
    route's backend."""

    split: UNetSplit
    full: CompiledMethod
    shallow: CompiledMethod

    def release(self) -> int:
        return self.full.release() + self.shallow.release()


@dataclass
class CompiledRoute:
    """The compiled method of one routed module object, and what its calls did."""

    part: str
    label: str
    module_ref: weakref.ReferenceType
    compiled: CompiledMethod
    """The module's method compiled through its backend (``ov_backend.CompiledMethod``)."""
    calls: int = 0
    eager_calls: int = 0
    """Calls dynamo ran without a compiled graph (plain PyTorch)."""
    eager_reason: str = ""
    f32: CompiledRoute | None = None
    """The f32 build this route runs since its output was not finite at automatic precision."""
    f32_switch: F32Switch | None = None
    """Why the route runs at f32 (set once the f32 build has run the call that was not finite)."""
    lora_applied: tuple[tuple[str, float, float], ...] = ()
    """The Lora extension's networks (name, TE and UNet strength) last written into this route's module."""
    pytorch_calls: int = 0
    """Calls run on the module's own method because something changed its work in a way OpenVINO does not
    take (see :func:`make_forward`'s ``bypass``)."""
    pytorch_reason: str = ""
    splits: dict[int, SplitBuild] = field(default_factory=dict)
    """Depth -> the step caching methods of the route's UNet (made on the first call with step caching)."""
    step_cache_off: str = ""
    """Why step caching cannot split this route's module (it then runs every call full)."""
    held: str = ""
    """Why every call runs on the module's own method in PyTorch for now (set and cleared by the generation
    that found the reason, e.g. another extension's code inside the module that a compiled graph would not
    follow)."""
    through_blocks: bool = False
    """The module's blocks are routed one by one for now (set and cleared by the generation): a call runs the
    module's own method, whose blocks run in OpenVINO, and is counted by them."""
    way: SplitBuild | None = None
    """How the last call ran the module: its whole compiled method (None) or step caching's methods at one
    depth (see :meth:`run_by`)."""

    own: Callable[..., Any] | None = None
    """The routed method as it was before routing, when what is compiled is another function of the module
    (``model_parts.Target.compiled``); None: the compiled one."""
    splitter: Callable[[Any, int], UNetSplit] = split_unet
    """How step caching splits the module at a depth (``model_parts.Target.split``)."""

    @property
    def source(self) -> Callable[..., Any]:
        """The routed method as it was before routing (what a call in PyTorch runs)."""
        return self.own if self.own is not None else self.compiled.source

    def release(self) -> int:
        """Release the compiled models of this route and of its f32 build (their converted models stay:
        using the route again costs a compile); returns how many were released."""
        own = self.compiled.release() + sum(build.release() for build in self.splits.values())
        return own + (self.f32.release() if self.f32 is not None else 0)

    def run_by(self, way: SplitBuild | None) -> None:
        """Note how this call runs the module. On a change, the compiled models of the other ways are released
        (counted in the backend's ``released``): each holds its own copy of the weights (a full-size SD 1.5
        UNet: 3.4 GB at f32), and a generation runs the UNet one way. Going back is a compile, not a
        conversion."""
        if way is self.way:
            return
        self.way = way
        released = self.compiled.release() if way is not None else 0
        released += sum(build.release() for build in self.splits.values() if build is not way)
        if released:
            logger.info("Accelerate with OpenVINO: %s now runs %s; %d compiled model(s) of its other way released",
                        self.label, "whole" if way is None else "with step caching", released)

    def split_at(self, module: Any, depth: int) -> SplitBuild | None:
        """The step caching methods at ``depth`` (made now if needed), or None when the module cannot be split
        (:attr:`step_cache_off` says why). Call under the accelerator's lock."""
        build = self.splits.get(depth)
        if build is None and not self.step_cache_off:
            try:
                split = self.splitter(module, depth)
            except StepCacheUnsupported as exc:
                self.step_cache_off = str(exc)
                logger.warning("Accelerate with OpenVINO: no step caching for %s: %s", self.label, exc)
                return None
            like = self.compiled
            build = self.splits[depth] = SplitBuild(split, *(
                ov_backend.CompiledMethod(getattr(split, kind), like.counter, like.varying, kind)
                for kind in ("full", "shallow")))
        return build


def compile_route(
    part: str,
    label: str,
    module_ref: weakref.ReferenceType,
    source: Callable[..., Any],
    counter: GraphRunCounter,
    varying_dims: Mapping[int, tuple[int, ...]],
    code: CodeType | None,
    method: str = "forward",
    own_code: bool = False,
    own: Callable[..., Any] | None = None,
    splitter: Callable[[Any, int], UNetSplit] | None = None,
) -> CompiledRoute:
    """A route whose method is ``source`` compiled through ``counter``'s backend (``ov_backend.CompiledMethod``);
    ``method`` is the name the routed module's method is replaced under, ``code`` the code object dynamo
    keeps its compiled variants on, ``own_code`` whether to compile a copy with its own (see
    ``ov_backend.CompiledMethod``), ``own`` the routed method when ``source`` is another function, ``splitter`` how
    step caching splits the module (None: ``split_unet``)."""
    compiled = ov_backend.CompiledMethod(source, counter, varying_dims, method, None if own_code else code, own_code)
    return CompiledRoute(part=part, label=label, module_ref=module_ref, compiled=compiled, own=own,
                         splitter=splitter or split_unet)


def f32_route(entry: CompiledRoute, counter: GraphRunCounter) -> CompiledRoute:
    """``entry``'s route built again through ``counter`` (the f32 backend's)."""
    like = entry.compiled
    return compile_route(entry.part, entry.label, entry.module_ref, like.source, counter, like.varying, like.code,
                         like.attribute, like.own_code, entry.own, entry.splitter)


def make_forward(
    entry: CompiledRoute,
    lock: threading.RLock,
    notify: Callable[[str | None], None],
    f32_build: Callable[[], CompiledRoute] | None,
    bypass: Callable[[Any, tuple[Any, ...], dict[str, Any]], str] | None = None,
    on_bypass: Callable[[CompiledRoute, str], None] | None = None,
    step_cache: StepCacheRun | None = None,
    on_uncached: Callable[[CompiledRoute, str], None] | None = None,
    inputs: Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]] | None = None,
) -> Callable[..., Any]:
    """The method that replaces ``entry``'s module method while routed.

    Args:
        entry: the route; its counters are updated under ``lock``.
        lock: the accelerator's lock.
        notify: called with "OpenVINO: compiling ..." before a call with a new input signature, and None after.
        f32_build: makes the route's f32 build (called under ``lock``, once); None when the run is at f32
            already, and then outputs are not checked.
        bypass: called with (the module, the call's args, its kwargs) before each call; a non-empty answer (why)
            runs the call on the module's own method in PyTorch, counted in ``entry.pytorch_calls`` (e.g. the
            WebUI's Token merging, which rewrites the UNet's blocks into ops OpenVINO cannot take, or a Forge patch
            in the UNet call's options).
        on_bypass: told (entry, why) of each such call.
        step_cache: the run's step caching (the UNet's route only): each call runs the route's split methods,
            full or shallow as it decides; a route that runs at f32 after an overflow runs uncached.
        on_uncached: told (entry, why) when step caching cannot split the route's module (it runs uncached).
        inputs: maps a call's (args, kwargs) to what the compiled method is given (``model_parts.Target.inputs``);
            None: the call's own.
    """
    label = PART_NAMES[entry.part]

    def run(build: CompiledRoute, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return run_method(build.compiled, args, kwargs, ", f32" if build is not entry else "")

    def run_method(compiled: CompiledMethod, args: tuple[Any, ...], kwargs: dict[str, Any], at: str) -> Any:
        signature = ov_backend.input_signature(args, kwargs)
        with lock:
            new = signature not in compiled.seen
        if new:
            shapes = "x".join(str(d) for d in signature[0][0]) if signature else "?"
            notify(f"OpenVINO: compiling {label} ({entry.label}{at}) for input {shapes} ...")

        try:
            result, eager = compiled.call(args, kwargs, signature)
        finally:
            if new:
                notify(None)
        reason = compiled.why_eager(EAGER_UNTIL) if eager else ""
        with lock:
            if eager:
                entry.eager_calls += 1
                entry.eager_reason = reason
        return result

    def rerun_at_f32(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with lock:
            first = entry.f32 is None
            if first:
                logger.warning(
                    "Accelerate with OpenVINO: %s (%s) returned inf/NaN at automatic precision; running it at "
                    "f32 from now on with this checkpoint (building it at f32)",
                    label,
                    entry.label,
                )
                entry.f32 = f32_build()
            build = entry.f32
        result = run(build, args, kwargs)
        if first:
            finite = all_finite(result)
            with lock:
                entry.f32_switch = F32Switch(part=label, finite_at_f32=finite)
            if not finite:
                logger.warning(
                    "Accelerate with OpenVINO: %s (%s) is not finite at f32 either: the model's own NaN/inf, "
                    "returned as is (A1111's NaN check reports it)",
                    label,
                    entry.label,
                )
        return result

    def forward(*args: Any, **kwargs: Any) -> Any:
        if entry.through_blocks:
            return entry.source(*args, **kwargs)
        module = entry.module_ref() if bypass is not None and not entry.held else None
        why = entry.held or (bypass(module, args, kwargs) if module is not None else "")
        if why:
            with lock:
                entry.pytorch_calls += 1
                entry.pytorch_reason = why
            if on_bypass is not None:
                on_bypass(entry, why)
            return entry.source(*args, **kwargs)
        if inputs is not None:
            args, kwargs = inputs(args, kwargs)
        with lock:
            entry.calls += 1
            build = entry.f32 or entry
            module = entry.module_ref() if step_cache is not None and build is entry else None
            split = entry.split_at(module, step_cache.settings.depth) if module is not None else None
            if build is entry:
                entry.run_by(split)
        if module is not None and split is None and on_uncached is not None:
            on_uncached(entry, entry.step_cache_off)
        if split is not None:
            result = step_cache.call(module, args, kwargs, lambda kind, a, kw: run_method(
                getattr(split, kind), (module, *a), kw, f", {kind}"))
        else:
            result = run(build, args, kwargs)
        if f32_build is None or build is not entry or all_finite(result):
            return result
        if not all_finite(args, kwargs):  # NaN/inf came in (from another part): not this part's precision
            return result
        return rerun_at_f32(args, kwargs)

    return forward
