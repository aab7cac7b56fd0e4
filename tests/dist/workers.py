"""Functions that run inside each rank of a test job (see ``launcher.run_ranks``).

States are deterministic functions of (step, rank), so any process can rebuild what a
checkpoint must contain and compare it bit for bit.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import torch

from atomic_checkpoint import CheckpointManager, KeepLast


def make_state(step: int, rank: int, *, n_big: int = 2, big_elems: int = 1 << 16) -> dict[str, Any]:
    """A model + optimizer + scheduler + RNG shaped state, unique per (step, rank)."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    model = {f"layer{i}.weight": torch.randn(big_elems, generator=g) for i in range(n_big)}
    model["emb.weight"] = torch.randn(64, 8, generator=g).to(torch.bfloat16)
    model["mask"] = torch.rand(17, generator=g) > 0.5
    model["counts"] = torch.randint(0, 1 << 40, (5,), generator=g, dtype=torch.int64)
    optim = {
        "state": {
            i: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(4, generator=g)}
            for i in range(3)
        },
        "param_groups": [{"lr": 0.001 * (rank + 1), "betas": (0.9, 0.999), "params": [0, 1, 2]}],
    }
    rng = random.Random(step * 7 + rank)
    return {
        "model": model,
        "optimizer": optim,
        "scheduler": {"last_epoch": step, "_last_lr": [0.001]},
        "rng": {"python": rng.getstate(), "torch": g.get_state()},
        "step": step,
        "rank": rank,
        "name": f"rank{rank}-step{step}",
    }


def replicated_state(step: int) -> dict[str, Any]:
    return {
        "config": {"hidden": 8, "step": step},
        "w": torch.arange(step + 10, dtype=torch.float32),
    }


def states_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a.keys()) == list(b.keys()) and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def w_roundtrip(rank: int, world: int, root: str, steps: list[int]) -> dict[str, Any]:
    """Save per-rank and replicated checkpoints; restore and compare each."""
    mgr = CheckpointManager(root, timeout_s=30)
    infos = []
    for s in steps:
        info = mgr.save(s, make_state(s, rank), metrics={"loss": 1.0 / (s + 1)})
        infos.append(info)
    rep = mgr.save(max(steps) + 1, replicated_state(max(steps) + 1), replicated=True)
    ok = all(states_equal(mgr.restore(s), make_state(s, rank)) for s in steps)
    rep_ok = states_equal(mgr.restore(rep.step), replicated_state(rep.step))
    latest = mgr.latest()
    mgr.close()
    return {
        "infos": [(i.step, i.path, i.size_bytes, i.run_id, i.commit_seq) for i in infos],
        "timings": [dict(i.timings_s) for i in infos],
        "restore_ok": ok,
        "replicated_ok": rep_ok,
        "latest": latest.step if latest else None,
    }


def w_files_mode(rank: int, world: int, root: str, step: int) -> dict[str, Any]:
    """Every rank writes its own files into the pending directory of ``saving()``."""
    mgr = CheckpointManager(root, timeout_s=30)
    with mgr.saving(step, metrics={"eval_loss": 0.5}) as d:
        (d / f"shard-{rank}.bin").write_bytes(bytes([rank]) * (1000 + rank))
        if rank == 0:
            (d / "config.json").write_text('{"a": 1}')
            (d / "sub").mkdir()
            (d / "sub" / "nested.txt").write_text("hello")
        seen_pending = str(d)
    info = mgr.last_saved
    mgr.close()
    return {
        "step": info.step if info else None,
        "path": info.path if info else None,
        "pending": seen_pending,
    }


def w_failing_on_commit(rank: int, world: int, root: str) -> dict[str, Any]:
    """The coordinator's on_commit raises at every commit; every rank saves twice."""

    def upload(info: Any) -> None:
        raise RuntimeError(f"upload of step {info.step} failed")

    mgr = CheckpointManager(root, timeout_s=30, on_commit=upload)
    out = []
    for step in (1, 2):
        try:
            out.append(mgr.save(step, make_state(step, rank)).step)
        except Exception as exc:  # reported, not raised: the test asserts there is none
            out.append(f"{type(exc).__name__}: {exc}")
    handle = mgr.save_async(3, make_state(3, rank))
    out.append(handle.result().step)
    mgr.close()
    return {"saved": out}


def w_save_steps(
    rank: int,
    world: int,
    root: str,
    steps: list[int],
    keep_last: int | None,
    timeout_s: float,
    pause_s: float = 0.0,
) -> dict[str, Any]:
    """Save ``steps`` in order (used with fault injection); report what completed."""
    mgr = CheckpointManager(
        root, timeout_s=timeout_s, retention=KeepLast(keep_last) if keep_last else None
    )
    done = []
    for s in steps:
        mgr.save(s, make_state(s, rank, n_big=2, big_elems=1 << 15))
        done.append(s)
        # Between saves, like training steps: a concurrent reader gets time to read
        # even on a loaded machine.
        time.sleep(pause_s)
    mgr.close()
    return {"done": done}


