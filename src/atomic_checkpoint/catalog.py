"""What is committed under a root: discovery and validation of checkpoints.

A name is a checkpoint only if it parses as ``checkpoint-<step>`` (strict) and its
manifest opens, parses and validates, and every listed file exists with its listed
size. "Committed?" is decided by *opening* the manifest, never by ``exists()``: on
network filesystems a renamed-away or deleted name keeps passing ``stat()`` for many
seconds on other clients, but ``open()`` asks the server (seen on sshfs).

Everything read here is untrusted (DESIGN invariant 9): an entry that is a symbolic link
is never a checkpoint (listed as foreign, "unsafe"), no file is read through a link,
and a manifest that cannot be read or parsed, whatever its shape, makes that one
checkpoint corrupt while the rest of the root is discovered.

Discovery reads what the answer needs, not the whole root: ``newest`` (``latest()``)
reads manifests newest first and stops at the first valid one, and a writable start
(``newest_valid``) the same way, reading the whole root only when nothing there is
valid; ``scan`` with a ``ManifestCache`` (``checkpoints()``, the rotation after each
save) reads again only the manifests that changed since they were validated, and checks
the files of the others with one ``stat`` each (on an object store, from one listing of
the root).
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import operator
import threading
import time
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from . import layout
from ._params import parameters_of
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitError,
    CorruptCheckpointError,
    StorageError,
    StoragePermissionError,
    UnsupportedSchemaError,
)
from .manifest import FileEntry, Hasher, Manifest, SharedManifest
from .storage import posix, visibility
from .storage.base import Storage
from .storage.temps import abandoned_temps, parse_temp_name

_T = TypeVar("_T")
log = logging.getLogger("atomic_checkpoint")

_VERIFY_CHUNK = 8 << 20
# Network filesystems: how long a size that disagrees with the manifest may take to
# show the truth before the file counts as corrupt.
_STALE_SIZE_WAIT_S = 3.0


def state_file(manifest: Manifest, name: str) -> FileEntry:
    """The entry of state file ``name`` (e.g. ``rank-00000.safetensors``): at the top of
    the checkpoint (rename strategy) or under the committed attempt's directory
    (marker strategy: ``attempt-<token>/rank-00000.safetensors``).

    Raises:
        CorruptCheckpointError: the manifest lists no such file.
    """
    found = [
        f
        for f in manifest.files
        if f.path == name
        or (
            f.path.count("/") == 1
            and f.path.endswith(f"/{name}")
            and layout.parse_attempt_dir(f.path.split("/", 1)[0])
        )
    ]
    if len(found) == 1:
        return found[0]
    return manifest.file(name)  # raises, naming the missing file


@dataclass(frozen=True)
class Entry:
    """One entry of a root, as ``atomic-checkpoint list`` shows it.

    ``status`` is ``ok`` (a valid checkpoint of this run, or of any run when no run is
    given), ``corrupt`` (ours, but fails validation), ``pending`` (a save in progress or
    abandoned), or ``foreign`` (a name or a run we do not own: never counted, never
    deleted).
    """

    name: str
    step: int | None
    status: str
    manifest: Manifest | None = None
    problem: str | None = None

    @property
    def unmanifested(self) -> bool:
        """A ``checkpoint-<step>`` folder without a manifest (``NO_MANIFEST``): another
        tool's checkpoint, or one torn before its manifest; adoptable, never resumed."""
        return self.status == "foreign" and self.problem == NO_MANIFEST


#: ``Entry.problem`` of a ``checkpoint-<step>`` directory with no manifest and no marker
#: of ours: another tool's checkpoint, or one that lost its manifest (not a link).
NO_MANIFEST = "no manifest"

#: ``Entry.problem`` of a file (a plain file, an object) named ``checkpoint-<step>``.
NOT_A_DIRECTORY = (
    "a file, not a checkpoint directory: restore and retention ignore it, but a script "
    "that copies checkpoint-* would take it; move it out of ROOT"
)


def read_manifest(storage: Storage, rel: str) -> Manifest:
    """Open and parse the manifest of checkpoint directory ``rel``.

    Raises:
        CheckpointNotFoundError: no manifest (not committed).
        CorruptCheckpointError: the manifest does not parse or validate.
    """
    where = storage.url(rel)
    # A checkpoint or manifest that is a symlink would make a checkpoint of whatever it
    # points to (another root's, which retention would then delete): refuse it before
    # reading a byte.
    check_inside(storage, rel, layout.MANIFEST_NAME)
    path = f"{rel}/{layout.MANIFEST_NAME}"
    # Bounded by the storage (``MAX_READ_BYTES``, refused by size before reading) and by
    # the parser (MAX_MANIFEST_BYTES); every parse failure is a CorruptCheckpointError.
    data = storage.read_bytes(path)
    try:
        manifest = Manifest.from_json_bytes(data, where=where)
    except CorruptCheckpointError:
        if storage.capabilities.coherent:
            raise
        manifest = _reread_stale_manifest(storage, path, where)
    expected = layout.parse_checkpoint_name(rel.rsplit("/", 1)[-1])
    if expected is not None and expected != manifest.step:
        raise CorruptCheckpointError(
            f"{where}: manifest says step {manifest.step} but the directory is step {expected}"
        )
    return manifest


def _reread_stale_manifest(storage: Storage, path: str, where: str) -> Manifest:
    """sshfs: a manifest replaced through another client (a step saved again) can read
    back as the new bytes cut to the old, cached size, which does not parse (seen under
    load: "Expecting ',' delimiter" at the old length). Refresh and re-read, with the
    same bound as for stale file sizes, before it counts as corrupt."""

    def parse() -> Manifest | CorruptCheckpointError:
        try:
            return Manifest.from_json_bytes(storage.read_bytes(path), where=where)
        except CorruptCheckpointError as exc:
            return exc

    got = _until_fresh(storage, path, parse, lambda v: isinstance(v, Manifest))
    if isinstance(got, CorruptCheckpointError):
        raise got
    return got


def _until_fresh(
    storage: Storage, path: str, probe: Callable[[], _T], fresh: Callable[[_T], bool]
) -> _T:
    """Network filesystems: drop this client's cached metadata of ``path`` and probe
    again until ``fresh(probe())``, for at most ``_STALE_SIZE_WAIT_S`` (one refresh is
    not always enough under load); returns the last probe."""
    storage.refresh(path)
    return visibility.until(storage, path, probe, fresh, _STALE_SIZE_WAIT_S)


_UNSAFE = "unsafe"


def is_link(storage: Storage, rel: str) -> bool:
    """Whether entry ``rel`` of a mounted root is a symbolic link. Such an entry is
    never a checkpoint (DESIGN invariant 9): ``ROOT/checkpoint-9 -> /elsewhere`` would
    make restore read, and retention delete, another root's data."""
    local = storage.local_path(rel)
    return local is not None and posix.is_link(local)


def check_inside(storage: Storage, rel: str, file_rel: str) -> None:
    """Refuse the checkpoint ``rel`` if it, or any path to ``file_rel`` inside it, is a
    symbolic link (links are never followed, wherever they point: DESIGN invariant 9);
    files that resolve outside their checkpoint; and files that are not regular files:
    opening a FIFO for reading blocks until a writer comes (never), a device reads
    forever."""
    base = storage.local_path(rel)
    if base is not None:
        posix.check_inside(base, file_rel, storage.url(rel))


