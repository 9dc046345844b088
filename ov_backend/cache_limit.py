"""The disk cache's size limit: which entries this process uses, and pruning the rest after a store.

Owns :class:`Holds` (the entries of a cache folder that objects of this process still use: an entry counts as in
use while an object that holds what was loaded from it or stored into it lives, e.g. the variant of a graph
compiled from it, or the weight set whose converted model it is), :class:`PruneResult`, :class:`CacheUsage`, and
:func:`enforce`: after a store, remove the least recently used entries that no one here uses until the cache holds
at most its limit. An entry in use is never removed; when those alone are over the limit they stay, one WARNING
says so, and :func:`cache_usage` reports it. Nothing here raises for a file it could not remove (another process may
prune the same folder, or a file may be read-only): the picture being made matters more than the cache's size.

Another process sharing the folder is not asked what it uses. Folders and files being written (their names start
with ".", see :mod:`ov_backend.cache` and :func:`ov_backend.files.atomic_path`) are never entries, so they are never
removed; an entry another process compiled from may be: on Linux its compiled model keeps running (the files stay
readable while mapped), and its next start converts or compiles it again.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ov_backend.files import format_bytes

if TYPE_CHECKING:
    from ov_backend.cache import ModelCache

logger = logging.getLogger(__name__)

#: The default of ``BackendSettings.cache_max_bytes`` (20 GiB), here so that the command line reads it without
#: loading OpenVINO. A cache entry is one part of one checkpoint: 1.7-3.4 GB for an SD 1.5 UNet, 5-10 GB for an
#: SDXL one, its blob on devices other than the CPU as much again. 20 GiB keeps a few of each a user switches
#: between (e.g. three SD 1.5 checkpoints and one SDXL with their VAEs and text encoders) and stops the folder
#: growing without bound (users of another OpenVINO extension reported 65 GB).
DEFAULT_CACHE_MAX_BYTES = 20 << 30


class Holds:
    """Which entries (keys as :meth:`ModelCache.entries` names them) objects of this process still use (thread-safe).

    An entry is in use while at least one of its holders lives; holders are referenced weakly, so dropping what
    was compiled from an entry (a use window's release, a backend's reset) frees it without telling anyone.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[str, list[weakref.ref[Any]]] = {}
        #: the WARNING that entries in use alone are over the limit was given (once per cache folder and process)
        self.warned = False

    def hold(self, keys: Iterable[str], holder: Any) -> None:
        """``holder`` (any object that can be referenced weakly) uses the entries ``keys`` while it lives."""
        ref = weakref.ref(holder)
        with self._lock:
            for key in keys:
                refs = self._holders.setdefault(key, [])
                if not any(r() is holder for r in refs):
                    refs.append(ref)

    def in_use(self) -> set[str]:
        """The keys some live holder uses (entries of dead holders are forgotten here)."""
        with self._lock:
            for key in list(self._holders):
                alive = [r for r in self._holders[key] if r() is not None]
                if alive:
                    self._holders[key] = alive
                else:
                    del self._holders[key]
            return set(self._holders)


@dataclass(frozen=True)
class PruneResult:
    """What a prune did (:meth:`ModelCache.prune_to`).

    Attributes:
        removed: the keys removed, least recently used first.
        removed_bytes: their size.
        total_bytes: the entries' size afterwards.
        kept_bytes: the size of the entries kept because they are in use.
        failed: keys that could not be removed (the reason is in the log).
    """

    removed: tuple[str, ...] = ()
    removed_bytes: int = 0
    total_bytes: int = 0
    kept_bytes: int = 0
    failed: tuple[str, ...] = ()


@dataclass(frozen=True)
class CacheUsage:
    """A cache folder's size against its limit, for a status.

    Attributes:
        bytes: the size of its entries (converted models, OpenVINO's blobs, saved captures).
        limit_bytes: the limit (0: none).
        in_use_bytes: the size of the entries this process uses (never pruned).
    """

    bytes: int
    limit_bytes: int
    in_use_bytes: int

    @property
    def over_limit(self) -> bool:
        """The entries are over the limit (the entries in use alone, since every store prunes)."""
        return bool(self.limit_bytes) and self.bytes > self.limit_bytes

    def as_dict(self) -> dict[str, int]:
        """``cache_bytes``, ``cache_limit_bytes``, ``cache_in_use_bytes`` (the status report's names)."""
        return {"cache_bytes": self.bytes, "cache_limit_bytes": self.limit_bytes,
                "cache_in_use_bytes": self.in_use_bytes}

    def text(self) -> str:
        """E.g. "1.2 GiB of 20.0 GiB limit", with what is over it."""
        if not self.limit_bytes:
            return f"{format_bytes(self.bytes)} (no limit)"
        text = f"{format_bytes(self.bytes)} of {format_bytes(self.limit_bytes)} limit"
        if self.over_limit:
            text += f" (over it: {format_bytes(self.in_use_bytes)} in use by this WebUI/process, kept)"
        return text


def enforce(cache: ModelCache, max_bytes: int, record: Callable[..., None] = lambda **amounts: None,
            keep: Iterable[str] = ()) -> PruneResult:
    """Prune ``cache`` to ``max_bytes`` (0: no limit, nothing done), never removing an entry in use (its
    :class:`Holds`) or in ``keep``; counts what went through ``record`` (``cache_pruned``, ``cache_pruned_bytes``,
    ``cache_prune_errors``, as ``StatsCounter.add`` takes them). Never raises for the files: a failure is logged."""
    if max_bytes <= 0:
        return PruneResult()
    try:
        result = cache.prune_to(max_bytes, keep=cache.holds.in_use() | set(keep))
    except OSError as err:  # the folder itself unreadable: the next store tries again
        logger.warning("could not prune the OpenVINO cache %s to %s: %s", cache.root, format_bytes(max_bytes), err)
        record(cache_prune_errors=1)
        return PruneResult()
    if result.removed or result.failed:
        record(cache_pruned=len(result.removed), cache_pruned_bytes=result.removed_bytes,
               cache_prune_errors=len(result.failed))
        logger.info("OpenVINO cache %s: removed %d least recently used entries (%s) to stay under %s",
                    cache.root, len(result.removed), format_bytes(result.removed_bytes), format_bytes(max_bytes))
    if result.total_bytes > max_bytes and not cache.holds.warned:
        cache.holds.warned = True
        logger.warning("OpenVINO cache %s holds %s, over its limit of %s: the models this process uses (%s) are "
                       "kept; raise the limit to keep other models too", cache.root,
                       format_bytes(result.total_bytes), format_bytes(max_bytes), format_bytes(result.kept_bytes))
    return result


def cache_usage(cache: ModelCache, max_bytes: int) -> CacheUsage:
    """The size of ``cache``'s entries against ``max_bytes``, and of those in use."""
    in_use = cache.holds.in_use()
    entries = cache.entries()
    return CacheUsage(sum(e.size_bytes for e in entries), max(max_bytes, 0),
                      sum(e.size_bytes for e in entries if e.key in in_use))
