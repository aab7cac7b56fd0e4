"""pytest fixtures wrapping the testbed context managers.

Import them into a conftest (``from tests.testbed.pytest_fixtures import *``)
or a test module. A fixture whose facility is missing skips the test with the
probe's reason, except under CI (``CI`` or ``TESTBED_STRICT`` set to a
non-empty value other than ``0``/``false``), where every facility must exist and a
missing one fails the test instead of hiding it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .disk import SmallDisk
from .fiu_tools import fiu_available
from .netns import NetnsPair
from .probes import PROBES
from .s3 import S3fsFuseMount, S3Server
from .sshfs import SshfsExport, SshfsMount

__all__ = [
    "fiu_ready",
    "netns_pair",
    "netns_sshfs",
    "require_facility",
    "s3_bucket",
    "s3_server",
    "s3fs_fuse_mount",
    "small_disk",
    "sshfs_export",
    "sshfs_nodes",
    "strict_facilities",
]

_bucket_counter = itertools.count(1)


def strict_facilities() -> bool:
    """Tells whether missing facilities must fail rather than skip (CI)."""
    for var in ("TESTBED_STRICT", "CI"):
        value = os.environ.get(var, "").strip().lower()
        if value and value not in ("0", "false", "no"):
            return True
    return False


def require_facility(name: str) -> None:
    """Skips (or, under CI, fails) the current test when ``name`` is missing.

    Args:
        name: A key of :data:`tests.testbed.probes.PROBES`, e.g. ``"sshfs"``.
    """
    ok, why = PROBES[name]()
    if ok:
        return
    message = f"testbed facility {name!r} unavailable: {why}"
    if strict_facilities():
        pytest.fail(message + " (required under CI)")
    pytest.skip(message)


@pytest.fixture
def sshfs_export(tmp_path: Path) -> Iterator[SshfsExport]:
    """A started private sshd exporting ``tmp_path/sshfs-srv/export``."""
    require_facility("sshfs")
    with SshfsExport(tmp_path / "sshfs-srv") as export:
        yield export


@pytest.fixture
def sshfs_nodes(sshfs_export: SshfsExport, tmp_path: Path) -> tuple[SshfsMount, SshfsMount]:
    """Two default-caching sshfs mounts of one export: nodes A and B."""
    return (
        sshfs_export.mount(tmp_path / "node-a"),
        sshfs_export.mount(tmp_path / "node-b"),
    )


@pytest.fixture
def netns_pair() -> Iterator[NetnsPair]:
    """Two linked network namespaces (sides ``a`` and ``b``)."""
    require_facility("netns")
    with NetnsPair("ack") as pair:
        yield pair


@pytest.fixture
def netns_sshfs(netns_pair: NetnsPair, tmp_path: Path) -> Iterator[SshfsExport]:
    """An export whose sshd runs in namespace a; mounts come from namespace b."""
    require_facility("sshfs")
    with netns_pair.sshfs_export(tmp_path / "netns-srv") as export:
        yield export


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One moto S3 server per test module (start-up takes about 1-2 s)."""
    require_facility("moto")
    with S3Server(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh, empty bucket on the module's S3 server."""
    return s3_server.create_bucket(f"testbed-{os.getpid()}-{next(_bucket_counter)}")


@pytest.fixture
def s3fs_fuse_mount(s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> Iterator[S3fsFuseMount]:
    """An s3fs-fuse mount of :func:`s3_bucket`."""
    require_facility("s3fs_fuse")
    with S3fsFuseMount(s3_server, s3_bucket, tmp_path / "s3fs-mnt") as mount:
        yield mount


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[int, str], SmallDisk]]:
    """Factory ``make(size_mb, kind="tmpfs")`` of small filesystems.

    Every disk made is unmounted at teardown.
    """
    counter = itertools.count()
    with contextlib.ExitStack() as stack:

        def make(size_mb: int, kind: str = "tmpfs") -> SmallDisk:
            require_facility(kind)
            base = tmp_path / f"disk-{next(counter)}"
            return stack.enter_context(SmallDisk(base, size_mb, kind))

        yield make


@pytest.fixture
def fiu_ready() -> None:
    """Skips (or fails under CI) unless libfiu and ``fiu_ctrl`` work."""
    ok, why = fiu_available()
    if not ok:
        message = f"libfiu unavailable: {why}"
        if strict_facilities():
            pytest.fail(message + " (required under CI)")
        pytest.skip(message)
