"""Object-store faults that only a network between the library and the store makes: an
answer lost after the request landed, an upload that lands late, a store that ignores
(or rejects) ``If-None-Match``. The real S3 server (moto on 127.0.0.1) behind the
fault-injecting proxy of ``tests/testbed/s3proxy.py``; ranks of one job are threads
with their own coordinator, exchanging through a real TCPStore."""

# Fixtures imported from tests.testbed are requested by parameter name.
# ruff: noqa: F811

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
from tests.testbed import S3Server
from tests.testbed.pytest_fixtures import s3_bucket, s3_server  # noqa: F401
from tests.testbed.s3proxy import Rule, S3Proxy

from atomic_checkpoint import (
    CheckpointError,
    CheckpointManager,
    KeepLast,
    SingleProcessCoordinator,
    StorageError,
    catalog,
)
from atomic_checkpoint.errors import LockError
from atomic_checkpoint.layout import MANIFEST_NAME

pytestmark = pytest.mark.netfs

ELEMS = 50_000


def state(step: int) -> dict[str, Any]:
    return {"step": step, "w": np.full(ELEMS, step * 1000, dtype=np.float32)}


def keys(server: S3Server, bucket: str, prefix: str) -> list[str]:
    out = server.boto3_client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in out.get("Contents", []))


@pytest.fixture
def proxy(s3_server):
    with S3Proxy(s3_server, lifetime_s=300) as p:
        yield p


# ------------------------------------------------------------ a lost manifest answer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("answers_lost", [1, None], ids=["retry-refused-412", "every-answer-lost"])
def test_a_save_whose_manifest_answer_is_lost_is_committed(
    s3_server, s3_bucket, proxy, answers_lost, caplog
):
    # The manifest's conditional PUT lands, its answer is lost (the connection is
    # reset). The client sends it again: the store answers 412 (or, when every answer
    # is lost, the client gives up with a connection error). Either way the checkpoint
    # is this save's: it must succeed, and retention must run; not "committed by
    # another writer", not a failure.
    url = f"s3://{s3_bucket}/lost"
    opts = proxy.storage_options(max_attempts=2)
    caplog.set_level(logging.INFO, logger="atomic_checkpoint")
    mgr = CheckpointManager(url, storage_options=opts, retention=KeepLast(1))
    mgr.storage.fs.retries = 2  # s3fs' own retry loop, on top of botocore's
    mgr.save(1, state(1))
    lost = proxy.add(
        Rule(
            "drop",
            method="PUT",
            kind="put-create",
            key=r"checkpoint-2/checkpoint\.manifest",
            times=answers_lost,
        )
    )
    info = mgr.save(2, state(2))
    mgr.close()
    assert lost.done.is_set() and lost.fired >= 1, proxy.log[-5:]
    sent = [r for r, _ in proxy.log if r.kind == "put-create" and "checkpoint-2/" in r.key]
    assert len(sent) >= 2, sent  # the first landed, then the client retried
    assert info.step == 2
    assert "was created by this save" in caplog.text or "own first request" in caplog.text
    # Committed, whole, and retention ran: step 1 is gone.
    reader = CheckpointManager(url, storage_options=s3_server.storage_options(), read_only=True)
    assert [c.step for c in reader.checkpoints()] == [2]
    assert float(reader.restore()["w"][0]) == 2000.0
    two = keys(s3_server, s3_bucket, "lost/checkpoint-2/")
    assert len(two) == 2 and f"lost/checkpoint-2/{MANIFEST_NAME}" in two, two
    assert keys(s3_server, s3_bucket, "lost/checkpoint-1/") == []


@pytest.mark.timeout(120)
def test_a_lost_answer_does_not_hide_a_real_second_writer(s3_server, s3_bucket, proxy):
    # The other side of recognising one's own manifest: when another writer's manifest
    # is there, a 412 still means "committed by another writer".
    url = f"s3://{s3_bucket}/other"
    mgr = CheckpointManager(url, storage_options=proxy.storage_options())
    mgr.save(1, state(1))
    other = CheckpointManager(
        url, storage_options=s3_server.storage_options(), read_only=True
    ).storage
    # Another writer commits step 2 between this save's "is it taken?" and its commit.
    taken = proxy.add(Rule("call", kind="put-create", key=r"checkpoint-2/checkpoint\.manifest"))
    taken.callback = lambda req: other.write_bytes_atomic(
        f"checkpoint-2/{MANIFEST_NAME}",
        other.read_bytes(f"checkpoint-1/{MANIFEST_NAME}").replace(b'"step": 1', b'"step": 2'),
    )
    with pytest.raises(CheckpointError, match="by another writer"):
        mgr.save(2, state(2))
    mgr.close()
    assert taken.fired == 1


