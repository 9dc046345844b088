"""``python -m ov_backend``: a first compile on a tiny model built here (until the full CLI lands)."""

from __future__ import annotations

import sys

from ov_backend.demo import main

if __name__ == "__main__":
    sys.exit(main())
