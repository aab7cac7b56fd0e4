"""A four-rank job whose ranks make different checkpoint calls at the same point (the
bug of a call under ``if rank == 0:``): every rank raises ``CollectiveMismatchError``
naming both calls, at once rather than at the timeout, nothing is lost, and the calls
made alike afterwards work. Before, a rank read another call's value ("too many values
to unpack") and the others waited for the timeout."""

from __future__ import annotations

import time
from typing import Any

import pytest

from atomic_checkpoint import CheckpointManager, CollectiveMismatchError, KeepLast
from tests.dist import workers
from tests.dist.launcher import ok_values, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

WORLD = 4
TIMEOUT_S = 20.0

# (what ranks 0 and 2 call, what ranks 1 and 3 call, the keys the error names). Pair i
# saves step 10 * (i + 1) if it saves; the calls made alike after it save that step + 1.
PAIRS = [
    ("save", "restore", ("save step 10: prepare", "restore: next candidate")),
    ("save", "latest", ("save step 20: prepare", "'latest'")),
    ("restore", "checkpoints", ("restore: next candidate", "'list'")),
    ("latest", "apply_retention", ("'latest'", "'apply_retention(): arguments'")),
    ("save", "rollback", ("save step 50: prepare", "'rollback(): arguments'")),
]


def w_mismatched(rank: int, world: int, root: str) -> list[Any]:
    import torch

    mgr = CheckpointManager(root, timeout_s=TIMEOUT_S, retention=KeepLast(3))
    mgr.save(1, workers.make_state(1, rank, big_elems=64))
    step = 0
    calls = {
        "save": lambda: mgr.save(step, {"w": torch.full((4,), float(rank))}),
        "restore": mgr.restore,
        "latest": mgr.latest,
        "checkpoints": mgr.checkpoints,
        "apply_retention": mgr.apply_retention,
        "rollback": lambda: mgr.rollback(1),
    }
    out = []
    for i, (even, odd, _) in enumerate(PAIRS):
        step = 10 * (i + 1)
        t0 = time.monotonic()
        try:
            calls[even if rank % 2 == 0 else odd]()
            got: tuple[str, str] = ("ok", "")
        except Exception as exc:
            got = (type(exc).__name__, str(exc))
        took = time.monotonic() - t0
        # The same calls on every rank work again, and see every committed step.
        step += 1
        mgr.save(step, {"w": torch.full((4,), float(step + rank))})
        back = mgr.restore(step)["w"].tolist()
        out.append((got, took, back == [float(step + rank)] * 4, mgr.latest().step))
    mgr.close()
    return out


def test_ranks_in_different_calls_all_raise_the_mismatch_at_once_and_go_on(tmp_path):
    root = tmp_path / "ckpt"
    v = ok_values(run_ranks(w_mismatched, WORLD, str(root), tmp_dir=str(tmp_path), timeout_s=150))
    for i, (_, _, keys) in enumerate(PAIRS):
        for rank in range(WORLD):
            (kind, msg), took, restored, latest = v[rank][i]
            assert kind == CollectiveMismatchError.__name__, (PAIRS[i], rank, kind, msg)
            assert all(k in msg for k in keys), (PAIRS[i], rank, msg)
            assert "in the same order" in msg
            assert took < TIMEOUT_S / 2, (PAIRS[i], rank, took)  # not a timeout
            assert restored and latest == 10 * (i + 1) + 1, (PAIRS[i], rank)
    # Nothing was committed by the mismatched calls (steps 10, 20, 50), and the
    # rollback to step 1 never ran (the steps above 1 are still there).
    reader = CheckpointManager(root, read_only=True)
    assert [c.step for c in reader.checkpoints()] == [31, 41, 51]


def w_mismatched_arguments(rank: int, world: int, root: str) -> dict[str, Any]:
    import os

    import torch

    mgr = CheckpointManager(root, timeout_s=3.0)
    for s in (5, 6):
        mgr.save(s, {"w": torch.full((4,), float(s))})
    out: dict[str, Any] = {}

    def outcome(fn: Any) -> tuple[str, str]:
        try:
            fn()
        except Exception as exc:
            return type(exc).__name__, str(exc)
        return "ok", ""

    # Before, restore(5) beside restore(6) said the step "was replaced 8 times while
    # being read", and rollback(5) beside rollback(4) removed step 6 without a word.
    out["restore"] = outcome(lambda: mgr.restore(5 if rank % 2 == 0 else 6))
    out["rollback"] = outcome(lambda: mgr.rollback(5 if rank % 2 == 0 else 4))
    out["after"] = [c.step for c in mgr.checkpoints()]
    # A rollback under `if rank == 0:` while the others save: before, rank 0 deleted
    # step 6 and then waited for the others.
    if rank == 0:
        out["alone"] = outcome(lambda: mgr.rollback(5))
    else:
        out["alone"] = outcome(lambda: mgr.save(7, {"w": torch.zeros(4)}))
    out["on_disk"] = sorted(n for n in os.listdir(root) if n.startswith("checkpoint-"))
    return out


