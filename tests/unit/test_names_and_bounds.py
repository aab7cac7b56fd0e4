"""What a save may write and what readers accept agree: files a ``saving()`` block
names like our own leftovers are the checkpoint's, never swept; names a manifest
cannot list fail the save; a manifest is never committed larger than readers read;
checkpoint names are matched whole (``checkpoint-3\\n`` is no step)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from atomic_checkpoint import CheckpointError, CheckpointManager, catalog, manifest
from atomic_checkpoint.layout import parse_checkpoint_name, parse_marker_name
from atomic_checkpoint.strategies import MarkerStrategy

MARKER_LIKE = "checkpoint.pending-0123456789abcdef.json"
TEMP_LIKE = "shard.bin.tmp-12345-67890"


@pytest.mark.parametrize("strategy", ["rename", "marker"])
def test_files_named_like_our_leftovers_are_the_checkpoints_and_never_swept(tmp_path, strategy):
    # clean, and a start under the marker strategy, deleted them as stale markers or
    # abandoned temporary files: the checkpoint then read as corrupt.
    with CheckpointManager(tmp_path, strategy=strategy) as mgr, mgr.saving(1) as d:
        (d / MARKER_LIKE).write_text("{}")
        (d / TEMP_LIKE).write_bytes(b"0123456789")
        old = time.time() - 7200  # copied with its time (cp -p): looks abandoned
        os.utime(d / TEMP_LIKE, (old, old))
    found = MarkerStrategy().leftovers(mgr.storage)
    assert found == [], found
    with CheckpointManager(tmp_path, strategy="marker") as mgr:  # a start sweeps
        assert [c.step for c in mgr.checkpoints()] == [1]
        listed = {f.path.rsplit("/", 1)[-1] for f in catalog.load_checkpoint(mgr.storage, 1).files}
        assert {MARKER_LIKE, TEMP_LIKE} <= listed
        catalog.validate(mgr.storage, "checkpoint-1", catalog.load_checkpoint(mgr.storage, 1))


@pytest.mark.parametrize("name", ["x:y.bin", "a\\b.bin"])
def test_a_name_no_manifest_can_list_fails_the_save_before_the_commit(tmp_path, name):
    # It was committed, and the same manager then listed the checkpoint as corrupt.
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"x": torch.zeros(2)})
        with (
            pytest.raises(CheckpointError, match="which a manifest cannot list"),
            mgr.saving(2) as d,
        ):
            (d / name).write_bytes(b"1")
        assert [c.step for c in mgr.checkpoints()] == [1]
        with mgr.saving(2) as d:  # the step is free for the save done right
            (d / "y.bin").write_bytes(b"1")
        assert mgr.latest().step == 2


def test_checkpoint_names_are_matched_whole(tmp_path):
    assert parse_checkpoint_name("checkpoint-3\n") is None
    assert parse_marker_name(MARKER_LIKE + "\n") is None
    with CheckpointManager(tmp_path) as mgr:
        for s in (1, 2):
            mgr.save(s, {"x": torch.full((2,), float(s))})
    os.rename(tmp_path / "checkpoint-2", tmp_path / "checkpoint-3\n")
    with CheckpointManager(tmp_path, read_only=True) as reader:
        assert [c.step for c in reader.checkpoints()] == [1]
        assert reader.latest().step == 1


def test_a_manifest_is_never_committed_larger_than_readers_accept(tmp_path, monkeypatch):
    # Deeply nested metadata within its 16 MiB limit made an indented manifest of
    # 74 MiB: the save returned, and every reader refused the checkpoint by its size.
    deep: object = 0
    for _ in range(400):
        deep = [deep]
    meta = {f"k{i}": deep for i in range(300)}
    with CheckpointManager(tmp_path) as mgr:
        info = mgr.save(1, {"x": torch.zeros(2)}, metadata=meta)
        size = os.path.getsize(tmp_path / "checkpoint-1" / "checkpoint.manifest.json")
        assert mgr.latest().step == 1 and info.metadata == meta
        assert size < manifest.MAX_MANIFEST_BYTES
    # Metrics had no bound at all.
    with pytest.raises(ValueError, match=r"metrics are about .* bytes as JSON"):
        manifest.check_metrics({f"{i:06d}" + "m" * 300: 1.0 for i in range(70_000)})
    # Whatever makes it too large (here a lower bound, many files) fails the save.
    monkeypatch.setattr(manifest, "MAX_MANIFEST_BYTES", 4000)
    with CheckpointManager(tmp_path / "many") as mgr:
        mgr.save(1, {"x": torch.zeros(2)})
        with (
            pytest.raises(ValueError, match="more than the 4000 bytes readers accept"),
            mgr.saving(2) as d,
        ):
            for i in range(100):
                (d / f"shard-{i:03d}.bin").write_bytes(b"1")
        assert [c.step for c in mgr.checkpoints()] == [1]
        assert os.listdir(tmp_path / "many" / ".pending") == []


def test_a_per_rank_manifest_that_lacks_a_ranks_file_is_corrupt(tmp_path):
    # A manifest of 2 ranks listing rank 0's file alone (a writer's bug, a hand edit)
    # verified and was listed; restore(rank=1) then failed on it.
    from tests.cli.helpers import rewrite_manifest

    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"x": torch.zeros(2)})
        mgr.save(2, {"x": torch.ones(2)})
    rewrite_manifest(tmp_path, 2, world_size=2)
    with CheckpointManager(tmp_path, read_only=True) as reader:
        assert [c.step for c in reader.checkpoints()] == [1]
        with pytest.raises(CheckpointError, match=r"lists no file of rank\(s\) \[1\]"):
            catalog.load_checkpoint(reader.storage, 2)


def test_a_marker_checkpoints_files_are_where_its_files_path_says(tmp_path):
    # Written in place (an object store, an s3fs-fuse mount), a saving() block's files
    # live in checkpoint-<step>/attempt-<token>/: nothing named that folder, and a
    # framework loading from the checkpoint's path found no config.json.
    with CheckpointManager(tmp_path, strategy="marker") as mgr:
        with mgr.saving(1) as d:
            (d / "config.json").write_text("{}")
        infos = (d.info, mgr.latest(), mgr.checkpoints()[0])
        for info in infos:
            assert os.path.isfile(os.path.join(info.files_path, "config.json")), info
            assert info.path == mgr.checkpoint_path(1) == str(tmp_path / "checkpoint-1")
            assert os.path.isfile(os.path.join(info.path, "checkpoint.manifest.json"))
        mgr.save(2, {"x": torch.zeros(2)})  # restored by step, not read by path
        assert mgr.latest().files_path == mgr.latest().path == str(tmp_path / "checkpoint-2")


def test_the_attempt_an_overwrite_replaced_is_swept_though_no_marker_names_it(tmp_path):
    # An overwrite (marker strategy: an object store) cut after its new manifest landed
    # left the replaced attempt's files: no marker names them, so neither a start nor
    # `clean` ever found them, billed for as long as the step is kept.
    import shutil

    with CheckpointManager(tmp_path, strategy="marker") as mgr:
        mgr.save(2, {"x": torch.ones(1 << 10)})
        live = catalog.load_checkpoint(mgr.storage, 2).files_dir
    ck = tmp_path / "checkpoint-2"
    orphan = "attempt-0123456789abcdef"
    shutil.copytree(ck / live, ck / orphan)  # the state the cut overwrite leaves
    assert [(c.name, c.trees) for c in MarkerStrategy().leftovers(mgr.storage)] == [
        ("checkpoint-2", (f"checkpoint-2/{orphan}",))
    ]
    with CheckpointManager(tmp_path, strategy="marker") as mgr:  # a start sweeps
        assert sorted(os.listdir(ck)) == sorted(["checkpoint.manifest.json", live])
        assert float(mgr.restore(2)["x"][0]) == 1.0


def test_an_orphan_attempt_is_found_on_an_object_store_too():
    # Object stores are swept from one recursive listing, which looked for markers and
    # temporary files only: an orphan attempt there was never even looked at.
    from atomic_checkpoint.storage.memory import MemoryStorage

    storage = MemoryStorage()
    assert storage.local_path("") is None  # the object-store path of the sweep
    with CheckpointManager(storage, strategy="marker") as mgr:
        mgr.save(2, {"x": torch.ones(4)})
    orphan = "checkpoint-2/attempt-0123456789abcdef"
    storage.makedirs(orphan)
    storage.write_bytes_atomic(f"{orphan}/rank-00000.safetensors", b"old copy")
    assert [c.trees for c in MarkerStrategy().leftovers(storage)] == [(orphan,)]
