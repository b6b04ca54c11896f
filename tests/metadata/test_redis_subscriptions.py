"""A wait's subscription, over a thread's kept subscriber connection: what an earlier wait left
on that connection (a confirmation it did not stay for, a message published before its
UNSUBSCRIBE) is never taken for the current wait's."""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from instride.config import Settings
from instride.errors import ConsumeTimeout
from instride.metadata.base import Record
from instride.metadata.redis import RedisMetadata
from tests.conftest import RedisServer, _redis_binary, stop_process
from tests.relay import Relay


class _Delayer(Relay):
    """A TCP relay in front of Redis that holds each client write containing ``marker`` for
    ``delay`` seconds (writes keep their order): a slow network for subscriptions only.
    :meth:`freeze` cuts the connections made so far without a word to their clients (as a
    Redis host that crashed, or a network cut): Redis sees them closed, the clients nothing."""

    def __init__(self, upstream: tuple[str, int], delay: float = 0.0,
                 marker: bytes = b"") -> None:
        self.delay, self.marker = delay, marker
        self.servers: list[socket.socket] = []
        super().__init__(upstream)

    def freeze(self) -> None:
        for server in self.servers:
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_RDWR)
        self.servers = []

    def serve(self, client: socket.socket, server: socket.socket) -> None:
        self.servers.append(server)
        held: queue.Queue[tuple[float, bytes]] = queue.Queue()
        threading.Thread(target=self._read, args=(client, held), daemon=True).start()
        threading.Thread(target=self._write, args=(held, server), daemon=True).start()
        threading.Thread(target=self._down, args=(server, client), daemon=True).start()

    def _read(self, src: socket.socket, held: queue.Queue[tuple[float, bytes]]) -> None:
        data = b"x"
        while data:
            try:
                data = src.recv(1 << 16)
            except OSError:
                data = b""
            late = self.marker and self.marker in data
            held.put((time.monotonic() + (self.delay if late else 0.0), data))

    @staticmethod
    def _write(held: queue.Queue[tuple[float, bytes]], dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                due, data = held.get()
                time.sleep(max(0.0, due - time.monotonic()))
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)

    def _down(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
            if src in self.servers:  # (not cut by freeze: the client hears of it)
                dst.shutdown(socket.SHUT_WR)


def _record(key: str) -> Record:
    return Record(key, "127.0.0.1:1", 1, "xxh3:0", 0, time.time(), "n1")


def _waiting(meta: RedisMetadata, key: str, timeout: float
             ) -> tuple[threading.Thread, list[Record | Exception]]:
    """A thread (started) waiting for ``key``; the list gets what its wait returned, or its
    :class:`ConsumeTimeout`."""
    got: list[Record | Exception] = []

    def wait() -> None:
        try:
            got.append(meta.wait_any([key], timeout))
        except ConsumeTimeout as exc:
            got.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    return thread, got


def test_a_wait_after_one_that_left_before_its_confirmation_hears_the_publication(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """A wait that timed out before Redis confirmed its SUBSCRIBE leaves that confirmation on
    the thread's subscriber connection. The next wait must not take it for its own (it would
    check before its own subscription is in force, and miss a publication in between: it
    waited out its timeout)."""
    relay = _Delayer((redis_server.host, redis_server.port), 0.3, b"SUBSCRIBE")
    direct = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=2))
    waiter = RedisMetadata(Settings(dir=tmp_path, redis_url=f"redis://127.0.0.1:{relay.port}/0",
                                    connect_timeout=2))
    try:
        got: list[Record | Exception] = []
        second = threading.Event()

        def wait() -> None:  # (both waits in one thread: one subscriber connection)
            with contextlib.suppress(ConsumeTimeout):
                waiter.wait_any(["stale-confirm"], 0.2)  # (gone before its confirmation came)
            time.sleep(0.6)  # (the confirmation is on the connection now, unread)
            second.set()
            try:
                got.append(waiter.wait_any(["stale-confirm"], 5.0))
            except ConsumeTimeout as exc:
                got.append(exc)

        thread = threading.Thread(target=wait)
        thread.start()
        assert second.wait(20)
        time.sleep(0.1)
        stored = direct.publish(_record("stale-confirm"))  # (while the wait subscribes)
        thread.join(20)
        assert len(got) == 1 and isinstance(got[0], Record) and got[0].version == stored.version
    finally:
        waiter.close()
        direct.close()
        relay.close()


