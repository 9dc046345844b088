"""The extension's runtime: one object per load of the script file, owning all state of the extension.

It is created by ``scripts/openvino_accelerate.py``; A1111 re-executes that file on reload, and the
``on_script_unloaded`` callback resets the old runtime. Both Script instances (txt2img and img2img)
share it, so a size compiled in one tab is ready in the other.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

from . import cache_owners, host, weights_at_load
from .accelerator import WINDOW_CONTINUE, WINDOW_NEW, WINDOW_OFF, Accelerator
from .backend_bridge import BackendApi, BackendUnavailable, load_backend, ov_backend
from .controlnet import control_units
from .generation import (
    Generation,
    InfotextEntry,
    NotAccelerated,
    RunRecord,
    append_comment,
    comment_on,
    run_report,
)
from .hosts import Host, detect
from .infotext import WRITTEN_KEYS
from .job import Job
from .model_parts import UnsupportedModel, checkpoint_key, checkpoint_label
from .options import read_options
from .precompile import ReadySizes, Size
from .settings import AccelerateSettings

logger = logging.getLogger(__name__)


class Extension:
    """State and actions of the extension; everything the Script and the panel do goes through here."""

    def __init__(self, load_api: Callable[[], BackendApi] = load_backend, webui: Host | None = None) -> None:
        """Args:
        load_api: imports the backend on first use (tests pass their own).
        webui: the WebUI it runs in (None: the one running, :func:`.hosts.detect`).
        """
        self.webui = webui if webui is not None else detect()
        """What differs between the WebUIs (:mod:`.hosts`)."""
        self._load_api = load_api
        self._lock = threading.RLock()
        self._api: BackendApi | None = None
        self._accelerator: Accelerator | None = None
        self.ready = ReadySizes()
        self._last_run: dict[str, Any] = {"accelerated": False, "status": "No generation with OpenVINO yet."}
        self._generation: Generation | None = None
        self._job: Job | None = None

    # --- backend -------------------------------------------------------------------------------
    def api(self) -> BackendApi:
        """The backend API (imported on first use). Raises BackendUnavailable."""
        with self._lock:
            if self._api is None:
                self._api = self._load_api()
            return self._api

    def made_accelerator(self) -> Accelerator | None:
        """The accelerator if one was made (:meth:`accelerator` makes it)."""
        return self._accelerator

    def accelerator(self) -> Accelerator:
        """The accelerator (created on first use). Raises BackendUnavailable."""
        with self._lock:
            if self._accelerator is None:
                self._accelerator = Accelerator(self.api(), notify=lambda text: setattr(host.state(), "textinfo", text),
                                                host=self.webui)
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

    def known_devices(self) -> list[str] | None:
        """:meth:`device_names`, or None without the backend (a device then goes unchecked)."""
        try:
            return self.device_names()
        except BackendUnavailable:
            return None

    # --- generation ----------------------------------------------------------------------------
    def run(self, p: Any, settings: AccelerateSettings, new_window: bool = True, calibrate: bool = True) -> Any:
        """Run A1111's pipeline on ``p`` with the chosen parts in OpenVINO; returns the ``Processed``.

        ``new_window``: the run is a generation of its own, so compiled models it does not use are
        released when it builds another (False: it continues the previous run's window). The Settings
        tab's "keep every compiled size" turns releasing off. ``calibrate``: at INT8, quantize the UNet at
        the end on the steps recorded so far (False for Pre-compile's 1-step runs: too few to calibrate on).
        """
        self.finish_stale()
        if not settings.parts:
            return self._run_plain(p, "No part selected: the image was made in plain PyTorch.", logging.INFO)
        try:
            generation = self.start_generation(p, settings, WINDOW_NEW if new_window else WINDOW_CONTINUE)
        except NotAccelerated as exc:
            return self._run_plain(p, str(exc), exc.level)
        try:
            processed = host.process_images(p)
        except BaseException as exc:  # A1111's NansException, an Interrupt, any error: the models are restored
            self._set_last_run({"accelerated": False, "status": self._end_generation(generation, exc)})
            raise
        record = self._finish_generation(p, generation, calibrate)
        self._set_last_run(run_report(record))
        append_comment(processed, record.status)
        return processed

    def start_generation(self, p: Any, settings: AccelerateSettings, window: str, section: bool = False) -> Generation:
        """Route ``p``'s model for one ``process_images`` call (the caller runs it, then
        :meth:`_finish_generation`); records the settings in ``p``'s infotext.

        Raises:
            NotAccelerated: the backend is missing, the model cannot be accelerated or the backend
                rejected the settings; the message says why (the image is still made, in PyTorch).
        """
        model = getattr(p, "sd_model", None) or host.loaded_model()
        try:
            accelerator = self.accelerator()
            options = read_options()
            if options.keep_all_sizes:
                window = WINDOW_OFF
            prepared = accelerator.prepare(model, settings, host.default_cache_dir(), window,
                                           options.previous_weights, options.step_cache, options.weights_in_file,
                                           options.cache_limit_bytes)
        except (BackendUnavailable, UnsupportedModel) as exc:
            raise NotAccelerated(f"Accelerate with OpenVINO: {exc}", logging.WARNING) from exc
        except ValueError as exc:  # settings the backend rejects, e.g. INT8 without NNCF: the image is still made
            raise NotAccelerated(f"Accelerate with OpenVINO: not used for this image: {exc}", logging.WARNING) from exc
        if section:  # X/Y/Z plot's cells share one dict: this cell's entries must not reach the next one's
            p.extra_generation_params = dict(p.extra_generation_params)
        generation = Generation(accelerator, prepared, model, settings, InfotextEntry(p, settings, section).unsupported,
                                lambda: control_units(p))
        generation.owner, generation.section = id(p), section
        cache_folder = settings.backend_choice(host.default_cache_dir()).cache_dir if settings.model_caching else ""
        generation.cache_folder, generation.cached_before = cache_folder, self._cache_keys(cache_folder)
        generation.start()
        with self._lock:
            self._generation = generation
        return generation

    def _forget(self, generation: Generation) -> None:
        with self._lock:
            if self._generation is generation:
                self._generation = None

    def _end_generation(self, generation: Generation, exc: BaseException | None = None) -> str:
        """Restore the model of a generation that did not finish; returns the status saying so."""
        self._forget(generation)
        status = generation.abort(exc)
        if status:
            logger.warning("Accelerate with OpenVINO: %s", status)
        return status

    def _finish_generation(self, p: Any, generation: Generation, calibrate: bool) -> RunRecord:
        self._forget(generation)
        vae_methods = (str(host.option("sd_vae_decode_method", "")), str(host.option("sd_vae_encode_method", "")))
        record = generation.finish(calibrate and not host.state().interrupted, vae_methods)
        if generation.cached_before is not None:
            cache_owners.record(generation.cache_folder,
                                self._cache_keys(generation.cache_folder) - generation.cached_before,
                                checkpoint_label(generation.model))
        if not host.state().interrupted:
            for checkpoint in generation.session.checkpoints():
                self._record_sizes(p, checkpoint, generation.settings)
        return record

    def finish_stale(self) -> None:
        """Restore the model of a generation whose ``postprocess`` never came (it stopped with an error)."""
        with self._lock:
            generation, job = self._generation, self._job
        if generation is None:
            return
        status = self._end_generation(generation)
        if job is not None and generation.section:
            job.stopped = status
        report = job.report() if job is not None and generation.section else None
        self._set_last_run(report if report is not None else {"accelerated": False, "status": status})

    # --- the always-on section -------------------------------------------------------------------
    def begin_job(self, p: Any) -> None:
        """A request starts (the section's ``setup`` hook, with the request's ``p``): its generations form
        one job. ``p.close()``, which A1111 calls when the request ends, however it ends, ends the job."""
        self.finish_stale()
        with self._lock:
            self._job = Job(owner=id(p))
        close = getattr(type(p), "close", None)
        if close is None or "close" in vars(p):  # not A1111's processing object, or someone wraps it already
            return
        extension, owner, request = self, id(p), weakref.ref(p)  # (no cycle through p: it is freed as before)

        def close_and_end_job(*args: Any, **kwargs: Any) -> Any:
            try:
                extension.end_job(owner)
            finally:  # the request's own close runs whatever happened
                target = request()
                result = close(target, *args, **kwargs) if target is not None else None
            return result

        p.close = close_and_end_job

    def end_job(self, owner: int) -> None:
        """The request with ``p`` of id ``owner`` ended: restore anything still routed, forget the job."""
        self.finish_stale()
        with self._lock:
            self._job = None if self._job is not None and self._job.owner == owner else self._job

    def section_process(self, p: Any, settings: AccelerateSettings | None, why_plain: str, error: bool = False) -> None:
        """The section's ``process`` hook: start routing ``p``'s generation with ``settings`` (None: the
        section is off for it, ``why_plain`` says why; ``error``: because its arguments were wrong, which the
        status route then says)."""
        self.finish_stale()
        with self._lock:
            job = self._job
            if job is None:  # a generation with no request around it (another extension's own p)
                job = self._job = Job(owner=id(p))
        if settings is None or not settings.parts:
            if any(key in p.extra_generation_params for key in WRITTEN_KEYS):  # a cell before this one's
                p.extra_generation_params = {k: v for k, v in p.extra_generation_params.items()
                                             if k not in WRITTEN_KEYS}
            job.plain.append(why_plain if settings is None else "no part selected")
            report = job.report()
            if report is not None:  # the job's status also says which of its generations ran in PyTorch
                self._set_last_run(report)
            if error and not job.started:
                self._set_last_run({"accelerated": False, "status": f"Accelerate with OpenVINO: {why_plain}"})
            return
        window = WINDOW_CONTINUE if job.started else WINDOW_NEW
        try:
            self.start_generation(p, settings, window, section=True)
        except NotAccelerated as exc:
            logger.log(exc.level, "%s", exc)
            comment_on(p, str(exc))
            job.plain.append(str(exc))
            if not job.records:
                self._set_last_run({"accelerated": False, "status": str(exc)})
            return

    def section_postprocess(self, p: Any, processed: Any) -> None:
        """The section's ``postprocess`` hook: finish the generation it started for ``p``; the job's status."""
        with self._lock:
            generation, job = self._generation, self._job
        if generation is None or not generation.section or generation.owner != id(p):
            return
        record = self._finish_generation(p, generation, calibrate=True)
        if job is None:
            job = Job(owner=id(p))
        job.records.append(record)
        self._set_last_run(job.report() or run_report(record))
        append_comment(processed, record.status)

    def dropdown_active(self) -> bool:
        """Whether the dropdown script runs the current generation (the section then leaves it alone)."""
        with self._lock:
            return self._generation is not None and not self._generation.section

    def _run_plain(self, p: Any, message: str, level: int) -> Any:
        logger.log(level, "%s", message)
        comment_on(p, message)
        self._set_last_run({"accelerated": False, "status": message})
        processed = host.process_images(p)
        if message not in (getattr(processed, "comments", "") or ""):
            append_comment(processed, message)
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
        """The last run's status as data (the HTTP status route), with what is held now (``Accelerator.held_now``)."""
        with self._lock:
            report, accelerator = dict(self._last_run), self._accelerator
        report.update(accelerator.held_now() if accelerator is not None else {"compiled_models": 0})
        return report

    def _record_sizes(self, p: Any, checkpoint: str, settings: AccelerateSettings) -> None:
        label = settings.infotext()
        self.ready.add(checkpoint, label, Size(int(p.width), int(p.height), int(p.batch_size)))
        if getattr(p, "enable_hr", False) and getattr(p, "hr_upscale_to_x", 0):
            self.ready.add(checkpoint, label, Size(int(p.hr_upscale_to_x), int(p.hr_upscale_to_y), int(p.batch_size)))

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
        """E.g. "12 entries, 1.2 GiB of 20.0 GiB limit in /models/openvino_cache", and sizes per checkpoint."""
        path = self.cache_dir(folder)
        cache = self.accelerator().backends.model_cache(path)
        limit = read_options().cache_limit_bytes
        usage = ov_backend.cache_usage(cache, ov_backend.DEFAULT_CACHE_MAX_BYTES if limit is None else limit)
        by_checkpoint = cache_owners.describe(path, cache)
        text = f"{len(list(cache.entries()))} entries, {usage.text()} in {path}"
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
        """In a generation: route the model A1111 switched to; else forget_unless and :mod:`.weights_at_load`."""
        with self._lock:
            generation, accelerator = self._generation, self._accelerator
            if generation is None and accelerator is not None:
                accelerator.forget_unless(model)
        if generation is not None:
            generation.session.follow(model)
        else:
            weights_at_load.place(model, accelerator, self.accelerator)

    def before_sampling(self, p: Any) -> None:
        """Before each sampling (the ``process_before_every_sampling`` hook): see :meth:`Generation.before_sampling`."""
        generation = self._generation
        if generation is not None and generation.active:
            generation.before_sampling(p)

    def on_cfg_denoiser(self, params: Any) -> None:
        """Before each UNet evaluation of a generation: see :meth:`Generation.before_unet`."""
        generation = self._generation
        if generation is not None and generation.active:
            generation.before_unet(host.loaded_model(), params)

    def unload(self) -> None:
        """Release everything (script reload or WebUI shutdown)."""
        self.finish_stale()
        with self._lock:
            if self._accelerator is not None:
                self._accelerator.reset()
            self.ready.clear()
