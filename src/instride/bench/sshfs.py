"""A real network file system between emulated nodes: sshfs against a storage server's sshd.

The paper's ``sharedfs`` baseline is Lustre: every byte a producer writes travels over the
network to separate storage servers, and every byte a consumer reads travels back. A plain
directory every network namespace sees costs nothing to reach, so it models only Lustre's
synchronization. :class:`SshfsStorage` adds the data movement:

- a *storage server*: one more network namespace (``<cluster prefix>st``) joined to the
  cluster's bridge at ``10.213.X.2``, running ``sshd`` (foreground, started and stopped by PID)
  that exports one directory on its "disk" (a directory on ``/dev/shm``, like the nodes' own
  storage) over SFTP;
- on every emulated node that runs ranks, an ``sshfs`` mount of that directory at
  ``<run dir>/mnt/node<i>``. ``sshfs`` runs in the node's *network* namespace
  (``nsenter --net``), so its traffic leaves through the node's ``eth0`` and crosses the
  bridge, but in the caller's *mount* namespace, so the mount exists before the ranks start.
  ``ip netns exec`` gives each rank a private copy of the mount table taken when it starts
  (the root mounts here are private, nothing propagates later), which is why every mount is
  made before the ranks and kept for the whole run or study.

Authentication uses keys generated for this storage server only (``ssh-keygen`` into the run
directory: a host key, a client key and its ``authorized_keys``); the client ignores the
user's ssh configuration and known hosts. Everything is removed by :meth:`SshfsStorage.down`,
also after a failure in :meth:`SshfsStorage.up`: mounts (``fusermount3 -u``, lazily if busy),
the ``sshfs`` and ``sshd`` processes (by PID), the storage namespace and its veth, the keys.

Semantics. The mount options keep a consumer from ever reading stale data after the pairwise
barrier: no sshfs directory/attribute cache (``dir_cache=no``), no kernel name/attribute
caching (``entry_timeout=0``, ``attr_timeout=0``, ``negative_timeout=0``), no ``kernel_cache``
(the page cache of a file is dropped on every open). FUSE without ``writeback_cache`` is
write-through and sshfs waits for every pending write in ``close``, so once the producer's
``close`` returns the frame is on the storage server. ``direct_io`` is not used: it only makes
every ``read`` bypass the (already invalidated) page cache.

Examples
--------
>>> from instride.emulate import EmulatedCluster                      # doctest: +SKIP
>>> with EmulatedCluster(nodes=2, serve=False, redis=False) as c, SshfsStorage(c) as s:
...     (s.mountpoint(1) / "x").write_bytes(b"hello")
...     c.run(2, ["cat", str(s.mountpoint(2) / "x")], capture_output=True).stdout
b'hello'
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..emulate import netns as nn
from ..errors import InstrideError

#: Port of the storage server's sshd (inside its own namespace, so the standard one).
SSH_PORT = 22
#: Last octet of the storage server's address on the cluster bridge (hub .1, nodes .11 ...).
STORAGE_HOST = 2
#: Seconds to wait for sshd to listen and for a mount to appear.
READY_TIMEOUT = 15.0
#: FUSE/sshfs options: no caching that could show a consumer stale data (see module docs).
MOUNT_OPTIONS = (
    "dir_cache=no", "entry_timeout=0", "attr_timeout=0", "negative_timeout=0",
)
#: ssh options of every mount. AES-GCM is the fastest cipher with AES-NI (Lustre encrypts
#: nothing, so the baseline gets the cheapest one); no compression (frames are floats).
SSH_OPTIONS = (
    "StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "BatchMode=yes",
    "IdentitiesOnly=yes", "PasswordAuthentication=no", "LogLevel=ERROR", "Compression=no",
    "Ciphers=aes128-gcm@openssh.com",
)
_INSTALL_HINT = "install it: apt-get install sshfs openssh-server (the Makefile's APT_PACKAGES)"


class SharedFsError(InstrideError, RuntimeError):
    """The sshfs storage server or one of its mounts cannot be set up (or is missing)."""


def _which(name: str, *extra: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    return next((p for p in extra if os.access(p, os.X_OK)), None)


def tools() -> dict[str, str | None]:
    """Paths of the programs the sshfs shared file system needs (``None`` when missing)."""
    return {
        "sshfs": _which("sshfs"),
        "sshd": _which("sshd", "/usr/sbin/sshd", "/sbin/sshd"),
        "ssh": _which("ssh"),
        "ssh-keygen": _which("ssh-keygen"),
        "fusermount": _which("fusermount3") or _which("fusermount"),
        "nsenter": _which("nsenter", "/usr/bin/nsenter"),
        "umount": _which("umount", "/usr/bin/umount", "/bin/umount"),
    }


def missing() -> list[str]:
    """What is missing for :class:`SshfsStorage` on this machine (empty: all there)."""
    out = [name for name, path in tools().items() if path is None]
    if not os.path.exists("/dev/fuse"):
        out.append("/dev/fuse")
    if os.geteuid() != 0:
        out.append("root")
    return out


def available() -> bool:
    """Whether :class:`SshfsStorage` can run here (tools, ``/dev/fuse``, root)."""
    return not missing()


def require() -> dict[str, str]:
    """The tool paths, or raise :class:`SharedFsError` naming what is missing.

    Raises
    ------
    SharedFsError
        When a program, ``/dev/fuse`` or root is missing.
    """
    lacking = missing()
    if lacking:
        raise SharedFsError(
            f"the sshfs shared file system needs {', '.join(lacking)}; {_INSTALL_HINT}"
        )
    return {k: v for k, v in tools().items() if v is not None}


def _mounted(path: Path) -> bool:
    """Whether ``path`` is a mount point in this process's mount namespace (never blocks)."""
    target = str(path)
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            fields = line.split()
            # mount point is field 5; octal escapes (\040) only for unusual characters
            if len(fields) > 4 and fields[4].encode().decode("unicode_escape") == target:
                return True
    return False


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def _stop_pid(proc: subprocess.Popen[bytes] | None, timeout: float = 5.0) -> None:
    """SIGTERM a process we started (by its PID), SIGKILL it after ``timeout``, reap it."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


class SshfsStorage:
    """A storage server on an emulated cluster's network and sshfs mounts of it on its nodes.

    Parameters
    ----------
    cluster
        A running :class:`instride.emulate.EmulatedCluster`.
    nodes
        Node numbers to mount on (default: every node of the cluster).
    base_dir
        Parent of the run directory (keys, config, logs, the export and the mount points).
        Default: ``/dev/shm`` (tmpfs, like the nodes' own storage), else the temp directory.

    Attributes
    ----------
    netns
        The storage server's network namespace.
    ip
        The storage server's address on the cluster bridge.
    export
        The exported directory on the storage server's "disk".
    run_dir
        The directory holding keys, config and logs (removed by :meth:`down`).

    Examples
    --------
    >>> with SshfsStorage(cluster, nodes=[1, 2]) as storage:         # doctest: +SKIP
    ...     storage.mountpoint(2)
    PosixPath('/dev/shm/instride-sshfs-.../mnt/node2')
    """

    def __init__(self, cluster: Any, nodes: Iterable[int] | None = None,
                 base_dir: str | os.PathLike[str] | None = None) -> None:
        self.cluster = cluster
        indices = [cluster.node(n).index for n in (nodes if nodes is not None else
                                                   range(1, len(cluster.nodes) + 1))]
        self.nodes: list[int] = sorted(set(indices))
        self.netns = cluster.prefix + "st"
        self.ip = cluster.hub_ip.rsplit(".", 1)[0] + f".{STORAGE_HOST}"
        self._base_dir = Path(base_dir) if base_dir is not None else None
        self.run_dir = Path("/nonexistent")
        self.export = self.run_dir / "export"
        self._sshd: subprocess.Popen[bytes] | None = None
        self._mounts: dict[int, subprocess.Popen[bytes]] = {}
        self._made_netns = False
        self._active = False

    # ------------------------------------------------------------------ paths
    def mountpoint(self, node: int | str) -> Path:
        """Where node ``node`` (number or ``node<i>``) sees the export."""
        return self.run_dir / "mnt" / self.cluster.node(node).name

    @property
    def mount_template(self) -> str:
        """The mount point with the node name as ``{node}`` (``.../mnt/{node}``)."""
        return str(self.run_dir / "mnt" / "{node}")

    @property
    def mounted(self) -> dict[str, Path]:
        """Node name -> mount point, for the mounts that are up."""
        return {self.cluster.node(i).name: self.mountpoint(i) for i in self._mounts
                if _mounted(self.mountpoint(i))}

    @property
    def pids(self) -> dict[str, int]:
        """PIDs of the processes this object runs: ``sshd`` and one ``sshfs`` per node."""
        out = {}
        if self._sshd is not None and self._sshd.poll() is None:
            out["sshd"] = self._sshd.pid
        for i, proc in self._mounts.items():
            if proc.poll() is None:
                out[f"sshfs-{self.cluster.node(i).name}"] = proc.pid
        return out

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> SshfsStorage:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> SshfsStorage:
        """Start the storage server and mount its export on every node; return self.

        On any failure everything created so far is removed (:meth:`down`) and the error is
        raised.

        Raises
        ------
        SharedFsError
            A tool is missing, the storage namespace exists already, sshd did not listen or a
            mount did not appear (the message holds the tail of its log).
        """
        exe = require()
        if nn.netns_exists(self.netns):
            raise SharedFsError(
                f"namespace {self.netns} exists: cluster {self.cluster.name} already has a "
                "storage server (one at a time per cluster)"
            )
        self._active = True
        try:
            parent = self._base_dir
            if parent is None:
                shm = Path("/dev/shm")
                parent = shm if os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
            parent.mkdir(parents=True, exist_ok=True)
            self.run_dir = Path(tempfile.mkdtemp(prefix="instride-sshfs-", dir=parent))
            self.export = self.run_dir / "export"
            self.export.mkdir()
            self._keys(exe["ssh-keygen"])
            nn.add_netns(self.netns)
            self._made_netns = True
            self._attach()
            self._start_sshd(exe["sshd"])
            for i in self.nodes:
                self._mount(i, exe)
        except BaseException:
            self.down()
            raise
        return self

    def _attach(self) -> None:
        """Join the storage namespace to the cluster's bridge at :attr:`ip`.

        Its MAC address is fixed (derived from the cluster), and the nodes forget whatever
        they knew about :attr:`ip`: a storage server re-created on the same cluster must not be
        unreachable until the nodes' stale ARP entries expire (that took ~70 s).
        """
        nn.add_veth(self.cluster.hub, "st0", "br0", self.netns, "eth0", f"{self.ip}/24")
        digest = hashlib.sha256(self.netns.encode()).digest()
        mac = "02:" + ":".join(f"{b:02x}" for b in digest[:5])
        nn.ip("-n", self.netns, "link", "set", "eth0", "address", mac)
        for node in self.cluster.nodes:
            if nn.netns_exists(node.netns):
                nn.ip("-n", node.netns, "neigh", "flush", "to", self.ip, check=False)

    def _keys(self, keygen: str) -> None:
        keys = self.run_dir / "keys"
        keys.mkdir(mode=0o700)
        for name in ("host_key", "client_key"):
            subprocess.run(
                [keygen, "-q", "-t", "ed25519", "-N", "", "-C", f"instride-{name}",
                 "-f", str(keys / name)], check=True, capture_output=True,
            )
        shutil.copyfile(keys / "client_key.pub", keys / "authorized_keys")
        os.chmod(keys / "authorized_keys", 0o600)
        config = self.run_dir / "sshd_config"
        config.write_text("\n".join([
            f"ListenAddress {self.ip}:{SSH_PORT}",
            f"HostKey {keys / 'host_key'}",
            f"AuthorizedKeysFile {keys / 'authorized_keys'}",
            "PidFile none",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "X11Forwarding no",
            "AllowTcpForwarding no",
            "PrintMotd no",
            "UseDNS no",
            "Subsystem sftp internal-sftp",
            "LogLevel ERROR",
            "",
        ]))

    def _start_sshd(self, sshd: str) -> None:
        # sshd's privilege separation directory (Debian creates it only from its service unit)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        log = self.run_dir / "sshd.log"
        with open(log, "ab") as fh:
            self._sshd = subprocess.Popen(
                nn.exec_argv(self.netns, [sshd, "-D", "-e", "-f",
                                          str(self.run_dir / "sshd_config")]),
                stdin=subprocess.DEVNULL, stdout=fh, stderr=fh, start_new_session=True,
            )
        deadline = time.monotonic() + READY_TIMEOUT
        while not nn.can_connect(self.netns, self.ip, SSH_PORT, timeout=0.5):
            if self._sshd.poll() is not None:
                raise SharedFsError(f"sshd exited (status {self._sshd.returncode}) before "
                                    f"listening on {self.ip}:{SSH_PORT}; log {log}:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise SharedFsError(f"sshd did not listen on {self.ip}:{SSH_PORT} within "
                                    f"{READY_TIMEOUT:.0f} s; log {log}:\n{_tail(log)}")
            time.sleep(0.05)

    def mount_argv(self, node: int) -> list[str]:
        """The command that mounts the export on node ``node`` (runs in the foreground)."""
        exe = require()
        opts = [f"IdentityFile={self.run_dir / 'keys' / 'client_key'}", *SSH_OPTIONS,
                *MOUNT_OPTIONS]
        return [
            exe["nsenter"], f"--net={nn.NETNS_RUN_DIR / self.cluster.node(node).netns}", "--",
            exe["sshfs"], "-f", "-F", "/dev/null", f"root@{self.ip}:{self.export}",
            str(self.mountpoint(node)), "-p", str(SSH_PORT), "-o", ",".join(opts),
        ]

    def _mount(self, node: int, exe: dict[str, str]) -> None:
        point = self.mountpoint(node)
        point.mkdir(parents=True)
        log = self.run_dir / f"sshfs-{self.cluster.node(node).name}.log"
        with open(log, "ab") as fh:
            proc = subprocess.Popen(self.mount_argv(node), stdin=subprocess.DEVNULL, stdout=fh,
                                    stderr=fh, start_new_session=True)
        self._mounts[node] = proc
        deadline = time.monotonic() + READY_TIMEOUT
        while not _mounted(point):
            if proc.poll() is not None:
                raise SharedFsError(f"sshfs on node{node} exited (status {proc.returncode}) "
                                    f"before mounting {point}; log {log}:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise SharedFsError(f"sshfs on node{node} did not mount {point} within "
                                    f"{READY_TIMEOUT:.0f} s; log {log}:\n{_tail(log)}")
            time.sleep(0.02)

    def _unmount(self, node: int, exe: dict[str, str | None]) -> None:
        point = self.mountpoint(node)
        if _mounted(point):
            done = False
            if exe["fusermount"]:
                done = subprocess.run([exe["fusermount"], "-u", "-q", str(point)],
                                      capture_output=True).returncode == 0
            if not done and _mounted(point):
                # busy (a rank still has a file open) or the daemon died: detach lazily
                argv = [exe["fusermount"], "-u", "-z", "-q"] if exe["fusermount"] else \
                       [exe["umount"] or "umount", "-l"]
                subprocess.run([*argv, str(point)], capture_output=True)
        proc = self._mounts.pop(node, None)
        if proc is not None:
            # sshfs exits by itself once unmounted; stop it by PID otherwise
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                _stop_pid(proc)

    def down(self) -> None:
        """Unmount every mount, stop sshfs and sshd, remove the namespace and the run dir.

        Safe to call any number of times, and after a failed :meth:`up`. SIGTERM and SIGINT
        are held back until it is done (a second Ctrl-C while it waited for an unmount left
        dead FUSE mounts and the keys' directory that nothing records).
        """
        if not self._active:
            return
        from ..emulate.teardown import signals_held

        with signals_held():
            self._down()

    def _down(self) -> None:
        exe = tools()
        for node in sorted(self._mounts):
            self._unmount(node, exe)
        _stop_pid(self._sshd)
        self._sshd = None
        if self._made_netns:
            # sshd's per-connection children (gone with their connections, normally)
            nn.kill_all(self.netns)
            # the veth pair first, explicitly: a namespace's devices go away asynchronously
            # after `ip netns del`, and the next up() of this cluster would find "st0" taken
            if nn.netns_exists(self.cluster.hub):
                nn.ip("-n", self.cluster.hub, "link", "del", "st0", check=False)
            nn.del_netns(self.netns)
            self._made_netns = False
        if self.run_dir.is_dir() and not any(_mounted(self.mountpoint(i)) for i in self.nodes):
            shutil.rmtree(self.run_dir, ignore_errors=True)
        self._active = False

    def __repr__(self) -> str:
        return (f"SshfsStorage(cluster={self.cluster.name!r}, ip={self.ip!r}, "
                f"nodes={self.nodes}, run_dir={str(self.run_dir)!r})")


def covers(storage: SshfsStorage | None, nodes: Sequence[int]) -> bool:
    """Whether ``storage`` is up and mounted on every node of ``nodes``."""
    if storage is None:
        return False
    names = storage.mounted
    return all(storage.cluster.node(n).name in names for n in nodes)


__all__ = ["MOUNT_OPTIONS", "SSH_OPTIONS", "SharedFsError", "SshfsStorage", "available",
           "covers", "missing", "require", "tools"]
