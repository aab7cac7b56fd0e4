"""A private sshd exporting a directory, mounted one or more times with sshfs.

Two sshfs mounts of one export behave like two nodes sharing a network
filesystem: each mount has its own kernel attribute/dentry cache and its own
sshfs directory cache, so one mount's view lags behind the other's writes
(see TESTBED.md). Mounting with ``coherent=True`` switches those caches off.

Example::

    with SshfsExport(tmp_path / "srv") as exp:
        a = exp.mount(tmp_path / "a")
        b = exp.mount(tmp_path / "b", coherent=True)
        (a.path / "f").write_text("x")
        for pid in a.ssh_pids():   # cut node A's link
            os.kill(pid, signal.SIGKILL)
"""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from ._util import (
    ManagedProcess,
    Service,
    TestbedError,
    find_mount,
    free_port,
    group_members,
    proc_stat,
    require_binary,
    resolve_mountpoint,
    run,
    unmount,
    wait_for_mount,
    wait_until,
    wait_until_live,
)

#: sshfs options that turn off every cache between the kernel, sshfs and the
#: server, so each mount sees the other mounts' changes at once.
COHERENT_OPTS = ("dir_cache=no", "attr_timeout=0", "entry_timeout=0", "negative_timeout=0")

#: ssh options that make a mount notice a dead link within about 3 s; without
#: them a partitioned link blocks sshfs operations for minutes (TCP retries).
FAST_FAIL_OPTS = ("ServerAliveInterval=1", "ServerAliveCountMax=2")

#: Privilege-separation directory compiled into Debian's sshd.
PRIVSEP_DIR = "/run/sshd"

_HOST_ALIAS = "testbed-export"
_START_ATTEMPTS = 5


class SshfsMount(Service):
    """One sshfs mount of an :class:`SshfsExport` (one "node"); made live by
    :meth:`SshfsExport.mount`, so ``with`` only unmounts it on exit."""

    def __init__(self, path: Path, proc: ManagedProcess):
        """Wraps an already-mounted sshfs process.

        Args:
            path: Resolved mount point.
            proc: The foreground sshfs process serving the mount.
        """
        self.path = path
        self.proc = proc

    @property
    def pid(self) -> int:
        """The sshfs daemon's pid."""
        return self.proc.pid

    def ssh_pids(self) -> list[int]:
        """Returns the pids of this mount's ssh transport processes.

        sshfs double-forks ssh, so ssh is not sshfs's child; it stays in
        sshfs's process group, which is unique to this mount.

        Returns:
            Live ``ssh`` processes of this mount (usually exactly one).
        """
        pids = []
        for pid in group_members(self.proc.pid):
            stat = proc_stat(pid)
            if pid != self.proc.pid and stat is not None and stat.comm == "ssh":
                pids.append(pid)
        return pids

    def kill_transport(self) -> list[int]:
        """SIGKILLs the ssh transport: the link is cut, sshfs sees EOF.

        Returns:
            The pids that were killed.
        """
        pids = self.ssh_pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def is_mounted(self) -> bool:
        """Tells whether /proc/mounts still lists this mount."""
        entry = find_mount(self.path)
        return entry is not None and entry.fstype == "fuse.sshfs"

    def unmount(self, timeout_s: float = 10.0) -> None:
        """Unmounts (fusermount3 -u, then umount -l) and stops sshfs.

        Safe to call repeatedly and after the link was cut.

        Args:
            timeout_s: Time budget for each unmount step.
        """
        try:
            unmount(self.path, fuse=True, timeout_s=timeout_s)
        finally:
            self.proc.stop(timeout_s=3.0)

    def start(self) -> None:
        """Nothing to do: the mount is live from :meth:`SshfsExport.mount` on."""

    def close(self) -> None:
        """Same as :meth:`unmount`."""
        self.unmount()


