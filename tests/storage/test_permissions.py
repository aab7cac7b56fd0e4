"""A root the job cannot write: a read-only filesystem (a real read-only tmpfs mount)
and a directory an unprivileged user may not write (a real child process that drops
root). Both are refused at open with ``StoragePermissionError``."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from atomic_checkpoint import CheckpointManager, StorageError, StoragePermissionError


@contextlib.contextmanager
def _reachable_base() -> Iterator[Path]:
    """A fresh directory an unprivileged user can reach (pytest's tmp_path sits under
    one only root may enter), removed afterwards; skips unless this is root, which
    switching to an unprivileged user needs."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user")
    base = Path(tempfile.mkdtemp(prefix="ac-perm-"))
    try:
        os.chmod(base, 0o755)
        yield base
    finally:
        shutil.rmtree(base)


@contextlib.contextmanager
def _tmpfs(where: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``where`` (made) with ``options``, unmounted after."""
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a read-only tmpfs needs root")
def test_read_only_filesystem_gives_a_permission_error(tmp_path):
    # EROFS, said as such: it was "not writable by this user: fix its permissions".
    with (
        _tmpfs(tmp_path / "ro", "size=1m,ro") as ro,
        pytest.raises(StoragePermissionError, match=r"mounted read-only: remount"),
    ):
        CheckpointManager(ro / "ckpt")


@pytest.mark.skipif(os.geteuid() != 0, reason="remounting a tmpfs read-only needs root")
def test_a_root_with_checkpoints_on_a_filesystem_remounted_read_only(tmp_path):
    with _tmpfs(tmp_path / "mnt", "size=4m") as mnt:
        with CheckpointManager(mnt / "ckpt") as mgr:
            mgr.save(1, {"w": [1.0, 2.0]})
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        # It began "is not writable by this user", though no permission could help.
        with pytest.raises(StoragePermissionError, match=r"is on a read-only filesystem") as err:
            CheckpointManager(mnt / "ckpt")
        said = str(err.value)
        assert "not writable by this user" not in said and "mounted read-only" in said, said
        with CheckpointManager(mnt / "ckpt", read_only=True) as reader:  # as it says
            assert reader.restore(1) == {"w": [1.0, 2.0]}


@pytest.mark.parametrize("holds", ["nothing", "checkpoints"])
def test_unwritable_root_for_a_normal_user(holds):
    # Root ignores permission bits, so this runs the check as an unprivileged user, in a
    # directory that user can reach (pytest's tmp_path sits under a directory only root
    # may enter, where every path would be "Permission denied" whatever we check).
    # Empty, ROOT's first mkdir fails; holding the user's own run (ROOT alone made
    # read-only afterwards), the lock is taken in its .atomic-checkpoint/ and the
    # writability check refuses ROOT: the same error type either way.
    with _reachable_base() as base:
        root = base / "locked"
        if holds == "checkpoints":
            with CheckpointManager(root) as mgr:
                mgr.save(1, {"x": 1})
            for d, dirs, files in os.walk(root):
                for name in [d, *(os.path.join(d, n) for n in dirs + files)]:
                    os.chown(name, 65534, 65534)
        root.mkdir(mode=0o555, exist_ok=True)
        os.chmod(root, 0o555)
        code = (
            "import os, sys\n"
            # Import first: the interpreter's own files may not be readable by that user.
            "from atomic_checkpoint import CheckpointManager, StoragePermissionError\n"
            "os.setgid(65534); os.setuid(65534)\n"
            f"try:\n    CheckpointManager({str(root)!r})\n"
            "except StoragePermissionError as e:\n    print('OK', e); sys.exit(0)\n"
            "except Exception as e:\n    print(type(e).__name__, e); sys.exit(3)\n"
            "sys.exit(4)\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=base
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        want = "Permission denied" if holds == "nothing" else "is not writable by this user"
        assert want in proc.stdout, proc.stdout
        # Which directory it may not write in, with its owner and mode.
        assert f"This user may not write in {str(root)!r} (owner uid " in proc.stdout
        assert "mode 0555" in proc.stdout, proc.stdout


def test_a_reader_refused_a_file_is_told_to_get_read_access_not_write_access():
    # A read-only restore of a rank file another user wrote with umask 077 said "check
    # that the checkpoint root is writable by this user": a reader never needs that.
    from atomic_checkpoint.errors import map_os_error

    exc = PermissionError(13, "Permission denied")
    read = str(map_os_error(exc, "read", "/r/checkpoint-1/rank-00000.safetensors"))
    assert "This user may not read it" in read and "writable" not in read
    create = str(map_os_error(exc, "create", "/nonexistent-dir/x"))
    assert "This user may not write in '/nonexistent-dir'" in create
    ro = str(map_os_error(OSError(30, "Read-only file system"), "create", "/r/x"))
    assert "mounted read-only: remount it read-write" in ro


def test_a_reader_not_let_into_pending_still_lists_and_verifies():
    # .pending/ of another user's job (umask 077), every checkpoint readable: a reader's
    # checkpoints() raised StoragePermissionError, and `list`/`verify` exited 2.
    with _reachable_base() as base:
        root = base / "root"
        with CheckpointManager(root) as mgr:
            mgr.save(1, {"x": 1})
        os.chmod(root / ".pending", 0o700)
        code = (
            "import os, sys\n"
            "from atomic_checkpoint import CheckpointManager\n"
            "import locale\n"
            "from atomic_checkpoint.cli import build_parser, main\n"
            "build_parser()  # argparse's gettext, imported while the interpreter is readable\n"
            "os.setgid(65534); os.setuid(65534)\n"
            f"with CheckpointManager({str(root)!r}, read_only=True) as r:\n"
            "    print('steps', [c.step for c in r.checkpoints()])\n"
            f"sys.exit(main(['verify', {str(root)!r}]))\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=base
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "steps [1]" in proc.stdout and "1 ok, 0 failed" in proc.stdout, proc.stdout
        assert "not listing" in proc.stderr and ".pending" in proc.stderr, proc.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_filesystem_mounted_over_an_open_root_is_said_as_such(tmp_path):
    # A reader opened on a directory, then a tmpfs mounted there: refused (right), but
    # said as "the mount it was on is gone ... mount the same filesystem there again".
    root = tmp_path / "root"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"x": 1})
    reader = CheckpointManager(root, read_only=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)], check=True)
    try:
        with pytest.raises(StorageError, match=r"was mounted over checkpoint root") as e:
            reader.checkpoints()
        assert "is gone" not in str(e.value) and "Unmount it to carry on" in str(e.value)
    finally:
        subprocess.run(["umount", str(root)], check=True)
        reader.close()


def test_the_advice_for_a_rename_names_the_directory_of_each_side():
    # "may not write in '/r/checkpoint-100 -> /r/.trash'": the pair read as one path.
    from atomic_checkpoint.errors import permission_advice

    advice = permission_advice(errno.EACCES, "rename", "/r/checkpoint-100 -> /r/.trash/x.1")
    assert "may not write in '/r' or '/r/.trash': make them writable" in advice
    one = permission_advice(errno.EACCES, "rename", "/r/.pending/a -> /r/.pending/b")
    assert "may not write in '/r/.pending': make it writable" in one
    # As root (chattr +i on ROOT), a mode or owner is rarely the cause: said too.
    assert ("lsattr -d; chattr -i" in advice) == (os.geteuid() == 0), advice
