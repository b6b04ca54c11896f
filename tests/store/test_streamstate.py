"""A stream's state shared through Redis (instride.store.streamstate): a group's lease."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis

from instride.config import Settings
from instride.metadata.redis import RedisMetadata
from instride.store.streamstate import Policy, RedisStreamState
from tests.conftest import RedisServer
from tests.relay import Relay, ReplyDropper


def _started(meta: RedisMetadata, stream: str) -> RedisStreamState:
    """``stream``'s state in Redis, started afresh with one consumer group, ``g``."""
    state = RedisStreamState(meta, stream, lease_s=30)
    state.start(Policy(), ("g",), reset=True)
    return state


def test_a_group_lease_whose_answer_was_lost_is_the_readers_own(redis_server: RedisServer,
                                                                tmp_path: Path) -> None:
    """The answer to the script that takes a group's lease (``SET NX``, the generation
    counted up) is lost (the connection fails after Redis ran it) and the client sends it
    again: the lease found taken is the reader's own, not another reader's (``GroupBusy``,
    the group locked until the lease ran out), and its generation is the one counted."""
    relay = ReplyDropper((redis_server.host, redis_server.port), marker=b"group:g:lease")
    meta = RedisMetadata(Settings(dir=tmp_path, redis_url=f"redis://127.0.0.1:{relay.port}/0",
                                  connect_timeout=2))
    direct = redis.Redis(host=redis_server.host, port=redis_server.port)
    try:
        state = _started(meta, "lease")
        state.open_group("warm", 0).close()  # (the script loaded: its run's answer is lost)
        relay.armed = True
        cursor = state.open_group("g", 0)
        assert relay.dropped == 1
        lease = direct.get("instride:stream:lease:group:g:lease")
        assert lease is not None and lease.decode() == cursor._token
        assert cursor._generation == int(direct.hget("instride:stream:lease:generations", "g"))
        cursor.close()
        assert direct.get("instride:stream:lease:group:g:lease") is None
    finally:
        direct.close()
        meta.close()
        relay.close()


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_commit_sent_again_after_the_lease_moved_does_not_set_the_cursor_back(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """A reader commits its group's cursor without waiting for the answer, and its connection
    fails after Redis ran the commit, before the answer came: the commit is sent again on its
    next connection. Meanwhile its lease ran out (the reader was stopped), and another reader
    took the group and committed further. The old reader's commit, sent again, must not set
    the cursor back: the group would get those frames again."""
    relay = ReplyDropper((redis_server.host, redis_server.port),
                          marker=b"instride:stream:fence:groups")
    old_meta = RedisMetadata(Settings(dir=tmp_path, redis_url=f"redis://127.0.0.1:{relay.port}/0",
                                      connect_timeout=2))
    new_meta = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=2))
    direct = redis.Redis(host=redis_server.host, port=redis_server.port)
    lease = "instride:stream:fence:group:g:lease"
    old = new = None
    try:
        state = _started(old_meta, "fence")
        old = state.open_group("g", 0)
        old.commit(3)
        old_meta.flush()
        assert direct.hget("instride:stream:fence:groups", "g") == b"3"
        relay.armed = True
        old.commit(5)  # run by Redis; its answer lost with the connection
        _wait_for(lambda: relay.dropped == 1)
        assert direct.hget("instride:stream:fence:groups", "g") == b"5"
        direct.delete(lease)  # (as if it ran out: the reader stopped longer than its lease)
        new = RedisStreamState(new_meta, "fence", lease_s=30).open_group("g", 0)
        assert new.value == 5
        new.commit(9)
        new_meta.flush()
        old_meta.flush()  # the old reader's next command: its commit is sent again first
        assert direct.hget("instride:stream:fence:groups", "g") == b"9"
        assert direct.get(lease) == new._token.encode()
    finally:
        for cursor in (old, new):
            if cursor is not None:
                cursor.close()
        direct.close()
        new_meta.close()
        old_meta.close()
        relay.close()


