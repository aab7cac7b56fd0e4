"""A local root names one directory however it is spelled: relative, ``./x/``, ``~/x``,
or a ``file://`` URL as ``Path.as_uri()`` writes it (percent-encoded, RFC 8089), both
for ``open_storage`` (what ``CheckpointManager`` and the CLI use) and for
``FsspecStorage("file://...")``. Real directories under ``tmp_path``."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from atomic_checkpoint import CheckpointManager
from atomic_checkpoint.storage import FsspecStorage, local_root, open_storage


def test_spellings_of_one_local_root_name_the_same_directory(tmp_path, monkeypatch):
    target = tmp_path / "runs" / "exp [1] 50%"
    target.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    spellings = [
        str(target),
        f"{target}//",
        "runs/exp [1] 50%",
        "./runs/../runs/exp [1] 50%/",
        "~/runs/exp [1] 50%",
        target.as_uri(),  # file:///.../exp%20%5B1%5D%2050%25
        "file://localhost" + target.as_uri()[len("file://") :],
    ]
    for text in spellings:
        assert local_root(text) == str(target), text
        assert open_storage(text).url() == str(target), text
    with CheckpointManager(target.as_uri()) as mgr:
        mgr.save(1, {"w": np.zeros(4)})
    assert (target / "checkpoint-1").is_dir()
    assert not (tmp_path / "~").exists()
    # fsspec's file:// takes the same URL to the same directory.
    storage = FsspecStorage(target.as_uri())
    assert storage.local_path() == str(target)
    assert "checkpoint-1" in storage.listdir("")


def test_no_pattern_expanding_fsspec_call_in_the_fsspec_storage():
    """fsspec's ``rm``, ``glob``, ``expand_path``, ``cat``, ``get``, ``put``, ``copy``
    and ``mv`` read ``[``, ``*`` and ``?`` in a path as a pattern (a root
    ``s3://b/exp[12]`` would match runs ``exp1`` and ``exp2``); the storage lists keys
    (``ls``, ``find``) and acts on exactly those. This keeps it that way."""
    import ast
    import inspect

    from atomic_checkpoint.storage import fsspec as module

    expanding = {"rm", "glob", "expand_path", "cat", "get", "put", "copy", "cp", "mv", "move"}
    calls = [
        f"line {node.lineno}: fs.{node.func.attr}(...)"
        for node in ast.walk(ast.parse(inspect.getsource(module)))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in expanding
        and isinstance(node.func.value, ast.Attribute)
        and node.func.value.attr == "fs"
    ]
    assert calls == [], f"pattern-expanding fsspec calls in storage/fsspec.py: {calls}"


@pytest.mark.parametrize(
    ("root", "meant"),
    [
        (Path("s3://bucket") / "run1", "'s3://bucket/run1'"),
        (Path("gs://bucket/a"), "'gs://bucket/a'"),
    ],
)
def test_a_url_that_went_through_pathlib_is_refused_not_made_a_local_directory(
    tmp_path, monkeypatch, root, meant
):
    # Path("s3://bucket") / "run1" is s3:/bucket/run1: it became ./s3:/bucket/run1, and
    # the checkpoints stayed on the node's disk without a word.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"looks like {meant} with one slash lost"):
        CheckpointManager(root)
    assert os.listdir(tmp_path) == []
    # A local directory really named like this: with ./ in front.
    assert open_storage("./s3:/bucket").local_path("") == str(tmp_path / "s3:" / "bucket")


def test_a_local_storage_path_never_climbs_out_of_the_root(tmp_path):
    from atomic_checkpoint import LocalStorage, UnsafeCheckpointError

    (tmp_path / "secret.txt").write_text("outside")
    storage = LocalStorage(tmp_path / "root")
    storage.makedirs("")
    for call in (
        lambda: storage.read_bytes("../secret.txt"),
        lambda: storage.write_bytes_atomic("../escaped.txt", b"x"),
        lambda: storage.size("a/../../secret.txt"),
    ):
        with pytest.raises(UnsafeCheckpointError, match=r"leaves .* through '\.\.'"):
            call()
    assert not (tmp_path / "escaped.txt").exists()


def test_a_file_url_naming_a_host_is_refused_not_made_relative(tmp_path, monkeypatch):
    # file://tmp/x (one slash short) saved to <cwd>/tmp/x: a restart from another
    # working directory started from scratch without a word.
    monkeypatch.chdir(tmp_path)
    for url in ("file://tmp/run", "file://otherhost/tmp/run"):
        with pytest.raises(ValueError, match=r"names the host .*three slashes"):
            CheckpointManager(url)
    assert os.listdir(tmp_path) == []
    assert local_root("file://LOCALHOST/tmp/run") == "/tmp/run"
    assert local_root("file:///tmp/a%20b") == "/tmp/a b"


def test_local_storage_normalises_its_root_as_open_storage_does(tmp_path, monkeypatch):
    # LocalStorage(root, capabilities=...) is the override the docs give for a FUSE
    # mount: it wrote "~/ckpt" and file:// URLs under the working directory.
    from atomic_checkpoint.storage.local import LocalStorage

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert LocalStorage("~/ckpt").root == str(tmp_path / "home" / "ckpt")
    url = (tmp_path / "u rl").as_uri()
    assert LocalStorage(url).root == str(tmp_path / "u rl")


def test_a_dangling_root_link_and_a_deleted_working_directory_are_said(tmp_path, monkeypatch):
    from atomic_checkpoint import CheckpointNotFoundError

    link = tmp_path / "ckpt"
    os.symlink(tmp_path / "unmounted" / "run", link)
    with pytest.raises(CheckpointNotFoundError, match=r"is a symbolic link to .*does not exist"):
        CheckpointManager(link)
    gone = tmp_path / "cwd"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(CheckpointNotFoundError, match="the working directory no longer exists"):
        CheckpointManager("relative-root")
