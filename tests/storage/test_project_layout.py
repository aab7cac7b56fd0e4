"""The Accelerate layout (``storage.project``) on a real directory: committed
checkpoints are ``<project>/checkpoints/checkpoint_<step>`` and nothing else of ours is
in that folder; steps are parsed strictly and ordered by integer; retention and the
start-up sweep work through the view and never touch foreign entries; every tool that
opens the project, or its ``checkpoints/`` folder, sees the same checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from atomic_checkpoint import CheckpointManager, KeepLast
from atomic_checkpoint.errors import CorruptCheckpointError, StorageError
from atomic_checkpoint.layout import accelerate_name, parse_accelerate_name
from atomic_checkpoint.storage import LocalStorage, open_storage
from atomic_checkpoint.storage.project import ProjectStorage, record_layout

FOREIGN = ["checkpoint_007", "checkpoint_1.5", "checkpoint-4", "notes.txt", "checkpoint_x"]


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "run"
    (project / "checkpoints").mkdir(parents=True)
    record_layout(LocalStorage(str(project)))
    for name in FOREIGN:
        if name.endswith(".txt"):
            (project / "checkpoints" / name).write_text("x")
        else:
            (project / "checkpoints" / name).mkdir()
            (project / "checkpoints" / name / "model.safetensors").write_bytes(b"0" * 8)
    return project


def _save(mgr: CheckpointManager, step: int) -> None:
    with mgr.saving(step) as pending:
        (pending / "model.safetensors").write_bytes(b"w" * (step + 1))


def test_strict_names() -> None:
    assert accelerate_name(0) == "checkpoint_0"
    assert parse_accelerate_name("checkpoint_12") == 12
    for name in (
        "checkpoint_007",
        "checkpoint_1.5",
        "checkpoint-3",
        "checkpoint_",
        "checkpoint_-1",
    ):
        assert parse_accelerate_name(name) is None, name


def test_discovery_retention_and_sweep_through_the_view(tmp_path: Path) -> None:
    project = _project(tmp_path)
    # A save killed in an earlier job: its pending folder is in the project directory.
    leftover = project / ".pending" / "checkpoint-11.0123456789abcdef"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"torn")

    mgr = CheckpointManager(str(project), retention=KeepLast(1))
    assert isinstance(mgr.storage, ProjectStorage)
    assert not leftover.exists()  # swept at start-up, under the run lock
    for step in (9, 10):
        _save(mgr, step)
    assert mgr.latest().step == 10  # by integer: "10" < "9" as strings
    mgr.close()  # waits for the rotation

    names = sorted(os.listdir(project / "checkpoints"))
    assert names == sorted([*FOREIGN, "checkpoint_10"])  # 9 rotated, foreign kept
    assert (project / "checkpoints" / "checkpoint_10" / "checkpoint.manifest.json").is_file()
    assert not any(n.startswith(".") for n in names)

    # The checkpoints/ folder opens as the same project; so does the project itself.
    for root in (project, project / "checkpoints"):
        reader = CheckpointManager(str(root), read_only=True)
        assert [c.step for c in reader.checkpoints()] == [10]
        assert reader.checkpoints()[0].path == str(project / "checkpoints" / "checkpoint_10")
        reader.verify(10)
        reader.close()
    view = open_storage(str(project / "checkpoints"))
    listed = view.listdir("")
    assert "checkpoint-10" in listed and "checkpoints/checkpoint-4" in listed
    assert "checkpoint_007" in listed  # foreign: never parsed as step 7


def test_checkpoints_folder_that_is_a_link_is_refused(tmp_path: Path) -> None:
    project = tmp_path / "run"
    project.mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", project / "checkpoints")
    with pytest.raises(StorageError, match="symbolic link"):
        ProjectStorage(LocalStorage(str(project)))


def test_damaged_layout_record_is_an_error_not_another_layout(tmp_path: Path) -> None:
    project = _project(tmp_path)
    (project / ".atomic-checkpoint" / "layout.json").write_text("{torn")
    with pytest.raises(CorruptCheckpointError, match=r"layout\.json"):
        open_storage(str(project))


@pytest.mark.timeout(30)
def test_a_fifo_as_the_layout_record_is_an_error_not_a_hang(tmp_path: Path) -> None:
    # Opening it for reading waited for a writer for ever: every manager, reader and
    # CLI command on the project hung.
    project = _project(tmp_path)
    record = project / ".atomic-checkpoint" / "layout.json"
    record.unlink()
    os.mkfifo(record)
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        open_storage(str(project))


def test_a_saving_block_on_a_project_written_in_place_lands_where_the_commit_looks(tmp_path):
    # Accelerate's project view on an s3fs-fuse mount (the marker strategy): the
    # saving() directory joined ROOT and the protocol's checkpoint-<n>/attempt-<t>, not
    # the project's checkpoints/checkpoint_<n>/: every save_state() failed ("holds no
    # file"), and its files were left where nothing cleans.
    project = tmp_path / "proj"
    project.mkdir()
    base = LocalStorage(str(project))
    record_layout(base)
    with CheckpointManager(ProjectStorage(base), strategy="marker") as mgr:
        with mgr.saving(0) as d:
            (d / "model.safetensors").write_bytes(b"weights")
        assert str(d).startswith(str(project / "checkpoints" / "checkpoint_0" / "attempt-"))
        assert (d / "model.safetensors").is_file() and d.info.files_path == str(d)
        assert [c.step for c in mgr.checkpoints()] == [0]
    assert sorted(os.listdir(project)) == [".atomic-checkpoint", ".pending", "checkpoints"]
