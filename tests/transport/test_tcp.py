"""The TCP transport: the transport contract, and its server half's peer protocol.

The contract (:mod:`tests.transport.contract`) runs against the real server half started by
name. The peer-protocol tests talk to real ``instride serve`` processes on loopback (three
module-scoped nodes sharing one Redis; tests that stop a server or need other options start
their own): authentication, key validation, malformed input, what is served, resource bounds.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from instride.errors import AuthenticationError, KeyNotFoundError, PeerUnavailable, TransferError
from instride.record import Record
from instride.transport import wire
from instride.transport.tcp import TcpTransport
from instride.transport.tcp.client import _batch
from tests import nodes as loopback
from tests.conftest import LoopbackNode, build_shim, free_port, stop_process
from tests.nodes import TOKEN, ask, forged, no_traceback, put, raw, recv_all, signed, stats, until

from .contract import TOKEN as CONTRACT_TOKEN
from .contract import Owner, TransportContract, _frame_bytes, wait_ready

# the fixtures (tests/nodes.py): three running nodes, one of a test alone, their Redis
redis_mod, nodes, own_node = loopback.redis_mod, loopback.nodes, loopback.own_node

_DYING = """
import os, signal, socket, struct, sys
from instride.transport import wire
body = open(sys.argv[2], "rb").read()
cut = int(sys.argv[3])
listener = socket.create_server(("127.0.0.1", int(sys.argv[1])))
print("ready", flush=True)
conn, _ = listener.accept()
n = struct.unpack(">I", conn.recv(4, socket.MSG_WAITALL))[0]
conn.recv(n, socket.MSG_WAITALL)
conn.sendall(wire.pack({"ok": True, "key": "t/cut.bin", "size": len(body)}))
conn.sendall(body[:cut])
os.kill(os.getpid(), signal.SIGKILL)
"""


class TestTcpContract(TransportContract):
    name = "tcp"

    @pytest.fixture
    def dying_owner(self, tmp_path: Path) -> Iterator:
        procs: list[subprocess.Popen] = []

        def start(body: bytes, cut: int) -> str:
            src = tmp_path / f"body-{len(procs)}.bin"
            src.write_bytes(body)
            port = free_port()
            proc = subprocess.Popen([sys.executable, "-c", _DYING, str(port), str(src), str(cut)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            procs.append(proc)
            assert wait_ready(proc), "the dying owner did not start"
            return f"127.0.0.1:{port}"

        yield start
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            assert proc.stdout is not None and proc.stderr is not None
            proc.stdout.close()
            proc.stderr.close()


    def test_stalled_large_fetch_does_not_block_small_ones(self, owner, consumer, tmp_path: Path) -> None:
        """No head-of-line blocking: while a peer is not reading a 32 MiB body (so the server
        cannot have finished sending it), small fetches on other connections complete; the large
        body then still arrives whole."""
        big = os.urandom(32 << 20)
        owner.put("t/big.bin", big)
        small = [owner.put(f"t/small-{i}.bin", bytes([i]) * 70_000) for i in range(5)]
        stalled = socket.create_connection(owner.addr.rsplit(":", 1), timeout=30)
        try:
            stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            stalled.sendall(wire.pack(wire.sign(CONTRACT_TOKEN, "fetch", "t/big.bin")))
            time.sleep(0.2)  # the server is now writing the big body into a full socket
            for i, record in enumerate(small):
                consumer.fetch(record, tmp_path / f"small-{i}.bin")
                assert (tmp_path / f"small-{i}.bin").read_bytes() == bytes([i]) * 70_000
            (n,) = struct.unpack(">I", recv_all(stalled, 4))
            assert json.loads(recv_all(stalled, n))["size"] == len(big)
            got = bytearray(len(big))
            view, done = memoryview(got), 0
            while done < len(big) and (k := stalled.recv_into(view[done:])):
                done += k
            assert got == big  # the stalled transfer was never dropped
        finally:
            stalled.close()

    def test_an_early_ask_after_the_owner_restarted_takes_a_new_connection(
            self, owner, consumer, tmp_path: Path) -> None:
        """A kept-alive connection whose owner went away (a restart on the same address) is
        not used for the next request: asked early for a key, the restarted owner sends it
        (the request is not sent into the dead connection, where it would fail)."""
        first = owner.put("t/before.bin", b"before the restart")
        consumer.fetch(first, tmp_path / "before.bin")  # (its connection is kept alive)
        owner.stop()
        again = Owner(tmp_path, self.name, addr=owner.addr)
        try:
            body = os.urandom(100_000)
            again.put("t/after.bin", body)
            sock = consumer.ask_when_published(first, "t/after.bin", 5)
            fd = os.open(tmp_path / "after.bin", os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                got = consumer.receive_asked(sock, first, "t/after.bin", fd, 5)
            finally:
                os.close(fd)
            assert got is not None and (got.size, got.digest) == (len(body), xxhash.xxh3_64_hexdigest(body))
            assert (tmp_path / "after.bin").read_bytes() == body
        finally:
            again.stop()


# ---------------------------------------------------------------------- peers: authentication
def test_fetch_with_right_token(nodes: list[LoopbackNode]) -> None:
    n1 = nodes[0]
    rec = put(n1, "s/ok.bin", b"payload" * 1000)
    reply = raw(n1, signed("s/ok.bin"))
    assert reply["ok"] is True and reply["size"] == rec.size


@pytest.mark.parametrize("token", ["wrong-token", ""])
def test_wrong_or_missing_token_is_refused_and_logged(nodes: list[LoopbackNode], token: str) -> None:
    n1, n2 = nodes[:2]
    rec = put(n1, f"s/secret-{len(token)}.bin", b"secret")
    reply = raw(n1, signed(rec.key, token=token))
    assert reply["ok"] is False and reply["error"] == "AuthenticationError"
    # Through the transport, a wrong token is a typed error and leaves nothing behind.
    bad = TcpTransport(n2.settings().with_(token=token or None))
    dest = n2.dir / f"stolen-{len(token)}.bin"
    with pytest.raises(AuthenticationError):
        bad.fetch(rec, dest)
    assert not dest.exists()
    until(lambda: "refused request" in n1.log.read_text(), 5, "refusal logged")


def test_unsigned_request_is_refused(nodes: list[LoopbackNode]) -> None:
    n1 = nodes[0]
    put(n1, "s/x", b"x")
    reply = raw(n1, wire.pack({"op": "fetch", "key": "s/x"}))
    assert reply["ok"] is False and reply["error"] == "AuthenticationError"


@pytest.mark.parametrize("key", ["../../etc/passwd", "/etc/passwd", "a/../../../etc/shadow",
                                 ".instride/node.sock", ""])
def test_traversal_gets_an_error_never_bytes(nodes: list[LoopbackNode], key: str) -> None:
    reply = raw(nodes[0], signed(key))
    assert reply["ok"] is False
    assert reply["error"] == "KeyValidationError"
    assert "size" not in reply


def test_missing_key_is_an_error(nodes: list[LoopbackNode]) -> None:
    reply = raw(nodes[0], signed("not/here"))
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
    reply = raw(n1, struct.pack(">I", len(body)) + body)
    assert reply["ok"] is False
    assert reply["error"] in ("WireError", "AuthenticationError")  # never a silent close
    no_traceback(n1)


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
    reply = raw(n1, forged(**fields))
    assert reply["ok"] is False and reply["error"] == "AuthenticationError"
    no_traceback(n1)


def test_oversized_truncated_and_unknown_requests(nodes: list[LoopbackNode]) -> None:
    n1 = nodes[0]
    assert raw(n1, struct.pack(">I", 10_000_000))["error"] == "WireError"
    assert raw(n1, struct.pack(">I", 0))["error"] == "WireError"
    assert raw(n1, struct.pack(">I", 5) + b"nope!")["error"] == "WireError"
    # A header cut short, and a length prefix cut short: an error reply, not a silent close.
    assert raw(n1, struct.pack(">I", 100) + b'{"op":', shut=True)["error"] == "WireError"
    assert raw(n1, b"\x00\x00", shut=True)["error"] == "WireError"
    assert raw(n1, wire.pack({"op": "fetch"}))["ok"] is False
    assert raw(n1, signed("k", op="delete"))["error"] == "WireError"
    # ... and the server still serves others.
    put(n1, "s/after", b"still here")
    assert raw(n1, signed("s/after"))["ok"] is True
    no_traceback(n1)


def test_at_the_peer_bound_an_idle_connection_gives_its_place(own_node: LoopbackNode,
                                                              tmp_path: Path) -> None:
    """At ``--max-peers``, a new connection was told "busy" (a TransferError for its fetch,
    which nothing retried) also when the connections held were idle ones that their clients
    kept alive for a next request. The one idle the longest now makes room; only when every
    connection is answering is a new one told "busy" (PeerUnavailable), and the transport
    tries again within its connect timeout."""
    node = own_node.start("--max-peers", "2")
    rec = put(node, "bound/k", b"served")
    idle = [socket.create_connection(("127.0.0.1", node.port), timeout=10) for _ in range(2)]
    try:
        for s in idle:  # (a request answered: kept alive, idle)
            s.sendall(signed("", op="ping"))
            n = struct.unpack(">I", recv_all(s, 4))[0]
            assert json.loads(recv_all(s, n))["ok"] is True
        until(lambda: stats(node)["peers"] == 2, 5, "2 idle peers")
        assert raw(node, signed("bound/k"))["ok"] is True
        for s in idle:
            s.settimeout(0.5)
        closed = []
        for s in idle:
            with contextlib.suppress(TimeoutError):
                closed.append(s.recv(1) == b"")
        assert closed == [True]  # (the older one; the other stays kept alive)
    finally:
        for s in idle:
            s.close()
    until(lambda: stats(node)["peers"] == 0, 5, "peers gone")
    # both connections answering (fetches held for a key not published yet): "busy"
    held = [socket.create_connection(("127.0.0.1", node.port), timeout=10) for _ in range(2)]
    try:
        for s in held:
            s.sendall(wire.pack(wire.sign(TOKEN, "fetch", "bound/later", wait=1500)))
        until(lambda: stats(node)["peers"] == 2, 5, "2 held fetches")
        reply = raw(node, signed("bound/k"))
        assert reply["error"] == "PeerUnavailable" and reply["message"].startswith("busy")
        t = TcpTransport(node.settings().with_(connect_timeout=10))
        try:  # (tried again until a held fetch ends)
            assert t.fetch_bytes(rec) == b"served"
        finally:
            t.close()
    finally:
        for s in held:
            s.close()


def test_a_stalled_owner_costs_one_timeout_not_two(own_node: LoopbackNode) -> None:
    """A fetch on a kept-alive connection to an owner that stopped answering (SIGSTOP, a hung
    node: the kernel still accepts connections) was tried again on a new connection after
    its reply timed out: twice the connect timeout before PeerUnavailable."""
    node = own_node.start()
    rec = put(node, "stall/k", b"data")
    t = TcpTransport(node.settings().with_(connect_timeout=2))
    assert node.proc is not None
    try:
        assert t.fetch_bytes(rec) == b"data"  # (the connection kept alive)
        # (every thread stopped before the fetch: kill() returns with the signal queued, and
        # a server thread that went on a moment answered the fetch -- 1 fresh-clone CI run)
        stop_process(node.proc.pid)
        start = time.monotonic()
        with pytest.raises(PeerUnavailable):
            t.fetch_bytes(rec)
        took = time.monotonic() - start
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)
        t.close()
    assert took < 3.5, f"{took:.1f} s: the timeout of 2 s was waited twice"


def test_a_held_fetch_that_misses_late_is_a_miss(nodes: list[LoopbackNode],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A fetch signed near the end of the clock window and held waiting for its key: the
    engine verified it as it arrived, then handed the miss to Python, which checked the
    window again — at the end of the wait — and answered AuthenticationError ("timestamp
    outside the accepted window"), logged as a refused request, for a plain miss."""
    n1 = nodes[0]
    put(n1, "late/there", b"(the directory waited in)")
    now = time.time()
    monkeypatch.setattr(wire.time, "time", lambda: now - wire.MAX_SKEW + 1.0)
    late = wire.pack(wire.sign(TOKEN, "fetch", "late/never", wait=1500))
    monkeypatch.undo()
    reply = raw(n1, late)
    assert reply["ok"] is False and reply["error"] == "KeyNotFoundError", reply


