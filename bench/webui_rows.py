"""What one ``python -m bench webui`` run measures: the scenario's requests (:data:`ROWS`) and the validated
settings."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ov_backend.settings import PREVIOUS_WEIGHTS
from tests.real_forge.forge import forge_testbed_ready, forge_testbed_root
from tests.real_webui.webui import testbed_ready, testbed_root

logger = logging.getLogger(__name__)

FULL_CHECKPOINTS = ("sd15-random.safetensors", "sd15-random-b.safetensors")
#: the bench's full-size SDXL base checkpoint (made by bench/make_sdxl.py into the test bed on first use)
SDXL_CHECKPOINT = "sdxl-random.safetensors"
#: ``python -m bench session``'s second SDXL checkpoint (its switch) and its SDXL LoRA (UNet attention layers)
SDXL_CHECKPOINT_B = "sdxl-random-b.safetensors"
SDXL_LORA = "bench-lora-sdxl"
MODELS = ("sd15", "sdxl")
#: rows that need a second checkpoint or a LoRA, which the bench makes for SD 1.5 only
NOT_SDXL = ("switch", "switch_back", "lora", "lora_change")
FULL_LORA = "bench-lora-sd15"
TINY_LORA = "ovtest-lora"  # written by tests/real_webui/make_models.py
PRECISION_KEYS = ("auto", "f32", "int8", "int8-weights")
#: The WebUIs the bench drives: A1111 v1.10.1 (``A1111_ROOT``) and Forge main at dfdcbab6 (``FORGE_ROOT``)
WEBUIS = ("a1111", "forge")
#: rows Forge does not run: the second checkpoint and the LoRA (the bench makes them in A1111's bed only), A1111's
#: Token merging, the Prompts-from-file job (its always-on section's arguments are A1111's) and step caching (which
#: refuses Forge's UNet: every step would run full)
NOT_FORGE = ("switch", "switch_back", "lora", "lora_change", "fallback", "prompts_file", "cache2_first", "cache2",
             "cache3", "cache4")


class Row(NamedTuple):
    """One request of the scenario."""

    key: str
    label: str
    size: int
    """Index into the settings' sizes."""
    batch: bool
    """At the settings' batch size (else 1)."""
    checkpoint: int
    """0: the first checkpoint, 1: the second."""
    lora: float | None
    """The LoRA's weight in the prompt; None: no LoRA."""
    long_prompt: bool = False
    """A prompt of two 75-token chunks: A1111 runs the UNet at a batch of 1 for the prompt and for the
    negative prompt apart (their conditionings differ in length)."""
    prompts_job: int = 0
    """A job of this many prompts through A1111's "Prompts from file or textbox" script (one
    ``process_images`` call each), accelerated by the always-on section; 0: a plain request through the
    dropdown entry."""
    step_cache: int = 1
    """The accelerated request's step caching interval (1: off). Stock has no step caching and does not run
    a row with it: its picture is the reference row's."""
    token_merging: float = 0.0
    """A1111's Token merging ratio for the request (0: off). With it on, the extension runs the UNet in PyTorch
    (a fallback, said in the status): with PyTorch's weights in the file, they are read back from it."""
    reference: str = ""
    """The row whose prompt (so A1111's conditioning) and stock picture this one shares; empty: its own."""


ROWS: tuple[Row, ...] = (
    Row("first", "first generation", 0, False, 0, None),
    Row("again", "same size again", 0, False, 0, None),
    Row("batch", "batch size {batch}", 0, True, 0, None),
    Row("size2", "second size {size}", 1, False, 0, None),
    Row("size3", "third size {size}", 2, False, 0, None),
    Row("back", "back to {size}", 0, False, 0, None),
    Row("long", "long prompt (UNet at batch 1)", 0, False, 0, None, long_prompt=True),
    Row("switch", "checkpoint switch", 0, False, 1, None),
    Row("switch_back", "switch back", 0, False, 0, None),
    Row("lora", "LoRA added (weight 1)", 0, False, 0, 1.0),
    Row("lora_change", "LoRA weight 1 -> 0.5", 0, False, 0, 0.5),
    Row("fallback", "Token merging 0.5: the UNet in PyTorch (a fallback)", 0, False, 0, None, token_merging=0.5),
    Row("prompts_file", "Prompts from file: a job of 4 prompts (section)", 0, False, 0, None, prompts_job=4),
    # step caching: the first request builds its two models; the others measure it warm, against "again"
    Row("cache2_first", "step caching every 2 steps, first (builds its models)", 0, False, 0, None,
        step_cache=2, reference="again"),
    Row("cache2", "step caching every 2 steps", 0, False, 0, None, step_cache=2, reference="again"),
    Row("cache3", "step caching every 3 steps", 0, False, 0, None, step_cache=3, reference="again"),
    Row("cache4", "step caching every 4 steps", 0, False, 0, None, step_cache=4, reference="again"),
)
#: A laptop user's session (``python -m bench session``): the first generation, a second size, a LoRA on and off, a
#: checkpoint switch and back.
_BY_KEY = {row.key: row for row in ROWS}
SESSION_ROWS: tuple[Row, ...] = (
    _BY_KEY["first"], _BY_KEY["size2"], _BY_KEY["lora"],
    Row("lora_off", "LoRA removed", 0, False, 0, None, reference="first"),
    _BY_KEY["switch"], _BY_KEY["switch_back"],
)
#: The always-on section's title (its name in ``alwayson_scripts``).
SECTION_TITLE = "OpenVINO"
PROMPTS_SCRIPT = "prompts from file or textbox"
RESTART = Row("restart", "first generation after a restart (warm cache)", 0, False, 0, None, reference="first")


