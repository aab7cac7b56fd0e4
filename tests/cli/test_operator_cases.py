"""Cases an operator meets that the CLI got wrong (a QA pass): a checkpoint whose state
file header restore rejects, a missing fsspec driver, what clean names, inspect across
tiers, --json documents of failed commands, positionals after options, one checkpoint
directory with its step, misleading messages, STEP parsing, --pin of a missing step,
an all-empty folder for adopt, Ctrl-C while starting, and the documented formats."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from atomic_checkpoint import CheckpointManager, SingleProcessCoordinator
from atomic_checkpoint.errors import CorruptCheckpointError, StorageError
from atomic_checkpoint.layout import MANIFEST_NAME
from atomic_checkpoint.manifest import _body_checksum
from tests.cli.helpers import (
    cli_env,
    error_line,
    make_root,
    manifest_path,
    run_cli,
    run_json,
    state_file,
)

REPO = Path(__file__).resolve().parents[2]


def _says(args: tuple, code: int, said: str, not_said: str) -> None:
    """``atomic-checkpoint ARGS`` exits ``code`` with an error line that says ``said``
    and not ``not_said`` (what it wrongly said before)."""
    proc = run_cli(*args)
    line = error_line(proc)
    assert proc.returncode == code, (args, proc.returncode, proc.stderr)
    assert said in line and not_said not in line, line


def _absurd_shape(root: Path, step: int) -> None:
    """Give the first tensor of ``step``'s state file a shape no load accepts, and
    record the file's new checksum in a resealed manifest: sizes and checksums match,
    the header does not."""
    path = state_file(root, step)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [2**40, 2**40]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    doc = json.loads(manifest_path(root, step).read_text())
    import xxhash

    assert doc["checksum_algorithm"] == "xxh3_64"
    doc["files"][0]["checksum"] = xxhash.xxh3_64(path.read_bytes()).hexdigest()
    doc["files"][0]["size"] = path.stat().st_size
    doc.pop("manifest_checksum", None)
    doc["manifest_checksum"] = _body_checksum(doc, doc["checksum_algorithm"])
    manifest_path(root, step).write_text(json.dumps(doc))


# ------------------------------------------------------------------ 1: header checks
@pytest.mark.timeout(120)
def test_verify_and_inspect_call_corrupt_what_restore_rejects(root):
    make_root(root, (100, 200))
    _absurd_shape(root, 100)
    with CheckpointManager(root, read_only=True, coordinator=SingleProcessCoordinator()) as mgr:
        with pytest.raises(CorruptCheckpointError, match="too large"):
            mgr.restore(100)
        with pytest.raises(CorruptCheckpointError, match="too large"):
            mgr.verify(100)  # the library's verify too, not the CLI's alone
        assert mgr.verify(200).step == 200

    proc = run_cli("verify", root, 100, "--quiet")
    assert proc.returncode == 1 and "too large" in error_line(proc)
    doc = run_json("verify", root, expect_rc=1)
    status = {r["step"]: r["status"] for r in doc["checkpoints"]}
    assert status == {100: "corrupt", 200: "ok"}, doc
    doc = run_json("inspect", root, 100, expect_rc=1)
    assert doc["status"] == "corrupt" and "rank-00000.safetensors" in doc["problem"]
    # list checks presence and sizes only, by design (its docs say so): still ok.
    listed = run_json("list", root)
    assert {e["step"]: e["status"] for e in listed["entries"]} == {100: "ok", 200: "ok"}


@pytest.mark.timeout(120)
def test_prune_does_not_take_a_newest_with_a_bad_header_as_verified(root):
    make_root(root, (100, 200, 300))
    _absurd_shape(root, 300)
    doc = run_json("prune", root, "--keep-last", "1", "--dry-run", expect_rc=1)
    kept = [r["step"] for r in doc["checkpoints"] if r["kept"]]
    assert kept == [200], doc  # 300 set aside: the next newest is kept for a resume
    assert [s["step"] for s in doc["skipped"]] == [300]


# ------------------------------------------------------------------ 2: fsspec drivers
def _protocol_without_driver() -> str:
    pytest.importorskip("fsspec")
    from fsspec.registry import known_implementations

    for proto in ("gs", "az", "oci", "dropbox", "box", "wandb"):
        spec = known_implementations.get(proto)
        if spec is None:
            continue
        module = spec["class"].split(".", 1)[0]
        if importlib.util.find_spec(module) is None:
            return proto
    pytest.skip("every candidate fsspec driver is installed here")


@pytest.mark.timeout(120)
def test_a_missing_fsspec_driver_is_an_environment_error(root):
    proto = _protocol_without_driver()
    url = f"{proto}://bucket/run1"
    with pytest.raises(StorageError, match="pip install"):
        from atomic_checkpoint.storage import open_storage

        open_storage(url)
    make_root(root, (1,))
    for args in (
        ("list", url),
        ("list", root, "--tier", url),
        ("verify", root, "--tier", url),
        ("drain", root, "--to", url),
    ):
        proc = run_cli(*args)
        line = error_line(proc)
        assert proc.returncode == 2, (args, proc.stderr)
        assert "internal error" not in line and "pip install" in line, line


# ------------------------------------------------------------------ 3: clean's names
@pytest.mark.timeout(60)
def test_clean_names_the_file_it_removes_not_the_checkpoint(root):
    make_root(root, (1,))
    temp = root / "checkpoint-1" / f"{MANIFEST_NAME}.tmp-0123456789-999999-1-2"
    temp.write_bytes(b"z\n")
    old = time.time() - 7200
    os.utime(temp, (old, old))  # abandoned by age, whoever wrote it
    name = f"checkpoint-1/{temp.name}"
    proc = run_cli("clean", root, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert f"would remove {name} (temporary, 2 B)" in proc.stdout, proc.stdout
    assert "would remove checkpoint-1 " not in proc.stdout
    doc = run_json("clean", root)
    assert [(i["name"], i["kind"], i["size_bytes"]) for i in doc["removed"]] == [
        (name, "temporary", 2)
    ]
    assert not temp.exists() and (root / "checkpoint-1" / MANIFEST_NAME).exists()


# ------------------------------------------------------------------ 4: inspect --tier
@pytest.mark.timeout(120)
def test_inspect_tier_keeps_root_and_tiers_when_root_lacks_the_step(root, tmp_path):
    make_root(root, (1, 2, 3))
    tier = tmp_path / "persistent"
    tier.mkdir()
    drained = run_cli("drain", root, "--to", tier)
    assert drained.returncode == 0, drained.stderr
    shutil.rmtree(root / "checkpoint-1")
    doc = run_json("inspect", root, 1, "--tier", tier)
    assert doc["root"] == str(root)
    assert doc["path"] == str(tier / "checkpoint-1")
    assert [(t["tier"], t["status"]) for t in doc["tiers"]] == [(0, "missing"), (1, "ok")]
    assert doc["tiers"][0]["url"] == str(root / "checkpoint-1")
    text = run_cli("inspect", root, 1, "--tier", tier)
    assert text.returncode == 0 and "tiers:       0 missing; 1 ok" in text.stdout, text.stdout


# ------------------------------------------------------------------ 5: --json on exit 1
@pytest.mark.timeout(120)
def test_json_commands_that_exit_1_still_print_their_document(root):
    make_root(root, (1, 2))
    (root / "checkpoint-7").mkdir()

    doc = run_json("inspect", root, 7, expect_rc=1)
    assert (doc["status"], doc["manifest"], doc["files"]) == ("not_a_checkpoint", None, [])
    assert "no manifest" in doc["problem"]
    doc = run_json("inspect", root, 9, expect_rc=1)
    assert doc["status"] == "missing" and "no checkpoint step 9" in doc["problem"]

    doc = run_json("verify", root, 7, expect_rc=1)
    [r] = doc["checkpoints"]
    assert doc["ok"] is False and (r["name"], r["status"]) == ("checkpoint-7", "not_a_checkpoint")
    doc = run_json("verify", root, 9, expect_rc=1)
    assert [(r["step"], r["status"]) for r in doc["checkpoints"]] == [(9, "missing")]
    doc = run_json("verify", root, expect_rc=1)
    assert {r["name"]: r["status"] for r in doc["checkpoints"]}["checkpoint-7"] == (
        "not_a_checkpoint"
    )
    # The error line is as before.
    proc = run_cli("verify", root, 9, "--json")
    assert "no checkpoint step 9" in error_line(proc)


@pytest.mark.timeout(60)
def test_verify_json_of_one_checkpoint_dir_with_an_unreadable_manifest(root):
    make_root(root, (1,))
    manifest_path(root, 1).write_text('{"format": "atomic-checkpoint", "step"')
    doc = run_json("verify", root / "checkpoint-1", expect_rc=1)
    [r] = doc["checkpoints"]
    assert r["status"] == "corrupt" and r["name"] == "checkpoint-1" and r["problem"]


# ------------------------------------------------------------------ 6: positionals
@pytest.mark.timeout(120)
def test_positionals_after_options(root, tmp_path):
    make_root(root, (1, 2))
    proc = run_cli("verify", root, "--quiet", 2)
    assert proc.returncode == 0, proc.stderr
    doc = run_json("verify", root, "--all-runs", 2)
    assert [r["step"] for r in doc["checkpoints"]] == [2]
    assert run_json("inspect", root, "--json", 1)["name"] == "checkpoint-1"

    other = tmp_path / "out"
    for step in (100, 200, 300):
        (other / f"checkpoint-{step}").mkdir(parents=True)
        (other / f"checkpoint-{step}" / "model.bin").write_bytes(b"weights")
    doc = run_json("adopt", other, "--framework", "generic", 100, 200, "--dry-run")
    assert doc["adopted"] and [a["step"] for a in doc["adopted"]] == [100, 200]
    # Still a usage error: one STEP too many.
    proc = run_cli("verify", root, 1, "--quiet", 2)
    assert proc.returncode == 2 and "unrecognized arguments: 2" in error_line(proc)


# ------------------------------------------------------------------ 7: ROOT/checkpoint-N N
@pytest.mark.timeout(120)
def test_one_checkpoint_dir_with_its_own_step(root):
    make_root(root, (1, 2))
    one = root / "checkpoint-2"
    proc = run_cli("verify", one, 2)
    assert proc.returncode == 0, proc.stderr
    assert run_json("verify", one, 2)["checkpoints"][0]["name"] == "checkpoint-2"
    for command in ("verify", "inspect"):
        _says((command, one, 1), 2, "is one checkpoint (checkpoint-2, of step 2)", "steps there")


# ------------------------------------------------------------------ 8: messages
@pytest.mark.timeout(60)
def test_a_file_named_like_a_checkpoint_is_said_to_be_no_directory(root):
    make_root(root, (1, 2))
    (root / "checkpoint-5").write_text("not a checkpoint\n")
    for command in ("verify", "inspect"):
        _says((command, root, 5), 1, "checkpoint-5 is not a directory", "steps there")


@pytest.mark.timeout(60)
def test_prune_says_when_no_deletion_succeeded(root):
    make_root(root, (1, 2, 3))
    shutil.rmtree(root / ".trash", ignore_errors=True)
    (root / ".trash").write_text("in the way\n")  # every un-commit fails
    said = "none of the checkpoints to delete was deleted"
    _says(("prune", root, "--keep-last", "1"), 1, said, "the others were handled")


@pytest.mark.timeout(60)
def test_timeout_while_waiting_for_an_interrupted_overwrite_names_it(root):
    make_root(root, (1, 2, 3))
    # An overwrite without atomic exchange stopped between its two renames: the old
    # copy in .trash/, the new one still in .pending/, step 2 absent.
    attempt = "0123456789abcdef"
    (root / ".trash").mkdir(exist_ok=True)
    os.rename(root / "checkpoint-2", root / ".trash" / f"checkpoint-2.{attempt}.replaced")
    shutil.copytree(
        root / ".trash" / f"checkpoint-2.{attempt}.replaced",
        root / ".pending" / f"checkpoint-2.{attempt}",
    )
    said = "waiting for an overwrite of step(s) 2"
    _says(("list", root, "--timeout", "1.2"), 2, said, "answered too slowly")


# ------------------------------------------------------------------ 9: STEP parsing
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args",
    [
        ("inspect", "{root}", "\u0663"),
        ("verify", "{root}", "\u0663"),
        ("prune", "{root}", "--pin", "\u0663", "--dry-run"),
        ("prune", "{root}", "--keep-last", "\u0661", "--dry-run"),
        ("adopt", "{root}", "\u0663", "--dry-run"),
    ],
)
def test_steps_and_counts_are_ascii_digits_only(root, args):
    make_root(root, (3,))
    proc = run_cli(*(a.format(root=root) for a in args))
    assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
    assert "invalid" in error_line(proc)


# ------------------------------------------------------------------ 10: --pin warning
@pytest.mark.timeout(60)
def test_prune_warns_of_a_pin_that_names_no_checkpoint(root):
    make_root(root, (1, 2, 3))
    proc = run_cli("prune", root, "--pin", 10000, 2, "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    [warning] = doc["warnings"]
    assert "--pin 10000" in warning and "pins nothing" in warning
    assert "warning: --pin 10000" in proc.stderr
    assert run_json("prune", root, "--pin", 2, "--dry-run")["warnings"] == []


# ------------------------------------------------------------------ 11: adopt generic
@pytest.mark.timeout(60)
def test_adopt_generic_refuses_a_folder_of_only_empty_files(tmp_path):
    out = tmp_path / "out"
    (out / "checkpoint-1").mkdir(parents=True)
    (out / "checkpoint-1" / "model.bin").write_bytes(b"")
    (out / "checkpoint-1" / "optimizer.bin").write_bytes(b"")
    (out / "checkpoint-2").mkdir()
    (out / "checkpoint-2" / "model.bin").write_bytes(b"weights")
    (out / "checkpoint-2" / "empty.txt").write_bytes(b"")  # one empty file is fine
    doc = run_json("adopt", out, "--framework", "generic", "--dry-run", expect_rc=1)
    assert [a["step"] for a in doc["adopted"]] == [2]
    [refused] = doc["refused"]
    assert refused["step"] == 1 and "every file in it is empty" in refused["problem"]


# ------------------------------------------------------------------ 12: Ctrl-C at start
_INTERRUPT_IMPORT = """
import runpy, sys
import atomic_checkpoint  # what Python imports before running __main__

