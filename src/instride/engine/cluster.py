"""The cluster engine: metadata in Redis, bytes over a transport, a versioned cache of copies.

A key whose file is on this node and was produced here (an *original*) is returned while its
record names this node (one metadata lookup, none right after a wait that returned the record;
served as it is when Redis is out of reach): once another node published the key over it, that
node's bytes are fetched over it. A key fetched from another node is a *cached copy*: a
sidecar file under ``.instride/cache/`` remembers its version, so a re-published key
(``overwrite=True`` bumps the version) is fetched anew instead of served stale, and copies are
evicted least-recently-used beyond ``INSTRIDE_CACHE_BYTES``. Originals are never evicted.
Concurrent consumers of one key on one node share a single transfer (a lock per key: a byte of
one lock file, :mod:`instride.store.slots`).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import mmap
import os
import re
import select
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .. import store
from ..config import Settings, same_addr
from ..errors import (
    ConsumeTimeout,
    FileTypeError,
    InstrideError,
    IntegrityError,
    KeyExistsError,
    KeyNotFoundError,
    MetadataUnavailable,
    PublicationUnsettled,
)
from ..keys import TMP_PATTERN, key_path, recyclable, tmp_name
from ..metadata import get_backend
from ..metadata.base import PendingRecord
from ..paths import ConfinedOpener
from ..record import Record
from ..store.procs import stopped
from ..store.publish import name_if_free
from ..store.recvpool import KEEP_BYTES, ReceivePool, map_to_receive
from ..store.slots import SlotLocks, slot_locks
from ..store.streamstate import RedisStreamState
from ..transport import Transport, get_transport
from ..transport.base import Received
from .base import map_file

_open = io.open  # the builtin, captured before instride.interception.pyopen may patch it
#: records remembered from wait_any: at most this many, for at most this many seconds
_SEEN_MAX = 1024
#: mappings of a key whose file is gone again before it could be mapped (a fetched copy
#: another process of the node evicted), before :class:`KeyNotFoundError`
#: (8: readers thrashing a cache smaller than what they read lost a copy three times in a
#: row under CI load, 1 read in ~450 of tests/engine/test_cluster.py's churn test)
_MAP_ATTEMPTS = 8
#: seconds a consumer on a key's owner node waits for the original's file its record names
#: (it has its name before the record is stored) before taking it as deleted
_OWN_GRACE = 1.0
#: seconds an original must predate its stream's current run to be taken for an earlier
#: run's (file systems that keep coarse modification times)
_RUN_MARGIN = 2.0
_SEEN_AGE = 5.0
#: seconds the nodes' clocks may differ, as an original and another node's publication of its
#: key are ordered (:func:`_older`): an original this node published after the other's, its
#: record not stored yet, was set aside and lost
_SUPERSEDED_MARGIN = 1.0
#: seconds a publication's record may take to be stored after its file got its name
#: (:func:`_older`): an original younger than this is never taken for superseded
_RECORD_LAG = 10.0
#: seconds a consumer that fetches a key the usual way waits for another consumer of its node
#: that asked for the key early to get its reply started (then it takes the copy made)
_ASKED_WAIT = 0.5
#: seconds a fetch waits for a key's fetch lock before it looks whether its holder is
#: stopped, and goes on without it if so (see ``ClusterEngine._lock``)
_STOPPED_AFTER = 0.02
#: seconds a copy's store waits for the key's store lock (held for microseconds)
_STORE_WAIT = 10.0
#: what an eviction leaves the cache at, as a share of ``INSTRIDE_CACHE_BYTES``: a tenth
#: below the bound, so that the next fetches do not take it over the bound (and walk every
#: copy of the node) again at once
_EVICT_TO = 0.9
#: seconds after which a cache under its bound is walked again all the same (copies other
#: processes of the node stored count then), at least; and at least this many times the last
#: walk took (a walk's share of the node's time stays small however many copies it keeps)
_REWALK_AFTER = 1.0
_REWALK_SHARE = 50
#: the share of the room below the bound, as the last walk found it, that this process may
#: fetch into before it walks again
_REWALK_ROOM = 0.25
#: seconds an early fetch waits for its record to be announced (the owner records a frame
#: right after renaming it) before looking it up
_HEARD_WITHIN = 0.002
#: seconds :meth:`ClusterEngine.wait_any` holds a request for the next key at its likely owner
#: before waiting the usual way (at most half the wait's timeout), and at most that much again
#: for the owner's reply
_EARLY_WAIT = 0.5
_EARLY_MARGIN = 1.0


_NUMBERED = re.compile(r"^(.*?)(\d+)(\D*)$")


def _drop(path: str) -> None:
    """Remove the file ``path``, if it is still there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _follows(key: str, prev: str) -> bool:
    """Whether ``key`` is the next of numbered keys after ``prev`` in the same directory
    (``.../frame_000000007.isf`` after ``..._000000006.isf``, ``run/f12`` after ``run/f11``)."""
    a, b = _NUMBERED.match(key), _NUMBERED.match(prev)
    return a is not None and b is not None and a[1] == b[1] and a[3] == b[3] \
        and int(a[2]) == int(b[2]) + 1


def _options(window: tuple[float, float] | None, into: memoryview | None = None,
             ahead: int = 0, digest_from: int = 0, batch: str | None = None) -> dict[str, object]:
    """The optional arguments of a transport's ``fetch_when_published`` that are set (a
    transport without them is called as before)."""
    return {k: v for k, v in (("window", window), ("into", into), ("ahead", ahead or None),
                              ("digest_from", digest_from or None), ("batch", batch))
            if v is not None}


#: Linux's ``CLOCK_REALTIME_COARSE`` (Python names it from 3.13 on)
_REALTIME_COARSE = getattr(time, "CLOCK_REALTIME_COARSE", 5)


def _file_clock_ns() -> int:
    """Now, as the kernel stamps files (``CLOCK_REALTIME_COARSE``: a file's modification time
    lags ``time.time()`` by up to a clock tick), in ns."""
    return time.clock_gettime_ns(_REALTIME_COARSE)


def _older(st: os.stat_result, record: Record) -> bool:
    """Whether an original of stat ``st`` (its change time: when it got its name) came before
    another node's publication ``record`` of its key, which the metadata names now: not newer
    than it by more than :data:`_SUPERSEDED_MARGIN` (the nodes' clocks may differ a little),
    and named more than :data:`_RECORD_LAG` ago. A file has its name before its record is
    stored, and a publication of this node whose record is still on its way (hashing a large
    file, a busy node server, Redis retried) would be the later one once stored: until then it
    is never set aside. The price: after another node's publication, this node's readers may
    get its original for up to :data:`_RECORD_LAG` after that original was named."""
    return st.st_ctime <= record.time + _SUPERSEDED_MARGIN \
        and time.time() - st.st_ctime > _RECORD_LAG


def _identity(record: Record) -> tuple[int, int, str, str]:
    """What makes a copy a copy of ``record``: its version alone is not enough (the version
    clock starts again with a new Redis, or a restarted one without persistence)."""
    return record.version, record.size, record.checksum, record.owner


def _copy_of(side: dict[str, Any], record: Record) -> bool:
    """Whether a copy whose sidecar says ``side`` holds the bytes of ``record``."""
    return (side.get("version"), side.get("size"), side.get("checksum"),
            side.get("owner")) == _identity(record)


class _Elsewhere(Exception):  # noqa: N818 (not an error: the other way won the race)
    """A key waited for was published by another owner: its record."""

    def __init__(self, record: Record) -> None:
        super().__init__(record.key)
        self.record = record


