"""Shared fixtures: a fresh managed directory, a real Redis server, child-process helpers.

Every fixture that starts something stops it in its finalizer, also when the test fails.
Processes are stopped by their own PID.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from instride.client import Client
from instride.config import Settings


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def ucx_segments_dir() -> Iterator[Path]:
    """The directory where UCX makes its shared-memory segment files (``UCX_POSIX_DIR``)
    in every process the tests start: this session's own, removed at its end. UCX unlinks a
    segment file right after creating it; a process killed in between leaves it behind, in
    ``/dev/shm`` by default."""
    parent = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="instride-tests-ucx-", dir=parent))
    old = os.environ.get("UCX_POSIX_DIR")
    os.environ["UCX_POSIX_DIR"] = str(path)
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("UCX_POSIX_DIR", None)
        else:
            os.environ["UCX_POSIX_DIR"] = old
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def managed_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh managed directory, exported as INSTRIDE_DIR (local mode)."""
    root = tmp_path / "managed"
    root.mkdir()
    monkeypatch.setenv("INSTRIDE_DIR", str(root))
    for var in ("INSTRIDE_REDIS_URL", "INSTRIDE_TOKEN", "INSTRIDE_TIMEOUT", "INSTRIDE_CACHE_BYTES",
                "INSTRIDE_ADDR", "INSTRIDE_SOCKET", "INSTRIDE_NODE", "INSTRIDE_PATCH_OPEN"):
        monkeypatch.delenv(var, raising=False)
    return root


@pytest.fixture
def shm() -> Iterator[Path]:
    """A fresh directory on /dev/shm (tmpfs): another file system than ``tmp_path``'s."""
    d = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d)


@pytest.fixture
def client(managed_dir: Path) -> Iterator[Client]:
    """A local-mode client on ``managed_dir``."""
    c = Client(Settings.from_env())
    yield c
    c.close()


def files_held(under: Path, *, maps: bool = True) -> list[str]:
    """The files beneath ``under`` this process holds: by its descriptors and (``maps``) its
    mappings (as ``/proc`` names them: a deleted file ends with `` (deleted)``)."""
    root = f"{os.path.realpath(under)}/"
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # (closed meanwhile)
            continue
    if maps:
        held += [line.split(None, 5)[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                 if len(line.split(None, 5)) == 6]
    return [h for h in held if h.startswith(root)]


def child_env(**extra: str) -> dict[str, str]:
    """The current environment plus ``extra``, for child processes."""
    env = dict(os.environ)
    env.update(extra)
    return env


def spawn_py(code: str, env: dict[str, str] | None = None, **kw: object) -> subprocess.Popen:
    """Start ``python -c code`` with the test's interpreter."""
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env or dict(os.environ),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw,  # type: ignore[arg-type]
    )


