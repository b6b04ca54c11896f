"""Low-level network-namespace plumbing for emulated nodes, through the ``ip`` command.

Everything here is a thin wrapper over one ``ip`` (iproute2) invocation, plus two helpers that
need no ``ip``: :func:`in_netns` runs a Python callable in a thread that has joined a network
namespace (``setns(2)``), and :func:`can_connect` uses it to test a TCP address as seen from
inside a namespace. Interfaces are created directly in their target namespace, never in the
host's, so the host network is never touched and interface names cannot collide between
clusters.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from ..errors import InstrideError

#: Where ``ip netns add`` bind-mounts named namespaces.
NETNS_RUN_DIR = Path("/run/netns")
#: Longest interface name Linux accepts (IFNAMSIZ - 1).
IFNAMSIZ = 15
_CLONE_NEWNET = 0x40000000
_INSTALL_HINT = "`make test` installs it (apt-get install iproute2 redis-server)"

T = TypeVar("T")


class ClusterError(InstrideError, RuntimeError):
    """An emulated cluster cannot be created, found, or torn down."""


def require_ip() -> str:
    """Return the path of the ``ip`` command, or raise :class:`ClusterError`.

    Raises
    ------
    ClusterError
        When not running as root or when iproute2 is not installed.
    """
    if os.geteuid() != 0:
        raise ClusterError(
            "emulated nodes need root (network namespaces); run as root, e.g. in the test container"
        )
    exe = shutil.which("ip") or next(
        (p for p in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip") if os.access(p, os.X_OK)), None
    )
    if exe is None:
        raise ClusterError(f"the `ip` command (iproute2) is not installed; {_INSTALL_HINT}")
    return exe


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS...`` and return the completed process.

    Parameters
    ----------
    *args
        Arguments of ``ip`` (``"-n", "ns", "link", "set", ...``).
    check
        Raise :class:`ClusterError` (with ``ip``'s stderr) when it fails.
    """
    argv = [require_ip(), *args]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def check_ifname(name: str) -> str:
    """Return ``name`` if it is a valid interface or namespace name (at most 15 characters)."""
    if not name or len(name) > IFNAMSIZ or "/" in name or any(c.isspace() for c in name):
        raise ClusterError(f"invalid interface/namespace name {name!r} (1-{IFNAMSIZ} characters)")
    return name


# ---------------------------------------------------------------------- namespaces
def list_netns() -> list[str]:
    """Names of the named network namespaces (``ip netns list``)."""
    out = ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_exists(name: str) -> bool:
    """Whether the named namespace exists."""
    return (NETNS_RUN_DIR / name).exists()


def add_netns(name: str) -> None:
    """Create a named network namespace and bring its loopback up."""
    ip("netns", "add", check_ifname(name))
    ip("-n", name, "link", "set", "lo", "up")


def del_netns(name: str) -> bool:
    """Delete a named namespace (its interfaces go with it); return whether it existed."""
    if not netns_exists(name):
        return False
    ip("netns", "del", name, check=False)
    return True


def netns_pids(name: str) -> list[int]:
    """PIDs of the processes whose network namespace is ``name``."""
    if not netns_exists(name):
        return []
    out = ip("netns", "pids", name, check=False).stdout
    return [int(tok) for tok in out.split() if tok.isdigit()]


def kill_all(name: str, passes: int = 10) -> None:
    """SIGKILL every process in network namespace ``name`` (by PID; never this process), list
    after list until none is left (``passes`` at most): a process forked after a listing, or
    an ``ip netns exec`` that had opened the namespace, would otherwise outlive the namespace's
    name in a namespace nobody can name."""
    me = os.getpid()
    for _ in range(passes):
        pids = [pid for pid in netns_pids(name) if pid != me]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def exec_argv(netns: str, argv: Sequence[str]) -> list[str]:
    """The argv that runs ``argv`` inside ``netns`` (``ip netns exec NS ...``)."""
    return [require_ip(), "netns", "exec", netns, *argv]


# ---------------------------------------------------------------------- links
def add_bridge(netns: str, bridge: str, cidr: str) -> None:
    """Create bridge ``bridge`` in ``netns`` with address ``cidr`` and bring it up."""
    ip("-n", netns, "link", "add", check_ifname(bridge), "type", "bridge")
    ip("-n", netns, "addr", "add", cidr, "dev", bridge)
    ip("-n", netns, "link", "set", bridge, "up")


def add_veth(hub: str, hub_if: str, bridge: str, node: str, node_if: str, cidr: str) -> None:
    """Join namespace ``node`` to ``bridge`` in ``hub`` with a veth pair.

    The pair is created in ``hub`` with its peer directly in ``node`` (never in the host's
    namespace); the node end gets address ``cidr``.
    """
    ip("-n", hub, "link", "add", check_ifname(hub_if), "type", "veth",
       "peer", "name", check_ifname(node_if), "netns", node)
    ip("-n", hub, "link", "set", hub_if, "master", bridge)
    ip("-n", hub, "link", "set", hub_if, "up")
    ip("-n", node, "addr", "add", cidr, "dev", node_if)
    ip("-n", node, "link", "set", node_if, "up")


def links(netns: str | None = None) -> list[str]:
    """Interface names in ``netns`` (default: the host's namespace)."""
    args = ["-o", "link", "show"] if netns is None else ["-n", netns, "-o", "link", "show"]
    out = ip(*args, check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


# ---------------------------------------------------------------------- in-namespace calls
_libc: ctypes.CDLL | None = None


def _setns(fd: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def in_netns(netns: str, fn: Callable[[], T]) -> T:
    """Call ``fn()`` in a fresh thread that has joined network namespace ``netns``.

    ``setns(CLONE_NEWNET)`` changes only the calling thread, and the thread ends with ``fn``,
    so the rest of the process stays in its own namespace. Sockets created by ``fn`` belong to
    ``netns`` (and keep working if used afterwards from any thread).
    """
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            fd = os.open(NETNS_RUN_DIR / netns, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(fd)
            finally:
                os.close(fd)
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            error.append(exc)

    thread = threading.Thread(target=target, name=f"netns-{netns}", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def can_connect(netns: str, host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether a TCP connection to ``host:port`` succeeds from inside ``netns``."""

    def attempt() -> bool:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return True
        except OSError:
            return False

    return in_netns(netns, attempt)
