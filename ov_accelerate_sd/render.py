"""Rendering the command line's jobs, ``generate``'s and ``batch``'s alike: one model at a time, switched only
when a line asks for another.

Owns :class:`RenderOptions` (what every line of a run shares: device, parts, cache, VAE, step caching's shape),
:class:`RenderTask` and :class:`RenderResult` (a batch of a line to render, and what came back), and
:class:`Renderer` (the loaded checkpoint, routed through ov_backend under one line's setup, a batch of a line
rendered with it, its counters and compile reports). A new checkpoint is a load; a new precision or step caching
interval on the same checkpoint is a new routing (the disk cache makes it a compile, not a conversion); the same
setup again costs nothing. At INT8 a routing's UNet calibrates by :mod:`.int8_calibration`'s first-batch policy.

The renderer holds no file: the command (or a worker) that owns it saves what it returns, so the same renderer
serves ``generate``, ``batch`` in one process, ``--workers`` processes and a cluster's workers.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .jobs import JobLine
from .parts import PARTS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RenderTask:
    """One batch of a job line, its seed resolved (picklable: a worker gets a copy)."""

    line: JobLine
    seed: int
    batch: int
    images: tuple[Any, ...] = field(default=(), compare=False)
    """What the command that owns the task saves of it (the images a resumed job still misses)."""


@dataclass
class RenderResult:
    """A task's images and where they came from."""

    task: RenderTask
    images: list[Any]
    """The ``GeneratedImage``s of the batch, in order."""
    worker: int = 0
    """The worker that rendered it (0: this process)."""
    stats: dict[str, float] = field(default_factory=dict)
    """The worker's counters so far (loads and load_seconds included)."""
    reports: list[str] = field(default_factory=list)
    """The worker's compile reports so far."""
    eager: str | None = None
    """Which parts' calls ran in plain PyTorch there, and why (None: none)."""