def validate(
    storage: Storage,
    rel: str,
    manifest: Manifest,
    *,
    full: bool = False,
    progress: Callable[[int], None] | None = None,
    sizes: Mapping[str, int] | None = None,
) -> None:
    """Check every listed file: inside the checkpoint, present, right size; with
    ``full``, check each state file's header as ``restore``'s loader does
    (``_check_header``) and recompute checksums. ``progress`` is called with bytes verified so far.
    ``sizes``: file sizes from a listing of the checkpoint just taken (object stores:
    one listing instead of a request per file); a file it does not show at its listed
    size is asked for again.

    Raises:
        CorruptCheckpointError: naming the file and what differs.
    """
    where = storage.url(rel)
    done = 0
    buf = bytearray(_VERIFY_CHUNK) if full else None
    for entry in manifest.files:
        check_inside(storage, rel, entry.path)
        size = None if sizes is None else sizes.get(entry.path)
        if size != entry.size_bytes:
            size = storage.size(f"{rel}/{entry.path}")
        if size != entry.size_bytes and not storage.capabilities.coherent:
            # sshfs: a path deleted and re-created through another client (a step saved
            # again) keeps its old size in this client's cache until it is refreshed.
            path = f"{rel}/{entry.path}"
            size = _until_fresh(
                storage,
                path,
                functools.partial(storage.size, path),
                functools.partial(operator.eq, entry.size_bytes),
            )
        if size is None:
            raise CorruptCheckpointError(f"{where}: file {entry.path!r} is missing")
        if size != entry.size_bytes:
            raise CorruptCheckpointError(
                f"{where}: file {entry.path!r} is {size} bytes, manifest says {entry.size_bytes}"
            )
        if buf is None:
            continue
        # The header first: it is read alone, and a header no load accepts (a state
        # file that claims a sparse 10 TiB of data) is refused before hours of hashing.
        _check_header(storage, rel, entry)
        h = Hasher(manifest.checksum_algorithm)
        view = memoryview(buf)
        with storage.open_read(f"{rel}/{entry.path}") as f:
            done += h.consume(f, view, progress, done)
        if h.hexdigest() != entry.checksum:
            raise CorruptCheckpointError(
                f"{where}: file {entry.path!r} checksum {h.hexdigest()} does not match the "
                f"manifest ({entry.checksum}): the file is corrupt"
            )


def failed_validation(storage: Storage, step: int) -> CorruptCheckpointError | None:
    """Why this run's committed-looking ``checkpoint-<step>`` is no checkpoint (a file
    missing, or of another size: sizes only), or None if it validates or cannot be read.
    Step 1 of a save of that step without ``overwrite``, on the leader: a save that
    failed after its manifest landed (an object store that processed a timed-out
    manifest PUT late) leaves one, which every read skips; the save that retries the
    step replaces it instead of calling it committed."""
    name = layout.checkpoint_name(step)
    try:
        validate(storage, name, read_manifest(storage, name))
    except CorruptCheckpointError as exc:
        return exc
    except CheckpointError:
        pass  # unreadable: not shown torn, so the save still refuses it
    return None


#: How many times a reader re-reads a checkpoint that is replaced while it reads it
#: before it gives up (a step overwritten again and again, faster than it can be read).
#: A retry costs a read of the checkpoint, and happens only when its manifest changed.
READ_ATTEMPTS = 8
# ``load_checkpoint``'s pause before reading again a directory found without a manifest
# (times the attempt: about 1.4 s in all before it is called never committed).
_UNMANIFESTED_PAUSE_S = 0.05

#: How long a reader waits for an overwrite without an atomic exchange (sshfs, NFS,
#: Windows) to give its step a name in ROOT again. Such an overwrite moves the old copy
#: into ``.trash/`` and then renames the new one in: between the two renames the step
#: has no name in ROOT, and a reader listing it then would miss a committed checkpoint
#: (found by the lifecycle model test). Two renames take milliseconds; a writer that
#: crashed between them leaves the step absent until the next start puts the new copy
#: back, and readers then report what they see after this wait, with a warning.
REPLACE_WAIT_S = 2.0
#: (root, step, attempts) of the overwrites ``_back`` waited for in vain (see there).
_STUCK: set[tuple[str, int, frozenset[str]]] = set()
_STUCK_LOCK = threading.Lock()
#: (root URL, step) of each interrupted overwrite a ``_back`` of this process is waiting
#: for right now (``overwrites_waited_for``).
_WAITING: dict[tuple[str, int], int] = {}


def overwrites_waited_for() -> list[tuple[str, int]]:
    """(root URL, step) of each overwrite without atomic exchange that a read of this
    process is waiting for at this moment (its step absent between the two renames):
    what a bounded command (``--timeout``) was waiting for, if not the storage."""
    with _STUCK_LOCK:
        return sorted(_WAITING)


def _being_replaced(storage: Storage, names: Collection[str] | None = None) -> dict[int, set[str]]:
    """The steps whose old copy an overwrite without atomic exchange has moved into
    ``.trash/`` and not yet deleted, with the attempts that did it: one listing of
    ``.trash/``, none where ``names`` (a listing of ROOT) shows there is no ``.trash/``."""
    if names is not None and layout.TRASH_DIR not in names:
        return {}
    found: dict[int, set[str]] = {}
    for name in storage.listdir(layout.TRASH_DIR):
        parsed = layout.parse_replaced_name(name)
        if parsed is not None:
            found.setdefault(parsed[0], set()).add(parsed[1])
    return found


def _back(
    storage: Storage, steps: Collection[int], replacing: dict[int, set[str]] | None = None
) -> set[int]:
    """Of ``steps``, each just found without a name in ROOT, those that have one again.

    A step that an overwrite without atomic exchange is replacing (its old copy is in
    ``.trash/``, its new one still in ``.pending/``) is waited for, up to
    ``REPLACE_WAIT_S``; the others are looked for once more. Each round looks at
    ``.trash/``, then ``.pending/``, then ROOT: an overwrite whose new copy has left
    ``.pending/`` has renamed it in, so a step found absent between the two renames is
    never missed. (An old copy left in ``.trash/`` by an overwrite that finished, once
    its step is deleted, has no twin in ``.pending/``: nothing to wait for.)
    ``replacing`` is ``_being_replaced``'s answer if the caller has just asked it.
    """
    back: set[int] = set()
    waiting = set(steps)
    deadline = time.monotonic() + REPLACE_WAIT_S
    delay = 0.001
    url = storage.url("")

    def stuck(s: int) -> tuple[str, int, frozenset[str]]:
        return url, s, frozenset(replacing.get(s, ()) if replacing else ())

    while waiting:
        # Listings, not ``is_dir``: a network filesystem's client answers a ``stat`` from
        # its cache, where a name deleted on another node lives on for seconds (sshfs);
        # ``listdir`` asks the server.
        if replacing is None:
            replacing = _being_replaced(storage)
        pending = set(storage.listdir(layout.PENDING_DIR)) if replacing.keys() & waiting else set()
        live = {
            s
            for s in waiting
            if pending & {layout.pending_name(s, a) for a in replacing.get(s, ())}
        }
        present = set(storage.listdir(""))
        back |= {s for s in waiting if layout.checkpoint_name(s) in present}
        waiting = live - back
        # An overwrite already waited for in vain (its writer died between the two
        # renames) is not waited for again by this process: every later read (each
        # latest() asked twice) took another 2 s until the job restarted.
        waiting = {s for s in waiting if stuck(s) not in _STUCK}
        if not waiting:
            break
        if time.monotonic() >= deadline:
            with _STUCK_LOCK:
                if len(_STUCK) > 1000:
                    _STUCK.clear()
                _STUCK.update(map(stuck, waiting))
            log.warning(
                "checkpoint step(s) %s in %s stayed absent for %.0f s: an overwrite without "
                "an atomic exchange stopped between its two renames (its writer crashed?); "
                "both copies are kept, and the next start of the job (or `atomic-checkpoint "
                "clean`) puts the new one back",
                ", ".join(map(str, sorted(waiting))),
                storage.url(""),
                REPLACE_WAIT_S,
            )
            break
        keys = [(url, s) for s in waiting]
        with _STUCK_LOCK:
            for key in keys:
                _WAITING[key] = _WAITING.get(key, 0) + 1
        try:
            time.sleep(delay)
        finally:
            with _STUCK_LOCK:
                for key in keys:
                    _WAITING[key] -= 1
                    if not _WAITING[key]:
                        del _WAITING[key]
        delay = min(delay * 2, 0.05)
        replacing = None
    return back


