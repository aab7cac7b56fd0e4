"""Shared plumbing for the testbed: deadlines, processes, the base of every service
(:class:`Service`), mounts and ports.

Everything here is bounded: every wait has a deadline and raises
:class:`TestbedTimeout` naming what did not happen, and every teardown step
swallows its own errors so that one stuck resource cannot keep the others
alive.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, TypeVar

T = TypeVar("T")
S = TypeVar("S", bound="Service")

# Directories searched for system binaries in addition to $PATH: sshd, ip and
# mkfs live in sbin, which is not on $PATH for every shell a test runs from.
_SBIN_DIRS = ("/usr/local/sbin", "/usr/sbin", "/sbin")


class TestbedError(RuntimeError):
    """A testbed service could not be started or stopped."""

    __test__ = False  # Not a pytest test class despite the name.


class TestbedTimeout(TestbedError):
    """A bounded wait ran out before the awaited condition held."""

    __test__ = False


def which(name: str) -> str | None:
    """Finds an executable on $PATH or in the sbin directories.

    Args:
        name: Executable name, e.g. ``"sshd"``.

    Returns:
        The absolute path, or None when it is not installed.
    """
    found = shutil.which(name)
    if found:
        return os.path.abspath(found)
    extra = os.pathsep.join(_SBIN_DIRS)
    found = shutil.which(name, path=extra)
    return os.path.abspath(found) if found else None


def require_binary(name: str) -> str:
    """Like :func:`which` but raises when the executable is missing.

    Args:
        name: Executable name.

    Returns:
        The absolute path of the executable.

    Raises:
        TestbedError: The executable is not installed.
    """
    path = which(name)
    if path is None:
        raise TestbedError(f"required executable {name!r} is not installed")
    return path


def wait_until(
    predicate: Callable[[], T | None],
    timeout_s: float,
    what: str,
    *,
    interval_s: float = 0.05,
    detail: Callable[[], str] | None = None,
) -> T:
    """Polls ``predicate`` until it returns a truthy value or time runs out.

    The loop is bounded both by wall time and by an iteration count, so a
    predicate that blocks briefly cannot turn it into an endless loop.

    Args:
        predicate: Called repeatedly; a truthy return value ends the wait.
        timeout_s: Seconds to wait at most.
        what: Human-readable name of the awaited condition, used in errors.
        interval_s: Sleep between polls.
        detail: Optional callable whose text (e.g. a log tail) is appended
            to the error message.

    Returns:
        The first truthy value returned by ``predicate``.

    Raises:
        TestbedTimeout: The condition did not hold within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    max_polls = math.ceil(timeout_s / interval_s) + 2
    for _ in range(max_polls):
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            break
        time.sleep(interval_s)
    extra = f": {detail()}" if detail is not None else ""
    raise TestbedTimeout(f"{what} did not happen within {timeout_s:.1f}s{extra}")


