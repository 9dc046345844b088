"""The real WebUI under measurement: the real-host tier's harness plus what a benchmark reads off it.

:class:`BenchWebUI` wraps ``tests.real_webui.webui.WebUI`` (install the extension as a user does, start,
stop, HTTP) and adds: a chosen startup checkpoint (the full-size SD 1.5 files of the test bed, linked
into the isolated data folder), a timed generation that follows A1111's own progress
(``/sdapi/v1/progress``) to get seconds per sampling step, the resident memory of the WebUI's Python
process from ``/proc``, and the size of the extension's disk cache. :class:`BenchForge` is the same on the Forge
tier's driver (``tests.real_forge.forge.Forge``). :func:`write_kohya_lora` writes a random rank-4 LoRA for the
layer names of any SD 1.x or SDXL checkpoint file.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ov_backend.memory import system_memory
from tests.real_forge.forge import SECTION_NAME, Forge
from tests.real_webui.webui import WebUI

logger = logging.getLogger(__name__)

GIB = float(1 << 30)
#: How often A1111's progress is read during a generation (seconds).
POLL_SECONDS = 0.2


@dataclass
class Timed:
    """One generation: wall time of the request and, from A1111's progress, seconds per sampling step."""

    seconds: float
    steps: int
    s_per_it: float | None
    """Mean time of the sampling steps after the second (compile-free once a shape is compiled) from A1111's
    progress; when it showed fewer than two step ends (steps faster than the polling), the request's
    seconds / steps (an upper bound: it includes the text encoder, the VAE and any compile)."""
    from_progress: bool
    images: int
    infotext: str
    picture: Any = None
    timeline: list[tuple[float, float, str]] = field(default_factory=list)
    """(seconds into the request, the WebUI's RSS in GiB, A1111's progress text then), every poll: where in
    a request its memory peaks."""
    """The first image (an RGB array), to compare with stock's for the same request."""