@dataclass(frozen=True)
class RenderOptions:
    """What every line of a run shares (picklable: a worker process gets a copy)."""

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
    order: tuple[RenderTask, ...] = field(default=(), compare=False, repr=False)
    """Every batch of the job, rendered or not, in the job's order: at INT8 each UNet graph is calibrated on the
    first of them that runs it, whichever process renders it and wherever a run started (empty: on the first
    batch this renderer gives it)."""

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
        for name in ("cache_dir", "threads", "cpu_pinning"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        return build_sd_settings(options)


def tasks_of(lines: Iterable[tuple[JobLine, int]]) -> tuple[RenderTask, ...]:
    """Every batch of ``lines`` (each with its resolved seed), in order."""
    return tuple(RenderTask(line, seed, batch) for line, seed in lines for batch in range(line.batch_count))


def checkpoint_of(line: JobLine, demo_folder: str | None = None) -> str:
    """The checkpoint file a line renders with (the demo model, built once, when it names none)."""
    if line.checkpoint:
        return line.checkpoint
    from .demo_checkpoint import demo_checkpoint

    return str(demo_checkpoint(demo_folder))


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


class Renderer:
    """Renders batches of job lines, keeping the model of the last line's setup loaded and routed.

    Args:
        options: what every line shares.
        say: called with a line of text for the user (a load, a new routing, an INT8 calibration).
    """

    def __init__(self, options: RenderOptions, say: Callable[[str], None] | None = None) -> None:
        self.options = options
        self._say = say or (lambda text: logger.info("%s", text))
        self._checkpoint: str | None = None
        self._setup: tuple[str, str, int] | None = None
        self._components: Any = None
        self._accelerator: Any = None
        self._generator: Any = None
        self._calibration: Any = None
        self._init_images: dict[str, Any] = {}
        self.loads = 0
        self.load_seconds = 0.0
        self._ended_reports: list[str] = []
        self._ended_stats: dict[str, float] = {}

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
            self._ended_reports += [report.summary() for report in self._accelerator.backends.reports()]
            self._ended_stats = summed([self._ended_stats, self._counters(self._accelerator)])
            self._accelerator.restore()
        self._accelerator = self._generator = self._calibration = None
        self._setup = None

    def use(self, line: JobLine) -> None:
        """Load and route the model of ``line``'s setup, unless it is the one in use.

        Raises:
            CheckpointError: the checkpoint cannot be loaded.
            StepCacheUnsupported: the model cannot run with step caching.
        """
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
        checkpoint = checkpoint_of(line, self.options.demo_folder)
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
        # the WebUI's own entry, so an image pastes back into its panel (no entry: made in PyTorch)
        entry = format_entry(settings.device, settings.accelerate, settings.precision,
                             step_cache=settings.step_cache.interval) if settings.accelerate else None
        self._generator = Generator(self._components, self._name, self._hash, {ENTRY_KEY: entry},
                                    step_cache=accelerator.step_cache,
                                    lora_dirs=self.options.lora_dirs or webui_lora_dirs(checkpoint))
        self._accelerator = accelerator
        self._setup = line.setup
        if settings.backend_choice().quantized and "unet" in settings.accelerate:
            self._calibrate_first_batches(accelerator, settings, line)
        self._say(f"OpenVINO on {settings.device} for {'+'.join(settings.accelerate)} at {settings.precision}"
                  + (f", step caching every {line.step_cache}" if line.step_cache > 1 else "")
                  if settings.accelerate else "every part in PyTorch (--pytorch)")

    def _calibrate_first_batches(self, accelerator: Any, settings: Any, line: JobLine) -> None:
        """At INT8: the UNet's calibration under the first-batch policy, for this routing."""
        from .int8_calibration import FirstBatchCalibration

        backends = accelerator.backends
        said = [backends.mark()]

        def quantize() -> list[str]:
            accelerator.calibrate()
            # the quantizations since the last said: at the end of a run, or during it (at calibration_samples calls)
            made = [r.summary() for r in backends.reports_since(said[0]) if r.route == "int8"]
            said[0] = backends.mark()
            return made

        def chunks(prompt: str, negative_prompt: str, clip_skip: int) -> int:
            encoder = self._generator.prompt_encoder(clip_skip)
            return max(encoder.chunk_count(prompt), encoder.chunk_count(negative_prompt))

        self._calibration = FirstBatchCalibration(self.options.order, self._sample, chunks, quantize, self._say)
        backends.backend(settings.backend_choice().for_part("unet")).watch_int8(self._calibration.watch)

    def _sample(self, task: RenderTask, on_step: Callable[[int, int], None] | None,
                should_stop: Callable[[], bool] | None) -> list[Any]:
        return self._generator.run_batch(job_for(task.line, task.seed, self._init_images), task.batch, on_step,
                                         should_stop)

    def render(self, task: RenderTask, on_step: Callable[[int, int], None] | None = None,
               should_stop: Callable[[], bool] | None = None) -> list[Any]:
        """The batch's ``GeneratedImage``s, in order.

        Raises:
            CheckpointError: the line's checkpoint cannot be loaded.
            LoraError: a LoRA of the prompt does not fit the model.
            StepCacheUnsupported: the model cannot run with step caching.
            Interrupted: ``should_stop`` said so; nothing of the batch is returned.
        """
        self.use(task.line)
        if self._calibration is None:
            return self._sample(task, on_step, should_stop)
        return self._calibration.render(task, on_step, should_stop)

    def result(self, task: RenderTask, images: list[Any], worker: int = 0) -> RenderResult:
        """``images`` of ``task`` with this renderer's counters and reports so far."""
        stats = self.stats()
        stats["loads"], stats["load_seconds"] = self.loads, self.load_seconds
        return RenderResult(task, images, worker, stats, self.reports(), self.eager_report())

    def stats(self) -> dict[str, float]:
        """The backend counters of every routing so far, the current one included, summed."""
        current = [self._counters(self._accelerator)] if self._accelerator is not None else []
        return summed([self._ended_stats, *current])

    def reports(self) -> list[str]:
        """The compile reports of every routing so far (what each graph's build did)."""
        current = [r.summary() for r in self._accelerator.backends.reports()] if self._accelerator else []
        return self._ended_reports + current

    def eager_report(self) -> str | None:
        """Which parts' calls ran in plain PyTorch, and why (the current routing), or None."""
        return self._accelerator.eager_report() if self._accelerator is not None else None

    def step_cache_text(self) -> str | None:
        """What step caching did in the current routing (None: off)."""
        run = self._accelerator.step_cache if self._accelerator is not None else None
        return run.describe() if run is not None else None

    def cache_usage(self) -> Any:
        """The disk cache the current routing uses, against its limit (None: nothing in OpenVINO)."""
        accelerator = self._accelerator
        if accelerator is None or not accelerator.settings.accelerate:
            return None
        return accelerator.backends.cache_usage(accelerator.settings.backend_choice())

    def close(self) -> dict[str, float]:
        """Put the models back and drop them; returns the summed backend counters."""
        self._unroute()
        self._components = None
        self._checkpoint = None
        return self._ended_stats
