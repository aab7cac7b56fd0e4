"""Discovery on the real S3 server (moto on 127.0.0.1) reads a bounded number of
manifests, counted: ``latest()`` newest first, and the rotation after a save only the
manifest it has not validated yet (one HEAD per other checkpoint proves it unchanged).

The root holds a hundred and twenty checkpoints (put straight through boto3): enough for a
full scan to stand out, quick to create on moto.
"""

# Fixtures imported from tests.testbed are requested by parameter name.
# ruff: noqa: F811

from __future__ import annotations

import logging

import numpy as np
import pytest
from tests.helpers import CountsReads
from tests.testbed.pytest_fixtures import s3_bucket, s3_server  # noqa: F401
from tests.testbed.roots import make_s3_root

from atomic_checkpoint import CheckpointManager, KeepLast, catalog
from atomic_checkpoint.layout import MANIFEST_NAME
from atomic_checkpoint.storage.fsspec import FsspecStorage

pytestmark = pytest.mark.netfs

N = 120
#: A save reads two manifests: its own step's (is it committed already?) and, in the
#: rotation, the one it just committed; latest() reads one per checkpoint it skips.
HANDFUL = 2


class CountingS3Storage(CountsReads, FsspecStorage):
    """The real FsspecStorage on s3://, counting manifest reads and file size checks."""


@pytest.mark.timeout(180)
def test_latest_and_rotation_read_a_handful_of_manifests(s3_server, s3_bucket, caplog):
    opts = s3_server.storage_options()
    url = make_s3_root(s3_server, s3_bucket, "run", range(N), threads=8)
    # The newest one is torn: skipped with a warning, one more manifest read.
    s3_server.boto3_client().put_object(
        Bucket=s3_bucket, Key=f"run/checkpoint-{N}/{MANIFEST_NAME}", Body=b'{"format": "a'
    )
    storage = CountingS3Storage(url, opts)
    mgr = CheckpointManager(storage, retention=KeepLast(N))
    storage.reset()
    caplog.set_level(logging.WARNING, logger="atomic_checkpoint")
    got = mgr.latest()
    assert got is not None and got.step == N - 1
    assert storage.manifest_reads <= HANDFUL + 1, storage.manifest_reads
    assert f"checkpoint-{N}" in caplog.text
    assert catalog.committed(storage, run_id=mgr.run_id)[-1].step == got.step

    # A start reads the newest checkpoints only; the first listing reads every manifest
    # once (as the first rotation would), and from then on the rotation knows them.
    mgr.checkpoints()
    for step in (N + 1, N + 2):
        storage.reset()
        mgr.save(step, {"w": np.full(64, step, dtype=np.float32)})
        mgr.wait()  # the rotation ran
        # ... and the torn one, read again at each scan (only valid ones are cached), and
        # the one the rotation un-commits (read in place of a HEAD: it is put back if
        # the job turns out to have lost the run lock meanwhile).
        assert storage.manifest_reads <= HANDFUL + 2, (step, storage.manifest_reads)
        assert storage.size_checks <= 2 * HANDFUL, (step, storage.size_checks)
    storage.reset()
    steps = [c.step for c in mgr.checkpoints()]
    assert steps == [*range(2, N), N + 1, N + 2]
    assert storage.manifest_reads == 1  # the torn one; the others: one HEAD each
    mgr.close()
