"""Protocol-conformance tests of the shim's cluster mode, against a FAKE node server.

These tests check that libinstride_preload.so (and include/instride/stream.hpp) speak the
node server's Unix-socket protocol correctly:

    CONSUME <timeout_ms|-1> <key>\\n   ->  [WAIT <ms>\\n ...] OK <absolute local path>\\n
                                                                 | ERR <errno> <message>\\n
    PUBLISH <key>\\n                   ->  OK <path>\\n               | ERR <errno> <message>\\n
    OVERWRITE <key>\\n                 ->  OK <path>\\n               | ERR <errno> <message>\\n

(``PUBLISH`` registers write-once, ``OVERWRITE`` as a replacing version: INSTRIDE_OVERWRITE=1.)
(``WAIT`` lines: a fetch still going on, past the request's timeout; each re-arms the shim's
deadline for the answer.)

The server here is a stand-in written for these tests (it answers from the local file
system and records requests); it is NOT instride's data server. End-to-end cluster tests
with the real server, Redis and several nodes live elsewhere in the suite.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socketserver
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import Builder, Shim


class FakeNodeServer:
    """Implements the line protocol over a Unix socket; answers from ``root``."""

    def __init__(self, root: Path, sock: Path) -> None:
        self.root = root
        self.sock = sock
        self.requests: list[str] = []
        self.fetched = root / ".instride" / "fetched"
        self.publish_error: int | None = None
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline().decode().rstrip("\n")
                outer.requests.append(line)
                key = line.rpartition(" ")[2]
                # a fetch that goes on past the timeout: a progress line a second for 7 s
                # (slow/), or for 2 s and then silence until the client hangs up (stalled/)
                if key.startswith(("slow/", "stalled/")):
                    for i in range(7 if key.startswith("slow/") else 2):
                        time.sleep(1)
                        self.wfile.write(f"WAIT {1000 * (i + 1)}\n".encode())
                    if key.startswith("stalled/"):
                        self.rfile.read()
                        return
                self.wfile.write((outer.answer(line) + "\n").encode())

        self.server = socketserver.ThreadingUnixStreamServer(str(sock), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def answer(self, line: str) -> str:
        verb, _, rest = line.partition(" ")
        if verb == "CONSUME":
            ms_text, _, key = rest.partition(" ")
            ms = int(ms_text)
            if key.startswith(("remote/", "slow/")):  # pretend to fetch it from its owner node
                dest = self.fetched / key
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(f"fetched {key}\n")
                return f"OK {dest}"
            path = self.root / key
            deadline = None if ms < 0 else time.monotonic() + ms / 1000
            while not path.exists():
                if deadline is not None and time.monotonic() > deadline:
                    return f"ERR {errno.ETIMEDOUT} timed out waiting for {key}"
                time.sleep(0.01)
            return f"OK {path}"
        if verb in ("PUBLISH", "OVERWRITE"):
            if self.publish_error is not None:
                return f"ERR {self.publish_error} refused by the fake server"
            path = self.root / rest
            if not path.is_file():
                return f"ERR {errno.ENOENT} {rest} is not published locally"
            return f"OK {path}"
        return f"ERR {errno.EINVAL} bad request"

    def __enter__(self) -> FakeNodeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="isk", dir="/tmp"))  # short: sun_path is 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def cluster(shim: Shim, sockdir: Path) -> Iterator[tuple[Shim, FakeNodeServer]]:
    sock = sockdir / "node.sock"
    with FakeNodeServer(shim.dir, sock) as server:
        env = shim.with_env(INSTRIDE_REDIS_URL="redis://127.0.0.1:1/0", INSTRIDE_SOCKET=str(sock))
        yield env, server


def test_publish_then_consume(cluster: tuple[Shim, FakeNodeServer]) -> None:
    shim, server = cluster
    key = shim.dir / "run" / "a.bin"
    shim.py(f"open({str(key)!r}, 'wb').write(b'cluster bytes')", check=True)
    assert key.read_bytes() == b"cluster bytes"  # the local atomic publish happened first
    assert server.requests == ["PUBLISH run/a.bin"]
    out = shim.run(["cat", key], check=True)
    assert out.stdout == b"cluster bytes"
    assert server.requests[1:] == ["CONSUME 10000 run/a.bin"]
    assert shim.temps() == []


def test_consumer_before_producer(cluster: tuple[Shim, FakeNodeServer]) -> None:
    shim, server = cluster
    key = shim.dir / "late.bin"
    consumer = shim.popen(["cat", key])
    time.sleep(0.4)
    assert consumer.poll() is None
    shim.py(f"open({str(key)!r}, 'wb').write(b'late' * 1000)", check=True)
    out, err = consumer.communicate(timeout=20)
    assert consumer.returncode == 0, err
    assert out == b"late" * 1000
    assert "PUBLISH late.bin" in server.requests


def test_consume_opens_the_path_the_server_returns(cluster: tuple[Shim, FakeNodeServer]) -> None:
    shim, server = cluster
    out = shim.run(["cat", shim.dir / "remote" / "x.bin"], check=True)
    assert out.stdout == b"fetched remote/x.bin\n"
    assert server.requests == ["CONSUME 10000 remote/x.bin"]


def test_server_timeout_is_etimedout(cluster: tuple[Shim, FakeNodeServer]) -> None:
    shim, server = cluster
    t0 = time.monotonic()
    proc = shim.with_env(INSTRIDE_TIMEOUT="0.5").run(["cat", shim.dir / "never.bin"])
    assert proc.returncode != 0
    assert os.strerror(errno.ETIMEDOUT).encode() in proc.stderr
    assert time.monotonic() - t0 < 4
    assert server.requests == ["CONSUME 500 never.bin"]


def test_progress_lines_rearm_the_wait_for_the_answer(cluster: tuple[Shim, FakeNodeServer]) -> None:
    """A node server fetching a published key for longer than INSTRIDE_TIMEOUT + 5 s sends a
    ``WAIT`` line about every second meanwhile: each re-arms the shim's 5 s for the answer,
    which comes 7 s after the request (INSTRIDE_TIMEOUT=0), and the file is read."""
    shim, server = cluster
    proc = shim.with_env(INSTRIDE_TIMEOUT="0").run(["cat", shim.dir / "slow" / "x.bin"],
                                                   timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == b"fetched slow/x.bin\n"
    assert server.requests == ["CONSUME 0 slow/x.bin"]


def test_progress_that_stops_is_a_timeout(cluster: tuple[Shim, FakeNodeServer]) -> None:
    """Progress lines that stop (a node server hung in the middle of a fetch) end the wait 5 s
    after the last one, with ETIMEDOUT: never a wait for ever."""
    shim, _server = cluster
    start = time.monotonic()
    proc = shim.with_env(INSTRIDE_TIMEOUT="0", INSTRIDE_DEBUG="1").run(
        ["cat", shim.dir / "stalled" / "x.bin"], timeout=30)
    assert proc.returncode != 0
    assert os.strerror(errno.ETIMEDOUT).encode() in proc.stderr, proc.stderr
    assert b"reported progress" in proc.stderr, proc.stderr  # (the wait that ended: said)
    assert 6 < time.monotonic() - start < 20  # (2 s of progress, then 5 s: not for ever)


def test_timeout_zero_sends_zero(cluster: tuple[Shim, FakeNodeServer]) -> None:
    """INSTRIDE_TIMEOUT=0 asks the node server not to wait (``CONSUME 0``), not forever (-1)."""
    shim, server = cluster
    proc = shim.with_env(INSTRIDE_TIMEOUT="0").run(["cat", shim.dir / "never.bin"], timeout=20)
    assert proc.returncode != 0
    assert os.strerror(errno.ETIMEDOUT).encode() in proc.stderr
    assert server.requests == ["CONSUME 0 never.bin"]


def test_no_timeout_sends_minus_one(cluster: tuple[Shim, FakeNodeServer]) -> None:
    shim, server = cluster
    (shim.dir / "here.txt").write_text("here")
    env = {k: v for k, v in shim.env.items() if k != "INSTRIDE_TIMEOUT"}
    out = Shim(shim.dir, shim.outside, env).run(["cat", shim.dir / "here.txt"], check=True)
    assert out.stdout == b"here"
    assert server.requests == ["CONSUME -1 here.txt"]


def test_publish_error_is_reported_by_close(cluster: tuple[Shim, FakeNodeServer]) -> None:
    shim, server = cluster
    server.publish_error = errno.EEXIST
    key = shim.dir / "dup.bin"
    code = (
        "import errno\n"
        f"f = open({str(key)!r}, 'wb'); f.write(b'x')\n"
        "try:\n"
        "    f.close()\n"
        "except OSError as e:\n"
        "    raise SystemExit(0 if e.errno == errno.EEXIST else 1)\n"
        "raise SystemExit(2)\n"
    )
    assert shim.py(code).returncode == 0
    assert server.requests == ["PUBLISH dup.bin"]


@pytest.mark.parametrize("refusal", [errno.EINVAL, errno.ENOENT])
def test_a_key_the_server_refuses_is_not_left_published(cluster: tuple[Shim, FakeNodeServer],
                                                        refusal: int) -> None:
    """A PUBLISH the node server refuses before recording anything (a key its rules refuse,
    ``ERR 22``; a name it does not find, ``ERR 2``): the written file does not stay under the
    key without a record, and a file moved in goes back where it came from."""
    shim, server = cluster
    server.publish_error = refusal
    key = shim.dir / "refused.bin"
    code = (
        f"f = open({str(key)!r}, 'wb'); f.write(b'x')\n"
        "try:\n"
        "    f.close()\n"
        "except OSError as e:\n"
        f"    raise SystemExit(0 if e.errno == {refusal} else 1)\n"
        "raise SystemExit(2)\n"
    )
    assert shim.py(code).returncode == 0
    assert not key.exists() and shim.temps() == []
    src = shim.outside / "mine.bin"
    src.write_bytes(b"my data")
    code = (
        "import os\n"
        "try:\n"
        f"    os.rename({str(src)!r}, {str(key)!r})\n"
        "except OSError as e:\n"
        f"    raise SystemExit(0 if e.errno == {refusal} else 1)\n"
        "raise SystemExit(2)\n"
    )
    assert shim.py(code).returncode == 0
    assert not key.exists() and src.read_bytes() == b"my data"
    assert server.requests == ["PUBLISH refused.bin", "PUBLISH refused.bin"]


def test_a_node_server_that_accepts_no_connection_is_a_timeout(shim: Shim, sockdir: Path) -> None:
    """A node server that is stopped or hung (its socket's backlog full): the connection is
    given up within INSTRIDE_TIMEOUT and its grace (ETIMEDOUT), never waited for forever."""
    import socket

    path = str(sockdir / "hung.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(0)
    queued = []
    try:
        full = False
        for _ in range(4):  # (until the backlog is full: the next connect would block)
            c = socket.socket(socket.AF_UNIX)
            c.setblocking(False)
            try:
                c.connect(path)
            except BlockingIOError:
                c.close()
                full = True
                break
            queued.append(c)
        assert full
        env = shim.with_env(INSTRIDE_REDIS_URL="redis://127.0.0.1:1/0", INSTRIDE_SOCKET=path,
                            INSTRIDE_TIMEOUT="0.5")
        start = time.monotonic()
        proc = env.run(["cat", shim.dir / "k.bin"], timeout=30)
        assert proc.returncode != 0
        assert os.strerror(errno.ETIMEDOUT).encode() in proc.stderr
        assert time.monotonic() - start < 15
    finally:
        for c in queued:
            c.close()
        listener.close()


def test_overwrite_mode_sends_overwrite(cluster: tuple[Shim, FakeNodeServer]) -> None:
    shim, server = cluster
    over = shim.with_env(INSTRIDE_OVERWRITE="1")
    key = shim.dir / "o.bin"
    over.py(f"open({str(key)!r}, 'wb').write(b'one')", check=True)
    over.py(f"open({str(key)!r}, 'wb').write(b'two')", check=True)
    assert key.read_bytes() == b"two"
    shim.py(f"open({str(shim.dir / 'w.bin')!r}, 'wb').write(b'w')", check=True)  # default: write-once
    assert server.requests == ["OVERWRITE o.bin", "OVERWRITE o.bin", "PUBLISH w.bin"]


def test_server_unreachable(shim: Shim, sockdir: Path) -> None:
    env = shim.with_env(INSTRIDE_REDIS_URL="redis://127.0.0.1:1/0",
                        INSTRIDE_SOCKET=str(sockdir / "nobody.sock"))
    code = (
        "import errno\n"
        "try:\n"
        f"    open({str(shim.dir / 'a.bin')!r}, 'rb')\n"
        "except OSError as e:\n"
        "    raise SystemExit(0 if e.errno == errno.ECONNREFUSED else 1)\n"
        "raise SystemExit(2)\n"
    )
    assert env.py(code).returncode == 0
    code = (
        "import errno\n"
        f"f = open({str(shim.dir / 'b.bin')!r}, 'wb'); f.write(b'x')\n"
        "try:\n"
        "    f.close()\n"
        "except OSError as e:\n"
        "    raise SystemExit(0 if e.errno == errno.ECONNREFUSED else 1)\n"
        "raise SystemExit(2)\n"
    )
    assert env.py(code).returncode == 0
    # documented: the local publish stands, only the metadata registration failed
    assert (shim.dir / "b.bin").read_bytes() == b"x"


def test_default_socket_is_under_managed_dir(shim: Shim, lib: Path) -> None:
    """Without INSTRIDE_SOCKET the shim uses $INSTRIDE_DIR/.instride/node.sock."""
    short = Path(tempfile.mkdtemp(prefix="ism", dir="/tmp"))
    try:
        (short / ".instride").mkdir()
        with FakeNodeServer(short, short / ".instride" / "node.sock") as server:
            env = {k: v for k, v in shim.env.items() if k != "INSTRIDE_SOCKET"}
            env.update(INSTRIDE_DIR=str(short), INSTRIDE_REDIS_URL="redis://127.0.0.1:1/0")
            s = Shim(short, shim.outside, env)
            s.py(f"open({str(short / 'k.txt')!r}, 'w').write('k')", check=True)
            assert s.run(["cat", short / "k.txt"], check=True).stdout == b"k"
            assert server.requests == ["PUBLISH k.txt", "CONSUME 10000 k.txt"]
    finally:
        shutil.rmtree(short)


def test_stream_hpp_cluster_mode(cluster: tuple[Shim, FakeNodeServer], build: Builder) -> None:
    """The C++ header (no shim loaded) speaks the same protocol."""
    shim, server = cluster
    exe = build("streams.cpp")
    env = {k: v for k, v in shim.env.items() if k != "LD_PRELOAD"}
    key = shim.dir / "cpp" / "a.txt"
    subprocess.run([exe, "produce", key, "3"], env=env, check=True, timeout=30)
    assert key.read_text() == "line 0\nline 1\nline 2\n"
    out = subprocess.run([exe, "consume", shim.dir / "remote" / "y"], env=env, check=True,
                         capture_output=True, timeout=30)
    assert out.stdout == b"fetched remote/y\n"
    assert server.requests == ["PUBLISH cpp/a.txt", "CONSUME 10000 remote/y"]


def test_symlinked_key_refused_before_asking_the_server(
    cluster: tuple[Shim, FakeNodeServer],
) -> None:
    """Confinement holds in cluster mode too: no request leaves for a path through a link."""
    shim, server = cluster
    elsewhere = shim.outside / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "y").write_text("outside\n")
    (shim.dir / "s").mkdir()
    (shim.dir / "s" / "link").symlink_to(elsewhere)
    src = shim.outside / "x.bin"
    src.write_bytes(b"x")
    for args in (["cat", shim.dir / "s" / "link" / "y"], ["cp", src, shim.dir / "s" / "link" / "z"]):
        proc = shim.run(args)
        assert proc.returncode != 0 and os.strerror(errno.ELOOP).encode() in proc.stderr, args
    assert server.requests == []
    assert sorted(p.name for p in elsewhere.iterdir()) == ["y"]


def test_directory_opens_without_a_request(cluster: tuple[Shim, FakeNodeServer]) -> None:
    """A read open of a directory (e.g. to fsync it) goes to libc in cluster mode too."""
    shim, server = cluster
    (shim.dir / "run").mkdir()
    code = (
        "import os\n"
        f"fd = os.open({str(shim.dir / 'run')!r}, os.O_RDONLY)\n"
        "os.fsync(fd)\nos.close(fd)\n"
    )
    shim.py(code, check=True)
    assert server.requests == []


def test_a_hung_node_server_does_not_hold_a_close_for_ever(shim: Shim, sockdir: Path) -> None:
    """A node server that accepts the publication and never answers, INSTRIDE_TIMEOUT unset
    (no limit on reads): the close of the written key still ends, with ETIMEDOUT, after 12
    times INSTRIDE_CONNECT_TIMEOUT (it waited for ever)."""
    import socket

    path = str(sockdir / "mute.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(8)
    taken: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                taken.append(listener.accept()[0])  # (read nothing, answer nothing)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        env = shim.with_env(INSTRIDE_REDIS_URL="redis://127.0.0.1:1/0", INSTRIDE_SOCKET=path,
                            INSTRIDE_CONNECT_TIMEOUT="0.25")
        env.env.pop("INSTRIDE_TIMEOUT", None)
        code = (
            "import errno\n"
            f"f = open({str(shim.dir / 'mute.bin')!r}, 'wb'); f.write(b'x')\n"
            "try:\n"
            "    f.close()\n"
            "except OSError as e:\n"
            "    raise SystemExit(0 if e.errno == errno.ETIMEDOUT else 1)\n"
            "raise SystemExit(2)\n"
        )
        start = time.monotonic()
        assert env.py(code, timeout=60).returncode == 0
        assert 2.5 < time.monotonic() - start < 30  # (12 x 0.25 s, not for ever)
        # a value Python refuses is refused here too: every publication fails with EINVAL
        bad = shim.with_env(INSTRIDE_CONNECT_TIMEOUT="0")
        code = (
            "import errno\n"
            "try:\n"
            f"    open({str(shim.dir / 'bad.bin')!r}, 'wb').close()\n"
            "except OSError as e:\n"
            "    raise SystemExit(0 if e.errno == errno.EINVAL else 1)\n"
            "raise SystemExit(2)\n"
        )
        assert bad.py(code).returncode == 0
    finally:
        listener.close()
        for c in taken:
            c.close()


@pytest.mark.parametrize("raw", ["inf", "forever", "2e9"])
def test_explicit_forever_is_sent_as_the_servers_longest_timeout(
        cluster: tuple[Shim, FakeNodeServer], raw: str) -> None:
    """INSTRIDE_TIMEOUT=inf waits forever whatever the node server's own INSTRIDE_TIMEOUT: it is
    sent as the longest timeout the server accepts (agent.MAX_TIMEOUT_MS), not as -1 ("unset:
    the server's")."""
    from instride.agent import MAX_TIMEOUT_MS

    shim, server = cluster
    (shim.dir / "here.txt").write_text("here")
    out = shim.with_env(INSTRIDE_TIMEOUT=raw).run(["cat", shim.dir / "here.txt"], check=True)
    assert out.stdout == b"here"
    assert server.requests == [f"CONSUME {MAX_TIMEOUT_MS} here.txt"]


def test_empty_timeout_is_unset(cluster: tuple[Shim, FakeNodeServer]) -> None:
    shim, server = cluster
    (shim.dir / "here.txt").write_text("here")
    out = shim.with_env(INSTRIDE_TIMEOUT=" ").run(["cat", shim.dir / "here.txt"], check=True)
    assert out.stdout == b"here"
    assert server.requests == ["CONSUME -1 here.txt"]
