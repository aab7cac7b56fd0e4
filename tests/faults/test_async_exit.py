"""An async save when the process ends: the interpreter's exit finishes a save in flight
or abandons a stuck one, a SIGKILL mid-write keeps the previous checkpoint, and the
example script runs end to end. Each runs a real child process (tests/unit starts
none)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from atomic_checkpoint import CheckpointManager, LocalStorage, catalog
from atomic_checkpoint.layout import PENDING_DIR
from tests.integrations.helpers import run_example

pytestmark = pytest.mark.timeout(120)

FAULTS = "ATOMIC_CHECKPOINT_FAULTS"


def listed(root) -> list[int]:
    return [c.step for c in CheckpointManager(root, read_only=True).checkpoints()]


def pending_entries(root) -> list[str]:
    d = os.path.join(root, PENDING_DIR)
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def _run_script(tmp_path, body: str, *, env: dict[str, str] | None = None, timeout: float = 60):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            """
            import logging, sys
            import torch
            from atomic_checkpoint import CheckpointManager
            logging.basicConfig(level=logging.INFO, stream=sys.stderr)
            root = sys.argv[1]
            """
        )
        + textwrap.dedent(body)
    )
    full_env = {**os.environ, **(env or {})}
    full_env.pop(FAULTS, None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        check=False,
    )


def test_interpreter_exit_finishes_the_save_in_flight(tmp_path):
    proc = _run_script(
        tmp_path,
        """
        mgr = CheckpointManager(root)
        mgr.save(1, {"w": torch.ones(8)})
        state = {"w": torch.arange(1 << 23, dtype=torch.float32)}
        mgr.save_async(2, state)
        state["w"].zero_()
        # falls off the end without wait() or close()
        """,
    )
    assert proc.returncode == 0, proc.stderr
    assert "interpreter exit: finished the in-flight async save of step 2" in proc.stderr
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, read_only=True)
    assert [c.step for c in mgr.checkpoints()] == [1, 2]
    mgr.verify(2)
    assert torch.equal(mgr.restore(2)["w"], torch.arange(1 << 23, dtype=torch.float32))


@pytest.mark.parametrize("where", ["second manager", "fork child", "forkserver child"])
def test_exit_finishes_the_save_in_flight_of_a_later_manager_and_of_a_child(tmp_path, where):
    # A manager opened after the process's first save_async (a notebook cell run again,
    # a second training stage): its lock was released at exit before its save ended
    # ("the run lock ... is not held by this job"), and the save was lost, exit 0. In a
    # multiprocessing child started by fork or forkserver no atexit hook runs at all:
    # the save was lost and the lock file left.
    body = """
        import multiprocessing as mp
        def train(root, first):
            if first:
                with CheckpointManager(root + "-first") as old:
                    old.save_async(1, {"w": torch.ones(8)})
            mgr = CheckpointManager(root)
            mgr.save(1, {"w": torch.ones(8)})
            mgr.save_async(2, {"w": torch.arange(1 << 22, dtype=torch.float32)})
            # ends without wait() or close()
        if __name__ == "__main__":
            how = sys.argv[2]
            if how == "second manager":
                train(root, True)
            else:
                ctx = mp.get_context(how.split()[0])
                p = ctx.Process(target=train, args=(root, False))
                p.start()
                p.join(60)
                print("child exit", p.exitcode, flush=True)
        """
    script = tmp_path / "job.py"
    script.write_text(
        "import logging, sys\nimport torch\nfrom atomic_checkpoint import CheckpointManager\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\nroot = sys.argv[1]\n"
        + textwrap.dedent(body)
    )
    env = {k: v for k, v in os.environ.items() if k != FAULTS}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt"), where],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "child exit 0" in proc.stdout or where == "second manager", proc.stdout
    assert "is not held by this job" not in proc.stderr, proc.stderr
    root = tmp_path / "ckpt"
    assert not (root / ".atomic-checkpoint" / "lock.json").exists()  # released
    with CheckpointManager(root, read_only=True) as mgr:
        assert [c.step for c in mgr.checkpoints()] == [1, 2]
        mgr.verify(2)


def test_interpreter_exit_abandons_a_stuck_save_and_leaves_nothing_discoverable(tmp_path):
    proc = _run_script(
        tmp_path,
        """
        mgr = CheckpointManager(root, timeout_s=1.0)
        mgr.save(1, {"w": torch.ones(8)})
        mgr.save_async(2, {"w": torch.zeros(1 << 20)})  # its write hangs (fault)
        """,
        env={FAULTS: "mid_write@0=hang:2"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "interpreter exit: abandoned the in-flight async save of step 2" in proc.stderr
    root = tmp_path / "ckpt"
    # The run lock stays with the exiting process. The locks' own exit hook deleted it:
    # on a hung filesystem (fsfreeze, a dead NFS server) the process then hung in that
    # unlink, and on a live one another job could take ROOT under the save.
    assert "the run lock stays with it" in proc.stderr.replace("\n", " "), proc.stderr
    assert "released the run lock" not in proc.stderr
    assert (root / ".atomic-checkpoint" / "lock.json").exists()
    assert listed(root) == [1]
    for entry in catalog.scan(LocalStorage(root)):
        assert entry.status in ("ok", "pending"), entry
    # The next writing start removes the abandoned pending data.
    CheckpointManager(root).close()
    assert pending_entries(root) == []


def test_sigkill_during_the_background_write_keeps_the_previous_checkpoint(tmp_path):
    proc = _run_script(
        tmp_path,
        """
        mgr = CheckpointManager(root)
        mgr.save(1, {"w": torch.full((1 << 20,), 1.0)})
        h = mgr.save_async(2, {"w": torch.full((1 << 22,), 2.0)})
        h.result()
        print("NOT KILLED")
        """,
        env={FAULTS: "mid_write@0=kill:2"},
    )
    assert proc.returncode == -9, (proc.returncode, proc.stderr)
    assert "NOT KILLED" not in proc.stdout
    root = tmp_path / "ckpt"
    # The half-written file sits in a pending directory: discoverable checkpoints are
    # only the complete, previous one.
    assert pending_entries(root), "expected the torn attempt under .pending/"
    for entry in catalog.scan(LocalStorage(root)):
        assert entry.status in ("ok", "pending"), entry
    mgr = CheckpointManager(root)  # the restarted job (takes over the dead job's lock)
    assert [c.step for c in mgr.checkpoints()] == [1]
    mgr.verify(1)
    assert torch.equal(mgr.restore()["w"], torch.full((1 << 20,), 1.0))
    assert pending_entries(root) == []
    mgr.save_async(2, {"w": torch.full((4,), 3.0)}).result()
    mgr.close()


@pytest.mark.timeout(120)
def test_example_async_save_runs(tmp_path):
    out = run_example(tmp_path, "async_save.py", tmp_path / "ckpt", timeout_s=100)
    assert out.count("save_async returned after") == 3, out
    assert "step 9: committed" in out and "checkpoint-9 (64 MiB)" in out, out
    assert "checkpoints: [9, 10]" in out, out
    assert "restored step 9 into the model" in out, out
    assert "identical to the weights at save_async time: True" in out, out
    assert {"checkpoint-9", "checkpoint-10"} <= set(os.listdir(tmp_path / "ckpt"))


def test_a_forked_child_is_told_the_manager_is_its_parents(tmp_path):
    # A child forked while an async save was in flight called save(), wait() or
    # close() and blocked for ever: the save thread exists only in the parent.
    proc = _run_script(
        tmp_path,
        """
        import os
        mgr = CheckpointManager(root)
        mgr.save(1, {"w": torch.ones(8)})
        mgr.save_async(2, {"w": torch.arange(1 << 22, dtype=torch.float32)})
        pid = os.fork()
        if pid == 0:
            # apply_retention() and rollback() deleted the parent's checkpoints from
            # the child; prepare_async() waited for ever for the parent's save.
            calls = (
                lambda: mgr.save(3, {"w": torch.ones(8)}),
                lambda: mgr.wait(),
                lambda: mgr.apply_retention(),
                lambda: mgr.rollback(1),
                lambda: mgr.prepare_async({"w": torch.ones(8)}),
            )
            for call in calls:
                try:
                    call()
                    os._exit(3)
                except Exception as exc:
                    print("child:", type(exc).__name__, exc, flush=True)
            mgr.close()  # a no-op in the child: the parent's lock is not released
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status), flush=True)
        mgr.save(3, {"w": torch.ones(8)})
        mgr.close()
        """,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.count("child: CheckpointError") == 5, out
    assert "belongs to process" in out and "child exit 0" in out, out
    assert "nothing is released" in proc.stderr
    assert listed(tmp_path / "ckpt") == [1, 2, 3]
