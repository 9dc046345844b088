"""PyTorch's copy of the weights OpenVINO runs, kept in a memory-mapped file instead of the process's memory.

OpenVINO's CPU plugin holds its own copy of a compiled model's weights in its kernels' layout, and keeps
the constants it was compiled from alive beside it; those constants are the PyTorch tensors themselves
(:mod:`ov_backend.weight_binding`). So a part run in OpenVINO costs its weights twice: a full SDXL at f32
needs about 28 GiB where stock PyTorch needs 15 (``docs/memory.md`` has the measurements).

A :class:`WeightFile` moves the tensors of a graph's weights, before the graph's first conversion, into a
file on disk that the process maps (``MAP_SHARED``): each tensor keeps its identity (``Tensor.set_`` points
it at its bytes in the mapping), so PyTorch, the module, A1111's LoRA code writing weights in place and the
converted models all see the same memory as before. Once OpenVINO has packed a model's weights (its first
inference), nothing reads the mapped pages; :meth:`WeightFile.drop_resident` takes them out of the process
(``MADV_DONTNEED``: the data stays in the file and the kernel's page cache, which the kernel reclaims
when memory runs short, instead of the process's memory, which it can only swap). Whatever reads them
later (a fallback to PyTorch, a LoRA write, a new compile) faults them back in from the page cache or the
disk: correct, at the cost of reading them. The file is unlinked as soon as it is mapped, so nothing is
left on disk when the process ends.

Only tensors no converted model reads yet may move (``Tensor.set_`` frees the old storage, which a
constant sharing it would still point to): the backend moves them before it converts anything of them.
POSIX only (``mmap`` with ``madvise`` and ``posix_fallocate``); elsewhere nothing moves and the reason says so.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
import threading
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ov_backend.files import format_bytes
from ov_backend.forget import ForgetLater
from ov_backend.report import StatsCounter

logger = logging.getLogger(__name__)

#: Byte alignment of each tensor in the file (a cache line; OpenVINO and numpy want at least the element size).
ALIGN = 64
#: Room left free on the file's disk after the file is written.
MIN_FREE_AFTER = 1 << 30
#: File systems that keep files in memory: a weight file there saves nothing.
MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})
#: While a model packs its weights, the file's pages leave the process this often (see :meth:`WeightHome.packing`).
#: OpenVINO's CPU plugin reads a whole model's constants within a second or two while it compiles (full-size SD 1.5
#: at 0.5 s: all 3.2 GiB of them resident at once for a moment; at 0.05 s: 0.2 GiB). A drop of nothing costs
#: about 40 microseconds on an 8 GiB file.
PACKING_DROP_SECONDS = 0.05
#: The rest of the time (a generation run by PyTorch reading its weights from the file, stock A1111 in between,
#: a LoRA written), this often: PyTorch reads every weight once per step, so the pages it faults in leave the
#: process within a second instead of adding up to the whole model until the next accelerated generation.
IDLE_DROP_SECONDS = 1.0
#: Pages dropped from the process at most this many bytes at a time while tensors move in.
_DROP_EVERY = 256 << 20


def give_back_freed_memory() -> None:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim``): tensors below glibc's mmap threshold
    (up to 32 MiB: most of a UNet's weights) live in its heap, and freeing them leaves their pages in the process
    until it is trimmed. A no-op elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def file_system_of(path: Path) -> str | None:
    """The type of the file system ``path`` is on ("ext4", "tmpfs", ...), from ``/proc/mounts``; None where
    it cannot be read."""
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            mounts = [line.split()[:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return None
    target = os.path.realpath(path)
    best, kind = "", None
    for _, point, fs in mounts:
        point = point.replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fs
    return kind


@dataclass
class MoveResult:
    """What one :meth:`WeightFile.move` did.

    Attributes:
        moved_bytes: bytes of tensors now in the file.
        seconds: time spent writing them.
        kept_bytes: bytes of tensors left in memory, by reason.
    """

    moved_bytes: int = 0
    seconds: float = 0.0
    kept_bytes: dict[str, int] = field(default_factory=dict)

    def keep(self, why: str, nbytes: int) -> None:
        self.kept_bytes[why] = self.kept_bytes.get(why, 0) + nbytes


class _Mapping:
    """One file's mapping and the tensors that live in it (``arrays``: it holds arrays of :meth:`WeightFile.arrays`,
    alive as long as something reads them: it is closed once nothing does)."""

    def __init__(self, mm: mmap.mmap, size: int, path: Path, arrays: bool = False) -> None:
        self.mm = mm
        self.size = size
        self.path = path
        self.arrays = arrays
        self.tensors: list[weakref.ref[torch.Tensor]] = []
        self.start = self.address()

    def address(self) -> int:
        view = (ctypes.c_char * 1).from_buffer(self.mm)
        try:
            return ctypes.addressof(view)
        finally:
            del view

    def holds(self, t: torch.Tensor) -> bool:
        ptr = t.data_ptr()
        return self.start <= ptr < self.start + self.size

    def alive(self) -> bool:
        return any(ref() is not None for ref in self.tensors)


class WeightFile:
    """Memory-mapped files in ``folder`` that hold PyTorch's copy of weights (see the module's docstring).

    Thread-safe. Args:
        folder: where the files are made (they are unlinked once mapped); on a disk, not a file system
            in memory.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._lock = threading.RLock()  # (weak reference callbacks take it, at any point of this thread)
        self._forget_later = ForgetLater(self._lock)  # (never waits for it: see ov_backend.forget)
        self._taking = threading.Lock()
        self._maps: list[_Mapping] = []
        #: id -> weak reference of every tensor :meth:`take` was given: a build may have converted it since
        self._seen: dict[int, weakref.ref[torch.Tensor]] = {}
        #: the thread that drops the files' pages from the process while any file is mapped (see :meth:`_keep`)
        self._keeper: threading.Thread | None = None
        self._packing = 0
        self._wake = threading.Event()

    # -- moving tensors in ------------------------------------------------------------------------------
    def unavailable(self) -> str | None:
        """Why no tensor can move into a file here, or None."""
        if os.name != "posix" or not hasattr(mmap, "MADV_DONTNEED") or not hasattr(os, "posix_fallocate"):
            return "keeping weights in a file needs Linux (mmap with madvise)"
        fs = file_system_of(self.folder) if self.folder.exists() else file_system_of(self.folder.parent)
        if fs in MEMORY_FILE_SYSTEMS:
            return f"the weights folder {self.folder} is on {fs}, which keeps files in memory"
        return None

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s data is in one of this object's files."""
        with self._lock:
            return any(m.holds(t) for m in self._maps)

    def move(self, tensors: Sequence[torch.Tensor], skip: Iterable[torch.Tensor] = ()) -> MoveResult:
        """Move the data of ``tensors`` into a new file, each tensor keeping its identity.

        Tensors already in a file, in ``skip`` (a converted model may read their memory), not on the CPU,
        not contiguous, shared with another tensor or needing grad stay where they are, counted by reason
        in the result. A file that cannot be made (no room on the disk, a file system in memory, ...)
        leaves every tensor where it was, with the reason.
        """
        result = MoveResult()
        skip_ids = {id(t) for t in skip}
        unique = list({id(t): t for t in tensors}.values())
        sharing = Counter(t.untyped_storage().data_ptr() for t in unique)
        todo: list[torch.Tensor] = []
        for t in unique:
            nbytes = _nbytes(t)
            if t.device.type != "cpu" or nbytes == 0 or self.holds(t):
                continue
            if id(t) in skip_ids:
                result.keep("read by a model converted before it could move", nbytes)
            elif not t.is_contiguous() or t.storage_offset() != 0 \
                    or t.untyped_storage().nbytes() != nbytes or sharing[t.untyped_storage().data_ptr()] > 1:
                result.keep("a view of a larger tensor", nbytes)
            elif t.requires_grad and not isinstance(t, torch.nn.Parameter):
                result.keep("needs grad", nbytes)
            else:
                todo.append(t)
        if not todo:
            return result
        size = sum(_nbytes(t) for t in todo)
        total = sum(_aligned(_nbytes(t)) for t in todo)
        why = self.unavailable() or self._no_room(total)
        if why is not None:
            result.keep(why, size)
            return result
        start = time.perf_counter()
        try:
            mapping = self._map_new(total)
        except OSError as err:
            result.keep(f"the weights file could not be made in {self.folder} ({err})", size)
            return result
        offset = since_drop = 0
        with torch.no_grad():
            for t in todo:
                nbytes = _nbytes(t)
                dest = torch.frombuffer(mapping.mm, dtype=torch.uint8, count=nbytes, offset=offset)
                dest.copy_(t.reshape(-1).view(torch.uint8))
                target = dest.view(t.dtype)
                t.set_(target.untyped_storage(), 0, t.shape, t.stride())
                mapping.tensors.append(weakref.ref(t))
                offset += _aligned(nbytes)
                since_drop += nbytes
                if since_drop >= _DROP_EVERY:  # the copy dirties the mapping: keep the process's share small
                    mapping.mm.madvise(mmap.MADV_DONTNEED)
                    since_drop = 0
        mapping.mm.madvise(mmap.MADV_DONTNEED)
        with self._lock:
            self._maps.append(mapping)
            self._start_keeper()
        give_back_freed_memory()  # the old storages were freed; most were in the C heap
        result.moved_bytes = size
        result.seconds = time.perf_counter() - start
        logger.info("moved %s of weights (%d tensors) into a memory-mapped file in %s in %.1fs",
                    format_bytes(result.moved_bytes), len(todo), self.folder, result.seconds)
        return result

    def take(self, tensors: Sequence[torch.Tensor]) -> MoveResult:
        """Before a build: :meth:`move` those of ``tensors`` never given here before, then remember them all
        (a build is about to convert them: from now on a converted model may read their memory)."""
        with self._taking:
            result = self.place(tensors)
            with self._lock:
                self._forget_later.drain()
                for t in tensors:
                    key = id(t)
                    self._seen[key] = weakref.ref(t, lambda ref, key=key: self._forget(key, ref))
            return result

    def place(self, tensors: Sequence[torch.Tensor]) -> MoveResult:
        """:meth:`move` those of ``tensors`` no build was given (:meth:`take`) before, without remembering them: for
        tensors no build is about to convert (a checkpoint's weights as it loads, the Lora extension's copies)."""
        with self._lock:
            seen = [t for t in tensors if (ref := self._seen.get(id(t))) is not None and ref() is t]
        return self.move(tensors, skip=seen)

    def fill(self, items: Sequence[tuple[torch.Size, torch.dtype, Callable[[], torch.Tensor]]],
             wrap: Callable[[torch.Tensor], torch.Tensor] | None = None,
             ) -> tuple[list[torch.Tensor] | None, MoveResult]:
        """New tensors in a new file, made one at a time from their sources: for a checkpoint's weights as they
        load, which then never exist in memory at their final precision.

        ``items``: for each tensor its shape, its dtype, and a function that returns its source (called once,
        when that tensor is written; the value is converted to the dtype as it is copied, so memory holds one
        source at a time, never the converted whole). Returns the tensors (in ``items``' order) and what was
        written; ``(None, result)`` with the reason in ``result.kept_bytes`` when no file can be made (nothing
        was called: the caller loads as it would have). A source of another shape raises ValueError (the
        file is then dropped: no half-written tensor is handed out). ``wrap`` makes each tensor what is handed out
        (e.g. a ``torch.nn.Parameter``): the file stays mapped while any of those lives."""
        result = MoveResult()
        sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype, _ in items]
        size, total = sum(sizes), sum(_aligned(n) for n in sizes)
        why = self.unavailable() or (self._no_room(total) if total else None)
        if why is not None:
            result.keep(why, size)
            return None, result
        if not total:  # only empty tensors: nothing to write, no file
            empty = [torch.empty(shape, dtype=dtype) for shape, dtype, _ in items]
            return [wrap(t) for t in empty] if wrap is not None else empty, result
        start = time.perf_counter()
        try:
            mapping = self._map_new(total)
        except OSError as err:
            result.keep(f"the weights file could not be made in {self.folder} ({err})", size)
            return None, result
        out: list[torch.Tensor] = []
        offset = since_drop = 0
        try:
            with torch.no_grad():
                for (shape, dtype, source), nbytes in zip(items, sizes):
                    dest = torch.frombuffer(mapping.mm, dtype=torch.uint8, count=nbytes, offset=offset) \
                        if nbytes else torch.empty(0, dtype=torch.uint8)
                    target = dest.view(dtype).view(shape)
                    value = source()
                    if tuple(value.shape) != tuple(target.shape):
                        raise ValueError(f"a source of shape {tuple(value.shape)} for a tensor of shape "
                                         f"{tuple(target.shape)}")
                    target.copy_(value)
                    del value
                    out.append(target)
                    offset += _aligned(nbytes)
                    since_drop += nbytes
                    if since_drop >= _DROP_EVERY:
                        mapping.mm.madvise(mmap.MADV_DONTNEED)
                        since_drop = 0
        except BaseException:
            out.clear()  # no half-written tensor is handed out; the file goes with its mapping
            try:
                mapping.mm.close()
            except BufferError:
                pass
            raise
        mapping.mm.madvise(mmap.MADV_DONTNEED)
        if wrap is not None:
            out = [wrap(t) for t in out]
        mapping.tensors.extend(weakref.ref(t) for t in out)
        with self._lock:
            self._maps.append(mapping)
            self._start_keeper()
        result.moved_bytes = size
        result.seconds = time.perf_counter() - start
        logger.info("wrote %s of weights (%d tensors) into a memory-mapped file in %s in %.1fs",
                    format_bytes(size), len(out), self.folder, result.seconds)
        return out, result

    def arrays(self, sizes: Sequence[int]) -> list[np.ndarray] | None:
        """Writable uint8 arrays of ``sizes`` bytes, in a new file: for constants a build makes that OpenVINO's CPU
        plugin keeps beside its packed copy (8-bit weights, :mod:`ov_backend.compress`), so their pages leave the
        process as PyTorch's do. The file lives while any of the arrays (or a view, an OpenVINO constant sharing
        one) does. None when no file can be made here (the caller keeps them in memory)."""
        total = sum(_aligned(n) for n in sizes)
        if not total or self.unavailable() or self._no_room(total):
            return None
        try:
            mapping = self._map_new(total, arrays=True)
        except OSError as err:
            logger.warning("8-bit weights stay in memory: no file in %s (%s)", self.folder, err)
            return None
        out, offset = [], 0
        for n in sizes:
            out.append(np.frombuffer(mapping.mm, dtype=np.uint8, count=n, offset=offset))
            offset += _aligned(n)
        with self._lock:
            self._maps.append(mapping)
            self._start_keeper()
        return out

    def _forget(self, key: int, ref: weakref.ref[torch.Tensor]) -> None:
        def remove() -> None:
            if self._seen.get(key) is ref:
                del self._seen[key]

        self._forget_later(remove)

    def _no_room(self, total: int) -> str | None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            stat = os.statvfs(self.folder)
        except OSError as err:
            return f"the weights folder {self.folder} cannot be used ({err})"
        free = stat.f_bavail * stat.f_frsize
        if free < total + MIN_FREE_AFTER:
            return (f"{format_bytes(free)} free in {self.folder}, and the weights need {format_bytes(total)} "
                    f"with {format_bytes(MIN_FREE_AFTER)} to spare")
        return None

    def _map_new(self, total: int, arrays: bool = False) -> _Mapping:
        path = self.folder / f".ov-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # reserve the blocks now: writing into a mapping of a file the disk has no room for is a SIGBUS
            os.posix_fallocate(fd, 0, total)
            mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
            os.unlink(path)  # the mapping keeps the data; nothing is left on disk after the process
        return _Mapping(mm, total, path, arrays)

    # -- memory ------------------------------------------------------------------------------------------
    def _start_keeper(self) -> None:
        with self._lock:
            if self._keeper is None:
                self._keeper = threading.Thread(target=self._keep, name="ov_backend_weight_pages", daemon=True)
                self._keeper.start()

    def _keep(self) -> None:
        """Drop the files' pages every :data:`PACKING_DROP_SECONDS` while a model packs, every
        :data:`IDLE_DROP_SECONDS` otherwise, until no file is mapped: whatever read them (OpenVINO packing its
        copy, PyTorch running a part or a whole stock generation, a LoRA written) gives them back to the page cache
        within that time, so PyTorch's copy never builds up in the process again. Dropping pages is always safe."""
        while True:
            with self._lock:
                if not self._maps:
                    self._keeper = None
                    return
                interval = PACKING_DROP_SECONDS if self._packing else IDLE_DROP_SECONDS
            if self._wake.wait(interval):
                self._wake.clear()
            self.drop_resident()

    @contextmanager
    def packing(self) -> Iterator[None]:
        """While in it, the pages leave every :data:`PACKING_DROP_SECONDS` (a model compiles and packs its
        weights: it reads all of them within seconds); at its start and end, at once."""
        self.drop_resident()
        with self._lock:
            self._packing += 1
        self._wake.set()
        try:
            yield
        finally:
            with self._lock:
                self._packing -= 1
            self.drop_resident()

    def drop_resident(self) -> None:
        """Take the files' pages out of the process (they stay in the file and the page cache); whatever
        reads them next faults them back in. Always safe. Files none of whose tensors is alive are closed
        when nothing else maps their memory."""
        with self._lock:
            for m in list(self._maps):
                if not m.alive():
                    try:
                        m.mm.close()
                    except BufferError:  # a converted model or a view still reads it: keep it mapped
                        pass
                    else:
                        self._maps.remove(m)
                        continue
                m.mm.madvise(mmap.MADV_DONTNEED)

    def file_bytes(self, arrays: bool = False) -> int:
        """Bytes of the files of PyTorch's weights mapped now (``arrays``: of :meth:`arrays`' files), on disk until
        they are closed."""
        with self._lock:
            return sum(m.size for m in self._maps if m.arrays == arrays)

    def resident_bytes(self, arrays: bool = False) -> int | None:
        """Bytes of the pages of PyTorch's weights' files (``arrays``: of :meth:`arrays`' files) in the process now
        (``/proc/self/smaps``); None where it cannot be read."""
        with self._lock:
            ranges = [(m.start, m.start + m.size) for m in self._maps if m.arrays == arrays]
        if not ranges:
            return 0
        try:
            with open("/proc/self/smaps", encoding="utf-8") as f:
                text = f.read()
        except OSError:
            return None
        total = 0
        current = False
        header = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")
        for line in text.splitlines():
            found = header.match(line)
            if found:
                lo, hi = int(found.group(1), 16), int(found.group(2), 16)
                current = any(lo < end and start < hi for start, end in ranges)
            elif current and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
        return total

    def close(self) -> None:
        """Close every file whose memory nothing reads any more (the others stay mapped)."""
        with self._lock:
            for m in list(self._maps):
                try:
                    m.mm.close()
                except BufferError:
                    continue
                self._maps.remove(m)


