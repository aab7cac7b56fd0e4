"""Self-check of the testbed: each fixture starts a real service, and the
filesystem behaviours the project's tests rely on actually happen here.

Each test prints one ``OBSERVED:`` line (shown with ``pytest -rA``) with the
timings and errnos seen, so a run doubles as a record of the environment.
"""

# Fixtures are imported from tests.testbed.pytest_fixtures and requested by
# parameter name, which pyflakes reads as redefinitions of the imports.
# ruff: noqa: F811

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

try:
    import tests.testbed  # noqa: F401
except ModuleNotFoundError:  # Run without the repository root on sys.path.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.netfs.nodes import dir_made_on_node_a
from tests.testbed import (
    FAST_FAIL_OPTS,
    NetnsPair,
    S3fsFuseMount,
    S3Server,
    SmallDisk,
    SshfsExport,
    SshfsMount,
    TestbedError,
    TestbedTimeout,
    all_probes,
    fill_until_enospc,
    fiu_run_argv,
    mount_entries,
    wait_until,
)
from tests.testbed._util import is_alive
from tests.testbed.netns import NETNS_RUN_DIR, list_netns
from tests.testbed.pytest_fixtures import (  # noqa: F401 - fixtures used by name
    fiu_ready,
    netns_pair,
    netns_sshfs,
    require_facility,
    s3_bucket,
    s3_server,
    s3fs_fuse_mount,
    small_disk,
    sshfs_export,
    sshfs_nodes,
    strict_facilities,
)

pytestmark = pytest.mark.netfs

# Bounded polling for cross-mount visibility: the documented lag of
# default-caching sshfs is ~20 s, so anything observed inside this window is
# the cached state, not a coincidence of timing.
OBSERVE_S = 3.0


def observed(**facts: object) -> None:
    """Prints one machine-readable line of what the test saw."""
    print("OBSERVED:", json.dumps(facts, default=str))


def errname(exc: OSError) -> str:
    """Symbolic errno of an OSError, e.g. ``"EPERM"``."""
    return errno.errorcode.get(exc.errno or 0, str(exc.errno))


def mounts_under(root: Path) -> list[str]:
    """Mount points at or below ``root`` (to prove teardown unmounted all)."""
    prefix = str(root.resolve())
    return [m.target for m in mount_entries() if m.target.startswith(prefix)]


# --------------------------------------------------------------------------
# Probes and harness behaviour
# --------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_probes_report_every_facility() -> None:
    probes = all_probes()
    observed(**{name: ok or why for name, (ok, why) in probes.items()})
    for name, (ok, why) in probes.items():
        assert isinstance(ok, bool) and isinstance(why, str), name
        assert ok or why, f"{name}: a missing facility must say why"
    if strict_facilities():
        missing = {name: why for name, (ok, why) in probes.items() if not ok}
        assert not missing, f"CI must provide every facility: {missing}"


@pytest.mark.timeout(10)
def test_wait_until_names_what_did_not_happen() -> None:
    start = time.monotonic()
    with pytest.raises(TestbedTimeout, match=r"the flag flipping did not happen within 0\.2s"):
        wait_until(lambda: False, 0.2, "the flag flipping")
    assert time.monotonic() - start < 2.0


@pytest.mark.timeout(60)
def test_teardown_after_exception_leaves_nothing(tmp_path: Path) -> None:
    require_facility("sshfs")
    require_facility("netns")
    with pytest.raises(RuntimeError, match="boom"):  # noqa: SIM117 - order matters
        with SshfsExport(tmp_path / "srv") as export:
            node = export.mount(tmp_path / "node")
            pids = [export.sshd_pid, node.pid, *node.ssh_pids()]
            with NetnsPair("ack") as pair:
                names = set(pair.names.values())
                assert names <= list_netns()
                raise RuntimeError("boom")
    assert mounts_under(tmp_path) == []
    assert not [p for p in pids if p is not None and is_alive(p)]
    assert not names & list_netns()
    observed(killed_pids=len(pids), namespaces_removed=sorted(names))