def test_a_group_cursor_is_written_only_while_the_lease_is_the_readers(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """A reader's commits reach Redis (read with its next command), backwards too (a seek);
    closing writes the last one before the lease goes; a commit of a reader whose lease is
    another reader's now writes nothing."""
    meta = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=2))
    direct = redis.Redis(host=redis_server.host, port=redis_server.port)
    lease = "instride:stream:commits:group:g:lease"
    try:
        state = _started(meta, "commits")
        reader = state.open_group("g", 0)
        reader.commit(7)
        meta.flush()
        assert direct.hget("instride:stream:commits:groups", "g") == b"7"
        reader.commit(2)  # (a seek back)
        meta.flush()
        assert direct.hget("instride:stream:commits:groups", "g") == b"2"
        reader.commit(4)
        reader.close()
        assert direct.hget("instride:stream:commits:groups", "g") == b"4"
        assert direct.get(lease) is None
        reader = state.open_group("g", 0)
        assert reader.value == 4
        direct.set(lease, "another-reader", px=30_000)  # (its lease ran out; taken over)
        reader.commit(8)  # (its renewals not due yet: it does not know)
        meta.flush()
        assert direct.hget("instride:stream:commits:groups", "g") == b"4"
        reader.close()
        assert direct.get(lease) == b"another-reader"
    finally:
        direct.close()
        meta.close()


class _Holder(Relay):
    """A TCP relay in front of Redis that, once armed, holds the first client write for which
    ``held_if`` is true until :attr:`go` is set (:attr:`held` is set meanwhile); everything
    else passes at once."""

    def __init__(self, upstream: tuple[str, int], held_if: Callable[[bytes], bool]) -> None:
        self.held_if = held_if
        self.armed = False
        self.held = threading.Event()
        self.go = threading.Event()
        super().__init__(upstream)

    def serve(self, client: socket.socket, server: socket.socket) -> None:
        threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
        threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if up and self.armed and not self.held.is_set() and self.held_if(data):
                    self.held.set()
                    self.go.wait(20)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)


def test_closing_a_reader_never_releases_a_lease_another_reader_took(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """A reader closes, and its lease runs out (the reader paused) after it found the lease its
    own and before its release reached Redis; another reader takes the group meanwhile. The
    release must not delete the new reader's lease: a third reader could take the group too
    (two readers taking the same frames)."""
    lease = b"instride:stream:release:group:g:lease"
    # (held: the write that releases the lease, a DEL or a script; not the GET that reads it)
    relay = _Holder((redis_server.host, redis_server.port),
                    lambda data: lease in data and b"$3\r\nGET\r\n" not in data)
    old_meta = RedisMetadata(Settings(dir=tmp_path, redis_url=f"redis://127.0.0.1:{relay.port}/0",
                                      connect_timeout=2))
    new_meta = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=2))
    direct = redis.Redis(host=redis_server.host, port=redis_server.port)
    new = None
    try:
        old = RedisStreamState(old_meta, "release", lease_s=30).open_group("g", 0)
        relay.armed = True
        closing = threading.Thread(target=old.close)
        closing.start()
        _wait_for(relay.held.is_set)
        direct.delete(lease)  # (as if it ran out)
        new = RedisStreamState(new_meta, "release", lease_s=30).open_group("g", 0)
        relay.go.set()
        closing.join(20)
        assert not closing.is_alive()
        assert direct.get(lease) == new._token.encode()
    finally:
        relay.go.set()
        if new is not None:
            new.close()
        direct.close()
        new_meta.close()
        old_meta.close()
        relay.close()


