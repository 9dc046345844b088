"""HTTP routes the extension adds to the WebUI's API (``--api``): the honest status of the last run.

API users get images and infotexts from ``/sdapi/v1/txt2img`` but not the comment under the images,
where the panel shows what ran in OpenVINO. ``GET /openvino-accelerate/v1/status`` returns the same
report as JSON: the text of the panel's "Last run", and its numbers (calls per routed part, OpenVINO
and PyTorch calls, compiles, compile and run seconds, cache hits, what fell back and why), and
``compiled_models``, the compiled OpenVINO models the extension holds in memory at the time of the request, and
``weights_in_file_now``: PyTorch's weights in the weight file then (``bytes``; ``resident_bytes`` of them in memory).
"""

from __future__ import annotations

import logging
from typing import Any

from .extension import Extension

logger = logging.getLogger(__name__)

STATUS_PATH = "/openvino-accelerate/v1/status"


def add_routes(app: Any, extension: Extension) -> None:
    """Add the extension's routes to the WebUI's FastAPI ``app`` (from the ``app_started`` callback)."""

    def status() -> dict[str, Any]:
        return extension.last_run_report()

    app.add_api_route(STATUS_PATH, status, methods=["GET"])
    logger.debug("added %s", STATUS_PATH)