@pytest.fixture
def unix_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server on a Unix socket only (a ``unix://`` URL: the waits go through redis-py)."""
    where = tmp_path_factory.mktemp("redis-unix")
    path = where / "redis.sock"
    proc = subprocess.Popen([_redis_binary(), "--port", "0", "--unixsocket", str(path), "--save", "",
                             "--appendonly", "no", "--loglevel", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not path.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)
        yield f"unix://{path}"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.parametrize("way", ["lean", "redis-py"])
def test_a_message_an_earlier_wait_left_unread_is_not_taken_for_a_publication(
        way: str, redis_server: RedisServer, unix_redis: str, tmp_path: Path) -> None:
    """A wait returns at the first of two publications in quick succession; the second one's
    message stays on the subscriber connection (it came before the UNSUBSCRIBE took effect).
    The key is then deleted: the next wait for it must time out, not return that message's
    record of a key that is gone."""
    url = redis_server.url if way == "lean" else unix_redis
    wrong = 0
    for _ in range(5):
        publisher = RedisMetadata(Settings(dir=tmp_path, redis_url=url, connect_timeout=2))
        waiter = RedisMetadata(Settings(dir=tmp_path, redis_url=url, connect_timeout=2))
        try:
            publisher.delete("stale-message")

            def publish_twice(publisher: RedisMetadata = publisher) -> None:
                time.sleep(0.1)  # (the waiter subscribed)
                first, second = (publisher.publish_soon(_record("stale-message")),
                                 publisher.publish_soon(_record("stale-message")))
                first()
                second()
                publisher.delete("stale-message")

            thread = threading.Thread(target=publish_twice)
            thread.start()
            waiter.wait_any(["stale-message"], 5.0)
            thread.join(20)
            assert publisher.lookup("stale-message") is None
            try:
                waiter.wait_any(["stale-message"], 0.3)
                wrong += 1
            except ConsumeTimeout:
                pass
        finally:
            waiter.close()
            publisher.close()
    assert wrong == 0


def test_a_forked_child_does_not_keep_its_parents_subscriptions(redis_server: RedisServer,
                                                                tmp_path: Path) -> None:
    """A process forks (a ``multiprocessing`` worker) while its thread keeps a subscription
    (a directory watched between waits), then closes its backend: Redis drops the connection
    and its subscription, though the child lives on (it held a copy of the descriptor)."""
    import multiprocessing

    import redis

    meta = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=2))
    admin = redis.Redis(host=redis_server.host, port=redis_server.port)
    ctx = multiprocessing.get_context("fork")
    child = None
    try:
        assert meta.watch("forked/", 5.0) and meta.watching("forked/")
        assert [c for c in admin.client_list() if int(c["psub"]) > 0]
        child = ctx.Process(target=time.sleep, args=(30,))
        child.start()
        meta.close()
        deadline = time.monotonic() + 5
        while [c for c in admin.client_list() if int(c["psub"]) > 0] \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [c for c in admin.client_list() if int(c["psub"]) > 0] == []
    finally:
        if child is not None:
            child.kill()
            child.join(10)
        admin.close()
        meta.close()