def test_a_cursor_closed_on_another_thread_keeps_the_last_commit_of_its_reader_thread(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """A group reader commits on its own thread (a worker iterating the stream), and the cursor
    is closed from another thread (shutting down) while that commit is still on
    its way to Redis (held here by a relay). The closing thread cannot read that thread's
    answers: it writes the last value again with the release, in one step. Before, the lease
    went first and the commit, arriving after it, was refused: the cursor stayed at the value
    before, and the group would get those frames again."""
    groups = b"instride:stream:away:groups"
    relay = _Holder((redis_server.host, redis_server.port), lambda data: groups in data)
    meta = RedisMetadata(Settings(dir=tmp_path, redis_url=f"redis://127.0.0.1:{relay.port}/0",
                                  connect_timeout=2))
    direct = redis.Redis(host=redis_server.host, port=redis_server.port)
    try:
        reader = _started(meta, "away").open_group("g", 0)
        relay.armed = True

        def worker() -> None:
            reader.commit(5)  # (held by the relay)

        t = threading.Thread(target=worker)
        t.start()
        t.join(10)
        _wait_for(relay.held.is_set)
        # closed on a new thread, the commit still held (Linux gives the ended worker's
        # thread id to the next thread: the close cannot tell them apart by it)
        closing = threading.Thread(target=reader.close)
        closing.start()
        closing.join(10)
        assert not closing.is_alive()
        assert direct.hget(groups, "g") == b"5"
        assert direct.get("instride:stream:away:group:g:lease") is None  # released
    finally:
        relay.go.set()
        direct.close()
        meta.close()
        relay.close()


def test_a_forked_child_closing_its_copy_of_a_cursor_leaves_the_parents_lease(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """A child made by ``fork`` inherits a reader's cursor, its token with it: its ``close``
    (explicit, or at its exit) must not delete the lease the parent still holds and renews
    (a second reader could then take the group: two readers taking the same frames)."""
    lease = b"instride:stream:forked:group:g:lease"
    meta = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=2))
    direct = redis.Redis(host=redis_server.host, port=redis_server.port)
    try:
        cursor = _started(meta, "forked").open_group("g", 0)
        pid = os.fork()
        if pid == 0:  # (the child: closes its copy, reports nothing but its exit status)
            try:
                cursor.close()
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert direct.get(lease) == cursor._token.encode()
        cursor.close()  # (the parent's own close releases it)
        assert direct.get(lease) is None
    finally:
        direct.close()
        meta.close()


def test_a_lease_whose_holder_exited_is_freed_at_once_and_no_other(redis_server: RedisServer,
                                                                   tmp_path: Path) -> None:
    """``release_gone``: a group's lease held by a process of this node that exited (killed:
    no release of its own) is freed at once, not after the lease's 30 s, and ``open_group``
    (a reader restarted after the crash) takes it so; one held by a live process, one named
    in another PID space (another machine), and a token that does not name its holder (an
    older instride's reader) are left to run out (``GroupBusy``)."""
    import subprocess
    import sys

    import pytest

    from instride.errors import GroupBusy

    settings = Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=2, node="n1")
    meta = RedisMetadata(settings)
    direct = redis.Redis(host=redis_server.host, port=redis_server.port)
    lease = "instride:stream:gone:group:g:lease"
    code = (
        "import time\n"
        "from pathlib import Path\n"
        "from instride.config import Settings\n"
        "from instride.metadata.redis import RedisMetadata\n"
        "from instride.store.streamstate import RedisStreamState\n"
        f"meta = RedisMetadata(Settings(dir=Path({str(tmp_path)!r}), redis_url={redis_server.url!r},"
        " node='n1'))\n"
        "cursor = RedisStreamState(meta, 'gone', lease_s=30).open_group('g', 0)\n"
        "print('held', flush=True)\n"
        "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        state = _started(meta, "gone")
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        direct_token = direct.get(lease)
        assert direct_token is not None
        assert not state.release_gone("g")  # its holder lives: kept
        with pytest.raises(GroupBusy):
            state.open_group("g", 0)
        proc.kill()
        proc.wait(30)
        assert direct_token is not None
        token = direct_token.decode()
        assert token.count("@") == 1 and token.split("@")[1].split(":")[1] == str(proc.pid)
        other_machine = token.replace(token.split("@")[1].split("/")[0], "0" * 8, 1)
        direct.set(lease, other_machine, px=30_000)
        assert not state.release_gone("g")  # (another machine's PIDs: cannot tell)
        with pytest.raises(GroupBusy):
            state.open_group("g", 0)
        direct.set(lease, direct_token, px=30_000)
        assert state.release_gone("g")  # its holder is gone: freed now
        assert direct.get(lease) is None
        state.open_group("g", 0).close()
        direct.set(lease, f"{proc.pid}-0123abcd", px=30_000)  # (an older instride's token)
        assert not state.release_gone("g")
        with pytest.raises(GroupBusy):
            state.open_group("g", 0)
        # a reader restarted after a crash (its holder gone): takes the group at once
        direct.set(lease, direct_token, px=30_000)
        state.open_group("g", 0).close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        direct.close()
        meta.close()


def test_a_lease_holder_is_judged_gone_only_when_it_surely_is() -> None:
    """The holder a lease's token names: gone when no process has its PID, when its PID names
    a process that started at another time (reused), or when it is a zombie (exited, not yet
    reaped); not gone — "cannot tell" — when it lives, when its start time was not known
    (written ``None``), or when it is of another PID space."""
    import subprocess
    import sys

    from instride.store.procs import proc_stat as _stat
    from instride.store.streamstate import _holder_gone, _lease_holder

    mine = _lease_holder()
    space, pid, start = mine.split(":")
    assert int(pid) == os.getpid() and start.isdigit()
    assert not _holder_gone(f"1-ab@{mine}")  # alive
    assert not _holder_gone(f"1-ab@{space}:{pid}:None")  # (its start time unknown)
    assert not _holder_gone(f"1-ab@other/1/2:{pid}:{start}")  # (another PID space)
    assert _holder_gone(f"1-ab@{space}:{pid}:{int(start) + 1}")  # its PID reused since
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while (stat := _stat(child.pid)) is not None and stat[0] != "Z":
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.01)
        assert stat is not None  # a zombie: exited, not reaped yet
        assert _holder_gone(f"1-ab@{space}:{child.pid}:{stat[1]}")
    finally:
        child.wait()
    assert _holder_gone(f"1-ab@{space}:{child.pid}:{stat[1]}")  # reaped: no such process


