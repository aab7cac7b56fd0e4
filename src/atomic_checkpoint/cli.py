"""The ``atomic-checkpoint`` command line: list, verify, clean, inspect, prune, adopt, drain.

Also runs as ``python -m atomic_checkpoint``. Every command takes ROOT, a checkpoint
root directory (local, NFS, sshfs, Lustre or any other mounted filesystem; a
``file://`` URL is accepted) or an object-store URL such as ``s3://bucket/prefix``
(credentials and endpoint from the environment, ``AWS_ENDPOINT_URL`` included, or
``--storage-option KEY=VALUE``)::

    atomic-checkpoint list ROOT [--json] [--all-runs] [--tier ROOT2 ...]
    atomic-checkpoint verify ROOT [STEP] [--json] [--quiet] [--progress | --no-progress]
                            [--tier ROOT2 ...]
    atomic-checkpoint clean ROOT [--dry-run] [--force] [--json]
    atomic-checkpoint inspect ROOT STEP [--json] [--tier ROOT2 ...]
    atomic-checkpoint prune ROOT [--keep-last N] [--keep-best K [--metric NAME]
                            [--mode min|max]] [--keep-every K] [--pin STEP ...]
                            [--run-id RUN] [--progress | --no-progress]
                            [--dry-run] [--force] [--json]
    atomic-checkpoint adopt ROOT [STEP ...] [--framework NAME] [--run-id RUN]
                            [--dry-run] [--json]
    atomic-checkpoint drain ROOT --to PERSISTENT [--to-storage-option KEY=VALUE]
                            [--timeout S] [--missing-ok] [--json]

``drain`` finishes a tiered job's replication (``tiered.py``) after the job ended:
every step committed on ROOT (the fast tier) that PERSISTENT lacks is copied, verified
as it is read and once it arrived, and committed there; it never deletes. It takes
ROOT's run lock (exit 3 while the job is alive), exits 1 when a step cannot be
replicated (ROOT's copy is corrupt), 2 when PERSISTENT did not answer within
``--timeout`` (the steps stay on ROOT). ``--missing-ok``: a ROOT that does not exist
(the job ended before its first save on this node) is nothing to drain, exit 0
(``"root_missing": true``, else false). A multi-node job's ROOT holds one node's ranks
only: under torchrun (``WORLD_SIZE`` > 1), one ``drain`` process per node drains every
node's copy together, as the job's replicators would. ``--json``: ``{"schema_version", "command":
"drain", "root", "to", "run_id", "root_missing", "replicated": [{"step", "size_bytes", "seconds"}],
"failed": [{"step", "problem"}], "left": [step, ...], "not_copied_below_newest": [step,
...], "ok": bool}``; ``not_copied_below_newest``: ROOT's steps that PERSISTENT lacks below
its newest step (its retention removed them), which drain never copies back. ``list --tier
ROOT2`` and ``verify --tier ROOT2`` (repeatable) also read the run's other tiers: their
document gets ``tiers`` (the URLs, ROOT first: the index of each is a tier number), each
``list`` entry gets ``tiers`` (indexes, 0 = ROOT) and a step held only elsewhere gets a
row of its own; ``verify`` checks every copy on every tier, each result with ``tier``
(status ``differs``: a copy on another tier whose files' checksums are not ROOT's copy's,
so not a replica of it; shown as ANOTHER COPY);
``inspect`` says each tier's copy of STEP (``tiers``: ``[{"tier", "url", "status",
"problem"}]``, status ok, missing, corrupt or foreign) and shows another tier's copy
when ROOT has none (``root`` stays ROOT, ``path`` is the copy shown, and ROOT's copy is
``missing`` in ``tiers``).

``list``, ``verify`` and ``inspect`` only read: they take no lock and are safe while a
job trains and saves into ROOT. ``clean`` and ``prune`` delete, and refuse while a live
job holds the run lock on ROOT (``--force`` overrides, with a warning); their
``--dry-run`` changes nothing and never refuses. ``adopt`` records the complete
checkpoint folders a framework wrote without this library (``adopt.py``) under the run
lock (exit 3 while a live job holds it), never moves or deletes anything, and exits 1
if any folder asked for (by default every one found) is refused as incomplete.

``list`` shows the entries of ROOT that are not checkpoints and not named like one (the
Trainer's ``save_model()`` files, logs) on one line; ``--json`` lists each. On a
Lightning ``ModelCheckpoint`` directory, ``list`` shows its ``.ckpt`` files by recorded
step and ``verify ROOT`` verifies them, both through their sidecar manifests (a file
without one cannot be verified); ``prune`` refuses it (``save_top_k`` manages them).

The run whose checkpoints are "ours" is the one recorded in
``ROOT/.atomic-checkpoint/run.json``. Checkpoints of other runs are shown as
``foreign``; ``verify ROOT`` verifies them too (each named with its run), and they are
never deleted. A root without a recorded run (written by hand, or its run file was
removed) is read as if every run were ours; ``prune`` then prunes the one run whose
checkpoints are there, and needs ``--run-id`` only when they are of several runs.
``clean --force`` also removes the run lock: the way to free a root whose job is
known to be dead before its lease runs out (a job that is alive after all is fenced:
it can no longer commit or delete).

Exit status:
    0  success. ``list`` exits 0 even when some entries are corrupt: it is
       informational; use ``verify`` in scripts.
    1  a problem was found: a checkpoint failed verification (its files differ from
       its manifest, or a state file's header is one ``restore`` rejects: a malformed
       safetensors header, absurd shapes), the requested step is
       not a valid checkpoint, nothing was there to verify, or a delete failed (also
       internal errors, which are bugs: ``-vv`` shows their traceback). For
       ``verify ROOT`` every ``checkpoint-<step>`` entry of ROOT counts: one with no
       readable manifest (a torn copy, another tool's directory, a symbolic link, a
       crashed object-store save) fails it too, unless it is a save in progress of the
       live job holding the run lock. So ``verify ROOT --quiet && upload ROOT`` never
       uploads a ``checkpoint-<step>`` that is not a complete, verified checkpoint,
       another run's (``foreign``) included.
    2  usage or environment error: bad arguments, ROOT missing or not a directory,
       ROOT unreadable, a storage error, no answer within ``--timeout S`` (every
       command but ``drain`` takes it: give up after S seconds, for a store that may
       stop answering), a prune with no recorded run, no
       ``--run-id`` and checkpoints of several runs, or ``--keep-best`` on a metric that
       no checkpoint records (a ROOT with no checkpoint has nothing to prune: 0).
    3  refused: a live job holds the run lock on ROOT (``clean``, ``prune``, ``adopt``,
       ``drain``; ``drain`` also when one holds PERSISTENT's).
    130 interrupted (Ctrl-C).

Errors print one line on stderr, ``atomic-checkpoint: error: <what, where, why, what
to do>``, never a traceback (``-vv`` adds one for internal errors).

JSON output (``--json``) goes to stdout as one document and is stable: keys are only
ever added, never renamed or removed, and ``schema_version`` is bumped if a meaning
changes. Sizes are integers in bytes, times are unix seconds (floats), problems are
strings or null. A size or time that is not known is null: ``size_bytes`` of a
``list``/``verify`` entry whose manifest cannot be read (a Lightning file without its
manifest, a ``checkpoint-<step>`` that is not a checkpoint), and ``adopt --dry-run``'s
per-checkpoint ``seconds`` (nothing was recorded). ``problem`` is null for ``ok``
entries, except a Lightning ``last.ckpt`` link (``save_last="link"``), status ``ok`` and
``problem`` "a link to <its target>". Every ``--json`` command that got as far as
reading ROOT prints its document, also when it then exits 1 (a step that is not there:
``verify ROOT STEP`` and ``inspect ROOT STEP`` say so in it). One that an error stops
before it has its document (ROOT missing or unreadable, the run lock held by a live job,
the storage failing, ``--timeout``) prints ``{"schema_version", "command", "root",
"error": {"type", "message", "exit_code"}}`` instead (``type``: ``LockHeldError`` for
exit 3, ``UsageError`` for bad arguments (``root`` is then null, and ``command`` too if
it is the command that is wrong), else the error's class: ``CliError`` for the command's
own checks, e.g. a missing ROOT, or the library's, e.g. ``StorageError``; ``message``:
the error line, as printed on stderr).
``list --json``::

    {"schema_version": 1, "command": "list", "root": "/ckpt/run1",
     "run_id": "run-20240501-120000-1a2b3c4d",
     "entries": [
      {"name": "checkpoint-200", "step": 200, "status": "ok", "problem": null,
       "run_id": "run-20240501-120000-1a2b3c4d", "created_unix": 1714564800.25,
       "size_bytes": 1048712, "metrics": {"eval_loss": 0.31}, "commit_seq": 2,
       "path": "/ckpt/run1/checkpoint-200", "adopted": false},
      {"name": ".pending/checkpoint-300.5f0c9e2a1b3d4c6e", "step": 300,
       "status": "pending", "problem": "not committed", "run_id": null,
       "created_unix": null, "size_bytes": 524288, "metrics": {}, "commit_seq": null,
       "path": "/ckpt/run1/.pending/checkpoint-300.5f0c9e2a1b3d4c6e", "adopted": false}]}

The top-level ``run_id`` is the run ROOT's run file records (null if none), also with
``--all-runs``, which only widens what is listed or verified.
``status`` is ``ok``, ``corrupt``, ``pending`` or ``foreign``; ``list`` checks presence and
sizes only (``verify`` reads the data and the state files' headers). The other documents:

- ``verify``: ``{"schema_version", "command": "verify", "root", "run_id", "ok": bool,
  "checkpoints": [{"name", "step", "status": "ok" | "corrupt" | "error" |
  "not_a_checkpoint" | "differs" | "missing", "problem", "run_id", "size_bytes",
  "verified_bytes", "seconds"}],
  "skipped": [{"name", "step", "status", "problem", "in_progress": bool}]}``; ``error``
  means the files could not be read (permissions, I/O), not that they differ;
  ``not_a_checkpoint`` is a ``checkpoint-<step>`` entry with no readable manifest
  (``problem`` says which case; also a file by that name); ``missing``: ``verify ROOT
  STEP`` of a step ROOT has no entry for. ``in_progress`` is true for a save of the live lock
  holder, the one manifest-less ``checkpoint-<step>`` that does not fail ``verify``. A
  checkpoint that the job owning ROOT un-commits while it is verified (retention,
  rollback) is listed in ``skipped`` with status ``removed`` and does not fail
  ``verify ROOT`` (``verify ROOT STEP`` of that step fails with ``error``).
- ``clean``: ``{"schema_version", "command": "clean", "root", "dry_run", "forced",
  "lock": <lock> | null, "lock_removed": bool, "restored": [{"name", "copy", "from"}],
  "removed": [{"name", "kind": "pending" | "trash" | "stale" | "upload" | "temporary" |
  "empty", "size_bytes"}], "failed": [{"name", "kind", "size_bytes", "problem"}],
  "freed_bytes"}``; with ``--dry-run`` "removed" lists what would be removed.
  ``restored``: steps an overwrite interrupted between its two renames had left absent,
  put back first (``copy``: "new" or "old", ``from``: the folder it was put back from).
  ``name`` is what is removed: an entry of ``.pending/`` or ``.trash/``, an uncommitted
  ``checkpoint-<step>``, or, beside a committed manifest (``stale``, ``temporary``), the
  attempt, marker or temporary file itself (``checkpoint-<step>/<file>``), one item each.
  ``empty``: an empty ``checkpoint-<step>`` directory (what a delete cut short after
  its last file leaves; it holds nothing, so nothing is lost).
  ``temporary``: a temporary file of an atomic write whose writer is gone. With marker
  commits (object stores) an uncommitted ``checkpoint-<step>`` is ``pending``,
  and the attempts and markers a crash left beside a committed one are ``stale``. On
  S3, an unfinished multipart upload under ROOT/ that ``clean`` aborted is ``upload``
  (``size_bytes`` 0: unknown); none is aborted while a live job holds the lock.
- ``inspect``: ``{"schema_version", "command": "inspect", "root", "name", "path",
  "status": "ok" | "corrupt" | "error" | "foreign" | "not_a_checkpoint" | "missing",
  "problem", "manifest": {"step", "run_id",
  "commit_seq", "created_unix", "world_size", "state_kind", "strategy",
  "checksum_algorithm", "schema_version", "library_version", "size_bytes", "metrics",
  "metadata", "domain_count", "domain_ranks", "adopted"} | null, "files": [{"path",
  "size_bytes", "checksum", "rank", "tensors": [{"name", "dtype", "shape"}] | null,
  "problem"}]}``. ``tensors`` is null for files that are not ``.safetensors`` or whose
  header cannot be read (``problem`` says why); ``manifest`` is null (and ``files``
  empty) when the manifest itself is unreadable, and for ``not_a_checkpoint`` (an entry
  by that name without a manifest: a directory never committed, a file) and ``missing``
  (no such entry). ``corrupt`` also covers a state file whose header ``restore``
  rejects (its ``problem`` says which file); ``error``: its files could not be read
  (the storage failed: permissions, I/O, a 503), not that they differ (exit 2).
  ``domain_count`` > 1 (node-local storage): this copy holds the files of the ranks
  in ``domain_ranks`` only; otherwise ``domain_ranks`` is null.
- ``prune``: ``{"schema_version", "command": "prune", "root", "run_id" (null: no run
  recorded and no checkpoint), "policy",
  "dry_run", "forced", "lock": <lock> | null, "checkpoints": [{"name", "step",
  "size_bytes", "created_unix", "metrics", "kept": bool, "reason", "deleted": bool}],
  "failed": [{"name", "step", "problem"}], "skipped": [{"name", "step", "status",
  "problem"}], "freed_bytes", "warnings": [str, ...]}``. ``warnings``: what was also
  printed on stderr as a warning, e.g. a ``--pin`` STEP that names no committed
  checkpoint of the run (it pins nothing).
- ``adopt``: ``{"schema_version", "command": "adopt", "root", "run_id", "dry_run",
  "adopted": [{"step", "framework", "size_bytes", "seconds"}], "already": [step, ...],
  "refused": [{"step", "problem"}], "seconds", "problem"}`` (the top-level ``problem``:
  why it exits non-zero, the error line; null when it exits 0; printed also when it
  fails half way, e.g. on a full disk: what it did before); ``inspect`` and ``list`` entries say
  ``"adopted": true`` for checkpoints recorded this way.
- ``<lock>`` is the holder of ``ROOT/.atomic-checkpoint/lock.json``: ``{"run_id",
  "host", "pid", "token", "acquired_unix", "renewed_unix", "expires_unix", "is_live"}``
  (``is_live`` false: the holder is provably gone, its process dead or its lease
  expired; the fields other than ``is_live`` are null for an unreadable lock file).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import signal
import sys
import textwrap
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TextIO

from . import _early, catalog, layout
from ._process import HOST_ENV, current_host
from ._version import __version__
from .adopt import AdoptResult
from .coordination import gather_summary
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LockError,
    LockHeldError,
    StorageError,
    StorageFullError,
)
from .layout import (
    CHECKPOINT_PREFIX,
    LIGHTNING_DEPTH,
    LIGHTNING_MANIFEST_SUFFIX,
    MANIFEST_NAME,
    META_DIR,
    OWN_DIRS,
    RUN_FILE,
    TRASH_DIR,
    checkpoint_name,
    parse_checkpoint_name,
    parse_sibling_pending,
    validate_step,
)
from .lock import without_takeover_advice
from .manifest import CheckpointInfo, Manifest, format_size
from .storage import is_url, local_root, open_storage, posix
from .storage.base import Storage, answer_within
from .storage.local import refuse_dangling_root
from .storage.temps import abandoned_temps, parse_temp_name
from .strategies import (
    CommitStrategy,
    Leftover,
    MarkerStrategy,
    RenameStrategy,
    choose_strategy,
    recover_replaced,
)

__all__ = ["EXIT_LOCKED", "EXIT_OK", "EXIT_PROBLEM", "EXIT_USAGE", "main"]

PROG = "atomic-checkpoint"
JSON_SCHEMA_VERSION = 1
EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_LOCKED = 3
EXIT_INTERRUPTED = 130

# The progress bar appears on its own (stderr a terminal) only for checkpoints that
# take noticeably long to hash; --progress shows it for every checkpoint.
_AUTO_PROGRESS_MIN_BYTES = 32 << 20

log = logging.getLogger("atomic_checkpoint")

_EPILOG = """\
examples:
  atomic-checkpoint list /ckpt/run1                 table of every entry under the root
  atomic-checkpoint list /ckpt/run1 --json | jq '.entries[] | select(.status != "ok")'
  atomic-checkpoint verify /ckpt/run1               full checksum check; exit 1 if corrupt
  atomic-checkpoint verify /ckpt/run1 4000 --quiet && upload /ckpt/run1/checkpoint-4000
  atomic-checkpoint inspect /ckpt/run1 4000         manifest, files, tensor shapes
  atomic-checkpoint clean /ckpt/run1 --dry-run      what crashed saves left behind
  atomic-checkpoint prune /ckpt/run1 --keep-last 3 --keep-best 1 --metric eval_loss --dry-run
  atomic-checkpoint drain /local/run1 --to s3://bucket/run1   finish a tiered job's replication