def test_ranks_passing_different_steps_to_restore_or_rollback_do_nothing(tmp_path):
    root = tmp_path / "ckpt"
    v = ok_values(
        run_ranks(w_mismatched_arguments, 3, str(root), tmp_dir=str(tmp_path), timeout_s=90)
    )
    for call, values in (("restore(step)", "rank 0: 5, rank 1: 6, rank 2: 5"),
                         ("rollback()", "rank 0: 5, rank 1: 4, rank 2: 5")):  # fmt: skip
        key = "restore" if call.startswith("restore") else "rollback"
        assert {x[key] for x in v} == {
            (
                "CollectiveMismatchError",
                f"the ranks called {call} with different arguments ({values}); nothing "
                "was done. Every rank must pass the same value: compute it once (e.g. on "
                "rank 0) and use it on every rank",
            )
        }
    assert all(x["after"] == [5, 6] for x in v)
    # Nothing deleted and nothing committed; every rank failed. These two calls wait on
    # different keys, so they meet at the timeout: whichever rank gave up first marked
    # the round (a timeout on its side), and a rank that reads that mark names the
    # mismatch.
    alone = [x["alone"] for x in v]
    assert {kind for kind, _ in alone} <= {"CollectiveMismatchError", "CoordinationTimeoutError"}
    assert any(k == "CollectiveMismatchError" and "rollback()" in m for k, m in alone), alone
    assert all(x["on_disk"] == ["checkpoint-5", "checkpoint-6"] for x in v)


def w_saving_fails_on_one_rank_then_retention_alone(
    rank: int, world: int, root: str
) -> dict[str, Any]:
    import os

    import torch

    mgr = CheckpointManager(root, timeout_s=3.0, retention=KeepLast(3))
    for s in (1, 2, 3):
        mgr.save(s, {"w": torch.full((4,), float(s))})
    out: dict[str, Any] = {}
    try:
        with mgr.saving(4) as d:
            (d / f"w-{rank}.bin").write_bytes(b"x")
            if rank == 1:
                raise RuntimeError("rank 1 could not serialise its shard")
        out["saving"] = ("ok", "", None)
    except Exception as exc:
        cause = exc.__cause__
        out["saving"] = (type(exc).__name__, str(exc), None if cause is None else str(cause))
    # apply_retention() under `if rank == 0:` while the other rank saves: rank 0 deleted
    # steps 1 and 2 before the round that found the mismatch.
    try:
        if rank == 0:
            mgr.retention = KeepLast(1)
            mgr.apply_retention()
        else:
            mgr.save(5, {"w": torch.zeros(4)})
        out["alone"] = "ok"
    except Exception as exc:
        out["alone"] = type(exc).__name__
    out["on_disk"] = sorted(n for n in os.listdir(root) if n.startswith("checkpoint-"))
    return out


