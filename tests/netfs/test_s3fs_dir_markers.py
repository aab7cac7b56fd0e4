"""s3fs-fuse's directory markers seen through ``s3://`` (a real S3 server, moto on
127.0.0.1, and an s3fs-fuse mount of the same bucket).

s3fs-fuse creates a zero-byte object ``prefix/`` for every directory it makes. A
checkpoint saved through the mount and deleted through ``s3://`` (retention, ``prune``,
``clean`` of a crashed save) must not leave that marker behind: both views listed it as
an entry without a manifest (``verify`` exit 1) that ``clean`` never removed. A prefix
holding nothing but such markers is no entry; a real checkpoint is never hidden.
"""

# Fixtures imported from tests.testbed are requested by parameter name.
# ruff: noqa: F811

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from tests.testbed.pytest_fixtures import (  # noqa: F401
    s3_bucket,
    s3_server,
    s3fs_fuse_mount,
)

from atomic_checkpoint import CheckpointManager, KeepLast, catalog, cli
from atomic_checkpoint.layout import MANIFEST_NAME

pytestmark = pytest.mark.netfs


def keys(server: Any, bucket: str, prefix: str) -> list[str]:
    out = server.boto3_client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in out.get("Contents", []))


def run_cli(server: Any, *args: str, url: str | None = None) -> int:
    argv = list(args)
    if url is not None:
        argv += [
            f"--storage-option={k}={json.dumps(v)}" for k, v in server.storage_options().items()
        ]
    return cli.main(argv)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["prune", "rotation"])
def test_deletes_through_s3_remove_the_mounts_directory_markers(
    s3fs_fuse_mount, s3_server, s3_bucket, how, capsys
):
    root = s3fs_fuse_mount.path / "run"
    url = f"s3://{s3_bucket}/run"
    with CheckpointManager(root) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": np.full(10, step, dtype=np.float32)})
    # s3fs-fuse made a marker object per directory: the case under test.
    assert "run/checkpoint-1/" in keys(s3_server, s3_bucket, "run/checkpoint-1/")

    opts = s3_server.storage_options()
    if how == "prune":
        assert run_cli(s3_server, "prune", url, "--keep-last", "1", url=url) == 0
        kept = [3]
    else:
        with CheckpointManager(url, storage_options=opts, retention=KeepLast(1)) as mgr:
            mgr.save(4, {"w": np.full(10, 4, dtype=np.float32)})
        kept = [4]

    gone = [s for s in (1, 2, 3, 4) if s not in kept]
    for step in gone:
        assert keys(s3_server, s3_bucket, f"run/checkpoint-{step}/") == [], step
    for step in kept:  # the kept checkpoint, its own marker included, is untouched
        assert f"run/checkpoint-{step}/{MANIFEST_NAME}" in keys(
            s3_server, s3_bucket, f"run/checkpoint-{step}/"
        )
    names = sorted(n for n in os.listdir(root) if n.startswith("checkpoint-"))
    assert names == [f"checkpoint-{s}" for s in kept]
    capsys.readouterr()
    assert run_cli(s3_server, "verify", url, "--quiet", url=url) == 0, capsys.readouterr()
    assert run_cli(s3_server, "verify", str(root), "--quiet") == 0, capsys.readouterr()
    via_s3 = CheckpointManager(url, storage_options=opts, read_only=True)
    assert [c.step for c in via_s3.checkpoints()] == kept
    assert float(via_s3.restore()["w"][0]) == float(kept[0])


CRASHING_SAVE = r"""
import sys, time
import numpy as np
from atomic_checkpoint import CheckpointManager
m = CheckpointManager(sys.argv[1])
m.save(1, {"w": np.ones(10)})
with m.saving(2) as d:
    (d / "a.bin").write_bytes(b"x" * 1000)
    print("WRITING", flush=True)
    time.sleep(120)
"""


@pytest.mark.timeout(180)
def test_clean_through_s3_of_a_crashed_mount_save_leaves_no_entry(
    s3fs_fuse_mount, s3_server, s3_bucket, capsys
):
    root = s3fs_fuse_mount.path / "run"
    url = f"s3://{s3_bucket}/run"
    saver = subprocess.Popen(
        [sys.executable, "-c", CRASHING_SAVE, str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert saver.stdout is not None
        line = saver.stdout.readline()
        assert line.startswith("WRITING"), (line, saver.stderr.read() if saver.stderr else "")
    finally:
        saver.send_signal(signal.SIGKILL)
        saver.communicate(timeout=30)
    assert any(k.endswith(".bin") for k in keys(s3_server, s3_bucket, "run/checkpoint-2/"))

    capsys.readouterr()
    assert run_cli(s3_server, "clean", url, "--json", url=url) == 0
    removed = json.loads(capsys.readouterr().out)
    assert removed, removed
    # Everything of the crashed save went, s3fs's directory markers included.
    assert keys(s3_server, s3_bucket, "run/checkpoint-2/") == []
    assert "checkpoint-2" not in os.listdir(root)
    assert run_cli(s3_server, "verify", url, "--quiet", url=url) == 0, capsys.readouterr()
    assert run_cli(s3_server, "verify", str(root), "--quiet") == 0, capsys.readouterr()
    opts = s3_server.storage_options()
    via_s3 = CheckpointManager(url, storage_options=opts, read_only=True)
    assert [c.step for c in via_s3.checkpoints()] == [1]


@pytest.mark.timeout(120)
def test_a_prefix_of_only_directory_markers_is_no_entry(s3_server, s3_bucket, capsys):
    """Markers left before this fix (or by a ``mkdir`` on a mount, or the S3 console):
    not listed; a checkpoint with a marker, and a zero-byte file, still are."""
    url = f"s3://{s3_bucket}/run"
    opts = s3_server.storage_options()
    with CheckpointManager(url, storage_options=opts) as mgr:
        mgr.save(1, {"w": np.ones(10)})
    client = s3_server.boto3_client()
    for key in ("run/checkpoint-7/", "run/checkpoint-7/attempt-x/", "run/checkpoint-1/"):
        client.put_object(Bucket=s3_bucket, Key=key, Body=b"")

    capsys.readouterr()
    assert run_cli(s3_server, "verify", url, "--quiet", url=url) == 0, capsys.readouterr()
    reader = CheckpointManager(url, storage_options=opts, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [1]
    entries = {e.name: e.status for e in catalog.scan(reader.storage)}
    assert entries == {"checkpoint-1": "ok"}, entries
    storage = reader.storage
    assert not storage.is_dir("checkpoint-7")
    assert "checkpoint-7" not in storage.listdir("")
    # A zero-byte file beside a marker is content: listed, even after a walk.
    for key, body in (("run/checkpoint-8/", b""), ("run/checkpoint-8/zero", b"")):
        client.put_object(Bucket=s3_bucket, Key=key, Body=body)
    storage.walk_files("")
    assert storage.listdir("checkpoint-8") == ["zero"]
    assert "checkpoint-8" in storage.listdir("") and storage.is_dir("checkpoint-8")
    # Something written there since makes it an entry again.
    client.put_object(Bucket=s3_bucket, Key="run/checkpoint-7/x", Body=b"data")
    assert "checkpoint-7" in storage.listdir("")
    assert storage.is_dir("checkpoint-7")
