"""Emulated nodes on one machine: network namespaces joined by a bridge.

An :class:`EmulatedCluster` of N nodes is

- one *hub* namespace holding a bridge ``br0`` with address ``10.213.X.1/24`` (X derived from
  the cluster name), and the Redis server of the cluster, bound to that address;
- one namespace per node, joined to the bridge by a veth pair, with address
  ``10.213.X.(10+i)/24`` on its ``eth0``, its own managed directory ``<base_dir>/node<i>`` and
  its own data server (``python -m instride serve``) listening on ``10.213.X.(10+i):7437``;
- a directory ``<base_dir>/shared`` every node sees (the file system is not isolated), for a
  shared-file-system baseline.

The host's own network is untouched: every interface is created inside one of the cluster's
namespaces. With ``unprivileged=True`` every node's processes run without root's capabilities
(``setpriv``), as a user's processes on a real cluster node do: what needs a privilege fails
there as it would on the cluster. A JSON state file (``/run/instride/clusters/<name>.json``)
lets another process (``instride cluster exec/status/down``) find the cluster.

Examples
--------
>>> from instride.emulate import EmulatedCluster                      # doctest: +SKIP
>>> with EmulatedCluster(nodes=2) as c:
...     c.run(1, ["python", "-c", "import instride; print(instride.open('k', 'wb'))"])
...     c.run(2, ["instride", "cat", "k"], capture_output=True).stdout
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import DEFAULT_PORT, read_variable
from ..errors import ConfigError
from . import mounts
from . import netns as nn
from .netns import ClusterError
from .teardown import TornDownOnSigterm, signals_held

#: Directory of the state files (override with ``INSTRIDE_CLUSTER_STATE_DIR``).
STATE_DIR: Path = read_variable("INSTRIDE_CLUSTER_STATE_DIR")
#: Port of the Redis server in the hub namespace (private to the cluster, so fixed).
REDIS_PORT = 6379
#: Port of every node's data server.
SERVER_PORT = DEFAULT_PORT
#: Seconds to wait for a data server or Redis to accept connections.
READY_TIMEOUT = 10.0
#: Largest number of nodes (.11 ... .254 of the /24).
MAX_NODES = 244

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: Node-specific variables: never inherited from the caller's environment.
_NODE_VARS = (
    "INSTRIDE_DIR", "INSTRIDE_REDIS_URL", "INSTRIDE_TOKEN", "INSTRIDE_NODE", "INSTRIDE_ADDR",
    "INSTRIDE_SOCKET",
)
_INSTALL_HINT = "`make test` installs it (apt-get install iproute2 redis-server)"


@dataclass(frozen=True)
class Node:
    """One emulated node.

    Attributes
    ----------
    index
        1-based node number.
    name
        ``"node<index>"`` (its ``INSTRIDE_NODE``).
    netns
        Name of its network namespace.
    ip
        Its IPv4 address on the cluster bridge.
    dir
        Its managed directory (``INSTRIDE_DIR``).
    env
        The full environment of a process on this node: the caller's environment, the
        cluster's ``UCX_POSIX_DIR`` (see :attr:`EmulatedCluster.ucx_dir`), its extra
        variables, and this node's ``INSTRIDE_*`` variables.
    """

    index: int
    name: str
    netns: str
    ip: str
    dir: Path
    env: dict[str, str] = field(repr=False, compare=False)

    @property
    def addr(self) -> str:
        """``ip:port`` of its data server (its ``INSTRIDE_ADDR``)."""
        return f"{self.ip}:{SERVER_PORT}"


def validate_name(name: str) -> str:
    """Return ``name`` if usable as a cluster name, else raise :class:`ConfigError`."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError(
            "cluster name", name,
            "use 1-64 letters, digits, '_', '.', '-', starting with a letter or digit",
        )
    return name


def state_path(name: str) -> Path:
    """Path of the state file of cluster ``name``."""
    return STATE_DIR / f"{validate_name(name)}.json"


def list_clusters() -> list[str]:
    """Names of the clusters that have a state file, sorted."""
    if not STATE_DIR.is_dir():
        return []
    return sorted(p.stem for p in STATE_DIR.glob("*.json"))


