"""Probes telling whether each testbed facility works on this machine.

Each probe returns ``(available, reason)``; ``reason`` says what is missing
so a test can ``pytest.skip(reason)`` only when a facility is truly absent.
Probes that need privileges try the real operation (creating and deleting a
network namespace with a veth pair, finding a free loop device) instead of
guessing from the user id. Results are cached per process.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

from ._util import TestbedError, run, which
from .fiu_tools import fiu_available
from .s3 import moto_server_path
from .sshfs import PRIVSEP_DIR

Probe = tuple[bool, str]

_OK: Probe = (True, "")
_CAP_SYS_ADMIN = 21


def _missing_binaries(*names: str) -> Probe:
    missing = [n for n in names if which(n) is None]
    if missing:
        return False, f"not installed: {', '.join(missing)}"
    return _OK


def _first_failure(*probes: Callable[[], Probe]) -> Probe:
    """Runs probes in order and returns the first failure, else success."""
    for probe in probes:
        ok, why = probe()
        if not ok:
            return ok, why
    return _OK


@functools.cache
def requires_root_capabilities() -> Probe:
    """Checks for CAP_SYS_ADMIN, needed for mount, loop devices and netns."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError as exc:
        return False, f"cannot read /proc/self/status: {exc}"
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            if int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1:
                return _OK
            return False, "CAP_SYS_ADMIN missing (run as root with full capabilities)"
    return False, "no CapEff line in /proc/self/status"


@functools.cache
def fuse_available() -> Probe:
    """Checks that /dev/fuse opens and fusermount3 exists."""
    ok, why = _missing_binaries("fusermount3")
    if not ok:
        return ok, why
    try:
        fd = os.open("/dev/fuse", os.O_RDWR)
    except OSError as exc:
        return False, f"/dev/fuse unusable: {exc}"
    os.close(fd)
    return _OK


@functools.cache
def sshfs_available() -> Probe:
    """Checks for sshd, ssh, ssh-keygen, sshfs and FUSE."""
    return _first_failure(
        functools.partial(_missing_binaries, "sshd", "ssh", "ssh-keygen", "sshfs"),
        fuse_available,
        _sshd_privsep_dir,
    )


def _sshd_privsep_dir() -> Probe:
    """sshd needs /run/sshd; only root can create it when it is missing."""
    if Path(PRIVSEP_DIR).is_dir() or os.geteuid() == 0:
        return _OK
    return False, f"{PRIVSEP_DIR} missing and not root to create it"


@functools.cache
def netns_available() -> Probe:
    """Creates and deletes a namespace holding a veth pair, for real."""
    ok, why = _missing_binaries("ip", "nsenter")
    if not ok:
        return ok, why
    ok, why = requires_root_capabilities()
    if not ok:
        return ok, why
    name = f"tbprobe{os.getpid()}"
    ip = which("ip") or "ip"
    try:
        run([ip, "netns", "add", name], timeout_s=10)
        try:
            run([ip, "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        finally:
            run([ip, "netns", "del", name], timeout_s=10, check=False)
    except TestbedError as exc:
        return False, f"network namespaces unusable: {exc}"
    return _OK


@functools.cache
def loop_available() -> Probe:
    """Checks for loop devices (a free one must be allocatable)."""
    ok, why = _missing_binaries("losetup", "mount", "umount")
    if not ok:
        return ok, why
    ok, why = requires_root_capabilities()
    if not ok:
        return ok, why
    if not Path("/dev/loop-control").exists():
        return False, "/dev/loop-control missing (no loop driver)"
    try:
        run([which("losetup") or "losetup", "-f"], timeout_s=10)
    except TestbedError as exc:
        return False, f"no free loop device: {exc}"
    return _OK


@functools.cache
def tmpfs_available() -> Probe:
    """Checks that tmpfs can be mounted (needs CAP_SYS_ADMIN)."""
    ok, why = _missing_binaries("mount", "umount")
    return requires_root_capabilities() if ok else (ok, why)


@functools.cache
def disk_available(kind: str) -> Probe:
    """Checks what :class:`~tests.testbed.disk.SmallDisk` needs for ``kind``.

    Args:
        kind: ``"tmpfs"``, ``"ext4"`` or ``"xfs"``.
    """
    if kind == "tmpfs":
        return tmpfs_available()
    ok, why = _missing_binaries({"ext4": "mkfs.ext4", "xfs": "mkfs.xfs"}[kind])
    return loop_available() if ok else (ok, why)


@functools.cache
def moto_available() -> Probe:
    """Checks for the moto_server binary and boto3."""
    if moto_server_path() is None:
        return False, "moto_server not installed (pip install 'moto[server]')"
    if importlib.util.find_spec("boto3") is None:
        return False, "boto3 not installed"
    return _OK


@functools.cache
def s3fs_python_available() -> Probe:
    """Checks for the fsspec ``s3fs`` package."""
    if importlib.util.find_spec("s3fs") is None:
        return False, "python package s3fs not installed"
    return moto_available()


@functools.cache
def s3fs_fuse_available() -> Probe:
    """Checks for the s3fs-fuse binary, FUSE and moto."""
    return _first_failure(
        functools.partial(_missing_binaries, "s3fs"), fuse_available, moto_available
    )


#: Every facility by name, for a summary or a CI gate.
PROBES: dict[str, Callable[[], Probe]] = {
    "root": requires_root_capabilities,
    "fuse": fuse_available,
    "sshfs": sshfs_available,
    "netns": netns_available,
    "loop": loop_available,
    "tmpfs": tmpfs_available,
    "ext4": lambda: disk_available("ext4"),
    "xfs": lambda: disk_available("xfs"),
    "moto": moto_available,
    "s3fs_python": s3fs_python_available,
    "s3fs_fuse": s3fs_fuse_available,
    "fiu": functools.cache(fiu_available),
}


def all_probes() -> dict[str, Probe]:
    """Runs every probe.

    Returns:
        ``{facility: (available, reason)}``.
    """
    return {name: probe() for name, probe in PROBES.items()}
