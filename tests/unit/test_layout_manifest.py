"""Pure pieces: names, steps, manifest schema, error tree."""

from __future__ import annotations

import errno
import json
import logging
import math
import pickle

import pytest

from atomic_checkpoint import errors
from atomic_checkpoint.layout import (
    checkpoint_name,
    parse_checkpoint_name,
    parse_pending_name,
    pending_name,
    validate_relative_path,
    validate_step,
)
from atomic_checkpoint.manifest import (
    MAX_METADATA_BYTES,
    FileEntry,
    Hasher,
    Manifest,
    check_metadata,
    check_metrics,
)


@pytest.mark.parametrize(
    "name,step",
    [
        ("checkpoint-0", 0),
        ("checkpoint-9", 9),
        ("checkpoint-10", 10),
        ("checkpoint-100000", 100000),
    ],
)
def test_checkpoint_names_parse(name, step):
    assert parse_checkpoint_name(name) == step
    assert checkpoint_name(step) == name


@pytest.mark.parametrize(
    "name",
    [
        "checkpoint-007",
        "checkpoint-1.5",
        "checkpoint--1",
        "checkpoint-",
        "tmp-checkpoint-5",
        "checkpoint-5.tmp",
        "Checkpoint-5",
        "checkpoint-5 ",
        "checkpoint-1e3",
        "checkpoint-٣",
    ],
)
def test_foreign_names_are_not_checkpoints(name):
    assert parse_checkpoint_name(name) is None


def test_pending_names_round_trip_and_are_unique_per_attempt():
    a, b = pending_name(5, "0123456789abcdef"), pending_name(5, "fedcba9876543210")
    assert a != b
    assert parse_pending_name(a) == (5, "0123456789abcdef")
    assert parse_checkpoint_name(a) is None  # a pending name is never a checkpoint


@pytest.mark.parametrize(
    "bad,exc",
    [
        (-1, ValueError),
        (1.0, TypeError),
        ("10", TypeError),
        (True, TypeError),
        (None, TypeError),
        (10**19, ValueError),
        (2**63, ValueError),  # above the format's int64
        (2.5, TypeError),
    ],
)
def test_bad_steps_are_rejected_clearly(bad, exc):
    with pytest.raises(exc, match="step"):
        validate_step(bad)


def test_the_largest_int64_step_is_accepted():
    assert validate_step(2**63 - 1) == 2**63 - 1


def test_numpy_and_torch_integer_steps_are_accepted():
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    assert validate_step(np.int64(7)) == 7
    assert validate_step(torch.tensor(8)) == 8


def test_numpy_and_torch_bools_are_refused_as_python_bools_are():
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    # int() makes 1 of each exactly: save(np.bool_(True), ...) made checkpoint-1.
    for flag in (np.bool_(True), np.bool_(False), torch.tensor(True)):
        with pytest.raises(TypeError, match="step must be a non-negative int"):
            validate_step(flag)


@pytest.mark.parametrize(
    "path",
    [
        "../x",
        "/etc/passwd",
        "a/../../b",
        "a//b",
        "./a",
        "a\\b",
        "C:/x",
        "",
        "a/\x00",
        "a/./b",
    ],
)
def test_manifest_paths_that_escape_are_rejected(path):
    with pytest.raises(ValueError):
        validate_relative_path(path)


def _manifest(**kw):
    base = dict(
        step=3,
        run_id="r",
        commit_seq=1,
        world_size=2,
        files=(
            FileEntry("rank-00000.safetensors", 10, "00000000000000ab", 0),
            FileEntry("rank-00001.safetensors", 10, "00000000000000cd", 1),
        ),
        state_kind="per_rank",
        metrics={"loss": 0.5},
        metadata={"k": [1, 2]},
    )
    base.update(kw)
    return Manifest(**base)


def test_manifest_round_trips():
    m = _manifest()
    back = Manifest.from_json_bytes(m.to_json_bytes())
    assert back == m
    assert back.size_bytes == 20


