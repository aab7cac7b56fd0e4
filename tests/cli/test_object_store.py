"""The command line on an object-store root (``s3://`` on a real S3 server, moto on
127.0.0.1): the same commands as on a directory, configured from the environment or
``--storage-option``, and ``clean`` sweeping what crashed marker saves leave."""

# Fixtures imported from tests.testbed are requested by parameter name.
# ruff: noqa: F811

from __future__ import annotations

import json

import pytest

from atomic_checkpoint import CheckpointManager, KeepLast
from atomic_checkpoint.storage import FsspecStorage
from atomic_checkpoint.strategies import MarkerStrategy
from tests.cli.helpers import error_line, run_cli, run_json, state
from tests.testbed.pytest_fixtures import s3_bucket, s3_server  # noqa: F401
from tests.testbed.s3 import ACCESS_KEY, REGION, SECRET_KEY

pytestmark = pytest.mark.netfs


def _aws_env(server) -> dict[str, str]:
    """What a user sets to point the AWS SDKs at a non-AWS endpoint."""
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ENDPOINT_URL": server.endpoint_url,
    }


def _keys(server, bucket: str, prefix: str) -> list[str]:
    listed = server.boto3_client().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in listed.get("Contents", []))


def _saved(server, url: str, step: int) -> dict:
    """A root at ``url`` holding checkpoint ``step``; returns its storage options."""
    opts = server.storage_options()
    with CheckpointManager(url, storage_options=opts) as mgr:
        mgr.save(step, state(step))
    return opts


def _crashed_attempt(url: str, opts: dict, step: int, token: str) -> None:
    """What a writer SIGKILLed after writing its data leaves: a marker and an attempt."""
    s = FsspecStorage(url, opts)
    pending = MarkerStrategy().prepare(s, step, token)
    s.write_bytes_atomic(f"{pending}/rank-00000.safetensors", b"x" * 1000)


