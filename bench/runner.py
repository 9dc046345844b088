"""The coordinator: starts the workers, interleaves the rounds, collects the numbers.

For each component: the parent builds the random weights and example inputs once (files the
workers map), then for each group of variants (one precision at a time for full-size
models, eager in every group) it starts the workers one after the other (so cold
conversions do not compete with each other), runs the rounds with the variants interleaved
(the order rotates each round), collects the outputs and peak RSS, stops the workers, and
measures the warm-cache first call of each cacheable variant in a fresh process.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bench import models, variants
from bench.image import ImageTask, image_main
from bench.settings import BenchSettings
from bench.worker import ResolutionsTask, Worker, WorkerError, WorkerTask, resolutions_main, variant_main

logger = logging.getLogger(__name__)


def _groups(settings: BenchSettings) -> list[list[str]]:
    """The variants alive together, eager first in each group."""
    others = [v for v in settings.variants if v != "eager"]
    if not settings.group_by_precision:
        return [["eager", *others]]
    groups = []
    for precision in variants.PRECISIONS:
        if precision == "int8":
            continue  # int8 runs beside auto, its float counterpart: their ratio is measured interleaved
        members = [v for v in others
                   if (variants.parse_variant(v).precision == "int8" and precision == "auto")
                   or variants.parse_variant(v).precision == precision]
        if members:
            groups.append(["eager", *members])
    return groups or [["eager"]]


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = out.double(), ref.double()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))


class _ComponentRun:
    """The measurements of one component."""

    def __init__(self, settings: BenchSettings, name: str, work: Path) -> None:
        self.settings = settings
        self.name = name
        self.work = work
        self.weights = models.ensure_weights(name, settings.quick, work / "weights")
        inputs = models.example_inputs(name, settings.quick, settings.size)
        self.inputs_path = models.save_inputs(inputs, work / "inputs" / f"{name}-{settings.size}.pt")
        self.input_shapes = [list(t.shape) for t in inputs]
        # a kept work dir must not make the cold first call warm
        shutil.rmtree(work / "cache" / name, ignore_errors=True)
        self.results: dict[str, dict[str, Any]] = {v: {"times": [], "errors": []} for v in settings.variants}
        self.rounds_load: list[float] = []

    def _task(self, variant: str) -> WorkerTask:
        cache = self.work / "cache" / self.name / variant.replace("/", "-")
        return WorkerTask(self.name, variant, self.settings.quick, self.weights, self.inputs_path, cache,
                          caching=True, log_level=self.settings.log_level)

    def _start(self, variant: str, what: str) -> tuple[Worker | None, dict[str, Any] | None]:
        label = f"{self.name} {variant} ({what})"
        logger.info("%s: starting", label)
        worker = Worker(variant_main, self._task(variant), label)
        try:
            ready = worker.receive(self.settings.call_timeout)
        except WorkerError as err:
            logger.error("%s", err)
            self.results[variant]["errors"].append(f"{what}: {err}")
            worker.close(5)
            return None, None
        logger.info("%s: first call %.2f s", label, ready["first_call_seconds"])
        return worker, ready

    def _stop(self, variant: str, worker: Worker) -> None:
        record = self.results[variant]
        try:
            path = self.work / "outputs" / f"{self.name}-{variant.replace('/', '-')}.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            record.update(worker.ask("output", str(path), self.settings.call_timeout))
            record["output_path"] = str(path)
            done = worker.ask("quit", None, self.settings.call_timeout)
            record["peak_rss_bytes"] = done["peak_rss_bytes"]
            record.setdefault("info", {}).update(done["info"])
        except WorkerError as err:
            logger.error("%s", err)
            record["errors"].append(str(err))
        worker.close()

    def _round(self, live: dict[str, Worker], round_index: int, group: str) -> None:
        order = list(live)
        shift = round_index % len(order)
        order = order[shift:] + order[:shift]
        self.rounds_load.append(os.getloadavg()[0])
        for variant in order:
            try:
                seconds, cpu = live[variant].ask("run", None, self.settings.call_timeout)
            except WorkerError as err:
                logger.error("%s", err)
                self.results[variant]["errors"].append(str(err))
                continue
            self.results[variant]["times"].append(seconds)
            self.results[variant].setdefault("cpu_times", []).append(cpu)
            self.results[variant].setdefault("times_by_group", {}).setdefault(group, []).append(seconds)
            logger.info("%s round %d %s: %.3f s (CPU %.3f s)", self.name, round_index + 1, variant, seconds, cpu)

    def _warm(self, variant: str) -> None:
        worker, ready = self._start(variant, "warm cache")
        if worker is None or ready is None:
            return
        record = self.results[variant]
        record["warm_first_call_seconds"] = ready["first_call_seconds"]
        if ready.get("first_call_split"):
            record["warm_first_call_split"] = ready["first_call_split"]
        try:
            done = worker.ask("quit", None, self.settings.call_timeout)
            record["warm_peak_rss_bytes"] = done["peak_rss_bytes"]
            record.setdefault("info", {})["warm"] = done["info"]
        except WorkerError as err:
            record["errors"].append(f"warm cache: {err}")
        worker.close()

    def run(self) -> dict[str, Any]:
        groups = _groups(self.settings)
        eager: Worker | None = None
        for number, group in enumerate(groups):
            label = "+".join(sorted({variants.parse_variant(v).precision for v in group if v != "eager"})) or "eager"
            live: dict[str, Worker] = {}
            for variant in group:
                if variant == "eager" and eager is not None:
                    live[variant] = eager
                    continue
                worker, ready = self._start(variant, "cold")
                if worker is None or ready is None:
                    continue
                live[variant] = worker
                record = self.results[variant]
                record.update(cold_first_call_seconds=ready["first_call_seconds"],
                              load_seconds=ready["load_seconds"], info=dict(ready["info"]),
                              resident_after_first_call=ready["resident_after_first_call"])
                if ready.get("first_call_split"):
                    record["cold_first_call_split"] = ready["first_call_split"]
                if variant == "eager":
                    eager = worker
            for round_index in range(self.settings.rounds):
                self._round(live, round_index, label)
            for variant, worker in live.items():
                if variant != "eager" or number == len(groups) - 1:
                    self._stop(variant, worker)
            if self.settings.warm:
                for variant in group:
                    if variants.parse_variant(variant).kind in variants.CACHEABLE:
                        self._warm(variant)
        self._compare()
        return {"description": models.component(self.name).description, "input_shapes": self.input_shapes,
                "groups": groups, "load_average_per_round": self.rounds_load, "variants": self.results}

    def _compare(self) -> None:
        ref_path = self.results.get("eager", {}).get("output_path")
        if ref_path is None:
            return
        ref = torch.load(ref_path, weights_only=True)
        for record in self.results.values():
            if "output_path" in record:
                record["rel_l2_vs_eager"] = rel_l2(torch.load(record["output_path"], weights_only=True), ref)


@contextmanager
def _work_dir(settings: BenchSettings):
    if settings.work_dir is not None:
        settings.work_dir.mkdir(parents=True, exist_ok=True)
        yield settings.work_dir
        return
    folder = Path(tempfile.mkdtemp(prefix="ov-bench-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_resolutions(settings: BenchSettings, work: Path) -> dict[str, Any]:
    """First-call time of each latent size through ov_backend (one process, caching off)."""
    name = "sdxl_unet" if "sdxl_unet" in settings.components and "unet" not in settings.components else "unet"
    weights = models.ensure_weights(name, settings.quick, work / "weights")
    task = ResolutionsTask(name, settings.quick, weights, settings.resolutions, "auto", work / "cache" / "resolutions",
                           settings.resolutions_dynamic, settings.log_level)
    worker = Worker(resolutions_main, task, f"{name} resolutions")
    try:
        result = worker.receive(settings.call_timeout * max(1, len(settings.resolutions)))
    except WorkerError as err:
        logger.error("%s", err)
        return {"component": name, "error": str(err)}
    finally:
        worker.close()
    return {"component": name, "precision": "auto", "dynamic": settings.resolutions_dynamic, **result}


def run_image(settings: BenchSettings, work: Path) -> dict[str, Any]:
    """The whole-image split through the standalone pipeline (one process)."""
    weights = {n: models.ensure_weights(n, settings.quick, work / "weights")
               for n in ("unet", "vae_decoder", "text_encoder")}
    task = ImageTask(settings.quick, weights, settings.image_steps, settings.size, settings.image_precision,
                     work / "cache" / "image", settings.log_level)
    worker = Worker(image_main, task, "whole image")
    try:
        return worker.receive(settings.call_timeout * 3)
    except WorkerError as err:
        logger.error("%s", err)
        return {"error": str(err)}
    finally:
        worker.close()


def run(settings: BenchSettings, sections: Sequence[str] = ("components", "resolutions", "image"),
        progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the raw results (see :mod:`bench.report` for the summary).

    Args:
        settings: what to measure.
        sections: any of "components", "resolutions", "image".
        progress: called with the results so far after each component and section (the CLI
            writes the files then, so a long run that fails late keeps what it measured).
    """
    start = time.perf_counter()
    results: dict[str, Any] = {"components": {}}

    def done() -> None:
        results["wall_seconds"] = time.perf_counter() - start
        if progress is not None:
            progress(results)

    with _work_dir(settings) as work:
        if "components" in sections:
            for name in settings.components:
                logger.info("component %s", name)
                results["components"][name] = _ComponentRun(settings, name, work).run()
                done()
        if "resolutions" in sections and settings.resolutions:
            results["resolutions"] = run_resolutions(settings, work)
            done()
        if "image" in sections and settings.image_steps:
            results["image"] = run_image(settings, work)
    done()
    return results
