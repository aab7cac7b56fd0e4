"""Checkpoints on an s3fs-fuse mount of a real S3 server (moto on 127.0.0.1).

s3fs-fuse looks like a directory, but renaming a directory copies every object and
then deletes it, and file data reaches S3 only at fsync/close (TESTBED.md). The manager
must notice from the mount table and commit with markers, and a dying s3fs must never
leave a torn checkpoint that a later reader (through the mount or through S3) takes.
"""

# Fixtures imported from tests.testbed are requested by parameter name.
# ruff: noqa: F811

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.testbed import S3fsFuseMount
from tests.testbed.pytest_fixtures import (  # noqa: F401
    require_facility,
    s3_bucket,
    s3_server,
    s3fs_fuse_mount,
)
from tests.testbed.s3proxy import Rule, S3Proxy

from atomic_checkpoint import CheckpointManager, KeepLast, catalog
from atomic_checkpoint.layout import MANIFEST_NAME

pytestmark = pytest.mark.netfs

WORKERS = Path(__file__).with_name("s3_workers.py")


def keys(server: Any, bucket: str, prefix: str) -> list[str]:
    out = server.boto3_client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in out.get("Contents", []))


@pytest.mark.timeout(120)
def test_marker_commits_chosen_on_s3fs_mount_and_readable_through_s3(
    s3fs_fuse_mount, s3_server, s3_bucket, tmp_path, caplog
):
    root = s3fs_fuse_mount.path / "run"
    caplog.set_level(logging.INFO, logger="atomic_checkpoint")
    mgr = CheckpointManager(root, retention=KeepLast(2))
    assert mgr.commit_strategy == "marker"
    assert mgr.storage.capabilities.name == "fuse.s3fs"
    assert not mgr.storage.capabilities.atomic_dir_rename
    assert (
        f"using marker commits on {root} (fuse.s3fs: directory rename is copy+delete)"
        in caplog.text
    )
    # The control: a plain directory on this machine keeps rename commits.
    assert CheckpointManager(tmp_path / "plain").commit_strategy == "rename"

    for step in (1, 2, 3):
        mgr.save(step, {"step": step, "w": np.full(100_000, step, dtype=np.float32)})
    mgr.close()
    assert [c.step for c in mgr.checkpoints()] == [2, 3]
    assert mgr.restore()["step"] == 3

    # Nothing was ever renamed on the mount: no .pending staging object exists, and the
    # bucket holds exactly each kept checkpoint's data and manifest.
    listed = keys(s3_server, s3_bucket, "run/")
    assert not [k for k in listed if "/.pending/checkpoint-" in k], listed
    assert not [k for k in listed if k.startswith("run/checkpoint-1/")], listed
    for step in (2, 3):
        assert f"run/checkpoint-{step}/{MANIFEST_NAME}" in listed

    # The commit record lives inside the checkpoint: a reader through the S3 API
    # (another client, another backend) sees the same checkpoints, complete.
    via_s3 = CheckpointManager(
        f"s3://{s3_bucket}/run", storage_options=s3_server.storage_options(), read_only=True
    )
    assert [c.step for c in via_s3.checkpoints()] == [2, 3]
    state = via_s3.restore()
    assert state["step"] == 3 and float(state["w"].sum()) == 300_000.0
    via_s3.verify(2)


def _data_files(root: Path, step: int) -> list[str]:
    return glob.glob(str(root / f"checkpoint-{step}" / "attempt-*" / "rank-*.safetensors"))


def _uploads(server: Any, bucket: str, prefix: str) -> list[str]:
    out = server.boto3_client().list_multipart_uploads(Bucket=bucket)
    return [u["Key"] for u in out.get("Uploads", []) if u["Key"].startswith(prefix)]


BIG_ELEMS = 16 << 20  # 64 MiB of float32: s3fs uploads it as 13 sequential 5 MB parts


