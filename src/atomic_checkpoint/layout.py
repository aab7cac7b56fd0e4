"""Names of checkpoint and pending locations (pure: no I/O).

Layout under a checkpoint root::

    ROOT/
      checkpoint-<step>/                    a committed checkpoint (rename strategy)
        checkpoint.manifest.json            the commit record, written last
        rank-00000.safetensors              per-rank state (or replicated.safetensors)
        ...                                 files written through ``saving()``
      .pending/checkpoint-<step>.<attempt>/ a save in progress (never a checkpoint)
      .trash/checkpoint-<step>.<token>/     un-committed by retention, being deleted
      .trash/checkpoint-<step>.<attempt>.replaced/
                                            the copy an overwrite replaced (no atomic
                                            exchange); <attempt> names the new copy
      .atomic-checkpoint/                   run identity and lock

Marker strategy (object stores), inside ``checkpoint-<step>/``::

      checkpoint.pending-<attempt>.json     a save in progress (written first)
      attempt-<attempt>/rank-00000.safetensors
                                            that save's data
      checkpoint.manifest.json              the commit record, created once, last

Steps are parsed with a strict regex: ``checkpoint-007`` and ``checkpoint-1.5`` are not
ours, and ordering is always by the integer step, never by string or mtime
(FAILURE_MODES B1, B2).

The names above are the ones the protocol works with everywhere. One other layout keeps
a framework's own convention on disk: Accelerate's automatic naming, where ROOT is the
project directory (recorded in ``ROOT/.atomic-checkpoint/layout.json``)::

    ROOT/                                   Accelerate's project_dir
      checkpoints/checkpoint_<step>/        a committed checkpoint (name: checkpoint-<step>)
      .pending/  .trash/  .atomic-checkpoint/

Accelerate's ``save_state()``/``load_state()`` list ``checkpoints/`` and sort every
entry by its digits, so nothing of ours but committed checkpoints may sit there.
``storage.project.ProjectStorage`` maps the protocol's names to these; the naming here
is pure, the same strict regex with ``_`` in place of ``-``.
"""

from __future__ import annotations

import json
import re
import socket
import time
import uuid

MANIFEST_NAME = "checkpoint.manifest.json"
PENDING_DIR = ".pending"
TRASH_DIR = ".trash"
META_DIR = ".atomic-checkpoint"
#: A tiered job's copies of other nodes' files (``peers=``), under each node's tier 0.
PEERS_DIR = ".peers"
#: The directories of ROOT that are the library's own, never checkpoints or foreign.
OWN_DIRS = (PENDING_DIR, TRASH_DIR, META_DIR, PEERS_DIR)
CHECKPOINT_PREFIX = "checkpoint-"

_CHECKPOINT_RE = re.compile(r"^checkpoint-(0|[1-9][0-9]{0,18})\Z")
_PENDING_RE = re.compile(r"^checkpoint-(0|[1-9][0-9]{0,18})\.([0-9a-f]{8,32})\Z")
_REPLACED_RE = re.compile(r"^checkpoint-(0|[1-9][0-9]{0,18})\.([0-9a-f]{8,32})\.replaced\Z")

#: What the integrations that commit one name by renaming a sibling onto it (Lightning's
#: ``.ckpt`` files, DCP's path-style checkpoints) write first: ``.<name>.<token>.pending``.
_SIBLING_PENDING_RE = re.compile(r"^\.(?P<final>.+)\.[0-9a-f]{16}\.pending\Z")

#: The sidecar manifest of a Lightning ``.ckpt`` file (``integrations.lightning``):
#: ``<name>.ckpt`` + this.
LIGHTNING_MANIFEST_SUFFIX = ".manifest.json"
#: How many folders down a Lightning directory's ``.ckpt`` files are looked for: a ``/``
#: in a ``ModelCheckpoint`` filename (a metric logged as ``val/loss`` in
#: ``"{epoch}-{step}-{val/loss:.3f}"``) puts its files in sub-folders.
LIGHTNING_DEPTH = 3

