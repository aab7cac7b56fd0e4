"""The naive "stage, then rename" checkpoint schemes, kept as fixtures.

These are the shapes of code that trainers shipped and that broke on shared storage
(FAILURE_MODES A2, A3, A5, A6, D1), run here as real ranks on real mounts so the
comparison with atomic-checkpoint stays honest. One save of step ``N``, every rank::

    1. os.makedirs(ROOT/tmp-checkpoint-N, exist_ok=True)       every rank (A3)
    2. write this rank's components (model, optim), each after an
       ``os.makedirs(its directory, exist_ok=True)``:
         flat:    tmp-checkpoint-N/<part>-rank-<r>.bin
         subdirs: tmp-checkpoint-N/rank-<r>/<part>.bin         (the DeepSpeed layout)
    3. barrier
    4. publish, "main process first" (transformers 4.36, A2, A4):
         rank 0:  if os.path.exists(staging): os.rename(staging, final)
         barrier
         renamers="all":        every other rank does the same
         renamers="local-main": the first rank of every other node does it (PR #28364
                                with save_on_each_node on a shared filesystem)
    5. barrier; rotation: list ROOT, delete the oldest ``checkpoint-*`` beyond
       ``keep`` with ``shutil.rmtree`` (rotators="main": rank 0; "all": every rank)
    6. barrier

On a coherent local disk step 4 works: the others see the staging name gone and skip.
On sshfs with default caching, a node that looked the staging directory up after its
own last change inside it keeps seeing it for ~20 s after another node renamed it, so
its ``os.rename`` fails with FileNotFoundError. ``os.makedirs(d, exist_ok=True)`` looks
up the parent of ``d``: in the subdirs layout the second component's makedirs looks up
the staging directory after the rank's last change in it (files are created one level
down), so its cached entry survives the rename. In the flat layout the lookup is
followed by a file creation in the staging directory itself, which drops the entry.
That is why the flat control passes on sshfs and the DeepSpeed layout fails.

Every error is caught and recorded, and every rank still reaches every barrier, so one
run measures the failure rate of many saves instead of dying at the first one.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

_STEP_RE = re.compile(r"^checkpoint-([0-9]+)$")


@dataclass(frozen=True)
class NaiveScheme:
    """One naive variant.

    Attributes:
        name: label used in reports.
        layout: "flat" (every rank writes a file into the staging directory) or
            "subdirs" (every rank writes into its own subdirectory of it).
        renamers: who renames after rank 0: "all" or "local-main".
        rotators: who deletes old checkpoints: "main" (rank 0) or "all".
    """

    name: str
    layout: str
    renamers: str
    rotators: str


SCHEMES: dict[str, NaiveScheme] = {
    s.name: s
    for s in (
        NaiveScheme("deepspeed-layout-every-rank-renames", "subdirs", "all", "main"),
        NaiveScheme("deepspeed-layout-node-main-renames", "subdirs", "local-main", "main"),
        NaiveScheme("flat-every-rank-rotates", "flat", "all", "all"),
        NaiveScheme("flat-control", "flat", "all", "main"),
    )
}


#: The components every rank saves, one file each (model shard, optimizer shard).
PARTS = ("model", "optim")


def rank_file(checkpoint_dir: str, layout: str, rank: int, part: str) -> str:
    """Where rank ``rank`` writes component ``part`` inside a checkpoint directory."""
    if layout == "flat":
        return os.path.join(checkpoint_dir, f"{part}-rank-{rank}.bin")
    return os.path.join(checkpoint_dir, f"rank-{rank}", f"{part}.bin")


def state_bytes(step: int, rank: int, size: int) -> bytes:
    """What rank ``rank`` writes at ``step``: recognisable, so a reader can check it."""
    head = f"step={step} rank={rank};".encode()
    return (head * (size // len(head) + 1))[:size]


def describe(exc: BaseException) -> str:
    """``FileNotFoundError(ENOENT)`` style label of an error, for counting."""
    code = getattr(exc, "errno", None)
    name = errno.errorcode.get(code, str(code)) if isinstance(code, int) else None
    return f"{type(exc).__name__}({name})" if name else type(exc).__name__


def _write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _rotate(root: str, keep: int) -> None:
    steps = sorted(int(m.group(1)) for m in map(_STEP_RE.match, os.listdir(root)) if m)
    for step in steps[: max(0, len(steps) - keep)]:
        # Plain rmtree: a concurrent deleter (or a stale listing) makes it raise.
        shutil.rmtree(os.path.join(root, f"checkpoint-{step}"))


def naive_save(
    scheme: NaiveScheme,
    root: str,
    step: int,
    *,
    rank: int,
    node_first_rank: int,
    keep: int,
    size: int,
    barrier: Any,
) -> list[str]:
    """One naive save of ``step`` on this rank; returns the errors it raised here.

    Collective: every rank calls it with the same ``step``; ``barrier()`` is a
    process-group barrier. ``node_first_rank`` is the first rank on this rank's node.
    """
    errors: list[str] = []

    def attempt(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except OSError as exc:
            errors.append(describe(exc))

    staging = os.path.join(root, f"tmp-checkpoint-{step}")
    final = os.path.join(root, f"checkpoint-{step}")

    def write() -> None:
        os.makedirs(staging, exist_ok=True)
        for part in PARTS:
            # Like save_pretrained or a DCP writer, each component makes sure its
            # directory exists before writing its file.
            target = rank_file(staging, scheme.layout, rank, part)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            _write_file(target, state_bytes(step, rank, size))

    def publish() -> None:
        if os.path.exists(staging):
            os.rename(staging, final)

    attempt(write)
    barrier()
    if rank == 0:
        attempt(publish)
    barrier()
    is_renamer = rank != 0 and (
        scheme.renamers == "all" or (scheme.renamers == "local-main" and rank == node_first_rank)
    )
    if is_renamer:
        attempt(publish)
    barrier()
    if rank == 0 or scheme.rotators == "all":
        attempt(_rotate, root, keep)
    barrier()
    return errors


def w_naive(
    rank: int,
    world: int,
    roots: list[str],
    nodes: list[int],
    scheme_names: list[str],
    saves: int,
    keep: int,
    size: int,
) -> dict[str, list[list[str]]]:
    """Run every scheme for ``saves`` saves; rank ``r`` works under ``roots[r]``.

    ``nodes[r]`` is the node of rank ``r`` (its mount). Each scheme gets its own
    subdirectory ``<scheme name>/`` of the root. Returns, per scheme, this rank's errors
    of every save.
    """
    import torch.distributed as dist

    node_first_rank = nodes.index(nodes[rank])
    out: dict[str, list[list[str]]] = {}
    for name in scheme_names:
        scheme = SCHEMES[name]
        root = os.path.join(roots[rank], name)
        if rank == 0:
            os.makedirs(root)
        dist.barrier()
        out[name] = [
            naive_save(
                scheme,
                root,
                step,
                rank=rank,
                node_first_rank=node_first_rank,
                keep=keep,
                size=size,
                barrier=dist.barrier,
            )
            for step in range(1, saves + 1)
        ]
    return out
