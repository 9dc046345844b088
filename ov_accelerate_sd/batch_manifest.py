"""A batch job's manifest: what is done in an output folder, so the same command resumes where it stopped.

Owns the folder's ``manifest.jsonl``, an append-only record, one JSON object a line, each written in one
``write`` and flushed to the disk (``fsync``) before the run goes on:

- ``{"kind": "line", "line": 3, "fingerprint": ..., "seed": 1234, "fields": {...}}``: a job line as it was
  planned, with its seed (drawn once when the line said -1);
- ``{"kind": "image", "line": 3, "index": 0, "seed": 1234, "file": "00003-00-1234.png", "bytes": 401233}``:
  an image whose PNG is complete on disk (written to a temporary name, then renamed: a killed run never
  leaves a half-written PNG under an image's name).

An image is done when its record is there and its file has the recorded size. A kill can tear only the last
record (dropped when the run resumes, so its image is rendered again); a PNG renamed but not yet recorded is
rendered again and rewritten with the same bytes; temporary files a kill left are removed. One run at a time
writes a folder (an advisory lock on ``.batch.lock``). A line that changed since the folder's run began is
refused, naming the fields that differ: an image in the folder always comes from the line the manifest says.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .jobs import MAX_SEED, JobLine

logger = logging.getLogger(__name__)

MANIFEST = "manifest.jsonl"
LOCK = ".batch.lock"


class ManifestError(ValueError):
    """The folder's manifest cannot be used for this job (with what to do instead)."""


def image_name(line: int, index: int, seed: int) -> str:
    """The PNG of image ``index`` of job line ``line``: "00003-00-1234.png" (sorts by line, then image)."""
    return f"{line:05d}-{index:02d}-{seed}.png"


@dataclass(frozen=True)
class PlannedImage:
    """One image of a job line: where it goes and which batch renders it."""

    line: int
    index: int
    seed: int
    batch: int
    file: str


def planned_images(line: JobLine, seed: int) -> list[PlannedImage]:
    """The images of ``line`` with its resolved ``seed`` (image i gets seed + i, as in the WebUI)."""
    return [PlannedImage(line.number, i, seed + i, i // line.batch_size, image_name(line.number, i, seed + i))
            for i in range(line.images)]


class Manifest:
    """The manifest of an output folder, locked for this run while open.

    Args:
        folder: the output folder (created if missing).

    Raises:
        ManifestError: another run holds the folder, or the manifest is damaged before its last line.
        OSError: the folder cannot be created or written.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self._lock()
        self.path = folder / MANIFEST
        self.lines: dict[int, dict[str, Any]] = {}
        self.images: dict[tuple[int, int], dict[str, Any]] = {}
        self.torn = False
        self._read()
        self._remove_leftovers()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115  (kept open for the run)

    def _lock(self) -> int | None:
        try:
            import fcntl
        except ImportError:  # Windows: no advisory lock; one run per folder is then the user's to keep
            return None
        fd = os.open(self.folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ManifestError(f"another batch run is writing {self.folder}; wait for it to end, or give "
                                "this one another --out") from None
        return fd

    def _read(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        rows = data.split(b"\n")
        offset = 0
        for number, row in enumerate(rows, start=1):
            start, offset = offset, offset + len(row) + 1
            if not row.strip():
                continue
            try:
                record = json.loads(row)
                kind = record["kind"]
            except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError):
                if number == len(rows):  # the last record, torn by a kill: dropped, its image rendered again
                    self.torn = True
                    os.truncate(self.path, start)
                    logger.info("%s: dropped the torn last record", self.path)
                    continue
                raise ManifestError(f"{self.path} is damaged at line {number} (not a record this program "
                                    "wrote); move it away to start the job over in this folder") from None
            if kind == "line":
                self.lines[int(record["line"])] = record
            elif kind == "image":
                self.images[(int(record["line"]), int(record["index"]))] = record
        if not self.torn and data and not data.endswith(b"\n"):  # a whole last record without its newline
            with open(self.path, "ab") as f:
                f.write(b"\n")

    def _remove_leftovers(self) -> None:
        """Temporary PNGs of a killed run (``.<name>.png.<id>.tmp``)."""
        for leftover in self.folder.glob(".*.png.*.tmp"):
            try:
                leftover.unlink()
                logger.info("removed %s, left by a stopped run", leftover)
            except OSError as exc:
                logger.warning("could not remove %s, left by a stopped run: %s", leftover, exc)

    def _append(self, *records: dict[str, Any]) -> None:
        self._file.write("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))
        self._file.flush()
        os.fsync(self._file.fileno())

    def changed_lines(self, lines: list[JobLine]) -> list[str]:
        """What differs between ``lines`` and the lines this folder's run recorded (one text a changed line)."""
        changed = []
        for line in lines:
            before = self.lines.get(line.number)
            if before is None or before["fingerprint"] == line.fingerprint:
                continue
            now = line.fields()
            differ = [f"{k} {json.dumps(before['fields'].get(k))} -> {json.dumps(now[k])}"
                      for k in now if before["fields"].get(k) != now[k]]
            changed.append(f"line {line.number}: " + ("; ".join(differ) or "changed"))
        return changed

    def seeds(self, lines: list[JobLine], rng: random.Random | None = None) -> dict[int, int]:
        """Every line's seed (line number -> seed): the one recorded, else its own, else (-1) a random one. The
        lines not recorded yet are recorded, in one write, before this returns."""
        draw = rng or random.SystemRandom()
        seeds: dict[int, int] = {}
        new: list[dict[str, Any]] = []
        for line in lines:
            before = self.lines.get(line.number)
            if before is not None and before["fingerprint"] == line.fingerprint:
                seeds[line.number] = int(before["seed"])
                continue
            seed = line.seed if line.seed != -1 else draw.randrange(MAX_SEED - line.images)
            new.append({"kind": "line", "line": line.number, "fingerprint": line.fingerprint, "seed": seed,
                        "fields": line.fields()})
            seeds[line.number] = seed
        if new:
            self._append(*new)
            self.lines.update((record["line"], record) for record in new)
        return seeds

    def done(self, image: PlannedImage) -> bool:
        """Whether ``image`` is complete on disk, as recorded."""
        record = self.images.get((image.line, image.index))
        if record is None or record.get("file") != image.file:
            return False
        try:
            return (self.folder / image.file).stat().st_size == int(record["bytes"])
        except OSError:
            return False

    def record(self, image: PlannedImage) -> None:
        """Record ``image``, whose PNG is complete on disk."""
        size = (self.folder / image.file).stat().st_size
        record = {"kind": "image", "line": image.line, "index": image.index, "seed": image.seed,
                  "file": image.file, "bytes": size}
        self._append(record)
        self.images[(image.line, image.index)] = record

    def close(self) -> None:
        self._file.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> Manifest:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