#: The Accelerate layout: committed checkpoints are ``ROOT/checkpoints/checkpoint_<step>``.
LAYOUT_FILE = f"{META_DIR}/layout.json"
#: The run file: which run owns ROOT (``{"run_id": ..., "created_unix": ..., "host": ...}``).
RUN_FILE = f"{META_DIR}/run.json"
ACCELERATE_LAYOUT = "accelerate"
ACCELERATE_DIR = "checkpoints"
_ACCELERATE_RE = re.compile(r"^checkpoint_(0|[1-9][0-9]{0,18})\Z")


def validate_step(step: object) -> int:
    """Return ``step`` as an int, or raise TypeError/ValueError saying what is wrong.

    numpy and torch integer scalars are accepted when they convert exactly; bools,
    floats and strings are not (``"10"`` and ``10.0`` are almost always bugs).
    """
    if isinstance(step, (bool, float, str, bytes)) or _is_bool_scalar(step):
        raise TypeError(f"step must be a non-negative int, got {type(step).__name__} {step!r}")
    try:
        value = int(step)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise TypeError(
            f"step must be a non-negative int, got {type(step).__name__} {step!r}"
        ) from None
    if value != step:
        raise TypeError(f"step must be a non-negative int, got {type(step).__name__} {step!r}")
    if value < 0:
        raise ValueError(f"step must be a non-negative int, got {value}")
    if value >= 2**63:
        # The format's integers are int64 (docs/format.md): a reader in another
        # language could not hold a larger step.
        raise ValueError(f"step {value} is too large (at most 2**63 - 1, the largest int64)")
    return value


def _is_bool_scalar(value: object) -> bool:
    """A numpy or torch bool (``np.bool_(True)``, ``torch.tensor(True)``): ``int()``
    makes 1 of it exactly, as of Python's own bool, and it is refused as that is."""
    dtype = getattr(value, "dtype", None)
    return dtype is not None and str(dtype) in ("bool", "torch.bool")


def checkpoint_name(step: int) -> str:
    """``checkpoint-<step>``, the name the Hugging Face Trainer also resumes from."""
    return f"{CHECKPOINT_PREFIX}{validate_step(step)}"


def parse_checkpoint_name(name: str) -> int | None:
    """The step of a committed-checkpoint directory name, or None if the name is not ours."""
    m = _CHECKPOINT_RE.match(name)
    return int(m.group(1)) if m else None


def accelerate_name(step: int) -> str:
    """``checkpoint_<step>``, the folder name of Accelerate's automatic naming."""
    return f"checkpoint_{validate_step(step)}"


def parse_accelerate_name(name: str) -> int | None:
    """The step of an Accelerate-named folder (``checkpoint_<step>``), or None. As strict
    as :func:`parse_checkpoint_name`: ``checkpoint_007`` is not a step."""
    m = _ACCELERATE_RE.match(name)
    return int(m.group(1)) if m else None


def new_attempt_token() -> str:
    return uuid.uuid4().hex[:16]


def pending_name(step: int, attempt: str) -> str:
    """Name (inside ``.pending/``) of one save attempt of ``step``: unique per attempt."""
    return f"{checkpoint_name(step)}.{attempt}"


def parse_pending_name(name: str) -> tuple[int, str] | None:
    m = _PENDING_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def sibling_pending_name(name: str) -> str:
    """The pending sibling a save of ``name`` writes, then renames onto ``name`` (Lightning's
    ``.ckpt`` files, DCP's path-style checkpoints): hidden, unique per save, never loaded."""
    return f".{name}.{new_attempt_token()}.pending"


def parse_sibling_pending(name: str) -> str | None:
    """The final name of a pending sibling (``sibling_pending_name``), else None."""
    m = _SIBLING_PENDING_RE.match(name)
    return m.group("final") if m else None


def replaced_name(step: int, attempt: str) -> str:
    """Name (inside ``.trash/``) of the copy of ``step`` that the overwrite attempt
    ``attempt`` moved out of the namespace. Distinct from a retention un-commit
    (``checkpoint-<step>.<token>``): while ``.pending/checkpoint-<step>.<attempt>`` still
    exists the overwrite was interrupted between its two renames and one of the two
    copies must be put back; a retention un-commit never comes back."""
    return f"{pending_name(step, attempt)}.replaced"


