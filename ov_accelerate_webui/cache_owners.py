"""Which checkpoint each disk-cache entry was made for, so the panel can show the cache's size per checkpoint.

The backend's cache keys name weights by content, not by checkpoint: the adapter notes, after each
generation, the entries that appeared during it and the checkpoint(s) it ran, in a small index beside
the cache (``checkpoints.json``, written atomically). Entries made by other tools, by earlier versions or
by a run the index could not be written for are counted as not attributed. Entries that hold nothing of
any weights and serve every checkpoint (the backend notes them: a model converted with the weights as
inputs, such as the UNet's and the VAE's, and the saved captures) are counted apart, whoever made them.
A broken or unreadable index is treated as empty: it only labels sizes, it never decides what is loaded.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .backend_bridge import ov_backend

logger = logging.getLogger(__name__)

INDEX_NAME = "checkpoints.json"
#: The group of the entries that serve every checkpoint.
SHARED = "every checkpoint (no weights in them)"


def entry_keys(cache: Any) -> set[str]:
    """The keys of the entries in ``cache`` now (an ``ov_backend.ModelCache``; names only, no sizes read)."""
    return set(cache.keys())


def _read(folder: Path) -> dict[str, str]:
    try:
        data = json.loads((folder / INDEX_NAME).read_text())
    except (OSError, ValueError):
        return {}
    owners = data.get("owners") if isinstance(data, dict) else None
    return {str(k): str(v) for k, v in owners.items()} if isinstance(owners, dict) else {}


def record(folder: str | os.PathLike[str], keys: Iterable[str], checkpoint: str) -> None:
    """Note that the entries ``keys`` of the cache in ``folder`` were made for ``checkpoint``.

    A failure to write (read-only folder, full disk) is logged and otherwise ignored.
    """
    keys = sorted(keys)
    if not keys:
        return
    path = Path(folder)
    owners = _read(path)
    owners.update({key: checkpoint for key in keys})
    try:
        with ov_backend.atomic_path(path / INDEX_NAME) as tmp:
            tmp.write_text(json.dumps({"owners": owners}, indent=1, sort_keys=True))
    except OSError as err:
        logger.warning("could not note the checkpoint of new cache entries in %s: %s", path, err)


def sizes_by_checkpoint(folder: str | os.PathLike[str], cache: Any) -> list[tuple[str, int, int]]:
    """(checkpoint, bytes, entries) for the entries of ``cache`` (in ``folder``), largest first; entries
    that serve every checkpoint are under :data:`SHARED`, others the index does not name under "not
    attributed"."""
    owners = _read(Path(folder))
    totals: dict[str, list[int]] = {}
    for entry in cache.entries():
        owner = SHARED if entry.any_weights else owners.get(entry.key, "not attributed")
        total = totals.setdefault(owner, [0, 0])
        total[0] += entry.size_bytes
        total[1] += 1
    return sorted(((owner, b, n) for owner, (b, n) in totals.items()), key=lambda item: -item[1])


def describe(folder: str | os.PathLike[str], cache: Any) -> str:
    """One line: "By checkpoint: a.safetensors [1234abcd] 12.0 MiB (3 entries); every checkpoint (no weights in
    them) 5.0 MiB (4 entries); ..." ("" when empty)."""
    fmt = ov_backend.format_bytes
    items = sizes_by_checkpoint(folder, cache)
    if not items:
        return ""
    return "By checkpoint: " + "; ".join(
        f"{owner} {fmt(size)} ({count} entr{'y' if count == 1 else 'ies'})" for owner, size, count in items
    ) + "."