def _root_names(storage: Storage, known: Iterable[str] = ()) -> list[str]:
    """One listing of ROOT, with the checkpoints that an overwrite without atomic
    exchange had just moved out of it put back (``_back``): those whose old copy is in
    ``.trash/``, and those of ``known`` (names seen in an earlier listing) now absent."""
    names = storage.listdir("")
    present = set(names)
    replacing = _being_replaced(storage, names)
    absent = {s for s in replacing if layout.checkpoint_name(s) not in present}
    for name in known:
        step = layout.parse_checkpoint_name(name)
        if step is not None and name not in present:
            absent.add(step)
    if not absent:
        return names
    return names + [layout.checkpoint_name(s) for s in sorted(_back(storage, absent, replacing))]


#: The fields that tell one commit of a step from another.
_COMMIT_IDENTITY = operator.attrgetter("step", "run_id", "commit_seq", "created_unix")


def same_copy(a: Manifest, b: Manifest) -> bool:
    """Whether two manifests describe the same commit of a step (not merely equal
    content: every save gets a new commit sequence number and commit time). Compared
    on the fields of a commit rather than with ``==`` on the manifests, which a NaN
    metric would make false. A ``SharedManifest`` (a rank's part of the file list) is
    the same copy when the other lists each of its files alike."""
    if _COMMIT_IDENTITY(a) != _COMMIT_IDENTITY(b):
        return False
    if isinstance(a, SharedManifest) or isinstance(b, SharedManifest):
        part, whole = (a, b) if isinstance(a, SharedManifest) else (b, a)
        return set(part.files) <= set(whole.files)
    return a.files == b.files


def manifest_now(storage: Storage, rel: str) -> Manifest | None:
    """The manifest of ``rel`` as it is now, or None if the checkpoint is gone (not
    committed any more)."""
    try:
        return read_manifest(storage, rel)
    except CheckpointNotFoundError:
        return None


@parameters_of(validate)
def validate_consistent(storage, rel, manifest, *, full, progress, sizes) -> Manifest:
    """``validate`` (with its parameters), robust to a concurrent overwrite of the step;
    returns the manifest the files were checked against.

    A reader that read the manifest of one copy can find the other copy's files under
    the same name: an overwrite swaps the whole directory (``renameat2`` with
    RENAME_EXCHANGE, or two renames without it), and the marker strategy replaces the
    manifest, then deletes the replaced attempt's files. Checked against the old
    manifest, the new files read as corrupt (other sizes or checksums) or missing. So a
    failure counts only if the manifest is still the one the files were checked
    against; if it changed, the files are checked again against the new one, at most
    ``READ_ATTEMPTS`` times (``sizes``, a listing of the first copy, only the first
    time). A success needs no second read: the files matched this manifest.

    Raises:
        CorruptCheckpointError: the files do not match the manifest, and it did not
            change meanwhile.
        CheckpointNotFoundError: the checkpoint was un-committed meanwhile (rotation).
        CheckpointError: it was replaced on every attempt.
    """
    for _ in range(READ_ATTEMPTS):
        try:
            validate(storage, rel, manifest, full=full, progress=progress, sizes=sizes)
            return manifest
        except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
            error = exc
        now = manifest_now(storage, rel)
        if now is None:
            raise CheckpointNotFoundError(
                f"{storage.url(rel)} was un-committed while it was being read "
                f"(rotation or rollback): {error}"
            ) from error
        if same_copy(now, manifest):
            raise error
        log.debug("%s was replaced while being read; reading the new copy", storage.url(rel))
        manifest, sizes = now, None
    raise CheckpointError(
        f"{storage.url(rel)} was replaced {READ_ATTEMPTS} times while being read (the step "
        "is being saved again and again with overwrite=True): read it once the writer stops"
    )


def check_state_headers(storage: Storage, rel: str, manifest: Manifest) -> None:
    """Parse and validate the header of each state file (``rank-<r>.safetensors``,
    ``replicated.safetensors``) of checkpoint ``rel`` as ``restore``'s loader does,
    reading the headers only: ``inspect``'s check, which reads no data (``validate``
    with ``full`` checks each before its checksum).

    Raises:
        CorruptCheckpointError: naming the file and what is wrong with its header.
    """
    for entry in manifest.files:
        check_inside(storage, rel, entry.path)
        _check_header(storage, rel, entry)


def _check_header(storage: Storage, rel: str, entry: FileEntry) -> None:
    """A state file's header, validated as ``restore``'s loader validates it
    (``serialization.read_header``: shapes, dtypes, offsets, the tree). A file whose
    checksum matches its manifest can still hold a header no load accepts (written so,
    or manifest and file changed together): a verification must not call ``ok`` what
    ``restore`` rejects as corrupt. Other files are not read."""
    if not layout.is_state_file(entry.path.rpartition("/")[2]):
        return
    from .serialization import read_header

    path = f"{rel}/{entry.path}"
    try:
        with storage.open_read(path) as f:
            read_header(f, size_bytes=entry.size_bytes)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{storage.url(path)}: {exc}") from exc


def load_checkpoint(storage: Storage, step: int, *, full: bool = False) -> Manifest:
    """Read and validate checkpoint ``step``; raises if it is not a valid checkpoint.
    Returns the manifest of the copy that was checked (see ``validate_consistent``)."""
    rel = layout.checkpoint_name(step)
    for attempt in range(READ_ATTEMPTS):
        last = attempt + 1 == READ_ATTEMPTS
        # Absent, or un-committed while being read: unless an overwrite without atomic
        # exchange was between its two renames and has put the step back (``_back``).
        try:
            manifest = read_manifest(storage, rel)
        except CheckpointNotFoundError as exc:
            if not last and _back(storage, (step,)):
                continue
            caps = storage.capabilities
            stale = not caps.coherent and caps.atomic_dir_rename
            if not last and stale and storage.is_dir(rel):
                # A network filesystem whose saves commit by rename (sshfs, NFS): a
                # directory, yet no manifest a moment ago, is a copy renamed in since (an
                # overwrite seen from another node, whose client showed neither name in
                # between) or one never committed. Read again, a little later each
                # time, before calling it never committed. (Where saves write in place,
                # a directory without a manifest is a save in progress: not waited for.)
                time.sleep(_UNMANIFESTED_PAUSE_S * (attempt + 1))
                continue
            raise missing_step_error(storage, step) from exc
        try:
            return validate_consistent(storage, rel, manifest, full=full)
        except CheckpointNotFoundError:
            if not last and _back(storage, (step,)):
                continue
            raise
    raise AssertionError("unreachable: the last attempt returns or raises")  # pragma: no cover


def entry_present(storage: Storage, rel: str) -> bool:
    """Whether entry ``rel`` of ROOT exists, asked past a network mount's cache: a name
    deleted through another mount keeps passing ``stat()`` here for ~20 s (sshfs), and
    a step just rotated away was reported as a directory "never committed" instead of
    missing. A fresh listing of ROOT settles it (only asked when the stat says yes)."""
    if not storage.is_dir(rel) and storage.size(rel) is None:
        return False
    if storage.capabilities.coherent:
        return True
    storage.refresh("")
    return rel in storage.listdir("")