def w_bad_state_on(rank: int, world: int, root: str, bad_rank: int, step: int) -> dict[str, Any]:
    """One rank holds an unsupported object: every rank must raise the same error."""
    mgr = CheckpointManager(root, timeout_s=20)
    mgr.save(step - 1, make_state(step - 1, rank, big_elems=64))
    state = make_state(step, rank, big_elems=64)
    if rank == bad_rank:
        state["optimizer"]["weird"] = object()
    try:
        mgr.save(step, state)
    except Exception as exc:
        return {
            "error_type": type(exc).__name__,
            "message": str(exc),
            "failed_ranks": getattr(exc, "failed_ranks", None),
            "listed": [c.step for c in mgr.checkpoints()],
        }
    return {"error_type": None}


def w_restore_into_mismatch_on(rank: int, world: int, root: str, bad_rank: int) -> dict[str, Any]:
    """``restore(into=)`` with a target of another shape on one rank: every rank must
    raise the same error, which ``except StateMismatchError`` catches (as with one
    process)."""
    from atomic_checkpoint import StateMismatchError

    mgr = CheckpointManager(root, timeout_s=20)
    mgr.save(1, {"w": torch.full((4,), float(rank))})
    into = {"w": torch.zeros(3 if rank == bad_rank else 4)}
    try:
        mgr.restore(into=into)
    except StateMismatchError as exc:
        out = {"caught": type(exc).__name__, "message": str(exc)}
        out["failed_ranks"] = getattr(exc, "failed_ranks", None)
        return out
    except Exception as exc:  # not caught as documented for one process
        return {"caught": None, "missed": f"{type(exc).__name__}: {exc}"}
    finally:
        mgr.close()
    return {"caught": None, "missed": "no error"}


def w_bad_input_on(
    rank: int, world: int, root: str, bad_rank: int, kind: str, strategy: str | None = None
) -> dict[str, Any]:
    """One rank passes metrics or metadata that cannot be recorded, to a save, an async
    save and a saving() block: every rank must raise, and the next save (made alike)
    must work."""
    mgr = CheckpointManager(root, timeout_s=20, strategy=strategy)
    mgr.save(1, make_state(1, rank, big_elems=64))
    bad: dict[str, Any] = {}
    if rank == bad_rank:
        bad = {"metrics": {"loss": "x"}} if kind == "metrics" else {"metadata": {"f": object()}}
    errors: dict[str, Any] = {}
    for step, how in ((2, "sync"), (3, "async"), (4, "saving")):
        try:
            if how == "sync":
                mgr.save(step, make_state(step, rank, big_elems=64), **bad)
            elif how == "saving":
                with mgr.saving(step, **bad) as d:
                    (d / f"part-{rank}.txt").write_text(str(step))
            else:
                mgr.save_async(step, make_state(step, rank, big_elems=64), **bad)
                mgr.wait()
        except Exception as exc:
            errors[how] = [type(exc).__name__, getattr(exc, "failed_ranks", None), str(exc)]
    mgr.save(5, make_state(5, rank, big_elems=64))
    listed = [c.step for c in mgr.checkpoints()]
    mgr.close()
    return {"errors": errors, "listed": listed}


def w_one_rank_leaves(rank: int, world: int, root: str, leaver: int, how: str) -> dict[str, Any]:
    """Rank ``leaver`` leaves after step 1 (its ``with`` block ends on an exception, or
    it calls close()); the others go on saving, synchronously then asynchronously:
    each save must fail at once on each of them, naming the rank that left, not after
    ``timeout_s``."""
    import time

    if rank == leaver:
        try:
            with CheckpointManager(root, timeout_s=30) as mgr:
                mgr.save(1, make_state(1, rank, big_elems=64))
                if how == "raise":
                    raise RuntimeError("a bug in this rank's training step")
        except RuntimeError:
            pass
        return {"left": True}
    mgr = CheckpointManager(root, timeout_s=30)
    mgr.save(1, make_state(1, rank, big_elems=64))
    errors = []
    for step, kind in ((2, "sync"), (3, "async")):
        t = time.monotonic()
        try:
            if kind == "sync":
                mgr.save(step, make_state(step, rank, big_elems=64))
            else:
                mgr.save_async(step, make_state(step, rank, big_elems=64))
                mgr.wait()
        except Exception as exc:
            errors.append([kind, type(exc).__name__, str(exc), time.monotonic() - t])
        else:
            errors.append([kind, None, "", time.monotonic() - t])
    mgr.close()
    return {"left": False, "errors": errors}