class BenchWebUI(WebUI):
    """A test-bed WebUI started on a given checkpoint, with timing, memory and cache readings."""

    def __init__(self, testbed: Path, data_dir: Path, log_dir: Path, checkpoint: str) -> None:
        super().__init__(testbed, data_dir, log_dir)
        self.checkpoint = checkpoint
        #: during the last timed request: the WebUI's largest VmHWM, the machine's least available GiB
        self.peak_seen: float = 0.0
        self.least_available: float | None = None
        #: the WebUI process's peak RSS (VmHWM, GiB) before each reset of it: with :meth:`memory`'s peak, the
        #: peak of its whole life
        self.life_peak: float = 0.0

    def start(self, timeout: float = 900) -> None:
        self.life_peak = 0.0
        super().start(timeout)

    def link_checkpoints(self, files: list[Path]) -> None:
        """Make checkpoint files of the test bed visible in the isolated data folder (symlinks, no copy)."""
        folder = self.data_dir / "models" / "Stable-diffusion"
        folder.mkdir(parents=True, exist_ok=True)
        for source in files:
            if not source.is_file():
                raise FileNotFoundError(f"{source} is missing: build the test bed's full-size models first")
            target = folder / source.name
            if not target.exists():
                target.symlink_to(source.resolve())

    # --- measurements ------------------------------------------------------------------------------
    def timed_generate(self, payload: dict[str, Any]) -> Timed:
        """Run a txt2img request while reading A1111's progress.

        A1111 sets ``state.sampling_step = i`` after step ``i`` (0-based) ends, so value ``k >= 1`` first
        appears when step ``k + 1`` has ended; the steps between the first and the last value seen are
        timed. Values from before the job began (``job_count == 0``) are ignored.
        """
        seen: dict[int, float] = {}
        timeline: list[tuple[float, float, str]] = []
        began = time.time()
        done = threading.Event()
        self.peak_seen, self.least_available = 0.0, None

        def poll() -> None:
            while not done.wait(POLL_SECONDS):
                self._watch_memory()
                try:
                    state = self.get("/sdapi/v1/progress?skip_current_image=true", timeout=30)["state"]
                except (AssertionError, OSError, KeyError, ValueError):
                    continue
                timeline.append((round(time.time() - began, 1), round(self.memory()["rss"], 2),
                                 f"{state.get('textinfo') or ''} step {state.get('sampling_step', 0)}"[:100]))
                step = int(state.get("sampling_step", 0))
                if state.get("job_count", 0) != 0 and step >= 1 and step not in seen:
                    seen[step] = time.time()

        thread = threading.Thread(target=poll, daemon=True)
        thread.start()
        try:
            result = self.generate(payload)
        finally:
            done.set()
            thread.join()
        steps = int(payload["steps"])
        usable = sorted(k for k in seen if k <= steps - 1)
        from_progress = len(usable) >= 2 and usable[-1] > usable[0]
        if from_progress:
            s_per_it = (seen[usable[-1]] - seen[usable[0]]) / (usable[-1] - usable[0])
        else:
            s_per_it = result.seconds / steps
        return Timed(result.seconds, steps, s_per_it, from_progress, len(result.images),
                     (result.infotexts or [""])[0], result.images[0] if result.images else None, timeline)

    def _watch_memory(self) -> None:
        """The WebUI's peak RSS and the machine's least available memory seen during the request: what is
        known of a request whose WebUI the kernel ends for want of memory."""
        self.peak_seen = max(self.peak_seen, self.memory()["peak"])
        memory = system_memory()
        if memory is not None:
            available = memory.available / GIB
            self.least_available = available if self.least_available is None else min(self.least_available,
                                                                                       available)

    def memory(self) -> dict[str, float]:
        """Resident memory of the WebUI's Python process (the largest one in its session), in GiB:
        ``rss`` now (VmRSS) and ``peak`` since it started (VmHWM)."""
        best = {"rss": 0.0, "peak": 0.0}
        if self.process is None:
            return best
        for pid in _session_pids(self.process.pid):
            fields = _status_fields(pid, ("VmRSS", "VmHWM"))
            if fields.get("VmHWM", 0) > best["peak"] * GIB:
                best = {"rss": fields.get("VmRSS", 0) / GIB, "peak": fields["VmHWM"] / GIB}
        return best

    def switch_checkpoint(self, name: str) -> float:
        """Load checkpoint ``name`` through ``/sdapi/v1/options`` (A1111 loads it before answering); seconds."""
        t0 = time.time()
        self.call("/sdapi/v1/options", {"sd_model_checkpoint": name})
        return time.time() - t0

    def reset_peak(self) -> bool:
        """Start the WebUI's peak RSS (VmHWM) again from its RSS now (``/proc/<pid>/clear_refs``), so the
        peak after a request is that request's own, not the checkpoint load's or an earlier request's.
        False where the kernel does not allow it (the peak then stays the process's)."""
        if self.process is None:
            return False
        self.life_peak = max(self.life_peak, self.memory()["peak"])
        done = False
        for pid in _session_pids(self.process.pid):
            try:
                Path(f"/proc/{pid}/clear_refs").write_text("5")
                done = True
            except OSError:
                return False
        return done

    def tree_memory(self) -> dict[str, float]:
        """Resident memory of the WebUI's process tree (its session), in GiB: ``rss_gib``, VmRSS summed over its
        processes, and ``peak_gib``, the largest VmHWM among them (the WebUI's Python process)."""
        rss = peak = 0.0
        if self.process is not None:
            for pid in _session_pids(self.process.pid):
                fields = _status_fields(pid, ("VmRSS", "VmHWM"))
                rss += fields.get("VmRSS", 0) / GIB
                peak = max(peak, fields.get("VmHWM", 0) / GIB)
        return {"rss_gib": rss, "peak_gib": peak}

    def cache_dir(self) -> Path:
        """The extension's default disk cache: ``openvino_cache`` under the WebUI's models folder."""
        return self.data_dir / "models" / "openvino_cache"

    def cache_size(self) -> tuple[int, int]:
        """(bytes on disk, files) of the extension's disk cache."""
        total = files = 0
        for path in self.cache_dir().rglob("*"):
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_blocks * 512
                files += 1
        return total, files


class BenchForge(BenchWebUI, Forge):
    """Forge (API only) with the same readings. Forge loads its checkpoint at the first generation, where A1111 loads
    it at its start: :meth:`start` ends with an untimed tiny generation, so that, as on A1111, no measured request
    pays the checkpoint load."""

    def start(self, timeout: float = 900) -> None:
        super().start(timeout)
        t0 = time.time()
        payload = {"prompt": "an untimed request that loads the checkpoint", "seed": 1, "steps": 1, "width": 64,
                   "height": 64, "sampler_name": "Euler", "batch_size": 1, "n_iter": 1, "save_images": False,
                   "send_images": False}
        # stock (with *Enable for every generation* on, the load still writes the weight file)
        payload["alwayson_scripts"] = {SECTION_NAME: {"args": [False]}}
        try:
            self.generate(payload)
        except OSError as exc:  # the connection dropped: Forge was killed as it loaded (e.g. under a memory limit)
            code = self.process.wait(timeout=30) if self.process is not None else None
            raise RuntimeError(f"the WebUI exited with {code}: killed while it loaded {self.checkpoint} ({exc})") \
                from exc
        logger.info("Forge loaded %s at its first generation in %.1f s", self.checkpoint, time.time() - t0)