@pytest.mark.parametrize(
    "field,value",
    [("metrics", {"loss": 0.1}), ("metadata", {"k": [1, 3]}), ("run_id", "s"), ("step", 4)],
)
def test_a_manifest_whose_fields_changed_after_it_was_written_is_corrupt(field, value):
    # No file checksum covers the manifest's own fields: a flipped byte in a metric
    # (which KeepBest acts on) or in the metadata (which a resuming job reads) was
    # read back as the truth.
    doc = json.loads(_manifest().to_json_bytes())
    doc[field] = value
    with pytest.raises(errors.CorruptCheckpointError, match="does not match its own checksum"):
        Manifest.from_json_bytes(json.dumps(doc).encode())
    # Written before the field existed: read as it is.
    del doc["manifest_checksum"]
    assert getattr(Manifest.from_json_bytes(json.dumps(doc).encode()), field) == value
    # Layout (indentation, key order) is not content.
    m = _manifest()
    same = json.loads(m.to_json_bytes())
    assert Manifest.from_json_bytes(json.dumps(same, indent=None).encode()) == m


def _mutate(fn):
    doc = json.loads(_manifest().to_json_bytes())
    fn(doc)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    "mutation,exc,match",
    [
        (lambda d: d.update(schema_version=99), errors.UnsupportedSchemaError, "newer"),
        (lambda d: d.pop("files"), errors.CorruptCheckpointError, "files"),
        (
            lambda d: d["files"][0].update(path="../../etc/passwd"),
            errors.UnsafeCheckpointError,
            "refusing",
        ),
        (lambda d: d["files"][0].update(path="/abs"), errors.UnsafeCheckpointError, "absolute"),
        (lambda d: d["files"][0].update(size=1 << 60), errors.CorruptCheckpointError, "absurd"),
        (lambda d: d["files"][0].update(size=-1), errors.CorruptCheckpointError, "absurd"),
        (lambda d: d["files"].append(dict(d["files"][0])), errors.CorruptCheckpointError, "twice"),
        (lambda d: d.update(format="other"), errors.CorruptCheckpointError, "not an atomic"),
        (lambda d: d.update(step="3"), errors.CorruptCheckpointError, "step"),
        (lambda d: d.update(checksum_algorithm="md5"), errors.UnsupportedSchemaError, "md5"),
        (lambda d: d["metrics"].update(loss="low"), errors.CorruptCheckpointError, "metric"),
        (lambda d: d.update(world_size=0), errors.CorruptCheckpointError, "world_size"),
        # The format's rules for checksums and strategies (all were accepted, and full
        # verification then called the intact file corrupt).
        (
            lambda d: d["files"][0].update(checksum=d["files"][0]["checksum"].upper() + "A"),
            errors.CorruptCheckpointError,
            "lowercase hex",
        ),
        (
            lambda d: d["files"][0].update(checksum=d["files"][0]["checksum"][1:]),
            errors.CorruptCheckpointError,
            "not 16 lowercase hex digits",
        ),
        (
            lambda d: d["files"][0].update(checksum="AbCdEf0123456789"),
            errors.CorruptCheckpointError,
            "lowercase hex",
        ),
        (lambda d: d.update(strategy=""), errors.CorruptCheckpointError, "no strategy"),
        # format.md: a file's rank is "the rank whose state it holds" (both were read as
        # valid: a rank outside the job, a per-rank file claiming another rank's name)
        (lambda d: d["files"][1].update(rank=2), errors.CorruptCheckpointError, "world_size is 2"),
        (lambda d: d["files"][1].update(rank=0), errors.CorruptCheckpointError, "its name says"),
    ],
)
def test_invalid_manifests_raise_precise_errors(mutation, exc, match):
    with pytest.raises(exc, match=match):
        Manifest.from_json_bytes(_mutate(mutation))


def test_files_named_by_their_writer_may_have_any_name_of_a_rank():
    # saving() and the integrations name their own files: only a per-rank save's state
    # files must carry the rank their name says.
    files = (FileEntry("out/rank-00001.safetensors", 10, "00000000000000ab", 0),)
    m = _manifest(state_kind="files", files=files)
    assert Manifest.from_json_bytes(m.to_json_bytes()).files == files


@pytest.mark.parametrize("data", [b"", b"{", b"[]", b"\xff\xfe", b"null"])
def test_garbage_manifests_are_corrupt(data):
    with pytest.raises(errors.CorruptCheckpointError):
        Manifest.from_json_bytes(data)


