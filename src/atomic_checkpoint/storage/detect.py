"""What filesystem a local path lives on, from the kernel's mount table.

The commit strategy depends on it: a FUSE mount of an object store (s3fs-fuse,
gcsfuse, mountpoint-s3, goofys, ...) looks like a directory, but its directory rename
is a per-object copy followed by a delete (or is refused outright), so a crash in the
middle leaves files under both names and observers see both prefixes at once
(FAILURE_MODES D2). Such mounts get the marker strategy. Network filesystems (sshfs,
NFS, SMB) keep atomic directory rename but are not coherent between clients, so
readers poll with a bound after a change (FAILURE_MODES D1). A FUSE mount of a kind
not listed here is unknown and gets the cautious treatment of both (marker commits,
bounded polls) and one warning that names it.

The table is ``/proc/self/mountinfo`` (Linux); the entry whose mount point is the
longest prefix of the resolved path wins, and of several mounts stacked on one mount
point the last one listed (the one on top). The path is made absolute (relative to the
working directory) and resolved through symlinks first, so ``"ckpt"``, ``"./out"`` and a
symlink to a mount are detected like the mount itself. Elsewhere (macOS, Windows) nothing is
detected and the path is treated as a local disk.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from .base import StorageCapabilities

log = logging.getLogger("atomic_checkpoint")

MOUNTINFO = "/proc/self/mountinfo"

#: FUSE filesystem names (the part after ``fuse.`` in the type, or the mount source
#: for a plain ``fuse`` type) of object-store mounts whose directory rename is
#: copy+delete or unsupported. JuiceFS and s3backer are absent on purpose: they keep
#: their own metadata and rename atomically.
COPY_DELETE_FUSE = frozenset(
    {
        "s3fs",  # s3fs-fuse: rename = CopyObject per key, then DeleteObject
        "gcsfuse",  # gcsfuse: directory rename off by default, else copy+delete
        "mountpoint-s3",  # mountpoint-s3: refuses directory rename
        "goofys",
        "geesefs",
        "rclone",  # rclone mount over S3/GCS/Azure remotes: server-side copy + delete
        "blobfuse",
        "blobfuse2",
        "ossfs",
        "cosfs",
        "obsfs",
    }
)

#: FUSE filesystems that are a local disk seen through FUSE (one client, rename is the
#: kernel's): overlay and bind layers, encryption layers, NTFS and exFAT drivers, and
#: container helpers. Any other FUSE type is unknown: it may be a network or object
#: store client, so it is treated as not coherent and without atomic rename (and a
#: warning names it). ``fuseblk`` mounts (a block device behind FUSE) are local too.
LOCAL_FUSE = frozenset(
    {
        "fuse-overlayfs",
        "bindfs",
        "gocryptfs",
        "encfs",
        "securefs",
        "cryfs",
        "ntfs-3g",
        "ntfs",
        "exfat",
        "lxcfs",
        "squashfuse",
        "portal",  # xdg-desktop-portal's document store
    }
)

#: Network and cluster filesystems, by mount type: rename is atomic on the server, but
#: each client caches names and attributes, so a change made through one client shows
#: up late on another (FAILURE_MODES D1). sshfs keeps a directory listing and a deleted
#: name's attributes for ~20 s; NFS caches attributes for acregmin/acdirmin seconds and
#: negative lookups; SMB, JuiceFS and 9p clients cache attributes too. Lustre, GPFS,
#: BeeGFS and CephFS keep clients coherent through lock managers, but how far is a
#: mount-time setting (client caches, statahead, NFS re-exports of them are common), and
#: treating a coherent mount as non-coherent only costs a refresh before each listing
#: and a bounded poll after each change, while the opposite mistake acts on stale names.
_NETWORK = {
    "fuse.sshfs": "sshfs",
    "nfs": "nfs",
    "nfs4": "nfs",
    "cifs": "smb",
    "smb3": "smb",
    "9p": "9p",
    "lustre": "lustre",
    "gpfs": "gpfs",
    "beegfs": "beegfs",
    "ceph": "cephfs",
    "fuse.ceph-fuse": "cephfs",
    "fuse.glusterfs": "glusterfs",
    "fuse.juicefs": "juicefs",
    "afs": "afs",
    "orangefs": "orangefs",
}

#: Network filesystems whose client accepts a directory fsync but cannot pass it on:
#: sftp has no request for it, so sshfs answers success and syncs nothing. The names
#: a commit creates are then as durable as the server's own filesystem makes them.
_NO_DIR_FSYNC = frozenset({"sshfs"})

_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class MountInfo:
    """One line of the mount table.

    Attributes:
        mount_point: where it is mounted.
        fstype: the filesystem type as the kernel lists it (``ext4``, ``fuse.s3fs``).
        source: the mounted thing (a device, ``host:/export``, a bucket name).
    """

    mount_point: str
    fstype: str
    source: str
    #: ``(major, minor)`` of the mounted filesystem, as ``st_dev`` of its files says.
    device: tuple[int, int] | None = None

    @property
    def fuse_name(self) -> str | None:
        """The FUSE filesystem's name (``s3fs`` for ``fuse.s3fs``), else None."""
        if self.fstype.startswith("fuse."):
            return self.fstype[len("fuse.") :]
        if self.fstype in ("fuse", "fuseblk"):
            # Old libfuse versions list no subtype; the source then names the daemon.
            return os.path.basename(self.source) or None
        return None

    @property
    def is_copy_delete(self) -> bool:
        """True for object-store FUSE mounts whose directory rename is not atomic."""
        return self.fuse_name in COPY_DELETE_FUSE


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as \040, \011, \012, \134.
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[MountInfo]:
    """Parse the text of ``/proc/<pid>/mountinfo`` (see proc(5)); bad lines are skipped.

    Each line: ``id parent major:minor root mount_point options [optional...] - fstype
    source super_options``; the optional fields end at the lone ``-``.
    """
    out = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
            mount_point = _unescape(fields[4])
            fstype = _unescape(fields[sep + 1])
            source = _unescape(fields[sep + 2]) if len(fields) > sep + 2 else ""
        except (ValueError, IndexError):
            continue
        major, _, minor = fields[2].partition(":")
        device = (int(major), int(minor)) if major.isdigit() and minor.isdigit() else None
        out.append(MountInfo(mount_point, fstype, source, device))
    return out