def parse_replaced_name(name: str) -> tuple[int, str] | None:
    m = _REPLACED_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def is_own_entry(name: str) -> bool:
    """Whether ``name``, an entry of ``.pending/`` or ``.trash/``, is one this library
    makes there (``checkpoint-<step>.<token>``, with ``.replaced`` in ``.trash/``). Only
    those are removed as leftovers: a directory that was never a checkpoint root may
    have folders of these names holding a user's own files."""
    return _PENDING_RE.match(name) is not None or _REPLACED_RE.match(name) is not None


# Marker strategy (strategies.MarkerStrategy) names inside ``checkpoint-<step>/``: a save
# writes its in-progress marker first, its data under ``attempt-<token>/``, and the
# manifest last. A directory with a marker and no manifest is a save in progress or an
# abandoned one: "pending", never a checkpoint, and ours to sweep.
MARKER_PREFIX = "checkpoint.pending-"
MARKER_SUFFIX = ".json"
ATTEMPT_PREFIX = "attempt-"
_MARKER_RE = re.compile(r"^checkpoint\.pending-([0-9a-f]{8,32})\.json\Z")
_ATTEMPT_RE = re.compile(r"^attempt-([0-9a-f]{8,32})\Z")


def marker_name(attempt: str) -> str:
    """The in-progress marker of one marker-strategy save attempt."""
    return f"{MARKER_PREFIX}{attempt}{MARKER_SUFFIX}"


def attempt_dir_name(attempt: str) -> str:
    """The directory, inside ``checkpoint-<step>/``, that one attempt writes its data to."""
    return f"{ATTEMPT_PREFIX}{attempt}"


def parse_marker_name(name: str) -> str | None:
    """The attempt token of a marker file name, or None if the name is not a marker."""
    m = _MARKER_RE.match(name)
    return m.group(1) if m else None


def parse_attempt_dir(name: str) -> str | None:
    """The attempt token of an ``attempt-<token>`` directory name, or None."""
    m = _ATTEMPT_RE.match(name)
    return m.group(1) if m else None


def rank_state_file(rank: int) -> str:
    # State files sit at the top of the checkpoint, next to the manifest, so one fsync of
    # the checkpoint directory makes every entry durable (no per-subdirectory fsyncs).
    return f"rank-{rank:05d}.safetensors"


_RANK_STATE_FILE_RE = re.compile(r"^rank-([0-9]{5,})\.safetensors\Z")


def parse_rank_state_file(name: str) -> int | None:
    """The rank of ``rank_state_file(rank)`` (a file's last path component), or None."""
    m = _RANK_STATE_FILE_RE.match(name)
    return int(m.group(1)) if m else None


REPLICATED_STATE_FILE = "replicated.safetensors"
_STATE_FILE_RE = re.compile(r"^(rank-[0-9]{5,}|replicated)\.safetensors\Z")


def is_state_file(name: str) -> bool:
    """Whether ``name`` (a file's last path component) is one of the state files this
    library's saves write (``rank-<r>.safetensors``, ``replicated.safetensors``)."""
    return _STATE_FILE_RE.match(name) is not None


def validate_relative_path(path: object) -> str:
    """Check that a path listed in a manifest stays inside its checkpoint.

    Raises:
        ValueError: absolute paths, ``..``, backslashes, empty or ``.`` components, NUL.
    """
    if not isinstance(path, str) or not path:
        raise ValueError(f"file path must be a non-empty string, got {path!r}")
    if "\x00" in path or "\\" in path:
        raise ValueError(f"file path {path!r} contains a NUL or a backslash")
    if path.startswith("/") or re.match(r"^[A-Za-z]:", path):
        raise ValueError(f"file path {path!r} is absolute")
    parts = path.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise ValueError(f"file path {path!r} has a {part or 'empty'!r} component")
    return path


def new_run_id() -> str:
    """A fresh run id: ``run-<local date and time>-<8 hex digits>``."""
    return f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


def run_doc(run_id: str) -> bytes:
    """The content of ROOT's run file (:data:`RUN_FILE`)."""
    doc = {"run_id": run_id, "created_unix": time.time(), "host": socket.gethostname()}
    return json.dumps(doc).encode()