def test_hashers_are_streaming_and_distinct():
    a, b = Hasher("xxh3_64"), Hasher("xxh3_64")
    a.update(b"hello world")
    b.update(b"hello ")
    b.update(memoryview(b"world"))
    assert a.hexdigest() == b.hexdigest()
    c = Hasher("crc32")
    c.update(b"hello world")
    assert c.hexdigest() == "0d4a1185"


def test_metrics_are_numbers_and_non_finite_ones_are_left_out(caplog):
    assert check_metrics({"a": 1}) == {"a": 1.0}
    with caplog.at_level(logging.WARNING, logger="atomic_checkpoint"):
        got = check_metrics({"nan": float("nan"), "inf": -math.inf, "big": 10**400, "b": 2})
    assert got == {"b": 2.0}  # a diverged loss never costs the save
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "metric 'nan' is nan",
        "metric 'inf' is -inf",
        "metric 'big' is inf",
    ]
    with pytest.raises(TypeError, match="number"):
        check_metrics({"a": "x"})
    with pytest.raises(TypeError, match="must be a mapping"):
        check_metrics(0.5)  # type: ignore[arg-type]


def test_metadata_is_a_bounded_json_mapping():
    assert check_metadata({"epoch": 3}) == {"epoch": 3}
    with pytest.raises(TypeError, match="must be a mapping"):
        check_metadata(["x"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="JSON-serialisable"):
        check_metadata({"a": object()})
    # A manifest larger than its readers accept would be a save that cannot be loaded.
    with pytest.raises(ValueError, match="put large data in the saved state"):
        check_metadata({"blob": "x" * (MAX_METADATA_BYTES + 1)})
    # What the manifest records, so that a save's CheckpointInfo says what latest()
    # reads back: int keys as strings, tuples as lists.
    assert check_metadata({"by_rank": {0: "a"}, "t": (1, 2)}) == {
        "by_rank": {"0": "a"},
        "t": [1, 2],
    }
    # Keys of mixed types cannot be sorted as the manifest sorts them: refused here,
    # naming metadata (it was a bare TypeError from the commit).
    with pytest.raises(TypeError, match="metadata must be JSON-serialisable, with string keys"):
        check_metadata({"m": {0: "a", "x": "b"}})


def test_a_rank_out_of_space_is_caught_as_storage_full_on_every_rank():
    """With one rank a full disk raises StorageFullError; with many it was only a
    DistributedCheckpointError, and `except StorageFullError:` around the save (the
    README's advice for a full disk) never fired under torchrun."""
    full = errors.RankFailure(1, "write", "StorageFullError", "write 'x' failed (errno 28)")
    other = errors.RankFailure(0, "write", "CoordinationTimeoutError", "rank 1 hung")
    e = errors.DistributedCheckpointError([other, full], step=7)
    assert isinstance(e, errors.StorageFullError) and isinstance(e, OSError)
    assert isinstance(e, errors.DistributedCheckpointError) and e.errno == errno.ENOSPC
    assert e.failures == (other, full) and e.step == 7 and "rank 1" in str(e)
    assert type(e) is errors.DistributedStorageFullError
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is type(e) and str(back) == str(e) and back.errno == errno.ENOSPC
    assert back.failures == e.failures and back.step == 7
    quota = errors.RankFailure(2, "write", "StorageFullError", "write 'y' failed (errno 122)")
    assert errors.DistributedCheckpointError([quota]).errno == errno.EDQUOT
    plain = errors.DistributedCheckpointError([other], step=7)
    assert type(plain) is errors.DistributedCheckpointError
    assert not isinstance(plain, errors.StorageFullError)
    assert str(pickle.loads(pickle.dumps(plain))) == str(plain)
    try:
        raise coordination_shared([full], 7)
    except errors.StorageFullError as caught:
        assert caught.failed_ranks == (1,)
    # restore(into=) with a target that does not match on one rank: the same for
    # StateMismatchError (a ValueError too), which `except StateMismatchError` missed.
    shape = errors.RankFailure(1, "load", "StateMismatchError", "'w': shape (3,) != (4,)")
    e2 = errors.DistributedCheckpointError([other, shape], step=7, operation="load")
    assert isinstance(e2, errors.StateMismatchError) and isinstance(e2, ValueError)
    assert type(e2) is errors.DistributedStateMismatchError and "loading" in str(e2)
    back2 = pickle.loads(pickle.dumps(e2))
    assert type(back2) is type(e2) and str(back2) == str(e2) and back2.operation == "load"
    # A full disk takes precedence: the save's failure is what the user must act on.
    assert type(errors.DistributedCheckpointError([shape, full])) is type(e)


def coordination_shared(failures, step):
    from atomic_checkpoint.coordination import shared_error

    return shared_error(failures, step)


def test_errors_pickle_and_keep_their_fields():
    failure = errors.RankFailure(2, "write", "StorageFullError", "disk full")
    e = errors.DistributedCheckpointError([failure], step=5)
    back = pickle.loads(pickle.dumps(e))
    assert back.failures == (failure,) and back.step == 5 and str(back) == str(e)
    t = errors.CoordinationTimeoutError("late", missing_ranks=(3,), key="k")
    assert pickle.loads(pickle.dumps(t)).missing_ranks == (3,)
    r = errors.ResumeError("wiped", partial_steps=(10, 20))
    assert pickle.loads(pickle.dumps(r)).partial_steps == (10, 20)
    assert errors.ResumeError("none").partial_steps == ()
    s = errors.map_os_error(OSError(errno.ENOSPC, "No space left on device"), "write", "/x")
    assert isinstance(s, errors.StorageFullError) and isinstance(s, OSError)
    back_s = pickle.loads(pickle.dumps(s))
    assert back_s.errno == errno.ENOSPC and back_s.path == "/x"
    assert isinstance(errors.map_os_error(OSError(errno.EROFS, "ro"), "w", "/x"), PermissionError)
    # A driver's error without an errno (an S3 read timeout) is not "(errno None)".
    timeout = errors.map_os_error(OSError("Read timeout on endpoint URL"), "open", "s3://b/r")
    assert str(timeout) == "open 's3://b/r' failed: Read timeout on endpoint URL"
    assert isinstance(errors.CheckpointNotFoundError("x"), FileNotFoundError)


class _StaleSizeStorage:
    """Pure logic only: a network-filesystem client that serves a replaced manifest cut
    to the old, cached length until it is refreshed (seen on sshfs under load)."""

    def __init__(self, stale_reads: int):
        from dataclasses import replace

        from atomic_checkpoint.storage.memory import MemoryStorage

        self.inner = MemoryStorage()
        self.capabilities = replace(self.inner.capabilities, coherent=False)
        self.stale_reads = stale_reads
        self.refreshes = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def refresh(self, path: str) -> None:
        self.refreshes += 1

    def read_bytes(self, path: str) -> bytes:
        data = self.inner.read_bytes(path)
        if path.endswith("manifest.json") and self.stale_reads > 0:
            self.stale_reads -= 1
            return data[: len(data) // 2]
        return data


def _manifest_bytes(step: int) -> bytes:
    m = Manifest(step=step, run_id="r", commit_seq=1, world_size=1, files=(), state_kind="files")
    return m.to_json_bytes()


@pytest.mark.parametrize("stale_reads", [1, 3])
def test_a_manifest_read_cut_to_a_stale_size_is_read_again(stale_reads):
    from atomic_checkpoint import catalog

    s = _StaleSizeStorage(stale_reads)
    s.inner.makedirs("checkpoint-4")
    s.inner.write_bytes_atomic("checkpoint-4/checkpoint.manifest.json", _manifest_bytes(4))
    assert catalog.read_manifest(s, "checkpoint-4").step == 4
    assert s.refreshes == stale_reads


def test_a_manifest_that_stays_unreadable_is_still_corrupt(monkeypatch):
    from atomic_checkpoint import catalog

    monkeypatch.setattr(catalog, "_STALE_SIZE_WAIT_S", 0.2)
    s = _StaleSizeStorage(10**6)
    s.inner.makedirs("checkpoint-4")
    s.inner.write_bytes_atomic("checkpoint-4/checkpoint.manifest.json", _manifest_bytes(4))
    with pytest.raises(errors.CorruptCheckpointError, match="not valid JSON"):
        catalog.read_manifest(s, "checkpoint-4")
    assert s.refreshes >= 2
