"""A stand-in for ov_backend's API (eager graphs, same surface), used only when the tests are run with
``OV_WEBUI_TESTS_BACKEND=standin`` while the real backend is unfinished. The default is the real one."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ov_accelerate_webui.backend_bridge import BackendApi


@dataclasses.dataclass(frozen=True)
class StandinSettings:
    device: str = "CPU"
    model_caching: bool = False
    cache_dir: Path = Path("cache")
    config: tuple[tuple[str, str], ...] = ()


def build_settings(options: dict[str, Any]) -> StandinSettings:
    unknown = set(options) - {f.name for f in dataclasses.fields(StandinSettings)}
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)}")
    if options.get("device", "CPU") not in ("CPU", "AUTO"):
        raise ValueError(f"unknown device {options['device']!r}; available: ['CPU']")
    return StandinSettings(
        device=options.get("device", "CPU"),
        model_caching=bool(options.get("model_caching")),
        cache_dir=Path(options.get("cache_dir", "cache")),
        config=tuple(sorted(dict(options.get("config", {})).items())),
    )


@dataclasses.dataclass
class Report:
    device: str
    fallback_ops: dict[str, str]
    cache_hit: bool = False
    convert_seconds: float = 0.0
    compile_seconds: float = 0.0

    def summary(self) -> str:
        return f"graph on {self.device}: stand-in"


class StandinBackend:
    def __init__(self, settings: StandinSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self.reports: list[Report] = []
        self._stats = {"compile_seconds": 0.0, "run_seconds": 0.0, "ov_calls": 0, "eager_calls": 0, "cache_hits": 0}

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        with self._lock:
            self.reports.append(Report(device=self.settings.device, fallback_ops={}))

        def run(*args: Any) -> Any:
            start = time.perf_counter()
            out = gm.forward(*args)
            with self._lock:
                self._stats["ov_calls"] += 1
                self._stats["run_seconds"] += time.perf_counter() - start
            return out

        return run

    def stats(self) -> dict[str, float]:
        with self._lock:
            return dict(self._stats)

    def reset(self) -> None:
        with self._lock:
            self.reports.clear()


class StandinCache:
    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def entries(self) -> list[Any]:
        return [p for p in self.root.glob("*") if p.is_file()] if self.root.is_dir() else []

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.entries())

    def clear(self, keys: Any = None) -> list[str]:
        removed = [p.name for p in self.entries()]
        for p in self.entries():
            p.unlink()
        return removed


def standin_api() -> BackendApi:
    return BackendApi(
        build_settings=build_settings,
        backend_class=StandinBackend,
        list_devices=lambda: [("CPU", "Stand-in CPU")],
        model_cache=StandinCache,
    )