def test_a_saving_block_failing_on_one_rank_and_retention_on_rank_0_alone(tmp_path):
    root = tmp_path / "ckpt"
    v = ok_values(
        run_ranks(
            w_saving_fails_on_one_rank_then_retention_alone,
            2,
            str(root),
            tmp_dir=str(tmp_path),
            timeout_s=90,
        )
    )
    # Every rank raises the same error; on rank 1 its own exception is the cause (it
    # raised the bare RuntimeError while rank 0 raised DistributedCheckpointError).
    kinds = {x["saving"][0] for x in v}
    assert kinds == {"DistributedCheckpointError"}, v
    assert all("rank 1" in x["saving"][1] and "could not serialise" in x["saving"][1] for x in v)
    assert v[1]["saving"][2] == "rank 1 could not serialise its shard"
    assert all(x["alone"] != "ok" for x in v), v
    assert all(x["on_disk"] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"] for x in v), v


def w_settings_by_rank(rank: int, world: int, root: str) -> dict[str, str]:
    """Step 1 saved alike; then managers opened with a ``run_id``, ``read_only``,
    ``retention`` or ``strategy`` that differs by rank. What each open raised, and how
    long it took."""
    with CheckpointManager(root, timeout_s=TIMEOUT_S) as mgr:
        mgr.save(1, {"r": rank})
    out = {}
    differing = (
        ("run_id", f"run-{rank}"),
        ("read_only", rank % 2 == 1),
        ("retention", KeepLast(1 + rank)),
        ("strategy", "marker" if rank % 2 else "rename"),
    )
    for name, value in differing:
        t = time.monotonic()
        try:
            CheckpointManager(root, timeout_s=TIMEOUT_S, **{name: value}).close()
            out[name] = "opened"
        except Exception as exc:
            out[name] = f"{type(exc).__name__} after {time.monotonic() - t:.1f} s: {exc}"
    if rank == 0:  # a manager made under `if rank == 0:`
        try:
            CheckpointManager(root, timeout_s=2.0).close()
            out["alone"] = "opened"
        except Exception as exc:
            out["alone"] = f"{type(exc).__name__}: {exc}"
    return out


def test_settings_that_differ_by_rank_fail_the_open_on_every_rank_at_once(tmp_path):
    # A run_id or retention passed differently by rank was rank 0's, silently; read_only=
    # on some ranks only failed with a mismatch of two rounds that did not name the
    # setting; a strategy differing by rank split one save between two layouts.
    v = ok_values(run_ranks(w_settings_by_rank, 2, str(tmp_path / "root"), tmp_dir=str(tmp_path)))
    for name in ("run_id", "read_only", "retention", "strategy"):
        said = [x[name] for x in v]
        assert all(x.startswith("CollectiveMismatchError after ") for x in said), said
        assert all(f"'{name}'" in x and "CheckpointManager()" in x for x in said), said
        assert all(float(x.split()[2]) < TIMEOUT_S / 2 for x in said), said
    assert all("'run-0'" in x["run_id"] and "'run-1'" in x["run_id"] for x in v), v
    assert all("KeepLast(1)" in x["retention"] and "KeepLast(2)" in x["retention"] for x in v), v
    assert v[0]["alone"].startswith("CoordinationTimeoutError"), v[0]
    assert "create it on every rank" in v[0]["alone"], v[0]


def w_own_root_per_rank(rank: int, world: int, base: str) -> str:
    import os

    root = os.path.join(base, f"node{rank}")  # one host: taken for one shared ROOT
    mgr = CheckpointManager(root, timeout_s=10.0)
    try:
        mgr.save(1, {"r": rank})
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        mgr.close()


def test_ranks_of_one_host_that_pass_different_roots_are_told_so(tmp_path):
    # Each rank wrote into a pending directory its leader had made in another ROOT, and
    # every rank read "create ... failed: No such file or directory".
    v = ok_values(run_ranks(w_own_root_per_rank, 2, str(tmp_path / "nodes"), tmp_dir=str(tmp_path)))
    assert all(x.startswith("DistributedCheckpointError") for x in v), v
    assert all("the ranks do not share one ROOT" in x and "ATOMIC_CHECKPOINT_HOST" in x for x in v)


def w_rank_0_alone(rank: int, world: int, root: str) -> list[Any]:
    import os
    import time

    import torch

    from atomic_checkpoint import coordination

    coordination.SLOW_ROUND_S = 2.0  # the default is 60 s; timeout_s is over twice this
    mgr = CheckpointManager(root, timeout_s=60.0)
    mgr.save(1, {"w": torch.zeros(4)})
    out = []
    alone = [lambda: mgr.restore(), mgr.checkpoints, lambda: mgr.rollback(1)]
    for i, call in enumerate(alone):
        step = 10 * (i + 1)
        t0 = time.monotonic()
        try:
            if rank == 0:
                call()
            else:
                mgr.save(step, {"w": torch.ones(4)})
            got = ("ok", "")
        except Exception as exc:
            got = (type(exc).__name__, str(exc))
        took = time.monotonic() - t0
        mgr.save(step + 1, {"w": torch.full((4,), float(step))})  # alike: works again
        on_disk = sorted(n for n in os.listdir(root) if n.startswith("checkpoint-"))
        out.append((got, took, on_disk))
    mgr.close()
    return out


def test_calls_on_rank_0_alone_that_never_meet_the_saves_are_found_after_slow_round_s(tmp_path):
    # Rank 0 restores, lists or rolls back while the others save: rank 0 collects its
    # call's values while the others wait for its answer as their leader, so neither
    # reads the other's call. Before, every rank waited out timeout_s (60 s here, 600 s
    # by default); now the waiting ranks announce their call after SLOW_ROUND_S.
    root = tmp_path / "ckpt"
    v = ok_values(run_ranks(w_rank_0_alone, 3, str(root), tmp_dir=str(tmp_path), timeout_s=170))
    for i, call in enumerate(("restore: next candidate", "'list'", "'rollback(): arguments'")):
        step = 10 * (i + 1)
        for rank in range(3):
            (kind, msg), took, on_disk = v[rank][i]
            assert kind == CollectiveMismatchError.__name__, (call, rank, kind, msg)
            assert call.strip("'") in msg and f"save step {step}: prepare" in msg, msg
            assert took < 30, (call, rank, took)  # not the 60 s timeout
            # Nothing committed by the mismatched save, nothing rolled back.
            kept = [f"checkpoint-{s + 1}" for s in (10, 20, 30)[: i + 1]]
            assert on_disk == ["checkpoint-1", *kept]


def w_resume_with_one_roots_mount_missing(rank: int, world: int, shared: str, empty: str) -> Any:
    """Both ranks (two "nodes") save to one ROOT; then rank 1 restarts on a node whose
    mount is missing: its ROOT is an empty local directory."""
    import os

    os.environ["ATOMIC_CHECKPOINT_HOST"] = f"node{rank}"
    mgr = CheckpointManager(shared, timeout_s=15.0)
    mgr.save(1, {"r": rank})
    mgr.close()
    out = {}
    root = shared if rank == 0 else empty
    for domains in ("auto", "shared"):
        t = time.monotonic()
        try:
            m = CheckpointManager(root, timeout_s=15.0, storage_domains=domains)
            try:
                m.restore()
                out[domains] = ("restored", "", 0.0)
            finally:
                m.close()
        except Exception as exc:
            out[domains] = (type(exc).__name__, str(exc), time.monotonic() - t)
    return out


def test_a_rank_whose_roots_mount_is_missing_is_named_on_resume_and_on_restore(tmp_path):
    # Before: with the domains detected, "steps [1] were saved by a job of 2 ranks on 1
    # node (this job: 2 ranks on 2 nodes) ... resume with the job's shape that saved
    # them", though the shape was the same; with storage_domains="shared", "was replaced
    # 8 times while being read (it is being saved again and again with overwrite=True)".
    empty = tmp_path / "node1-mountpoint"
    empty.mkdir()
    v = ok_values(
        run_ranks(
            w_resume_with_one_roots_mount_missing,
            2,
            str(tmp_path / "root"),
            str(empty),
            tmp_dir=str(tmp_path),
            timeout_s=120,
        )
    )
    for out in v:
        kind, text, _ = out["auto"]
        assert kind == "ResumeError", out
        assert "its mount is missing" in text and "mount the shared storage at ROOT" in text
        kind, text, _ = out["shared"]
        assert kind == "DistributedCheckpointError", out
        assert "overwrite=True" not in text
        assert "rank 1 does not see" in text and "do not share one ROOT" in text, text
    # Nothing was written into the empty mount point, and the step is intact.
    assert [p.name for p in empty.iterdir() if p.name.startswith("checkpoint-")] == []
    assert (tmp_path / "root" / "checkpoint-1" / "checkpoint.manifest.json").exists()


def w_lone_call_then_calls_alike(rank: int, world: int, root: str, lone: int, call: str) -> Any:
    """Step 1 saved alike; ``lone`` alone calls ``call`` (the misuse under ``if rank ==
    0:``) and times out, the others wait until it has; then every rank saves steps 2
    and 3 and lists. What each call did on this rank."""
    import os

    done = os.path.join(root + "-flags", "lone-done")
    os.makedirs(os.path.dirname(done), exist_ok=True)
    mgr = CheckpointManager(root, timeout_s=3.0)
    mgr.save(1, {"r": rank})
    out: dict[str, Any] = {}
    if rank == lone:
        try:
            getattr(mgr, call)()
            out["lone"] = "ok"
        except Exception as exc:
            out["lone"] = type(exc).__name__
        open(done, "w").close()
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
    for step in (2, 3):
        try:
            out[f"save {step}"] = mgr.save(step, {"r": rank}).step
        except Exception as exc:
            out[f"save {step}"] = f"{type(exc).__name__}: {exc}"
    out["listed"] = [c.step for c in mgr.checkpoints()]
    mgr.close()
    return out


@pytest.mark.parametrize(("lone", "call"), [(0, "checkpoints"), (1, "checkpoints"), (0, "latest")])
def test_calls_made_alike_after_a_call_one_rank_made_alone_work_again(tmp_path, lone, call):
    # The lone call times out on its rank, as documented; it had taken a round number
    # on that rank alone, so every later call met the other ranks one round out of
    # step and failed, for good (every save, on every rank).
    root = str(tmp_path / "ckpt")
    v = ok_values(
        run_ranks(
            w_lone_call_then_calls_alike, 3, root, lone, call, tmp_dir=str(tmp_path), timeout_s=120
        )
    )
    assert v[lone]["lone"] == "CoordinationTimeoutError", v
    assert all(x["save 2"] == 2 and x["save 3"] == 3 for x in v), v
    assert all(x["listed"] == [1, 2, 3] for x in v), v
