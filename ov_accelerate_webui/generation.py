"""One accelerated ``process_images`` call (:class:`Generation`) and a job of several (:class:`Job`).

The dropdown script wraps ``process_images`` in one ``with`` block; the always-on section cannot: A1111
calls its ``process`` hook before the model is used and its ``postprocess`` hook after, and a dropdown
script (X/Y/Z plot, Prompts from file, SD upscale, Loopback ...) may call ``process_images`` many times
in one job. So a generation is started and finished by two calls, and an error between them (no
``postprocess``) is finished by whoever comes next: the next generation, the end of the job (the
request's ``p.close()``), a model load or the script's unload. Nothing stays routed after any of them.

A job is what one press of Generate (or one API request) runs: its generations share compiled models
(the first starts a new use window, the others continue it) and the status route reports the job as a
whole, with each generation's line in ``runs`` (:mod:`.job`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ov_accelerate_sd.openvino_entry import PART_NAMES

from .accelerator import Accelerator, PreparedRun
from .backend_bridge import ov_backend
from .controlnet import ControlUnit
from .finite_guard import F32Switch
from .infotext import generation_params
from .lora import LoraChange, changes_line
from .session import RoutingSession
from .settings import AccelerateSettings
from .status import cache_line, run_status, weights_line
from .step_caching import sampler_step, step_cache_facts, step_cache_line

logger = logging.getLogger(__name__)


#: What ``Generation``'s ``on_unsupported`` is told, instead of a part's name, when the UNet cannot be step cached
#: (it runs every step full).
STEP_CACHING = "step caching"


def comment_on(p: Any, message: str) -> None:
    """Put ``message`` under the images of ``p``'s generation (A1111's ``p.comment``, where ``p`` has one)."""
    comment = getattr(p, "comment", None)
    if comment is not None:
        comment(message)


def append_comment(processed: Any, text: str) -> None:
    """Add ``text`` to the comments shown under ``processed``'s images."""
    if processed is not None:
        processed.comments = ((getattr(processed, "comments", "") or "") + "\n" + text).strip()


class InfotextEntry:
    """The extension's entries in ``p``'s infotext for one generation: written as it starts, and again with a note
    when something of it did not run as chosen (:meth:`unsupported`), so the image records what really ran."""

    def __init__(self, p: Any, settings: AccelerateSettings, section: bool) -> None:
        self.p, self.settings, self.section = p, settings, section
        self.notes: list[str] = []
        p.extra_generation_params.update(generation_params(settings, section=section))

    def unsupported(self, name: str, reason: str) -> None:
        """``name`` (a part's short name, or :data:`STEP_CACHING`) did not run as chosen, because of ``reason``."""
        if name == STEP_CACHING:  # every UNet step ran full: the image was not made with step caching
            self.settings = dataclasses.replace(self.settings, step_cache=1)
            self.notes.append("no step caching")
            comment_on(self.p, f"Accelerate with OpenVINO: no step caching: {reason}")
        else:
            short = getattr(reason, "short", "")  # (a check's Reason names what made it so)
            self.notes.append(f"{name} in PyTorch ({short})" if short else f"{name} in PyTorch")
            comment_on(self.p, f"Accelerate with OpenVINO: {name} ran in plain PyTorch: {reason}")
        self.p.extra_generation_params.update(generation_params(self.settings, self.notes, section=self.section))


class NotAccelerated(Exception):
    """The generation cannot go through OpenVINO; the message says why (the image is made in PyTorch)."""

    def __init__(self, message: str, level: int) -> None:
        super().__init__(message)
        self.level = level