def _device_near(path: str) -> tuple[int, int] | None:
    """``(major, minor)`` of the filesystem holding ``path``, or of its nearest existing
    parent; None if none can be examined."""
    while True:
        try:
            st = os.stat(path)
        except OSError:
            parent = os.path.dirname(path)
            if parent == path:
                return None
            path = parent
            continue
        return os.major(st.st_dev), os.minor(st.st_dev)


def mount_of(path: str | os.PathLike[str], *, table: str | None = None) -> MountInfo | None:
    """The mount that holds ``path`` (resolved through symlinks), or None if unknown.

    Args:
        path: any local path; it need not exist yet.
        table: mountinfo text to use instead of ``/proc/self/mountinfo`` (tests).
    """
    # Absolute first: a relative root ("ckpt", "./out") is relative to the working
    # directory, and only an absolute path can be matched against mount points.
    text = os.path.abspath(os.fspath(path))
    given = table
    if table is None:
        try:
            with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
                table = f.read()
        except OSError:
            return None  # not Linux, or /proc not mounted: nothing to detect
        # The real path: a symlink to an s3fs or sshfs mount lives on that mount.
        # realpath resolves symlinks of the existing part and keeps a tail that does
        # not exist yet (a root about to be created lives on its nearest parent's mount).
        target = os.path.realpath(text)
    else:
        target = text  # a given table describes paths, not this machine's files
    best: MountInfo | None = None
    holding: list[MountInfo] = []
    for entry in parse_mountinfo(table):
        mp = entry.mount_point
        inside = target == mp or target.startswith(mp.rstrip("/") + "/") or mp == "/"
        # ">=": a later mount on the same point is stacked on top of the earlier one.
        if inside and (best is None or len(mp) >= len(best.mount_point)):
            best = entry
        if inside:
            holding.append(entry)
    if given is None and best is not None:
        # The longest mount point is not always what holds the path: a filesystem
        # mounted later over a parent of it (a FUSE mount over /a, with a tmpfs at
        # /a/b) hides /a/b, and the path is on the FUSE mount. The device of the path
        # says which; where no entry has it (btrfs subvolumes report other numbers),
        # the longest prefix stands.
        device = _device_near(target)
        same = [e for e in holding if e.device is not None and e.device == device]
        if same and best not in same:
            best = same[-1]  # the one mounted last: on top
    return best


