"""``python -m bench``: the command line of the benchmark (argument parsing and logging only)."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import time
from collections.abc import Sequence

from bench import models, report, runner, settings

logger = logging.getLogger("bench")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                epilog="python -m bench webui --help: the real-WebUI benchmark; "
                                       "python -m bench step-cache --help: step caching's images; "
                                       "python -m bench soak --help: the soak; "
                                       "python -m bench batch --help: a batch job by each way of running it; "
                                       "python -m bench load --help: a checkpoint load's memory; "
                                       "python -m bench session --help: a WebUI's whole session under a memory "
                                       "limit; python -m bench streams --help: NUM_STREAMS against N processes")
    p.add_argument("--quick", action="store_true", help="small models, seconds not minutes (CI smoke test)")
    p.add_argument("--components", nargs="+", choices=models.COMPONENT_NAMES, metavar="NAME",
                   help=f"components to measure (default: {' '.join(settings.DEFAULT_COMPONENTS)}; "
                        f"known: {' '.join(models.COMPONENT_NAMES)})")
    p.add_argument("--sdxl", action="store_true", help="also measure SDXL's UNet (10 GiB of fp32 weights)")
    p.add_argument("--variants", nargs="+", metavar="NAME",
                   help=f"variants (default: {' '.join(settings.DEFAULT_VARIANTS)})")
    p.add_argument("--rounds", type=int, help="timed calls per variant, interleaved (default 3; quick 2)")
    p.add_argument("--size", type=int, help="image size in pixels (default 512; quick 64)")
    p.add_argument("--out", help="folder of the JSON and markdown files (default bench/results)")
    p.add_argument("--name", help="file name stem of the results (default bench-full or bench-quick)")
    p.add_argument("--work-dir", help="keep weights and caches here (default: a temporary folder, removed)")
    p.add_argument("--no-warm", dest="warm", action="store_false", default=None,
                   help="skip the warm-cache first call")
    p.add_argument("--all-at-once", dest="group_by_precision", action="store_false", default=None,
                   help="interleave both precisions together (needs memory for every compiled model at once)")
    p.add_argument("--resolutions", nargs="*", metavar="HxW",
                   help="latent sizes for the new-shape measurement (default 64x64 96x64 64x96); none to skip")
    p.add_argument("--resolutions-dynamic", action="store_true", default=None,
                   help="compile the UNet of the new-resolution measurement with torch.compile(dynamic=True)")
    p.add_argument("--image-steps", type=int, help="steps of the whole-image split (default 20; quick 2; 0 skips)")
    p.add_argument("--image-precision", choices=("auto", "f32"), help="precision of the whole image (default auto)")
    p.add_argument("--only", nargs="+", choices=("components", "resolutions", "image"),
                   default=("components", "resolutions", "image"), help="run only these sections")
    p.add_argument("--note", help="a sentence printed above the tables (e.g. what else ran on the machine)")
    p.add_argument("-v", "--verbose", action="count", default=0, help="-v: progress; -vv: workers' logs too")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["webui"]:  # the real-WebUI benchmark has its own options
        from bench import webui

        return webui.main(argv[1:])
    if argv[:1] == ["batch"]:  # one seeded job by each way of running it: images a minute and memory
        from bench import batch

        return batch.main(argv[1:])
    if argv[:1] == ["session"]:  # a WebUI's whole session under a memory limit, stock against the extension
        from bench import session

        return session.main(argv[1:])
    if argv[:1] == ["streams"]:  # OpenVINO's throughput mode against N processes, on the UNet
        from bench import streams

        return streams.main(argv[1:])
    if argv[:1] == ["load"]:  # a checkpoint load's memory: A1111's own against the load into the weight file
        from bench import load

        return load.main(argv[1:])
    if argv[:1] == ["soak"]:  # hours of mixed requests against the real WebUI, bounded (its own options)
        from bench import soak

        return soak.main(argv[1:])
    if argv[:1] == ["step-cache"]:  # step caching's quality and speed, whole images (its own options)
        from bench import step_cache

        return step_cache.main(argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    components = list(args.components or settings.DEFAULT_COMPONENTS)
    if args.sdxl and "sdxl_unet" not in components:
        components.append("sdxl_unet")
    options = {
        "quick": args.quick, "components": components, "variants": args.variants, "rounds": args.rounds,
        "size": args.size, "out": args.out, "work_dir": args.work_dir, "warm": args.warm,
        "group_by_precision": args.group_by_precision, "resolutions": args.resolutions,
        "resolutions_dynamic": args.resolutions_dynamic,
        "image_steps": args.image_steps, "image_precision": args.image_precision,
        "log_level": logging.INFO if args.verbose > 1 else logging.WARNING,
    }
    try:
        config = settings.build_settings(options)
    except ValueError as err:
        _parser().error(str(err))
    header = {"command": "python -m bench " + shlex.join(argv),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": report.machine(), "note": args.note,
              # folders are machine-specific and change no result: the command line shows them
              "settings": {k: str(v) for k, v in vars(config).items() if k not in ("out", "work_dir")}}
    stem = args.name or ("bench-quick" if config.quick else "bench-full")

    def write(results: dict) -> None:
        results.update(header)
        report.write(results, config.out, stem)

    results = runner.run(config, args.only, progress=write)
    json_path, md_path = report.write(results, config.out, stem)
    sys.stdout.write(report.markdown(results) + f"\nWrote {json_path} and {md_path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
