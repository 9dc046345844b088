"""Rendering a batch job's images: one model at a time, switched only when a line asks for another.

Owns :class:`RenderOptions` (what every line of a run shares: device, parts, cache, VAE, step caching's
shape), :class:`BatchRenderer` (the loaded checkpoint, routed through ov_backend under one line's setup, and
a batch of a line rendered with it) and :func:`job_for` (a job line and its seed -> a ``GenerationJob``). A new
checkpoint is a load; a new precision or step caching interval on the same checkpoint is a new routing (the
disk cache makes it a compile, not a conversion); the same setup again costs nothing.

The renderer holds no file and no manifest: the command (or a worker process) that owns it saves what it
returns, so the same renderer serves one process, ``--workers`` processes and a cluster's workers.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .batch_jobs import JobLine
from .parts import PARTS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RenderOptions:
    """What every line of a batch run shares (picklable: a worker process gets a copy)."""

    device: str = "CPU"
    accelerate: tuple[str, ...] = PARTS
    """The parts routed through OpenVINO; the others stay in PyTorch."""
    model_caching: bool = True
    cache_dir: str | None = None
    cache_max_bytes: int | None = None
    vae: str | None = None
    """A VAE file replacing every checkpoint's own."""
    step_cache_depth: int = 2
    step_cache_start: int = 2
    step_cache_end: int = 1
    threads: int | None = None
    """OpenVINO's and PyTorch's threads for this renderer (None: all cores); set in a worker process."""
    cpu_pinning: bool | None = None
    """Whether OpenVINO pins its threads to cores (None: its default); off in a Ray worker, which shares the node's
    cores with other workers without knowing which are its own."""
    lora_dirs: tuple[str, ...] = ()
    """Folders of the LoRA files prompts name; empty: the WebUI's ``models/Lora`` beside each checkpoint."""
    demo_folder: str | None = field(default=None, compare=False)
    """Where the demo checkpoint is built (None: the per-user cache)."""
    order: tuple[tuple[JobLine, int], ...] = field(default=(), compare=False, repr=False)
    """The job's lines with their seeds, every one, rendered or not: at INT8 each UNet graph is calibrated on the
    first batch, in this order (a setup's lines in the file's order), that runs it, whichever process renders it
    and wherever a run started (empty: on the first batch this renderer gives it)."""

    def settings(self, precision: str, step_cache: int) -> Any:
        """The SD layer's settings for one line's precision and step caching interval."""
        from .settings import build_sd_settings

        options: dict[str, Any] = {
            "device": self.device, "precision": precision, "model_caching": self.model_caching,
            "cache_max_bytes": self.cache_max_bytes, "accelerate": self.accelerate,
            "step_cache": {"interval": step_cache, "depth": self.step_cache_depth,
                           "full_start": self.step_cache_start, "full_end": self.step_cache_end},
            # one model per size: what a size renders never depends on the sizes before it (a resumed run gives
            # the bytes of a run in one go), and a size of its own is the CPU's fastest per step
            "shared_shapes": "never",
        }
        if self.cache_dir is not None:
            options["cache_dir"] = self.cache_dir
        if self.threads is not None:
            options["threads"] = self.threads
        if self.cpu_pinning is not None:
            options["cpu_pinning"] = self.cpu_pinning
        return build_sd_settings(options)


