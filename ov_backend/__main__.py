"""``python -m ov_backend``: the command line (generate, devices, cache, demo).

A thin entry point: the commands live in ``ov_accelerate_sd.cli``, imported only here, so
``import ov_backend`` never pulls in diffusers or transformers.
"""

from __future__ import annotations

import sys


def main() -> int:
    from ov_accelerate_sd.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
