"""Object-store roots that must never reach beyond themselves (a real S3 server, moto
on 127.0.0.1, and fsspec's ``file://`` and ``memory://``).

- A root whose name holds ``[``, ``*`` or ``?`` is a literal key prefix: retention, the
  start-up sweep, discard, ``clean`` and ``prune`` there never touch the runs whose
  names the pattern would match (fsspec's recursive ``rm`` expands patterns).
- The start-up sweep and ``clean`` delete only what they listed as abandoned, and check
  the run lock before each entry: a job that takes over (or starts) in between and
  commits the same step keeps its checkpoint. The interleaving is forced by a storage
  that runs the other job at the sweep's first deletion.
"""

# Fixtures imported from tests.testbed are requested by parameter name.
# ruff: noqa: F811

from __future__ import annotations

import errno
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from tests.testbed.pytest_fixtures import s3_bucket, s3_server  # noqa: F401
from tests.testbed.s3 import ACCESS_KEY, REGION, SECRET_KEY

from atomic_checkpoint import CheckpointManager, KeepLast, cli
from atomic_checkpoint.errors import FencedError, StorageError
from atomic_checkpoint.layout import MANIFEST_NAME
from atomic_checkpoint.storage import FsspecStorage
from atomic_checkpoint.strategies import MarkerStrategy

pytestmark = pytest.mark.netfs

GLOB_ROOTS = ("exp[12]", "exp?", "exp*")


def keys(server: Any, bucket: str, prefix: str = "") -> list[str]:
    client = server.boto3_client()
    out: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out += [o["Key"] for o in page.get("Contents", [])]
    return sorted(out)


def state(step: int) -> dict[str, Any]:
    return {"step": step, "w": np.full(1000, step, dtype=np.float32)}


def crashed_attempt(storage: Any, step: int, token: str) -> None:
    """What a writer SIGKILLed after writing its data leaves: a marker and an attempt."""
    pending = MarkerStrategy().prepare(storage, step, token)
    storage.write_bytes_atomic(f"{pending}/rank-00000.safetensors", b"x" * 100)


def aws_env(server: Any) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ENDPOINT_URL": server.endpoint_url,
    }


