"""The node-local state of a stream with retention: head counters, policy, consumer groups.

Everything lives in a hidden directory of the managed directory,
``.instride/streams/<stream name>.stream/``:

``head``
    32 bytes mapped by the producer and its readers: the oldest frame still retained and the
    number of frames written. A reader that does not find frame *i* compares *i* with the
    oldest retained frame to tell "not written yet" from "dropped".
``policy.json``
    The producer's retention settings (``retain``, ``retain_bytes``, ``on_full``, archive).
``groups/<name>``
    One 8-byte cursor per consumer group: the next frame the group has not finished with.
    A reader of the group holds an exclusive ``flock`` on the file while it runs (one reader
    per group; the kernel drops the lock when the reader dies, so a restarted reader takes
    over and resumes at the cursor).
``pool/``
    The producer's retired frame files waiting for reuse (:mod:`instride.store.ring`).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import mmap
import os
import re
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import redis

from ..errors import ConfigError, GroupBusy, GroupLeaseLost, GroupReset, MetadataUnavailable
from ..perthread import forks
from .dirs import allocate
from .procs import pid_space as _pid_space
from .procs import proc_stat as _stat

POLICIES = ("block", "drop-oldest", "latest")
#: The consumer group of a stream's archiver (``archive=``).
ARCHIVE_GROUP = "archive"
#: A group's position past every frame: a reader that stopped for good (``leave_group``)
#: takes nothing more, so its producer no longer waits for it.
GROUP_DONE = 2**62
#: tries of a re-run's reset of the groups (Redis) that a commit can spoil (WATCH)
_RESET_TRIES = 100
_GROUP_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\Z")
_HEAD = struct.Struct("<qqqq")  # oldest retained, frames written, producer pid, run count
_CURSOR = struct.Struct("<q")


def state_dir(root: Path, stream: str) -> Path:
    """The hidden state directory of ``stream`` under the managed directory ``root``."""
    return root / ".instride" / "streams" / f"{stream}.stream"


def check_group(name: str) -> str:
    """Validate a consumer group name.

    Raises
    ------
    ConfigError
        Not 1-64 characters of letters, digits, ``_``, ``-`` and ``.`` (not starting with
        ``.`` or ``-``).
    """
    if not isinstance(name, str) or not _GROUP_RE.match(name):
        raise ConfigError(
            "group", name,
            "a consumer group name is 1-64 letters, digits, '_', '-' or '.', not starting with '.' or '-'",
        )
    return name


@dataclass
class Policy:
    """Retention settings of a stream, as its producer set them."""

    retain: int | None = None
    retain_bytes: int | None = None
    on_full: str = "block"
    archive: str | None = None

    def __post_init__(self) -> None:
        if self.on_full not in POLICIES:
            raise ConfigError("on_full", self.on_full, f"expected one of {', '.join(POLICIES)}")
        if self.on_full == "latest":
            self.retain = 1
        for name in ("retain", "retain_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(name, value, "must be an integer >= 1 (or None: unbounded)")

    @property
    def bounded(self) -> bool:
        """Whether the stream retires old frames at all."""
        return self.retain is not None or self.retain_bytes is not None

    @property
    def drops(self) -> bool:
        """Whether old frames are dropped (rather than the producer waiting)."""
        return self.on_full != "block"

    def save(self, directory: Path) -> None:
        """Write ``policy.json`` atomically."""
        tmp = directory / f".policy.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(asdict(self)))
        os.rename(tmp, directory / "policy.json")

    @classmethod
    def load(cls, directory: Path) -> Policy | None:
        """Read ``policy.json``; ``None`` when the stream has none."""
        try:
            return cls(**json.loads((directory / "policy.json").read_text()))
        except FileNotFoundError:
            return None


class Head:
    """The shared counters of a stream (a small mapped file).

    Parameters
    ----------
    path
        The ``head`` file.
    writable
        The producer maps it writable (creating it); readers map it read-only.
    """

    def __init__(self, path: Path, *, writable: bool) -> None:
        flags = os.O_RDWR | os.O_CREAT if writable else os.O_RDONLY
        fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
        try:
            if writable and os.fstat(fd).st_size < _HEAD.size:
                allocate(fd, _HEAD.size, path)  # (not sparse: a full disk is ENOSPC, not SIGBUS)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._mm = mmap.mmap(fd, _HEAD.size, prot=prot)
        finally:
            os.close(fd)

    @classmethod
    def open(cls, path: Path) -> Head | None:
        """Map an existing head read-only; ``None`` if the stream has none."""
        try:
            return cls(path, writable=False)
        except (FileNotFoundError, ValueError):
            return None

    @property
    def oldest(self) -> int:
        """The oldest frame still retained."""
        return int(_CURSOR.unpack_from(self._mm, 0)[0])

    @oldest.setter
    def oldest(self, value: int) -> None:
        _CURSOR.pack_into(self._mm, 0, value)

    @property
    def written(self) -> int:
        """Frames written so far."""
        return int(_CURSOR.unpack_from(self._mm, 8)[0])

    @written.setter
    def written(self, value: int) -> None:
        _CURSOR.pack_into(self._mm, 8, value)

    @property
    def producer(self) -> int:
        """PID of the producer that last wrote the stream (0: none)."""
        return int(_CURSOR.unpack_from(self._mm, 16)[0])

    @producer.setter
    def producer(self, value: int) -> None:
        _CURSOR.pack_into(self._mm, 16, value)

    @property
    def runs(self) -> int:
        """How many producers started the stream in this file (0: none, or an earlier
        instride's, which kept no count)."""
        return int(_CURSOR.unpack_from(self._mm, 24)[0])

    @runs.setter
    def runs(self, value: int) -> None:
        _CURSOR.pack_into(self._mm, 24, value)

    def close(self) -> None:
        """Unmap."""
        self._mm.close()


class Groups:
    """The consumer groups of a stream on this node (their cursor files).

    In cluster mode the groups live in Redis instead (:class:`RedisStreamState`), so that a
    producer sees the progress of readers on every node.
    """

    def __init__(self, directory: Path) -> None:
        self.dir = directory / "groups"
        self._fds: dict[str, int] = {}
        self._names: list[str] = []
        self._listed = -1.0  # when the group names were last read (monotonic seconds)

    def register(self, name: str, start: int = 0) -> bool:
        """Create group ``name`` with its cursor at ``start``; False if it existed."""
        check_group(name)
        self.dir.mkdir(parents=True, exist_ok=True)
        # unique per thread: a producer and a reader thread of one process may register at once
        tmp = self.dir / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_bytes(_CURSOR.pack(start))
        try:
            os.link(tmp, self.dir / name)  # atomic create-if-absent with its content
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink()

    def names(self) -> list[str]:
        """Registered groups."""
        try:
            return sorted(n for n in os.listdir(self.dir) if not n.startswith("."))
        except FileNotFoundError:
            return []

    def cursors(self) -> dict[str, int]:
        """Each group's cursor (the first frame it has not finished with).

        The names of the groups are re-read at most every 50 ms (a group registered
        meanwhile is seen within that time; its cursor starts at 0, so no frame it needs is
        retired before: retirement waits for it from then on).
        """
        now = time.monotonic()
        if now - self._listed > 0.05:
            self._names = self.names()
            self._listed = now
        out = {}
        for name in self._names:
            fd = self._fds.get(name)
            if fd is None:
                try:
                    fd = os.open(self.dir / name, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                self._fds[name] = fd
            out[name] = _cursor_value(os.pread(fd, _CURSOR.size, 0))
        return out

    def reset(self, keep: Sequence[str] = ()) -> None:
        """Set the cursors back to 0 (a stream re-written from its start); drop the groups
        that have no place in the new run (:func:`_dropped_on_reset`).

        Each cursor file is replaced by a new one (or removed), not written over: a reader of
        the earlier run that still holds its group holds the old file (unlinked now, which
        its :meth:`GroupCursor.check` sees), so it can neither write its position of the
        earlier run into the new cursor nor keep the group from a reader of the new run."""
        self.close()  # (the cached descriptors are the old files')
        for name in self.names():
            try:
                with open(self.dir / name, "rb") as fh:
                    value = _cursor_value(fh.read(_CURSOR.size))
            except FileNotFoundError:
                continue
            if _dropped_on_reset(name, value, keep):
                with contextlib.suppress(FileNotFoundError):
                    (self.dir / name).unlink()
                continue
            tmp = self.dir / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
            tmp.write_bytes(_CURSOR.pack(0))
            os.replace(tmp, self.dir / name)

    def close(self) -> None:
        """Close cached descriptors."""
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()


class GroupCursor:
    """A reader's exclusive handle on its group's cursor.

    Raises
    ------
    GroupBusy
        Another live process holds the group.
    """

    def __init__(self, groups: Groups, stream: str, name: str, start: int) -> None:
        groups.register(name, start)
        self.name, self.stream = name, stream
        self._fd = os.open(groups.dir / name, os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise GroupBusy(stream, name) from None
        self.value = _cursor_value(os.pread(self._fd, _CURSOR.size, 0))
        _HELD_CURSORS.add(self)

    def check(self) -> None:
        """Whether the group is still this reader's: its lock is held until the reader closes
        or dies, but a re-run of the stream replaces the group's cursor file (the old one
        has no name left).

        Raises
        ------
        GroupReset
            The stream was re-run: this reader's position is the earlier run's.
        """
        if self._fd < 0:  # (a forked child's copy: the group stayed with the parent)
            raise GroupBusy(self.stream, self.name)
        if os.fstat(self._fd).st_nlink == 0:
            raise GroupReset(self.stream, self.name)

    def commit(self, value: int) -> None:
        """Record that the group is done with every frame before ``value``.

        Raises
        ------
        GroupReset
            The stream was re-run: nothing is recorded.
        """
        self.check()
        if value != self.value:
            os.pwrite(self._fd, _CURSOR.pack(value), 0)
            self.value = value

    def close(self) -> None:
        """Release the group (the cursor stays)."""
        _HELD_CURSORS.discard(self)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _forked(self) -> None:
        """In a child made by ``fork``: close the inherited descriptor. Its lock is the open
        file's, shared with the parent's descriptor: kept open here, it held the group after
        the parent closed its reader (``GroupBusy`` for every next reader while the child
        lived — a ``multiprocessing`` pool's workers, say); closed, the parent's stays."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


#: the group cursors this process holds (one node's: their files are locked)
_HELD_CURSORS: weakref.WeakSet[GroupCursor] = weakref.WeakSet()


def _close_inherited_cursors() -> None:
    for cursor in list(_HELD_CURSORS):
        cursor._forked()
    _HELD_CURSORS.clear()


os.register_at_fork(after_in_child=_close_inherited_cursors)


def _cursor_value(data: bytes) -> int:
    """A cursor file's value; a short one (a file cut by a crash before it reached the disk,
    or by hand) counts as 0: its group reads the stream again from its start — frames
    delivered twice, none skipped — and the producer waits for it."""
    return int(_CURSOR.unpack(data)[0]) if len(data) == _CURSOR.size else 0


def _dropped_on_reset(name: str, value: int, keep: Sequence[str]) -> bool:
    """Whether a re-run drops group ``name`` (its cursor ``value`` in the earlier run) rather
    than setting it back to 0: not one the new run's producer names (``keep``), and either
    the earlier run's archiver's (no archiver of this run reads it) or a group its reader
    finished for good (``leave_group``: set back to 0, a producer under "block" would wait
    for a reader that never comes). Other groups stay, at 0, for the new run's readers."""
    if name in keep:
        return False
    return name == ARCHIVE_GROUP or value >= GROUP_DONE


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def cursors_of(fields: dict[bytes, bytes]) -> dict[str, int]:
    """The groups' cursors from the fields of the state's :attr:`StreamState.cursors_key`."""
    return {k.decode(): int(v) for k, v in fields.items()}


class StreamState(Protocol):
    """What a stream needs to share between its producer and its readers."""

    def start(self, policy: Policy, groups: tuple[str, ...], *, reset: bool,
              forget: Sequence[str] = ()) -> None:
        """Producer: record the policy, zero the head, register groups; forget the records
        of the keys ``forget`` (an earlier run's) in the same step."""

    def set_head(self, oldest: int, written: int) -> None:
        """Producer: the oldest frame retained and the frames written."""

    def along_publication(self, oldest: int, written: int,
                          retired: list[str]) -> list[tuple[Any, ...]] | None:
        """Producer: the metadata commands that share the head counters and forget the
        ``retired`` frames' records in the same step as the next publication, or ``None``
        where the state shares the head itself (:meth:`set_head`)."""

    def cursors(self) -> dict[str, int]:
        """Each consumer group's cursor."""

    #: the metadata hash of the groups' cursors, which a publication can read back in the
    #: same step (see :func:`cursors_of`); ``None`` where the state keeps them itself
    cursors_key: str | None

    def wait_progress(self, seconds: float) -> None:
        """Producer: wait (at most ``seconds``) for a group to move."""

    def head(self) -> tuple[int, int] | None:
        """``(oldest retained, frames written)``."""

    def policy(self) -> Policy | None:
        """The producer's retention policy."""

    def open_group(self, name: str, start: int) -> Any:
        """Reader: take the group; an object with ``value``, ``commit(i)``, ``close()``."""

    def set_archive(self, node: str, path: str) -> None:
        """Record the stream's archive file."""

    def archive(self) -> tuple[str, str] | None:
        """``(node, path)`` of the archive."""

    def run_id(self) -> str | None:
        """The id of the stream's current run (new with every producer's start); ``None``
        before a producer started; ``""`` where its producer recorded none (an earlier
        instride's)."""

    #: whether :meth:`run_mark` is cheap enough to look at for every frame (a mapped
    #: counter), or costs a round trip to the metadata (looked at now and then)
    run_mark_cheap: bool

    def run_mark(self, deadline: float | None = None) -> object:
        """A mark of the stream's current run that changes with every producer's start
        (``None`` before one started): what a plain reader compares to tell a re-run.
        ``deadline``: when to give up asking the metadata (``MetadataUnavailable``)."""

    def close(self) -> None:
        """Release what the state holds."""


class LocalStreamState:
    """A stream's head, policy, groups and archive location in files on this node (local mode).

    The producer and every reader of one node share them; the same methods as
    :class:`RedisStreamState`, which holds them in Redis for a cluster.

    Parameters
    ----------
    root
        The managed directory.
    stream
        The stream name.
    """

    cursors_key = None  # (the cursors are files of this node)

    def __init__(self, root: Path, stream: str) -> None:
        self.stream = stream
        self.dir = state_dir(root, stream)
        self._head: Head | None = None
        self._groups = Groups(self.dir)
        self._notify: Any = None

    # producer
    def start(self, policy: Policy, groups: tuple[str, ...], *, reset: bool,
              forget: Sequence[str] = ()) -> None:
        """Record the policy, zero the head, register ``groups`` (and reset cursors).
        ``forget``: nothing to do (a key's file is its record; the producer removed them)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if self._head is not None:  # (mapped read-only by a look at it first)
            self._head.close()
        self._head = Head(self.dir / "head", writable=True)
        # (first: a reader that takes a frame of this run sees the count up once it has it)
        self._head.runs += 1
        self._head.oldest = 0
        self._head.written = 0
        self._head.producer = os.getpid()
        policy.save(self.dir)
        # the run's id: new with every producer's start (an archive records the run it holds)
        tmp = self.dir / f".run.{os.getpid()}.tmp"
        tmp.write_text(uuid.uuid4().hex)
        os.rename(tmp, self.dir / "run")
        if reset:
            self._groups.reset(keep=groups)
            # (the earlier run's archive is not this run's: readers must not take its frames)
            with contextlib.suppress(FileNotFoundError):
                (self.dir / "archive.json").unlink()
        for name in groups:
            self._groups.register(name, 0)

    def set_head(self, oldest: int, written: int) -> None:
        """Publish the head counters (the oldest first: a reader that misses a frame sees why)."""
        assert self._head is not None
        self._head.oldest = oldest
        self._head.written = written

    def along_publication(self, oldest: int, written: int,
                          retired: list[str]) -> list[tuple[Any, ...]] | None:
        """``None``: the head is a file of this node, shared by :meth:`set_head`."""
        return None

    def cursors(self) -> dict[str, int]:
        """Each group's cursor."""
        return self._groups.cursors()

    def wait_progress(self, seconds: float) -> None:
        """Sleep until a group moves (or ``seconds`` pass)."""
        if self._notify is None:
            from inotify_simple import INotify
            from inotify_simple import flags as inflags

            self._groups.dir.mkdir(parents=True, exist_ok=True)
            self._notify = INotify()
            self._notify.add_watch(self._groups.dir, inflags.MODIFY | inflags.CREATE | inflags.MOVED_TO)
            return  # the caller re-checks after arming: a commit may have landed before
        self._notify.read(timeout=max(1, int(seconds * 1000)))

    # consumer
    def head(self) -> tuple[int, int] | None:
        """``(oldest retained, frames written)``; ``None`` if no producer recorded one."""
        if self._head is None:
            self._head = Head.open(self.dir / "head")
            if self._head is None:
                return None
        return self._head.oldest, self._head.written

    def policy(self) -> Policy | None:
        """The producer's policy."""
        return Policy.load(self.dir)

    def open_group(self, name: str, start: int) -> GroupCursor:
        """Take the group (exclusively) and return its cursor.

        Raises
        ------
        GroupBusy
            Another live reader holds the group.
        """
        return GroupCursor(self._groups, self.stream, check_group(name), start)

    def run_id(self) -> str | None:
        """The id of the stream's current run; ``None`` before a producer started, ``""``
        where its producer recorded none (an earlier instride's)."""
        try:
            return (self.dir / "run").read_text()
        except FileNotFoundError:
            return "" if (self.dir / "head").exists() else None

    run_mark_cheap = True

    def run_mark(self, deadline: float | None = None) -> int | None:
        """How many producers started the stream (its head's count, mapped: ~0.3 µs)."""
        if self.head() is None:
            return None
        assert self._head is not None
        return self._head.runs

    def set_archive(self, node: str, path: str) -> None:
        """Record the stream's archive file."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".archive.{os.getpid()}.tmp"
        tmp.write_text(json.dumps([node, path]))
        os.rename(tmp, self.dir / "archive.json")

    def archive(self) -> tuple[str, str] | None:
        """``(node, path)`` of the stream's archive, if it has one."""
        try:
            node, path = json.loads((self.dir / "archive.json").read_text())
        except (FileNotFoundError, ValueError):
            return None
        return str(node), str(path)

    def close(self) -> None:
        """Release descriptors, watches and the head's mapping (mapped again if asked for)."""
        if self._notify is not None:
            self._notify.close()
            self._notify = None
        self._groups.close()
        head, self._head = self._head, None
        if head is not None:
            head.close()


#: seconds a cluster group reader's lease lasts unless renewed (renewed every third of it)
LEASE_S = 10.0


def _lease_holder() -> str:
    """What a lease's token says of the process that holds it, after its ``@``: its PID
    space, PID and start time, so that a process of the same space can tell the holder gone
    (:meth:`RedisStreamState.release_gone`); empty where any of it cannot be read."""
    space, pid = _pid_space(), os.getpid()
    stat = _stat(pid)
    return f"{space}:{pid}:{stat[1]}" if space is not None and stat is not None else ""


def _holder_gone(token: str) -> bool:
    """Whether the process a lease's ``token`` names is known gone: of this PID space, and
    no such process (``kill(pid, 0)``: no process of that number), or the number now names a
    process that started at another time (reused), or its exited leader with no thread
    left (a zombie). ``False`` wherever it cannot be told: another machine or namespace, a
    token without its holder (an instride before it), a process this one may not look at
    (another user's under ``hidepid``)."""
    _, at, holder = token.partition("@")
    parts = holder.split(":")
    if not at or len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return False
    space, pid, start = parts[0], int(parts[1]), parts[2]
    if space != _pid_space():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # (EPERM: it exists, another user's)
        pass
    stat = _stat(pid)
    if stat is None:
        return False
    state, started = stat
    if started != start:
        return True
    if state in ("Z", "X"):  # (its leader exited: gone unless a thread of it still runs)
        try:
            return len(os.listdir(f"/proc/{pid}/task")) <= 1
        except OSError:
            return False
    return False


class RedisStreamState:
    """A stream's head, policy and consumer groups in Redis (cluster mode).

    A producer on the owner node retires a frame only when every group, whichever node it
    reads on, has taken it; readers on other nodes learn from the head that a frame they
    wanted was dropped. A group's reader holds a lease in Redis that it renews while it
    runs; a reader that dies loses it after ``lease_s`` seconds (then another reader may
    take the group and resume at its cursor).

    Parameters
    ----------
    metadata
        The engine's :class:`~instride.metadata.redis.RedisMetadata`: its ``redis`` client
        for what happens once per stream, its lean ``command``, ``hgetall``, ``set_later``
        (an ``HSET`` that does not wait for the reply) and ``eval_later`` (a script that
        does not) for what happens with every frame (head counters, group cursors).
    stream
        The stream name.
    lease_s
        Lifetime of a group reader's lease (default :data:`LEASE_S`).
    """

    def __init__(self, metadata: Any, stream: str, lease_s: float | None = None) -> None:
        self.metadata = metadata
        self.redis = metadata.redis
        self.stream = stream
        self.lease_s = LEASE_S if lease_s is None else lease_s
        self._head = f"instride:stream:{stream}:head"
        self._groups = self.cursors_key = f"instride:stream:{stream}:groups"
        #: each group's lease generation: counted up by every reader that takes the lease, and
        #: by a re-run (see RedisGroupCursor: a reader whose lease ran out takes it again only
        #: if nobody took it meanwhile)
        self._generations = f"instride:stream:{stream}:generations"

    # producer
    def start(self, policy: Policy, groups: tuple[str, ...], *, reset: bool,
              forget: Sequence[str] = ()) -> None:
        """Record the policy, zero the head, register ``groups`` (and reset cursors), and
        forget the records of ``forget`` (an earlier run's keys), in one transaction: a reader
        sees the earlier run with its records or the new run without them, never between."""
        # (head counters of an earlier run still owed an answer on this thread's connection
        # are sent again on its next one: settled first, so that they never land after this)
        self.metadata.flush()
        run = uuid.uuid4().hex

        def transaction() -> None:
            for tries in itertools.count(1):
                try:
                    return attempt()
                except redis.WatchError:  # (a group registered or moved meanwhile: again)
                    if tries >= _RESET_TRIES:
                        raise MetadataUnavailable(
                            self.metadata.url, f"start stream {self.stream}: its groups moved "
                            f"under each of {tries} tries to reset them") from None
                    time.sleep(min(0.001 * tries, 0.05))

        def attempt() -> None:
            with self.redis.pipeline(transaction=True) as pipe:  # (reset on the way out)
                steps(pipe)

        def steps(pipe: Any) -> None:
            if reset:
                # (watched: a group registered, or committed to, between this read and the
                # transaction — a reader of the earlier run — would keep its earlier position)
                pipe.watch(self._groups)
                cursors = cursors_of(pipe.hgetall(self._groups))
                pipe.multi()
            for key in forget:
                for command in self.metadata.forget_commands(key):
                    pipe.execute_command(*command)
            # "run": new with every producer's start (a re-run under the name: overwrite=True),
            # so that readers of other nodes can tell their copies of an earlier run's frames;
            # "node": where it produces (a node's originals of the stream are all of earlier
            # runs if not there)
            pipe.hset(self._head, mapping={"oldest": 0, "written": 0,
                                           "policy": json.dumps(asdict(policy)),
                                           "producer": os.getpid(), "run": run,
                                           "since": repr(time.time()),
                                           "node": self.metadata.settings.addr or ""})
            if reset:  # (a reader of the earlier run loses its lease: see RedisGroupCursor)
                pipe.hincrby(self._head, "resets", 1)
                pipe.hdel(self._head, "archive")  # (the earlier run's: not this run's frames)
                for name, value in cursors.items():
                    if _dropped_on_reset(name, value, groups):
                        pipe.hdel(self._groups, name)
                    else:
                        pipe.hset(self._groups, name, 0)
                    pipe.delete(self.lease_key(name))
                    pipe.hincrby(self._generations, name, 1)
            for name in groups:
                pipe.hsetnx(self._groups, name, 0)
            pipe.execute()

        self._r(f"start stream {self.stream}", transaction)

    def _r(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn`` (redis-py commands) as every metadata call runs: connection errors tried
        again within the connect timeout, then :class:`MetadataUnavailable` (exit status 6)."""
        return self.metadata._call(what, fn)

    def set_head(self, oldest: int, written: int) -> None:
        """Publish the head counters (without waiting for Redis's reply, where it can)."""
        self.metadata.set_later(self._head, {"oldest": oldest, "written": written})

    def along_publication(self, oldest: int, written: int,
                          retired: list[str]) -> list[tuple[Any, ...]] | None:
        """The head counters and the retired frames' records, as commands the publication of
        the next frame runs right after storing its record (one script, one round trip)."""
        return self.metadata.frame_steps(  # type: ignore[no-any-return]
            self.stream, self._head, self._groups, oldest, written, retired)

    def cursors(self) -> dict[str, int]:
        """Each group's cursor."""
        return cursors_of(self.metadata.hgetall(self._groups))

    def wait_progress(self, seconds: float) -> None:
        """Sleep a little before the caller polls the cursors again."""
        time.sleep(min(seconds, 0.005))

    def close(self) -> None:
        """Stop waiting on the stream's directory: this thread's kept subscription to its
        publications (if it waited for frames) ends."""
        self.metadata.unwatch(f"{self.stream}/")

    def set_archive(self, node: str, path: str) -> None:
        """Record the node and path of the stream's archive file."""
        self._r("record the archive", lambda: self.redis.hset(self._head, "archive",
                                                              json.dumps([node, path])))

    def archive(self) -> tuple[str, str] | None:
        """``(node, path)`` of the stream's archive, if it has one."""
        raw = self._r("look up the archive", lambda: self.redis.hget(self._head, "archive"))
        if raw is None:
            return None
        node, path = json.loads(raw)
        return str(node), str(path)

    # consumer
    def head(self) -> tuple[int, int] | None:
        """``(oldest retained, frames written)``; ``None`` if no producer recorded one."""
        oldest, written = self.metadata.command("HMGET", self._head, "oldest", "written")
        if oldest is None or written is None:
            return None
        return int(oldest), int(written)

    def policy(self) -> Policy | None:
        """The producer's policy."""
        raw = self._r("look up the policy", lambda: self.redis.hget(self._head, "policy"))
        return None if raw is None else Policy(**json.loads(raw))

    def run(self, deadline: float | None = None) -> tuple[str, float, str | None] | str | None:
        """The current run of the stream (made new by each producer's start), when it
        started (``time.time()``) and the address of the node that produces it (``None``:
        not recorded, by an earlier instride); ``None`` before a producer started; ``""``
        for a stream whose producer recorded no run (an earlier instride's). ``deadline``:
        when to give up reaching Redis (default: the connect timeout from now)."""
        written, run, since, node = self.metadata.command(
            "HMGET", self._head, "written", "run", "since", "node", deadline=deadline)
        if written is None:
            return None
        if run is None or since is None:
            return ""
        return (_text(run), float(since), _text(node) if node else None)  # ("": not known)

    def run_id(self) -> str | None:
        """The id of the stream's current run (see :meth:`run`)."""
        run = self.run()
        return run[0] if isinstance(run, tuple) else run

    run_mark_cheap = False

    def run_mark(self, deadline: float | None = None) -> str | None:
        """The stream's current run id (a round trip to Redis)."""
        run = self.run(deadline)
        return run[0] if isinstance(run, tuple) else run

    def resets(self) -> int:
        """How many times the stream's groups were reset (by re-runs, ``overwrite=True``)."""
        return int(self._r("count the resets", lambda: self.redis.hget(self._head, "resets"))
                   or 0)

    def lease_key(self, group: str) -> str:
        """The Redis key of ``group``'s lease."""
        return f"instride:stream:{self.stream}:group:{group}:lease"

    def release_gone(self, group: str) -> bool:
        """Free ``group``'s lease where the process holding it is gone — a process of this
        machine's kernel and PID namespace that exited, or whose PID another process took
        since — instead of waiting until the lease runs out (:data:`LEASE_S`): that process
        renews it no more. Whether it was freed (``False``: held by a live process, or by
        one this process cannot look at — of another machine or namespace, or a reader of an
        instride before this check — or free already)."""
        key = self.lease_key(check_group(group))
        token = self._r("look up a lease", lambda: self.redis.get(key))
        if token is None or not _holder_gone(_text(token)):
            return False
        release = self.redis.register_script(_RELEASE)
        return bool(self._r("free a lease", lambda: release(keys=[key, self._generations],
                                                           args=[token, group])))

    def open_group(self, name: str, start: int) -> RedisGroupCursor:
        """Take the group's lease and return its cursor. A lease whose holder is a process of
        this machine that is gone is freed and taken (:meth:`release_gone`): a reader
        restarted after a crash resumes at once, not once the lease has run out.

        Raises
        ------
        GroupBusy
            Another reader holds the group: a live one, or one of another machine (or of an
            instride before this check) whose lease has not run out yet.
        """
        try:
            return RedisGroupCursor(self, check_group(name), start)
        except GroupBusy:
            if not self.release_gone(name):
                raise
        return RedisGroupCursor(self, name, start)


#: renew a lease only if it is still this reader's (its token): never one another reader took
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

#: take a group's lease (KEYS: the lease, the generations; ARGV: the token, its lifetime in ms,
#: the group): the lease's new generation, or 0 where another reader holds it. One already this
#: token's (a script sent again after its answer was lost) answers its generation.
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return tonumber(redis.call('HGET', KEYS[2], ARGV[3]) or 0)
end
return 0
"""

#: take a lease that ran out back (KEYS and ARGV as :data:`_ACQUIRE`'s, then the generation
#: it had): only while nobody holds it and nobody took it since (the generation is unchanged:
#: no other reader, no re-run), so that the group's frames are still this reader's to take
_RETAKE = """
if redis.call('EXISTS', KEYS[1]) == 0
    and tonumber(redis.call('HGET', KEYS[2], ARGV[3]) or -1) == tonumber(ARGV[4]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

#: release a lease only if it is still this reader's (its token): one that ran out meanwhile
#: and that another reader took stays that reader's (one step: no other command in between).
#: KEYS: the lease, the generations; ARGV: the token, the group. The generation is counted up:
#: a renewal of the reader's under way as it closed must not take the lease back (:data:`_RETAKE`)
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
  return redis.call('DEL', KEYS[1])
end
return 0
"""

#: seconds a group reader's commit waits at most for the answer to the one before (see
#: RedisGroupCursor.commit): a Redis paused that long slows its readers down, not more
_ANSWER_WAIT = 0.1

#: write a group's cursor only while the group's lease is still this reader's (its token): a
#: commit sent again on a new connection after the lease moved to another reader (which may
#: have committed further since) writes nothing. KEYS: the lease, the groups' cursors; ARGV:
#: the token, the group, the cursor. Not "never backwards": a reader's seek may set it back.
_COMMIT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
end
return -1
"""

#: :data:`_COMMIT` and :data:`_RELEASE` in one step (KEYS and ARGV as :data:`_COMMIT`'s, then the
#: generations: counted up as by :data:`_RELEASE`): the
#: release of a cursor that committed, perhaps on another thread than the one closing it (see
#: ``RedisGroupCursor.close``); a commit still on its way lands before this (overwritten) or
#: after it (refused: the lease is gone)
_COMMIT_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
  redis.call('HINCRBY', KEYS[3], ARGV[2], 1)
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class RedisGroupCursor:
    """A reader's lease on its group in Redis, renewed in the background.

    The lease is renewed only while it is still this reader's (a token compared in Redis), so
    a reader stopped or paused for longer than the lease — whose group another reader then
    took over — finds it lost: :meth:`check` (before every frame) and :meth:`commit` raise
    :class:`~instride.errors.GroupLeaseLost` instead of taking frames as the group, and the
    new reader's lease is never extended by the old one. Its commits are fenced the same way:
    Redis writes the cursor only while the lease holds this reader's token, so a commit that
    arrives late (sent again after its connection failed) never overwrites the new reader's.
    A lease that ran out while nobody took the group (the reader paused, no other waiting for
    the group) is taken back at the next renewal or check: each taking of a lease counts the
    group's generation up, and the lease is taken back only while the generation is still
    the reader's (a reader that took the group and let it go meanwhile, or a re-run, counted
    it up). A re-run of the stream (``overwrite=True``) deletes every group's lease with the
    reset of the cursors: the reader of the earlier run finds its lease gone when Redis's
    answer to its next commit says it refused it (see :meth:`check`), or at its next renewal,
    and raises :class:`~instride.errors.GroupReset` (told apart by the stream's count of
    resets).
    """

    def __init__(self, state: RedisStreamState, name: str, start: int) -> None:
        self.state, self.name = state, name
        self._lock = state.lease_key(name)
        self._resets = state.resets()  # (a lease lost to a re-run of the stream: GroupReset)
        # (after its "@", the process holding it: see RedisStreamState.release_gone)
        self._token = f"{os.getpid()}-{uuid.uuid4().hex}@{_lease_holder()}"
        r = state.redis
        self._retake = r.register_script(_RETAKE)
        acquire = r.register_script(_ACQUIRE)  # (sent again, it answers the lease taken)
        self._generation = int(state._r(f"take group {name}'s lease", lambda: acquire(
            keys=[self._lock, state._generations],
            args=[self._token, int(state.lease_s * 1000), name])))
        if not self._generation:
            raise GroupBusy(state.stream, name)
        self._renewed = time.monotonic()  # (the lease is good until lease_s after this)
        self._lost = False
        self._script = r.register_script(_RENEW)
        self._release = r.register_script(_RELEASE)
        self._commit_release = r.register_script(_COMMIT_RELEASE)
        #: whether a commit was sent (on its thread's own connection, its answer read there;
        #: see :meth:`close`)
        self._committed = False
        #: commits sent whose answers were not read yet; whether one read was a refusal
        self._owed, self._refused = 0, False

        def cursor() -> int:
            r.hsetnx(state._groups, name, start)
            return int(r.hget(state._groups, name))

        try:
            self.value = state._r(f"read group {name}'s cursor", cursor)
        except BaseException:  # (the lease taken, nobody to renew or release it: let go of)
            with contextlib.suppress(Exception):
                self._release(keys=[self._lock, state._generations], args=[self._token, name])
            raise
        self._stop = threading.Event()
        self._forks = forks()  # (of the process that took the lease: see close)
        self._renewer = threading.Thread(target=self._renew, daemon=True, name=f"instride-lease-{name}")
        self._renewer.start()

    def _renew(self) -> None:
        every = self.state.lease_s / 3
        while not self._stop.wait(every):
            with contextlib.suppress(Exception):
                self._extend()

    def _extend(self) -> bool:
        """Extend the lease if it is still ours, or take it back if it ran out and nobody
        took it since; whether it is ours (else it is lost for good)."""
        started = time.monotonic()
        if self._lost or self._stop.is_set():  # (closed: never taken back after its release)
            return False
        ms = int(self.state.lease_s * 1000)
        if self._script(keys=[self._lock], args=[self._token, ms]) or self._retake(
                keys=[self._lock, self.state._generations],
                args=[self._token, ms, self.name, self._generation]):
            self._renewed = max(self._renewed, started)
            return True
        self._lost = True
        return False

    def check(self) -> None:
        """Before the reader takes another frame as the group: the lease is still its own.

        Free while the background renewals keep up and no commit was refused; after a pause
        of more than two renewal periods (the process was stopped, the machine paused), or
        once the answer to a commit says Redis refused it (the lease is not the reader's: a
        re-run of the stream deleted it, or another reader took it), one round trip to Redis
        says. The answers to the commits sent are taken in here, without waiting (a look at
        the connection, until each is in; :meth:`commit` waits up to :data:`_ANSWER_WAIT` s
        for the one before it): a reader of a re-run stream learns of it from its first commit
        after the re-run, having taken the new run's frames only while that answer was on
        its way (none or one usually, twice ``commit_every`` at most) — not from its next
        renewal, up to a third of the lease later. A commit it refused because the lease ran
        out, with nobody taking it meanwhile, is sent again once the lease is taken back.

        Raises
        ------
        GroupLeaseLost
            The lease expired and is (or was) another reader's.
        """
        if self._owed:
            with contextlib.suppress(Exception):  # (a connection that failed: the next call's)
                self.state.metadata.take_deferred()
        refused = self._refused
        if not refused and not self._lost \
                and time.monotonic() - self._renewed < self.state.lease_s * 2 / 3:
            return
        try:
            ours = self._extend()
        except Exception:  # (Redis unreachable: the lease may still be ours; the commit says)
            return
        self._refused = False
        if ours and refused:  # (a lease that ran out and that nobody took: taken back, and
            with contextlib.suppress(Exception):  # the commit it refused sent again; else
                self._send(self.value)  # the next one writes a later position)
            return
        if not ours:
            rerun = False
            with contextlib.suppress(Exception):  # (the run's look is only for the message)
                rerun = self.state.resets() != self._resets
            if rerun:
                raise GroupReset(self.state.stream, self.name)
            raise GroupLeaseLost(self.state.stream, self.name, self.state.lease_s)

    def commit(self, value: int) -> None:
        """Record that the group is done with every frame before ``value``.

        Sent without waiting for the reply (read before each frame, and before the next
        commit, which waits up to :data:`_ANSWER_WAIT` s for it), and written by Redis only
        while the lease is still this reader's (see :data:`_COMMIT`).

        Raises
        ------
        GroupLeaseLost
            The lease is another reader's now (:class:`~instride.errors.GroupReset`: the
            stream was re-run): nothing is recorded.
        MetadataUnavailable
            Redis could not be reached to send it.
        """
        self.check()
        if value != self.value:
            if self._owed:
                # One commit's answer on its way at most: the one before is read first (there
                # long since, but for a Redis slower than the reader's frames; waited for
                # _ANSWER_WAIT s at most), so that a reader of a re-run stream learns of it
                # from its first commit after the re-run, or the one after.
                if self.state.metadata.take_deferred(_ANSWER_WAIT):
                    self._owed = 0  # (none owed on this thread's connection)
                self.check()
            # (the value first: a close() on another thread meanwhile writes this one)
            before, self.value = self.value, value
            try:
                self._send(value)
            except BaseException:
                self.value = before
                raise

    def _send(self, value: int) -> None:
        """Send the commit of ``value``, its answer read later (:meth:`_answered`)."""
        self._committed = True
        self._owed += 1
        try:
            self.state.metadata.eval_later(_COMMIT, [self._lock, self.state._groups],
                                           [self._token, self.name, value],
                                           on_reply=self._answered)
        except BaseException:
            self._owed -= 1
            raise

    def _answered(self, reply: Any) -> None:
        """A commit's answer, read: ``-1``, refused (see :data:`_COMMIT`)."""
        self._owed = max(0, self._owed - 1)
        if reply == -1:
            self._refused = True

    def close(self) -> None:
        """Release the lease (the cursor stays), if it is still this reader's (compared and
        deleted in one step: see :data:`_RELEASE`).

        The last commit is answered first (this thread's deferred commands): a commit that
        arrived after the lease went would be refused. Once anything was committed, the last
        value is written again with the release, in one step: a cursor closed on another
        thread than the one that committed (a reader iterating on a worker thread, closed
        from the main thread) cannot read that thread's answers, and its last commit may
        still be on its way (which thread did is not told by its id: Linux gives an ended
        thread's id to the next). Where Redis cannot be reached within the connect timeout,
        the lease is kept until it runs out instead, so that the commit, sent again on this
        thread's next connection meanwhile, may still be written.

        In a child made by ``fork`` (which inherits the cursor, its token with it) nothing is
        released: the lease is the parent's, which renews it and reads on.
        """
        if self._forks != forks():
            self._stop.set()
            return
        if not self._stop.is_set():
            self._stop.set()
            try:
                self.state.metadata.flush()
            except MetadataUnavailable as exc:
                if getattr(exc, "refused", None) is None:
                    return  # (out of reach: whether the lease went cannot be known)
                # (else an error answer to a deferred command: answered, in step)
            except Exception:  # (likewise: AuthenticationError, an older client's errors)
                pass
            with contextlib.suppress(Exception):
                if self._committed:
                    # A commit may have gone from another thread, on that thread's own
                    # connection: its answer is not this thread's to read, and it may still
                    # be on its way (or wait there to be sent again). The last value is
                    # written again, with the release in the same step.
                    self._commit_release(keys=[self._lock, self.state._groups,
                                               self.state._generations],
                                         args=[self._token, self.name, self.value])
                else:
                    self._release(keys=[self._lock, self.state._generations],
                                  args=[self._token, self.name])
