"""The run lock's tidy-up at each start on S3: takeover claims are kept for an hour
(``lock._CLAIM_KEEP_S``), so a job restarted in a loop leaves one per restart. A start
must read only the claims it removes (plus one), not every claim of the last hour: with
one GET per claim, each restart of a crash-looping job got slower than the one before.
The real S3 server (moto on 127.0.0.1) behind the proxy of ``tests/testbed/s3proxy.py``,
which counts the requests."""

# Fixtures imported from tests.testbed are requested by parameter name.
# ruff: noqa: F811

from __future__ import annotations

import json
import time

import pytest
from tests.testbed.pytest_fixtures import s3_bucket, s3_server  # noqa: F401
from tests.testbed.s3proxy import S3Proxy

from atomic_checkpoint import CheckpointManager
from atomic_checkpoint.layout import META_DIR
from atomic_checkpoint.storage import FsspecStorage

pytestmark = pytest.mark.netfs

OLD, YOUNG = 5, 15


@pytest.mark.timeout(120)
def test_a_start_reads_only_the_claims_it_removes(s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/claims"
    direct = FsspecStorage(url, s3_server.storage_options())
    now = time.time()
    names = []
    # What earlier takeovers left: claims on generations 1..20, the oldest five more
    # than an hour old.
    for token in range(1, OLD + YOUNG + 1):
        name = f"lock.takeover-{token}-{token:032x}.0.json"
        claimed = now - 7200 if token <= OLD else now - 60
        doc = {"generation": f"{token}-{token:032x}", "by": "x", "claimed_unix": claimed}
        direct.write_bytes_atomic(f"{META_DIR}/{name}", json.dumps(doc).encode())
        names.append(name)
    with S3Proxy(s3_server, lifetime_s=300) as proxy:
        proxy.reset_log()
        mgr = CheckpointManager(url, storage_options=proxy.storage_options())
        claim_reads = [r for r in proxy.requests if r.kind == "get" and "/lock.takeover-" in r.key]
        mgr.close()
    left = sorted(n for n in direct.listdir(META_DIR) if n.startswith("lock.takeover-"))
    assert left == sorted(names[OLD:]), "old claims must go, young ones stay"
    # The five it removed, and the first one it keeps; not all twenty.
    assert len(claim_reads) <= OLD + 1, [r.key for r in claim_reads]
