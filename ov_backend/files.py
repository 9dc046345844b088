"""Files on disk, for every layer: where per-user caches live, how a file is written atomically, sizes as text.

Owns three small rules that the SD layer and the WebUI adapter use too (each defined once, here):

- :func:`user_cache_root`: ``$XDG_CACHE_HOME`` or ``~/.cache``; never the working directory.
- :func:`atomic_path`: a temporary path beside the target, moved onto it when the block succeeds (a
  killed run never leaves a half-written file), created with mode 0666 filtered by the umask as the
  user's other files are, not 0600 as ``tempfile.mkstemp`` makes them.
- :func:`format_bytes`: binary units with their binary names (KiB, MiB, GiB, TiB).

Imports only the standard library.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

FILE_MODE = 0o666
"""Mode asked for new files; the process umask takes away from it (0644 under umask 022)."""
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def user_cache_root() -> Path:
    """The per-user cache folder (``$XDG_CACHE_HOME``, else ``~/.cache``); each package uses a subfolder."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base)


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path to write, moved onto ``path`` when the block succeeds (removed otherwise).

    Raises:
        OSError: the folder cannot take the file (missing, not writable, full, ...).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def format_bytes(size: float) -> str:
    """A size in bytes as text in binary units: 512 -> "512 B", 1536 -> "1.5 KiB", 3 << 30 -> "3.0 GiB"."""
    value = float(size)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
