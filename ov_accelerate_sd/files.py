"""Writing a file atomically, with the mode a plain ``open(path, "w")`` would give it.

``atomic_path(path)`` yields a temporary path beside ``path``; when the block ends without an
error the temporary file replaces ``path`` (a killed run never leaves a half-written file), and
otherwise it is removed. The temporary file is created with mode 0666 filtered by the umask, as
the user's other files are, not 0600 as ``tempfile.mkstemp`` makes them.
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


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path to write, moved onto ``path`` when the block succeeds.

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
