"""Two nodes with their own addresses: torchrun across two network namespaces.

Namespace ``a`` runs node 0 (torchrun's rendezvous store and sshd, which exports the
shared directory); namespace ``b`` runs node 1. Each node mounts the export through
sshfs from inside its own namespace (``nsenter --net``, so the mount stays visible to
the test), so node 1's storage traffic and its rendezvous traffic cross the veth link:
taking that link down (``NetnsPair.cut``) partitions node 1 from both. torchrun runs
under ``ip netns exec``. Results come back as one JSON file per rank
(``scripts/two_node_job.py``); what is on disk is judged from the server side, the
export directory itself.
"""

# Fixtures are imported from tests.testbed.pytest_fixtures and requested by
# parameter name, which pyflakes reads as redefinitions of the imports.
# ruff: noqa: F811

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

try:
    import tests.testbed  # noqa: F401
except ModuleNotFoundError:  # Run without the repository root on sys.path.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.testbed import FAST_FAIL_OPTS, NetnsPair, SshfsExport, SshfsMount, wait_until
from tests.testbed._util import descendants, kill_pids, run
from tests.testbed.pytest_fixtures import (  # noqa: F401 - fixtures used by name
    netns_pair,
    require_facility,
)

from atomic_checkpoint import LocalStorage, catalog