@dataclass
class RunRecord:
    """What one accelerated ``process_images`` call did: the facts of its status."""

    settings: AccelerateSettings
    calls: dict[str, int]
    eager: dict[str, tuple[int, str]]
    stats: dict[str, float]
    reports: list[Any]
    switches: list[str]
    f32: dict[str, tuple[F32Switch, bool]]
    attention: str | None
    lora_changes: list[LoraChange]
    pytorch: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Route label -> (calls run in PyTorch on the module's own method, why): work OpenVINO does not take."""
    notes: list[str] = field(default_factory=list)
    """Why a routed part was not called (e.g. the WebUI decoded with TAESD), one sentence each."""
    step_cache: dict[str, Any] = field(default_factory=dict)
    """The UNet's step caching in this run (empty: off): settings, full and shallow calls, why calls ran full."""
    weights_in_file: tuple[int, int | None] = (0, 0)
    """Bytes of PyTorch's weights kept in memory-mapped files, and of their pages in the WebUI's memory after
    the generation (None: unknown): see ``ov_backend.WeightFile``."""
    cache: dict[str, int] = field(default_factory=dict)
    """The disk cache after the generation (empty: off): ``cache_bytes``, ``cache_limit_bytes`` (0: none),
    ``cache_in_use_bytes`` (``ov_backend.CacheUsage.as_dict``)."""
    status: str = ""

    def text(self) -> str:
        unet_in_pytorch = any(label.endswith("diffusion_model") for label in self.pytorch)
        status = run_status(self.settings, self.calls, self.reports, self.stats, switches=self.switches,
                            eager=self.eager, f32=self.f32, pytorch=self.pytorch,
                            attention=None if unet_in_pytorch else self.attention)
        if self.lora_changes:
            status += "\n" + changes_line(self.lora_changes, self.reports)
        if self.step_cache:
            status += "\n" + step_cache_line(self.step_cache)
        return "\n".join([status, *self.notes, *weights_line(self.weights_in_file),
                          *cache_line(self.cache, int(self.stats.get("cache_pruned", 0)))])

    def summary(self) -> dict[str, Any]:
        """This generation's line in the job's report."""
        return {"settings": self.settings.infotext(), "calls": dict(self.calls), "compiles": len(self.reports),
                "eager_calls": int(self.stats.get("eager_calls", 0)), "ov_calls": int(self.stats.get("ov_calls", 0))}


def _weak(model: Any) -> Callable[[], Any]:
    """A weak reference to ``model`` (the WebUI's models take one: a model it drops is not kept alive), or, for an
    object that takes none, the object itself."""
    try:
        return weakref.ref(model)
    except TypeError:
        return lambda: model


class Generation:
    """One ``process_images`` call with the chosen parts of the model routed through OpenVINO.

    :meth:`start` routes (and replaces the UNet's attention), :meth:`finish` or :meth:`abort` restores and
    records what ran; each is safe to call once, in that order, and :meth:`abort` after :meth:`finish`
    does nothing.
    """

    def __init__(self, accelerator: Accelerator, prepared: PreparedRun, model: Any, settings: AccelerateSettings,
                 on_unsupported: Callable[[str, str], None],
                 control_units: Callable[[], list[ControlUnit]] = list) -> None:
        self.accelerator = accelerator
        self.settings = settings
        self.session = RoutingSession(accelerator, prepared, model, on_unsupported, control_units)
        self._on_unsupported = on_unsupported
        self._said: set[str] = set()
        self.attention = accelerator.host.attention(settings.parts)
        self._stack: contextlib.ExitStack | None = None
        self.owner: int | None = None
        """``id`` of the ``p`` it runs for (the section finishes only its own)."""
        self.section = False
        """Started by the always-on section (else by the dropdown script, around ``process_images``)."""
        self.cache_folder = ""
        """The disk cache's folder ("" without one)."""
        self.cached_before: set[str] | None = None
        """The disk cache's keys before the generation (None: not known)."""
        self._sampling: tuple[Any, Callable[[], Any]] | None = None
        """The ``p`` of the last sampling the host's patch point was set for, and (weakly) the model it was set on."""

    @property
    def prepared(self) -> PreparedRun:
        """The routes of the generation's model (the one it started with, or the one the WebUI loaded in its place
        before sampling: :meth:`.session.RoutingSession.follow`)."""
        return self.session.first

    @property
    def model(self) -> Any:
        """The generation's model (see :attr:`prepared`)."""
        return self.session.first_model

    @property
    def active(self) -> bool:
        return self._stack is not None

    def before_unet(self, loaded: Any, params: Any) -> None:
        """Before each UNet evaluation (A1111's ``cfg_denoiser`` callback, with its ``params``): route the
        ``loaded`` model if A1111 switched to it without a ``model_loaded`` callback (a model kept in memory,
        ``sd_checkpoints_limit`` > 1), and tell the run's step caching, if on, where sampling is
        (:func:`.step_caching.sampler_step`)."""
        if self.attention is not None:
            self.attention.ensure()  # a model load inside the generation applied the WebUI's attention again
        self.session.follow(loaded)
        self.session.observe(loaded)
        sampled = self._sampling
        if sampled is not None and loaded is not None and sampled[1]() is not loaded:
            # the WebUI switched models inside a sampling (Forge's refiner: a new model whose UNet Forge samples on
            # with no process_before_every_sampling): its routes go on the host's patch point too
            self.before_sampling(sampled[0])
        if self.prepared.step_cache is not None:
            sampler_step(self.prepared.step_cache, params)

    def before_sampling(self, p: Any) -> None:
        """Before each sampling of the generation (each batch, the hires pass; the section's
        ``process_before_every_sampling`` hook): the host puts the routes it owns on its patch point for it
        (Forge's UNet function wrapper). When it cannot, the UNet runs in PyTorch and the status says why."""
        loaded = getattr(p, "sd_model", None)
        self._sampling = (p, _weak(loaded)) if loaded is not None else None
        why = self.accelerator.host.route_for_sampling(p, self.session.sampling_routes())
        if why:
            logger.warning("Accelerate with OpenVINO: the UNet runs in PyTorch for this sampling: %s", why)
            if "unet" not in self._said:
                self._said.add("unet")
                self._on_unsupported(PART_NAMES["unet"], why)

    def _ran_uncached(self, route: Any, why: str) -> None:
        if STEP_CACHING not in self._said:  # once: the infotext's note, the comment under the images
            self._said.add(STEP_CACHING)
            self._on_unsupported(STEP_CACHING, why)

    def _ran_in_pytorch(self, route: Any, why: str) -> None:
        if route.part not in self._said:  # once per part: the infotext's note, the comment under the images
            self._said.add(route.part)
            self._on_unsupported(PART_NAMES[route.part], why)

    def start(self) -> None:
        self.accelerator.lora_changes()  # from earlier runs: not this run's
        self.accelerator.on_pytorch = self._ran_in_pytorch
        self.accelerator.on_uncached = self._ran_uncached
        stack = contextlib.ExitStack()
        try:
            if self.attention is not None:
                stack.enter_context(self.attention)
            stack.enter_context(self.session)
        except BaseException:
            stack.close()
            raise
        self._stack = stack

    def _restore(self, exc: BaseException | None = None) -> None:
        if self.accelerator.on_pytorch == self._ran_in_pytorch:
            self.accelerator.on_pytorch = None
        if self.accelerator.on_uncached == self._ran_uncached:
            self.accelerator.on_uncached = None
        stack, self._stack = self._stack, None
        if stack is not None:
            if exc is None:
                stack.close()
            else:
                stack.__exit__(type(exc), exc, exc.__traceback__)

    def abort(self, exc: BaseException | None = None) -> str:
        """Restore the model after a generation that did not finish; returns the status saying so."""
        if self._stack is None:
            return ""
        self._restore(exc)
        why = f"{type(exc).__name__}: {exc}" if exc is not None else "an error (its hooks after the images never ran)"
        return (f"The generation stopped with {why}. The WebUI's models were restored; calls through OpenVINO "
                f"before it: {self.session.calls()}.")

    def _cache_usage(self) -> dict[str, int]:
        """The disk cache the generation used, against its limit (empty with the cache off)."""
        usage = self.accelerator.backends.cache_usage(self.prepared.choice)
        return usage.as_dict() if usage is not None else {}

    def finish(self, calibrate: bool, vae_methods: tuple[str, str] = ("", "")) -> RunRecord:
        """Restore the model and record what ran (quantizing the UNet first at INT8 when ``calibrate``).
        ``vae_methods``: the WebUI's VAE decode and encode methods ("Full", "TAESD"), which say why the VAE
        was not called."""
        self._restore()
        if calibrate and self.accelerator.calibrate(self.prepared):
            logger.info("Accelerate with OpenVINO: the UNet was quantized to INT8 on this generation's steps")
        # between generations OpenVINO holds its weights, not the last size's activations
        self.accelerator.backends.release_intermediate_memory()
        # what read PyTorch's weights during the generation (a LoRA written, a part run in PyTorch) leaves them
        self.accelerator.backends.drop_resident_weights()
        session, prepared = self.session, self.prepared
        record = RunRecord(
            settings=self.settings,
            calls=session.calls(),
            eager=session.eager(),
            stats=self.accelerator.stats_since(prepared),
            reports=self.accelerator.reports_since(prepared),
            switches=list(session.events),
            f32=session.f32(),
            attention=self.attention.replaced if self.attention else None,
            lora_changes=self.accelerator.lora_changes(),
            pytorch=session.pytorch(),
            step_cache=step_cache_facts(prepared.step_cache, session),
            weights_in_file=self.accelerator.backends.weights_in_files(),
            cache=self._cache_usage(),
        )
        record.notes = [*self.accelerator.pop_load_notes(), *session.notes, *_uncalled_vae(record.calls, vae_methods)]
        record.status = record.text()
        logger.info("%s", record.status)
        if record.eager:
            logger.warning("Accelerate with OpenVINO: %s",
                           ov_backend.describe_eager(record.eager, record.calls))
        return record


def run_report(record: RunRecord) -> dict[str, Any]:
    """The status route's data for one generation that went through OpenVINO."""
    fallbacks: dict[str, str] = {}
    for report in record.reports:
        fallbacks.update(report.fallback_ops)
    return {
        "accelerated": True,
        "status": record.status,
        "settings": record.settings.infotext(),
        "calls": dict(record.calls),
        "eager": {label: {"calls": n, "why": why} for label, (n, why) in record.eager.items()},
        "pytorch": {label: {"calls": n, "why": why} for label, (n, why) in record.pytorch.items()},
        "compiles": len(record.reports),
        "fallback_ops": fallbacks,
        "switches": list(record.switches),
        "lora_changes": {change.label: change.networks for change in record.lora_changes},
        "lora_write_seconds": sum(change.write_seconds for change in record.lora_changes),
        "step_cache": dict(record.step_cache),
        "generations": 1,
        "plain_generations": 0,
        "runs": [record.summary()],
        "pytorch_weights_in_file": {"bytes": record.weights_in_file[0], "resident_bytes": record.weights_in_file[1]},
        **record.cache,
        **ov_backend.Stats.from_mapping(record.stats).report_json(),
    }


def _uncalled_vae(calls: dict[str, int], methods: tuple[str, str]) -> list[str]:
    """A sentence for each VAE half that was routed, not called, and replaced by the WebUI's TAESD."""
    notes = []
    for half, method, setting in (("decoder", methods[0], "VAE type for decode"),
                                  ("encoder", methods[1], "VAE type for encode")):
        routed = [n for label, n in calls.items() if label.endswith(f"first_stage_model.{half}")]
        if routed and not any(routed) and method == "TAESD":
            notes.append(f"The VAE {half} was not called: Settings -> VAE -> '{setting}' is TAESD, a small separate "
                         f"model the WebUI runs in PyTorch (set it to Full to run the VAE {half} in OpenVINO).")
    return notes
