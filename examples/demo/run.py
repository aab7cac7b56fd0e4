"""The atomic-checkpoint demo: a 4-process training job is killed in the middle of a
save, restarted, and resumes from the newest complete checkpoint.

    python examples/demo/run.py [--root DIR] [--keep]

What it shows, in order:
1. torchrun starts 4 ranks; they train and checkpoint every 5 steps.
2. Rank 2 is SIGKILLed in the middle of writing checkpoint 20 (a real kill, injected
   through ATOMIC_CHECKPOINT_FAULTS); torchrun tears the job down.
3. What is on disk: checkpoints 5..15 are complete; the half-written save of step 20 is
   pending data that no reader will ever see as a checkpoint.
4. The same command is run again: it resumes from step 15 and finishes.
5. An uninterrupted reference run gives bit-identical final weights.
6. `atomic-checkpoint list` shows the checkpoints that retention kept.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def banner(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def torchrun(root: str, *, fault: str | None = None, out: str | None = None) -> int:
    env = dict(os.environ)
    env.pop("ATOMIC_CHECKPOINT_FAULTS", None)
    if fault:
        env["ATOMIC_CHECKPOINT_FAULTS"] = fault
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           "--max_restarts=0", os.path.join(HERE, "train.py"), "--root", root, "--steps", "40"]
    if out:
        cmd += ["--out", out]
    t = time.monotonic()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("[train]"):
            print("  " + line, flush=True)
    print(f"  (torchrun exited with code {proc.returncode} after {time.monotonic() - t:.1f} s)",
          flush=True)
    return proc.returncode


def cli(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "atomic_checkpoint", *args],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    return proc.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", help="checkpoint directory (default: a new temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the directories afterwards")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="atomic-checkpoint-demo-")
    root = args.root or os.path.join(work, "checkpoints")
    ref_root = os.path.join(work, "reference")
    try:
        banner("1. Training with 4 processes; rank 2 will be killed while saving step 20")
        rc = torchrun(root, fault="mid_write@2=kill:20")
        if rc == 0:
            print("  the job was expected to die, but it finished", flush=True)
            return 1
        print("  the job died in the middle of a save.", flush=True)

        banner("2. What is on disk now")
        print(cli("list", root), flush=True)
        pending = os.listdir(os.path.join(root, ".pending"))
        print(f"  half-written save left in .pending/: {pending} -- never listed as a "
              "checkpoint, removed when the job restarts", flush=True)

        banner("3. Restarting the same job: it resumes from the newest complete checkpoint")
        final = os.path.join(work, "final.pt")
        if torchrun(root, out=final) != 0:
            print("  the restarted job failed", flush=True)
            return 1

        banner("4. An uninterrupted reference run, for comparison")
        ref_final = os.path.join(work, "reference.pt")
        if torchrun(ref_root, out=ref_final) != 0:
            return 1
        import torch

        a = torch.load(final, weights_only=True)
        b = torch.load(ref_final, weights_only=True)
        same = all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()
        print(f"  final weights of the killed-and-resumed run are "
              f"{'bit-identical to' if same else 'DIFFERENT from'} the uninterrupted run", flush=True)

        banner("5. The checkpoints that retention kept (last 3 + best by loss)")
        print(cli("list", root), flush=True)
        print(cli("verify", root), flush=True)
        return 0 if same else 1
    finally:
        if args.keep:
            print(f"kept {work}", flush=True)
        else:
            shutil.rmtree(work)


if __name__ == "__main__":
    sys.exit(main())