exit status: 0 ok, 1 problem found, 2 usage or environment error,
             3 refused because a live job holds the run lock, 130 interrupted.
list, verify and inspect never write and are safe while a job is saving.
"""


class CliError(Exception):
    """A failure the command line reports as one line and an exit status."""

    def __init__(self, message: str, code: int = EXIT_PROBLEM):
        super().__init__(message)
        self.code = code


class _RootMissing(CliError):
    """ROOT does not exist (a directory never created, an empty object-store prefix):
    exit 2 for every command; ``drain --missing-ok`` takes ``open()`` as an empty fast
    tier instead (nothing is opened unless it asks)."""

    def __init__(self, message: str, open_root: Callable[[], Storage]):
        super().__init__(message, EXIT_USAGE)
        self.open = open_root


def _error_line(message: str) -> None:
    # One line, whatever the message holds: scripts grep stderr line by line.
    text = " ".join(str(message).split())
    sys.stderr.write(_visible(f"{PROG}: error: {text}\n"))
    sys.stderr.flush()


def _warn(message: str) -> None:
    sys.stderr.write(_visible(f"{PROG}: warning: {' '.join(message.split())}\n"))
    sys.stderr.flush()


#: Control characters but newline and tab (C0, DEL, C1): never written as they are.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _visible(text: str) -> str:
    """``text`` with each control character written as ``\\uXXXX``: names, run ids,
    metric names and tensor names come from files anyone may have written, and ESC
    sequences in them reached the terminal (retitled it, cleared it). The escape is
    also valid inside a JSON string, so ``--json`` output stays JSON."""
    return _CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


class _VisibleStream:
    """A text stream that writes what it is given through ``_visible`` (stdout, for
    the duration of a command)."""

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(_visible(text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _VisibleFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return _visible(super().format(record))


# ---------------------------------------------------------------------- formatting
def _human_bytes(n: float | None) -> str:
    return "-" if n is None else format_size(n)


def _local_time(t: float | None) -> str:
    if t is None or not math.isfinite(t):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _metrics_text(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in metrics.items()) or "-"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, cell in enumerate(cells):
            last = i == len(cells) - 1
            if i in right:
                out.append(cell.rjust(widths[i]))
            else:
                out.append(cell if last else cell.ljust(widths[i]))
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def _short_problem(storage: Storage, name: str, problem: str | None) -> str | None:
    """Drop the ``<path of the checkpoint>: `` prefix catalog puts on its messages: a
    table row already names the checkpoint."""
    if problem is None:
        return None
    prefix = f"{storage.url(name)}: "
    return problem[len(prefix) :] if problem.startswith(prefix) else problem


#: Whether the running command printed its JSON document (``_failed``; a command run
#: under ``--timeout`` prints from another thread).
_EMITTED = {"done": False}


def _emit_json(doc: dict[str, Any]) -> None:
    _EMITTED["done"] = True
    _write_out(json.dumps(doc, indent=1, allow_nan=False) + "\n")


def _error_type(exc: BaseException, code: int) -> str:
    """The public name of what stopped a command: ``LockHeldError`` for every refusal
    of exit 3, whichever check made it; else the class of ``exc``."""
    if code == EXIT_LOCKED:
        return LockHeldError.__name__
    return next(c.__name__ for c in type(exc).__mro__ if not c.__name__.startswith("_"))


def _failed(args: argparse.Namespace, exc: BaseException, message: str, code: int) -> int:
    """A command stopped by an error: the error line on stderr and, with ``--json``,
    when the command printed no document of its own, the error document on stdout (a
    script reads one document whatever happened)."""
    _error_line(message)
    if getattr(args, "json", False):
        _emit_error_doc(args, _error_type(exc, code), message, code)
    return code


def _usage_failed(args: argparse.Namespace | None, code: int) -> int:
    """A usage error (``_Parser.error`` printed its line): with ``--json``, its error
    document too. ``args``: None when the arguments could not be parsed at all."""
    if _USAGE_ERROR:
        _emit_error_doc(args, "UsageError", _USAGE_ERROR["message"], code)
    return code


def _emit_error_doc(args: argparse.Namespace | None, kind: str, message: str, code: int) -> None:
    """The error document, unless the command printed its own document already."""
    if _EMITTED["done"]:
        return
    root = getattr(args, "root", None)
    command = getattr(args, "command", None) if args is not None else _USAGE_ERROR["command"]
    doc = {
        "schema_version": 1,
        "command": command,
        "root": root if isinstance(root, str) else None,
        "error": {"type": kind, "message": " ".join(message.split()), "exit_code": code},
    }
    with contextlib.suppress(OSError, ValueError):
        _emit_json(doc)


_OUT_PIECE = 1 << 16


def _write_out(text: str) -> None:
    """Write ``text`` to stdout in pieces of 64 KiB, flushing each. One large write to a
    pipe whose reader goes away (``list --json | head``) is taken in part by the kernel,
    and CPython's buffered writer then reports it as written: the command would exit 0
    with its output cut. Written in pieces, the next piece raises BrokenPipeError, and
    ``main`` exits 1 quietly."""
    for i in range(0, len(text), _OUT_PIECE):
        sys.stdout.write(text[i : i + _OUT_PIECE])
        sys.stdout.flush()


# ---------------------------------------------------------------------- the root
#: Storage options that are always strings (credentials, names): a secret of digits
#: only must not become a number because it parses as JSON.
_STRING_OPTIONS = frozenset(
    {"key", "secret", "token", "username", "password", "profile", "endpoint_url", "region_name"}
)


def _storage_options(pairs: Sequence[str] | None) -> dict[str, Any]:
    """``--storage-option KEY=VALUE`` pairs; a VALUE that parses as JSON is that value
    (``anon=true``, ``client_kwargs={"endpoint_url": "http://..."}``), else a string;
    credentials and names (``_STRING_OPTIONS``) are always the string given."""
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise CliError(
                f"--storage-option {pair!r}: expected KEY=VALUE, e.g. "
                'client_kwargs=\'{"endpoint_url": "http://127.0.0.1:9000"}\'',
                EXIT_USAGE,
            )
        if key in _STRING_OPTIONS:
            quoted = len(value) >= 2 and value[0] == value[-1] == '"'
            try:
                out[key] = json.loads(value) if quoted else value  # '"123"' still works
            except ValueError:
                out[key] = value
            continue
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _open_root(text: str, options: Sequence[str] | None = None) -> Storage:
    """The storage of ROOT, or a CliError (exit 2) saying why it cannot be read."""
    if is_url(text):
        return _open_url_root(text, _storage_options(options))
    if options:
        raise CliError(
            "--storage-option applies to URL roots (s3://, gs://, ...), not to a directory "
            "(for a URL --tier, pass --tier-storage-option)",
            EXIT_USAGE,
        )
    if not text.removeprefix("file://"):
        raise CliError("ROOT is empty: pass the checkpoint root directory", EXIT_USAGE)
    path = _local_path(text)
    try:
        refuse_dangling_root(path)
    except CheckpointNotFoundError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    if not posix.lexists(path):
        raise _RootMissing(
            f"checkpoint root {path!r} does not exist (check the path, and that its "
            "filesystem is mounted)",
            lambda: open_storage(path),
        )
    if not posix.is_dir(path):
        raise CliError(
            f"checkpoint root {path!r} is not a directory: pass the directory that holds "
            "checkpoint-<step>/ entries",
            EXIT_USAGE,
        )
    if not posix.is_accessible(path):
        raise CliError(f"checkpoint root {path!r} is not readable by this user", EXIT_USAGE)
    # Capabilities from the mount table, as the manager gets them (s3fs-fuse: marker).
    return open_storage(path)


def _refuse_one_checkpoint(storage: Storage, command: str) -> None:
    """Exit 2 for a ROOT that is one checkpoint (it holds a manifest at its top): a
    command that changes a root found "nothing to prune" there, exit 0."""
    if storage.size(MANIFEST_NAME) is not None:
        parent = catalog.plain_path(storage.url("")).rstrip("/").rpartition("/")[0]
        raise CliError(
            f"{storage.url()} is one checkpoint (it holds {MANIFEST_NAME}), not a "
            f"checkpoint root: `{command}` works on the directory that holds the "
            f"checkpoint-<step> entries ({parent or '..'})",
            EXIT_USAGE,
        )


def _local_path(text: str) -> str:
    """``local_root`` of a local ROOT (``~``, relative, trailing slashes, ``file://``
    escapes), or a CliError (exit 2) for one that names no local path."""
    try:
        return local_root(text)
    except (ValueError, CheckpointNotFoundError) as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


def _open_url_root(url: str, options: dict[str, Any]) -> Storage:
    """An object-store root (``s3://bucket/prefix``, any fsspec URL). Credentials and
    endpoints come from the usual environment (``AWS_*``, ``AWS_ENDPOINT_URL``) or
    ``--storage-option``. An empty prefix is "does not exist": object stores have no
    directories, so nothing else tells a typo from an empty root."""
    try:
        storage = open_storage(url, options or None)
        names = storage.listdir("")
    except CheckpointError as exc:
        raise CliError(f"cannot read checkpoint root {url}: {exc}", EXIT_USAGE) from None
    if not names:
        raise _RootMissing(
            f"checkpoint root {url} holds nothing (check the bucket and prefix, and the "
            "endpoint and credentials: AWS_ENDPOINT_URL, or --storage-option)",
            lambda: storage,
        )
    return storage


def _run_id_for_reading(storage: Storage) -> str | None:
    """The recorded run, or None (every run) with a warning if the run file is bad."""
    try:
        return catalog.recorded_run_id(storage)
    except CheckpointError as exc:
        _warn(f"{exc}; showing the checkpoints of every run")
        return None


def _tree_size(storage: Storage, rel: str) -> int:
    """Bytes under ``rel`` without following symlinks (a link is its own size)."""
    local = storage.local_path(rel)
    if local is None:
        total = sum(size for _, size in storage.walk_files(rel))
        # An object (a marker, a temporary manifest) has nothing under its name: it is
        # its own size, as a file is on a filesystem (clean said "would free 0 B").
        return total or (storage.size(rel) or 0)
    return posix.tree_size(local)


# ---------------------------------------------------------------------- the run lock
class _UnreadableLock:
    """Stands for a lock file that exists but does not parse: a job may be creating it
    right now, so it counts as live until it is older than a lease (as a manager's
    start judges it); on an object store, where its age is not known, always."""

    run_id = host = pid = acquired_unix = renewed_unix = lease_s = token = None

    def __init__(self, age_s: float | None):
        self.age_s = age_s

    def is_live(self) -> bool:
        from .lock import DEFAULT_LEASE_S

        # Live for ever, a 2-day-old torn lock made prune and clean refuse (exit 3)
        # with "it frees itself when its lease expires", and a manager took it over.
        return self.age_s is None or self.age_s <= DEFAULT_LEASE_S

    def describe(self) -> str:
        age = "" if self.age_s is None else f", last written {self.age_s:.0f} s ago"
        return f"an unreadable lock file (not a lock document: torn by a crash{age})"


def _lock_holder(storage: Storage) -> Any | None:
    """Who holds the run lock on ROOT (live or not), or None when nobody does."""
    from .lock import LOCK_FILE, read_lock_holder

    try:
        return read_lock_holder(storage)
    except LockError:
        local = storage.local_path(LOCK_FILE)
        modified = None if local is None else posix.mtime(local)
        return _UnreadableLock(None if modified is None else time.time() - modified)


def _lock_doc(holder: Any | None) -> dict[str, Any] | None:
    if holder is None:
        return None
    renewed, lease = holder.renewed_unix, holder.lease_s
    return {
        "run_id": holder.run_id,
        "host": holder.host,
        "pid": holder.pid,
        "token": holder.token,
        "acquired_unix": holder.acquired_unix,
        "renewed_unix": renewed,
        "expires_unix": None if renewed is None or lease is None else renewed + lease,
        "is_live": holder.is_live(),
    }


def _check_lock(storage: Storage, what: str, *, force: bool, dry_run: bool) -> Any | None:
    """Refuse (exit 3) while a live job holds the run lock, unless forced or dry-run.

    Returns the holder (live or not), or None when the lock is free.
    """
    holder = _lock_holder(storage)
    if holder is None:
        return None
    if not holder.is_live():
        log.info(
            "the run lock on %s is held by %s, which is gone", storage.url(), holder.describe()
        )
        return holder
    who = holder.describe()
    if dry_run:
        _warn(
            f"this is a dry run, but {what} without --dry-run would refuse: {who} holds "
            f"the run lock on {storage.url()}"
        )
        return holder
    if not force:
        here = current_host()
        elsewhere = (
            f" It ran on host {holder.host!r}, and this is {here!r}: only there can its "
            f"process be seen to be gone (run this there, or set {HOST_ENV}={holder.host} if "
            "this is that node under another name)."
            if getattr(holder, "host", here) != here
            else ""
        )
        raise CliError(
            f"refusing to {what} {storage.url()}: the run lock is held by {who}, which may "
            f"be saving right now.{elsewhere} Stop that job first (a dead job's lock frees "
            "itself when its lease expires), or pass --force once you are sure it is gone",
            EXIT_LOCKED,
        )
    _warn(
        f"--force: going ahead with {what} on {storage.url()} although the run lock is held "
        f"by {who}; if that job is alive, it loses the run lock for good: the save or "
        "deletion it has in progress fails, and so does every later one (FencedError). "
        "Restart it to go on (it resumes from its newest checkpoint)"
    )
    return holder


def _lock_unchanged(storage: Storage, seen: Any, before: str, what: str = "clean") -> None:
    """Raise (exit 3) if the run lock changed hands since ``what`` started: a job that
    started meanwhile may be saving into what is about to be removed."""
    now = _lock_holder(storage)
    if now is None or (isinstance(now, _UnreadableLock) and isinstance(seen, _UnreadableLock)):
        return
    generation = getattr(now, "generation", None)
    if generation is not None and generation == getattr(seen, "generation", None):
        return
    raise CliError(
        f"stopped before {storage.url(before)}: {now.describe()} took the run lock on "
        f"{storage.url()} while {what} was running, and may be saving there. Nothing of "
        f"that job was touched; run {what} again once it has finished",
        EXIT_LOCKED,
    )


def _break_lock(storage: Storage, holder: Any) -> bool:
    """Remove the lock file ``holder`` was read from, if it is still that holder's
    (``clean --force``: the documented way to free a root whose job is dead). The old
    holder, if it is alive after all, is fenced: it can no longer commit or delete."""
    from .lock import LOCK_FILE

    current = _lock_holder(storage)
    if current is None:
        return False
    if getattr(current, "generation", None) != getattr(holder, "generation", None):
        _warn(f"the run lock changed hands meanwhile ({current.describe()}): left in place")
        return False
    storage.delete_file(LOCK_FILE)
    _warn(f"--force: removed the run lock {storage.url(LOCK_FILE)} held by {holder.describe()}")
    return True


# ---------------------------------------------------------------------- list
def _entry_doc(storage: Storage, e: catalog.Entry) -> dict[str, Any]:
    m = e.manifest
    size: int | None
    if m is not None:
        size = m.size_bytes
    elif e.status == "pending":
        size = _tree_size(storage, e.name)
    else:
        size = None
    return {
        "name": e.name,
        "step": e.step,
        "status": e.status,
        "problem": _short_problem(storage, e.name, e.problem),
        "run_id": m.run_id if m is not None else None,
        "created_unix": m.created_unix if m is not None else None,
        "size_bytes": size,
        "metrics": dict(m.metrics) if m is not None else {},
        "commit_seq": m.commit_seq if m is not None else None,
        "path": storage.url(e.name),
        "adopted": bool(m is not None and m.adopted),
    }


def _on_disk(storage: Storage, name: str) -> str:
    """``name`` as it is under ROOT: Accelerate's project view names
    ``checkpoints/checkpoint_<i>`` ``checkpoint-<i>``; what the text output shows is
    what ``ls`` and ``rm`` find (the JSON documents keep the protocol's names, and each
    entry's ``path``)."""
    real = getattr(storage, "real", None)
    return real(name) if callable(real) else name


def _is_other_entry(d: dict[str, Any]) -> bool:
    """An entry of ROOT that is neither a checkpoint nor named like one (the Trainer's
    ``save_model()`` files, logs, a README): shown as one line by ``list``. Entries
    named like checkpoints (``checkpoint-<step>`` torn copies, links and other runs',
    ``checkpoint-007``, Accelerate's ``checkpoint_<i>``, Lightning's ``.ckpt`` files)
    keep their own rows."""
    name = d["name"]
    return (
        d["status"] == "foreign"
        and d["step"] is None
        and "/" not in name
        and not name.startswith("checkpoint")
        and not name.endswith(".ckpt")
    )


def _others_row(others: list[dict[str, Any]], n_columns: int) -> list[str]:
    names = sorted(d["name"] for d in others)
    shown = ", ".join(names[:6]) + (f", ... ({len(names) - 6} more)" if len(names) > 6 else "")
    row = [f"({len(names)} other entries)", "-", "-", "-", "-"]
    row += ["-"] * (n_columns - 6)
    return [*row, f"foreign: not checkpoints, left alone: {shown}"]


def _open_tier(text: str, options: Sequence[str] | None = None) -> Storage:
    """Another tier of ROOT's run (``--tier``): a directory that must exist, or a URL
    (credentials from the environment or ``--tier-storage-option``) that may still be
    empty: a persistent tier nothing reached yet."""
    if is_url(text):
        return _open_target(text, options)
    return _open_root(text)


def _tier_docs(args: argparse.Namespace, run_id: str | None) -> list[tuple[Storage, dict]]:
    """Each ``--tier``'s storage and its valid checkpoints of the run, by step."""
    out: list[tuple[Storage, dict[int, dict[str, Any]]]] = []
    for text in getattr(args, "tier", None) or ():
        st = _open_tier(text, getattr(args, "tier_storage_option", None))
        docs = {
            e.step: _entry_doc(st, e)
            for e in catalog.scan(st, run_id=run_id)
            if e.status == "ok" and e.step is not None and "/" not in e.name
        }
        out.append((st, docs))
    return out


def _add_tiers(docs: list[dict[str, Any]], tiers: list[tuple[Storage, dict]]) -> None:
    """``tiers`` of each entry: the tiers holding a valid copy of its step (0: ROOT, then
    each ``--tier`` in order); steps valid only on other tiers get an entry of their own
    (the first such tier's), sorted in among ROOT's by step."""
    on_root = {d["step"] for d in docs if d["status"] == "ok" and d["step"] is not None}
    for d in docs:
        if d["status"] != "ok" or d["step"] is None or "/" in d["name"]:
            d["tiers"] = []
            continue
        d["tiers"] = [0] + [i + 1 for i, (_st, held) in enumerate(tiers) if d["step"] in held]
    extra: dict[int, dict[str, Any]] = {}
    for i, (_st, held) in enumerate(tiers):
        for step, d in held.items():
            if step in on_root:
                continue
            extra.setdefault(step, {**d, "tiers": []})["tiers"].append(i + 1)
    docs.extend(extra.values())
    docs.sort(key=lambda d: (d["step"] is None, d["step"] or 0))


def cmd_list(args: argparse.Namespace) -> int:
    storage = _open_root(args.root, args.storage_option)
    single = None if args.tier else _as_checkpoint_dir(storage, args.storage_option)
    if single is not None:
        # ROOT is one checkpoint directory (a copy of one): listed as its parent lists
        # it, not as a root whose manifest file is a foreign entry.
        storage, only = single
        run_id = recorded = None
        found = [e for e in catalog.scan(storage, run_id=None) if e.name == only]
        docs = [_entry_doc(storage, e) for e in found]
    else:
        # The document names the recorded run also with --all-runs, which only widens
        # what is listed.
        recorded = _run_id_for_reading(storage)
        run_id = None if args.all_runs else recorded
        docs = [_entry_doc(storage, e) for e in catalog.scan(storage, run_id=run_id)]
    lightning = _lightning_list_docs(storage) if single is None else []
    if lightning:
        # A Lightning ModelCheckpoint directory: each .ckpt through its sidecar manifest
        # (the sidecars are part of their files, not entries of their own).
        docs = [
            d
            for d in docs
            if not d["name"].endswith((".ckpt", ".ckpt.manifest.json"))
            and _lightning_leftover(d["name"]) is None
            and d["name"] not in _lightning_folders([x["name"] for x in lightning])
        ]
        docs = sorted(docs + lightning, key=lambda d: (d["step"] is None, d["step"] or 0))
    for d in docs:
        sibling = _sibling_pending_problem(d["name"]) if d["status"] == "foreign" else None
        if sibling is not None:
            # Ours (a path-style DCP save's), not a foreign entry.
            d["status"], d["problem"] = "pending", sibling
            d["size_bytes"] = _tree_size(storage, d["name"])
    tiers = _tier_docs(args, run_id)
    if tiers:
        _add_tiers(docs, tiers)
    if args.json:
        _emit_json(
            {
                "schema_version": JSON_SCHEMA_VERSION,
                "command": "list",
                "root": storage.url(),
                "run_id": recorded,
                "entries": docs,
                **({"tiers": [storage.url()] + [st.url() for st, _ in tiers]} if tiers else {}),
            }
        )
        return EXIT_OK
    if not docs:
        print(f"{storage.url()}: no checkpoints, pending saves or other entries")
        return EXIT_OK
    headers = ["NAME", "STEP", "COMMITTED", "SIZE", "METRICS", "STATUS"]
    if args.all_runs:
        headers.insert(5, "RUN")
    if tiers:
        headers.insert(len(headers) - 1, "TIERS")
    rows = []
    others = [d for d in docs if _is_other_entry(d)]
    for d in docs:
        if _is_other_entry(d):
            continue
        status = d["status"] + (" (adopted)" if d["adopted"] else "")
        if d["problem"] is not None:
            status = f"{status}: {d['problem']}"
            if d["problem"] == catalog.NO_MANIFEST and d["name"].endswith(".ckpt"):
                status += (
                    f" (written by Lightning's own plugin: `{PROG} adopt ROOT --framework "
                    "lightning` checks it and makes it verifiable)"
                )
            elif d["problem"] == catalog.NO_MANIFEST and "/" not in d["name"]:
                status += f" (`{PROG} adopt ROOT --dry-run` tells whether it is complete)"
        row = [
            _on_disk(storage, d["name"]),
            "-" if d["step"] is None else str(d["step"]),
            _local_time(d["created_unix"]),
            _human_bytes(d["size_bytes"]),
            _metrics_text(d["metrics"]),
            status,
        ]
        if args.all_runs:
            row.insert(5, d["run_id"] or "-")
        if tiers:
            row.insert(len(row) - 1, ",".join(map(str, d["tiers"])) or "-")
        rows.append(row)
    if others:
        rows.append(_others_row(others, len(headers)))
    _write_out(_table(headers, rows, right={1, 3}) + "\n")
    counts: dict[str, int] = {}
    for d in docs:
        counts[d["status"]] = counts.get(d["status"], 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    print(f"\n{storage.url()}: {summary}" + (f" (run {run_id})" if run_id else ""))
    for i, (st, held) in enumerate(tiers):
        print(f"tier {i + 1}: {st.url()}: {len(held)} ok")
    return EXIT_OK


# ---------------------------------------------------------------------- verify
class _Progress:
    """Progress of one checkpoint's verification on stderr: a redrawn bar on a
    terminal, else (``--progress`` into a file or pipe) a line every second."""

    def __init__(self, stream: TextIO, label: str, total: int, *, tty: bool):
        self.stream, self.label, self.total, self.tty = stream, label, total, tty
        self.t0 = time.monotonic()
        self.last = -math.inf
        self.done = 0
        self.drawn = False

    def rate(self) -> float:
        elapsed = time.monotonic() - self.t0
        return self.done / elapsed if elapsed > 0 else 0.0

    def __call__(self, done: int) -> None:
        self.done = done
        now = time.monotonic()
        if now - self.last < (0.1 if self.tty else 1.0):
            return
        self.last = now
        frac = min(1.0, done / self.total) if self.total else 1.0
        counts = f"{_human_bytes(done)} / {_human_bytes(self.total)}"
        speed = f"{_human_bytes(self.rate())}/s"
        if self.tty:
            bar = "#" * int(frac * 30)
            self.stream.write(
                f"\r{self.label} [{bar:<30}] {frac * 100:5.1f}%  {counts}  {speed}\x1b[K"
            )
        else:
            self.stream.write(f"{self.label}: {frac * 100:5.1f}%  {counts}  {speed}\n")
        self.drawn = True
        self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            if self.drawn:
                self.stream.write("\r\x1b[K")  # erase the bar; the result line follows
        else:
            elapsed = time.monotonic() - self.t0
            self.stream.write(
                f"{self.label}: verified {_human_bytes(self.done)} in {elapsed:.2f} s "
                f"({_human_bytes(self.rate())}/s)\n"
            )
        self.stream.flush()


def _progress_option(p: argparse.ArgumentParser, what: str = "") -> None:
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"progress {what + ' ' if what else ''}with bytes/s on stderr (default: a bar "
        "when stderr is a terminal, for checkpoints of "
        f"{_human_bytes(_AUTO_PROGRESS_MIN_BYTES)} or more)",
    )


def _progress_for(args: argparse.Namespace, label: str, total: int) -> _Progress | None:
    tty = sys.stderr.isatty()
    if args.progress is False:
        return None
    if args.progress is None and not (tty and total >= _AUTO_PROGRESS_MIN_BYTES):
        return None
    return _Progress(sys.stderr, label, total, tty=tty)


def _as_checkpoint_dir(
    storage: Storage, options: Sequence[str] | None = None
) -> tuple[Storage, str] | None:
    """(storage of its parent, its name) if ROOT is itself a checkpoint directory (a
    manifest at its top, and no root of its own); else None. A URL too
    (``s3://bucket/run/checkpoint-30``: the copy an upload made), opened with
    ``options``."""
    local = storage.local_path("")
    if local is None:
        if storage.size(MANIFEST_NAME) is None or storage.size(RUN_FILE) is not None:
            return None
        parent, _, name = storage.url("").rstrip("/").rpartition("/")
        if not name or parent.endswith(":/"):
            return None  # a bucket itself
        return open_storage(parent, _storage_options(options) or None), name
    if posix.lexists(os.path.join(local, META_DIR)):
        return None
    if not posix.is_file(os.path.join(local, MANIFEST_NAME)):
        return None
    parent, name = os.path.split(local.rstrip("/"))
    if not name:
        return None
    return open_storage(parent), name


def _verify_one(
    storage: Storage, name: str, manifest: Manifest, args: argparse.Namespace
) -> dict[str, Any]:
    progress = _progress_for(args, name, manifest.size_bytes)
    verified = [0]

    def on_progress(done: int) -> None:
        verified[0] = done
        if progress is not None:
            progress(done)

    t0 = time.monotonic()
    status, problem = "ok", None
    try:
        # A step saved again while it is verified reads as corrupt if its new files are
        # checked against the manifest listed before: verify the copy that is there.
        manifest = catalog.validate_consistent(
            storage, name, manifest, full=True, progress=on_progress
        )
    except CheckpointNotFoundError as exc:  # un-committed meanwhile: gone, not corrupt
        status, problem = "removed", f"removed while being verified: {exc}"
    except CorruptCheckpointError as exc:
        status, problem = "corrupt", str(exc)
    except CheckpointError as exc:  # unreadable (permissions, I/O): not proven corrupt
        status, problem = "error", str(exc)
    finally:
        if progress is not None:
            progress.finish()
    seconds = time.monotonic() - t0
    return {
        "name": name,
        "step": manifest.step,
        "status": status,
        "problem": _short_problem(storage, name, problem),
        "run_id": manifest.run_id,
        "size_bytes": manifest.size_bytes,
        "verified_bytes": verified[0],
        "seconds": seconds,
    }


def _skip_fields(r: dict[str, Any]) -> dict[str, Any]:
    return {k: r[k] for k in ("name", "step", "status", "problem")}


def _broken(storage: Storage, e: catalog.Entry) -> dict[str, Any]:
    return {
        "name": e.name,
        "step": e.step,
        "status": "corrupt",
        "problem": _short_problem(storage, e.name, e.problem),
        "run_id": e.manifest.run_id if e.manifest is not None else None,
        "size_bytes": e.manifest.size_bytes if e.manifest is not None else None,
        "verified_bytes": 0,
        "seconds": 0.0,
    }


def _looks_like_checkpoint(e: catalog.Entry) -> bool:
    """A ``checkpoint-<step>`` name in ROOT itself (what ``restore``, retention and a
    script that uploads ``ROOT/checkpoint-*`` look at) with no manifest that could be
    read: no manifest at all, an uncommitted marker attempt, or a symbolic link.
    Another run's checkpoints (a manifest, another run id) are not in question."""
    return e.step is not None and "/" not in e.name and e.manifest is None


def _held_live(storage: Storage, holder: list[Any]) -> bool:
    """Whether a live job holds ROOT's run lock; ``holder`` caches the holder, read
    once per command and only if asked."""
    if not holder:
        holder.append(_lock_holder(storage))
    return holder[0] is not None and holder[0].is_live()


def _no_manifest_verdict(storage: Storage, e: catalog.Entry, holder: list[Any]) -> str | None:
    """Why ``e`` (see ``_looks_like_checkpoint``) fails ``verify``; ``"in_progress"`` for
    the one case that does not fail, a marker save or delete of the live job that holds
    the run lock; None when the directory went away since the listing.

    Saves through ``.pending/`` (atomic directory rename) never show a
    ``checkpoint-<step>`` without a manifest, not even for an instant: one rename
    brings in the directory with its manifest, and rotation renames it out whole. So
    on such a root a manifest-less ``checkpoint-<step>`` is always something else: a
    torn copy, a save of another tool, a manifest deleted by hand. Only marker commits
    (object stores, s3fs-style mounts) stage in place, behind a marker.
    """
    if e.status == "pending":
        if _held_live(storage, holder):
            return "in_progress"
        return (
            f"{e.problem} and no live job holds the run lock: the "
            f"leftover of a crashed save or delete; restore ignores it, `{PROG} clean` "
            "removes it"
        )
    if e.problem == catalog.NO_MANIFEST:
        try:
            if not storage.is_dir(e.name):
                return None
            empty = not storage.listdir(e.name)
        except CheckpointError:
            empty = False
        if empty and _held_live(storage, holder):
            # A marker save creates checkpoint-<step>/, then its marker in it (on a
            # mounted object store the gap is a round trip): an empty one while a job
            # holds the lock is that job's save starting.
            return "in_progress"
        return (
            "no manifest: never committed by this library (a torn copy, another tool's "
            "save, or a manifest deleted); restore ignores it. If it is another tool's "
            f"(a stock Trainer, Accelerate, DCP), `{PROG} adopt ROOT --dry-run` tells "
            f"whether it is complete and `{PROG} adopt ROOT` adopts it; otherwise copy the "
            "complete checkpoint again, or remove it"
        )
    return _short_problem(storage, e.name, e.problem) or "not a checkpoint"


def _single_target(storage: Storage, step: int) -> catalog.Entry:
    """The catalog entry of ``checkpoint-<step>``: status "ok" (its manifest read),
    "corrupt" (a manifest that cannot be read), "not_a_checkpoint" (an entry by that
    name without one: a directory never committed, a file) or "missing" (no such
    entry); ``problem`` says why in the last three cases."""
    name = checkpoint_name(step)
    try:
        manifest = catalog.read_manifest(storage, name)
    except CheckpointNotFoundError:
        problem = str(catalog.missing_step_error(storage, step))
        there = catalog.entry_present(storage, name)
        return catalog.Entry(name, step, "not_a_checkpoint" if there else "missing", None, problem)
    except CheckpointError as exc:
        return catalog.Entry(name, step, "corrupt", problem=str(exc))
    return catalog.Entry(name, step, "ok", manifest)


def _one_checkpoint_step(storage: Storage, single: tuple[Storage, str], step: int) -> Storage:
    """The parent of ROOT, which is one checkpoint directory (``single``: see
    ``_as_checkpoint_dir``), when STEP is that checkpoint's step; else a CliError (exit
    2) saying that ROOT is one checkpoint of another step."""
    parent, name = single
    own = parse_checkpoint_name(name)
    if own == step:
        return parent
    if own is None:
        try:
            own = catalog.read_manifest(parent, name).step
        except CheckpointError:
            own = None
    which = f"of step {own}" if own is not None else "whose step cannot be read"
    raise CliError(
        f"{storage.url()} is one checkpoint ({name}, {which}), not a checkpoint root, so "
        f"it holds no step {step}: pass it without STEP, or pass the directory that holds "
        f"checkpoint-{step} ({catalog.plain_path(parent.url(''))})",
        EXIT_USAGE,
    )


def _lightning_names(storage: Storage) -> list[str]:
    """The ``.ckpt`` entries at the top of a mounted ROOT: a Lightning
    ``ModelCheckpoint`` directory, whose files ``AtomicCheckpointIO`` makes verifiable
    through a sidecar manifest each (``<name>.manifest.json``)."""
    if storage.local_path("") is None:
        return []
    top = storage.listdir("")
    names = [n for n in top if n.endswith(".ckpt") and "/" not in n]
    # A "/" in a ModelCheckpoint filename (a metric logged as "val/loss" in
    # "{epoch}-{step}-{val/loss:.3f}") puts its files in sub-folders, as far down as
    # latest_checkpoint looks: those with a sidecar manifest count. Folders of a
    # CheckpointManager root (checkpoints, the library's own) are not entered.
    level = [n for n in top if _may_hold_lightning_files(storage, n)]
    for depth in range(LIGHTNING_DEPTH):
        below = []
        for folder in level:
            for n in storage.listdir(folder):
                rel = f"{folder}/{n}"
                if n.endswith(".ckpt"):
                    if storage.size(rel + LIGHTNING_MANIFEST_SUFFIX) is not None:
                        names.append(rel)
                elif depth + 1 < LIGHTNING_DEPTH and _may_hold_lightning_files(storage, rel):
                    below.append(rel)
        level = below
    return sorted(names)


def _may_hold_lightning_files(storage: Storage, rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return (
        not name.startswith((".", CHECKPOINT_PREFIX, "checkpoint_"))
        and name not in OWN_DIRS
        and storage.is_dir(rel)
        and not posix.is_link(storage.local_path(rel) or rel)
    )


def _lightning_folders(names: Sequence[str]) -> set[str]:
    """The top folders of ROOT that the Lightning files ``names`` lie in."""
    return {n.split("/", 1)[0] for n in names if "/" in n}


def _verify_lightning(storage: Storage, name: str, *, full: bool = True) -> dict[str, Any]:
    """Verify one ``.ckpt`` of a Lightning directory against its sidecar manifest
    (``integrations.lightning.verify_checkpoint``: size, then with ``full`` the whole
    checksum). A link (``save_last="link"``) is verified through its target, which must
    be a file of ROOT: nothing outside ROOT is read (DESIGN invariant 9)."""
    root = posix.real_path(storage.local_path("") or ".")
    path = storage.local_path(name) or name
    doc: dict[str, Any] = {
        "name": name,
        "step": None,
        "status": "ok",
        "problem": None,
        "run_id": None,
        "size_bytes": None,
        "verified_bytes": 0,
        "seconds": 0.0,
        "created_unix": None,
        "adopted": False,
        "link_to": None,
    }
    target = path
    if posix.is_link(path):
        target = posix.real_path(path)
        if os.path.dirname(target) != root or not target.endswith(".ckpt"):
            return {
                **doc,
                "status": "not_a_checkpoint",
                "problem": f"a symbolic link to {target}, which is not a .ckpt file of this "
                "directory: not read (links are followed only to a checkpoint of ROOT)",
            }
        doc["link_to"] = os.path.basename(target)
    if posix.is_dir(target):
        return {
            **doc,
            "status": "not_a_checkpoint",
            "problem": "a directory (a sharded checkpoint): AtomicCheckpointIO writes single "
            "files, so there is no manifest to verify it against",
        }
    try:
        from .integrations.lightning import verify_checkpoint
    except ImportError as exc:
        return {**doc, "status": "error", "problem": f"cannot verify .ckpt files: {exc}"}
    sidecar = target + LIGHTNING_MANIFEST_SUFFIX
    if posix.is_link(sidecar) or not posix.is_file(sidecar):
        what = "is a symbolic link (not read)" if posix.is_link(sidecar) else "is missing"
        return {
            **doc,
            "status": "not_a_checkpoint",
            "problem": f"its manifest {os.path.basename(sidecar)} {what}: written without "
            "AtomicCheckpointIO, or torn, so it cannot be verified",
        }
    t0 = time.monotonic()
    try:
        info = verify_checkpoint(target, full=full, require_manifest=True)
    except CheckpointNotFoundError as exc:
        return {**doc, "status": "removed", "problem": f"removed while being verified: {exc}"}
    except CorruptCheckpointError as exc:
        return {**doc, "status": "corrupt", "problem": str(exc)}
    except CheckpointError as exc:
        return {**doc, "status": "error", "problem": str(exc)}
    return {
        **doc,
        "step": info.global_step,
        "size_bytes": info.size_bytes,
        "verified_bytes": info.size_bytes if full else 0,
        "seconds": time.monotonic() - t0,
        "created_unix": info.written_unix,
        "adopted": info.adopted,
    }


def _doomed_siblings(storage: Storage) -> list[str]:
    """The pending siblings (``layout.sibling_pending_name``) at the top of a mounted
    ROOT whose final name exists: saves killed before their rename, which can never
    commit now."""
    if storage.local_path("") is None:
        return []
    names = storage.listdir("")
    # Directories only: a Lightning .ckpt's pending file sits beside a last.ckpt that
    # every save replaces, so it may be a save in progress.
    return sorted(
        n
        for n in names
        if (final := parse_sibling_pending(n)) is not None
        and final in names
        and storage.is_dir(n)
        and not final.endswith(".ckpt")
    )


def _sibling_pending_problem(name: str) -> str | None:
    """What ``list`` says of a pending sibling left beside a path-style checkpoint."""
    final = parse_sibling_pending(name)
    if final is None:
        return None
    return (
        f"a save of {final} in progress, or killed before its rename: never loaded; removed "
        f"once a save of {final} commits (`{PROG} clean` removes it once {final} exists)"
    )


def _lightning_leftover(name: str) -> str | None:
    """The ``.ckpt`` file that ``name``, an entry of a Lightning directory, is being
    written for (``AtomicCheckpointIO``'s pending sibling, or its sidecar manifest's
    temporary file), else None."""
    final = parse_sibling_pending(name)
    if final is None:
        temp = parse_temp_name(name)
        final = temp.final.removesuffix(LIGHTNING_MANIFEST_SUFFIX) if temp is not None else None
    return final if final is not None and final.endswith(".ckpt") else None


def _lightning_list_docs(storage: Storage) -> list[dict[str, Any]]:
    """``list``'s entries for the ``.ckpt`` files of a Lightning ``ModelCheckpoint``
    directory: step, time and size from each file's sidecar manifest, the size checked
    (``verify`` reads the checksums); a file without one (Lightning's own plugin wrote
    it) is foreign until adopted."""
    docs = []
    for name in _lightning_names(storage):
        r = _verify_lightning(storage, name, full=False)
        status, problem = r["status"], r["problem"]
        if status == "not_a_checkpoint" and problem is not None and "missing" in problem:
            status, problem = "foreign", catalog.NO_MANIFEST
        elif status == "not_a_checkpoint":
            status = "foreign"
        elif status == "removed":
            continue  # deleted by ModelCheckpoint (save_top_k) since the listing
        if r["link_to"] is not None and status == "ok":
            problem = f"a link to {r['link_to']}"
        docs.append(
            {
                "name": name,
                "step": r["step"],
                "status": status,
                "problem": problem,
                "run_id": None,
                "created_unix": r["created_unix"],
                "size_bytes": r["size_bytes"],
                "metrics": {},
                "commit_seq": None,
                "path": storage.url(name),
                "adopted": r["adopted"],
            }
        )
    for name in storage.listdir("") if storage.local_path("") is not None else []:
        final = _lightning_leftover(name)
        if final is None:
            continue
        # A save in progress, or one a crash cut short (the .ckpt keeps its previous
        # content): "pending", as in a CheckpointManager root, not a foreign entry.
        docs.append(
            {
                "name": name,
                "step": None,
                "status": "pending",
                "problem": (
                    f"a save of {final} in progress, or cut short by a crash: never loaded; "
                    "the next save into this directory removes it"
                ),
                "run_id": None,
                "created_unix": None,
                "size_bytes": _tree_size(storage, name),
                "metrics": {},
                "commit_seq": None,
                "path": storage.url(name),
                "adopted": False,
            }
        )
    return docs


def cmd_verify(args: argparse.Namespace) -> int:
    storage = _open_root(args.root, args.storage_option)
    recorded = _run_id_for_reading(storage)
    run_id = None if args.all_runs else recorded
    results: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []

    def report(r: dict[str, Any], n_files: int) -> None:
        if r["status"] == "removed":
            if args.step is None:
                # Un-committed by the job that owns ROOT (retention, rollback) while it
                # was read: a checkpoint that is gone, not a failed one. Verifying a live
                # job's root must not fail because the job rotates.
                skipped.append({**_skip_fields(r), "in_progress": False})
                if not args.json and not args.quiet:
                    print(
                        f"{r['name']}: removed while being verified (retention or rollback "
                        "of the job that owns ROOT): skipped",
                        flush=True,
                    )
                return
            r = {**r, "status": "error"}  # the step asked for is gone
        results.append(r)
        if args.json:
            return
        shown = _on_disk(storage, r["name"])
        name = shown if not r.get("tier") else f"{shown} (tier {r['tier']})"
        if run_id and r.get("run_id") not in (None, run_id):
            name = f"{name} (run {r['run_id']})"
        if r["status"] == "ok":
            if not args.quiet:
                rate = r["size_bytes"] / r["seconds"] if r["seconds"] > 0 else 0.0
                print(
                    f"{name}: ok ({_human_bytes(r['size_bytes'])} in {n_files} file(s), "
                    f"{r['seconds']:.2f} s, {_human_bytes(rate)}/s)",
                    flush=True,
                )
        else:
            word = {
                "corrupt": "CORRUPT",
                "not_a_checkpoint": "NOT A CHECKPOINT",
                "differs": "ANOTHER COPY",
            }.get(r["status"], "ERROR")
            print(f"{name}: {word}: {r['problem']}", flush=True)

    impostors: list[dict[str, Any]] = []
    lightning = _lightning_names(storage) if args.step is None else []
    single = None if args.tier else _as_checkpoint_dir(storage, args.storage_option)
    if single is not None and args.step is not None:
        # ROOT/checkpoint-N N: that checkpoint, as `verify ROOT/checkpoint-N` reads it.
        _one_checkpoint_step(storage, single, args.step)
    if single is not None:
        # ROOT is one checkpoint directory (a path-style DCP save's checkpoint_id, or
        # checkpoint-<step> itself): verified against its own manifest.
        parent, name = single
        try:
            manifest = catalog.read_manifest(parent, name)
        except CheckpointError as exc:
            problem = f"{storage.url()}: {exc}"
            if args.json:
                gone = catalog.Entry(name, parse_checkpoint_name(name), "corrupt", None, problem)
                _emit_verify_json(storage, recorded, [_broken(parent, gone)], [])
            raise CliError(problem) from exc
        report(_verify_one(parent, name, manifest, args), len(manifest.files))
        targets = []
    elif args.step is not None:
        target = _single_target(storage, args.step)
        if target.status in ("missing", "not_a_checkpoint"):
            # No checkpoint there: the document says so (status "missing" or
            # "not_a_checkpoint"), and the error line as ever.
            if args.json:
                r = {**_broken(storage, target), "status": target.status}
                _emit_verify_json(storage, recorded, [r], [])
            raise CliError(str(target.problem))
        targets = [target]
    else:
        targets = []
        holder: list[Any] = []  # the run lock's holder, read once and only if needed
        for e in catalog.scan(storage, run_id=run_id):
            if e.status in ("ok", "corrupt"):
                targets.append(e)
                continue
            if lightning and (
                e.name.endswith((".ckpt", ".ckpt.manifest.json"))
                or e.name in _lightning_folders(lightning)
            ):
                continue  # verified below, through the sidecar manifests
            named = parse_checkpoint_name(e.name) is not None
            if e.status == "foreign" and e.manifest is not None and named:
                # Another run's checkpoint in ROOT: verified too, since every
                # `checkpoint-<step>` of ROOT counts (`verify ROOT && upload ROOT`
                # must not upload a corrupt one because another run wrote it).
                targets.append(e)
                continue
            in_progress = False
            if _looks_like_checkpoint(e):
                verdict = _no_manifest_verdict(storage, e, holder)
                if verdict is None:
                    continue  # un-committed and removed since the listing: gone
                if verdict != "in_progress":
                    impostors.append(
                        {**_broken(storage, e), "status": "not_a_checkpoint", "problem": verdict}
                    )
                    continue
                in_progress = True
            skipped.append(
                {
                    "name": e.name,
                    "step": e.step,
                    "status": e.status,
                    "problem": _short_problem(storage, e.name, e.problem),
                    "in_progress": in_progress,
                }
            )

    def verify_entry(e: catalog.Entry) -> None:
        if e.status in ("ok", "foreign") and e.manifest is not None:
            report(_verify_one(storage, e.name, e.manifest, args), len(e.manifest.files))
        else:
            report(_broken(storage, e), 0)

    for e in targets:
        verify_entry(e)
    seen = {e.name for e in targets}
    for _ in range(3 if args.step is None else 0):
        if results or not any(r["status"] == "removed" for r in skipped):
            break
        # Every checkpoint listed was rotated away while it was read (a job saving
        # faster than verify reads): the ones committed since are verified instead of
        # failing with "nothing was verified" (a false alarm for `verify ROOT || alert`).
        newer = [
            e
            for e in catalog.scan(storage, run_id=run_id)
            if e.status in ("ok", "corrupt") and e.name not in seen
        ]
        for e in reversed(newer):  # the newest first: the longest to live
            seen.add(e.name)
            targets.append(e)
            verify_entry(e)
            if results:
                break
    for r in impostors:
        report(r, 0)
    # A Lightning ModelCheckpoint directory: its .ckpt files, through their sidecars.
    for name in lightning:
        report(_verify_lightning(storage, name), 1)
    # Other tiers of the run (--tier): every copy of every step is verified, each
    # result says its tier (0: ROOT).
    tiers = [_open_tier(t, args.tier_storage_option) for t in args.tier or ()]
    for r in results if tiers else ():
        r["tier"] = 0
    # Each tier's copy of a step must be ROOT's copy: two valid but different copies
    # (another job's, two copies of a root drained into one place) are not "verified".
    on_root = {e.step: e.manifest for e in targets if e.status == "ok" and e.manifest is not None}
    for i, st in enumerate(tiers, start=1):
        for e in catalog.scan(st, run_id=run_id):
            if e.status not in ("ok", "corrupt") or e.step is None or "/" in e.name:
                continue
            if args.step is not None and e.step != args.step:
                continue
            r = (
                _verify_one(st, e.name, e.manifest, args)
                if e.status == "ok" and e.manifest is not None
                else _broken(st, e)
            )
            ours = on_root.get(e.step)
            theirs = e.manifest
            if (
                r["status"] == "ok"
                and ours is not None
                and theirs is not None
                and not catalog.is_replica(theirs, ours)
            ):
                r["status"] = "differs"
                r["problem"] = (
                    f"another copy of step {e.step} than {storage.url(e.name)} (its files' "
                    "checksums differ): not a replica of ROOT's checkpoint"
                )
            r["tier"] = i
            report(r, len(e.manifest.files) if e.manifest is not None else 0)
    results.sort(
        key=lambda r: (r["step"] if r["step"] is not None else -1, r["name"], r.get("tier", 0))
    )
    bad = [r for r in results if r["status"] != "ok"]
    ok = bool(results) and not bad
    if args.json:
        _emit_verify_json(storage, recorded, results, skipped, tiers, ok=ok)
    elif not args.quiet:
        held: dict[int, list[int]] = {}
        for r in results:
            if tiers and r["status"] == "ok" and r["step"] is not None:
                held.setdefault(r["step"], []).append(r["tier"])
        for step, where in sorted(held.items()):
            print(f"{checkpoint_name(step)}: verified on tier(s) {','.join(map(str, where))}")
        extra = f", {len(skipped)} skipped (pending, foreign or removed: see `{PROG} list`)"
        print(
            f"{storage.url()}: {len(results) - len(bad)} ok, {len(bad)} failed"
            + (extra if skipped else "")
        )
    if not results:
        whose = f" of run {run_id!r}" if run_id else ""
        if any(r["status"] == "removed" for r in skipped):
            raise CliError(
                f"nothing was verified: every checkpoint{whose} in {storage.url()} was removed "
                "while it was being read (the job that owns ROOT rotates them faster than "
                "verify reads them); run verify again, or verify one step with a longer life"
            )
        state_files = [n for n in storage.listdir("") if layout.is_state_file(n)]
        if state_files and storage.size(MANIFEST_NAME) is None:
            # The files of one checkpoint, without its manifest: a copy cut short.
            raise CliError(
                f"{storage.url()} holds the state files of one checkpoint "
                f"({', '.join(sorted(state_files)[:3])}) but no {MANIFEST_NAME}, which is written "
                "last: a copy that was cut short, or a save that never committed, so it "
                "cannot be verified. Copy the complete checkpoint again"
            )
        raise CliError(f"nothing to verify: {storage.url()} holds no checkpoint{whose}")
    if bad:
        names = ", ".join(_on_disk(storage, r["name"]) for r in bad)
        first = bad[0]
        raise CliError(
            f"{len(bad)} of {len(results)} checkpoint(s) failed verification ({names}); "
            f"{first['name']}: {first['problem']}"
        )
    return EXIT_OK


def _emit_verify_json(
    storage: Storage,
    run_id: str | None,
    results: list[dict[str, Any]],
    skipped: list[dict[str, Any]],
    tiers: Sequence[Storage] = (),
    *,
    ok: bool = False,
) -> None:
    _emit_json(
        {
            "schema_version": JSON_SCHEMA_VERSION,
            "command": "verify",
            "root": storage.url(),
            "run_id": run_id,
            "ok": ok,
            "checkpoints": results,
            "skipped": skipped,
            **({"tiers": [storage.url()] + [st.url() for st in tiers]} if tiers else {}),
        }
    )


# ---------------------------------------------------------------------- clean
def _clean_leftovers(
    storage: Storage,
    strategy: CommitStrategy,
    leftovers: list[Leftover],
    *,
    dry_run: bool,
    before_each: Callable[[str], None] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Remove (or with ``dry_run`` only size) what ``strategy.leftovers`` listed;
    ``before_each(name)`` runs before each removal. Returns (removed, failed) items."""
    removed: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    for left in leftovers:
        # Beside a committed manifest only the stale attempts, markers and temporary
        # files go: each is named, never the checkpoint that stays.
        each = left.committed and bool(left.paths)
        items: list[dict[str, Any]] = [
            {"name": name, "kind": left.kind, "size_bytes": 0}
            for name in (left.paths if each else [left.name])
        ]
        try:
            for item in items:
                paths = [item["name"]] if each else left.paths
                item["size_bytes"] = sum(_tree_size(storage, p) for p in paths)
            if not dry_run:
                if before_each is not None:
                    before_each(left.name)
                strategy.remove_leftover(storage, left)
                log.info("removed %s", ", ".join(storage.url(p) for p in left.paths))
        except CliError:
            raise
        except CheckpointError as exc:
            failed.extend({**item, "problem": str(exc)} for item in items)
            continue
        removed.extend(items)
    return removed, failed


def _open_uploads(storage: Storage) -> list[Any]:
    """The unfinished multipart uploads under ROOT/ (S3); [] where there are none or
    they cannot be listed (``_clean_uploads`` reports that)."""
    listing = getattr(storage, "open_uploads", None)
    try:
        return [] if listing is None else list(listing(""))
    except CheckpointError:
        return []


def _of_this_root(path: str) -> bool:
    """Whether ``path`` (relative to ROOT) is where this root's own writes go: a
    ``checkpoint-<step>/`` entry or one of its directories (``.pending``, ``.trash``,
    ``.atomic-checkpoint``)."""
    head = path.split("/", 1)[0]
    return parse_checkpoint_name(head) is not None or head in layout.OWN_DIRS


def _clean_uploads(
    storage: Storage,
    holder: Any | None,
    since: float,
    *,
    dry_run: bool,
    before: Sequence[Any] = (),
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Abort the unfinished multipart uploads under ROOT/ (S3): a writer killed in the
    middle of a large file leaves one, its parts stored and billed but in no listing,
    and a sweep whose own abort failed leaves one no later sweep can find (the keys
    beside it are gone). Returns (removed, failed) items of kind ``upload``.

    ``before``: the uploads open before ``clean`` removed the marker leftovers, which
    aborts the uploads of each attempt it removes: those are reported here too.

    Which ones: only uploads under the prefix ``<root>/`` (never a sibling such as
    ``run10`` beside ``run1``, never another run's prefix), and never one a live writer
    may still be doing. So nothing while a live job, or an unreadable lock file, holds
    the run lock (``--force`` then leaves the uploads for a later clean: aborting
    them would fail that job's save in progress), and none that started after ``clean``
    read the lock (``since``; a job that took the lock meanwhile). The lock is read
    again right before the aborts (exit 3 if it changed hands).
    """
    listing = getattr(storage, "open_uploads", None)
    abort = getattr(storage, "abort_upload", None)
    if listing is None or abort is None:
        return [], []
    try:
        uploads = listing("")
    except CheckpointError as exc:
        return [], [
            {"name": "(unfinished uploads)", "kind": "upload", "size_bytes": 0, "problem": str(exc)}
        ]
    # Only uploads of this root's own layout: under ROOT/sub/ may be another root, whose
    # live job's upload an abort failed ("Internal Server Error" in its save), and this
    # root's run lock says nothing of that job.
    others = [u for u in uploads if not _of_this_root(u.path)]
    if others:
        _warn(
            f"left {len(others)} unfinished upload(s) under {storage.url()} that are not of "
            f"its checkpoints (e.g. {others[0].path}: another root inside it?): run clean "
            "on that root"
        )
        uploads = [u for u in uploads if _of_this_root(u.path)]
    open_now = {u.path for u in uploads}
    with_attempts = [
        {"name": u.path, "kind": "upload", "size_bytes": 0}
        for u in before
        if u.path not in open_now
        and _of_this_root(u.path)
        and (u.initiated_unix is None or u.initiated_unix < since)
    ]
    if not uploads:
        return with_attempts, []
    if holder is not None and holder.is_live():
        _warn(
            f"left {len(uploads)} unfinished upload(s) under {storage.url()}: the run lock "
            f"is held by {holder.describe()}, which may be writing them. Run clean again "
            "once that job has ended"
        )
        return [], []
    removed: list[dict[str, Any]] = with_attempts
    failed: list[dict[str, Any]] = []
    if not dry_run:
        _lock_unchanged(storage, holder, uploads[0].path)
    for upload in uploads:
        if upload.initiated_unix is not None and upload.initiated_unix >= since:
            continue  # started after clean read the lock: not provably abandoned
        item: dict[str, Any] = {"name": upload.path, "kind": "upload", "size_bytes": 0}
        try:
            if not dry_run:
                abort(upload)
                log.info("aborted the unfinished upload of %s", storage.url(upload.path))
        except CheckpointError as exc:
            failed.append({**item, "problem": str(exc)})
            continue
        removed.append(item)
    return removed, failed


def cmd_clean(args: argparse.Namespace) -> int:
    try:
        storage = _open_root(args.root, args.storage_option)
    except _RootMissing as exc:
        # An object-store prefix whose only content is unfinished uploads (its objects
        # deleted by hand, `aws s3 rm --recursive`): in no listing, billed, and clean
        # is the command that aborts them. It refused the "empty" root.
        storage = exc.open()
        if not is_url(args.root) or not _open_uploads(storage):
            raise
    _refuse_one_checkpoint(storage, "clean")
    since = time.time()
    holder = _check_lock(storage, "clean", force=args.force, dry_run=args.dry_run)
    # An overwrite interrupted between its two renames (no atomic exchange) left its
    # step absent and both copies in .pending/ and .trash/: one goes back first, and
    # nothing recovery could not settle is removed (never the only copy of a step).
    recovery = recover_replaced(storage, dry_run=args.dry_run)
    restored = [
        {"name": checkpoint_name(step), "copy": copy, "from": source}
        for step, copy, source in recovery.restored
    ]
    rename = RenameStrategy()
    removed, failed = _clean_leftovers(
        storage, rename, rename.leftovers(storage, keep=recovery.keep), dry_run=args.dry_run
    )
    # A process killed inside an atomic write (run record, lock, claim) left its
    # temporary file; only one whose writer is provably gone goes (``storage.temps``).
    # A path-style DCP save killed before its rename left `.<name>.<token>.pending/`
    # beside NAME. Once NAME exists it can never commit (those saves never replace):
    # only then is it removed, as no job may still write it.
    temps = [rel for d in ("", META_DIR) for rel, _why in abandoned_temps(storage, d)]
    for kind, rels in (("temporary", temps), ("pending", _doomed_siblings(storage))):
        for rel in rels:
            item = {"name": rel, "kind": kind, "size_bytes": 0}
            try:
                item["size_bytes"] = (
                    _tree_size(storage, rel) if kind == "pending" else storage.size(rel) or 0
                )
                if not args.dry_run:
                    if kind == "pending":
                        storage.delete_tree(rel)
                    else:
                        storage.delete_file(rel)
                    log.info("removed %s", storage.url(rel))
            except CheckpointError as exc:
                failed.append({**item, "problem": str(exc)})
                continue
            removed.append(item)
    # Marker commits (object stores, s3fs-style mounts) stage in place: a crashed save
    # leaves an attempt and its marker under checkpoint-<step>/ instead of .pending/.
    # Only what the listing found is removed (never a manifest), and before each entry
    # the lock is read again: a job that starts meanwhile may be committing that step.
    # Looked for whatever strategy the storage would choose now: a run may have asked
    # for the marker strategy on a disk whose rename is atomic (``strategy="marker"``).
    marker = MarkerStrategy()
    uploads_before = [] if args.dry_run else _open_uploads(storage)
    gone, not_gone = _clean_leftovers(
        storage,
        marker,
        marker.leftovers(storage),
        dry_run=args.dry_run,
        before_each=lambda name: _lock_unchanged(storage, holder, name),
    )
    removed += gone
    failed += not_gone
    aborted, not_aborted = _clean_uploads(
        storage, holder, since, dry_run=args.dry_run, before=uploads_before
    )
    removed += aborted
    failed += not_aborted
    lock_removed = False
    if holder is not None and args.force and not args.dry_run and not failed:
        lock_removed = _break_lock(storage, holder)
    freed = sum(i["size_bytes"] for i in removed)
    if args.json:
        _emit_json(
            {
                "schema_version": JSON_SCHEMA_VERSION,
                "command": "clean",
                "root": storage.url(),
                "dry_run": args.dry_run,
                "forced": bool(args.force),
                "lock": _lock_doc(holder),
                "lock_removed": lock_removed,
                "restored": restored,
                "removed": removed,
                "failed": failed,
                "freed_bytes": freed,
            }
        )
    else:
        verb = "would remove" if args.dry_run else "removed"
        for r in restored:
            print(
                f"{'would restore' if args.dry_run else 'restored'} {r['name']} from the "
                f"{r['copy']} copy of an interrupted overwrite ({r['from']})"
            )
        for i in removed:
            name = _on_disk(storage, i["name"])
            if i["kind"] == "upload":
                print(f"{verb} {name} (unfinished multipart upload)")
            else:
                print(f"{verb} {name} ({i['kind']}, {_human_bytes(i['size_bytes'])})")
        for i in failed:
            print(f"FAILED {_on_disk(storage, i['name'])}: {i['problem']}")
        if not removed and not failed:
            print(f"{storage.url()}: nothing to clean (no abandoned pending or trash data)")
        else:
            what = "would free" if args.dry_run else "freed"
            print(f"{storage.url()}: {what} {_human_bytes(freed)} in {len(removed)} entr(ies)")
    if failed:
        raise CliError(
            f"could not remove {len(failed)} entr(ies) under {storage.url()}: "
            f"{failed[0]['name']}: {failed[0]['problem']}"
        )
    return EXIT_OK


# ---------------------------------------------------------------------- inspect
def _file_tensors(storage: Storage, name: str, entry: Any) -> tuple[list[Any] | None, str | None]:
    """Tensor names, dtypes and shapes of one ``.safetensors`` file, read from its
    header only: no tensor data is read, nothing is unpickled, torch is not imported."""
    from .serialization import read_header

    if not entry.path.endswith(".safetensors"):
        return None, None
    rel = f"{name}/{entry.path}"
    try:
        catalog.check_inside(storage, name, entry.path)
        size = storage.size(rel)
        if size is None:
            return None, "missing"
        with storage.open_read(rel) as f:
            header = read_header(f, size_bytes=size)
    except CheckpointError as exc:
        return None, _short_problem(storage, name, str(exc))
    tensors = [
        {"name": t, "dtype": dtype, "shape": list(shape)}
        for t, (dtype, shape) in header.tensors.items()
    ]
    return tensors, None


def _tier_copies(
    tiers: list[Storage], name: str, run_id: str | None, root_status: dict[str, Any]
) -> list[dict[str, Any]]:
    """Where the run's other tiers (``--tier``) hold ``name``: each tier's copy, with
    ROOT's first (tier 0), as ``{"tier", "url", "status", "problem"}``; status "ok",
    "missing" (no manifest there: not replicated yet, or rotated away), "corrupt" or
    "foreign" (another run's)."""
    out = [{"tier": 0, **root_status}]
    for i, st in enumerate(tiers, start=1):
        status, problem = "ok", None
        try:
            m = catalog.read_manifest(st, name)
            catalog.validate(st, name, m)
            if run_id is not None and not m.belongs_to(run_id):
                status, problem = "foreign", f"belongs to run {m.run_id!r}, not {run_id!r}"
        except CheckpointNotFoundError:
            status = "missing"
        except CheckpointError as exc:
            status, problem = "corrupt", _short_problem(st, name, str(exc))
        out.append({"tier": i, "url": st.url(name), "status": status, "problem": problem})
    return out


def cmd_inspect(args: argparse.Namespace) -> int:
    storage = _open_root(args.root, args.storage_option)
    single = None if args.tier else _as_checkpoint_dir(storage, args.storage_option)
    if single is not None:
        # ROOT is that checkpoint's directory: read from its parent.
        storage = _one_checkpoint_step(storage, single, args.step)
    root = storage
    run_id = _run_id_for_reading(storage)
    tiers = [_open_tier(t, args.tier_storage_option) for t in args.tier or ()]
    name = checkpoint_name(args.step)
    shown = 0  # the tier whose copy is shown (0: ROOT)
    if tiers and not storage.is_dir(name):
        # Held only by another tier (ROOT's copy rotated away, or a fresh node): that
        # copy is the one shown; ROOT stays the document's root, its copy "missing".
        held = [t for t in _tier_copies(tiers, name, run_id, {})[1:] if t["status"] == "ok"]
        if held:
            shown = held[0]["tier"]
            storage = tiers[shown - 1]
            print(
                f"{root.url(name)} does not exist; showing the copy at {storage.url(name)}",
                file=sys.stderr,
            )

    def tier_copies(own: dict[str, Any], owner: str | None) -> list[dict[str, Any]] | None:
        """Each tier's copy (None without --tier): ROOT's first, the one shown ``own``."""
        if not tiers:
            return None
        absent = {"url": root.url(name), "status": "missing", "problem": None}
        copies = _tier_copies(tiers, name, run_id or owner, own if shown == 0 else absent)
        copies[shown] = {"tier": shown, **own}
        return copies

    target = _single_target(storage, args.step)
    if target.manifest is None:
        problem = _short_problem(storage, name, target.problem)
        if args.json:
            own = {"url": storage.url(name), "status": target.status, "problem": problem}
            copies = tier_copies(own, None)
            _emit_inspect_json(storage, name, target.status, problem, None, [], copies, root=root)
        lightning = _lightning_names(storage) if target.status == "missing" else []
        if lightning:
            # "checkpoint steps there: none" contradicted `list`, which shows its files.
            raise CliError(
                f"{storage.url()} is a Lightning ModelCheckpoint directory ({len(lightning)} "
                ".ckpt file(s)), not a CheckpointManager root: `inspect` reads "
                f"checkpoint-<step> folders. `{PROG} list {args.root}` shows its files by "
                f"recorded step and `{PROG} verify {args.root}` checks them against their "
                "manifests",
                EXIT_USAGE,
            )
        if target.status in ("missing", "not_a_checkpoint"):
            raise CliError(str(target.problem))
        raise CliError(f"{storage.url(name)} is corrupt: {problem}")
    m = target.manifest
    status, problem = "ok", None
    try:
        catalog.validate(storage, name, m)  # sizes; the data is not read
        catalog.check_state_headers(storage, name, m)  # what restore's loader rejects
    except CorruptCheckpointError as exc:
        status, problem = "corrupt", _short_problem(storage, name, str(exc))
    except CheckpointError as exc:  # unreadable (a 503, permissions, I/O): not proven corrupt
        status, problem = "error", _short_problem(storage, name, str(exc))
    if status == "ok" and run_id is not None and not m.belongs_to(run_id):
        status, problem = "foreign", f"belongs to run {m.run_id!r}, not {run_id!r}"
    files = []
    for f in m.files:
        tensors, file_problem = _file_tensors(storage, name, f)
        files.append(
            {
                "path": f.path,
                "size_bytes": f.size_bytes,
                "checksum": f.checksum,
                "rank": f.rank,
                "tensors": tensors,
                "problem": file_problem,
            }
        )
    manifest_doc = {
        "step": m.step,
        "run_id": m.run_id,
        "commit_seq": m.commit_seq,
        "created_unix": m.created_unix,
        "world_size": m.world_size,
        "state_kind": m.state_kind,
        "strategy": m.strategy,
        "checksum_algorithm": m.checksum_algorithm,
        "schema_version": m.schema_version,
        "library_version": m.library_version,
        "size_bytes": m.size_bytes,
        "metrics": dict(m.metrics),
        "metadata": dict(m.metadata),
        "domain_count": m.domain_count,
        "domain_ranks": None if m.domain_ranks is None else list(m.domain_ranks),
        "adopted": m.adopted,
    }
    own = {"url": storage.url(name), "status": status, "problem": problem}
    copies = tier_copies(own, m.run_id)
    if args.json:
        _emit_inspect_json(storage, name, status, problem, manifest_doc, files, copies, root=root)
    else:
        _print_inspect(storage, name, status, problem, m, files, copies)
    if status == "corrupt":
        raise CliError(f"{storage.url(name)} is corrupt: {problem}")
    if status == "error":
        raise CliError(
            f"could not read {storage.url(name)} (this says nothing about its data; try "
            f"again once the storage answers): {problem}",
            EXIT_USAGE,
        )
    return EXIT_OK


def _emit_inspect_json(
    storage: Storage,
    name: str,
    status: str,
    problem: str | None,
    manifest_doc: dict[str, Any] | None,
    files: list[dict[str, Any]],
    copies: list[dict[str, Any]] | None = None,
    *,
    root: Storage,
) -> None:
    """``inspect``'s document: ``storage`` holds the copy shown (another tier's where
    ROOT lacks the step), ``root`` is ROOT."""
    _emit_json(
        {
            "schema_version": JSON_SCHEMA_VERSION,
            "command": "inspect",
            "root": root.url(),
            "name": name,
            "path": storage.url(name),
            "status": status,
            "problem": problem,
            "manifest": manifest_doc,
            "files": files,
            **({"tiers": copies} if copies is not None else {}),
        }
    )


def _print_inspect(
    storage: Storage,
    name: str,
    status: str,
    problem: str | None,
    m: Manifest,
    files: list[dict[str, Any]],
    copies: list[dict[str, Any]] | None = None,
) -> None:
    fields = [
        ("path", storage.url(name)),
        (
            "status",
            f"{status}: {problem}"
            if problem is not None
            else f"{status} (manifest and file sizes; no data read: `{PROG} verify` checks "
            "the checksums)"
            if status == "ok"
            else status,
        ),
        ("step", str(m.step)),
        ("run id", m.run_id),
        ("commit seq", str(m.commit_seq)),
        ("created", f"{_local_time(m.created_unix)} ({m.created_unix:.3f})"),
        ("world size", str(m.world_size)),
        ("state kind", m.state_kind),
        ("strategy", m.strategy),
        ("checksums", m.checksum_algorithm),
        (
            "schema",
            f"{m.schema_version} (atomic-checkpoint {m.library_version})"
            if m.library_version
            else f"{m.schema_version} (no library version recorded)",
        ),
        ("size", f"{_human_bytes(m.size_bytes)} ({m.size_bytes} bytes) in {len(m.files)} file(s)"),
        ("metrics", _metrics_text(dict(m.metrics))),
        ("metadata", json.dumps(dict(m.metadata), sort_keys=True) if m.metadata else "-"),
    ]
    if m.domain_count > 1:
        ranks = ", ".join(map(str, m.domain_ranks or ()))
        fields.insert(7, ("domains", f"{m.domain_count} (this copy holds ranks {ranks})"))
    if m.adopted:
        adoption = m.metadata.get("adoption")
        by = adoption.get("framework") if isinstance(adoption, dict) else None
        fields.insert(
            2,
            (
                "adopted",
                f"yes: written by {by or 'a framework'}, recorded by `{PROG} adopt` (checksums "
                "taken at adoption, not at save time)",
            ),
        )
    if copies is not None:
        fields.append(
            (
                "tiers",
                "; ".join(
                    f"{c['tier']} {c['status']}" + (f" ({c['problem']})" if c["problem"] else "")
                    for c in copies
                ),
            )
        )
    print(name)
    for key, value in fields:
        print(f"  {key + ':':<12} {value}")
    print("\nfiles:")
    rows = [
        [
            f["path"],
            _human_bytes(f["size_bytes"]),
            f["checksum"],
            "-" if f["rank"] is None else str(f["rank"]),
        ]
        for f in files
    ]
    _write_out(_indent(_table(["PATH", "SIZE", "CHECKSUM", "RANK"], rows, right={1, 3})) + "\n")
    for f in files:
        if f["tensors"] is None and f["problem"] is None:
            continue
        print(f"\n{f['path']}:")
        if f["problem"] is not None:
            print(f"  cannot read its header: {f['problem']}")
            continue
        tensors = f["tensors"]
        elements = sum(math.prod(t["shape"]) for t in tensors)
        print(f"  {len(tensors)} tensor(s), {elements:,} element(s)")
        if tensors:
            rows = [[t["name"], t["dtype"], str(t["shape"])] for t in tensors]
            print(_indent(_table(["TENSOR", "DTYPE", "SHAPE"], rows, right=set())))


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())


# ---------------------------------------------------------------------- prune
def _policy(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    from .retention import AnyOf, KeepBest, KeepEvery, KeepLast, Pin

    if args.keep_best is None and (args.metric is not None or args.mode is not None):
        parser.error("--metric and --mode go with --keep-best K")
    policies: list[Any] = []
    if args.keep_last is not None:
        policies.append(KeepLast(args.keep_last))
    if args.keep_best is not None:
        policies.append(
            KeepBest(args.keep_best, metric=args.metric or "eval_loss", mode=args.mode or "min")
        )
    if args.keep_every is not None:
        policies.append(KeepEvery(args.keep_every))
    if args.pin:
        policies.append(Pin(args.pin))
    if not policies:
        parser.error(
            "say what to keep: --keep-last N, --keep-best K, --keep-every K and/or --pin STEP"
        )
    return policies[0] if len(policies) == 1 else AnyOf(*policies)


def cmd_prune(args: argparse.Namespace) -> int:
    policy = _policy(args, args.parser)
    storage = _open_root(args.root, args.storage_option)
    _refuse_one_checkpoint(storage, "prune")
    # A live job's lock is the first answer (exit 3), whatever else is wrong.
    holder = _check_lock(storage, "prune", force=args.force, dry_run=args.dry_run)
    ours = any(parse_checkpoint_name(n) is not None for n in storage.listdir(""))
    if args.dry_run or not ours:
        # Nothing made where there is no checkpoint to delete: an empty root, a
        # directory of other files (it was left holding .atomic-checkpoint/lock.token),
        # a Lightning directory that is refused.
        return _prune(args, storage, policy, holder, None)
    # Held for the whole prune: a job starting meanwhile would save (or roll back and
    # save again) the steps this prune is about to delete by name (exit 3 for it).
    lock = _take_lock(storage, "prune", args.run_id, force=args.force)
    try:
        return _prune(args, storage, policy, holder, lock)
    finally:
        lock.release()


def _take_lock(storage: Storage, what: str, run_id: str | None, *, force: bool) -> Any:
    """The run lock, for a command that deletes (``--force``: taken over from a live
    holder, which is then fenced); exit 3 when a job holds it."""
    from .lock import RunLock

    lock = RunLock(storage, run_id=run_id or f"atomic-checkpoint {what}")
    try:
        storage.makedirs(META_DIR)
        lock.acquire(takeover=force)
    except LockHeldError as exc:
        raise CliError(f"refusing to {what} {storage.url()}: {exc}", EXIT_LOCKED) from None
    except StorageFullError as exc:
        # The lock file cannot be written on a full disk, and freeing it is what this
        # command is for (no job can take the lock either until it has). Each deletion
        # then checks that no job took the lock since.
        _warn(f"cannot take the run lock ({exc}); going on without it, stopping if a job takes it")
        return _LockWatch(storage, _lock_holder(storage), what)
    return lock


@dataclasses.dataclass
class _LockWatch:
    """In place of the run lock where it cannot be taken (a full disk): ``check`` raises
    (exit 3) once the lock changed hands since the command started."""

    storage: Storage
    seen: Any
    what: str

    def check(self) -> None:
        _lock_unchanged(self.storage, self.seen, "", self.what)

    def release(self) -> None:
        """Nothing to release."""


def _prune(args: argparse.Namespace, storage: Storage, policy: Any, holder: Any, lock: Any) -> int:
    from .retention import describe_plan, plan_keeping_a_verified_newest, unrecorded_metrics

    try:
        run_id = args.run_id or catalog.recorded_run_id(storage)
    except CheckpointError as exc:
        # Torn (a crash while it was first written): read as no run file, as the manager
        # does (it replaces it): the run is then the one whose checkpoints are there.
        print(f"{PROG}: warning: {exc}: taken as no run file", file=sys.stderr)
        run_id = None
    # No run file (a tiered job's persistent tier, a root saved with run_id=): the run
    # is unambiguous when every checkpoint there belongs to one. One scan either way.
    entries = catalog.scan(storage, run_id=run_id)
    if run_id is None:
        runs = set(catalog.runs_of(e.manifest for e in entries if e.status == "ok" and e.manifest))
        if len(runs) > 1:
            raise CliError(
                f"{storage.url()} records no run ({RUN_FILE} is missing) and holds "
                f"checkpoints of {len(runs)} runs, so it is not known whose checkpoints to "
                f"prune: pass --run-id RUN (see the RUN column of `{PROG} list --all-runs`)",
                EXIT_USAGE,
            )
        # Every valid entry is this run's: the scan stands. None: nothing to prune.
        run_id = runs.pop() if runs else None
    manifests = [e.manifest for e in entries if e.status == "ok" and e.manifest is not None]
    lightning = _lightning_names(storage) if not manifests else []
    if lightning:
        # Said, not a quiet "nothing to prune" a user would take for done.
        raise CliError(
            f"{storage.url()} is a Lightning ModelCheckpoint directory ({len(lightning)} .ckpt "
            "file(s)), not a CheckpointManager root: its files are kept or removed by "
            "ModelCheckpoint(save_top_k=...), which also tracks them for resume. Lower "
            "save_top_k, or delete a file by hand together with its <name>.ckpt"
            f"{LIGHTNING_MANIFEST_SUFFIX} sidecar",
            EXIT_USAGE,
        )
    skipped = [
        {
            "name": e.name,
            "step": e.step,
            "status": e.status,
            "problem": _short_problem(storage, e.name, e.problem),
        }
        for e in entries
        if e.status != "ok"
    ]
    infos: list[CheckpointInfo] = [m.info(storage.url(checkpoint_name(m.step))) for m in manifests]
    warnings: list[str] = []
    have = {i.step for i in infos}
    for step in sorted(set(args.pin) - have):
        # A typo'd --pin would silently pin nothing while the plan deletes the rest.
        warnings.append(
            f"--pin {step}: {storage.url()} holds no committed checkpoint of step {step} of "
            f"this run, so it pins nothing; check the step (`{PROG} list`)"
        )
        _warn(warnings[-1])
    for metric, recorded in unrecorded_metrics(policy, infos).items():
        raise CliError(
            f"no checkpoint of run {run_id!r} records metric {metric!r} (recorded: "
            f"{', '.join(recorded) or 'none'}), so --keep-best would keep nothing: "
            "check --metric",
            EXIT_USAGE,
        )

    # Every byte of every checkpoint the policy keeps (--quick: of the newest one) is
    # verified before anything is deleted; one that fails is set aside, and the policy
    # is applied to the others (see plan_keeping_a_verified_newest).
    def verifies(step: int) -> bool:
        name = checkpoint_name(step)
        manifest = next(m for m in manifests if m.step == step)
        progress = _progress_for(args, f"verifying {name}", manifest.size_bytes)
        try:
            catalog.validate_consistent(storage, name, manifest, full=True, progress=progress)
            return True
        except CorruptCheckpointError as exc:
            problem = f"failed verification, so not counted as kept: {exc}"
            skipped.append(
                {
                    "name": name,
                    "step": step,
                    "status": "corrupt",
                    "problem": _short_problem(storage, name, problem),
                }
            )
            return False
        finally:
            if progress is not None:
                progress.finish()

    victim_steps, infos = plan_keeping_a_verified_newest(
        policy, infos, verifies, every_kept=not args.quick
    )
    victims = set(victim_steps)
    plan = describe_plan(policy, infos)
    failed: list[dict[str, Any]] = []
    deleted: set[int] = set()
    if victims and not args.dry_run:
        # Un-commit before deleting, as rotation does (the rename strategy: into .trash/).
        strategy = choose_strategy(storage)
        for step in sorted(victims):
            try:
                if strategy.retire(storage, step, fence=lock.check if lock else None):
                    log.info("retention: deleted %s", storage.url(checkpoint_name(step)))
            except CheckpointError as exc:
                failed.append({"name": checkpoint_name(step), "step": step, "problem": str(exc)})
                continue
            deleted.add(step)
    rows = []
    for info, kept, reason in plan:
        rows.append(
            {
                "name": checkpoint_name(info.step),
                "step": info.step,
                "size_bytes": info.size_bytes,
                "created_unix": info.created_unix,
                "metrics": dict(info.metrics),
                "kept": kept,
                "reason": reason,
                "deleted": info.step in deleted,
            }
        )
    sizes = {i.step: i.size_bytes for i in infos}
    freed = sum(sizes[s] for s in (victims if args.dry_run else deleted))
    if args.json:
        _emit_json(
            {
                "schema_version": JSON_SCHEMA_VERSION,
                "command": "prune",
                "root": storage.url(),
                "run_id": run_id,
                "policy": repr(policy),
                "dry_run": args.dry_run,
                "forced": bool(args.force),
                "lock": _lock_doc(holder),
                "checkpoints": rows,
                "failed": failed,
                "skipped": skipped,
                "freed_bytes": freed,
                "warnings": warnings,
            }
        )
    else:
        _print_prune(storage, run_id, policy, rows, failed, skipped, freed, args.dry_run)
    if failed:
        # Said as it is: "the others were handled" read wrong when every deletion failed.
        others = (
            "none of the checkpoints to delete was deleted"
            if not deleted
            else f"{len(deleted)} of the {len(victims)} to delete were deleted"
        )
        raise CliError(
            f"could not delete {len(failed)} checkpoint(s): {failed[0]['name']}: "
            f"{str(failed[0]['problem']).rstrip('.')} ({others}; fix that and run prune "
            f"again, and `{PROG} clean` to remove what a failed deletion left in {TRASH_DIR}/)"
        )
    corrupt = [e for e in skipped if e["status"] == "corrupt"]
    if corrupt:
        # A problem found (exit 1, as verify): a nightly `prune || alert` must fire.
        raise CliError(
            f"{len(corrupt)} checkpoint(s) of the run are corrupt, kept and not counted "
            f"({', '.join(str(e['name']) for e in corrupt)}); the policy was applied to the "
            f"others. `{PROG} verify {storage.url()}` says more"
        )
    return EXIT_OK


def _print_prune(
    storage: Storage,
    run_id: str | None,
    policy: Any,
    rows: list[dict[str, Any]],
    failed: list[dict[str, Any]],
    skipped: list[dict[str, Any]],
    freed: int,
    dry_run: bool,
) -> None:
    print(f"{storage.url()}: run {run_id or '(none recorded)'}, policy {policy!r}")
    if not rows:
        print(
            "no checkpoint of this run passed verification: nothing to prune"
            if any(e["status"] == "corrupt" for e in skipped)
            else "no committed checkpoint of this run: nothing to prune"
        )
    failed_steps = {f["step"] for f in failed}
    table = []
    for r in rows:
        if r["kept"]:
            action = "keep"
        elif dry_run:
            action = "would delete"
        elif r["step"] in failed_steps:
            action = "FAILED"
        else:
            action = "deleted"
        table.append(
            [str(r["step"]), action, _human_bytes(r["size_bytes"]), _metrics_text(r["metrics"]),
             r["reason"]]
        )  # fmt: skip
    if table:
        print(_table(["STEP", "ACTION", "SIZE", "METRICS", "REASON"], table, right={0, 2}))
    for s in skipped:
        print(f"not considered: {_on_disk(storage, s['name'])} ({s['status']}: {s['problem']})")
    n = sum(1 for r in rows if not r["kept"]) if dry_run else sum(r["deleted"] for r in rows)
    verb = "would delete" if dry_run else "deleted"
    print(f"{verb} {n} checkpoint(s), {'would free' if dry_run else 'freed'} {_human_bytes(freed)}")


# ---------------------------------------------------------------------- adopt
def cmd_adopt(args: argparse.Namespace) -> int:
    from .adopt import adopt

    storage = _open_root(args.root, args.storage_option)
    t0 = time.monotonic()
    lines: list[str] = []

    def say(line: str) -> None:
        # One line per checkpoint as soon as it is settled: a large root takes minutes
        # (every byte is read for its checksum).
        line = _adopt_cli_words(line)
        lines.append(line)
        if not args.json:
            print(line, flush=True)

    try:
        result = adopt(
            storage,
            args.step or None,
            framework=args.framework,
            run_id=args.run_id,
            dry_run=args.dry_run,
            progress=say,
        )
    except ValueError as exc:  # an unknown --framework
        raise CliError(_adopt_cli_words(str(exc)), EXIT_USAGE) from None
    except CheckpointError as exc:
        # The library's messages advise its Python parameters (run_id=, takeover=True):
        # a shell user is told the flags instead. Same error type: same exit status.
        if not isinstance(exc, OSError):
            exc.args = (_adopt_cli_words(str(exc)),)
        if args.json:
            # The document too (a script reads stdout): what was done before the error
            # (a full disk half way), and the error as its problem.
            done = getattr(exc, "adopt_result", None)
            if done is None:
                done = AdoptResult(storage.url(""), None, dry_run=args.dry_run)
            _emit_json(_adopt_doc(done, time.monotonic() - t0, str(exc)))
        raise
    seconds = time.monotonic() - t0
    problem = _adopt_problem(args, result)
    if args.json:
        _emit_json(_adopt_doc(result, seconds, problem))
    elif result.adopted or result.already or result.refused or result.unreadable:
        verb = "would adopt" if result.dry_run else "adopted"
        total = sum(result.size_bytes.get(s, 0) for s in result.adopted)
        print(
            f"{result.root}: {verb} {len(result.adopted)} ({_human_bytes(total)}), "
            f"{len(result.already)} already committed, "
            f"{len(result.refused) + len(result.unreadable)} refused, in "
            f"{seconds:.2f} s" + (f" (run {result.run_id})" if result.run_id else "")
        )
    if problem is not None:
        raise CliError(problem)
    return EXIT_OK


def _adopt_doc(result: AdoptResult, seconds: float, problem: str | None) -> dict[str, Any]:
    """``adopt --json``'s document."""
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "command": "adopt",
        "root": result.root,
        "run_id": result.run_id,
        "dry_run": result.dry_run,
        "adopted": [
            {
                "step": s,
                "framework": result.frameworks.get(s),
                "size_bytes": result.size_bytes.get(s),
                "seconds": result.seconds.get(s),
            }
            for s in result.adopted
        ],
        "already": result.already,
        "refused": [
            {"step": s, "problem": _adopt_cli_words(p)} for s, p in sorted(result.refused.items())
        ]
        + [{"step": None, "name": n, "problem": p} for n, p in sorted(result.unreadable.items())],
        "seconds": seconds,
        # Why the command exits non-zero (null when it exits 0): the error line on stderr.
        "problem": problem,
    }


#: The library's advice in Python terms -> the ``adopt`` command's flags.
_ADOPT_CLI_WORDS = (
    ("pass run_id= with the run to adopt into", "pass --run-id RUN with the run to adopt into"),
    ("Omit run_id, or pass the recorded one", "Omit --run-id, or pass the recorded one"),
    (' (framework="dcp")', ""),
)


def _adopt_cli_words(text: str) -> str:
    """``text`` (an error of ``adopt``) with the Python parameters it advises replaced
    by the command line's flags."""
    for python, flags in _ADOPT_CLI_WORDS:
        text = text.replace(python, flags)
    return without_takeover_advice(text)


def _adopt_problem(args: argparse.Namespace, result: Any) -> str | None:
    """Why ``adopt`` exits 1 (a checkpoint refused, or nothing to adopt), or None."""
    if result.refused:
        first = min(result.refused)
        return _adopt_cli_words(
            f"{len(result.refused) + len(result.unreadable)} checkpoint(s) not adopted (step(s) "
            f"{', '.join(map(str, sorted(result.refused)))}); step {first}: "
            f"{result.refused[first]}. Nothing was written for them; resume ignores them"
        )
    if result.unreadable:
        name, why = sorted(result.unreadable.items())[0]
        return (
            f"{len(result.unreadable)} checkpoint(s) not adopted: {name}: {why.rstrip('.')}. "
            "Nothing was "
            "written for them; a resume from this directory takes the newest adopted one, "
            "which may be older"
        )
    if result.adopted or result.already:
        return None
    own = os.path.basename(str(result.root).rstrip("/"))
    one = (
        f" ({own} is named like one checkpoint folder itself: pass the directory that holds it)"
        if parse_checkpoint_name(own) is not None or own.startswith("checkpoint_")
        else ""
    )
    if args.framework == "generic":
        return (
            f"nothing to adopt: {result.root} holds no folder named checkpoint-<N>{one}; "
            "the generic rule takes only folders named so: rename each checkpoint folder "
            "to checkpoint-<its step> first"
        )
    return (
        f"nothing to adopt: {result.root} holds no checkpoint folder of a known framework "
        "(checkpoint-<N> of the Trainer, checkpoints/checkpoint_<i> of Accelerate, "
        f"Lightning's .ckpt files){one}; --framework generic adopts other checkpoint-<N> folders"
    )


# ---------------------------------------------------------------------- arguments
# ---------------------------------------------------------------------- drain
def _open_target(text: str, options: Sequence[str] | None) -> Storage:
    """The persistent tier of ``drain``: like ROOT, but it may be empty or new (a
    directory is created, an empty object-store prefix is a fresh tier)."""
    if is_url(text):
        return open_storage(text, _storage_options(options) or None)
    if options:
        raise CliError("--to-storage-option applies to URL targets (s3://, ...)", EXIT_USAGE)
    return open_storage(_local_path(text))


def _check_target(fast: Storage, slow: Storage, timeout_s: float) -> None:
    """Refuse (exit 2) a local ``--to`` that does not exist, and one that records
    another run than ROOT, before anything is copied. The persistent tier's run file
    is read within ``timeout_s``: one that does not answer is left to the lock check,
    which says so (exit 2)."""
    path = slow.local_path("")
    if path is not None and not posix.is_dir(path):
        # It was created, parents and all: a mistyped or unmounted --to took the steps
        # onto this node's disk, and drain said they were replicated. A tiered job
        # creates its persistent tier when it starts, so it exists.
        raise CliError(
            f"--to {path} does not exist (check the path, and that its filesystem is "
            f"mounted); to drain into a new directory, create it first (mkdir -p {path})",
            EXIT_USAGE,
        )
    try:
        here = catalog.recorded_run_id(fast)
        there = answer_within(
            timeout_s, f"the run file of {slow.url()}", lambda: catalog.recorded_run_id(slow)
        )
    except CheckpointError:
        return  # torn, or no answer: the tiers' own start and lock check say more
    if here is not None and there is not None and here != there:
        # Its steps landed among that run's checkpoints, with a warning worded for a
        # training job ("this run starts from scratch beside them"), and exit 0.
        raise CliError(
            f"{slow.url()} is the persistent tier of run {there!r}, and {fast.url()} holds "
            f"run {here!r}: drain copies a run into its own persistent tier. Check --to",
            EXIT_USAGE,
        )


def cmd_drain(args: argparse.Namespace) -> int:
    coord, owned = _drain_group()
    try:
        return _drain(args, coord)
    finally:
        if owned:  # this process made the group: leave it torn down, as torchrun asks
            import torch.distributed as dist

            dist.destroy_process_group()


def _drain(args: argparse.Namespace, coord: Any) -> int:
    from .tiered import Tier, TieredCheckpointManager, check_tiers_separate

    missing = False
    try:
        fast = _open_root(args.root, args.storage_option)
    except _RootMissing as exc:
        # A job that ended (or was killed) before its first save on this node never
        # created ROOT: nothing can be waiting for the persistent tier. A mistyped ROOT
        # reads the same, so exit 0 only when asked.
        if not args.missing_ok:
            raise CliError(
                f"{exc}; if the job ended before its first save on this node, there is "
                "nothing to drain: --missing-ok makes that exit 0",
                exc.code,
            ) from None
        fast, missing = exc.open(), True
    if not missing:
        _refuse_one_checkpoint(fast, "drain")
    slow = _open_target(args.to, args.to_storage_option)
    try:
        check_tiers_separate(fast, slow)
    except ValueError as exc:
        raise CliError(f"{exc}: pass another --to", EXIT_USAGE) from None
    if missing and coord is None:
        _drain_outcome(args, fast, slow, None, root_missing=True)
        return EXIT_OK
    names = fast.listdir("") if coord is None else None
    if names is not None and all(parse_checkpoint_name(n) is None for n in names):
        # No checkpoint at all: nothing to copy, and nothing written on either tier.
        _drain_outcome(args, fast, slow, None, root_missing=False)
        return EXIT_OK
    deadline = time.monotonic() + args.timeout  # every wait below counts against it
    _check_target(fast, slow, args.timeout)
    if missing and not args.json:
        # Under torchrun it still takes part: the other nodes' steps need every node.
        print(f"{fast.url()} does not exist: this node takes part with an empty tier 0")
    done: list[dict[str, Any]] = []
    last = [time.monotonic()]

    def on_commit(tier: int, info: CheckpointInfo) -> None:
        if tier != 1:
            return
        now = time.monotonic()
        doc = {"step": info.step, "size_bytes": info.size_bytes, "seconds": now - last[0]}
        last[0] = now
        done.append(doc)
        if not args.json:
            rate = _human_bytes(info.size_bytes / doc["seconds"] if doc["seconds"] > 0 else 0)
            print(
                f"{checkpoint_name(info.step)}: replicated and verified "
                f"({_human_bytes(info.size_bytes)}, {doc['seconds']:.2f} s, {rate}/s)",
                flush=True,
            )

    def check_locks() -> None:
        # Opening the tiers with the job's run id would take its lock over (a restarted
        # job does that): a live job's lock on either tier is a refusal first (exit 3).
        # The persistent tier's read counts against --timeout: an endpoint that never
        # answers must not hold drain for its client's minutes of retries.
        _check_lock(fast, "drain", force=args.force, dry_run=False)
        try:
            answer_within(
                deadline - time.monotonic(),
                f"the run lock of {slow.url()}",
                lambda: _check_lock(slow, "drain into", force=args.force, dry_run=False),
            )
        except StorageError as exc:
            raise CliError(
                f"cannot read the run lock of {slow.url()} ({exc}): nothing was copied; run "
                f"`{PROG} drain` again once it answers",
                EXIT_USAGE,
            ) from None

    if coord is None:
        check_locks()
    else:
        _agree(coord, "drain: run locks", check_locks, args.timeout)
    # No retention on either tier: drain copies, it never deletes. Several processes
    # (one per node, under torchrun): each node's ROOT is its own tier 0.
    mgr = TieredCheckpointManager(
        [Tier(fast), Tier(slow)],
        on_commit=on_commit,
        # What is left of --timeout (its start waits for tier 1 at most min(this,
        # 30 s)): the lock check above may have used some of it.
        timeout_s=max(deadline - time.monotonic(), 0.5),
        **({} if coord is None else {"coordinator": coord, "fast_domains": "per-host"}),
    )
    try:
        todo = mgr.replication_backlog()
        if not args.json:
            print(
                f"{fast.url()} -> {slow.url()}: "
                + (
                    f"{len(todo)} step(s) to check, copied where missing: {todo}"
                    if todo
                    else "checking"
                ),
                flush=True,
            )
        if todo:
            mgr.wait_replicated(timeout_s=max(deadline - time.monotonic(), 0.0))
    except CheckpointError:
        pass  # a failed step: reported below with the others
    finally:
        left = mgr.close(timeout_s=0)
    failed: dict[int, Any] = dict(mgr.replication_failures())
    error = mgr.last_replication_error
    below: list[int] = []
    if coord is not None:
        # Tier 1's commits are rank 0's (on_commit fires there): every node reports them.
        done = coord.broadcast("drain: replicated", done, src=0, timeout_s=args.timeout)
    if coord is None:
        # What the replicator does not look at: a step ROOT holds torn (not a
        # checkpoint there, so never queued), a step TO holds another copy of (two
        # copies of one root drained into one place), and steps below TO's newest that
        # TO lacks (never copied back: TO orders checkpoints by step).
        below = _drain_audit(fast, slow, mgr.run_id, failed)
    else:
        # The replicator takes only the steps every node holds: one that only some do
        # (a node whose disk was replaced lost its copy) stayed here, and drain said
        # "0 left", exit 0, as if all were replicated.
        failed.update(_stranded(fast, slow, mgr.run_id, failed))
    _drain_outcome(args, fast, slow, mgr.run_id, missing, done, failed, left, below)
    if failed:
        first = min(failed)
        raise CliError(
            f"{len(failed)} step(s) cannot be replicated ({sorted(failed)}); step {first}: "
            f"{failed[first]}"
        )
    if left:
        why = f"{type(error).__name__}: {error}" if error is not None else "time ran out"
        raise CliError(
            f"steps {left} did not reach {slow.url()} within {args.timeout:g} s ({why}); "
            f"they stay on {fast.url()}: run `{PROG} drain` again once it answers",
            EXIT_USAGE,
        )
    return EXIT_OK


def _drain_audit(fast: Storage, slow: Storage, run_id: str, failed: dict[int, Any]) -> list[int]:
    """After a single-process drain: add to ``failed`` each step of the run that ROOT
    holds corrupt and TO lacks, and each that TO holds another copy of; return the
    valid steps of ROOT below TO's newest that TO lacks (not copied, by design).

    Reads on TO one listing, its newest valid manifest, and the manifests of the steps
    ROOT holds: not every checkpoint of a persistent tier that keeps thousands."""
    here = {e.step: e for e in catalog.scan(fast, run_id=run_id) if e.step is not None}
    listed = catalog.listed_steps(slow)  # one listing of TO serves both reads below
    newest_there = next(
        (
            e.step
            for e in catalog.newest_first(slow, run_id=run_id, steps=listed)
            if e.status == "ok" and e.manifest is not None
        ),
        None,
    )
    named = [(step, name) for step, name in listed if step in here]
    there = {
        e.step: e.manifest
        for e in catalog.newest_first(slow, run_id=run_id, steps=named)
        if e.step is not None and e.status == "ok" and e.manifest is not None
    }
    below = []
    for step, e in sorted(here.items()):
        if step in failed:
            continue
        if e.status == "corrupt" and step not in there:
            failed[step] = f"ROOT's copy is corrupt, so it is not replicated: {e.problem}"
        elif e.status == "ok" and e.manifest is not None and step in there:
            if not catalog.is_replica(there[step], e.manifest):
                failed[step] = (
                    f"{slow.url(checkpoint_name(step))} is another copy of step {step} than "
                    f"{fast.url(checkpoint_name(step))} (different checksums): not replaced; "
                    "inspect both (two copies of one root drained into one place?)"
                )
        elif e.status == "ok" and newest_there is not None and step < newest_there:
            below.append(step)
    return below


def _stranded(
    fast: Storage, slow: Storage, run_id: str, failed: Mapping[int, Any]
) -> dict[int, str]:
    """After a drain on several nodes: the valid steps of this node's ROOT that TO lacks
    and that are newer than TO's newest, each with why it was not replicated."""
    listed = catalog.listed_steps(slow)
    newest = next(
        (
            e.step
            for e in catalog.newest_first(slow, run_id=run_id, steps=listed)
            if e.status == "ok" and e.manifest is not None
        ),
        None,
    )
    there = {step for step, _ in listed}
    return {
        e.step: (
            f"{fast.url(checkpoint_name(e.step))} is not on every node's tier 0 (a node "
            "whose disk was replaced lost its copy), so it cannot be replicated from the "
            "nodes' tier 0; start the job again on these tiers with peers=: it restores "
            "the newest such step from the peer copies and replicates it"
        )
        for e in catalog.scan(fast, run_id=run_id)
        if e.status == "ok"
        and e.step is not None
        and e.step not in failed
        and e.step not in there
        and (newest is None or e.step > newest)
    }


def _drain_outcome(
    args: argparse.Namespace,
    fast: Storage,
    slow: Storage,
    run_id: str | None,
    root_missing: bool,
    done: Sequence[dict[str, Any]] = (),
    failed: Mapping[int, BaseException | str] | None = None,
    left: Sequence[int] = (),
    below: Sequence[int] = (),
) -> None:
    """``drain``'s report: the JSON document, or one line per failed step and a summary
    (for a ROOT that does not exist, with ``--missing-ok``, that it had nothing)."""
    failed = failed or {}
    if args.json:
        _emit_json(
            {
                "schema_version": JSON_SCHEMA_VERSION,
                "command": "drain",
                "root": fast.url(),
                "to": slow.url(),
                "run_id": run_id,
                "root_missing": root_missing,
                "replicated": list(done),
                "failed": [{"step": s, "problem": str(e)} for s, e in sorted(failed.items())],
                "left": list(left),
                "not_copied_below_newest": list(below),
                "ok": not failed and not left,
            }
        )
        return
    if root_missing and not done and not failed and not left:
        print(f"{fast.url()} does not exist: nothing to drain (no step was saved there)")
        return
    for s, e in sorted(failed.items()):
        print(f"{checkpoint_name(s)}: NOT REPLICATED: {e}", flush=True)
    if below:
        print(
            f"not copied: step(s) {list(below)} of {fast.url()} are below the newest step on "
            f"{slow.url()} and missing there (its retention removed them, or they were "
            "deleted): a root orders checkpoints by step, so drain never copies them back"
        )
    print(
        f"{slow.url()}: {len(done)} replicated, {len(failed)} failed, {len(left)} left "
        f"on {fast.url()}"
    )


def _drain_group() -> tuple[Any, bool]:
    """Under torchrun (``WORLD_SIZE`` > 1), one ``drain`` process per node: the job's
    coordinator, the process group initialised from the environment (gloo) unless the
    caller did, and whether this call initialised it. None for a single process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None, False
    import torch.distributed as dist

    from .coordination import TorchDistributedCoordinator

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo")
    return TorchDistributedCoordinator(), owned


def _named_refusals(refusals: list[tuple[int, str] | None]) -> list[tuple[int, tuple[int, str]]]:
    return [(r, got) for r, got in enumerate(refusals) if got is not None]


def _agree(coord: Any, key: str, check: Callable[[], None], timeout_s: float) -> None:
    """Run ``check`` on every process; if it refused on any, every process refuses
    alike (the first refusal's exit status, each refusal named by its rank)."""
    refusal: tuple[int, str] | None = None
    try:
        check()
    except CliError as exc:
        refusal = (exc.code, str(exc))
    named = gather_summary(coord, key, refusal, _named_refusals, timeout_s=timeout_s)
    if named:
        text = "; ".join(f"rank {r}: {msg}" for r, (_, msg) in named)
        raise CliError(text, named[0][1][0])


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (and exit 2), like every
    other error of this command."""

    def error(self, message: str) -> NoReturn:
        # The line starts with "atomic-checkpoint: error:" already; a subcommand's
        # parser adds its name ("list: ...").
        where = self.prog.removeprefix(PROG).strip()
        line = f"{where + ': ' if where else ''}{message} (see `{self.prog} --help`)"
        _error_line(line)
        _USAGE_ERROR.update(command=where.split(" ")[0] or None, message=line)
        raise SystemExit(EXIT_USAGE)


#: The usage error the parser reported, for ``--json`` (``_main``).
_USAGE_ERROR: dict[str, Any] = {}


class _CommandParser(_Parser):
    """A command's parser: its positionals may come after its options (``verify ROOT
    --quiet 2``, ``adopt ROOT --framework generic 100 200``). Plain argparse matches
    optional positionals (STEP) greedily with ROOT, so a STEP after an option was an
    "unrecognized argument"; ``parse_intermixed_args`` does this right but refuses a
    parser with subcommands, so the subcommand parsers (which have none) use it when the
    main parser hands them their arguments."""

    _intermixing = False

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        if self._intermixing:  # parse_known_intermixed_args's own passes (up to 3.12)
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def _ascii_digits(text: str) -> bool:
    """Only ASCII digits: ``str.isdigit`` also takes ``"٣"`` (Arabic-Indic three) and
    ``"³"``, which a STEP must not be read as."""
    return text.isascii() and text.isdigit()


def _step_arg(text: str) -> int:
    if not _ascii_digits(text):
        raise argparse.ArgumentTypeError(f"invalid step {text!r}: a non-negative integer")
    try:
        return validate_step(int(text))
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count_arg(text: str) -> int:
    if not _ascii_digits(text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: an integer >= 1")
    return int(text)


def _seconds_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: seconds > 0")
    return value


_TIER_HELP = (
    "another tier of ROOT's run (a TieredCheckpointManager's persistent tier, a directory or "
    "a URL with credentials from the environment); repeatable: shows which tiers (0: ROOT, "
    "then each --tier in order) hold each step"
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``atomic-checkpoint`` (also used for the docs)."""
    fmt = argparse.RawDescriptionHelpFormatter
    parser = _Parser(
        prog=PROG,
        description=(
            "Inspect and maintain an atomic-checkpoint root: list, verify, clean, inspect "
            "and prune checkpoints."
        ),
        epilog=_EPILOG,
        formatter_class=fmt,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    # -v before or after COMMAND: the subcommands' copy must not reset the count given
    # before COMMAND, so its default is SUPPRESS.
    verbosity = _CommandParser(add_help=False)
    for target, default in ((parser, 0), (verbosity, argparse.SUPPRESS)):
        target.add_argument(
            "-v",
            "--verbose",
            action="count",
            default=default,
            help="log what the library does (-vv: debug, and tracebacks for internal errors)",
        )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_CommandParser)
    sub.required = True

    def command(name: str, help_text: str, prose: str, *examples: str) -> argparse.ArgumentParser:
        lines = "\n".join(f"  {PROG} {name} {e}" for e in examples)
        heading = "example" if len(examples) == 1 else "examples"
        p = sub.add_parser(
            name,
            help=help_text,
            description=f"{textwrap.fill(prose, width=79)}\n\n{heading}:\n{lines}",
            parents=[verbosity],
            formatter_class=fmt,
        )
        p.add_argument(
            "root",
            metavar="ROOT",
            help="the checkpoint root: a directory, or a URL such as s3://bucket/prefix",
        )
        p.add_argument(
            "--storage-option",
            action="append",
            metavar="KEY=VALUE",
            help="for URL roots: an fsspec storage option (VALUE as JSON if it parses), "
            "e.g. anon=true; repeatable",
        )
        return p

    def finish(
        p: argparse.ArgumentParser,
        func: Callable[[argparse.Namespace], int],
        *,
        all_runs: str | None = None,
        tier: bool = False,
        dry_run: str | None = None,
        force: str | None = None,
    ) -> None:
        """The options several commands share, in one order, then the command's function."""
        if all_runs:
            p.add_argument("--all-runs", action="store_true", help=all_runs)
        if tier:
            p.add_argument("--tier", action="append", metavar="ROOT2", help=_TIER_HELP)
            p.add_argument(
                "--tier-storage-option",
                action="append",
                metavar="KEY=VALUE",
                help="an fsspec storage option for the URL --tier(s), as --storage-option "
                "is for ROOT; repeatable",
            )
        if dry_run:
            p.add_argument("--dry-run", action="store_true", help=dry_run)
        if force:
            p.add_argument("--force", action="store_true", help=force)
        if func is not cmd_drain:  # drain's --timeout bounds its wait for TO (its own)
            p.add_argument(
                "--timeout",
                dest="give_up_s",
                type=_seconds_arg,
                default=None,
                metavar="S",
                help="give up after S seconds (exit 2): for a store that may stop "
                "answering, whose client retries for many minutes (default: no limit)",
            )
        p.add_argument("--json", action="store_true", help="one JSON document on stdout")
        p.set_defaults(func=func, parser=p)

    p = command(
        "list",
        "table of checkpoints, pending saves and foreign entries",
        "Show every entry of ROOT: step, commit time (local), size, metrics, and status "
        "(ok, corrupt, pending, foreign) with the problem of each non-ok entry. Checks "
        "presence and sizes, not checksums (use verify). Exits 0 even when entries are "
        "corrupt.",
        "/ckpt/run1",
        "/ckpt/run1 --json",
    )
    finish(
        p,
        cmd_list,
        all_runs="validate and show the checkpoints of every run, not only ROOT's recorded run",
        tier=True,
    )

    p = command(
        "verify",
        "recompute every checksum; exit 1 on any problem",
        "Read every byte of every checkpoint in ROOT (or only STEP), compare "
        "sizes and checksums with the manifest, and check each state file's header as "
        "restore does (a header it rejects is CORRUPT). Prints a line per checkpoint, ok or "
        "CORRUPT: <problem>; exits 1 if any checkpoint fails (or there is none), 2 if "
        "ROOT does not exist. Every checkpoint-<step> entry of ROOT counts: one with no "
        "readable manifest (torn copy, another tool's directory, symlink, crashed "
        "object-store save) is NOT A CHECKPOINT and fails verify, unless it is a save in "
        "progress of the live job holding the run lock (--json: skipped, in_progress "
        "true). Other runs' checkpoints are verified too, each line naming its run. Shows "
        "a progress bar (bytes/s) on stderr for large checkpoints when stderr is a terminal.",
        "/ckpt/run1",
        "/ckpt/run1 4000 --quiet",
        "/ckpt/run1 --json --progress 2>verify.log",
    )
    p.add_argument("step", metavar="STEP", nargs="?", type=_step_arg, help="only this step")
    p.add_argument("-q", "--quiet", action="store_true", help="print only problems")
    _progress_option(p)
    finish(
        p,
        cmd_verify,
        all_runs="no longer needed: the checkpoints of every run in ROOT are verified",
        tier=True,
    )

    p = command(
        "clean",
        "remove abandoned pending and trash data",
        "Remove what crashed saves and interrupted deletions left: the entries of "
        "ROOT/.pending/ and ROOT/.trash/ the library named (checkpoint-<step>.<token>; "
        "other files there stay), and empty checkpoint-<step> directories (a delete cut "
        "short after its last file). Committed checkpoints are never touched. "
        "Refuses (exit 3) while a live job holds the run lock on ROOT. With --force it "
        "cleans anyway and removes the run lock: the way to free a root whose job is "
        "known to be dead before its lease runs out (if that job is alive after all, it "
        "can no longer commit or delete).",
        "/ckpt/run1 --dry-run",
        "/ckpt/run1",
    )
    finish(
        p,
        cmd_clean,
        dry_run="show what would be removed",
        force="clean even though a live job holds the run lock (that job can then no "
        "longer commit or delete: restart it)",
    )

    p = command(
        "inspect",
        "manifest, files and tensor shapes of one checkpoint",
        "Show the manifest of checkpoint STEP (step, run, commit sequence, time, world "
        "size, state kind, metrics, metadata), its files (size, checksum, rank), and "
        "the tensor names, dtypes and shapes of its .safetensors files, read from their "
        "headers (no tensor data is read, no code from the checkpoint runs). Exits 1 if "
        "the checkpoint is corrupt (a file missing or of another size, or a state file "
        "header that restore rejects), or if STEP is not a checkpoint.",
        "/ckpt/run1 4000",
        "/ckpt/run1 4000 --json",
    )
    p.add_argument("step", metavar="STEP", type=_step_arg, help="the checkpoint's step")
    finish(p, cmd_inspect, tier=True)

    p = command(
        "prune",
        "apply a retention policy by hand",
        "Delete this run's committed checkpoints that no given policy keeps (a "
        "checkpoint is kept if any policy keeps it); the newest is never deleted, "
        "corrupt and foreign entries are never touched. Before anything is deleted, every "
        "byte of every checkpoint kept is verified (--quick: of the newest one, what a "
        "resume would load; the others by size): one that fails is set aside, never "
        "deleted, not counted as kept, and the policy is applied to the others. Each "
        "deletion un-commits first (renames into ROOT/.trash/), then deletes. Refuses "
        "(exit 3) while a live job holds the run lock, and holds it while it runs, so no "
        "job starts in the middle of a prune.",
        "/ckpt/run1 --keep-last 3 --dry-run",
        "/ckpt/run1 --keep-last 2 --keep-best 1 --metric eval_loss --mode min --pin 10000",
    )
    p.add_argument("--keep-last", type=_count_arg, metavar="N", help="keep the N newest")
    p.add_argument("--keep-best", type=_count_arg, metavar="K", help="keep the K best by --metric")
    p.add_argument("--metric", metavar="NAME", help="metric for --keep-best (eval_loss)")
    p.add_argument(
        "--mode", choices=("min", "max"), help="min: lower is better (default); max: higher"
    )
    p.add_argument(
        "--keep-every", type=_count_arg, metavar="K", help="keep steps that are multiples of K"
    )
    p.add_argument(
        "--pin",
        type=_step_arg,
        nargs="+",
        action="extend",
        metavar="STEP",
        default=[],
        help="keep these steps (--pin 1000 5000, or --pin 1000 --pin 5000)",
    )
    p.add_argument("--run-id", metavar="RUN", help="prune this run (default: ROOT's run)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="verify every byte of the newest checkpoint kept only (the others by size): "
        "faster on large roots, but a bit-rotted older one is then counted as kept",
    )
    _progress_option(p, "of the verification of the checkpoints kept")
    finish(
        p,
        cmd_prune,
        dry_run="show the plan, delete nothing",
        force="prune even though a live job holds the run lock (that job can then no "
        "longer commit or delete: restart it)",
    )

    p = command(
        "adopt",
        "record a framework's existing checkpoints as committed checkpoints",
        "Check the checkpoint folders a framework wrote without atomic-checkpoint "
        "(checkpoint-<N> of the Hugging Face Trainer, checkpoints/checkpoint_<i> of "
        "Accelerate) with the framework's own completeness rule, and record each complete "
        "one with a manifest marked adopted (checksums taken now), so that resume, verify "
        "and retention use it. A torn folder is refused with the reason and left as it is; "
        "nothing is ever moved or deleted. Idempotent. Takes the run lock (exit 3 while a "
        "live job holds it). Exits 1 if any checkpoint asked for (by default: every "
        "folder found) is refused, or if there is nothing to adopt.",
        "out/ --dry-run",
        "out/",
        "out/ 500 1000 --framework hf",
    )
    p.add_argument(
        "step",
        metavar="STEP",
        nargs="*",
        type=_step_arg,
        help="only these steps (default: every checkpoint folder found)",
    )
    p.add_argument(
        "--framework",
        default="auto",
        metavar="NAME",
        help="whose completeness rule applies: auto (from the folder names; default), hf, "
        "accelerate, lightning, dcp (only when named), or generic (any readable files: only "
        "when asked for)",
    )
    p.add_argument(
        "--run-id", metavar="RUN", help="the run to record them under (default: ROOT's run)"
    )
    finish(p, cmd_adopt, dry_run="check and report, write nothing")

    p = command(
        "drain",
        "finish a tiered job's replication to the persistent tier",
        "Copy every step committed on ROOT (a TieredCheckpointManager's fast tier) that "
        "the persistent tier TO lacks, oldest first, as the job's replicator would: each "
        "file's checksum is checked as it is read from ROOT and again once it arrived, "
        "and the step is committed on TO only if both match the save's manifest. Never "
        "deletes (no retention on either tier). Takes ROOT's run lock: exit 3 while the "
        "job is alive. Exit 1 if a step cannot be replicated (ROOT's copy is corrupt, or "
        "TO holds another copy), 2 if TO did not answer within --timeout (the steps stay "
        "on ROOT; run it again).",
        "/local/run1 --to /nfs/run1",
        "/local/run1 --to s3://bucket/run1 --timeout 600 --json",
    )
    p.add_argument(
        "--to", required=True, metavar="PERSISTENT", help="the persistent tier (dir or URL)"
    )
    p.add_argument(
        "--to-storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="an fsspec storage option for a URL --to; repeatable",
    )
    p.add_argument(
        "--timeout",
        type=_seconds_arg,
        default=3600.0,
        metavar="S",
        help="give up after S seconds without finishing (default 3600)",
    )
    p.add_argument(
        "--missing-ok",
        action="store_true",
        help="a ROOT that does not exist (the job ended before its first save on this "
        "node) is nothing to drain: exit 0, not 2; for scripts that drain every node",
    )
    finish(p, cmd_drain, force="drain even though a live job holds a run lock (that job is fenced)")
    return parser


def _setup_logging(verbose: int) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_VisibleFormatter(f"{PROG}: %(levelname)s: %(message)s"))
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.DEBUG if verbose >= 2 else logging.INFO if verbose else logging.WARNING)


def _within(limit: float, func: Callable[[argparse.Namespace], int], args: Any) -> int:
    """``func(args)``, or a ``CliError`` (exit 2) once it has run ``limit`` seconds
    (``--timeout``). The command goes on in a daemon thread until the process exits,
    as if the process had been killed there: what it changed is as safe as after a
    crash (a delete un-commits before it deletes; ``clean`` removes what is left)."""

    def late() -> CliError:
        global _ABANDONED
        _ABANDONED = True
        waits = catalog.overwrites_waited_for()
        if waits:
            # Not the storage: the command was waiting (up to REPLACE_WAIT_S) for an
            # overwrite stopped between its two renames to put its step back.
            steps = ", ".join(str(step) for _, step in waits)
            return CliError(
                f"{args.command} {args.root} did not finish within {limit:g} s (--timeout): "
                f"it was waiting for an overwrite of step(s) {steps} (stopped between its "
                f"two renames) to put the step back, up to {catalog.REPLACE_WAIT_S:g} s. "
                f"Run it again with a --timeout above that; `{PROG} clean` settles an "
                "overwrite whose writer is gone",
                EXIT_USAGE,
            )
        return CliError(
            f"{args.command} {args.root} did not finish within {limit:g} s (--timeout): the "
            "storage answered too slowly, not at all, or only with errors its client retries "
            "(an endpoint that is down, hung or throttling: HTTP 503). "
            "Nothing is left half-done that the next command cannot handle: run it again, "
            "with a longer --timeout, once the storage answers",
            EXIT_USAGE,
        )

    return answer_within(limit, args.command, lambda: func(args), late=late)


def _tolerant_output() -> None:
    """Write what the terminal's encoding cannot show as escapes: a root named in
    Japanese under a Latin-1 locale made `verify` and `list` fail with an "internal
    error" (exit 1, read as "a checkpoint is corrupt" by `verify ROOT && upload`)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)  # a TextIOWrapper's
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):  # pragma: no cover - a closed or odd stream
                pass


#: Set when ``--timeout`` gave up on the command (``_within``): it goes on in a daemon
#: thread, inside a storage call that does not answer.
_ABANDONED = False


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see the module docstring).

    Run as the program (``argv`` None: the ``atomic-checkpoint`` script, ``python -m
    atomic_checkpoint``), a command that ``--timeout`` gave up on ends the process
    here, with its exit status: Python's own exit waited for the threads still inside
    the storage call (a thread pool's workers, the run lock's release at exit), and an
    `adopt` frozen half way never exited."""
    if signal.getsignal(signal.SIGINT) is _early.interrupted_while_importing:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt again
    stdout = sys.stdout
    try:
        _tolerant_output()
        sys.stdout = _VisibleStream(stdout)
        code = _main(argv)
    except KeyboardInterrupt:
        # Before the command ran (its parser being built, a lazy import): 130 too.
        _error_line("interrupted")
        code = EXIT_INTERRUPTED
    finally:
        if isinstance(sys.stdout, _VisibleStream):
            sys.stdout = stdout
    if _ABANDONED and argv is None:
        # As if killed there: what the command changed is as safe as after a crash.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    return code


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    _USAGE_ERROR.clear()
    _EMITTED["done"] = False
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        code = exc.code if isinstance(exc.code, int) else EXIT_USAGE
        # A script asked for JSON: bad arguments are a document too.
        words = sys.argv[1:] if argv is None else list(argv)
        return _usage_failed(None, code) if "--json" in words else code
    verbose = int(getattr(args, "verbose", 0) or 0)
    _setup_logging(verbose)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        limit = getattr(args, "give_up_s", None)
        return func(args) if limit is None else _within(limit, func, args)
    except SystemExit as exc:  # parser.error from inside a command
        code = exc.code if isinstance(exc.code, int) else EXIT_USAGE
        return _usage_failed(args, code) if getattr(args, "json", False) else code
    except CliError as exc:
        return _failed(args, exc, str(exc), exc.code)
    except LockHeldError as exc:
        return _failed(args, exc, str(exc), EXIT_LOCKED)
    except StorageError as exc:
        return _failed(args, exc, str(exc), EXIT_USAGE)
    except CheckpointError as exc:
        return _failed(args, exc, str(exc), EXIT_PROBLEM)
    except KeyboardInterrupt as exc:
        return _failed(args, exc, "interrupted", EXIT_INTERRUPTED)
    except BrokenPipeError:
        # The reader of stdout went away (`... | head`): stop quietly, and keep Python
        # from complaining again when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PROBLEM
    except OSError as exc:
        return _failed(args, exc, f"{type(exc).__name__}: {exc}", EXIT_USAGE)
    except Exception as exc:
        if verbose >= 2:
            traceback.print_exc()
        return _failed(
            args,
            exc,
            f"internal error: {type(exc).__name__}: {exc} (a bug in atomic-checkpoint "
            f"{__version__}; run with -vv for the traceback and report it)",
            EXIT_PROBLEM,
        )
