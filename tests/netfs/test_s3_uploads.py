"""Unfinished multipart uploads on S3: a writer killed in the middle of a large file
leaves one; its parts are stored (and billed) but in no listing, and a sweep whose own
abort failed leaves one that no later sweep finds. ``atomic-checkpoint clean`` aborts
those under the run's prefix, across every page of the store's listing, and never one
of another run (``run10`` beside ``run1``) or of a live job. The real S3 server (moto on
127.0.0.1) behind the proxy of ``tests/testbed/s3proxy.py``, which pages the upload
listing as S3 does (moto answers in one page)."""

# Fixtures imported from tests.testbed are requested by parameter name.
# ruff: noqa: F811

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from tests.testbed import S3Server
from tests.testbed.pytest_fixtures import s3_bucket, s3_server  # noqa: F401
from tests.testbed.s3proxy import S3Proxy

from atomic_checkpoint import CheckpointManager, cli

pytestmark = pytest.mark.netfs

ATTEMPT = "checkpoint-3/attempt-0123456789abcdef"


def state(step: int) -> dict[str, Any]:
    return {"step": step, "w": np.full(1000, step, dtype=np.float32)}


def open_uploads(server: S3Server, bucket: str) -> list[str]:
    """Every unfinished upload's key (moto lists them all in one page)."""
    out = server.boto3_client().list_multipart_uploads(Bucket=bucket)
    return sorted(u["Key"] for u in out.get("Uploads", []))


def leave_uploads(server: S3Server, bucket: str, keys: list[str]) -> None:
    client = server.boto3_client()
    for key in keys:
        up = client.create_multipart_upload(Bucket=bucket, Key=key)
        client.upload_part(
            Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=1, Body=b"p" * 1000
        )


def clean(opts: dict[str, Any], url: str, capsys: Any, *extra: str) -> tuple[int, dict, str]:
    capsys.readouterr()
    argv = ["clean", url, "--json", *extra]
    argv += [f"--storage-option={k}={json.dumps(v)}" for k, v in opts.items()]
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, json.loads(out.out) if out.out.strip() else {}, out.err


@pytest.fixture
def proxy(s3_server):
    with S3Proxy(s3_server, lifetime_s=300) as p:
        yield p


@pytest.mark.timeout(120)
def test_clean_aborts_every_page_of_uploads_under_the_root_and_nothing_else(
    s3_server, s3_bucket, proxy, capsys
):
    opts = s3_server.storage_options()
    url = f"s3://{s3_bucket}/run1"
    with CheckpointManager(url, storage_options=opts) as mgr:
        mgr.save(1, state(1))
    ours = [f"run1/{ATTEMPT}/rank-{r:05d}.safetensors" for r in range(7)]
    # Another run whose name extends ours, another run, and a key that is the root's
    # name itself without the separator: none of them is under "run1/".
    theirs = [
        f"run10/{ATTEMPT}/rank-00000.safetensors",
        "run1x/checkpoint-1/rank-00000.safetensors",
        "run1",
        "other/run1/checkpoint-3/rank-00000.safetensors",
    ]
    leave_uploads(s3_server, s3_bucket, ours + theirs)
    proxy.list_uploads_page = 3  # 7 uploads under run1/: pages of 3, 3 and 1

    proxy.reset_log()
    rc, doc, err = clean(proxy.storage_options(), url, capsys)
    assert rc == 0, err
    aborted = sorted(i["name"] for i in doc["removed"] if i["kind"] == "upload")
    assert aborted == sorted(k[len("run1/") :] for k in ours)
    assert open_uploads(s3_server, s3_bucket) == sorted(theirs)
    lists = [r for r in proxy.requests if r.kind == "list-uploads"]
    assert len(lists) >= 3, "clean read the first page of the upload listing only"
    # The committed checkpoint is untouched.
    with CheckpointManager(url, storage_options=opts, read_only=True) as reader:
        assert reader.restore()["step"] == 1


@pytest.mark.timeout(120)
def test_clean_never_aborts_an_upload_while_a_live_job_holds_the_lock(s3_server, s3_bucket, capsys):
    opts = s3_server.storage_options()
    url = f"s3://{s3_bucket}/live"
    key = f"live/{ATTEMPT}/rank-00000.safetensors"
    holder = CheckpointManager(url, storage_options=opts)  # live: this very process
    try:
        holder.save(1, state(1))
        leave_uploads(s3_server, s3_bucket, [key])  # as if the holder were writing it
        rc, _, err = clean(opts, url, capsys)
        assert rc == 3 and "run lock" in err  # refused, as ever
        # Forced: the lock goes, but the live job's upload in progress stays.
        rc, doc, err = clean(opts, url, capsys, "--force")
        assert rc == 0, err
        assert doc["lock_removed"] is True
        assert not [i for i in doc["removed"] if i["kind"] == "upload"]
        assert "left 1 unfinished upload" in err
        assert open_uploads(s3_server, s3_bucket) == [key]
    finally:
        holder.close()
    # Nobody holds the lock now: the next clean aborts it.
    rc, doc, err = clean(opts, url, capsys)
    assert rc == 0, err
    assert [i["name"] for i in doc["removed"] if i["kind"] == "upload"] == [key[len("live/") :]]
    assert open_uploads(s3_server, s3_bucket) == []


