"""Which mount holds a root, on real mounts: a filesystem mounted over a parent of an
older mount hides it, and the root is on the newer one, whatever the longest mount
point in the table says."""

from __future__ import annotations

import os
import subprocess

import pytest

from atomic_checkpoint.storage.detect import mount_of


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting tmpfs needs root")
def test_a_mount_over_a_parent_of_an_older_mount_is_the_one_that_holds_the_root(tmp_path):
    # A tmpfs at a/b, then another over a: a/b/ck lives on the second. The longest
    # mount point (a/b) was taken, so an unknown FUSE mount over a (whose rename is
    # not atomic) was detected as the tmpfs under it: rename commits, no warning, and
    # saves that returned were not there.
    a = tmp_path / "a"
    (a / "b").mkdir(parents=True)
    mounted = []
    try:
        for source, where in (("ac-older", a / "b"), ("ac-newer", a)):
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=1m", source, str(where)], check=True
            )
            mounted.append(where)
        assert mount_of(a / "b" / "ck").source == "ac-newer"
        (a / "b").mkdir()  # on the newer tmpfs now
        assert mount_of(a / "b" / "ck").source == "ac-newer"
    finally:
        for where in reversed(mounted):
            subprocess.run(["umount", str(where)], check=True)
    assert mount_of(a / "b" / "ck").source != "ac-newer"  # back on the disk's mount
