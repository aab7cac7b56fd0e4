"""The storage boundary is closed: outside ``storage/``, the package makes no raw
filesystem call (``os.*``, ``os.path.*`` queries, ``open()``, ``shutil``).

OSError is mapped to the exception tree in one place, the storage layer (its
``storage/posix.py`` helpers and the backends); a raw call elsewhere lets an OSError
escape unmapped, or maps it a second, different way. This test reads the source (no
import, no I/O beyond it) and names every call that crosses the boundary.
"""

from __future__ import annotations

import ast
from pathlib import Path

import atomic_checkpoint

PACKAGE = Path(atomic_checkpoint.__file__).parent

# ``os`` functions that touch a filesystem (or a descriptor of one).
_OS_CALLS = frozenset(
    [
        "access",
        "chmod",
        "chown",
        "close",
        "fdatasync",
        "fstat",
        "fsync",
        "ftruncate",
        "link",
        "listdir",
        "lstat",
        "makedirs",
        "mkdir",
        "open",
        "posix_fadvise",
        "pread",
        "preadv",
        "pwrite",
        "pwritev",
        "read",
        "readlink",
        "remove",
        "removedirs",
        "rename",
        "renames",
        "replace",
        "rmdir",
        "scandir",
        "sendfile",
        "stat",
        "statvfs",
        "symlink",
        "truncate",
        "unlink",
        "utime",
        "walk",
        "write",
    ]
)
# ``os.path`` functions that ask the filesystem (``join``, ``dirname``... do not).
_OS_PATH_CALLS = frozenset(
    [
        "exists",
        "getatime",
        "getctime",
        "getmtime",
        "getsize",
        "isdir",
        "isfile",
        "islink",
        "ismount",
        "lexists",
        "realpath",
        "samefile",
    ]
)

# The calls that stay, each with why. Key: (module, function, call).
_ALLOWED = {
    # /proc of this machine, never a checkpoint root: the lock's liveness check.
    ("_process.py", "read_text", "open"),
    ("_process.py", "pid_namespace", "os.readlink"),
    # Silences stdout after a BrokenPipeError (`atomic-checkpoint list | head`).
    ("cli.py", "_main", "os.open"),
    # A message to stderr (fd 2) just before ``os._exit`` from the start-up deadline's
    # thread: logging could block on a lock the main thread holds.
    ("preemption.py", "_startup_deadline", "os.write"),
    # The load path's direct-I/O reader: it works on the descriptor that
    # ``Storage.open_read`` returned (size, page-cache residency, O_DIRECT re-open
    # through /proc/self/fd, positional reads), never on a path of ROOT.
    ("serialization.py", "_file_size", "os.fstat"),
    ("serialization.py", "_positional_fd", "os.fstat"),
    ("serialization.py", "_DirectReads.__init__", "os.open"),
    ("serialization.py", "_DirectReads.close", "os.close"),
    ("serialization.py", "_DirectReads.read", "os.preadv"),
    ("serialization.py", "_cached_fraction", "os.fstat"),
    ("serialization.py", "_pread_chunk", "os.preadv"),
}


def _raw_calls(path: Path) -> list[tuple[str, str, int]]:
    """(function, call, line) of every raw filesystem call in the module at ``path``."""
    found: list[tuple[str, str, int]] = []
    scope: list[str] = []

    class Visitor(ast.NodeVisitor):
        def _scoped(self, node: ast.AST, name: str) -> None:
            scope.append(name)
            self.generic_visit(node)
            scope.pop()

        def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
            self._scoped(node, node.name)

        def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
            self._scoped(node, node.name)

        def visit_ClassDef(self, node: ast.ClassDef) -> None:
            self._scoped(node, node.name)

        def visit_Call(self, node: ast.Call) -> None:
            call = _name_of(node.func)
            if call is not None:
                found.append((".".join(scope), call, node.lineno))
            self.generic_visit(node)

    Visitor().visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return found


def _name_of(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return "open" if func.id == "open" else None
    if not isinstance(func, ast.Attribute):
        return None
    owner = func.value
    if isinstance(owner, ast.Name):
        if owner.id == "os" and func.attr in _OS_CALLS:
            return f"os.{func.attr}"
        if owner.id == "shutil":
            return f"shutil.{func.attr}"
        if owner.id == "io" and func.attr == "open":
            return "io.open"
    if (
        isinstance(owner, ast.Attribute)
        and isinstance(owner.value, ast.Name)
        and (owner.value.id, owner.attr) == ("os", "path")
        and func.attr in _OS_PATH_CALLS
    ):
        return f"os.path.{func.attr}"
    return None


def _modules_outside_storage() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "storage")


def test_no_raw_filesystem_call_outside_storage():
    crossing = []
    for path in _modules_outside_storage():
        module = path.relative_to(PACKAGE).as_posix()
        for function, call, line in _raw_calls(path):
            if (module, function, call) not in _ALLOWED:
                crossing.append(f"{module}:{line} {function or '<module>'}: {call}")
    assert not crossing, (
        "raw filesystem calls outside atomic_checkpoint/storage/ (OSError escapes the "
        "storage boundary; use a storage method or a storage/posix.py helper):\n"
        + "\n".join(crossing)
    )


def test_the_allow_list_names_only_calls_that_exist():
    # A stale entry would silently allow the call back in after a refactor.
    present = set()
    for path in _modules_outside_storage():
        module = path.relative_to(PACKAGE).as_posix()
        present |= {(module, function, call) for function, call, _ in _raw_calls(path)}
    assert present >= _ALLOWED, sorted(_ALLOWED - present)


def test_the_scan_finds_a_raw_call(tmp_path):
    # The scan itself must see each kind of call it claims to catch.
    source = tmp_path / "sample.py"
    source.write_text(
        "import os, shutil\n"
        "def f(p):\n"
        "    os.rmdir(p)\n"
        "    os.path.isdir(p)\n"
        "    shutil.rmtree(p)\n"
        "    open(p)\n"
        "    os.path.join(p, 'x')\n"
    )
    assert [(fn, call) for fn, call, _ in _raw_calls(source)] == [
        ("f", "os.rmdir"),
        ("f", "os.path.isdir"),
        ("f", "shutil.rmtree"),
        ("f", "open"),
    ]