def summed(counters: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Counters (backend stats of several routings or workers) added up by name."""
    total: dict[str, float] = {}
    for one in counters:
        for key, value in one.items():
            total[key] = total.get(key, 0.0) + float(value)
    return total


def job_for(line: JobLine, seed: int, init_images: dict[str, Any] | None = None) -> Any:
    """The ``GenerationJob`` of ``line`` with its resolved ``seed`` (init images read once, kept in
    ``init_images`` by path)."""
    from PIL import Image

    from .pipeline import GenerationJob

    init = None
    if line.init_image:
        cache = init_images if init_images is not None else {}
        if line.init_image not in cache:
            with Image.open(line.init_image) as img:
                cache[line.init_image] = img.convert("RGB")
        init = cache[line.init_image]
    return GenerationJob(
        prompt=line.prompt, negative_prompt=line.negative_prompt, steps=line.steps, cfg_scale=line.cfg_scale,
        sampler=line.sampler, width=line.width, height=line.height, seed=seed, batch_size=line.batch_size,
        batch_count=line.batch_count, init_image=init, denoising_strength=line.denoising_strength,
        clip_skip=line.clip_skip,
    )


class _NeedsCalibration(Exception):
    """A UNet call would calibrate the INT8 model ``key`` on a batch that is not the job's first to run it."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class BatchRenderer:
    """Renders batches of job lines, keeping the model of the last line's setup loaded and routed.

    Args:
        options: what every line shares.
        say: called with a line of text for the user (a load, a new routing).
    """

    def __init__(self, options: RenderOptions, say: Callable[[str], None] | None = None) -> None:
        self.options = options
        self._say = say or (lambda text: logger.info("%s", text))
        self._checkpoint: str | None = None
        self._setup: tuple[str, str, int] | None = None
        self._components: Any = None
        self._accelerator: Any = None
        self._generator: Any = None
        self._init_images: dict[str, Any] = {}
        self.loads = 0
        self.load_seconds = 0.0
        self._watch: Callable[[str, bool], bool] | None = None
        self._said: Any = None
        #: a class of batches (:meth:`_class_of`) -> the INT8 models (cache keys) its UNet calls run or calibrate
        self._graphs: dict[tuple, frozenset[str]] = {}
        #: a line's number -> its class (for the current setup)
        self._classes: dict[int, tuple] = {}
        self.reports: list[str] = []
        """The compile reports of the routings this renderer ended (what each graph's build did)."""
        self.backend_stats: dict[str, float] = {}
        """The counters of every routing this renderer made, summed (compile and run seconds, calls, ...)."""

    def checkpoint_path(self, line: JobLine) -> str:
        if line.checkpoint:
            return line.checkpoint
        from .demo_checkpoint import demo_checkpoint

        return str(demo_checkpoint(self.options.demo_folder))

    @staticmethod
    def _counters(accelerator: Any) -> dict[str, float]:
        """An accelerator's backend counters, with ``conversions``: the partitions converted to OpenVINO (a
        LoRA or size change reuses a conversion and only compiles; a disk cache hit converts nothing)."""
        stats = {key: float(value) for key, value in accelerator.stats().items()}
        stats["conversions"] = float(sum(1 for report in accelerator.backends.reports() for p in report.partitions
                                         if p.in_openvino and not p.reused and not p.cache_hit))
        return stats

    def _unroute(self) -> None:
        if self._accelerator is not None:
            self.reports += [report.summary() for report in self._accelerator.backends.reports()]
            self.backend_stats = summed([self.backend_stats, self._counters(self._accelerator)])
            self._accelerator.restore()
        self._accelerator = self._generator = None
        self._setup = None

    def _use(self, line: JobLine) -> None:
        import time

        from .accelerate import Accelerator
        from .checkpoint import file_hash
        from .loader import load_components
        from .lora import webui_lora_dirs
        from .openvino_entry import ENTRY_KEY, format_entry
        from .pipeline import Generator

        if self._setup == line.setup:
            return
        if self._generator is not None:
            self._generator.loras.restore()  # the next routing starts from the checkpoint's own weights
        self._unroute()
        checkpoint = self.checkpoint_path(line)
        if checkpoint != self._checkpoint:
            self._components = None
            gc.collect()  # the last checkpoint's weights go before the next one's come in
            started = time.perf_counter()
            self._components = load_components(checkpoint, vae_path=self.options.vae)
            self._checkpoint = checkpoint
            self._name, self._hash = Path(checkpoint).stem, file_hash(checkpoint)
            seconds = time.perf_counter() - started
            self.loads += 1
            self.load_seconds += seconds
            self._say(f"loaded {checkpoint} ({self._components.family}) in {seconds:.1f}s")
        settings = self.options.settings(line.precision, line.step_cache)
        accelerator = Accelerator(self._components, settings)
        if settings.accelerate:
            accelerator.apply()
        entry = format_entry(settings.device, settings.accelerate, settings.precision,
                             step_cache=settings.step_cache.interval) if settings.accelerate else None
        self._generator = Generator(self._components, self._name, self._hash, {ENTRY_KEY: entry},
                                    step_cache=accelerator.step_cache,
                                    lora_dirs=self.options.lora_dirs or webui_lora_dirs(checkpoint))
        self._accelerator = accelerator
        self._setup = line.setup
        self._graphs.clear()
        self._classes.clear()
        self._said = accelerator.backends.mark()
        if settings.backend_choice().quantized and "unet" in settings.accelerate:
            unet = accelerator.backends.backend(settings.backend_choice().for_part("unet"))
            unet.watch_int8(lambda key, quantized: self._watch(key, quantized) if self._watch is not None else True)
        self._say(f"OpenVINO on {settings.device} for {'+'.join(settings.accelerate)} at {settings.precision}"
                  + (f", step caching every {line.step_cache}" if line.step_cache > 1 else "")
                  if settings.accelerate else "every part in PyTorch (--pytorch)")

    def render(
        self,
        line: JobLine,
        seed: int,
        batch: int,
        on_step: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[Any]:
        """Batch ``batch`` of ``line`` (its seed resolved): the ``GeneratedImage``s, in order.

        Raises:
            CheckpointError: the line's checkpoint cannot be loaded.
            LoraError: a LoRA of the prompt does not fit the model.
            StepCacheUnsupported: the model cannot run with step caching.
            Interrupted: ``should_stop`` said so; nothing of the batch is returned.
        """
        self._use(line)
        if not self._int8():
            return self._generator.run_batch(job_for(line, seed, self._init_images), batch, on_step, should_stop)
        task = (line, seed, batch)
        images, recorded = self._calibrated(task, on_step, should_stop)
        self._calibrate("the batch renders again at INT8")
        if recorded:
            # the batch ran (part of) the UNet at float while it was recorded: rendered again, every INT8 image comes
            # from the INT8 model, whether it was calibrated in this run, in another process or read from the cache
            images, _ = self._calibrated(task, on_step, should_stop)
        return images

    def _int8(self) -> bool:
        return self._accelerator is not None and self._accelerator.settings.backend_choice().quantized

    def _calibrated(self, task: tuple[JobLine, int, int], on_step: Callable[[int, int], None] | None,
                    should_stop: Callable[[], bool] | None, sampling_only: bool = False) -> tuple[list[Any], bool]:
        """``task`` rendered at INT8 (``sampling_only``: up to its last sampling step; no images): each UNet graph
        it runs without an INT8 model is calibrated on the job's first batch that runs it: on this one if it is
        that batch (its float calls are then recorded), else on that batch sampled here first, its images not
        made. Returns the images and whether calls were recorded."""
        allowed: set[str] = set()
        sampled: set[str] = set()
        while True:
            try:
                return self._run(task, allowed, on_step, should_stop, sampling_only)
            except _NeedsCalibration as need:
                if need.key in sampled:  # the batch sampled for it did not run it: the classes missed a difference
                    logger.warning("INT8: the batch sampled to calibrate a UNet graph line %d runs did not run it; "
                                   "line %d calibrates it", task[0].number, task[0].number)
                    allowed.add(need.key)
                    continue
                first = self._first_batch_of(need.key, task, should_stop)
                if first is None:
                    allowed.add(need.key)
                    continue
                sampled.add(need.key)
                self._say(f"INT8: line {first[0].number} (batch {first[2] + 1}) is the job's first batch to run a "
                          f"UNet graph line {task[0].number} runs: its steps are sampled here to calibrate it, "
                          "no image saved")
                self._calibrated(first, None, should_stop, sampling_only=True)
                self._calibrate("")

    def _run(self, task: tuple[JobLine, int, int], allowed: set[str] | None,
             on_step: Callable[[int, int], None] | None, should_stop: Callable[[], bool] | None,
             sampling_only: bool) -> tuple[list[Any], bool]:
        """One run of ``task`` under the INT8 watch: a float UNet call records for the models in ``allowed``, raises
        :class:`_NeedsCalibration` for the others (``allowed`` None: records for none, raises for none). The INT8
        models its calls ran or recorded for are kept as its class's (a run that went through every step only)."""
        from .pipeline import Interrupted

        line, seed, batch = task
        self._use(line)
        seen: set[str] = set()
        recorded = False
        sampled = False

        def watch(key: str, quantized: bool) -> bool:
            nonlocal recorded
            seen.add(key)
            if quantized or allowed is None:
                return False
            if key not in allowed:
                raise _NeedsCalibration(key)
            recorded = True
            return True

        def step(done: int, total: int) -> None:
            nonlocal sampled
            sampled = done >= total
            if on_step is not None:
                on_step(done, total)

        def stop() -> bool:
            return (sampling_only and sampled) or (should_stop is not None and should_stop())

        self._watch = watch
        try:
            images = self._generator.run_batch(job_for(line, seed, self._init_images), batch, step, stop)
        except Interrupted:
            if not (sampling_only and sampled) or (should_stop is not None and should_stop()):
                raise
            images = []
        finally:
            self._watch = None
        self._graphs[self._class_of(task)] = frozenset(seen)
        return images, recorded

    def _class_of(self, task: tuple[JobLine, int, int]) -> tuple:
        """What decides which UNet graphs a batch runs, and the weights they run with: batches of one class run the
        same INT8 models. Finer than the graphs is safe (it costs a sampling to learn a class's graphs); coarser
        would not be (the LoRAs, the size and batch size, the sampler, img2img, the prompt's chunks of 75 tokens)."""
        from .lora import parse_prompt_loras

        line = task[0]
        known = self._classes.get(line.number)
        if known is not None:
            return known
        try:
            text, refs = parse_prompt_loras(line.prompt)
            encoder = self._generator.prompt_encoder(line.clip_skip)
            chunks = max(encoder.chunk_count(text), encoder.chunk_count(line.negative_prompt))
            made: tuple = (line.setup, tuple(sorted(map(repr, refs))), line.width, line.height, line.batch_size,
                           line.sampler, bool(line.init_image), chunks)
        except Exception:  # a line whose prompt does not parse: a class of its own
            made = ("line", line.number)
        self._classes[line.number] = made
        return made

    def _first_batch_of(self, key: str, task: tuple[JobLine, int, int],
                        should_stop: Callable[[], bool] | None) -> tuple[JobLine, int, int] | None:
        """The job's first batch (in :attr:`RenderOptions.order`) whose UNet runs the INT8 model ``key``, when it is
        not ``task`` (None: ``task`` is). The graphs of a class of batches before ``task``'s first are learnt by
        sampling one of them (no image saved), once."""
        from .pipeline import Interrupted

        line = task[0]
        mine = self._class_of(task)
        for other, seed in self.options.order:
            if other.setup != line.setup:
                continue
            for batch in range(other.batch_count):
                candidate = (other, seed, batch)
                if other.number == line.number and batch == task[2]:
                    return None
                kind = self._class_of(candidate)
                if kind == mine:
                    return candidate
                if kind not in self._graphs:
                    self._say(f"INT8: line {other.number}'s steps are sampled once, no image saved, to learn which "
                              "UNet graphs it runs (the job's first batch of a graph calibrates it)")
                    try:
                        self._run(candidate, None, None, should_stop, sampling_only=True)
                    except Interrupted:
                        raise
                    except Exception as exc:  # the line cannot render (a LoRA not found...): it calibrates nothing
                        logger.info("INT8: line %d cannot render (%s); it runs no UNet graph", other.number, exc)
                        self._graphs[kind] = frozenset()
                if key in self._graphs[kind]:
                    return candidate
        return None

    def _calibrate(self, then: str) -> None:
        """At INT8: quantize every UNet graph that recorded calls in the run just made, and say what was quantized
        since the last time (with ``then``). A graph is so calibrated on its first batch alone, whatever follows
        it: with a batch of fewer calls than ``calibration_samples`` it would otherwise go on recording into the next
        batch of its shape, and the pictures of that batch would depend on where a run started."""
        backends = self._accelerator.backends
        self._accelerator.calibrate()
        # the quantizations since the last said: at the end of the run, or during it (at calibration_samples calls)
        made = [r for r in backends.reports_since(self._said) if r.route == "int8"]
        self._said = backends.mark()
        if made:
            self._say("INT8: " + "; ".join(r.summary() for r in made) + (f"; {then}" if then else ""))

    def stats(self) -> dict[str, float]:
        """The backend counters of every routing so far, the current one included, summed."""
        current = [self._counters(self._accelerator)] if self._accelerator is not None else []
        return summed([self.backend_stats, *current])

    def eager_report(self) -> str | None:
        """Which parts' calls ran in plain PyTorch, and why (the current routing), or None."""
        return self._accelerator.eager_report() if self._accelerator is not None else None

    def close(self) -> dict[str, float]:
        """Put the models back and drop them; returns the summed backend counters."""
        self._unroute()
        self._components = None
        self._checkpoint = None
        return self.backend_stats
