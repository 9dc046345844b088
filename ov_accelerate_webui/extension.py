"""The extension's runtime: one object per load of the script file, owning all state of the extension.

It is created by ``scripts/openvino_accelerate.py``; A1111 re-executes that file on reload, and the
``on_script_unloaded`` callback resets the old runtime. Both Script instances (txt2img and img2img)
share it, so a size compiled in one tab is ready in the other.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from . import cache_owners, host
from .accelerator import WINDOW_CONTINUE, WINDOW_NEW, WINDOW_OFF, Accelerator
from .attention import FusedAttention
from .backend_bridge import BackendApi, BackendUnavailable, backend_module, load_backend
from .infotext import generation_params
from .lora import LoraChange, changes_line
from .model_parts import UnsupportedModel, checkpoint_key, checkpoint_label
from .precompile import ReadySizes, Size, parse_sizes
from .session import RoutingSession
from .settings import AccelerateSettings
from .status import run_status
from .ui import KEEP_SIZES_OPTION, PREVIOUS_WEIGHTS_OPTION

logger = logging.getLogger(__name__)


class Extension:
    """State and actions of the extension; everything the Script and the panel do goes through here."""

    def __init__(self, load_api: Callable[[], BackendApi] = load_backend) -> None:
        """Args:
        load_api: imports the backend on first use (tests pass their own).
        """
        self._load_api = load_api
        self._lock = threading.RLock()
        self._api: BackendApi | None = None
        self._accelerator: Accelerator | None = None
        self.ready = ReadySizes()
        self._last_run: dict[str, Any] = {"accelerated": False, "status": "No generation with OpenVINO yet."}
        self._session: RoutingSession | None = None
        self._attention: FusedAttention | None = None

    # --- backend -------------------------------------------------------------------------------
    def api(self) -> BackendApi:
        """The backend API (imported on first use). Raises BackendUnavailable."""
        with self._lock:
            if self._api is None:
                self._api = self._load_api()
            return self._api

    def accelerator(self) -> Accelerator:
        """The accelerator (created on first use). Raises BackendUnavailable."""
        with self._lock:
            if self._accelerator is None:
                self._accelerator = Accelerator(self.api(), notify=_set_textinfo)
            return self._accelerator

    def device_choices(self) -> list[tuple[str, str]]:
        """(label, device) pairs for the panel: each device with its full name, AUTO, HETERO if > 1 device."""
        devices = self.api().list_devices()
        choices = [(f"{name}: {full}" if full else name, name) for name, full in devices]
        choices.append(("AUTO: let OpenVINO choose", "AUTO"))
        names = [name for name, _full in devices]
        if len(names) > 1:
            hetero = "HETERO:" + ",".join(sorted(names, key=lambda n: (n.startswith("CPU"), n)))
            choices.append((f"{hetero}: split across devices", hetero))
        return choices

    def device_names(self) -> list[str]:
        """Names of the devices OpenVINO sees."""
        return [name for name, _full in self.api().list_devices()]

    # --- generation ----------------------------------------------------------------------------
    def run(self, p: Any, settings: AccelerateSettings, new_window: bool = True, calibrate: bool = True) -> Any:
        """Run A1111's pipeline on ``p`` with the chosen parts in OpenVINO; returns the ``Processed``.

        ``new_window``: the run is a generation of its own, so compiled models it does not use are
        released when it builds another (False: it continues the previous run's window). The Settings
        tab's "keep every compiled size" turns releasing off. ``calibrate``: at INT8, quantize the UNet at
        the end on the steps recorded so far (False for Pre-compile's 1-step runs: too few to calibrate on).
        """
        model = getattr(p, "sd_model", None) or host.loaded_model()
        if not settings.parts:
            return self._run_plain(p, "No part selected: the image was made in plain PyTorch.", logging.INFO)
        try:
            accelerator = self.accelerator()
            window = (WINDOW_OFF if host.option(KEEP_SIZES_OPTION, False)
                      else WINDOW_NEW if new_window else WINDOW_CONTINUE)
            prepared = accelerator.prepare(model, settings, host.default_cache_dir(), window,
                                           str(host.option(PREVIOUS_WEIGHTS_OPTION, "auto") or "auto"))
        except (BackendUnavailable, UnsupportedModel) as exc:
            return self._run_plain(p, f"Accelerate with OpenVINO: {exc}", logging.WARNING)
        except ValueError as exc:  # settings the backend rejects, e.g. INT8 without NNCF: the image is still made
            return self._run_plain(p, f"Accelerate with OpenVINO: not used for this image: {exc}", logging.WARNING)
        notes: list[str] = []
        p.extra_generation_params.update(generation_params(settings))

        def unsupported(name: str, reason: str) -> None:
            notes.append(f"{name} in PyTorch")
            p.extra_generation_params.update(generation_params(settings, notes))
            comment = getattr(p, "comment", None)
            if comment is not None:
                comment(f"Accelerate with OpenVINO: {name} ran in plain PyTorch: {reason}")

        cache_folder = settings.backend_options(host.default_cache_dir())["cache_dir"] if settings.model_caching else ""
        cached_before = self._cache_keys(cache_folder)
        session = RoutingSession(accelerator, prepared, model, on_unsupported=unsupported)
        with self._lock:
            self._session = session
        accelerator.lora_changes()  # from earlier runs: not this run's
        attention = FusedAttention() if "unet" in settings.parts else None
        with self._lock:
            self._attention = attention
        try:
            with attention or contextlib.nullcontext(), session:
                processed = host.process_images(p)
        except BaseException as exc:  # A1111's NansException, an Interrupt, any error: the models are restored
            stopped = (f"The generation stopped with {type(exc).__name__}: {exc}. The WebUI's models were restored; "
                       f"calls through OpenVINO before it: {session.calls()}.")
            self._set_last_run({"accelerated": False, "status": stopped})
            raise
        finally:
            with self._lock:
                self._session = self._attention = None
        if calibrate and not host.state().interrupted and accelerator.calibrate(prepared):
            logger.info("Accelerate with OpenVINO: the UNet was quantized to INT8 on this generation's steps")
        if cached_before is not None:
            cache_owners.record(cache_folder, self._cache_keys(cache_folder) - cached_before, checkpoint_label(model))
        calls, eager = session.calls(), session.eager()
        reports, stats = accelerator.reports_since(prepared), accelerator.stats_since(prepared)
        status = run_status(settings, calls, reports, stats, switches=session.events, eager=eager, f32=session.f32(),
                            attention=attention.replaced if attention else None)
        lora_changes = accelerator.lora_changes()
        if lora_changes:
            status += "\n" + changes_line(lora_changes, reports)
        logger.info("%s", status)
        if eager:
            logger.warning("Accelerate with OpenVINO: %s", backend_module("graph_runs").describe_eager(eager, calls))
        self._set_last_run(_run_report(status, settings, calls, eager, stats, reports, session.events, lora_changes))
        if not host.state().interrupted:
            for checkpoint in session.checkpoints():
                self._record_sizes(p, checkpoint, settings)
        if processed is not None:
            processed.comments = ((getattr(processed, "comments", "") or "") + "\n" + status).strip()
        return processed

    def _run_plain(self, p: Any, message: str, level: int) -> Any:
        logger.log(level, "%s", message)
        comment = getattr(p, "comment", None)
        if comment is not None:
            comment(message)
        self._set_last_run({"accelerated": False, "status": message})
        processed = host.process_images(p)
        if processed is not None and message not in (getattr(processed, "comments", "") or ""):
            processed.comments = ((getattr(processed, "comments", "") or "") + "\n" + message).strip()
        return processed

    def _set_last_run(self, run: dict[str, Any]) -> None:
        with self._lock:
            self._last_run = run

    @property
    def last_status(self) -> str:
        """The last generation's status text (the panel's "Last run", the comment under the images)."""
        with self._lock:
            return str(self._last_run["status"])

    def last_run_report(self) -> dict[str, Any]:
        """The last generation's status as data (what the HTTP status route returns)."""
        with self._lock:
            return dict(self._last_run)

    def _record_sizes(self, p: Any, checkpoint: str, settings: AccelerateSettings) -> None:
        label = settings.infotext()
        self.ready.add(checkpoint, label, Size(int(p.width), int(p.height), int(p.batch_size)))
        if getattr(p, "enable_hr", False) and getattr(p, "hr_upscale_to_x", 0):
            self.ready.add(checkpoint, label, Size(int(p.hr_upscale_to_x), int(p.hr_upscale_to_y), int(p.batch_size)))

    def precompile(self, sizes_text: str, batch_size: int, settings: AccelerateSettings) -> Iterator[str]:
        """Compile each size ahead of a batch job (a 1-step generation each); yields progress lines.

        Raises:
            ValueError: for a malformed size list.
        """
        sizes = parse_sizes(sizes_text, batch_size)
        for number, size in enumerate(sizes, start=1):
            yield f"Compiling {size.label()} ({number}/{len(sizes)}) ..."
            p = host.txt2img_processing(
                prompt="",
                negative_prompt="",
                width=size.width,
                height=size.height,
                batch_size=size.batch_size,
                n_iter=1,
                steps=1,
                do_not_save_samples=True,
                do_not_save_grid=True,
            )
            with host.queue_lock():
                # one window: every size stays compiled; at INT8 its 1-step calls are recorded, and the next
                # generation calibrates on them and its own steps
                self.run(p, settings, new_window=number == 1, calibrate=False)
        yield f"Ready: {', '.join(s.label() for s in sizes)}."

    def ready_sizes_text(self) -> str:
        """Which sizes are ready for the loaded checkpoint, one line per setting."""
        model = host.loaded_model()
        if model is None:
            return "No checkpoint loaded."
        ready = self.ready.for_checkpoint(checkpoint_key(model))
        if not ready:
            return "No size compiled yet for this checkpoint."
        lines = [f"{label}: {', '.join(s.label() for s in sizes)}" for label, sizes in sorted(ready.items())]
        lines.append("(Converted. The sizes of the last generation stay compiled in memory; another costs at most "
                     "a compile, no conversion.)")
        return "\n".join(lines)

    # --- disk cache ------------------------------------------------------------------------------
    def cache_dir(self, folder: str) -> str:
        """The folder in use: ``folder`` or the default under the models folder."""
        return (folder or "").strip() or host.default_cache_dir()

    def cache_size_text(self, folder: str) -> str:
        """E.g. "12 entries, 1.2 GiB in /models/openvino_cache", and a line of sizes per checkpoint."""
        path = self.cache_dir(folder)
        cache = self.api().model_cache(path)
        size = backend_module("files").format_bytes(cache.total_bytes())
        by_checkpoint = cache_owners.describe(path, cache)
        text = f"{len(list(cache.entries()))} entries, {size} in {path}"
        return f"{text}\n{by_checkpoint}" if by_checkpoint else text

    def _cache_keys(self, folder: str) -> set[str] | None:
        """The keys of the disk cache in ``folder`` now; None without a folder or when it cannot be read."""
        if not folder:
            return None
        try:
            return cache_owners.entry_keys(self.api().model_cache(folder))
        except OSError as err:
            logger.warning("could not list the OpenVINO cache in %s: %s", folder, err)
            return None

    def clear_cache(self, folder: str, confirmed: bool) -> str:
        """Delete the compiled models on disk if ``confirmed``; returns the new size text."""
        if not confirmed:
            return "Not cleared (not confirmed). " + self.cache_size_text(folder)
        path = self.cache_dir(folder)
        self.api().model_cache(path).clear()
        logger.info("cleared the OpenVINO cache in %s", path)
        return "Cleared. " + self.cache_size_text(folder)

    # --- lifecycle ---------------------------------------------------------------------------------
    def on_model_loaded(self, model: Any) -> None:
        """During a generation: route the model A1111 switched to. Otherwise: drop compiled models of
        checkpoints that are no longer in use."""
        with self._lock:
            session = self._session
            if session is None and self._accelerator is not None:
                self._accelerator.forget_unless(model)
        if session is not None:
            session.follow(model)

    def on_cfg_denoiser(self, params: Any) -> None:
        """Before each UNet step: route the loaded model if A1111 switched to it without a
        ``model_loaded`` callback (a model kept in memory, ``sd_checkpoints_limit`` > 1)."""
        session, attention = self._session, self._attention
        if attention is not None:
            attention.ensure()  # a model load inside the generation applied the WebUI's attention again
        if session is not None:
            session.follow(host.loaded_model())

    def unload(self) -> None:
        """Release everything (script reload or WebUI shutdown)."""
        with self._lock:
            if self._accelerator is not None:
                self._accelerator.reset()
            self.ready.clear()


def _set_textinfo(text: str | None) -> None:
    host.state().textinfo = text


def _run_report(
    status: str,
    settings: AccelerateSettings,
    calls: dict[str, int],
    eager: dict[str, tuple[int, str]],
    stats: dict[str, float],
    reports: list[Any],
    switches: list[str],
    lora_changes: list[LoraChange],
) -> dict[str, Any]:
    """The status route's data for a run that went through OpenVINO."""
    fallbacks: dict[str, str] = {}
    for report in reports:
        fallbacks.update(report.fallback_ops)
    return {
        "accelerated": True,
        "status": status,
        "settings": settings.infotext(),
        "calls": dict(calls),
        "eager": {label: {"calls": n, "why": why} for label, (n, why) in eager.items()},
        "compiles": len(reports),
        "fallback_ops": fallbacks,
        "switches": list(switches),
        "lora_changes": {change.label: change.networks for change in lora_changes},
        "lora_write_seconds": sum(change.write_seconds for change in lora_changes),
        **{key: stats.get(key, 0) for key in ("ov_calls", "eager_calls", "cache_hits", "compile_seconds",
                                               "convert_seconds", "run_seconds", "released", "released_stale",
                                               "kept_previous", "capture_seconds", "captures_made",
                                               "captures_saved", "captures_loaded")},
    }
