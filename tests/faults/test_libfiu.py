"""libfiu faults in real processes: each storage error reaches the caller as the
project's error, with its errno and path, and never as a wrong diagnosis.

Children run under ``fiu-run -x`` with ``reliability/fiu_extra.c`` preloaded and arm
their own faults through libfiu's C API (``reliability.fiuctl.Fiu``). The campaign
(``reliability.iofaults``) runs the full point x phase x rank matrix; these tests pin
the violations it found, plus a bounded slice of the matrix through the same machinery.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from reliability import REPO_ROOT, iofaults
from reliability.fiuctl import EXTRA_ENV, build_extra, fiu_argv
from reliability.tally import Tally

from atomic_checkpoint import CheckpointManager
from tests.testbed.pytest_fixtures import strict_facilities

pytestmark = [pytest.mark.faults]


@pytest.fixture(scope="module")
def extra_so(tmp_path_factory: pytest.TempPathFactory) -> str:
    ok, why = iofaults.available()
    if not ok:
        if strict_facilities():
            pytest.fail(f"libfiu campaign unavailable: {why} (required under CI)")
        pytest.skip(f"libfiu campaign unavailable: {why}")
    return build_extra(str(tmp_path_factory.mktemp("fiu")))


def run_child(extra: str, tmp_path: Path, code: str, *args: str) -> dict:
    """Run ``code`` under fiu-run in a fresh interpreter; it prints one JSON line."""
    prelude = "import errno, json, os, sys\nfrom reliability.fiuctl import Fiu\nfiu = Fiu()\n"
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, **{EXTRA_ENV: extra})
    argv = fiu_argv(
        extra,
        [sys.executable, "-c", prelude + textwrap.dedent(code), *args],
        ctrl_prefix=str(tmp_path / "fiu-ctrl"),
    )
    done = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=60, check=False, cwd=REPO_ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(60)
def test_failed_rename_of_an_atomic_replace_is_a_storage_error(extra_so, tmp_path):
    # Found by the campaign: os.replace's OSError escaped write_bytes_atomic raw (the
    # run lock writes its token through it, so a manager start failed with OSError).
    root = tmp_path / "root"
    root.mkdir()
    (root / "state.json").write_bytes(b"old")
    out = run_child(
        extra_so,
        tmp_path,
        """
        from atomic_checkpoint.storage.local import LocalStorage
        s = LocalStorage(sys.argv[1])
        out = {}
        for name in ("ENOSPC", "EIO", "EROFS"):
            fiu.enable("posix/io/dir/rename", getattr(errno, name), onetime=True)
            try:
                s.write_bytes_atomic("state.json", b"new")
                out[name] = None
            except Exception as exc:
                out[name] = [type(exc).__name__, getattr(exc, "errno", None), str(exc)]
            fiu.disable("posix/io/dir/rename")
        out["left"] = sorted(os.listdir(sys.argv[1]))
        print(json.dumps(out))
    """,
        str(root),
    )
    want = {"ENOSPC": "StorageFullError", "EIO": "StorageError", "EROFS": "StoragePermissionError"}
    for name, kind in want.items():
        assert out[name] is not None, f"{name}: the failed rename was reported as success"
        assert out[name][:2] == [kind, getattr(errno, name)], out[name]
        assert "state.json" in out[name][2] and f"errno {getattr(errno, name)}" in out[name][2]
    # The old content stays, and no temporary file is left behind.
    assert (root / "state.json").read_bytes() == b"old"
    assert out["left"] == ["state.json"]


@pytest.mark.timeout(60)
def test_unreadable_storage_is_an_io_error_not_a_corrupt_or_missing_checkpoint(extra_so, tmp_path):
    # Found by the campaign: an EIO while opening the run file was reported as a corrupt
    # checkpoint, and EIO on every manifest made latest() None ("nothing to resume":
    # a silent fresh start over existing checkpoints) and restore() say "no valid
    # checkpoint". An I/O error says nothing about the checkpoint: it must surface.
    root = tmp_path / "root"
    mgr = CheckpointManager(root)
    mgr.save(1, {"x": 1})
    mgr.save(2, {"x": 2})
    mgr.close()
    out = run_child(
        extra_so,
        tmp_path,
        """
        import atomic_checkpoint.serialization  # imported before the fault: it is code
        from atomic_checkpoint import CheckpointManager
        def attempt(fn):
            try:
                return ["ok", repr(fn())]
            except Exception as exc:
                return [type(exc).__name__, getattr(exc, "errno", None), str(exc)]
        out = {}
        reader = CheckpointManager(sys.argv[1], read_only=True)
        fiu.enable("posix/io/oc/open", errno.EIO, onetime=False)
        out["start"] = attempt(lambda: CheckpointManager(sys.argv[1]))
        out["latest"] = attempt(lambda: reader.latest())
        out["restore"] = attempt(lambda: reader.restore())
        fiu.disable("posix/io/oc/open")
        out["after"] = attempt(lambda: reader.restore()["x"])
        print(json.dumps(out))
    """,
        str(root),
    )
    for what in ("start", "latest", "restore"):
        assert out[what][0] != "ok", (what, out[what])
        kind, code, message = out[what]
        assert kind == "StorageError" and code == errno.EIO, (what, out[what])
        assert "errno 5" in message and str(root) in message, (what, message)
    assert out["after"] == ["ok", "2"]  # the fault cleared: the newest checkpoint is there


@pytest.mark.timeout(60)
def test_read_errors_while_restoring_or_verifying_are_storage_errors(extra_so, tmp_path):
    # Found by the campaign: a read error (EIO from a failing disk) inside restore()
    # escaped as a bare OSError, bypassing the error tree, and verify() did the same.
    root = tmp_path / "root"
    mgr = CheckpointManager(root)
    mgr.save(1, {"w": list(range(1000)), "name": "x" * 5000})
    mgr.close()
    out = run_child(
        extra_so,
        tmp_path,
        """
        import atomic_checkpoint.serialization  # imported before the fault: it is code
        from atomic_checkpoint import CheckpointManager
        from atomic_checkpoint.storage.local import LocalStorage
        mgr = CheckpointManager(sys.argv[1], read_only=True)
        arm = []
        real_open = LocalStorage.open_read

        def open_read(self, path):
            # Arm once the state file is open: its next read fails (the manifest,
            # read before it, is not what this test is about).
            f = real_open(self, path)
            if path.endswith(".safetensors") and arm:
                fiu.enable("posix/io/rw/read", arm.pop(), onetime=True)
            return f

        LocalStorage.open_read = open_read
        out = {}
        for what, fn in (("restore", lambda: mgr.restore(1)), ("verify", lambda: mgr.verify(1))):
            for name in ("EIO", "ENOSPC"):
                arm.append(getattr(errno, name))
                try:
                    fn()
                    out[what + name] = None
                except Exception as exc:
                    out[what + name] = [type(exc).__name__, getattr(exc, "errno", None), str(exc)]
                fiu.disable("posix/io/rw/read")
        print(json.dumps(out))
    """,
        str(root),
    )
    for what in ("restore", "verify"):
        for name, kind in (("EIO", "StorageError"), ("ENOSPC", "StorageFullError")):
            got = out[what + name]
            assert got is not None, f"{what}: the read error was swallowed"
            assert got[:2] == [kind, getattr(errno, name)], (what, got)
            assert "rank-00000.safetensors" in got[2] and "read" in got[2], (what, got)


def _run_slice(combos: list[str], tmp_path: Path, fs: str = "local") -> Tally:
    """The libfiu campaign (quick size, seed 3, quietly) on just ``combos``."""
    only = [iofaults.parse_combo(c) for c in combos]
    return iofaults.run("quick", 3, lambda _line: None, str(tmp_path), only=only, fs=fs)


@pytest.mark.timeout(240)
def test_campaign_slice_is_clean(extra_so, tmp_path):
    """The combinations that failed while the campaign was built, and one of each
    point in a protocol phase, through the real 3-rank job under fiu-run."""
    combos = [
        "rename:EIO:once:startup:coordinator",
        "rename:EDQUOT:persistent:startup:coordinator",
        "open:EROFS:persistent:startup:coordinator",
        "open:EIO:persistent:restore:coordinator",
        "write:ENOSPC:once:mid_write:peer",
        "fsync:EIO:persistent:after_write:coordinator",
        "rename:ENOSPC:once:after_manifest:coordinator",
        "fsync:EIO:once:after_rename:coordinator",
        "mkdir:EDQUOT:persistent:prepare:coordinator",
        "unlink:EIO:persistent:after_uncommit:coordinator",
        "open:EIO:once:before_write:peer",
    ]
    tally = _run_slice(combos, tmp_path)
    assert tally.trials == len(combos)
    assert tally.faults >= len(combos) - 1, tally.stats
    assert tally.violations == 0, "\n".join(tally.details)


@pytest.mark.timeout(180)
def test_campaign_slice_on_s3fs_fuse_is_clean(extra_so, tmp_path):
    """Found by the libfiu campaign on an s3fs-fuse root (marker strategy, a storage
    that is not coherent between clients):

    - after a commit every peer reads the manifest back through its own mount (to wait
      until it is visible); a read or open error there made that peer's save raise
      while the other ranks returned success for the same committed step (split);
    - a failed unlink of ``create_exclusive``'s temporary file (the run lock's) was
      swallowed, and the file stayed for ever: neither the next start nor ``clean``
      removes it (leak).
    """
    from tests.testbed.pytest_fixtures import require_facility

    require_facility("s3fs_fuse")
    require_facility("s3fs_python")
    combos = [
        "read:EIO:persistent:prepare:peer:save",
        "open:ENOSPC:persistent:during_broadcast:peer:save_async",
        "unlink:ENOSPC:once:startup:coordinator",
    ]
    tally = _run_slice(combos, tmp_path, fs="s3fs")
    assert tally.trials == len(combos)
    assert tally.faults == len(combos), tally.stats
    assert tally.violations == 0, "\n".join(tally.details)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", ["EIO", "ENOSPC", "EINTR"])
def test_a_failing_close_is_a_storage_error(extra_so, tmp_path, code):
    # NFS and FUSE report a deferred write error at close(). The close of a directory
    # after its fsync, and of the run lock's new file, let it escape as a bare OSError
    # (no path, not a CheckpointError): a training loop catching CheckpointError died.
    root = tmp_path / "root"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"x": 1})
    out = run_child(
        extra_so,
        tmp_path,
        """
        import atomic_checkpoint.serialization  # imported before the fault: it is code
        from atomic_checkpoint import CheckpointError, CheckpointManager, KeepLast
        code = getattr(errno, sys.argv[2])
        def attempt(fn):
            fiu.enable("posix/io/oc/close", code, onetime=False)
            try:
                fn()
                return ["ok"]
            except CheckpointError as exc:
                return ["ours", type(exc).__name__, exc.errno, str(exc)]
            except BaseException as exc:
                return ["bare", type(exc).__name__, repr(exc)]
            finally:
                fiu.disable("posix/io/oc/close")
        out = {"start": attempt(lambda: CheckpointManager(sys.argv[1]).close())}
        mgr = CheckpointManager(sys.argv[1], retention=KeepLast(1))
        mgr.save_async(2, {"x": 2}).result(30)  # its modules imported before the fault
        out["save"] = attempt(lambda: mgr.save(3, {"x": 3}))
        out["async"] = attempt(lambda: mgr.save_async(4, {"x": 4}).result(30))
        out["retention"] = attempt(lambda: mgr.apply_retention())
        mgr.close()
        print(json.dumps(out))
    """,
        str(root),
        code,
    )
    for what, got in out.items():
        assert got[0] == "ours", (what, got)
        assert got[2] == getattr(errno, code) and str(root) in got[3], (what, got)