pytestmark = [pytest.mark.netfs, pytest.mark.dist, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("scripts") / "two_node_job.py"
MASTER_PORT = 29512
#: Bound on every wait of the job for other ranks, and the process-group timeout.
JOB_TIMEOUT_S = 10.0


def observed(**facts: object) -> None:
    """Prints one machine-readable line of what the test measured."""
    print("OBSERVED:", json.dumps(facts, default=str))


@dataclass
class TwoNodes:
    pair: NetnsPair
    export: SshfsExport
    mounts: dict[str, SshfsMount]
    base: Path

    def server(self) -> LocalStorage:
        """The run's directory as the server has it (not through any mount)."""
        return LocalStorage(self.export.export / "run")


@pytest.fixture
def two_nodes(netns_pair: NetnsPair, tmp_path: Path) -> Iterator[TwoNodes]:
    """sshd in namespace a; node a and node b each mount the export from inside
    their own namespace, failing fast (about 3 s) when the link is down."""
    require_facility("sshfs")
    with netns_pair.sshfs_export(tmp_path / "srv") as export:
        mounts = {
            "a": export.mount(
                tmp_path / "node-a",
                extra_opts=FAST_FAIL_OPTS,
                launcher=netns_pair.nsenter_args("a"),
            ),
            "b": export.mount(tmp_path / "node-b", extra_opts=FAST_FAIL_OPTS),
        }
        (tmp_path / "tmp").mkdir()
        yield TwoNodes(netns_pair, export, mounts, tmp_path)


class Job:
    """Both nodes' torchrun processes of one job; killed (with their workers) on exit."""

    def __init__(self, nodes: TwoNodes, name: str, job_args: list[str]):
        self.nodes = nodes
        self.status = nodes.base / f"status-{name}"
        self.status.mkdir()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        for node_rank, side in enumerate(("a", "b")):
            argv = [
                *nodes.pair.exec_args(side),
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node_rank={node_rank}",
                "--nproc_per_node=2",
                f"--master_addr={nodes.pair.addr_a}",
                f"--master_port={MASTER_PORT}",
                str(SCRIPT),
                "--root",
                str(nodes.mounts[side].path / "run"),
                "--status",
                str(self.status),
                "--timeout",
                str(JOB_TIMEOUT_S),
                *job_args,
            ]
            env = {
                **os.environ,
                "ATOMIC_CHECKPOINT_HOST": f"node-{side}",
                # Gloo finds its address from the host name, which resolves to loopback:
                # name the interface that reaches the other node.
                "GLOO_SOCKET_IFNAME": nodes.pair.veth,
                "OMP_NUM_THREADS": "1",
                "TMPDIR": str(nodes.base / "tmp"),  # torchrun leaves torchelastic_* dirs
                "PYTHONUNBUFFERED": "1",
            }
            self.logs[side] = nodes.base / f"torchrun-{name}-{side}.log"
            with open(self.logs[side], "wb") as log:
                self.procs[side] = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )

    def log_tail(self) -> str:
        return "\n".join(
            f"--- node {side}:\n{path.read_text(errors='replace')[-3000:]}"
            for side, path in self.logs.items()
        )

    def results(self, timeout_s: float) -> list[dict[str, Any]]:
        """Every rank's result, waiting at most ``timeout_s`` for all four."""
        files = [self.status / f"result-{r}.json" for r in range(4)]
        try:
            wait_until(lambda: all(f.exists() for f in files), timeout_s, "4 rank results")
        except Exception as exc:
            raise AssertionError(f"{exc}\n{self.log_tail()}") from None
        return [json.loads(f.read_text()) for f in files]

    def wait_exit(self, timeout_s: float) -> None:
        """Both torchruns exit on their own (after a successful job)."""
        deadline = time.monotonic() + timeout_s
        for side, proc in self.procs.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"torchrun on node {side} did not exit\n{self.log_tail()}")
            assert proc.returncode == 0, f"torchrun on node {side} failed\n{self.log_tail()}"

    def kill(self) -> None:
        for proc in self.procs.values():
            kill_pids([*descendants(proc.pid), proc.pid], signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def run_job(nodes: TwoNodes, name: str, job_args: list[str]) -> list[dict[str, Any]]:
    with Job(nodes, name, job_args) as job:
        results = job.results(timeout_s=120)
        job.wait_exit(timeout_s=30)
    failed = [r for r in results if not r["ok"]]
    assert not failed, json.dumps(failed, indent=1)
    return results


def checkpoint_dirs(nodes: TwoNodes) -> list[int]:
    names = [n for n in os.listdir(nodes.export.export / "run") if n.startswith("checkpoint-")]
    return sorted(int(n.split("-", 1)[1]) for n in names)


@pytest.mark.timeout(240)
def test_two_namespaces_save_rotate_resume_cycle(two_nodes: TwoNodes) -> None:
    start = time.monotonic()
    job1 = run_job(two_nodes, "job1", ["--steps", "1-5", "--keep", "3"])
    job1_s = time.monotonic() - start
    # One storage domain across the two hosts (found by the probe through both
    # mounts), sshfs detected as non-coherent on both nodes.
    for r in job1:
        assert r["domain"] == [0, 0, [0, 1, 2, 3], [0]]
        assert r["storage"] == ["sshfs", False]
        assert r["saved"] == [1, 2, 3, 4, 5]
        assert r["retained"] == [3, 4, 5]
    assert checkpoint_dirs(two_nodes) == [3, 4, 5]

    job2 = run_job(two_nodes, "job2", ["--steps", "6-8", "--keep", "3", "--resume"])
    for r in job2:
        assert r["resumed_from"] == 5
        assert r["restore_ok"] and r["peer_restore_ok"], r
        assert r["retained"] == [6, 7, 8]
    server = two_nodes.server()
    assert checkpoint_dirs(two_nodes) == [6, 7, 8]
    for step in (6, 7, 8):
        catalog.load_checkpoint(server, step, full=True)
    assert server.listdir(".pending") == [] and server.listdir(".trash") == []
    observed(
        namespaces=two_nodes.pair.names,
        master=two_nodes.pair.addr_a,
        job1_s=round(job1_s, 1),
        total_s=round(time.monotonic() - start, 1),
        resumed_from=5,
        retained=[6, 7, 8],
    )


CUT_BOUND_S = 45.0


@pytest.mark.timeout(240)
def test_cutting_the_link_during_a_save_fails_every_rank_cleanly(two_nodes: TwoNodes) -> None:
    pair = two_nodes.pair
    # Slow node b's uplink so the announced save (8 MiB per rank) is still being
    # written when the link goes down; small saves are unaffected.
    run(
        [*pair.exec_args("b"), "tc", "qdisc", "add", "dev", pair.veth, "root", "tbf",
         "rate", "40mbit", "burst", "64kb", "latency", "400ms"],
        timeout_s=10,
    )  # fmt: skip
    with Job(
        two_nodes,
        "cut",
        ["--steps", "1-4", "--keep", "2", "--announce", "4", "--announce-elems", str(1 << 21)],
    ) as job:
        announced = [job.status / f"saving-{r}" for r in range(4)]
        try:
            wait_until(lambda: all(f.exists() for f in announced), 120, "the save of step 4")
        except Exception as exc:
            raise AssertionError(f"{exc}\n{job.log_tail()}") from None
        time.sleep(0.3)  # inside the writes of step 4
        cut_at = time.time()
        pair.cut()
        results = job.results(timeout_s=CUT_BOUND_S + 15)
    assert not any(r["ok"] for r in results), results
    # The cut took node b's storage down with its link (sshfs gave up on the dead
    # connection and unmounted itself); node a's mount is local to its namespace.
    assert not two_nodes.mounts["b"].is_mounted()
    assert two_nodes.mounts["a"].is_mounted()

    # Every rank raised an error of the library's tree within the bound, saying what
    # failed: node b's ranks lost their storage and the coordination store; node a's
    # ranks timed out waiting for node b's, named.
    for r in results:
        assert r["saved"] == [1, 2, 3], r
        assert r["is_checkpoint_error"], r
        assert r["ended_unix"] - cut_at < CUT_BOUND_S, r
    for r in results[:2]:
        assert r["error_type"] == "CoordinationTimeoutError", r
        assert "[2, 3]" in r["message"], r

    # From the server's side: step 4 is not there, torn or whole; the earlier
    # checkpoints are intact; nothing pending is left to be mistaken for one.
    server = two_nodes.server()
    assert checkpoint_dirs(two_nodes) == [2, 3]
    entries = catalog.scan(server)
    assert [(e.name, e.status) for e in entries if e.status != "ok"] == []
    for step in (2, 3):
        catalog.load_checkpoint(server, step, full=True)
    observed(
        cut_after_announce_s=0.3,
        failed_within_s={r["rank"]: round(r["ended_unix"] - cut_at, 1) for r in results},
        errors={r["rank"]: f"{r['error_type']}: {r['message'][:160]}" for r in results},
        server_checkpoints=checkpoint_dirs(two_nodes),
    )
