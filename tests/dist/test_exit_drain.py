"""A process that exits right after an exchange: the store requests its coordinator
deferred (the round's key deletions) run before the interpreter tears down.

Without that, the end of a training loop guarded by ``PreemptionGuard`` (an exchange
at every step) ended with ``terminate called without an active exception`` (SIGABRT)
in a fraction of the runs: the worker thread was inside a store request while the
interpreter and torch's store client were torn down, and the launcher reported the
finished job as failed.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import run_python

_CHILD = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from atomic_checkpoint.coordination import TorchDistributedCoordinator

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    coord = TorchDistributedCoordinator(store, rank=0, world_size=1)
    coord.all_gather("warm-up", 1, timeout_s=30)  # the worker thread runs

    def late_request():
        time.sleep(1.0)  # still running when the main thread reaches exit
        store.set("deferred", "ran")
        open(sys.argv[1], "w").write(store.get("deferred").decode())

    coord._worker.defer(late_request)
    sys.exit(0)
    """
)


@pytest.mark.timeout(120)
def test_store_requests_deferred_at_exit_run_before_the_process_ends(tmp_path):
    marker = tmp_path / "ran"
    proc = run_python(_CHILD, marker, timeout_s=90)
    assert proc.returncode == 0, proc.stderr
    assert marker.read_text() == "ran"
