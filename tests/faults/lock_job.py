"""A training job on a checkpoint root, driven step by step over stdin, for lock tests.

Run as ``python lock_job.py``; it imports only atomic_checkpoint (no torch), so it starts
in a fraction of a second. Each stdin line is a JSON command; each answer is one JSON
line on stdout: ``{"ok": true, ...}`` or ``{"ok": false, "error": TYPE, "message": ...}``.
Logs (INFO) go to stderr. The test decides every interleaving by when it sends
commands, so races are forced exactly, without sleeps.

Commands (``op``):
    open      ``root``, ``kwargs`` for CheckpointManager, ``gate_rotation`` (bool): the
              retention KeepLast(1) then blocks inside rotation, once armed, until
              ``open_gate``. Answers ``elapsed_s`` (constructor time) and the lock token.
    save      ``step``: a synchronous save.
    arm       arm the rotation gate for the next rotation.
    wait_gate wait until a rotation or a gated save is blocked at its gate.
    save_gated ``step``: a ``saving()`` block in a thread that writes a file, then blocks
              before leaving the block (before the commit) until ``open_gate``.
    save_publish_gated ``step``: a ``save()`` in a thread whose leader blocks after its
              last check of the lock, right before the commit strategy publishes,
              until ``open_gate``.
    save_state_gated ``step``: a ``save()`` in a thread whose leader blocks after the
              rank wrote its state file, before it checks that the file is there, until
              ``open_gate``.
    open_gate let the blocked rotation or save go on.
    join      wait for the gated save; answers its outcome as ``save``.
    rotation_error  the failure of the last rotation, as the manager recorded it.
    close     ``mgr.close()``.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from atomic_checkpoint import CheckpointManager, KeepLast

GATE_TIMEOUT_S = 30.0


class Gate:
    def __init__(self) -> None:
        self.armed = False
        self.entered = threading.Event()
        self.opened = threading.Event()

    def block(self) -> None:
        self.entered.set()
        if not self.opened.wait(GATE_TIMEOUT_S):
            raise TimeoutError("the test never opened the gate")


class GatedKeepLast:
    """KeepLast(1) whose ``keep`` blocks once armed: a rotation caught mid-way."""

    def __init__(self, gate: Gate):
        self.gate = gate
        self.inner = KeepLast(1)

    def keep(self, checkpoints: Sequence[Any]) -> frozenset[int]:
        if self.gate.armed:
            self.gate.armed = False
            self.gate.block()
        return self.inner.keep(checkpoints)


class Job:
    """One manager and the commands that drive it."""

    def __init__(self) -> None:
        self.mgr: CheckpointManager | None = None
        self.gate = Gate()
        self.saver: threading.Thread | None = None
        self.saved: dict[str, Any] = {}

    @property
    def m(self) -> CheckpointManager:
        if self.mgr is None:
            raise RuntimeError("send 'open' first")
        return self.mgr

    def op_open(self, cmd: dict[str, Any]) -> dict[str, Any]:
        kwargs = dict(cmd.get("kwargs", {}))
        if cmd.get("gate_rotation"):
            kwargs["retention"] = GatedKeepLast(self.gate)
        t = time.perf_counter()
        self.mgr = CheckpointManager(cmd["root"], **kwargs)
        elapsed = time.perf_counter() - t
        lock = self.mgr._lock
        return {"elapsed_s": elapsed, "token": lock.token if lock else None}

    def op_save(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return {"step": self.m.save(cmd["step"], {"step": cmd["step"]}).step}

    def op_arm(self, cmd: dict[str, Any]) -> dict[str, Any]:
        # The previous save's rotation runs in the background: let it finish first, or
        # it would be the one caught by the gate (and the next save would wait for it).
        thread = self.m._rotation
        if thread is not None:
            thread.join(GATE_TIMEOUT_S)
        self.gate.armed = True
        return {}

    def op_wait_gate(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return {"entered": self.gate.entered.wait(GATE_TIMEOUT_S)}

    def op_open_gate(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.gate.opened.set()
        return {}

    def _save_in_thread(self, save: Any) -> dict[str, Any]:
        """Run ``save()`` in a thread; ``join`` answers its outcome."""

        def body() -> None:
            try:
                save()
                self.saved = {"ok": True}
            except Exception as exc:
                self.saved = {"ok": False, "error": type(exc).__name__, "message": str(exc)}

        self.saver = threading.Thread(target=body)
        self.saver.start()
        return {}

    def op_save_gated(self, cmd: dict[str, Any]) -> dict[str, Any]:
        step, mgr = cmd["step"], self.m

        def save() -> None:
            with mgr.saving(step) as d:
                (d / "weights.bin").write_bytes(b"w" * 1000)
                self.gate.block()

        return self._save_in_thread(save)

    def op_save_publish_gated(self, cmd: dict[str, Any]) -> dict[str, Any]:
        step, strategy = cmd["step"], self.m.strategy
        real = strategy.publish

        def gated(*args: Any, **kwargs: Any) -> Any:
            del strategy.publish  # the class's method again
            self.gate.block()
            return real(*args, **kwargs)

        strategy.publish = gated  # type: ignore[method-assign]
        return self._save_in_thread(lambda: self.m.save(step, {"step": step}))

    def op_save_state_gated(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from atomic_checkpoint import commit

        step, mgr, real = cmd["step"], self.m, commit._await_files

        def gated(*args: Any, **kwargs: Any) -> None:
            commit._await_files = real
            self.gate.block()
            real(*args, **kwargs)

        commit._await_files = gated
        return self._save_in_thread(lambda: mgr.save(step, {"step": step}))

    def op_join(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if self.saver is not None:
            self.saver.join(GATE_TIMEOUT_S)
        return {"save": self.saved}

    def op_rotation_error(self, cmd: dict[str, Any]) -> dict[str, Any]:
        thread = self.m._rotation
        if thread is not None:
            thread.join(GATE_TIMEOUT_S)
        err = self.m._rotation_error
        return {"error": type(err).__name__ if err else None, "message": str(err or "")}

    def op_close(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.m.close()
        return {}


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
    job = Job()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        try:
            reply = {"ok": True, **getattr(job, f"op_{cmd['op']}")(cmd)}
        except Exception as exc:
            reply = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
