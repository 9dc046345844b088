"""Per-user folders of the SD layer (derived tokenizer files, the demo checkpoint).

Never the working directory: ``$XDG_CACHE_HOME/ov_accelerate_sd`` or ``~/.cache/ov_accelerate_sd``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ov_backend.files import user_cache_root

logger = logging.getLogger(__name__)


def user_cache_dir() -> Path:
    """The per-user cache folder of this package (not created here)."""
    return user_cache_root() / "ov_accelerate_sd"