@dataclass(frozen=True)
class WebUIBenchSettings:
    """What one run measures (defaults block = the field defaults)."""

    webui: str = "a1111"
    """The WebUI measured: "a1111" (the A1111 test bed) or "forge" (the Forge test bed, ``FORGE_ROOT``: its full-size
    SD 1.5 is the A1111 bed's, linked; the rows of :data:`NOT_FORGE` are left out)."""
    tiny: bool = False
    """The real-host tier's tiny models (minutes) instead of the full-size SD 1.5 checkpoints (Forge: its tier's
    SD 1.5 checkpoint, full-size CLIP and VAE with a small UNet)."""
    model: str = "sd15"
    """The full-size model: "sd15" (the test bed's two SD 1.5 checkpoints) or "sdxl" (one SDXL base checkpoint:
    no checkpoint switch, no LoRA rows)."""
    precisions: tuple[str, ...] = ("auto",)
    """Accelerated runs, in order: "auto" (what users run), "f32" and/or "int8" (the INT8 UNet: its first
    generation, a checkpoint switch and each LoRA change calibrate and quantize)."""
    steps: int = 4
    """Sampling steps per request (Euler); at least 3 for a seconds-per-step reading."""
    sizes: tuple[tuple[int, int], ...] = ((512, 512), (512, 384), (384, 512))
    """(width, height): the first size, a second and a third."""
    batch: int = 4
    """The batch size of the "batch" row."""
    rows: tuple[str, ...] = ()
    """The requests to measure, by key (e.g. ``("first", "again")``; "restart" for the restart phase), in the
    scenario's order, stock and each precision; empty: all of them (with model sdxl: all it can take).
    :func:`build_settings` adds the rows a chosen one is compared with (its ``reference``)."""
    testbed: Path = Path()
    """The test bed's root (``A1111_ROOT``; Forge: ``FORGE_ROOT``)."""
    out: Path = Path("bench/results")
    """Folder of the JSON and markdown results."""
    name: str = ""
    """File name stem of the results; empty: ``webui-<date>`` (``webui-tiny-<date>`` with ``tiny``)."""
    work_dir: Path | None = None
    """The WebUI's data folder and logs; None: a temporary folder, removed at the end."""
    min_available_gib: float = 18.0
    """Refuse to start with less memory available (the accelerated WebUI reached 14-19 GB)."""
    previous_weights: str = ""
    """The extension's setting for the compiled models of the weights used before a change ("auto", "keep",
    "release"), set before the accelerated requests; empty: the WebUI's (default "auto")."""
    accelerated_only: bool = False
    """No stock requests: the process's peak RSS is then the accelerated requests' own (see ``--accelerated-only``)."""
    weights_in_file: str = ""
    """The extension's setting for PyTorch's copy of the accelerated weights ("on": in a memory-mapped file, "off":
    in memory beside OpenVINO's), set before the first accelerated request; empty: the WebUI's (default on)."""
    enable_always: bool = False
    """Settings -> OpenVINO -> "Enable for every generation" on from the WebUI's start (written into the data folder's
    config before it): its checkpoint loads move the weights into the file as they load. Needs ``accelerated_only``
    (the section would accelerate stock's requests)."""
    session: bool = False
    """``python -m bench session``'s settings: a WebUI started afresh per run of :data:`SESSION_ROWS` (with model
    sdxl, a second SDXL checkpoint and an SDXL LoRA are made for it)."""


TINY_SIZES = ((64, 64), (96, 64), (64, 96))
SDXL_SIZES = ((1024, 1024), (1024, 768), (768, 1024))


