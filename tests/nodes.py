"""Helpers for tests that talk to real ``instride serve`` processes on loopback.

Raw peer requests (length-prefixed JSON, signed with the job token), Unix-socket lines to the
node agent, and the fixtures of the modules that use them (imported there: ``redis_mod``,
``nodes``, ``own_node``).
"""

from __future__ import annotations

import json
import signal
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from instride.record import Record
from instride.transport import wire
from tests.conftest import LoopbackNode, RedisServer, running_nodes

TOKEN = "test-token"


@pytest.fixture(scope="module")
def redis_mod() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory, redis_mod: RedisServer) -> Iterator[list[LoopbackNode]]:
    """Three running nodes shared by the tests that do not stop them."""
    with running_nodes(tmp_path_factory.mktemp("srv"), redis_mod.url, TOKEN) as made:
        yield made


@pytest.fixture
def own_node(tmp_path: Path, redis_mod: RedisServer) -> Iterator[LoopbackNode]:
    """A node of this test alone (not started: the test passes its options)."""
    node = LoopbackNode(tmp_path, 7, redis_mod.url, TOKEN)
    yield node
    node.stop(signal.SIGKILL)


def raw(node: LoopbackNode, payload: bytes, *, shut: bool = False) -> dict:
    with socket.create_connection(("127.0.0.1", node.port), timeout=5) as s:
        s.sendall(payload)
        if shut:
            s.shutdown(socket.SHUT_WR)
        head = recv_all(s, 4)
        assert len(head) == 4, "server must reply with an error header"
        (n,) = struct.unpack(">I", head)
        body = recv_all(s, n)
        assert len(body) == n
        return json.loads(body)


def recv_all(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def signed(key: str, op: str = "fetch", token: str = TOKEN) -> bytes:
    return wire.pack(wire.sign(token, op, key))


def forged(**fields: object) -> bytes:
    """A signed request with some fields replaced (its MAC no longer matches, or is malformed)."""
    header = wire.sign(TOKEN, "fetch", "any/key")
    header.update(fields)
    return wire.pack(header)


def put(node: LoopbackNode, key: str, data: bytes) -> Record:
    c = node.client()
    try:
        with c.open(key, "wb") as fh:
            fh.write(data)
        rec = c.lookup(key)
    finally:
        c.close()
    assert rec is not None
    return rec


def unix(node: LoopbackNode) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(str(node.dir / ".instride" / "node.sock"))
    return s


def ask(node: LoopbackNode, line: str, timeout: float = 10) -> str:
    with unix(node) as s:
        s.settimeout(timeout)
        s.sendall(line.encode() + b"\n")
        return s.makefile().readline().rstrip("\n")


def stats(node: LoopbackNode) -> dict:
    reply = ask(node, "STATS")
    assert reply.startswith("OK "), reply
    return json.loads(reply[3:])


def until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def no_traceback(node: LoopbackNode) -> None:
    text = node.log.read_text()
    assert "Traceback" not in text, text[-3000:]