class SshfsExport(Service):
    """A private sshd on loopback (or in a namespace) exporting a directory."""

    def __init__(
        self,
        base_dir: Path | str,
        *,
        listen_host: str = "127.0.0.1",
        server_launcher: Sequence[str] = (),
        client_launcher: Sequence[str] = (),
        startup_timeout_s: float = 10.0,
    ):
        """Prepares keys and configs; the server starts on ``__enter__``.

        Args:
            base_dir: Scratch directory owned by the caller; keys, configs,
                logs and the ``export`` directory are created inside.
            listen_host: Address sshd listens on and sshfs connects to.
            server_launcher: argv prefix for sshd, e.g. ``ip netns exec A``.
            client_launcher: Default argv prefix for sshfs, e.g.
                ``nsenter --net=/var/run/netns/B`` (mount stays visible to
                the whole machine).
            startup_timeout_s: Bound on the wait for sshd to listen.
        """
        self.base_dir = Path(base_dir).resolve()
        self.host = listen_host
        self.server_launcher = list(server_launcher)
        self.client_launcher = list(client_launcher)
        self.startup_timeout_s = startup_timeout_s
        self.export = self.base_dir / "export"
        self.ssh_config = self.base_dir / "ssh_config"
        self.sshd_config = self.base_dir / "sshd_config"
        self.port = 0
        # The effective user, not $USER: sshd checks keys of the account it logs into.
        self.user = pwd.getpwuid(os.geteuid()).pw_name
        self._sshd: ManagedProcess | None = None
        self._mounts: list[SshfsMount] = []

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> None:
        """Generates keys and configs and starts sshd.

        Raises:
            TestbedError: sshd did not start after several ports.
        """
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.export.mkdir(exist_ok=True)
        self._make_keys()
        # sshd refuses to start without its privilege-separation directory.
        try:
            Path(PRIVSEP_DIR).mkdir(mode=0o755, parents=True, exist_ok=True)
        except OSError as exc:
            raise TestbedError(f"cannot create sshd's {PRIVSEP_DIR}: {exc}") from exc
        errors = []
        for _ in range(_START_ATTEMPTS):
            # A port free now may be taken before sshd binds: retry on a new one.
            self.port = free_port("127.0.0.1")
            self._write_configs()
            try:
                self._start_sshd()
                return
            except TestbedError as exc:
                errors.append(str(exc))
        raise TestbedError(f"sshd did not start on {self.host}: {' | '.join(errors)}")

    def close(self) -> None:
        """Unmounts every mount of this export and stops sshd."""
        for mount in reversed(self._mounts):
            with contextlib.suppress(TestbedError):
                mount.unmount()
        self._mounts.clear()
        if self._sshd is not None:
            # Per-connection sshd processes call setsid(), so they are not in
            # the listener's process group; collect them as descendants.
            self._sshd.stop(timeout_s=3.0)
            self._sshd = None

    @property
    def sshd_pid(self) -> int | None:
        """The sshd listener's pid while it runs."""
        return self._sshd.pid if self._sshd is not None else None

    # -- mounting ----------------------------------------------------------

    def mount(
        self,
        mountpoint: Path | str,
        coherent: bool = False,
        extra_opts: Sequence[str] = (),
        *,
        launcher: Sequence[str] | None = None,
        timeout_s: float = 10.0,
    ) -> SshfsMount:
        """Mounts the export with sshfs and waits until the mount is live.

        Args:
            mountpoint: Directory to mount on (created if missing).
            coherent: Disable all caching (see :data:`COHERENT_OPTS`).
            extra_opts: Further ``-o`` options for sshfs or ssh, e.g.
                :data:`FAST_FAIL_OPTS`.
            launcher: argv prefix for sshfs; defaults to the export's
                ``client_launcher``.
            timeout_s: Bound on the wait for /proc/mounts to list the mount.

        Returns:
            The live mount; it is also unmounted by :meth:`close`.

        Raises:
            TestbedError: sshfs exited or the mount did not appear in time.
        """
        if self._sshd is None:
            raise TestbedError("SshfsExport.mount() called before start()")
        target = resolve_mountpoint(mountpoint)
        opts = [*(COHERENT_OPTS if coherent else ()), *extra_opts]
        argv = [
            *(self.client_launcher if launcher is None else launcher),
            require_binary("sshfs"),
            "-f",  # Foreground: the pid we hold is the daemon serving the mount.
            "-F",
            str(self.ssh_config),  # Must be absolute: ssh is started elsewhere.
            f"{_HOST_ALIAS}:{self.export}",
            str(target),
        ]
        if opts:
            argv += ["-o", ",".join(opts)]
        log = self.base_dir / f"sshfs-{len(self._mounts)}-{target.name}.log"
        proc = ManagedProcess(argv, log)
        try:
            wait_for_mount(target, "fuse.sshfs", proc, timeout_s, "sshfs mount")
            wait_until_live(target, "fuse.sshfs", proc, timeout_s, "sshfs mount")
        except TestbedError:
            with contextlib.suppress(TestbedError):
                unmount(target, fuse=True)
            proc.stop(timeout_s=2.0)
            raise
        mount = SshfsMount(target, proc)
        self._mounts.append(mount)
        return mount

    # -- internals ---------------------------------------------------------

    def _make_keys(self) -> None:
        """Creates the host key and the client key pair (ed25519, no passphrase)."""
        keygen = require_binary("ssh-keygen")
        for name in ("ssh_host_ed25519_key", "client_ed25519"):
            key = self.base_dir / name
            if not key.exists():
                run([keygen, "-q", "-t", "ed25519", "-N", "", "-C", "testbed", "-f", str(key)])
        pub = (self.base_dir / "client_ed25519.pub").read_text()
        authorized = self.base_dir / "authorized_keys"
        authorized.write_text(pub)
        authorized.chmod(0o600)

    def _write_configs(self) -> None:
        """Writes sshd_config and the client ssh_config for the current port."""
        b = self.base_dir
        self.sshd_config.write_text(
            "\n".join(
                [
                    f"Port {self.port}",
                    f"ListenAddress {self.host}",
                    f"HostKey {b / 'ssh_host_ed25519_key'}",
                    f"PidFile {b / 'sshd.pid'}",
                    f"AuthorizedKeysFile {b / 'authorized_keys'}",
                    "UsePAM no",
                    "StrictModes no",
                    "PermitRootLogin yes",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UseDNS no",
                    "PrintMotd no",
                    "MaxStartups 100",
                    "Subsystem sftp internal-sftp",
                    "",
                ]
            )
        )
        self.ssh_config.write_text(
            "\n".join(
                [
                    f"Host {_HOST_ALIAS}",
                    f"  HostName {self.host}",
                    f"  Port {self.port}",
                    f"  User {self.user}",
                    f"  IdentityFile {b / 'client_ed25519'}",
                    "  IdentitiesOnly yes",
                    "  StrictHostKeyChecking no",
                    "  UserKnownHostsFile /dev/null",
                    "  BatchMode yes",
                    "  LogLevel ERROR",
                    "",
                ]
            )
        )

    def _start_sshd(self) -> None:
        """Starts sshd in the foreground and waits for its listening line."""
        sshd = require_binary("sshd")  # Absolute: sshd re-execs itself.
        argv = [*self.server_launcher, sshd, "-D", "-e", "-f", str(self.sshd_config)]
        log = self.base_dir / f"sshd-{self.port}.log"
        proc = ManagedProcess(argv, log)
        ready = f"Server listening on {self.host} port {self.port}"
        proc.wait_ready(
            lambda: ready in proc.log_tail(20_000),
            self.startup_timeout_s,
            f"sshd listening on {self.host}:{self.port}",
        )
        self._sshd = proc


def wait_visible(path: Path, timeout_s: float = 3.0) -> float:
    """Waits until ``path`` exists through a mount; returns the seconds taken.

    Args:
        path: Path inside a mount.
        timeout_s: Seconds to wait at most.

    Returns:
        Elapsed seconds until the path became visible.
    """
    start = time.monotonic()
    wait_until(lambda: path.exists(), timeout_s, f"{path} visible")
    return time.monotonic() - start
