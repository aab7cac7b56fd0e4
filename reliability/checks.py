"""The invariants of DESIGN.md, checked from outside the job after every trial.

- :func:`inspect_root` reads a root the way a resuming job would, and more strictly:
  every discoverable checkpoint must verify fully and restore bit-exactly for every
  rank (states are deterministic functions of (step, rank): ``tests.dist.workers``).
- :func:`next_start_leftovers` starts a writing manager (the "next start") and reports
  any pending or trash data that survived its start-up sweep.
- :func:`strays` lists, for any storage (an object store included), every file and
  ``checkpoint-<step>`` directory that belongs to no valid checkpoint and is not the
  run's own metadata; :func:`clean_root` runs ``atomic-checkpoint clean`` on a root.
- :func:`describe_error` turns an exception into plain data that crosses processes;
  :func:`unclear_reason` decides whether it says what failed.
"""

from __future__ import annotations

import errno as errno_mod
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from atomic_checkpoint import CheckpointManager, SingleProcessCoordinator, catalog
from atomic_checkpoint.layout import (
    MANIFEST_NAME,
    META_DIR,
    PENDING_DIR,
    TRASH_DIR,
    checkpoint_name,
    parse_checkpoint_name,
    rank_state_file,
)
from atomic_checkpoint.storage import open_storage
from atomic_checkpoint.storage.base import Storage
from atomic_checkpoint.storage.local import LocalStorage
from atomic_checkpoint.storage.temps import parse_temp_name

if TYPE_CHECKING:
    from reliability.tally import Tally

#: Error types a storage fault of each errno must map to (errors.map_os_error).
STORAGE_TYPES = {
    errno_mod.ENOSPC: "StorageFullError",
    errno_mod.EDQUOT: "StorageFullError",
    errno_mod.EROFS: "StoragePermissionError",
    errno_mod.EACCES: "StoragePermissionError",
    errno_mod.EPERM: "StoragePermissionError",
}


def expected_state(step: int, rank: int, size: int) -> Any:
    """What rank ``rank`` saved at ``step`` in every campaign (``size`` elements per
    big tensor)."""
    from tests.dist.workers import make_state

    return make_state(step, rank, n_big=2, big_elems=size)


def states_equal(a: Any, b: Any) -> bool:
    from tests.dist.workers import states_equal as eq

    return bool(eq(a, b))


# ---------------------------------------------------------------------------- errors


def describe_error(exc: BaseException) -> dict[str, Any]:
    """Plain data for one exception: type, base types, message and the attributes that
    name what failed (errno, path, missing ranks, per-rank failures)."""
    failures = [
        {"rank": f.rank, "phase": f.phase, "error_type": f.error_type, "message": f.message}
        for f in getattr(exc, "failures", ()) or ()
    ]
    missing = getattr(exc, "missing_ranks", None)
    return {
        "type": type(exc).__name__,
        "mro": [c.__name__ for c in type(exc).__mro__],
        "message": str(exc),
        "errno": getattr(exc, "errno", None),
        "path": getattr(exc, "path", None) or getattr(exc, "filename", None),
        "missing_ranks": list(missing) if missing is not None else None,
        "failures": failures,
    }


def _names_errno(text: str, code: int) -> bool:
    return f"errno {code}" in text or f"[Errno {code}]" in text


def unclear_reason(
    desc: dict[str, Any],
    *,
    errno: int | None = None,
    victim: int | None = None,
    dead: Iterable[int] = (),
    full: bool = False,
) -> str | None:
    """Why ``desc`` (from :func:`describe_error`) does not say what failed, or None.

    Args:
        errno: the errno of the injected storage fault: the error must carry it, on
            the failing rank, with the error type it maps to.
        full: the fault is a full disk: ``StorageFullError`` is right whatever the
            errno (sshfs reports a full server disk as EIO; the library then finds the
            full disk by its free space).
        victim: the rank the fault was injected on.
        dead: ranks known to be dead or stuck: a timeout must name one of them.
    """
    kind, msg, mro = desc["type"], desc["message"], desc["mro"]
    if "CheckpointError" not in mro:
        return f"{kind} is not a CheckpointError: {msg[:200]!r}"
    if len(msg) < 20:
        return f"{kind} message too short to say what failed: {msg!r}"
    if "step -1" in msg:
        return f"{kind} names a step that does not exist: {msg[:200]!r}"
    dead = set(dead)
    if kind == "CoordinationTimeoutError":
        missing = desc["missing_ranks"] or []
        if not missing:
            return f"timeout names no rank: {msg[:200]!r}"
        if any(str(r) not in msg for r in missing):
            return f"timeout message does not name ranks {missing}: {msg[:200]!r}"
        if dead and not dead & set(missing):
            return f"timeout names ranks {missing}, but rank(s) {sorted(dead)} failed"
        return None
    if "DistributedCheckpointError" in mro:  # DistributedStorageFullError too
        failures = desc["failures"]
        if not failures:
            return "distributed error lists no failing rank"
        for f in failures:
            if not f["phase"] or not f["error_type"] or len(f["message"]) < 15:
                return f"rank failure without phase/type/message: {f}"
        if errno is not None:
            mine = [f for f in failures if victim is None or f["rank"] == victim]
            if not mine:
                return f"the fault was on rank {victim}, but the error names ranks " + str(
                    [f["rank"] for f in failures]
                )
            want = STORAGE_TYPES.get(errno, "StorageError")
            if not any(_names_errno(f["message"], errno) for f in mine):
                return f"no failure of rank {victim} names errno {errno}: {failures}"
            if not any(
                f["error_type"] in (want, "StorageFullError" if full else want) for f in mine
            ):
                return f"rank {victim} failed with {[f['error_type'] for f in mine]}, not {want}"
        return None
    if "StorageError" in mro:
        if desc["errno"] is None and errno is not None:
            return f"{kind} without errno: {msg[:200]!r}"
        if errno is not None:
            if desc["errno"] != errno:
                return f"{kind} has errno {desc['errno']}, the fault was errno {errno}"
            want = STORAGE_TYPES.get(errno, "StorageError")
            if kind != want and not (full and kind == "StorageFullError"):
                return f"errno {errno} raised {kind}, not {want}"
        if not desc["path"] and "'" not in msg and "/" not in msg:
            return f"{kind} does not name a path: {msg[:200]!r}"
        return None
    if errno is not None and not _names_errno(msg, errno):
        return f"{kind} does not name errno {errno}: {msg[:200]!r}"
    return None