@pytest.mark.timeout(30)
def test_mount_against_dead_sshd_fails_fast_with_clear_error(
    sshfs_export: SshfsExport, tmp_path: Path
) -> None:
    assert sshfs_export.sshd_pid is not None
    os.kill(sshfs_export.sshd_pid, 9)
    wait_until(lambda: not is_alive(sshfs_export.sshd_pid or 0), 5.0, "sshd exit")
    start = time.monotonic()
    with pytest.raises(TestbedError, match="sshfs mount") as info:
        sshfs_export.mount(tmp_path / "never", timeout_s=10.0)
    elapsed = time.monotonic() - start
    assert elapsed < 10.0
    assert mounts_under(tmp_path) == []
    observed(seconds=round(elapsed, 3), error=str(info.value)[:160])


# --------------------------------------------------------------------------
# sshfs: two mounts of one export are two nodes
# --------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_sshfs_new_file_visible_but_old_listing_stays_stale(
    sshfs_nodes: tuple[SshfsMount, SshfsMount],
) -> None:
    on_a, on_b = dir_made_on_node_a(sshfs_nodes, "dir")
    (on_a / "one").write_text("1")
    assert os.listdir(on_b) == ["one"]  # B now caches this listing.

    (on_a / "two").write_text("2")
    start = time.monotonic()
    wait_until(lambda: (on_b / "two").exists(), OBSERVE_S, "new file on B")
    visible_after = time.monotonic() - start
    assert (on_b / "two").read_text() == "2"

    # sshfs's directory cache keeps serving the old listing (~20 s).
    stale = []
    for _ in range(5):
        time.sleep(0.2)
        stale.append(os.listdir(on_b))
    assert all(listing == ["one"] for listing in stale), stale

    # A metadata write through B on the directory drops B's cached listing.
    os.utime(on_b)
    assert sorted(os.listdir(on_b)) == ["one", "two"]
    observed(exists_after_s=round(visible_after, 4), stale_listing_for_s=1.0)


@pytest.mark.timeout(30)
def test_sshfs_renamed_dir_still_stats_on_other_node_but_open_fails(
    sshfs_export: SshfsExport, sshfs_nodes: tuple[SshfsMount, SshfsMount], tmp_path: Path
) -> None:
    a, b = sshfs_nodes
    coherent = sshfs_export.mount(tmp_path / "coherent", coherent=True)
    (a.path / "old").mkdir()
    (a.path / "old" / "MANIFEST").write_text("committed")
    for node in (b, coherent):  # Populate both nodes' caches.
        assert (node.path / "old" / "MANIFEST").read_text() == "committed"

    os.rename(a.path / "old", a.path / "new")
    samples = []
    deadline = time.monotonic() + 1.5
    for _ in range(15):
        stat_ok = (b.path / "old").exists()
        try:
            (b.path / "old" / "MANIFEST").read_text()
            open_result = "ok"
        except OSError as exc:
            open_result = errname(exc)
        samples.append((stat_ok, open_result))
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)

    # Default caching: stat() answers from the cache, open() asks the server.
    assert all(stat_ok for stat_ok, _ in samples), samples
    assert all(res == "ENOENT" for _, res in samples), samples
    assert os.listdir(b.path / "old") == []
    # Coherent mount: the old name is gone at once, the new one is there.
    assert not (coherent.path / "old").exists()
    assert (coherent.path / "new" / "MANIFEST").read_text() == "committed"
    observed(samples=len(samples), over_s=1.5, b_stat="ok", b_open="ENOENT", coherent="gone")


@pytest.mark.timeout(60)
def test_sshfs_exclusive_create_and_mkdir_have_one_winner(
    sshfs_nodes: tuple[SshfsMount, SshfsMount],
) -> None:
    rounds = 10
    loser_errnos: dict[str, int] = {}

    def race(make: object, index: int, kind: str) -> None:
        barrier = threading.Barrier(2, timeout=10)
        results: list[str] = []

        def contender(node: SshfsMount) -> None:
            target = node.path / f"{kind}-{index}"
            barrier.wait()
            try:
                make(target)  # type: ignore[operator]
                results.append("won")
            except OSError as exc:
                results.append(errname(exc))

        threads = [threading.Thread(target=contender, args=(n,)) for n in sshfs_nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=15)
        assert not any(t.is_alive() for t in threads), "contender hung"
        assert sorted(results).count("won") == 1, results
        loser = next(r for r in results if r != "won")
        assert loser in ("EEXIST", "EPERM"), results
        loser_errnos[loser] = loser_errnos.get(loser, 0) + 1

    def excl_create(path: Path) -> None:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))

    for i in range(rounds):
        race(excl_create, i, "file")
        race(os.mkdir, i, "dir")
    observed(rounds=rounds * 2, loser_errnos=loser_errnos)