def run(
    argv: Sequence[str],
    *,
    timeout_s: float = 30.0,
    check: bool = True,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Runs a short command to completion with a timeout.

    Args:
        argv: Command and arguments.
        timeout_s: Seconds before the command is killed.
        check: Raise when the exit status is non-zero.
        env: Environment for the child (default: inherit).

    Returns:
        The completed process with text stdout/stderr.

    Raises:
        TestbedError: The command failed (with ``check``) or timed out.
    """
    try:
        done = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        raise TestbedTimeout(f"{' '.join(argv)!r} did not finish within {timeout_s}s") from exc
    except OSError as exc:
        raise TestbedError(f"cannot run {' '.join(argv)!r}: {exc}") from exc
    if check and done.returncode != 0:
        raise TestbedError(
            f"{' '.join(argv)!r} exited {done.returncode}: {(done.stderr or done.stdout).strip()}"
        )
    return done


def free_port(host: str = "127.0.0.1") -> int:
    """Returns a TCP port that is free on ``host`` right now.

    The port is released before returning, so another process may take it;
    callers that bind must retry with a new port when binding fails.

    Args:
        host: Address to probe.

    Returns:
        A port number.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/PID/stat the testbed needs."""

    pid: int
    comm: str
    state: str
    ppid: int
    pgid: int


def proc_stat(pid: int) -> ProcStat | None:
    """Reads /proc/PID/stat.

    Args:
        pid: Process id.

    Returns:
        The parsed fields, or None when the process does not exist.
    """
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm may contain spaces and parentheses: split at the LAST ')'.
    head, _, tail = raw.rpartition(")")
    comm = head.partition("(")[2]
    fields = tail.split()
    return ProcStat(pid, comm, fields[0], int(fields[1]), int(fields[2]))


def all_procs() -> list[ProcStat]:
    """Lists every process visible in /proc.

    Returns:
        One entry per live or zombie process.
    """
    procs = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = proc_stat(int(entry))
            if stat is not None:
                procs.append(stat)
    return procs


def is_alive(pid: int) -> bool:
    """Tells whether a process exists and is not a zombie.

    Zombies count as dead: an orphan re-parented to an init that does not
    reap keeps its /proc entry forever but will never run again.

    Args:
        pid: Process id.

    Returns:
        True when the process is running (or stopped, or in D state).
    """
    stat = proc_stat(pid)
    return stat is not None and stat.state not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    """Returns all live descendants of ``pid`` (children, grandchildren, ...).

    Args:
        pid: Root process id.

    Returns:
        Live descendant pids, parents before children.
    """
    children: dict[int, list[int]] = {}
    for stat in all_procs():
        if stat.state not in ("Z", "X"):
            children.setdefault(stat.ppid, []).append(stat.pid)
    found: list[int] = []
    frontier = [pid]
    for _ in range(10_000):  # Bound: no real tree is this deep or wide.
        if not frontier:
            break
        current = frontier.pop()
        for child in children.get(current, []):
            found.append(child)
            frontier.append(child)
    return found


def group_members(pgid: int) -> list[int]:
    """Returns live processes whose process group is ``pgid``.

    Args:
        pgid: Process group id.

    Returns:
        Live member pids.
    """
    return [s.pid for s in all_procs() if s.pgid == pgid and s.state not in ("Z", "X")]


def kill_pids(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    """Sends a signal to each pid, ignoring processes that already exited.

    Args:
        pids: Process ids.
        sig: Signal number.
    """
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def wait_pids_gone(pids: Iterable[int], timeout_s: float) -> bool:
    """Waits until none of ``pids`` is alive.

    Args:
        pids: Process ids.
        timeout_s: Seconds to wait at most.

    Returns:
        True when all exited in time.
    """
    pending = list(pids)
    try:
        wait_until(
            lambda: not any(is_alive(p) for p in pending),
            timeout_s,
            "process exit",
            interval_s=0.02,
        )
    except TestbedTimeout:
        return False
    return True


class ManagedProcess:
    """A background child in its own session with its output in a log file.

    The child gets its own session (and so its own process group) so that a
    teardown can find the helpers it forks, such as the ssh transport that
    sshfs double-forks and that is therefore re-parented away from it.
    """

    def __init__(self, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None):
        """Starts the process.

        Args:
            argv: Command and arguments.
            log_path: File receiving the child's stdout and stderr.
            env: Environment for the child (default: inherit).

        Raises:
            TestbedError: The executable could not be started.
        """
        self.argv = list(argv)
        self.log_path = log_path
        self._log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        try:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        except OSError as exc:
            self._log.close()
            raise TestbedError(f"cannot start {' '.join(self.argv)!r}: {exc}") from exc

    @property
    def pid(self) -> int:
        """The child's pid (also its process group and session id)."""
        return self.popen.pid

    def wait_ready(
        self, ready: Callable[[], bool], timeout_s: float, what: str, *, interval_s: float = 0.05
    ) -> None:
        """Waits until ``ready()`` holds; on failure stops the child and raises.

        Args:
            ready: Probe of the service (a port that answers, a line in the log).
            timeout_s: Seconds to wait at most.
            what: Name of the awaited condition, e.g. ``"sshd listening on H:P"``.
            interval_s: Sleep between probes.

        Raises:
            TestbedError: The child exited first (with its exit status and log).
            TestbedTimeout: ``ready()`` did not hold in time (with the log tail).
        """

        def check() -> bool:
            if not self.alive():
                raise TestbedError(f"exited before {what}: {self.describe_exit()}")
            return ready()

        try:
            wait_until(check, timeout_s, what, interval_s=interval_s, detail=self.log_tail)
        except TestbedError:
            self.stop(timeout_s=2.0)
            raise

    def alive(self) -> bool:
        """Tells whether the child is still running."""
        return self.popen.poll() is None

    def log_tail(self, max_chars: int = 2000) -> str:
        """Returns the end of the child's log, for error messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "<no log>"
        return text[-max_chars:].strip() or "<empty log>"

    def describe_exit(self) -> str:
        """Returns the exit status and log tail, for error messages."""
        return f"exit status {self.popen.poll()}, log: {self.log_tail()}"

    def kill(self) -> None:
        """Sends SIGKILL to the child only (its helpers keep running)."""
        kill_pids([self.pid], signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)

    def stop(self, timeout_s: float = 5.0, extra_pids: Iterable[int] = ()) -> None:
        """Stops the child, its process group and ``extra_pids``.

        Sends SIGTERM, waits up to ``timeout_s``, then SIGKILLs whatever is
        left. Always reaps the child and closes the log.

        Args:
            timeout_s: Grace period after SIGTERM.
            extra_pids: Further processes to stop (e.g. setsid'd children).
        """
        targets = {self.pid, *extra_pids, *descendants(self.pid), *group_members(self.pid)}
        kill_pids(targets, signal.SIGTERM)
        if not wait_pids_gone(targets, timeout_s):
            kill_pids(targets, signal.SIGKILL)
            wait_pids_gone(targets, 5.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)
        self._log.close()


class Service:
    """A testbed resource used as a context manager: ``with`` starts it and releases
    it on exit, even after an exception.

    Subclasses implement :meth:`start` (bounded: every wait has a deadline) and
    :meth:`close` (safe after a failed or partial start, and when called twice).
    """

    def start(self) -> None:
        """Starts the resource (a process, a mount, a namespace, a filesystem)."""
        raise NotImplementedError

    def close(self) -> None:
        """Releases everything :meth:`start` made."""
        raise NotImplementedError

    def __enter__(self: S) -> S:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# --------------------------------------------------------------------------
# Mounts
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/mounts."""

    source: str
    target: str
    fstype: str
    options: str


def _unescape(field: str) -> str:
    """Decodes the octal escapes (``\\040`` for space) used in /proc/mounts."""
    out = []
    i = 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_entries() -> list[MountEntry]:
    """Parses /proc/mounts of this process's mount namespace.

    Returns:
        All mount entries, in mount order.
    """
    entries = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 4:
            entries.append(MountEntry(*(_unescape(p) for p in parts[:4])))
    return entries


def find_mount(target: Path) -> MountEntry | None:
    """Returns the topmost mount whose mount point is exactly ``target``.

    Args:
        target: An already-resolved absolute path (never resolved here, so a
            hung FUSE mount cannot block the lookup).

    Returns:
        The entry, or None when nothing is mounted there.
    """
    wanted = str(target)
    found = None
    for entry in mount_entries():
        if entry.target == wanted:
            found = entry
    return found


def resolve_mountpoint(path: Path | str) -> Path:
    """Creates a mount point directory and returns its resolved path.

    Resolve once, before mounting: resolving a path that crosses a hung FUSE
    mount would block in stat().

    Args:
        path: Directory to mount on.

    Returns:
        The absolute, symlink-free path.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


def wait_for_mount(
    target: Path, fstype: str, proc: ManagedProcess | None, timeout_s: float, what: str
) -> MountEntry:
    """Waits until /proc/mounts lists ``target`` with type ``fstype``.

    Args:
        target: Resolved mount point.
        fstype: Expected type, e.g. ``"fuse.sshfs"``.
        proc: The FUSE daemon; its early exit aborts the wait with its log.
        timeout_s: Seconds to wait at most.
        what: Name used in the error message.

    Returns:
        The mount entry.

    Raises:
        TestbedError: The daemon exited before mounting.
        TestbedTimeout: The mount did not appear in time.
    """

    def check() -> MountEntry | None:
        entry = find_mount(target)
        if entry is not None and entry.fstype == fstype:
            return entry
        if proc is not None and not proc.alive():
            raise TestbedError(f"{what} exited before mounting: {proc.describe_exit()}")
        return None

    detail = (lambda: proc.log_tail()) if proc is not None else None
    return wait_until(check, timeout_s, f"{what} ({fstype} at {target})", detail=detail)


def wait_until_live(
    target: Path, fstype: str, proc: ManagedProcess, timeout_s: float, what: str
) -> None:
    """Waits until a FUSE mount answers a stat() of its root.

    sshfs 3.7 lists its mount in /proc/mounts *before* the ssh connection is
    up; when the connection then fails it exits and unmounts again. So a
    mount only counts as live once a request has gone through it. The stat
    runs in a child process (``stat`` from coreutils) because a request to a
    stuck FUSE daemon blocks the caller, and only a child can be killed.

    Args:
        target: Resolved mount point.
        fstype: Expected type in /proc/mounts.
        proc: The FUSE daemon.
        timeout_s: Seconds to wait at most.
        what: Name used in the error message.

    Raises:
        TestbedError: The daemon exited or the mount went away.
        TestbedTimeout: No stat() succeeded in time.
    """
    stat_bin = which("stat") or "stat"
    deadline = time.monotonic() + timeout_s

    def answered() -> bool:
        if not proc.alive():
            raise TestbedError(f"{what} exited after mounting: {proc.describe_exit()}")
        entry = find_mount(target)
        if entry is None or entry.fstype != fstype:
            raise TestbedError(f"{what} unmounted itself: {proc.log_tail()}")
        budget = max(0.5, min(5.0, deadline - time.monotonic()))
        # Device numbers of the mount root and its parent differ only while
        # the stat really went through the mount (not to the directory below).
        argv = [stat_bin, "-c", "%d", str(target), str(target.parent)]
        try:
            done = run(argv, timeout_s=budget, check=False)
        except TestbedTimeout:
            return False
        devices = done.stdout.split()
        return done.returncode == 0 and len(devices) == 2 and devices[0] != devices[1]

    wait_until(answered, timeout_s, f"{what} answering at {target}", detail=proc.log_tail)
    # The daemon may have failed just after answering from its own cache.
    if not proc.alive() or find_mount(target) is None:
        raise TestbedError(f"{what} died right after mounting: {proc.log_tail()}")


def _fuse_connection_id(target: Path) -> str | None:
    """Finds the FUSE connection number of a mount from /proc/self/mountinfo.

    The connection number is the device minor. It is read from mountinfo
    rather than stat() because stat() on a hung FUSE mount blocks.
    """
    wanted = str(target)
    conn = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        parts = line.split()
        if len(parts) > 4 and _unescape(parts[4]) == wanted:
            conn = parts[2].partition(":")[2]
    return conn


def _abort_fuse_connection(target: Path) -> None:
    """Aborts a FUSE connection so that hung requests fail and umount works."""
    conn = _fuse_connection_id(target)
    if conn is None:
        return
    with contextlib.suppress(OSError):
        Path(f"/sys/fs/fuse/connections/{conn}/abort").write_text("1")


def unmount(target: Path, *, fuse: bool, timeout_s: float = 10.0) -> None:
    """Unmounts ``target``, escalating until it is gone.

    FUSE mounts: ``fusermount3 -u``, then ``umount -l``, then aborting the
    FUSE connection (for a daemon stuck on a dead network link) and
    ``umount -l`` again. Other mounts: ``umount``, then ``umount -l``.

    Args:
        target: Resolved mount point.
        fuse: Whether this is a FUSE mount.
        timeout_s: Time budget for each step.

    Raises:
        TestbedError: The mount point is still mounted after all steps.
    """
    steps: list[Callable[[], object]] = []
    if fuse:
        fusermount = which("fusermount3") or which("fusermount") or "fusermount3"
        steps.append(lambda: run([fusermount, "-u", str(target)], timeout_s=timeout_s))
    else:
        steps.append(lambda: run(["umount", str(target)], timeout_s=timeout_s))
    # --no-canonicalize: the path is already resolved, and resolving it again
    # would stat() the mount root, which blocks while a FUSE daemon hangs.
    lazy = ["umount", "-l", "--no-canonicalize", str(target)]
    steps.append(lambda: run(lazy, timeout_s=timeout_s))
    if fuse:
        steps.append(lambda: _abort_fuse_connection(target))
        steps.append(lambda: run(lazy, timeout_s=timeout_s))
    errors = []
    for step in steps:
        if find_mount(target) is None:
            return
        try:
            step()
        except TestbedError as exc:
            errors.append(str(exc))
    if find_mount(target) is not None:
        raise TestbedError(f"could not unmount {target}: {'; '.join(errors)}")