def build_settings(options: dict[str, Any]) -> WebUIBenchSettings:
    """Validated settings from a dict; unknown keys and bad values raise ``ValueError`` naming them."""
    known = {f.name for f in dataclasses.fields(WebUIBenchSettings)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    values = {k: v for k, v in options.items() if v is not None}
    if values.get("tiny"):
        values.setdefault("sizes", TINY_SIZES)
        values.setdefault("min_available_gib", 0.0)
    if values.get("model") == "sdxl":
        values.setdefault("sizes", SDXL_SIZES)
    forge = values.get("webui") == "forge"
    # absolute: the WebUI runs in its own folder, where a path relative to here names nothing
    values["testbed"] = Path(values.get("testbed") or (forge_testbed_root() if forge else testbed_root())).absolute()
    config = WebUIBenchSettings(**values)
    if config.webui not in WEBUIS:
        raise ValueError(f"webui must be {' or '.join(WEBUIS)}, got {config.webui!r}")
    bad = [p for p in config.precisions if p not in PRECISION_KEYS]
    if bad or not config.precisions:
        raise ValueError(f"precisions must be among {', '.join(PRECISION_KEYS)}, got {bad or 'none'}")
    if config.steps < (1 if config.session else 3):  # (the session reads no seconds per step)
        raise ValueError(f"steps must be at least 3 (seconds per step are read from steps 3 on), got {config.steps}")
    if len(config.sizes) != 3 or any(w % 8 or h % 8 or w <= 0 or h <= 0 for w, h in config.sizes):
        raise ValueError(f"sizes: three WxH with multiples of 8, got {config.sizes}")
    keys = [row.key for row in (*ROWS, RESTART)]
    unknown_rows = [key for key in config.rows if key not in keys]
    if unknown_rows:
        raise ValueError(f"rows: unknown request(s) {', '.join(unknown_rows)}; known: {', '.join(keys)}")
    if config.model not in MODELS or config.model == "sdxl" and config.tiny:
        raise ValueError(f"model must be {' or '.join(MODELS)} (and sd15 with tiny), got {config.model!r}")
    if config.model == "sdxl" and not config.session:  # one checkpoint, no LoRA made for it
        alone = [row.key for row in (*ROWS, RESTART) if row.key not in NOT_SDXL]
        if any(key not in alone for key in config.rows):
            raise ValueError(f"rows: with model sdxl only {', '.join(alone)} (one checkpoint and no LoRA), "
                             f"got {', '.join(config.rows)}")
    if forge:
        if config.session and config.model != "sdxl":
            raise ValueError("webui forge runs the session with model sdxl only")
        alone = [row.key for row in (*ROWS, RESTART) if row.key not in NOT_FORGE]
        if not config.session and any(key not in alone for key in config.rows):
            raise ValueError(f"rows: with webui forge only {', '.join(alone)}, got {', '.join(config.rows)}")
        config = dataclasses.replace(config, rows=config.rows or (() if config.session else tuple(alone)))
    elif config.model == "sdxl" and not config.session:
        alone = [row.key for row in (*ROWS, RESTART) if row.key not in NOT_SDXL]
        config = dataclasses.replace(config, rows=config.rows or tuple(alone))
    if config.rows:  # with the rows they are measured against, in the scenario's order
        wanted = set(config.rows) | {row.reference for row in (*ROWS, RESTART) if row.key in config.rows}
        config = dataclasses.replace(config, rows=tuple(key for key in keys if key in wanted))
    if config.previous_weights and config.previous_weights not in PREVIOUS_WEIGHTS:
        raise ValueError(f"previous_weights must be {' or '.join(PREVIOUS_WEIGHTS)}, got {config.previous_weights!r}")
    if config.weights_in_file not in ("", "on", "off"):
        raise ValueError(f"weights_in_file must be on or off, got {config.weights_in_file!r}")
    if config.enable_always and not config.accelerated_only and not config.session:
        raise ValueError("enable_always needs accelerated_only: with the section enabled for every generation, "
                         "stock's requests would be accelerated too")
    if config.batch < 2:
        raise ValueError(f"batch must be at least 2, got {config.batch}")
    if not (forge_testbed_ready if forge else testbed_ready)(Path(config.testbed)):
        raise ValueError(f"no {'Forge' if forge else 'WebUI'} test bed in {config.testbed}: build it "
                         f"(bash .ci/testbed) or set {'FORGE_ROOT' if forge else 'A1111_ROOT'}")
    return config


def parse_size(text: str) -> tuple[int, int]:
    width, sep, height = text.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit():
        raise argparse.ArgumentTypeError(f"a size is WIDTHxHEIGHT (e.g. 512x768), got {text!r}")
    return int(width), int(height)
