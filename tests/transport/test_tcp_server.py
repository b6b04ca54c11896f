"""The TCP transport's data server (``transport/tcp/server.py`` and ``csrc/tcp/serve.c``):
what peers without the job token can and cannot do to it.

Real ``instride serve`` processes on loopback (tests/nodes.py), raw sockets for the peers.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from instride.transport import wire
from tests import nodes as loopback
from tests.conftest import LoopbackNode, build_shim, child_env, free_port
from tests.nodes import TOKEN, put, raw, recv_all, signed, stats, until

_C = Path(__file__).resolve().parent / "c"

# the fixtures (tests/nodes.py): a node of a test alone, its Redis
redis_mod, own_node = loopback.redis_mod, loopback.own_node


def _ping(s: socket.socket) -> dict:
    s.sendall(signed("", op="ping"))
    head = recv_all(s, 4)
    assert len(head) == 4, "the connection was closed"
    return json.loads(recv_all(s, struct.unpack(">I", head)[0]))


def test_connections_without_a_request_do_not_take_the_places_of_served_ones(
        own_node: LoopbackNode) -> None:
    """At ``--max-peers``, connections that never sent a whole request (no token needed: a
    port scan, a peer sending its header a byte at a time) took the place of a client's
    kept-alive connection (closed to make room for them), and every new client was told
    "busy" for as long as they were held (each up to the request timeout, then opened
    again). The one that has waited the longest for its request now makes room first."""
    node = own_node.start("--max-peers", "2", "--request-timeout", "10")
    put(node, "room/k", b"served")
    client = socket.create_connection(("127.0.0.1", node.port), timeout=10)
    silent: list[socket.socket] = []
    try:
        assert _ping(client)["ok"] is True  # (kept alive, idle)
        # a header that never ends, then a connection that sends nothing
        slow = socket.create_connection(("127.0.0.1", node.port), timeout=10)
        silent.append(slow)
        slow.sendall(struct.pack(">I", 200) + b'{"op":')
        until(lambda: stats(node)["peers"] == 2, 5, "2 peers")
        time.sleep(0.3)
        silent.append(socket.create_connection(("127.0.0.1", node.port), timeout=10))
        assert slow.recv(1) == b"", "the oldest connection without a request makes room"
        time.sleep(0.3)
        # the client's kept-alive connection was left alone, and a new client is served
        assert _ping(client)["ok"] is True
        reply = raw(node, wire.pack(wire.sign(TOKEN, "fetch", "room/k")))
        assert reply["ok"] is True, reply
        assert silent[1].recv(1) == b""
    finally:
        client.close()
        for s in silent:
            s.close()


def _reply(s: socket.socket) -> dict:
    head = recv_all(s, 4)
    assert len(head) == 4, "the connection was closed without a reply"
    return json.loads(recv_all(s, struct.unpack(">I", head)[0]))


def test_a_first_request_read_whole_is_never_shut_to_make_room(
        own_node: LoopbackNode, tmp_path: Path) -> None:
    """At ``--max-peers``, a connection whose first request had come whole could be shut to
    make room: its thread had read the request and not yet cleared its "pending" mark (nothing
    unread, no request answered yet: the first to go), and its client got no reply. Now the
    mark is cleared before the request's last byte is read. ``c/header_delay.c`` holds the
    server's thread for 2 s in the read of the request, widening that moment."""
    shim = build_shim(_C / "header_delay.c", tmp_path, "-ldl")
    mark = tmp_path / "read"
    own_node.env.update(LD_PRELOAD=str(shim), HEADER_DELAY_MARK=str(mark))
    node = own_node.start("--max-peers", "1")
    put(node, "pe/slowpoke.bin", b"served")
    first = socket.create_connection(("127.0.0.1", node.port), timeout=10)
    other = None
    try:
        first.sendall(signed("pe/slowpoke.bin"))
        until(mark.exists, 10, "the server reading the request")
        time.sleep(0.3)  # (past the grace a new connection's request is given)
        other = socket.create_connection(("127.0.0.1", node.port), timeout=10)
        reply = _reply(first)
        assert reply["ok"] is True and reply["size"] == len(b"served"), reply
        assert recv_all(first, reply["size"]) == b"served"
        busy = _reply(other)  # (no place for it: the served one keeps its own)
        assert busy["error"] == "PeerUnavailable" and busy["message"].startswith("busy"), busy
    finally:
        first.close()
        if other is not None:
            other.close()


