"""A Redis that restarts with its data (answering ``LOADING`` while it reads it back), closes a
connection, or stops answering: requests wait for it within their deadlines, and nothing sent
is lost (a publication sent soon before, values set without waiting for the answer)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from instride.config import Settings
from instride.errors import ConsumeTimeout
from instride.metadata.base import Record
from instride.metadata.redis import RedisMetadata
from tests.conftest import RedisServer


class _SavedRedis(RedisServer):
    """A redis-server that saves its data in ``where`` and loads it again when restarted."""

    def __init__(self, where: Path) -> None:
        super().__init__()
        self.where = where

    def start(self, *extra: str) -> _SavedRedis:
        super().start("--dir", str(self.where), *extra)
        return self


@pytest.fixture
def saved_redis(tmp_path: Path) -> Iterator[_SavedRedis]:
    server = _SavedRedis(tmp_path).start()
    try:
        yield server
    finally:
        server.stop()


def _record(key: str) -> Record:
    return Record(key, "127.0.0.1:1", 1, "xxh3:0", 0, time.time(), "n1")


def test_requests_while_redis_loads_its_data_wait_until_it_is_ready(
        saved_redis: _SavedRedis, tmp_path: Path) -> None:
    direct = redis.Redis(port=saved_redis.port)
    with direct.pipeline(transaction=False) as pipe:
        for i in range(4000):
            pipe.set(f"filler:{i}", "x")
        pipe.execute()
    meta = RedisMetadata(Settings(dir=tmp_path, redis_url=f"redis://127.0.0.1:{saved_redis.port}/0",
                                  connect_timeout=10))
    try:
        old = meta.publish(_record("load/old"))
        direct.save()
        direct.close()
        saved_redis.stop()
        saved_redis.start("--key-load-delay", "400", "--loading-process-events-interval-bytes",
                          "1024")  # (4,000 keys at 0.4 ms: ~1.6 s of LOADING)
        probe = redis.Redis(port=saved_redis.port, retry=None)
        with pytest.raises(redis.BusyLoadingError):  # (it is loading: what is tested is met)
            probe.get("filler:0")
        probe.close()
        assert meta.lookup("load/old") == old
        soon = meta.publish_soon(_record("load/soon"))
        assert meta.publish(_record("load/new")).version > old.version
        assert meta.wait_any(["load/old"], 10) == old
        stored = soon()
        assert meta.lookup("load/soon") == stored and stored.version > old.version
    finally:
        meta.close()


def test_values_set_without_waiting_survive_a_connection_redis_closed(
        saved_redis: _SavedRedis, tmp_path: Path) -> None:
    """``set_later`` (a group's cursor, a stream's head) sends an ``HSET`` and reads its reply
    later. On a connection Redis has closed (an idle ``timeout``, ``CLIENT KILL``, a restart)
    the write succeeds locally and the reply never comes: the command is sent again on the
    next connection, and ``flush`` returns once it has run (it was lost)."""
    meta = RedisMetadata(Settings(dir=tmp_path, redis_url=f"redis://127.0.0.1:{saved_redis.port}/0",
                                  connect_timeout=5))
    direct = redis.Redis(port=saved_redis.port)
    try:
        meta.set_later("later:groups", {"g": 1})
        meta.flush()
        direct.client_kill_filter(_type="normal", skipme=True)  # (as Redis's idle timeout)
        time.sleep(0.1)
        meta.set_later("later:groups", {"g": 2})
        meta.flush()
        assert direct.hgetall("later:groups") == {b"g": b"2"}
        meta.set_later("later:groups", {"g": 3})
        direct.client_kill_filter(_type="normal", skipme=True)  # (before its reply was read)
        assert meta.hgetall("later:groups") == {b"g": b"3"}
    finally:
        direct.close()
        meta.close()


def test_scripts_run_without_waiting_need_no_script_cache(
        saved_redis: _SavedRedis, tmp_path: Path) -> None:
    """``eval_later`` (a group's fenced cursor commit) sends a script and reads its reply
    later. A restarted Redis knows no script (``SCRIPT FLUSH`` and a closed connection here),
    and an operator's ``SCRIPT FLUSH`` empties the cache under a live connection: the script
    still runs, also when it is the command sent again because its reply never came (never
    ``NOSCRIPT``)."""
    meta = RedisMetadata(Settings(dir=tmp_path, redis_url=f"redis://127.0.0.1:{saved_redis.port}/0",
                                  connect_timeout=5))
    direct = redis.Redis(port=saved_redis.port)
    script = "return redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])"
    try:
        meta.eval_later(script, ["later:script"], ["g", 1])
        meta.flush()
        assert direct.hgetall("later:script") == {b"g": b"1"}
        direct.script_flush()
        direct.client_kill_filter(_type="normal", skipme=True)  # (as a restart)
        time.sleep(0.1)
        meta.eval_later(script, ["later:script"], ["g", 2])
        meta.flush()
        assert direct.hgetall("later:script") == {b"g": b"2"}
        meta.eval_later(script, ["later:script"], ["g", 3])
        direct.script_flush()
        direct.client_kill_filter(_type="normal", skipme=True)  # (before its reply was read)
        assert meta.hgetall("later:script") == {b"g": b"3"}
        direct.script_flush()  # (a live connection: nothing tells it)
        for value in (4, 5):
            meta.eval_later(script, ["later:script"], ["g", value])
            assert meta.hgetall("later:script") == {b"g": str(value).encode()}
        meta.flush()
    finally:
        direct.close()
        meta.close()


def test_calls_keep_their_deadline_while_redis_does_not_answer(saved_redis: _SavedRedis,
                                                               tmp_path: Path) -> None:
    """A Redis that stops answering (stopped, swapping, a long fork): a wait and a lookup with a
    short timeout end by it (``ConsumeTimeout``, ``MetadataUnavailable``), not after the
    socket's timeout (5 s here) per attempt."""
    import os
    import signal

    from instride.errors import ConsumeTimeout, MetadataUnavailable
    from tests.conftest import stop_process

    meta = RedisMetadata(Settings(dir=tmp_path, redis_url=f"redis://127.0.0.1:{saved_redis.port}/0",
                                  connect_timeout=5))
    assert saved_redis.proc is not None
    try:
        meta.publish(_record("quiet/warm"))  # (the connections made)
        meta.wait_any(["quiet/warm"], 5)
        stop_process(saved_redis.proc.pid)
        try:
            start = time.monotonic()
            with pytest.raises(ConsumeTimeout):
                meta.wait_any(["quiet/x"], 0.5)
            assert time.monotonic() - start < 3
            start = time.monotonic()
            with pytest.raises(MetadataUnavailable):
                meta.lookup("quiet/x", time.monotonic() + 0.5)
            assert time.monotonic() - start < 3
        finally:
            os.kill(saved_redis.proc.pid, signal.SIGCONT)
        assert meta.lookup("quiet/warm") is not None  # (answering again: nothing left broken)
    finally:
        meta.close()


@pytest.mark.parametrize("keys", [["restart-top"], ["restart/a/k", "elsewhere/k"]])
def test_a_wait_subscribed_per_key_outlasts_a_restart_that_loads_data(
        saved_redis: _SavedRedis, tmp_path: Path, keys: list[str]) -> None:
    """A wait that subscribes per key (a key of no directory, keys of no common directory, a
    Redis user without pattern rights) across a Redis restart that reads its data back: its
    new subscription's ``PING`` was answered ``LOADING``, which the wait took for a refusal
    and **ended with ``MetadataUnavailable``** (waiters survive restarts). It subscribes again
    until Redis is ready, and returns the record published then."""
    direct = redis.Redis(port=saved_redis.port)
    with direct.pipeline(transaction=False) as pipe:
        for i in range(4000):
            pipe.set(f"filler:{i}", "x")
        pipe.execute()
    url = f"redis://127.0.0.1:{saved_redis.port}/0"
    meta = RedisMetadata(Settings(dir=tmp_path, redis_url=url, connect_timeout=10))
    got: list[object] = []

    def wait() -> None:
        try:
            got.append(meta.wait_any(keys, 30))
        except Exception as exc:  # noqa: BLE001 (what it raised is the result)
            got.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)  # (a hang must not hang the suite)
    waiter.start()
    publisher = None
    try:
        time.sleep(0.5)  # (subscribed, waiting)
        direct.save()
        direct.close()
        saved_redis.stop()
        saved_redis.start("--key-load-delay", "400", "--loading-process-events-interval-bytes",
                          "1024")  # (4,000 keys at 0.4 ms: ~1.6 s of LOADING)
        publisher = RedisMetadata(Settings(dir=tmp_path, redis_url=url, connect_timeout=10))
        stored = publisher.publish(_record(keys[0]))  # (once Redis is ready)
        waiter.join(20)
        assert not waiter.is_alive(), "the wait went on"
        assert got == [stored]
    finally:
        meta.close()
        if publisher is not None:
            publisher.close()