def build_shim(src: Path, out_dir: Path, *libs: str) -> Path:
    """Compile the test's C file ``src`` (an ``LD_PRELOAD`` library standing in for some
    behaviour of the system) into ``out_dir``; return the shared library's path."""
    gcc = shutil.which("gcc")
    assert gcc is not None, "gcc is required (apt-get install build-essential)"
    out = out_dir / (src.stem + ".so")
    subprocess.run([gcc, "-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-shared", "-fPIC",
                    "-o", str(out), str(src), *libs], check=True, capture_output=True, text=True)
    return out


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """``SIGSTOP`` process ``pid`` and return once every thread of it has stopped.

    ``kill`` returns when the signal is queued: a thread running on another core may go on
    for a moment (a reply sent, a frame read) before it stops; a test that acts on a stopped
    process waits for it here (``/proc/<pid>/task/*/stat``, state ``T``).
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as fh:
                    states.append(fh.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                continue  # (a thread that ended meanwhile)
        if states and all(st in ("T", "t") for st in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not stop within {timeout} s: {states}")
        time.sleep(0.001)


def wait_ready(proc: subprocess.Popen, timeout: float = 30.0) -> bool:
    """Whether ``proc`` printed its "ready" line within ``timeout`` seconds (never hangs)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    out = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in out:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return False
            chunk = os.read(fd, 4096)
            if not chunk:  # the child exited
                return False
            out += chunk
    return b"ready" in out


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    """Wait for ``proc`` (killing it by PID on timeout) and return (rc, stdout, stderr)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"process {proc.pid} timed out; stderr: {err!r}") from None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def _redis_binary() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError(
            "redis-server is not installed; `make test` installs it (apt-get install redis-server)"
        )
    return exe


class RedisServer:
    """A throw-away redis-server on 127.0.0.1 (or a given host) and a free port."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, *extra: str) -> RedisServer:
        """Start it (``extra``: more ``redis-server`` options, e.g. ``--dir`` for a server whose
        saved data a restart loads); it answers connections when this returns."""
        self.proc = subprocess.Popen(
            [_redis_binary(), "--port", str(self.port), "--bind", self.host, "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)  # (one with data to save takes a moment)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A running redis-server, stopped at the end of the test."""
    server = RedisServer().start()
    yield server
    server.stop()


class LoopbackNode:
    """One emulated node on loopback: a managed directory and an ``instride serve`` process.

    (Cheap stand-in for tests of the server itself; cross-node behaviour is also tested
    between network namespaces in tests/cluster.)
    """

    def __init__(self, root: Path, index: int, redis_url: str, token: str) -> None:
        self.index = index
        self.port = free_port()
        self.dir = root / f"node{index}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = root / f"node{index}.log"
        self.env = child_env(
            INSTRIDE_DIR=str(self.dir), INSTRIDE_REDIS_URL=redis_url, INSTRIDE_TOKEN=token,
            INSTRIDE_ADDR=f"127.0.0.1:{self.port}", INSTRIDE_NODE=f"node{index}",
            INSTRIDE_CONNECT_TIMEOUT="2",
        )
        self.proc: subprocess.Popen | None = None
        #: whether it ever started (a restart keeps its address: records name it)
        self.started = False

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def settings(self) -> Settings:
        return Settings.from_env(self.env)

    def client(self) -> Client:
        return Client(self.settings())

    def start(self, *args: str, timeout: float = 30.0) -> LoopbackNode:
        """Start ``instride serve [args]``; raise (never hang) if it is not ready in ``timeout`` s.

        A first start whose port another process took since :func:`free_port` found it free
        (an outgoing connection's ephemeral port) starts again on another port."""
        for _ in range(3):
            logged = self.log.stat().st_size if self.log.exists() else 0
            try:
                return self._start(args, timeout)
            except RuntimeError:
                with open(self.log, "rb") as fh:
                    fh.seek(logged)
                    taken = b"Address already in use" in fh.read()
                if not taken or self.started:
                    raise
                self.port = free_port()
                self.env["INSTRIDE_ADDR"] = self.addr
        return self._start(args, timeout)

    def _start(self, args: tuple[str, ...], timeout: float) -> LoopbackNode:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "instride", "serve", *args],
                                         env=self.env, stdout=subprocess.PIPE, stderr=log)
        if not wait_ready(self.proc, timeout):
            self.stop(9)
            raise RuntimeError(f"server node{self.index} did not start within {timeout} s: "
                               f"{self.log.read_text()}")
        self.started = True
        return self

    def stop(self, sig: int = 15) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None


@contextlib.contextmanager
def running_nodes(root: Path, redis_url: str, token: str, ids: Iterable[int] = (1, 2, 3), *,
                  sig: int = signal.SIGTERM) -> Iterator[list[LoopbackNode]]:
    """Loopback nodes ``ids`` under ``root`` sharing the Redis at ``redis_url``, their data
    servers running; all stopped after (with ``sig``), also when one failed to start."""
    made = [LoopbackNode(root, i, redis_url, token) for i in ids]
    try:
        for n in made:
            n.start()
        yield made
    finally:
        for n in made:
            n.stop(sig)


@pytest.fixture
def loopback_nodes(tmp_path: Path, redis_server: RedisServer) -> Iterator[list[LoopbackNode]]:
    """Three nodes on loopback sharing one Redis, with their data servers running."""
    with running_nodes(tmp_path, redis_server.url, "test-token") as made:
        yield made
