"""The on-disk cache of converted OpenVINO models.

Layout under the cache folder::

    models/<key>/model.xml, model.bin, meta.json   one converted model per entry
    blobs/                                          OpenVINO's own CACHE_DIR (compiled blobs)
    captures/<key>.capture                          torch's saved captures (see ov_backend.portable)
    weights/                                        not the cache's: PyTorch's weights moved out of memory
                                                    (ov_backend.weight_file; its files are unlinked once mapped)

An entry is written into a temporary folder and renamed into place, and ``meta.json`` (with
the size and a checksum of every file) is written last, so a process killed mid-write leaves
nothing that is trusted later. An entry whose files do not match its ``meta.json`` is
reported, removed and rebuilt. Files up to 64 MiB are checksummed whole; larger ones (a full
UNet's weights are gigabytes) by their size and 64 blocks of 1 MiB spread over the file, which
catches truncation and overwritten regions without reading gigabytes at every start. The
modification time of ``meta.json`` is the entry's last use (a load refreshes it); :meth:`ModelCache.prune`
removes the least recently used entries first, never one in ``keep`` (the entries this process uses,
:mod:`ov_backend.cache_limit`), and never a file or folder being written (its name starts with ".").
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openvino as ov

from ov_backend.cache_limit import Holds, PruneResult
from ov_backend.files import atomic_path

logger = logging.getLogger(__name__)

CACHE_FORMAT = 2
_MODEL_FILES = ("model.xml", "model.bin")
_META = "meta.json"
_CHUNK = 16 << 20
_WHOLE_FILE_LIMIT = 64 << 20
_SAMPLE_BLOCKS = 64
_SAMPLE_BLOCK = 1 << 20


@dataclass(frozen=True)
class CacheEntry:
    """One item in the cache.

    Attributes:
        key: the entry's key (folder name), "blobs/<file>" for OpenVINO's compiled blobs, or
            "captures/<file>" for a saved capture.
        path: where it lives.
        size_bytes: its size on disk.
        last_used: seconds since the epoch of its last load or store.
        description: what was cached (graph, input signature, device).
        any_weights: it holds nothing of any weights and its key names none: it serves every checkpoint
            (a model converted with the weights as inputs, a saved capture).
    """

    key: str
    path: Path
    size_bytes: int
    last_used: float
    description: str = ""
    any_weights: bool = False


def make_key(parts: Mapping[str, Any]) -> str:
    """A stable key for ``parts`` (any JSON-serialisable mapping)."""
    payload = json.dumps({"format": CACHE_FORMAT, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:40]


def _file_digest(path: Path) -> str:
    """sha256 of the whole file up to 64 MiB; above, of its size and 64 evenly spread 1 MiB blocks."""
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= _WHOLE_FILE_LIMIT:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        else:
            h.update(f"sampled|{size}|".encode())
            step = (size - _SAMPLE_BLOCK) // (_SAMPLE_BLOCKS - 1)
            for index in range(_SAMPLE_BLOCKS):
                f.seek(index * step)
                h.update(f.read(_SAMPLE_BLOCK))
    return h.hexdigest()[:40]


def _dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def _raise_unless_gone(_function: Any, _path: str, info: Any) -> None:
    """``shutil.rmtree``'s error handler: a file already gone is fine, anything else is raised."""
    if not issubclass(info[0], FileNotFoundError):
        raise info[1]


