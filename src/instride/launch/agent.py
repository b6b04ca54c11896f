"""The node agent: one per node of a job, started by ``instride job`` through the launcher.

``python -m instride.launch.agent`` (with the job's variables: ``INSTRIDE_JOB_ID``,
``INSTRIDE_JOB_DIR``, ``INSTRIDE_JOB_PORT``, ``INSTRIDE_REDIS_URL``, ``INSTRIDE_TOKEN``)

1. refuses to start when this node still runs an earlier job's service (its record in the
   node's state directory names a live process) and removes what a *dead* earlier service
   left behind (its managed directory and record);
2. creates the node's managed directory (``INSTRIDE_JOB_DIR`` with ``%n``/``%j`` replaced;
   an existing directory is refused, never reused or removed);
3. runs ``instride serve`` on this node's address (``INSTRIDE_JOB_IFACE``'s, else the one on
   the route to Redis) and waits until it listens;
4. writes ``<dir>/.instride/node.env`` (read by the task prolog / wrapper script) and
   registers ``node -> host:port`` in Redis;
5. on SIGTERM/SIGINT/SIGHUP, or when the server ends, stops the server and removes the managed
   directory and the record.

A failure before the service is up is reported in Redis (so the launcher can name the node)
and on stderr, and leaves nothing behind. Exit status: 0 after a normal stop, 3 when the service
could not start, 4 when the server died on its own.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..config import DEFAULT_PORT
from .base import (
    ERRORS,
    REGISTRY,
    LaunchError,
    ServerStartError,
    StaleServiceError,
    expand_dir,
    iface_address,
    node_name,
    redis_client,
    route_address,
)

#: Seconds the data server has to listen after it was started.
SERVER_READY_TIMEOUT = 30.0
#: Longest path of a Unix socket (sun_path holds 108 bytes with its terminating NUL).
MAX_SOCKET_PATH = 107


def state_dir(env: dict[str, str] | None = None) -> Path:
    """The node-local directory of service records (``INSTRIDE_JOB_STATE_DIR``)."""
    env = dict(os.environ) if env is None else env
    return Path(env.get("INSTRIDE_JOB_STATE_DIR") or f"/tmp/instride-{os.getuid()}-services")


def check_state_dir(states: Path, *, create: bool) -> int | None:
    """Check the node's directory of service records; return the uid of its owner.

    Its records name processes that ``instride job`` (and ``--cleanup``) signal, so it must be
    a real directory (not a symbolic link) with no permission for group or others, owned by
    this user. Root may read (``create=False``: ``--cleanup`` in a Slurm ``Epilog``) another
    user's: records are then trusted only where the file, the processes and the directories
    they name belong to the directory's owner.

    Parameters
    ----------
    states
        The directory (:func:`state_dir`).
    create
        Create it (mode 0700) if missing; else a missing directory gives ``None``.

    Returns
    -------
    int or None
        The owner's uid; ``None`` when it does not exist and ``create`` is false.

    Raises
    ------
    LaunchError
        It cannot be created, is not a directory, belongs to another user, or is open to
        other users; the message names it.
    """
    if create:
        try:
            states.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise LaunchError(f"cannot create the state directory {states}: {exc.strerror}; "
                              "choose another (--state-dir, INSTRIDE_JOB_STATE_DIR)") from None
    try:
        st = os.lstat(states)
    except FileNotFoundError:
        if create:
            raise LaunchError(f"the state directory {states} vanished") from None
        return None
    except OSError as exc:
        raise LaunchError(f"cannot read the state directory {states}: {exc.strerror}") from None
    hint = "remove it, or choose another (--state-dir, INSTRIDE_JOB_STATE_DIR)"
    if not stat.S_ISDIR(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise LaunchError(f"the state directory {states} is {kind}; {hint}")
    euid = os.geteuid()
    if st.st_uid != euid and (create or euid != 0):
        raise LaunchError(f"the state directory {states} belongs to uid {st.st_uid}, not to "
                          f"this user (uid {euid}); {hint}")
    if st.st_mode & 0o077:
        raise LaunchError(f"the state directory {states} is open to other users (mode "
                          f"{stat.S_IMODE(st.st_mode):o}); `chmod 700` it, or {hint}")
    return st.st_uid


def _start_time(pid: int) -> int | None:
    """Start time of a live, non-zombie process (clock ticks since boot), else None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _alive(pid: object, start: object) -> bool:
    return (type(pid) is int and pid > 0 and type(start) is int
            and _start_time(pid) == start)


