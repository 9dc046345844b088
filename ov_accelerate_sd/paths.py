"""Per-user folders of the SD layer (derived tokenizer files, the demo checkpoint).

Never the working directory: ``$XDG_CACHE_HOME/ov_accelerate_sd`` or ``~/.cache/ov_accelerate_sd``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def user_cache_dir() -> Path:
    """The per-user cache folder of this package (not created here)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ov_accelerate_sd"