# ---------------------------------------------------------------------------- roots


@dataclass
class RootView:
    """What a reader finds in a root after a trial.

    Attributes:
        steps: valid checkpoints (every file verified, every rank restored exactly).
        torn: descriptions of discoverable checkpoints that are not complete or exact.
        orphans: ``checkpoint-<step>`` directories without a manifest (not
            discoverable, but they block a save of that step).
        killed_writes: ``checkpoint-<step>`` directories holding nothing but the
            library's temporary files (a marker or manifest write killed between its
            temporary file and the rename): what a kill leaves by design, which the next
            start must remove (checked by the campaigns after it).
        killed_deletes: empty ``checkpoint-<step>`` directories: what the marker
            strategy's delete leaves when it is killed between the unlink of its last
            marker and its ``rmdir`` (no order of the two closes that window). Nothing
            in them, so they block no save; the next start's sweep must remove them.
        pending: entries under ``.pending``.
        trash: entries under ``.trash``.
        run_ids: run ids of the valid checkpoints.
    """

    steps: list[int] = field(default_factory=list)
    torn: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    killed_writes: list[str] = field(default_factory=list)
    killed_deletes: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    trash: list[str] = field(default_factory=list)
    run_ids: set[str] = field(default_factory=set)

    @property
    def newest(self) -> int | None:
        return self.steps[-1] if self.steps else None


SizeOf = Callable[[int, int], int]


def inspect_root(root: str | Storage, *, world: int, size: int | SizeOf) -> RootView:
    """Everything discoverable under ``root`` (a local path, or any storage such as an
    ``FsspecStorage`` on an object store) must verify and restore bit-exactly.

    ``size``: tensor elements of every saved state, or ``size(step, rank)``.
    """
    from atomic_checkpoint.serialization import load_state

    view = RootView()
    if isinstance(root, (str, os.PathLike)):
        if not os.path.isdir(root):
            return view
        storage: Storage = LocalStorage(os.fspath(root))
    else:
        storage = root
    for e in catalog.scan(storage):
        if e.status == "corrupt":
            view.torn.append(f"{e.name}: {e.problem}")
        elif e.status == "pending":
            names = storage.listdir(e.name) if e.step is not None else []
            if names and all(parse_temp_name(n) is not None for n in names):
                view.killed_writes.append(e.name)
            else:
                view.pending.append(e.name)
        elif e.status == "foreign":
            if e.step is not None and e.problem == "no manifest":
                inside = sorted(storage.listdir(e.name))
                if inside:
                    view.orphans.append(f"{e.name} ({inside})")
                else:
                    view.killed_deletes.append(e.name)
        elif e.status == "ok" and e.manifest is not None and e.step is not None:
            problem = _check_exact(storage, e.step, e.manifest, world, size, load_state)
            if problem:
                view.torn.append(f"{e.name}: {problem}")
            else:
                view.steps.append(e.step)
                view.run_ids.add(e.manifest.run_id)
    view.trash = storage.listdir(TRASH_DIR)
    view.steps.sort()
    return view