def test_a_deeply_nested_header_does_not_kill_the_server(own_node: LoopbackNode) -> None:
    """One request of 16 KB of '[' (no token needed): the JSON parser recursed once per level
    on a connection thread of 256 KiB of stack, which Python 3.12's deeper C recursion limit
    lets overflow: the data server died (SIGSEGV). The server here runs with a recursion
    limit that deep, as 3.12 has. The header is refused before the parser now."""
    serve = ("import runpy, sys; sys.setrecursionlimit(100_000); sys.argv = ['instride', 'serve'];"
             " runpy.run_module('instride', run_name='__main__', alter_sys=True)")
    with open(own_node.log, "ab") as log:
        own_node.proc = subprocess.Popen([sys.executable, "-c", serve], env=own_node.env,
                                         stdout=subprocess.PIPE, stderr=log)
    assert wait_ready(own_node.proc, 30), own_node.log.read_text()
    deep = b"[" * 16_000
    reply = raw(own_node, struct.pack(">I", len(deep)) + deep)
    assert reply["error"] == "WireError" and "nested" in reply["message"]
    assert own_node.proc.poll() is None
    put(own_node, "deep/after", b"still here")
    assert raw(own_node, signed("deep/after"))["ok"] is True


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
    assert raw(n1, signed("fuzz/none"))["error"] == "KeyNotFoundError"


# ---------------------------------------------------------------------- peers: what is served
def test_symlinks_and_special_files_are_never_served(nodes: list[LoopbackNode]) -> None:
    n1 = nodes[0]
    put(n1, "sym/real.bin", b"inside")
    (n1.dir / "sym" / "host").symlink_to("/etc/hostname")
    (n1.dir / "sym" / "inner").symlink_to(n1.dir / "sym" / "real.bin")  # even pointing inside
    (n1.dir / "symdir").symlink_to("/etc")
    (n1.dir / "alias").symlink_to(n1.dir / "sym")  # a directory link, even pointing inside
    os.mkfifo(n1.dir / "sym" / "fifo")
    (n1.dir / "sym" / "adir").mkdir()
    for key in ("sym/host", "sym/inner", "symdir/hostname", "alias/real.bin", "sym/fifo", "sym/adir"):
        start = time.monotonic()
        reply = raw(n1, signed(key))
        assert reply["ok"] is False and reply["error"] == "KeyNotFoundError", (key, reply)
        assert "size" not in reply
        assert time.monotonic() - start < 3, f"{key}: the server blocked"
    assert "symbolic link" in raw(n1, signed("sym/host"))["message"]
    assert "not a regular file" in raw(n1, signed("sym/fifo"))["message"]
    assert "outside" in raw(n1, signed("symdir/hostname"))["message"]
    assert "symbolic link" in raw(n1, signed("alias/real.bin"))["message"]
    # the regular file next to them is served; the FIFO did not block the event loop
    assert raw(n1, signed("sym/real.bin"))["size"] == 6
    # the thin-client face refuses to record them
    assert ask(n1, "PUBLISH sym/host").startswith("ERR 22 ")
    assert ask(n1, "PUBLISH sym/fifo").startswith("ERR 22 ")
    assert ask(n1, "PUBLISH symdir/hostname").startswith("ERR 22 ")
    assert ask(n1, "PUBLISH alias/real.bin").startswith("ERR 22 ")
    no_traceback(n1)


def test_peer_connection_limits_and_deadlines(own_node: LoopbackNode) -> None:
    # (a request timeout of 3 s: the third connection must come before b is dropped)
    node = own_node.start("--max-peers", "2", "--request-timeout", "3", "--send-timeout", "1")
    # Connection cap: a third concurrent connection takes the place of the one that has waited
    # the longest for a request ("busy" where every place is answering: the test above).
    a = socket.create_connection(("127.0.0.1", node.port), timeout=10)
    b = socket.create_connection(("127.0.0.1", node.port), timeout=10)
    try:
        until(lambda: stats(node)["peers"] == 2, 5, "2 peers connected")
        time.sleep(0.3)  # (a connection just made is given 0.1 s to send its request)
        reply = raw(node, signed("x"))
        assert reply["ok"] is False and reply["error"] == "KeyNotFoundError", reply
        assert a.recv(1) == b""
        # A connection that sends nothing is closed after the request timeout.
        start = time.monotonic()
        assert b.recv(1) == b""
        assert time.monotonic() - start < 10
    finally:
        a.close()
        b.close()
    until(lambda: stats(node)["peers"] == 0, 5, "idle peers dropped")
    # After a successful request the connection is kept alive past the request timeout.
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as s:
        s.sendall(signed("", op="ping"))
        n = struct.unpack(">I", recv_all(s, 4))[0]
        assert json.loads(recv_all(s, n))["ok"] is True
        time.sleep(3.5)
        s.sendall(signed("kept/none"))
        n = struct.unpack(">I", recv_all(s, 4))[0]
        assert json.loads(recv_all(s, n))["error"] == "KeyNotFoundError"
    # A peer that stops reading does not pin a transfer: dropped after 1 s + size / 50 MB/s.
    size = 48 << 20
    put(node, "big/stall.bin", b"\0" * size)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(10)
        s.connect(("127.0.0.1", node.port))
        s.sendall(signed("big/stall.bin"))
        until(lambda: "stalled" in node.log.read_text(), 10, "stalled transfer dropped")
        got = 0
        try:
            while chunk := s.recv(1 << 20):
                got += len(chunk)
        except ConnectionResetError:
            pass
        assert got < size
    assert stats(node)["stalled"] >= 1
    assert raw(node, signed("big/none"))["error"] == "KeyNotFoundError"
    no_traceback(node)


# ---------------------------------------------------------------------- client side of a cut
def test_transfer_cut_midway_is_a_transfer_error(nodes: list[LoopbackNode], tmp_path: Path) -> None:
    """An owner that sends a valid reply header, half the body, then closes."""
    body = os.urandom(100_000)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def fake_owner() -> None:
        conn, _ = listener.accept()
        with conn:
            n = struct.unpack(">I", recv_all(conn, 4))[0]
            recv_all(conn, n)
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
        owner.join(5)
        owner = threading.Thread(target=fake_owner, daemon=True)  # again, into memory
        owner.start()
        with pytest.raises(TransferError, match="closed after 50000 of 100000"):
            t.fetch_when_published(rec, "cut/x.bin", -1, 1.0, into=memoryview(bytearray(200_000)))
    finally:
        t.close()
        owner.join(5)
        listener.close()
    assert not dest.exists()


# ---------------------------------------------------------------------- fetches that wait
def _transport(node: LoopbackNode) -> TcpTransport:
    return TcpTransport(node.settings())

def _requests_sent(transport: TcpTransport) -> list[str]:
    """The keys of the requests ``transport`` signs from now on, in order (a list it fills)."""
    sent: list[str] = []
    signed_before = transport._signed

    def counting(*args: object, **kw: object) -> bytes:
        sent.append(args[0].key)  # type: ignore[attr-defined]
        return signed_before(*args, **kw)  # type: ignore[arg-type]

    transport._signed = counting  # type: ignore[method-assign]
    return sent