def _owner(path: str | os.PathLike[str]) -> int | None:
    """The uid that owns ``path`` (not followed if a link), or None."""
    try:
        return os.lstat(path).st_uid
    except OSError:
        return None


def read_record(node: str, states: Path, owner: int | None = None) -> dict[str, Any] | None:
    """The record of ``node``'s service in ``states``, or None.

    Raises
    ------
    LaunchError
        When ``owner`` is given and the record's file belongs to another uid.
    """
    path = states / f"{node}.json"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError:
        return {}  # unreadable (a link...): treated as the leftover of a dead service
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if owner is not None and st.st_uid != owner:
            raise LaunchError(f"the service record {path} belongs to uid {st.st_uid}, not to "
                              f"the owner of {states} (uid {owner}): refused; remove it")
        if not stat.S_ISREG(st.st_mode):
            return {}
        try:
            record = json.loads(fh.read())
        except (OSError, ValueError):
            return {}
    return record if isinstance(record, dict) else {}


def _server_ready_timeout() -> float:
    """Seconds the data server has to listen: the job's ``--ready-timeout``
    (``INSTRIDE_JOB_READY_TIMEOUT``, set by ``instride job``), else
    :data:`SERVER_READY_TIMEOUT`."""
    try:
        value = float(os.environ.get("INSTRIDE_JOB_READY_TIMEOUT", SERVER_READY_TIMEOUT))
    except ValueError:
        return SERVER_READY_TIMEOUT
    return value if math.isfinite(value) and value > 0 else SERVER_READY_TIMEOUT


def _remove_empty_parents(path: Path, top: Path, owner: int | None = None) -> None:
    """Remove the parents of ``path`` up to ``top`` (included) while they are empty (and, with
    ``owner``, belong to that uid)."""
    if path != top and top not in path.parents:
        return
    for parent in [p for p in path.parents if p == top or top in p.parents]:
        if owner is not None and _owner(parent) != owner:
            return
        try:
            parent.rmdir()
        except OSError:
            return


