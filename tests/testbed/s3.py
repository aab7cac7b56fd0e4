"""A local S3 server (moto) and s3fs-fuse mounts of its buckets.

moto keeps everything in memory: :meth:`S3Server.kill` loses every bucket,
which is how a test models an object store that vanished. s3fs-fuse turns a
bucket into a POSIX-looking directory whose directory rename is per-object
copy+delete and whose data reaches S3 only at fsync/close (see TESTBED.md).

Example::

    with S3Server() as s3:
        s3.create_bucket("ckpt")
        fs = s3fs.S3FileSystem(**s3.storage_options())
        with S3fsFuseMount(s3, "ckpt", tmp_path / "m") as m:
            (m.path / "f").write_bytes(b"x")
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._util import (
    ManagedProcess,
    Service,
    TestbedError,
    find_mount,
    free_port,
    require_binary,
    resolve_mountpoint,
    unmount,
    wait_for_mount,
    wait_until_live,
    which,
)

#: Credentials moto accepts (it accepts any).
ACCESS_KEY = "testbed-key"
SECRET_KEY = "testbed-secret"
REGION = "us-east-1"

_START_ATTEMPTS = 3


def moto_server_path() -> str | None:
    """Locates ``moto_server`` next to the running interpreter, else on $PATH.

    Returns:
        The path, or None when moto[server] is not installed.
    """
    beside = Path(sys.executable).parent / "moto_server"
    if beside.is_file():
        return str(beside)
    return which("moto_server")


def boto3_client(endpoint_url: str, **options: Any) -> Any:
    """A boto3 S3 client with the testbed's credentials and region, for the server (or a
    proxy in front of it) at ``endpoint_url``; ``options`` go to ``boto3.client`` (a
    botocore ``config``, for one)."""
    import boto3  # Imported lazily: only S3 tests need boto3.

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name=REGION,
        **options,
    )


class S3Server(Service):
    """``moto_server`` on 127.0.0.1 and a free port."""

    def __init__(self, log_dir: Path | str | None = None, startup_timeout_s: float = 20.0):
        """Prepares the server; it starts on ``__enter__``.

        Args:
            log_dir: Where the server log goes (default: a temporary file
                that is removed on close).
            startup_timeout_s: Bound on the wait for HTTP readiness.
        """
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.startup_timeout_s = startup_timeout_s
        self.host = "127.0.0.1"
        self.port = 0
        self._proc: ManagedProcess | None = None
        self._tmp_logs: list[Path] = []

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> None:
        """Starts moto_server and waits until it answers HTTP.

        Raises:
            TestbedError: moto is not installed or did not come up.
        """
        binary = moto_server_path()
        if binary is None:
            raise TestbedError("moto_server not found (pip install 'moto[server]')")
        errors = []
        for _ in range(_START_ATTEMPTS):
            # The port can be taken between probing and binding: retry.
            self.port = free_port(self.host)
            proc = ManagedProcess([binary, "-H", self.host, "-p", str(self.port)], self._log_path())
            try:
                proc.wait_ready(
                    self._ready,
                    self.startup_timeout_s,
                    f"moto_server HTTP on {self.endpoint_url}",
                    interval_s=0.1,
                )
            except TestbedError as exc:
                errors.append(str(exc))
                continue
            self._proc = proc
            return
        raise TestbedError(f"moto_server did not start: {' | '.join(errors)}")

    def close(self) -> None:
        """Stops the server (in-memory data is lost)."""
        if self._proc is not None:
            self._proc.stop(timeout_s=3.0)
            self._proc = None
        for log in self._tmp_logs:
            with contextlib.suppress(OSError):
                log.unlink()
        self._tmp_logs.clear()

    def kill(self) -> None:
        """SIGKILLs the server, as a crash of the object store."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.stop(timeout_s=1.0)
            self._proc = None

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs."""
        return self._proc.pid if self._proc is not None else None

    # -- clients -----------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://{self.host}:{self.port}"

    def boto3_client(self) -> Any:
        """Returns a boto3 S3 client for this server."""
        return boto3_client(self.endpoint_url)

    def create_bucket(self, name: str) -> str:
        """Creates a bucket (names need 3-63 lowercase characters).

        Args:
            name: Bucket name.

        Returns:
            The bucket name.
        """
        self.boto3_client().create_bucket(Bucket=name)
        return name

    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs ``storage_options`` for this server.

        The listings cache is off: with it, s3fs answers ``ls``/``exists``
        from a stale local copy after another client changed the bucket.
        """
        return {
            "key": ACCESS_KEY,
            "secret": SECRET_KEY,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION},
            "use_listings_cache": False,
        }

    # -- internals -----------------------------------------------------------

    def _log_path(self) -> Path:
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            return self.log_dir / f"moto-{self.port}.log"
        fd, name = tempfile.mkstemp(prefix=f"moto-{self.port}-", suffix=".log")
        os.close(fd)
        self._tmp_logs.append(Path(name))
        return Path(name)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint_url + "/", timeout=1.0):
                return True
        except urllib.error.HTTPError:
            return True  # Any HTTP answer, even an error, means it is serving.
        except OSError:
            return False


