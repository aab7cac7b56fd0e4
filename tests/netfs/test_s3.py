"""Checkpoints on a real S3 server (moto on 127.0.0.1), through ``s3://`` roots.

Writers, readers and racers are separate processes (``s3_workers.py``) talking to the
server over HTTP, as jobs on different hosts would; kills are real SIGKILLs at named
fault points of the protocol.
"""

# Fixtures imported from tests.testbed are requested by parameter name.
# ruff: noqa: F811

from __future__ import annotations

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
from tests.testbed import S3Server, free_port
from tests.testbed.pytest_fixtures import s3_bucket, s3_server  # noqa: F401

from atomic_checkpoint import CheckpointError, CheckpointManager, KeepLast, StorageError, catalog
from atomic_checkpoint.errors import CheckpointExistsError
from atomic_checkpoint.layout import MANIFEST_NAME

pytestmark = pytest.mark.netfs

WORKERS = Path(__file__).with_name("s3_workers.py")
ELEMS = 1_500_000  # 6 MiB of float32 per checkpoint


def start(role: str, args: dict[str, Any], env: dict[str, str] | None = None) -> subprocess.Popen:
    full_env = {**os.environ, **(env or {})}
    return subprocess.Popen(
        [sys.executable, str(WORKERS), role, json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
    )


def finish(proc: subprocess.Popen, timeout_s: float) -> tuple[int, list[dict[str, Any]], str]:
    """Wait (bounded) and return (returncode, JSON lines, stderr)."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"worker did not finish within {timeout_s} s; stderr: {err[-2000:]}")
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return proc.returncode, lines, err


def keys(server: S3Server, bucket: str, prefix: str) -> list[str]:
    out = server.boto3_client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in out.get("Contents", []))


def state(step: int) -> dict[str, Any]:
    return {"step": step, "w": np.full(ELEMS, step * 1000, dtype=np.float32)}


@pytest.mark.timeout(120)
def test_save_restore_rotate_round_trip(s3_server, s3_bucket, caplog):
    url = f"s3://{s3_bucket}/run1"
    opts = s3_server.storage_options()
    caplog.set_level(logging.INFO, logger="atomic_checkpoint")
    mgr = CheckpointManager(url, storage_options=opts, retention=KeepLast(2))
    assert mgr.commit_strategy == "marker"
    assert f"using marker commits on {url} (s3: directory rename is copy+delete)" in caplog.text
    assert mgr.latest() is None
    for step in (10, 20, 30, 40):
        info = mgr.save(step, state(step), metrics={"loss": 1.0 / step})
        assert info.step == step and info.path == f"{url}/checkpoint-{step}"
    mgr.close()

    assert [c.step for c in mgr.checkpoints()] == [30, 40]
    assert mgr.latest().step == 40
    restored = mgr.restore()
    assert restored["step"] == 40 and float(restored["w"][0]) == 40_000.0
    into = state(0)
    got = mgr.restore(step=30, into=into)  # the fast path: straight into existing arrays
    assert got["step"] == 30 and got["w"] is into["w"] and float(into["w"][-1]) == 30_000.0
    assert mgr.verify(30).metrics == {"loss": pytest.approx(1 / 30)}

    # What is in the bucket: rotated steps are gone entirely, kept ones hold exactly
    # their manifest and one attempt's data, and no marker or upload lingers.
    listed = keys(s3_server, s3_bucket, "run1/checkpoint-")
    assert not [k for k in listed if k.startswith(("run1/checkpoint-10/", "run1/checkpoint-20/"))]
    for step in (30, 40):
        mine = [k for k in listed if k.startswith(f"run1/checkpoint-{step}/")]
        assert len(mine) == 2, mine
        assert f"run1/checkpoint-{step}/{MANIFEST_NAME}" in mine
        assert any("/attempt-" in k and k.endswith("/rank-00000.safetensors") for k in mine)
    uploads = s3_server.boto3_client().list_multipart_uploads(Bucket=s3_bucket)
    assert not uploads.get("Uploads"), uploads.get("Uploads")

    # Saving a committed step again is refused; the checkpoint is untouched.
    again = CheckpointManager(url, storage_options=opts)
    with pytest.raises(CheckpointExistsError):
        again.save(40, state(41))
    assert again.restore()["step"] == 40
    # overwrite=True replaces it whole: the new manifest swaps in with one PUT, the
    # old attempt's data is deleted afterwards.
    again.save(40, state(44), overwrite=True)
    assert float(again.restore()["w"][0]) == 44_000.0
    mine = keys(s3_server, s3_bucket, "run1/checkpoint-40/")
    assert len(mine) == 2, mine
    # saving() hands out a local directory: on an object store it says so up front.
    with (
        pytest.raises(CheckpointError, match=r"saving\(\) needs a mounted filesystem"),
        again.saving(50),
    ):
        pass
    again.close()


@pytest.mark.timeout(180)
@pytest.mark.dist
def test_two_rank_gloo_job_saves_and_restores_per_rank_state(s3_server, s3_bucket):
    # Rank 1 writes into the attempt that rank 0 (the coordinator) prepared; the one
    # manifest lists both ranks' files; each rank restores its own state.
    url = f"s3://{s3_bucket}/ddp"
    args = {
        "url": url,
        "storage_options": s3_server.storage_options(),
        "steps": [1, 2, 3],
        "elems": 250_000,
    }
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [start("ddp", args, env={**env, "RANK": str(r)}) for r in (0, 1)]
    reports = []
    for proc in ranks:
        rc, lines, err = finish(proc, 150)
        assert rc == 0, err[-3000:]
        reports += [e for e in lines if e["event"] == "report"]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for r in reports:
        assert r["strategy"] == "marker"
        assert r["checkpoints"] == [2, 3] and r["latest"] == 3
        assert r["restored_own_state"], r
    manifest = json.loads(
        s3_server.boto3_client()
        .get_object(Bucket=s3_bucket, Key=f"ddp/checkpoint-3/{MANIFEST_NAME}")["Body"]
        .read()
    )
    paths = sorted(f["path"].split("/", 1)[1] for f in manifest["files"])
    assert paths == ["rank-00000.safetensors", "rank-00001.safetensors"]
    assert len({f["path"].split("/", 1)[0] for f in manifest["files"]}) == 1  # one attempt


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_concurrent_reader_never_sees_a_torn_checkpoint(s3_server, s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/live"
    opts = s3_server.storage_options()
    stop = tmp_path / "writer-done"
    reader = start(
        "poller", {"url": url, "storage_options": opts, "stop_file": str(stop), "deadline_s": 90}
    )
    t0 = time.monotonic()
    writer = start(
        "saver",
        {
            "url": url,
            "storage_options": opts,
            "steps": list(range(1, 31)),
            "elems": ELEMS,
            "keep": 2,
        },
    )
    rc, lines, err = finish(writer, 90)
    write_s = time.monotonic() - t0
    stop.touch()
    assert rc == 0, err[-3000:]
    assert [e["step"] for e in lines if e["event"] == "saved"] == list(range(1, 31))
    rc, report_lines, err = finish(reader, 60)
    assert rc == 0, err[-3000:]
    report = report_lines[-1]
    print(
        f"OBSERVED: 30 saves of 6 MiB in {write_s:.1f} s; reader: {report['polls']} polls, "
        f"{report['reads_ok']} good restores of {report['distinct_steps']} distinct steps, "
        f"{report['vanished']} vanished (rotated away mid-read), {report['torn']} torn, "
        f"{report['corrupt_listed']} corrupt entries listed"
    )
    assert report["torn"] == 0, report["problems"]
    assert report["corrupt_listed"] == 0, report["problems"]
    assert report["regressions"] == 0, "latest() went backwards"
    assert report["problems"] == []
    # The reader really raced the writer: it restored many different checkpoints.
    assert report["reads_ok"] >= 10 and report["distinct_steps"] >= 5, report


@pytest.mark.timeout(180)
@pytest.mark.faults
@pytest.mark.parametrize("phase", ["mid_write", "after_write", "after_manifest"])
def test_writer_killed_mid_save_leaves_nothing_discoverable(s3_server, s3_bucket, phase):
    url = f"s3://{s3_bucket}/killed"
    opts = s3_server.storage_options()
    writer = start(
        "saver",
        {"url": url, "storage_options": opts, "steps": [1, 2, 3], "elems": ELEMS, "keep": 0},
        env={"ATOMIC_CHECKPOINT_FAULTS": f"{phase}@0=kill:3"},
    )
    rc, lines, err = finish(writer, 90)
    assert rc == -9, f"writer was not killed at {phase}: rc={rc} {err[-2000:]}"
    assert [e["step"] for e in lines if e["event"] == "saved"] == [1, 2]

    # Step 3 left data behind (with its in-progress marker), but no manifest.
    left = keys(s3_server, s3_bucket, "killed/checkpoint-3/")
    assert f"killed/checkpoint-3/{MANIFEST_NAME}" not in left
    assert any(".pending-" in k for k in left), left

    reader = CheckpointManager(url, storage_options=opts, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [1, 2]
    assert reader.latest().step == 2
    restored = reader.restore()
    assert restored["step"] == 2 and float(restored["w"][0]) == 2000.0
    entries = {e.name: e.status for e in catalog.scan(reader.storage)}
    assert entries.get("checkpoint-3") == "pending", entries
    assert "corrupt" not in entries.values()

    # The next writer (the dead one's lock is taken over) sweeps the remains and can
    # save step 3 for real.
    mgr = CheckpointManager(url, storage_options=opts)
    assert keys(s3_server, s3_bucket, "killed/checkpoint-3/") == []
    mgr.save(3, state(3))
    assert mgr.restore()["step"] == 3
    mgr.close()


@pytest.mark.timeout(120)
@pytest.mark.faults
def test_multipart_upload_of_a_killed_writer_is_aborted_by_the_sweep(
    s3_server, s3_bucket, tmp_path
):
    # A writer killed in the middle of a large file: S3 keeps its uploaded parts
    # (invisible, but stored) until the upload is aborted.
    url = f"s3://{s3_bucket}/mpu"
    opts = s3_server.storage_options()
    script = (
        "import json, os, signal, sys\n"
        "from atomic_checkpoint.storage import FsspecStorage\n"
        "from atomic_checkpoint.strategies import MarkerStrategy\n"
        "s = FsspecStorage(sys.argv[1], json.loads(sys.argv[2]), block_size_bytes=5 << 20)\n"
        "pending = MarkerStrategy().prepare(s, 7, 'deadbeefdeadbeef')\n"
        "w = s.open_write(pending + '/rank-00000.safetensors')\n"
        "w.write(b'x' * (11 << 20))  # two 5 MiB parts go out; the rest stays buffered\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, url, json.dumps(opts)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == -9, proc.stderr
    client = s3_server.boto3_client()
    uploads = client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert [u["Key"] for u in uploads if u["Key"].startswith("mpu/checkpoint-7/")]
    mgr = CheckpointManager(url, storage_options=opts)  # sweeps at start-up
    uploads = client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert not [u["Key"] for u in uploads if u["Key"].startswith("mpu/checkpoint-7/")]
    assert keys(s3_server, s3_bucket, "mpu/checkpoint-7/") == []
    mgr.close()


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_two_writers_racing_for_one_step_exactly_one_commits(s3_server, s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/race"
    opts = s3_server.storage_options()
    steps = [101, 102, 103, 104, 105, 106]
    elems = 400_000
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    racers = [
        start(
            "racer",
            {
                "url": url,
                "storage_options": opts,
                "writer": i,
                "steps": steps,
                "elems": elems,
                "barrier_dir": str(barrier),
            },
        )
        for i in (1, 2)
    ]
    # Release each round only when both writers have written all their data, having
    # both found the step uncommitted: the one interleaving where a non-exclusive
    # commit would let both "win".
    deadline = time.monotonic() + 120
    for step in steps:
        while not all((barrier / f"ready-{step}-{i}").exists() for i in (1, 2)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in racers):
                for p in racers:
                    p.kill()
                pytest.fail(f"racers did not both reach step {step}: {racers[0].stderr.read()}")
            time.sleep(0.005)
        (barrier / f"go-{step}").touch()
    results = [finish(p, 60) for p in racers]
    events = []
    for rc, lines, err in results:
        assert rc == 0, err[-3000:]
        events += [e for e in lines if e["event"] in ("won", "lost", "error")]
    assert not [e for e in events if e["event"] == "error"], events

    reader = CheckpointManager(url, storage_options=opts, read_only=True)
    for step in steps:
        outcome = {e["writer"]: e for e in events if e["step"] == step}
        winners = [w for w, e in outcome.items() if e["event"] == "won"]
        losers = [w for w, e in outcome.items() if e["event"] == "lost"]
        assert len(winners) == 1 and len(losers) == 1, (step, outcome)
        # The checkpoint is the winner's, whole: its content, its files, verified.
        restored = reader.restore(step=step)
        assert float(restored["w"][0]) == step * 1000 + winners[0]
        assert bool((restored["w"] == restored["w"][0]).all())
        reader.verify(step)
        listed = keys(s3_server, s3_bucket, f"race/checkpoint-{step}/")
        assert sorted(k.split("/", 2)[2] for k in listed) == sorted(
            [*outcome[winners[0]]["files"], MANIFEST_NAME]
        ), "the loser's files or markers were left behind"
    print(
        "OBSERVED: "
        + ", ".join(
            f"step {e['step']}: writer {e['writer']} won" for e in events if e["event"] == "won"
        )
    )


@pytest.mark.timeout(60)
def test_missing_bucket_and_dead_server_are_clear_storage_errors(s3_server, tmp_path):
    opts = s3_server.storage_options()
    with pytest.raises(StorageError, match="does not exist"):
        CheckpointManager("s3://no-such-bucket-here/run", storage_options=opts)

    with S3Server(tmp_path / "doomed") as doomed:
        bucket = doomed.create_bucket("doomed")
        fast_fail = {
            **doomed.storage_options(),
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2},
        }
        mgr = CheckpointManager(f"s3://{bucket}/run", storage_options=fast_fail)
        mgr.save(1, {"x": np.zeros(10)})
        doomed.kill()
        t = time.monotonic()
        with pytest.raises(StorageError) as err:
            mgr.save(2, {"x": np.zeros(10)})
        assert time.monotonic() - t < 30
        # Mapped at the storage boundary: one of ours, naming the URL.
        assert f"s3://{bucket}/run" in str(err.value)
        mgr.close()  # releasing the lock on a dead server is logged, never raised


def test_connect_sets_the_client_up_before_the_first_request(s3_server, s3_bucket):
    """``connect()`` (which a tiered manager starts beside the rest of its start) leaves
    the S3 client ready, so that the first listing of a restore does not build it."""
    from atomic_checkpoint.storage.fsspec import FsspecStorage

    opts = {**s3_server.storage_options(), "skip_instance_cache": True}
    storage = FsspecStorage(f"s3://{s3_bucket}/run", opts)
    assert storage.fs._s3 is None  # s3fs builds its client at the first request
    storage.connect()
    client = storage.fs._s3
    assert client is not None
    assert storage.listdir("") == []
    assert storage.fs._s3 is client  # the first request used it, built nothing new