@pytest.mark.timeout(30)
def test_sshfs_rename_onto_nonempty_dir_is_eperm_and_dir_fsync_is_noop(
    sshfs_nodes: tuple[SshfsMount, SshfsMount],
) -> None:
    a, _ = sshfs_nodes
    (a.path / "src").mkdir()
    (a.path / "dst").mkdir()
    (a.path / "dst" / "keep").write_text("x")
    with pytest.raises(OSError) as info:
        os.rename(a.path / "src", a.path / "dst")
    assert info.value.errno == errno.EPERM  # Not ENOTEMPTY as on local filesystems.

    dir_fd = os.open(a.path / "src", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)  # Accepted, but sshfs has no way to sync a directory.
    finally:
        os.close(dir_fd)
    observed(rename_onto_nonempty=errname(info.value), dir_fsync="no error")


@pytest.mark.timeout(30)
def test_sshfs_killed_transport_aborts_writer_and_drops_mount(
    sshfs_export: SshfsExport, tmp_path: Path
) -> None:
    node = sshfs_export.mount(tmp_path / "node")
    chunk = b"x" * 65536
    fd = os.open(node.path / "partial", os.O_WRONLY | os.O_CREAT, 0o644)
    written = os.write(fd, chunk)
    killed = node.kill_transport()
    assert killed, "no ssh transport found"
    start = time.monotonic()
    failure = None
    for _ in range(1000):
        try:
            written += os.write(fd, chunk)
        except OSError as exc:
            failure = errname(exc)
            break
        if time.monotonic() - start > OBSERVE_S:
            break
    fail_after = time.monotonic() - start
    try:
        os.close(fd)
        close_result = "ok"
    except OSError as exc:
        close_result = errname(exc)
    assert failure in ("ECONNABORTED", "EIO", "ENOTCONN"), failure

    # A partial file stays on the server.
    partial = sshfs_export.export / "partial"
    assert partial.exists() and partial.stat().st_size < written + len(chunk)
    # sshfs exits on the lost link and unmounts itself: the mount point is a
    # plain, empty local directory again, so later writes to that path would
    # silently land on the local disk.
    wait_until(lambda: not node.is_mounted(), OBSERVE_S, "sshfs self-unmount")
    assert os.listdir(node.path) == []
    observed(
        writer_errno=failure,
        failed_after_s=round(fail_after, 4),
        close=close_result,
        server_bytes=partial.stat().st_size,
        mount_gone=True,
    )


# --------------------------------------------------------------------------
# Network namespaces
# --------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_netns_partition_fails_sshfs_operation_within_bound(
    netns_pair: NetnsPair, netns_sshfs: SshfsExport, tmp_path: Path
) -> None:
    node = netns_sshfs.mount(tmp_path / "node", extra_opts=FAST_FAIL_OPTS)
    (node.path / "before").write_text("ok")
    assert (netns_sshfs.export / "before").read_text() == "ok"

    # The client really lives in namespace b; the mount is visible here.
    ns_b = os.stat(f"{NETNS_RUN_DIR}/{netns_pair.name('b')}").st_ino
    assert os.stat(f"/proc/{node.pid}/ns/net").st_ino == ns_b
    # Namespace addresses do not exist in the root namespace.
    with (
        pytest.raises(OSError),
        socket.create_connection((netns_pair.addr_a, netns_sshfs.port), timeout=1.0),
    ):
        pass

    netns_pair.cut()
    assert not netns_pair.link_is_up()
    # A blocked FUSE request cannot be interrupted from a thread: run the
    # operation in a child that can be killed if it overstays the bound.
    script = f"open({str(node.path / 'after')!r}, 'w').write('x')"
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=20
    )
    elapsed = time.monotonic() - start
    assert done.returncode != 0
    assert "Error" in done.stderr
    assert elapsed < 10.0
    assert not (netns_sshfs.export / "after").exists()

    netns_pair.restore()
    again = netns_sshfs.mount(tmp_path / "again")
    assert (again.path / "before").read_text() == "ok"
    observed(
        namespaces=netns_pair.names,
        failed_after_s=round(elapsed, 3),
        error=done.stderr.strip().splitlines()[-1],
        remount_after_restore="ok",
    )


