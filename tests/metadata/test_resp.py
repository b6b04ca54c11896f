"""The lean Redis connection: pipelined calls and deferred commands, against a real Redis."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import redis

from instride.metadata.redis import RedisMetadata
from instride.metadata.resp import RespConnection
from tests.conftest import RedisServer


def _conn(server: RedisServer) -> RespConnection:
    return RespConnection(server.host, server.port, 0, None, None, 5.0, 5.0)


def test_deferred_replies_are_read_before_the_next_calls(redis_server: RedisServer) -> None:
    conn = _conn(redis_server)
    conn.defer([("HSET", "h", "a", 1), ("HSET", "h", "b", 2)])
    assert conn.deferred == 2
    # the next call gets its own replies, not the deferred ones
    assert conn.call([("HGET", "h", "a"), ("HGET", "h", "b")]) == [b"1", b"2"]
    assert conn.deferred == 0
    conn.close()


def test_replies_asked_for_soon_never_go_to_another_caller(redis_server: RedisServer) -> None:
    conn = _conn(redis_server)
    conn.call([("SET", "k1", "one"), ("SET", "k2", "two")])
    conn.defer([("SET", "k3", "three")])  # a deferred reply ahead of everything
    first = conn.call_soon([("GET", "k1")])
    assert first() == [b"one"]
    abandoned = conn.call_soon([("GET", "k1")])  # (its function not called before the next use)
    assert conn.call([("GET", "k2")]) == [b"two"]  # not k1's reply
    conn.defer([("SET", "k4", "four")])
    later = conn.call_soon([("GET", "k3")])
    assert later() == [b"three"]
    assert abandoned() == [b"one"]  # kept for it meanwhile
    gone = conn.call_soon([("GET", "k2")])
    conn.close()
    with pytest.raises(ConnectionError):  # lost with the connection: an error, not a wrong reply
        gone()
    assert conn.call([("GET", "k4")]) == [b"four"]  # reconnects, in step


def test_several_replies_owed_at_once_go_to_their_callers(redis_server: RedisServer) -> None:
    # call_soon does not read the replies owed before it: several may be owed at once,
    # each goes to its own function whatever the order they are called in, and answered()
    # says when the oldest is readable without waiting
    conn = _conn(redis_server)
    conn.call([("SET", "a", "1"), ("SET", "b", "2"), ("SET", "c", "3")])
    assert conn.answered()  # (none owed)
    owed = [conn.call_soon([("GET", k)]) for k in ("a", "b", "c")]
    deadline = time.monotonic() + 5
    while not conn.answered() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert conn.answered()
    assert owed[1]() == [b"2"]  # (reads a's reply on the way, for a)
    assert owed[0]() == [b"1"]
    assert conn.call([("GET", "a")]) == [b"1"]  # c's reply read and kept first
    assert owed[2]() == [b"3"]
    lost = [conn.call_soon([("GET", k)]) for k in ("a", "b")]
    conn.close()
    for fn in lost:
        with pytest.raises(ConnectionError):
            fn()
    conn.close()


def test_answered_works_for_a_socket_past_descriptor_1023(redis_server: RedisServer) -> None:
    # (select() refuses such descriptors; a producer holding many files gets them)
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
    conn = _conn(redis_server)
    try:
        conn.call([("SET", "hi", "1")])
        assert conn.sock is not None and conn.sock.fileno() > 1023
        owed = conn.call_soon([("GET", "hi")])
        deadline = time.monotonic() + 5
        while not conn.answered() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert conn.answered() and owed() == [b"1"]
    finally:
        conn.close()
        for fd in held:
            os.close(fd)


def test_a_failed_deferred_command_surfaces_at_the_next_defer_not_at_other_calls(
        redis_server: RedisServer) -> None:
    """A deferred command's error answer is read by whatever call comes next, but raised only
    by the next ``defer`` (or ``raise_deferred``): the call that read it succeeded, and must
    not report a failure of its own (a publication would be undone after Redis stored it)."""
    conn = _conn(redis_server)
    conn.call([("SET", "s", "x")])
    conn.defer([("HSET", "s", "a", 1)])  # WRONGTYPE: s is a string
    assert conn.call([("GET", "s")]) == [b"x"]  # its own answer; the deferred one read
    assert conn.deferred == 0
    with pytest.raises(redis.ResponseError, match="deferred.*WRONGTYPE"):
        conn.defer([("HSET", "h2", "a", 1)])
    conn.defer([("HSET", "h2", "a", 1)])  # (reported once: this one goes)
    assert conn.call([("HGET", "h2", "a")]) == [b"1"]  # the connection is still in step
    conn.defer([("HSET", "s", "b", 2)])
    conn.call([("PING",)])
    with pytest.raises(redis.ResponseError, match="deferred.*WRONGTYPE"):
        conn.raise_deferred()
    conn.raise_deferred()  # (once)
    conn.close()


def test_deferred_answers_go_to_their_callbacks_when_taken_in(redis_server: RedisServer) -> None:
    """A deferred command's answer goes to its ``on_reply`` when read: by ``take_deferred``
    (without waiting: nothing while it has not come, the command's answer once it has; a
    ``call_soon`` function's answer, coming after it, stays for that function) or by the next
    call (on a new connection where the old one was lost: sent again first). An error answer
    goes to it as an exception, and is raised by the next ``defer``."""
    conn = _conn(redis_server)
    got: list[object] = []
    conn.take_deferred()  # (none owed: nothing read)
    conn.defer([("INCRBY", "n", 5)], on_reply=got.append)
    soon = conn.call_soon([("GET", "n")])
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        conn.take_deferred()
        time.sleep(0.001)
    assert got == [5] and conn.deferred == 0
    assert soon() == [b"5"]  # (its answer kept for it)
    conn.defer([("INCRBY", "n", 2)], on_reply=got.append)
    conn.defer([("HSET", "n", "a", 1)], on_reply=got.append)  # WRONGTYPE
    assert conn.call([("GET", "n")]) == [b"7"]  # (reads both on the way)
    assert got[:2] == [5, 7] and "WRONGTYPE" in str(got[2])
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        conn.defer([("PING",)])
    conn.defer([("GET", "n")], on_reply=got.append)
    assert conn.take_deferred(5.0)  # (waited for)
    conn.defer([("GET", "n")], on_reply=got.append)
    conn.close()  # (lost before its answer: the next call sends it again, reads its answer)
    assert not conn.take_deferred(0.1)
    assert conn.call([("PING",)]) == [b"PONG"]
    assert got[:2] == [5, 7] and isinstance(got[2], Exception)
    assert got[3:] == [b"7", b"7"] and conn.deferred == 0
    conn.close()


def test_a_failed_deferred_command_does_not_fail_a_publication(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """A cursor commit refused by Redis must not make the next publication of the thread
    raise (a write-once file would be removed although its record is stored); ``flush``
    reports it."""
    from instride.config import Settings
    from instride.errors import MetadataUnavailable
    from instride.record import Record

    md = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=2))
    try:
        md.command("SET", "instride:test:str", "x")
        md.set_later("instride:test:str", {"a": 1})  # WRONGTYPE
        rec = md.publish(Record("out/r", "127.0.0.1:1", 1, "xxh3:00", 1, 0.0, "n"),
                         overwrite=False)
        assert rec.version > 0 and md.lookup("out/r") is not None
        with pytest.raises(MetadataUnavailable, match="deferred.*WRONGTYPE"):
            md.flush()
        md.flush()
    finally:
        md.close()


def test_set_later_is_seen_by_other_clients(redis_server: RedisServer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from instride.config import Settings

    md = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=2))
    md.set_later("instride:test:head", {"oldest": 3, "written": 9})
    md.lookup("any")  # the next command on the connection reads the deferred reply
    other = redis.Redis.from_url(redis_server.url)
    assert other.hgetall("instride:test:head") == {b"oldest": b"3", b"written": b"9"}
    md.close()


def test_pending_drains_what_arrived_without_waiting(redis_server: RedisServer) -> None:
    conn = _conn(redis_server)  # (a socket with a 5 s timeout: pending must not wait on it)
    conn.send([("SUBSCRIBE", "instride:test:chan")])
    assert conn.read(5.0) == [b"subscribe", b"instride:test:chan", 1]
    assert conn.pending() == []  # nothing came: an empty list, at once
    redis.Redis(redis_server.host, redis_server.port).publish("instride:test:chan", "a")
    got: list[object] = []
    deadline = time.monotonic() + 5.0
    while not got and time.monotonic() < deadline:  # Redis writes the message to the
        got = conn.pending()  # subscriber after it answered the publisher: poll for it
        if not got:
            time.sleep(0.001)
    assert got == [[b"message", b"instride:test:chan", b"a"]]
    assert conn.sock is not None and conn.sock.gettimeout() == 5.0  # left as it was
    conn.close()


def test_commands_larger_than_the_socket_takes_at_once_go_whole(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    # what the descriptor takes at once goes directly, the rest the usual way (which waits for
    # room): a command of 4 MiB through a 64 KiB send buffer, and its reply, arrive whole
    from instride.metadata import resp

    took: list[tuple[int, int]] = []
    written = resp._written
    monkeypatch.setattr(resp, "_written", lambda sock, data: took.append(
        (written(sock, data), len(data))) or took[-1][0])
    conn = _conn(redis_server)
    assert conn.call([("PING",)]) == [b"PONG"]
    assert conn.sock is not None
    conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
    big = os.urandom(4 << 20)
    assert conn.call([("SET", "resp:big", big), ("GET", "resp:big"), ("STRLEN", "resp:big")]) \
        == [b"OK", big, len(big)]
    assert took[0] == (14, 14)  # (the PING: at once, whole)
    assert 0 <= took[1][0] < took[1][1]  # (the SET: only part of it at once)
    assert conn.sock.gettimeout() == 5.0
    conn.close()


def test_answered_says_no_until_the_reply_is_there_and_keeps_what_it_read(
        redis_server: RedisServer) -> None:
    """answered() takes in what has arrived without waiting: a reply Redis holds (BLPOP) is
    not there yet; once it is, the bytes read meanwhile go to their caller. A connection Redis
    closed is "answered" at once: its caller gets the error now, not frames later."""
    conn = _conn(redis_server)
    try:
        conn.call([("DEL", "q")])
        owed = conn.call_soon([("BLPOP", "q", "5")])
        assert not conn.answered()  # (held by Redis for up to five seconds)
        conn2 = _conn(redis_server)
        conn2.call([("RPUSH", "q", "x")])
        deadline = time.monotonic() + 5
        while not conn.answered() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert owed() == [[b"q", b"x"]]  # (what answered() read in goes to its caller)
        owed = conn.call_soon([("BLPOP", "q", "5")])
        conn2.call([("CLIENT", "KILL", "SKIPME", "yes", "TYPE", "normal")])
        conn2.close()
        deadline = time.monotonic() + 5
        while not conn.answered() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert conn.answered()  # (closed: its caller learns so at once, from the read)
        with pytest.raises(ConnectionError):
            owed()
    finally:
        conn.close()


def test_answered_waits_for_every_reply_a_function_is_owed(redis_server: RedisServer,
                                                           tmp_path: Path) -> None:
    """A function owed several replies (a publication goes with a ``PING`` ahead of it) is not
    answered when only the first came: Redis holding writes back (``CLIENT PAUSE ... WRITE``,
    as a failover does) answers the ``PING`` and holds the script."""
    from instride.config import Settings
    from instride.record import Record

    md = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=5))
    admin = redis.Redis(redis_server.host, redis_server.port)
    try:
        md.publish(Record("p/0", "127.0.0.1:1", 1, None, 1, time.time(), "n"))  # (connected)
        admin.execute_command("CLIENT", "PAUSE", 800, "WRITE")
        pending = md.publish_soon(Record("p/1", "127.0.0.1:1", 1, None, 1, time.time(), "n"))
        time.sleep(0.2)  # (the PING's answer is in by now)
        assert not pending.answered()
        deadline = time.monotonic() + 5
        while not pending.answered() and time.monotonic() < deadline:
            time.sleep(0.01)
        start = time.monotonic()
        assert pending().version > 0
        assert time.monotonic() - start < 0.1  # (answered: calling it did not wait)
    finally:
        admin.close()
        md.close()


def test_a_connection_redis_closed_is_dropped_before_the_next_command(
    redis_server: RedisServer,
) -> None:
    """``fresh()``: a connection whose end Redis closed (here ``CLIENT KILL``; a restart or
    Redis's idle ``timeout`` alike) is dropped before the next command is written to it, so
    the command goes out on a new connection, or fails to connect: never written where it
    could not be answered. A live connection, or one still owed replies, is left alone."""
    conn = _conn(redis_server)
    other = redis.Redis.from_url(redis_server.url)
    try:
        from instride.metadata.resp import FRESH_AFTER

        (me,) = conn.call([("CLIENT", "ID")])
        time.sleep(2 * FRESH_AFTER)  # (quiet long enough to be looked at)
        conn.fresh()
        assert conn.sock is not None  # (alive: kept)
        other.client_kill_filter(_id=me)
        deadline = time.monotonic() + 5
        while conn.sock is not None and time.monotonic() < deadline:
            conn.fresh()
            time.sleep(0.01)
        assert conn.sock is None  # dropped as soon as Redis's end was seen
        sent = conn.sent
        assert conn.call([("PING",)]) == [b"PONG"] and conn.sent == sent + 1  # (one write)
        pending = conn.call_soon([("PING",)])
        time.sleep(2 * FRESH_AFTER)
        conn.fresh()  # (a reply is owed: read first, kept for its function)
        assert conn.sock is not None and pending() == [b"PONG"]
        conn.defer([("SET", "fresh:k", "v")])
        conn.fresh()  # (a deferred command's answer is read first)
        assert conn.deferred == 0 and conn.sock is not None
    finally:
        conn.close()
        other.close()


def test_a_close_from_another_thread_wakes_a_blocked_read_and_frees_nothing_under_it(
    redis_server: RedisServer,
) -> None:
    """``close()`` from a thread other than the connection's (``RedisMetadata.close`` closes
    every thread's): the socket is shut down, not closed, while its thread lives. Its read
    blocked in ``recv`` wakes at once with :class:`ConnectionError` (a plain close would
    leave it blocked until its 30 s timeout) and its descriptor stays its own until then; its
    next call reconnects. Its own thread closes it for good."""
    import threading

    got: list[BaseException | object] = []
    ready = threading.Event()
    box: list[RespConnection] = []

    def owner() -> None:
        conn = _conn(redis_server)
        box.append(conn)
        conn.send([("SUBSCRIBE", "nobody-publishes-here")])
        assert conn.read(5.0) is not None  # (the confirmation)
        ready.set()
        try:
            got.append(conn.read(30.0))  # (nothing comes: blocked in recv)
        except BaseException as exc:  # noqa: BLE001 (what it raised is the result)
            got.append(exc)
        got.append(conn.call([("PING",)]))  # (a new connection)
        conn.close()
        got.append(conn.sock)

    t = threading.Thread(target=owner)
    t.start()
    try:
        assert ready.wait(10)
        time.sleep(0.1)  # (into its recv)
        conn = box[0]
        sock = conn.sock
        assert sock is not None
        fd = sock.fileno()
        conn.close()  # from this thread: shut down only
        # (the descriptor stays the owner's: still open, unless the owner's read already woke
        # and its thread closed it — which may come before this look)
        open_still = sock.fileno() == fd
        t.join(10)
        assert open_still or got, "closed from another thread than its own"
        assert not t.is_alive(), "the blocked read did not wake"
        assert isinstance(got[0], ConnectionError)
        assert got[1] == [b"PONG"] and got[2] is None  # reconnected; then closed by its thread
        assert sock.fileno() == -1  # (the old socket closed by its own thread)
    finally:
        t.join(40)


def _list_soon(other: redis.Redis, key: str, want: list[bytes], within: float) -> list[bytes]:
    """``key``'s list as another client sees it once it is ``want`` (or ``within`` s passed)."""
    deadline = time.monotonic() + within
    while (got := other.lrange(key, 0, -1)) != want and time.monotonic() < deadline:
        time.sleep(0.002)
    return got  # type: ignore[no-any-return]


def test_commands_held_back_go_with_the_next_write_in_order(redis_server: RedisServer) -> None:
    """``call_soon(hold=True)``: the kernel holds the commands back (``MSG_MORE``) until the
    connection's next write, which takes them out with it, in the order written; the
    functions get their own replies. ``answered()`` says no for a held function (perhaps not
    sent), and reading its replies pushes it out instead of waiting for ever."""
    conn = _conn(redis_server)
    other = redis.Redis.from_url(redis_server.url)
    try:
        conn.call([("DEL", "held")])
        other.ping()
        start = time.monotonic()
        first = conn.call_soon([("RPUSH", "held", "a")], hold=True)
        second = conn.call_soon([("RPUSH", "held", "b")], hold=True)
        assert conn._held == 2 and not conn.answered()
        seen = other.lrange("held", 0, -1)
        if time.monotonic() - start < 0.15:  # (Linux sends them by itself after ~0.2 s)
            assert seen == []  # held back: not sent
        third = conn.call_soon([("RPUSH", "held", "c")])  # the next write: all three, in order
        assert conn._held == 0
        assert _list_soon(other, "held", [b"a", b"b", b"c"], 5) == [b"a", b"b", b"c"]
        assert first() == [1] and second() == [2] and third() == [3]
        owed = conn.call_soon([("RPUSH", "held", "d")], hold=True)
        assert owed() == [4]  # (read: pushed out first, not waited for for ever)
        conn.call_soon([("RPUSH", "held", "e")], hold=True)
        conn.flush_held()
        assert _list_soon(other, "held", [b"a", b"b", b"c", b"d", b"e"], 5)[-1] == b"e"
    finally:
        conn.close()
        other.close()


def test_commands_held_back_go_out_by_themselves_when_nothing_follows(
    redis_server: RedisServer, tmp_path: Path,
) -> None:
    """Nothing written after held commands: Linux sends them within its 0.2 s cork ceiling;
    a connection closed, or a process that exits, sends them before its socket's close — also
    with replies it never read in (a TCP socket closed so is reset, dropping what it held)."""
    conn = _conn(redis_server)
    other = redis.Redis.from_url(redis_server.url)
    try:
        conn.call([("DEL", "alone", "closed", "exited")])
        conn.call_soon([("RPUSH", "alone", "x")], hold=True)
        start = time.monotonic()
        assert _list_soon(other, "alone", [b"x"], 5) == [b"x"]
        assert time.monotonic() - start < 2.0
        conn.call_soon([("PING",)])  # (its reply comes in, never read)
        time.sleep(0.1)
        lost = conn.call_soon([("RPUSH", "closed", "y")], hold=True)
        conn.close()
        assert _list_soon(other, "closed", [b"y"], 5) == [b"y"]
        with pytest.raises(ConnectionError):
            lost()  # (its reply went with the connection: a caller sends it again)
        script = tmp_path / "held.py"
        script.write_text(
            "import os, sys\n"
            "from instride.metadata.resp import RespConnection\n"
            f"c = RespConnection({redis_server.host!r}, {redis_server.port}, 0, None, None, 5, 5)\n"
            "c.call_soon([('PING',)])\n"  # (its reply comes in, never read)
            "import time; time.sleep(0.1)\n"
            "c.call_soon([('RPUSH', 'exited', 'z')], hold=True)\n"
            "sys.exit(0)\n")
        import subprocess
        import sys

        subprocess.run([sys.executable, str(script)], check=True, timeout=60)
        assert _list_soon(other, "exited", [b"z"], 5) == [b"z"]
    finally:
        conn.close()
        other.close()


def test_held_commands_go_out_when_a_connection_is_dropped_unclosed_or_a_child_ends(
    redis_server: RedisServer,
) -> None:
    """A connection collected without ``close()`` (its thread ended, the stream never closed)
    and a ``multiprocessing`` child (which ends by ``os._exit``: no ``atexit``) let go of
    what they hold like ``close()`` does, with replies unread in: never a reset that drops it."""
    import gc
    import multiprocessing
    import threading

    other = redis.Redis.from_url(redis_server.url)
    try:
        other.delete("dropped", "child")

        def dropped() -> None:
            conn = _conn(redis_server)
            conn.call_soon([("PING",)])  # (its reply comes in, never read)
            time.sleep(0.1)
            conn.call_soon([("RPUSH", "dropped", "x")], hold=True)

        t = threading.Thread(target=dropped)
        t.start()
        t.join(10)
        gc.collect()
        assert _list_soon(other, "dropped", [b"x"], 5) == [b"x"]
        child = multiprocessing.get_context("fork").Process(
            target=_hold_in_a_child, args=(redis_server.host, redis_server.port))
        child.start()
        child.join(30)
        assert child.exitcode == 0
        assert _list_soon(other, "child", [b"y"], 5) == [b"y"]
    finally:
        other.close()


_KILLED_HOLDER = """
import os, signal, sys, time
from instride.metadata.resp import RespConnection
conn = RespConnection(sys.argv[1], int(sys.argv[2]), 0, None, None, 5.0, 5.0)
key = sys.argv[3]
conn.call([("PING",)])  # (connected: a command is held only on a connection made)
if key == "owed":  # a reply owed (it comes in, never read)
    conn.call_soon([("PING",)])
else:  # commands held back, the second over a full segment (loopback's: ~64 KiB), which
    # the kernel sends at once: the first's reply comes in, never read
    conn.call_soon([("RPUSH", key, "a")], hold=True)
    conn.call_soon([("RPUSH", key, "b" * 100_000)], hold=True)
    time.sleep(0.3)  # (and Linux sends the rest after ~0.2 s: both answered, unread)
conn.call_soon([("RPUSH", key, "z")], hold=True)
time.sleep(0.05)  # (the replies come in; Linux would send what is held after ~0.2 s)
os.kill(os.getpid(), signal.SIGKILL)  # (no close, no exit hook: the kernel closes the socket)
"""


@pytest.mark.parametrize("key", ["owed", "segment"])
def test_held_commands_survive_a_process_killed_outright(redis_server: RedisServer,
                                                         key: str) -> None:
    """A process killed outright (``SIGKILL``: no close, no exit hook) with a reply come in
    and unread has its socket reset by TCP, which drops what the socket holds back: a reply
    owed to a command sent before (``owed``), or to a held one the kernel sent already with a
    full segment (``segment``). So a command is held only once every such reply is taken in
    (and what came in meanwhile is taken in right after the held write; what comes in later
    pushes the held bytes out): the kernel's close sends them."""
    import signal
    import subprocess
    import sys

    other = redis.Redis.from_url(redis_server.url)
    try:
        other.delete(key)
        run = subprocess.run([sys.executable, "-c", _KILLED_HOLDER, redis_server.host,
                              str(redis_server.port), key],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
        want = [b"z"] if key == "owed" else [b"a", b"b" * 100_000, b"z"]
        assert _list_soon(other, key, want, 5) == want
    finally:
        other.close()


def _hold_in_a_child(host: str, port: int) -> None:
    conn = RespConnection(host, port, 0, None, None, 5.0, 5.0)
    conn.call_soon([("PING",)])  # (its reply comes in, never read)
    time.sleep(0.1)
    conn.call_soon([("RPUSH", "child", "y")], hold=True)
    _keep.append(conn)  # (alive until the child's end: not collected before)


_keep: list[RespConnection] = []


@pytest.mark.parametrize("way", ["call_soon", "held", "defer"])
def test_an_interrupt_right_after_a_write_sends_no_reply_astray(redis_server: RedisServer,
                                                              way: str) -> None:
    """Ctrl-C (or a signal handler's exception) landing right after a command went out, before
    the connection noted it: ``call_soon`` took it for not sent and forgot its reply, and
    ``defer`` counted its commands as owed only after the write. The next call got that
    reply instead of its own (a lookup could return another key's record). The connection now
    goes, and the next call gets its own reply."""
    c = _conn(redis_server)
    c.call([("SET", "astray/b", "mine")])
    real = c._send_packed

    def sent_then_interrupted(data: bytes, *, more: bool = False) -> None:
        real(data, more=more)
        raise KeyboardInterrupt

    c._send_packed = sent_then_interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        if way == "defer":
            c.defer([("SET", "astray/a", "x")])
        else:
            c.call_soon([("SET", "astray/a", "x")], hold=way == "held")
    c._send_packed = real  # type: ignore[method-assign]
    assert c.call([("GET", "astray/b")]) == [b"mine"]
    assert c.call([("GET", "astray/b")]) == [b"mine"]
    c.close()