@pytest.mark.timeout(240)
@pytest.mark.faults
@pytest.mark.parametrize("when", ["mid_upload", "data_durable"])
def test_killing_s3fs_mid_save_leaves_nothing_torn(s3_server, s3_bucket, tmp_path, when):
    """``mid_upload``: s3fs dies while it is uploading step 3's data (a multipart upload
    in progress on the server, its second part held by a proxy between s3fs and the
    server). ``data_durable``: the data is complete in S3 and the writer is stopped just
    before its manifest, then s3fs dies."""
    require_facility("s3fs_fuse")
    mountpoint = tmp_path / "mnt"
    prefix = "run/checkpoint-3/"
    with contextlib.ExitStack() as stack:
        # mid_upload: s3fs talks to the server through the fault-injecting proxy, which
        # holds the second part of step 3's data upload: the upload is then in progress
        # on the server for as long as the test needs (no window to catch by polling).
        proxy = stack.enter_context(S3Proxy(s3_server)) if when == "mid_upload" else None
        held = None
        if proxy is not None:
            held = proxy.add(
                Rule("delay", kind="part", key=r"^run/checkpoint-3/.*\.safetensors$", skip=1)
            )
        # Small sequential parts: step 3's data is uploaded as 13 parts, one at a time.
        mount = S3fsFuseMount(
            proxy if proxy is not None else s3_server,  # anything with an endpoint_url
            s3_bucket,
            mountpoint,
            extra_opts=["multipart_size=5", "parallel_count=1"],
        )
        mount.start()
        stack.callback(mount.close)
        root = mount.path / "run"
        env = dict(os.environ)
        if when == "data_durable":
            # Stop after the data is written and fsync'd (uploaded), before the manifest.
            env["ATOMIC_CHECKPOINT_FAULTS"] = "after_write@0=hang:3"
        args = {"url": str(root), "steps": [1, 2, 3], "elems": 1000, "keep": 0}
        args["elems_by_step"] = {"3": BIG_ELEMS}
        writer = subprocess.Popen(
            [sys.executable, str(WORKERS), "saver", json.dumps(args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        deadline = time.monotonic() + 120
        observed = ""
        while not observed:
            if time.monotonic() > deadline or writer.poll() is not None:
                writer.kill()
                out, err = writer.communicate(timeout=10)
                pytest.fail(
                    f"never saw step 3 {when.replace('_', ' ')}: {out[-1000:]} {err[-2000:]}"
                )
            if held is not None:
                if held.arrived.wait(0.2):
                    assert _uploads(s3_server, s3_bucket, prefix), "no upload open on the server"
                    observed = "a multipart upload of step 3's data in progress (part 2 held)"
                continue
            data = [k for k in keys(s3_server, s3_bucket, prefix) if k.endswith(".safetensors")]
            if data:
                head = s3_server.boto3_client().head_object(Bucket=s3_bucket, Key=data[0])
                if head["ContentLength"] >= BIG_ELEMS * 4:
                    observed = f"step 3's data complete in S3 ({head['ContentLength']} B)"
            time.sleep(0.01)
        mount.kill()  # SIGKILL s3fs: every access through the mount now fails
        if when == "data_durable":
            writer.kill()
        try:
            out, err = writer.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            writer.kill()
            out, err = writer.communicate(timeout=10)
            pytest.fail("the writer hung after s3fs died")
        saved = [json.loads(x)["step"] for x in out.splitlines() if '"saved"' in x]
        assert saved == [1, 2], (out, err[-2000:])
        assert writer.returncode != 0
        if when == "mid_upload":
            # A clean error from our tree (ENOTCONN mapped), not a hang or a success.
            assert "atomic_checkpoint.errors.StorageError" in err, err[-3000:]
        raised = [x for x in err.splitlines() if x.startswith("atomic_checkpoint.errors.")]
        what = raised[-1][:300] if raised else f"killed (exit {writer.returncode})"
        print(f"OBSERVED: killed s3fs with {observed}; the writer: {what}")

    # Nothing committed for step 3 reached S3.
    assert f"{prefix}{MANIFEST_NAME}" not in keys(s3_server, s3_bucket, prefix)

    # Remount (a fresh s3fs, empty caches) and look through it.
    with S3fsFuseMount(s3_server, s3_bucket, mountpoint) as again:
        root = again.path / "run"
        reader = CheckpointManager(root, read_only=True)
        assert [c.step for c in reader.checkpoints()] == [1, 2]
        state = reader.restore()
        assert state["step"] == 2 and float(state["w"][0]) == 2000.0
        reader.verify(2)
        statuses = {e.name: e.status for e in catalog.scan(reader.storage)}
        assert "corrupt" not in statuses.values(), statuses
        assert statuses.get("checkpoint-3") == "pending", statuses

        # The next writer sweeps what the dead save left and saves step 3 for real.
        mgr = CheckpointManager(root)
        assert not _data_files(root, 3)
        assert keys(s3_server, s3_bucket, prefix) in ([], [prefix])
        mgr.save(3, {"step": 3, "w": np.full(1000, 3000, dtype=np.float32)})
        assert mgr.restore()["step"] == 3
        mgr.close()