class ModelCache:
    """Converted models on disk, keyed by everything that changes what they compute.

    Args:
        root: the cache folder (created on first store).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        #: the entries objects of this process use (never pruned; see :mod:`ov_backend.cache_limit`)
        self.holds = Holds()
        #: the folder's size limit in bytes set by whoever shares this object among backends (0: none); it
        #: overrides each backend's ``cache_max_bytes``, so changing it needs no new backend. None: the backends'.
        self.max_bytes: int | None = None

    @property
    def models_dir(self) -> Path:
        return self.root / "models"

    @property
    def blob_dir(self) -> Path:
        """The folder handed to OpenVINO as CACHE_DIR."""
        return self.root / "blobs"

    @property
    def capture_dir(self) -> Path:
        """The folder of saved captures (dynamo's work for a function, see :mod:`ov_backend.portable`)."""
        return self.root / "captures"

    def capture_file(self, key: str) -> Path:
        """Where the capture ``key`` is saved (whether or not it is)."""
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"invalid capture key {key!r}")
        return self.capture_dir / f"{key}.capture"

    def _entry_dir(self, key: str) -> Path:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"invalid cache key {key!r}")
        return self.models_dir / key

    def _verify(self, entry: Path) -> str | None:
        """Why the entry cannot be trusted, or None if its files match its meta.json."""
        try:
            meta = json.loads((entry / _META).read_text())
        except (OSError, ValueError) as err:
            return f"unreadable {_META}: {err}"
        files = meta.get("files")
        if meta.get("format") != CACHE_FORMAT or not isinstance(files, dict):
            return "unknown entry format"
        for name in _MODEL_FILES:
            info = files.get(name)
            path = entry / name
            if not info or not path.is_file():
                return f"{name} is missing"
            size = path.stat().st_size
            if size != info.get("size"):
                return f"{name} is {size} bytes, expected {info.get('size')} (truncated?)"
            if _file_digest(path) != info.get("checksum"):
                return f"{name} does not match its checksum (corrupted)"
        return None

    def model_file(self, key: str) -> Path | None:
        """The ``model.xml`` of the entry under ``key`` once its files are checked; None when absent
        or untrustworthy (then removed). Marks the entry as used."""
        entry = self._entry_dir(key)
        if not entry.is_dir():
            return None
        problem = self._verify(entry)
        if problem is not None:
            logger.warning("OpenVINO cache entry %s is damaged (%s); removing it and converting again",
                           entry, problem)
            shutil.rmtree(entry, ignore_errors=True)
            return None
        try:
            os.utime(entry / _META)
        except OSError:
            pass
        return entry / "model.xml"

    def load(self, key: str, core: ov.Core) -> ov.Model | None:
        """The model stored under ``key``, or None when absent or untrustworthy (then removed)."""
        xml = self.model_file(key)
        if xml is None:
            return None
        try:
            return core.read_model(str(xml), str(xml.with_name("model.bin")))
        except RuntimeError as err:
            logger.warning("OpenVINO cache entry %s could not be read (%s); removing it", xml.parent, err)
            shutil.rmtree(xml.parent, ignore_errors=True)
            return None

    def store(self, key: str, model: ov.Model, description: str = "", any_weights: bool = False) -> Path | None:
        """Write ``model`` under ``key`` atomically; returns the entry, or None if writing failed.

        ``any_weights``: the model holds nothing of the weights it runs with and the key names none (noted
        in the entry, see :attr:`CacheEntry.any_weights`).

        A failure (disk full, permissions) is logged as a WARNING and never raised: the caller
        keeps its compiled model either way.
        """
        final = self._entry_dir(key)
        if final.is_dir():
            return final
        tmp: Path | None = None
        try:
            self.models_dir.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key[:8]}-{uuid.uuid4().hex[:6]}-", dir=self.models_dir))
            ov.serialize(model, str(tmp / "model.xml"), str(tmp / "model.bin"))
            files = {name: {"size": (tmp / name).stat().st_size, "checksum": _file_digest(tmp / name)}
                     for name in _MODEL_FILES}
            meta = {"format": CACHE_FORMAT, "key": key, "description": description,
                    "created": time.time(), "files": files, **({"any_weights": True} if any_weights else {})}
            with open(tmp / _META, "w") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.rename(tmp, final)
            except OSError:
                if final.is_dir():  # another process stored the same entry first
                    shutil.rmtree(tmp, ignore_errors=True)
                    return final
                raise
            return final
        except (OSError, RuntimeError) as err:
            logger.warning("could not write OpenVINO cache entry %s: %s; continuing without it", final, err)
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            return None

    @property
    def failures_file(self) -> Path:
        """Conversions known to fail (key -> reason), so that a later process does not try them again."""
        return self.root / "conversion-failures.json"

    def failure(self, key: str) -> str | None:
        """Why the conversion named ``key`` failed before, or None (an unreadable file counts as empty)."""
        try:
            known = json.loads(self.failures_file.read_text())
        except (OSError, ValueError):
            return None
        reason = known.get(key) if isinstance(known, dict) else None
        return str(reason) if reason is not None else None

    def note_failure(self, key: str, reason: str) -> None:
        """Remember that the conversion named ``key`` failed (written atomically; a failure to write is logged)."""
        try:
            known = json.loads(self.failures_file.read_text())
            known = known if isinstance(known, dict) else {}
        except (OSError, ValueError):
            known = {}
        known[key] = reason[:2000]
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with atomic_path(self.failures_file) as tmp:
                tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
        except OSError as err:
            logger.warning("could not note a failed conversion in %s: %s", self.failures_file, err)

    def keys(self) -> set[str]:
        """The keys of the entries (as :meth:`entries` names them), from folder and file names only."""
        keys: set[str] = set()
        if self.models_dir.is_dir():
            keys.update(e.name for e in self.models_dir.iterdir() if e.is_dir() and not e.name.startswith("."))
        for sub in (self.blob_dir, self.capture_dir):
            if sub.is_dir():
                keys.update(f"{sub.name}/{b.name}" for b in sub.iterdir()
                            if b.is_file() and not b.name.startswith("."))
        return keys

    def entries(self) -> list[CacheEntry]:
        """Every entry (converted models and OpenVINO blobs), most recently used first."""
        found: list[CacheEntry] = []
        if self.models_dir.is_dir():
            for entry in self.models_dir.iterdir():
                if not entry.is_dir() or entry.name.startswith("."):
                    continue
                try:
                    meta = json.loads((entry / _META).read_text())
                    last_used = (entry / _META).stat().st_mtime
                except (OSError, ValueError):
                    try:
                        meta, last_used = {}, entry.stat().st_mtime
                    except OSError:  # removed meanwhile (another process pruning)
                        continue
                found.append(CacheEntry(entry.name, entry, _dir_size(entry), last_used,
                                        str(meta.get("description", "(damaged)" if not meta else "")),
                                        meta.get("any_weights") is True))
        for sub, description, any_weights in (
                (self.blob_dir, "OpenVINO compiled blob", False),
                (self.capture_dir, "saved capture of a compiled function (torch.compile)", True)):
            if sub.is_dir():
                for item in sub.iterdir():
                    if item.name.startswith("."):  # being written (atomic_path's temporary file)
                        continue
                    try:
                        if not item.is_file():
                            continue
                        st = item.stat()
                    except OSError:  # removed meanwhile (another process pruning)
                        continue
                    found.append(CacheEntry(f"{sub.name}/{item.name}", item, st.st_size, st.st_mtime,
                                                description, any_weights))
        return sorted(found, key=lambda e: e.last_used, reverse=True)

    def total_bytes(self) -> int:
        """The size of the whole cache folder, temporary files included."""
        return _dir_size(self.root) if self.root.is_dir() else 0

    def _remove(self, entry: CacheEntry) -> None:
        if entry.path.is_dir():
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            entry.path.unlink(missing_ok=True)

    def _remove_checked(self, entry: CacheEntry) -> None:
        """Remove ``entry``; gone already (another process pruned it) counts as removed.

        Raises:
            OSError: it could not be removed (permissions, a file held open on Windows, ...).
        """
        if entry.path.is_dir():
            # meta.json first: what is left of a folder that could not be removed whole is no trusted entry
            (entry.path / _META).unlink(missing_ok=True)
            shutil.rmtree(entry.path, onerror=_raise_unless_gone)
        else:
            entry.path.unlink(missing_ok=True)

    def clear(self, keys: Iterable[str] | None = None) -> list[str]:
        """Remove the given entries (all, with ``keys=None``, leftovers included); returns the keys removed."""
        if keys is None:
            removed = [e.key for e in self.entries()]
            for sub in (self.models_dir, self.blob_dir, self.capture_dir):
                shutil.rmtree(sub, ignore_errors=True)
            self.failures_file.unlink(missing_ok=True)
            return removed
        wanted = set(keys)
        removed = []
        for entry in self.entries():
            if entry.key in wanted:
                self._remove(entry)
                removed.append(entry.key)
        unknown = wanted - set(removed)
        if unknown:
            raise KeyError(f"no cache entries named {', '.join(sorted(unknown))} in {self.root}")
        return removed

    def prune(self, max_bytes: int) -> list[str]:
        """Remove least recently used entries until the cache holds at most ``max_bytes``; returns their keys."""
        return list(self.prune_to(max_bytes).removed)

    def prune_to(self, max_bytes: int, keep: Iterable[str] = ()) -> PruneResult:
        """Remove least recently used entries, except those in ``keep``, until the cache holds at most ``max_bytes``.

        An entry that cannot be removed is logged (WARNING) and skipped; one that vanished meanwhile (another
        process pruning) counts as removed.

        Raises:
            ValueError: ``max_bytes`` is negative.
        """
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        kept = set(keep)
        entries = self.entries()
        total = sum(e.size_bytes for e in entries)
        removed: list[str] = []
        failed: list[str] = []
        removed_bytes = 0
        for entry in reversed(entries):  # oldest first
            if total <= max_bytes:
                break
            if entry.key in kept:
                continue
            try:
                self._remove_checked(entry)
            except OSError as err:
                logger.warning("could not remove OpenVINO cache entry %s while pruning (%s); leaving it",
                               entry.path, err)
                failed.append(entry.key)
                continue
            total -= entry.size_bytes
            removed_bytes += entry.size_bytes
            removed.append(entry.key)
        kept_bytes = sum(e.size_bytes for e in entries if e.key in kept)
        return PruneResult(tuple(removed), removed_bytes, total, kept_bytes, tuple(failed))