def _waiting(transport: TcpTransport, like: Record, key: str, out: Path, wait: float,
             until_name: str | None = None) -> tuple[threading.Thread, dict]:
    """Start ``fetch_when_published`` in a thread; its result (or error) lands in the dict."""
    result: dict = {}

    def run() -> None:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            result["got"] = transport.fetch_when_published(like, key, fd, wait, until_name)
        except Exception as exc:  # noqa: BLE001 (reported by the test)
            result["error"] = exc
        finally:
            os.close(fd)
        result["done"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_a_waiting_fetch_is_answered_when_the_key_is_published(nodes: list[LoopbackNode],
                                                                tmp_path: Path) -> None:
    n1, n2 = nodes[0], nodes[1]
    like = put(n1, "wt/first", b"first")
    transport = _transport(n2)
    try:
        thread, result = _waiting(transport, like, "wt/second", tmp_path / "second", 30.0)
        time.sleep(0.3)  # the request is held at the owner now
        assert thread.is_alive()
        data = os.urandom(700_000)
        put(n1, "wt/second", data)
        published = time.monotonic()
        thread.join(30)
        assert "error" not in result, result
        assert result["got"][:2] == (len(data), xxhash.xxh3_64_hexdigest(data))
        assert (tmp_path / "second").read_bytes() == data
        assert result["done"] - published < 10  # sent on publication, not when the wait ran out
        # the same kept connection serves the next request
        thread, result = _waiting(transport, like, "wt/first", tmp_path / "again", 5.0)
        thread.join(30)
        assert result["got"][:2] == (5, xxhash.xxh3_64_hexdigest(b"first"))
    finally:
        transport.close()
    no_traceback(n1)


def test_a_fetch_into_memory_lands_there_or_in_the_file_when_it_does_not_fit(
        nodes: list[LoopbackNode], tmp_path: Path) -> None:
    """``into``: the body is received straight into the caller's memory, hashed on the way (the
    file untouched); a body larger than that memory goes to the file as usual."""
    n1, n2 = nodes[0], nodes[1]
    data = os.urandom(300_000)
    like = put(n1, "mem/a", data)
    transport = _transport(n2)
    fd = os.open(tmp_path / "a", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        room = bytearray(400_000)
        got = transport.fetch_when_published(like, "mem/a", fd, 5.0, into=memoryview(room))
        assert got[:2] == (len(data), xxhash.xxh3_64_hexdigest(data))
        assert bytes(room[: len(data)]) == data and os.fstat(fd).st_size == 0
        small = bytearray(1000)
        got = transport.fetch_when_published(like, "mem/a", fd, 5.0, into=memoryview(small))
        assert got[:2] == (len(data), xxhash.xxh3_64_hexdigest(data))
        assert small == bytearray(1000) and (tmp_path / "a").read_bytes() == data
    finally:
        os.close(fd)
        transport.close()


def test_a_fetch_when_published_says_when_the_key_was_published_and_digests_from_an_offset(
        nodes: list[LoopbackNode], tmp_path: Path) -> None:
    """``published``: the owner's file's modification time (a stream's producer stamps it as it
    publishes), as its server reports it; ``digest_from``: the digest leaves out the bytes
    before it (a frame's header), received into memory or into the file alike."""
    n1, n2 = nodes[0], nodes[1]
    data = os.urandom(300_000)
    like = put(n1, "pub/a", data)
    stamp = time.time() - 3.25  # (the file's stamp: to the µs in the reply)
    os.utime(n1.dir / "pub" / "a", (stamp, stamp))
    transport = _transport(n2)
    fd = os.open(tmp_path / "a", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        for room in (bytearray(400_000), bytearray(10)):  # into memory, into the file
            got = transport.fetch_when_published(like, "pub/a", fd, 5.0, into=memoryview(room),
                                                 digest_from=128)
            assert got is not None
            assert got.size == len(data) and got.digest == xxhash.xxh3_64_hexdigest(data[128:])
            assert got.published == pytest.approx(stamp, abs=2e-6)
            assert got.head == data[:128]  # (the bytes left out: a frame's header, for its record)
        assert (tmp_path / "a").read_bytes() == data
    finally:
        os.close(fd)
        transport.close()


def test_the_native_receive_into_a_file_copies_the_bytes_before_the_digest_out(
        tmp_path: Path) -> None:
    """``isc_recv_file``'s ``head``: the bytes before ``hash_from`` (a frame's header, which a
    file opened only for writing cannot give back), exact however the sender splits them; the
    file and the digest (of the rest) as without it; a body shorter than the header leaves the
    rest of ``head`` as it was, and a peer that closes early is reported with what came."""
    from instride.transport.tcp.engine import load_library

    lib = load_library()

    def receive(data: bytes, parts: list[int], size: int) -> tuple[int, int, str, bytes, bytes]:
        a, b = socket.socketpair()

        def send() -> None:
            _send_in_pieces(b, data, parts, 0.005)
            b.close()

        sender = threading.Thread(target=send)
        sender.start()
        path = tmp_path / f"r{len(parts)}-{size}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # (write-only)
        hexdigest, got, where = ctypes.create_string_buffer(17), ctypes.c_uint64(), ctypes.c_int()
        head = ctypes.create_string_buffer(128)
        try:
            rc = lib.isc_recv_file(a.fileno(), fd, size, 128, 5_000, hexdigest, ctypes.byref(got),
                                   ctypes.byref(where), head)
        finally:
            sender.join(10)
            os.close(fd)
            a.close()
        return rc, got.value, hexdigest.value.decode(), head.raw, path.read_bytes()

    data = os.urandom(100_000)
    for parts in ([1] * 200, [3, 5, 7, 100, 13], [127, 1, 1], [128], [129], []):
        rc, got, digest, head, stored = receive(data, parts, len(data))
        assert (rc, got) == (0, len(data)) and stored == data, parts
        assert head == data[:128] and digest == xxhash.xxh3_64_hexdigest(data[128:]), parts
    small = data[:50]
    rc, got, digest, head, _ = receive(small, [10, 7], len(small))
    assert rc == 0 and head == small + bytes(78) and digest == xxhash.xxh3_64_hexdigest(b"")
    rc, got, _, head, _ = receive(data[:60], [20], 1000)  # (the peer closes after 60 bytes)
    assert rc == -errno.ECONNRESET and got == 60 and head[:60] == data[:60]


LEAK_PROBE = """
import ctypes, os, socket, threading
from instride.transport.tcp.engine import load_library

lib, size = load_library(), 1 << 17
sink = os.open("/dev/null", os.O_WRONLY)


def receive():  # one body received into a file by the native receive, on this thread
    a, b = socket.socketpair()
    with a, b:
        sender = threading.Thread(target=b.sendall, args=(b"x" * size,))
        sender.start()
        hexd, got, where = ctypes.create_string_buffer(17), ctypes.c_uint64(), ctypes.c_int()
        rc = lib.isc_recv_file(a.fileno(), sink, size, 0, 5000, hexd, ctypes.byref(got),
                               ctypes.byref(where), None)
        sender.join()
        assert rc == 0 and got.value == size, rc


def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def threads(n):
    for _ in range(n):
        t = threading.Thread(target=receive)
        t.start()
        t.join()


threads(20)  # (warm-up: the allocator's arenas, the library)
before = rss()
threads(300)
print((rss() - before) / 2**20)
"""


def test_a_thread_that_received_leaves_no_buffer_behind() -> None:
    """The native receive's buffer (128 KiB per thread) goes with its thread: 300 short-lived
    threads that each received a body leave far less than their 37.5 MiB of buffers."""
    out = subprocess.run([sys.executable, "-c", LEAK_PROBE], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout) < 8.0, out.stdout


def test_a_file_being_rewritten_is_not_served_until_its_writer_lets_go(
        nodes: list[LoopbackNode], tmp_path: Path) -> None:
    """The owner's server holds what it sends (shared lock) and serves nothing under an
    exclusive lock — a stream's producer rewriting a retired frame's file: "not found" at once
    (the C engine refuses it, the Python rules then answer so); released, the file is served."""
    n1, n2 = nodes[0], nodes[1]
    like = put(n1, "rw/a", b"whole frame")
    writer = os.open(n1.dir / "rw" / "a", os.O_RDWR)
    transport = _transport(n2)
    fd = os.open(tmp_path / "a", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(writer, fcntl.LOCK_EX)
        assert transport.fetch_when_published(like, "rw/a", fd, 0.3) is None
        fcntl.flock(writer, fcntl.LOCK_UN)
        got = transport.fetch_when_published(like, "rw/a", fd, 5.0)
        assert got is not None and got.size == len(b"whole frame")
    finally:
        os.close(fd)
        os.close(writer)
        transport.close()
    no_traceback(n1)


def test_a_file_renamed_away_between_the_servers_open_and_its_lock_is_not_sent(
        own_node: LoopbackNode, nodes: list[LoopbackNode], tmp_path: Path) -> None:
    """The C engine opens a key, then locks it, then checks the name still names that file: a
    file renamed away in between (a stream's producer retiring the frame, another file put under
    the key) is not sent under the key. ``c/swap_probe.c`` does the renaming inside the
    server's ``flock``; what the key names then (``new``) is served, never what it named."""
    probe = build_shim(Path(__file__).resolve().parent / "c" / "swap_probe.c", tmp_path, "-ldl")
    path = own_node.dir / "sw" / "a"
    own_node.env.update(LD_PRELOAD=str(probe), SWAP_PROBE_PATH=str(path))
    own_node.start()
    like = put(own_node, "sw/a", b"old")
    transport = _transport(nodes[1])
    fd = os.open(tmp_path / "a", os.O_RDWR | os.O_CREAT, 0o644)
    room = bytearray(16)
    try:
        got = transport.fetch_when_published(like, "sw/a", fd, 5.0, into=memoryview(room))
    finally:
        os.close(fd)
        transport.close()
    assert Path(f"{path}.swapped").exists()  # (the probe renamed it inside the server's lock)
    assert got is not None and bytes(room[: got.size]) == b"new"
    no_traceback(own_node)


def test_an_error_of_one_connection_being_accepted_does_not_stop_the_server(
        own_node: LoopbackNode, tmp_path: Path) -> None:
    """``accept`` fails for a connection that had a network error before it was accepted
    (``EPROTO``, ``ENETDOWN``, ``EHOSTUNREACH``, ...): the server goes on accepting the next
    ones. ``c/accept_fault.c`` fails the server's first TCP accept so."""
    shim = build_shim(Path(__file__).resolve().parent / "c" / "accept_fault.c", tmp_path, "-ldl")
    own_node.env.update(LD_PRELOAD=str(shim))
    own_node.start()
    put(own_node, "af/a.bin", b"after the fault")
    with socket.create_connection(("127.0.0.1", own_node.port), timeout=5) as s:
        s.sendall(signed("af/a.bin"))
        with contextlib.suppress(ConnectionResetError):
            assert s.recv(1) == b""  # (the connection the fault took: closed)
    for _ in range(3):
        reply = raw(own_node, signed("af/a.bin"))
        assert reply["ok"] is True and reply["size"] == len(b"after the fault")
    no_traceback(own_node)


def test_what_was_asked_ahead_of_one_owner_is_dropped_alone(
        nodes: list[LoopbackNode], tmp_path: Path) -> None:
    """``drop_ahead(owner)`` (a reader refused a frame of that owner) closes that owner's batch
    only; a batch asked of another owner on the same thread goes on."""
    n1, n2, n3 = nodes
    likes = [put(n, f"do{n.index}/frame_000000000.isf", b"zero") for n in (n1, n3)]
    for n in (n1, n3):
        put(n, f"do{n.index}/frame_000000001.isf", b"one")
    transport = _transport(n2)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    before = stats(n3)["peers"]
    try:
        room = memoryview(bytearray(100))
        for like, n in zip(likes, (n1, n3), strict=True):
            got = transport.fetch_when_published(like, f"do{n.index}/frame_000000001.isf", fd,
                                                 30.0, into=room, ahead=3)
            assert got is not None and got.size == 3
        # (one per owner and stream)
        assert set(transport._batches()) == {f"{n1.addr}|do1", f"{n3.addr}|do3"}
        transport.drop_ahead(n1.addr)
        assert set(transport._batches()) == {f"{n3.addr}|do3"}
        until(lambda: stats(n1)["peers"] == 0, 10, "the dropped batch's connection closed")
        assert stats(n3)["peers"] == before + 1  # (the other one still held there)
    finally:
        os.close(fd)
        transport.close()


def test_a_reply_for_another_key_than_the_one_asked_ahead_is_refused(
        nodes: list[LoopbackNode], tmp_path: Path) -> None:
    """A batch asked for ahead whose replies are out of step with the keys the caller asks for
    (the owner names each key it sends): a typed error, never the other key's bytes."""
    n1, n2 = nodes[0], nodes[1]
    like = put(n1, "os/frame_000000000.isf", b"zero")
    for i in (1, 2):
        put(n1, f"os/frame_{i:09d}.isf", b"frame %d" % i)
    transport = _transport(n2)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        room = memoryview(bytearray(100))
        assert transport.fetch_when_published(like, "os/frame_000000001.isf", fd, 5.0, into=room,
                                              ahead=1) is not None
        sock, _rest = transport._batches()[_batch(like.owner, like.key)]
        transport._batches()[_batch(like.owner, like.key)] = (sock, ["os/frame_000000009.isf"])
        with pytest.raises(TransferError, match="frame_000000002"):
            transport.fetch_when_published(like, "os/frame_000000009.isf", fd, 5.0, into=room,
                                           ahead=1)
        assert _batch(like.owner, like.key) not in transport._batches()
    finally:
        os.close(fd)
        transport.close()


@pytest.mark.parametrize("into", [True, False], ids=["into memory", "into the file"])
def test_a_reply_to_a_request_asked_early_for_another_key_is_refused(reply_pair: tuple,
                                                                     tmp_path: Path,
                                                                     into: bool) -> None:
    """``receive_asked`` takes only the reply for the key it asked for (as
    ``fetch_when_published`` does): another key's reply is a typed error, its bytes unread."""
    transport, ours, theirs = reply_pair
    theirs.sendall(_reply_bytes({"ok": True, "key": "rp/frame_000000002.isf", "size": 3}, b"abc"))
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with pytest.raises(TransferError, match="sent 'rp/frame_000000002.isf'"):
            transport.receive_asked(ours, HINT, HINT.key, fd, 1.0,
                                    into=memoryview(bytearray(100)) if into else None)
        assert os.fstat(fd).st_size == 0
    finally:
        os.close(fd)
    assert ours.fileno() == -1


def test_frames_asked_for_ahead_come_as_published_on_one_request(
        nodes: list[LoopbackNode], tmp_path: Path) -> None:
    """``ahead``: one request asks for a numbered key and the next ones; the owner sends each
    as it is published, and the calls for them send no request (the server counts one fetch
    request per body all the same). A key not published in time ends them: that call gets
    ``None``, the connection stays usable, and a later call asks again."""
    n1, n2 = nodes[0], nodes[1]
    frames = [os.urandom(200_000 + i) for i in range(7)]
    like = put(n1, "ah/frame_000000000.isf", frames[0])
    transport = _transport(n2)
    sent = _requests_sent(transport)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        for i in range(1, 5):
            put(n1, f"ah/frame_{i:09d}.isf", frames[i])
        room = bytearray(300_000)
        for i in range(1, 5):  # one request for 1 + 3
            got = transport.fetch_when_published(like, f"ah/frame_{i:09d}.isf", fd, 5.0,
                                                 into=memoryview(room), ahead=3)
            assert got[:2] == (len(frames[i]), xxhash.xxh3_64_hexdigest(frames[i]))
            assert bytes(room[: len(frames[i])]) == frames[i]
        assert sent == ["ah/frame_000000001.isf"]
        # the next batch: frame 5 is published while it is held, frame 6 is never published
        threading.Timer(0.3, put, (n1, "ah/frame_000000005.isf", frames[5])).start()
        got = transport.fetch_when_published(like, "ah/frame_000000005.isf", fd, 1.0,
                                             into=memoryview(room), ahead=3)
        assert got[:2] == (len(frames[5]), xxhash.xxh3_64_hexdigest(frames[5]))
        assert transport.fetch_when_published(like, "ah/frame_000000006.isf", fd, 1.0,
                                              into=memoryview(room), ahead=3) is None
        assert sent == ["ah/frame_000000001.isf", "ah/frame_000000005.isf"]
        put(n1, "ah/frame_000000006.isf", frames[6])
        got = transport.fetch_when_published(like, "ah/frame_000000006.isf", fd, 1.0,
                                             into=memoryview(room), ahead=3)
        assert got[:2] == (len(frames[6]), xxhash.xxh3_64_hexdigest(frames[6]))
        assert sent[-1] == "ah/frame_000000006.isf"  # asked again
    finally:
        os.close(fd)
        transport.close()
    until(lambda: stats(n1)["peers"] == 0, 10, "the batch's connection closed")
    no_traceback(n1)


def test_a_reader_that_asks_for_another_key_drops_what_it_asked_for_ahead(
        nodes: list[LoopbackNode], tmp_path: Path) -> None:
    """Frames asked for ahead and not wanted any more (another key asked for, or
    :meth:`drop_ahead` when a stream's reader closes): the connection is closed (the owner lets
    go of the request), and the other key arrives exact on a new one."""
    n1, n2 = nodes[0], nodes[1]
    like = put(n1, "ad/frame_000000000.isf", b"zero")
    put(n1, "ad/frame_000000001.isf", b"one")
    put(n1, "ad/other", b"other")
    transport = _transport(n2)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        room = bytearray(100)
        got = transport.fetch_when_published(like, "ad/frame_000000001.isf", fd, 30.0,
                                             into=memoryview(room), ahead=3)
        assert got[:2] == (3, xxhash.xxh3_64_hexdigest(b"one"))
        until(lambda: stats(n1)["peers"] == 1, 5, "the batch is held at the owner")
        got = transport.fetch_when_published(like, "ad/other", fd, 5.0, into=memoryview(room))
        assert got[:2] == (5, xxhash.xxh3_64_hexdigest(b"other"))
        until(lambda: stats(n1)["peers"] == 1, 10, "the abandoned batch's connection closed")
        got = transport.fetch_when_published(like, "ad/frame_000000001.isf", fd, 30.0,
                                             into=memoryview(room), ahead=3)  # (the kept one)
        assert got[:2] == (3, xxhash.xxh3_64_hexdigest(b"one"))
        transport.drop_ahead()  # a stream's reader closes
        until(lambda: stats(n1)["peers"] == 0, 10, "the dropped batch's connection closed")
    finally:
        os.close(fd)
        transport.close()
    no_traceback(n1)


COUNTS = {
    "count 1": {"count": 1, "wait": 100},
    "count over the limit": {"count": wire.MAX_COUNT + 1, "wait": 100},
    "count a boolean": {"count": True, "wait": 100},
    "count a string": {"count": "3", "wait": 100},
    "count without a wait": {"count": 3},
}


@pytest.mark.parametrize("fields", COUNTS.values(), ids=COUNTS.keys())
def test_malformed_counts_are_refused(nodes: list[LoopbackNode], fields: dict) -> None:
    reply = raw(nodes[0], forged(**fields))
    assert reply["ok"] is False and reply["error"] == "AuthenticationError"
    no_traceback(nodes[0])


def test_the_count_is_signed(nodes: list[LoopbackNode]) -> None:
    """A captured request for frames ahead with its count changed is refused; signed right, a
    count the C engine cannot serve (the key's file appeared after it looked, or a key that
    needs normalizing) is answered "not found", never with fewer replies than asked for."""
    put(nodes[0], "cs/frame_1", b"x")
    header = wire.sign(TOKEN, "fetch", "cs/frame_0", wait=100, count=3)
    header["count"] = 5
    reply = raw(nodes[0], wire.pack(header))
    assert reply["error"] == "AuthenticationError" and "bad mac" in reply["message"]
    ok = wire.sign(TOKEN, "fetch", "cs//frame_1", wait=100, count=3)  # (normalized by Python)
    reply = raw(nodes[0], wire.pack(ok))
    assert reply["ok"] is False and reply["error"] == "KeyNotFoundError"
    no_traceback(nodes[0])


def _policies(pid: int) -> list[int]:
    """The scheduling policy of each thread of process ``pid``."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # (a thread that ended meanwhile)
            out.append(os.sched_getscheduler(int(tid)))
    return out


@pytest.mark.parametrize("sched", ["auto", "batch"])
def test_a_long_wait_for_a_key_may_preempt_under_auto(own_node: LoopbackNode, sched: str) -> None:
    """The server's threads run under SCHED_BATCH; under "auto" (the default) a fetch that
    waited 50 ms for its key waits on under SCHED_OTHER, so that the publication's wake-up
    may preempt a busy core's thread, and its thread is under SCHED_BATCH again once it
    answered. Under "batch" it never leaves SCHED_BATCH."""
    node = own_node.start("--sched", sched)
    assert node.proc is not None
    pid = node.proc.pid
    assert set(_policies(pid)) == {os.SCHED_BATCH}
    put(node, f"pr-{sched}/early", b"early")  # (a key is waited for in a directory that exists)
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as s:
        s.sendall(wire.pack(wire.sign(TOKEN, "fetch", f"pr-{sched}/late", wait=20_000)))
        if sched == "auto":
            until(lambda: os.SCHED_OTHER in _policies(pid), 5, "the waiting thread raised")
            assert _policies(pid).count(os.SCHED_OTHER) == 1  # (that thread alone)
        else:
            time.sleep(0.5)  # (10 times the threshold of "auto")
            assert set(_policies(pid)) == {os.SCHED_BATCH}
        put(node, f"pr-{sched}/late", b"late")
        (n,) = struct.unpack(">I", recv_all(s, 4))
        reply = json.loads(recv_all(s, n))
        assert reply["ok"] is True and recv_all(s, reply["size"]) == b"late"
        until(lambda: set(_policies(pid)) == {os.SCHED_BATCH}, 5, "the thread lowered again")
    no_traceback(node)


def test_a_waiting_fetch_ends_when_its_wait_runs_out(nodes: list[LoopbackNode], tmp_path: Path) -> None:
    n1, n2 = nodes[0], nodes[1]
    like = put(n1, "wo/first", b"first")
    transport = _transport(n2)
    try:
        start = time.monotonic()
        thread, result = _waiting(transport, like, "wo/never", tmp_path / "never", 0.4)
        thread.join(30)
        assert result == {"got": None, "done": result["done"]}
        assert result["done"] - start >= 0.4  # it was held
        assert (tmp_path / "never").read_bytes() == b""  # nothing received
    finally:
        transport.close()


def test_a_waiting_fetch_is_not_held_while_its_until_name_exists(nodes: list[LoopbackNode],
                                                                 tmp_path: Path) -> None:
    """A stream's reader names the end marker: a stream that ended answers at once."""
    n1, n2 = nodes[0], nodes[1]
    like = put(n1, "wu/first", b"first")
    put(n1, "wu/END", b"{}")
    transport = _transport(n2)
    try:
        start = time.monotonic()
        thread, result = _waiting(transport, like, "wu/next", tmp_path / "next", 30.0, "END")
        thread.join(30)
        assert result.get("got", "missing") is None and result["done"] - start < 10
    finally:
        transport.close()


def test_a_waiting_fetch_ends_when_another_name_appears(nodes: list[LoopbackNode], tmp_path: Path) -> None:
    n1, n2 = nodes[0], nodes[1]
    like = put(n1, "wa/first", b"first")
    transport = _transport(n2)
    try:
        thread, result = _waiting(transport, like, "wa/next", tmp_path / "next", 30.0)
        time.sleep(0.3)
        put(n1, "wa/end_of_stream.json", b"{}")  # e.g. the stream ended instead
        appeared = time.monotonic()
        thread.join(30)
        assert result.get("got", "missing") is None and result["done"] - appeared < 10
    finally:
        transport.close()


WAITS = {
    "wait a boolean": {"wait": True},
    "wait negative": {"wait": -1},
    "wait over the limit": {"wait": wire.MAX_WAIT_MS + 1},
    "wait fractional": {"wait": 1.5},
    "wait a string": {"wait": "100"},
    "until not a string": {"wait": 100, "until": 7},
}


@pytest.mark.parametrize("fields", WAITS.values(), ids=WAITS.keys())
def test_malformed_waits_are_refused(nodes: list[LoopbackNode], fields: dict) -> None:
    reply = raw(nodes[0], forged(**fields))
    assert reply["ok"] is False and reply["error"] == "AuthenticationError"
    no_traceback(nodes[0])


@pytest.mark.parametrize("change", [{"wait": 50}, {"until": "OTHER"}, {"until": None}])
def test_the_wait_and_until_are_signed(nodes: list[LoopbackNode], change: dict) -> None:
    """A captured waiting fetch with its wait or its until name changed is refused."""
    header = wire.sign(TOKEN, "fetch", "ws/k", wait=100, until="END")
    header.update(change)
    if header["until"] is None:
        del header["until"]
    reply = raw(nodes[0], wire.pack(header))
    assert reply["ok"] is False and reply["error"] == "AuthenticationError"
    assert "bad mac" in reply["message"]
    ok = wire.sign(TOKEN, "fetch", "ws/k", wait=100, until="END")
    assert wire.verify(TOKEN, ok) is None
    assert raw(nodes[0], wire.pack(ok))["error"] == "KeyNotFoundError"  # signed right: answered


def test_a_peer_leaving_or_a_stop_ends_a_held_fetch(own_node: LoopbackNode) -> None:
    node = own_node.start()
    put(node, "wl/first", b"first")
    gone = socket.create_connection(("127.0.0.1", node.port), timeout=10)
    gone.sendall(wire.pack(wire.sign(TOKEN, "fetch", "wl/never", wait=wire.MAX_WAIT_MS)))
    until(lambda: stats(node)["peers"] == 1, 5, "the waiting peer connected")
    gone.close()  # the peer goes away: the server lets go of its request
    until(lambda: stats(node)["peers"] == 0, 5, "the held request of a peer gone ended")
    held = socket.create_connection(("127.0.0.1", node.port), timeout=10)
    try:
        held.sendall(wire.pack(wire.sign(TOKEN, "fetch", "wl/never", wait=wire.MAX_WAIT_MS)))
        until(lambda: stats(node)["peers"] == 1, 5, "the waiting peer connected")
        assert node.proc is not None
        start = time.monotonic()
        node.proc.send_signal(signal.SIGTERM)  # a held request does not keep the server up
        node.proc.wait(30)
        assert time.monotonic() - start < 20 and node.proc.returncode == 0
        try:
            ended = held.recv(1)
        except ConnectionResetError:  # ("peers" counts connections: a request the server had
            ended = b""  # not read yet when it stopped is reset by the kernel, not answered)
        assert ended == b""  # closed without a reply
    finally:
        held.close()
    no_traceback(node)


def test_a_stopping_server_sends_no_more_of_what_was_asked_ahead(
        own_node: LoopbackNode) -> None:
    """Frames asked for ahead that are published already are not all sent during the stop's
    grace: the server ends the batch once it is stopping (the grace is for requests in
    flight), after the frame it is sending, and closes the connection."""
    node = own_node.start("--grace", "20")
    frames, size = 40, 1 << 20
    for i in range(frames):
        put(node, f"sa/frame_{i:09d}.isf", bytes([i]) * size)
    sock = socket.create_connection(("127.0.0.1", node.port), timeout=10)
    try:
        sock.sendall(wire.pack(wire.sign(TOKEN, "fetch", "sa/frame_000000000.isf", wait=1000,
                                         count=frames)))

        def reply() -> dict | None:
            prefix = recv_all(sock, 4)
            if len(prefix) < 4:
                return None
            header = json.loads(recv_all(sock, wire.parse_length(prefix)))
            if header.get("ok") and len(recv_all(sock, header["size"])) < header["size"]:
                return None
            return header

        assert reply()["key"] == "sa/frame_000000000.isf"  # type: ignore[index]
        assert node.proc is not None
        node.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # (the stop has begun: the server's thread waits in its send)
        got = 1
        with contextlib.suppress(ConnectionError, OSError):
            while reply() is not None:
                got += 1
        node.proc.wait(30)
        # what TCP's buffers held when the stop came, and the frame then being sent: not all 40
        assert got < frames // 2, got
    finally:
        sock.close()


def test_a_wait_that_is_not_a_plain_integer_is_refused_whole(nodes: list[LoopbackNode]) -> None:
    """``100.0`` or ``1e2`` sign like 100 but are not what a client sends: the C engine does
    not serve them, and the protocol's rules refuse them — never bytes after a wait."""
    n1 = nodes[0]
    put(n1, "wf/here", b"here")
    for text in ("100.0", "1e2", "0100"):
        header = wire.sign(TOKEN, "fetch", "wf/here", wait=100)
        body = json.dumps(header, separators=(",", ":")).replace('"wait":100', f'"wait":{text}')
        reply = raw(n1, struct.pack(">I", len(body)) + body.encode())
        assert reply["ok"] is False and reply["error"] in ("AuthenticationError", "WireError")
    no_traceback(n1)


def _most_inotify_watches(pid: int) -> int:
    """The most watches one inotify instance of process ``pid`` holds (``/proc``'s fdinfo)."""
    most = 0
    for info in Path(f"/proc/{pid}/fdinfo").iterdir():
        with contextlib.suppress(OSError):  # (a descriptor closed meanwhile)
            most = max(most, info.read_text().count("inotify wd:"))
    return most


def test_waiting_fetches_share_the_servers_watches_and_a_miss_keeps_the_connection(
        own_node: LoopbackNode, tmp_path: Path) -> None:
    """Many fetches wait at once, each answered when its own key is published (they share one
    inotify instance: instances are few, and shared by all of a user's processes); at most 64
    directories are watched at once — a fetch in a 65th is answered at once. A request whose
    wait ran out leaves its connection open for the next fetch."""
    node = own_node.start()
    like = put(node, "wb/first", b"first")
    for d in range(65):
        (node.dir / f"wd{d}").mkdir()

    def ask_waiting(key: str) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", node.port), timeout=30)
        s.sendall(wire.pack(wire.sign(TOKEN, "fetch", key, wait=30_000)))
        return s

    def reply(s: socket.socket) -> dict:
        (n,) = struct.unpack(">I", recv_all(s, 4))
        return json.loads(recv_all(s, n))

    same_key = [ask_waiting("wb/next") for _ in range(12)]  # e.g. 12 readers of one stream
    held = [ask_waiting(f"wd{d}/k") for d in range(63)]  # 63 more: 64 directories
    try:
        until(lambda: stats(node)["peers"] == 75, 10, "75 waiting peers")
        # every held request read: 64 directories watched (connected is not read yet)
        until(lambda: _most_inotify_watches(node.proc.pid) == 64, 10, "64 directories watched")
        start = time.monotonic()
        with ask_waiting("wd64/k") as extra:  # a 65th directory: not held
            assert reply(extra)["error"] == "KeyNotFoundError"
        assert time.monotonic() - start < 20  # answered, not held
        put(node, "wb/next", b"next")
        for s in same_key:  # every one of them, from one event
            got = reply(s)
            assert got["key"] == "wb/next" and recv_all(s, got["size"]) == b"next"
        put(node, "wd5/k", b"five")
        assert reply(held[5])["size"] == 4 and recv_all(held[5], 4) == b"five"
    finally:
        for s in same_key + held:
            s.close()
    until(lambda: stats(node)["peers"] == 0, 10, "the waiting peers gone")
    transport = _transport(own_node)
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT, 0o644)
    try:  # (in this thread: connections are kept per thread)
        assert transport.fetch_when_published(like, "wb/later", fd, 0.3) is None
        assert stats(node)["peers"] == 1  # kept open after the miss
        assert transport.fetch_when_published(like, "wb/first", fd, 5.0)[:2] == (  # type: ignore[index]
            5, xxhash.xxh3_64_hexdigest(b"first"))
        assert stats(node)["peers"] == 1  # the same connection served it
    finally:
        os.close(fd)
        transport.close()
    no_traceback(node)


@pytest.mark.parametrize("pieces", [[4, 56], [2, 2, 56], [4, 7, 49], [1, 1, 1, 1, 10, 46]],
                         ids=["whole", "split-prefix", "split-header", "byte-by-byte"])
def test_a_reply_header_is_read_whole_however_it_arrives(pieces: list[int]) -> None:
    """The reply header is taken without a poll when it has arrived whole (the usual case), and
    assembled by the usual receive when it comes in pieces, also within its length prefix;
    nothing of the body after it is taken."""
    header = wire.pack({"ok": True, "key": "a/b", "size": 3, "pad": "x" * 15})
    assert len(header) == sum(pieces)
    body = b"xyz"
    hint = Record("a/b", "127.0.0.1:1", 0, "", 0, 0.0)
    a, b = socket.socketpair()
    try:
        a.settimeout(5)

        def send() -> None:
            _send_in_pieces(b, header, pieces, 0.02)
            b.sendall(body)

        if len(pieces) == 2 and pieces[0] == 4:
            send()  # (all there before the read: no waiting at all)
            sender = None
        else:
            sender = threading.Thread(target=send)
            sender.start()
        reply = TcpTransport._reply(a, hint, 1000)
        assert reply == {"ok": True, "key": "a/b", "size": 3, "pad": "x" * 15}
        assert a.gettimeout() == 5  # (as it was)
        if sender is not None:
            sender.join(5)
        assert a.recv(16) == body
    finally:
        a.close()
        b.close()


def _send_in_pieces(sock: socket.socket, data: bytes, pieces: list[int], pause: float) -> None:
    """Send ``data`` as the given pieces, a pause after each, then the rest (if any)."""
    at = 0
    for n in pieces:
        sock.sendall(data[at:at + n])
        at += n
        time.sleep(pause)
    if at < len(data):
        sock.sendall(data[at:])


def _reply_bytes(header: dict, body: bytes = b"") -> bytes:
    return wire.pack(header) + body


@pytest.fixture
def reply_pair(tmp_path: Path) -> Iterator[tuple[TcpTransport, socket.socket, socket.socket]]:
    """A transport and both ends of a connection: the test writes an owner's replies on one."""
    from instride.config import Settings

    ours, theirs = socket.socketpair()
    ours.settimeout(2.0)
    try:
        yield TcpTransport(Settings(dir=tmp_path, token="t")), ours, theirs
    finally:
        ours.close()
        theirs.close()


HINT = Record(key="rp/frame_000000001.isf", owner="127.0.0.1:1", size=0, checksum="", version=1,
              time=0.0)


def test_a_reply_asked_ahead_comes_whole_in_one_native_call(reply_pair: tuple) -> None:
    """``_reply_into`` (``isc_recv_reply``): header and body, the body hashed from
    ``digest_from`` on; a header arriving in pieces, the body later, makes no difference."""
    transport, ours, theirs = reply_pair
    body = os.urandom(300_000)
    wire_bytes = _reply_bytes({"ok": True, "key": HINT.key, "size": len(body), "published": 7.5},
                              body)
    room = bytearray(400_000)

    def send_slowly() -> None:
        for part in (wire_bytes[:2], wire_bytes[2:9], wire_bytes[9:60], wire_bytes[60:]):
            time.sleep(0.05)
            theirs.sendall(part)

    sender = threading.Thread(target=send_slowly)
    sender.start()
    reply, got = transport._reply_into(ours, HINT, 1.0, memoryview(room), 16)
    sender.join()
    assert reply == {"ok": True, "key": HINT.key, "size": len(body), "published": 7.5}
    assert got == (len(body), xxhash.xxh3_64_hexdigest(body[16:]))
    assert bytes(room[: len(body)]) == body


def test_a_reply_whose_body_does_not_fit_leaves_the_body_to_the_caller(reply_pair: tuple) -> None:
    transport, ours, theirs = reply_pair
    theirs.sendall(_reply_bytes({"ok": True, "key": HINT.key, "size": 50}, b"b" * 50))
    reply, got = transport._reply_into(ours, HINT, 1.0, memoryview(bytearray(10)), 0)
    assert got is None and reply["size"] == 50
    assert recv_all(ours, 50) == b"b" * 50  # (the body is still on the connection, whole)


@pytest.mark.parametrize("header", [{"ok": True, "key": HINT.key, "size": "12"},
                                    {"ok": True, "key": HINT.key}, {"key": HINT.key, "ok": True,
                                                                    "size": 3}],
                         ids=["size a string", "no size", "another order"])
def test_a_reply_of_another_shape_is_left_to_the_caller(reply_pair: tuple, header: dict) -> None:
    """The native call takes a body only where the header is the servers' own shape; any other
    is the caller's to read (and to refuse: see ``_size``)."""
    transport, ours, theirs = reply_pair
    theirs.sendall(_reply_bytes(header, b"xyz"))
    reply, got = transport._reply_into(ours, HINT, 1.0, memoryview(bytearray(100)), 0)
    assert got is None and reply == header


NEXT = Record(key="rp/frame_000000002.isf", owner="127.0.0.1:1", size=0, checksum="", version=1,
              time=0.0)


def _asked(transport: TcpTransport, ours: socket.socket, keys: list[str]) -> None:
    """As if ``keys`` had been asked for ahead on ``ours`` (their request sent)."""
    transport._batches()[_batch(NEXT.owner, NEXT.key)] = (ours, list(keys))


def _room(n: int) -> tuple[bytearray, int, ctypes.Array]:
    room = bytearray(n)
    pin = (ctypes.c_char * n).from_buffer(room)
    return room, ctypes.addressof(pin), pin


def test_a_frame_asked_ahead_comes_checked_in_one_native_call(reply_pair: tuple) -> None:
    """``next_asked`` (``isc_recv_frame``): the reply the servers write for the key asked
    next, its body a frame file that passes its checksums: received and checked in the native
    call, the publication time parsed, the rest of what was asked kept for the next call."""
    transport, ours, theirs = reply_pair
    frame = _frame_bytes(3)
    theirs.sendall(b"".join(
        wire.LENGTH.pack(len(h)) + h + frame for h in [
            b'{"ok":true,"key":"%s","size":%d,"published":1764480000.250000}'
            % (NEXT.key.encode(), len(frame))]))
    _asked(transport, ours, [NEXT.key, "rp/frame_000000003.isf"])
    room, address, _pin = _room(len(frame) + 100)
    got = transport.next_asked(NEXT, NEXT.key, memoryview(room), address, lambda: -1, 1.0)
    assert isinstance(got, tuple)
    received, checked = got
    assert checked and received.size == len(frame) and received.published == 1764480000.25
    assert received.digest == xxhash.xxh3_64_hexdigest(frame[128:])
    assert bytes(room[: len(frame)]) == frame
    assert transport._batches()[_batch(NEXT.owner, NEXT.key)] == (ours, ["rp/frame_000000003.isf"])


def test_a_key_not_asked_ahead_is_left_to_the_usual_way(reply_pair: tuple) -> None:
    """Nothing is read where the key is not the next one asked for: ``False``."""
    transport, ours, theirs = reply_pair
    room, address, _pin = _room(1000)
    assert transport.next_asked(NEXT, NEXT.key, memoryview(room), address, lambda: -1, 1.0) \
        is False
    _asked(transport, ours, ["rp/frame_000000005.isf"])
    theirs.sendall(b"left alone")
    assert transport.next_asked(NEXT, NEXT.key, memoryview(room), address, lambda: -1, 1.0) \
        is False
    assert recv_all(ours, 10) == b"left alone"


@pytest.mark.parametrize("at", [3, 50, 500], ids=["magic", "header field", "payload"])
def test_a_frame_asked_ahead_that_fails_its_checksums_is_refused(reply_pair: tuple,
                                                                  at: int) -> None:
    """A body that is not the frame its header describes (a flipped byte in the header or the
    payload): ``None``, the connection closed (what was asked ahead with it is dropped)."""
    transport, ours, theirs = reply_pair
    frame = bytearray(_frame_bytes(3))
    frame[at] ^= 0xFF
    theirs.sendall(_reply_bytes({"ok": True, "key": NEXT.key, "size": len(frame),
                                 "published": 2.0}, bytes(frame)))
    _asked(transport, ours, [NEXT.key, "rp/frame_000000003.isf"])
    room, address, _pin = _room(len(frame))
    assert transport.next_asked(NEXT, NEXT.key, memoryview(room), address, lambda: -1, 1.0) \
        is None
    assert ours.fileno() == -1 and not transport._batches()


def test_a_frame_asked_ahead_in_a_reply_of_another_shape_is_left_to_the_callers_check(
        reply_pair: tuple) -> None:
    """A reply that is not the servers' exact shape (fields in another order, one more): read
    the usual way, its frame not checked (``checked`` false: the caller checks it)."""
    transport, ours, theirs = reply_pair
    frame = _frame_bytes(3)
    theirs.sendall(_reply_bytes({"key": NEXT.key, "ok": True, "size": len(frame),
                                 "published": 2.5, "more": 1}, frame))
    _asked(transport, ours, [NEXT.key])
    room, address, _pin = _room(len(frame))
    got = transport.next_asked(NEXT, NEXT.key, memoryview(room), address, lambda: -1, 1.0)
    assert isinstance(got, tuple)
    received, checked = got
    assert not checked and received.size == len(frame) and received.published == 2.5
    assert bytes(room) == frame
    assert not transport._batches()  # (nothing more was asked: the connection is kept)


def test_a_frame_asked_ahead_larger_than_the_memory_goes_to_the_file(reply_pair: tuple,
                                                                     tmp_path: Path) -> None:
    """A frame that does not fit the memory given is received into the caller's file, as
    :meth:`fetch_when_published` does (not checked: the caller checks it)."""
    transport, ours, theirs = reply_pair
    frame = _frame_bytes(3)
    theirs.sendall(_reply_bytes({"ok": True, "key": NEXT.key, "size": len(frame),
                                 "published": 3.0}, frame))
    _asked(transport, ours, [NEXT.key])
    room, address, _pin = _room(100)
    fd = os.open(tmp_path / "into", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        got = transport.next_asked(NEXT, NEXT.key, memoryview(room), address, lambda: fd, 1.0)
        assert isinstance(got, tuple) and got[1] is False and got[0].size == len(frame)
        assert got[0].published == 3.0
        assert (tmp_path / "into").read_bytes() == frame
    finally:
        os.close(fd)


def test_a_reply_asked_ahead_for_another_key_is_refused_and_drops_the_rest(
        reply_pair: tuple) -> None:
    transport, ours, theirs = reply_pair
    frame = _frame_bytes(3)
    theirs.sendall(_reply_bytes({"ok": True, "key": "rp/frame_000000009.isf", "size": len(frame),
                                 "published": 3.0}, frame))
    _asked(transport, ours, [NEXT.key, "rp/frame_000000003.isf"])
    room, address, _pin = _room(len(frame))
    with pytest.raises(TransferError, match="frame_000000009"):
        transport.next_asked(NEXT, NEXT.key, memoryview(room), address, lambda: -1, 1.0)
    assert ours.fileno() == -1 and not transport._batches()


@pytest.mark.parametrize("body", [b"", b"ISF1" + bytes(60)], ids=["empty", "shorter than a header"])
def test_a_body_asked_ahead_that_cannot_be_a_frame_is_refused(reply_pair: tuple,
                                                                body: bytes) -> None:
    transport, ours, theirs = reply_pair
    theirs.sendall(_reply_bytes({"ok": True, "key": NEXT.key, "size": len(body),
                                 "published": 1.0}, body))
    _asked(transport, ours, [NEXT.key])
    room, address, _pin = _room(200)
    assert transport.next_asked(NEXT, NEXT.key, memoryview(room), address, lambda: -1, 1.0) \
        is None


def _sent_with_time(reply_pair: tuple, published: bytes) -> tuple[bytearray, int, ctypes.Array]:
    """A frame asked for ahead, its reply the servers' shape with ``published`` as its time
    (written as given); the memory to receive it into."""
    transport, ours, theirs = reply_pair
    frame = _frame_bytes(3)
    header = b'{"ok":true,"key":"%s","size":%d,"published":%s}' % (NEXT.key.encode(), len(frame),
                                                                     published)
    theirs.sendall(wire.LENGTH.pack(len(header)) + header + frame)
    _asked(transport, ours, [NEXT.key])
    return _room(len(frame))


@pytest.mark.parametrize("published", [b"1e400", b"-1e400"])
def test_a_publication_time_past_a_float_is_no_time(reply_pair: tuple, published: bytes) -> None:
    """A time the native parse cannot take as a finite number is left to the usual parse,
    which reads it as no time (as :func:`_seconds` does for any reply)."""
    transport, ours, _ = reply_pair
    room, address, _pin = _sent_with_time(reply_pair, published)
    got = transport.next_asked(NEXT, NEXT.key, memoryview(room), address, lambda: -1, 1.0)
    assert isinstance(got, tuple) and got[1] is False and got[0].published is None


@pytest.mark.parametrize("published", [b"nan", b"inf", b"+1.5", b"0x10", b"01.5", b"1.", b"1e"])
def test_a_publication_time_that_is_no_json_number_is_no_valid_reply(reply_pair: tuple,
                                                                     published: bytes) -> None:
    """The native parse takes only what JSON takes (C's strtod also reads "nan", "inf", a
    "+", hex, leading zeros, a bare "1."): anything else is the usual parse's, which refuses
    the reply."""
    transport, ours, _ = reply_pair
    room, address, _pin = _sent_with_time(reply_pair, published)
    with pytest.raises(PeerUnavailable, match="no valid reply"):
        transport.next_asked(NEXT, NEXT.key, memoryview(room), address, lambda: -1, 1.0)
    assert ours.fileno() == -1


def test_a_frame_asked_ahead_not_published_in_time_is_none(reply_pair: tuple) -> None:
    transport, ours, theirs = reply_pair
    theirs.sendall(_reply_bytes({"ok": False, "error": "KeyNotFoundError",
                                 "message": "not published in time"}))
    _asked(transport, ours, [NEXT.key, "rp/frame_000000003.isf"])
    room, address, _pin = _room(100)
    assert transport.next_asked(NEXT, NEXT.key, memoryview(room), address, lambda: -1, 1.0) \
        is None
    # (the owner's last reply for the request: the connection goes back to the pool, the
    # rest of what was asked is not waited for)
    assert not transport._batches() and transport._pool()[NEXT.owner] is ours


def test_a_full_disk_under_a_fetch_names_the_key(reply_pair: tuple) -> None:
    """A write of the fetched bytes that fails (``ENOSPC``: ``/dev/full``) is an ``OSError``
    with its errno, naming the key and how far the transfer came."""
    transport, ours, theirs = reply_pair
    theirs.sendall(b"z" * 60_000)
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        with pytest.raises(OSError, match=r"No space left on device: writing the copy of "
                                          r"'rp/full\.bin' fetched here \(after \d+ of 60000 bytes\)") as exc:
            transport._stream_to_file(ours, fd, 60_000, "rp/full.bin")
        assert exc.value.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_refusals_asked_ahead_are_typed(reply_pair: tuple) -> None:
    transport, ours, theirs = reply_pair
    theirs.sendall(_reply_bytes({"ok": False, "error": "KeyNotFoundError", "message": "late"}))
    with pytest.raises(KeyNotFoundError):
        transport._reply_into(ours, HINT, 1.0, memoryview(bytearray(100)), 0)
    theirs.sendall(_reply_bytes({"ok": False, "error": "AuthenticationError", "message": "bad"}))
    with pytest.raises(AuthenticationError, match="bad"):
        transport._reply_into(ours, HINT, 1.0, memoryview(bytearray(100)), 0)
    assert ours.fileno() == -1  # (closed: the owner refused the token)


def test_a_stopping_owners_refusal_is_peer_unavailable(reply_pair: tuple) -> None:
    """An owner that is stopping answers a request that came in its grace period so; the
    asker gets :class:`PeerUnavailable` (the owner is going away), not an authentication
    error."""
    transport, ours, theirs = reply_pair
    theirs.sendall(_reply_bytes({"ok": False, "error": "PeerUnavailable",
                                 "message": "server is stopping"}))
    with pytest.raises(PeerUnavailable, match="server is stopping"):
        transport._reply_into(ours, HINT, 1.0, memoryview(bytearray(100)), 0)
    assert ours.fileno() == -1


@pytest.mark.parametrize("size", [-1, -4096, 2.5, True, "12", None])
def test_a_reply_whose_size_is_not_a_byte_count_is_refused(nodes: list[LoopbackNode],
                                                           size: object) -> None:
    """A reply header whose size is negative or not a whole number is a typed error, and no
    byte after it is received: a negative size handed to the native receive would be taken as
    2**64 - 1 bytes and written past the end of the memory given."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    header = {"ok": True, "key": "neg/x.bin", "size": size}
    if size is None:
        del header["size"]

    def fake_owner() -> None:
        conn, _ = listener.accept()
        with conn:
            n = struct.unpack(">I", recv_all(conn, 4))[0]
            recv_all(conn, n)
            conn.sendall(wire.pack(header))
            with contextlib.suppress(OSError):
                conn.sendall(b"\xab" * 65536)

    owner = threading.Thread(target=fake_owner, daemon=True)
    owner.start()
    rec = Record(key="neg/x.bin", owner=f"127.0.0.1:{port}", size=4096, checksum="xxh3:0",
                 version=1, time=time.time(), node="fake")
    mem = bytearray(16 * 4096)  # the memory given is its first page
    t = TcpTransport(nodes[1].settings())
    try:
        with pytest.raises(TransferError, match="not a byte count"):
            t.fetch_when_published(rec, "neg/x.bin", -1, 1.0, into=memoryview(mem)[:4096])
    finally:
        t.close()
        owner.join(5)
        listener.close()
    assert mem == bytes(len(mem))  # nothing received, in the memory given or after it


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Both ends of a loopback TCP connection (a unix socket's poll takes no low-water mark,
    which the native receive sets): ours, theirs."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        theirs = socket.create_connection(listener.getsockname())
        ours, _ = listener.accept()
    return ours, theirs


def test_a_body_that_comes_slowly_but_steadily_is_not_stalled(reply_pair: tuple) -> None:
    """The native receive sleeps until a large piece of the body is there; bytes that keep
    coming, but fewer than that piece within the socket's timeout, are not a stall. A body
    that stops coming is one, after the timeout."""
    transport = reply_pair[0]
    ours, theirs = _tcp_pair()
    with ours, theirs:
        ours.settimeout(0.5)
        body = os.urandom(200_000)
        theirs.sendall(_reply_bytes({"ok": True, "key": HINT.key, "size": len(body)}))
        sender = threading.Thread(target=_send_in_pieces,
                                  args=(theirs, body, [10_000] * 20, 0.1), daemon=True)
        sender.start()  # 2 s for the whole body, 50 KB within each timeout (above the pace)
        into = memoryview(bytearray(len(body)))
        try:
            reply, got = transport._reply_into(ours, HINT, 1.0, into, 0)
        finally:
            sender.join(10)
        assert got == (len(body), xxhash.xxh3_64_hexdigest(body)) and bytes(into) == body
        theirs.sendall(_reply_bytes({"ok": True, "key": HINT.key, "size": len(body)},
                                    body[:50_000]))
        with pytest.raises(TransferError, match="stalled after 50000 of 200000"):
            transport._reply_into(ours, HINT, 1.0, into, 0)


_STOPPED_RECEIVER = """
import ctypes, socket, sys
from instride.transport.tcp.engine import load_library
lib = load_library()
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
size = int(sys.argv[2])
buf = ctypes.create_string_buffer(size)
hexd, got = ctypes.create_string_buffer(17), ctypes.c_uint64(0)
print("ready", flush=True)
rc = lib.isc_recv_mem(sock.fileno(), ctypes.addressof(buf), size, 0, 500, hexd, ctypes.byref(got))
print(rc, got.value, hexd.value.decode() or "-", flush=True)
"""


def test_a_receiver_that_did_not_run_is_not_cut_as_too_slow() -> None:
    """The pace counted a receiver's time stopped (``SIGSTOP``, a debugger, a frozen VM) as
    waiting, and judged it on the one piece it took on resuming: a transfer with megabytes
    queued behind that piece was cut as "too slow". Bytes already in the socket count as
    come now."""
    body = os.urandom(16 << 20)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        child = subprocess.Popen([sys.executable, "-c", _STOPPED_RECEIVER,
                                  str(listener.getsockname()[1]), str(len(body))],
                                 stdout=subprocess.PIPE, text=True)
        try:
            conn, _ = listener.accept()
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            time.sleep(0.2)  # (in its wait for the body's bytes: stopped there)
            stop_process(child.pid)
            sender = threading.Thread(target=conn.sendall, args=(body,), daemon=True)
            sender.start()  # (at full speed, into its socket, until the buffers are full)
            time.sleep(2.5)  # (five stall times: 160 KiB due, more than the one piece taken)
            os.kill(child.pid, signal.SIGCONT)
            rc, got, digest = child.stdout.readline().split()
            sender.join(10)
            assert (int(rc), int(got)) == (0, len(body))
            assert digest == xxhash.xxh3_64_hexdigest(body)
        finally:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.wait(10)
            assert child.stdout is not None
            child.stdout.close()
            with contextlib.suppress(NameError):
                conn.close()


def test_a_silence_after_bytes_below_the_low_water_mark_is_a_stall_in_time(
        reply_pair: tuple) -> None:
    """The native receive sleeps until a large piece is there (a low-water mark), and looked
    at what had come only when the stall time ran out: bytes that came just after the last
    ones, then silence, began the clock again there -- a cut went unnoticed for up to twice
    the stall time, and a silence longer than the stall time (1.7 s of 1 s) was ridden out.
    The queue is looked at every quarter of the stall time now."""
    transport = reply_pair[0]
    ours, theirs = _tcp_pair()
    with ours, theirs:
        ours.settimeout(1.0)
        body = os.urandom(8 << 20)
        theirs.sendall(_reply_bytes({"ok": True, "key": HINT.key, "size": len(body)}))
        def send() -> None:  # (4 MiB, 1,000 bytes 0.05 s later, then 1.7 s of nothing)
            _send_in_pieces(theirs, body[:(4 << 20) + 1000], [4 << 20], 0.05)
            time.sleep(1.7)
            with contextlib.suppress(OSError):
                theirs.sendall(body[(4 << 20) + 1000:])

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        try:
            with pytest.raises(TransferError, match=f"stalled after {(4 << 20) + 1000} of "
                                                    f"{8 << 20} bytes"):
                transport._reply_into(ours, HINT, 1.0, memoryview(bytearray(len(body))), 0)
        finally:
            sender.join(10)


BROKEN = {
    "nothing within the wait": (b"", PeerUnavailable, "no valid reply: Connection timed out"),
    "header length 0": (struct.pack(">I", 0), PeerUnavailable, r"header length 0 out of range"),
    "header length too long": (struct.pack(">I", wire.MAX_HEADER + 1), PeerUnavailable,
                               "out of range"),
    "header not JSON": (struct.pack(">I", 5) + b"{nope", PeerUnavailable, "not valid JSON"),
    "header cut short": (struct.pack(">I", 50) + b'{"ok":', TransferError,
                         "connection closed after 10 bytes of the reply's header"),
    "header stalled": (struct.pack(">I", 50) + b'{"ok":', TransferError,
                       "stalled after 10 bytes of the reply's header"),
    "length prefix stalled": (b"\0\0", TransferError, "stalled after 2 bytes of the reply's"),
    "body cut short": (wire.pack({"ok": True, "key": HINT.key, "size": 10}) + b"abc",
                       TransferError, "after 3 of 10 bytes"),
}


@pytest.mark.parametrize("sent", BROKEN.values(), ids=BROKEN.keys())
def test_broken_replies_asked_ahead_are_typed_and_close_the_connection(
        reply_pair: tuple, sent: tuple) -> None:
    """A reply that never comes, a header of a bad length or not JSON, a header or body that
    breaks off (the owner closes the connection) or stalls: a typed error, the socket closed
    (its next bytes can never be taken for the next frame's). A reply that began and did not
    finish -- its header too -- is a ``TransferError``, as a body cut short (round 48: one cut
    or stalled in its header was ``PeerUnavailable``, as if no reply had come)."""
    transport, ours, theirs = reply_pair
    data, error, message = sent
    ours.settimeout(0.2)
    theirs.sendall(data)
    if (data.startswith(struct.pack(">I", 50)) and "stalled" not in message) \
            or b'"size":10' in data:
        theirs.shutdown(socket.SHUT_WR)  # (the owner went away mid-reply)
    with pytest.raises(error, match=message):
        transport._reply_into(ours, HINT, 0.1, memoryview(bytearray(100)), 0)
    assert ours.fileno() == -1


def test_a_signal_while_a_reply_asked_ahead_is_awaited_runs_its_handler(
        reply_pair: tuple) -> None:
    """A signal that comes while the native call waits for a reply: its Python handler runs
    (as during any wait on a socket) and the wait goes on; a handler that raises (Ctrl-C)
    ends it, the connection closed."""
    transport, ours, theirs = reply_pair
    main = threading.get_ident()
    seen: list[int] = []

    def note(signum: int, _frame: object) -> None:
        seen.append(signum)

    def fail(_signum: int, _frame: object) -> None:
        raise RuntimeError("interrupted by the user")

    old = signal.signal(signal.SIGUSR1, note)
    try:
        body = b"z" * 1000
        threading.Timer(0.1, signal.pthread_kill, (main, signal.SIGUSR1)).start()
        threading.Timer(0.4, theirs.sendall, (_reply_bytes(
            {"ok": True, "key": HINT.key, "size": len(body)}, body),)).start()
        reply, got = transport._reply_into(ours, HINT, 2.0, memoryview(bytearray(2000)), 0)
        assert seen == [signal.SIGUSR1] and got == (len(body), xxhash.xxh3_64_hexdigest(body))
        signal.signal(signal.SIGUSR1, fail)
        sent = threading.Event()

        def reply_late() -> None:
            sent.set()
            theirs.sendall(_reply_bytes({"ok": True, "key": HINT.key, "size": 3}, b"abc"))

        threading.Timer(0.1, signal.pthread_kill, (main, signal.SIGUSR1)).start()
        late = threading.Timer(1.5, reply_late)
        late.start()
        try:
            with pytest.raises(RuntimeError, match="interrupted"):
                transport._reply_into(ours, HINT, 2.0, memoryview(bytearray(2000)), 0)
            assert not sent.is_set()  # (at once, not once the owner answered)
            assert ours.fileno() == -1
        finally:
            late.cancel()
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_a_reply_naming_its_size_twice_is_refused(reply_pair: tuple) -> None:
    """The native call takes the first "size" of a header, JSON the last: a header where they
    differ is refused, never a body of the wrong length taken for a frame."""
    transport, ours, theirs = reply_pair
    header = b'{"ok":true,"key":"%s","size":3,"size":50}' % HINT.key.encode()
    theirs.sendall(struct.pack(">I", len(header)) + header + b"abc")
    with pytest.raises(TransferError, match="malformed reply"):
        transport._reply_into(ours, HINT, 1.0, memoryview(bytearray(100)), 0)
    assert ours.fileno() == -1


@pytest.mark.parametrize("sent", ["nothing", "half a body"])
def test_signals_more_often_than_the_timeout_do_not_make_the_wait_endless(
        reply_pair: tuple, sent: str) -> None:
    """A signal (its handler runs, then the wait goes on) every 50 ms, against a timeout of
    0.5 s: the wait for the reply's first byte, and the wait for the rest of a body that
    stopped coming, started their whole timeout again after each, and never ended (here:
    not until the signals stop, after 4 s)."""
    import signal

    transport, ours, theirs = reply_pair
    ours.settimeout(0.5)
    if sent != "nothing":
        theirs.sendall(_reply_bytes({"ok": True, "key": HINT.key, "size": 1000}, b"x" * 500))
    ticks: list[int] = []
    old = signal.signal(signal.SIGALRM, lambda *_: ticks.append(1))
    stop = threading.Timer(4.0, signal.setitimer, (signal.ITIMER_REAL, 0))
    signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
    stop.start()
    t0 = time.monotonic()
    try:
        with pytest.raises((PeerUnavailable, TransferError)):
            transport._reply_into(ours, HINT, 0.5, memoryview(bytearray(2000)), 0)
        elapsed = time.monotonic() - t0
    finally:
        stop.cancel()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert ticks and elapsed < 3, elapsed


def test_a_peers_numbers_past_what_they_can_mean_are_refused_typed() -> None:
    """A reply announcing a body of 2**64 + 5 bytes (the native receive took it as 5, and a
    file truncated to 2**64 raised OverflowError), or a 400-digit publication time
    (OverflowError out of the receive): a TransferError, and no time."""
    from instride.transport.tcp.client import _seconds, _size

    for size in (1 << 64 | 5, 1 << 63, -1, 2.5, True):
        with pytest.raises(TransferError, match="body size"):
            _size({"ok": True, "size": size}, HINT)
    assert _size({"ok": True, "size": (1 << 63) - 1}, HINT) == (1 << 63) - 1
    assert _seconds(10**400) is None and _seconds(float("nan")) is None and _seconds(7.5) == 7.5


def test_no_reply_to_a_key_asked_for_is_a_typed_error(reply_pair: tuple,
                                                             tmp_path: Path) -> None:
    """``receive_asked`` without ``into``: no reply within the wait was a raw
    ``TimeoutError``, where ``_reply_asked`` gives ``PeerUnavailable``."""
    transport, ours, _theirs = reply_pair
    ours.settimeout(0.3)
    with open(tmp_path / "dest", "wb") as fh, pytest.raises(PeerUnavailable, match="no valid"):
        transport.receive_asked(ours, HINT, HINT.key, fh.fileno(), 0.2)


def test_the_server_takes_the_open_files_it_may(tmp_path: Path) -> None:
    """The data server kept the soft limit of open files (often 1,024) while it served up to
    512 peers at ~3 descriptors each: past ~300, new connections waited unaccepted, held
    fetches missed and the agent's requests failed. It raises the soft limit to the hard
    one, and serves only as many peers at once as that limit allows, with a warning."""
    code = textwrap.dedent("""
        import logging, resource, sys
        logging.basicConfig()
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, int(sys.argv[1])))
        from instride.server import fit_peers
        print(fit_peers(512), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    """)
    for hard, peers in ((8192, 512), (1024, 192)):
        run = subprocess.run([sys.executable, "-c", code, str(hard)], capture_output=True,
                             text=True, timeout=60, check=True)
        assert run.stdout.split() == [str(peers), str(hard)]
        assert ("serving at most 192 peers" in run.stderr) == (peers < 512)


def test_an_owner_that_closes_before_replying_is_unavailable(tmp_path: Path) -> None:
    """An owner that accepts and closes without a reply byte (a server shedding a flood) was a
    TransferError ("connection closed after 0 of 4 header bytes") on the Python path, and
    PeerUnavailable on the native one: no reply at all is PeerUnavailable on both."""
    from instride.config import Settings

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.1)  # (the thread looks at `stop` between accepts)
    port = listener.getsockname()[1]
    stop = threading.Event()

    def shed() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = listener.accept()
                conn.recv(65536)
                conn.close()

    th = threading.Thread(target=shed, daemon=True)
    th.start()
    client = TcpTransport(Settings(dir=tmp_path, token=TOKEN, connect_timeout=2.0))
    rec = Record("k/a.bin", f"127.0.0.1:{port}", 10, "xxh3:" + xxhash.xxh3_64_hexdigest(b"x" * 10),
                 1, 0.0)
    try:
        with pytest.raises(PeerUnavailable):
            client.fetch_bytes(rec)
        with pytest.raises(PeerUnavailable):
            client.fetch(rec, tmp_path / "a.bin")
        assert not (tmp_path / "a.bin").exists()
    finally:
        stop.set()
        client.close()
        listener.close()
        th.join(5)


def test_a_forked_child_keeps_none_of_the_parents_connections_open(
        nodes: list[LoopbackNode], tmp_path: Path) -> None:
    """A child forked while frames were asked for ahead (a ``multiprocessing`` worker that never
    touches instride) kept its copies of the parent's descriptors: the parent's drop of the
    batch and its ``close()`` closed nothing at the owner, which held the request and went
    on sending frames into a connection nobody reads, until the child ended."""
    n1, n2 = nodes[0], nodes[1]
    like = put(n1, "fo/frame_000000000.isf", b"zero")
    put(n1, "fo/frame_000000001.isf", b"one")
    plain = put(n1, "fo/plain.bin", b"plain")
    transport = _transport(n2)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    child = -1
    try:
        got = transport.fetch_when_published(like, "fo/frame_000000001.isf", fd, 30.0,
                                             into=memoryview(bytearray(100)), ahead=3)
        assert got is not None and got.size == 3
        assert transport.fetch_bytes(plain) == b"plain"  # (and a kept-alive connection)
        until(lambda: stats(n1)["peers"] == 2, 10, "the batch and the kept connection")
        child = os.fork()
        if child == 0:  # (a worker that never uses instride)
            try:
                time.sleep(30)
            finally:
                os._exit(0)
        transport.drop_ahead()
        transport.close()
        until(lambda: stats(n1)["peers"] == 0, 10, "the parent's connections closed")
    finally:
        if child > 0:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        os.close(fd)
        transport.close()


def test_a_readers_frames_asked_ahead_on_another_thread_are_taken_over(
        nodes: list[LoopbackNode], tmp_path: Path) -> None:
    """A reader (its own ``batch``) that reads on one thread, then on another (an executor's
    threads): the second thread sent a new request and left the first thread's batch held at
    the owner, which the reader's drop did not reach (the owner sent frames into it for as
    long as that thread lived). Now the batch goes on where it was asked: no new request,
    and the reader's drop closes it."""
    n1, n2 = nodes[0], nodes[1]
    like = put(n1, "tt/frame_000000000.isf", b"zero")
    put(n1, "tt/frame_000000001.isf", b"one")
    put(n1, "tt/frame_000000002.isf", b"two")
    transport = _transport(n2)
    sent = _requests_sent(transport)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    results: dict[str, object] = {}
    first_done, release = threading.Event(), threading.Event()

    def read(name: str, index: int, hold: bool) -> None:
        try:
            results[name] = transport.fetch_when_published(
                like, f"tt/frame_{index:09d}.isf", fd, 30.0, into=memoryview(bytearray(100)),
                ahead=3, batch="reader-x")
        except BaseException as exc:  # (reported by the assertion below)
            results[name] = exc
        if hold:  # (the first thread lives on: an executor's)
            first_done.set()
            release.wait(30)

    first = threading.Thread(target=read, args=("first", 1, True))
    first.start()
    try:
        assert first_done.wait(30)
        second = threading.Thread(target=read, args=("second", 2, False))
        second.start()
        second.join(30)
        assert [r[:2] for r in (results["first"], results["second"])] == [  # type: ignore[index]
            (3, xxhash.xxh3_64_hexdigest(b"one")), (3, xxhash.xxh3_64_hexdigest(b"two"))]
        assert sent == ["tt/frame_000000001.isf"]  # (frame 2 came on what was asked ahead)
        transport.drop_ahead(batch="reader-x")  # the reader closes
        until(lambda: stats(n1)["peers"] == 0, 10, "the reader's batch closed at the owner")
    finally:
        release.set()
        first.join(30)
        os.close(fd)
        transport.close()


def test_a_reader_closed_from_another_thread_as_it_reads_is_no_untyped_error(
        reply_pair: tuple) -> None:
    """The reader's batch dropped from another thread (the reader closed there) just as its
    own thread took it for the next frame: ``next_asked`` raised ``KeyError``, past the
    cluster engine (which lets only typed errors turn into the usual way) to the reader's
    caller. Now it is the usual way (``None``), and the closed connection is not read."""
    transport, ours, theirs = reply_pair
    name = _batch(NEXT.owner, NEXT.key)

    class Racing(dict):  # (the other thread's drop lands between the look and the take)
        def get(self, key: object, default: object = None) -> object:
            found = super().get(key, default)
            dropper = threading.Thread(target=transport.drop_ahead, kwargs={"batch": key})
            dropper.start()
            dropper.join(10)
            return found

    racing = Racing()
    transport._per_thread.get().batches = racing
    racing[name] = (ours, [NEXT.key])
    transport._homes[name] = racing
    room, address, _pin = _room(1000)
    assert transport.next_asked(NEXT, NEXT.key, memoryview(room), address, lambda: -1, 1.0) \
        is None
    assert ours.fileno() == -1 and name not in racing


_STALLING = """
import socket, struct, sys, time
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
while True:
    conn, _ = listener.accept()
    n = struct.unpack(">I", conn.recv(4, socket.MSG_WAITALL))[0]
    conn.recv(n, socket.MSG_WAITALL)
    conn.sendall(bytes.fromhex(sys.argv[1]))  # the start of a reply, then nothing
"""


@pytest.mark.parametrize("sent", [struct.pack(">I", 50) + b'{"ok":', b"\0\0"],
                         ids=["in the header", "in the length prefix"])
def test_an_owner_that_stalls_in_its_reply_header_is_a_transfer_error(
        tmp_path: Path, sent: bytes) -> None:
    """An owner that began its reply and stalled before the header was whole was
    ``PeerUnavailable`` (no valid reply: timed out), as if it had never answered, on the
    Python path (a fetch) and the native one (``_reply_into``) alike: a transfer that began
    and did not finish is a ``TransferError``, as for a stall in the body. (Closed there, it
    was a ``TransferError`` on the Python path already, ``PeerUnavailable`` on the native.)"""
    with _fake_owner(_STALLING, sent, tmp_path, 0.5) as (client, address):
        rec = Record("st/a.bin", address, 10, "xxh3:0", 1, 0.0)
        with pytest.raises(TransferError, match="stalled after"):
            client.fetch_bytes(rec)
        with pytest.raises(TransferError, match="stalled after"):  # (a held fetch's)
            client.fetch_when_published(rec, "st/b.bin", -1, 0.2)
        sock = client.ask_when_published(rec, "st/c.bin", 0.2)
        with pytest.raises(TransferError, match="stalled after"):  # (native)
            client.receive_asked(sock, rec, "st/c.bin", -1, 0.2,
                                 into=memoryview(bytearray(100)))


@contextlib.contextmanager
def _fake_owner(script: str, sent: bytes, tmp_path: Path,
                connect_timeout: float) -> Iterator[tuple[TcpTransport, str]]:
    """An owner process running ``script`` (it prints its port, then answers every request
    with ``sent`` and what the script adds), and a transport whose stall time is
    ``connect_timeout``: the transport and the owner's address; both stopped after."""
    from instride.config import Settings

    owner = subprocess.Popen([sys.executable, "-c", script, sent.hex()],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        port = int(owner.stdout.readline())
        client = TcpTransport(Settings(dir=tmp_path, token=TOKEN,
                                       connect_timeout=connect_timeout))
        try:
            yield client, f"127.0.0.1:{port}"
        finally:
            client.close()
    finally:
        owner.kill()
        owner.wait(10)
        assert owner.stdout is not None
        owner.stdout.close()


_DRIPPING = """
import socket, struct, sys, threading, time
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)

def serve(conn):
    n = struct.unpack(">I", conn.recv(4, socket.MSG_WAITALL))[0]
    conn.recv(n, socket.MSG_WAITALL)
    conn.sendall(bytes.fromhex(sys.argv[1]))  # the start of a reply,
    try:
        for _ in range(24):  # then a byte every 0.25 s: never a stall of 0.4 s, for 6 s
            time.sleep(0.25)
            conn.sendall(b" ")
    except OSError:
        pass

while True:
    threading.Thread(target=serve, args=(listener.accept()[0],), daemon=True).start()
"""

_BODY_HEAD = wire.pack({"ok": True, "key": "dr/a.bin", "size": 1000})


@pytest.mark.parametrize("sent", [_BODY_HEAD, struct.pack(">I", 60) + b'{"ok":'],
                         ids=["in the body", "in the header"])
def test_an_owner_that_drips_its_reply_is_cut_as_too_slow(tmp_path: Path, sent: bytes) -> None:
    """An owner that sent a byte just before each stall time held a fetch for as long as it
    went on (nothing was ever a stall): a reply that began must keep a pace (64 KiB per second
    of waiting for it, reckoned over each stall time), or it is a ``TransferError`` -- on every
    receive path: the Python header read and the native body into memory (``fetch_bytes``),
    the native receive into a file (``fetch``), the native reply into memory
    (``fetch_when_published``). Nothing is left under the destination."""
    where = (r"of 1000 bytes" if sent == _BODY_HEAD else
             r"(of 60 header bytes|bytes of the reply's header)")  # (Python's, C's)
    slow = rf"too slow \(under 64 KiB/s\) after \d+ {where}"
    dest = tmp_path / "copy.bin"
    with _fake_owner(_DRIPPING, sent, tmp_path, 0.4) as (client, address):
        rec = Record("dr/a.bin", address, 1000, "xxh3:0", 1, 0.0)
        for fetch in (lambda: client.fetch_bytes(rec), lambda: client.fetch(rec, dest),
                      lambda: client.fetch_when_published(rec, "dr/a.bin", -1, 0.2,
                                                          into=memoryview(bytearray(2000)))):
            began = time.monotonic()
            with pytest.raises(TransferError, match=slow):
                fetch()
            assert time.monotonic() - began < 5  # (the owner drips for 6 s)
        assert not dest.exists() and os.listdir(tmp_path) == []


def test_a_readers_batch_read_from_two_threads_at_once_is_asked_for_once(
        nodes: list[LoopbackNode], tmp_path: Path) -> None:
    """A reader (its own ``batch``) read from two threads at once: each thread found no
    batch (the other had it) and asked for one of its own, both kept -- two requests held at
    the owner for one reader, the reader's drop reaching only the last one kept (the other
    held, its frames sent into a connection nobody reads, for as long as its thread lived).
    Now the calls take turns: the second goes on on what the first asked ahead."""
    n1, n2 = nodes[0], nodes[1]
    like = put(n1, "two/frame_000000000.isf", b"zero")
    transport = _transport(n2)
    sent = _requests_sent(transport)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    results: dict[int, object] = {}

    def read(index: int) -> None:
        try:
            results[index] = transport.fetch_when_published(
                like, f"two/frame_{index:09d}.isf", fd, 30.0, into=memoryview(bytearray(100)),
                ahead=3, batch="reader-two")
        except BaseException as exc:  # (reported by the assertion below)
            results[index] = exc

    threads = [threading.Thread(target=read, args=(i,)) for i in (1, 2)]
    first, second = threads
    try:
        first.start()
        until(lambda: sent == ["two/frame_000000001.isf"], 10, "the first thread's request")
        second.start()  # (while the first waits for frame 1: the owner holds its request)
        time.sleep(0.3)
        put(n1, "two/frame_000000001.isf", b"one")
        put(n1, "two/frame_000000002.isf", b"two")
        first.join(30)
        second.join(30)
        assert [results[i][:2] for i in (1, 2)] == [  # type: ignore[index]
            (3, xxhash.xxh3_64_hexdigest(b"one")), (3, xxhash.xxh3_64_hexdigest(b"two"))]
        assert sent == ["two/frame_000000001.isf"]  # (frame 2: on what was asked ahead)
        transport.drop_ahead(batch="reader-two")  # the reader closes
        until(lambda: stats(n1)["peers"] == 0, 10, "the reader's one batch closed at the owner")
    finally:
        for th in threads:
            if th.ident is not None:
                th.join(30)
        os.close(fd)
        transport.close()


def test_a_readers_batch_dropped_while_another_thread_reads_on_it_is_closed(
        nodes: list[LoopbackNode], tmp_path: Path) -> None:
    """A reader closed (its batch dropped) from one thread while another thread waited on its
    batch for the next frame: the drop found nothing to close (the reading thread had it),
    and the reading thread then kept the rest of the batch -- held at the owner, never read
    nor dropped again. Now the reading thread closes it."""
    n1, n2 = nodes[0], nodes[1]
    like = put(n1, "dr/frame_000000000.isf", b"zero")
    put(n1, "dr/frame_000000001.isf", b"one")
    transport = _transport(n2)
    sent = _requests_sent(transport)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    results: list[object] = []

    def read() -> None:
        try:
            for index in (1, 2):
                results.append(transport.fetch_when_published(
                    like, f"dr/frame_{index:09d}.isf", fd, 30.0,
                    into=memoryview(bytearray(100)), ahead=3, batch="reader-dr"))
        except BaseException as exc:  # (reported by the assertion below)
            results.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        until(lambda: len(results) == 1, 10, "frame 1")
        home = transport._homes.get("reader-dr")
        # the reading thread took its batch for frame 2 (not published yet: it waits)
        until(lambda: home is not None and "reader-dr" not in home, 10, "the batch taken")
        transport.drop_ahead(batch="reader-dr")  # the reader closes, from this thread
        put(n1, "dr/frame_000000002.isf", b"two")
        reader.join(30)
        assert [r[:2] for r in results] == [  # type: ignore[index]
            (3, xxhash.xxh3_64_hexdigest(b"one")), (3, xxhash.xxh3_64_hexdigest(b"two"))]
        assert sent == ["dr/frame_000000001.isf"]
        until(lambda: stats(n1)["peers"] == 0, 10, "the dropped batch closed at the owner")
    finally:
        reader.join(30)
        os.close(fd)
        transport.close()


def test_close_closes_the_connections_of_every_thread(
        nodes: list[LoopbackNode], tmp_path: Path) -> None:
    """Connections are kept per thread: ``close()`` closed the calling thread's alone, and
    another thread's kept-alive connection and frames asked ahead stayed open (held at the
    owner) until that thread ended or the garbage collector came. Now it closes them all."""
    n1, n2 = nodes[0], nodes[1]
    like = put(n1, "cl/frame_000000000.isf", b"zero")
    put(n1, "cl/frame_000000001.isf", b"one")
    plain = put(n1, "cl/plain.bin", b"plain")
    transport = _transport(n2)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    done, release = threading.Event(), threading.Event()
    results: list[object] = []

    def work() -> None:  # (a worker thread that lives on: an executor's)
        try:
            results.append(transport.fetch_when_published(
                like, "cl/frame_000000001.isf", fd, 30.0, into=memoryview(bytearray(100)),
                ahead=3))
            results.append(transport.fetch_bytes(plain))  # (a connection of its own)
        except BaseException as exc:  # (reported by the assertion below)
            results.append(exc)
        done.set()
        release.wait(30)

    worker = threading.Thread(target=work)
    worker.start()
    try:
        assert done.wait(30)
        assert results[1] == b"plain" and results[0][:2] == (  # type: ignore[index]
            3, xxhash.xxh3_64_hexdigest(b"one"))
        until(lambda: stats(n1)["peers"] == 2, 10, "the kept connection and the batch")
        transport.close()  # (from this thread)
        until(lambda: stats(n1)["peers"] == 0, 10, "the worker's connections closed")
    finally:
        release.set()
        worker.join(30)
        os.close(fd)
        transport.close()


def test_close_while_threads_make_their_first_connections_raises_nothing(tmp_path: Path) -> None:
    """``close()`` goes over every thread's tables; threads making their first ones meanwhile
    changed the registry under that iteration: ``RuntimeError: dictionary changed size during
    iteration`` (untyped) out of ``close()``."""
    import threading

    from instride.config import Settings
    from instride.transport.tcp.client import TcpTransport

    transport = TcpTransport(Settings(dir=tmp_path))
    stop = threading.Event()
    errors: list[BaseException] = []

    def first_tables() -> None:
        while not stop.is_set():
            threads = [threading.Thread(target=lambda: (transport._pool(), transport._batches()))
                       for _ in range(50)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()

    def closer() -> None:
        while not stop.is_set():
            try:
                transport.close()
            except BaseException as exc:  # noqa: BLE001 (what the test looks for)
                errors.append(exc)

    workers = [threading.Thread(target=first_tables), threading.Thread(target=closer)]
    for th in workers:
        th.start()
    time.sleep(4)
    stop.set()
    for th in workers:
        th.join(30)
    assert not errors, errors[:3]