def _forget_record(states: Path, node: str, owner: int) -> None:
    """Remove ``node``'s record beneath the state directory's descriptor, and only from a
    directory of ``owner`` (where the owner could remove it too). Root's removal by path
    after the checks (``--cleanup`` in an ``Epilog``) could be led elsewhere by a link the
    user put in the directory's place meanwhile (their directory renamed, a link to another
    in its place): a file of that name in someone else's directory removed."""
    try:
        fd = os.open(states, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # (gone, or a link now: no directory of the owner's there to clean)
        return
    try:
        if os.fstat(fd).st_uid == owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{node}.json", dir_fd=fd)
    finally:
        os.close(fd)


def _remove_leftovers(record: dict[str, Any], owner: int) -> None:
    raw = record.get("dir")
    if not (raw and isinstance(raw, str)):
        return
    top = record.get("top") if isinstance(record.get("top"), str) else None
    if os.geteuid() == 0 and owner != 0:
        # Root removing a user's directory does it with that user's rights only: the path
        # comes from the user's record, and a component the user swaps for a link between
        # the checks and the removal must not lead root's rmtree into someone else's files.
        if not _as_user(owner, lambda: _remove_managed(Path(raw), top, owner)):
            print(f"instride job --cleanup: removing {raw} as uid {owner} failed",
                  file=sys.stderr, flush=True)
    else:
        _remove_managed(Path(raw), top, owner)


def _remove_managed(path: Path, top: str | None, owner: int) -> None:
    # Only what looks like an instride managed directory of the records' owner is removed.
    if (not path.is_symlink() and path.is_dir() and _owner(path) == owner
            and (path / ".instride").is_dir()):
        shutil.rmtree(path, ignore_errors=True)
        if top:
            _remove_empty_parents(path, Path(top), owner)


def _as_user(uid: int, fn: Callable[[], None]) -> bool:
    """Run ``fn`` in a child process that has only ``uid``'s rights (its primary group, no
    supplementary groups); wait for it; return whether it succeeded."""
    try:
        gid = pwd.getpwuid(uid).pw_gid
    except KeyError:  # (no passwd entry, e.g. its directory service down: the nobody group,
        gid = 65534  # never another user's)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child (its effect is tested)
        code = 1
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            fn()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def cleanup_node(node: str | None = None, states: Path | None = None,
                 grace: float = 5.0, job: str | None = None) -> dict[str, Any] | None:
    """Stop the service recorded for ``node`` (by PID) and remove what it left; return its record.

    What ``instride job --cleanup`` runs (e.g. in a Slurm ``Epilog``, as root). Processes are
    signalled only when their PID still has the recorded start time and belongs to the owner
    of the state directory (see :func:`check_state_dir`).

    Parameters
    ----------
    node
        The node (default: :func:`~instride.launch.base.node_name`).
    states
        The state directory (default: :func:`state_dir`).
    grace
        Seconds between SIGTERM and SIGKILL.
    job
        Only a service of this job (else ``None`` is returned and nothing is done).

    Returns
    -------
    dict or None
        The record, or ``None`` when none (of ``job``) is recorded.

    Raises
    ------
    LaunchError
        The state directory or the record is not trusted (:func:`check_state_dir`).
    """
    node = node or node_name()
    states = states or state_dir()
    owner = check_state_dir(states, create=False)
    if owner is None:
        return None
    record = read_record(node, states, owner)
    if record is None or (job is not None and str(record.get("job")) != job):
        return None
    procs = [(pid, start) for pid, start in (
        (record.get("server_pid"), record.get("server_start")),
        (record.get("pid"), record.get("start")))
        if _alive(pid, start) and _owner(f"/proc/{pid}") == owner]
    for pid, start in procs:
        if _alive(pid, start):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for pid, start in procs:
        while _alive(pid, start) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid, start):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    _remove_leftovers(record, owner)
    _forget_record(states, node, owner)
    return record


def check_stale(node: str, job: str, states: Path) -> str | None:
    """Refuse a live earlier service; remove a dead one's leftovers (return a note if so).

    Raises
    ------
    StaleServiceError
        When the recorded agent or server of this node still runs.
    LaunchError
        The state directory or the record is not this user's (:func:`check_state_dir`).
    """
    owner = check_state_dir(states, create=True)
    assert owner is not None
    record = read_record(node, states, owner)
    if record is None:
        return None
    for pid, start in ((record.get("pid"), record.get("start")),
                       (record.get("server_pid"), record.get("server_start"))):
        if _alive(pid, start):
            raise StaleServiceError(node, str(record.get("job", "?")), int(pid))
    _remove_leftovers(record, owner)
    _forget_record(states, node, owner)
    return (f"removed the leftovers of job {record.get('job', '?')} on {node} "
            f"({record.get('dir', 'no directory')})")


def _listening(host: str, port: int, sock_path: Path) -> bool:
    """Whether a data server answers on both its faces: TCP and its Unix socket (PING)."""
    try:
        with socket.create_connection((host, port), 0.5):
            pass
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(str(sock_path))
            s.sendall(b"PING\n")
            return s.recv(64).startswith(b"OK")
    except OSError:
        return False