def _check_exact(
    storage: Storage, step: int, manifest: Any, world: int, size: int | SizeOf, load_state: Any
) -> str | None:
    try:
        catalog.validate(storage, checkpoint_name(step), manifest, full=True)
    except Exception as exc:
        return f"does not verify: {exc}"
    if manifest.world_size != world:
        return f"world_size {manifest.world_size}, the job had {world}"
    paths = {f.path for f in manifest.files}
    for r in range(world):
        # The marker strategy lists files under their attempt (``attempt-<token>/...``).
        want = rank_state_file(r)
        found = [p for p in paths if p == want or p.endswith(f"/{want}")]
        if len(found) != 1:
            return f"manifest lists {len(found)} copies of {want}"
        rel = f"{checkpoint_name(step)}/{found[0]}"
        try:
            with storage.open_read(rel) as f:
                state = load_state(f)
        except Exception as exc:
            return f"rank {r} does not load: {type(exc).__name__}: {exc}"
        elems = size(step, r) if callable(size) else size
        if not states_equal(state, expected_state(step, r, elems)):
            return f"rank {r} restores a different state than it saved"
    return None


def next_start_leftovers(
    root: str, storage_options: dict[str, Any] | None = None
) -> tuple[list[str], str | None]:
    """Start a writing manager on ``root`` (one process) and close it.

    ``storage_options``: for a URL root (``s3://...``), fsspec's options.

    Returns:
        The pending and trash entries still there after its start-up sweep, and the
        error text if the start itself failed.
    """
    try:
        mgr = CheckpointManager(
            root,
            coordinator=SingleProcessCoordinator(),
            timeout_s=30,
            storage_options=storage_options,
        )
        mgr.close()
    except Exception as exc:
        return [], f"{type(exc).__name__}: {exc}"
    storage = open_storage(root, storage_options) if storage_options else LocalStorage(root)
    left = [f"{PENDING_DIR}/{n}" for n in storage.listdir(PENDING_DIR)]
    left += [f"{TRASH_DIR}/{n}" for n in storage.listdir(TRASH_DIR)]
    return left, None


#: Files of the run's metadata directory that stay between jobs by design (lock.py):
#: the run record, the last lock token, and takeover claims (kept for an hour).
_KEPT_META = ("run.json", "lock.token")
_KEPT_META_PREFIXES = ("lock.takeover-",)


def strays(storage: Storage) -> list[str]:
    """What no reader needs once no job holds ``storage``'s root: every file that is
    neither listed by the manifest of a valid checkpoint (nor that manifest itself) nor
    kept metadata, and every ``checkpoint-<step>`` directory without a valid manifest
    (on s3fs-fuse an empty directory is an object of its own). Judged from the files
    themselves, independently of the library's own idea of leftovers (markers, attempt
    directories), so what that idea misses shows up here."""
    from atomic_checkpoint.storage.fsspec import PROBE_PREFIX

    owned: set[str] = set()
    valid: set[str] = set()
    for e in catalog.scan(storage):
        if e.status == "ok" and e.step is not None and e.manifest is not None:
            name = checkpoint_name(e.step)
            valid.add(name)
            owned.add(f"{name}/{MANIFEST_NAME}")
            owned |= {f"{name}/{f.path}" for f in e.manifest.files}
    out = []
    for rel, _size in storage.walk_files(""):
        if rel in owned:
            continue
        head, _, base = rel.rpartition("/")
        if head == META_DIR and (
            base in _KEPT_META
            or base.startswith(_KEPT_META_PREFIXES)
            # A conditional-create probe whose delete failed: the next lock holder
            # removes it once it is a minute old (lock.PROBE_STALE_S).
            or base.startswith(PROBE_PREFIX)
        ):
            continue
        out.append(rel)
    for name in storage.listdir(""):
        empty = not any(r.startswith(f"{name}/") for r in out)
        if parse_checkpoint_name(name) is not None and name not in valid and empty:
            out.append(f"{name}/")
    return sorted(out)


def leaks_after_clean(
    tally: Tally,
    label: str,
    direct: Storage,
    leaked: set[str],
    root: str,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """On an object store, after the next start: every object belongs to a committed
    checkpoint or to the run's metadata (:func:`strays`); what the start left must go
    with ``atomic-checkpoint clean`` on ``root`` (run as a user would), else a ``leaks``
    violation. ``leaked`` carries the objects already reported, across trials, so each
    leaked object counts once, in the trial after which it was first seen."""
    left = strays(direct)
    if not left:
        return
    tally.count("left_for_clean", str(len(left)))
    tally.stats.setdefault("left_by_next_start", []).append(len(left))
    rc, out = clean_root(root, storage_options)
    still = [k for k in strays(direct) if k not in leaked]
    leaked.update(still)
    if still:
        tally.violate(
            "leaks",
            f"{label}: left after the next start {left}, and after clean (exit {rc}) "
            f"{still}: {out[-300:]}",
        )


def clean_root(root: str, storage_options: dict[str, Any] | None = None) -> tuple[int, str]:
    """Run ``atomic-checkpoint clean ROOT --json`` in this process, as a user would;
    returns its exit status and output."""
    import contextlib
    import io
    import json

    from atomic_checkpoint.cli import main as cli_main

    argv = ["clean", root, "--json"]
    argv += [f"--storage-option={k}={json.dumps(v)}" for k, v in (storage_options or {}).items()]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = cli_main(argv)
    return rc, out.getvalue()
