"""``FsspecStorage``: object stores (S3, GCS, Azure, ...) and any other fsspec URL.

An object store has keys, not directories: "renaming a directory" is a copy of every
object followed by a delete, which can stop half way and leave both copies
(``fs.mv(..., recursive=True)`` does exactly that). So this backend never renames;
checkpoints are committed with the marker strategy (``strategies.MarkerStrategy``): data is
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
  ``file://``): of two writers racing, exactly one gets True. Some S3-compatible
  servers ignore the header (both get True) or reject it: ``check_conditional_create``
  probes the store once, and the storage option ``conditional_create`` (or
  ``ATOMIC_CHECKPOINT_CONDITIONAL_CREATE``) declares it (false: check, then write).
- Listings are never cached (``use_listings_cache=False`` is forced): with the cache, a
  client answers ``ls`` from a stale copy after another client committed or deleted.
- S3 has been strongly consistent for reads after writes, overwrites, deletes and
  listings since December 2020, so the store counts as coherent.
- A path is never a pattern: a tree is deleted by listing its keys (``find``, a literal
  prefix listing) and deleting exactly those (S3 ``DeleteObjects``), never with fsspec's
  ``rm``/``glob``/``expand_path``, which read ``[``, ``*`` and ``?`` as wildcards (a
  root ``s3://b/exp[12]`` would reach runs ``exp1`` and ``exp2``). URL roots are keys
  taken literally (no ``%`` decoding), except ``file://`` URLs, which RFC 8089 encodes.
- A zero-byte key ending in ``/`` is a directory marker (s3fs-fuse writes one per
  directory it makes), never content: a prefix holding nothing but markers is listed
  as nothing, and a delete that leaves a prefix so removes its markers (by their exact
  keys), so a checkpoint saved through a mount and deleted through ``s3://`` leaves no
  empty entry behind.

fsspec (and the store's driver, e.g. s3fs) is imported only when an ``FsspecStorage``
is created: ``import atomic_checkpoint`` never imports it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    StorageError,
    StoragePermissionError,
    map_os_error,
)
from .base import (
    MAX_READ_BYTES,
    AbortOnError,
    Reader,
    StorageCapabilities,
    check_no_links,
    linked,
    too_large,
)
from .posix import fsync_directory
from .temps import temp_name

log = logging.getLogger("atomic_checkpoint")


@dataclass(frozen=True)
class OpenUpload:
    """An unfinished multipart upload: its parts are stored (and billed) but no object
    exists until it completes; ``path`` is the key relative to the root."""

    path: str
    upload_id: str
    #: When the store says it started (unix seconds), or None if it does not say.
    initiated_unix: float | None


#: Seconds botocore waits for a connection to an S3 endpoint, unless the storage
#: options set ``config_kwargs["connect_timeout"]``.
_S3_CONNECT_TIMEOUT_S = 10

#: Protocols whose paths start with a bucket (or container) and that have no real
#: directories: ``makedirs`` is a no-op there and an empty "directory" does not exist.
OBJECT_STORES = frozenset(
    {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2", "tos", "cos", "obs"}
)

#: Protocols whose driver turns ``open(path, "xb")`` / ``pipe_file(mode="create")`` into
#: a create-if-absent that excludes every other client (S3: ``If-None-Match: *``,
#: checked against a real S3 server in tests/storage and tests/netfs).
CONDITIONAL_CREATE = frozenset({"s3", "s3a", "memory", "file", "local"})

#: Storage option (and environment variable) that declares whether the store honours
#: ``If-None-Match: *``: "auto" (default: probed once, see
#: ``FsspecStorage.check_conditional_create``), true (trusted without a probe) or false
#: (it does not: check-then-write, and the run lock cannot separate two jobs that start
#: at the same instant; the user accepts that risk).
CONDITIONAL_CREATE_OPTION = "conditional_create"
CONDITIONAL_CREATE_ENV = "ATOMIC_CHECKPOINT_CONDITIONAL_CREATE"
_OPT_OUT_HINT = (
    f"storage_options={{'{CONDITIONAL_CREATE_OPTION}': False}} (command line: "
    f"--storage-option {CONDITIONAL_CREATE_OPTION}=false; or {CONDITIONAL_CREATE_ENV}=false)"
)
#: What a store that does not implement the header answers, as s3fs maps it: 501
#: NotImplemented is ENOSYS (errno 38).
_HEADER_REJECTED = frozenset({errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP})

#: Name prefix of the conditional-create probe keys, under ``.atomic-checkpoint/``.
PROBE_PREFIX = "probe-conditional-create-"

_LOCAL = frozenset({"file", "local"})
_DEFAULT_BLOCK = 32 << 20  # multipart part size: S3 needs >= 5 MiB, at most 10,000 parts
_READAHEAD = 1 << 20  # small reads (headers) are served from one ranged GET of this size
_RANGE = 16 << 20  # a large readinto is split into ranged GETs of this size, fetched together


def _is_dir_marker(key: str, size: Any) -> bool:
    """Whether an object is a directory marker: a zero-byte key ending in ``/``, as
    s3fs-fuse (and the S3 console) create one per directory. Never content."""
    return key.endswith("/") and size is not None and int(size) == 0


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


def _conditional_create_setting(value: Any, url: str) -> str:
    """One of "auto", "on", "off", from the storage option (else the environment)."""
    if value is None:
        value = os.environ.get(CONDITIONAL_CREATE_ENV, "").strip() or "auto"
    text = str(value).strip().lower()
    if text in ("auto", ""):
        return "auto"
    if text in ("true", "1", "yes", "on"):
        return "on"
    if text in ("false", "0", "no", "off"):
        return "off"
    raise ValueError(
        f"FsspecStorage({url!r}): {CONDITIONAL_CREATE_OPTION}={value!r} must be true, false or auto"
    )


class FsspecStorage:
    """Storage at any fsspec URL: ``s3://bucket/prefix``, ``gs://...``, ``memory://x``,
    ``file:///path``.

    Args:
        url: the checkpoint root.
        storage_options: passed to the fsspec filesystem (for S3: ``key``, ``secret``,
            ``client_kwargs={"endpoint_url": ...}``, ``profile``, ...), exactly as
            ``fsspec.open(url, **storage_options)`` takes them; and one of ours,
            ``conditional_create`` (true, false or "auto", the default: probed once by
            the run lock; false for a store that ignores or rejects ``If-None-Match``).
        capabilities: override what the backend claims (e.g. ``exclusive_create=False``
            for an S3-compatible server that ignores ``If-None-Match``).
        block_size_bytes: multipart part size for writes (S3: at least 5 MiB).

    Raises:
        StorageError: fsspec, or the driver for the URL's protocol (s3fs, gcsfs, ...),
            is not installed (the message names the ``pip install`` command; the
            ``ImportError`` is its ``__cause__``), or the URL cannot be opened with these
            options.
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
            # An environment to fix, not a bug: the library's error for a storage that
            # cannot be opened (the CLI's exit 2), with what to install.
            raise StorageError(
                f"FsspecStorage({url!r}) needs fsspec: pip install 'atomic-checkpoint[fsspec]' "
                "(for s3:// also s3fs: pip install 'atomic-checkpoint[s3]')",
                path=url,
            ) from exc
        opts = dict(storage_options or {})
        if url.split("://", 1)[0] in ("s3", "s3a"):
            # botocore waits 60 s for a connection by default, retried: a root on an
            # unreachable endpoint took minutes to fail. Reads keep their defaults (a
            # large upload's completion can take long); see docs/storage/object-stores.md.
            config = dict(opts.get("config_kwargs") or {})
            config.setdefault("connect_timeout", _S3_CONNECT_TIMEOUT_S)
            opts["config_kwargs"] = config
        if opts.get("use_listings_cache"):
            log.warning(
                "FsspecStorage(%s): ignoring use_listings_cache=True; a cached listing "
                "hides other clients' commits and deletes",
                url,
            )
        opts["use_listings_cache"] = False
        # Ours, not the driver's: does the store honour If-None-Match (see
        # ``check_conditional_create``)? Taken out before fsspec sees the options.
        self.conditional_create = _conditional_create_setting(
            opts.pop(CONDITIONAL_CREATE_OPTION, None), url
        )
        if url.startswith("file://"):
            from . import local_root

            # RFC 8089: a file URL is percent-encoded (Path.as_uri() writes "%20");
            # fsspec would take "%20" literally and write to another directory.
            url = "file://" + local_root(url)
        try:
            fs, root = url_to_fs(url, **opts)
        except ImportError as exc:
            scheme = url.split("://", 1)[0]
            raise StorageError(
                f"no fsspec driver for {scheme}:// is installed ({exc}); for s3:// run "
                "pip install 'atomic-checkpoint[s3]', for gs:// pip install gcsfs, for "
                "az:// pip install adlfs",
                path=url,
            ) from exc
        except (ValueError, TypeError, OSError) as exc:
            raise StorageError(
                f"cannot open checkpoint root {url!r} with fsspec: {exc}. Check the URL "
                "and storage_options"
            ) from exc
        self.fs = fs
        self.protocol = _protocol(fs)
        self._root = str(root).rstrip("/") or ("/" if str(root).startswith("/") else "")
        if self.protocol in OBJECT_STORES and "//" in self._root.lstrip("/"):
            # Keys are literal: s3://bkt//exp writes keys "/exp/...", but s3fs lists
            # "bkt//exp" as "bkt/exp", so every checkpoint saved there was committed and
            # never found again (latest() None, the next save of its step refused).
            raise StorageError(
                f"checkpoint root {url!r} has an empty path segment ('//'): keys written "
                "there cannot be listed back. Remove the extra '/' (e.g. a prefix that "
                "starts with '/' joined after 'bucket/')",
                path=url,
            )
        if self.protocol in ("s3", "s3a") and "?versionId=" in self._root:
            # s3fs cuts every key at "?versionId=" (an object version): each file under
            # this root would be read from and written to one and the same key.
            raise StorageError(
                f"checkpoint root {url!r} contains '?versionId=', which s3fs reads as an "
                "object version, not as part of the key: choose another prefix",
                path=url,
            )
        self._is_local = self.protocol in _LOCAL
        self._is_object_store = self.protocol in OBJECT_STORES
        #: Keys, no directories (S3, GCS, Azure, ...): nothing is ever removed by prefix
        #: "because the directory is empty" there (see ``strategies._drop_if_empty``).
        self.is_object_store = self._is_object_store
        self.block_size_bytes = max(int(block_size_bytes), 5 << 20)
        self.capabilities = capabilities or StorageCapabilities(
            name=self.protocol,
            # fsspec's mv of a directory is copy-then-delete on object stores and in
            # memory; even on file:// it would replace an empty target. Never a commit.
            atomic_dir_rename=False,
            dir_fsync=self._is_local and os.name != "nt",
            exclusive_create=self.protocol in CONDITIONAL_CREATE
            and self.conditional_create != "off",
            coherent=True,
            direct_io=False,  # bytes go through fsspec's file objects
        )
        self._bucket_checked = False
        #: Prefixes (full paths, no trailing "/") seen holding a directory-marker object
        #: (``_is_dir_marker``): a delete under one of them then removes the markers of a
        #: prefix it leaves without content (``_drop_dir_markers``).
        self._dir_marked: set[str] = set()
        #: Of those, the ones seen holding nothing else (``_marker_only``).
        self._dir_empty: set[str] = set()
        #: What ``check_conditional_create`` found (None until it ran).
        self.conditional_create_found: tuple[bool, str] | None = None

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url()!r})"

    def connect(self) -> None:
        """Set up the driver's client now, ahead of the first request. An object
        store's first request otherwise pays for it (s3fs: the botocore session, its
        service model and TLS context, about 0.2 s of CPU), and for a restore that is
        on the critical path. No request is sent; best effort: whatever fails here
        fails again, and is reported, at the first real request. Safe beside other
        threads' requests (s3fs sets its session up under a lock)."""
        set_session = getattr(self.fs, "set_session", None)
        if set_session is None or not getattr(self.fs, "async_impl", False):
            return
        try:
            from fsspec.asyn import sync

            sync(self.fs.loop, set_session)
        except Exception as exc:
            log.debug("%s: connecting ahead of the first request failed: %s", self, exc)

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

    def _beneath(self, rel: str, *, final: bool = True) -> None:
        """file://: refuse a path that passes through a symbolic link below the root
        (and, with ``final``, that is one), as ``LocalStorage`` does (DESIGN invariant
        9). Object stores have no links."""
        if self._is_local and rel.strip("/"):
            check_no_links(self._root, rel.strip("/"), final=final)

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
            if code == errno.EACCES and self._is_object_store:
                # The store refused the request (403): credentials or policy, not the
                # file permissions map_os_error would advise on.
                return StoragePermissionError(
                    f"{action} {where!r} failed: the object store refused the request "
                    f"({text}). Check the access key and secret (storage_options key/"
                    "secret, or the environment and profile), and that the bucket "
                    "policy allows this key to read and write this prefix",
                    errno=code,
                    path=where,
                )
            if code == errno.EBUSY and self._is_object_store:
                # s3fs' errno for 503 (SlowDown, ServiceUnavailable) and 409: the HTTP
                # answer and what to do about it, not "[Errno 16] Device busy".
                return StorageError(
                    f"{action} {where!r} failed: the object store answered that it is "
                    f"busy ({text}): HTTP 503 Slow Down or Service Unavailable (a request "
                    "rate above what the store allows), or 409, after the client's "
                    "retries. Give it more retries, e.g. storage_options={'config_kwargs': "
                    "{'retries': {'mode': 'adaptive', 'max_attempts': 10}}}, or spread the "
                    "load (docs/scale.md)",
                    errno=code,
                    path=where,
                )
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
            self._check_bucket()
            return
        self._beneath(path)
        p = self._abs(path)
        with self._mapped("create directory", path):
            if self.fs.isfile(p):
                raise StorageError(
                    f"cannot create directory {self.url(path)!r}: a file with that name exists",
                    errno=errno.EEXIST,
                    path=self.url(path),
                )
            self.fs.makedirs(p, exist_ok=True)

    def _check_bucket(self) -> None:
        """Raise StorageError (ENOENT) if ROOT's bucket does not exist; once per storage."""
        if self._bucket_checked:
            return
        bucket = self._root.split("/", 1)[0]
        try:
            # info, not exists: s3fs' exists() answers False for any error,
            # including bad storage_options, which must not read as "no bucket".
            self.fs.info(bucket)
        except FileNotFoundError as exc:
            raise StorageError(
                f"bucket {bucket!r} of {self.url()!r} does not exist (or these "
                "credentials cannot see it): create it first, or correct the URL",
                errno=errno.ENOENT,
                path=self.url(),
            ) from exc
        except Exception as exc:
            raise self._error(exc, "open bucket of", "") from exc
        self._bucket_checked = True

    def open_write(self, path: str, *, size_hint: int | None = None) -> _FsspecWriter:
        self._beneath(path)
        return _FsspecWriter(self, path)

    def open_read(self, path: str) -> Reader:
        p = self._abs(path)
        try:
            if self._is_local:
                # file://: the OS file itself, so readinto lands straight in the buffer;
                # never through a link (O_NOFOLLOW for the file itself).
                self._beneath(path, final=False)
                fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
                return open(fd, "rb", buffering=0)
            size = self.fs.size(p)
        except FileNotFoundError as exc:
            raise self._not_found(path) from exc
        except OSError as exc:
            if exc.errno == errno.ELOOP and os.path.islink(p):
                raise linked(p) from exc
            raise self._error(exc, "open", path) from exc
        except Exception as exc:
            raise self._error(exc, "open", path) from exc
        if size is None:
            raise self._not_found(path)
        return _RangeReader(self, path, int(size))

    def read_bytes(self, path: str) -> bytes:
        """Bounded (``MAX_READ_BYTES``): file:// by the size from ``fstat`` before
        reading; an object store by one ranged GET of one byte more than the bound,
        so a huge object costs at most that (a 0-byte object has no range to ask for:
        the store's refusal is answered by its size)."""
        p = self._abs(path)
        if self._is_local:
            with self.open_read(path) as f:
                size = os.fstat(f.fileno()).st_size
                if size > MAX_READ_BYTES:
                    raise too_large(self.url(path), size)
                data = f.read(MAX_READ_BYTES + 1)
        else:
            try:
                data = bytes(self.fs.cat_file(p, start=0, end=MAX_READ_BYTES + 1))
            except (FileNotFoundError, IsADirectoryError) as exc:
                raise self._not_found(path) from exc
            except Exception as exc:
                if self.size(path) == 0:
                    return b""
                raise self._error(exc, "read", path) from exc
        if len(data) > MAX_READ_BYTES:
            raise too_large(self.url(path), None)
        return data

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
            if _errno_of(exc) in _HEADER_REJECTED or "NotImplemented" in str(exc):
                raise StorageError(
                    f"create {self.url(path)!r} failed: the store rejected the conditional "
                    f"create (If-None-Match: *) with {type(exc).__name__}: {exc}. It does not "
                    "support conditional writes, so neither the run lock nor the commit can "
                    "exclude a second writer there. Use a store that supports them, or "
                    f"accept the risk (one job per root, started alone): "
                    f"{_OPT_OUT_HINT}",
                    errno=_errno_of(exc),
                    path=self.url(path),
                ) from exc
            raise self._error(exc, "create", path) from exc
        return True

    def check_conditional_create(self) -> tuple[bool, str]:
        """Whether the store honours a conditional create, found once per storage: a
        probe key is created twice with ``If-None-Match: *``; the second must be
        refused. S3-compatible servers differ (some ignore the header and overwrite,
        some reject it), and the protocol name cannot tell; the run lock and the marker
        commit are exclusive only where it is honoured.

        Returns:
            ``(honoured, what was seen)``; ``(True, ...)`` without a probe where there
            is nothing to probe (a local or in-memory filesystem, or the user declared
            the store's behaviour with the ``conditional_create`` storage option).

        Raises:
            StorageError: the probe could not be written or read (the store is
                unreachable, or denies writes under the root).
        """
        if self.conditional_create_found is not None:
            return self.conditional_create_found
        if not self.capabilities.exclusive_create:
            found = (False, "off (storage option conditional_create=false)")
        elif self._is_local or self.protocol == "memory" or self.conditional_create == "on":
            found = (True, "trusted, not probed")
        else:
            found = self._probe_conditional_create()
        self.conditional_create_found = found
        return found

    def abort_uploads(self, path: str) -> None:
        """Abort the unfinished multipart uploads under ``path/`` (S3; elsewhere a
        no-op). After a commit, an upload still open under the committed attempt is an
        orphan: its start landed but the answer was lost, the client started another
        upload of the same file, and the first one's parts stay stored (and billed),
        invisible to listings, until aborted. Failures are logged, never raised."""
        self._abort_uploads(path)

    def _probe_bytes(self, path: str) -> bytes | None:
        try:
            return self.read_bytes(path)
        except CheckpointNotFoundError:
            return None

    def _probe_conditional_create(self) -> tuple[bool, str]:
        import uuid

        from ..layout import META_DIR

        nonce = uuid.uuid4().hex
        probe = f"{META_DIR}/{PROBE_PREFIX}{nonce}"

        def doc(n: int) -> bytes:
            # created_unix: a probe key left by a failed delete is removed by the run
            # lock's tidy-up once it is stale (a probe lasts milliseconds).
            return json.dumps({"probe": nonce, "n": n, "created_unix": time.time()}).encode()

        first = doc(1)
        try:
            try:
                created = self.create_exclusive(probe, first)
            except StorageError as exc:
                if exc.errno in _HEADER_REJECTED or "rejected the conditional" in str(exc):
                    return False, f"rejected: the store refused If-None-Match: * ({exc.errno})"
                raise
            # A first answer lost and a refused retry read the same as "exists": only our
            # bytes there mean the create landed.
            if not created and self._probe_bytes(probe) != first:
                return False, "unexpected: the create of a fresh probe key was refused"
            again = self.create_exclusive(probe, doc(2))
            if again:
                return False, "ignored: a second If-None-Match: * create of one key succeeded"
            return True, "honoured: a second If-None-Match: * create of one key was refused"
        finally:
            for attempt in range(2):  # a few bytes, but nothing else would remove them
                try:
                    self.delete_file(probe)
                    break
                except CheckpointError as exc:
                    if attempt:
                        log.warning("could not delete the probe key %s: %s", self.url(probe), exc)

    def _local_publish(self, path: str, data: bytes, *, exclusive: bool) -> bool:
        """file://: write a temporary file, fsync it, then put it in place by rename
        (replace) or hard link (create-once: link fails if the name exists), so no
        reader ever opens a half-written file."""
        self._beneath(path, final=False)
        final = self._abs(path)
        tmp = temp_name(final)
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
            self._beneath(path)  # reached through a link: not a directory of ours
        except CheckpointError:
            return []
        try:
            # Object stores: detail costs nothing more (the same one listing request)
            # and gives each entry's type.
            infos = self.fs.ls(p, detail=self._is_object_store)
        except (FileNotFoundError, NotADirectoryError):
            if self._is_object_store:
                # A prefix with nothing under it is an empty directory; a bucket that
                # is not there is a wrong URL, not an empty root: a read-only manager
                # (which makes no directories) would otherwise list nothing for ever.
                self._check_bucket()
            return []
        except Exception as exc:
            raise self._error(exc, "list", path) from exc
        listed = [str(i["name"]) if isinstance(i, Mapping) else str(i) for i in infos]
        children = self._rel_children(p, listed)
        if not self._is_object_store:
            return children
        self._note_dir_markers(listed)
        here = p.rstrip("/")
        if here + "/" in listed and here != self._root.rstrip("/"):
            # Its own directory marker (s3fs-fuse) and no file beside it: if nothing but
            # markers lies below either (one more listing), it is empty.
            files = [
                i
                for i in infos
                if not isinstance(i, Mapping)
                or (i.get("type") != "directory" and str(i["name"]) != here + "/")
            ]
            if not files:
                self._dir_empty.add(here)
                if self._marker_only(here):
                    return []
        # A prefix holding nothing but directory markers is no entry (checked again
        # here, with one listing, so a prefix written to since is listed).
        return [c for c in children if not self._marker_only(f"{here}/{c}")]

    def _info(self, path: str) -> dict[str, Any] | None:
        """fsspec's ``info`` of ``path`` (one HEAD on an object store), None if missing."""
        p = self._abs(path)
        self._beneath(path)
        try:
            return dict(self.fs.info(p))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except Exception as exc:
            raise self._error(exc, "stat", path) from exc

    def size(self, path: str) -> int | None:
        info = self._info(path)
        if info is None or info.get("type") != "file" or str(info.get("name", "")).endswith("/"):
            return None
        return int(info["size"])

    def stat_token(self, path: str) -> tuple[str, ...] | None:
        """What identifies this version of file ``path`` without reading it (one HEAD on
        an object store: ETag and size; inode, size and times on file://), or None if it
        is missing or not a file. An object store's ETag is derived from the content (the
        MD5 of a single-part upload, of the parts' MD5s for a multipart one), so an equal
        token means the same bytes. Used by ``catalog.ManifestCache``."""
        info = self._info(path)
        return None if info is None else self._token(info)

    def stat_tokens(self, path: str) -> dict[str, tuple[tuple[str, ...], int]] | None:
        """``stat_token`` and size of every file under ``path`` (paths relative to it)
        from one recursive listing: on an object store a thousand keys per request,
        where ``stat_token`` and ``size`` cost one request per file. None on file://,
        where a ``stat`` per file is cheaper than a walk of every file."""
        if not self._is_object_store:
            return None
        p = self._abs(path)
        try:
            found = self.fs.find(p, detail=True)
        except FileNotFoundError:
            return {}
        except Exception as exc:
            raise self._error(exc, "walk", path) from exc
        self._note_dir_markers(found)
        self._note_empty_prefixes(found)
        prefix = p.rstrip("/") + "/"
        out = {}
        for name, info in found.items():
            name = str(name)
            token = self._token(info)
            if name.startswith(prefix) and not name.endswith("/") and token is not None:
                out[name[len(prefix) :]] = (token, int(info["size"]))
        return out

    def _token(self, info: Mapping[str, Any]) -> tuple[str, ...] | None:
        if info.get("type") != "file" or info.get("islink"):
            return None
        # The same fields from a HEAD and from a listing, so tokens taken either way
        # compare equal.
        keys = ("ETag", "size") if self._is_object_store else ("size", "mtime", "ino", "created")
        return tuple(f"{k}={info.get(k, info.get(k.lower()))}" for k in keys)

    def is_dir(self, path: str) -> bool:
        try:
            self._beneath(path)
        except CheckpointError:
            return False  # a link to a directory is not a directory of ours
        with self._mapped("stat", path):
            found = bool(self.fs.isdir(self._abs(path)))
        return found and not self._marker_only(self._abs(path).rstrip("/"))

    def walk_files(self, path: str) -> list[tuple[str, int]]:
        p = self._abs(path)
        self._beneath(path)
        try:
            found = self.fs.find(p, detail=True)
        except FileNotFoundError:
            return []
        except Exception as exc:
            raise self._error(exc, "walk", path) from exc
        self._note_dir_markers(found)
        self._note_empty_prefixes(found)
        prefix = p.rstrip("/") + "/"
        out = []
        for name, info in found.items():
            name = str(name)
            # "prefix/" keys are directory markers (s3fs-fuse, the S3 console), not files.
            if not name.startswith(prefix) or name.endswith("/") or info.get("type") != "file":
                continue
            out.append((name[len(prefix) :], int(info["size"])))
        return sorted(out)

    def fsync_dir(self, path: str) -> None:
        # Object stores: an object is durable when its PUT returns; nothing to flush.
        if not self.capabilities.dir_fsync:
            return
        fsync_directory(self._abs(path))

    def delete_file(self, path: str) -> None:
        self._beneath(path, final=False)  # a link itself may go, never what is behind one
        try:
            self.fs.rm_file(self._abs(path))
        except FileNotFoundError:
            pass  # deletes tolerate ENOENT: a concurrent cleaner got there first
        except Exception as exc:
            raise self._error(exc, "delete", path) from exc
        self._drop_dir_markers(path)

    def delete_tree(self, path: str) -> None:
        """Delete every object under ``path/`` (and ``path`` itself if it is a file).

        The keys are listed, then exactly those keys are deleted. Never through fsspec's
        ``rm(path, recursive=True)``: it expands ``[``, ``*`` and ``?`` in the path as a
        glob pattern, so a root such as ``s3://b/exp[12]`` would delete the checkpoints
        of runs ``exp1`` and ``exp2``. ``find`` and ``ls`` list a prefix literally.
        """
        p = self._abs(path)
        if p.rstrip("/") == self._root.rstrip("/"):
            raise StorageError(
                f"refusing to delete the whole checkpoint root {self.url()!r}",
                path=self.url(),
            )
        # file://: never through a link, and not a tree that is one (like LocalStorage;
        # ``delete_file`` removes a link itself).
        self._beneath(path)
        if self._is_local:
            self._delete_local_tree(path)
            return
        with self._mapped("list for deletion", path):
            keys = self._keys_under(p)
        self._delete_keys(keys, path)
        if not self._is_object_store:
            self._remove_empty_dirs(p)
        self._abort_uploads(path)
        self._drop_dir_markers(path)

    def _note_dir_markers(self, names: Any) -> None:
        """Remember the prefixes of the directory-marker keys among ``names`` (full
        paths, as ``ls``/``find`` return them): a later delete under one of them checks
        whether it left the prefix holding nothing but markers."""
        if not self._is_object_store:
            return
        for name in names:
            name = str(name)
            if name.endswith("/") and name.rstrip("/"):
                self._dir_marked.add(name.rstrip("/"))

    def _note_empty_prefixes(self, found: Mapping[str, Any]) -> None:
        """From a recursive listing (``find(detail=True)``): remember the prefixes that
        hold directory markers and nothing else (see ``_marker_only``)."""
        if not self._is_object_store:
            return
        markers = {
            str(n).rstrip("/") for n, i in found.items() if _is_dir_marker(str(n), i.get("size"))
        }
        markers.discard("")
        if not markers:
            return  # the usual case: a store written through the API only
        holding: set[str] = set()
        for name, info in found.items():
            name = str(name)
            if _is_dir_marker(name, info.get("size")):
                continue
            parent = name.rsplit("/", 1)[0] if "/" in name else ""
            while parent and parent not in holding:
                if parent in markers:
                    holding.add(parent)
                parent = parent.rsplit("/", 1)[0] if "/" in parent else ""
        self._dir_empty.update(markers - holding)

    def _marker_only(self, prefix: str) -> bool:
        """Whether ``prefix`` (a full path), seen holding nothing but directory markers,
        still does: asked of the store again (one listing), as something may have been
        written there since. False, without a request, for any other prefix."""
        if prefix not in self._dir_empty or prefix == self._root.rstrip("/"):
            return False
        if self._only_dir_markers(prefix) is None:
            self._dir_empty.discard(prefix)
            return False
        return True

    def _only_dir_markers(self, prefix: str) -> list[str] | None:
        """The keys at and below ``prefix/`` (full paths) if every one of them is a
        directory marker (``_is_dir_marker``), else None (it holds content, or cannot be
        listed: then nothing is deleted). Stops at the first key that is not a marker."""
        bucket, _, key = prefix.partition("/")
        call_s3 = getattr(self.fs, "call_s3", None)
        if self.protocol in ("s3", "s3a") and call_s3 is not None:
            found: list[str] = []
            token: dict[str, str] = {}
            for _page in range(10_000):
                try:
                    out = call_s3(
                        "list_objects_v2", Bucket=bucket, Prefix=key + "/", MaxKeys=100, **token
                    )
                except Exception as exc:
                    log.debug("not checking %s for directory markers: %s", prefix, exc)
                    return None
                for obj in out.get("Contents", []) or []:
                    name = str(obj.get("Key", ""))
                    if not _is_dir_marker(name, obj.get("Size")):
                        return None
                    found.append(f"{bucket}/{name}")
                if not out.get("IsTruncated") or not out.get("NextContinuationToken"):
                    return found
                token = {"ContinuationToken": str(out["NextContinuationToken"])}
            return None
        try:
            listed = self.fs.find(prefix, detail=True)
        except Exception as exc:
            log.debug("not checking %s for directory markers: %s", prefix, exc)
            return None
        mine = {str(n): i for n, i in listed.items() if str(n).startswith(prefix + "/")}
        if not all(_is_dir_marker(n, i.get("size")) for n, i in mine.items()):
            return None
        return sorted(mine)

    def _drop_dir_markers(self, path: str) -> None:
        """After a delete on an object store: remove the directory-marker objects of
        ``path`` and of each parent below the root that now hold nothing else (deepest
        first; it stops at the first that holds content).

        s3fs-fuse (and the S3 console) create a zero-byte ``prefix/`` object per
        directory. The strategies never delete a checkpoint's prefix as such on an
        object store (only the keys they list), so such a marker outlived its
        checkpoint and was listed, through the mount and through ``s3://``, as an entry
        without a manifest, which ``clean`` did not remove. Only zero-byte keys ending
        in ``/`` go, each by its exact key: never a file, so never a checkpoint. Only
        prefixes a listing of this storage showed holding a marker are checked, so a
        store without markers costs no extra request. Best effort: a failure is logged
        (a marker left is an empty entry, never data)."""
        if not self._is_object_store or not self._dir_marked:
            return
        root = self._root.rstrip("/")
        current = self._abs(path).rstrip("/")
        while current.startswith(root + "/"):
            if current in self._dir_marked:
                markers = self._only_dir_markers(current)
                if markers is None:
                    return  # content is left here (and so in every parent)
                try:
                    self._delete_keys(sorted(markers, reverse=True), current[len(root) + 1 :])
                except CheckpointError as exc:
                    log.warning("could not delete the directory markers of %s: %s", current, exc)
                    return
                self._dir_marked.discard(current)
                self._dir_empty.discard(current)
                with contextlib.suppress(Exception):
                    self.fs.invalidate_cache(current)
            current = current.rsplit("/", 1)[0]

    def _keys_under(self, p: str) -> list[str]:
        """The objects at or below ``p``, from a literal prefix listing (``find``: one
        paginated LIST of ``p/`` on S3; it never reads its argument as a pattern)."""
        try:
            found = self.fs.find(p, withdirs=False)
        except FileNotFoundError:
            return []
        prefix = p.rstrip("/") + "/"
        # "p/" and "p/sub/" are directory-marker objects (s3fs-fuse, the S3 console):
        # real keys, deleted with the rest. A sibling "p10/..." never starts with "p/".
        return sorted({str(n) for n in found if str(n) == p or str(n).startswith(prefix)})

    def _delete_keys(self, keys: list[str], rel: str) -> None:
        """Delete exactly ``keys`` (full paths as ``find`` returns them); already-missing
        keys are fine (a concurrent cleaner got there first)."""
        if not keys:
            return
        call_s3 = getattr(self.fs, "call_s3", None)
        if self.protocol in ("s3", "s3a") and call_s3 is not None:
            # DeleteObjects takes exact keys (no patterns), at most 1,000 per request;
            # it answers 200 even when some keys fail, so its Errors list is checked.
            bucket = self._root.split("/", 1)[0]
            for start in range(0, len(keys), 1000):
                chunk = keys[start : start + 1000]
                objects = []
                for k in chunk:
                    if not k.startswith(bucket + "/"):
                        raise StorageError(
                            f"delete {self.url(rel)!r}: listed key {k!r} is outside bucket "
                            f"{bucket!r}; nothing more was deleted",
                            path=self.url(rel),
                        )
                    objects.append({"Key": k[len(bucket) + 1 :]})
                with self._mapped("delete", rel):
                    out = call_s3(
                        "delete_objects", Bucket=bucket, Delete={"Objects": objects, "Quiet": True}
                    )
                errors = [e for e in (out or {}).get("Errors", []) if e.get("Code") != "NoSuchKey"]
                if errors:
                    first = errors[0]
                    raise StorageError(
                        f"delete {self.url(rel)!r}: the store refused to delete {len(errors)} "
                        f"object(s); first {first.get('Key')!r}: {first.get('Code')} "
                        f"{first.get('Message')}. Check the credentials' delete permission",
                        path=self.url(rel),
                    )
            return
        for k in sorted(keys, reverse=True):
            try:
                # rm_file takes one literal path in every driver shipped with fsspec and
                # in s3fs, gcsfs and adlfs (rm and expand_path are the ones that glob).
                self.fs.rm_file(k)
            except FileNotFoundError:
                pass
            except Exception as exc:
                raise self._error(exc, "delete", rel) from exc

    def _remove_empty_dirs(self, p: str) -> None:
        """Drop the (now empty) directories of a deleted tree on stores that keep them
        (``memory://``), deepest first; a directory that is not empty stays."""
        try:
            found = self.fs.find(p, withdirs=True, detail=True)
        except Exception:
            found = {}
        prefix = p.rstrip("/") + "/"
        dirs = [
            str(n)
            for n, info in found.items()
            if info.get("type") == "directory" and str(n).startswith(prefix)
        ]
        for d in [*sorted(dirs, key=len, reverse=True), p]:
            with contextlib.suppress(Exception):
                self.fs.rmdir(d)

    def _delete_local_tree(self, path: str) -> None:
        """file://: remove the tree with the OS (``shutil.rmtree`` takes its argument
        literally and never follows a symlink out of the tree); a symlink or a file at
        ``path`` is unlinked itself."""
        p = self._abs(path)
        try:
            if os.path.islink(p) or not os.path.isdir(p):
                os.unlink(p)
            else:
                shutil.rmtree(p)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise map_os_error(exc, "delete", p) from exc

    def _abort_uploads(self, path: str) -> None:
        """S3: abort unfinished multipart uploads under ``path/``. A writer killed in the
        middle of a large file leaves its uploaded parts invisible but stored (and
        billed) until aborted; the sweep of its attempt gets here. Failures are logged:
        what is left, ``atomic-checkpoint clean`` removes."""
        try:
            for upload in self.open_uploads(path):
                self.abort_upload(upload)
        except CheckpointError as exc:
            log.warning("could not abort unfinished uploads under %s: %s", self.url(path), exc)

    def open_uploads(self, path: str = "") -> list[OpenUpload]:
        """The unfinished multipart uploads under ``path/`` (the root itself by
        default); ``[]`` on stores without them (anything but S3).

        The listing asks the store for the prefix ``<root key>/<path>/`` only, so a
        sibling prefix (``run10`` beside ``run1``) or another run in the bucket is never
        returned, and each key is checked against the prefix again. It follows every
        page (``IsTruncated``, ``NextKeyMarker``/``NextUploadIdMarker``; S3 answers at
        most 1,000 uploads a page): a bucket busy with uploads must not hide ours
        behind the first page.

        Raises:
            StorageError: the store could not be listed (the uploads are then unknown).
        """
        call_s3 = getattr(self.fs, "call_s3", None)
        if self.protocol not in ("s3", "s3a") or call_s3 is None:
            return []
        bucket, _, key = self._abs(path).partition("/")
        prefix = key.rstrip("/") + "/" if key.strip("/") else ""
        base = self._abs("").partition("/")[2].rstrip("/")
        base = base + "/" if base else ""
        found: list[OpenUpload] = []
        markers: dict[str, str] = {}
        for _page in range(10_000):  # bounded: 10^7 uploads under one prefix
            with self._mapped("list unfinished uploads under", path):
                out = call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
            for upload in out.get("Uploads", []) or []:
                name = str(upload.get("Key", ""))
                if name.startswith(prefix) and name.startswith(base):  # never trust blindly
                    started = upload.get("Initiated")
                    found.append(
                        OpenUpload(
                            path=name[len(base) :],
                            upload_id=str(upload["UploadId"]),
                            initiated_unix=started.timestamp()
                            if hasattr(started, "timestamp")
                            else None,
                        )
                    )
            following = {
                "KeyMarker": str(out.get("NextKeyMarker") or ""),
                "UploadIdMarker": str(out.get("NextUploadIdMarker") or ""),
            }
            if not out.get("IsTruncated") or following == markers:
                break  # the last page (or a store that does not advance: stop)
            markers = following
        return found

    def abort_upload(self, upload: OpenUpload) -> None:
        """Abort one unfinished multipart upload (its parts are deleted); an upload
        already gone (completed or aborted meanwhile) is fine.

        Raises:
            StorageError: the store refused or could not be reached.
        """
        call_s3 = getattr(self.fs, "call_s3", None)
        if call_s3 is None:
            return
        bucket, _, key = self._abs(upload.path).partition("/")
        try:
            call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload.upload_id)
        except FileNotFoundError:
            pass  # NoSuchUpload: completed or aborted by someone else meanwhile
        except Exception as exc:
            raise self._error(exc, "abort the unfinished upload of", upload.path) from exc

    def refresh(self, path: str) -> None:
        # Listings are never cached (use_listings_cache=False); drop whatever a driver
        # may keep anyway (e.g. file info cached by an open).
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self._abs(path))


class _FsspecWriter(AbortOnError):
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