class Sampler:
    """The WebUI's memory read from ``/proc`` every ``interval`` seconds on a thread of its own, from :meth:`start`
    until :meth:`stop`, summed over its process session: the peaks of its anonymous memory (``RssAnon``: what only
    swap can take from it) and of its resident memory (``VmRSS``, file pages included), and its largest ``VmHWM``."""

    def __init__(self, ui: WebUI, interval: float = 0.1) -> None:
        self.ui, self.interval = ui, interval
        self.anon_peak = self.rss_peak = self.hwm_peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def reading(self) -> dict[str, int]:
        """``RssAnon`` and ``VmRSS`` summed, ``VmHWM`` the largest, in bytes, now (the peaks follow).

        Raises:
            ProcessLookupError: the WebUI has ended (killed for want of memory, under a limit).
        """
        process = self.ui.process
        pids = _session_pids(process.pid) if process is not None else []
        now = {"RssAnon": 0, "VmRSS": 0, "VmHWM": 0}
        found = False
        for pid in pids:
            fields = _status_fields(pid, ("RssAnon", "VmRSS", "VmHWM"))
            found = found or "RssAnon" in fields  # (gone, or a zombie: no memory fields)
            for key in ("RssAnon", "VmRSS"):
                now[key] += fields.get(key, 0)
            now["VmHWM"] = max(now["VmHWM"], fields.get("VmHWM", 0))
        if not found:
            raise ProcessLookupError("the WebUI process has ended")
        self.anon_peak = max(self.anon_peak, now["RssAnon"])
        self.rss_peak = max(self.rss_peak, now["VmRSS"])
        self.hwm_peak = max(self.hwm_peak, now["VmHWM"])
        return now

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            try:
                self.reading()
            except ProcessLookupError:  # ended: whoever waits on it says so
                return

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # state ppid pgrp session ...
        if int(fields[3]) == sid:
            pids.append(int(entry.name))
    return pids


def _status_fields(pid: int, names: tuple[str, ...]) -> dict[str, int]:
    """Fields of ``/proc/<pid>/status`` in bytes."""
    out: dict[str, int] = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in names:
            out[key] = int(value.split()[0]) * 1024
    return out


def write_kohya_lora(checkpoint: Path, target: Path, rank: int = 4, seed: int = 7) -> int:
    """A random rank-``rank`` LoRA in kohya's format for the attention projections of an SD 1.x checkpoint
    (UNet ``to_q/to_k/to_v/to_out.0``, CLIP ``q/k/v/out_proj``) or of an SDXL one's UNet (its keys share SD 1.x's
    prefix; A1111 finds them by ``lora_unet`` -> ``diffusion_model``), named as A1111's Lora extension looks
    them up; each layer's change is a fraction of its weight's spread. Returns the number of layers."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    unet, te = "model.diffusion_model.", "cond_stage_model.transformer."
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(checkpoint), framework="pt") as f:
        for key in sorted(f.keys()):
            name = key.removesuffix(".weight")
            last = name.split(".")[-1]
            if key.startswith(unet) and (last in ("to_q", "to_k", "to_v") or name.endswith("to_out.0")):
                lora = "lora_unet_" + name[len(unet):].replace(".", "_")
            elif key.startswith(te) and last in ("q_proj", "k_proj", "v_proj", "out_proj"):
                lora = "lora_te_" + name[len(te):].replace(".", "_")
            else:
                continue
            weight = f.get_tensor(key).float()
            out_features, in_features = weight.shape
            tensors[f"{lora}.lora_down.weight"] = torch.randn(rank, in_features, generator=gen) / in_features**0.5
            tensors[f"{lora}.lora_up.weight"] = torch.randn(out_features, rank, generator=gen) * (
                0.6 * float(weight.std()))
            tensors[f"{lora}.alpha"] = torch.tensor(float(rank))
    if not tensors:
        raise ValueError(f"{checkpoint} has no SD 1.x or SDXL UNet attention layers for a LoRA")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".part")
    save_file(tensors, str(partial))
    os.replace(partial, target)
    return len(tensors) // 3
