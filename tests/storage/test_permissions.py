"""A root the job cannot write: a read-only filesystem (a real read-only tmpfs mount)
and a directory an unprivileged user may not write (a real child process that drops
root). Both are refused at open with ``StoragePermissionError``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from atomic_checkpoint import CheckpointManager, StoragePermissionError


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a read-only tmpfs needs root")
def test_read_only_filesystem_gives_a_permission_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(ro)], check=True)
    try:
        with pytest.raises(StoragePermissionError, match=r"writable|read-only"):
            CheckpointManager(ro / "ckpt")
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_unwritable_root_for_a_normal_user(tmp_path):
    # Root ignores permission bits, so this runs the check as an unprivileged user.
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user")
    root = tmp_path / "locked"
    root.mkdir(mode=0o555)
    os.chmod(tmp_path, 0o755)
    code = (
        "import os, sys\n"
        # Import first: the interpreter's own files may not be readable by that user.
        "from atomic_checkpoint import CheckpointManager, StoragePermissionError\n"
        "os.setgid(65534); os.setuid(65534)\n"
        f"try:\n    CheckpointManager({str(root)!r})\n"
        "except StoragePermissionError as e:\n    print('OK', e); sys.exit(0)\n"
        "sys.exit(3)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=str(tmp_path)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Permission denied" in proc.stdout or "writable" in proc.stdout