def w_hang_one(rank: int, world: int, root: str, step: int, timeout_s: float) -> dict[str, Any]:
    """Run with ATOMIC_CHECKPOINT_FAULTS=before_write@<r>=hang: the others must time out."""
    mgr = CheckpointManager(root, timeout_s=timeout_s)
    mgr.save(step - 1, make_state(step - 1, rank, big_elems=64))
    import time

    t = time.monotonic()
    try:
        mgr.save(step, make_state(step, rank, big_elems=64))
    except Exception as exc:
        return {
            "error_type": type(exc).__name__,
            "message": str(exc),
            "missing": getattr(exc, "missing_ranks", None),
            "elapsed": time.monotonic() - t,
        }
    return {"error_type": None}


def w_node_local(
    rank: int,
    world: int,
    base: str,
    steps: list[int],
    keep_last: int | None,
    resave: int | None = None,
    then_keep: int | None = None,
) -> dict[str, Any]:
    """Two ranks per "node", each node with its own directory (node-local disks).
    ``then_keep``: after the saves, ``KeepLast(then_keep)`` applied at once."""
    from atomic_checkpoint.domains import HOST_ENV

    node = rank // 2
    os.environ[HOST_ENV] = f"node{node}"
    root = os.path.join(base, f"node{node}")
    mgr = CheckpointManager(
        root, timeout_s=10, retention=KeepLast(keep_last) if keep_last else None
    )
    latest = mgr.latest()
    restored = None
    if latest is not None:
        restored = states_equal(
            mgr.restore(latest.step), make_state(latest.step, rank, big_elems=256)
        )
    done = []
    for s in steps:
        mgr.save(s, make_state(s, rank, big_elems=256))
        done.append(s)
    if resave is not None:
        mgr.save(resave, make_state(resave, rank, big_elems=256))
        done.append(resave)
    applied = None
    if then_keep is not None:
        mgr.retention = KeepLast(then_keep)
        applied = mgr.apply_retention()
    out = {
        "applied": applied,
        "domain": (mgr.domain.index, mgr.domain.leader, mgr.domain.members, mgr.domain.leaders),
        "latest": latest.step if latest else None,
        "restored_ok": restored,
        "done": done,
        "listed": [c.step for c in mgr.checkpoints()],
    }
    mgr.close()
    return out


def w_node_local_restore_step(
    rank: int, world: int, base: str, step: int | None, swapped: bool = False
) -> dict[str, Any]:
    """``w_node_local``'s layout (``swapped``: ranks 0-1 now on node 1, 2-3 on node 0):
    every rank asks for ``step`` (which may be on some nodes only), then ``latest()``,
    made alike on every rank."""
    import time

    from atomic_checkpoint.domains import HOST_ENV

    node = 1 - rank // 2 if swapped else rank // 2
    os.environ[HOST_ENV] = f"node{node}"
    mgr = CheckpointManager(os.path.join(base, f"node{node}"), timeout_s=10)
    t0 = time.monotonic()
    try:
        mgr.restore(step=step)
        error = None
    except Exception as exc:
        error = [type(exc).__name__, str(exc)]
    took = time.monotonic() - t0
    latest = mgr.latest()
    mgr.close()
    return {"error": error, "seconds": took, "latest": latest.step if latest else None}


def w_shared_two_hosts(rank: int, world: int, root: str) -> tuple[Any, ...]:
    from atomic_checkpoint.domains import HOST_ENV

    os.environ[HOST_ENV] = f"host{rank // 2}"
    mgr = CheckpointManager(root, timeout_s=10)
    mgr.save(1, make_state(1, rank, big_elems=64))
    d = mgr.domain
    mgr.close()
    return (d.index, d.leader, d.members, d.leaders)


def best_loss(step: int) -> float:
    """Losses fall with the step, except step 7, which is the best of the whole run."""
    return 1e-4 if step == 7 else 1.0 / step


def w_retention_run(
    rank: int, world: int, root: str, steps: list[int], timeout_s: float = 30.0
) -> dict[str, Any]:
    from atomic_checkpoint import KeepBest

    mgr = CheckpointManager(
        root, timeout_s=timeout_s, retention=KeepLast(3) | KeepBest(1, metric="loss", mode="min")
    )
    for s in steps:
        mgr.save(
            s, {"w": torch.full((64,), float(s)), "rank": rank}, metrics={"loss": best_loss(s)}
        )
    listed = [c.step for c in mgr.checkpoints()]
    mgr.close()
    return {"listed": listed}
