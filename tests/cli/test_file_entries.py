# ruff: noqa: F811  (pytest fixtures imported by name)
"""A file (not a directory) named ``checkpoint-<step>`` in ROOT: a stray ``touch``, or
an object of that name on a store. It is never a checkpoint: the job opens, resumes and
rotates around it; ``list`` names it, ``verify ROOT`` fails on it (a script that copies
``checkpoint-*`` would take it); ``clean`` leaves it (it is not ours) and says so.

Before, on a local root every start, ``latest()``, ``restore()``, ``list``, ``verify``
and ``prune`` failed with "Not a directory (errno 20)", and ``clean`` claimed to remove
it ("empty, 0 B") and did not; on S3 ``verify`` left it out and exited 0.
"""

from __future__ import annotations

import numpy as np
import pytest

from atomic_checkpoint import CheckpointManager, KeepLast
from tests.cli.helpers import run_json
from tests.testbed.pytest_fixtures import s3_bucket, s3_server  # noqa: F401

STRAY = b"x" * 1000


def _check(url: str, opts: dict | None, env: dict[str, str] | None) -> None:
    mgr = CheckpointManager(url, storage_options=opts, retention=KeepLast(1))
    assert mgr.latest().step == 200
    assert mgr.restore()["w"][0] == 2.0
    mgr.save(300, {"w": np.full(4, 3.0)})  # rotation deletes 100 and 200, not the file
    assert [c.step for c in mgr.checkpoints()] == [300]
    mgr.close()

    listed = {e["name"]: e for e in run_json("list", url, env=env)["entries"]}
    assert listed["checkpoint-700"]["status"] == "foreign"
    assert listed["checkpoint-700"]["problem"].startswith("a file, not a checkpoint directory")
    assert listed["checkpoint-300"]["status"] == "ok"

    verified = run_json("verify", url, env=env, expect_rc=1)
    checked = {c["name"]: c for c in verified["checkpoints"]}
    assert checked["checkpoint-300"]["status"] == "ok"
    assert checked["checkpoint-700"]["status"] == "not_a_checkpoint"
    assert "move it out of ROOT" in checked["checkpoint-700"]["problem"]

    assert run_json("clean", url, env=env)["removed"] == []
    assert [c["step"] for c in run_json("prune", url, "--keep-last", "1", env=env)[
        "checkpoints"
    ]] == [300]  # fmt: skip


def _save_two(url: str, opts: dict | None) -> None:
    with CheckpointManager(url, storage_options=opts) as mgr:
        mgr.save(100, {"w": np.full(4, 1.0)})
        mgr.save(200, {"w": np.full(4, 2.0)})


@pytest.mark.timeout(120)
def test_a_file_named_like_a_checkpoint_in_a_local_root(root):
    _save_two(str(root), None)
    (root / "checkpoint-700").write_bytes(STRAY)
    _check(str(root), None, None)
    assert (root / "checkpoint-700").read_bytes() == STRAY


@pytest.mark.netfs
@pytest.mark.timeout(180)
def test_an_object_named_like_a_checkpoint_on_s3(s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/stray"
    opts = s3_server.storage_options()
    _save_two(url, opts)
    s3_server.boto3_client().put_object(Bucket=s3_bucket, Key="stray/checkpoint-700", Body=STRAY)
    from tests.cli.test_object_store import _aws_env

    _check(url, opts, _aws_env(s3_server))
    got = s3_server.boto3_client().get_object(Bucket=s3_bucket, Key="stray/checkpoint-700")
    assert got["Body"].read() == STRAY
