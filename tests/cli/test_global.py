"""Global behaviour of ``atomic-checkpoint``: version, help, usage errors, logging,
broken pipes, and imports."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import atomic_checkpoint
from tests.cli.helpers import cli_env, error_line, make_root, run_cli, run_json
from tests.helpers import run_python


@pytest.mark.timeout(60)
def test_version_through_module_and_entry_point():
    for entry_point in (False, True):
        proc = run_cli("--version", entry_point=entry_point)
        assert proc.returncode == 0
        assert proc.stdout.strip() == f"atomic-checkpoint {atomic_checkpoint.__version__}"


@pytest.mark.timeout(60)
def test_help_lists_commands_with_examples():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for command in ("list", "verify", "clean", "inspect", "prune"):
        assert f"    {command}" in proc.stdout
    assert "examples:" in proc.stdout and "exit status: 0 ok, 1 problem found" in proc.stdout
    for command, example in (
        ("list", "atomic-checkpoint list /ckpt/run1 --json"),
        ("verify", "atomic-checkpoint verify /ckpt/run1 4000 --quiet"),
        ("clean", "atomic-checkpoint clean /ckpt/run1 --dry-run"),
        ("inspect", "atomic-checkpoint inspect /ckpt/run1 4000"),
        ("prune", "atomic-checkpoint prune /ckpt/run1 --keep-last 3 --dry-run"),
    ):
        sub = run_cli(command, "--help")
        assert sub.returncode == 0 and example in sub.stdout, command


@pytest.mark.timeout(60)
def test_usage_errors_are_one_line_exit_2(tmp_path):
    for args, needle in (
        ((), "required: COMMAND"),
        (("frobnicate",), "invalid choice: 'frobnicate'"),
        (("list",), "ROOT"),
        (("list", tmp_path, "--bogus"), "unrecognized arguments: --bogus"),
    ):
        proc = run_cli(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.count("\n") == 1 and needle in error_line(proc), (args, proc.stderr)
        assert "--help" in proc.stderr  # says where to look
        assert proc.stderr.count("atomic-checkpoint:") == 1, proc.stderr  # named once


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", [["list"], ["verify"], ["prune", "--keep-last", "1"]])
def test_a_url_with_one_slash_lost_is_named_as_such(tmp_path, command):
    # Read as a local relative path: "<cwd>/s3:/bucket/run1 does not exist".
    proc = run_cli(*command[:1], "s3:/bucket/run1", *command[1:], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "looks like 's3://bucket/run1' with one slash lost" in error_line(proc)
    assert not (tmp_path / "s3:").exists()


def test_verbose_logs_what_the_library_does(root):
    make_root(root, (1, 2, 3))
    quiet = run_cli("prune", root, "--keep-last", "2")
    assert quiet.returncode == 0 and quiet.stderr == ""
    loud = run_cli("prune", root, "--keep-last", "1", "-v")
    assert loud.returncode == 0
    assert f"atomic-checkpoint: INFO: retention: deleted {root / 'checkpoint-2'}" in loud.stderr


@pytest.mark.timeout(60)
def test_closed_stdout_stops_quietly(root):
    make_root(root, (1,))
    # 3000 foreign entries: the table sums them up in one row, the JSON lists each, far
    # more than a pipe's buffer holds, so the command is still writing when the reader
    # goes (with the table alone, the command could finish first and exit 0).
    for i in range(3000):
        (root / f"stray-{i:05d}").write_text("")
    proc = subprocess.Popen(
        [sys.executable, "-m", "atomic_checkpoint", "list", "--json", str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(10) == b'{\n "schema'
    proc.stdout.close()  # like `| head -1`
    err = proc.stderr.read().decode()
    proc.wait(timeout=30)
    proc.stderr.close()
    assert proc.returncode == 1 and err == ""


def _cli_in_a_child(root, code: str, *, before: str = "") -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a child process on a root with step 7, after ``before``: ``sys``,
    the CLI's ``main`` and ``root`` are defined for it."""
    make_root(root, (7,))
    prelude = f"import sys\n{before}from atomic_checkpoint.cli import main\nroot = {str(root)!r}\n"
    return run_python(prelude + code, env={"PYTHONWARNINGS": "error"})


