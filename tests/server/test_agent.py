"""The node server: the agent's Unix-socket protocol for thin clients, write-once across
nodes, waits that never starve publications, and SIGTERM with pending waits.

Tests share three module-scoped nodes (real ``instride serve`` processes on loopback and one
Redis); tests that stop a server start their own.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest

from instride.agent import one_line
from instride.emulate import EmulatedCluster
from tests import nodes as loopback
from tests.conftest import LoopbackNode, RedisServer
from tests.nodes import ask, no_traceback, put, stats, unix, until

# the fixtures (tests/nodes.py): three running nodes, one of a test alone, their Redis
redis_mod, nodes, own_node = loopback.redis_mod, loopback.nodes, loopback.own_node


# ---------------------------------------------------------------------- thin clients
def test_unix_socket_protocol(nodes: list[LoopbackNode]) -> None:
    n1, n2, n3 = nodes
    put(n1, "u/frame", b"abc" * 100)
    assert ask(n2, "PING") == "OK pong"
    assert ask(n2, "CONSUME 5000 u/frame") == f"OK {n2.dir / 'u' / 'frame'}"
    assert (n2.dir / "u" / "frame").read_bytes() == b"abc" * 100
    assert ask(n2, "CONSUME 200 u/never").startswith("ERR 110 ")
    assert ask(n2, "CONSUME 0 u/never").startswith("ERR 110 ")
    assert ask(n2, "CONSUME 200 ../x").startswith("ERR 22 ")
    assert ask(n2, "CONSUME soon u/frame").startswith("ERR 22 ")
    assert ask(n2, "CONSUME -2 u/frame").startswith("ERR 22 ")  # only -1 means "default"
    assert ask(n2, "BOGUS").startswith("ERR 22 ")
    assert ask(n2, "x" * 9000).startswith("ERR 7 ")
    (n2.dir / "u" / "shim.out").write_bytes(b"from the shim")
    assert ask(n2, "PUBLISH u/shim.out") == f"OK {n2.dir / 'u' / 'shim.out'}"
    # a second PUBLISH of the very file recorded (this node, the same bytes) is confirmed, as
    # one that settles an unsettled publication is; it keeps the original
    assert ask(n2, "PUBLISH u/shim.out") == f"OK {n2.dir / 'u' / 'shim.out'}"
    assert (n2.dir / "u" / "shim.out").read_bytes() == b"from the shim"
    (n1.dir / "u" / "shim.out").write_bytes(b"another file")  # another node's: refused
    assert ask(n1, "PUBLISH u/shim.out").startswith("ERR 17 ")
    assert not (n1.dir / "u" / "shim.out").exists()
    assert ask(n2, "PUBLISH u/absent").startswith("ERR 2 ")
    c3 = n3.client()
    try:
        assert c3.consume("u/shim.out", timeout=5).read_bytes() == b"from the shim"
    finally:
        c3.close()
    # several requests on one connection
    with unix(n2) as s:
        f = s.makefile("rw")
        for _ in range(3):
            f.write("PING\n")
            f.flush()
            assert f.readline() == "OK pong\n"
    # restrictive modes
    assert oct(os.stat(n2.dir / ".instride" / "node.sock").st_mode & 0o777) == "0o600"
    assert oct(os.stat(n2.dir / ".instride").st_mode & 0o777) == "0o700"


def test_a_thin_clients_next_numbered_key_is_asked_of_its_owner_while_it_waits(
        nodes: list[LoopbackNode]) -> None:
    """``CONSUME`` of a key not on the node waits as a Python consumer walking a stream does:
    once the node fetched ``k000001`` from node 1, the wait for ``k000002`` asks node 1 for it,
    and node 1 sends it as it is published (``fetched_early`` in ``STATS``), not after a
    request sent once the publication was heard."""
    n1, n2, _ = nodes
    for i, data in ((1, b"one"), (2, b"two")):
        key = f"early/k{i:06d}"
        before = stats(n2)
        got: list[str] = []
        waiter = threading.Thread(target=lambda k=key, out=got: out.append(
            ask(n2, f"CONSUME 10000 {k}")))
        waiter.start()
        until(lambda: stats(n2)["waiting"] == 1, 5, "the CONSUME is waiting")
        time.sleep(0.2)  # (its wait has started: the early ask is out, where there is one)
        put(n1, key, data)
        waiter.join(15)
        assert got == [f"OK {n2.dir / key}"] and (n2.dir / key).read_bytes() == data
        after = stats(n2)
        assert after["fetched"] == before["fetched"] + 1
        # the first key is fetched once heard; the next is asked for early
        assert after["fetched_early"] == before["fetched_early"] + (i == 2), i


def test_a_consume_is_answered_by_its_worker_and_the_connection_goes_on(
        nodes: list[LoopbackNode]) -> None:
    """The worker thread that has a ``CONSUME``'s path writes ``OK <path>`` to the client
    itself (no hop back to the event loop: ``answered_at_once`` in ``STATS``); the connection
    then answers its next requests in order, also ones sent before the answer was read."""
    n1, n2, _ = nodes
    put(n1, "direct/a", b"a")
    path = n2.dir / "direct" / "a"
    before = stats(n2)["answered_at_once"]
    with unix(n2) as s:
        s.settimeout(10)
        f = s.makefile("rw")
        for line, want in (("CONSUME 5000 direct/a", f"OK {path}"), ("PING", "OK pong"),
                           ("CONSUME 5000 direct/a", f"OK {path}")):
            f.write(line + "\n")
            f.flush()
            assert f.readline() == want + "\n"
        f.write("CONSUME 5000 direct/a\nPING\nCONSUME 200 direct/never\nPING\n")  # (at once)
        f.flush()
        got = [f.readline() for _ in range(4)]
        assert got[:2] == [f"OK {path}\n", "OK pong\n"] and got[3] == "OK pong\n", got
        assert got[2].startswith("ERR 110 "), got  # (an error: the event loop answers it)
    assert stats(n2)["answered_at_once"] == before + 3
    assert path.read_bytes() == b"a"


_PRODUCE = ("import os, sys, instride\n"
            "with instride.open(sys.argv[1], 'wb') as fh:\n"
            "    fh.write(os.urandom(int(sys.argv[2])))\n")


def test_a_fetch_outlasting_the_consumes_timeout_sends_progress_lines() -> None:
    """``CONSUME``'s timeout bounds the wait for the key's publication, not the transfer: a key
    published on another node whose bytes take longer to come than the request's timeout (12
    MiB over a 20 Mbit/s link: ~5 s, for ``CONSUME 0``) is answered with ``WAIT <ms>`` lines
    while the fetch goes on (the first a second after the request, then about each second:
    the thin client re-arms its deadline on each), then ``OK <path>``; a request sent after
    it on the same connection is answered after that, in order. A small key fetched at once
    gets its one line, as ever."""
    with EmulatedCluster(nodes=2) as c:
        for key, size in (("slow/big.bin", 12 << 20), ("slow/small.bin", 1000)):
            made = c.run(1, [sys.executable, "-c", _PRODUCE, key, str(size)], capture_output=True,
                         text=True, timeout=60)
            assert made.returncode == 0, made.stderr
        # (what node 2 receives, at the hub's end of its link)
        subprocess.run(["tc", "-n", c.hub, "qdisc", "replace", "dev", "n2", "root", "tbf", "rate",
                        "20mbit", "burst", "64kb", "latency", "100ms"], check=True)
        sock = c.node(2).dir / ".instride" / "node.sock"
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(30)
            s.connect(str(sock))
            f = s.makefile("rw")
            f.write("CONSUME 0 slow/small.bin\n")
            f.flush()
            assert f.readline() == f"OK {c.node(2).dir / 'slow' / 'small.bin'}\n"
            start = time.monotonic()
            f.write("CONSUME 0 slow/big.bin\nPING\n")
            f.flush()
            lines = []
            while not lines or lines[-1].startswith("WAIT "):
                lines.append(f.readline())
            took = time.monotonic() - start
            assert f.readline() == "OK pong\n"
        big = c.node(2).dir / "slow" / "big.bin"
        assert lines[-1] == f"OK {big}\n", lines
        assert took > 3, "the transfer was not slow: the test shows nothing"
        progress = [int(line.split()[1]) for line in lines[:-1]]
        # (a second apart, the first after a second: generous bounds)
        assert len(progress) >= 2 and 900 <= progress[0] < progress[-1], lines
        assert big.read_bytes() == (c.node(1).dir / "slow" / "big.bin").read_bytes()


def test_publish_is_write_once_across_nodes(nodes: list[LoopbackNode]) -> None:
    n1, n2, n3 = nodes
    first = put(n1, "wo/k.bin", b"first")
    mine = n2.dir / "wo" / "k.bin"
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.write_bytes(b"second")
    reply = ask(n2, "PUBLISH wo/k.bin")
    assert reply.startswith("ERR 17 "), reply
    assert not mine.exists(), "the conflicting local file must be removed"
    c3 = n3.client()
    try:
        rec = c3.lookup("wo/k.bin")
        assert rec is not None and rec.owner == n1.addr and rec.version == first.version
        # The explicit overwrite form takes the key over, as a new version.
        mine.write_bytes(b"second")
        assert ask(n2, "OVERWRITE wo/k.bin") == f"OK {mine}"
        rec = c3.lookup("wo/k.bin")
        assert rec is not None and rec.owner == n2.addr and rec.version == first.version + 1
        assert c3.consume("wo/k.bin", timeout=5).read_bytes() == b"second"
    finally:
        c3.close()


def test_delete_forgets_the_record_of_an_original_removed_on_its_node(
        nodes: list[LoopbackNode]) -> None:
    """``DELETE <key>`` (a thin client removed the key's file): the record goes where the file
    removed was this node's original, as the Python client's ``delete`` -- other nodes no
    longer see the key, and it may be published again. A key whose file is still in place,
    another node's key (a fetched copy removed, or a conflicting file the engine removed), and
    a key never published keep their records; the answer is ``OK <path>`` each time."""
    n1, n2, n3 = nodes
    put(n1, "del/mine", b"original")
    assert ask(n1, "DELETE del/mine") == f"OK {n1.dir / 'del' / 'mine'}"  # still in place
    c3 = n3.client()
    try:
        assert c3.lookup("del/mine") is not None
        os.unlink(n1.dir / "del" / "mine")
        assert ask(n1, "DELETE del/mine") == f"OK {n1.dir / 'del' / 'mine'}"
        assert c3.lookup("del/mine") is None
        with c3.open("del/mine", "wb") as fh:  # (write-once: refused while the record stayed)
            fh.write(b"again")
        put(n2, "del/theirs", b"n2's")
        assert ask(n1, "CONSUME 5000 del/theirs").startswith("OK ")
        os.unlink(n1.dir / "del" / "theirs")  # a copy removed: n1's cache only
        assert ask(n1, "DELETE del/theirs") == f"OK {n1.dir / 'del' / 'theirs'}"
        assert c3.consume("del/theirs", timeout=5).read_bytes() == b"n2's"
        assert ask(n1, "DELETE del/never") == f"OK {n1.dir / 'del' / 'never'}"
        assert ask(n1, "DELETE ../x").startswith("ERR 22 ")
    finally:
        c3.close()
    no_traceback(n1)


@pytest.mark.parametrize("when", ["before the look", "after the look"])
def test_a_delete_never_unpublishes_a_publication_made_meanwhile(
        nodes: list[LoopbackNode], when: str) -> None:
    """``DELETE`` after a thin client's ``rm`` of an original looked at the file, then at the
    record, then deleted the key as ``Client.delete`` does: another process of the node that
    published the key again in between (a producer's next run) **lost its new file and its
    record** (unpublished everywhere, no error). Only the record goes, and only while it is
    the one looked up; a file in place is never touched."""
    from instride.agent import LocalAgent

    n1 = nodes[0]
    key = f"race/{when.split()[0]}"  # (the nodes serve the module's tests)
    a, b = n1.client(), n1.client()  # (two processes of one node)
    try:
        with a.open(key, "wb") as fh:
            fh.write(b"first")
        os.unlink(n1.dir / key)  # (the shim's unlink; its DELETE follows)

        def publish_again() -> None:
            with b.open(key, "wb", overwrite=True) as fh:
                fh.write(b"second")

        if when == "before the look":
            real_lookup = a.lookup

            def lookup(key: str, *args: Any, **kw: Any) -> Any:
                publish_again()
                return real_lookup(key, *args, **kw)

            a.lookup = lookup  # type: ignore[method-assign]
        else:
            real_delete = a.metadata.delete_if  # type: ignore[attr-defined]

            def delete_if(record: Any) -> bool:
                publish_again()
                return bool(real_delete(record))

            a.metadata.delete_if = delete_if  # type: ignore[attr-defined]
        agent = types.SimpleNamespace(settings=a.settings, client=a)
        LocalAgent._unpublish(agent, key)  # type: ignore[arg-type]
        assert (n1.dir / key).read_bytes() == b"second"
        record = b.lookup(key)
        assert record is not None and record.version >= 2, record
    finally:
        a.close()
        b.close()


def test_one_line_flattens_messages() -> None:
    assert one_line("a\nb\r\nc\rd\x0be\x00f\u2028g") == "a b c d e f g"
    assert one_line("x" * 5000) == "x" * 1000
    assert "\n" not in one_line("Traceback:\n  line 1\n  line 2\n")


def test_waits_never_starve_publications_and_end_with_their_clients(nodes: list[LoopbackNode]) -> None:
    n3 = nodes[2]
    base = stats(n3)
    conns = []
    try:
        for _ in range(80):
            s = unix(n3)
            s.sendall(b"CONSUME -1 never/k\n")
            conns.append(s)
        # 64 wait threads busy, 16 waits queued behind them
        until(lambda: stats(n3)["waiting"] == 64, 10, "64 waits running")

        def quick_requests_answer() -> None:
            ready = n3.dir / "busy" / f"ready-{time.monotonic_ns()}.bin"
            ready.parent.mkdir(parents=True, exist_ok=True)
            ready.write_bytes(b"r")
            key = ready.relative_to(n3.dir).as_posix()
            start = time.monotonic()
            assert ask(n3, f"PUBLISH {key}", timeout=5) == f"OK {ready}"
            assert ask(n3, f"CONSUME 1000 {key}", timeout=5) == f"OK {ready}"
            assert time.monotonic() - start < 5

        quick_requests_answer()
        for s in conns[:40]:
            s.close()
        # the abandoned waits end (no reply to nobody); the 16 queued ones got threads
        until(lambda: stats(n3)["waiting"] == 40, 8, "abandoned waits ended")
        assert stats(n3)["abandoned"] - base["abandoned"] >= 24
        quick_requests_answer()
        # the remaining waits are still pending
        for s in conns[40:]:
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
    finally:
        for s in conns:
            s.close()
    until(lambda: stats(n3)["waiting"] == 0, 8, "all waits ended")
    assert stats(n3)["abandoned"] - base["abandoned"] == 80
    assert n3.proc is not None and n3.proc.poll() is None
    no_traceback(n3)


def test_waits_on_an_outdated_copy_do_not_hold_up_publications(nodes: list[LoopbackNode]) -> None:
    """A key this node holds a copy of, overwritten since on its owner: a CONSUME found a file
    there and ran in the few quick threads, where it waited on a fetch from the owner (here
    stopped) — five such waits held PUBLISH back until the fetches gave up."""
    from tests.conftest import stop_process

    n1, _, n3 = nodes
    put(n1, "outdated/k", b"first")
    assert ask(n3, "CONSUME 5000 outdated/k") == f"OK {n3.dir / 'outdated' / 'k'}"  # (a copy)
    c1 = n1.client()
    try:
        with c1.open("outdated/k", "wb", overwrite=True) as fh:
            fh.write(b"second")
    finally:
        c1.close()
    assert n1.proc is not None
    stop_process(n1.proc.pid)
    conns = []
    try:
        for _ in range(5):
            s = unix(n3)
            s.sendall(b"CONSUME -1 outdated/k\n")
            conns.append(s)
        time.sleep(0.3)  # (the five waits under way, fetching from the stopped owner)
        mine = n3.dir / "outdated" / "mine.bin"
        mine.write_bytes(b"m")
        assert ask(n3, "PUBLISH outdated/mine.bin", timeout=10) == f"OK {mine}"
        for s in conns:  # (still waiting: PUBLISH was not queued behind them)
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
    finally:
        os.kill(n1.proc.pid, signal.SIGCONT)
        for s in conns:
            s.close()
    no_traceback(n3)


def test_a_client_gone_with_a_request_unread_ends_its_wait(own_node: LoopbackNode) -> None:
    """A client that sent a second request after its CONSUME and closed the connection is gone
    (its wait ends and frees the thread), although a request of it waits unread; one that only
    shut down its sending side still gets its answer."""
    node = own_node.start("--workers", "2")
    base = stats(node)["abandoned"]
    for _ in range(2):
        with unix(node) as s:
            s.sendall(b"CONSUME -1 never/k\nPING\n")
    until(lambda: stats(node)["abandoned"] == base + 2 and stats(node)["waiting"] == 0, 8,
          "waits of clients gone ended")
    with unix(node) as s:  # both threads free again: served
        s.sendall(b"CONSUME 5000 half/k\n")
        s.shutdown(socket.SHUT_WR)
        time.sleep(0.5)
        put(node, "half/k", b"late")
        assert s.makefile().readline() == f"OK {node.dir / 'half' / 'k'}\n"
    no_traceback(node)


def test_a_thin_client_beside_a_deleted_original_is_told_it_is_gone(
        nodes: list[LoopbackNode]) -> None:
    """A CONSUME on the owner node of a key whose original was deleted (its record left) is
    answered ERR 2 after a moment, although the server waits in slices of a second."""
    n1 = nodes[0]
    put(n1, "gone/thin.bin", b"x" * 100)
    os.unlink(n1.dir / "gone" / "thin.bin")
    time.sleep(1.1)  # (the record is older than the moment a file may take to get its name)
    start = time.monotonic()
    assert ask(n1, "CONSUME 20000 gone/thin.bin", timeout=30).startswith("ERR 2 ")
    assert time.monotonic() - start < 10
    no_traceback(n1)


def test_redis_refusing_a_publication_is_a_typed_answer_not_an_internal_error(
        tmp_path: Path, redis_server: RedisServer) -> None:
    """A thin client's ``PUBLISH`` while Redis refuses writes (``maxmemory`` reached) is
    answered with the refusal's errno (``ENOSPC``) and Redis's message, not as an internal
    error: nothing counted in ``errors``, no traceback in the server's log."""
    import errno

    import redis

    node = LoopbackNode(tmp_path, 8, redis_server.url, loopback.TOKEN)
    try:
        node.start()
        (node.dir / "oom").mkdir(parents=True, exist_ok=True)
        (node.dir / "oom" / "a.out").write_bytes(b"shim output")
        redis.Redis.from_url(redis_server.url).config_set("maxmemory", "1")
        reply = ask(node, "PUBLISH oom/a.out")
        assert reply.startswith(f"ERR {errno.ENOSPC} ") and "OOM" in reply, reply
        assert "internal error" not in reply, reply
        assert stats(node)["errors"] == 0
        no_traceback(node)
    finally:
        node.stop(signal.SIGKILL)


def test_a_request_line_longer_than_max_line_is_refused(nodes: list[LoopbackNode]) -> None:
    """``MAX_LINE`` is the longest request line the agent takes (its newline aside): one
    byte more is refused with ``E2BIG``, also below the read buffer's larger limit."""
    from instride.agent import MAX_LINE

    n1 = nodes[0]
    assert ask(n1, "x" * MAX_LINE).startswith("ERR 22 ")  # (taken: an unknown request)
    assert ask(n1, "x" * (MAX_LINE + 1)).startswith("ERR 7 ")
    assert ask(n1, "CONSUME 0 " + "k" * (MAX_LINE + 100)).startswith("ERR 7 ")


def test_a_consume_queued_behind_busy_workers_keeps_to_its_timeout(own_node: LoopbackNode) -> None:
    node = own_node.start("--workers", "1")
    with unix(node) as busy:
        busy.sendall(b"CONSUME -1 never/a\n")  # (holds the one wait thread)
        until(lambda: stats(node)["waiting"] == 1, 5, "the wait running")
        start = time.monotonic()
        assert ask(node, "CONSUME 500 never/b", timeout=10).startswith("ERR 110 ")
        assert time.monotonic() - start < 5
    no_traceback(node)


def test_requests_that_are_not_utf8_or_ask_for_an_endless_timeout_are_refused(
        nodes: list[LoopbackNode]) -> None:
    """A key that is not UTF-8 is refused, never mended into another key (whose file would be
    served); a timeout too large to be one is refused, not an internal error."""
    n1 = nodes[0]
    (n1.dir / "c").mkdir(exist_ok=True)
    (n1.dir / "c" / "b\ufffd.bin").write_bytes(b"someone else's")
    with unix(n1) as s:
        s.sendall(b"CONSUME 100 c/b\xfe.bin\n")
        assert s.makefile().readline().startswith("ERR 22 request is not valid UTF-8")
    assert ask(n1, "CONSUME 99999999999999999999999 c/x").startswith("ERR 22 bad timeout")
    assert stats(n1)["errors"] == 0
    no_traceback(n1)


def test_a_half_sent_line_times_out_and_connections_are_capped(
        managed_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection that does not send a whole line within LINE_TIMEOUT is answered ERR 110
    and closed; connections beyond the cap are answered ERR 24 and closed."""
    import asyncio

    from instride import agent as agent_mod
    from instride.client import Client
    from instride.config import Settings

    monkeypatch.setattr(agent_mod, "LINE_TIMEOUT", 0.5)
    settings = Settings.from_env()
    client = Client(settings)

    async def scenario() -> list[bytes]:
        agent = agent_mod.LocalAgent(settings, client)
        agent.max_connections = 2
        await agent.start()
        try:
            path = str(settings.socket)
            r1, w1 = await asyncio.open_unix_connection(path)
            w1.write(b"CONSUME 100 half")  # (no end of line)
            r2, w2 = await asyncio.open_unix_connection(path)
            w2.write(b"PING\n")  # (a whole line at once: served)
            second = await asyncio.wait_for(r2.readline(), 5)
            r3, w3 = await asyncio.open_unix_connection(path)  # one too many
            third = await asyncio.wait_for(r3.read(), 5)
            first = await asyncio.wait_for(r1.read(), 5)  # (answered, then closed)
            for w in (w1, w2, w3):
                w.close()
            return [first, second, third]
        finally:
            await agent.stop(1.0)

    try:
        first, second, third = asyncio.run(scenario())
    finally:
        client.close()
    assert first.startswith(b"ERR 110 no whole request line within 0.5 s")
    assert second == b"OK pong\n"
    assert third.startswith(b"ERR 24 too many connections")


def test_a_directory_whose_path_breaks_lines_is_not_served(tmp_path: Path) -> None:
    import asyncio

    from instride.agent import LocalAgent
    from instride.client import Client
    from instride.config import Settings
    from instride.errors import ServeError

    root = tmp_path / "a\nb"
    root.mkdir()
    settings = Settings(dir=root)
    client = Client(settings)
    try:
        with pytest.raises(ServeError, match="line break"):
            asyncio.run(LocalAgent(settings, client).start())
    finally:
        client.close()


# ---------------------------------------------------------------------- lifecycle
def test_sigterm_with_pending_waits_exits_cleanly(own_node: LoopbackNode) -> None:
    node = own_node.start("--grace", "2")
    assert ask(node, "PING") == "OK pong"  # started and serving
    conns = []
    try:
        for i in range(5):
            s = unix(node)
            s.sendall(f"CONSUME -1 never/{i}\n".encode())
            conns.append(s)
        until(lambda: stats(node)["waiting"] == 5, 10, "5 waits pending")
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


# ---------------------------------------------------------------------- scheduling policy
def _policies(pid: int) -> set[int]:
    """The scheduling policies of every thread of process ``pid``."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.add(os.sched_getscheduler(int(tid)))
        except ProcessLookupError:  # (a thread that ended meanwhile)
            continue
    return out


@pytest.mark.parametrize(("args", "env", "policy"), [
    ((), "", os.SCHED_BATCH),
    (("--sched", "auto"), "normal", os.SCHED_BATCH),
    (("--sched", "normal"), "", os.SCHED_OTHER),
    ((), "normal", os.SCHED_OTHER),
    (("--sched", "batch"), "normal", os.SCHED_BATCH),
    (("--sched", "inherit"), "", os.SCHED_IDLE)])
def test_the_servers_threads_run_under_the_chosen_policy(own_node: LoopbackNode,
                                                         args: tuple[str, ...], env: str,
                                                         policy: int) -> None:
    # SCHED_BATCH by default ("auto"; a thread raised for a long wait is tested with the tcp
    # transport): woken by a publication, a server thread does not preempt the simulation on
    # a busy core; every thread started (transport, agent workers) inherits it.
    # Started under SCHED_IDLE (as by `chrt -i`): "normal" leaves it, "inherit" keeps it.
    # INSTRIDE_SERVE_SCHED chooses where --sched does not.
    if env:
        own_node.env["INSTRIDE_SERVE_SCHED"] = env
    before = os.sched_getscheduler(0)
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    try:
        node = own_node.start(*args)
    finally:
        os.sched_setscheduler(0, before, os.sched_param(0))
    assert ask(node, "PING") == "OK pong"
    assert node.proc is not None
    assert _policies(node.proc.pid) == {policy}


def test_a_policy_the_system_refuses_is_a_warning(tmp_path: Path) -> None:
    # a process under SCHED_IDLE without the right to leave it (no CAP_SYS_NICE: a user
    # namespace's root; RLIMIT_NICE 0): the server says so and runs as it was started,
    # rather than not starting at all
    chrt, unshare = shutil.which("chrt"), shutil.which("unshare")
    assert chrt and unshare, "util-linux's chrt and unshare are needed (apt-get install util-linux)"
    code = ("import logging, os, resource; resource.setrlimit(resource.RLIMIT_NICE, (0, 0)); "
            "logging.basicConfig(); from instride.server import set_policy; "
            "set_policy('batch'); print(os.sched_getscheduler(0))")
    proc = subprocess.run([chrt, "-i", "0", unshare, "--user", "--map-root-user", sys.executable,
                           "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(os.SCHED_IDLE)
    assert "scheduling policy batch refused (Operation not permitted)" in proc.stderr


def test_an_unknown_policy_is_refused() -> None:
    from instride.server import set_policy

    with pytest.raises(ValueError, match="unknown scheduling policy 'fifo'"):
        set_policy("fifo")


def test_a_taken_address_is_a_clear_error(tmp_path: Path) -> None:
    # another process listens on the address: one line naming it, exit status 6, no traceback
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        addr = f"127.0.0.1:{taken.getsockname()[1]}"
        env = dict(os.environ, INSTRIDE_DIR=str(tmp_path), INSTRIDE_ADDR=addr)
        env.pop("INSTRIDE_REDIS_URL", None)
        proc = subprocess.run([sys.executable, "-m", "instride", "serve"], env=env,
                              capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert proc.returncode == 6, proc.stderr
    assert f"cannot listen on {addr}: Address already in use" in proc.stderr
    assert "Traceback" not in proc.stderr


def _serve(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "instride", "serve", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_second_server_on_the_same_socket_is_refused_and_leaves_it(
        own_node: LoopbackNode) -> None:
    # a second `instride serve` on the same INSTRIDE_DIR (another port): exit 6, naming the
    # socket; the first one's socket stays in place and answers
    node = own_node.start()
    sock = node.dir / ".instride" / "node.sock"
    made = os.stat(sock).st_ino
    from tests.conftest import free_port

    env = dict(node.env, INSTRIDE_ADDR=f"127.0.0.1:{free_port()}")
    proc = _serve(env)
    assert proc.returncode == 6, proc.stderr
    assert f"{sock}: another data server answers on this socket" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert os.stat(sock).st_ino == made
    assert ask(node, "PING") == "OK pong"


def test_a_stale_socket_is_replaced_and_a_later_servers_socket_kept(
        own_node: LoopbackNode) -> None:
    # a socket nobody listens on (a server killed with SIGKILL) is replaced at start; a server
    # stopping removes its socket only if the path still holds the one it made
    sock = own_node.dir / ".instride" / "node.sock"
    sock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock))
    stale.close()
    node = own_node.start()
    assert ask(node, "PING") == "OK pong"
    sock.unlink()  # replaced meanwhile by another server's socket
    other = socket.socket(socket.AF_UNIX)
    other.bind(str(sock))
    try:
        theirs = os.stat(sock).st_ino
        assert node.proc is not None
        node.proc.send_signal(signal.SIGTERM)
        assert node.proc.wait(15) == 0
        assert os.stat(sock).st_ino == theirs, "a later server's socket must stay"
    finally:
        other.close()


def test_sighup_stops_the_server_in_order(own_node: LoopbackNode) -> None:
    """SIGHUP (the terminal or ssh session closed) went to the CLI's handler, which raised
    inside the event loop: the server never stopped in order — waiting clients got a bare
    EOF, the socket stayed. It stops as for SIGTERM now (status 129)."""
    node = own_node.start()
    assert ask(node, "PING") == "OK pong"
    s = unix(node)
    try:
        s.sendall(b"CONSUME -1 never/there\n")
        until(lambda: stats(node)["waiting"] == 1, 10, "the wait pending")
        assert node.proc is not None
        node.proc.send_signal(signal.SIGHUP)
        assert node.proc.wait(15) == 129
        assert s.makefile().readline().startswith("ERR 103 ")
    finally:
        s.close()
    assert not (node.dir / ".instride" / "node.sock").exists()
    assert "Traceback" not in node.log.read_text()


def test_a_socket_path_naming_a_users_file_is_refused_not_removed(tmp_path: Path) -> None:
    """``--socket ~/notes.txt`` (a typo, or INSTRIDE_SOCKET naming a file): connecting to it is
    refused as to a dead server's socket, and the file was removed to make room."""
    notes = tmp_path / "notes.txt"
    notes.write_text("precious data")
    env = dict(os.environ, INSTRIDE_DIR=str(tmp_path / "managed"))
    env.pop("INSTRIDE_REDIS_URL", None)
    proc = _serve(env, "--socket", str(notes))
    assert proc.returncode == 6, proc.stderr
    assert "exists and is not a socket" in proc.stderr
    assert notes.read_text() == "precious data"


def test_sigint_exits_130_sigterm_0(own_node: LoopbackNode) -> None:
    node = own_node.start()
    assert node.proc is not None
    node.proc.send_signal(signal.SIGINT)
    assert node.proc.wait(15) == 130
    node = own_node.start()
    assert node.proc is not None
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(15) == 0
    assert "Traceback" not in node.log.read_text()


@pytest.mark.parametrize(("option", "value"), [
    ("--grace", "nan"), ("--grace", "inf"), ("--grace", "-1"), ("--grace", "2147484"),
    ("--send-timeout", "3000000"), ("--send-timeout", "0"), ("--send-timeout", "inf"),
    ("--request-timeout", "2147483.5"), ("--request-timeout", "nan"),
    ("--request-timeout", "1_0")])
def test_durations_are_finite_and_fit_the_engine(option: str, value: str,
                                                 tmp_path: Path) -> None:
    env = dict(os.environ, INSTRIDE_DIR=str(tmp_path))
    env.pop("INSTRIDE_REDIS_URL", None)
    proc = _serve(env, option, value)
    assert proc.returncode == 2, proc.stderr
    assert f"argument {option}: must be a finite number of seconds" in proc.stderr
    assert "at most 2147483" in proc.stderr


def test_the_library_refuses_durations_the_engine_cannot_take(tmp_path: Path) -> None:
    from instride.config import Settings
    from instride.errors import ConfigError
    from instride.server import NodeServer

    settings = Settings.from_env({"INSTRIDE_DIR": str(tmp_path)})
    for kw in ({"grace": float("nan")}, {"grace": -1.0}, {"send_timeout": 3e6},
               {"request_timeout": 0.0}, {"request_timeout": float("inf")}):
        with pytest.raises(ConfigError, match="at most 2147483"):
            NodeServer(settings, **kw)  # type: ignore[arg-type]


def test_warnings_about_the_address_peers_are_told() -> None:
    from instride.cli.serve import address_warnings

    ok = address_warnings("10.0.0.11:7437", True, None)
    assert ok == [] and address_warnings("10.0.0.11:7437", True, "0.0.0.0:7437") == []
    assert address_warnings("10.0.0.11:7437", True, "10.0.0.11:7437") == []
    [unset, loop] = address_warnings("127.0.0.1:7437", False, "10.0.0.11:7437")
    assert "INSTRIDE_ADDR is unset" in unset and "10.0.0.11:7437" in unset
    assert "loopback" in loop
    [unset, loop] = address_warnings("127.0.0.1:7437", False, "0.0.0.0:7437")
    assert "INSTRIDE_ADDR is unset" in unset
    [differs] = address_warnings("10.0.0.11:7437", True, "10.0.0.12:7437")
    assert "peers are told INSTRIDE_ADDR=10.0.0.11:7437" in differs
    [differs] = address_warnings("10.0.0.11:7437", True, "0.0.0.0:9000")
    assert "listens on 0.0.0.0:9000" in differs
    [wild] = address_warnings("0.0.0.0:7437", True, None)
    assert "a wildcard" in wild
    assert "loopback" in address_warnings("127.0.0.1:7437", True, None)[0]


def test_serve_warns_when_listen_differs_from_instride_addr(own_node: LoopbackNode) -> None:
    from tests.conftest import free_port

    del own_node.env["INSTRIDE_ADDR"]
    node = own_node.start("--listen", f"127.0.0.1:{free_port()}")
    assert ask(node, "PING") == "OK pong"
    assert "INSTRIDE_ADDR is unset: producers of this node record 127.0.0.1:7437" in \
        node.log.read_text()