def _cpu_s(pid: int) -> float:
    """The CPU time (user + system, seconds) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_urgent_byte_in_a_first_request_neither_spins_nor_refuses_it(
        own_node: LoopbackNode) -> None:
    """The first request's last byte is read only once the server saw it there unread; it
    asked FIONREAD, which counts nothing past an out-of-band (urgent) byte, while poll said
    readable and a peek saw the byte: a peer (no token needed) that sent an urgent byte before
    its header's last one made the connection's thread spin a core, taking the server's lock
    each turn, until the request timeout -- and then the request was refused ("timed out
    reading the request header"), where the server before answered it at once (the kernel
    leaves an urgent byte out of the stream). The byte is looked for with a peek now, which
    sees what the read will get."""
    node = own_node.start("--request-timeout", "20")
    put(node, "oob/k.bin", b"served")
    request = signed("oob/k.bin")
    with socket.create_connection(("127.0.0.1", node.port), timeout=60) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(request[:-1])
        time.sleep(0.2)
        s.send(b"X", socket.MSG_OOB)
        time.sleep(0.05)
        cpu, began = _cpu_s(node.proc.pid), time.monotonic()
        s.send(request[-1:])
        reply = _reply(s)
        took, spent = time.monotonic() - began, _cpu_s(node.proc.pid) - cpu
        assert reply["ok"] is True and recv_all(s, reply["size"]) == b"served", reply
    assert took < 10, f"answered after {took:.1f} s"
    assert spent < 5, f"the server used {spent:.1f} s of CPU meanwhile"


_STOPPING = """
import asyncio, socket, sys, time
from pathlib import Path
from instride.config import Settings
from instride.transport import wire
from instride.transport.tcp.server import TcpServer
root = Path(sys.argv[1])
(root / "k").mkdir()
(root / "k" / "big.bin").write_bytes(bytes(32 << 20))
server = TcpServer(Settings(dir=root, token="t", addr=f"127.0.0.1:{sys.argv[2]}"),
                   send_timeout=120)
loop = asyncio.new_event_loop()
loop.run_until_complete(server.start())
peer = socket.socket()
peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
peer.connect(("127.0.0.1", server.port))
peer.sendall(wire.pack(wire.sign("t", "fetch", "k/big.bin")))  # and never read
time.sleep(0.5)  # (the server is now writing into a full socket: a transfer in flight)
began = time.monotonic()
loop.run_until_complete(server.stop(0.5))
print(time.monotonic() - began, flush=True)
"""


def test_a_stop_is_bounded_on_the_monotonic_clock(tmp_path: Path) -> None:
    """The stop's grace for transfers in flight (and its wait for their threads) was a
    deadline on the wall clock: a clock set back while it waited (NTP, an administrator) made
    the stop wait that much longer -- a day, for a clock set back a day. ``c/clock_shift.c``
    makes the wall clock read 30 s ahead of the kernel's (as if set back by 30 s once read):
    the stop with a 0.5 s grace took 30.5 s; it is bounded on the monotonic clock now."""
    shim = build_shim(_C / "clock_shift.c", tmp_path, "-ldl")
    (tmp_path / "root").mkdir()
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(_STOPPING),
                          str(tmp_path / "root"), str(free_port())],
                         env=child_env(LD_PRELOAD=str(shim), CLOCK_SHIFT_S="30"),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert float(run.stdout) < 15, f"the stop took {run.stdout.strip()} s"


def test_malformed_requests_cannot_grow_the_log_without_bound(own_node: LoopbackNode) -> None:
    """Every malformed request (no token needed: anyone who reaches the port) wrote a warning
    line of its own: a peer sending bad length prefixes in a loop grew the server's log without
    bound (a disk filled). Now at most a burst of such lines a second are written, the first
    ones kept, and the rest are counted in one "suppressed" line."""
    node = own_node.start()
    before = node.log.read_text().count("\n")
    sent = 400
    for _ in range(sent):
        with socket.create_connection(("127.0.0.1", node.port), timeout=10) as s:
            s.sendall(struct.pack(">I", 0))  # a header length out of range
            assert _reply(s)["ok"] is False
    time.sleep(1.2)  # (a new second: the next line reports what was suppressed)
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as s:
        s.sendall(struct.pack(">I", 0))
        _reply(s)
    until(lambda: "suppressed" in node.log.read_text(), 10, "the suppressed summary")
    text = node.log.read_text()
    grown = text.count("\n") - before
    assert "header length 0 out of range" in text, "the first ones are kept"
    assert grown < sent / 2, f"{grown} log lines for {sent + 1} malformed requests"


def test_requests_with_a_wrong_token_cannot_grow_the_log_without_bound(
        own_node: LoopbackNode) -> None:
    """A request framed well but not signed with the job's token (no token needed to send
    one) reaches the server's Python side, which wrote a warning line for each: the same
    flood as malformed requests, through another door. At most a burst a second now, the rest
    counted in one "suppressed" line."""
    node = own_node.start()
    before = node.log.read_text().count("\n")
    sent = 300
    for _ in range(sent):
        with socket.create_connection(("127.0.0.1", node.port), timeout=10) as s:
            s.sendall(wire.pack(wire.sign("not-the-token", "fetch", "any/k")))
            assert _reply(s)["ok"] is False
    time.sleep(1.2)  # (a new second: the next line reports what was suppressed)
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as s:
        s.sendall(wire.pack(wire.sign("not-the-token", "fetch", "any/k")))
        _reply(s)
    until(lambda: "suppressed" in node.log.read_text(), 10, "the suppressed summary")
    text = node.log.read_text()
    assert "refused request from" in text, "the first ones are kept"
    assert text.count("\n") - before < sent / 2, text.count("\n") - before
