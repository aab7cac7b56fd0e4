"""Fault campaigns: the real library, real processes, real faults, invariants checked
after every trial.

Each campaign module exposes ``run(size, seed, progress, workdir) -> Tally``:

- :mod:`reliability.kill`: SIGKILL a random rank (coordinator included) at a named
  fault point or at a truly random moment of save, commit or rotation; local disk,
  sshfs (two mounts: two nodes), S3 (``s3://`` on the test bed's S3 server) and
  s3fs-fuse (two mounts of the bucket).
- :mod:`reliability.iofaults`: libfiu errors (ENOSPC, EIO, EDQUOT, EROFS) on write,
  fsync, rename, open, mkdir and unlink, on one chosen rank, in each protocol phase,
  transient and persistent; on a local disk and on an s3fs-fuse mount.
- :mod:`reliability.diskfull`: real full filesystems (tmpfs, ext4 ``-m 0``, xfs).
- :mod:`reliability.hang`: a hung, a frozen (SIGSTOP) and a slow-storage rank.
- :mod:`reliability.badinput`: damaged and malicious checkpoints.
- :mod:`reliability.preemption`: real torchrun jobs preempted by SIGTERM at random
  moments (start-up, training, mid-save) and in every delivery pattern, with a grace
  period; ours against stock torchrun and the loop without start-up protection.
- :mod:`reliability.tiered`: tiered jobs (1-3 ranks as nodes, peer replicas, tier 1 a
  directory or S3): one fault (a rank or the replicator killed at any phase, a node's
  tier 0 wiped or full, the link to S3 cut or stalled), then a restart or ``drain``.

``python reliability/run.py --quick|--full`` runs them and prints the summary table;
``tests/faults/test_campaigns.py`` runs the quick size in CI.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # campaigns import tests.dist and tests.testbed
    sys.path.insert(0, REPO_ROOT)


def fresh_dir(path: str) -> str:
    """``path`` as an empty directory (what an earlier run left there is removed): a
    campaign's work directory."""
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def run_module(
    module: str, *args: str, timeout_s: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` on this checkout (its ``src/`` and root on PYTHONPATH),
    at most ``timeout_s``, its output captured as text and its exit status left to the
    caller. ``env``: the child's environment (default: this process's)."""
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO_ROOT, "src"), REPO_ROOT])
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