def _require_redis() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        raise ClusterError(f"redis-server is not installed; {_INSTALL_HINT}")
    return exe


def _start_time(pid: int) -> int | None:
    """Start time (clock ticks since boot) of a live, non-zombie process, else None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = raw[raw.rfind(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _alive(pid: int, start: int | None) -> bool:
    now = _start_time(pid)
    return now is not None and (start is None or now == start)


def _check_base_dir(path: Path) -> None:
    """Refuse a ``base_dir`` that is, or lies under, something other than a directory, before
    anything is made (it used to fail half-way with a bare "Not a directory")."""
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    if not existing.is_dir():
        what = "is" if existing == path else f"lies under {existing}, which is"
        raise ConfigError("base_dir", str(path), f"it {what} not a directory")


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


class EmulatedCluster(TornDownOnSigterm):
    """N emulated nodes (network namespaces), their data servers and one Redis server.

    Parameters
    ----------
    nodes
        Number of nodes (1 ... 244).
    name
        Cluster name, unique among running clusters; it names the state file and (hashed) the
        namespaces. Default: a random name ``c<hex>``, so concurrent users never collide.
    base_dir
        Directory for the nodes' managed directories (``node<i>``), the shared directory
        (``shared``), the logs and UCX's shared-memory segments (``ucx``: the nodes'
        ``UCX_POSIX_DIR``, unless ``env`` sets it). Default: a new temporary directory on
        ``/dev/shm``. Whatever the cluster creates is removed by :meth:`down`.
    serve
        Start ``python -m instride serve`` on every node.
    redis
        Start a Redis server (cluster mode); without it nodes run in local mode.
    token
        The job token (``INSTRIDE_TOKEN``); default: random.
    env
        Extra environment variables for every node's processes; the node-specific
        ``INSTRIDE_*`` variables (``INSTRIDE_DIR``, ``_REDIS_URL``, ``_TOKEN``, ``_NODE``,
        ``_ADDR``, ``_SOCKET``) are refused (:class:`ConfigError`): the cluster sets them.
    unprivileged
        Run every node's processes — the data servers and whatever :meth:`popen`, :meth:`run`,
        :meth:`command` and ``instride cluster exec`` start — without any capability (an empty
        bounding set, no new privileges: ``setpriv`` of util-linux), as an unprivileged user's
        processes on a cluster node run. They keep the user id 0, so the files they make are
        root's; Redis runs as usual.
    huge_pages
        Put ``base_dir`` on a tmpfs of its own mounted with huge pages (``huge=within_size``),
        unmounted by :meth:`down`: new files of 2 MiB and more are made of huge pages, far
        fewer page allocations (on a VM, host faults) than on ``/dev/shm`` (see
        :mod:`instride.emulate.mounts`). A ``base_dir`` given must then be empty.

    Examples
    --------
    >>> with EmulatedCluster(nodes=2, serve=False) as c:          # doctest: +SKIP
    ...     c.run(2, ["python", "-c", "import os; print(os.environ['INSTRIDE_NODE'])"])
    """

    def __init__(
        self,
        nodes: int = 2,
        name: str | None = None,
        base_dir: str | os.PathLike[str] | None = None,
        serve: bool = True,
        redis: bool = True,
        token: str | None = None,
        env: Mapping[str, str] | None = None,
        unprivileged: bool = False,
        huge_pages: bool = False,
    ) -> None:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
            raise ConfigError("nodes", nodes, f"expected an integer from 1 to {MAX_NODES}")
        self.name = validate_name(name if name is not None else "c" + secrets.token_hex(5))
        self.serve = bool(serve)
        self.with_redis = bool(redis)
        self.token = token if token else secrets.token_hex(16)
        self.extra_env = {str(k): str(v) for k, v in (env or {}).items()}
        for key in self.extra_env:
            if key in _NODE_VARS:
                raise ConfigError("env", f"{key}={self.extra_env[key]}",
                                  f"{key} is set by the cluster for each node (node-specific "
                                  f"variables: {', '.join(_NODE_VARS)})")
        self.unprivileged = bool(unprivileged)
        self.huge_pages = bool(huge_pages)
        self._mounted: list[str] = []  # mount points we made, unmounted by down()
        # (resolved: the kernel lists a mount under its real path, and down() compares it)
        self._base_dir_arg = Path(base_dir).resolve() if base_dir is not None else None
        self.base_dir: Path = self._base_dir_arg or Path("/nonexistent")
        self._nodes_count = nodes
        self._created: list[str] = []  # paths we created, removed by down()
        self._pids: dict[str, list[int | None]] = {}  # role -> [pid, start time]
        self._popen: dict[str, subprocess.Popen[bytes]] = {}
        #: "down", "starting" or "up" (as recorded in the state file).
        self.status_text = "down"
        self._active = False  # True once this object owns the name (claimed or attached)
        #: this cluster's mark in its state file: the name's next cluster has another
        self._nonce: str | None = None
        self._layout()

    # ------------------------------------------------------------------ layout
    def _layout(self) -> None:
        digest = hashlib.sha256(self.name.encode()).hexdigest()
        #: Prefix of every namespace of this cluster ("is" + 8 hex digits).
        self.prefix = "is" + digest[:8]
        self.hub = self.prefix + "hub"
        third = int(digest[8:10], 16)
        self.subnet = f"10.213.{third}.0/24"
        self.hub_ip = f"10.213.{third}.1"
        self.redis_url: str | None = (
            f"redis://{self.hub_ip}:{REDIS_PORT}/0" if self.with_redis else None
        )
        self.shared_dir = self.base_dir / "shared"
        #: Where UCX's shared-memory transport makes its segment files (``UCX_POSIX_DIR``),
        #: unless ``env`` names another: removed by :meth:`down` with whatever a process
        #: killed between their creation and their unlinking left there.
        self.ucx_dir = self.base_dir / "ucx"
        base = {k: v for k, v in os.environ.items() if k not in _NODE_VARS}
        base["UCX_POSIX_DIR"] = str(self.ucx_dir)
        base.update(self.extra_env)
        self.nodes: list[Node] = []
        for i in range(1, self._nodes_count + 1):
            ip = f"10.213.{third}.{10 + i}"
            ndir = self.base_dir / f"node{i}"
            env = dict(base)
            env.update(
                INSTRIDE_DIR=str(ndir), INSTRIDE_NODE=f"node{i}",
                INSTRIDE_ADDR=f"{ip}:{SERVER_PORT}", INSTRIDE_TOKEN=self.token,
            )
            if self.redis_url:
                env["INSTRIDE_REDIS_URL"] = self.redis_url
            self.nodes.append(Node(i, f"node{i}", f"{self.prefix}n{i}", ip, ndir, env))

    @property
    def state_path(self) -> Path:
        """Path of this cluster's JSON state file."""
        return state_path(self.name)

    def node(self, index: int | str) -> Node:
        """Node number ``index`` (1-based), also accepted as ``"node<i>"`` or ``"<i>"``."""
        raw = index
        if isinstance(index, str):
            text = index.removeprefix("node")
            if not text.isdigit():
                raise ConfigError("node", raw, "expected a node number or node<i>")
            index = int(text)
        if isinstance(index, bool) or not isinstance(index, int) or not (
            1 <= index <= len(self.nodes)
        ):
            raise ConfigError("node", raw, f"cluster {self.name} has nodes 1..{len(self.nodes)}")
        return self.nodes[index - 1]

    # ------------------------------------------------------------------ state file
    def _state(self) -> dict[str, Any]:
        return {
            "version": 1,
            "name": self.name,
            "status": self.status_text,
            "nodes": len(self.nodes),
            "prefix": self.prefix,
            "hub": self.hub,
            "subnet": self.subnet,
            "redis_url": self.redis_url,
            "serve": self.serve,
            "token": self.token,
            "base_dir": str(self.base_dir),
            "shared_dir": str(self.shared_dir),
            "env": self.extra_env,
            "unprivileged": self.unprivileged,
            "huge_pages": self.huge_pages,
            "mounted": self._mounted,
            "created": self._created,
            "pids": self._pids,
            "owner_pid": os.getpid(),
            "updated": time.time(),
            "nonce": self._nonce,
        }

    def _owns_name(self) -> bool:
        """Whether the name is still this cluster's: its state file gone (nobody else claimed
        it) or holding this cluster's nonce — not that of a cluster made under the same name
        after this one was destroyed from another process (which ``down()`` must not touch)."""
        try:
            state = json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return True
        except (OSError, ValueError):
            return False
        return isinstance(state, dict) and state.get("nonce") == self._nonce

    def _save(self) -> None:
        if not self._owns_name():  # (another cluster's file now: never overwritten)
            return
        path = self.state_path
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self._state(), indent=2))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)

    def _claim(self) -> None:
        """Create the state file exclusively, so two clusters can never share a name."""
        STATE_DIR.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Written whole under a hidden name, then given its own by a hard link, which fails
        # where the name is taken: never an empty or half-written state file under the name
        # (another process's status, down or attach read one while it was being written)
        self._nonce = secrets.token_hex(8)
        path = self.state_path
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{self._nonce}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(json.dumps(self._state(), indent=2))
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise ClusterError(
                    f"cluster {self.name!r} already exists ({path}); "
                    f"run `instride cluster down --name {self.name}` first"
                ) from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self._active = True

    @classmethod
    def attach(cls, name: str = "default") -> EmulatedCluster:
        """The running cluster ``name``, from its state file (for another process).

        Raises
        ------
        ClusterError
            When no cluster of that name has a state file.
        """
        path = state_path(name)
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            raise ClusterError(
                f"no cluster named {name!r} (no {path}); start one with "
                f"`instride cluster up --name {name}`"
            ) from None
        except json.JSONDecodeError as exc:
            raise ClusterError(f"corrupt state file {path}: {exc}") from None
        try:
            self = cls(
                nodes=int(state["nodes"]), name=state["name"], base_dir=state["base_dir"],
                serve=bool(state["serve"]), redis=state["redis_url"] is not None,
                token=state["token"], env=state.get("env") or {},
                unprivileged=bool(state.get("unprivileged", False)),
                huge_pages=bool(state.get("huge_pages", False)),
            )
            self._created = list(state.get("created", []))
            self._mounted = list(state.get("mounted", []))
            self._pids = {k: list(v) for k, v in state.get("pids", {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # (not ours, or cut)
            raise ClusterError(f"corrupt state file {path}: {type(exc).__name__}: {exc}") \
                from None
        self.status_text = state.get("status", "unknown")
        self._nonce = state.get("nonce")
        self._active = True
        return self

    # ------------------------------------------------------------------ life cycle
    def up(self) -> EmulatedCluster:
        """Create the namespaces, bridge, directories, Redis and data servers; return self.

        On any failure everything created so far is removed (:meth:`down`) and the error is
        raised.

        Raises
        ------
        ClusterError
            Not root, ``ip`` or ``redis-server`` missing, the name is taken, or Redis or a
            data server did not start (the message holds the tail of its log).
        ConfigError
            ``base_dir`` is, or lies under, something other than a directory.
        """
        nn.require_ip()
        if self.with_redis:
            _require_redis()
        if self._base_dir_arg is not None:
            _check_base_dir(self._base_dir_arg)
        leftovers = [ns for ns in nn.list_netns() if ns.startswith(self.prefix)]
        if leftovers and not self.state_path.exists():
            raise ClusterError(
                f"namespaces {leftovers} of cluster {self.name!r} already exist; "
                f"run `instride cluster down --name {self.name}`"
            )
        self.status_text = "starting"
        self._claim()
        try:
            self._make_dirs()
            self._save()
            nn.add_netns(self.hub)
            nn.add_bridge(self.hub, "br0", f"{self.hub_ip}/24")
            for node in self.nodes:
                nn.add_netns(node.netns)
                nn.add_veth(self.hub, f"n{node.index}", "br0", node.netns, "eth0", f"{node.ip}/24")
            if self.with_redis:
                self.start_redis()
            if self.serve:
                self._start_servers([n.index for n in self.nodes])
            self.status_text = "up"
            self._save()
        except BaseException:
            self.down()
            raise
        return self

    def _make_dirs(self) -> None:
        if self._base_dir_arg is None:
            parent = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None
            self.base_dir = Path(tempfile.mkdtemp(prefix=f"instride-{self.name}-", dir=parent))
            self._created.append(str(self.base_dir))
            self._layout()  # directories now known
        elif not self.base_dir.exists():
            self.base_dir.mkdir(parents=True)
            self._created.append(str(self.base_dir))
        if self.huge_pages:
            # (recorded before the mount: an interrupt during it leaves one that down() finds;
            # unmounting what is not mounted does nothing — unless a mount of the user's is
            # there already, which is recorded only once ours is on it)
            early = not mounts.is_mount(self.base_dir)
            if early:
                self._mounted.append(str(self.base_dir))
                self._save()
            mounts.mount_huge_tmpfs(self.base_dir)
            if not early:
                self._mounted.append(str(self.base_dir))
            self._save()  # (a down() from another process unmounts it)
        managed = {n.dir for n in self.nodes}
        for path in [self.shared_dir, self.ucx_dir, *(n.dir for n in self.nodes)]:
            if not path.exists():
                # (a node's managed directory 0700 whatever the umask: one its group may
                # write — umask 002, common on HPC systems — is refused by every client)
                path.mkdir(parents=True, mode=0o700 if path in managed else 0o777)
                self._created.append(str(path))

    def _log(self, role: str) -> Path:
        path = self.base_dir / f"{role}.log"
        if str(path) not in self._created:
            self._created.append(str(path))
        return path

    def _spawn(self, role: str, netns: str, argv: Sequence[str], env: Mapping[str, str]) -> None:
        with open(self._log(role), "ab") as log:
            proc = subprocess.Popen(
                nn.exec_argv(netns, argv), env=dict(env), stdin=subprocess.DEVNULL,
                stdout=log, stderr=log, cwd=self.base_dir, start_new_session=True,
            )
        self._popen[role] = proc
        self._pids[role] = [proc.pid, _start_time(proc.pid)]
        self._save_if_present()

    def _wait_ready(self, roles: dict[str, tuple[str, str, int]], what: str) -> None:
        """Wait until every role's (netns, host, port) accepts TCP connections."""
        pending = dict(roles)
        deadline = time.monotonic() + READY_TIMEOUT
        while pending:
            for role, (netns, host, port) in list(pending.items()):
                pid, start = self._pids[role]
                if pid is None or not _alive(pid, start):
                    code = self._popen[role].poll() if role in self._popen else None
                    raise ClusterError(
                        f"{what} {role} exited (status {code}) before listening on "
                        f"{host}:{port}; log {self._log(role)}:\n{_tail(self._log(role))}"
                    )
                if nn.can_connect(netns, host, port, timeout=0.5):
                    del pending[role]
            if not pending:
                return
            if time.monotonic() > deadline:
                role = next(iter(pending))
                raise ClusterError(
                    f"{what} {role} did not listen on {pending[role][1]}:{pending[role][2]} "
                    f"within {READY_TIMEOUT:.0f} s; log {self._log(role)}:\n"
                    f"{_tail(self._log(role))}"
                )
            time.sleep(0.05)

    def _start_servers(self, indices: Sequence[int]) -> None:
        for i in indices:
            node = self.node(i)
            self._spawn(node.name, node.netns,
                        self._as_node([sys.executable, "-m", "instride", "serve"]), node.env)
        self._wait_ready(
            {self.node(i).name: (self.node(i).netns, self.node(i).ip, SERVER_PORT)
             for i in indices},
            "data server of",
        )

    def _stop(self, roles: Sequence[str], timeout: float = 5.0) -> None:
        """SIGTERM the processes of ``roles`` by PID, SIGKILL them after ``timeout``."""
        live = []
        for role in roles:
            pid, start = self._pids.get(role, [None, None])
            if pid is not None and _alive(pid, start):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                live.append((role, pid, start))
        deadline = time.monotonic() + timeout
        for role, pid, start in live:
            proc = self._popen.get(role)
            while _alive(pid, start) and time.monotonic() < deadline:
                if proc is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(max(0.0, min(0.1, deadline - time.monotonic())))
                else:
                    time.sleep(0.02)
            if _alive(pid, start):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
        for role in roles:
            self._popen.pop(role, None)
            self._pids.pop(role, None)

    def stop_server(self, index: int | str) -> None:
        """Stop node ``index``'s data server (SIGTERM, then SIGKILL after 5 s)."""
        self._stop([self.node(index).name])
        self._save_if_present()

    def start_server(self, index: int | str) -> None:
        """(Re)start node ``index``'s data server and wait until it listens.

        Raises
        ------
        ClusterError
            When it is already running, or did not start within ``READY_TIMEOUT``.
        """
        node = self.node(index)
        pid, start = self._pids.get(node.name, [None, None])
        if pid is not None and _alive(pid, start):
            raise ClusterError(f"the data server of {node.name} is already running (pid {pid})")
        self._start_servers([node.index])
        self._save_if_present()

    def stop_redis(self) -> None:
        """Stop the Redis server (by PID)."""
        self._stop(["redis"])
        self._save_if_present()

    def start_redis(self) -> None:
        """(Re)start the Redis server on the same address and port; wait until it listens."""
        if not self.with_redis:
            raise ClusterError(f"cluster {self.name} was created with redis=False")
        pid, start = self._pids.get("redis", [None, None])
        if pid is not None and _alive(pid, start):
            raise ClusterError(f"Redis of cluster {self.name} is already running (pid {pid})")
        argv = [
            _require_redis(), "--bind", self.hub_ip, "--port", str(REDIS_PORT), "--save", "",
            "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no",
            "--dir", str(self.base_dir), "--loglevel", "warning",
        ]
        self._spawn("redis", self.hub, argv, os.environ)
        self._wait_ready({"redis": (self.hub, self.hub_ip, REDIS_PORT)}, "Redis")
        self._save_if_present()

    def _save_if_present(self) -> None:
        if self.state_path.exists():
            self._save()

    def down(self) -> None:
        """Remove everything the cluster created; safe to call any number of times.

        Stops the processes it started (by PID), kills any other process left in its
        namespaces, deletes its namespaces (and with them the veths and the bridge), removes
        the directories and logs it created and its state file. Does nothing on an object
        that never owned its name (``up()`` not called, or refused because the name is taken).
        """
        if not self._active:
            return
        with signals_held():  # (a second signal must not leave it half-way)
            self._down()

    def _down(self) -> None:
        self._stop(list(self._pids))
        if not self._owns_name():
            # destroyed from another process, and its name taken by a new cluster since: the
            # namespaces, directories and state file under that name are the new one's
            self.status_text = "down"
            self._active = False
            return
        try:
            namespaces = [ns for ns in nn.list_netns() if ns.startswith(self.prefix)]
        except ClusterError:
            namespaces = []
        for ns in sorted(namespaces, key=lambda s: s == self.hub):  # nodes first, hub last
            nn.kill_all(ns)
            nn.del_netns(ns)
        for raw in reversed(self._mounted):  # (its files go with it)
            mounts.unmount(Path(raw))
        self._mounted = []
        for raw in reversed(self._created):
            path = Path(raw)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        self._created = []
        with contextlib.suppress(FileNotFoundError, ConfigError):
            self.state_path.unlink()
        self.status_text = "down"
        self._active = False

    @classmethod
    def destroy(cls, name: str = "default") -> bool:
        """Tear down cluster ``name`` from another process; return whether anything existed.

        Works from the state file when there is one, and otherwise still removes leftover
        namespaces of that name (e.g. after a crash of the process that ran ``up``).

        Raises
        ------
        ClusterError
            The state file cannot be read (corrupt): the namespaces of that name are removed,
            but the processes, directories and state file it lists are left, and the error
            names the file.
        """
        try:
            cluster = cls.attach(name)
        except ClusterError as exc:
            corrupt = state_path(name).exists()
            cluster = cls(nodes=1, name=name, redis=False, serve=False)
            cluster._active = True
            existed = any(ns.startswith(cluster.prefix) for ns in nn.list_netns())
            if corrupt:  # what it lists (base_dir, PIDs) is unknown: keep it for a person
                for ns in sorted(ns for ns in nn.list_netns() if ns.startswith(cluster.prefix)):
                    nn.del_netns(ns)
                raise ClusterError(f"{exc}; its namespaces are removed, but the processes, "
                                   "directories and logs it lists are not: remove them and "
                                   "the file by hand") from None
            cluster.down()
            return existed
        cluster.down()
        return True

    # ------------------------------------------------------------------ running commands
    def _env(self, index: int | str, env: Mapping[str, str] | None) -> dict[str, str]:
        full = dict(self.node(index).env)
        if env:
            full.update(env)
        return full

    def command(self, index: int | str, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` inside node ``index``'s namespace."""
        if isinstance(argv, (str, bytes)) or not argv:
            raise ConfigError("argv", argv, "expected a non-empty list of arguments")
        return nn.exec_argv(self.node(index).netns, self._as_node([os.fspath(a) for a in argv]))

    def _as_node(self, argv: list[str]) -> list[str]:
        """``argv`` as a node runs it: without capabilities for an unprivileged cluster."""
        if not self.unprivileged:
            return argv
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise ClusterError("setpriv is not installed (an unprivileged cluster's nodes run"
                               " their processes through it); apt-get install util-linux")
        return [setpriv, "--bounding-set", "-all", "--inh-caps", "-all", "--no-new-privs",
                "--", *argv]

    def popen(self, index: int | str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` on node ``index`` (inside its namespace, with its environment).

        ``env=`` in ``kwargs`` adds to (overrides in) the node's environment; other keyword
        arguments go to :class:`subprocess.Popen`. The returned process's PID is the command's.
        """
        env = self._env(index, kwargs.pop("env", None))
        return subprocess.Popen(self.command(index, argv), env=env, **kwargs)

    def run(
        self, index: int | str, argv: Sequence[str], **kwargs: Any
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` on node ``index`` to completion (like :func:`subprocess.run`)."""
        env = self._env(index, kwargs.pop("env", None))
        return subprocess.run(self.command(index, argv), env=env, **kwargs)

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """A JSON-ready description: addresses, directories, process liveness."""
        existing = set(nn.list_netns())

        def proc(role: str, netns: str, host: str, port: int) -> dict[str, Any]:
            pid, start = self._pids.get(role, [None, None])
            alive = pid is not None and _alive(pid, start)
            listening = alive and netns in existing and nn.can_connect(netns, host, port, 0.3)
            return {"pid": pid, "alive": alive, "listening": listening}

        info: dict[str, Any] = {
            "name": self.name,
            "status": self.status_text,
            "state_file": str(self.state_path),
            "subnet": self.subnet,
            "unprivileged": self.unprivileged,
            "huge_pages": self.huge_pages,
            "hub": {"netns": self.hub, "ip": self.hub_ip, "exists": self.hub in existing},
            "redis": None,
            "base_dir": str(self.base_dir),
            "shared_dir": str(self.shared_dir),
            "nodes": [],
        }
        if self.redis_url:
            info["redis"] = {"url": self.redis_url,
                             **proc("redis", self.hub, self.hub_ip, REDIS_PORT)}
        for n in self.nodes:
            entry: dict[str, Any] = {
                "index": n.index, "name": n.name, "netns": n.netns, "ip": n.ip,
                "addr": n.addr, "dir": str(n.dir), "netns_exists": n.netns in existing,
                "server": proc(n.name, n.netns, n.ip, SERVER_PORT) if self.serve else None,
            }
            info["nodes"].append(entry)
        return info

    def __repr__(self) -> str:
        return (f"EmulatedCluster(name={self.name!r}, nodes={len(self.nodes)}, "
                f"subnet={self.subnet!r}, redis={self.redis_url!r})")
