"""The C engine of the tcp transport (libinstride_tcp.so): its fast path and Python's decisions
agree, and they share one replay guard."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from instride.config import Settings
from instride.transport import wire
from instride.transport.tcp.server import TcpServer
from tests.conftest import free_port
from tests.nodes import recv_all


class _Running:
    def __init__(self, root: Path, token: str) -> None:
        self.port = free_port()
        self.root = root
        self.token = token
        self.server = TcpServer(Settings(dir=root, token=token, addr=f"127.0.0.1:{self.port}"))
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.server.start())

    def ask(self, payload: bytes) -> tuple[dict, bytes]:
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
            s.sendall(payload)
            (n,) = struct.unpack(">I", recv_all(s, 4))
            reply = json.loads(recv_all(s, n))
            body = recv_all(s, reply["size"]) if reply.get("ok") and "size" in reply else b""
        return reply, body

    def mtime(self) -> object:
        """The served file's modification time, as a reply's ``published`` (µs: the C engine
        prints it so)."""
        return pytest.approx(os.stat(self.root / "k" / "a.bin").st_mtime, abs=2e-6)

    def stop(self) -> None:
        self.loop.run_until_complete(self.server.stop(1.0))
        self.loop.close()


@pytest.fixture(params=["short-token", "t" * 100 + "\u00e9 and more than 64 bytes"])
def running(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[_Running]:
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "a.bin").write_bytes(b"abc" * 1000)
    node = _Running(tmp_path, request.param)
    try:
        yield node
    finally:
        node.stop()


def test_a_library_of_another_calling_convention_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``libinstride_tcp.so`` left from an older build (its functions take other arguments) is
    refused with a typed error saying what to do, never called."""
    from instride.errors import ConfigError
    from instride.transport.tcp import engine

    other = engine.library_path().with_name("libinstride_local.so")  # (no isc_abi at all)
    monkeypatch.setattr(engine, "_lib", None)
    monkeypatch.setattr(engine, "library_path", lambda: other)
    with pytest.raises(ConfigError, match="another version of instride.*reinstall"):
        engine.load_library()


def test_signed_fetch_is_served_by_the_engine_alone(running: _Running,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="instride.server")
    reply, body = running.ask(wire.pack(wire.sign(running.token, "fetch", "k/a.bin")))
    assert reply == {"ok": True, "key": "k/a.bin", "size": 3000, "published": running.mtime()} \
        and body == b"abc" * 1000
    assert not [r for r in caplog.records if "sending" in r.getMessage()]  # not handed to Python
    # the engine counts a transfer after its last byte left, which can be just after the asker
    # has it all: give the counter a moment (bounded), then require exact values
    deadline = time.monotonic() + 5.0
    while running.server.snapshot()["fetches"] == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    stats = running.server.snapshot()
    assert stats["fetches"] == 1 and stats["bytes_sent"] == 3000
    # the same with a wrong token: refused by Python, with the reason
    reply, body = running.ask(wire.pack(wire.sign("wrong", "fetch", "k/a.bin")))
    assert reply["error"] == "AuthenticationError" and "bad mac" in reply["message"] and not body


def test_one_replay_guard_for_both_paths(running: _Running) -> None:
    header = wire.sign(running.token, "fetch", "k/a.bin")
    assert running.ask(wire.pack(header))[0]["ok"] is True  # the engine's fast path
    # the same request again, byte for byte: refused
    reply, body = running.ask(wire.pack(header))
    assert reply["error"] == "AuthenticationError" and "replayed" in reply["message"] and not body
    # ... and formatted otherwise (an escaped character: the engine hands it to Python), the
    # MAC still valid: refused as well, Python asks the engine's guard
    raw = json.dumps(header, separators=(",", ":")).replace('"fetch"', '"\\u0066etch"').encode()
    reply, body = running.ask(struct.pack(">I", len(raw)) + raw)
    assert reply["error"] == "AuthenticationError" and "replayed" in reply["message"] and not body
    # a request first seen by Python (a field the engine does not know) spends its nonce too
    odd = dict(wire.sign(running.token, "fetch", "k/a.bin"), extra=1)
    assert running.ask(wire.pack(odd))[0]["ok"] is True
    odd.pop("extra")
    assert "replayed" in running.ask(wire.pack(odd))[0]["message"]


def test_the_replay_guard_forgets_each_nonce_as_it_leaves_the_window(running: _Running) -> None:
    """The guard remembers a nonce while its timestamp is inside the 300 s window, and forgets
    the oldest first, also when two clients' clocks differ: over twelve minutes of requests at
    four a second it holds at most five minutes' worth, and refuses none of them."""
    from instride.transport.tcp.engine import load_library

    lib, handle = load_library(), running.server._handle
    rate, t0 = 4, time.time() + 1e5  # (later than any request this test's server saw)
    refused = []
    for i in range(12 * 60 * rate):
        now = t0 + i / rate
        ts = now - (0.5 if i % 2 else 0.0)  # (the second client's clock is 0.5 s behind)
        nonce = b"nonce-%08d" % i
        rc = lib.iss_replay_check(handle, nonce, len(nonce), ts, now)
        if rc != 0:
            refused.append((i, rc))
    assert refused == []
    assert 300 * rate - 2 <= running.server.replay_held() <= 300 * rate + 2


