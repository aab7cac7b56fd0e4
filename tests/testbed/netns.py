"""Two network namespaces joined by a veth pair: two hosts with own addresses.

Addresses inside the namespaces exist only there, so both ends of any test
traffic must run inside them: a server with :meth:`NetnsPair.exec_args`, a
FUSE client with :meth:`NetnsPair.nsenter_args` (``ip netns exec`` would also
give the client a private mount namespace, hiding its mount from everyone
else). :meth:`NetnsPair.cut` takes the link down: a network partition.

Example::

    with NetnsPair("ck") as pair, pair.sshfs_export(tmp_path / "srv") as exp:
        m = exp.mount(tmp_path / "m", extra_opts=FAST_FAIL_OPTS)
        pair.cut()      # operations on m now fail within about 3 s
"""

from __future__ import annotations

import contextlib
import re
import signal
from pathlib import Path

from ._util import (
    Service,
    TestbedError,
    kill_pids,
    require_binary,
    run,
    wait_pids_gone,
    wait_until,
)
from .sshfs import SshfsExport

#: Directory where ``ip netns add`` bind-mounts named namespaces.
NETNS_RUN_DIR = "/var/run/netns"

_VETH = "tbveth0"
_MAX_SUBNETS = 250
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_-]{1,20}$")


def list_netns() -> set[str]:
    """Returns the names listed by ``ip netns list``."""
    out = run([require_binary("ip"), "netns", "list"], timeout_s=10).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