class ClusterEngine:
    """Engine of cluster mode (``INSTRIDE_REDIS_URL`` set).

    Parameters
    ----------
    settings
        Supplies the managed directory, the Redis URL, the token, this node's address and
        name, the cache bound and the transport's name.
    """

    name = "cluster"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.root = settings.dir
        #: owners' spellings of an address met, and whether each names this node
        self._spellings: dict[str, bool] = {}
        self.metadata = get_backend("redis", settings)
        self.confined = ConfinedOpener(self.root)  # [confine] maps keys, never through links
        self.transport: Transport = get_transport(settings.transport, settings)
        settings.internal_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.cache_dir = settings.internal_dir / "cache"
        #: dropped copies' files, reused by the next fetches (no fresh pages per fetch)
        # (bounded like the cache it recycles: a node that keeps few copies keeps few spares)
        # (a node that keeps every copy has nothing to recycle: its next file is made ahead)
        self.recv_pool = ReceivePool(settings.internal_dir / "recv", keep_bytes=min(
            KEEP_BYTES, KEEP_BYTES if settings.cache_bytes is None else settings.cache_bytes),
            ahead=settings.cache_bytes is None, ahead_bytes=settings.ahead_bytes)
        #: who of the node fetches a key (one transfer per key and node at a time)
        self._key_locks = slot_locks(settings.internal_dir / "fetch.lock")
        #: node-wide store locks by key (writing or removing a copy and its sidecar)
        self._store_locks = slot_locks(settings.internal_dir / "store.lock")
        #: who of the node fetches a key past a stopped holder of its fetch lock (see _lock)
        self._past_locks = slot_locks(settings.internal_dir / "fetch-past.lock")
        #: who of the node asks a key's owner early (one consumer per key at a time)
        self._asking_locks = slot_locks(settings.internal_dir / "asking.lock")
        #: early fetches received into a mapping of their file (for tests and benchmarks)
        self.mapped_receives = 0
        #: the mapping the last early fetch received into (see _unmap)
        self._mapped: mmap.mmap | None = None
        #: number of transfers this process made (for tests and benchmarks), and how many of
        #: them were answered as their key was published (:meth:`fetch_when_published`)
        self.transfers = 0
        self.early_transfers = 0
        #: seconds spent by the last :meth:`consume` waiting for the record, receiving and
        #: verifying the bytes, and storing them (publication under the key + cache index)
        self.last_timing = {"wait": 0.0, "fetch": 0.0, "store": 0.0}
        # Records just returned by wait_any, so that the consume() that usually follows needs
        # no second metadata round trip: key -> (monotonic time seen, record). Bounded in size
        # and age; a stale record costs nothing but a verified retry (see _fetch).
        self._seen: dict[str, tuple[float, Record]] = {}
        # Copies this process stored moments ago (key -> (monotonic time, version)): the
        # consume() that follows a wait needs not read the sidecar it just wrote, nor touch it.
        self._kept: dict[str, tuple[float, tuple[int, int, str, str]]] = {}
        self._dirs: set[str] = set()  # directories known to exist (for fetched copies)
        #: the bytes of the node's copies as last walked plus what this process fetched since
        #: (``None``: not walked yet), and when the next walk is due all the same (see evict)
        self._cached_bytes: int | None = None
        self._fetched_since = 0  # (bytes this process fetched since that walk)
        self._rewalk_at = 0.0
        #: the record of the last key this process fetched (a stream's reader asks the same
        #: owner for its next frame: :meth:`fetch_when_published`)
        self.last_fetched: Record | None = None
        # ... and of the last one per directory: a process reading several streams in turn
        # (threads, or a node server's thin clients) asks each stream's owner for its next
        # frame, not only the stream it fetched from last
        self._fetched_in: dict[str, Record] = {}
        #: early fetches whose record came from the announcements heard (no lookup)
        self.records_heard = 0
        #: waits whose early request was withdrawn: another owner published first
        self.early_withdrawn = 0
        self._cache_s = str(self.cache_dir)

    # ------------------------------------------------------------------ cache index
    def _sidecar(self, key: str) -> str:
        return f"{self._cache_s}/{key}.json"  # a string: this is on every read's path

    def cached_copy(self, key: str) -> dict[str, Any] | None:
        """What the fetched copy of ``key`` on this node is a copy of (its record's
        ``version``, ``size``, ``checksum`` and ``owner``), or ``None`` (absent or original)."""
        try:
            with _open(self._sidecar(key), "rb") as fh:
                side = json.loads(fh.read())
            int(side["version"])
        except (FileNotFoundError, NotADirectoryError, ValueError, KeyError, TypeError):
            return None
        return side  # type: ignore[no-any-return]

    def cached_version(self, key: str) -> int | None:
        """Version of the fetched copy of ``key`` on this node, or ``None`` (absent or original)."""
        side = self.cached_copy(key)
        return None if side is None else int(side["version"])

    def _mine(self, owner: str) -> bool:
        """Whether a record's ``owner`` is this node: its ``INSTRIDE_ADDR``, however spelled
        (``localhost:7000`` and ``127.0.0.1:7000``: processes of one node may spell it
        differently; an original taken for another node's would be fetched over itself,
        stored as a copy, and evicted)."""
        if owner == self.settings.addr:
            return True
        known = self._spellings.get(owner)
        if known is None:
            known = same_addr(owner, self.settings.addr) is True
            if len(self._spellings) < 1024:  # (a bounded memo: few owners per job)
                self._spellings[owner] = known
        return known

    def forget_fetched(self, key: str) -> None:
        """Drop the cache entry of ``key`` (it became an original of this node)."""
        side = self._sidecar(key)
        # Usually there is none: asked with access(), which answers without raising — the
        # FileNotFoundError of a bare unlink cost ~30 µs of a publication's path (cold).
        if os.access(side, os.F_OK, follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                os.unlink(side)

    def _copy_here(self, key: str) -> dict[str, Any] | None:
        """:meth:`cached_copy`, where the key's file is that very copy: the inode its sidecar
        names (an original this node published over the copy since, its sidecar not removed
        yet, is no copy: never evicted, dropped, or stored over as one)."""
        side = self.cached_copy(key)
        if side is None or "ino" not in side:  # (a sidecar of an earlier instride: as before)
            return side
        try:
            ino = os.stat(f"{self.root}/{key}", follow_symlinks=False).st_ino
        except (FileNotFoundError, NotADirectoryError):
            return None
        return side if ino == side["ino"] else None

    def _remember(self, record: Record, ino: int) -> None:
        side = self._sidecar(record.key)
        tmp = tmp_name(side)
        body = json.dumps({"version": record.version, "size": record.size,
                           "checksum": record.checksum, "owner": record.owner,
                           "ino": ino}).encode()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:  # first copy under this directory
            os.makedirs(os.path.dirname(side), exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, body)  # a few dozen bytes: one write
        finally:
            os.close(fd)
        os.replace(tmp, side)

    def _store_copy(self, staged: str, path: str, record: Record, *,
                    since_ns: int | None = None, deadline: float | None = None,
                    superseded: tuple[int, int] | None = None) -> bool:
        """Give the fetched bytes in ``staged`` the key's name, and their version a sidecar,
        under the key's store lock (:meth:`_storing`, bounded by ``deadline``); whether it
        did.

        The sidecar comes first, the name after: a moment with the file and no sidecar would
        make the copy look like an original of this node (:meth:`is_copy`), and a reader
        beside it would wait here for the stream's next frame, which is made elsewhere, for a
        whole wait slice; a sidecar without its file only says nothing is cached. A file
        already there (an earlier copy, or an original a later publication elsewhere
        superseded) is first set aside (:meth:`_set_aside`): a reader then sees the earlier
        copy with its sidecar, no file, or the new copy with its own — never old bytes with a
        newer version.

        A publication of this node takes the key's name without the store lock (nor does the
        C library's): a rename of its original may come at any moment, also between a look
        at the name and the copy's rename, which replaced the new original (lost; the other
        node's bytes served under this node's record). So no step here replaces a file it has not
        seen: the copy takes a free name only (:func:`~instride.store.publish.name_if_free`),
        and a file set aside that is not the one looked at is put back. An original there
        stays; nothing is stored (``False``; the caller drops ``staged``).

        ``since_ns`` (:func:`_file_clock_ns`): when the caller's fetch took the key's fetch
        lock. A copy stored since then by another fetch — one that went past this one,
        stopped meanwhile (see :meth:`_lock`) — of a later publication of the key stays:
        nothing is stored, so that a fetch resumed late never sets the node's copy back to an
        earlier publication; nor does an original this node published since then give way.
        ``superseded`` (device, inode): an original the record says another node's publication
        superseded, looked at after ``since_ns``'s clock tick began — that file gives way
        whatever its change time (a coarse clock gives both one tick).
        """
        key = record.key
        ino = os.stat(staged).st_ino  # (the copy's, named in its sidecar)
        with self._storing(key, deadline):
            try:
                seen = os.lstat(path)
            except (FileNotFoundError, NotADirectoryError):
                seen = None
            if seen is not None:
                if not stat.S_ISREG(seen.st_mode):  # (a directory of this node's keys, say:
                    # never moved aside with what it holds)
                    raise FileTypeError(key, "something else than a file has its name on this "
                                        "node (a directory of keys?): no copy is stored there",
                                        errno.EISDIR if stat.S_ISDIR(seen.st_mode)
                                        else errno.EINVAL)
                if since_ns is not None and (seen.st_dev, seen.st_ino) != superseded \
                        and self._stored_later(record, path, since_ns):
                    return False
                if not self._set_aside(key, path, seen):
                    return False
            self._remember(record, ino)
            try:
                if name_if_free(staged, path):
                    return True
            except BaseException:
                self.forget_fetched(key)
                raise
            self.forget_fetched(key)  # (an original of this node took the name meanwhile)
            return False

    def _set_aside(self, key: str, path: str, seen: os.stat_result) -> bool:
        """Take the file ``seen`` at ``path`` (an earlier copy, or a superseded original)
        away from the key's name, under the key's store lock, before a copy takes it; whether
        the name is free of it now. A rename moves whatever has the name: an original this
        node published since ``seen`` was looked at is put back (unless a still later one has
        the name by now) and the sidecar goes (``False``: the original stays)."""
        aside = tmp_name(path)
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return True  # (deleted meanwhile: the name is free)
        if os.path.samestat(os.lstat(aside), seen):
            _drop(aside)  # (the earlier copy)
            return True
        if not name_if_free(aside, path):  # (a still later original has the name)
            _drop(aside)
        self.forget_fetched(key)  # (put back: an original; raised, it stays aside, not lost)
        return False

    def _stored_later(self, record: Record, path: str, since_ns: int) -> bool:
        """Whether the file at ``path`` (there) came since ``since_ns``: an original this node
        published (no sidecar), or a copy another fetch stored, of a later publication (a
        higher version: the clock a Redis draws versions from only goes up; compared only for
        a copy stored meanwhile — or touched, as a copy in use is — never for one from
        before, which may come from a Redis restarted since without its data)."""
        try:
            stored = os.stat(self._sidecar(record.key)).st_mtime_ns
        except (FileNotFoundError, NotADirectoryError):
            try:  # (no sidecar under the store lock: an original of this node; its rename or
                # link into place set its change time — not its modification time, which a
                # file written earlier and published now keeps)
                return os.stat(path, follow_symlinks=False).st_ctime_ns >= since_ns
            except (FileNotFoundError, NotADirectoryError):
                return False
        if self._copy_here(record.key) is None:
            return True  # (not the copy its sidecar names: an original published over it)
        if stored < since_ns:
            return False
        side = self.cached_copy(record.key)
        return side is not None and not _copy_of(side, record) \
            and int(side["version"]) > record.version

    @contextlib.contextmanager
    def _lock(self, key: str, deadline: float | None, *, past_stopped: bool = False,
              locks: SlotLocks | None = None) -> Iterator[bool]:
        """Exclusive per-key lock across the node's processes and threads, bounded by
        ``deadline`` (:class:`ConsumeTimeout` once it has passed; ``time.monotonic()``: one try).

        A byte of one file (:mod:`instride.store.slots`: a POSIX record lock at the key's
        CRC-32), so one system call to take it and one to let go: a lock file made and
        removed per fetch cost ~0.1 ms of each frame a woken consumer fetched (create, lock,
        two checks that the name still names it, unlink, close), and a file kept per key
        would pile up, one for every frame of every stream the node ever fetched.

        ``past_stopped`` (a fetch): a holder that is stopped — ``SIGSTOP``, ``Ctrl-Z``, a
        debugger's breakpoint; it keeps its locks while it is — is not waited for once the
        wait has lasted :data:`_STOPPED_AFTER`: the block runs without the lock (yields
        ``False``; else ``True``), a transfer of its own, whose copy is stored under the
        node's store lock as every copy is (:meth:`_store_copy`). A holder that runs, however
        slowly, is waited for. The consumers that go past it take turns, under a second lock
        of the key (``.instride/fetch-past.lock``, taken the same way: ``locks``), so that
        one transfer of the key reaches the node, not one per consumer that waited; past a
        holder of that one stopped too, the block runs under neither.
        """
        locks = self._key_locks if locks is None else locks
        delay, start = 0.001, time.monotonic()
        while True:
            with locks.held(key) as taken:
                if taken:
                    yield True
                    return
            now = time.monotonic()
            if past_stopped and now - start >= _STOPPED_AFTER \
                    and self._holder_stopped(key, locks):
                if locks is self._key_locks:
                    with self._lock(key, deadline, past_stopped=True, locks=self._past_locks):
                        yield False
                else:
                    yield False
                return
            if deadline is not None and now >= deadline:
                # (how long it waited: the lock's wait, not the moment past the deadline)
                raise ConsumeTimeout(key, now - start)
            time.sleep(delay)  # another consumer of this node is fetching the key
            delay = min(delay * 2, 0.05)

    def _holder_stopped(self, key: str, locks: SlotLocks) -> bool:
        """Whether the process holding ``key``'s lock of ``locks`` is stopped (see
        :meth:`_lock`)."""
        pid = locks.holder(key)
        return pid is not None and stopped(pid)

    @contextlib.contextmanager
    def _storing(self, key: str, deadline: float | None = None) -> Iterator[None]:
        """The node's store lock of ``key`` (a byte of ``.instride/store.lock``, as the fetch
        lock): held while a copy and its sidecar are written or removed, so that two stores
        of different publications never interleave (a file of one with the sidecar of the
        other) — also where a fetch went past a stopped holder of the fetch lock. Held for
        microseconds; a holder stopped inside it is waited for until ``deadline`` (50 ms at
        least: a transfer that ran past it is not thrown away for a moment's contention), at
        most :data:`_STORE_WAIT` s (:class:`ConsumeTimeout`)."""
        start = time.monotonic()
        delay, until = 0.0002, start + _STORE_WAIT
        if deadline is not None:  # (a few tries at least: its holders hold it for µs)
            until = max(min(until, deadline), start + 0.05)
        while True:
            with self._store_locks.held(key) as taken:
                if taken:
                    yield
                    return
            now = time.monotonic()
            if now >= until:
                raise ConsumeTimeout(key, now - start)
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def cached_entries(self) -> list[tuple[float, int, str]]:
        """``(last use, size, key)`` of every fetched copy on this node."""
        out = []
        for dirpath, _dirs, files in os.walk(self.cache_dir):
            for name in files:
                if not name.endswith(".json") or TMP_PATTERN.match(name):
                    continue
                side = Path(dirpath) / name
                key = str(side.relative_to(self.cache_dir))[: -len(".json")]
                try:
                    st = os.stat(self.root / key)
                    used = os.stat(side).st_mtime
                except FileNotFoundError:
                    continue
                out.append((used, st.st_size, key))
        return out

    def evict(self, keep: str | None = None) -> list[str]:
        """Evict least-recently-used fetched copies until they fit in ``INSTRIDE_CACHE_BYTES``.

        Called after each fetch (``keep``: the key just fetched, never evicted; without
        it, the cache is walked in any case). Walking the
        cache lists and stats every copy of the node, O(copies): it is walked only when the
        bytes this process fetched since the last walk exceed a quarter of the room that walk
        left below the bound (:data:`_REWALK_ROOM`: other processes of the node fetch into
        the same room — with N of them the cache goes over the bound by about N/4 of that
        room at most, until one walks), or once the last walk is a while ago
        (:data:`_REWALK_AFTER`). Over the bound, copies go until the cache is a tenth below
        it (:data:`_EVICT_TO`), so that the next fetches do not walk at once again.
        """
        limit = self.settings.cache_bytes
        if limit is None:
            return []
        if keep is not None and self._cached_bytes is not None:
            with contextlib.suppress(OSError):
                self._fetched_since += os.stat(f"{self.root}/{keep}",
                                               follow_symlinks=False).st_size
            room = max(0, limit - self._cached_bytes)
            if self._fetched_since <= room * _REWALK_ROOM and time.monotonic() < self._rewalk_at:
                return []  # (room left as far as this process knows, and walked lately)
        began = time.monotonic()
        entries = sorted(self.cached_entries())
        total = sum(size for _, size, _ in entries)
        target = limit if total <= limit else int(limit * _EVICT_TO)
        evicted = []
        for _used, size, key in entries:
            if total <= target:
                break
            if key == keep:
                continue
            # Under the key's lock, never beside a fetch of it in another process (which
            # would store its new copy between the file's removal and the sidecar's, leaving a
            # copy that looks like an original); a key being fetched now is passed over.
            try:
                with self._lock(key, time.monotonic()), self._store_locks.held(key) as free:
                    if not free or self._copy_here(key) is None:
                        continue  # (being stored, evicted, or made an original, meanwhile)
                    # the file first: without a sidecar the copy would look like an original
                    self._drop_file(f"{self.root}/{key}", locked=False)
                    self.forget_fetched(key)
            except ConsumeTimeout:
                continue
            total -= size
            evicted.append(key)
        now = time.monotonic()
        self._cached_bytes, self._fetched_since = total, 0
        self._rewalk_at = now + max(_REWALK_AFTER, _REWALK_SHARE * (now - began))
        return evicted

    # ------------------------------------------------------------------ consuming
    def _current(self, key: str, path: str | Path, deadline: float | None = None) -> bool:
        """Whether the local file of ``key`` may be served (original, or copy of the latest
        version). ``deadline``: the caller's, for the look at Redis a copy needs (with Redis
        away, :class:`MetadataUnavailable` comes by then, not after the connect timeout)."""
        if not os.path.exists(path):
            return False
        seen = self._seen.get(key)  # what wait_any returned moments ago: no second round trip
        kept = self._kept.pop(key, None)
        if kept is not None and seen is not None and kept[1] == _identity(seen[1]) \
                and time.monotonic() - kept[0] <= _SEEN_AGE:
            self._seen.pop(key, None)  # (another thread may have taken it: _take_seen)
            return True  # the copy of that very record, stored by this process moments ago
        side = self.cached_copy(key)
        if side is None:
            # An original produced on this node, unless a publication of another node
            # superseded it since (overwrite=True there; or write-once, after a Redis that
            # lost its data): the record names that node then, and its bytes are fetched.
            # Served without a look before, the node's readers kept the old bytes for good.
            # No record at all (deleted, or a Redis restarted without its data), or Redis out
            # of reach: served, as before.
            fresh = seen is not None and time.monotonic() - seen[0] <= _SEEN_AGE
            try:
                rec_now = seen[1] if fresh and seen is not None else \
                    self.metadata.lookup(key, deadline)
            except MetadataUnavailable:
                return True
            if rec_now is None or self._mine(rec_now.owner):
                if fresh:
                    self._seen.pop(key, None)  # (another thread may have taken it)
                return True
            return not self._superseded(path, rec_now)
        if seen is not None and _copy_of(side, seen[1]) and time.monotonic() - seen[0] <= _SEEN_AGE:
            self._seen.pop(key, None)  # (another thread may have taken it: _take_seen)
            rec: Record | None = seen[1]
        else:
            rec = self.metadata.lookup(key, deadline)
        if rec is None:
            # the key was deleted (its record is gone): the copy is of nothing now, never
            # served as the key; dropped, so that the key is not taken for one published
            # here either (a write-once publication of it on this node would be refused)
            self.drop_copy(key)
            return False
        if _copy_of(side, rec):
            with contextlib.suppress(FileNotFoundError):
                os.utime(self._sidecar(key))  # LRU touch
            return True
        return False

    @staticmethod
    def _superseded(path: str | Path, record: Record) -> bool:
        """Whether the original at ``path`` came before another node's publication
        ``record`` (:func:`_older`): one gone meanwhile is not served either."""
        try:
            return _older(os.stat(path), record)
        except FileNotFoundError:
            return True

    def fetched_now(self, key: str) -> bool:
        """Whether this process stored the copy of ``key`` moments ago, of the very record
        :meth:`wait_any` returned for it (an early fetch): the copy :meth:`consume` would
        serve without a look at its sidecar or at Redis. Used once, as there; nothing is
        asked of the file system (the caller looks at the file: it may be gone since)."""
        kept = self._kept.pop(key, None)
        seen = self._seen.get(key)
        if kept is None or seen is None or kept[1] != _identity(seen[1]) \
                or time.monotonic() - kept[0] > _SEEN_AGE:
            return False
        self._seen.pop(key, None)
        return True

    def consume(self, key: str, timeout: float | None) -> Path:
        """Make ``key`` local (waiting and fetching as needed) and return its path."""
        path = key_path(key, self.root)
        timing = self.last_timing = {"wait": 0.0, "fetch": 0.0, "store": 0.0}
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._current(key, path, deadline):
            return path
        start = time.monotonic()
        if deadline is not None:
            timeout = max(0.0, deadline - start)
        record = self._take_seen(key, start) or self.metadata.wait_any([key], timeout)
        timing["wait"] = time.monotonic() - start
        if self._mine(record.owner):
            # Published by a process of this node: the original is here (a file has its name
            # before its record is stored) unless it was deleted since; a moment's grace
            return self._own(key, path, record, deadline)
        # Another consumer of this node asked the owner for the key early and its reply has
        # not started (it then takes the key's lock, and lets go of this one): wait for that
        # (a moment, for a published key) rather than move the key across a second time.
        soon = time.monotonic() + _ASKED_WAIT
        self._asking_locks.wait_free(key, soon if deadline is None else min(deadline, soon))
        with self._lock(key, deadline, past_stopped=True):
            since_ns = _file_clock_ns()  # (see _store_copy)
            side = self.cached_copy(key)
            superseded = None
            if os.path.exists(path):
                if side is not None and _copy_of(side, record):
                    return path  # (another consumer of this node fetched it meanwhile)
                if side is None:
                    # An original: published by a process of this node since the look above
                    # (the record read before is no reason to fetch over it), or one that a
                    # publication elsewhere superseded: fetched over, _store_copy sets that
                    # very file aside (its change time may be this one's clock tick: a newer
                    # original by it; a publication of this node after this look is another
                    # file, which stays). The record now tells which.
                    try:
                        st = os.stat(path)
                    except FileNotFoundError:
                        st = None
                    current = self.metadata.lookup(key, deadline)
                    if current is None or self._mine(current.owner) \
                            or st is not None and not _older(st, current):
                        return path
                    record = current
                    superseded = None if st is None else (st.st_dev, st.st_ino)
            self._fetch(record, path, since_ns, deadline, superseded=superseded)
        self.evict(keep=key)
        return path

    def _own(self, key: str, path: Path, record: Record, deadline: float | None) -> Path:
        """The original of ``key`` on this node (``record`` names this node as its owner): its
        file, or :class:`KeyNotFoundError` when it was deleted (the record stays until the
        key is published again) — never a wait for a file nobody will make. A file has its
        name before its record is stored: one whose record is older than :data:`_OWN_GRACE`
        and is not there is gone (also for a caller that waits in short slices, as the node
        server does for its thin clients)."""
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        grace = _OWN_GRACE if left is None else min(_OWN_GRACE, left)
        try:
            return store.wait_any([path], grace, label=key)
        except ConsumeTimeout:
            pass
        current = self.metadata.lookup(key, deadline)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if current is not None and _identity(current) != _identity(record) \
                or current is None and (left is None or left > 0):
            return self.consume(key, left)  # (published again, or unpublished: wait for it)
        if current is not None and time.time() - current.time >= _OWN_GRACE:
            raise KeyNotFoundError(key)
        raise ConsumeTimeout(key, grace)  # (a record a moment old: its file may yet come)

    def _take_seen(self, key: str, now: float) -> Record | None:
        """The record :meth:`wait_any` returned for ``key`` moments ago, if any (used once)."""
        seen = self._seen.pop(key, None)
        if seen is None or now - seen[0] > _SEEN_AGE:
            return None
        return seen[1]

    def _parent_made(self, parent: str) -> None:
        if parent not in self._dirs:  # one mkdir per directory, not one per fetch
            os.makedirs(parent, exist_ok=True)
            if len(self._dirs) >= _SEEN_MAX:
                self._dirs.clear()
            self._dirs.add(parent)

    def _fetch(self, record: Record, path: Path, since_ns: int,
               deadline: float | None = None, *,
               superseded: tuple[int, int] | None = None) -> None:
        staged = tmp_name(str(path))
        parent = str(path.parent)
        self._parent_made(parent)
        t0 = time.monotonic()
        fd = -1  # the staged file, open (so locked) until it has its name
        try:
            for attempt in range(3):
                try:
                    try:
                        fd = self._receive(record, staged)
                    except FileNotFoundError as exc:
                        if isinstance(exc, KeyNotFoundError) or os.path.isdir(parent):
                            raise
                        os.makedirs(parent, exist_ok=True)  # removed meanwhile (instride gc)
                        fd = self._receive(record, staged)
                    break
                except (IntegrityError, KeyNotFoundError):
                    newer = self._republished(record, attempt)
                    if newer is None:
                        raise
                    record = newer
            self.transfers += 1
            self._fetched(record)
            t1 = time.monotonic()
            try:
                stored = self._store_copy(staged, str(path), record, since_ns=since_ns,
                                          deadline=deadline, superseded=superseded)
            except BaseException:
                stored = False
                raise
            finally:
                if not stored:  # (failed, or a later publication's copy stored meanwhile)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(staged)
        finally:
            if fd >= 0:
                os.close(fd)
        self.last_timing["fetch"] = t1 - t0
        self.last_timing["store"] = time.monotonic() - t1

    def _staged(self, staged: str, size: int) -> int:
        """A file to receive ``size`` bytes into, named ``staged``: a recycled one of the
        receive pool, else a new one. Open for writing and locked (shared, as a writer's
        temporary file: ``instride gc`` leaves it; a recycled file's exclusive lock made
        shared) until the caller closes it, once the file has its name."""
        fd = self.recv_pool.take(staged, size)
        if fd is None:
            fd = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        store.mark_writing(fd)
        return fd

    def _receive(self, record: Record, staged: str) -> int:
        """Fetch ``record`` into ``staged``: a recycled file of the receive pool when there is
        one (overwritten in place), else a new file; nothing is left there on failure.

        Returns the file's descriptor, open and locked (shared, as a writer's temporary file:
        ``instride gc`` leaves it) for the caller to close once the file has its name."""
        fd = self._staged(staged, record.size)
        try:
            self.transport.fetch_into(record, fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged)
            raise
        return fd

    def fetch_when_published(self, key: str, like: Record, wait: float,
                             until: str | None = None,
                             window: tuple[float, float] | None = None) -> Record | None:
        """Fetch ``key`` from the owner of ``like`` as soon as it is published there.

        For a stream's reader that asks for its next frame before it exists: the owner's data
        server holds the request until the frame is published (at most ``wait`` seconds, not
        while ``until`` — the stream's end marker — is there), then sends it at once — no
        wake-up through the metadata and no request round trip on the frame's path. The bytes
        are then checked against the key's record and kept as a fetched copy, as
        :meth:`consume` keeps one. The record is taken from the announcements this thread
        hears when it waited in the key's directory before (a stream reader's first frame
        leaves such a subscription), else looked up — asked for as soon as the owner's reply
        starts, and again a moment later if the owner has not recorded it yet. The bytes are
        hashed as the record of ``like`` asks (a frame's record: from its header on, the header
        kept for the check); a key whose record is of the other kind is refused so and
        fetched again the usual way. Anything
        else — nothing published within ``wait``, a transport without the operation, a
        failed transfer, bytes that do not match the record — returns ``None`` and leaves
        nothing behind: the caller then waits the usual way, which reports errors.
        ``window`` (``time.monotonic()``, from, to): when the frame is due — the reply is
        slept for until then and busy-polled in it (``Stream(spin="auto")``).

        Returns
        -------
        Record or None
            The record of the copy now on this node (under the key, as :meth:`consume` leaves
            it), or ``None``.
        """
        fetch = getattr(self.transport, "fetch_when_published", None)
        if fetch is None:
            return None
        asked, on_reply = self._asking(key)

        def receive(fd: int, into: memoryview | None,
                    replied: Callable[[], None]) -> tuple[Received | None, Record | None]:
            # (a frame like the last one is checked by its record as a frame: its header apart)
            def reply_started() -> None:
                replied()
                if on_reply is not None:
                    on_reply()

            return fetch(like, key, fd, wait, until, reply_started,
                         **_options(window, into, digest_from=like.digest_from)), None

        return self._take_early(key, like, wait, receive, asked)

    def _asking(self, key: str) -> tuple[list[Callable[[], Record | None]], Callable[[], None] | None]:
        """Where an early fetch's record comes from: a thread that waited in the key's
        directory keeps hearing its announcements (the record will be among them, no round
        trip); otherwise it is asked for as soon as the owner's reply starts, overlapping the
        body. Returns the list the asked-for record's reader lands in, and the ``on_reply``
        that asks (``None`` when the record will be heard)."""
        asked: list[Callable[[], Record | None]] = []
        if self.metadata.watching(key.rpartition("/")[0] + "/"):
            return asked, None
        return asked, lambda: asked.append(self.metadata.lookup_soon(key))

    def _take_early(self, key: str, like: Record, wait: float,
                    receive: Callable[[int, memoryview | None, Callable[[], None]],
                                      tuple[Received | None, Record | None]],
                    asked: list[Callable[[], Record | None]]) -> Record | None:
        """Receive ``key`` asked for early into a staged file and keep it as a fetched copy
        once it matches the key's record; ``None`` (nothing left behind) for anything else.

        ``receive(fd, into, replied)`` gives the bytes' size and digest, and the record if
        known already: into the staged file ``fd``, or into ``into``, a mapping of that file
        (when its pages are allocated already: see
        :func:`~instride.store.recvpool.map_to_receive`); it calls ``replied()`` once the
        owner's reply has started, before the bytes are taken off the socket. That takes the
        key's lock: while the owner's server is still sending, rather than on the frame's
        path once the bytes are all in (a woken process's first pass through any code is slow
        on a VM: ~0.1 ms for the lock).

        One consumer of the node asks early for a key at a time: a lock of its own (not the
        key's, which a consumer stopped in its wait would then hold from everyone; a byte of
        one file: :mod:`instride.store.slots`) is taken without waiting before the request;
        a key another consumer of this node (a thread, a process) asked for already is left
        to the usual way, which finds the copy that one stores (one transfer per key and
        node, but for a consumer that fetches the usual way first, before the owner's reply
        started)."""
        path = f"{self.root}/{key}"
        staged = tmp_name(path)
        fd = -1
        mapped = view = None
        held = contextlib.ExitStack()
        asking = contextlib.ExitStack()  # (the early request's lock, until the reply starts)
        locked: list[int] = []  # (when the key's fetch lock was taken, once it was)
        named = False  # (whether the staged file got the key's name: nothing to drop then)

        def replied() -> None:
            if not locked:
                held.enter_context(self._lock(key, time.monotonic() + wait, past_stopped=True))
                locked.append(_file_clock_ns())
                asking.close()  # (the key's lock holds the others off now; let go of it
                # while the bytes come, not on the frame's path once they are in)

        self._unmap()
        try:
            if not asking.enter_context(self._asking_locks.held(key)):
                return None  # (asked for by another consumer of this node)
            self._parent_made(path.rpartition("/")[0])
            fd = self._staged(staged, like.size)  # (open, so locked, until it has its name)
            if like.size <= self.recv_pool.ahead_bytes:
                mapped = map_to_receive(fd, like.size)
                view = None if mapped is None else memoryview(mapped)
                self.mapped_receives += mapped is not None
            with held:
                got, record = receive(fd, view, replied)
                # (a file the pool sized for the last frame, or a new one the bytes made:
                # of another size only where this frame's size differs from that one's)
                if got is not None and got[0] != like.size and os.fstat(fd).st_size != got[0]:
                    os.ftruncate(fd, got[0])  # (a recycled file sized for another frame)
                if got is None:
                    return None
                record = self._early_record(key, got, record, asked, wait)
                if record is None:
                    return None
                replied()  # (taken already, unless the transport never said)
                # (usually no copy is there: the sidecar is read only when one is)
                there = os.access(path, os.F_OK, follow_symlinks=False)
                side = self.cached_copy(key) if there else None
                if not (side is not None and _copy_of(side, record)):
                    if not self._store_copy(staged, path, record, since_ns=locked[0],
                                            deadline=time.monotonic() + wait):
                        return None  # (a later publication's copy, stored meanwhile)
                    named = True
                    if len(self._kept) >= _SEEN_MAX:
                        self._kept.clear()
                    self._kept[key] = (time.monotonic(), _identity(record))
        except (InstrideError, OSError):
            # nothing there in time, not recorded, not the recorded bytes, a failed transfer
            # or store, Redis away for a moment: the usual way sorts it out (or says what)
            self._dirs.discard(path.rpartition("/")[0])  # (in case gc removed it)
            return None
        finally:
            held.close()  # (the locks, if no with-block let go of them)
            asking.close()
            if mapped is not None:
                view.release()  # type: ignore[union-attr]
                self._unmap(later=mapped)
            if fd >= 0:
                os.close(fd)
            if not named and os.access(staged, os.F_OK, follow_symlinks=False):
                self._drop_file(staged, locked=False)
        self.transfers += 1
        self.early_transfers += 1
        self._fetched(record)
        self.evict(keep=key)
        return record

    def _fetched(self, record: Record) -> None:
        """Remember ``record`` as the last key fetched, of all and of its directory."""
        self.last_fetched = record
        parent = record.key.rpartition("/")[0]
        if parent not in self._fetched_in and len(self._fetched_in) >= _SEEN_MAX:
            self._fetched_in.clear()
        self._fetched_in[parent] = record

    def _unmap(self, later: mmap.mmap | None = None) -> None:
        """Unmap the receive file's mapping kept by the last early fetch; keep ``later``
        instead (unmapped by the next early fetch, before it takes a file, or by
        :meth:`close`): off the path of the frame just received (an unmapping may wait for
        the other CPUs' TLBs), and never while the file could be claimed from the receive
        pool (a mapping of it would keep it from being reused)."""
        old, self._mapped = self._mapped, later
        if old is not None:
            with contextlib.suppress(BufferError, ValueError):
                old.close()

    def _early_record(self, key: str, got: Received, record: Record | None,
                      asked: list[Callable[[], Record | None]], wait: float) -> Record | None:
        """The record of ``key`` received early (``got``: its size, digest and header), checked against
        the bytes: the one known already, else asked for meanwhile, heard announced or looked
        up; ``None`` when what the owner sent is not that key's (a record of another key).

        Raises
        ------
        IntegrityError
            The bytes are not the recorded ones.
        """
        if record is None and asked:
            record = asked[0]()
        elif record is None:
            record = self.metadata.announced(key, _HEARD_WITHIN)
            self.records_heard += record is not None
        if record is None:
            record = self.metadata.lookup(key)
        # Sent as it was renamed into place, the frame is recorded a moment later (the
        # owner's next round trip to Redis): look again shortly, then wait for it.
        pause = 0.0002
        while record is None and pause < 0.005:
            time.sleep(pause)
            pause *= 2
            record = self.metadata.lookup(key)
        if record is None:
            record = self.metadata.wait_any([key], max(wait, 0.05))
        if record.key != key:
            return None
        record.verify(got.digest, got.size, got.head)
        return record

    def receive_when_published(self, key: str, like: Record, wait: float, fd: int,
                               check: Callable[[Received], bool],
                               until: str | None = None,
                               window: tuple[float, float] | None = None,
                               into: memoryview | None = None,
                               ahead: int = 0, digest_from: int = 0,
                               unwatch: bool = False, batch: str | None = None,
                               ) -> Received | None:
        """:meth:`fetch_when_published` into the caller's memory ``into`` (when the frame fits;
        else into ``fd``, from its offset) instead of a fetched copy, checked by the caller
        instead of against the key's record: nothing is stored on this node, and nothing is
        asked of the metadata. For a bounded stream's reader, which drops each frame once it
        moves on (:mod:`~instride.store.inbox`) and checks each frame by the checksums the
        frame file carries itself (``digest_from``: the digest leaves out the bytes before
        that offset, the frame's header; ``check`` compares). Such a reader needs no
        announcements of the stream's frames: with ``unwatch`` (the reader's first such call
        after a wait through the metadata), this thread's kept subscription to the key's
        directory, which that wait left, is dropped, and Redis stops sending them. ``ahead``:
        the owner may send that many next frames too, each as it is published (the reader's
        next calls then send no request; see the transport's ``fetch_when_published``), kept
        under ``batch`` (a reader's own name: two readers of a thread keep their own; see
        :meth:`drop_ahead`).

        Returns
        -------
        Received or None
            What was received, the bytes in ``into`` (or ``fd``) passed ``check``; ``None``
            when nothing was published within ``wait``, the transport cannot, the transfer
            failed or ``check`` refused the bytes (the caller waits the usual way, which
            reports errors).
        """
        fetch = getattr(self.transport, "fetch_when_published", None)
        if fetch is None:
            return None
        if unwatch:
            self.metadata.unwatch(key.rpartition("/")[0] + "/")
        try:
            got = fetch(like, key, fd, wait, until, None,
                        **_options(window, into, ahead, digest_from, batch))
        except (InstrideError, OSError):
            return None  # (as for a fetched copy: the usual way sorts it out, or says what)
        if got is None:
            return None
        if not check(got):  # (the frames asked for ahead with it are not wanted either: the
            self.drop_ahead(like.owner, key, batch)  # usual way fetches this one, and asks again)
            return None
        self.transfers += 1
        self.early_transfers += 1
        return got  # type: ignore[no-any-return]

    def receive_next_asked(self, key: str, like: Record, wait: float, into: memoryview,
                           address: int, fd: Callable[[], int],
                           check: Callable[[Received, bool], bool],
                           unwatch: bool = False, batch: str | None = None,
                           ) -> Received | bool | None:
        """:meth:`receive_when_published` for a stream reader's common case, in one native
        call where the transport has one (``next_asked``): ``key`` is the next of the frames
        this thread asked ``like``'s owner for ahead, received into ``into`` (the memory at
        ``address``; ``fd`` gives the file for a frame that does not fit) and checked there
        as a frame file. ``check(received, checked)`` decodes it (``checked``: its
        checksums passed already) and says whether it passes. ``unwatch``: as for
        :meth:`receive_when_published`, where this applies.

        Returns
        -------
        Received, False or None
            As :meth:`receive_when_published`; ``False`` where this does not apply (the
            frame was not asked for ahead, or the transport cannot): nothing was read, and
            the caller goes on with :meth:`receive_when_published`.
        """
        nxt = getattr(self.transport, "next_asked", None)
        if nxt is None:
            return False
        try:
            got = nxt(like, key, into, address, fd, wait, **({} if batch is None
                                                               else {"batch": batch}))
        except (InstrideError, OSError):
            return None  # (as receive_when_published: the usual way sorts it out, or says what)
        if got is False:
            return False
        if unwatch:  # (a wait through the metadata since the last frame subscribed again)
            self.metadata.unwatch(key.rpartition("/")[0] + "/")
        if got is None:
            return None
        received, checked = got
        if not check(received, checked):  # (as receive_when_published)
            self.drop_ahead(like.owner, key, batch)
            return None
        self.transfers += 1
        self.early_transfers += 1
        return received  # type: ignore[no-any-return]

    def drop_ahead(self, owner: str | None = None, key: str | None = None,
                   batch: str | None = None) -> None:
        """Drop the frames this thread asked for ahead (a stream's reader closes), of
        ``owner`` (its address) alone when given, and of the stream of ``key`` alone when
        given (other readers' batches stay); of the reader named ``batch`` alone when given,
        whichever thread it read in."""
        drop = getattr(self.transport, "drop_ahead", None)
        if drop is not None:
            drop(owner, key, batch)

    def _wait_early(self, keys: Sequence[str], timeout: float | None) -> Record | None:
        """:meth:`wait_any` for a consumer walking numbered keys (a stream's frames) that
        fetched the key before ``keys[0]`` from another node: ask that key's owner for
        ``keys[0]`` (its data server sends it as it is published), while hearing the
        directory's announcements — whichever comes first. The key then arrives as a fetched
        copy (see :meth:`fetch_when_published`). Only then: a wait for any other key does not
        move its bytes.

        Returns the record of ``keys[0]``, now on this node (or of one of ``keys`` found
        published already by a thread that did not watch the directory yet); ``None`` when
        this does not apply or nothing came in time (the caller waits the usual way).

        Raises
        ------
        _Elsewhere
            One of ``keys`` was published by another owner (or another of them first): its
            record, as the usual wait would return it.
        """
        key = keys[0] if keys else ""
        like = self._fetched_in.get(key.rpartition("/")[0])
        ask = getattr(self.transport, "ask_when_published", None)
        parent = like.key.rpartition("/")[0] if like is not None else ""
        if like is None or ask is None or not parent or not _follows(key, like.key) \
                or any(k.rpartition("/")[0] != parent for k in keys):
            return None
        prefix = parent + "/"
        wait = _EARLY_WAIT if timeout is None else min(_EARLY_WAIT, timeout / 2)
        if wait < 0.01 or os.access(f"{self.root}/{key}", os.F_OK):
            return None
        sub = self.metadata.subscription(prefix)  # (a stream's first wait left one)
        watch = getattr(self.metadata, "watch", None)
        if sub is None and watch is not None:
            # A thread that never waited here (a node server runs each wait on whichever
            # thread of its pool is free). Published already: nothing to ask for early (a
            # reader that may meet retired frames would hold a request for a gone one);
            # else it watches the directory from now on, as a wait there would leave it.
            try:
                found = self.metadata.lookup_any(keys)
            except (InstrideError, OSError):
                return None  # (Redis away for a moment: the usual wait recovers, or says so)
            if found is not None:
                return found
            if watch(prefix, wait):
                sub = self.metadata.subscription(prefix)
        if sub is None:
            return None
        sub_fd = sub.fileno()
        until = keys[1].rpartition("/")[2] if len(keys) > 1 else None
        gone = select.POLLERR | select.POLLHUP | select.POLLNVAL

        def receive(fd: int, into: memoryview | None,
                    replied: Callable[[], None]) -> tuple[Received | None, Record | None]:
            # The same protocol as the usual wait: drop what was heard, look up, then trust
            # what is heard after the lookup. The request goes out first: the lookup's round
            # trip overlaps its wait.
            self.metadata.heard(keys)
            sock = ask(like, key, wait, until)
            handed = False
            try:
                rec = self.metadata.lookup_any(keys)
                known = None
                poller = select.poll()
                poller.register(sock.fileno(), select.POLLIN)
                poller.register(sub_fd, select.POLLIN)
                # (the owner answers when its wait ends; a margin for that answer, within the
                # caller's timeout, of which the early wait takes at most half)
                deadline = time.monotonic() + wait + min(_EARLY_MARGIN, wait)
                while True:
                    if rec is not None and (rec.key != key or rec.owner != like.owner):
                        raise _Elsewhere(rec)  # (withdrawn: the owner drops a closed request)
                    if rec is not None:
                        known = rec  # from the owner asked: its bytes are on their way
                    left = deadline - time.monotonic()
                    if left <= 0 or self.metadata.subscription(prefix) is not sub:
                        return None, None  # (Redis went away: the usual wait recovers)
                    ready = dict(poller.poll(left * 1000))
                    if sock.fileno() in ready:
                        break
                    if ready.get(sub_fd, 0) & gone:
                        return None, None
                    heard = self.metadata.heard(keys)
                    rec = next((heard[k] for k in keys if k in heard), known)
                # The bytes are on their way: the key's lock, while they come (see
                # _take_early). The record, if not known yet, is read from the announcements
                # once the bytes are in (_early_record): a look now, before the bytes, usually
                # finds nothing yet (the owner records a frame after its publication), and
                # costs a woken process ~0.1 ms on the frame's path.
                replied()
                handed = True
                got = self.transport.receive_asked(  # type: ignore[attr-defined]
                    sock, like, key, fd, wait, digest_from=like.digest_from,
                    **({} if into is None else {"into": into}))
                return got, known
            finally:
                if not handed:
                    sock.close()  # (withdrawn: the owner's server drops it)

        return self._take_early(key, like, wait, receive, [])

    def consume_bytes(self, key: str, timeout: float | None) -> memoryview:
        """Content of ``key``: the local file memory-mapped, or a key owned elsewhere received
        into memory, verified and not stored."""
        path = key_path(key, self.root)
        deadline = None if timeout is None else time.monotonic() + timeout
        hold = recyclable(key)  # (a stream's frame: held while mapped)

        def opener(_path: object, _flags: int) -> int:
            return self.confined.open(key, hold=hold)

        for attempt in range(_MAP_ATTEMPTS):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._current(key, path, deadline):
                record = self._take_seen(key, time.monotonic()) or self.metadata.wait_any([key], left)
                if not self._mine(record.owner):
                    return memoryview(self._fetch_bytes(record))
            local = self.consume(key, left)
            try:
                return map_file(local, opener)  # [confine]
            except FileNotFoundError:
                # a fetched copy another process of this node evicted between its fetch and
                # this mapping (INSTRIDE_CACHE_BYTES): made local again
                if attempt == _MAP_ATTEMPTS - 1:
                    raise KeyNotFoundError(key) from None
        raise AssertionError("unreachable")

    def _fetch_bytes(self, record: Record) -> bytearray:
        """``transport.fetch_bytes``, again with the current record when the owner
        re-published the key since ``record`` was seen (as :meth:`_fetch`)."""
        for attempt in range(3):
            try:
                data = self.transport.fetch_bytes(record)
            except (IntegrityError, KeyNotFoundError):
                newer = self._republished(record, attempt)
                if newer is None:
                    raise
                record = newer
                continue
            self.transfers += 1
            return data
        raise AssertionError("unreachable")

    def _republished(self, record: Record, attempt: int) -> Record | None:
        """The key's current record, for attempt ``attempt + 1`` of at most 3 of a transfer
        that did not match ``record``, when it is another one: the owner re-published the key
        meanwhile, or ``record`` came from a moment-old notification. ``None``: give up."""
        newer = self.metadata.lookup(record.key) if attempt < 2 else None
        return newer if newer is not None and _identity(newer) != _identity(record) else None

    # ------------------------------------------------------------------ engine protocol
    def ready(self, key: str) -> str | None:
        """The local file of ``key`` if it may be served now: an original of this node, or a
        fetched copy of the latest version (one metadata lookup)."""
        path = key_path(key, self.root)
        return str(path) if self._current(key, path) else None

    def wait_any(self, keys: Sequence[str], timeout: float | None) -> str:
        """The first of ``keys`` to be recorded in the metadata.

        The record is remembered for a moment, so that a :meth:`consume` of the key right
        after (the usual sequence of a stream consumer) needs no second metadata round trip.
        A consumer that fetched the key before ``keys[0]`` from another node (frame after
        frame of a stream) asks that owner for ``keys[0]`` while it waits, so the key is
        usually on this node already when the wait returns (:meth:`_wait_early`).
        """
        start = time.monotonic()
        try:
            record = self._wait_early(keys, timeout)
        except _Elsewhere as first:
            record = first.record
            self.early_withdrawn += 1
        if record is None:
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
            record = self.metadata.wait_any(list(keys), left)
        if len(self._seen) >= _SEEN_MAX:
            self._seen.clear()
        self._seen[record.key] = (time.monotonic(), record)
        return record.key

    def exists(self, key: str) -> bool:
        """Whether ``key`` is on this node (an original) or recorded in the metadata; a
        fetched copy of a key deleted since (no record) is not the key: dropped, ``False``."""
        if os.path.exists(self.root / key) and not self.is_copy(key):
            return True
        if self.metadata.lookup(key) is not None:
            return True
        if self.is_copy(key):
            self.drop_copy(key)
        return False

    def drop_unrecorded_copy(self, key: str) -> bool:
        """Drop this node's fetched copy of ``key`` if the key has no record (deleted by its
        owner since the fetch); whether the key's name is free of it now. For a write-once
        publication of ``key`` on this node that found a file under the key: a copy of a
        deleted key is no publication, and must not refuse it."""
        if self._copy_here(key) is None or self.metadata.lookup(key) is not None:
            return False
        self.drop_copy(key)
        return not os.path.lexists(self.root / key)

    #: a writer should hash what it writes and pass it to :meth:`published` (saves a pass)
    wants_checksum = True
    confines = False  # a fetched copy is checked by the client

    def retired(self, key: str) -> None:
        """A file of this node was taken away from its key: delete its record (a stream's
        frame: its publication confirmed before, no mark of it kept, see
        :meth:`RedisMetadata.forget`)."""
        self.metadata.forget(key)

    def drop_copy(self, key: str) -> None:
        """Remove this node's fetched copy of ``key`` (never an original of this node): a
        bounded stream's frame its reader released. Its storage goes to the receive pool for
        the next fetch, reused once no reader holds the frame's lock.

        Under the key's lock, as :meth:`evict`: never beside a fetch of the key in another
        process of this node (a new run's frame), whose new copy and sidecar would go with
        the old ones (a file gone under its consumer, or a copy left looking like an
        original); a key being fetched now is left to that fetch."""
        try:
            with self._lock(key, time.monotonic()), self._store_locks.held(key) as free:
                if free and self._copy_here(key) is not None:
                    # the file first: without a sidecar the copy would look like an original
                    self._drop_file(f"{self.root}/{key}", locked=True)
                    self.forget_fetched(key)
        except ConsumeTimeout:
            pass

    def forget_other_runs(self, stream: str, run: str, since: float, node: str | None,
                          files: re.Pattern[str]) -> int:
        """Drop this node's files of ``stream`` (names matching ``files``: its frames and end
        marker) that are of another run than ``run``, begun at ``since`` (``time.time()``): a
        stream re-run under its name (``overwrite=True``) numbers its frames from 0 again, and
        an earlier run's frame would be taken for the new one. Fetched copies go (a copy of
        the new run is fetched after this, by the reader that calls it); originals of an
        earlier run made on this node, from before ``since`` (their records went with the
        re-run's start), are deleted. The run whose files the node holds is noted in a file
        of the node, so this costs a directory scan once per run and node. Returns the number
        of files dropped."""
        mark = self.settings.internal_dir / "runs" / f"{stream}.run"
        try:
            if mark.read_text() == run:
                return 0
        except (FileNotFoundError, NotADirectoryError):
            pass
        dropped = 0
        # (the same address spelled otherwise is this node: its originals are the run's own;
        # one that cannot be told apart, a host name that does not resolve, may be too)
        elsewhere = node is not None and same_addr(node, self.settings.addr) is False
        before = math.inf if elsewhere else since - _RUN_MARGIN
        try:
            entries = list(os.scandir(self.root / stream))
        except (FileNotFoundError, NotADirectoryError):
            entries = []
        for entry in entries:
            if not files.fullmatch(entry.name):
                continue
            key = f"{stream}/{entry.name}"
            try:
                if self.is_copy(key):
                    self.drop_copy(key)
                elif entry.stat(follow_symlinks=False).st_mtime < before:
                    os.unlink(entry.path)
                else:
                    continue
            except FileNotFoundError:
                continue
            dropped += 1
        mark.parent.mkdir(parents=True, exist_ok=True)
        tmp = tmp_name(str(mark))
        with open(tmp, "w") as fh:
            fh.write(run)
        os.replace(tmp, mark)
        return dropped

    def is_copy(self, key: str) -> bool:
        """Whether this node's file of ``key`` was fetched from another node (it has a cache
        entry; an original has none)."""
        return os.access(self._sidecar(key), os.F_OK, follow_symlinks=False)

    def _drop_file(self, path: str, *, locked: bool) -> None:
        """Take a dropped copy's name away: into the receive pool, else deleted."""
        if not self.recv_pool.give(path, locked=locked):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def frame_path(self, key: str) -> str | None:
        """Where ``key``'s file is when a copy is on this node (else fetch it first)."""
        path = f"{self.root}/{key}"
        return path if os.access(path, os.F_OK) else None  # (exists() raises per miss)

    def stream_state(self, stream: str) -> RedisStreamState:
        """The stream's head, policy and groups: in Redis, shared by every node."""
        return RedisStreamState(self.metadata, stream)

    def published(self, key: str, overwrite: bool, checksum: str | None = None,
                  size: int | None = None, *, then: Sequence[tuple[Any, ...]] = ()) -> None:
        """Record a publication of this node (owner, size, checksum, new version).

        ``checksum`` and ``size``, when the writer computed them while writing, spare a second
        pass over the file. ``then``: metadata commands run in the same step once the record
        is stored (a stream's head counters and retired frames).
        """
        self.register(key, overwrite=overwrite, checksum=checksum, size=size, then=then)

    def published_soon(self, key: str, overwrite: bool, checksum: str, size: int, *,
                       then: Sequence[tuple[Any, ...]] = (),
                       report: str | None = None, hold: bool = False) -> PendingRecord:
        """:meth:`published` without waiting for the metadata's answer: the record is sent
        now and stored as soon as Redis reads it; calling the result waits for the answer
        and raises what :meth:`published` would (it may be called again after it raised: a
        record not known to be stored is sent again, as the same publication).

        For a stream's frames after its first (which finds an existing stream at once): a
        later frame's key cannot be taken by anyone else, so the producer confirms its
        frames' records a few frames later instead of waiting for each. Unlike
        :meth:`register`, a refused record does not remove the file: the stream's producer
        owns it. ``report``: a metadata hash read back in the same step (the result's
        ``reported``; where the metadata cannot, ``None``). ``hold``: the record may be held
        back, to go with the next ones (see :meth:`RedisMetadata.publish_soon`).
        """
        soon = getattr(self.metadata, "publish_soon", None)
        if soon is None:  # (a backend that cannot: recorded now, ``then`` with it)
            stored = self.register(key, overwrite=overwrite, checksum=checksum, size=size,
                                   then=then)
            return PendingRecord(lambda: stored, lambda: True)
        record = Record(key=key, owner=self.settings.addr, size=size, checksum=checksum,
                        version=1, time=time.time(), node=self.settings.node)
        self.forget_fetched(key)  # our own original now, never evicted
        return soon(record, overwrite=overwrite, then=then,  # type: ignore[no-any-return]
                    report=report, hold=hold)

    def register(self, key: str, *, overwrite: bool, checksum: str | None = None,
                 size: int | None = None, then: Sequence[tuple[Any, ...]] = ()) -> Record:
        """Record the file in place under ``key`` with this node as owner.

        ``checksum`` (``"xxh3:<hex>"``, or a stream frame's ``"isf:<hex>"``) and ``size`` may
        be given by a caller that computed them while writing the file; otherwise the file
        is read once to compute them. ``then`` are metadata commands to run in the same step,
        once the record is stored. If recording fails, a write-once file is removed again, so
        no key is left visible without a record; except a second registration of the very
        file already recorded (same owner and checksum: a thin client's repeated
        ``PUBLISH``), which must not remove the published original.
        """
        path = f"{self.root}/{key}"
        if checksum is None or size is None:  # (the size of the bytes the checksum is of)
            checksum, size = store.file_checksum_and_size(path)
        record = Record(key=key, owner=self.settings.addr, size=size,
                        checksum=checksum, version=1, time=time.time(),
                        node=self.settings.node)
        self.forget_fetched(key)  # our own original now, never evicted
        try:
            if then:  # (a Redis backend's extension: the protocol's publish takes none)
                return self.metadata.publish(record, overwrite=overwrite, then=then)
            return self.metadata.publish(record, overwrite=overwrite)
        except KeyExistsError:
            # [keep] a second registration of the very file already recorded (this node, the
            # same bytes: a thin client's repeated PUBLISH, or the one that settles an
            # unsettled publication) is confirmed, and never removes the published original;
            # a conflicting file is removed.
            existing = None if overwrite else self.metadata.lookup(key)
            if existing is not None and existing.checksum == record.checksum and (
                    self._mine(existing.owner)):
                return existing
            if not overwrite:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            raise
        except PublicationUnsettled:
            raise  # [keep] the file stays: a record stored after all names it
        except BaseException:
            if not overwrite:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            raise

    def close(self) -> None:
        """Release the transport's and the metadata backend's connections."""
        self.confined.close()
        self.transport.close()
        self.metadata.close()
        self.recv_pool.close()
        self._unmap()


__all__ = ["ClusterEngine"]
