"""Small real filesystems for disk-full tests: tmpfs, or loop-mounted ext4/xfs.

A write past the end of a small filesystem fails with a real ENOSPC from the
kernel. Beware (TESTBED.md): one large ``os.write`` that does not fit is a
short write, not an error; only the next write raises. An unclosed file can
swallow ENOSPC at garbage collection, so close files explicitly.

Example::

    with SmallDisk(tmp_path, 16, kind="ext4") as disk:
        free = disk.free_bytes()
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path

from ._util import Service, TestbedError, require_binary, resolve_mountpoint, run, unmount

KINDS = ("tmpfs", "ext4", "xfs")

# mkfs.xfs refuses filesystems under 300 MB unless it believes it runs under
# fstests; these variables are that switch. Small XFS images work fine.
_XFS_SMALL_ENV = {"TEST_DIR": "1", "TEST_DEV": "1", "QA_CHECK_FS": "1"}
_XFS_MIN_MB = 16
_XFS_UNFLAGGED_MIN_MB = 300


class SmallDisk(Service):
    """A freshly made filesystem of ``size_mb`` MiB mounted under ``base_dir``."""

    def __init__(
        self, base_dir: Path | str, size_mb: int, kind: str = "tmpfs", *, options: str = ""
    ):
        """Validates arguments; the filesystem is made on ``__enter__``.

        Args:
            base_dir: Scratch directory; a fresh mount point (and the image
                file for ext4/xfs) is made inside it.
            size_mb: Size in MiB (xfs needs at least 16).
            kind: ``"tmpfs"``, ``"ext4"`` or ``"xfs"``.
            options: Extra mount options (comma-separated), e.g. ``"commit=600"``.

        Raises:
            ValueError: Unknown kind or size too small.
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        if size_mb < 1 or (kind == "xfs" and size_mb < _XFS_MIN_MB):
            raise ValueError(f"size_mb={size_mb} is too small for {kind}")
        self.base_dir = Path(base_dir)
        self.size_mb = size_mb
        self.kind = kind
        self.options = options
        self.path = self.base_dir / f"{kind}-disk"  # Made unique in start().
        self.image: Path | None = None
        self._mounted = False

    def start(self) -> None:
        """Makes and mounts the filesystem.

        Raises:
            TestbedError: mkfs or mount failed.
        """
        self.base_dir.mkdir(parents=True, exist_ok=True)
        # A fresh directory per disk: several disks can share one base_dir.
        self.path = resolve_mountpoint(
            tempfile.mkdtemp(prefix=f"{self.kind}-disk-", dir=self.base_dir)
        )
        mount = require_binary("mount")
        try:
            if self.kind == "tmpfs":
                opts = _options(f"size={self.size_mb}m,mode=0755", self.options)
                run([mount, "-t", "tmpfs", "-o", opts, "tmpfs", str(self.path)])
            else:
                self.image = self._make_image()
                # -o loop sets up an auto-clearing loop device: umount frees it.
                run([mount, "-o", _options("loop", self.options), str(self.image), str(self.path)])
            self._mounted = True
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Unmounts and removes the image file."""
        try:
            if self._mounted:
                unmount(self.path, fuse=False)
                self._mounted = False
        finally:
            if self.image is not None:
                with contextlib.suppress(OSError):
                    self.image.unlink()
                self.image = None

    def free_bytes(self) -> int:
        """Bytes an unprivileged writer could still allocate (``f_bavail``)."""
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def _make_image(self) -> Path:
        image = self.path.with_name(self.path.name + ".img")
        with open(image, "wb") as f:
            f.truncate(self.size_mb * 1024 * 1024)  # Sparse: costs no disk space.
        if self.kind == "ext4":
            # -m 0: no root reserve, so a root test process hits the real wall.
            run([require_binary("mkfs.ext4"), "-q", "-F", "-m", "0", str(image)])
        else:
            env = dict(os.environ)
            if self.size_mb < _XFS_UNFLAGGED_MIN_MB:
                env.update(_XFS_SMALL_ENV)
            run([require_binary("mkfs.xfs"), "-q", "-f", str(image)], env=env)
        return image


def _options(*parts: str) -> str:
    return ",".join(p for p in parts if p)


class PowerCutImage(SmallDisk):
    """What a power cut at this moment would leave of a loop-mounted :class:`SmallDisk`,
    mounted read-write at a fresh place (its journal or log replayed, as at a reboot).

    The copy is of the disk's image file, i.e. of what the loop device has been given:
    the blocks the filesystem wrote out (an fsync, a journal commit, writeback). Pages
    that are still dirty in the mounted filesystem's cache, which a SIGKILL keeps and a
    power cut loses, are not in it. Take it while nothing writes to the disk (the writer
    killed or stopped), so that it is one moment. It models a disk that writes through:
    what a drive cache loses on top (blocks handed over but not flushed) is kept here.

    Example::

        with SmallDisk(tmp, 64, "ext4", options="commit=600") as disk:
            ...  # a job writes under disk.path and is killed
            with PowerCutImage(disk, tmp / "cut") as after:
                ...  # after.path holds what the reboot finds
    """

    def __init__(self, disk: SmallDisk, base_dir: Path | str):
        """Nothing is copied until ``__enter__``.

        Raises:
            ValueError: ``disk`` has no device image (tmpfs lives in memory only).
        """
        if disk.kind not in ("ext4", "xfs"):
            raise ValueError(f"a {disk.kind} disk has no device to copy")
        super().__init__(base_dir, disk.size_mb, disk.kind)
        self.disk = disk

    def start(self) -> None:  # close() is SmallDisk's: unmount, remove the image
        """Copies the device and mounts the copy.

        Raises:
            TestbedError: the disk is not mounted, or mount failed.
        """
        if self.disk.image is None:
            raise TestbedError("the disk is not started: there is no device to copy")
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.path = resolve_mountpoint(tempfile.mkdtemp(prefix="cut-", dir=self.base_dir))
        self.image = self.path.with_name(self.path.name + ".img")
        try:
            _copy_sparse(self.disk.image, self.image)
            # A copy of a mounted XFS has the same UUID; XFS refuses that unless told.
            opts = _options("loop", "nouuid" if self.disk.kind == "xfs" else "")
            run([require_binary("mount"), "-o", opts, str(self.image), str(self.path)])
            self._mounted = True
        except BaseException:
            self.close()
            raise


def _copy_sparse(src: Path, dst: Path, chunk: int = 1 << 20) -> None:
    """Copies a mostly empty image, leaving holes where ``src`` reads zeros."""
    zeros = bytes(chunk)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while block := fin.read(chunk):
            if block == zeros[: len(block)]:
                fout.seek(len(block), os.SEEK_CUR)
            else:
                fout.write(block)
        fout.truncate(fin.tell())


def fill_until_enospc(path: Path, chunk: int = 1 << 20, limit_bytes: int = 1 << 34) -> int:
    """Writes ``path`` in chunks until the filesystem is full.

    Args:
        path: File to create.
        chunk: Bytes per write.
        limit_bytes: Give up after this many bytes (bounds the loop).

    Returns:
        Bytes written before ENOSPC.

    Raises:
        TestbedError: ``limit_bytes`` were written without hitting ENOSPC.
        OSError: Any error other than ENOSPC.
    """
    data = b"\0" * chunk
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(limit_bytes // chunk + 1):
            try:
                written += os.write(fd, data)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    return written
                raise
    finally:
        os.close(fd)
    raise TestbedError(f"wrote {written} bytes to {path} without ENOSPC")