def missing_step_error(storage: Storage, step: int) -> CheckpointNotFoundError:
    """Why there is no checkpoint ``step`` to load, in the user's terms: no such entry
    (and which steps there are), or a directory that was never committed. For
    ``restore``/``verify`` and the CLI alike; called only once a read found nothing."""
    rel = layout.checkpoint_name(step)
    present = entry_present(storage, rel)
    if present and storage.is_dir(rel):
        purposes = _marker_purposes(storage, rel)
        if "delete" in purposes:
            # Marker roots un-commit in place (the manifest goes first, then the data):
            # a reader of a step that rotation took was told "never committed".
            return CheckpointNotFoundError(
                f"{storage.url(rel)} was un-committed (rotation or rollback) and is being "
                "deleted; list the checkpoints again"
            )
        if purposes:
            return CheckpointNotFoundError(
                f"{storage.url(rel)} is a save that has not committed (in progress, or "
                "crashed); resume ignores it"
            )
        return CheckpointNotFoundError(
            f"{storage.url(rel)} has no manifest: it was never committed (a crashed save or "
            "another tool wrote it) or its manifest was deleted; resume ignores it, and "
            f"`atomic-checkpoint verify {storage.url('')}` (without a step) says what it is"
        )
    if present and storage.size(rel) is not None:
        # A regular file (or a link to one) by that name: "no checkpoint step 5 ...
        # (checkpoint steps there: ..., 5)" named it as a step that exists.
        return CheckpointNotFoundError(
            f"{storage.url(rel)} is not a directory (a file by a checkpoint's name: a "
            "checkpoint is a directory holding a manifest); resume ignores it. Move it "
            "aside, or copy the complete checkpoint directory in its place"
        )
    steps = [s for s, _ in _checkpoint_names(storage.listdir(""))[0]]
    return CheckpointNotFoundError(
        f"no checkpoint step {step} in {storage.url('')} (checkpoint steps there: "
        f"{_steps_near(steps, step)}; see `atomic-checkpoint list`)"
    )


def exists_error(storage: Storage, step: int) -> CheckpointExistsError:
    """Why a save of ``step`` without ``overwrite`` is refused: it is committed."""
    return CheckpointExistsError(
        f"checkpoint step {step} is already committed at "
        f"{storage.url(layout.checkpoint_name(step))}; pass overwrite=True to replace it "
        "atomically, or save under a new step"
    )


def await_readable(storage: Storage, step: int, timeout_s: float) -> None:
    """Non-coordinators on a network filesystem: wait until the commit is visible.

    Runs after every rank was told the save committed, so it never fails the save: a
    rank that raised here while the others returned would report a failure for a
    committed step (found by the libfiu campaign on s3fs-fuse: an EIO reading the
    manifest back through one rank's mount). A manifest that stays invisible or cannot
    be read from this rank is a warning; the checkpoint is committed either way."""
    where = storage.url(layout.checkpoint_name(step))

    def read() -> CheckpointError | None:
        try:
            read_manifest(storage, layout.checkpoint_name(step))
            return None
        except CheckpointError as exc:
            return exc

    exc = visibility.until(
        storage, "", read, lambda e: not isinstance(e, CheckpointNotFoundError), timeout_s
    )
    if isinstance(exc, CheckpointNotFoundError):
        log.warning(
            "checkpoint step %d is committed but not visible from this rank after %g s: "
            "%s (this mount's cache is stale; it shows the step later)",
            step,
            timeout_s,
            where,
        )
    elif exc is not None:
        log.warning(
            "checkpoint step %d is committed, but this rank cannot read its manifest back "
            "at %s: %s",
            step,
            where,
            exc,
        )


