"""``FsspecStorage``: object stores (S3, GCS, Azure, ...) and any other fsspec URL.

An object store has keys, not directories: "renaming a directory" is a copy of every
object followed by a delete, which can stop half way and leave both copies
(``fs.mv(..., recursive=True)`` does exactly that). So this backend never renames;
checkpoints are committed with the marker strategy (``commit.MarkerStrategy``): data is
written in place under its final name and the manifest, created once, is the commit::

    before commit                                  after commit
    s3://bucket/prefix/                            s3://bucket/prefix/
      checkpoint-100/      (previous, untouched)     checkpoint-100/
      checkpoint-200/                                checkpoint-200/
        checkpoint.pending-<attempt>.json              attempt-<attempt>/rank-00000.safetensors
        attempt-<attempt>/rank-00000.safetensors       attempt-<attempt>/rank-00001.safetensors
        attempt-<attempt>/rank-00001.safetensors       checkpoint.manifest.json  (created once)

Rules this backend follows, each a property of the stores:

- One PUT is atomic: a reader sees the old object, the new one, or none, never a part.
  ``write_bytes_atomic`` is therefore a plain PUT, and a multipart upload becomes
  visible only when it completes (an aborted one leaves nothing).
- ``create_exclusive`` is a conditional PUT (``If-None-Match: *``) where the store
  offers one (S3 and S3-compatible servers that implement it, ``memory://``,
  ``file://``): of two writers racing, exactly one gets True.
- Listings are never cached (``use_listings_cache=False`` is forced): with the cache, a
  client answers ``ls`` from a stale copy after another client committed or deleted.
- S3 has been strongly consistent for reads after writes, overwrites, deletes and
  listings since December 2020, so the store counts as coherent.

fsspec (and the store's driver, e.g. s3fs) is imported only when an ``FsspecStorage``
is created: ``import atomic_checkpoint`` never imports it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    StorageError,
    map_os_error,
)
from .base import Reader, StorageCapabilities

log = logging.getLogger("atomic_checkpoint")

#: Protocols whose paths start with a bucket (or container) and that have no real
#: directories: ``makedirs`` is a no-op there and an empty "directory" does not exist.
OBJECT_STORES = frozenset(
    {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2", "tos", "cos", "obs"}
)

#: Protocols whose driver turns ``open(path, "xb")`` / ``pipe_file(mode="create")`` into
#: a create-if-absent that excludes every other client (S3: ``If-None-Match: *``,
#: checked against a real S3 server in tests/storage and tests/netfs).
CONDITIONAL_CREATE = frozenset({"s3", "s3a", "memory", "file", "local"})

_LOCAL = frozenset({"file", "local"})
_DEFAULT_BLOCK = 32 << 20  # multipart part size: S3 needs >= 5 MiB, at most 10,000 parts
_READAHEAD = 1 << 20  # small reads (headers) are served from one ranged GET of this size
_RANGE = 16 << 20  # a large readinto is split into ranged GETs of this size, fetched together


def _protocol(fs: Any) -> str:
    proto = fs.protocol
    return str(proto if isinstance(proto, str) else proto[0])


def _errno_of(exc: BaseException) -> int | None:
    code = getattr(exc, "errno", None)
    if isinstance(code, int):
        return code
    # fsspec drivers raise the builtin subclasses, often without an errno.
    for typ, value in (
        (FileNotFoundError, errno.ENOENT),
        (FileExistsError, errno.EEXIST),
        (PermissionError, errno.EACCES),
        (IsADirectoryError, errno.EISDIR),
        (NotADirectoryError, errno.ENOTDIR),
        (TimeoutError, errno.ETIMEDOUT),
        (ConnectionError, errno.ECONNRESET),
    ):
        if isinstance(exc, typ):
            return value
    return None


class FsspecStorage:
    """Storage at any fsspec URL: ``s3://bucket/prefix``, ``gs://...``, ``memory://x``,
    ``file:///path``.

    Args:
        url: the checkpoint root.
        storage_options: passed to the fsspec filesystem (for S3: ``key``, ``secret``,
            ``client_kwargs={"endpoint_url": ...}``, ``profile``, ...), exactly as
            ``fsspec.open(url, **storage_options)`` takes them.
        capabilities: override what the backend claims (e.g. ``exclusive_create=False``
            for an S3-compatible server that ignores ``If-None-Match``).
        block_size_bytes: multipart part size for writes (S3: at least 5 MiB).

    Raises:
        ImportError: fsspec, or the driver for the URL's protocol (s3fs, gcsfs, ...),
            is not installed; the message names the ``pip install`` command.
        StorageError: the URL cannot be opened with these options.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        capabilities: StorageCapabilities | None = None,
        block_size_bytes: int = _DEFAULT_BLOCK,
    ):
        try:
            from fsspec.core import url_to_fs
        except ImportError as exc:
            raise ImportError(
                f"FsspecStorage({url!r}) needs fsspec: pip install 'atomic-checkpoint[fsspec]' "
                "(for s3:// also s3fs: pip install 'atomic-checkpoint[s3]')"
            ) from exc
        opts = dict(storage_options or {})
        if opts.get("use_listings_cache"):
            log.warning(
                "FsspecStorage(%s): ignoring use_listings_cache=True; a cached listing "
                "hides other clients' commits and deletes",
                url,
            )
        opts["use_listings_cache"] = False
        try:
            fs, root = url_to_fs(url, **opts)
        except ImportError as exc:
            scheme = url.split("://", 1)[0]
            raise ImportError(
                f"no fsspec driver for {scheme}:// is installed ({exc}); for s3:// run "
                "pip install 'atomic-checkpoint[s3]', for gs:// pip install gcsfs, for "
                "az:// pip install adlfs"
            ) from exc
        except (ValueError, TypeError, OSError) as exc:
            raise StorageError(
                f"cannot open checkpoint root {url!r} with fsspec: {exc}. Check the URL "
                "and storage_options"
            ) from exc
        self.fs = fs
        self.protocol = _protocol(fs)
        self._root = str(root).rstrip("/") or ("/" if str(root).startswith("/") else "")
        self._is_local = self.protocol in _LOCAL
        self._is_object_store = self.protocol in OBJECT_STORES
        self.block_size_bytes = max(int(block_size_bytes), 5 << 20)
        self.capabilities = capabilities or StorageCapabilities(
            name=self.protocol,
            # fsspec's mv of a directory is copy-then-delete on object stores and in
            # memory; even on file:// it would replace an empty target. Never a commit.
            atomic_dir_rename=False,
            dir_fsync=self._is_local and os.name != "nt",
            exclusive_create=self.protocol in CONDITIONAL_CREATE,
            coherent=True,
        )
        self._bucket_checked = False

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url()!r})"

    # ------------------------------------------------------------------ paths
    def _abs(self, rel: str) -> str:
        rel = rel.strip("/")
        if not rel:
            return self._root
        if self._root in ("", "/"):
            return f"{self._root}{rel}"
        return f"{self._root}/{rel}"

    def url(self, path: str = "") -> str:
        return str(self.fs.unstrip_protocol(self._abs(path)))

    def local_path(self, path: str = "") -> str | None:
        return self._abs(path) if self._is_local else None

    def _rel_children(self, base: str, names: list[str]) -> list[str]:
        prefix = base.rstrip("/") + "/"
        out = set()
        for name in names:
            name = name.rstrip("/")
            if name.startswith(prefix) and len(name) > len(prefix):
                out.add(name[len(prefix) :].split("/", 1)[0])
        return sorted(out)

    # ------------------------------------------------------------------ errors
    def _error(self, exc: BaseException, action: str, rel: str) -> CheckpointError:
        """Map a backend error (OSError, botocore, aiohttp, ...) into the error tree."""
        if isinstance(exc, CheckpointError):
            return exc
        where = self.url(rel)
        code = _errno_of(exc)
        if isinstance(exc, OSError) or code is not None:
            text = str(exc) or type(exc).__name__
            err = map_os_error(OSError(code, text), action, where)
            if type(err) is StorageError and "bucket does not exist" in text.lower():
                err = StorageError(
                    f"{action} {where!r} failed: the bucket does not exist. Create it first "
                    "(atomic-checkpoint never creates buckets)",
                    errno=code,
                    path=where,
                )
            return err
        return StorageError(
            f"{action} {where!r} failed: {type(exc).__name__}: {exc}. Check the endpoint, "
            "the credentials and the network (storage_options)",
            path=where,
        )

    @contextlib.contextmanager
    def _mapped(self, action: str, rel: str) -> Iterator[None]:
        try:
            yield
        except CheckpointError:
            raise
        except Exception as exc:  # the storage boundary: nothing but our errors escapes
            raise self._error(exc, action, rel) from exc

    def _not_found(self, rel: str) -> CheckpointNotFoundError:
        return CheckpointNotFoundError(f"{self.url(rel)!r} does not exist")

    # ------------------------------------------------------------------ Storage
    def makedirs(self, path: str) -> None:
        if self._is_object_store:
            # No directories to make; but a missing bucket must fail here, clearly, and
            # never be created behind the user's back (s3fs' makedirs would create it).
            if not self._bucket_checked:
                bucket = self._root.split("/", 1)[0]
                try:
                    # info, not exists: s3fs' exists() answers False for any error,
                    # including bad storage_options, which must not read as "no bucket".
                    self.fs.info(bucket)
                except FileNotFoundError as exc:
                    raise StorageError(
                        f"bucket {bucket!r} of {self.url()!r} does not exist (or these "
                        "credentials cannot see it): create it first",
                        errno=errno.ENOENT,
                        path=self.url(),
                    ) from exc
                except Exception as exc:
                    raise self._error(exc, "open bucket of", "") from exc
                self._bucket_checked = True
            return
        p = self._abs(path)
        with self._mapped("create directory", path):
            if self.fs.isfile(p):
                raise StorageError(
                    f"cannot create directory {self.url(path)!r}: a file with that name exists",
                    errno=errno.EEXIST,
                    path=self.url(path),
                )
            self.fs.makedirs(p, exist_ok=True)

    def open_write(self, path: str, *, size_hint: int | None = None) -> _FsspecWriter:
        return _FsspecWriter(self, path)

    def open_read(self, path: str) -> Reader:
        p = self._abs(path)
        try:
            if self._is_local:
                # file://: the OS file itself, so readinto lands straight in the buffer.
                return open(p, "rb", buffering=0)
            size = self.fs.size(p)
        except FileNotFoundError as exc:
            raise self._not_found(path) from exc
        except Exception as exc:
            raise self._error(exc, "open", path) from exc
        if size is None:
            raise self._not_found(path)
        return _RangeReader(self, path, int(size))

    def read_bytes(self, path: str) -> bytes:
        p = self._abs(path)
        try:
            return bytes(self.fs.cat_file(p))
        except (FileNotFoundError, IsADirectoryError) as exc:
            raise self._not_found(path) from exc
        except Exception as exc:
            raise self._error(exc, "read", path) from exc

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        if self._is_local:
            self._local_publish(path, bytes(data), exclusive=False)
            return
        # One PUT is atomic on object stores (and one dict assignment in memory://):
        # readers see the old object or the new one, never a part of either.
        with self._mapped("write", path):
            self.fs.pipe_file(self._abs(path), bytes(data))

    def create_exclusive(self, path: str, data: bytes) -> bool:
        if self._is_local:
            return self._local_publish(path, bytes(data), exclusive=True)
        p = self._abs(path)
        if not self.capabilities.exclusive_create:
            # No conditional create on this store: check, then write. Two clients can
            # both pass the check; callers (the marker commit) are built to survive it.
            if self.size(path) is not None:
                return False
            self.write_bytes_atomic(path, data)
            return True
        try:
            # s3fs sends If-None-Match: * : the store refuses (412) if the key exists.
            self.fs.pipe_file(p, bytes(data), mode="create")
        except FileExistsError:
            return False
        except Exception as exc:
            raise self._error(exc, "create", path) from exc
        return True

    def _local_publish(self, path: str, data: bytes, *, exclusive: bool) -> bool:
        """file://: write a temporary file, fsync it, then put it in place by rename
        (replace) or hard link (create-once: link fails if the name exists), so no
        reader ever opens a half-written file."""
        final = self._abs(path)
        tmp = f"{final}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            if exclusive:
                try:
                    os.link(tmp, final)
                except FileExistsError:
                    return False
            else:
                os.replace(tmp, final)
        except OSError as exc:
            raise map_os_error(exc, "write", final) from exc
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        self.fsync_dir(path.rsplit("/", 1)[0] if "/" in path else "")
        return True

    def listdir(self, path: str) -> list[str]:
        p = self._abs(path)
        try:
            names = self.fs.ls(p, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except Exception as exc:
            raise self._error(exc, "list", path) from exc
        return self._rel_children(p, [str(n) for n in names])

    def size(self, path: str) -> int | None:
        p = self._abs(path)
        try:
            info = self.fs.info(p)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except Exception as exc:
            raise self._error(exc, "stat", path) from exc
        if info.get("type") != "file" or str(info.get("name", "")).endswith("/"):
            return None
        return int(info["size"])

    def is_dir(self, path: str) -> bool:
        with self._mapped("stat", path):
            return bool(self.fs.isdir(self._abs(path)))

    def walk_files(self, path: str) -> list[tuple[str, int]]:
        p = self._abs(path)
        try:
            found = self.fs.find(p, detail=True)
        except FileNotFoundError:
            return []
        except Exception as exc:
            raise self._error(exc, "walk", path) from exc
        prefix = p.rstrip("/") + "/"
        out = []
        for name, info in found.items():
            name = str(name)
            # "prefix/" keys are directory markers (s3fs-fuse, the S3 console), not files.
            if not name.startswith(prefix) or name.endswith("/") or info.get("type") != "file":
                continue
            out.append((name[len(prefix) :], int(info["size"])))
        return sorted(out)

    def rename_dir(self, src: str, dst: str) -> None:
        raise StorageError(
            f"cannot rename {self.url(src)!r} to {self.url(dst)!r}: {self.protocol}:// has "
            "no atomic directory rename (moving a prefix copies every object, then deletes "
            "it, and can stop half way). Checkpoints here are committed with the marker "
            "strategy, which never renames",
            errno=errno.ENOTSUP,
            path=self.url(src),
        )

    def exchange_dirs(self, a: str, b: str) -> bool:
        return False

    def fsync_dir(self, path: str) -> None:
        # Object stores: an object is durable when its PUT returns; nothing to flush.
        if not self.capabilities.dir_fsync:
            return
        p = self._abs(path)
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as exc:
            raise map_os_error(exc, "open directory", p) from exc
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise map_os_error(exc, "fsync directory", p) from exc
        finally:
            os.close(fd)

    def delete_file(self, path: str) -> None:
        try:
            self.fs.rm_file(self._abs(path))
        except FileNotFoundError:
            pass  # deletes tolerate ENOENT: a concurrent cleaner got there first
        except Exception as exc:
            raise self._error(exc, "delete", path) from exc

    def delete_tree(self, path: str) -> None:
        p = self._abs(path)
        if p.rstrip("/") == self._root.rstrip("/"):
            raise StorageError(
                f"refusing to delete the whole checkpoint root {self.url()!r}",
                path=self.url(),
            )
        try:
            # s3fs: bulk DeleteObjects of every key under "p/" (never "p10/...").
            self.fs.rm(p, recursive=True)
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise self._error(exc, "delete", path) from exc
        self._abort_uploads(path)

    def _abort_uploads(self, path: str) -> None:
        """S3: abort unfinished multipart uploads under ``path``. A writer killed in the
        middle of a large file leaves its uploaded parts invisible but stored (and
        billed) until aborted; the sweep of its attempt gets here."""
        list_uploads = getattr(self.fs, "list_multipart_uploads", None)
        abort = getattr(self.fs, "abort_mpu", None)
        if list_uploads is None or abort is None:
            return
        bucket, _, key = self._abs(path).partition("/")
        prefix = key.rstrip("/") + "/"
        try:
            uploads = list_uploads(bucket)
            for upload in uploads:
                if str(upload.get("Key", "")).startswith(prefix):
                    abort(bucket, upload["Key"], upload["UploadId"])
        except Exception as exc:
            log.warning("could not abort unfinished uploads under %s: %s", self.url(path), exc)

    def refresh(self, path: str) -> None:
        # Listings are never cached (use_listings_cache=False); drop whatever a driver
        # may keep anyway (e.g. file info cached by an open).
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self._abs(path))


