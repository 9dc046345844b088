"""Command line: ``python -m ov_backend generate|batch|devices|cache|demo``.

An entry point with no logic of its own beyond arguments and output: it validates the
arguments (argparse message and exit code 2 on anything wrong, before any model is loaded),
loads the checkpoint, routes it through ov_backend, renders the jobs, saves PNGs with the
WebUI's infotext, and prints progress and a summary. The first Ctrl-C stops after the current
sampler step (exit code 130), keeping the images already saved; a second one aborts.

Each sub-command's parser carries its handler (``set_defaults``), so an error names that
sub-command's usage. Parsing imports neither torch nor OpenVINO: ``--help`` and argument
errors answer at once, and the handlers import what they need.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from pathlib import Path
from typing import Any

from ov_backend.cache_limit import DEFAULT_CACHE_MAX_BYTES
from ov_backend.files import format_bytes
from ov_backend.precision import DEFAULT_PRECISION, PRECISIONS

from .console import out
from .jobs import option
from .parts import PARTS

logger = logging.getLogger(__name__)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.I)


def _count(text: str) -> int:
    """A count of workers or CPUs: a whole number, at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _workers(text: str) -> str:
    if text.strip().lower() == "auto":
        return "auto"
    return str(_count(text))


def parse_size(text: str) -> int:
    """"2G", "500M", "1.5GB", "1024" -> bytes (powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 500M, 2G)")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * 1024 ** " KMGT".index(unit or " "))


def _add_render_options(gen: argparse.ArgumentParser, out_default: Path | None) -> None:
    """The options ``generate`` and ``batch`` share (for ``batch``, each is the default of a job line's field)."""
    gen.add_argument("--vae", type=Path, help="separate VAE file replacing the checkpoint's")
    gen.add_argument("--negative-prompt", default="", help="what to steer away from (WebUI syntax; default: none)")
    gen.add_argument("--steps", type=option("steps"), default=None, help="sampling steps (default 20; demo 8)")
    gen.add_argument("--cfg-scale", type=option("cfg_scale", float), default=7.0,
                     help="classifier-free guidance scale, >= 0, as in the WebUI: "
                          "uncond + cfg * (cond - uncond); 0: negative prompt only, 1: prompt only (default 7)")
    gen.add_argument("--sampler", default="Euler a", help="WebUI sampler name, e.g. 'DPM++ 2M Karras' "
                     "(default 'Euler a')")
    gen.add_argument("--width", type=option("width"), default=None, help="multiple of 8 (default 512; demo 128)")
    gen.add_argument("--height", type=option("height"), default=None, help="multiple of 8 (default 512; demo 128)")
    gen.add_argument("--seed", type=option("seed"), default=-1, help="-1: random; image i of a job gets seed + i")
    gen.add_argument("--batch-size", type=option("batch_size"), default=1,
                     help="images rendered together in one batch (default 1)")
    gen.add_argument("--batch-count", type=option("batch_count"), default=1,
                     help="batches rendered one after the other for each prompt (default 1)")
    gen.add_argument("--init-image", type=Path, help="img2img: start from this image")
    gen.add_argument("--denoising-strength", type=option("denoising_strength", float), default=0.75,
                     help="img2img: how much of the init image is redrawn, in (0, 1] (default 0.75)")
    gen.add_argument("--clip-skip", type=option("clip_skip"), default=1,
                     help="stop the text encoder this many layers before its last, as the WebUI's "
                          "'Clip skip' (default 1: the last layer)")
    gen.add_argument("--lora-dir", action="append", type=Path, default=[], metavar="DIR",
                     help="folder of the LoRA files <lora:name:weight> in a prompt names, searched with its subfolders "
                          "(repeatable; default: the WebUI's models/Lora beside the checkpoint, when it is in one)")
    gen.add_argument("--device", default="CPU", help="OpenVINO device (see the devices command)")
    gen.add_argument("--precision", choices=PRECISIONS, default=DEFAULT_PRECISION,
                     help="auto: the plugin chooses (bf16 on CPUs that have it); f32: force f32; int8: the "
                          "UNet quantized with NNCF (needs nncf), calibrated on the first batch's steps, which run "
                          "at auto; the VAE and text encoder stay at auto; int8-weights: the UNet's and text "
                          "encoder's weights compressed to 8 bits (least memory), computing at auto")
    gen.add_argument("--cache-dir", type=Path, help="compiled-model cache (default: per-user cache folder)")
    gen.add_argument("--no-cache", action="store_true", help="do not read or write the compiled-model cache")
    gen.add_argument("--cache-max-size", type=parse_size, default=DEFAULT_CACHE_MAX_BYTES, metavar="SIZE",
                     help="after each store, prune the compiled-model cache to this size, least recently used first, "
                          "never what this run uses (e.g. 2G, 500M; 0: no limit; default "
                          f"{format_bytes(DEFAULT_CACHE_MAX_BYTES)})")
    gen.add_argument("--pytorch", action="append", choices=PARTS, default=[], metavar="PART",
                     help=f"leave this part in PyTorch (repeatable; one of {', '.join(PARTS)})")
    gen.add_argument("--step-cache", type=option("step_cache"), default=1, metavar="N",
                     help="step caching (DeepCache): the full UNet every N sampler steps, only its shallow blocks on "
                          "the steps between (faster; the picture differs a little: docs/step-cache.md). "
                          "Default 1: off")
    gen.add_argument("--step-cache-depth", type=option("step_cache_depth"), default=2, metavar="D",
                     help="input blocks (and as many output blocks) a shallow step runs (default 2)")
    gen.add_argument("--step-cache-start", type=option("step_cache_start"), default=2, metavar="K",
                     help="sampler steps at the start that always run the full UNet (default 2)")
    gen.add_argument("--step-cache-end", type=option("step_cache_end"), default=1, metavar="K",
                     help="sampler steps at the end that always run the full UNet (default 1)")
    if out_default is not None:
        gen.add_argument("--out", type=Path, default=out_default,
                         help="folder for the PNGs, created if missing (default: outputs, in the current folder)")
    else:
        gen.add_argument("--out", type=Path, required=True,
                         help="folder for the PNGs and the job's manifest.jsonl, created if missing; the same "
                              "command with the same folder resumes the job")



def build_parser() -> argparse.ArgumentParser:
    """The argument parser of all commands; each sub-command sets ``handler`` and ``command_parser``."""
    parser = argparse.ArgumentParser(
        prog="python -m ov_backend", description="Stable Diffusion through OpenVINO, from WebUI checkpoints."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log compile reports and details")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{generate,batch,devices,cache,demo}")

    gen = commands.add_parser("generate", help="render images from a WebUI .safetensors checkpoint",
                              description="Render images from a WebUI checkpoint, with the WebUI's conventions.")
    gen.set_defaults(handler=_generate, command_parser=gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path, help="WebUI checkpoint (.safetensors, or .ckpt)")
    source.add_argument("--demo", action="store_true",
                        help="build (once) a tiny SD-1.5-shaped model with random weights and use it")
    prompt = gen.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="the prompt (WebUI syntax: (word:1.2), [word], BREAK)")
    prompt.add_argument("--prompts-file", type=Path, help="one prompt per line; each line is one job")
    _add_render_options(gen, Path("outputs"))

    batch = commands.add_parser(
        "batch", help="render a job file (JSONL or a prompts file) into a folder, resumable",
        description="Render every line of a job file into --out, with the WebUI's infotext in each PNG. Running the "
                    "same command again resumes: finished images are kept, the rest rendered with the same seeds. "
                    "Each option below is the default of the job line field of the same name (docs/batch.md).")
    batch.set_defaults(handler=_batch, command_parser=batch)
    jobs = batch.add_mutually_exclusive_group(required=True)
    jobs.add_argument("jobs", nargs="?", type=Path, metavar="JOBS",
                      help="a .jsonl job file: one JSON object a line with any of the fields prompt, negative_prompt, "
                           "seed, width, height, steps, sampler, cfg_scale, batch_size, batch_count, checkpoint, "
                           "precision, step_cache, init_image, denoising_strength, clip_skip")
    jobs.add_argument("--prompts-file", type=Path, help="one prompt a line; each line is one job")
    model = batch.add_mutually_exclusive_group()
    model.add_argument("--checkpoint", type=Path, help="WebUI checkpoint of the lines that name none")
    model.add_argument("--demo", action="store_true",
                       help="the lines that name no checkpoint use the demo model (the default without --checkpoint)")
    batch.add_argument("--prompt", help="the prompt of the lines that give none")
    batch.add_argument("--skip-bad", action="store_true",
                       help="list the bad lines and render the others (default: a bad line stops the job before it "
                            "renders anything)")
    batch.add_argument("--workers", type=_workers, default=None, metavar="N",
                       help="render N batches at once in N processes, each on its share of the cores (refused when "
                            "N would not fit in memory, saying what would); auto: chosen from the cores and the "
                            "memory (default 1; with --ray: as many as the cluster holds)")
    batch.add_argument("--ray", metavar="ADDRESS",
                       help="render on the workers of a Ray cluster: 'auto' (the one started on this machine with "
                            "'ray start --head'), or its address; needs the optional extra requirements-ray.txt")
    batch.add_argument("--ray-cpus-per-worker", type=_count, default=None, metavar="N",
                       help="with --ray: the CPUs each worker takes (and OpenVINO's threads in it; default: up to 4, "
                            "fewer when no node has 4)")
    _add_render_options(batch, None)

    devices = commands.add_parser("devices", help="the devices OpenVINO sees, with full names and capabilities")
    devices.set_defaults(handler=_devices, command_parser=devices)

    cache = commands.add_parser("cache", help="the compiled-model cache")
    cache.set_defaults(handler=_cache, command_parser=cache)
    cache.add_argument("action", choices=("list", "clear", "prune"))
    cache.add_argument("keys", nargs="*", help="clear: only these entries (keys as 'cache list' shows them)")
    cache.add_argument("--max-size", type=parse_size, help="prune: total size to keep (e.g. 2G, 500M)")
    cache.add_argument("--cache-dir", type=Path, help="cache folder (default: per-user cache folder)")

    demo = commands.add_parser("demo", help="ov_backend's own demo: compile a small CNN and compare with PyTorch")
    demo.set_defaults(handler=_demo, command_parser=demo)
    demo.add_argument("--device", default="CPU", help="OpenVINO device (see the devices command)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return args.handler(args.command_parser, args)


def _generate(parser: argparse.ArgumentParser, args: Any) -> int:
    from .generate_command import run_generate

    return run_generate(parser, args)


def _batch(parser: argparse.ArgumentParser, args: Any) -> int:
    from .batch_command import run_batch

    return run_batch(parser, args)


def _demo(parser: argparse.ArgumentParser, args: Any) -> int:
    from ov_backend.demo import run_demo

    try:
        run_demo(args.device, out, verbose=args.verbose)
    except ValueError as exc:
        parser.error(str(exc))
    return 0


def _devices(parser: argparse.ArgumentParser, args: Any) -> int:
    from ov_backend.devices import device_info

    for info in device_info():
        caps = ", ".join(info.capabilities) or "-"
        out(f"{info.name:10} {info.full_name}  [{caps}]")
    return 0


def _cache(parser: argparse.ArgumentParser, args: Any) -> int:
    from ov_backend.cache import ModelCache
    from ov_backend.settings import default_cache_dir

    if args.action == "prune" and args.max_size is None:
        parser.error("cache prune needs --max-size (e.g. --max-size 2G)")
    if args.action != "prune" and args.max_size is not None:
        parser.error("--max-size only applies to 'cache prune'")
    if args.action != "clear" and args.keys:
        parser.error(f"entry keys only apply to 'cache clear', not {args.action!r}")
    folder = args.cache_dir or default_cache_dir()
    cache = ModelCache(folder)
    if args.action == "list":
        entries = cache.entries()
        for entry in entries:
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.last_used))
            out(f"{entry.key}  {format_bytes(entry.size_bytes):>10}  {used}  {entry.description}")
        out(f"{len(entries)} entries, {format_bytes(sum(e.size_bytes for e in entries))} in {folder}")
    elif args.action == "clear":
        unknown = sorted(set(args.keys) - {entry.key for entry in cache.entries()})
        if unknown:
            parser.error(f"no cache entries named {', '.join(unknown)} in {folder} "
                         "('cache list' shows the keys; nothing was removed)")
        removed = cache.clear(args.keys or None)
        out(f"removed {len(removed)} entries from {folder}")
    else:
        removed = cache.prune(args.max_size)
        left = format_bytes(sum(e.size_bytes for e in cache.entries()))
        out(f"removed {len(removed)} entries; {left} left in {folder}")
    return 0