@pytest.mark.timeout(180)
def test_list_verify_inspect_prune_clean_on_s3(s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/run1"
    opts = s3_server.storage_options()
    mgr = CheckpointManager(url, storage_options=opts, retention=KeepLast(10))
    for step in (1, 2, 3):
        mgr.save(step, state(step), metrics={"loss": 1.0 / step})
    mgr.close()
    _crashed_attempt(url, opts, 4, "0123456789abcdef")  # nothing committed at step 4
    _crashed_attempt(url, opts, 3, "fedcba9876543210")  # a stale attempt beside step 3
    env = _aws_env(s3_server)

    listed = run_json("list", url, env=env)
    assert listed["root"] == url
    ok = [e for e in listed["entries"] if e["status"] == "ok"]
    assert [e["step"] for e in ok] == [1, 2, 3], listed
    assert all(e["path"] == f"{url}/checkpoint-{e['step']}" for e in ok)

    # The crashed attempt at step 4 is named like a checkpoint and is none, and no live
    # job is writing it: verify fails on it (until clean) and verifies the others.
    verified = run_json("verify", url, env=env, expect_rc=1)
    assert verified["ok"] is False
    checked = {c["step"]: c for c in verified["checkpoints"]}
    assert [s for s, c in checked.items() if c["status"] == "ok"] == [1, 2, 3]
    assert checked[4]["status"] == "not_a_checkpoint" and "clean" in checked[4]["problem"]
    assert all(checked[s]["verified_bytes"] == checked[s]["size_bytes"] > 0 for s in (1, 2, 3))

    inspected = run_json("inspect", url, "2", env=env)
    assert inspected["manifest"]["strategy"] == "marker"
    tensors = {t["name"] for f in inspected["files"] for t in f["tensors"] or []}
    assert {"model.w", "model.b", "model.mask"} <= tensors, inspected

    # clean: the uncommitted step-4 attempt goes whole, the stale attempt and marker
    # beside step 3 go, step 3's own data stays. --dry-run first changes nothing.
    before = _keys(s3_server, s3_bucket, "run1/")
    plan = run_json("clean", url, "--dry-run", env=env)
    # Beside committed step 3, what goes is named, never checkpoint-3 itself.
    assert {(i["name"], i["kind"]) for i in plan["removed"]} == {
        ("checkpoint-4", "pending"),
        ("checkpoint-3/attempt-fedcba9876543210", "stale"),
        ("checkpoint-3/checkpoint.pending-fedcba9876543210.json", "stale"),
    }, plan
    assert all(i["size_bytes"] >= 1000 for i in plan["removed"] if "pending-" not in i["name"])
    assert _keys(s3_server, s3_bucket, "run1/") == before
    done = run_json("clean", url, env=env)
    assert done["freed_bytes"] == plan["freed_bytes"] and not done["failed"]
    after = _keys(s3_server, s3_bucket, "run1/")
    assert not [k for k in after if k.startswith("run1/checkpoint-4/")]
    assert not [k for k in after if "fedcba9876543210" in k]
    three = [k for k in after if k.startswith("run1/checkpoint-3/")]
    assert len(three) == 2 and any(k.endswith("checkpoint.manifest.json") for k in three)
    assert run_json("verify", url, "3", env=env)["ok"] is True
    assert run_json("verify", url, env=env)["ok"] is True  # the leftover is gone
    assert not run_json("clean", url, env=env)["removed"]

    pruned = run_json("prune", url, "--keep-last", "1", env=env)
    assert [c["step"] for c in pruned["checkpoints"] if c["deleted"]] == [1, 2]
    assert [e["step"] for e in run_json("list", url, env=env)["entries"]] == [3]
    mgr = CheckpointManager(url, storage_options=opts)
    assert mgr.latest().step == 3 and mgr.restore()["step"] == 3
    mgr.close()


@pytest.mark.timeout(120)
def test_storage_options_on_the_command_line(s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/run2"
    _saved(s3_server, url, 7)
    args = [
        f"--storage-option=key={ACCESS_KEY}",
        f"--storage-option=secret={SECRET_KEY}",
        "--storage-option=client_kwargs="
        + json.dumps({"endpoint_url": s3_server.endpoint_url, "region_name": REGION}),
    ]
    no_aws = {"AWS_ENDPOINT_URL": "", "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}
    listed = run_json("list", url, *args, env=no_aws)
    assert [e["step"] for e in listed["entries"]] == [7]
    # Credentials of digits only stay strings (they parse as JSON numbers), quoted or not.
    digits = [*args[2:], "--storage-option=key=12345678", '--storage-option=secret="87654321"']
    listed = run_json("list", url, *digits, env=no_aws)
    assert [e["step"] for e in listed["entries"]] == [7]
    # A malformed option is a usage error naming the expected form.
    bad = run_cli("list", url, "--storage-option", "no-equals-sign", env=no_aws)
    assert bad.returncode == 2 and "KEY=VALUE" in error_line(bad)
    # Options make no sense for a directory.
    local = run_cli("list", "/", "--storage-option", "anon=true")
    assert local.returncode == 2 and "URL roots" in error_line(local)


@pytest.mark.timeout(120)
def test_missing_prefix_and_unreachable_endpoint_are_usage_errors(s3_server, s3_bucket):
    env = _aws_env(s3_server)
    empty = run_cli("list", f"s3://{s3_bucket}/no-such-run", env=env)
    assert empty.returncode == 2, empty.stderr
    assert "holds nothing" in error_line(empty) and "AWS_ENDPOINT_URL" in error_line(empty)
    down = dict(env, AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_MAX_ATTEMPTS="1")
    proc = run_cli("verify", f"s3://{s3_bucket}/x", env=down, timeout_s=90)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert f"s3://{s3_bucket}/x" in error_line(proc)


def test_a_url_root_needs_no_mount_any_more():
    # The old refusal ("mount the bucket") is gone; an unknown scheme says what failed.
    proc = run_cli("list", "nosuchscheme://bucket/prefix")
    assert proc.returncode == 2 and "nosuchscheme://bucket/prefix" in error_line(proc)


@pytest.mark.timeout(120)
def test_one_checkpoint_of_an_s3_root_is_verified_by_its_own_url(s3_server, s3_bucket):
    # "nothing to verify: ... holds no checkpoint" (exit 1) for the URL of one uploaded
    # checkpoint, while its local copy and the parent URL verified; and a manager opened
    # there started a run inside the checkpoint.
    from atomic_checkpoint import CheckpointError

    url = f"s3://{s3_bucket}/models"
    opts = _saved(s3_server, url, 30)
    one = f"{url}/checkpoint-30"
    doc = run_json("verify", one, env=_aws_env(s3_server))
    assert doc["ok"] is True and [c["step"] for c in doc["checkpoints"]] == [30], doc
    before = _keys(s3_server, s3_bucket, "models/")
    with pytest.raises(CheckpointError, match="is one checkpoint"):
        CheckpointManager(one, storage_options=opts)
    assert _keys(s3_server, s3_bucket, "models/") == before


@pytest.mark.timeout(180)
def test_inspect_says_could_not_read_not_corrupt_when_the_store_fails(s3_server, s3_bucket):
    # A 503 on every read of a rank file is the store failing, not the checkpoint:
    # `inspect` called the intact checkpoint corrupt (exit 1), and a script acting on
    # its verdict would delete a good checkpoint.
    from tests.testbed.s3proxy import Rule, S3Proxy

    url = f"s3://{s3_bucket}/unread"
    _saved(s3_server, url, 2)
    with S3Proxy(s3_server, lifetime_s=120) as proxy:
        opts = proxy.storage_options(max_attempts=1)
        flags = [f"--storage-option={k}={json.dumps(v)}" for k, v in opts.items()]
        proxy.add(Rule("error", method="GET", key=r"checkpoint-2/.*rank-00000", times=None))
        failed = run_cli("inspect", url, "2", *flags, "--json")
        assert failed.returncode == 2, (failed.stdout, failed.stderr)
        doc = json.loads(failed.stdout)
        assert doc["status"] == "error" and "rank-00000" in doc["problem"], doc
        assert "corrupt" not in error_line(failed) and "could not read" in error_line(failed)
    assert run_json("inspect", url, "2", env=_aws_env(s3_server))["status"] == "ok"


@pytest.mark.timeout(120)
def test_list_and_clean_agree_on_the_size_of_a_save_killed_before_its_data(
    s3_server, s3_bucket
):
    # A writer killed after its marker and before any data leaves one object (the
    # marker): `list` showed its size, `clean --dry-run` said "would free 0 B" (a size of
    # what lies under the marker's name, as if it were a folder).
    url = f"s3://{s3_bucket}/marker-only"
    opts = _saved(s3_server, url, 1)
    MarkerStrategy().prepare(FsspecStorage(url, opts), 2, "0123456789abcdef")
    env = _aws_env(s3_server)
    listed = {e["step"]: e for e in run_json("list", url, env=env)["entries"]}
    planned = run_json("clean", url, "--dry-run", env=env)["removed"]
    assert [(p["name"], p["kind"]) for p in planned] == [("checkpoint-2", "pending")], planned
    assert planned[0]["size_bytes"] == listed[2]["size_bytes"] > 0, (planned, listed[2])