def test_a_wait_on_a_connection_cut_without_a_word_subscribes_again(
        redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The connections of a waiting thread are cut without a FIN or RST reaching it (the Redis
    host crashed, the network was cut): its subscriber, silent for a while, is asked a PING;
    unanswered, it is taken for lost, and the wait subscribes again on a new connection and
    finds the key published meanwhile — per key, and in a watched directory."""
    from instride.metadata import resp

    monkeypatch.setattr(resp, "PROBE_AFTER", 0.5, raising=False)
    monkeypatch.setattr(resp, "PROBE_WAIT", 0.5, raising=False)
    relay = _Delayer((redis_server.host, redis_server.port))
    direct = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=2))
    waiter = RedisMetadata(Settings(dir=tmp_path, redis_url=f"redis://127.0.0.1:{relay.port}/0",
                                    connect_timeout=2))
    try:
        for key in ("cut-key", "cut/dir/key"):
            thread, got = _waiting(waiter, key, 20.0)
            time.sleep(0.3)  # (subscribed)
            relay.freeze()
            time.sleep(0.1)
            stored = direct.publish(_record(key))  # (nobody hears it: the subscription is gone)
            thread.join(30)
            assert len(got) == 1 and isinstance(got[0], Record), got
            assert got[0].version == stored.version
    finally:
        waiter.close()
        direct.close()
        relay.close()


class _UnixRedis:
    """A redis-server on a Unix socket only, at ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.proc: subprocess.Popen | None = None

    def start(self) -> _UnixRedis:
        """Start it; it answers on ``path`` when this returns (a path that names the socket of
        another server, stopped, is taken over: redis-server replaces the socket file)."""
        self.proc = subprocess.Popen([_redis_binary(), "--port", "0", "--unixsocket", str(self.path),
                                      "--save", "", "--appendonly", "no", "--loglevel", "warning"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            probe = redis.Redis(unix_socket_path=str(self.path), socket_timeout=0.2,
                                socket_connect_timeout=0.2, retry=None)
            try:
                if probe.info("server")["process_id"] == self.proc.pid:
                    return self
            except (redis.RedisError, OSError):
                pass
            finally:
                probe.close()
            assert self.proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop it (resumed first, if a test stopped it with ``SIGSTOP``)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@pytest.fixture
def unix_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[_UnixRedis]]]:
    """A directory for Unix sockets, and the list of the redis-servers a test starts there: each
    stopped at the end (resumed first if the test stopped it), and the directory removed."""
    where = tmp_path_factory.mktemp("redis-unix")
    servers: list[_UnixRedis] = []
    try:
        yield where, servers
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(where, ignore_errors=True)


def test_a_wait_through_redis_py_gives_up_a_subscriber_connection_nobody_answers(
        unix_servers: tuple[Path, list[_UnixRedis]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Over a ``unix://`` URL (redis-py's subscriber, not the lean one) the Redis server stops
    answering (stopped: a hung server) and another one takes its socket's path. The waiting
    subscriber, silent ``PROBE_AFTER`` seconds, is asked a PING; unanswered ``PROBE_WAIT``
    seconds later, it is given up, and the wait subscribes again (with the new server) and
    finds the key published there, rather than waiting out its timeout on a connection that
    nobody will ever answer."""
    from instride.metadata import resp

    monkeypatch.setattr(resp, "PROBE_AFTER", 0.5, raising=False)
    monkeypatch.setattr(resp, "PROBE_WAIT", 0.5, raising=False)
    where, servers = unix_servers
    path = where / "redis.sock"
    servers.append(_UnixRedis(path))
    old = servers[-1].start()
    assert old.proc is not None
    url = f"unix://{path}"
    waiter = RedisMetadata(Settings(dir=tmp_path, redis_url=url, connect_timeout=2))
    publisher = None
    try:
        thread, got = _waiting(waiter, "silent-key", 20.0)
        watch = redis.Redis(unix_socket_path=str(path))
        deadline = time.monotonic() + 10
        while watch.pubsub_numsub("instride:pub:silent-key") != [(b"instride:pub:silent-key", 1)]:
            assert time.monotonic() < deadline, "the wait did not subscribe"
            time.sleep(0.01)
        watch.close()
        stop_process(old.proc.pid)
        stopped = time.monotonic()
        servers.append(_UnixRedis(path))
        servers[-1].start()
        publisher = RedisMetadata(Settings(dir=tmp_path, redis_url=url, connect_timeout=2))
        stored = publisher.publish(_record("silent-key"))
        thread.join(40)
        took = time.monotonic() - stopped
        assert len(got) == 1 and isinstance(got[0], Record), got
        assert got[0].version == stored.version
        # (given up after PROBE_AFTER + PROBE_WAIT, 1 s here; the pool's idle connections to the
        # stopped server given up with it: the look that follows does not wait out redis-py's
        # socket timeout, 5 s, on one of them)
        assert took < 4, took
    finally:
        if publisher is not None:
            publisher.close()
        waiter.close()


def test_a_wait_through_redis_py_whose_connection_redis_closed_sees_a_publication_made_meanwhile(
        unix_servers: tuple[Path, list[_UnixRedis]], tmp_path: Path) -> None:
    """Over a ``unix://`` URL (redis-py's subscriber), Redis closes the waiting subscriber's
    connection (``client-output-buffer-limit pubsub``, a proxy's cut: ``CLIENT KILL`` here) and
    the key is published right after. redis-py's retry used to reconnect and subscribe again
    inside its read, silently: the publication made in between was missed and the key never
    looked up again, so the wait ran out its timeout. The wait now hears of the closed
    connection, subscribes again and looks the key up."""
    where, servers = unix_servers
    path = where / "redis.sock"
    servers.append(_UnixRedis(path))
    servers[-1].start()
    url = f"unix://{path}"
    waiter = RedisMetadata(Settings(dir=tmp_path, redis_url=url, connect_timeout=2))
    publisher = RedisMetadata(Settings(dir=tmp_path, redis_url=url, connect_timeout=2))
    admin = redis.Redis(unix_socket_path=str(path))
    try:
        for i in range(3):
            key = f"cut/{i}"
            thread, got = _waiting(waiter, key, 6.0)
            channel = f"instride:pub:{key}"
            deadline = time.monotonic() + 5
            while admin.pubsub_numsub(channel) != [(channel.encode(), 1)]:
                assert time.monotonic() < deadline, "the wait did not subscribe"
                time.sleep(0.005)
            time.sleep(0.05)  # (its subscription confirmed and its look at the key done)
            admin.client_kill_filter(_type="pubsub")
            stored = publisher.publish(_record(key))
            thread.join(20)
            assert len(got) == 1 and isinstance(got[0], Record), (key, got)
            assert got[0].version == stored.version
    finally:
        admin.close()
        publisher.close()
        waiter.close()


class _CutOnceFound:
    """A relay in front of Redis (TCP or a Unix socket) that, once a waiter's subscriber
    connection is in place, lets ``meanwhile`` publish the key as the waiter's look at it goes
    by, then cuts that subscriber connection (a reset: the waiter's next write on it fails)
    and takes no connection any more (Redis out of reach) before passing the look on: the
    look finds the record, and what the wait sends next on its subscriber fails."""

    def __init__(self, listener: socket.socket, connect: Callable[[], socket.socket],
                 meanwhile: Callable[[], None]) -> None:
        self.listener, self.connect, self.meanwhile = listener, connect, meanwhile
        self.subscriber: socket.socket | None = None
        self.cut = False
        self.socks: list[socket.socket] = []
        self.readers: dict[socket.socket, threading.Thread] = {}
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = self.connect()
            self.socks += [client, server]
            self.readers[client] = threading.Thread(target=self._up, args=(client, server),
                                                    daemon=True)
            self.readers[client].start()
            threading.Thread(target=self._down, args=(server, client), daemon=True).start()

    def _up(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if b"SUBSCRIBE" in data and self.subscriber is None:
                    self.subscriber = src
                elif b"HGETALL" in data and self.subscriber is not None and not self.cut:
                    self.cut = True
                    self.meanwhile()
                    with contextlib.suppress(OSError):
                        self.listener.shutdown(socket.SHUT_RDWR)
                    self.listener.close()
                    sub = self.subscriber
                    if sub.family == socket.AF_INET:  # (a reset, not an orderly end)
                        sub.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                       struct.pack("ii", 1, 0))
                    # (shut down first: its own reader, blocked in recv(), holds it open
                    # until it returns; on a Unix socket this is what fails the peer's writes)
                    with contextlib.suppress(OSError):
                        sub.shutdown(socket.SHUT_RDWR)
                    sub.close()
                    self.readers[sub].join(5)  # (let go: the reset has gone out)
                dst.sendall(data)

    @staticmethod
    def _down(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)

    def close(self) -> None:
        self.listener.close()
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.close()


@pytest.mark.parametrize("path", ["lean", "redis-py"])
def test_a_wait_that_found_its_record_returns_it_though_its_unsubscribe_fails(
        request: pytest.FixtureRequest, tmp_path: Path, path: str) -> None:
    """A wait subscribed per key (a key of no directory) finds the record in its look after
    subscribing; the ``UNSUBSCRIBE`` that follows fails (the subscriber connection was cut
    that moment) and the error took the place of the record found: the wait **subscribed
    again and again, Redis out of reach, and ended with ConsumeTimeout** (or, Redis back,
    waited for a record it had had). The record found is returned; the failed connection is
    closed (its subscriptions went with it)."""
    if path == "lean":
        server: RedisServer = request.getfixturevalue("redis_server")
        listener = socket.create_server(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
        direct_url = server.url

        def connect() -> socket.socket:
            return socket.create_connection((server.host, server.port))
    else:
        where, servers = request.getfixturevalue("unix_servers")
        servers.append(_UnixRedis(where / "redis.sock"))
        servers[-1].start()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(where / "relay.sock"))
        listener.listen()
        url, direct_url = f"unix://{where / 'relay.sock'}", f"unix://{where / 'redis.sock'}"

        def connect() -> socket.socket:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(where / "redis.sock"))
            return sock
    direct = RedisMetadata(Settings(dir=tmp_path, redis_url=direct_url, connect_timeout=2))
    stored: list[Record] = []
    relay = _CutOnceFound(listener, connect,
                          lambda: stored.append(direct.publish(_record("found-then-cut"))))
    waiter = RedisMetadata(Settings(dir=tmp_path, redis_url=url, connect_timeout=1))
    try:
        thread, got = _waiting(waiter, "found-then-cut", 3.0)
        thread.join(20)
        assert relay.cut and len(stored) == 1
        assert got == stored
    finally:
        waiter.close()
        direct.close()
        relay.close()