@pytest.mark.timeout(240)
def test_glob_characters_in_an_s3_root_never_reach_other_runs(
    s3_server, s3_bucket, monkeypatch, capsys
):
    opts = s3_server.storage_options()
    # Two ordinary runs beside the patterned roots, each with two checkpoints, and one
    # of them with a large file upload in progress (a live writer's multipart upload).
    for run in ("exp1", "exp2"):
        with CheckpointManager(f"s3://{s3_bucket}/{run}", storage_options=opts) as mgr:
            mgr.save(1, state(1))
            mgr.save(2, state(2))
    client = s3_server.boto3_client()
    live = client.create_multipart_upload(
        Bucket=s3_bucket, Key="exp1/checkpoint-3/attempt-0123456789abcdef/rank-00000.safetensors"
    )
    others = keys(s3_server, s3_bucket, "exp1/") + keys(s3_server, s3_bucket, "exp2/")
    others = [k for k in others if "/checkpoint-" in k]
    assert len(others) == 8, others

    def other_runs() -> list[str]:
        found = keys(s3_server, s3_bucket, "exp1/") + keys(s3_server, s3_bucket, "exp2/")
        return [k for k in found if "/checkpoint-" in k]

    for var, value in aws_env(s3_server).items():  # the command line's configuration
        monkeypatch.setenv(var, value)

    def cli_json(*args: str) -> dict[str, Any]:
        capsys.readouterr()
        assert cli.main([*args, "--json"]) == 0, capsys.readouterr().err
        return json.loads(capsys.readouterr().out)

    for name in GLOB_ROOTS:
        url = f"s3://{s3_bucket}/{name}"
        # Retention (KeepLast) deletes steps 1 and 2 of this run.
        with CheckpointManager(url, storage_options=opts, retention=KeepLast(1)) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, state(step))
            # Discard: a save that fails after writing its data throws its attempt away.
            monkeypatch.setenv("ATOMIC_CHECKPOINT_FAULTS", "after_write@0=raise:4")
            with pytest.raises(Exception, match="injected"):
                mgr.save(4, state(4))
            monkeypatch.delenv("ATOMIC_CHECKPOINT_FAULTS")
        assert other_runs() == others, f"retention or discard in {name} reached other runs"
        # The start-up sweep removes a crashed save's remains.
        crashed_attempt(FsspecStorage(url, opts), 5, "aaaaaaaaaaaaaaaa")
        with CheckpointManager(url, storage_options=opts) as mgr:
            assert [c.step for c in mgr.checkpoints()] == [3]
        # clean removes another crashed save; prune deletes by policy.
        crashed_attempt(FsspecStorage(url, opts), 6, "bbbbbbbbbbbbbbbb")
        assert [i["name"] for i in cli_json("clean", url)["removed"]] == ["checkpoint-6"]
        with CheckpointManager(url, storage_options=opts) as mgr:
            mgr.save(7, state(7))
        pruned = cli_json("prune", url, "--keep-last", "1")
        assert [c["step"] for c in pruned["checkpoints"] if c["deleted"]] == [3]

        mine = [k for k in keys(s3_server, s3_bucket, f"{name}/") if "/checkpoint-" in k]
        assert sorted({k.split("/")[1] for k in mine}) == ["checkpoint-7"], mine

    # Nothing of the other runs was touched, not even the upload in progress.
    assert other_runs() == others
    uploads = client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert [u["UploadId"] for u in uploads] == [live["UploadId"]]
    for run in ("exp1", "exp2"):
        reader = CheckpointManager(f"s3://{s3_bucket}/{run}", storage_options=opts, read_only=True)
        assert [c.step for c in reader.checkpoints()] == [1, 2]
        reader.verify(1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol", ["file", "memory"])
def test_glob_characters_in_an_fsspec_root_never_reach_other_runs(tmp_path, protocol):
    base = f"file://{tmp_path}" if protocol == "file" else f"memory://glob-{id(tmp_path)}"
    for run in ("exp1", "exp2"):
        with CheckpointManager(FsspecStorage(f"{base}/{run}")) as mgr:
            mgr.save(1, state(1))
            mgr.save(2, state(2))
    for name in GLOB_ROOTS:
        storage = FsspecStorage(f"{base}/{name}")
        with CheckpointManager(storage, retention=KeepLast(1)) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, state(step))
        crashed_attempt(storage, 4, "cccccccccccccccc")
        with CheckpointManager(storage) as mgr:  # the start-up sweep
            assert [c.step for c in mgr.checkpoints()] == [3]
        held = {p.split("/")[0] for p, _ in storage.walk_files("") if p.startswith("checkpoint-")}
        assert held == {"checkpoint-3"}
    for run in ("exp1", "exp2"):
        reader = CheckpointManager(FsspecStorage(f"{base}/{run}"), read_only=True)
        assert [c.step for c in reader.checkpoints()] == [1, 2]
        reader.verify(1)
        reader.verify(2)


class _HookedS3(FsspecStorage):
    """The real S3 storage, which runs ``hook`` once, at the first deletion inside a
    checkpoint directory: after the sweep (or ``clean``) has listed what it will
    remove, before it removes anything."""

    def __init__(self, url: str, opts: dict[str, Any], hook: Callable[[], None]):
        super().__init__(url, opts)
        self._hook: Callable[[], None] | None = hook

    def _fire(self, path: str) -> None:
        if self._hook is not None and path.startswith("checkpoint-"):
            hook, self._hook = self._hook, None
            hook()

    def delete_file(self, path: str) -> None:
        self._fire(path)
        super().delete_file(path)

    def delete_tree(self, path: str) -> None:
        self._fire(path)
        super().delete_tree(path)


def _crashed_root(
    s3_server: Any, s3_bucket: str, committed: int, crashed: dict[int, str]
) -> tuple[str, dict[str, Any]]:
    """``s3://BUCKET/run`` (its URL and storage options) holding step ``committed`` of
    run "r", and the data and markers of the saves a killed job left: step -> token."""
    url = f"s3://{s3_bucket}/run"
    opts = s3_server.storage_options()
    with CheckpointManager(url, storage_options=opts, run_id="r") as first:
        first.save(committed, state(committed))
    for step, token in crashed.items():
        crashed_attempt(FsspecStorage(url, opts), step, token)
    return url, opts


