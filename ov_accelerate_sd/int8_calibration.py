"""INT8's first-batch calibration for the command line's renders: which batch calibrates each UNet graph.

At precision "int8" ov_backend runs a UNet graph at float until its INT8 model exists, recording the calls its
owner lets it record (``OVBackend.watch_int8``), and quantizes on them. The policy here: **each graph is calibrated
on the job's first batch that runs it, on that batch alone**, in the job's order (a setup's lines in the file's
order), whichever process renders the batch and wherever a resumed run starts, so an INT8 picture never depends on
how the job was split or stopped. Then the batch that recorded renders again, so every INT8 image comes from the
INT8 model.

How the stop works, all in this module: :meth:`FirstBatchCalibration.watch` sees each UNet call's graph; a graph
whose calibrating batch is another one is not recorded, its key is noted in the run's :class:`_Run`, and the run's
stop callback, which the pipeline polls after each step, ends the batch (``Interrupted``); :meth:`render` then
samples that other batch first (its steps only, no image) and comes back.

Batches of one *class* (:meth:`FirstBatchCalibration._class_of`) run the same graphs; a class not seen
yet is learnt by sampling one of its batches once (no image). The WebUI's policy differs (its docs say why): a
generation records its own steps and the UNet is quantized at its end; it is not rendered again, the WebUI's user
sees the next generation at INT8.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

StepCallback = Callable[[int, int], None] | None
StopCallback = Callable[[], bool] | None


@dataclass
class _Run:
    """One sampling of a batch under the watch."""

    allowed: set[str] | None
    """The INT8 models its float calls record for; None: none, and none is asked for."""
    seen: set[str] = field(default_factory=set)
    recorded: bool = False
    needs: str | None = None
    """A model another batch must calibrate first (the run stops after the step that met it)."""
    sampled: bool = False


class FirstBatchCalibration:
    """The first-batch policy of one routing (a checkpoint at INT8): made when the routing is, dropped with it.

    Args:
        order: the job's batches in order, as tasks (``line``, ``seed``, ``batch``), every one, rendered or not.
        sample: ``sample(task, on_step, should_stop)`` renders a task with the routing, its images (raises the
            pipeline's ``Interrupted`` when ``should_stop`` says so).
        chunks: ``chunks(prompt, negative_prompt, clip_skip)``: the text encoder's chunks of 75 tokens a prompt
            (its LoRA tags taken out) takes with its negative prompt.
        quantize: quantize what was recorded; returns the reports of what was made since the last call.
        say: a line for the user.
    """

    def __init__(self, order: tuple[Any, ...], sample: Callable[[Any, StepCallback, StopCallback], list[Any]],
                 chunks: Callable[[str, str, int], int], quantize: Callable[[], list[str]],
                 say: Callable[[str], None]) -> None:
        self._order = order
        self._sample = sample
        self._chunks = chunks
        self._quantize = quantize
        self._say = say
        self._run: _Run | None = None
        #: a class of batches (:meth:`_class_of`) -> the INT8 models (cache keys) its UNet calls run or calibrate
        self._graphs: dict[tuple, frozenset[str]] = {}
        #: a line's number -> its class
        self._classes: dict[int, tuple] = {}

    def watch(self, key: str, quantized: bool) -> bool:
        """The UNet backend's INT8 watch: whether a float call of the model ``key`` is recorded."""
        run = self._run
        if run is None:
            return True  # outside a render (none here): as the backend does by default
        run.seen.add(key)
        if quantized or run.allowed is None:
            return False
        if key not in run.allowed:
            run.needs = run.needs or key
            return False
        run.recorded = True
        return True

    def render(self, task: Any, on_step: StepCallback, should_stop: StopCallback) -> list[Any]:
        """``task``'s images, every one from the INT8 models (calibrating what it is the first batch of)."""
        images, recorded = self._calibrated(task, on_step, should_stop)
        self._quantized("the batch renders again at INT8")
        if recorded:
            # the batch ran (part of) the UNet at float while it was recorded: rendered again, every INT8 image comes
            # from the INT8 model, whether it was calibrated in this run, in another process or read from the cache
            images, _ = self._calibrated(task, on_step, should_stop)
        return images

    def _calibrated(self, task: Any, on_step: StepCallback, should_stop: StopCallback,
                    sampling_only: bool = False) -> tuple[list[Any], bool]:
        """``task`` rendered (``sampling_only``: up to its last step, no image), each graph it runs without an INT8
        model calibrated first on the job's first batch that runs it. Returns the images and whether calls were
        recorded."""
        allowed: set[str] = set()
        sampled: set[str] = set()
        while True:
            images, run = self._once(task, allowed, on_step, should_stop, sampling_only)
            if run.needs is None:
                return images, run.recorded
            key = run.needs
            if key in sampled:  # the batch sampled for it did not run it: the classes missed a difference
                logger.warning("INT8: the batch sampled to calibrate a UNet graph line %d runs did not run it; "
                               "line %d calibrates it", task.line.number, task.line.number)
                allowed.add(key)
                continue
            first = self._first_batch_of(key, task, should_stop)
            if first is None:
                allowed.add(key)
                continue
            sampled.add(key)
            self._say(f"INT8: line {first.line.number} (batch {first.batch + 1}) is the job's first batch to run a "
                      f"UNet graph line {task.line.number} runs: its steps are sampled here to calibrate it, "
                      "no image saved")
            self._calibrated(first, None, should_stop, sampling_only=True)
            self._quantized("")

    def _once(self, task: Any, allowed: set[str] | None, on_step: StepCallback, should_stop: StopCallback,
              sampling_only: bool) -> tuple[list[Any], _Run]:
        """One sampling of ``task`` under the watch; the graphs it ran are kept as its class's (a run that went
        through every step, or to its last with ``sampling_only``)."""
        from .pipeline import Interrupted

        run = self._run = _Run(allowed)

        def step(done: int, total: int) -> None:
            run.sampled = done >= total
            if on_step is not None:
                on_step(done, total)

        def asked() -> bool:
            return should_stop is not None and should_stop()

        def stop() -> bool:
            return run.needs is not None or (sampling_only and run.sampled) or asked()

        try:
            images = self._sample(task, step, stop)
        except Interrupted:
            if asked() or (run.needs is None and not (sampling_only and run.sampled)):
                raise
            images = []
        finally:
            self._run = None
        if run.needs is None:
            self._graphs[self._class_of(task)] = frozenset(run.seen)
        return images, run

    def _first_batch_of(self, key: str, task: Any, should_stop: StopCallback) -> Any | None:
        """The job's first batch (in its order) whose UNet runs the INT8 model ``key``, when it is not ``task``
        (None: ``task`` is). The graphs of a class of batches before ``task``'s first are learnt by sampling one of
        them (no image saved), once."""
        from .pipeline import Interrupted

        mine = self._class_of(task)
        for candidate in self._order:
            if candidate.line.setup != task.line.setup:
                continue
            if candidate.line.number == task.line.number and candidate.batch == task.batch:
                return None
            kind = self._class_of(candidate)
            if kind == mine:
                return candidate
            if kind not in self._graphs:
                self._say(f"INT8: line {candidate.line.number}'s steps are sampled once, no image saved, to learn "
                          "which UNet graphs it runs (the job's first batch of a graph calibrates it)")
                try:
                    self._once(candidate, None, None, should_stop, sampling_only=True)
                except Interrupted:
                    raise
                except Exception as exc:  # the line cannot render (a LoRA not found...): it calibrates nothing
                    logger.info("INT8: line %d cannot render (%s); it runs no UNet graph", candidate.line.number, exc)
                    self._graphs[kind] = frozenset()
            if key in self._graphs[kind]:
                return candidate
        return None

    def _class_of(self, task: Any) -> tuple:
        """What decides which UNet graphs a batch runs, and the weights they run with: batches of one class run the
        same INT8 models. Finer than the graphs is safe (it costs a sampling to learn a class's graphs); coarser
        would not be (the LoRAs, the size and batch size, the sampler, img2img, the prompt's chunks of 75 tokens)."""
        from .lora import parse_prompt_loras

        line = task.line
        known = self._classes.get(line.number)
        if known is not None:
            return known
        try:
            text, refs = parse_prompt_loras(line.prompt)
            made: tuple = (line.setup, tuple(sorted(map(repr, refs))), line.width, line.height, line.batch_size,
                           line.sampler, bool(line.init_image), self._chunks(text, line.negative_prompt,
                                                                             line.clip_skip))
        except Exception:  # a line whose prompt does not parse: a class of its own
            made = ("line", line.number)
        self._classes[line.number] = made
        return made

    def _quantized(self, then: str) -> None:
        """Quantize every UNet graph that recorded calls in the run just made and say what was made (with ``then``).
        A graph is so calibrated on its first batch alone, whatever follows it: with a batch of fewer calls than
        ``calibration_samples`` it would otherwise go on recording into the next batch of its shape, and the
        pictures of that batch would depend on where a run started."""
        made = self._quantize()
        if made:
            self._say("INT8: " + "; ".join(made) + (f"; {then}" if then else ""))
