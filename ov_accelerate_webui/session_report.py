"""What a :class:`.session.RoutingSession` reports of its routes: calls, runs in PyTorch and why, f32 switches.

Routes of models switched to during the generation are named with the model's short name ("sd_xl_refiner_1.0:
model.diffusion_model"); a module object routed twice is counted under its first name.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from .finite_guard import F32Switch

logger = logging.getLogger(__name__)

#: Why a UNet route in place ran no sampling step.
BYPASSED = ("sampling steps ran but none called the routed forward, and nothing replaced it: something (another "
            "extension) called the model's own forward directly")

#: Why a UNet run block by block is not step cached.
BLOCKS_UNCACHED = "another extension's forward ran its blocks one by one, which step caching does not split"


def reached(entry: Any) -> int:
    """Calls that reached the routed method: through OpenVINO, or in PyTorch by its own choice (Token merging)."""
    return entry.calls + entry.pytorch_calls


class SessionReport:
    """The report half of a routing session (its state is :class:`.session.RoutingSession`'s)."""

    _lock: threading.RLock
    accelerator: Any
    runs: list[Any]
    run_names: list[str]
    _blocks: dict[tuple[int, str], tuple[Any, str, Any]]
    _block_runs: list[Any]
    _foreign: dict[tuple[int, str], list[Any]]
    _bypassed: dict[tuple[int, str], list[Any]]
    _control_pytorch: dict[str, list[Any]]

    def calls(self) -> dict[str, int]:
        """Route label -> calls during the session; routes of models switched to are prefixed by their name."""
        result: dict[str, int] = {}
        seen: set[int] = set()
        with self._lock:
            for run, name in zip(self.runs, self.run_names):
                for entry, before in zip(run.entries, run.calls_before):
                    if id(entry) in seen:  # the same module object, counted under its first name
                        continue
                    seen.add(id(entry))
                    key = f"{name}: {entry.label}" if name else entry.label
                    result[key] = result.get(key, 0) + entry.calls - before + self._calls_by_blocks(entry)
        return result

    def _calls_by_blocks(self, unet: Any) -> int:
        """The UNet evaluations of ``unet``'s route that ran through its blocks (each calls the first input
        block once)."""
        for blocks, _who, entry in self._blocks.values():
            if entry is unet:
                first = next(i for i, e in enumerate(blocks.entries) if e.label.endswith(".input_blocks.0"))
                return blocks.entries[first].calls - blocks.calls_before[first]
        return 0

    def f32(self) -> dict[str, tuple[F32Switch, bool]]:
        """Route label (named as in :meth:`calls`) -> (why it ran at f32 at automatic precision, whether it
        switched during the session); only such routes."""
        result: dict[str, tuple[F32Switch, bool]] = {}
        seen: set[str] = set()
        with self._lock:
            for run, name in zip(self.runs, self.run_names):
                for label, switch in self.accelerator.f32_since(run).items():
                    key = f"{name}: {label}" if name else label
                    if key not in seen:
                        seen.add(key)
                        result[key] = switch
            for blocks in self._block_runs:
                result.update(self.accelerator.f32_since(blocks))
        return result

    def eager(self) -> dict[str, tuple[int, str]]:
        """Route label (named as in :meth:`calls`) -> (calls dynamo ran in plain PyTorch, why); only routes
        that had such calls."""
        result: dict[str, tuple[int, str]] = {}
        seen: set[int] = set()
        with self._lock:
            for run, name in zip(self.runs, self.run_names):
                for entry, before in zip(run.entries, run.eager_before):
                    if id(entry) in seen:
                        continue
                    seen.add(id(entry))
                    if entry.eager_calls > before:
                        key = f"{name}: {entry.label}" if name else entry.label
                        result[key] = (entry.eager_calls - before, entry.eager_reason)
            for blocks in self._block_runs:
                for entry, before in zip(blocks.entries, blocks.eager_before):
                    if entry.eager_calls > before:
                        result[entry.label] = (entry.eager_calls - before, entry.eager_reason)
        return result

    def step_cache_off(self) -> dict[str, str]:
        """Route label -> why step caching could not split its module (it ran uncached)."""
        off = {e.label: e.step_cache_off for run in self.runs for e in run.entries if e.step_cache_off}
        return {**off, **{entry.label: BLOCKS_UNCACHED for _b, _who, entry in self._blocks.values()}}

    def pytorch(self) -> dict[str, tuple[int, str]]:
        """Route label (named as in :meth:`calls`) -> (calls run in PyTorch, why); only routes that had such
        calls: on the module's own method (Token merging), or through another extension's replacement of the
        routed method that never called the accelerated one (counted in sampling steps)."""
        result: dict[str, tuple[int, str]] = {}
        seen: set[int] = set()
        with self._lock:
            for run, name in zip(self.runs, self.run_names):
                for route, entry, before in zip(run.routes, run.entries, run.pytorch_before):
                    if id(entry) in seen:
                        continue
                    seen.add(id(entry))
                    key = f"{name}: {entry.label}" if name else entry.label
                    if entry.pytorch_calls > before:
                        result[key] = (entry.pytorch_calls - before, entry.pytorch_reason)
                    replaced = self._foreign.get((id(route.module), route.method))
                    if replaced is not None and reached(entry) == replaced[1]:
                        result[key] = (replaced[2], replaced[0] + " (calls counted in sampling steps)")
                    bypassed = self._bypassed.get((id(route.module), route.method))
                    if bypassed is not None and bypassed[2] and reached(entry) == bypassed[0]:
                        result[key] = (bypassed[1], BYPASSED + " (calls counted in sampling steps)")
            for name, (steps, why) in self._control_pytorch.items():
                result[name] = (steps, why + " (calls counted in sampling steps)")
        return result