def test_a_nonce_forgotten_at_the_windows_edge_is_not_fresh_again(running: _Running) -> None:
    """Two clock readings decide a request: its window check, then the guard (also another
    thread's later one, which forgets the nonces past the window). A replay whose timestamp
    reached the window's edge passed the first on its reading while another request's reading
    had just made the guard forget its nonce: served again. What the guard forgets, it
    refuses from then on (its floor), in the engine and in Python's guard (UCX)."""
    from instride.transport.replay import ReplayGuard
    from instride.transport.tcp.engine import load_library

    lib, handle = load_library(), running.server._handle
    t = time.time() + 2e5  # (later than any request this test's server saw)
    assert lib.iss_replay_check(handle, b"captured", 8, t, t) == 0
    assert lib.iss_replay_check(handle, b"captured", 8, t, t + 299.9) == 1  # a replay: refused
    assert lib.iss_replay_check(handle, b"another", 7, t + 1, t + 300.0001) == 0  # forgets it
    assert lib.iss_replay_check(handle, b"captured", 8, t, t + 299.9999) != 0  # still refused
    guard = ReplayGuard()
    assert guard.check("captured", t, now=t) is None
    assert guard.check("another", t + 1, now=t + 300.0001) is None
    assert guard.check("captured", t, now=t + 299.9999) is not None


def test_a_request_that_comes_while_the_server_stops_is_told_so(running: _Running) -> None:
    """A request Python answers after :meth:`stop` began (in the grace it gives transfers):
    "server is stopping", as ``PeerUnavailable`` (the asker's error for an owner going away),
    never as a refused token."""
    header = json.dumps(dict(wire.sign(running.token, "fetch", "k/a.bin"), extra=1)).encode()
    handle, running.server._handle = running.server._handle, None  # (as stop() leaves it)
    try:
        reply, fd, size, keep = running.server.decide(header, "127.0.0.1:1")
    finally:
        running.server._handle = handle
    assert reply == {"ok": False, "error": "PeerUnavailable", "message": "server is stopping"}
    assert fd is None and size == 0 and keep is False


def test_a_server_out_of_descriptors_says_so(running: _Running) -> None:
    """A server that cannot open the file for want of descriptors answers PeerUnavailable
    ("cannot open ... now"), never "not found": the key is there, the server is not able."""
    import resource

    header = json.dumps(dict(wire.sign(running.token, "fetch", "k/a.bin"), extra=1)).encode()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest = os.open("/dev/null", os.O_RDONLY)  # the lowest free descriptor number
    os.close(lowest)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))  # (the next open: EMFILE)
    try:
        reply, fd, size, keep = running.server.decide(header, "127.0.0.1:1")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert reply["error"] == "PeerUnavailable", reply
    assert reply["message"] == "cannot open k/a.bin now: Too many open files"
    assert fd is None and keep is False


def test_engine_declines_what_python_refuses(running: _Running, tmp_path: Path) -> None:
    (tmp_path / "k" / "link").symlink_to(tmp_path / "k" / "a.bin")
    (tmp_path / "k" / "sub").mkdir()
    cases = {
        "k/link": ("KeyNotFoundError", "symbolic link"),
        "k/sub": ("KeyNotFoundError", "not a regular file"),
        "k/none": ("KeyNotFoundError", "k/none"),
        "../outside": ("KeyValidationError", ""),
        "k/./a.bin": ("", ""),  # needs normalizing: Python serves it under its normal name
    }
    for key, (err, text) in cases.items():
        reply, body = running.ask(wire.pack(wire.sign(running.token, "fetch", key)))
        if not err:
            assert reply == {"ok": True, "key": "k/a.bin", "size": 3000,
                             "published": running.mtime()} and body == b"abc" * 1000
            continue
        assert reply["error"] == err and text in reply["message"], (key, reply)
        assert not body


def test_engine_not_built_is_a_config_error_naming_the_packages(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from instride.errors import ConfigError
    from instride.transport.tcp import engine

    monkeypatch.setattr(engine, "_lib", None)
    monkeypatch.setattr(engine, "library_path", lambda: tmp_path / "libinstride_tcp.so")
    with pytest.raises(ConfigError, match="libssl-dev libxxhash-dev"):
        engine.load_library()
    (tmp_path / "libinstride_tcp.so").write_bytes(b"not an ELF file")
    with pytest.raises(ConfigError, match="cannot load libinstride_tcp.so"):
        engine.load_library()


def test_a_waiting_fetch_spends_its_nonce_before_it_waits(running: _Running) -> None:
    """A signed fetch that waits for its key spends its nonce as it arrives: the same bytes
    sent again while it waits are refused at once as a replay (they neither hold a server
    thread for the wait nor race the request they copy), and the waiting request is still
    served once its key is published."""
    header = wire.sign(running.token, "fetch", "k/late.bin", wait=10_000)
    first = socket.create_connection(("127.0.0.1", running.port), timeout=20)
    try:
        first.sendall(wire.pack(header))
        time.sleep(0.3)  # (the first request is waiting inside the server now)
        start = time.monotonic()
        reply, body = running.ask(wire.pack(header))
        assert reply["error"] == "AuthenticationError" and "replayed" in reply["message"]
        assert not body and time.monotonic() - start < 5.0  # (answered, not held for the wait)
        (running.root / "k" / ".late.tmp").write_bytes(b"late")  # (published whole)
        os.rename(running.root / "k" / ".late.tmp", running.root / "k" / "late.bin")
        (n,) = struct.unpack(">I", recv_all(first, 4))
        reply = json.loads(recv_all(first, n))
        assert reply["ok"] is True and recv_all(first, reply["size"]) == b"late"
    finally:
        first.close()


def test_a_waiting_fetch_that_misses_is_told_not_found(running: _Running) -> None:
    """A fetch whose wait ends before its key is published gets "not found" (the engine hands
    it to Python, which answers), not a refusal of the nonce the engine already spent."""
    reply, body = running.ask(wire.pack(wire.sign(running.token, "fetch", "k/never.bin", wait=200)))
    assert reply["ok"] is False and reply["error"] == "KeyNotFoundError" and not body
