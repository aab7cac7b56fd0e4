"""``storage_domains="per-host"`` on a root the hosts share, and on node-local roots.

Ranks are threads, each with its own client of one real TCPStore; each rank's host is
the one its thread says (two ranks per host)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from atomic_checkpoint import CheckpointError, CheckpointManager, domains
from tests.helpers import on_store_threads

_where = threading.local()


def _open_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, root_of: Any) -> list[Any]:
    monkeypatch.setattr(domains, "current_host", lambda: _where.host)

    def body(coord: Any, rank: int) -> int:
        _where.host = f"node{rank // 2}"
        with CheckpointManager(
            root_of(rank), coordinator=coord, storage_domains="per-host", timeout_s=20
        ) as mgr:
            mgr.save(1, {"rank": rank})
            return mgr.domain.count

    return on_store_threads(4, body)


def test_per_host_on_a_root_the_hosts_share_says_so_on_every_rank(tmp_path, monkeypatch):
    # Each host's leader took the run lock of the same ROOT: the second was told that
    # "another job" held it (its own job's leader), or, with a run_id, the two took
    # it from each other until every rank was fenced.
    got = _open_all(tmp_path, monkeypatch, lambda _rank: tmp_path / "shared")
    for kind, value, _s in got:
        assert kind == "error" and isinstance(value, CheckpointError), got
        assert "the hosts share ROOT" in str(value) and "'auto'" in str(value), value
    assert not list((tmp_path / "shared").glob("checkpoint-*"))


def test_per_host_on_node_local_roots_commits_a_copy_per_host(tmp_path, monkeypatch):
    got = _open_all(tmp_path, monkeypatch, lambda rank: tmp_path / f"node{rank // 2}")
    assert [(kind, value) for kind, value, _s in got] == [("ok", 2)] * 4, got
    for node in ("node0", "node1"):
        assert (tmp_path / node / "checkpoint-1" / "checkpoint.manifest.json").is_file()