def _job_commits(
    url: str, opts: dict[str, Any], step: int, value: int, into: list[CheckpointManager]
) -> Callable[[], None]:
    """A hook that starts a job of run "r" on ``url``, which commits ``step`` as
    ``state(value)`` and stays open, appended to ``into``."""

    def start_and_commit() -> None:
        job = CheckpointManager(url, storage_options=opts, run_id="r")
        job.save(step, state(value))
        into.append(job)

    return start_and_commit


@pytest.mark.timeout(120)
def test_sweep_never_undoes_a_commit_made_after_a_takeover(s3_server, s3_bucket):
    # A job killed while saving steps 6 and 7 left their data and markers.
    url, opts = _crashed_root(
        s3_server, s3_bucket, 5, {6: "dddddddddddddddd", 7: "eeeeeeeeeeeeeeee"}
    )
    newer: list[CheckpointManager] = []
    # The restarted job (same run id) takes the lock over from job A, which is still
    # sweeping, sweeps for itself and commits step 6.
    job_b_takes_over_and_commits_step_6 = _job_commits(url, opts, 6, 66, newer)

    # Job A lists steps 6 and 7 as abandoned; job B runs at A's first deletion.
    a_error: BaseException | None = None
    try:
        CheckpointManager(
            _HookedS3(url, opts, job_b_takes_over_and_commits_step_6), run_id="r"
        ).close()
    except FencedError as exc:
        a_error = exc
    assert newer, "the takeover did not happen during the sweep"
    b = newer[0]
    try:
        assert b.latest() is not None and b.latest().step == 6
        assert float(b.restore()["w"][0]) == 66.0
        b.verify(6)
        six = keys(s3_server, s3_bucket, "run/checkpoint-6/")
        assert f"run/checkpoint-6/{MANIFEST_NAME}" in six
        assert not [k for k in six if "dddddddddddddddd" in k], six
        assert not keys(s3_server, s3_bucket, "run/checkpoint-7/")  # swept by B
        # Job A stopped at its next entry: it no longer holds the lock.
        assert a_error is not None and "lost the run lock" in str(a_error)
    finally:
        b.close()
    reader = CheckpointManager(url, storage_options=opts, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [5, 6]


@pytest.mark.timeout(120)
def test_clean_never_undoes_a_commit_of_a_job_started_meanwhile(
    s3_server, s3_bucket, monkeypatch, capsys
):
    url, opts = _crashed_root(
        s3_server, s3_bucket, 1, {2: "1111111111111111", 3: "2222222222222222"}
    )
    started: list[CheckpointManager] = []
    a_job_starts_and_commits_step_2 = _job_commits(url, opts, 2, 22, started)

    hooked = _HookedS3(url, opts, a_job_starts_and_commits_step_2)
    monkeypatch.setattr(cli, "_open_root", lambda text, options=None: hooked)
    rc = cli.main(["clean", url])
    err = capsys.readouterr().err
    assert started, "the job did not start during clean"
    job = started[0]
    try:
        # The job's commit is whole; clean stopped before its next entry, saying why.
        assert f"run/checkpoint-2/{MANIFEST_NAME}" in keys(s3_server, s3_bucket, "run/")
        assert job.latest().step == 2
        assert float(job.restore()["w"][0]) == 22.0
        job.verify(2)
        assert rc == cli.EXIT_LOCKED, err
        assert "took the run lock" in err and "while clean was running" in err, err
    finally:
        job.close()


@pytest.mark.timeout(60)
def test_s3_roots_name_keys_literally(s3_server, s3_bucket):
    opts = s3_server.storage_options()
    # Trailing slashes name the same root; "%5B" is a key, never decoded to "[".
    with CheckpointManager(f"s3://{s3_bucket}/lit/", storage_options=opts) as mgr:
        assert mgr.root == f"s3://{s3_bucket}/lit"
        mgr.save(1, state(1))
    with CheckpointManager(f"s3://{s3_bucket}/lit//", storage_options=opts) as mgr:
        assert [c.step for c in mgr.checkpoints()] == [1]
    with CheckpointManager(f"s3://{s3_bucket}/a%5Bb", storage_options=opts) as mgr:
        mgr.save(1, state(1))
    written = [k for k in keys(s3_server, s3_bucket, "a") if "checkpoint-1/" in k]
    assert written and all(k.startswith("a%5Bb/checkpoint-1/") for k in written), written
    # s3fs would cut every key at "?versionId=": such a root is refused up front.
    with pytest.raises(StorageError, match="versionId"):
        FsspecStorage(f"s3://{s3_bucket}/run?versionId=1", opts)
    # Deleting the whole root is refused, however the root is spelled.
    with pytest.raises(StorageError, match="refusing to delete the whole checkpoint root"):
        FsspecStorage(f"s3://{s3_bucket}/lit/", opts).delete_tree("")


def test_a_root_with_an_empty_segment_is_refused_and_a_403_names_the_credentials(
    s3_server, s3_bucket
):
    opts = s3_server.storage_options()
    # "s3://bkt//exp" (a prefix "/exp" joined after "bkt/") wrote keys "/exp/...",
    # which s3fs lists as "bkt/exp": a save there was committed and never found again
    # (latest() None, the next save of its step refused as already committed).
    for root in (f"s3://{s3_bucket}//exp", f"s3://{s3_bucket}/a//b"):
        with pytest.raises(StorageError, match="empty path segment"):
            CheckpointManager(root, storage_options=opts)
    assert keys(s3_server, s3_bucket, "/") == []
    # The store's 403 is about the key, secret or bucket policy, not file permissions.
    storage = FsspecStorage(f"s3://{s3_bucket}/exp", opts)
    err = storage._error(PermissionError(errno.EACCES, "Forbidden"), "open bucket of", "")
    assert isinstance(err, PermissionError)
    assert "access key and secret" in str(err) and "mounted read-only" not in str(err)


def test_a_read_only_manager_on_a_bucket_that_does_not_exist_says_so(
    s3_server, s3_bucket, monkeypatch, capsys
):
    """An evaluator pointed at a misspelled bucket listed no checkpoints, for ever (a
    writable manager fails at its first makedirs; a reader makes none). A prefix with
    nothing under it in a real bucket is still an empty root: the job has not saved."""
    opts = s3_server.storage_options()
    empty = CheckpointManager(f"s3://{s3_bucket}/not-yet", storage_options=opts, read_only=True)
    assert empty.checkpoints() == [] and empty.latest() is None
    empty.close()
    with pytest.raises(StorageError, match=f"bucket '{s3_bucket}-typo' .* does not exist") as err:
        reader = CheckpointManager(
            f"s3://{s3_bucket}-typo/run", storage_options=opts, read_only=True
        )
        reader.checkpoints()
    assert err.value.errno == errno.ENOENT
    for name, value in aws_env(s3_server).items():
        monkeypatch.setenv(name, value)
    assert cli.main(["list", f"s3://{s3_bucket}-typo/run"]) == 2
    assert f"bucket '{s3_bucket}-typo'" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_store_that_keeps_answering_503_is_named_with_what_to_do(s3_server, s3_bucket):
    """s3fs turns a 503 (SlowDown) into errno 16: the failed save said "[Errno 16]" and
    nothing of the store's throttling, nor of the retries that would ride it out."""
    from tests.testbed.s3proxy import Rule, S3Proxy

    with S3Proxy(s3_server, lifetime_s=100) as proxy:
        opts = proxy.storage_options(max_attempts=1)
        with CheckpointManager(f"s3://{s3_bucket}/busy", storage_options=opts) as mgr:
            mgr.save(1, state(1))
            proxy.add(Rule("error", status=503, method="PUT", key=r"rank-00000", times=None))
            with pytest.raises(StorageError) as err:
                mgr.save(2, state(2))
            assert err.value.errno == errno.EBUSY
            assert "503" in str(err.value) and "max_attempts" in str(err.value), err.value
            assert [c.step for c in mgr.checkpoints()] == [1]
