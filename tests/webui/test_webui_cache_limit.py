"""Settings -> OpenVINO -> "Disk cache limit (GB)": the limit reaches the backend, a generation that stores a new
entry prunes the older ones but never those in use, and the panel, the status text and the status route give the
cache's size against the limit and what was pruned, as numbers."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from conftest import IMAGE_TOLERANCE, make_p, max_pixel_diff

from ov_accelerate_webui.options import CACHE_LIMIT_OPTION, read_options

#: about 1 KiB, as a user would type a tiny limit in GB: less than any entry
TINY_GB = 0.000001


def _old_entry(cache_dir: Path) -> None:
    """An entry of an earlier session, last used long ago."""
    import openvino as ov

    from ov_backend import ModelCache

    cache = ModelCache(cache_dir)
    param = ov.opset13.parameter([1, 4], ov.Type.f32)
    cache.store("from-an-earlier-session", ov.Model([ov.opset13.relu(param)], [param], "old"), "old model")
    os.utime(cache.models_dir / "from-an-earlier-session" / "meta.json", (1, 1))


class _App:
    """FastAPI's ``add_api_route``, as the WebUI's app has it: the route's function by path."""

    def __init__(self) -> None:
        self.routes: dict[str, Any] = {}

    def add_api_route(self, path: str, endpoint: Any, methods: list[str]) -> None:
        self.routes[path] = endpoint


def test_the_limit_reaches_the_backend_prunes_and_is_reported(fake_host: SimpleNamespace, extension: Any,
                                                              tmp_path: Path, caplog: Any) -> None:
    from ov_accelerate_webui.api import STATUS_PATH, add_routes
    from ov_accelerate_webui.settings import build_settings

    cache_dir = tmp_path / "own-cache"  # not the session's shared cache: this test prunes it
    _old_entry(cache_dir)
    settings = build_settings({"precision": "f32", "cache_dir": str(cache_dir)})
    setattr(fake_host.shared.opts, CACHE_LIMIT_OPTION, TINY_GB)
    limit = int(TINY_GB * (1 << 30))
    plain = fake_host.processing.process_images(make_p(fake_host))
    with caplog.at_level(logging.WARNING):
        processed = extension.run(make_p(fake_host), settings)
    assert max_pixel_diff(plain, processed) <= IMAGE_TOLERANCE  # the picture is made, and right
    backends = extension.accelerator().backends.all()
    assert backends and {b.settings.cache_max_bytes for b in backends} == {limit}
    assert not (cache_dir / "models" / "from-an-earlier-session").exists()
    from ov_backend import ModelCache

    on_disk = ModelCache(cache_dir).entries()
    assert on_disk  # the generation's own entries, in use: kept over the limit
    app = _App()
    add_routes(app, extension)
    report = app.routes[STATUS_PATH]()
    assert report["cache_limit_bytes"] == limit
    assert report["cache_bytes"] == sum(e.size_bytes for e in on_disk) > limit
    assert report["cache_in_use_bytes"] == report["cache_bytes"]
    assert report["cache_pruned"] >= 1 and report["cache_pruned_bytes"] > 0 and report["cache_prune_errors"] == 0
    assert all(isinstance(report[k], int) for k in ("cache_bytes", "cache_limit_bytes", "cache_pruned"))
    assert "Disk cache: removed" in extension.last_status and "of 1.0 KiB limit (over it:" in extension.last_status
    assert sum("over its limit" in r.getMessage() for r in caplog.records) == 1
    assert "of 1.0 KiB limit" in extension.cache_size_text(str(cache_dir))  # the panel's line

    # a second size: still one WARNING, and what the first generation pruned is not counted again
    with caplog.at_level(logging.WARNING):
        extension.run(make_p(fake_host, width=64, height=96), settings)
    assert sum("over its limit" in r.getMessage() for r in caplog.records) == 1
    assert app.routes[STATUS_PATH]()["cache_limit_bytes"] == limit

    # a new limit is the cache folder's, not a new backend's: the same backends, nothing compiled again, the
    # status under the new limit (0: none)
    before = extension.accelerator().backends.all()
    setattr(fake_host.shared.opts, CACHE_LIMIT_OPTION, 0)
    extension.run(make_p(fake_host, width=64, height=96), settings)
    report = app.routes[STATUS_PATH]()
    assert extension.accelerator().backends.all() == before
    assert report["compiles"] == 0 and report["cache_limit_bytes"] == 0, report["status"]


def test_default_no_limit_and_a_bad_value(fake_host: SimpleNamespace, caplog: Any) -> None:
    from ov_accelerate_webui import create_extension
    from ov_backend import DEFAULT_CACHE_MAX_BYTES

    create_extension().register_callbacks()
    fake_host.callbacks.ui_settings_callback()
    info = fake_host.shared.opts.data_labels[CACHE_LIMIT_OPTION]
    assert info.default == 20 and "Disk cache limit (GB)" in info.label and "0: no limit" in info.label
    assert info.section == ("openvino", "OpenVINO")
    assert read_options().cache_limit_bytes == DEFAULT_CACHE_MAX_BYTES == 20 << 30  # the option's default
    setattr(fake_host.shared.opts, CACHE_LIMIT_OPTION, 0)
    assert read_options().cache_limit_bytes == 0
    setattr(fake_host.shared.opts, CACHE_LIMIT_OPTION, 2.5)
    assert read_options().cache_limit_bytes == 5 << 29
    setattr(fake_host.shared.opts, CACHE_LIMIT_OPTION, -3)
    with caplog.at_level(logging.WARNING):
        assert read_options().cache_limit_bytes is None  # the backend's default
    assert any("disk cache limit must be a number of GB >= 0" in r.getMessage() and "default limit" in r.getMessage()
               for r in caplog.records)


def test_no_limit_reports_zero_and_prunes_nothing(fake_host: SimpleNamespace, extension: Any, tmp_path: Path) -> None:
    from ov_accelerate_webui.settings import build_settings

    cache_dir = tmp_path / "own-cache"
    _old_entry(cache_dir)
    setattr(fake_host.shared.opts, CACHE_LIMIT_OPTION, 0)
    extension.run(make_p(fake_host), build_settings({"precision": "f32", "cache_dir": str(cache_dir)}))
    report = extension.last_run_report()
    assert report["cache_limit_bytes"] == 0 and report["cache_pruned"] == 0 and report["cache_bytes"] > 0
    assert (cache_dir / "models" / "from-an-earlier-session").is_dir()
    assert "(no limit)" in extension.cache_size_text(str(cache_dir))