@pytest.mark.timeout(60)
def test_read_commands_import_no_framework(root):
    """list, verify and inspect start fast and work where torch is not installed."""
    proc = _cli_in_a_child(
        root,
        "for args in (['list', root], ['verify', root], ['inspect', root, '7'],\n"
        "             ['clean', root, '--dry-run']):\n"
        "    assert main([*args, '--json']) == 0, args\n"
        "bad = sorted(m for m in ('torch', 'numpy', 'safetensors', 'fsspec') if m in sys.modules)\n"
        "print('IMPORTED', bad)\n",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "IMPORTED []"


@pytest.mark.timeout(60)
def test_without_its_checksum_dependency_the_package_says_so_at_import(root):
    # xxhash is a declared dependency; its import was optional, so without it every
    # xxh3_64 checkpoint read as corrupt: verify printed CORRUPT and exited 1 for
    # healthy checkpoints, and a start refused to resume from "corrupt" ones.
    proc = _cli_in_a_child(
        root,
        "sys.exit(main(['verify', root]))\n",
        before="sys.modules['xxhash'] = None  # an environment without it\n",
    )
    assert proc.returncode != 0 and "CORRUPT" not in proc.stdout, proc.stdout
    assert "ModuleNotFoundError" in proc.stderr and "xxhash" in proc.stderr, proc.stderr


def _keys(doc: object) -> set[str]:
    """Every key of a JSON document, at any depth (not the user's metric and metadata
    names)."""
    if isinstance(doc, dict):
        inner = (v for k, v in doc.items() if k not in ("metrics", "metadata"))
        return set(doc) | {k for v in inner for k in _keys(v)}
    if isinstance(doc, list):
        return {k for v in doc for k in _keys(v)}
    return set()


@pytest.mark.timeout(120)
def test_every_json_key_the_commands_emit_is_documented(root, tmp_path):
    # The module docstring (docs/cli.md's reference) is the stable --json schema; clean's
    # "restored" and drain's "not_copied_below_newest", among others, were emitted but
    # not documented.
    from atomic_checkpoint import cli

    make_root(root, (100, 200))
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    documents = [
        run_json(*args)
        for args in (
            ("list", root),
            ("verify", root),
            ("inspect", root, "200"),
            ("clean", root, "--dry-run"),
            ("prune", root, "--keep-last", "1", "--dry-run"),
            ("drain", root, "--to", persistent),
            ("list", root, "--tier", persistent),
            ("verify", root, "--tier", persistent),
        )
    ]
    doc = cli.__doc__ or ""
    emitted = {k for d in documents for k in _keys(d) if d["command"] != "inspect"}
    # inspect's document holds the manifest as it is (its fields: docs/format.md).
    emitted |= {k for d in documents if d["command"] == "inspect" for k in d}
    missing = sorted(k for k in emitted if f'"{k}"' not in doc and f"``{k}``" not in doc)
    assert missing == [], f"--json keys not in the documented schema: {missing}"


@pytest.mark.timeout(120)
def test_a_json_command_stopped_by_an_error_still_prints_one_document(root, tmp_path):
    """`--json` scripts parse stdout: a command refused before it had its document (a
    missing ROOT, the lock of a live job) printed nothing there, only the error line on
    stderr. It now prints an error document, with the same message and exit status."""
    from atomic_checkpoint import CheckpointManager, cli

    missing = tmp_path / "no-such-root"
    for args in (("list", missing), ("verify", missing), ("inspect", missing, "3")):
        doc = run_json(*args, expect_rc=2)
        assert doc["command"] == args[0] and doc["root"] == str(missing), doc
        assert doc["error"]["exit_code"] == 2 and "does not exist" in doc["error"]["message"]
    make_root(root, (100, 200))
    with CheckpointManager(root):  # a live job holds the run lock
        proc = run_cli("prune", root, "--keep-last", "1", "--json")
    assert proc.returncode == 3, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["error"]["type"] == "LockHeldError" and doc["error"]["exit_code"] == 3
    assert doc["error"]["message"] in " ".join(error_line(proc).split()), (doc, proc.stderr)
    # Bad arguments too, whether argparse or the command itself refuses them (AE-D1:
    # `inspect ROOT abc --json` and `prune ROOT --json` printed nothing on stdout).
    for args, command in (
        (("inspect", root, "abc"), "inspect"),
        (("verify", root, "--timeout", "0"), "verify"),
        (("prune", root), "prune"),
        (("prune", root, "--keep-last", "0"), "prune"),
        (("no-such-command",), None),
    ):
        doc = run_json(*args, expect_rc=2)
        assert doc["command"] == command and doc["error"]["type"] == "UsageError", doc
        assert doc["error"]["exit_code"] == 2 and "--help" in doc["error"]["message"], doc
    # A document the command printed itself is not followed by a second one.
    ok = run_cli("verify", root, "100", "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["command"] == "verify"
    for key in ("error", "type", "message", "exit_code"):
        assert f'"{key}"' in (cli.__doc__ or "") or f"``{key}``" in (cli.__doc__ or ""), key


@pytest.mark.parametrize("entry_point", [False, True], ids=["module", "script"])
def test_ctrl_c_while_the_package_imports_is_one_line_and_130(root, entry_point):
    # A Ctrl-C in the command's first moments (Python importing the package) ended
    # with a KeyboardInterrupt traceback and status 1, which a script reads as "a
    # problem was found". Signals at growing delays cover the import and the command.
    import signal
    import subprocess
    import sys
    import time

    from atomic_checkpoint import _early
    from tests.cli.helpers import ENTRY_POINT, cli_env

    assert _early.command_line(["python", "-m", "atomic_checkpoint", "list", "R"])
    assert _early.command_line(["python", "/venv/bin/atomic-checkpoint", "list", "R"])
    assert not _early.command_line(["python", "train.py"])
    assert not _early.command_line(["python", "-m", "atomic_checkpoint.launch", "t.py"])
    make_root(root, steps=(100,))
    cmd = [str(ENTRY_POINT)] if entry_point else [sys.executable, "-m", "atomic_checkpoint"]
    interrupted = 0
    for i in range(12):
        with subprocess.Popen(
            [*cmd, "verify", str(root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cli_env(None),
        ) as proc:
            time.sleep(0.1 + 0.06 * i)
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            _out, err = proc.communicate(timeout=60)
        if "Traceback" in err:  # only from Python's own start, before the package runs
            assert "/atomic_checkpoint/" not in err, (i, err)
            continue
        if proc.returncode == -signal.SIGINT:  # at the interpreter's own exit: the shell's 130
            continue
        if proc.returncode != 0:
            assert proc.returncode == 130, (i, proc.returncode, err)
            assert err.strip().splitlines()[-1] == "atomic-checkpoint: error: interrupted", err
            interrupted += 1
    assert interrupted > 0