@pytest.mark.timeout(120)
def test_clean_dry_run_lists_uploads_and_aborts_none(s3_server, s3_bucket, capsys):
    opts = s3_server.storage_options()
    url = f"s3://{s3_bucket}/dry"
    with CheckpointManager(url, storage_options=opts) as mgr:
        mgr.save(1, state(1))
    key = f"dry/{ATTEMPT}/rank-00000.safetensors"
    leave_uploads(s3_server, s3_bucket, [key])
    rc, doc, err = clean(opts, url, capsys, "--dry-run")
    assert rc == 0, err
    assert [i["name"] for i in doc["removed"] if i["kind"] == "upload"] == [key[len("dry/") :]]
    assert open_uploads(s3_server, s3_bucket) == [key]


@pytest.mark.timeout(120)
def test_clean_reports_the_upload_of_a_crashed_attempt_it_removes(s3_server, s3_bucket, capsys):
    """A save SIGKILLed mid-upload leaves its marker, its attempt and the attempt's
    upload. Removing the attempt aborts the upload with it: clean still reports it (a
    dry run listed it; before, the real run did not)."""
    from atomic_checkpoint.storage import FsspecStorage
    from atomic_checkpoint.strategies import MarkerStrategy

    opts = s3_server.storage_options()
    url = f"s3://{s3_bucket}/crashed"
    with CheckpointManager(url, storage_options=opts) as mgr:
        mgr.save(1, state(1))
    MarkerStrategy().prepare(FsspecStorage(url, opts), 3, ATTEMPT.rsplit("-", 1)[1])
    key = f"crashed/{ATTEMPT}/rank-00000.safetensors"
    leave_uploads(s3_server, s3_bucket, [key])
    rc, dry, err = clean(opts, url, capsys, "--dry-run")
    assert rc == 0, err
    planned = sorted((i["name"], i["kind"]) for i in dry["removed"])
    rc, doc, err = clean(opts, url, capsys)
    assert rc == 0, err
    assert sorted((i["name"], i["kind"]) for i in doc["removed"]) == planned
    assert (key[len("crashed/") :], "upload") in planned and ("checkpoint-3", "pending") in planned
    assert open_uploads(s3_server, s3_bucket) == []


@pytest.mark.timeout(120)
def test_clean_leaves_uploads_of_a_root_nested_in_it_and_cleans_a_prefix_of_uploads_only(
    s3_server, s3_bucket, capsys
):
    """A live job of s3://b/run/sub (its own run lock) had its upload aborted by `clean
    s3://b/run`, and its save failed with "Internal Server Error". And a prefix whose
    only content is unfinished uploads (its objects removed by hand) was refused as
    "holds nothing", the uploads left billed."""
    opts = s3_server.storage_options()
    url = f"s3://{s3_bucket}/run"
    with CheckpointManager(url, storage_options=opts) as mgr:
        mgr.save(1, state(1))
    nested = f"run/sub/{ATTEMPT}/rank-00000.safetensors"
    ours = f"run/{ATTEMPT}/rank-00000.safetensors"
    leave_uploads(s3_server, s3_bucket, [nested, ours])
    rc, doc, err = clean(opts, url, capsys)
    assert rc == 0, err
    assert [r["name"] for r in doc["removed"] if r["kind"] == "upload"] == [
        ATTEMPT + "/rank-00000.safetensors"
    ]
    assert "not of its checkpoints (e.g. sub/" in err
    assert open_uploads(s3_server, s3_bucket) == [nested]

    only = f"only/{ATTEMPT}/rank-00000.safetensors"
    leave_uploads(s3_server, s3_bucket, [only])
    rc, doc, err = clean(opts, f"s3://{s3_bucket}/only", capsys)
    assert rc == 0, err
    assert [r["name"] for r in doc["removed"]] == [ATTEMPT + "/rank-00000.safetensors"]
    assert open_uploads(s3_server, s3_bucket) == [nested]
    # An empty prefix without uploads is still "holds nothing" (a typo), exit 2.
    rc, _, err = clean(opts, f"s3://{s3_bucket}/typo", capsys)
    assert rc == 2 and "holds nothing" in err
