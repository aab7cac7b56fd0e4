"""One rank's files: stream a serialization plan or an async save's snapshot into the
pending location, checksum it while writing, make it durable; or, after a ``saving()``
block, checksum and fsync the files another writer left there.

Called on the rank that writes, from the thread that saves (the caller's own thread for
a sync save, the background thread for an async one), between step 1 and step 3 of the
commit (DESIGN "The save protocol": step 2). The returned :class:`RankReport` is what
the rank sends to its domain's leader; the manifest lists its files.

Contract of :func:`write_plan` and :func:`write_image`:

- What they write: one file, ``path``, which the caller chose inside the pending
  location (DESIGN invariant 2: writes go only there); the report names it ``rel``, its
  path relative to the pending location. Its size is passed to the storage as
  ``size_hint``, so a local disk reserves the space and a full disk fails at open,
  before a byte is written.
- When they fsync: the file, through the descriptor that wrote it (the writer's
  ``close``), before they return. The entry of the file in its directory is made
  durable by the commit, which fsyncs the pending directory before the manifest.
- What the report promises: the file's exact size in bytes and the checksum
  (``Hasher``: the manifest's algorithm) of exactly those bytes, computed from the
  bytes as they were handed to the storage, never by reading the file back; ``write_s``
  is the time from the call until every byte is written and hashed, ``fsync_s`` the
  time of the final close (fsync).
- Errors: the storage's (``StorageError`` and its subclasses, mapped at the storage
  boundary: ``StorageFullError`` at open or at a write), ``SaveAbandonedError`` when
  an async save's ``cancel`` is set, and whatever the plan or snapshot raises. On any
  error, ``KeyboardInterrupt`` included, the partial file is removed (the writer's
  ``abort``) and no helper thread is left behind; the error is raised unchanged, and
  the commit turns it into every rank's error.
- The fault point ``mid_write`` fires after the first chunk is written (some bytes
  written, the rest not, nothing fsync'd).

O_DIRECT: where the storage declares direct I/O (``capabilities.direct_io``, a
:class:`.storage.base.DirectIOStorage`: local disks) and says it is enabled for this
root, a file of at least 4 MiB goes to the device by DMA from page-aligned memory,
skipping the copy into the page cache. A sync save copies the plan's chunks through a
few reused page-aligned :class:`Staging` buffers; an async save writes straight from
its snapshot image, which is page-aligned already. The storage's writer pads the last
block and cuts the file back to its size at close, so both paths write the same bytes
as the page cache does. A storage that does not declare direct I/O is never asked.

:func:`report_files` (``saving()`` blocks, whose writers such as ``save_pretrained``
neither checksum nor fsync) writes nothing: on the leader, after every rank's block,
it reads every file under the pending location, checksums it, fsyncs it (on a mounted
filesystem) and then every directory below the pending location, deepest first.

Nothing here imports the manager or the commit protocol: the commit imports
:class:`RankReport` from here.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from . import device_staging
from ._faults import fault_point
from .errors import CheckpointError, CommitError, SaveAbandonedError
from .layout import MANIFEST_NAME, validate_relative_path
from .manifest import FileEntry, Hasher
from .storage import posix
from .storage.base import DIRECT_IO_ALIGN, DirectWriter, Done, Storage, Writer, direct_io

__all__ = ["RankReport", "Staging", "merge_reports", "report_files", "write_image", "write_plan"]


@dataclass(frozen=True)
class RankReport:
    """What one rank tells the coordinator after writing: every file it wrote (path
    relative to the pending location, size, checksum, rank), and how long the writes
    and the fsyncs took."""

    files: tuple[FileEntry, ...]
    write_s: float
    fsync_s: float


def merge_reports(reports: Sequence[RankReport]) -> tuple[FileEntry, ...]:
    """Every rank's files, for the manifest, sorted by path. A file two ranks report
    alike (a file every rank of a ``saving()`` block rewrote) is listed once; two ranks
    that wrote one path with different content fail the save: each rank writes only
    its own files."""
    seen: dict[str, FileEntry] = {}
    for r in reports:
        for f in r.files:
            other = seen.get(f.path)
            if other is not None and (other.size_bytes, other.checksum) != (
                f.size_bytes,
                f.checksum,
            ):
                raise CommitError(
                    f"ranks {other.rank} and {f.rank} both wrote {f.path!r} with different "
                    "content; each rank must write only its own files"
                )
            seen.setdefault(f.path, f)
    return tuple(sorted(seen.values(), key=lambda f: f.path))


def report_files(storage: Storage, pending: str, rank: int) -> RankReport:
    """Files mode: the leader checksums and fsyncs every file (arbitrary writers, such
    as ``save_pretrained``, neither checksum nor fsync), after every rank has written.

    Every file under ``pending`` is listed with ``rank``; ``write_s`` is the time to
    read and fsync the files, ``fsync_s`` the time to fsync the directories."""
    storage.refresh(pending)
    t = time.perf_counter()
    entries = []
    local = storage.local_path(pending)
    for rel, _size in storage.walk_files(pending):
        if rel == MANIFEST_NAME:
            # The commit writes the manifest there, over this file: the checkpoint would
            # list a file that is not what it says (corrupt from its first commit).
            raise CheckpointError(
                f"the save wrote a file named {MANIFEST_NAME!r} at the top of the "
                f"checkpoint ({storage.url(pending + '/' + rel)}); that name is the "
                "manifest's, which the commit writes. Nothing was committed. Was an "
                "earlier checkpoint copied in whole? Copy its data files only"
            )
        try:
            validate_relative_path(rel)
        except ValueError as exc:
            # Committed, it was a checkpoint that every reader refuses (as corrupt).
            raise CheckpointError(
                f"the save wrote {storage.url(pending + '/' + rel)!r}, which a manifest "
                f"cannot list: {exc} (a backslash, or a name starting with a letter and "
                "a colon, reads as a Windows path). Nothing was committed; give the file "
                "another name"
            ) from None
        h = Hasher()
        path = storage.local_path(f"{pending}/{rel}") if local else None
        with storage.open_read(f"{pending}/{rel}") as f:
            size = h.consume(f, memoryview(bytearray(8 << 20)))
            if path is not None:
                posix.fsync_file(path, f)
        entries.append(FileEntry(rel, size, h.hexdigest(), rank))
    t_write = time.perf_counter() - t
    t = time.perf_counter()
    if local is not None:
        # Every directory the block created, not only the parents of files: a directory
        # holding only subdirectories has entries too, and they are durable only once
        # it is fsync'd (DESIGN invariant 2). Bottom-up, so each directory is fsync'd
        # after everything below it is final; symlinked directories are not followed.
        for rel in posix.dirs_deepest_first(local):
            storage.fsync_dir(f"{pending}/{rel}" if rel else pending)
    return RankReport(tuple(entries), t_write, time.perf_counter() - t)


# Below this size hashing runs inline: a helper thread costs more than it saves.
_PIPELINE_MIN_BYTES = 16 << 20


class _HashPipe:
    """Feeds a ``Hasher`` from a helper thread, so the checksum of one chunk is computed
    while the next chunk is written (loads hash as their reads come in, in
    ``serialization._read_pieces``).

    xxhash and ``os.write`` release the GIL, so with two cores the checksum costs no
    wall time (in line, it adds ~6 % to a disk-speed write: xxh3 runs at ~17 GB/s
    here). Chunks are hashed in the order they are fed; a fed chunk must stay unchanged
    until ``close`` (the chunks of a plan do).
    """

    _DEPTH = 4  # chunks queued ahead of the hasher (references, not copies)
    _IDLE_S = 60.0  # a producer that vanished without close() frees the thread

    def __init__(self, hasher: Hasher, *, background: bool):
        self.hasher = hasher
        self._error: BaseException | None = None
        self._q: queue.Queue[Any] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._q = queue.Queue(maxsize=self._DEPTH)
            self._thread = threading.Thread(
                target=self._run, name="atomic-checkpoint-hash", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        q = self._q
        if q is None:  # pragma: no cover - only started with a queue
            return
        while True:
            try:
                data = q.get(timeout=self._IDLE_S)
            except queue.Empty:
                return
            if data is None:
                return
            if self._error is None:
                try:
                    self.hasher.update(data)
                except BaseException as exc:  # re-raised by close() in the producer
                    self._error = exc

    @property
    def background(self) -> bool:
        """Whether fed chunks are hashed later, on the helper (so must stay unchanged)."""
        return self._q is not None

    def update(self, data: Any) -> None:
        if self._q is None:
            self.hasher.update(data)
        else:
            self._q.put(data)

    def close(self) -> None:
        """Wait until every fed chunk is hashed; stop the helper. Idempotent."""
        t, self._thread = self._thread, None
        if t is not None and self._q is not None:
            self._q.put(None)
            t.join()
        if self._error is not None:
            raise self._error

    def hexdigest(self) -> str:
        self.close()
        return self.hasher.hexdigest()


# Files at least this large are written with O_DIRECT where the storage offers it.
_DIRECT_MIN_BYTES = 4 << 20
# An async save writes its snapshot image in chunks of this size (fewer, larger writes
# disturb the training thread's copy less while they overlap it).
_IMAGE_CHUNK_BYTES = 32 << 20


def _abandoned(storage: Storage, path: str, step: int) -> SaveAbandonedError:
    return SaveAbandonedError(
        f"the write of {storage.url(path)} was stopped: the async save of step {step} was "
        "abandoned (manager closed or interpreter exiting)"
    )


def _open_direct(storage: Storage, path: str, size: int) -> DirectWriter | None:
    """An O_DIRECT writer for a large file where the storage offers one, else None."""
    store = direct_io(storage)  # declared by the storage's capabilities, never probed
    if store is None or size < _DIRECT_MIN_BYTES:
        return None
    try:
        import numpy  # noqa: F401  (the staging copies need it)
    except ImportError:
        return None
    return store.open_write_direct(path, size_hint=size)


class Staging:
    """Page-aligned host buffers that a sync save copies its tensors through on their way
    to an O_DIRECT write: a few chunks, allocated by the first save and reused by every
    later one (on these VMs memory freed and touched again costs up to 15x)."""

    COUNT = 4  # chunks in flight: two being written, one being filled, one spare

    def __init__(self) -> None:
        self._chunk = 0
        self.arrays: list[Any] = []

    def buffers(self, chunk: int) -> list[Any]:
        if chunk > self._chunk:
            import numpy as np

            # Private anonymous memory (numpy's), one block cut to alignment: pages for
            # chunks of 2 MiB and more, huge-page boundaries for larger ones (numpy asks
            # for transparent huge pages; fewer pages to pin per O_DIRECT write). Not
            # mmap.mmap(-1, n): that is a *shared* mapping, backed by shmem, whose pages
            # the kernel pins for each O_DIRECT write far more slowly (measured: 2.1
            # against 3.0 GB/s).
            align = max(DIRECT_IO_ALIGN, min(chunk, 2 << 20))
            self.arrays = []
            raw = np.empty(self.COUNT * chunk + align, dtype=np.uint8)
            skip = -raw.ctypes.data % align
            for i in range(self.COUNT):
                start = skip + i * chunk
                self.arrays.append(raw[start : start + chunk])
            self._chunk = chunk
        return [a[:chunk] for a in self.arrays]


def _staging_chunk(total: int) -> int:
    """1 to 8 MiB, a power of two, at most 1/64 of the file: the staging buffers stay
    under 1/16 of the state (the sync save's memory target is 5 % of the state)."""
    chunk = 1 << 20
    while chunk < (8 << 20) and chunk * 2 * 64 <= total:
        chunk *= 2
    return chunk


def write_plan(
    storage: Storage,
    path: str,
    rel: str,
    plan: Any,
    rank: int,
    step: int,
    staging: Staging | None = None,
) -> RankReport:
    """Stream a serialization plan to ``path``, hashing each chunk as it is written.

    With ``staging`` and a storage that offers O_DIRECT (local disks), the bytes are
    copied through page-aligned staging buffers and written from there by DMA, two
    writes in flight; otherwise they go through the page cache.
    """
    t = time.perf_counter()
    total = plan.total_size_bytes
    dw = _open_direct(storage, path, total) if staging is not None else None
    # Through the page cache, the checksum runs on a helper core while this thread
    # copies into the kernel; with O_DIRECT it runs here, on each chunk just before it
    # is copied into staging (the copy then reads it from cache): this thread is far
    # ahead of the disk either way, and a second reader of every byte only competes
    # for memory bandwidth (measured: 0.36 against 0.42 of the page-cache write's time).
    # Opened (space reserved: ENOSPC comes here) before the hashing helper starts, so
    # a full disk leaves no helper thread behind.
    w: Writer | None = None
    h: _HashPipe | None = None
    try:
        # Inside the try: an interrupt between these left an open file (its blocks in
        # use once it was deleted) and I/O threads blocked for ever.
        w = storage.open_write(path, size_hint=total) if dw is None else None
        h = _HashPipe(Hasher(), background=dw is None and total >= _PIPELINE_MIN_BYTES)
        if dw is not None and staging is not None:
            size = _stream_direct(dw, plan, h, staging, rank, step)
        else:
            if w is None:  # pragma: no cover - a direct writer without staging
                w = storage.open_write(path, size_hint=total)
            size = _stream_buffered(w, plan, h, rank, step)
        digest, t_write, t_fsync = _finish(t, h, dw, w, size)
    except BaseException:
        _abort_write(h, dw, w)
        raise
    return RankReport((FileEntry(rel, size, digest, rank),), t_write, t_fsync)


def _stream_buffered(w: Writer, plan: Any, h: _HashPipe, rank: int, step: int) -> int:
    """Write the plan's chunks through the page cache; ``h`` hashes the same chunks
    (on its helper thread for a large plan)."""
    size = 0
    for i, chunk in enumerate(plan.iter_chunks()):
        h.update(chunk)
        w.write(chunk)
        size += len(chunk) if isinstance(chunk, bytes) else memoryview(chunk).nbytes
        if i == 0:  # some bytes written, the rest not, nothing fsync'd
            fault_point("mid_write", rank, step)
    return size


def _stream_direct(
    dw: DirectWriter, plan: Any, h: _HashPipe, staging: Staging, rank: int, step: int
) -> int:
    """Copy the plan's chunks into staging buffers and write each full buffer with
    O_DIRECT; the checksum is computed (by ``h``'s helper) from the same chunks.

    GPU tensors come to the host through page-locked slots (``device_staging``): each
    chunk is copied there by DMA while the one before it is copied into staging (this
    loop is done with a chunk before it asks for the next, which
    ``iter_chunks(staging=)`` requires)."""
    if not plan.on_gpu():
        return _stage_and_write(dw, plan, h, staging, None, rank, step)
    if h.background:  # pragma: no cover - write_plan hashes in line here
        raise AssertionError("a hashing queue would hold chunks of reused slots")
    with device_staging.borrowed(sys.modules["torch"], pin=True) as ring:
        return _stage_and_write(dw, plan, h, staging, ring, rank, step)


def _stage_and_write(
    dw: DirectWriter,
    plan: Any,
    h: _HashPipe,
    staging: Staging,
    ring: device_staging.DeviceStaging | None,
    rank: int,
    step: int,
) -> int:
    import numpy as np

    chunk = _staging_chunk(plan.total_size_bytes)
    bufs = staging.buffers(chunk)
    in_flight: list[Done | None] = [None] * len(bufs)
    k, fill, offset, size = 0, 0, 0, 0
    cur = bufs[0]
    for i, piece in enumerate(plan.iter_chunks(chunk, staging=ring)):
        h.update(piece)
        src = np.frombuffer(piece, dtype=np.uint8)
        pos, n_src = 0, int(src.size)
        while pos < n_src:
            n = min(n_src - pos, chunk - fill)
            cur[fill : fill + n] = src[pos : pos + n]  # numpy copies without the GIL
            fill += n
            pos += n
            if fill == chunk:
                in_flight[k] = dw.submit(memoryview(cur), offset)
                offset += chunk
                fill = 0
                k = (k + 1) % len(bufs)
                done = in_flight[k]
                if done is not None:
                    done.wait()  # that buffer's previous write is finished
                cur = bufs[k]
        size += n_src
        if i == 0:  # some bytes written, the rest not, nothing fsync'd
            fault_point("mid_write", rank, step)
    if fill:
        padded = -(-fill // DIRECT_IO_ALIGN) * DIRECT_IO_ALIGN
        cur[fill:padded] = 0  # the file is cut back to its size at close
        dw.submit(memoryview(cur)[:padded], offset)
    return size


def write_image(
    storage: Storage,
    path: str,
    rel: str,
    snap: Any,
    rank: int,
    step: int,
    cancel: threading.Event,
    demote: Callable[[], None] | None = None,
) -> RankReport:
    """Write an async save's snapshot image to ``path`` while the training thread
    copies it (``snap.wait_ready``), and checksum it.

    Where the storage offers O_DIRECT (local disks) each chunk goes to the device by DMA
    straight from the page-aligned image as soon as the writer learns it is copied (by
    default once the whole copy is done, so that the writes do not slow the training
    thread's copy; see ``Snapshot._copy``): nothing is copied again, and the save is
    durable about when a sync save would be. The checksum is computed afterwards from
    the image (it does not change), by this thread at its lowered priority (``demote()``
    is called once the copy is complete: while training copies, this thread must keep up
    with it). Else
    the image goes through the page cache, hashed on a helper core as it is written.

    ``cancel``: when set, the write stops at the next chunk and fails.
    """
    t = time.perf_counter()
    total = snap.total_size_bytes
    image = snap.image
    # Opened (its space reserved) once the first chunk is copied, not while training
    # copies: on tmpfs, reserving allocates and zeroes every page, and beside the copy
    # it slowed it 2-4x (1 GiB on 2 cores: 0.19-0.40 s against 0.09 s without it). The
    # writer learns of copied bytes at the end of the copy by default, so the space is
    # still reserved before any byte is written: a full disk fails the save as before.
    snap.wait_ready(min(_IMAGE_CHUNK_BYTES, total))
    dw = _open_direct(storage, path, total)
    w = None if dw is not None else storage.open_write(path, size_hint=total)
    h = _HashPipe(Hasher(), background=dw is None and total >= _PIPELINE_MIN_BYTES)
    chunks = range(0, max(total, 1), _IMAGE_CHUNK_BYTES)
    last = None
    try:
        for i, start in enumerate(chunks):
            if cancel.is_set():
                raise _abandoned(storage, path, step)
            end = min(start + _IMAGE_CHUNK_BYTES, total)
            snap.wait_ready(end)
            if dw is not None:
                if last is not None and not snap.is_complete():
                    # One write in flight while training still copies, two after: the
                    # DMA competes with the copy for memory bandwidth (measured at 4
                    # GiB, time blocked / plain copy and time durable / sync save: 1.17
                    # and 0.97 with two, 1.04 and 1.01 with one, 0.96 and 1.11 when
                    # nothing is written until the copy ends).
                    last.wait()
                # The image is zero-padded to a whole page: the last write is too.
                last = dw.submit(image[start : min(start + _IMAGE_CHUNK_BYTES, len(image))], start)
            elif w is not None:
                h.update(image[start:end])
                w.write(image[start:end])
            if i == 0:  # some bytes written, the rest not, nothing fsync'd
                fault_point("mid_write", rank, step)
        if demote is not None:
            demote()
        if dw is not None:
            for start in chunks:  # while the last writes are in flight
                if cancel.is_set():
                    raise _abandoned(storage, path, step)
                h.update(image[start : min(start + _IMAGE_CHUNK_BYTES, total)])
        digest, t_write, t_fsync = _finish(t, h, dw, w, total)
    except BaseException:
        _abort_write(h, dw, w)
        raise
    return RankReport((FileEntry(rel, total, digest, rank),), t_write, t_fsync)


def _finish(
    t: float, h: _HashPipe, dw: DirectWriter | None, w: Writer | None, size: int
) -> tuple[str, float, float]:
    """The checksum and the last writes, then the fsync (the writer's close). Returns
    the checksum, the time from ``t`` until every byte was written and hashed, and the
    time of the close."""
    digest = h.hexdigest()
    if dw is not None:
        dw.drain()
    t_write = time.perf_counter() - t
    t = time.perf_counter()
    if dw is not None:
        dw.close(size)
    elif w is not None:
        w.close()
    return digest, t_write, time.perf_counter() - t


def _abort_write(h: _HashPipe | None, dw: DirectWriter | None, w: Writer | None) -> None:
    """After any failure: stop the hashing helper (its own error, if any, gives way to
    the one being raised) and remove the partial file."""
    if h is not None:
        with contextlib.suppress(BaseException):
            h.close()
    if dw is not None:
        dw.abort()
    elif w is not None:
        w.abort()