def _steps_near(steps: list[int], step: int, most: int = 10) -> str:
    """``steps`` (ascending) as a short list for a message about ``step``: all of them,
    or, of many, the ones just below and above it, the newest and a count ("100, 200
    ... 1000 (1000 in all)"), never a cut list that reads as complete."""
    if not steps:
        return "none"
    if len(steps) <= most:
        return ", ".join(map(str, steps))
    at = bisect.bisect_left(steps, step)
    near = steps[max(0, at - most // 2) : at + most // 2]
    shown = ", ".join(map(str, near))
    if near[0] != steps[0]:
        shown = f"{steps[0]} ... {shown}"
    if near[-1] != steps[-1]:
        shown = f"{shown} ... {steps[-1]}"
    return f"{shown} ({len(steps)} in all)"


def _foreign_entries(storage: Storage, rel: str) -> list[str]:
    """The entries of checkpoint directory ``rel`` that no save or delete of ours left:
    neither a marker, an attempt directory nor a temporary file whose writer is gone."""
    names = storage.listdir(rel)
    ours = {path.rsplit("/", 1)[-1] for path, _ in abandoned_temps(storage, rel, names)}
    return [
        n
        for n in names
        if layout.parse_marker_name(n) is None
        and layout.parse_attempt_dir(n) is None
        and n not in ours
    ]


def step_taken(
    storage: Storage,
    step: int,
    *,
    overwrite: bool = False,
    run_id: str | None = None,
    renames: bool = False,
) -> bool:
    """Step 1 of a save, on the domain leader: whether ``checkpoint-<step>`` is taken,
    by a manifest, or (with ``overwrite``, which then replaces it) by a foreign
    directory. Without ``overwrite`` a foreign directory is an error: it is never
    replaced silently. Another run's checkpoint (a manifest with another run id than
    ``run_id``) is an error with or without ``overwrite``: other runs' checkpoints are
    never replaced or deleted. A commit by rename (``renames``) cannot land on any
    directory of that name, empty or holding only our leftovers (an interrupted copy or
    delete): said before anything is written, not by the rename after every rank wrote.
    Raises ``CheckpointExistsError`` or ``CommitError`` for what is never replaced."""
    name = layout.checkpoint_name(step)
    try:
        manifest = read_manifest(storage, name)
        if run_id and manifest.run_id and manifest.run_id != run_id:
            raise CheckpointExistsError(
                f"{storage.url(name)} is a checkpoint of another run ({manifest.run_id!r}; "
                f"this job continues run {run_id!r}): checkpoints of other runs are never "
                "replaced or deleted, overwrite=True included. Save under another step or "
                f"into another root, or continue that run (run_id={manifest.run_id!r})"
            )
    except CheckpointNotFoundError:
        # Marker-strategy leftovers (markers, attempt directories) are ours, not foreign.
        there = visibility.dir_still_there(storage, name)
        foreign = _foreign_entries(storage, name) if there else []
        if there and renames and not foreign:
            # Only the remains of an in-place save or delete cut short (the marker
            # strategy's, or its empty directory): a run that used that strategy on this
            # ROOT before it renamed. With no manifest they never were a checkpoint, and
            # this run's sweep does not look for them (it knows its own remains only):
            # removed here, so that they never block this save (FAILURE_MODES E3).
            log.warning(
                "removing %s: the remains of an in-place save or delete that was cut short "
                "(no manifest: never a checkpoint)",
                storage.url(name),
            )
            storage.delete_tree(name)
            return False
        if there and (renames or foreign):
            if overwrite:
                return True
            raise CommitError(
                f"{storage.url(name)} exists but is not a committed checkpoint (no manifest): "
                "it was not written by atomic-checkpoint, or by an incomplete in-place save. "
                "Move it away, or pass overwrite=True to replace it"
            ) from None
        return False
    except UnsupportedSchemaError as exc:
        # Written by a newer version of this library: this one cannot tell what it is
        # or whose, so it never replaces it (docs/format.md), overwrite=True included.
        raise CheckpointExistsError(
            f"{storage.url(name)} was written by a newer version of atomic-checkpoint "
            f"({exc}): this version never replaces or deletes it, overwrite=True "
            "included. Save under another step, or upgrade atomic-checkpoint"
        ) from None
    except CorruptCheckpointError as exc:
        if not overwrite:
            # Not "already committed": nothing valid is there, but it is never replaced
            # silently (it may be a checkpoint whose manifest a disk fault damaged).
            raise CheckpointExistsError(
                f"{storage.url(name)} is not a valid checkpoint ({exc}), and it is never "
                "replaced silently (it may be a checkpoint a disk fault damaged, or one "
                "copied from elsewhere). Pass overwrite=True to replace it, or move it away"
            ) from None
    return True


def _marker_purposes(storage: Storage, rel: str) -> set[str]:
    """What the markers in directory ``rel`` say it is being used for (marker strategy:
    ``save``, ``delete``); empty where there is none or none can be read."""
    purposes = set()
    try:
        names = storage.listdir(rel)
        for name in names:
            if layout.parse_marker_name(name) is None:
                continue
            try:
                doc = json.loads(storage.read_bytes(f"{rel}/{name}"))
            except (CheckpointError, ValueError, RecursionError):
                continue  # gone since the listing, or torn
            if isinstance(doc, dict) and isinstance(doc.get("purpose"), str):
                purposes.add(doc["purpose"])
    except CheckpointError:
        pass
    return purposes


class ManifestCache:
    """What discovery learned about a root, kept between scans (one per manager).

    Maps a checkpoint name to the manifest that was read and validated there, with the
    storage's token of the manifest file (``Storage.stat_token``: inode, size and
    times, or an object's ETag and size) taken *before* it was read. A later scan of
    the same name costs one ``stat`` of the manifest (on an object store, a share of one
    listing of ROOT: ``stat_tokens``) instead of a read and a parse: an equal token
    proves the manifest unchanged (a replaced manifest is a new file: new inode and
    times, a new ETag). Its files are still checked for presence and size, as a full
    scan checks them, so a listing never shows a checkpoint that ``newest`` would skip.
    A change between the token and the read leaves an old token next to the new
    manifest, so the next scan reads it again: the cache can miss, never lie.

    The owner drops the names it commits and deletes (``forget``) as well; names that
    left the root are dropped at each scan. A storage without ``stat_token`` (the
    in-memory one) is never cached. At most ``max_files`` file entries are held (a root
    of many-rank checkpoints would otherwise keep every manifest in memory); past that,
    the others are read as without a cache. Thread-safe: an async save's commit may
    invalidate while the training thread lists.
    """

    def __init__(self, max_files: int = 1 << 20) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[Hashable, Manifest, bool]] = {}
        self._files = 0
        self.max_files = max_files
        #: Manifests read (and parsed) through this cache since it was made.
        self.reads = 0
        #: Scans answered from the cache without reading the manifest.
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _count(self, *, read: bool) -> None:
        """One more manifest read (``read``) or cache hit (scans run in threads)."""
        with self._lock:
            if read:
                self.reads += 1
            else:
                self.hits += 1

    def forget(self, name: str) -> None:
        """Drop ``name`` (a commit or delete of it by the cache's owner)."""
        with self._lock:
            self._drop(name)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._files = 0

    def _drop(self, name: str) -> None:
        got = self._entries.pop(name, None)
        if got is not None:
            self._files -= len(got[1].files)

    def _names(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def _keep_only(self, names: set[str]) -> None:
        with self._lock:
            for name in [n for n in self._entries if n not in names]:
                self._drop(name)

    def _listing_is_cheap(self, n: int) -> bool:
        """Whether one listing of every file in ROOT costs less than ``n`` requests for
        the manifests alone (object stores): most of ROOT is known, with few files per
        checkpoint. A root of 4096-rank checkpoints is never listed whole."""
        with self._lock:
            known = [m for _, m, _ in self._entries.values()]
        if not known or 2 * len(known) < n:
            return False
        per = sum(len(m.files) + 1 for m in known) / len(known)
        return per <= _LISTING_FILES_PER_CHECKPOINT

    def _get(self, name: str, token: Hashable) -> tuple[Manifest, bool] | None:
        with self._lock:
            got = self._entries.get(name)
        if got is None or got[0] != token:
            return None
        return got[1], got[2]

    def _put(self, name: str, token: Hashable, manifest: Manifest, validated: bool) -> None:
        with self._lock:
            self._drop(name)
            if self._files + len(manifest.files) > self.max_files:
                return
            self._entries[name] = (token, manifest, validated)
            self._files += len(manifest.files)


def manifest_token(storage: Storage, rel: str) -> Hashable | None:
    """The storage's token of checkpoint ``rel``'s manifest (see ``ManifestCache``), or
    None when it cannot say (no ``stat_token``, missing, a link, an error): the caller
    then reads the manifest, which reports whatever is wrong."""
    fn = getattr(storage, "stat_token", None)
    if fn is None:
        return None
    try:
        token = fn(f"{rel}/{layout.MANIFEST_NAME}")
    except CheckpointError:
        return None
    return token if isinstance(token, Hashable) else None


#: Object stores: how many manifest tokens (one HEAD each), or manifests a scan reads,
#: are asked for at once. A small request costs a round trip, not bandwidth: thousands
#: of them one after the other would make a listing take minutes.
_TOKEN_THREADS = 16


#: A recursive listing of ROOT replaces a HEAD per manifest while the checkpoints
#: hold at most this many files on average (the keys listed, a thousand per request).
_LISTING_FILES_PER_CHECKPOINT = 16


def _manifest_tokens(
    storage: Storage, names: list[str], cache: ManifestCache
) -> tuple[list[Hashable | None], dict[str, dict[str, int]] | None]:
    """The manifest token of each of ``names``, and, where one listing of ROOT told
    them, the sizes of the files in each checkpoint (name -> file path -> size)."""
    if storage.local_path("") is not None or len(names) < 2:
        return [manifest_token(storage, name) for name in names], None
    bulk = getattr(storage, "stat_tokens", None)
    if bulk is not None and cache._listing_is_cheap(len(names)):
        try:
            found = bulk("")
        except CheckpointError:
            found = None
        if found is not None:
            sizes: dict[str, dict[str, int]] = {}
            for path, (_, size) in found.items():
                top, _, rest = path.partition("/")
                if rest:
                    sizes.setdefault(top, {})[rest] = size
            tokens = [found.get(f"{name}/{layout.MANIFEST_NAME}") for name in names]
            return [None if t is None else t[0] for t in tokens], sizes
    with ThreadPoolExecutor(min(_TOKEN_THREADS, len(names))) as pool:
        return list(pool.map(functools.partial(manifest_token, storage), names)), None


def _checkpoint_entry(
    storage: Storage,
    name: str,
    step: int,
    *,
    run_id: str | None,
    full: bool,
    cache: ManifestCache | None,
    token: Hashable | None = None,
    sizes: Mapping[str, int] | None = None,
) -> Entry | None:
    """The status of the one entry ``name`` (a strict ``checkpoint-<step>`` name) of the
    root, or None if it vanished or changed while being looked at (un-committed by
    rotation, or an overwrite between its two renames: see ``_settled``).

    Raises:
        StorageError: an I/O error that says nothing about the checkpoint.
    """
    if is_link(storage, name):
        target = posix.link_target(storage.local_path(name) or name)
        return Entry(
            name,
            step,
            "foreign",
            problem=f"{_UNSAFE}: a symbolic link (to {target}), never a checkpoint: "
            "not read, not counted, not deleted",
        )
    if token is not None and cache is not None:
        known = cache._get(name, token)
        if known is not None:
            manifest, validated = known
            if run_id is not None and not manifest.belongs_to(run_id):
                cache._count(read=False)
                return Entry(name, step, "foreign", manifest, f"belongs to run {manifest.run_id!r}")
            if validated:
                # The manifest is unchanged; its files are checked as a full scan checks
                # them (present, listed size), so a file damaged since is found, and the
                # listing agrees with latest(). Any doubt: the full read below decides.
                if _files_as_listed(storage, name, manifest, sizes):
                    cache._count(read=False)
                    return Entry(name, step, "ok", manifest)
                cache.forget(name)
    try:
        manifest = read_manifest(storage, name)
    except CheckpointNotFoundError:
        # Changed while being looked at: gone (un-committed, or an overwrite without
        # atomic exchange between its two renames), or back with a manifest since it was
        # read; None, and the caller (``_settled``) looks again. Asked of listings, which
        # a network filesystem's client takes from the server, not of a cached ``stat``.
        children = storage.listdir(name)
        if not children:  # gone, or empty: ROOT tells, and a copy renamed in since is not
            if name not in storage.listdir(""):
                return None
            children = storage.listdir(name)
            # A file of that name lists no children either (an empty directory is what
            # a killed delete leaves; a vanished name has no size).
            if not children and not storage.is_dir(name) and storage.size(name) is not None:
                return Entry(name, step, "foreign", problem=NOT_A_DIRECTORY)
        if layout.MANIFEST_NAME in children:
            return None
        if any(layout.parse_marker_name(c) is not None for c in children):
            return Entry(name, step, "pending", problem="not committed (marker, no manifest)")
        if children and all(parse_temp_name(c) is not None for c in children):
            # A marker or manifest write killed between its temporary file and the rename
            # (e.g. the un-commit marker of a delete whose other files were gone): our
            # own remains, which the next start's sweep and `clean` remove, not a
            # foreign directory.
            why = "not committed (an interrupted write's temporary file)"
            return Entry(name, step, "pending", problem=why)
        return Entry(name, step, "foreign", problem=NO_MANIFEST)
    except StorageError:
        # An I/O error (EIO, EACCES, ESTALE...) says nothing about the checkpoint.
        # Counting it as corrupt would resume from an older step, or find "nothing
        # to resume" and start from scratch over good checkpoints, because of one
        # transient error: report it, unless the checkpoint is gone meanwhile.
        if _vanished(storage, name):
            return None
        raise
    except CheckpointError as exc:
        return Entry(name, step, "corrupt", problem=str(exc))
    finally:
        if cache is not None:
            cache._count(read=True)
    if run_id is not None and not manifest.belongs_to(run_id):
        if token is not None and cache is not None:
            cache._put(name, token, manifest, False)  # read, not validated: not ours
        return Entry(name, step, "foreign", manifest, f"belongs to run {manifest.run_id!r}")
    try:
        checked = validate_consistent(storage, name, manifest, full=full)
    except CheckpointNotFoundError:
        return None  # un-committed under us (rotation): gone, not corrupt
    except StorageError:
        if _vanished(storage, name):
            return None
        raise  # see above: an I/O error is not corruption
    except CheckpointError as exc:
        if _vanished(storage, name):
            # Rotation un-committed it between our manifest read and the file checks
            # (a reader racing a live job): it is gone, not corrupt.
            return None
        return Entry(name, step, "corrupt", manifest, str(exc))
    if token is not None and cache is not None and checked is manifest:
        # Replaced while being checked: the token is the old copy's; not cached.
        cache._put(name, token, checked, True)
    return Entry(name, step, "ok", checked)


def _settled(storage: Storage, name: str, step: int, **how: Any) -> Entry | None:
    """``_checkpoint_entry(storage, name, step, **how)``, read again where the entry lost
    its name (or changed) while it was being read and has it again (``_back``: an overwrite without
    atomic exchange between its two renames), at most ``READ_ATTEMPTS`` times; None
    where it is gone."""
    entry = _checkpoint_entry(storage, name, step, **how)
    for _ in range(READ_ATTEMPTS - 1):
        if entry is not None or not _back(storage, (step,)):
            return entry
        how.update(token=None, sizes=None)  # those were taken of the copy that left
        entry = _checkpoint_entry(storage, name, step, **how)
    return entry


def _files_as_listed(
    storage: Storage, rel: str, manifest: Manifest, sizes: Mapping[str, int] | None
) -> bool:
    """Whether every file ``manifest`` lists is still in checkpoint ``rel`` at its listed
    size: the checks of ``validate``, made cheaply for a manifest known unchanged. On a
    mounted filesystem one ``lstat`` per file and per directory on the way: every one a
    directory or a regular file, never a link (so nothing resolves outside, as
    ``check_inside`` requires). False at the first doubt (including an error): the
    caller then reads and validates the checkpoint in full, which says what is wrong
    and waits out a network filesystem's stale sizes."""
    base = storage.local_path(rel)
    if base is None:
        try:
            validate(storage, rel, manifest, sizes=sizes)
        except CheckpointError:
            return False
        return True
    return posix.files_as_listed(base, [(f.path, f.size_bytes) for f in manifest.files])


def _checkpoint_names(names: list[str]) -> tuple[list[tuple[int, str]], list[str]]:
    """The strict ``checkpoint-<step>`` names of a root listing, ascending by step, and
    the other names (the library's own directories left out)."""
    steps: list[tuple[int, str]] = []
    others: list[str] = []
    for name in names:
        if name in layout.OWN_DIRS:
            continue
        step = layout.parse_checkpoint_name(name)
        if step is None:
            others.append(name)
        else:
            steps.append((step, name))
    steps.sort()
    return steps, others


def scan(
    storage: Storage,
    *,
    run_id: str | None = None,
    full: bool = False,
    cache: ManifestCache | None = None,
) -> list[Entry]:
    """Every entry of the root with its status, checkpoints ascending by step first.

    Reads every checkpoint's manifest and checks its files' sizes, except where
    ``cache`` (not with ``full``) proves a manifest unchanged since it was validated.
    """
    # A checkpoint listed before (in ``cache``) and absent now is looked for again: an
    # overwrite without atomic exchange may be between its two renames (``_back``).
    names = _root_names(storage, () if cache is None else cache._names())
    steps, others = _checkpoint_names(names)
    tokens: list[Hashable | None] = [None] * len(steps)
    sizes: dict[str, dict[str, int]] | None = None
    if cache is not None:
        cache._keep_only({name for _, name in steps})
        if not full:
            # Taken before any manifest is read: see ManifestCache.
            tokens, sizes = _manifest_tokens(storage, [name for _, name in steps], cache)
    entries: list[Entry] = [
        Entry(name, None, "foreign", problem="not a checkpoint name") for name in others
    ]

    def settle(item: tuple[tuple[int, str], Hashable | None]) -> Entry | None:
        (step, name), token = item
        return _settled(
            storage,
            name,
            step,
            run_id=run_id,
            full=full,
            cache=cache,
            token=token,
            sizes=None if sizes is None else sizes.get(name, {}),
        )

    items = list(zip(steps, tokens, strict=True))
    if storage.local_path("") is None and len(items) > 1:
        # Object stores: each manifest is a round trip (and a listing for its files'
        # sizes); 2,000 of them one after the other took 100 s on a server on loopback.
        with ThreadPoolExecutor(min(_TOKEN_THREADS, len(items))) as pool:
            settled = list(pool.map(settle, items))
    else:
        settled = [settle(item) for item in items]
    vanished = any(entry is None for entry in settled)
    entries += [entry for entry in settled if entry is not None]
    # Names that vanished meanwhile were deleted by a rotation, which commits a newer
    # checkpoint first: list again for names this listing predates (bounded), so that
    # a reader racing a KeepLast(1) rotation never sees an empty root.
    seen = {step for step, _ in steps}
    for _ in range(READ_ATTEMPTS - 1):
        if not vanished:
            break
        vanished = False
        for step, name in _new_names(storage, seen):
            entry = _settled(storage, name, step, run_id=run_id, full=full, cache=cache)
            if entry is not None:
                entries.append(entry)
            vanished = vanished or entry is None
    try:
        pending = storage.listdir(layout.PENDING_DIR)
    except StoragePermissionError as exc:
        # Saves in progress are no reader's business: a reader let into every
        # checkpoint but not into .pending/ (another user's umask 077) could not list
        # or verify anything.
        log.warning("not listing %s: %s", storage.url(layout.PENDING_DIR), exc)
        pending = []
    for name in filter(layout.is_own_entry, pending):  # not a user's own folders
        parsed = layout.parse_pending_name(name)
        entries.append(
            Entry(
                f"{layout.PENDING_DIR}/{name}",
                parsed[0] if parsed else None,
                "pending",
                problem="not committed",
            )
        )
    entries.sort(
        key=lambda e: (e.status == "pending", e.step if e.step is not None else -1, e.name)
    )
    return entries


def _vanished(storage: Storage, rel: str) -> bool:
    try:
        read_manifest(storage, rel)
    except CheckpointNotFoundError:
        return True
    except CheckpointError:
        return False
    return False


#: (url, problem) of the entries a warning named, newest last: each is named once per
#: process (later walks log it at debug level), so a reader that polls ``latest()``
#: does not repeat the same warning for as long as the entry stays.
_WARNED: dict[tuple[str, str], None] = {}
_WARNED_MAX = 4096


def warn_skipped(storage: Storage, e: Entry) -> None:
    if e.status == "corrupt" or (e.status == "foreign" and _UNSAFE in (e.problem or "")):
        url, problem = storage.url(e.name), e.problem or ""
        # catalog's messages start with the checkpoint's path: said once.
        problem = problem[len(url) + 2 :] if problem.startswith(f"{url}: ") else problem
        key = (url, problem)
        if key in _WARNED:
            log.debug("skipping %s: %s (warned before)", url, problem)
            return
        _WARNED[key] = None
        if len(_WARNED) > _WARNED_MAX:
            del _WARNED[next(iter(_WARNED))]
        log.warning("skipping %s: %s", url, problem)


def committed(
    storage: Storage,
    *,
    run_id: str | None,
    warn: bool = True,
    cache: ManifestCache | None = None,
) -> list[Manifest]:
    """This run's valid checkpoints, ascending by step; invalid ones are skipped with a
    warning that says what is wrong (DESIGN invariant 6). With ``cache``, a manifest
    validated before and unchanged since is not read again (see ``ManifestCache``)."""
    return list(_valid_only(storage, scan(storage, run_id=run_id, cache=cache), warn=warn))


def listed_steps(storage: Storage) -> list[tuple[int, str]]:
    """The strict ``checkpoint-<step>`` names of the root as ``(step, name)``, ascending:
    one listing, no manifest read (the names say nothing of validity)."""
    return _checkpoint_names(_root_names(storage))[0]


def newest_first(
    storage: Storage, *, run_id: str | None, steps: list[tuple[int, str]]
) -> Iterator[Entry]:
    """The entries named in ``steps`` (``listed_steps``), newest first, each read (its
    manifest and its files' sizes) only when the caller asks for it."""
    return _newest_first(storage, run_id=run_id, steps=steps)


def _valid_only(storage: Storage, entries: Iterable[Entry], *, warn: bool) -> Iterator[Manifest]:
    """The manifests of the valid checkpoints among ``entries``, in their order; with
    ``warn``, each invalid one is logged as it is passed over."""
    for e in entries:
        if e.status == "ok" and e.manifest is not None:
            yield e.manifest
        elif warn:
            warn_skipped(storage, e)


def newest(
    storage: Storage,
    *,
    run_id: str | None,
    warn: bool = True,
    skip: Collection[int] = (),
    unmanifested: list[str] | None = None,
) -> Manifest | None:
    """This run's newest valid checkpoint, or None: what ``committed(...)[-1]`` answers,
    reading manifests newest first and stopping at the first that validates, so a
    root of thousands of checkpoints costs one listing and, normally, one manifest read
    and a size check of that checkpoint's files (not of every checkpoint's).

    The same rules as ``committed``: strict names only, links never followed, other
    runs' checkpoints passed over, and a corrupt one skipped with a warning naming what
    is wrong (DESIGN invariant 6); each one skipped costs one more manifest read. No
    cache: the answer is always checked against the storage as it is now. Steps in
    ``skip`` (``restore()``'s fallback: the ones it already tried) are passed over
    unread. ``unmanifested``: gets the names of the ``checkpoint-<step>`` directories
    without a manifest (nor a marker of ours) met above it, newest first (what a
    reader's start reports).

    Raises:
        StorageError: an I/O error on a candidate (as ``scan``): never taken for "no
            checkpoint", which would resume from an older step or from scratch.
    """
    entries = _newest_first(storage, run_id=run_id, skip=skip, cache=None)
    if unmanifested is not None:
        entries = _noting_unmanifested(entries, unmanifested)
    return next(_valid_only(storage, entries, warn=warn), None)


def _noting_unmanifested(entries: Iterable[Entry], met: list[str]) -> Iterator[Entry]:
    for e in entries:
        if e.unmanifested:
            met.append(e.name)
        yield e


def _newest_first(
    storage: Storage,
    *,
    run_id: str | None,
    skip: Collection[int] = (),
    cache: ManifestCache | None = None,
    steps: list[tuple[int, str]] | None = None,
) -> Iterator[Entry]:
    """The checkpoint entries of the root (strict names only), newest step first, each
    read when the caller asks for the next one: one listing of ROOT (unless ``steps``,
    from ``_checkpoint_names``, is given), then one manifest read and one size check of
    its files per entry. Names that vanish meanwhile are passed over. ``cache`` is
    filled with what is read, so a later ``scan`` through it does not read it again.

    Without ``steps``, a walk on which names vanished (retention deleted them, after it
    committed a newer checkpoint this listing predates) lists ROOT again when it runs
    out, for the names it has not walked yet: a reader racing a ``KeepLast(1)``
    rotation would otherwise find no checkpoint at all, although one was committed at
    every instant. At most ``READ_ATTEMPTS`` listings."""
    relist = steps is None
    if steps is None:
        steps, _ = _checkpoint_names(_root_names(storage))
    walked = set(skip)
    steps = [(step, name) for step, name in steps if step not in walked]
    walked.update(step for step, _ in steps)
    for _ in range(READ_ATTEMPTS):
        vanished = False
        for step, name in reversed(steps):
            token = manifest_token(storage, name) if cache is not None else None
            entry = _settled(
                storage, name, step, run_id=run_id, full=False, cache=cache, token=token
            )
            if entry is None:
                vanished = True
            else:
                yield entry
        if not (relist and vanished):
            return
        steps = _new_names(storage, walked)


def _new_names(storage: Storage, seen: set[int]) -> list[tuple[int, str]]:
    """The checkpoint names of a fresh listing of ROOT whose steps are not in ``seen``
    (added to it), ascending: what a walk on which names vanished (a rotation, which
    commits a newer checkpoint first) has not looked at yet."""
    fresh = [(s, n) for s, n in _checkpoint_names(_root_names(storage))[0] if s not in seen]
    seen.update(s for s, _ in fresh)
    return fresh


@dataclass(frozen=True)
class Newest:
    """What a walk down from the newest checkpoint of a root learned (``newest_valid``).

    Attributes:
        valid: this run's newest valid checkpoints, newest first (at most the number
            asked for).
        corrupt: the corrupt checkpoints met on the way (``scan``'s "corrupt").
        last_seq: the highest ``commit_seq`` of any manifest read on the way, whatever
            its run or status: every checkpoint name at or above the oldest step in
            ``valid`` was read (all of them when ``valid`` is empty).
        complete: every checkpoint name of the root was looked at, so ``valid`` and
            ``corrupt`` are what a full ``scan`` counts; otherwise names below the
            oldest step in ``valid`` were not read.
        unmanifested: the ``checkpoint-<step>`` directories met on the way that hold
            no manifest and no marker of ours (another tool's, e.g. a stock Trainer's,
            or a checkpoint that lost its manifest), ascending.
        corrupt_steps: the steps among ``corrupt`` whose manifest is this run's and
            readable (a file missing, of another size: a save of that step replaces
            it, as one that failed its checksums), ascending.
        other_runs: the other runs whose checkpoints were met on the way, each with
            the newest step of it met (``other_runs_of``).
    """

    valid: tuple[Manifest, ...]
    corrupt: int
    last_seq: int
    complete: bool
    unmanifested: tuple[str, ...] = ()
    corrupt_steps: tuple[int, ...] = ()
    other_runs: dict[str, int] = field(default_factory=dict)


def newest_valid(
    storage: Storage, *, run_id: str, count: int = 1, cache: ManifestCache | None = None
) -> Newest:
    """This run's ``count`` newest valid checkpoints, read newest first and stopping
    there (``newest``'s walk), with what was learned on the way: a writable start's
    view of the root without reading every manifest in it. Only when fewer than
    ``count`` are valid is the whole root read, and then the counts are those of a
    full ``scan``. Nothing is logged (a start reports what it decides, not each entry).

    Raises:
        StorageError: an I/O error on a candidate (as ``scan``).
    """
    steps, _ = _checkpoint_names(storage.listdir(""))
    return _walk_down(storage, steps, run_id=run_id, count=count, cache=cache)


def _walk_down(
    storage: Storage,
    steps: list[tuple[int, str]],
    *,
    run_id: str,
    count: int,
    cache: ManifestCache | None,
) -> Newest:
    """``newest_valid`` over the checkpoint names ``steps`` (``_checkpoint_names``)."""
    valid: list[Manifest] = []
    unmanifested: list[str] = []
    seen: list[Entry] = []
    corrupt = last_seq = 0
    for entry in _newest_first(storage, run_id=run_id, cache=cache, steps=steps):
        seen.append(entry)
        if entry.manifest is not None:
            last_seq = max(last_seq, entry.manifest.commit_seq)
        if entry.status == "corrupt":
            corrupt += 1
        elif entry.unmanifested:
            unmanifested.append(entry.name)
        elif entry.status == "ok" and entry.manifest is not None:
            valid.append(entry.manifest)
            if len(valid) >= count:
                break
    # Stopped at the count-th valid checkpoint: complete only if it was the oldest name.
    complete = len(valid) < count or valid[-1].step == steps[0][0]
    return Newest(
        tuple(valid),
        corrupt,
        last_seq,
        complete,
        tuple(reversed(unmanifested)),
        corrupt_steps_of(seen, run_id),
        other_runs_of(seen),
    )


def other_runs_of(entries: Iterable[Entry]) -> dict[str, int]:
    """The runs of the other runs' checkpoints among ``entries`` (``foreign`` with a
    manifest), each with its newest step there: what a run that finds none of its own
    names, instead of a silent start from scratch beside them."""
    runs: dict[str, int] = {}
    for e in entries:
        m = e.manifest
        if e.status == "foreign" and m is not None and m.run_id:
            runs[m.run_id] = max(runs.get(m.run_id, m.step), m.step)
    return runs


def plain_path(path: str) -> str:
    """A file's path in a checkpoint without the marker strategy's ``attempt-<token>/``
    prefix: the same file of a step in every copy, whatever strategy wrote it."""
    head, sep, rest = path.partition("/")
    if sep and layout.parse_attempt_dir(head) is not None:
        return rest
    return path


def same_content(a: Manifest, b: Manifest) -> bool:
    """Whether two copies of a step (on two tiers, or two roots) hold the same files:
    the same paths, sizes and checksums."""

    def files(m: Manifest) -> set[tuple[str, int, str]]:
        return {(plain_path(f.path), f.size_bytes, f.checksum) for f in m.files}

    return a.state_kind == b.state_kind and files(a) == files(b)


def is_replica(copy: Manifest, source: Manifest) -> bool:
    """Whether ``copy`` (a step on the persistent tier) is a replica of ``source`` (the
    step on a tier 0): ``same_content``, or, for one node's tier 0 of a multi-node job
    (a manifest of its storage domain, ``domain_ranks``), every file of that node in the
    copy alike: the copy holds every node's files."""
    if source.domain_ranks is None:
        return same_content(copy, source)

    def files(m: Manifest) -> set[tuple[str, int, str]]:
        return {(plain_path(f.path), f.size_bytes, f.checksum) for f in m.files}

    return copy.state_kind == source.state_kind and files(source) <= files(copy)


def runs_of(manifests: Iterable[Manifest]) -> dict[str, list[int]]:
    """The runs whose checkpoints ``manifests`` are, each with its steps: what a root
    without a run file holds. A checkpoint that records no run
    (``Manifest.belongs_to``) is every run's, and counted under "" only when no
    checkpoint names a run."""
    runs: dict[str, list[int]] = {}
    anonymous: list[int] = []
    for m in manifests:
        if m.run_id:
            runs.setdefault(m.run_id, []).append(m.step)
        else:
            anonymous.append(m.step)
    if not runs and anonymous:
        return {"": anonymous}
    for steps in runs.values():
        steps.extend(anonymous)
    return runs


def corrupt_steps_of(entries: Iterable[Entry], run_id: str) -> tuple[int, ...]:
    """The steps of ``entries`` that are corrupt checkpoints of ``run_id`` with a
    readable manifest (a file missing, or of another size), ascending."""
    return tuple(
        sorted(
            e.manifest.step
            for e in entries
            if e.status == "corrupt" and e.manifest is not None and e.manifest.belongs_to(run_id)
        )
    )


@dataclass(frozen=True)
class Above:
    """What a rollback to ``step`` learns of a root (``above``).

    Attributes:
        ours: this run's checkpoints above ``step``, valid or corrupt (a readable
            manifest of this run), newest first: what the rollback deletes.
        below: ``newest_valid``'s answer among the checkpoints at or below ``step``.
    """

    ours: tuple[int, ...]
    below: Newest


def above(
    storage: Storage,
    step: int,
    *,
    run_id: str,
    count: int = 1,
    cache: ManifestCache | None = None,
) -> Above:
    """This run's checkpoints above ``step``, and its newest valid ones at or below it:
    one listing, then the manifests above ``step`` and, below it, newest first down to
    the ``count``-th valid one. A rollback by a few steps on a root of thousands of
    checkpoints reads a few manifests, not all of them. Other runs' checkpoints and
    entries without a readable manifest are never counted as ours.

    Raises:
        StorageError: an I/O error on a candidate (as ``scan``).
    """
    steps, _ = _checkpoint_names(storage.listdir(""))
    split = bisect.bisect_right([s for s, _ in steps], step)  # steps ascend
    ours = tuple(
        e.step
        for e in _newest_first(storage, run_id=run_id, cache=cache, steps=steps[split:])
        if e.status in ("ok", "corrupt") and e.manifest is not None and e.step is not None
    )
    below = _walk_down(storage, steps[:split], run_id=run_id, count=count, cache=cache)
    return Above(ours, below)


def recorded_run_id(storage: Storage) -> str | None:
    """The run recorded in ROOT's run file (``layout.RUN_FILE``), or None when there is none.

    Read by the CLI and by ``adopt`` (the manager reads it too, but repairs a damaged
    one instead of refusing).

    Raises:
        CorruptCheckpointError: the run file exists but is not JSON or holds no run id.
        StorageError: it cannot be read.
    """
    try:
        data = storage.read_bytes(layout.RUN_FILE)
    except CheckpointNotFoundError:
        return None
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(
            f"{storage.url(layout.RUN_FILE)} is not valid JSON ({exc})"
        ) from exc
    rid = doc.get("run_id") if isinstance(doc, dict) else None
    if not isinstance(rid, str) or not rid:
        raise CorruptCheckpointError(f"{storage.url(layout.RUN_FILE)} holds no run_id")
    return rid