class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == "atomic_checkpoint.cli":
            raise KeyboardInterrupt
        return None

sys.meta_path.insert(0, Interrupt())
sys.argv = ["atomic-checkpoint", "list", "."]
runpy.run_module("atomic_checkpoint", run_name="__main__", alter_sys=True)
"""


@pytest.mark.timeout(60)
def test_ctrl_c_while_the_cli_is_imported_exits_130():
    proc = subprocess.run(
        [sys.executable, "-c", _INTERRUPT_IMPORT],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
    )
    assert proc.returncode == 130, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "atomic-checkpoint: error: interrupted"


def test_ctrl_c_before_the_command_runs_exits_130(monkeypatch, capsys):
    from atomic_checkpoint import cli

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    try:
        code = cli.main(["list", "."])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C while the parser was built escaped main()")
    assert code == 130
    assert "error: interrupted" in capsys.readouterr().err


# ------------------------------------------------------------------ 13: documented formats
@pytest.mark.timeout(60)
def test_format_md_lists_every_field_of_lock_json(root):
    make_root(root, (1,))
    mgr = CheckpointManager(root, coordinator=SingleProcessCoordinator())
    try:
        doc = json.loads((root / ".atomic-checkpoint" / "lock.json").read_text())
    finally:
        mgr.close()
    row = next(
        line
        for line in (REPO / "docs" / "format.md").read_text().splitlines()
        if line.startswith("| `lock.json` |")
    )
    documented = set(re.findall(r"`([a-z_]+)`", row))
    assert set(doc) - documented == set(), row
    assert '"atomic-checkpoint-lock"' in row and doc["kind"] == "atomic-checkpoint-lock"


def test_docstring_says_every_command_that_exits_3():
    from atomic_checkpoint import cli

    doc = cli.__doc__ or ""
    line = doc[doc.index("    3  refused") :].split("\n    130")[0]
    for command in ("clean", "prune", "adopt", "drain"):
        assert f"``{command}``" in line, line
    assert "[--run-id RUN] [--progress | --no-progress]" in doc


def test_verify_refuses_a_sparse_huge_state_file_by_its_header_without_hashing_it(root):
    # A resealed manifest records a state file made sparse 10 TiB: restore and inspect
    # refused its header at once, verify (and mgr.verify) hashed 10 TiB of holes (hours).
    from tests.cli.helpers import rewrite_manifest

    make_root(root, (1, 2, 3))
    path = state_file(root, 3)
    size = 10 * 2**40
    try:
        os.truncate(path, size)
    except OSError as exc:
        pytest.skip(f"{path.parent} cannot hold a sparse {size}-byte file: {exc}")
    doc = json.loads(manifest_path(root, 3).read_text())
    files = [dict(f, size=size) if f["path"] == path.name else f for f in doc["files"]]
    rewrite_manifest(root, 3, files=files)
    t0 = time.monotonic()
    proc = run_cli("verify", str(root), "--json", timeout_s=60)
    assert time.monotonic() - t0 < 30
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    bad = [c for c in doc["checkpoints"] if c["step"] == 3]
    assert bad and bad[0]["status"] == "corrupt" and "unexpected bytes" in bad[0]["problem"], bad
    mgr = CheckpointManager(root, read_only=True, coordinator=SingleProcessCoordinator())
    with pytest.raises(CorruptCheckpointError, match="unexpected bytes"):
        mgr.verify(3)
