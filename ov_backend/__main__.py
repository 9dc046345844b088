"""``python -m ov_backend``: the command line (generate, devices, cache, demo).

A thin entry point: the commands live in ``ov_accelerate_sd.cli``, imported only here, so
``import ov_backend`` never pulls in diffusers or transformers. Under ``-m`` the package loads
nothing itself (see ``ov_backend/__init__.py``), so ``--help`` and argument errors answer
without importing torch or OpenVINO.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    from ov_accelerate_sd.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