class Agent:
    """The service of one node (see the module docstring)."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = dict(os.environ) if env is None else env
        try:
            self.job = self.env["INSTRIDE_JOB_ID"]
            self.pattern = self.env["INSTRIDE_JOB_DIR"]
            self.redis_url = self.env["INSTRIDE_REDIS_URL"]
            self.token = self.env["INSTRIDE_TOKEN"]
        except KeyError as exc:
            raise LaunchError(f"the node agent needs {exc.args[0]} (start it with `instride job`)"
                              ) from None
        self.port = int(self.env.get("INSTRIDE_JOB_PORT") or DEFAULT_PORT)
        self.iface = self.env.get("INSTRIDE_JOB_IFACE") or None
        self.node = node_name(self.env)
        self.states = state_dir(self.env)
        self.dir = expand_dir(self.pattern, self.node, self.job)
        self.server: subprocess.Popen[bytes] | None = None
        self.created_dir = False
        self.created_top = self.dir
        self.wrote_record = False
        self.stop_signal: int | None = None
        self.server_log: collections.deque[str] = collections.deque(maxlen=8)

    # ------------------------------------------------------------------ start
    def address(self) -> str:
        if self.iface:
            return iface_address(self.iface)
        parts = urlsplit(self.redis_url)
        return route_address(parts.hostname or "127.0.0.1", parts.port or 6379)

    def start(self) -> str:
        """Bring the service up; return this node's ``host:port``."""
        note = check_stale(self.node, self.job, self.states)
        if note:
            print(f"instride agent: {note}", file=sys.stderr, flush=True)
        host = self.address()
        addr = f"{host}:{self.port}"
        sock_path = self.dir / ".instride" / "node.sock"
        if len(os.fsencode(sock_path)) > MAX_SOCKET_PATH:
            raise ServerStartError(
                self.node, f"its managed directory {self.dir} is too long for the data server's"
                f" Unix socket ({len(os.fsencode(sock_path))} > {MAX_SOCKET_PATH} bytes for "
                f"{sock_path}); choose a shorter --dir")
        top = self.dir
        while not top.parent.exists() and top.parent != top:
            top = top.parent
        try:
            self.dir.mkdir(parents=True)
            self.created_top = top
            # the user's alone (the umask's 0755 let others list its keys, and read the files
            # unmodified programs write there through the preload library)
            self.dir.chmod(0o700)
        except FileExistsError:
            raise ServerStartError(self.node, f"its managed directory {self.dir} exists already"
                                   " (choose a fresh --dir; it must contain %j)") from None
        except OSError as exc:
            raise ServerStartError(
                self.node, f"cannot create its managed directory {self.dir}: {exc.strerror}"
            ) from None
        self.created_dir = True
        self._write_record()
        env = {k: v for k, v in self.env.items() if not k.startswith("INSTRIDE_JOB_")}
        env.update(INSTRIDE_DIR=str(self.dir), INSTRIDE_ADDR=addr, INSTRIDE_NODE=self.node,
                   INSTRIDE_TOKEN=self.token, INSTRIDE_REDIS_URL=self.redis_url)
        env.pop("INSTRIDE_SOCKET", None)
        self.server = subprocess.Popen(
            [sys.executable, "-m", "instride", "serve", "--grace", "2", "--log-level", "warning"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        threading.Thread(target=self._relay, args=(self.server.stderr,), daemon=True).start()
        self._write_record()
        ready = _server_ready_timeout()
        deadline = time.monotonic() + ready
        while True:
            if self.server.poll() is not None:
                time.sleep(0.2)  # let the relay read the server's last words
                last = " | ".join(line for line in self.server_log if line.strip())[-600:]
                raise ServerStartError(self.node, f"`instride serve` on {addr} exited with "
                                       f"status {self.server.returncode}: {last or 'no output'}")
            if _listening(host, self.port, sock_path):
                break
            if time.monotonic() > deadline:
                raise ServerStartError(self.node, f"`instride serve` did not listen on {addr} "
                                       f"within {ready:g} s")
            time.sleep(0.05)
        internal = self.dir / ".instride"
        internal.mkdir(mode=0o700, exist_ok=True)
        # The host line lets the script find this file without trusting SLURMD_NODENAME.
        lines = [f"# host {os.uname().nodename}", f"export INSTRIDE_DIR={self.dir}",
                 f"export INSTRIDE_ADDR={addr}", f"export INSTRIDE_NODE={self.node}"]
        tmp = internal / ".node.env.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, internal / "node.env")
        return addr

    def _relay(self, stream: Any) -> None:
        """Copy the server's stderr to ours, keeping its last lines for error messages."""
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            self.server_log.append(line)
            print(f"[{self.node}] {line}", file=sys.stderr, flush=True)
        stream.close()

    def _write_record(self) -> None:
        self.states.mkdir(parents=True, exist_ok=True, mode=0o700)
        server_pid = self.server.pid if self.server is not None else None
        record = {
            "job": self.job, "node": self.node, "dir": str(self.dir),
            "top": str(self.created_top),
            "pid": os.getpid(), "start": _start_time(os.getpid()),
            "server_pid": server_pid,
            "server_start": _start_time(server_pid) if server_pid else None,
        }
        path = self.states / f"{self.node}.json"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
        self.wrote_record = True

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        """Stop the server (if any), remove the managed directory and the record."""
        if self.server is not None and self.server.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.server.send_signal(signal.SIGTERM)
            try:
                self.server.wait(8)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait(5)
        if self.created_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            _remove_empty_parents(self.dir, self.created_top)
            self.created_dir = False
        if self.wrote_record:
            with contextlib.suppress(FileNotFoundError):
                (self.states / f"{self.node}.json").unlink()
            self.wrote_record = False

    def run(self) -> int:
        """Start, serve until told to stop, clean up; return the exit status."""
        def on_signal(signum: int, _frame: object) -> None:
            self.stop_signal = signum
            if self.server is not None and self.server.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.server.send_signal(signal.SIGTERM)

        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, on_signal)
        client = redis_client(self.redis_url, timeout=2.0)
        try:
            try:
                addr = self.start()
                if self.stop_signal is not None:
                    return 0
                client.hset(REGISTRY.format(job=self.job), self.node, addr)
            except Exception as exc:  # noqa: BLE001 - reported to the launcher, then re-raised
                if isinstance(exc, StaleServiceError):
                    message = f"stale|{exc.job}|{exc.pid}"
                else:
                    message = "error|" + (exc.detail if isinstance(exc, ServerStartError)
                                          else f"{type(exc).__name__}: {exc}")
                with contextlib.suppress(Exception):
                    client.hset(ERRORS.format(job=self.job), self.node, message)
                print(f"instride agent on {self.node}: {exc}", file=sys.stderr, flush=True)
                return 3
            assert self.server is not None
            # Waited in steps: the kernel may hand a SIGTERM to the relay thread, and the
            # handler (which forwards it to the server) runs only when the main thread is back
            # in Python — a plain wait() would hold it until the server ended on its own.
            while True:
                try:
                    rc = self.server.wait(timeout=0.25)
                    break
                except subprocess.TimeoutExpired:
                    continue
            self.stop()  # before anything else: Redis may be gone already
            if self.stop_signal is None:
                message = f"the data server ended on its own (status {rc})"
                with contextlib.suppress(Exception):  # the launcher names the node from it
                    client.hdel(REGISTRY.format(job=self.job), self.node)
                    client.hset(ERRORS.format(job=self.job), self.node, f"error|{message}")
                print(f"instride agent on {self.node}: {message}", file=sys.stderr, flush=True)
                return 4
            with contextlib.suppress(Exception):
                client.hdel(REGISTRY.format(job=self.job), self.node)
            return 0
        finally:
            for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(s, signal.SIG_IGN)
            self.stop()
            client.close()


def main() -> int:
    """Entry point of ``python -m instride.launch.agent``."""
    try:
        agent = Agent()
    except LaunchError as exc:
        print(f"instride agent: {exc}", file=sys.stderr)
        return 3
    return agent.run()


if __name__ == "__main__":
    raise SystemExit(main())