class S3fsFuseMount(Service):
    """An s3fs-fuse mount of one bucket of an :class:`S3Server`."""

    def __init__(
        self,
        server: S3Server,
        bucket: str,
        mountpoint: Path | str,
        *,
        extra_opts: Sequence[str] = (),
        timeout_s: float = 15.0,
    ):
        """Prepares the mount; it is made on ``__enter__``.

        Args:
            server: A started S3 server.
            bucket: Existing bucket to mount.
            mountpoint: Directory to mount on (created if missing); the
                passwd file is written beside it.
            extra_opts: Further ``-o`` options for s3fs.
            timeout_s: Bound on the wait for /proc/mounts to list the mount.
        """
        self.server = server
        self.bucket = bucket
        self.mountpoint = Path(mountpoint)
        self.extra_opts = list(extra_opts)
        self.timeout_s = timeout_s
        self.path = self.mountpoint
        self._proc: ManagedProcess | None = None
        self._passwd: Path | None = None

    @property
    def pid(self) -> int:
        """The s3fs daemon's pid (kill it to crash the mount)."""
        if self._proc is None:
            raise TestbedError("S3fsFuseMount is not mounted")
        return self._proc.pid

    def start(self) -> None:
        """Runs s3fs in the foreground and waits for ``fuse.s3fs`` in /proc/mounts.

        Raises:
            TestbedError: s3fs exited or the mount did not appear in time.
        """
        self.path = resolve_mountpoint(self.mountpoint)
        self._passwd = self.path.parent / f".{self.path.name}.passwd-s3fs"
        self._passwd.write_text(f"{ACCESS_KEY}:{SECRET_KEY}\n")
        self._passwd.chmod(0o600)  # s3fs refuses a passwd file others can read.
        opts = [
            f"passwd_file={self._passwd}",
            f"url={self.server.endpoint_url}",
            "use_path_request_style",
            f"endpoint={REGION}",
            *self.extra_opts,
        ]
        argv = [require_binary("s3fs"), self.bucket, str(self.path), "-f", "-o", ",".join(opts)]
        log = self.path.parent / f".{self.path.name}.s3fs.log"
        self._proc = ManagedProcess(argv, log)
        try:
            wait_for_mount(self.path, "fuse.s3fs", self._proc, self.timeout_s, "s3fs mount")
            wait_until_live(self.path, "fuse.s3fs", self._proc, self.timeout_s, "s3fs mount")
        except TestbedError:
            self.close()
            raise

    def kill(self) -> None:
        """SIGKILLs s3fs: the mount stays listed but every access fails."""
        if self._proc is not None:
            self._proc.kill()

    def is_mounted(self) -> bool:
        """Tells whether /proc/mounts still lists this mount."""
        entry = find_mount(self.path)
        return entry is not None and entry.fstype == "fuse.s3fs"

    def close(self) -> None:
        """Unmounts (fusermount3 -u, then umount -l) and stops s3fs."""
        try:
            unmount(self.path, fuse=True)
        finally:
            if self._proc is not None:
                self._proc.stop(timeout_s=3.0)
                self._proc = None
            if self._passwd is not None:
                with contextlib.suppress(OSError):
                    self._passwd.unlink()
