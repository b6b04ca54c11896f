"""The TCP transport's data server (``transport/tcp/server.py`` and ``csrc/tcp/serve.c``):
what peers without the job token can and cannot do to it.

Real ``instride serve`` processes on loopback (tests/nodes.py), raw sockets for the peers.
"""

from __future__ import annotations

import json
import socket
import struct
import time

from instride.transport import wire
from tests import nodes as loopback
from tests.conftest import LoopbackNode
from tests.nodes import TOKEN, put, raw, recv_all, signed, stats, until

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