def test_a_renewal_under_way_as_the_reader_closes_does_not_take_the_lease_back(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """The renewer thread passed its "closed?" check, then the reader closed (its release
    deleted the lease), then the renewal found the lease gone and the generation unchanged,
    and took it back: a closed reader held the group for a whole lease, nobody renewing it,
    and every other reader got GroupBusy (this very process reopening the group too). The
    release counts the generation up."""
    meta = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=2))
    direct = redis.Redis(host=redis_server.host, port=redis_server.port)
    lease = "instride:stream:late:group:g:lease"
    try:
        state = _started(meta, "late")
        for committed in (False, True):  # (a release alone, and one with the last commit)
            cursor = state.open_group("g", 0)
            if committed:
                cursor.commit(3)
            cursor.close()
            assert direct.get(lease) is None
            cursor._stop.clear()  # (as the renewer, past its check before the close)
            assert cursor._extend() is False
            assert direct.get(lease) is None
            state.open_group("g", 0).close()  # (free at once, not GroupBusy)
    finally:
        direct.close()
        meta.close()


def test_a_stream_state_out_of_reach_is_metadata_unavailable(tmp_path: Path) -> None:
    """A stream's shared state with Redis out of reach raised redis-py's own ConnectionError
    (untyped for instride's callers: not exit status 6), after redis-py's three quick tries
    instead of the connect timeout's."""
    from instride.errors import MetadataUnavailable
    from tests.conftest import free_port

    meta = RedisMetadata(Settings(dir=tmp_path, redis_url=f"redis://127.0.0.1:{free_port()}/0",
                                  connect_timeout=0.5))
    state = RedisStreamState(meta, "away", lease_s=30)
    try:
        for call in (state.policy, state.archive, state.resets,
                     lambda: state.start(Policy(), ("g",), reset=True),
                     lambda: state.open_group("g", 0)):
            try:
                call()
            except MetadataUnavailable:
                continue
            raise AssertionError(f"{call} did not raise MetadataUnavailable")
    finally:
        meta.close()
