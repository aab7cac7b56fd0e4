"""A persistent tier that accepts connections and never answers (the proxy in front of
the real S3 server holds every request), or refuses every request: the job's start,
``close(timeout_s=)`` and ``atomic-checkpoint drain --timeout`` keep their bounds, and
saves go on at tier 0. Before, each of them waited for the S3 client's retries:
``close(timeout_s=5)`` took 215 s, ``drain --timeout 5`` and the constructor did not
return within minutes."""

# Fixtures imported from tests.testbed are requested by parameter name.
# ruff: noqa: F811

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from tests.cli.helpers import run_cli
from tests.testbed.pytest_fixtures import s3_bucket, s3_server  # noqa: F401
from tests.testbed.s3proxy import Rule, S3Proxy
from tests.tiered.test_tiered import fast_root, same, state, steps_on  # noqa: F401

from atomic_checkpoint import (
    CheckpointManager,
    KeepLast,
    StorageError,
    Tier,
    TieredCheckpointManager,
)

pytestmark = [pytest.mark.netfs, pytest.mark.timeout(120)]


@contextmanager
def silent_s3(s3_server: Any) -> Iterator[tuple[S3Proxy, Any]]:
    """A proxy in front of the S3 server, and a function that makes it hold every
    request (unanswered, the connection open) until the context ends."""
    with S3Proxy(s3_server, lifetime_s=110) as proxy:
        rules: list[Rule] = []

        def silence() -> Rule:
            rules.append(proxy.add(Rule("delay", times=None)))
            return rules[-1]

        try:
            yield proxy, silence
        finally:
            for rule in rules:
                rule.release.set()
                proxy.remove(rule)


def test_start_and_close_keep_their_bounds_while_tier_1_never_answers(
    s3_server, s3_bucket, fast_root
):
    url = f"s3://{s3_bucket}/run"
    with silent_s3(s3_server) as (proxy, silence):
        tiers = [
            Tier(fast_root, retention=KeepLast(1)),
            Tier(url, retention=KeepLast(3), storage_options=proxy.storage_options()),
        ]
        with TieredCheckpointManager(tiers, timeout_s=20) as mgr:
            mgr.save(1, state(1))
            assert mgr.wait_replicated(timeout_s=30)
        silence()
        t0 = time.monotonic()
        mgr = TieredCheckpointManager(tiers, timeout_s=4)  # tier 0 names the run
        assert time.monotonic() - t0 < 15
        mgr.save(2, state(2))  # saves go on at tier 0, held there
        assert steps_on(mgr.fast) == [1, 2] or steps_on(mgr.fast) == [2]
        # Reads answer from tier 0 within the bound (min(timeout_s, 30 s)): they waited
        # for the S3 client's retries, minutes, though tier 0 held the newest step.
        for read in (mgr.latest, mgr.checkpoints, mgr.restore):
            t0 = time.monotonic()
            got = read()
            assert time.monotonic() - t0 < 15, read
            assert got is not None
        assert mgr.latest().step == 2 and same(mgr.restore(), state(2))
        t0 = time.monotonic()
        # Step 2 stays held on tier 0 (step 1 too: tier 1 could not be consulted).
        assert 2 in mgr.close(timeout_s=3)
        assert time.monotonic() - t0 < 10
    # The link is back: the next start replicates step 2.
    opts = s3_server.storage_options()
    tiers[1] = Tier(url, retention=KeepLast(3), storage_options=opts)
    with TieredCheckpointManager(tiers, timeout_s=20) as mgr:
        assert mgr.wait_replicated(timeout_s=60)
    reader = CheckpointManager(url, storage_options=opts, read_only=True)
    assert steps_on(reader) == [1, 2] and same(reader.restore(), state(2))


def test_a_new_node_whose_tier_1_cannot_be_read_says_why_it_cannot_start(
    s3_server, s3_bucket, tmp_path
):
    url = f"s3://{s3_bucket}/run"
    with silent_s3(s3_server) as (proxy, silence):
        silence()
        tiers = [Tier(tmp_path / "new-node"), Tier(url, storage_options=proxy.storage_options())]
        t0 = time.monotonic()
        with pytest.raises(StorageError, match=r"holds no checkpoint .* did not answer within"):
            TieredCheckpointManager(tiers, timeout_s=3)
        assert time.monotonic() - t0 < 15
    assert not (tmp_path / "new-node").exists() or not any((tmp_path / "new-node").iterdir())


def test_drain_keeps_its_timeout_while_tier_1_never_answers(s3_server, s3_bucket, tmp_path):
    root = tmp_path / "node"
    with CheckpointManager(root) as mgr:
        mgr.save(1, state(1))  # on tier 0 only: what drain is for
    url = f"s3://{s3_bucket}/run"
    with silent_s3(s3_server) as (proxy, silence):
        silence()
        opts = proxy.storage_options()
        args = [f"--to-storage-option={k}={json.dumps(v)}" for k, v in opts.items()]
        t0 = time.monotonic()
        proc = run_cli("drain", root, "--to", url, *args, "--timeout", "3")
        took = time.monotonic() - t0
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "did not answer within" in proc.stderr and "nothing was copied" in proc.stderr
    assert took < 20, took
    assert steps_on(CheckpointManager(root, read_only=True)) == [1]  # still there
