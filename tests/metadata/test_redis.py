"""Cluster-mode metadata (Redis) passes the metadata contract, plus versions and restarts."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import hiredis
import pytest
import redis

from instride.config import Settings
from instride.errors import (
    AuthenticationError,
    ConfigError,
    ConsumeTimeout,
    KeyExistsError,
    MetadataUnavailable,
)
from instride.metadata.base import Record
from instride.metadata.redis import RedisMetadata
from tests.conftest import RedisServer
from tests.relay import ReplyDropper

from .contract import MetadataContract, Put


@pytest.fixture
def backend(redis_server: RedisServer, tmp_path) -> Iterator[RedisMetadata]:  # type: ignore[no-untyped-def]
    b = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=2))
    yield b
    b.close()


@pytest.fixture
def put(backend: RedisMetadata) -> Put:
    def _put(key: str, data: bytes) -> Record:
        return backend.publish(Record(key, "127.0.0.1:1", len(data), "xxh3:0", 0, time.time(), "n1"))

    return _put


class TestRedisMetadata(MetadataContract):
    pass


def _via(relay: Any, tmp_path: Any, connect_timeout: float = 5) -> RedisMetadata:
    """A backend that reaches Redis through ``relay`` (a :class:`ReplyDropper`)."""
    return RedisMetadata(Settings(dir=tmp_path, redis_url=f"redis://127.0.0.1:{relay.port}/0",
                                  connect_timeout=connect_timeout))


def _record(key: str) -> Record:
    return Record(key, "127.0.0.1:1", 1, "xxh3:0", 0, time.time(), "n1")


def test_versions_bump_and_write_once(backend: RedisMetadata, put: Put) -> None:
    first = put("v/k", b"1").version
    second = put("v/k", b"22").version
    assert 1 <= first < second
    rec = backend.lookup("v/k")
    assert rec is not None and rec.version == second and rec.size == 2
    with pytest.raises(KeyExistsError):
        backend.publish(Record("v/k", "x:1", 1, None, 0, time.time()), overwrite=False)
    assert backend.lookup("v/k").version == second  # type: ignore[union-attr]


def test_waiter_survives_redis_restart(redis_server: RedisServer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    settings = Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=2)
    waiter = RedisMetadata(settings)
    result: list[Record] = []
    t = threading.Thread(target=lambda: result.append(waiter.wait_any(["r/k"], 30)))
    t.start()
    time.sleep(0.3)
    redis_server.stop()
    time.sleep(0.5)
    redis_server.start()  # same port, empty (no persistence)
    time.sleep(0.5)
    publisher = RedisMetadata(settings)
    publisher.publish(Record("r/k", "x:1", 1, None, 0, time.time()))
    t.join(30)
    assert result and result[0].key == "r/k"
    waiter.close()
    publisher.close()


def test_unreachable_redis_is_a_typed_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.conftest import free_port

    b = RedisMetadata(Settings(dir=tmp_path, redis_url=f"redis://127.0.0.1:{free_port()}/0",
                               connect_timeout=0.5))
    start = time.monotonic()
    with pytest.raises(MetadataUnavailable) as info:
        b.lookup("x")
    assert time.monotonic() - start < 10
    assert "127.0.0.1" in str(info.value)


def test_an_unreachable_redis_error_does_not_show_its_password(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The job's Redis password is not in the error (printed to a job's output file, often
    readable by others, while that Redis listens on the node's address)."""
    import pickle

    from tests.conftest import free_port

    port = free_port()
    for url, shows in ((f"redis://:s3cretpw@127.0.0.1:{port}/0", "***@127.0.0.1"),
                       # (redis-py reads a password of the query too)
                       (f"redis://127.0.0.1:{port}/0?password=s3cretpw", "password=***")):
        b = RedisMetadata(Settings(dir=tmp_path, redis_url=url, connect_timeout=0.5))
        with pytest.raises(MetadataUnavailable) as info:
            b.lookup("x")
        for shown in (str(info.value), info.value.url,
                      repr(pickle.loads(pickle.dumps(info.value)))):
            assert "s3cretpw" not in shown and shows in shown, shown


def test_a_deleted_key_leaves_nothing_and_its_next_version_is_higher(backend: RedisMetadata,
                                                                     put: Put) -> None:
    put("d/k", b"1")
    second = put("d/k", b"2").version
    backend.delete("d/k")
    assert backend.lookup("d/k") is None
    # nothing of the key is kept in Redis (a bounded stream forgets a frame per frame)
    assert [k for k in backend.redis.scan_iter("instride:*d/k*")] == []
    # a node caching the second version must not mistake the new publication for its copy
    assert put("d/k", b"3").version > second


@pytest.mark.parametrize("path", ["lean", "redis-py"])
def test_deletes_run_their_script_by_its_digest_and_after_a_script_flush(
        redis_server: RedisServer, tmp_path, path: str) -> None:  # type: ignore[no-untyped-def]
    """``delete`` and ``delete_if`` sent their Lua script's whole text with every call
    (``EVAL``; a stream that deletes per frame sends it per frame): they go by its digest
    (``EVALSHA``), and Redis having forgotten it (a restart, ``SCRIPT FLUSH``: ``NOSCRIPT``)
    still deletes."""
    admin = redis.Redis.from_url(redis_server.url)
    md = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=5))
    if path == "redis-py":
        md._fast_args = None  # (the redis-py path, as a unix:// or TLS URL takes)

    def calls(command: str) -> int:
        return int(admin.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))

    try:
        # first use, again by digest, after a flush, again by digest
        for i, flush in enumerate((False, False, True, False)):
            recs = [md.publish(_record(f"sha/{i}/{j}")) for j in range(2)]
            if flush:
                admin.script_flush()
            evals = calls("eval")
            md.delete(recs[0].key)
            assert md.delete_if(recs[1])
            assert md.lookup(recs[0].key) is None and md.lookup(recs[1].key) is None
            if i in (1, 3):  # (else the script's text may go once, to load it)
                assert calls("eval") == evals
    finally:
        md.close()
        admin.close()


def test_a_version_never_goes_back_below_what_the_key_had(backend: RedisMetadata, put: Put) -> None:
    # keys left by an earlier instride (a version counter per key, kept past deletion) or with
    # a record of a version above the clock: the next publication gets a higher version
    # still, and the clock moves past it, so a copy cached before an upgrade is never taken
    # for a later publication
    r = backend.redis
    clock = int(r.get("instride:clock") or 0)
    r.set("instride:ver:up/gone", clock + 50)  # (deleted under the old scheme: its counter kept)
    assert put("up/gone", b"x").version == clock + 51
    assert r.exists("instride:ver:up/gone") == 0  # (the leftover is gone with its use)
    r.hset("instride:rec:up/high", mapping={"version": clock + 90, "owner": "x:1", "size": 1,
                                             "checksum": "", "time": 0, "node": "", "key": "up/high"})
    assert put("up/high", b"y").version == clock + 91
    assert put("up/next", b"z").version == clock + 92  # (the clock moved past both)


def test_commands_run_with_a_publication_only_once_it_is_stored(backend: RedisMetadata,
                                                                put: Put) -> None:
    """A stream's producer shares its head and forgets retired frames in the step that
    records the next frame: the commands run after the record, and not at all if the
    publication is refused."""
    put("t/old", b"1")
    rec = Record("t/new", "127.0.0.1:1", 1, "xxh3:0", 0, time.time(), "n1")
    head = "instride:test:head"
    then = [("HSET", head, "oldest", 1, "written", 2), *backend.forget_commands("t/old")]
    assert backend.publish(rec, then=then).version >= 1
    assert backend.lookup("t/new") is not None and backend.lookup("t/old") is None
    assert "t/old" not in backend.list("t/")
    assert backend.redis.hgetall(head) == {b"oldest": b"1", b"written": b"2"}
    with pytest.raises(KeyExistsError):  # refused: the commands do not run
        backend.publish(rec, overwrite=False, then=[("HSET", head, "written", 3)])
    assert backend.redis.hget(head, "written") == b"2"


@pytest.fixture(params=["short", "long"])
def form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The publication's form: the short one (what a plain key's and a stream frame's records
    go in), or the long one (any other follow-up commands)."""
    if request.param == "long":
        import instride.metadata.redis as backend_module

        monkeypatch.setattr(backend_module, "_frame_words", lambda *_: None)
    return str(request.param)


def _frame_steps(stream: str, oldest: int, written: int,
                 retired: list[str]) -> list[tuple[Any, ...]]:
    """What a stream's producer runs with a frame's publication (streamstate's
    ``along_publication``): its head counters, the retired frames' records forgotten."""
    return RedisMetadata.frame_steps(stream, f"instride:stream:{stream}:head",
                                     f"instride:stream:{stream}:groups", oldest, written, retired)