def test_a_wait_backs_off_while_redis_loads_its_data(saved_redis: _SavedRedis,
                                                     tmp_path: Path) -> None:
    """A wait subscribed per key across a restart whose Redis
    answers ``LOADING`` for ~3 s: each attempt to subscribe is answered ``LOADING`` and its
    connection closed; the wait **connected again every 0.05 s** (~60 connections in 3 s
    per waiting thread: a node's pool of waiters hammering a Redis busy loading). It backs
    off, doubling its pause to 1 s, and still returns the record published once Redis is
    ready; a wait whose timeout comes during the loading still ends at it."""
    direct = redis.Redis(port=saved_redis.port)
    with direct.pipeline(transaction=False) as pipe:
        for i in range(4000):
            pipe.set(f"filler:{i}", "x")
        pipe.execute()
    url = f"redis://127.0.0.1:{saved_redis.port}/0"
    keys = ["backoff-top"]  # (a key of no directory: subscribed per key)
    meta = RedisMetadata(Settings(dir=tmp_path, redis_url=url, connect_timeout=10))
    short = RedisMetadata(Settings(dir=tmp_path, redis_url=url, connect_timeout=10))
    got: list[object] = []
    ended: list[tuple[float, object]] = []

    def wait() -> None:
        try:
            got.append(meta.wait_any(keys, 30))
        except Exception as exc:  # noqa: BLE001 (what it raised is the result)
            got.append(exc)

    def wait_short() -> None:  # (its timeout runs out while Redis loads)
        time.sleep(0.8)
        start = time.monotonic()
        try:
            ended.append((0.0, short.wait_any([keys[0] + "-never"], 1.0)))
        except Exception as exc:  # noqa: BLE001 (what it raised is the result)
            ended.append((time.monotonic() - start, exc))

    waiter = threading.Thread(target=wait, daemon=True)  # (a hang must not hang the suite)
    waiter.start()
    publisher = probe = None
    try:
        time.sleep(0.5)  # (subscribed, waiting)
        direct.save()
        direct.close()
        saved_redis.stop()
        saved_redis.start("--key-load-delay", "750", "--loading-process-events-interval-bytes",
                          "1024")  # (4,000 keys at 0.75 ms: ~3 s of LOADING)
        timed = threading.Thread(target=wait_short, daemon=True)
        timed.start()
        probe = redis.Redis(port=saved_redis.port, retry=None)  # (one connection, kept)
        assert probe.info("persistence")["loading"] == 1
        while probe.info("persistence")["loading"]:
            time.sleep(0.05)
        # (this probe's, the two waits' subscribers (the short one's ended), the waiter's
        # first attempts: a handful with a backoff; ~60 without)
        made = probe.info("stats")["total_connections_received"]
        assert made <= 20, made
        publisher = RedisMetadata(Settings(dir=tmp_path, redis_url=url, connect_timeout=10))
        stored = publisher.publish(_record(keys[0]))
        waiter.join(20)
        timed.join(20)
        assert not waiter.is_alive(), "the wait went on"
        assert got == [stored]
        assert len(ended) == 1 and isinstance(ended[0][1], ConsumeTimeout), ended
        assert ended[0][0] < 3.0, ended  # (its timeout, 1 s: not a pause past it)
    finally:
        if probe is not None:
            probe.close()
        meta.close()
        short.close()
        if publisher is not None:
            publisher.close()
