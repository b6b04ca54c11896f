"""The data server: authentication, key validation, malformed input, resource bounds, waits,
SIGTERM, the Unix-socket protocol, write-once across nodes, symlinks and special files.

Most tests share three module-scoped nodes (real ``instride serve`` processes on loopback and
one Redis); tests that stop a server or need other options start their own.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from instride.errors import AuthenticationError, TransferError
from instride.metadata.base import Record
from instride.agent import one_line
from instride.transport import wire
from instride.transport.tcp import TcpTransport
from tests.conftest import LoopbackNode, RedisServer

TOKEN = "test-token"


# ---------------------------------------------------------------------- helpers
def _raw(node: LoopbackNode, payload: bytes, *, shut: bool = False) -> dict:
    with socket.create_connection(("127.0.0.1", node.port), timeout=5) as s:
        s.sendall(payload)
        if shut:
            s.shutdown(socket.SHUT_WR)
        head = _recv_all(s, 4)
        assert len(head) == 4, "server must reply with an error header"
        (n,) = struct.unpack(">I", head)
        body = _recv_all(s, n)
        assert len(body) == n
        return json.loads(body)


def _recv_all(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _signed(key: str, op: str = "fetch", token: str = TOKEN) -> bytes:
    return wire.pack(wire.sign(token, op, key))


def _forged(**fields: object) -> bytes:
    """A signed request with some fields replaced (its MAC no longer matches, or is malformed)."""
    header = wire.sign(TOKEN, "fetch", "any/key")
    header.update(fields)
    return wire.pack(header)


def _put(node: LoopbackNode, key: str, data: bytes) -> Record:
    c = node.client()
    try:
        with c.open(key, "wb") as fh:
            fh.write(data)
        rec = c.lookup(key)
    finally:
        c.close()
    assert rec is not None
    return rec


def _unix(node: LoopbackNode) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(str(node.dir / ".instride" / "node.sock"))
    return s


def _ask(node: LoopbackNode, line: str, timeout: float = 10) -> str:
    with _unix(node) as s:
        s.settimeout(timeout)
        s.sendall(line.encode() + b"\n")
        return s.makefile().readline().rstrip("\n")


def _stats(node: LoopbackNode) -> dict:
    reply = _ask(node, "STATS")
    assert reply.startswith("OK "), reply
    return json.loads(reply[3:])


def _until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def _no_traceback(node: LoopbackNode) -> None:
    text = node.log.read_text()
    assert "Traceback" not in text, text[-3000:]


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def redis_mod() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory, redis_mod: RedisServer) -> Iterator[list[LoopbackNode]]:
    """Three running nodes shared by the tests that do not stop them."""
    root = tmp_path_factory.mktemp("srv")
    made = [LoopbackNode(root, i, redis_mod.url, TOKEN) for i in (1, 2, 3)]
    try:
        for n in made:
            n.start()
        yield made
    finally:
        for n in made:
            n.stop()


@pytest.fixture
def own_node(tmp_path: Path, redis_mod: RedisServer) -> Iterator[LoopbackNode]:
    """A node of this test alone (not started: the test passes its options)."""
    node = LoopbackNode(tmp_path, 7, redis_mod.url, TOKEN)
    yield node
    node.stop(signal.SIGKILL)


# ---------------------------------------------------------------------- peers: authentication
def test_fetch_with_right_token(nodes: list[LoopbackNode]) -> None:
    n1 = nodes[0]
    rec = _put(n1, "s/ok.bin", b"payload" * 1000)
    reply = _raw(n1, _signed("s/ok.bin"))
    assert reply["ok"] is True and reply["size"] == rec.size


@pytest.mark.parametrize("token", ["wrong-token", ""])
def test_wrong_or_missing_token_is_refused_and_logged(nodes: list[LoopbackNode], token: str) -> None:
    n1, n2 = nodes[:2]
    rec = _put(n1, f"s/secret-{len(token)}.bin", b"secret")
    reply = _raw(n1, _signed(rec.key, token=token))
    assert reply["ok"] is False and reply["error"] == "AuthenticationError"
    # Through the transport, a wrong token is a typed error and leaves nothing behind.
    bad = TcpTransport(n2.settings().with_(token=token or None))
    dest = n2.dir / f"stolen-{len(token)}.bin"
    with pytest.raises(AuthenticationError):
        bad.fetch(rec, dest)
    assert not dest.exists()
    _until(lambda: "refused request" in n1.log.read_text(), 5, "refusal logged")


def test_unsigned_request_is_refused(nodes: list[LoopbackNode]) -> None:
    n1 = nodes[0]
    _put(n1, "s/x", b"x")
    reply = _raw(n1, wire.pack({"op": "fetch", "key": "s/x"}))
    assert reply["ok"] is False and reply["error"] == "AuthenticationError"


@pytest.mark.parametrize("key", ["../../etc/passwd", "/etc/passwd", "a/../../../etc/shadow",
                                 ".instride/node.sock", ""])
def test_traversal_gets_an_error_never_bytes(nodes: list[LoopbackNode], key: str) -> None:
    reply = _raw(nodes[0], _signed(key))
    assert reply["ok"] is False
    assert reply["error"] == "KeyValidationError"
    assert "size" not in reply


def test_missing_key_is_an_error(nodes: list[LoopbackNode]) -> None:
    reply = _raw(nodes[0], _signed("not/here"))
    assert reply == {"ok": False, "error": "KeyNotFoundError", "message": reply["message"]}


# ---------------------------------------------------------------------- peers: malformed input
MALFORMED_HEADERS = {
    "deeply nested JSON": b"[" * 20_000 + b"]" * 20_000,
    "nested object": b'{"a":' * 5_000 + b"1" + b"}" * 5_000,
    "integer of 5000 digits": b'{"ts":' + b"9" * 5_000 + b"}",
    "not UTF-8": b"\xff\xfe\xfd",
    "lone surrogate": b'{"op":"fetch","key":"\\ud800","nonce":"n","ts":1,"mac":"' + b"0" * 64 + b'"}',
    "not an object": b"[1,2,3]",
    "not JSON": b"nope!",
}


@pytest.mark.parametrize("body", MALFORMED_HEADERS.values(), ids=MALFORMED_HEADERS.keys())
def test_malformed_header_gets_wire_error(nodes: list[LoopbackNode], body: bytes) -> None:
    n1 = nodes[0]
    reply = _raw(n1, struct.pack(">I", len(body)) + body)
    assert reply["ok"] is False
    assert reply["error"] in ("WireError", "AuthenticationError")  # never a silent close
    _no_traceback(n1)


FORGED = {
    "uppercase mac": {"mac": "A" * 64},
    "non-ASCII mac": {"mac": "é" * 64},
    "short mac": {"mac": "abc"},
    "mac not a string": {"mac": 12},
    "NaN timestamp": {"ts": float("nan")},
    "infinite timestamp": {"ts": float("inf")},
    "huge integer timestamp": {"ts": 10**300},
    "boolean timestamp": {"ts": True},
    "string timestamp": {"ts": "1700000000"},
    "key not a string": {"key": ["a", "b"]},
    "op not a string": {"op": {"x": 1}},
    "nonce missing": {"nonce": None},
}


@pytest.mark.parametrize("fields", FORGED.values(), ids=FORGED.keys())
def test_malformed_fields_are_refused(nodes: list[LoopbackNode], fields: dict) -> None:
    n1 = nodes[0]
    reply = _raw(n1, _forged(**fields))
    assert reply["ok"] is False and reply["error"] == "AuthenticationError"
    _no_traceback(n1)


def test_oversized_truncated_and_unknown_requests(nodes: list[LoopbackNode]) -> None:
    n1 = nodes[0]
    assert _raw(n1, struct.pack(">I", 10_000_000))["error"] == "WireError"
    assert _raw(n1, struct.pack(">I", 0))["error"] == "WireError"
    assert _raw(n1, struct.pack(">I", 5) + b"nope!")["error"] == "WireError"
    # A header cut short, and a length prefix cut short: an error reply, not a silent close.
    assert _raw(n1, struct.pack(">I", 100) + b'{"op":', shut=True)["error"] == "WireError"
    assert _raw(n1, b"\x00\x00", shut=True)["error"] == "WireError"
    assert _raw(n1, wire.pack({"op": "fetch"}))["ok"] is False
    assert _raw(n1, _signed("k", op="delete"))["error"] == "WireError"
    # ... and the server still serves others.
    _put(n1, "s/after", b"still here")
    assert _raw(n1, _signed("s/after"))["ok"] is True
    _no_traceback(n1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(min_size=0, max_size=300))
def test_fuzzed_bytes_never_crash_the_server(nodes: list[LoopbackNode], junk: bytes) -> None:
    n1 = nodes[0]
    with socket.create_connection(("127.0.0.1", n1.port), timeout=5) as s:
        s.sendall(junk)
        s.shutdown(socket.SHUT_WR)
        try:
            while s.recv(65536):
                pass
        except (ConnectionResetError, TimeoutError):
            pass
    assert n1.proc is not None and n1.proc.poll() is None
    assert _raw(n1, _signed("fuzz/none"))["error"] == "KeyNotFoundError"


# ---------------------------------------------------------------------- peers: what is served
def test_symlinks_and_special_files_are_never_served(nodes: list[LoopbackNode]) -> None:
    n1 = nodes[0]
    _put(n1, "sym/real.bin", b"inside")
    (n1.dir / "sym" / "host").symlink_to("/etc/hostname")
    (n1.dir / "sym" / "inner").symlink_to(n1.dir / "sym" / "real.bin")  # even pointing inside
    (n1.dir / "symdir").symlink_to("/etc")
    (n1.dir / "alias").symlink_to(n1.dir / "sym")  # a directory link, even pointing inside
    os.mkfifo(n1.dir / "sym" / "fifo")
    (n1.dir / "sym" / "adir").mkdir()
    for key in ("sym/host", "sym/inner", "symdir/hostname", "alias/real.bin", "sym/fifo", "sym/adir"):
        start = time.monotonic()
        reply = _raw(n1, _signed(key))
        assert reply["ok"] is False and reply["error"] == "KeyNotFoundError", (key, reply)
        assert "size" not in reply
        assert time.monotonic() - start < 3, f"{key}: the server blocked"
    assert "symbolic link" in _raw(n1, _signed("sym/host"))["message"]
    assert "not a regular file" in _raw(n1, _signed("sym/fifo"))["message"]
    assert "outside" in _raw(n1, _signed("symdir/hostname"))["message"]
    assert "symbolic link" in _raw(n1, _signed("alias/real.bin"))["message"]
    # the regular file next to them is served; the FIFO did not block the event loop
    assert _raw(n1, _signed("sym/real.bin"))["size"] == 6
    # the thin-client face refuses to record them
    assert _ask(n1, "PUBLISH sym/host").startswith("ERR 22 ")
    assert _ask(n1, "PUBLISH sym/fifo").startswith("ERR 22 ")
    assert _ask(n1, "PUBLISH symdir/hostname").startswith("ERR 22 ")
    assert _ask(n1, "PUBLISH alias/real.bin").startswith("ERR 22 ")
    _no_traceback(n1)


# ---------------------------------------------------------------------- thin clients
def test_unix_socket_protocol(nodes: list[LoopbackNode]) -> None:
    n1, n2, n3 = nodes
    _put(n1, "u/frame", b"abc" * 100)
    assert _ask(n2, "PING") == "OK pong"
    assert _ask(n2, "CONSUME 5000 u/frame") == f"OK {n2.dir / 'u' / 'frame'}"
    assert (n2.dir / "u" / "frame").read_bytes() == b"abc" * 100
    assert _ask(n2, "CONSUME 200 u/never").startswith("ERR 110 ")
    assert _ask(n2, "CONSUME 0 u/never").startswith("ERR 110 ")
    assert _ask(n2, "CONSUME 200 ../x").startswith("ERR 22 ")
    assert _ask(n2, "CONSUME soon u/frame").startswith("ERR 22 ")
    assert _ask(n2, "BOGUS").startswith("ERR 22 ")
    assert _ask(n2, "x" * 9000).startswith("ERR 7 ")
    (n2.dir / "u" / "shim.out").write_bytes(b"from the shim")
    assert _ask(n2, "PUBLISH u/shim.out") == f"OK {n2.dir / 'u' / 'shim.out'}"
    assert _ask(n2, "PUBLISH u/absent").startswith("ERR 2 ")
    c3 = n3.client()
    try:
        assert c3.consume("u/shim.out", timeout=5).read_bytes() == b"from the shim"
    finally:
        c3.close()
    # several requests on one connection
    with _unix(n2) as s:
        f = s.makefile("rw")
        for _ in range(3):
            f.write("PING\n")
            f.flush()
            assert f.readline() == "OK pong\n"
    # restrictive modes
    assert oct(os.stat(n2.dir / ".instride" / "node.sock").st_mode & 0o777) == "0o600"
    assert oct(os.stat(n2.dir / ".instride").st_mode & 0o777) == "0o700"


def test_publish_is_write_once_across_nodes(nodes: list[LoopbackNode]) -> None:
    n1, n2, n3 = nodes
    first = _put(n1, "wo/k.bin", b"first")
    mine = n2.dir / "wo" / "k.bin"
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.write_bytes(b"second")
    reply = _ask(n2, "PUBLISH wo/k.bin")
    assert reply.startswith("ERR 17 "), reply
    assert not mine.exists(), "the conflicting local file must be removed"
    c3 = n3.client()
    try:
        rec = c3.lookup("wo/k.bin")
        assert rec is not None and rec.owner == n1.addr and rec.version == first.version
        # The explicit overwrite form takes the key over, as a new version.
        mine.write_bytes(b"second")
        assert _ask(n2, "OVERWRITE wo/k.bin") == f"OK {mine}"
        rec = c3.lookup("wo/k.bin")
        assert rec is not None and rec.owner == n2.addr and rec.version == first.version + 1
        assert c3.consume("wo/k.bin", timeout=5).read_bytes() == b"second"
    finally:
        c3.close()


def test_one_line_flattens_messages() -> None:
    assert one_line("a\nb\r\nc\rd\x0be\x00f\u2028g") == "a b c d e f g"
    assert one_line("x" * 5000) == "x" * 1000
    assert "\n" not in one_line("Traceback:\n  line 1\n  line 2\n")


def test_waits_never_starve_publications_and_end_with_their_clients(nodes: list[LoopbackNode]) -> None:
    n3 = nodes[2]
    base = _stats(n3)
    conns = []
    try:
        for _ in range(80):
            s = _unix(n3)
            s.sendall(b"CONSUME -1 never/k\n")
            conns.append(s)
        # 64 wait threads busy, 16 waits queued behind them
        _until(lambda: _stats(n3)["waiting"] == 64, 10, "64 waits running")

        def quick_requests_answer() -> None:
            ready = n3.dir / "busy" / f"ready-{time.monotonic_ns()}.bin"
            ready.parent.mkdir(parents=True, exist_ok=True)
            ready.write_bytes(b"r")
            key = ready.relative_to(n3.dir).as_posix()
            start = time.monotonic()
            assert _ask(n3, f"PUBLISH {key}", timeout=5) == f"OK {ready}"
            assert _ask(n3, f"CONSUME 1000 {key}", timeout=5) == f"OK {ready}"
            assert time.monotonic() - start < 5

        quick_requests_answer()
        for s in conns[:40]:
            s.close()
        # the abandoned waits end (no reply to nobody); the 16 queued ones got threads
        _until(lambda: _stats(n3)["waiting"] == 40, 8, "abandoned waits ended")
        assert _stats(n3)["abandoned"] - base["abandoned"] >= 24
        quick_requests_answer()
        # the remaining waits are still pending
        for s in conns[40:]:
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
    finally:
        for s in conns:
            s.close()
    _until(lambda: _stats(n3)["waiting"] == 0, 8, "all waits ended")
    assert _stats(n3)["abandoned"] - base["abandoned"] == 80
    assert n3.proc is not None and n3.proc.poll() is None
    _no_traceback(n3)


# ---------------------------------------------------------------------- lifecycle
def test_sigterm_with_pending_waits_exits_cleanly(own_node: LoopbackNode) -> None:
    node = own_node.start("--grace", "2")
    assert _ask(node, "PING") == "OK pong"  # started and serving
    conns = []
    try:
        for i in range(5):
            s = _unix(node)
            s.sendall(f"CONSUME -1 never/{i}\n".encode())
            conns.append(s)
        _until(lambda: _stats(node)["waiting"] == 5, 10, "5 waits pending")
        assert node.proc is not None
        start = time.monotonic()
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(2 + 2) == 0
        assert time.monotonic() - start < 4
        for s in conns:  # told, not left hanging
            assert s.makefile().readline().startswith("ERR 103 ")
    finally:
        for s in conns:
            s.close()
    assert not (node.dir / ".instride" / "node.sock").exists()
    text = node.log.read_text()
    assert "shutting down" in text and "Traceback" not in text, text


def test_peer_connection_limits_and_deadlines(own_node: LoopbackNode) -> None:
    node = own_node.start("--max-peers", "2", "--request-timeout", "1", "--send-timeout", "1")
    # Connection cap: the third concurrent connection is told "busy".
    a = socket.create_connection(("127.0.0.1", node.port), timeout=10)
    b = socket.create_connection(("127.0.0.1", node.port), timeout=10)
    try:
        _until(lambda: _stats(node)["peers"] == 2, 5, "2 peers connected")
        reply = _raw(node, _signed("x"))
        assert reply["ok"] is False and "busy" in reply["message"]
        # A connection that sends nothing is closed after the request timeout.
        start = time.monotonic()
        assert a.recv(1) == b"" and b.recv(1) == b""
        assert time.monotonic() - start < 5
    finally:
        a.close()
        b.close()
    _until(lambda: _stats(node)["peers"] == 0, 5, "idle peers dropped")
    # After a successful request the connection is kept alive past the request timeout.
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as s:
        s.sendall(_signed("", op="ping"))
        n = struct.unpack(">I", _recv_all(s, 4))[0]
        assert json.loads(_recv_all(s, n))["ok"] is True
        time.sleep(1.5)
        s.sendall(_signed("kept/none"))
        n = struct.unpack(">I", _recv_all(s, 4))[0]
        assert json.loads(_recv_all(s, n))["error"] == "KeyNotFoundError"
    # A peer that stops reading does not pin a transfer: dropped after 1 s + size / 50 MB/s.
    size = 48 << 20
    _put(node, "big/stall.bin", b"\0" * size)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(10)
        s.connect(("127.0.0.1", node.port))
        s.sendall(_signed("big/stall.bin"))
        _until(lambda: "stalled" in node.log.read_text(), 10, "stalled transfer dropped")
        got = 0
        try:
            while chunk := s.recv(1 << 20):
                got += len(chunk)
        except ConnectionResetError:
            pass
        assert got < size
    assert _stats(node)["stalled"] >= 1
    assert _raw(node, _signed("big/none"))["error"] == "KeyNotFoundError"
    _no_traceback(node)


# ---------------------------------------------------------------------- client side of a cut
def test_transfer_cut_midway_is_a_transfer_error(nodes: list[LoopbackNode], tmp_path: Path) -> None:
    """An owner that sends a valid reply header, half the body, then closes."""
    body = os.urandom(100_000)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def fake_owner() -> None:
        conn, _ = listener.accept()
        with conn:
            n = struct.unpack(">I", _recv_all(conn, 4))[0]
            _recv_all(conn, n)
            conn.sendall(wire.pack({"ok": True, "key": "cut/x.bin", "size": len(body)}))
            conn.sendall(body[: len(body) // 2])

    owner = threading.Thread(target=fake_owner, daemon=True)
    owner.start()
    rec = Record(key="cut/x.bin", owner=f"127.0.0.1:{port}", size=len(body),
                 checksum="xxh3:" + xxhash.xxh3_64_hexdigest(body), version=1, time=time.time(),
                 node="fake")
    dest = tmp_path / "partial.bin"
    t = TcpTransport(nodes[1].settings())
    try:
        with pytest.raises(TransferError, match="closed after 50000 of 100000"):
            t.fetch(rec, dest)
    finally:
        t.close()
        owner.join(5)
        listener.close()
    assert not dest.exists()