@pytest.mark.parametrize("soon", [False, True])
def test_a_stream_frames_short_record_stores_what_the_long_one_does(
        backend: RedisMetadata, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch,
        soon: bool) -> None:
    """A stream frame's record goes in the short form (the script makes the names, the
    announcement and the follow-up commands from their words): it stores, announces, runs and
    reports exactly what the long form does — and four fit one TCP segment, where one of the
    long form did (Redis woken once per segment of records held back)."""
    import instride.metadata.redis as backend_module

    other = redis.Redis.from_url(redis_server.url)
    watch = other.pubsub()
    got: dict[str, Any] = {}
    try:
        for form in ("short", "long"):
            stream = f"eq{form}/s"
            for i in range(3):  # (the frames the publication retires)
                backend.publish(_record(f"{stream}/f{i}"))
            other.hset(f"instride:stream:{stream}:groups", mapping={"g": 2, "h": 5})
            watch.subscribe(f"instride:pub:{stream}/f3")
            assert watch.get_message(timeout=5)["type"] == "subscribe"  # type: ignore[index]
            rec = Record(f"{stream}/f3", "10.213.82.11:7437", 659752, "isf:dc58279ee6f1e961", 0,
                         1796118320.042593, "node1")
            then = _frame_steps(stream, 2, 4, [f"{stream}/f0", f"{stream}/f1"])
            report = f"instride:stream:{stream}:groups"
            if form == "long":  # (the long form, as for any other follow-up commands)
                monkeypatch.setattr(backend_module, "_frame_words", lambda *_: None)
            sent = backend._publication(rec, True, then, report)
            assert sent[2] is (form == "short")
            if form == "short":
                packed = hiredis.pack_command(backend._evalsha(sent))
                assert 4 * (len(packed) + len(backend_module._AHEAD)) <= 1448, len(packed)
            if soon:
                pending = backend.publish_soon(rec, then=then, report=report)
                stored = pending()
                reported = pending.reported
            else:
                stored = backend.publish(rec, then=then)
                reported = None
            msg = watch.get_message(timeout=5)
            while msg is not None and msg["type"] != "message":
                msg = watch.get_message(timeout=5)
            assert msg is not None
            fields = other.hgetall(f"instride:rec:{stream}/f3")
            assert fields.pop(b"pub") and fields.pop(b"version") == str(stored.version).encode()
            got[form] = {
                "record": {k: v.replace(form.encode(), b"*") for k, v in fields.items()},
                "announced": msg["data"].split(b"\0", 1)[1].replace(form.encode(), b"*"),
                "version in it": msg["data"].split(b"\0", 1)[0] == str(stored.version).encode(),
                "head": other.hgetall(f"instride:stream:{stream}:head"),
                "forgotten": [other.exists(f"instride:rec:{stream}/f{i}") for i in range(3)],
                "listed": [k.replace(form, "*") for k in backend.list(f"{stream}/")],
                "reported": reported,
            }
        monkeypatch.undo()
        assert got["short"] == got["long"]
        assert got["short"]["version in it"] and got["short"]["forgotten"] == [0, 0, 1]
        assert got["short"]["head"] == {b"oldest": b"2", b"written": b"4"}
        assert got["short"]["reported"] == ({b"g": b"2", b"h": b"5"} if soon else None)
        # (other follow-up commands -- the same words as a plain list, a head of another
        # name -- or a report of another hash: the long form says them)
        assert then == [("HSET", f"instride:stream:{stream}:head", "oldest", 2, "written", 4),
                        *RedisMetadata.forget_commands(f"{stream}/f0"),
                        *RedisMetadata.forget_commands(f"{stream}/f1")]
        assert backend._publication(rec, True, list(then), None)[2] is False
        other_head = RedisMetadata.frame_steps(stream, "instride:test:head", report, 1, 2, [])
        assert other_head == [("HSET", "instride:test:head", "oldest", 1, "written", 2)]
        assert backend._publication(rec, True, other_head, None)[2] is False
        assert backend._publication(rec, True, then, "instride:stream:other:groups")[2] is False
        assert backend._publication(rec, True, then, None)[2] is True
        assert backend._publication(rec, True, (), None)[2] is True
        then.append(("HSET", "instride:test:other", "a", 1))  # (a command added: long form)
        assert backend._publication(rec, True, then, None)[2] is False
    finally:
        watch.close()
        other.close()


