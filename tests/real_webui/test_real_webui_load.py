"""A checkpoint load while acceleration is in use, in the real WebUI: the weights of the routed parts go from the
checkpoint file straight into the weight file, and A1111's f32 model of them is never in memory.

On the bed's full-size random SD 1.5 (``sd15-random.safetensors``, float16 on disk: 4.3 GB at f32), linked into the
session WebUI's models. The WebUI process's anonymous memory (``RssAnon`` in ``/proc/<pid>/status``: what the kernel
can only swap, apart from file pages it can drop) is sampled every few milliseconds during each load: A1111's own
load is the control, and shows the measure sees the f32 model appear. The pictures of a stock generation after either
load are the same bit for bit.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from .controlnet import CONTROLNET_CHECKPOINT
from .test_real_webui import request
from .webui import CHECKPOINT_A, WebUI

#: Growth of the WebUI's anonymous memory during an accelerated load, as a share of the checkpoint's weights at f32:
#: what is not routed (the text encoder's token and position embeddings, A1111's buffers) and the interpreter's own.
#: Measured 0.04 (0.16 GiB) on an AMD EPYC Zen 4; A1111's own load 1.02 (its f32 model, 4.05 GiB).
FILLED_MAX_SHARE = 0.25
logger = logging.getLogger(__name__)
STOCK_MIN_SHARE = 0.9


def f32_bytes(checkpoint: Path) -> int:
    """Bytes of a safetensors checkpoint's floating-point tensors at f32 (from its header)."""
    with open(checkpoint, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
    return sum(4 * int(np.prod(v["shape"])) for k, v in header.items()
               if k != "__metadata__" and v["dtype"] in ("F16", "BF16", "F32"))


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no RssAnon in /proc/{pid}/status")


def load_growth(webui: WebUI, checkpoint: str) -> int:
    """Switch to ``checkpoint`` through the options (as the dropdown does); returns the highest anonymous memory of
    the WebUI process during the load less that just before it."""
    assert webui.process is not None
    pid = webui.process.pid
    before = rss_anon(pid)
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon(pid))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        webui.call("/sdapi/v1/options", {"sd_model_checkpoint": checkpoint})
    finally:
        done.set()
        sampler.join()
    return max(peak[0], rss_anon(pid)) - before


@pytest.fixture
def full_size(webui: WebUI) -> Iterator[Path]:
    source = webui.testbed / "webui" / "models" / "Stable-diffusion" / CONTROLNET_CHECKPOINT
    if not source.is_file():
        pytest.fail(f"the test bed has no {source}: run `bash .ci/testbed`")
    target = webui.data_dir / "models" / "Stable-diffusion" / CONTROLNET_CHECKPOINT
    if not target.exists():
        target.symlink_to(source)
    webui.call("/sdapi/v1/refresh-checkpoints", {})
    try:
        yield source
    finally:
        webui.call("/sdapi/v1/options", {"sd_model_checkpoint": CHECKPOINT_A, "openvino_enable_always": False,
                                         "openvino_weights_in_file": True})


def test_an_accelerated_load_writes_the_weights_into_the_file_and_never_holds_the_f32_model(
        webui: WebUI, full_size: Path) -> None:
    f32 = f32_bytes(full_size)
    payload = request("a lighthouse on a cliff", width=64, height=64, steps=1)

    # A1111's own load (weights in a file off: acceleration takes no part in it), then a stock picture
    webui.call("/sdapi/v1/options", {"openvino_weights_in_file": False, "openvino_enable_always": False})
    stock_growth = load_growth(webui, CONTROLNET_CHECKPOINT)
    stock = webui.generate(payload)
    webui.call("/sdapi/v1/options", {"sd_model_checkpoint": CHECKPOINT_A})

    # the same load with acceleration in use ("Enable for every generation"), then the same stock picture
    webui.call("/sdapi/v1/options", {"openvino_weights_in_file": True, "openvino_enable_always": True})
    filled_growth = load_growth(webui, CONTROLNET_CHECKPOINT)
    mapped, _resident = webui.weight_file_pages()
    webui.call("/sdapi/v1/options", {"openvino_enable_always": False})
    after = webui.generate(payload)

    shares = f"A1111's load {stock_growth / f32:.2f}, accelerated {filled_growth / f32:.2f} of {f32 / 2**30:.2f} GiB"
    logger.info("anonymous memory growth during the load: %s", shares)
    assert stock_growth > STOCK_MIN_SHARE * f32, shares  # the measure sees A1111's f32 model appear
    assert filled_growth < FILLED_MAX_SHARE * f32, shares
    assert mapped > 0.9 * f32, (mapped, f32)  # the UNet, VAE and text encoder (all but the embeddings) are in the file
    in_file = webui.status()["weights_in_file_now"]["bytes"]  # the extension's own count of the same
    assert in_file > 0.9 * f32, (in_file, f32)
    assert len(after.images) == len(stock.images) == 1
    assert np.array_equal(after.images[0], stock.images[0])  # the same weights, bit for bit