def _copy_delete_capabilities(fstype: str) -> StorageCapabilities:
    """The cautious capabilities of a mount whose rename may be copy+delete: no atomic
    directory rename (so the marker strategy), no directory fsync, no exclusive create
    across clients, not coherent."""
    return StorageCapabilities(
        name=fstype,
        atomic_dir_rename=False,
        dir_fsync=False,
        exclusive_create=False,
        coherent=False,
    )


def local_capabilities(path: str | os.PathLike[str]) -> StorageCapabilities:
    """Capabilities of a ``LocalStorage`` rooted at ``path``, from its mount.

    - object-store FUSE (``fuse.s3fs``, ``fuse.gcsfuse``, ...): no atomic directory
      rename (so the marker strategy), no exclusive create across clients (O_EXCL and
      mkdir do not exclude between two s3fs mounts), not coherent (s3fs caches stat
      results; other clients see a 0-byte file until the writer's close).
    - sshfs: not coherent; ``dir_fsync`` False, because a directory fsync there is a
      silent no-op (it succeeds and syncs nothing), so it is not attempted.
    - NFS, SMB, 9p, Lustre, GPFS, BeeGFS, CephFS, GlusterFS, JuiceFS, AFS, OrangeFS:
      not coherent (see ``_NETWORK`` for why even the lock-managed ones).
    - a FUSE mount of any other kind (not in ``COPY_DELETE_FUSE``, ``_NETWORK`` or
      ``LOCAL_FUSE``): unknown, so the cautious answer: no atomic directory rename, no
      exclusive create, not coherent; a warning names the type and the override.
    - everything else (ext4, xfs, tmpfs, btrfs, ...): a coherent local disk.
    """
    mount = mount_of(path)
    dir_fsync = os.name != "nt"
    if mount is None:
        return StorageCapabilities(name="local", dir_fsync=dir_fsync)
    if mount.is_copy_delete:
        return _copy_delete_capabilities(mount.fstype)
    network = _NETWORK.get(mount.fstype)
    if network is not None:
        return StorageCapabilities(
            name=network, dir_fsync=dir_fsync and network not in _NO_DIR_FSYNC, coherent=False
        )
    fuse = mount.fuse_name
    if fuse is not None and mount.fstype != "fuseblk" and fuse not in LOCAL_FUSE:
        _warn_unknown_fuse(mount)
        return _copy_delete_capabilities(mount.fstype)
    return StorageCapabilities(name="local", dir_fsync=dir_fsync)


_WARNED_FUSE: set[tuple[str, str]] = set()


def _warn_unknown_fuse(mount: MountInfo) -> None:
    """Say once per mount which FUSE filesystem is unknown, what is assumed, and how
    to tell the library better."""
    key = (mount.mount_point, mount.fstype)
    if key in _WARNED_FUSE:
        return
    _WARNED_FUSE.add(key)
    log.warning(
        "atomic-checkpoint: %s is a FUSE mount of an unknown kind (%s, source %r): "
        "treating it as not coherent between clients and without atomic directory "
        "rename (marker commits, bounded waits for visibility). If its directory rename "
        "is atomic and every client sees changes at once, pass "
        "LocalStorage(root, capabilities=StorageCapabilities(name=%r, "
        "atomic_dir_rename=True, coherent=True, exclusive_create=..., dir_fsync=...)) as "
        "the root, each field saying what the filesystem does (see StorageCapabilities: "
        "exclusive_create, that creating a file fails if it exists, across clients; "
        "dir_fsync, that fsync of a directory makes its entries durable)",
        mount.mount_point,
        mount.fstype,
        mount.source,
        mount.fstype,
    )