class _FsspecWriter:
    """Streams one object. Large writes go out as multipart parts of ``block_size``;
    ``close()`` completes the upload (the object appears whole, at once); ``abort()``
    aborts it, so nothing appears."""

    def __init__(self, storage: FsspecStorage, rel: str):
        self._s = storage
        self._rel = rel
        self._block = storage.block_size_bytes
        with storage._mapped("create", rel):
            self._f: Any = storage.fs.open(storage._abs(rel), "wb", block_size=self._block)

    def write(self, data: bytes | memoryview) -> None:
        f = self._f
        if f is None:
            raise StorageError(f"write to closed file {self._s.url(self._rel)!r}")
        view = memoryview(data).cast("B")
        with self._s._mapped("write", self._rel):
            # Bounded pieces: the driver buffers what it is given before uploading a
            # part, so one multi-GiB tensor must not become one multi-GiB buffer.
            for start in range(0, len(view), self._block):
                f.write(view[start : start + self._block])

    def close(self) -> None:
        f, self._f = self._f, None
        if f is None:
            return
        try:
            if self._s._is_local:
                f.flush()
                os.fsync(f.fileno())
            f.close()
        except BaseException as exc:
            self._discard(f)
            if isinstance(exc, Exception):
                raise self._s._error(exc, "close", self._rel) from exc
            raise

    def abort(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            self._discard(f)

    def _discard(self, f: Any) -> None:
        from fsspec.spec import AbstractBufferedFile

        try:
            # s3fs: AbortMultipartUpload, so no parts linger (and cost) on the bucket.
            f.discard()
        except Exception as exc:
            log.warning("could not abort the upload of %s: %s", self._s.url(self._rel), exc)
        if isinstance(f, AbstractBufferedFile):
            # Buffered (object store) files write only at flush/close: after discard,
            # mark closed so neither we nor the garbage collector uploads the rest.
            f.closed = True
        else:
            with contextlib.suppress(Exception):
                f.close()
        try:
            self._s.delete_file(self._rel)
        except CheckpointError as exc:
            log.warning("could not remove the partial file %s: %s", self._s.url(self._rel), exc)

    def __enter__(self) -> _FsspecWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class _RangeReader:
    """Reads an object with ranged GETs: small reads through a readahead buffer, large
    ``readinto`` calls as several ranges fetched concurrently and copied straight into
    the caller's buffer."""

    def __init__(self, storage: FsspecStorage, rel: str, size: int):
        self._s = storage
        self._rel = rel
        self._path = storage._abs(rel)
        self._size = size
        self._pos = 0
        self._buf = b""
        self._buf_start = 0
        self.closed = False

    def _fetch(self, start: int, end: int) -> list[bytes]:
        """Bytes [start, end) as a list of chunks (one ranged GET each)."""
        starts = list(range(start, end, _RANGE))
        ends = [min(s + _RANGE, end) for s in starts]
        try:
            if len(starts) == 1:
                chunks = [self._s.fs.cat_file(self._path, start=start, end=end)]
            else:
                chunks = self._s.fs.cat_ranges(
                    [self._path] * len(starts), starts, ends, on_error="raise"
                )
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"{self._s.url(self._rel)!r} disappeared while being read (deleted by "
                "retention or by another job?)"
            ) from exc
        except Exception as exc:
            raise self._s._error(exc, "read", self._rel) from exc
        for chunk, s, e in zip(chunks, starts, ends, strict=True):
            if isinstance(chunk, BaseException):
                raise self._s._error(chunk, "read", self._rel) from chunk
            if len(chunk) != e - s:
                raise StorageError(
                    f"read {self._s.url(self._rel)!r}: got {len(chunk)} bytes at offset {s}, "
                    f"expected {e - s} (the object changed while being read?)",
                    path=self._s.url(self._rel),
                )
        return [bytes(c) for c in chunks]

    def readinto(self, buffer: Any, /) -> int:
        out = memoryview(buffer).cast("B")
        want = min(len(out), self._size - self._pos)
        if want <= 0:
            return 0
        done = 0
        # 1. whatever the readahead buffer holds
        off = self._pos - self._buf_start
        if 0 <= off < len(self._buf):
            n = min(want, len(self._buf) - off)
            out[:n] = self._buf[off : off + n]
            done = n
        rest = want - done
        if rest >= _READAHEAD:
            # 2a. large: ranged GETs straight into the caller's memory
            pos = self._pos + done
            for chunk in self._fetch(pos, pos + rest):
                out[done : done + len(chunk)] = chunk
                done += len(chunk)
        elif rest > 0:
            # 2b. small: refill the readahead buffer
            pos = self._pos + done
            self._buf = b"".join(self._fetch(pos, min(pos + _READAHEAD, self._size)))
            self._buf_start = pos
            out[done:want] = self._buf[:rest]
            done = want
        self._pos += done
        return done

    def read(self, size: int = -1, /) -> bytes:
        n = self._size - self._pos if size is None or size < 0 else size
        buf = bytearray(max(0, min(n, self._size - self._pos)))
        got = self.readinto(buf)
        return bytes(buf[:got])

    def seek(self, offset: int, whence: int = 0, /) -> int:
        if whence == os.SEEK_SET:
            pos = offset
        elif whence == os.SEEK_CUR:
            pos = self._pos + offset
        elif whence == os.SEEK_END:
            pos = self._size + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")
        self._pos = pos
        return pos

    def tell(self) -> int:
        return self._pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True
        self._buf = b""

    def __enter__(self) -> _RangeReader:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()