@pytest.mark.parametrize("soon", ["now", "soon", "held"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_publication_whose_reply_is_lost_is_retried_as_itself(redis_server: RedisServer,
                                                                  tmp_path, overwrite: bool,
                                                                  soon: str, form: str) -> None:  # type: ignore[no-untyped-def]
    """The connection fails after Redis stored a record and before its reply arrived: the
    retry finds the publication done — one version, one announcement — and a write-once
    key is not reported as existing (its own producer would otherwise fail). ``soon``: the
    record sent without waiting (``publish_soon``), the lost reply found by its confirmation;
    ``held``: held back first (``hold=True``), pushed out by the confirmation."""
    relay = ReplyDropper((redis_server.host, redis_server.port))
    url = f"redis://127.0.0.1:{relay.port}/0"
    b = RedisMetadata(Settings(dir=tmp_path, redis_url=url, connect_timeout=5))
    watch = redis.Redis.from_url(redis_server.url).pubsub()
    try:
        warm = b.publish(Record("lost/warm", "127.0.0.1:1", 1, "xxh3:0", 0, time.time(), "n1"))
        watch.subscribe("instride:pub:lost/k")
        assert watch.get_message(timeout=5)["type"] == "subscribe"  # type: ignore[index]
        relay.armed = True
        lost = Record("lost/k", "127.0.0.1:1", 7, "xxh3:1", 0, time.time(), "n1")
        rec = b.publish(lost, overwrite=overwrite) if soon == "now" \
            else b.publish_soon(lost, overwrite=overwrite, hold=soon == "held")()
        assert relay.dropped == 1  # the reply was lost: the publication was retried
        assert rec.version == warm.version + 1  # (one publication, not two)
        stored = b.lookup("lost/k")
        assert stored is not None and stored.version == rec.version and stored.size == 7
        first = watch.get_message(timeout=5)
        assert first is not None and first["type"] == "message"
        assert watch.get_message(timeout=0.3) is None  # announced once
        # a later publication of the key is a new one: refused write-once, a new version else
        if overwrite:
            again = b.publish(Record("lost/k", "127.0.0.1:1", 7, "xxh3:1", 0, time.time(), "n1"))
            assert again.version == rec.version + 1
        else:
            with pytest.raises(KeyExistsError):
                b.publish(Record("lost/k", "127.0.0.1:1", 7, "xxh3:1", 0, time.time(), "n1"),
                          overwrite=False)
    finally:
        watch.close()
        b.close()
        relay.close()


class _DropAfterAnotherWrites(ReplyDropper):
    """A :class:`ReplyDropper` that, once Redis has answered the armed request, lets another
    writer act (``meanwhile``) before it cuts the connection: the client's retry comes after
    that writer's publication, every time (no race to win). ``cut=False``: the connection
    is left up, the reply kept (the client waits on: ``meanwhile`` interrupts it);
    ``skip``: that many requests that hold the marker pass before the armed one."""

    def __init__(self, upstream: tuple[str, int], meanwhile: Callable[[], None], *,
                 cut: bool = True, skip: int = 0) -> None:
        self.meanwhile = meanwhile
        self.cut = cut
        self.skip = skip
        super().__init__(upstream)

    def _up(self, src: socket.socket, dst: socket.socket, doomed: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if self.armed and self.marker in data:
                    if self.skip:
                        self.skip -= 1
                    else:
                        self.armed = False
                        doomed.set()  # (before the request goes: its reply is the one dropped)
                dst.sendall(data)

    def _down(self, src: socket.socket, dst: socket.socket, doomed: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if doomed.is_set():
                    self.meanwhile()  # (the client still waits for the reply it never gets)
                    self.dropped += 1
                    if self.cut:
                        for s in (src, dst):
                            s.shutdown(socket.SHUT_RDWR)
                            s.close()
                    return
                dst.sendall(data)


@pytest.mark.parametrize("soon", ["now", "soon"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_retried_publication_never_overwrites_a_newer_record(redis_server: RedisServer,
                                                               tmp_path, overwrite: bool,
                                                               soon: str, form: str) -> None:  # type: ignore[no-untyped-def]
    """Redis stored a publication, its reply was lost, and another writer published the key
    before the retry: the publish script knew only the key's last publication id, so the
    retry was taken for a new publication and **stored the older record over the newer one**
    (a version above it: readers and caches took the stale record for the latest), or, for a
    write-once key, raised :class:`KeyExistsError` for its own stored publication. The retry
    finds its publication done: the newer record stays, and it reports its own version."""
    other = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=5))
    newer: list[Record] = []
    relay = _DropAfterAnotherWrites(
        (redis_server.host, redis_server.port),
        lambda: newer.append(other.publish(Record("race/k", "127.0.0.1:2", 22, "xxh3:2", 0,
                                                  time.time(), "n2"))))
    b = _via(relay, tmp_path)
    try:
        warm = b.publish(_record("race/warm"))
        relay.armed = True
        mine = Record("race/k", "127.0.0.1:1", 7, "xxh3:1", 0, time.time(), "n1")
        rec = b.publish(mine, overwrite=overwrite) if soon == "now" \
            else b.publish_soon(mine, overwrite=overwrite)()
        assert relay.dropped == 1 and len(newer) == 1  # (lost reply, then the other writer)
        assert rec.version == warm.version + 1 < newer[0].version  # its own, stored first
        assert b.lookup("race/k") == newer[0]  # the newer record stays
        # (a later publication is a new one, as always)
        assert b.publish(mine).version > newer[0].version
    finally:
        b.close()
        other.close()
        relay.close()


@pytest.mark.parametrize("between", ["a delete", "a delete and another publication"])
def test_a_retried_publication_never_brings_back_a_record_deleted_meanwhile(
        redis_server: RedisServer, tmp_path, between: str, form: str) -> None:  # type: ignore[no-untyped-def]
    """Redis stored a publication, its reply was lost, and the key was deleted (and perhaps
    published again by another writer) before the retry: the retry found no record of its own
    and stored it again, bringing back a deleted record or putting the older record over the
    newer one. A delete leaves the publication's mark, as an overwrite does: the retry is done
    already, and stores nothing."""
    other = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=5))
    newer: list[Record] = []

    def meanwhile() -> None:
        other.delete("gone/k")
        if between != "a delete":
            newer.append(other.publish(Record("gone/k", "127.0.0.1:2", 22, "xxh3:2", 0,
                                              time.time(), "n2")))

    relay = _DropAfterAnotherWrites((redis_server.host, redis_server.port), meanwhile)
    b = _via(relay, tmp_path)
    try:
        warm = b.publish(_record("gone/warm"))
        relay.armed = True
        rec = b.publish(Record("gone/k", "127.0.0.1:1", 7, "xxh3:1", 0, time.time(), "n1"))
        assert relay.dropped == 1  # (lost reply, then the delete)
        assert rec.version == warm.version + 1  # its own, stored first
        assert b.lookup("gone/k") == (newer[0] if newer else None)  # nothing brought back
    finally:
        b.close()
        other.close()
        relay.close()


def test_a_retried_delete_never_forgets_a_publication_stored_meanwhile(
        redis_server: RedisServer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Redis ran a delete, its reply was lost, and another writer published the key again
    before the retry: the retry forgot that newer publication (a file on its owner's node
    that no other node could find any more). A delete leaves a mark of its own, as a
    publication does: its retry finds it done, and forgets nothing more."""
    other = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=5))
    newer: list[Record] = []

    def meanwhile() -> None:
        newer.append(other.publish(Record("del/k", "127.0.0.1:2", 22, "xxh3:2", 0,
                                          time.time(), "n2")))

    relay = _DropAfterAnotherWrites((redis_server.host, redis_server.port), meanwhile)
    b = _via(relay, tmp_path)
    try:
        b.publish(_record("del/k"))
        b.delete("del/warm")  # (the script loaded: the armed request is the one that runs)
        relay.armed = True
        b.delete("del/k")
        assert relay.dropped == 1  # (lost reply, then the other's publication)
        assert newer and b.lookup("del/k") == newer[0]  # the newer publication stays
        assert "del/k" in b.list("del/")
        b.delete("del/k")  # (a delete of its own, later: forgets it)
        assert b.lookup("del/k") is None
    finally:
        b.close()
        other.close()
        relay.close()


def test_a_full_redis_still_forgets_what_is_deleted(backend: RedisMetadata,
                                                   redis_server: RedisServer) -> None:
    """Redis full (``maxmemory``, ``noeviction``: writes that take memory refused ``OOM``): a
    delete wrote its marks first, so it was refused and forgot nothing — the one command
    that frees memory, refused when memory is what is missing. It forgets the record first
    now; the marks follow where Redis takes them."""
    admin = redis.Redis.from_url(redis_server.url)
    try:
        for key in ("full/a", "full/b"):
            backend.publish(_record(key))
        b_record = backend.lookup("full/b")
        assert b_record is not None
        admin.config_set("maxmemory", "1")
        with pytest.raises(MetadataUnavailable, match="OOM"):  # (Redis is full indeed)
            backend.publish(_record("full/c"))
        backend.delete("full/a")
        assert backend.delete_if(b_record)
        assert backend.list("full/") == []
        assert not admin.exists("instride:rec:full/a") and not admin.exists("instride:rec:full/b")
    finally:
        admin.config_set("maxmemory", "0")
        admin.close()


def test_a_late_retry_is_settled_by_its_own_record_and_unsettled_without_it(
        redis_server: RedisServer, tmp_path, monkeypatch: pytest.MonkeyPatch, form: str) -> None:  # type: ignore[no-untyped-def]
    """The marks that let a retry know it was overwritten or deleted meanwhile last a bounded
    time. A retry later than that still finds its own record (a confirmation from another
    thread, minutes after a stream's last frame: its close must settle it), but where the
    record is another's or gone and no mark says more, it is :class:`PublicationUnsettled`
    (register it again), never stored blindly over a newer record."""
    from instride.errors import PublicationUnsettled
    from instride.metadata import redis as backend_module

    monkeypatch.setattr(backend_module, "_RETRY_WITHIN_S", 0.0)  # (every retry is late)
    direct = redis.Redis.from_url(redis_server.url)
    relay = ReplyDropper((redis_server.host, redis_server.port))
    b = _via(relay, tmp_path)
    try:
        warm = b.publish(_record("late/warm"))
        relay.armed = True  # its own record there: settled, its version
        assert b.publish(_record("late/k")).version == warm.version + 1
        assert relay.dropped == 1
        # confirmed from another thread (its answer not read there: sent again) long after
        pending = b.publish_soon(_record("late/t"))
        confirmed: list[Any] = []
        worker = threading.Thread(target=lambda: confirmed.append(pending()))
        worker.start()
        worker.join(30)
        assert confirmed and confirmed[0].version == warm.version + 2
        # overwritten meanwhile and its mark gone (expired): unsettled, the newer record kept
        other = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url,
                                       connect_timeout=5))

        def overwritten() -> None:
            other.publish(Record("late/o", "127.0.0.1:2", 22, "xxh3:2", 0, time.time(), "n2"))
            for mark in direct.keys("instride:was:*"):
                direct.delete(mark)

        relay.close()
        relay = _DropAfterAnotherWrites((redis_server.host, redis_server.port), overwritten)
        b.close()
        b = _via(relay, tmp_path)
        b.publish(_record("late/warm2"))
        relay.armed = True
        with pytest.raises(PublicationUnsettled, match="holds neither its record nor a mark"):
            b.publish(Record("late/o", "127.0.0.1:1", 7, "xxh3:1", 0, time.time(), "n1"))
        assert b.lookup("late/o").owner == "127.0.0.1:2"  # the newer record stays
        other.close()
    finally:
        b.close()
        relay.close()


def test_a_publication_redis_never_answered_is_unsettled_not_failed(redis_server: RedisServer,
                                                                    tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Redis stored a record and then went out of reach before its answer, for longer than
    the connect timeout: the publication raises :class:`PublicationUnsettled` (it may be
    recorded: here it is), not the plain :class:`MetadataUnavailable` of a Redis that never
    got it."""
    from instride.errors import PublicationUnsettled

    relay = ReplyDropper((redis_server.host, redis_server.port), refuse=True)
    b = _via(relay, tmp_path, 0.5)
    direct = redis.Redis.from_url(redis_server.url)
    try:
        b.publish(Record("unsettled/warm", "127.0.0.1:1", 1, "xxh3:0", 0, time.time(), "n1"))
        relay.armed = True
        with pytest.raises(PublicationUnsettled, match="'unsettled/k' may or may not be recorded") \
                as info:
            b.publish(Record("unsettled/k", "127.0.0.1:1", 7, "xxh3:1", 0, time.time(), "n1"),
                      overwrite=False)
        assert isinstance(info.value, MetadataUnavailable) and info.value.key == "unsettled/k"
        assert direct.hget("instride:rec:unsettled/k", "size") == b"7"  # stored after all
        # Redis out of reach before anything was sent: plainly unavailable (nothing stored)
        with pytest.raises(MetadataUnavailable) as info:
            b.publish(Record("unsettled/never", "127.0.0.1:1", 1, "xxh3:2", 0, time.time(), "n1"))
        assert not isinstance(info.value, PublicationUnsettled)
        assert not direct.exists("instride:rec:unsettled/never")
    finally:
        direct.close()
        b.close()
        relay.close()


def test_a_pending_publication_redis_did_not_run_stays_plainly_unavailable(
        redis_server: RedisServer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``publish_soon``'s record answered ``NOSCRIPT`` (Redis forgot the script: it did not
    run), and Redis out of reach before it went again: nothing is stored, so its
    confirmation is plainly :class:`MetadataUnavailable` — the first time and every time
    after, not :class:`PublicationUnsettled` (its producer would keep a frame for a record
    that cannot exist)."""
    from instride.errors import PublicationUnsettled

    admin = redis.Redis.from_url(redis_server.url)
    relay = ReplyDropper((redis_server.host, redis_server.port), refuse=True, pass_reply=True)
    b = _via(relay, tmp_path, 0.5)
    try:
        b.publish(_record("noscript/warm"))
        admin.script_flush()
        relay.armed = True
        pending = b.publish_soon(_record("noscript/k"))
        deadline = time.monotonic() + 10
        while relay.dropped == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # (its connection's end is in, and seen as such: see resp.FRESH_AFTER)
        for _ in range(2):
            with pytest.raises(MetadataUnavailable) as info:
                pending()
            assert not isinstance(info.value, PublicationUnsettled), info.value
        assert relay.dropped == 1
        assert not admin.exists("instride:rec:noscript/k")
    finally:
        b.close()
        relay.close()
        admin.close()


@pytest.mark.parametrize("held", [False, True])
def test_a_pending_publication_redis_never_answered_is_unsettled_not_failed(
        redis_server: RedisServer, tmp_path, held: bool) -> None:  # type: ignore[no-untyped-def]
    """``publish_soon``'s record, its reply lost after Redis stored it and Redis then out of
    reach past the connect timeout while it is confirmed: the confirmation raised the plain
    :class:`MetadataUnavailable` of a record never sent (its producer would take the frame
    for unpublished). It is :class:`PublicationUnsettled`, as :meth:`publish`'s is, and
    stays so when confirmed again."""
    from instride.errors import PublicationUnsettled

    relay = ReplyDropper((redis_server.host, redis_server.port), refuse=True)
    b = _via(relay, tmp_path, 0.5)
    direct = redis.Redis.from_url(redis_server.url)
    try:
        b.publish(Record("unsettled/warm", "127.0.0.1:1", 1, "xxh3:0", 0, time.time(), "n1"))
        relay.armed = True
        pending = b.publish_soon(Record("unsettled/s", "127.0.0.1:1", 7, "xxh3:1", 0,
                                        time.time(), "n1"), overwrite=False, hold=held)
        for _ in range(2):
            with pytest.raises(PublicationUnsettled,
                               match="'unsettled/s' may or may not be recorded") as info:
                pending()
            assert info.value.key == "unsettled/s"
        assert relay.dropped == 1
        assert direct.hget("instride:rec:unsettled/s", "size") == b"7"  # stored after all
    finally:
        direct.close()
        b.close()
        relay.close()


class _Interrupted(BaseException):
    """What a test's signal handler raises (as Ctrl-C's handler raises KeyboardInterrupt)."""


@pytest.mark.parametrize("between", ["a refusal", "an interrupt"])
def test_a_pending_publication_that_may_be_stored_is_sent_again_as_a_retry(
        redis_server: RedisServer, tmp_path, between: str) -> None:  # type: ignore[no-untyped-def]
    """``publish_soon``'s record not sent (Redis out of reach then) goes with its
    confirmation; Redis stores it there, and the attempt ends before its answer is read: the
    retry that follows is refused (an ACL changed meanwhile: ``NOPERM``), or an interrupt
    comes (Ctrl-C, a signal handler's exception). The record forgot that it may have been
    stored: the next confirmation sent it as a first publication, and it **stored the older
    record over the key's newer one**. It stays a retry, whatever ended the attempt: it
    finds its publication done (its version), and the newer record stays."""
    import signal

    from instride.errors import PublicationUnsettled

    admin = redis.Redis.from_url(redis_server.url)
    admin.execute_command("ACL", "SETUSER", "app", "on", ">pw", "~*", "&*", "+@all")
    other = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=5))
    other.publish(_record("again/warm"))  # (Redis knows the script: EVALSHA runs it)
    main = threading.get_ident()

    def meanwhile() -> None:  # (Redis has stored the record; its answer is not passed on)
        if between == "a refusal":
            admin.execute_command("ACL", "SETUSER", "app", "-evalsha", "-eval")
        else:
            signal.pthread_kill(main, signal.SIGUSR1)

    def interrupt(signum: int, frame: Any) -> None:
        raise _Interrupted

    relay = _DropAfterAnotherWrites((redis_server.host, redis_server.port), meanwhile,
                                    cut=between == "a refusal")
    relay.listener.shutdown(socket.SHUT_RDWR)  # (Redis out of reach while the record is sent)
    relay.listener.close()
    b = RedisMetadata(Settings(dir=tmp_path, redis_url=f"redis://app:pw@127.0.0.1:{relay.port}/0",
                               connect_timeout=2))
    old = signal.signal(signal.SIGUSR1, interrupt)
    try:
        pending = b.publish_soon(Record("again/k", "127.0.0.1:1", 7, "xxh3:1", 0, time.time(),
                                        "n1"))
        assert not admin.exists("instride:rec:again/k")  # (not sent)
        relay.resume()
        relay.armed = True
        with pytest.raises(PublicationUnsettled if between == "a refusal" else _Interrupted):
            pending()
        assert relay.dropped == 1
        stored = int(admin.hget("instride:rec:again/k", "version"))  # (stored after all)
        admin.execute_command("ACL", "SETUSER", "app", "+@all")
        newer = other.publish(Record("again/k", "127.0.0.1:2", 22, "xxh3:2", 0, time.time(),
                                     "n2"))
        assert pending().version == stored  # its own publication, done
        assert b.lookup("again/k") == newer  # the newer record stays
    finally:
        signal.signal(signal.SIGUSR1, old)
        b.close()
        other.close()
        relay.close()
        admin.close()


@pytest.mark.parametrize("between", ["Redis full", "the script forgotten, the key published"])
def test_a_pending_publication_whose_answer_was_lost_is_settled_by_its_retry(
        redis_server: RedisServer, tmp_path, between: str) -> None:  # type: ignore[no-untyped-def]
    """``publish_soon``'s record stored, its answer lost; before the confirmation's retry,
    Redis became full (``maxmemory``, ``noeviction``: every write refused ``OOM``), or forgot
    its scripts (a restart: ``NOSCRIPT``) while another writer published the key. The retry
    writes nothing where its publication is done (its record, or its mark, is read first):
    it is answered its version, not refused, and the newer record stays."""
    admin = redis.Redis.from_url(redis_server.url)
    other = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=5))
    newer: list[Record] = []

    def meanwhile() -> None:
        if between == "Redis full":
            admin.config_set("maxmemory", "1")
        else:
            newer.append(other.publish(Record("full/k", "127.0.0.1:2", 22, "xxh3:2", 0,
                                              time.time(), "n2")))
            admin.script_flush()

    relay = _DropAfterAnotherWrites((redis_server.host, redis_server.port), meanwhile)
    b = _via(relay, tmp_path)
    try:
        warm = b.publish(_record("full/warm"))
        relay.armed = True
        rec = b.publish_soon(Record("full/k", "127.0.0.1:1", 7, "xxh3:1", 0, time.time(),
                                    "n1"))()
        assert relay.dropped == 1
        assert rec.version == warm.version + 1  # its own publication, done
        assert b.lookup("full/k") == (newer[0] if newer else rec)
        if newer:  # (the retry went through redis-py, which loaded the script again: a plain
            # publication's, the short form)
            assert admin.script_exists(b._publish_frame.sha) == [True]
    finally:
        admin.config_set("maxmemory", "0")
        b.close()
        other.close()
        relay.close()
        admin.close()


def test_a_publication_whose_retry_is_refused_is_unsettled_not_refused(
        redis_server: RedisServer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Redis stored a publication, its answer was lost, and the retry was refused for want
    of rights (an ACL changed meanwhile: ``NOPERM``): :meth:`publish` raised
    :class:`AuthenticationError`, as if nothing were stored (the cluster engine removes a
    write-once key's file then, and Redis holds a record naming it). It is
    :class:`PublicationUnsettled` (it may be recorded: here it is), naming the refusal."""
    from instride.errors import PublicationUnsettled

    admin = redis.Redis.from_url(redis_server.url)
    admin.execute_command("ACL", "SETUSER", "app", "on", ">pw", "~*", "&*", "+@all")
    relay = _DropAfterAnotherWrites(
        (redis_server.host, redis_server.port),
        lambda: admin.execute_command("ACL", "SETUSER", "app", "-evalsha", "-eval"))
    b = RedisMetadata(Settings(dir=tmp_path, redis_url=f"redis://app:pw@127.0.0.1:{relay.port}/0",
                               connect_timeout=2))
    try:
        b.publish(_record("refused/warm"))
        relay.armed = True
        with pytest.raises(PublicationUnsettled, match="NOPERM") as info:
            b.publish(Record("refused/k", "127.0.0.1:1", 7, "xxh3:1", 0, time.time(), "n1"),
                      overwrite=False)
        assert relay.dropped == 1 and info.value.key == "refused/k"
        assert admin.hget("instride:rec:refused/k", "size") == b"7"  # stored after all
    finally:
        b.close()
        relay.close()
        admin.close()


@pytest.mark.parametrize("path", ["redis-py", "after NOSCRIPT"])
def test_a_publication_redis_py_sends_again_itself_never_overwrites_a_newer_record(
        redis_server: RedisServer, tmp_path, path: str) -> None:  # type: ignore[no-untyped-def]
    """A publication through redis-py (a URL that needs it, ``unix://`` or TLS; or the
    lean connection's fallback when Redis forgot the script, ``NOSCRIPT``): Redis stored it,
    its answer was lost, and another writer published the key meanwhile. redis-py sends a
    command again itself after a lost connection (its ``Retry``), with the same arguments:
    naming no mark, that send **stored the older record over the newer one**. Each send
    through redis-py names the publication's mark: the newer record stays."""
    admin = redis.Redis.from_url(redis_server.url)
    other = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=5))
    newer: list[Record] = []
    relay = _DropAfterAnotherWrites(
        (redis_server.host, redis_server.port),
        lambda: newer.append(other.publish(Record("py/k", "127.0.0.1:2", 22, "xxh3:2", 0,
                                                  time.time(), "n2"))),
        skip=2 if path == "after NOSCRIPT" else 0)  # (the EVALSHAs answered NOSCRIPT)
    b = _via(relay, tmp_path)
    if path == "redis-py":
        b._fast_args = None  # (the redis-py path, as a unix:// or TLS URL takes)
    try:
        warm = b.publish(_record("py/warm"))
        if path == "after NOSCRIPT":
            admin.script_flush()
        relay.armed = True
        rec = b.publish(Record("py/k", "127.0.0.1:1", 7, "xxh3:1", 0, time.time(), "n1"))
        assert relay.dropped == 1 and len(newer) == 1  # (lost answer, then the other writer)
        assert rec.version == warm.version + 1 < newer[0].version  # its own, stored first
        assert b.lookup("py/k") == newer[0]  # the newer record stays
    finally:
        b.close()
        other.close()
        relay.close()
        admin.close()


def test_a_record_sent_soon_is_stored_before_it_is_confirmed(backend: RedisMetadata,
                                                             redis_server: RedisServer) -> None:
    # publish_soon: Redis stores the record as it reads it; the confirmation gives the stored
    # version, and a refused write-once record raises when confirmed (again on a second call)
    other = redis.Redis.from_url(redis_server.url)
    try:
        other.script_flush()  # (Redis restarted: the script is unknown; the confirmation
        # publishes it the usual way, which loads it)
        first = backend.publish_soon(Record("soon/a", "127.0.0.1:1", 2, "xxh3:1", 0, time.time()))
        assert first().version >= 1 and backend.lookup("soon/a") is not None
        confirm = backend.publish_soon(Record("soon/k", "127.0.0.1:1", 3, "xxh3:2", 0, time.time(),
                                              "n1"))
        deadline = time.monotonic() + 5
        while not other.exists("instride:rec:soon/k") and time.monotonic() < deadline:
            time.sleep(0.005)
        assert other.hget("instride:rec:soon/k", "size") == b"3"  # stored, not yet confirmed
        version = confirm().version
        assert version > first().version
        assert confirm().version == version  # (the same answer: read once)
        assert backend.lookup("soon/k").version == version  # type: ignore[union-attr]
        refused = backend.publish_soon(Record("soon/k", "x:1", 1, "xxh3:3", 0, time.time()),
                                       overwrite=False)
        for _ in range(2):
            with pytest.raises(KeyExistsError):
                refused()
        assert backend.lookup("soon/k").size == 3  # type: ignore[union-attr]
        # an error answer (a command run with the record fails: WRONGTYPE) is raised, every
        # time, as publish raises it — not hidden by sending the publication again
        other.set("soon:str", "x")
        # (the script forgotten again: the record goes through redis-py, which loads it, and
        # its answer is raised every time too -- it had been sent again, as a retry, and
        # answered stored)
        other.script_flush()
        failing = backend.publish_soon(Record("soon/e", "127.0.0.1:1", 1, "xxh3:4", 0, time.time()),
                                       then=[("HSET", "soon:str", "a", "1")])
        for _ in range(2):
            with pytest.raises(MetadataUnavailable, match="WRONGTYPE"):
                failing()
    finally:
        other.close()


def test_a_pending_record_refused_at_login_is_sent_again_and_a_refused_run_keeps_its_errno(
        redis_server: RedisServer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``publish_soon``'s record kept the refusal it met the second time it went (after
    ``NOSCRIPT``, through redis-py) and raised it on every later call: right for an answer of
    the script — it ran, or Redis refused to run it, so sent again it would be taken for a
    retry of a publication done — but a refused login ran nothing: once the password works
    again, the next call publishes. A refusal kept is raised as itself every time (``OOM``:
    ``ENOSPC``, also what ``str()`` shows)."""
    import errno as errno_module

    admin = redis.Redis.from_url(redis_server.url)
    url = f"redis://:pw@127.0.0.1:{redis_server.port}/0"
    try:
        admin.config_set("requirepass", "pw")
        admin = redis.Redis(host=redis_server.host, port=redis_server.port, password="pw")
        b = RedisMetadata(Settings(dir=tmp_path, redis_url=url, connect_timeout=1))
        b.publish(_record("auth/warm"))
        admin.config_set("requirepass", "rotated")  # (the password changed, then back)
        b.close()  # (the record's connection is made again: AUTH first)
        pending = b.publish_soon(_record("auth/k"))
        with pytest.raises(AuthenticationError):
            pending()
        admin = redis.Redis(host=redis_server.host, port=redis_server.port, password="rotated")
        admin.config_set("requirepass", "pw")
        admin = redis.Redis(host=redis_server.host, port=redis_server.port, password="pw")
        assert pending().version >= 1 and admin.exists("instride:rec:auth/k")
        # Redis full and its scripts forgotten: the record's run refused, every time, as itself
        admin.config_set("maxmemory", "1")
        admin.script_flush()
        full = b.publish_soon(_record("auth/full"))
        for _ in range(2):
            with pytest.raises(MetadataUnavailable) as info:
                full()
            assert info.value.errno == errno_module.ENOSPC
            assert str(info.value).startswith(f"[Errno {errno_module.ENOSPC}]"), str(info.value)
        b.close()
    finally:
        admin.config_set("maxmemory", "0")
        admin.config_set("requirepass", "")
        admin.close()


def test_a_held_record_runs_before_whatever_its_thread_asks_next(backend: RedisMetadata,
                                                                 redis_server: RedisServer) -> None:
    """A record held back (``publish_soon(hold=True)``) is run before anything its thread
    asks Redis next — also through redis-py's connections — and ``flush()`` waits for it."""
    other = redis.Redis.from_url(redis_server.url)
    try:
        # (connected, the script loaded: a record is held only on a connection made)
        backend.publish(Record("hold/w", "127.0.0.1:1", 2, "xxh3:1", 0, time.time()))
        backend.publish_soon(Record("hold/a", "127.0.0.1:1", 2, "xxh3:1", 0, time.time()),
                             hold=True)
        backend.flush()
        assert other.exists("instride:rec:hold/a")  # (run, not only sent)
        backend.publish_soon(Record("hold/b", "127.0.0.1:1", 2, "xxh3:1", 0, time.time()),
                             hold=True)
        assert "hold/b" in backend.list("hold/")  # (a redis-py read: the record came first)
    finally:
        other.close()


def test_a_held_record_confirmed_from_another_thread_never_comes_after_its_copy(
        backend: RedisMetadata, redis_server: RedisServer) -> None:
    """Confirmed from another thread than its sender's, a record is sent again on that
    thread's connection: the original, held back in the sender's socket, is pushed out first.
    Coming later, it would record again a key retired meanwhile (a bounded stream's frame
    whose record its producer forgot)."""
    other = redis.Redis.from_url(redis_server.url)
    held, done = [], threading.Event()

    def sender() -> None:  # (alive until the end: its connection is not collected)
        backend.publish(Record("hold/s", "127.0.0.1:1", 2, "xxh3:1", 0, time.time()))
        held.append(backend.publish_soon(Record("hold/t", "127.0.0.1:1", 2, "xxh3:1", 0,
                                                time.time()), hold=True))
        done.wait(30)

    backend.publish(Record("hold/w", "127.0.0.1:1", 2, "xxh3:1", 0, time.time()))
    t = threading.Thread(target=sender)
    t.start()
    try:
        while not held:
            time.sleep(0.001)
        assert held[0]().version >= 1  # (confirmed here: sent again, after the original)
        other.delete("instride:rec:hold/t")  # retired: its record forgotten
        time.sleep(0.4)  # (past Linux's ~0.2 s: an original still held would have come)
        assert not other.exists("instride:rec:hold/t")
    finally:
        done.set()
        t.join(30)
        other.close()


def test_a_record_sent_soon_reads_back_a_hash_in_the_same_step(backend: RedisMetadata,
                                                                redis_server: RedisServer) -> None:
    # publish_soon(report=): the publication reads a hash (a stream's group cursors) right
    # after its own commands, in the same script: the answer carries the hash as it was then
    other = redis.Redis.from_url(redis_server.url)
    try:
        other.hset("rep:groups", mapping={"g": 3, "h": 7})
        sent = backend.publish_soon(Record("rep/k0", "127.0.0.1:1", 2, "xxh3:1", 0, time.time()),
                                    then=[("HSET", "rep:groups", "g", "5")], report="rep:groups")
        assert sent.reported is None  # (not before it is confirmed)
        assert sent().version >= 1
        assert sent.reported == {b"g": b"5", b"h": b"7"}  # (after the publication's own HSET)
        # a hash that does not exist: no fields; no report asked: None
        empty = backend.publish_soon(Record("rep/k1", "127.0.0.1:1", 2, "xxh3:1", 0, time.time()),
                                     report="rep:none")
        assert empty().version > sent().version and empty.reported == {}
        plain = backend.publish_soon(Record("rep/k2", "127.0.0.1:1", 2, "xxh3:1", 0, time.time()))
        assert plain().version > empty().version and plain.reported is None
        # the script unknown to Redis (a restart): the confirmation publishes it the usual way,
        # which reports the hash too
        other.script_flush()
        again = backend.publish_soon(Record("rep/k3", "127.0.0.1:1", 2, "xxh3:1", 0, time.time()),
                                     report="rep:groups")
        assert again().version > plain().version and again.reported == {b"g": b"5", b"h": b"7"}
    finally:
        other.close()


def test_a_record_sent_soon_is_freed_without_the_cycle_collector(
        backend: RedisMetadata, redis_server: RedisServer) -> None:
    # A stream's producer sends one record per frame: a pending record that referred to
    # itself (a closure confirming it) was freed only by the cyclic garbage collector, ~22
    # objects per frame and, every few hundred frames, a full collection of the producer's
    # whole heap. Each must go as soon as its last reference does: answered, not confirmed,
    # published again (the script unknown to Redis: a restart) or refused.
    import gc
    import weakref

    other = redis.Redis.from_url(redis_server.url)
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        other.set("free:str", "x")
        for i, how in enumerate(("confirmed", "not confirmed", "again", "refused")):
            if how == "again":
                other.script_flush()
            sent = backend.publish_soon(
                Record(f"free/k{i}", "127.0.0.1:1", 2, "xxh3:1", 0, time.time()),
                report="free:groups",
                then=[("HSET", "free:str", "a", "1")] if how == "refused" else ())
            assert type(sent).__name__ == "_SoonRecord"  # (the lean connection's way)
            if how == "refused":
                for _ in range(2):
                    with pytest.raises(MetadataUnavailable, match="WRONGTYPE"):
                        sent()
            elif how != "not confirmed":
                assert sent().version >= 1 and sent.reported == {}
            gone = weakref.ref(sent)
            del sent
            assert gone() is None, f"a pending record ({how}) survived its last reference"
        assert backend.lookup("free/k1") is not None  # (the unconfirmed one stored too)
    finally:
        if enabled:
            gc.enable()
        other.close()


def test_failed_record_retracts_write_once_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import instride
    from tests.conftest import free_port

    settings = Settings(dir=tmp_path / "n", redis_url=f"redis://127.0.0.1:{free_port()}/0",
                        token="t", connect_timeout=0.3)
    c = instride.Client(settings)
    with pytest.raises(MetadataUnavailable):
        with c.open("half/k", "wb") as fh:
            fh.write(b"data")
    assert not (settings.dir / "half" / "k").exists()


def test_password_and_database_of_the_url_are_used(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The lean per-frame connection authenticates and selects the URL's database, like redis-py."""
    server = RedisServer().start()
    try:
        admin = redis.Redis(host=server.host, port=server.port)
        admin.config_set("requirepass", "s3cret")
        url = f"redis://:s3cret@{server.host}:{server.port}/3"
        meta = RedisMetadata(Settings(dir=tmp_path, redis_url=url, connect_timeout=2.0))
        try:
            rec = meta.publish(Record("k/a", "h:1", 3, "xxh3:00", 1, 1.0, "n"), overwrite=False)
            assert rec.version == 1
            assert meta.lookup("k/a") == rec
            authed = redis.Redis(host=server.host, port=server.port, password="s3cret", db=3)
            assert authed.exists("instride:rec:k/a") == 1  # in database 3, not 0
            bad = RedisMetadata(Settings(dir=tmp_path, redis_url=url.replace("s3cret", "wrong"),
                                         connect_timeout=0.5))
            with pytest.raises(AuthenticationError):
                bad.lookup("k/a")
            bad.close()
        finally:
            meta.close()
    finally:
        server.stop()


def test_a_first_request_sent_soon_on_a_connection_that_selects_a_database_is_not_held(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A thread's first ``publish_soon`` or ``lookup_soon`` (its lean connection made then)
    with a URL that names a database: the connection's SELECT is answered first, and the
    request is not held until the socket's timeout (5 s) for a reply to a command it sent
    after the SELECT."""
    server = RedisServer().start()
    try:
        url = f"redis://{server.host}:{server.port}/2"
        for ask in ("publish_soon", "lookup_soon"):
            meta = RedisMetadata(Settings(dir=tmp_path, redis_url=url, connect_timeout=1.0))
            try:
                start = time.monotonic()
                if ask == "publish_soon":
                    got = meta.publish_soon(Record("db/a", "h:1", 3, "xxh3:00", 1, 1.0, "n"))()
                    assert got.version >= 1
                else:
                    assert meta.lookup_soon("db/a")() is not None
                assert time.monotonic() - start < 2.5, ask
            finally:
                meta.close()
    finally:
        server.stop()


def test_a_timeout_of_zero_still_looks_once(backend: RedisMetadata, put: Put) -> None:
    """A wait or lookup whose timeout is 0 (or has passed) finds a key that is recorded: the
    caller's deadline bounds the wait for a publication, and each look at Redis gets a moment
    at least. (It once failed at once when the answer was not in yet, and every time after.)"""
    rec = put("zero/k", b"z")
    for _ in range(100):
        assert backend.wait_any(["zero/k"], 0) == rec
        assert backend.lookup("zero/k", time.monotonic()) == rec


def test_a_subscriber_that_hears_its_messages_by_draining_is_not_taken_for_lost(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A subscriber read by ``pending()`` (a stream's reader drains what it heard) as well as
    by ``read()``: what it takes in either way counts as the connection being alive, so the
    liveness ``PING`` is answered in time and a healthy connection is never closed."""
    from instride.metadata import resp

    monkeypatch.setattr(resp, "PROBE_AFTER", 0.2)
    monkeypatch.setattr(resp, "PROBE_WAIT", 0.2)
    sub = resp.RespConnection(redis_server.host, redis_server.port, 0, None, None, 5.0, 2.0)
    pub = redis.Redis(host=redis_server.host, port=redis_server.port)
    try:
        sub.send([("SUBSCRIBE", "alive")])
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            pub.publish("alive", b"x")
            time.sleep(0.02)
            sub.pending()  # (drained: the messages and the PING's answer)
            sub.read(0.001)  # (nothing more: the liveness check runs)
        assert sub.sock is not None
    finally:
        pub.close()
        sub.close()


def test_a_consumer_waits_frame_after_frame_of_one_directory(backend: RedisMetadata, put: Put) -> None:
    # The per-directory subscription stays in force between waits: records published
    # while nobody waits are heard and found, records published during a wait wake it.
    put("run/f0", b"x")
    assert backend.wait_any(["run/f0", "run/end"], 5).key == "run/f0"
    with pytest.raises(ConsumeTimeout):  # nothing there yet: a timeout, not a hang
        backend.wait_any(["run/f1", "run/end"], 0.2)
    versions = {i: put(f"run/f{i}", b"x").version for i in (1, 2, 3)}  # published between waits
    for i in (1, 2, 3):
        rec = backend.wait_any([f"run/f{i}", "run/end"], 5)
        assert (rec.key, rec.version) == (f"run/f{i}", versions[i])

    def produce() -> None:
        for i in range(4, 40):
            time.sleep(0.003)
            put(f"run/f{i}", b"x")

    writer = threading.Thread(target=produce)
    writer.start()
    try:
        keys = [backend.wait_any([f"run/f{i}", "run/end"], 5).key for i in range(4, 40)]
    finally:
        writer.join()
    assert keys == [f"run/f{i}" for i in range(4, 40)]


def test_unwatch_ends_the_kept_subscription(backend: RedisMetadata, put: Put,
                                            redis_server: RedisServer) -> None:
    other = redis.Redis.from_url(redis_server.url)
    d = f"unwatch{uuid.uuid4().hex[:8]}/"  # a directory no other client watches

    def watched() -> bool:
        return other.execute_command("PUBSUB", "NUMPAT") > base

    base = other.execute_command("PUBSUB", "NUMPAT")
    put(f"{d}f0", b"x")
    with pytest.raises(ConsumeTimeout):  # waiting in d subscribes to its publications
        backend.wait_any([f"{d}f1", f"{d}end"], 0.2)
    assert watched()
    put(f"{d}f1", b"x")  # heard while nobody waits
    backend.unwatch(d)
    deadline = time.monotonic() + 10
    while watched() and time.monotonic() < deadline:  # PUNSUBSCRIBE is not waited for
        time.sleep(0.01)
    assert not watched()
    backend.unwatch(d)  # again: nothing to do
    # what was published is still found; waiting there again subscribes again
    assert backend.wait_any([f"{d}f1", f"{d}end"], 5).key == f"{d}f1"
    with pytest.raises(ConsumeTimeout):
        backend.wait_any([f"{d}f2", f"{d}end"], 0.2)
    assert watched()


def test_a_watching_thread_hears_a_records_announcement(backend: RedisMetadata, put: Put) -> None:
    """After a wait in a directory, the thread's kept subscription hears the records
    published there: :meth:`announced` gives one without a lookup (it waits for one that is
    about to come), once; nothing for a directory not watched or a key not announced."""
    d = f"heard{uuid.uuid4().hex[:8]}/"
    put(f"{d}f0", b"x")
    assert backend.announced(f"{d}f0", 0.1) is None and not backend.watching(d)  # not watched
    with pytest.raises(ConsumeTimeout):  # waiting in d subscribes to its publications
        backend.wait_any([f"{d}f1", f"{d}end"], 0.1)
    assert backend.watching(d)
    put(f"{d}other", b"x")  # another key's announcement: kept on the way, for later
    put(f"{d}f1", b"x")
    rec = backend.announced(f"{d}f1", 5.0)
    assert rec is not None
    assert (rec.key, rec.version, rec.owner, rec.node) == (
        f"{d}f1", backend.lookup(f"{d}f1").version, "127.0.0.1:1", "n1")  # type: ignore[union-attr]
    assert backend.announced(f"{d}f1", 0.1) is None  # read once
    kept = backend.heard([f"{d}other", f"{d}f1"])  # (a reader behind its producer reads ahead)
    assert list(kept) == [f"{d}other"] and kept[f"{d}other"].version == backend.lookup(
        f"{d}other").version  # type: ignore[union-attr]
    assert backend.heard([f"{d}other"]) == {}  # taken once
    later = threading.Timer(0.1, lambda: put(f"{d}f2", b"x"))  # published while it listens
    later.start()
    try:
        rec = backend.announced(f"{d}f2", 10.0)
    finally:
        later.join()
    assert rec is not None and rec.key == f"{d}f2"
    assert backend.announced(f"{d}f3", 0.1) is None  # never published: nothing within the wait


def test_kept_announcements_are_bounded_and_forgotten_with_their_directory(
        backend: RedisMetadata, put: Put, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader far behind overflows the kept announcements: the oldest go, and for a while
    :meth:`announced` does not wait for one (it may have been dropped) but answers at once,
    so the caller looks the record up. Ending the watch of a directory forgets its kept
    announcements."""
    import instride.metadata.redis as mod

    monkeypatch.setattr(mod, "_HEARD_MAX", 4)
    d = f"kept{uuid.uuid4().hex[:8]}/"
    with pytest.raises(ConsumeTimeout):
        backend.wait_any([f"{d}k0", f"{d}end"], 0.1)
    for i in range(6):
        put(f"{d}k{i}", b"x")
    kept: dict = {}
    deadline = time.monotonic() + 10
    while not kept and time.monotonic() < deadline:  # (announcements arrive asynchronously)
        kept = backend.heard([f"{d}k5"])  # all six read by now: k0 and k1 dropped on the way
        time.sleep(0.01)
    assert list(kept) == [f"{d}k5"]
    assert backend.heard([f"{d}k0", f"{d}k1"]) == {}
    assert set(backend.heard([f"{d}k2", f"{d}k3"])) == {f"{d}k2", f"{d}k3"}
    t = time.monotonic()
    assert backend.announced(f"{d}k9", 5.0) is None  # never published, and not waited for
    assert time.monotonic() - t < 2.5
    backend.unwatch(d)
    assert backend.heard([f"{d}k4"]) == {}  # forgotten with the watch


def test_a_record_heard_before_a_deletion_is_not_returned(backend: RedisMetadata, put: Put) -> None:
    d = f"del{uuid.uuid4().hex[:8]}/"
    with pytest.raises(ConsumeTimeout):  # the directory is watched from now on
        backend.wait_any([f"{d}k", f"{d}end"], 0.1)
    put(f"{d}k", b"x")  # announced to the kept subscription, not read yet
    backend.delete(f"{d}k")
    with pytest.raises(ConsumeTimeout):  # gone: the announcement must not wake the wait
        backend.wait_any([f"{d}k"], 0.3)


def test_a_subscription_that_times_out_unconfirmed_does_not_linger(
        backend: RedisMetadata, redis_server: RedisServer) -> None:
    other = redis.Redis.from_url(redis_server.url)
    base = other.execute_command("PUBSUB", "NUMPAT")
    for i in range(20):  # deadlines that pass while the subscription is being confirmed
        with pytest.raises(ConsumeTimeout):
            backend.wait_any([f"gone{i}/x"], 1e-6 * i)
    deadline = time.monotonic() + 10  # (a closed connection's subscriptions go when Redis sees it)
    while other.execute_command("PUBSUB", "NUMPAT") > base + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert other.execute_command("PUBSUB", "NUMPAT") <= base + 1  # at most the one confirmed


def test_waits_work_where_an_acl_refuses_pattern_subscriptions(redis_server: RedisServer,
                                                               tmp_path) -> None:  # type: ignore[no-untyped-def]
    admin = redis.Redis.from_url(redis_server.url)
    admin.execute_command("ACL", "SETUSER", "app", "on", ">pw", "~*", "resetchannels",
                          "&instride:pub:*", "+@all")  # channels yes, the pattern d/* no
    url = f"redis://app:pw@{redis_server.host}:{redis_server.port}/0"
    md = RedisMetadata(Settings(dir=tmp_path, redis_url=url, connect_timeout=2))
    pub = RedisMetadata(Settings(dir=tmp_path, redis_url=url, connect_timeout=2))
    try:
        for key in ("top", "d/k", "d/k2"):
            timer = threading.Timer(0.1, lambda k=key: pub.publish(
                Record(k, "127.0.0.1:1", 1, None, 0, time.time(), "n1")))
            timer.start()
            try:
                assert md.wait_any([key], 10).key == key
            finally:
                timer.join()
    finally:
        md.close()
        pub.close()


def test_a_forked_child_has_publication_ids_of_its_own() -> None:
    """A publication's id names the process (a retry after a lost reply is recognised by it):
    a child forked after the parent published must not repeat the parent's next ids."""
    from instride.metadata.redis import _publication_id

    parent = _publication_id()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, to the parent
        try:
            os.write(w, _publication_id().encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        child = os.read(r, 200).decode()
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert parent.split(".")[1] == str(os.getpid())
    assert child.split(".")[1] == str(pid)
    # (a run of its own too: a later child given the same process id draws other ids)
    assert child.split(".")[0] != parent.split(".")[0]


def test_an_announcement_carries_the_stored_record_exactly(backend: RedisMetadata,
                                                           redis_server: RedisServer) -> None:
    """The message a publication sends (fields joined by NUL, the key last) gives the very
    record a lookup gives — the time to the last digit of its repr, a key with spaces, colons
    and non-ASCII characters, no checksum — and a JSON message (an earlier instride's) is still
    understood; anything else is no record."""
    from instride.metadata.redis import _from_message

    other = redis.Redis.from_url(redis_server.url)
    sub = other.pubsub()
    sub.psubscribe("instride:pub:ann/*")
    assert sub.get_message(timeout=5)["type"] == "psubscribe"  # type: ignore[index]
    sent = [Record("ann/a b:c/ü.dat", "10.0.0.7:7501", 644_156, "isf:0123456789abcdef", 0,
                   1764373200.1234567, "node-7"),
            Record("ann/plain", "h:1", 0, None, 0, 1.5, "")]
    for i, rec in enumerate(sent):
        if i == 1:  # versions past 1e14 (a Lua number's default form: 1e+15) stay exact
            other.set("instride:clock", 10**15)
        stored = backend.publish(rec)
        msg = None
        deadline = time.monotonic() + 5
        while msg is None or msg["type"] != "pmessage":
            assert time.monotonic() < deadline, "no announcement"
            msg = sub.get_message(timeout=1)
        heard = _from_message(msg["data"])
        assert heard == stored == backend.lookup(rec.key)
        assert heard is not None and heard.time == rec.time and heard.checksum == rec.checksum
        assert i == 0 or heard.version == 10**15 + 1
    sub.close()
    other.close()
    old = (b'{"checksum":"xxh3:00ff","key":"d/k","node":"n1","owner":"h:1","size":3,'
           b'"time":12.5,"version":9}')
    assert _from_message(old) == Record("d/k", "h:1", 3, "xxh3:00ff", 9, 12.5, "n1")
    for junk in (b"", b"1\x002", b"x\x001\x001\x00h\x00n\x00c\x00k", b"{not json", None, 42):
        assert _from_message(junk) is None
    with pytest.raises(ConfigError, match="INSTRIDE_NODE.*NUL"):  # (the separator: refused)
        backend.publish(Record("ann/nul", "h:1", 1, None, 0, 1.0, "no\0de"))
    assert backend.lookup("ann/nul") is None


FORKED = """
import os, sys, tempfile
import instride.metadata.redis as r
from instride.config import Settings
m = r.RedisMetadata(Settings(dir=tempfile.mkdtemp(), redis_url="redis://127.0.0.1:1/0"))
run = r._RUN
m._lock.acquire()  # (another thread's, at the fork)
child = os.fork()
if child == 0:
    fresh = r._RUN != run and m._lock.acquire(timeout=2)
    os._exit(0 if fresh else 1)
m._lock.release()
print(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
"""


def test_a_forked_child_draws_its_own_ids_and_lock() -> None:
    """A forked child kept its parent's run of publication ids (its count going on from the
    parent's: a later child given the same process id drew the same ids, and its publication
    was taken for a retry of another's — nothing stored) and the metadata object's lock, which
    another thread could hold at the fork: held for ever in the child."""
    res = subprocess.run([sys.executable, "-c", FORKED], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "0"


def test_error_replies_of_redis_are_typed_errors(redis_server: RedisServer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Redis *answering* with an error (maxmemory reached, no or a wrong password, an ACL
    that refuses a command) is a typed error naming the reply, never a raw redis-py one: a
    refusal for want of credentials or rights an :class:`AuthenticationError` naming the URL
    without its password (at once, also for a wait without a timeout), any other a
    :class:`MetadataUnavailable` that carries Redis's message (``ENOSPC`` for ``OOM``)."""
    import errno

    admin = redis.Redis.from_url(redis_server.url)
    host, port = redis_server.host, redis_server.port
    rec = Record("e/k", "127.0.0.1:1", 1, None, 0, time.time(), "n1")
    lean = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=1))
    plain = RedisMetadata(Settings(dir=tmp_path, redis_url=redis_server.url, connect_timeout=1))
    plain._fast_args = None  # (the redis-py path, as a unix:// or TLS URL takes)
    try:
        admin.config_set("maxmemory", "1")  # (noeviction: every write refused with OOM)
        for md in (lean, plain):
            for attempt in (lambda m=md: m.publish(rec), lambda m=md: m.publish_soon(rec)(),
                            lambda m=md: m.command("SET", "e/x", "1")):
                with pytest.raises(MetadataUnavailable) as got:
                    attempt()
                assert "OOM" in str(got.value) and got.value.errno == errno.ENOSPC
        admin.config_set("maxmemory", "0")
        admin.execute_command("ACL", "SETUSER", "weak", "on", ">pw", "~*", "+ping")
        admin.config_set("requirepass", "s3cret")
        weak = f"redis://weak:pw@{host}:{port}/0"
        for url in (redis_server.url, f"redis://:wrong@{host}:{port}/0", weak):
            md = RedisMetadata(Settings(dir=tmp_path, redis_url=url, connect_timeout=1))
            try:
                for attempt in (lambda m=md: m.lookup("e/k"), lambda m=md: m.publish(rec),
                                lambda m=md: m.delete("e/k"),
                                lambda m=md: m.wait_any(["e/k"], None)):
                    start = time.monotonic()
                    with pytest.raises(AuthenticationError) as auth:
                        attempt()
                    assert time.monotonic() - start < 5
                    shown = str(auth.value)
                    assert f"{host}:{port}" in shown, shown
                    assert "wrong" not in shown and "pw@" not in shown, shown
            finally:
                md.close()
    finally:
        admin = redis.Redis(host=host, port=port, password="s3cret")
        admin.config_set("requirepass", "")
        lean.close()
        plain.close()


@pytest.mark.parametrize("lean", [True, False])
def test_a_wait_refused_its_subscription_is_a_typed_error_at_once(
        redis_server: RedisServer, tmp_path, lean: bool) -> None:  # type: ignore[no-untyped-def]
    """A Redis user with key rights but no channel rights (Redis 7's ``resetchannels``, the
    default for new ACL users): lookups worked, and a wait without a timeout **waited for
    ever** (the lean subscriber skipped SUBSCRIBE's error reply), or raised redis-py's raw
    ``NoPermissionError``. It is an ``AuthenticationError`` at once."""
    admin = redis.Redis.from_url(redis_server.url)
    admin.execute_command("ACL", "SETUSER", "nochan", "on", ">pw", "~*", "resetchannels",
                          "+@all")
    url = f"redis://nochan:pw@{redis_server.host}:{redis_server.port}/0"
    md = RedisMetadata(Settings(dir=tmp_path, redis_url=url, connect_timeout=1))
    if not lean:
        md._fast_args = None  # (the redis-py path, as a unix:// or TLS URL takes)
    got: list[object] = []

    def wait() -> None:
        try:
            got.append(md.wait_any(["y/k"], None))
        except Exception as exc:  # noqa: BLE001 (what it raised is the result)
            got.append(exc)

    try:
        assert md.lookup("y/k") is None
        t = threading.Thread(target=wait, daemon=True)  # (a hang must not hang the suite)
        t.start()
        t.join(10)
        assert not t.is_alive(), "the wait went on"
        assert isinstance(got[0], AuthenticationError) and "SUBSCRIBE" in str(got[0]), got
    finally:
        md.close()
        admin.execute_command("ACL", "DELUSER", "nochan")


def _fill_client_slots(server: RedisServer) -> list[socket.socket]:
    """Connections that take every client slot Redis has left (its ``maxclients``)."""
    hogs: list[socket.socket] = []
    while True:
        conn = socket.create_connection((server.host, server.port), timeout=5)
        conn.sendall(b"PING\r\n")
        reply = conn.recv(100)
        if b"max number of clients" in reply:  # (the one too many: turned away)
            conn.close()
            return hogs
        hogs.append(conn)


@pytest.mark.parametrize("password", [None, "pw"])
def test_redis_at_its_client_limit_is_waited_out_not_taken_for_an_answer(
        tmp_path, password: str | None) -> None:  # type: ignore[no-untyped-def]
    """Redis at its ``maxclients`` turns each new connection away with ``ERR max number of
    clients reached`` (redis-py raises it as a lost connection, and retries). The lean
    connections took it for an answer: a wait without a timeout **ended at once with
    ``MetadataUnavailable``** (with a password in the URL an ``AuthenticationError``
    blaming it), a publication Redis never ran was called unsettled, and a subscriber turned
    away switched off pattern subscriptions. Now it is Redis out of reach for the moment:
    retried until the caller's deadline, and the waits return once a slot is free."""
    server = RedisServer().start("--maxclients", "16",
                                 *(("--requirepass", password) if password else ()))
    auth = f":{password}@" if password else ""
    url = f"redis://{auth}{server.host}:{server.port}/0"
    settings = Settings(dir=tmp_path, redis_url=url, connect_timeout=1)
    pub, early, late = (RedisMetadata(settings) for _ in range(3))
    full, ready = threading.Event(), threading.Semaphore(0)
    got: dict[str, object] = {}
    watching: list[bool] = []
    hogs: list[socket.socket] = []

    def wait(key: str, connected: bool) -> None:
        try:
            if connected:  # (this thread's lookup connection made before Redis is full)
                early.lookup(key)
            ready.release()
            full.wait()
            got[key] = (early if connected else late).wait_any([key], 30)
            if key == "max/pattern":  # (its directory's publications still heard: the
                watching.append(early.watching("max/"))  # patterns not given up)
        except Exception as exc:  # noqa: BLE001 (what it raised is the result)
            got[key] = exc

    waits = [threading.Thread(target=wait, args=args, daemon=True)
             for args in (("max/pattern", True), ("maxtop", True), ("max/new", False))]
    try:
        pub.lookup("max/x")  # (its connections made)
        pub.publish(_record("max/warm"))
        for t in waits:
            t.start()
            ready.acquire()
        hogs = _fill_client_slots(server)
        full.set()
        with pytest.raises(MetadataUnavailable) as refused:
            late.publish(_record("max/late"))
        assert type(refused.value) is MetadataUnavailable, refused.value  # (never ran: not
        assert "max number of clients" in str(refused.value)  # unsettled, nor a login's)
        time.sleep(1)  # (the waits turned away meanwhile)
        for conn in hogs:
            conn.close()
        stored = {key: pub.publish(_record(key)) for key in ("max/pattern", "maxtop", "max/new")}
        for t in waits:
            t.join(15)
            assert not t.is_alive(), "a wait went on"
        assert got == stored and watching == [True]
        assert early.publish(_record("max/late")).version > 0
    finally:
        for conn in hogs:
            conn.close()
        for md in (pub, early, late):
            md.close()
        server.stop()


def test_a_command_set_later_that_redis_turned_away_runs_once_it_has_room(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``set_later`` sent on a connection that Redis at its ``maxclients`` turned away: its
    ``ERR max number of clients reached`` was taken for the command's own answer, the
    command **dropped** (it never ran) and ``flush`` raised. It is sent again on the next
    connection, like a command whose connection was lost."""
    server = RedisServer().start("--maxclients", "8")
    settings = Settings(dir=tmp_path, redis_url=server.url, connect_timeout=2)
    meta = RedisMetadata(settings)
    direct = redis.Redis.from_url(server.url)
    hogs: list[socket.socket] = []
    try:
        direct.ping()
        hogs = _fill_client_slots(server)
        meta.set_later("max:later", {"g": 1})  # (sent: turned away, unread yet)
        meta.take_deferred(1.0)  # (what came taken in: Redis's word, not the command's answer)
        for conn in hogs:
            conn.close()
        meta.flush()
        assert direct.hgetall("max:later") == {b"g": b"1"}
    finally:
        for conn in hogs:
            conn.close()
        direct.close()
        meta.close()
        server.stop()


def test_a_publication_whose_connection_failed_at_its_login_is_not_unsettled(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A password in the URL: a new connection first sends ``AUTH``. Redis going out of
    reach after that and before its answer (the publication itself never sent) made the
    publication :class:`PublicationUnsettled` — "may or may not be recorded", its file kept
    — as if the record had gone out: the login's write was counted as the publication's.
    It is plainly :class:`MetadataUnavailable` (nothing was sent: nothing is stored)."""
    from instride.errors import PublicationUnsettled

    server = RedisServer().start("--requirepass", "pw")
    relay = ReplyDropper((server.host, server.port), marker=b"AUTH", refuse=True)
    b = RedisMetadata(Settings(dir=tmp_path, redis_url=f"redis://:pw@127.0.0.1:{relay.port}/0",
                               connect_timeout=0.5))
    direct = redis.Redis(host=server.host, port=server.port, password="pw")
    try:
        b.publish(_record("login/warm"))
        b.close()  # (the next publication connects again: AUTH first)
        relay.armed = True
        with pytest.raises(MetadataUnavailable) as info:
            b.publish(_record("login/k"))
        assert relay.dropped == 1  # (the AUTH's answer was the one lost)
        assert not isinstance(info.value, PublicationUnsettled), info.value
        assert not direct.exists("instride:rec:login/k")
    finally:
        direct.close()
        b.close()
        relay.close()
        server.stop()
