"""What one ``python -m bench soak`` run sends: its validated settings and the seeded stream of requests.

The stream is a pure function of the settings (:func:`requests`): the same seed gives the same requests, so a
run that found something can be run again. It opens with a warm-up block that sees every size of the pool,
img2img, the LoRA, the second checkpoint, a Prompts-from-file job and an X/Y/Z grid once; after it, requests
are drawn from the same mix, with an Interrupt and two clients at once early on, and now and then a size never
seen before (``new_size_every``): what a user generating for hours sends, and what would show a compiled model
kept per new size.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.real_webui.webui import testbed_ready, testbed_root

logger = logging.getLogger(__name__)

MODELS = ("sd15", "tiny")
KINDS = ("txt2img", "img2img", "prompts", "xyz", "interrupt", "pair")
#: How the extension is turned on for a request: the dropdown entry's ``script_args``, or the always-on section
ROUTES = ("script", "section")
PRECISIONS = ("f32", "auto", "int8", "int8-weights")
TINY_SIZES = ((64, 64), (96, 64), (64, 96))
SD15_SIZES = ((512, 512), (512, 384), (384, 512))
#: After the warm-up: the share of each kind of request (a checkpoint switch is drawn apart, see SWITCH_SHARE)
MIX = (("txt2img", 0.46), ("img2img", 0.22), ("prompts", 0.08), ("xyz", 0.08), ("pair", 0.1), ("interrupt", 0.06))
#: After the warm-up: the share of requests sent to the second checkpoint (the next one switches back)
SWITCH_SHARE = 0.08
LORA_WEIGHTS = (None, 1.0, 0.5)
SUBJECTS = ("a lighthouse on a cliff", "a red fox in the snow", "a teapot on a table", "a city street at night",
            "a sailing boat at dawn", "a mountain lake", "an old library", "a field of sunflowers")
STYLES = ("oil painting", "photograph", "watercolor", "(golden hour:1.2)", "ink drawing", "[soft light]")


@dataclass(frozen=True)
class SoakSettings:
    """One soak run (defaults block = the field defaults)."""

    model: str = "sd15"
    """"sd15": the test bed's two full-size SD 1.5 checkpoints; "tiny": the real-host tier's tiny models."""
    requests: int = 0
    """Stop after this many requests of the stream (0: only the time budget stops it; both 0: 40)."""
    minutes: float = 0.0
    """Start no request after this many minutes from the first one (0: no time budget)."""
    seed: int = 1
    """Seed of the stream (the requests and their image seeds)."""
    sizes: tuple[tuple[int, int], ...] = SD15_SIZES
    """(width, height) pool: the warm-up sees each once, the stream repeats them."""
    new_size_every: int = 8
    """After the warm-up, every this many requests uses a size never seen before (0: never)."""
    size_step: int = 64
    """A new size is a pool size grown or shrunk on one side by a multiple of this many pixels (64: the sizes users
    pick, whose latent halves evenly through the UNet; 8: any size, see docs/benchmarks.md on the UNet's captures)."""
    steps: int = 4
    """Sampling steps of a request (an Interrupt's request takes three times as many)."""
    precision: str = "f32"
    """The extension's precision ("f32": the pictures must match stock's at 40 dB)."""
    sample_every: int = 4
    """Compare every this many requests (and the first of each kind) with stock for the same request and seed."""
    stock: bool = False
    """Every request with the extension off: stock A1111's own curve for the same stream (no picture compared; the
    status fields stay empty), to tell the WebUI's own growth from the extension's."""
    stock_baseline: bool = False
    """Before the run, the same stream with the extension off in a WebUI of its own: stock's RSS curve, and the bound
    on the extension's growth beyond stock's (``rss_beyond_stock``)."""
    previous_weights: str = ""
    """Settings -> OpenVINO's choice for the previous checkpoint's or LoRA's compiled models ("auto", "keep",
    "release"), set before the first request; empty: the WebUI's (default auto)."""
    testbed: Path = Path()
    """The test bed's root (``A1111_ROOT``)."""
    out: Path = Path("bench/results")
    """Folder of the JSON, markdown and PNG results."""
    name: str = ""
    """File name stem; empty: ``soak-<model>-<date>``."""
    work_dir: Path | None = None
    """The WebUI's data folder and logs; None: a temporary folder, removed at the end."""
    min_available_gib: float = 10.0
    """Refuse to start with less memory available (full-size SD 1.5 in this WebUI takes about 7 GiB)."""


def build_settings(options: dict[str, Any], check_testbed: bool = True) -> SoakSettings:
    """Validated settings from a dict; unknown keys and bad values raise ``ValueError`` naming them."""
    known = {f.name for f in dataclasses.fields(SoakSettings)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    values = {k: v for k, v in options.items() if v is not None}
    if values.get("model") == "tiny":
        values.setdefault("sizes", TINY_SIZES)
        values.setdefault("min_available_gib", 0.0)
    if not values.get("requests") and not values.get("minutes"):
        values["requests"] = 40
    values["testbed"] = Path(values.get("testbed") or testbed_root()).absolute()
    config = SoakSettings(**values)
    if config.model not in MODELS:
        raise ValueError(f"model must be {' or '.join(MODELS)}, got {config.model!r}")
    if config.requests < 0 or config.minutes < 0:
        raise ValueError(f"requests and minutes must not be negative, got {config.requests} and {config.minutes}")
    if not config.sizes or any(w % 8 or h % 8 or w <= 0 or h <= 0 for w, h in config.sizes):
        raise ValueError(f"sizes: WxH with positive multiples of 8, got {config.sizes}")
    if len(set(config.sizes)) != len(config.sizes):
        raise ValueError(f"sizes: each size once, got {config.sizes}")
    if config.steps < 2:
        raise ValueError(f"steps must be at least 2, got {config.steps}")
    if config.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {config.precision!r}")
    if config.size_step <= 0 or config.size_step % 8:
        raise ValueError(f"size_step must be a positive multiple of 8, got {config.size_step}")
    if config.new_size_every < 0 or config.sample_every < 1:
        raise ValueError("new_size_every must be >= 0 and sample_every >= 1, got "
                         f"{config.new_size_every} and {config.sample_every}")
    if config.previous_weights not in ("", "auto", "keep", "release"):
        raise ValueError(f"previous_weights must be auto, keep or release, got {config.previous_weights!r}")
    if check_testbed and not testbed_ready(config.testbed):
        raise ValueError(f"no WebUI test bed in {config.testbed}: build it (bash .ci/testbed) or set A1111_ROOT")
    return config


@dataclass(frozen=True)
class Request:
    """One request of the stream (a pair's second client is its ``partner``)."""

    index: int
    kind: str
    width: int
    height: int
    prompt: str
    seed: int
    steps: int
    batch_size: int = 1
    n_iter: int = 1
    lora: float | None = None
    """The LoRA's weight in the prompt; None: no LoRA."""
    checkpoint: int = 0
    """0: the first checkpoint, 1: the second."""
    route: str = "script"
    warmup: bool = False
    new_size: bool = False
    """Its size was never seen before in the run."""
    sample: bool = False
    """Compared with stock for the same request and seed."""
    lines: int = 0
    """Prompts from file: how many prompts the job has."""
    cells: int = 0
    """X/Y/Z: how many cells (values of the X axis)."""
    partner: Request | None = field(default=None, compare=False)

    @property
    def expected_images(self) -> int:
        """What A1111 returns for the request when nothing stops it (``save_images`` off: no grid of a batch).
        X/Y/Z returns its grid first, then each cell's first image; a pair counts both clients'."""
        if self.kind == "xyz":
            return self.cells + 1
        own = self.batch_size * self.n_iter * (self.lines if self.kind == "prompts" else 1)
        return own + (self.partner.expected_images if self.partner is not None else 0)

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"


def fresh_sizes(pool: tuple[tuple[int, int], ...], rng: random.Random, step_px: int) -> Iterator[tuple[int, int]]:
    """Sizes not in ``pool``, each once: the pool's sizes grown or shrunk on one side by 1 to 4 ``step``s (up to 8
    when ``step`` is under 64) pixels."""
    seen = set(pool)
    most = 4 if step_px >= 64 else 8
    while True:
        w, h = rng.choice(pool)
        step = step_px * rng.randint(1, most) * rng.choice((-1, 1))
        size = (w + step, h) if rng.random() < 0.5 else (w, h + step)
        if min(size) >= 64 and size not in seen:
            seen.add(size)
            yield size


def requests(config: SoakSettings) -> Iterator[Request]:
    """The stream: the warm-up block, then requests drawn from :data:`MIX` for ever (the runner stops it)."""
    rng = random.Random(config.seed)
    new_sizes = fresh_sizes(config.sizes, rng, config.size_step)
    index = 0
    seen_kinds: set[str] = set()

    def make(kind: str, size: tuple[int, int], warmup: bool = False, new_size: bool = False,
             **kwargs: Any) -> Request:
        nonlocal index
        index += 1
        prompt = f"{rng.choice(SUBJECTS)}, {rng.choice(STYLES)}, take {index}"
        sample = kind not in ("pair", "interrupt") and (kind not in seen_kinds or index % config.sample_every == 0)
        seen_kinds.add(kind)
        steps = config.steps * 3 if kind == "interrupt" else config.steps
        return Request(index, kind, size[0], size[1], prompt, rng.randrange(1, 2**31), steps, warmup=warmup,
                       new_size=new_size, sample=sample, **kwargs)

    first = config.sizes[0]
    # warm-up: every size, part and model once
    for i, size in enumerate(config.sizes):
        yield make("txt2img", size, warmup=True, route=ROUTES[i % 2])
    yield make("img2img", first, warmup=True)
    yield make("txt2img", first, warmup=True, lora=1.0, route="section")
    yield make("txt2img", first, warmup=True, checkpoint=1)
    yield make("txt2img", first, warmup=True)
    yield make("prompts", first, warmup=True, route="section", lines=3)
    yield make("xyz", first, warmup=True, route="section", cells=2)
    lora: float | None = None
    stream = 0
    forced = {2: "interrupt", 4: "pair"}  # early, so that a short run has them too
    forced_lora = {6: 0.5, 9: None}  # the LoRA at another weight, then off
    while True:
        stream += 1
        new_size = config.new_size_every > 0 and stream % config.new_size_every == 0
        size = next(new_sizes) if new_size else rng.choice(config.sizes)
        if rng.random() < 0.25:
            lora = rng.choice(LORA_WEIGHTS)
        lora = forced_lora.get(stream, lora)
        kind = forced.get(stream) or rng.choices([k for k, _ in MIX], [w for _, w in MIX])[0]
        checkpoint = 1 if kind in ("txt2img", "img2img") and rng.random() < SWITCH_SHARE else 0
        route = rng.choice(ROUTES)
        if kind in ("prompts", "xyz"):
            yield make(kind, size, new_size=new_size, route="section", lora=lora,
                       lines=rng.randint(2, 3) if kind == "prompts" else 0, cells=2 if kind == "xyz" else 0)
        elif kind == "interrupt":
            yield make(kind, size, new_size=new_size, route=route, lora=lora, n_iter=3)
        elif kind == "pair":
            pair = make("pair", size, new_size=new_size, route=route, lora=lora, batch_size=rng.randint(1, 2))
            other = make("txt2img", rng.choice(config.sizes), route=rng.choice(ROUTES), lora=lora,
                         batch_size=rng.randint(1, 2))
            yield dataclasses.replace(pair, partner=other)
        else:
            batch, n_iter = rng.randint(1, 4), rng.randint(1, 2)
            yield make(kind, size, new_size=new_size, route=route, lora=lora, batch_size=batch, n_iter=n_iter,
                       checkpoint=checkpoint)
            if checkpoint:  # and back
                yield make(kind, rng.choice(config.sizes), route=route, lora=lora)
