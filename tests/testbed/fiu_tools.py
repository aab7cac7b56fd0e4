"""libfiu fault injection: run a Python child with injectable POSIX failures.

``fiu-run -x`` preloads libfiu's POSIX wrappers into the child; every
wrapped libc call (``fsync``, ``rename``, ``write``, ``open``, ...) then has a
named failure point that can be switched on while the child runs.

How the child enables failure points
------------------------------------
``fiu-run`` exports ``FIU_CTRL_FIFO`` (a path prefix); the preloaded library
creates the control pipes ``<prefix>-<pid>.in`` / ``.out`` for the process.
The child controls itself through them with Debian's ``fiu_ctrl`` module::

    import errno, os, fiu_ctrl
    ctl = fiu_ctrl.PipeControl(f"{os.environ['FIU_CTRL_FIFO']}-{os.getpid()}")
    ctl.enable("posix/io/sync/fsync", failinfo=errno.EIO)     # every fsync fails
    ctl.enable("posix/io/dir/rename", failinfo=errno.ENOSPC,
               flags=["onetime"])                             # next rename fails
    ctl.disable("posix/io/sync/fsync")

(:func:`child_control` does the first two lines.) ``failinfo`` becomes the
errno of the failing call. Faults on *write* points must be ``onetime``: the
control channel itself writes to a pipe, so a permanent write fault would
break the next ``enable``/``disable``. A parent can drive the child the same
way with :func:`parent_control` and the child's pid.

Failure points can also be enabled from the start, without the control pipe,
with ``enable=[enable_cmd("posix/io/sync/fsync", errno.EIO)]`` in
:func:`fiu_run_argv`.

The ``fiu`` and ``fiu_ctrl`` modules ship only in Debian's system
dist-packages; a venv on the same Python minor version needs ``fiu.py``,
``fiu_ctrl.py`` and ``fiu_ll.*.so`` symlinked into its site-packages (the
project's bootstrap script does that). :func:`fiu_available` checks it all.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._util import which

#: Where distributions install the fiu preload libraries.
PRELOAD_DIRS = ("/usr/lib/fiu", "/usr/local/lib/fiu", "/usr/lib/x86_64-linux-gnu/fiu")
_PRELOADS = ("fiu_run_preload.so", "fiu_posix_preload.so")


def preload_dir() -> str | None:
    """Returns the directory holding both fiu preload libraries, if any."""
    for directory in PRELOAD_DIRS:
        if all(Path(directory, lib).is_file() for lib in _PRELOADS):
            return directory
    return None


def fiu_available(python: str | None = None) -> tuple[bool, str]:
    """Checks that fiu-run, the preload libraries and ``fiu_ctrl`` all work.

    Args:
        python: Interpreter that will run the children (default: this one).

    Returns:
        ``(True, "")`` when usable, else ``(False, reason)``.
    """
    if which("fiu-run") is None:
        return False, "fiu-run not installed (apt-get install fiu-utils libfiu0)"
    if preload_dir() is None:
        return False, f"fiu preload libraries not found in {PRELOAD_DIRS}"
    python = python or sys.executable
    try:
        done = subprocess.run(
            [python, "-c", "import fiu_ctrl, fiu"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"cannot run {python}: {exc}"
    if done.returncode != 0:
        return False, (
            f"{python} cannot import fiu_ctrl (symlink Debian's fiu.py, fiu_ctrl.py "
            f"and fiu_ll*.so into the venv): {done.stderr.strip().splitlines()[-1:]}"
        )
    return True, ""


def enable_cmd(name: str, failinfo: int | None = None, failnum: int = 1) -> str:
    """Builds a ``fiu-run -c`` command that enables ``name`` from the start.

    Args:
        name: Failure point, e.g. ``"posix/io/sync/fsync"``.
        failinfo: errno the failing call reports.
        failnum: Value returned by the failure point (non-zero = fail).

    Returns:
        The command text, e.g. ``"enable name=posix/io/sync/fsync,failnum=1,failinfo=5"``.
    """
    parts = [f"name={name}", f"failnum={failnum}"]
    if failinfo is not None:
        parts.append(f"failinfo={failinfo}")
    return "enable " + ",".join(parts)


def fiu_run_argv(
    script: str | os.PathLike[str],
    *args: str,
    python: str | None = None,
    ctrl_prefix: str | os.PathLike[str] | None = None,
    enable: Sequence[str] = (),
) -> list[str]:
    """Builds argv running ``python script args...`` under ``fiu-run -x``.

    Args:
        script: Python script (or ``"-c"`` followed by code in ``args``).
        *args: Arguments after the script.
        python: Interpreter (default: this one).
        ctrl_prefix: Control-pipe prefix; put it in the test's tmp dir so
            leftover pipes are cleaned up with it (default: fiu-run's
            ``$TMPDIR/fiu-ctrl``).
        enable: ``fiu-run -c`` commands from :func:`enable_cmd`.

    Returns:
        The argv list.
    """
    argv = ["fiu-run", "-x"]
    plib = preload_dir()
    if plib is not None:
        argv += ["-l", plib]
    if ctrl_prefix is not None:
        argv += ["-f", str(ctrl_prefix)]
    for command in enable:
        argv += ["-c", command]
    return [*argv, python or sys.executable, str(script), *args]


def child_control() -> Any:
    """Inside a child started by :func:`fiu_run_argv`: its own control pipe.

    Returns:
        A ``fiu_ctrl.PipeControl`` for the calling process.

    Raises:
        RuntimeError: The process was not started under ``fiu-run``.
    """
    import fiu_ctrl  # Only present where libfiu's Python bindings are.

    prefix = os.environ.get("FIU_CTRL_FIFO")
    if not prefix:
        raise RuntimeError("FIU_CTRL_FIFO is not set: not running under fiu-run")
    return fiu_ctrl.PipeControl(f"{prefix}-{os.getpid()}")


def parent_control(pid: int, ctrl_prefix: str | os.PathLike[str]) -> Any:
    """From a parent: the control pipe of child ``pid``.

    Args:
        pid: The child's pid (fiu-run execs, so it is the Popen pid).
        ctrl_prefix: The ``ctrl_prefix`` passed to :func:`fiu_run_argv`.

    Returns:
        A ``fiu_ctrl.PipeControl``; its calls wait up to 3 s for the pipes.
    """
    import fiu_ctrl

    return fiu_ctrl.PipeControl(f"{ctrl_prefix}-{pid}")