class NetnsPair(Service):
    """Namespaces ``<prefix><n>a`` and ``<prefix><n>b`` linked by a veth pair.

    Side ``"a"`` has address ``10.77.<n>.1/24`` and side ``"b"``
    ``10.77.<n>.2/24``. ``n`` is the first number whose namespace names are
    free; claiming a name with ``ip netns add`` fails if another test took it
    first, so parallel pairs never share namespaces. The veth ends are
    created directly inside the namespaces, so their names cannot collide
    with anything on the host.
    """

    def __init__(self, prefix: str = "tb", subnet_prefix: str = "10.77"):
        """Validates names; the namespaces are created on ``__enter__``.

        Args:
            prefix: Namespace name prefix (letters, digits, ``_``, ``-``).
            subnet_prefix: First two octets of the /24 subnets used.

        Raises:
            ValueError: The prefix has characters ``ip netns`` rejects.
        """
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"bad namespace prefix {prefix!r}")
        self.prefix = prefix
        self.subnet_prefix = subnet_prefix
        self.index = 0
        self.names: dict[str, str] = {}
        self.veth = _VETH
        self._created: list[str] = []

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> None:
        """Claims two namespace names, links them and brings the link up.

        Raises:
            TestbedError: No free names, or ``ip`` failed.
        """
        try:
            self._claim_names()
            self._link()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Kills processes left inside the namespaces and deletes them.

        Deleting a namespace destroys its veth end (and so the pair). Any
        process still inside would keep the namespace alive, so they are
        killed first: these namespaces were made by this object, so whatever
        runs inside was started for the test.
        """
        ip = require_binary("ip")
        for name in reversed(self._created):
            pids = self._ns_pids(name)
            kill_pids(pids, signal.SIGKILL)
            wait_pids_gone(pids, 5.0)
            with contextlib.suppress(TestbedError):
                run([ip, "netns", "del", name], timeout_s=10)
        self._created.clear()

    # -- addresses and launchers ---------------------------------------------

    def name(self, side: str) -> str:
        """Returns the namespace name of ``side`` (``"a"`` or ``"b"``)."""
        try:
            return self.names[side]
        except KeyError:
            raise ValueError(f"side must be 'a' or 'b', not {side!r}") from None

    def addr(self, side: str) -> str:
        """Returns the IPv4 address of ``side`` (without prefix length)."""
        host = {"a": 1, "b": 2}[side]
        return f"{self.subnet_prefix}.{self.index}.{host}"

    @property
    def addr_a(self) -> str:
        """Address of side a."""
        return self.addr("a")

    @property
    def addr_b(self) -> str:
        """Address of side b."""
        return self.addr("b")

    def exec_args(self, side: str) -> list[str]:
        """argv prefix running a command inside ``side``'s namespace.

        Uses ``ip netns exec``, which also gives the command a private mount
        namespace: fine for servers, wrong for FUSE clients.
        """
        return [require_binary("ip"), "netns", "exec", self.name(side)]

    def nsenter_args(self, side: str) -> list[str]:
        """argv prefix joining only ``side``'s network namespace.

        A FUSE mount made through this prefix stays visible to every process
        on the machine.
        """
        return [require_binary("nsenter"), f"--net={NETNS_RUN_DIR}/{self.name(side)}"]

    def sshfs_export(
        self, base_dir: Path | str, server: str = "a", client: str = "b"
    ) -> SshfsExport:
        """An :class:`SshfsExport` whose sshd runs in ``server``'s namespace.

        Its mounts are made from ``client``'s namespace by default, so all
        sshfs traffic crosses the veth link and :meth:`cut` partitions it.

        Args:
            base_dir: Scratch directory for the export.
            server: Side running sshd.
            client: Side running sshfs.

        Returns:
            An unstarted export (use it as a context manager).
        """
        return SshfsExport(
            base_dir,
            listen_host=self.addr(server),
            server_launcher=self.exec_args(server),
            client_launcher=self.nsenter_args(client),
        )

    # -- partitions ----------------------------------------------------------

    def cut(self, side: str = "b") -> None:
        """Takes ``side``'s veth end down: the peer loses carrier too."""
        self._ip(side, "link", "set", self.veth, "down")

    def restore(self, side: str = "b", timeout_s: float = 5.0) -> None:
        """Brings ``side``'s veth end back up and waits for carrier on both."""
        self._ip(side, "link", "set", self.veth, "up")
        self._wait_carrier(timeout_s)

    def link_is_up(self) -> bool:
        """Tells whether both veth ends report carrier (LOWER_UP)."""
        return all(self._has_carrier(side) for side in ("a", "b"))

    # -- internals -----------------------------------------------------------

    def _claim_names(self) -> None:
        ip = require_binary("ip")
        existing = list_netns()
        for n in range(1, _MAX_SUBNETS + 1):
            pair = {"a": f"{self.prefix}{n}a", "b": f"{self.prefix}{n}b"}
            if set(pair.values()) & existing:
                continue
            if not self._try_add(ip, pair["a"]):
                continue
            if not self._try_add(ip, pair["b"]):
                run([ip, "netns", "del", pair["a"]], timeout_s=10, check=False)
                self._created.remove(pair["a"])
                continue
            self.index, self.names = n, pair
            return
        raise TestbedError(f"no free namespace names {self.prefix}<1..{_MAX_SUBNETS}>a/b")

    def _try_add(self, ip: str, name: str) -> bool:
        """Claims a name; False when another process created it first."""
        done = run([ip, "netns", "add", name], timeout_s=10, check=False)
        if done.returncode == 0:
            self._created.append(name)
            return True
        if "exists" in done.stderr:
            return False
        raise TestbedError(f"ip netns add {name} failed: {done.stderr.strip()}")

    def _link(self) -> None:
        ip = require_binary("ip")
        a, b = self.names["a"], self.names["b"]
        run([ip, "link", "add", self.veth, "netns", a, "type", "veth",
             "peer", "name", self.veth, "netns", b], timeout_s=10)  # fmt: skip
        for side in ("a", "b"):
            self._ip(side, "addr", "add", f"{self.addr(side)}/24", "dev", self.veth)
            self._ip(side, "link", "set", "lo", "up")
            self._ip(side, "link", "set", self.veth, "up")
        self._wait_carrier(5.0)

    def _ip(self, side: str, *args: str) -> None:
        run([require_binary("ip"), "-n", self.name(side), *args], timeout_s=10)

    def _has_carrier(self, side: str) -> bool:
        ip = require_binary("ip")
        out = run([ip, "-n", self.name(side), "link", "show", self.veth], timeout_s=10).stdout
        return "LOWER_UP" in out

    def _wait_carrier(self, timeout_s: float) -> None:
        wait_until(self.link_is_up, timeout_s, f"carrier on {self.veth} in {self.names}")

    def _ns_pids(self, name: str) -> list[int]:
        ip = require_binary("ip")
        done = run([ip, "netns", "pids", name], timeout_s=10, check=False)
        return [int(tok) for tok in done.stdout.split() if tok.isdigit()]