# --------------------------------------------------------------------------
# S3: moto server and s3fs-fuse
# --------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_s3_conditional_writes_give_create_once_and_cas(
    s3_server: S3Server, s3_bucket: str
) -> None:
    require_facility("s3fs_python")
    import s3fs
    from botocore.exceptions import ClientError

    fs = s3fs.S3FileSystem(**s3_server.storage_options())
    fs.pipe(f"{s3_bucket}/record", b"first", mode="create")
    with pytest.raises(FileExistsError):
        fs.pipe(f"{s3_bucket}/record", b"second", mode="create")
    assert fs.cat(f"{s3_bucket}/record") == b"first"

    client = s3_server.boto3_client()
    etag = client.put_object(Bucket=s3_bucket, Key="ptr", Body=b"v1")["ETag"]
    statuses = []
    for kwargs in ({"IfNoneMatch": "*"}, {"IfMatch": '"0000"'}):
        with pytest.raises(ClientError) as info:
            client.put_object(Bucket=s3_bucket, Key="ptr", Body=b"x", **kwargs)
        statuses.append(info.value.response["ResponseMetadata"]["HTTPStatusCode"])
    assert statuses == [412, 412]
    client.put_object(Bucket=s3_bucket, Key="ptr", Body=b"v2", IfMatch=etag)
    observed(create_twice="FileExistsError", if_none_match=412, stale_if_match=412)


@pytest.mark.timeout(60)
def test_s3fs_fuse_mount_type_and_data_only_at_fsync(
    s3_server: S3Server, s3_bucket: str, s3fs_fuse_mount: S3fsFuseMount
) -> None:
    entry = next(m for m in mount_entries() if m.target == str(s3fs_fuse_mount.path))
    assert entry.fstype == "fuse.s3fs"
    client = s3_server.boto3_client()

    def remote() -> bytes | None:
        try:
            return client.get_object(Bucket=s3_bucket, Key="obj")["Body"].read()
        except client.exceptions.NoSuchKey:
            return None

    fd = os.open(s3fs_fuse_mount.path / "obj", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"payload")
        before = remote()  # Missing or empty: data is still in s3fs's cache.
        os.fsync(fd)
        after = remote()
    finally:
        os.close(fd)
    assert before in (None, b"")
    assert after == b"payload"
    observed(fstype=entry.fstype, before_fsync=before, after_fsync=after)


@pytest.mark.timeout(60)
def test_s3fs_fuse_killed_daemon_leaves_dead_mount_until_close(
    s3_server: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    require_facility("s3fs_fuse")
    mount = S3fsFuseMount(s3_server, s3_bucket, tmp_path / "m")
    with mount:
        (mount.path / "f").write_text("x")
        mount.kill()
        with pytest.raises(OSError) as info:
            os.listdir(mount.path)
        assert info.value.errno == errno.ENOTCONN
        assert mount.is_mounted()  # Dead but still listed: needs an unmount.
    assert mounts_under(tmp_path) == []
    observed(after_kill=errname(info.value), cleaned_up=True)


@pytest.mark.timeout(60)
def test_s3_server_kill_drops_endpoint(tmp_path: Path) -> None:
    require_facility("moto")
    start = time.monotonic()
    with S3Server(tmp_path) as server:
        startup = time.monotonic() - start
        server.create_bucket("doomed")
        url = server.endpoint_url
        server.kill()
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url + "/", timeout=2).close()
    observed(startup_s=round(startup, 3), after_kill="connection refused")