@pytest.mark.timeout(120)
def test_a_multipart_upload_started_twice_leaves_no_orphan(s3_server, s3_bucket, proxy):
    # Found by the s3-faults campaign: the start of a multipart upload lands, its answer
    # is lost, the client starts another upload of the same file and completes that
    # one. The first upload stays open under a committed attempt, where no sweep, no
    # clean and no retention pass of that step looks: stored and billed for ever.
    from atomic_checkpoint.storage import FsspecStorage

    url = f"s3://{s3_bucket}/mpu"
    storage = FsspecStorage(url, proxy.storage_options(max_attempts=2), block_size_bytes=5 << 20)
    lost = proxy.add(Rule("drop", kind="mpu-start", key=r"rank-00000"))
    big = {"w": np.arange((6 << 20) // 4, dtype=np.float32)}  # 6 MiB: two parts
    with CheckpointManager(storage, coordinator=SingleProcessCoordinator()) as mgr:
        mgr.save(1, big)
    assert lost.fired == 1
    starts = [r for r, _ in proxy.log if r.kind == "mpu-start"]
    assert len(starts) == 2, starts  # the lost one, and the client's second upload
    uploads = s3_server.boto3_client().list_multipart_uploads(Bucket=s3_bucket)
    assert not uploads.get("Uploads"), uploads.get("Uploads")
    reader = CheckpointManager(url, storage_options=s3_server.storage_options(), read_only=True)
    assert np.array_equal(reader.restore()["w"], big["w"])


# ------------------------------------------------------------ an upload landing late


@pytest.mark.timeout(180)
@pytest.mark.dist
def test_a_rank_upload_landing_after_the_discard_is_swept(s3_server, s3_bucket, proxy):
    # Rank 1's data PUT is held by the network until the leader has given up on it
    # (coordination timeout) and discarded the attempt; then it lands. That object must
    # stay recognisably ours: the next start sweeps it, and the step saves again.
    import torch.distributed as dist

    from atomic_checkpoint import TorchDistributedCoordinator

    url = f"s3://{s3_bucket}/late"
    opts = proxy.storage_options()
    store = dist.TCPStore(
        "127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    late = proxy.add(Rule("delay", method="PUT", key=r"late/checkpoint-5/attempt-[^/]+/rank-00001"))
    managers: dict[int, CheckpointManager] = {}
    outcome: dict[int, BaseException | None] = {}

    def rank(r: int, event: str) -> None:
        try:
            if event == "start":
                coord = TorchDistributedCoordinator(
                    dist.TCPStore("127.0.0.1", store.port, 1, False, timeout=timedelta(60)),
                    rank=r,
                    world_size=2,
                    namespace="late",
                )
                managers[r] = CheckpointManager(
                    url, storage_options=opts, coordinator=coord, timeout_s=3
                )
            else:
                managers[r].save(5, {"rank": r, **state(5)})
            outcome[r] = None
        except BaseException as exc:
            outcome[r] = exc

    for event in ("start", "save"):
        threads = [threading.Thread(target=rank, args=(r, event)) for r in (0, 1)]
        for t in threads:
            t.start()
        if event == "save":
            threads[0].join(60)  # the leader gives up on rank 1 and discards
            assert not threads[0].is_alive()
            assert late.arrived.is_set(), proxy.log
            late.release.set()  # now rank 1's upload lands
            assert late.done.wait(30)
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        if event == "start":
            assert outcome == {0: None, 1: None}, outcome
    assert isinstance(outcome[0], CheckpointError), outcome
    for m in managers.values():
        m.close()
    landed = keys(s3_server, s3_bucket, "late/checkpoint-5/")
    assert any(k.endswith("rank-00001.safetensors") for k in landed), landed
    # Recognisably ours: listed as pending (not foreign), swept by the next start.
    plain = s3_server.storage_options()
    reader = CheckpointManager(url, storage_options=plain, read_only=True)
    status = {e.name: e.status for e in catalog.scan(reader.storage)}
    assert status.get("checkpoint-5") == "pending", status
    mgr = CheckpointManager(url, storage_options=plain, coordinator=SingleProcessCoordinator())
    assert keys(s3_server, s3_bucket, "late/checkpoint-5/") == []
    mgr.save(5, state(5))
    mgr.close()
    assert len(keys(s3_server, s3_bucket, "late/checkpoint-5/")) == 2


# ------------------------------------------------------------ If-None-Match ignored


def _start_two_jobs_together(url: str, opts: dict[str, Any], held: Rule) -> dict[str, Any]:
    """Job A's create of lock.json is held until job B has finished starting: both
    read "no lock" before either create lands."""
    results: dict[str, Any] = {}

    def job(name: str) -> None:
        try:
            results[name] = CheckpointManager(
                url, storage_options=opts, coordinator=SingleProcessCoordinator()
            )
        except CheckpointError as exc:
            results[name] = exc

    a = threading.Thread(target=job, args=("a",))
    a.start()
    for _ in range(600):  # A reached its lock create, or finished without one
        if held.arrived.wait(0.05) or not a.is_alive():
            break
    b = threading.Thread(target=job, args=("b",))
    b.start()
    b.join(60)
    held.release.set()
    a.join(60)
    assert not a.is_alive() and not b.is_alive()
    return results


@pytest.mark.timeout(180)
def test_two_jobs_on_a_store_that_ignores_if_none_match(s3_server, s3_bucket, proxy, caplog):
    url = f"s3://{s3_bucket}/ignored"
    opts = proxy.storage_options()
    caplog.set_level(logging.INFO, logger="atomic_checkpoint")
    held = proxy.add(Rule("strip", kind="put-create", key=r"lock\.json$", hold=True))
    proxy.add(Rule("strip", kind="put-create", times=None))  # every conditional PUT
    results = _start_two_jobs_together(url, opts, held)
    holders = [m for m in results.values() if isinstance(m, CheckpointManager)]
    refused = [e for e in results.values() if isinstance(e, LockError)]
    for m in holders:
        m.close()
    # Exactly one holds the lock, or the library refuses to run there, saying why and
    # naming the opt-out.
    assert len(holders) <= 1, "two jobs both hold the run lock: " + str(results)
    assert len(holders) + len(refused) == 2, results
    for err in refused:
        assert "does not honour conditional create" in str(err)
        assert "conditional_create=false" in str(err) and "ignored" in str(err)
    assert "conditional create (If-None-Match: *) on" in caplog.text

    # The documented opt-out: one job alone starts and saves, with a warning.
    caplog.clear()
    with CheckpointManager(
        url,
        storage_options={**opts, "conditional_create": False},
        coordinator=SingleProcessCoordinator(),
    ) as mgr:
        mgr.save(1, state(1))
    assert "no exclusive create across clients" in caplog.text
    assert CheckpointManager(url, storage_options=opts, read_only=True).latest().step == 1


@pytest.mark.timeout(120)
def test_a_store_that_rejects_if_none_match_fails_clearly(s3_server, s3_bucket, proxy, monkeypatch):
    url = f"s3://{s3_bucket}/rejected"
    opts = proxy.storage_options(max_attempts=1)
    proxy.add(Rule("error", status=501, kind="put-create", times=None))
    with pytest.raises(StorageError) as err:
        CheckpointManager(url, storage_options=opts, coordinator=SingleProcessCoordinator())
    text = str(err.value)
    assert "rejected the conditional create" in text and "conditional_create=false" in text, text
    # With the opt-out (here from the environment) the job runs, check-then-write.
    monkeypatch.setenv("ATOMIC_CHECKPOINT_CONDITIONAL_CREATE", "false")
    with CheckpointManager(
        url, storage_options=opts, coordinator=SingleProcessCoordinator()
    ) as mgr:
        mgr.save(3, state(3))
        assert mgr.restore()["step"] == 3


@pytest.mark.timeout(120)
def test_conditional_create_probed_once_and_honoured_on_the_real_server(
    s3_server, s3_bucket, proxy, caplog
):
    caplog.set_level(logging.INFO, logger="atomic_checkpoint")
    url = f"s3://{s3_bucket}/honoured"
    # A probe key left by an earlier probe whose delete failed: the lock tidies it.
    stale = "honoured/.atomic-checkpoint/probe-conditional-create-0123456789abcdef"
    doc = {"probe": "0123456789abcdef", "n": 1, "created_unix": time.time() - 3600}
    s3_server.boto3_client().put_object(Bucket=s3_bucket, Key=stale, Body=json.dumps(doc).encode())
    with CheckpointManager(url, storage_options=proxy.storage_options()) as mgr:
        mgr.save(1, state(1))
    lines = [r.getMessage() for r in caplog.records if "If-None-Match: *) on" in r.getMessage()]
    assert len(lines) == 1 and "honoured" in lines[0], lines
    probes = [r for r, _ in proxy.log if "probe-conditional-create" in r.key]
    mine = [r.kind for r in probes if not r.key.endswith("0123456789abcdef")]
    assert mine == ["put-create", "put-create", "delete"], probes
    assert not keys(s3_server, s3_bucket, "honoured/.atomic-checkpoint/probe")


@pytest.mark.timeout(120)
def test_the_command_line_can_declare_no_conditional_create(s3_server, s3_bucket):
    from tests.cli.helpers import run_json
    from tests.testbed.s3 import ACCESS_KEY, REGION, SECRET_KEY

    url = f"s3://{s3_bucket}/cli"
    with CheckpointManager(url, storage_options=s3_server.storage_options()) as mgr:
        mgr.save(4, state(4))
    env = {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ENDPOINT_URL": s3_server.endpoint_url,
    }
    listed = run_json("list", url, "--storage-option", "conditional_create=false", env=env)
    assert [e["step"] for e in listed["entries"]] == [4]