class WeightHome:
    """A backend's use of a :class:`WeightFile`: moves a graph's weights before its first conversion, and
    never moves a tensor a conversion may already read.

    Args:
        file: the file(s) weights move into (one may serve several backends: they then agree on what
            was converted).
        stats: the backend's counters (``weights_moved_bytes``, ``weights_move_seconds``, ``weights_kept_bytes``).
    """

    def __init__(self, file: WeightFile, stats: StatsCounter) -> None:
        self.file = file
        self._stats = stats

    def before_build(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Move what of ``tensors`` can move (none that any build saw before); returns whether any moved."""
        result = self.file.take(tensors)
        self._stats.add(weights_moved_bytes=result.moved_bytes, weights_move_seconds=result.seconds,
                        compile_seconds=result.seconds, weights_kept_bytes=sum(result.kept_bytes.values()))
        for why, nbytes in result.kept_bytes.items():
            logger.warning("%s of PyTorch's weights stay in memory beside OpenVINO's copy: %s",
                           format_bytes(nbytes), why)
        return bool(result.moved_bytes)

    @contextmanager
    def packing(self) -> Iterator[None]:
        """While OpenVINO compiles a model and packs its weights (its first inference), or the weights are
        fingerprinted: each weight is read once, so the pages read leave the process every
        :data:`PACKING_DROP_SECONDS` instead of every :data:`IDLE_DROP_SECONDS`, and the file's pages never add up
        to a whole model beside OpenVINO's copy (a full SDXL UNet: 9.6 GiB at f32). Afterwards every page goes,
        and the C heap gives back what compiling freed."""
        try:
            with self.file.packing():
                yield
        finally:
            give_back_freed_memory()  # what compiling freed