# --------------------------------------------------------------------------
# Small disks
# --------------------------------------------------------------------------

RENAME_ONTO_NONEMPTY = {"tmpfs": errno.ENOTEMPTY, "ext4": errno.ENOTEMPTY, "xfs": errno.EEXIST}
SIZES_MB = {"tmpfs": 8, "ext4": 16, "xfs": 32}


@pytest.mark.faults
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["tmpfs", "ext4", "xfs"])
def test_small_disk_write_past_free_space_hits_enospc(small_disk: object, kind: str) -> None:
    disk: SmallDisk = small_disk(SIZES_MB[kind], kind)  # type: ignore[operator]
    entry = next(m for m in mount_entries() if m.target == str(disk.path))
    assert entry.fstype == kind
    free = disk.free_bytes()
    assert 0 < free <= SIZES_MB[kind] * 1024 * 1024

    big = b"\0" * (free + (1 << 20))
    fd = os.open(disk.path / "big", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        short = os.write(fd, big)  # One oversized write is short, not an error...
        with pytest.raises(OSError) as info:
            os.write(fd, big[short:])  # ...the next one raises.
    finally:
        os.close(fd)
    assert 0 < short < len(big)
    assert info.value.errno == errno.ENOSPC

    os.unlink(disk.path / "big")
    (disk.path / "src").mkdir()
    (disk.path / "dst").mkdir()
    (disk.path / "dst" / "keep").write_text("x")
    with pytest.raises(OSError) as rename_info:
        os.rename(disk.path / "src", disk.path / "dst")
    assert rename_info.value.errno == RENAME_ONTO_NONEMPTY[kind]
    observed(
        kind=kind,
        free_bytes=free,
        short_write=short,
        then=errname(info.value),
        rename_onto_nonempty=errname(rename_info.value),
    )


@pytest.mark.faults
@pytest.mark.timeout(30)
def test_fill_until_enospc_stops_at_the_wall(tmp_path: Path) -> None:
    require_facility("tmpfs")
    with SmallDisk(tmp_path, 4, "tmpfs") as disk:
        written = fill_until_enospc(disk.path / "fill")
        assert disk.free_bytes() == 0
        assert 0 < written <= 4 * 1024 * 1024
    assert mounts_under(tmp_path) == []
    observed(written=written)


# --------------------------------------------------------------------------
# libfiu
# --------------------------------------------------------------------------

FIU_CHILD = r"""
import errno, json, os, sys
import fiu_ctrl

ctl = fiu_ctrl.PipeControl(f"{os.environ['FIU_CTRL_FIFO']}-{os.getpid()}")
work = sys.argv[1]
out = {}
fd = os.open(os.path.join(work, "f"), os.O_WRONLY | os.O_CREAT, 0o644)
ctl.enable("posix/io/sync/fsync", failinfo=errno.EIO)
try:
    os.fsync(fd)
    out["fsync"] = 0
except OSError as exc:
    out["fsync"] = exc.errno
ctl.disable("posix/io/sync/fsync")
os.fsync(fd)
os.close(fd)
ctl.enable("posix/io/dir/rename", failinfo=errno.ENOSPC, flags=["onetime"])
out["rename"] = []
for i in range(2):
    try:
        os.rename(os.path.join(work, "f"), os.path.join(work, f"g{i}"))
        out["rename"].append(0)
    except OSError as exc:
        out["rename"].append(exc.errno)
print(json.dumps(out))
"""


@pytest.mark.faults
@pytest.mark.timeout(60)
def test_fiu_child_injects_fsync_eio_and_onetime_rename_enospc(
    fiu_ready: None, tmp_path: Path
) -> None:
    script = tmp_path / "child.py"
    script.write_text(FIU_CHILD)
    work = tmp_path / "work"
    work.mkdir()
    argv = fiu_run_argv(script, str(work), ctrl_prefix=tmp_path / "fiu-ctrl")
    start = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"fsync": errno.EIO, "rename": [errno.ENOSPC, 0]}
    assert sorted(os.listdir(work)) == ["g1"]
    observed(result=result, seconds=round(elapsed, 3))
