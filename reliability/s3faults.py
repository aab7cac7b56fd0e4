"""S3 faults campaign: a fault at every request of a save, a rotation, a start-up sweep
and the run lock, on a real S3 server (moto on 127.0.0.1) behind the fault-injecting
proxy of ``tests/testbed/s3proxy.py``.

Operations (one root per operation, reused across its trials):

- **save**: ``save(step)`` with ``KeepLast(2)``, then ``wait()``: the marker, the
  data PUT, the checks, the manifest's conditional create, the marker's delete, and
  the rotation of the oldest step (un-commit, batch delete, upload abort);
- **save-mpu**: the same with a state large enough for a multipart upload (start,
  parts, complete);
- **start**: a manager starting over what crashed saves left (an uncommitted attempt
  with an unfinished multipart upload, a stale attempt beside a committed step), then
  closing: the conditional-create probe, the lock's acquisition, the sweep (its batch
  deletes and upload aborts) and the lock's release;
- **kill**: a separate process saving (and rotating) is SIGKILLed at its n-th request,
  half the time after the request landed, half the time before; in the larger sizes
  also one saving a multipart state (killed mid-upload: an upload left open).

Each operation is first run without a fault to count its requests; then a fault is
injected at request ``i`` for every ``i`` (``full``) or a random sample (``quick``):
an S3 error (500 ``InternalError``; 503 ``SlowDown``, which the client retries), a
dropped answer (the request landed; the client sees a reset and retries), a cut
connection (the request never landed), a delay, an outage (every request from ``i``
on fails until the operation ends: clean-up fails too), and on conditional creates a
412 and a stripped ``If-None-Match``.

A failed operation's manager is closed while the fault still holds; the next trial
starts a new one (the "next start"). After a trial that ended well and left nothing
behind, its manager goes on into the next trial.

Checked after every trial, from a client that bypasses the proxy:

- **torn**: every discoverable checkpoint verifies and restores bit-exactly;
- **lost**: the newest ``KeepLast`` checkpoints committed before the trial are there;
- **split** (false errors): a save that raised did not commit its step, a save that
  returned did;
- **unclear**: every error is a ``CheckpointError`` that says what failed and where;
- **leaks**: after the next start's sweep and, if anything is left, ``atomic-checkpoint
  clean``, every object under the root belongs to a committed checkpoint or to the run
  lock, and no multipart upload is left;
- **stuck**: the next start, and a save of a step whose save failed, succeed.

Counts: faults by request type and fault kind (``by_request_fault``), where they fell
(``by_op``), and how the operations ended (``outcomes``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from atomic_checkpoint.storage.fsspec import PROBE_PREFIX

from .checks import describe_error, unclear_reason
from .tally import Progress, Tally

KEEP = 2
SMALL = 1 << 10  # float32 elements: one small PUT per checkpoint
LARGE = (6 << 20) // 4  # 6 MiB: two multipart parts of 5 MiB and the rest
BLOCK = 5 << 20
#: A fault trial's operation that has not ended after this long is a hang.
OP_BOUND_S = 120.0
BUCKET = "s3faults"

FAULTS = ("error-500", "error-503", "drop", "cut", "outage")
CREATE_FAULTS = ("error-412", "strip")


@dataclass(frozen=True)
class S3Size:
    #: fault trials per operation and round; None: every (request, fault) pair
    sample: int | None
    rounds: int
    kills: int | None  # None: a kill at every request of a save
    ops: tuple[str, ...] = ("save", "start", "save-mpu")
    #: also kill a save of the multipart state (the same number of kills)
    mpu_kills: bool = True


SIZES = {
    "quick": S3Size(sample=4, rounds=1, kills=1, mpu_kills=False),
    "full": S3Size(sample=None, rounds=3, kills=None),
    # Sampled, between the two: a wider look in minutes.
    "medium": S3Size(sample=25, rounds=1, kills=6),
}


def state(step: int, elems: int) -> dict[str, Any]:
    return {"step": step, "w": np.arange(elems, dtype=np.float32) + np.float32(step)}


def run(size: str, seed: int, progress: Progress, workdir: str) -> Tally:
    from tests.testbed.s3 import S3Server
    from tests.testbed.s3proxy import S3Proxy

    cfg = SIZES[size]
    tally = Tally("s3-faults")
    rng = random.Random(seed)
    log_dir = os.path.join(workdir, "s3faults")
    os.makedirs(log_dir, exist_ok=True)
    with S3Server(log_dir) as server, S3Proxy(server, lifetime_s=4 * 3600) as proxy:
        server.create_bucket(BUCKET)
        camp = _Campaign(tally, rng, server, proxy)
        for r in range(cfg.rounds):
            for op in cfg.ops:
                camp.enumerate(op, cfg.sample)
                progress(
                    f"s3-faults: round {r + 1} {op}: {tally.trials} trials, {tally.faults} "
                    f"faults, {tally.violations} violations"
                )
        camp.kills(cfg.kills, SMALL)
        if cfg.mpu_kills:
            camp.kills(cfg.kills, LARGE)
        progress(f"s3-faults: kills: {tally.trials} trials, {tally.violations} violations")
    return tally.finish()


def _fault_rule(fault: str, index: int, creates_before: int) -> Any:
    """The rule for ``fault`` at the ``index``-th request (a 412 and a stripped header:
    at the conditional create that is the ``index``-th request, the
    ``creates_before``-th conditional create)."""
    from tests.testbed.s3proxy import Rule

    if fault == "error-500":
        return Rule("error", status=500, skip=index)
    if fault == "error-503":
        return Rule("error", status=503, skip=index)
    if fault == "error-412":
        return Rule("error", status=412, kind="put-create", skip=creates_before)
    if fault == "strip":
        return Rule("strip", kind="put-create", skip=creates_before)
    if fault == "drop":
        return Rule("drop", skip=index)
    if fault == "cut":
        return Rule("cut", skip=index)
    if fault == "delay":
        return Rule("delay", delay_s=0.2, skip=index)
    if fault == "outage":
        return Rule("error", status=500, skip=index, times=None)
    raise ValueError(fault)


@dataclass
class _Campaign:
    tally: Tally
    rng: random.Random
    server: Any
    proxy: Any
    roots: dict[str, _Root] = field(default_factory=dict, init=False)

    # ------------------------------------------------------------------ plumbing
    def root(self, op: str) -> _Root:
        if op not in self.roots:
            self.roots[op] = _Root(self, f"{op}-{len(self.roots)}")
        return self.roots[op]

    def enumerate(self, op: str, sample: int | None) -> None:
        root = self.root(op)
        kinds = root.dry_run(op)
        if kinds is None:
            return
        plan: list[tuple[int, str]] = []
        for i, kind in enumerate(kinds):
            faults = list(FAULTS)
            if i % 4 == 0:
                faults.append("delay")
            if kind == "put-create":
                faults += CREATE_FAULTS
            plan += [(i, f) for f in faults]
        if sample is not None:
            plan = self.rng.sample(plan, min(sample, len(plan)))
        for index, fault in plan:
            root.fault_trial(op, index, fault, kinds)
        root.finish()

    def kills(self, count: int | None, elems: int) -> None:
        op = "save-mpu" if elems == LARGE else "save"
        root = self.root(f"kill-{op}")
        kinds = root.dry_run(op)
        if kinds is None:
            return
        indices = list(range(len(kinds)))
        if count is not None:
            indices = self.rng.sample(indices, min(count, len(indices)))
        for i in indices:
            root.kill_trial(i, kinds[i], land=self.rng.random() < 0.5, elems=elems)
        root.finish()


class _Root:
    """One root (``s3://BUCKET/<name>``), its known committed steps, and the checks."""

    def __init__(self, camp: _Campaign, name: str):
        self.camp = camp
        self.tally = camp.tally
        self.name = name
        self.url = f"s3://{BUCKET}/{name}"
        self.run_id = f"campaign-{name}"
        self.committed: set[int] = set()
        self.step = 0
        self.failed_step: int | None = None
        self.leaked: set[str] = set()
        self.kept: Any = None  # the manager of the last trial, if it ended well
        from atomic_checkpoint.storage import FsspecStorage

        self.direct = FsspecStorage(self.url, camp.server.storage_options())

    # -------------------------------------------------------------- managers
    def _opts(self, *, via_proxy: bool) -> dict[str, Any]:
        if not via_proxy:
            return self.camp.server.storage_options()
        # No botocore retries (no random back-off of up to seconds); s3fs' own loop
        # retries connection errors and SlowDown after 0.1-0.3 s.
        return self.camp.proxy.storage_options(max_attempts=1)

    def _storage(self, *, via_proxy: bool) -> Any:
        from atomic_checkpoint.storage import FsspecStorage

        s = FsspecStorage(self.url, self._opts(via_proxy=via_proxy), block_size_bytes=BLOCK)
        s.fs.retries = 3
        return s

    def open(self, *, via_proxy: bool = True) -> Any:
        from atomic_checkpoint import CheckpointManager, KeepLast, SingleProcessCoordinator

        return CheckpointManager(
            self._storage(via_proxy=via_proxy),
            retention=KeepLast(KEEP),
            coordinator=SingleProcessCoordinator(),
            timeout_s=30,
            run_id=self.run_id,
        )

    def next_step(self) -> int:
        self.step += 1
        return self.step

    # -------------------------------------------------------------- operations
    def _op(self, op: str, mgr: Any, step: int) -> tuple[BaseException | None, Any]:
        """Runs ``op``; returns (the save's or start's error, the manager to close)."""
        if op in ("save", "save-mpu"):
            elems = LARGE if op == "save-mpu" else SMALL
            try:
                mgr.save(step, state(step, elems))
                mgr.wait()  # and its rotation
            except BaseException as exc:
                return exc, mgr
            return None, mgr
        if op == "start":
            try:
                started = self.open()
            except BaseException as exc:
                return exc, None
            try:
                started.close()  # the lock's release, still under the fault
            except BaseException as exc:
                return exc, None
            return None, None
        raise ValueError(op)

    def _setup(self) -> Any | None:
        """The next start (unfaulted): sweeps what the previous trial left, then the
        leak check; a save that failed before is retried (stuck if it fails). After a
        trial that ended well and left nothing, its manager goes on (a start costs
        dozens of requests; with nothing left there is nothing for it to do)."""
        kept, self.kept = self.kept, None
        if kept is not None:
            if self.failed_step is None and not self._unaccounted(lock_held=True):
                return kept
            with contextlib.suppress(Exception):
                kept.close()
        try:
            mgr = self.open()
        except Exception as exc:
            self.tally.violate("stuck", f"{self.name}: the next start failed: {exc}")
            return None
        mgr = self._leak_check(mgr)
        if mgr is None:
            return None
        if self.failed_step is not None:
            step, self.failed_step = self.failed_step, None
            if step not in self._steps_now():
                try:
                    mgr.save(step, state(step, SMALL))
                    self.committed.add(step)
                except Exception as exc:
                    self.tally.violate(
                        "stuck", f"{self.name}: saving step {step} again after the fault: {exc}"
                    )
        return mgr

    def finish(self) -> None:
        """The next start after the last trial, with its leak check."""
        mgr = self._setup()
        if mgr is not None:
            self._close(mgr)

    def dry_run(self, op: str) -> list[str] | None:
        """Runs ``op`` without a fault; returns the kinds of its requests, in order."""
        mgr = self._setup()
        if mgr is None:
            return None
        step = self.next_step()
        if op == "start":
            self._close(mgr)
            self._leftovers()
        self.camp.proxy.reset_log()
        error, used = self._op(op, mgr, step)
        kinds = [r.kind for r in self.camp.proxy.requests]
        if used is not None:
            if error is None:
                self.kept = used
            else:
                self._close(used)
        self.tally.trials += 1
        if error is not None:
            self.tally.violate("stuck", f"{self.name}: {op} without a fault failed: {error}")
            return None
        self._judge(f"{op} (no fault)", None, step if op != "start" else None, error)
        return kinds

    def fault_trial(self, op: str, index: int, fault: str, kinds: list[str]) -> None:
        mgr = self._setup()
        if mgr is None:
            return
        step = self.next_step()
        if op == "start":
            self._close(mgr)
            self._leftovers()
        label = f"{op}: {fault} at request {index} ({kinds[index]})"
        rule = _fault_rule(fault, index, kinds[:index].count("put-create"))
        proxy = self.camp.proxy
        proxy.reset_log()
        proxy.add(rule)
        self.tally.trials += 1
        box: dict[str, Any] = {}

        def work() -> None:
            box["result"] = self._op(op, mgr, step)

        t = threading.Thread(target=work, daemon=True)
        t.start()
        t.join(OP_BOUND_S)
        if t.is_alive():
            proxy.clear()
            self.tally.violate("hangs", f"{label}: did not end within {OP_BOUND_S:g} s")
            t.join(60)
            return
        error, used = box["result"]
        if used is not None:
            if error is None:
                self.kept = used
            else:
                # Closed still under the fault (an outage goes on until the operation
                # ends): the next start must cope with what a failing close leaves.
                with contextlib.suppress(Exception):
                    used.close()
        proxy.clear()
        if rule.fired:
            self.tally.faults += 1
            hit = rule.requests[0].kind
            self.tally.count("by_request_fault", f"{hit} {fault}")
            self.tally.count("by_op", f"{op} {fault}")
        else:
            self.tally.count("missed", label)
        outcome = "ok" if error is None else f"raised {type(error).__name__}"
        self.tally.count("outcomes", f"{op}: {outcome}")
        saved = step if op != "start" else None
        self._judge(label, error, saved, error)

    def kill_trial(self, index: int, kind: str, *, land: bool, elems: int = SMALL) -> None:
        from tests.testbed.s3proxy import Rule

        mgr = self._setup()
        if mgr is None:
            return
        self._close(mgr)
        step = self.next_step()
        label = f"kill at request {index} ({kind}, {'landed' if land else 'not landed'})"
        self.tally.trials += 1
        proxy = self.camp.proxy
        args = {
            "url": self.url,
            "opts": self._opts(via_proxy=True),
            "step": step,
            "n": elems,
            "run_id": self.run_id,
        }
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            ready = proc.stdout.readline() if proc.stdout else ""
            if not ready.startswith("ready"):
                proc.kill()
                err = proc.communicate(timeout=30)[1]
                self.tally.violate("stuck", f"{label}: the worker did not start: {err[-500:]}")
                return
            rule = Rule(
                "call",
                skip=index,
                land=land,
                callback=lambda _req: os.kill(proc.pid, signal.SIGKILL),
            )
            proxy.reset_log()
            proxy.add(rule)
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out, err = proc.communicate(timeout=OP_BOUND_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=30)
            self.tally.violate("hangs", f"{label}: the worker did not end")
            return
        finally:
            proxy.clear()
        if proc.returncode == -signal.SIGKILL:
            self.tally.faults += 1
            self.tally.count("by_request_fault", f"{kind} kill")
            self.tally.count("by_op", f"kill {'landed' if land else 'cut'}")
        elif proc.returncode == 0 and "saved" in out:
            self.tally.count("missed", label)
        else:
            self.tally.violate("stuck", f"{label}: the worker failed: {err[-500:]}")
        # A killed save may or may not have committed: neither is an error; its step
        # must be whole if it is there, and the older ones must be.
        self._judge(label, None, None, None)

    # -------------------------------------------------------------- checks
    def _close(self, mgr: Any) -> None:
        try:
            mgr.close()
        except Exception as exc:
            self.tally.violate("stuck", f"{self.name}: close() without a fault failed: {exc}")

    def _leftovers(self) -> None:
        """What crashed saves leave: an attempt never committed (with a multipart upload
        its writer never finished), a stale attempt beside the newest committed step."""
        from atomic_checkpoint.layout import new_attempt_token
        from atomic_checkpoint.strategies import MarkerStrategy

        s = self.direct
        crashed = self.next_step()
        for step in (crashed, max(self.committed, default=crashed)):
            pending = MarkerStrategy().prepare(s, step, new_attempt_token())
            s.write_bytes_atomic(f"{pending}/rank-00000.safetensors", b"x" * 1000)
            if step == crashed:
                self.camp.server.boto3_client().create_multipart_upload(
                    Bucket=BUCKET, Key=f"{self.name}/{pending}/rank-00001.safetensors"
                )

    def _owed(self) -> list[int]:
        """Retention keeps the newest KEEP; older ones may go (or stay, if a rotation
        failed): only the newest are owed."""
        return sorted(self.committed)[-KEEP:]

    def _steps_now(self) -> set[int]:
        from atomic_checkpoint import catalog

        return {
            e.step for e in catalog.scan(self.direct) if e.status == "ok" and e.step is not None
        }

    def _judge(
        self, label: str, error: BaseException | None, saved: int | None, raised: Any
    ) -> None:
        from atomic_checkpoint import catalog
        from atomic_checkpoint.layout import checkpoint_name
        from atomic_checkpoint.serialization import load_state

        tally = self.tally
        if saved is not None and error is None:
            self.committed.add(saved)  # the newest KEEP are owed, this one included
        owed = self._owed()
        present: set[int] = set()
        for e in catalog.scan(self.direct):
            if e.status == "corrupt":
                tally.violate("torn", f"{label}: {e.name}: {e.problem}")
                continue
            if e.status != "ok" or e.step is None or e.manifest is None:
                continue
            try:
                catalog.validate(self.direct, checkpoint_name(e.step), e.manifest, full=True)
                [entry] = [f for f in e.manifest.files if f.path.endswith("rank-00000.safetensors")]
                with self.direct.open_read(f"{checkpoint_name(e.step)}/{entry.path}") as f:
                    got = load_state(f)
            except Exception as exc:
                tally.violate("torn", f"{label}: {e.name} does not verify: {exc}")
                continue
            n = int(np.asarray(got["w"]).size)
            want = state(e.step, n)
            if int(got["step"]) != e.step or not np.array_equal(np.asarray(got["w"]), want["w"]):
                tally.violate("torn", f"{label}: {e.name} restores another state")
                continue
            present.add(e.step)
        for step in owed:
            if step not in present:
                tally.violate("lost", f"{label}: step {step} (committed before) is gone")
        if saved is not None:
            if error is None and saved not in present:
                tally.violate("split", f"{label}: save({saved}) returned, but it is not there")
            elif error is not None and saved in present:
                tally.violate("split", f"{label}: save({saved}) raised {error!r}, but it committed")
            if error is not None and saved not in present:
                self.failed_step = saved
        # Steps a killed save may have committed count as committed from now on.
        self.committed |= {s for s in present if s > max(owed, default=0)}
        if error is not None:
            desc = describe_error(error)
            reason = unclear_reason(desc)
            if reason:
                tally.violate("unclear", f"{label}: {reason}")

    def _keys(self) -> tuple[list[str], list[str]]:
        client = self.camp.server.boto3_client()
        prefix = f"{self.name}/"
        keys: list[str] = []
        token: dict[str, str] = {}
        while True:
            out = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix, **token)
            keys += [o["Key"][len(prefix) :] for o in out.get("Contents", [])]
            if not out.get("IsTruncated"):
                break
            token = {"ContinuationToken": out["NextContinuationToken"]}
        uploads = client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
        return keys, [u["Key"] for u in uploads]

    def _unaccounted(self, *, lock_held: bool) -> list[str]:
        from atomic_checkpoint import catalog
        from atomic_checkpoint.layout import MANIFEST_NAME, META_DIR, checkpoint_name

        keys, uploads = self._keys()
        ok = set()
        for e in catalog.scan(self.direct):
            if e.status == "ok" and e.step is not None and e.manifest is not None:
                name = checkpoint_name(e.step)
                ok.add(f"{name}/{MANIFEST_NAME}")
                ok |= {f"{name}/{f.path}" for f in e.manifest.files}
        left = []
        for k in keys:
            if k in ok:
                continue
            if k.startswith(f"{META_DIR}/"):
                base = k.rsplit("/", 1)[1]
                if base in ("run.json", "lock.token") or base.startswith("lock.takeover-"):
                    continue  # claims are kept for an hour by design (lock.py)
                if base.startswith(PROBE_PREFIX):
                    # A probe whose delete failed: the next lock holder removes it once
                    # it is a minute old (lock.PROBE_STALE_S); counted, not a leak.
                    self.tally.count("probe_keys_left", k)
                    continue
                if lock_held and (base == "lock.json" or base.startswith("lock.lease-")):
                    continue
            left.append(k)
        return left + [f"upload {u}" for u in uploads]

    def _leak_check(self, mgr: Any) -> Any | None:
        """After the next start's sweep: what is left must go with ``clean``. Returns
        the manager to go on with (reopened if ``clean`` had to run)."""
        left = self._unaccounted(lock_held=True)
        if not left:
            return mgr
        # The sweep left something: `clean` (the CLI, as a user runs it) must remove it.
        self._close(mgr)
        self.tally.count("left_for_clean", str(len(left)))
        from atomic_checkpoint.cli import main as cli_main

        opts = self.camp.server.storage_options()
        argv = ["clean", self.url, "--json"]
        argv += [f"--storage-option={k}={json.dumps(v)}" for k, v in opts.items()]
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            rc = cli_main(argv)
        # Each leaked object counts once, in the trial after which it was first seen.
        still = [k for k in self._unaccounted(lock_held=False) if k not in self.leaked]
        self.leaked |= set(still)
        if still:
            self.tally.violate(
                "leaks", f"{self.name}: left after the next start and clean (rc {rc}): {still}"
            )
        try:
            return self.open()
        except Exception as exc:
            self.tally.violate("stuck", f"{self.name}: the start after clean failed: {exc}")
            return None


_WORKER = r"""
import json, sys
import numpy as np
from atomic_checkpoint import CheckpointManager, KeepLast, SingleProcessCoordinator
from atomic_checkpoint.storage import FsspecStorage
a = json.loads(sys.argv[1])
s = FsspecStorage(a["url"], a["opts"], block_size_bytes=5 << 20)
s.fs.retries = 3
m = CheckpointManager(s, retention=KeepLast(2), coordinator=SingleProcessCoordinator(),
                      timeout_s=30, run_id=a["run_id"])
print("ready", flush=True)
sys.stdin.readline()
step = a["step"]
m.save(step, {"step": step, "w": np.arange(a["n"], dtype=np.float32) + np.float32(step)})
m.close()
print("saved", flush=True)
"""
