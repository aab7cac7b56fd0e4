"""Real disk-full campaign: ROOT on a small filesystem that really runs out of space.

Filesystems: tmpfs, ext4 made with ``-m 0`` (no root reserve: the campaign runs as
root), xfs, and sshfs whose export lives on a small tmpfs (a network filesystem without
``fallocate``, which reports the server's full disk as EIO: the library must still say
ENOSPC). Per filesystem:

- **one rank**: one random rank's state alone is larger than the free space;
- **together**: every rank's state fits alone, but not all of them together;

Each trial: 3 ranks save step 1 (fits); the coordinator fills the disk until a few MiB
are free; step 2 must fail on every rank with a ``DistributedStorageFullError`` that
carries ``StorageFullError`` (errno ENOSPC) for the rank(s) that hit the wall; step 1
must stay the newest checkpoint; the failed save must give back the space it took and
leave nothing pending; after the filler is removed, the same manager saves step 2 and
restores it bit-exactly.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
from collections.abc import Iterator
from typing import Any

from . import fresh_dir
from .checks import inspect_root, unclear_reason
from .jobs import ForkJob
from .tally import Progress, Tally
from .workers import w_disk_full

WORLD = 3
SMALL = 1 << 10  # tensor elements of the state that fits
LEAVE_FREE = 6 << 20  # bytes left free before the save that does not fit
#: Bytes a failed save may keep (directory blocks, journal, xfs log): it must give
#: back the space of every file it wrote.
SLACK = 512 << 10

KINDS = {"quick": ("tmpfs", "ext4", "xfs", "sshfs"), "full": ("tmpfs", "ext4", "xfs", "sshfs")}
REPEATS = {"quick": 1, "full": 3}
VARIANTS = ("one-rank", "together")


def run(size: str, seed: int, progress: Progress, workdir: str) -> Tally:
    tally = Tally("disk-full")
    rng = random.Random(seed)
    base = fresh_dir(os.path.join(workdir, "disk-full"))
    for kind in KINDS[size]:
        try:
            with _small_root(kind, base) as (root, filler):
                # What the filesystem says (sshfs: EIO) is a statistic; the library must
                # say ENOSPC on every kind (``storage.posix.write_error``).
                code = errno.ENOSPC
                said = code if kind != "sshfs" else probe_full_errno(root, os.path.dirname(filler))
                tally.stats.setdefault("errno_of_a_full_disk", {})[kind] = (
                    errno.errorcode[said] if said else "none"
                )
                for i in range(REPEATS[size]):
                    for variant in VARIANTS:
                        where = os.path.join(root, f"r{i}-{variant}")
                        _trial(tally, kind, variant, where, filler, rng, base, code)
        except Exception as exc:
            tally.violate("stuck", f"{kind}: could not run: {type(exc).__name__}: {exc}")
        progress(f"disk-full: {kind} done, {tally.trials} trials, {tally.violations} violations")
    return tally.finish()


@contextlib.contextmanager
def _small_root(kind: str, base: str) -> Iterator[tuple[str, str]]:
    """(a directory for roots, the filler path) on a small filesystem of ``kind``."""
    from tests.testbed import SmallDisk, SshfsExport

    if kind != "sshfs":
        with SmallDisk(base, 48 if kind == "xfs" else 32, kind=kind) as disk:
            yield str(disk.path), os.path.join(str(disk.path), "filler")
        return
    with (
        SmallDisk(base, 32, kind="tmpfs") as disk,
        SshfsExport(os.path.join(str(disk.path), "srv")) as exp,
    ):
        mnt = exp.mount(os.path.join(base, "sshfs-mnt"))
        # The filler is written on the server side; the ranks see the full disk through
        # the mount, as clients of a full NFS/sshfs server do.
        yield str(mnt.path), os.path.join(str(exp.export), "filler")


def probe_full_errno(mount_dir: str, server_dir: str) -> int | None:
    """The errno a client of ``mount_dir`` gets when the server's disk is full.

    SFTP (protocol 3, what sshfs speaks) has no "disk full" status: the server sends a
    generic failure, which sshfs reports as EIO. The library reports it as the full
    disk it is (ENOSPC, ``StorageFullError``); this probe records what the filesystem
    itself said.
    """
    filler = os.path.join(server_dir, "probe-filler")
    try:
        with open(filler, "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        fd = os.open(os.path.join(mount_dir, "probe"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            for _ in range(64):
                os.write(fd, b"x" * (1 << 20))
            os.fsync(fd)
        except OSError as exc:
            return exc.errno
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
        return None
    finally:
        for p in (filler, os.path.join(server_dir, "probe")):
            with contextlib.suppress(OSError):
                os.unlink(p)


def _trial(
    tally: Tally,
    kind: str,
    variant: str,
    root: str,
    filler: str,
    rng: random.Random,
    base: str,
    code: int,
) -> None:
    tally.trials += 1
    if variant == "one-rank":
        victim = rng.randrange(WORLD)
        big = {victim: (2 * LEAVE_FREE) // 8}  # 2 tensors of 4-byte floats: 2x the free space
    else:
        big = {r: (LEAVE_FREE * 45 // 100) // 8 for r in range(WORLD)}  # 3 x 45 %
    label = f"{kind} {variant}"
    tmp = os.path.join(base, "jobs")
    os.makedirs(tmp, exist_ok=True)
    job = ForkJob(w_disk_full, WORLD, root, SMALL, big, filler, LEAVE_FREE, tmp_dir=tmp)
    try:
        results = job.wait(timeout_s=120)
    finally:
        job.close()
    values: list[dict[str, Any]] = []
    for r in results:
        if r.exitcode is None:
            tally.violate("hangs", f"{label}: rank {r.rank} did not finish")
            return
        if r.error is not None or r.exitcode != 0:
            tally.violate("stuck", f"{label}: rank {r.rank} crashed: {r.error_text[-400:]}")
            return
        values.append(r.value)
    _judge(tally, label, values, code)
    view = inspect_root(root, world=WORLD, size=lambda s, r: big.get(r, SMALL) if s == 2 else SMALL)
    for t in view.torn:
        tally.violate("torn", f"{label}: {t}")
    if view.steps != [1, 2]:
        tally.violate("lost", f"{label}: the root holds steps {view.steps}, not [1, 2]")
    # The next trial on this disk needs the room back.
    shutil.rmtree(root, ignore_errors=True)


def _judge(tally: Tally, label: str, values: list[dict[str, Any]], code: int) -> None:
    coord = values[0]
    if any(v.get("saved_full") for v in values):
        tally.violate("split", f"{label}: a save larger than the free space succeeded on some rank")
        return
    tally.faults += 1
    for i, v in enumerate(values):
        desc = v["error"]
        reason = unclear_reason(desc, errno=code, full=True) if desc else "no error"
        if reason:
            tally.violate("unclear", f"{label}: rank {i}: {reason}")
        elif "DistributedCheckpointError" in desc["mro"]:
            tally.count("failed_ranks", str(sorted(f["rank"] for f in desc["failures"])))
        tally.count("error", desc["type"] if desc else "none")
        if v["steps_after"] != [1]:
            tally.violate("lost", f"{label}: rank {i} lists {v['steps_after']} after the failure")
        if v["retry_error"] is not None:
            tally.violate(
                "stuck",
                f"{label}: rank {i}: the save after freeing space failed: {v['retry_error']}",
            )
        elif not v["restored"]:
            tally.violate("torn", f"{label}: rank {i}: step 2 does not restore exactly")
    if coord["pending_after"]:
        tally.violate(
            "leaks", f"{label}: pending data after the failed save: {coord['pending_after']}"
        )
    kept = coord["free_before"] - coord["free_after"]
    tally.stats.setdefault("bytes_kept_after_failure", {})[label] = kept
    if kept > SLACK:
        tally.violate("leaks", f"{label}: the failed save kept {kept} bytes of the disk")
