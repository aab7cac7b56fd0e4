"""Real storage services and real faults for tests, benchmarks and campaigns.

Plain context managers (no pytest dependency) that start real services on
127.0.0.1 or inside network namespaces they create, wait for them with
bounded loops, and tear everything down on exit, even after an exception:

- :class:`SshfsExport` / :class:`SshfsMount`: a private sshd and sshfs
  mounts of its export; two mounts behave like two nodes.
- :class:`NetnsPair`: two network namespaces joined by a veth pair, with
  :meth:`NetnsPair.cut` / :meth:`NetnsPair.restore` for partitions.
- :class:`S3Server` / :class:`S3fsFuseMount`: moto_server and s3fs-fuse.
- :class:`SmallDisk`: a small tmpfs, ext4 or xfs filesystem for ENOSPC;
  :class:`PowerCutImage`: what a power cut would leave of a loop-mounted one.
- :mod:`.fiu_tools`: libfiu fault injection in a Python child.
- :mod:`.probes`: ``(available, reason)`` for each facility.

pytest fixtures wrapping these live in :mod:`tests.testbed.pytest_fixtures`.
"""

from ._util import TestbedError, TestbedTimeout, free_port, mount_entries, wait_until
from .disk import PowerCutImage, SmallDisk, fill_until_enospc
from .fiu_tools import child_control, enable_cmd, fiu_available, fiu_run_argv, parent_control
from .netns import NetnsPair
from .probes import (
    PROBES,
    all_probes,
    disk_available,
    fuse_available,
    loop_available,
    moto_available,
    netns_available,
    requires_root_capabilities,
    s3fs_fuse_available,
    s3fs_python_available,
    sshfs_available,
    tmpfs_available,
)
from .s3 import S3fsFuseMount, S3Server
from .sshfs import COHERENT_OPTS, FAST_FAIL_OPTS, SshfsExport, SshfsMount

__all__ = [
    "COHERENT_OPTS",
    "FAST_FAIL_OPTS",
    "PROBES",
    "NetnsPair",
    "PowerCutImage",
    "S3Server",
    "S3fsFuseMount",
    "SmallDisk",
    "SshfsExport",
    "SshfsMount",
    "TestbedError",
    "TestbedTimeout",
    "all_probes",
    "child_control",
    "disk_available",
    "enable_cmd",
    "fill_until_enospc",
    "fiu_available",
    "fiu_run_argv",
    "free_port",
    "fuse_available",
    "loop_available",
    "moto_available",
    "mount_entries",
    "netns_available",
    "parent_control",
    "requires_root_capabilities",
    "s3fs_fuse_available",
    "s3fs_python_available",
    "sshfs_available",
    "tmpfs_available",
    "wait_until",
]
