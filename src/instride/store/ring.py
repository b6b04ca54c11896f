"""Recycled frame files: the producer's slot pool and the readers' leases (one node).

A stream with retention keeps its frames as ordinary published files, but their storage is
recycled: a retired frame's file is first *unpublished* (renamed from its key into the
stream's hidden pool, so the key is gone in one step), and only later rewritten as a new
frame, once no reader holds it. The pages of the file stay allocated, so a steady-state
stream takes no page faults per frame, and the producer writes each frame straight into a
memory map it keeps (no intermediate buffer, no ``write`` copy).

Holding a frame is a shared ``flock`` on the file, taken by the reader right after it opens
the key and checked against the key (the file must still be the one published under it);
the producer rewrites a pooled file only when it can take the exclusive lock. A view handed
to a reader is therefore never changed under it while the reader holds the frame, and a
reader that dies releases its hold with its file descriptors, so nothing waits for a
timeout. A frame opened by its key (``instride.open``, ``consume_bytes``; the preload
library's ``open`` of its path) is held the same way (the ``hold`` of
:meth:`~instride.paths.ConfinedOpener.open`). Programs that read frames without instride
(plain ``open``, no preload library) take no lease: they are safe for as long as the frame
is retained, and the pool reuses a retired file last (first in, first out), but a file held
longer than that can be rewritten under them.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import resource
import secrets
import stat
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np

from ..errors import ConfigError, FileTypeError, InstrideError, UnsafePathError
from ..frames import HEADER_SIZE, NativeFrame
from ..native import library
from ..perthread import forks
from .dirs import NO_ROOM, allocate
from .gc import lock_held, pid_alive
from .publish import publish_file
from .spare import SpareMaker

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
#: isl_lease's results (csrc/local/take.c)
_LEASE_HELD, _LEASE_ABSENT, _LEASE_RETIRED = 0, 1, 2
#: isl_take's results (csrc/local/take.c)
TAKE_HELD, TAKE_OTHER, TAKE_TIMEOUT, TAKE_INTERRUPTED, TAKE_REARM, TAKE_COPIED = range(6)
_GONE_CAP = 16
_T = TypeVar("_T")


def _more_open_files() -> bool:
    """Raise this process's soft limit of open files (doubled, at most to the hard limit), as
    Go's runtime does at start; whether it grew."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(2 * soft, 1024)
    if hard != resource.RLIM_INFINITY:
        want = min(hard, want)
    if want <= soft:
        return False
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        return False
    return True


#: every reader's holds in this process (see Leases._forget_holds)
_LEASES: weakref.WeakSet[Leases] = weakref.WeakSet()
#: holds being taken by the portable path (Leases.open: opened, not recorded yet), and the
#: condition a fork waits on for them (see _no_open_under_way)
_opening = 0
_opened = threading.Condition()
#: forks waiting for them (or about to fork): new opens wait until they are done (a fork
#: first, as the native side's writer-first lock: threads opening frames one after the other
#: would starve it); a count, for two threads that fork at once
_forking = 0
#: seconds a fork waits at most for them (an open of a file system that hangs: NFS), and an
#: open for a fork
_FORK_WAIT = 5.0


def _no_open_under_way() -> None:
    """Before a fork: wait until no thread is between the portable path's open of a frame and
    the record of its hold (the native take's span is guarded in C: take.c's fork_guard). A
    child forked in between kept a descriptor no record named, and with it the lock. Opens
    that begin meanwhile wait until the fork is done (:func:`_opens_again`)."""
    global _forking
    with _opened:
        _forking += 1
        _opened.wait_for(lambda: not _opening, _FORK_WAIT)


def _opens_again() -> None:
    """After a fork, in the parent: the opens held off go on."""
    global _forking
    with _opened:
        _forking = max(0, _forking - 1)
        _opened.notify_all()


def _forget_inherited_holds() -> None:
    global _opening, _opened, _forking
    # (the child's only thread opens nothing)
    _opening, _opened, _forking = 0, threading.Condition(), 0
    for leases in list(_LEASES):
        leases._forget_holds()


os.register_at_fork(before=_no_open_under_way, after_in_parent=_opens_again,
                    after_in_child=_forget_inherited_holds)


def _close_if(fd: int, dev: int, ino: int) -> None:
    """Close ``fd`` if it is still a descriptor of file ``(dev, ino)`` (a forked child: the
    parent may have closed the number just before the fork, and another file taken it)."""
    try:
        st = os.fstat(fd)
    except OSError:
        return
    if st.st_dev == dev and st.st_ino == ino:
        with contextlib.suppress(OSError):
            os.close(fd)


def _with_more_files(make: Callable[[], _T], kept: int) -> _T:
    """``make()`` (which opens descriptors), again after raising the soft limit of open files
    (:func:`_more_open_files`) each time it ran out; a reader's :class:`ConfigError` once the
    limit can grow no more."""
    while True:
        try:
            return make()
        except OSError as exc:
            if exc.errno != errno.EMFILE or isinstance(exc, InstrideError):
                raise
            if not _more_open_files():
                soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                raise ConfigError(
                    "RLIMIT_NOFILE", soft,
                    f"a stream's reader keeps a mapping (an open file) per frame file it has "
                    f"seen, up to the producer's retain= and a few more ({kept} now); the "
                    f"process may open no more (hard limit {hard}: raise it with `ulimit -Hn`, "
                    "or keep fewer frames: retain=)") from None


def _files_exhausted(slots: int) -> ConfigError:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return ConfigError("RLIMIT_NOFILE", soft,
                       f"a stream's producer holds 2 open files per frame it keeps ({slots} now);"
                       f" the process may open no more (hard limit {hard}: raise it with"
                       " `ulimit -Hn`, or keep fewer frames: retain=)")


@dataclass
class Slot:
    """One frame file owned by the producer: its descriptor, mapping and current name.

    A pool that does not recycle writes its new files with ``write`` and maps none of them
    (``mm`` is ``None``, unless the slow path mapped it: see :meth:`SlotPool.mapping`); the
    frame's header is then kept in ``head`` once written.
    """

    fd: int
    ino: int
    size: int
    mm: mmap.mmap | None
    pool_name: str
    path: str  # where the file is now: in the pool, or at its key once published
    pooled: bool = True  # in the pool (not published under a key)
    addr: int = 0  # where ``mm`` is mapped (for the native encode)
    pooled_b: bytes = b""  # its path in the pool, encoded (for the native encode)
    #: a helper may be prefaulting the mapping: call before unmapping (see SpareMaker.ask)
    settle: Callable[[], None] | None = None
    #: the frame's header as written, where the file is not mapped (``isl_append_fd``)
    head: bytes | None = None

    def unmap(self) -> None:
        """Unmap, once no helper prefaults the mapping any more."""
        settle, self.settle = self.settle, None
        if settle is not None:
            settle()
        if self.mm is not None:
            with contextlib.suppress(BufferError, ValueError):
                self.mm.close()

    def close(self) -> None:
        """Unmap and close (the file itself stays where it is)."""
        self.unmap()
        with contextlib.suppress(OSError):
            os.close(self.fd)


#: madvise(MADV_POPULATE_WRITE) (Linux 5.14; not among Python 3.11's mmap constants)
MADV_POPULATE_WRITE = 23
_prefaults: list[bool] = []


def prefault_works() -> bool:
    """Whether this kernel fills a mapping's page tables on request (MADV_POPULATE_WRITE):
    only then is a new frame file mapped without them, for a helper to fill."""
    if not _prefaults:
        probe = mmap.mmap(-1, mmap.PAGESIZE)
        try:
            probe.madvise(MADV_POPULATE_WRITE)
            _prefaults.append(True)
        except (OSError, ValueError):
            _prefaults.append(False)
        finally:
            probe.close()
    return _prefaults[0]


def stamp(fd: int) -> None:
    """Stamp a frame's file with its publication time, to the nanosecond (its modification
    time; the kernel's own stamps are a clock tick coarse), as ``isl_append`` does: a node's
    data server reports it to the stream's readers on other nodes, which learn the producer's
    cadence from it (``Stream(spin="auto")``). Best effort."""
    now = time.time_ns()
    with contextlib.suppress(OSError):
        os.utime(fd, ns=(now, now))


def _no_library(*_args: object) -> int:
    raise RuntimeError("libinstride_local.so is not loaded")  # (never: see native_frame)


class SlotPool:
    """The producer's frame files for one stream: taken, published, retired, reused.

    Parameters
    ----------
    pool_dir
        The stream's hidden pool directory (on the managed directory's file system, so a
        pooled file can be renamed to its key).
    recycle
        Reuse retired files (streams with retention); otherwise every frame gets a new file
        and retired files are deleted. A new file that was not made ahead (see
        :meth:`prepare`: a producer flat out leaves the helper no idle time) is then written
        with ``write``, not mapped (where the native library is loaded): on a VM, mapping a
        new file, faulting in its pages and unmapping it cost about twice what writing it
        does. A recycling pool allocates a new file's pages before mapping it. Either way a
        full file system is an ``OSError`` (``ENOSPC``, ``EDQUOT``), not a ``SIGBUS`` on a
        store into a mapping (on file systems that write in place: tmpfs, ext4, xfs; a
        copy-on-write one, btrfs or ZFS, can still run out of room under a mapping).
    """

    def __init__(self, pool_dir: Path, *, recycle: bool) -> None:
        self.pool_dir = pool_dir
        self._pool_s = str(pool_dir)
        self.recycle = recycle
        pool_dir.mkdir(parents=True, exist_ok=True)
        collect_pool(pool_dir)  # files of an earlier producer of this stream that died
        # this producer's name in its files, and the file whose lock says it runs
        self._owner = f"{os.getpid()}.{secrets.token_hex(4)}"
        self._alive = _hold_alive(pool_dir, self._owner)
        _LIVE_POOLS.add(self)  # (a forked child lets go of the lock: see _forget_alive)
        self._slots: dict[int, Slot] = {}  # ino -> slot, every file this producer owns
        self._free: deque[int] = deque()  # retired, in the order they were retired
        self._spare = SpareMaker()  # the next files, made ahead while the CPU is idle
        self._mapped: Slot | None = None  # one of them, mapped, for the next take()
        self._next: Slot | None = None  # a retired file locked ahead for the next take()
        self._published: list[Slot] = []  # published, not recycled: closed by prepare()
        self._made = 0
        #: frames taken, and how many had been when the file being made ahead was asked for
        self._takes = self._asked_at = 0
        self._forks = forks()  # (of the producer: a forked child owns none of these files)
        lib = library()
        #: the native encode (a NativeFrame is only made where the library is loaded)
        self._append: Callable[..., int] = lib.isl_append if lib is not None else _no_library
        #: the native encode into a file that is not mapped (a pool that does not recycle)
        self._append_fd: Callable[..., int] | None = \
            getattr(lib, "isl_append_fd", None) if lib is not None and not recycle else None
        self._head = (ctypes.c_char * HEADER_SIZE)()  # (what it writes as the header)

    # ------------------------------------------------------------------ writing
    def take(self, size: int) -> Slot:
        """A file of ``size`` bytes, mapped writable (or, a new file of a pool that does not
        recycle, not mapped: see the class), that no reader holds (exclusive lock).

        Reuses the retired file :meth:`prepare` locked, else the longest-retired file nobody
        holds, else the file :meth:`prepare` made and mapped; makes a new file when there is
        none (it never waits for one being made).
        """
        slot, self._next = self._next, None
        if slot is None:
            slot = self._lock_free()
        if slot is not None and slot.size > size:
            # (never shrunk: a reader that kept the arrays of a frame it released from this
            # file still maps its length, and a page past the new end would kill it, SIGBUS;
            # a file whose frames shrank goes, its mappings stay whole, and one is made)
            self.discard(slot)
            slot = None
        if slot is not None:
            if slot.size != size:
                try:
                    with self._out_of_room():
                        self._resize(slot, size)
                except OSError:  # (not grown: the file goes, its room back)
                    self.discard(slot)
                    raise
            return slot
        mapped, self._mapped = self._mapped, None
        if mapped is not None:
            if mapped.size == size:
                return mapped
            self.discard(mapped)
        takes, self._takes = self._takes, self._takes + 1
        if self._append_fd is not None and takes > self._asked_at:
            # Written, not mapped: a file made since serves — one a prepare() since it was
            # asked for found not made yet (a producer flat out). Not the file asked for
            # right after the last frame: prepare() maps that one once it is made, for the
            # frame after this one, and has it prefaulted; taken here, every next file would
            # be too, and never one mapped (a paced producer's JAC frames then all went
            # through write: encode and publication 313 µs median, against 187 µs mapped and
            # prefaulted, frames 20 ms apart between emulated nodes).
            self._made += 1
            path = f"{self._pool_s}/slot-{self._owner}-{self._made}"
            fd = self._spare.take(size, path)
            if fd is not None:
                return self._adopt(path, fd, size, map_=False)
        with self._out_of_room():
            return self._new(size)

    def _lock_free(self) -> Slot | None:
        """The longest-retired file no reader holds, locked exclusively; ``None``: none."""
        for _ in range(len(self._free)):
            ino = self._free.popleft()
            slot = self._slots[ino]
            try:
                fcntl.flock(slot.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a reader still holds it: try it again later
                self._free.append(ino)
                continue
            return slot
        return None

    def prepare(self, size: int) -> None:
        """Have the next frame's file ready: a retired file locked (a pool that recycles), or
        a new file made, its pages allocated (a pool that does not: every frame is a new file).

        A producer calls it after publishing a frame, so that allocating the next file's pages
        (about as long as writing the frame) happens between frames instead of between the
        start of the next ``append`` and its publication — in a helper thread that runs only
        when the CPU is otherwise idle (:mod:`~instride.store.spare`), so not while the
        frame's consumers need it. The file asked for after one frame is mapped after the
        next (if it is made by then: else later), for the one after: :meth:`take` never waits
        for it.
        """
        self.release_published()
        if self.recycle:
            # a retired file locked now, between frames, for the next take (a pooled file no
            # key names: no reader can reach it meanwhile)
            if self._next is None:
                self._next = self._lock_free()
            return
        unfilled = None
        if self._mapped is None:  # the file made since: mapped now, not in the next append
            self._made += 1
            path = f"{self._pool_s}/slot-{self._owner}-{self._made}"
            fd = self._spare.take(size, path)
            if fd is not None:
                # Made while the CPU was idle: its mapping's page tables (~70 µs for a JAC
                # frame, now, while the frame just published is sent and read) are filled
                # by the next helper first, also while the CPU is idle
                ahead = prefault_works() and self._spare.prefault_safe
                self._mapped = self._adopt(path, fd, size, populate=not ahead)
                unfilled = self._mapped if ahead else None
        if not self._spare.pending:
            self._asked_at = self._takes
            settle = self._spare.ask(self._pool_s, size, None if unfilled is None
                                     else (unfilled.addr, unfilled.size))
            if unfilled is not None:
                unfilled.settle = settle
        if unfilled is not None and unfilled.settle is None:  # (no helper: filled now)
            with contextlib.suppress(OSError, ValueError):
                unfilled.mm.madvise(MADV_POPULATE_WRITE)

    def _new(self, size: int) -> Slot:
        for _ in range(2):
            self._made += 1
            path = f"{self._pool_s}/slot-{self._owner}-{self._made}"
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                return self._adopt(path, fd, size, made=False, map_=self._append_fd is None)
            except OSError as exc:
                # Each frame kept holds two descriptors (its file, and the mapping's own
                # copy): a ring of hundreds of frames can reach a soft limit of 1024.
                if exc.errno != errno.EMFILE or not _more_open_files():
                    if exc.errno == errno.EMFILE:
                        raise _files_exhausted(len(self._slots)) from None
                    raise
        raise _files_exhausted(len(self._slots))

    def _adopt(self, path: str, fd: int, size: int, *, made: bool = True,
               populate: bool = True, map_: bool = True) -> Slot:
        """Take the new file ``path`` (open as ``fd``) as a slot of ``size`` bytes; ``made``:
        its pages were allocated ahead (:mod:`~instride.store.spare`), mapped at once (their
        page tables filled now, unless not ``populate``); else allocated now, before it is
        mapped; not ``map_``: neither (it is written with ``write``: ``isl_append_fd``)."""
        try:
            if not made and map_:
                allocate(fd, size, path)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED
                           | (_POPULATE if made and populate else 0)) if map_ else None
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        slot = Slot(fd, os.fstat(fd).st_ino, size, mm, os.path.basename(path), path,
                    addr=0 if mm is None else _address(mm), pooled_b=os.fsencode(path))
        self._slots[slot.ino] = slot
        return slot

    def mapping(self, slot: Slot) -> mmap.mmap:
        """``slot``'s mapping, made now (its file allocated first) where it has none: for the
        encode of the slow path (no native library, or positions it does not take)."""
        if slot.mm is None:
            with self._out_of_room():
                allocate(slot.fd, slot.size, slot.path)
            slot.mm = mmap.mmap(slot.fd, slot.size)
            slot.addr = _address(slot.mm)
        return slot.mm

    @staticmethod
    def _resize(slot: Slot, size: int) -> None:
        slot.unmap()
        os.ftruncate(slot.fd, size)
        if size > slot.size:  # (the pages it grew by: allocated, as a new file's are)
            allocate(slot.fd, size, slot.path)
        slot.mm = mmap.mmap(slot.fd, size)
        slot.size = size
        slot.addr = _address(slot.mm)

    def publish(self, slot: Slot, final: str, key: str, *, overwrite: bool, fsync: bool) -> None:
        """Give the written ``slot`` its key (atomically) and let readers hold it.

        The exclusive lock is dropped *before* the rename: a reader woken by the rename must
        find the frame lockable (else it takes it for a frame being replaced and backs off).
        Nobody can reach the pooled file meanwhile: readers open keys only, and one that
        opened this file under its previous key finds, once locked, that the key no longer
        names it.
        """
        if fsync:
            try:
                if slot.mm is not None:
                    slot.mm.flush()
                else:
                    os.fsync(slot.fd)
            except BaseException:  # (EIO, ENOSPC: its file goes, as a failed write's; it
                self.discard(slot)  # stayed taken and locked, with its descriptors, for good)
                raise
        stamp(slot.fd)
        fcntl.flock(slot.fd, fcntl.LOCK_UN)
        self._publish(slot, final, key, overwrite=overwrite)

    def write_and_publish(self, slot: Slot, frame: NativeFrame, final: bytes, *,
                          overwrite: bool, fsync: bool) -> bool:
        """Encode ``frame`` into the pooled ``slot`` and publish it as :meth:`publish` does,
        in one native call (``isl_append``: no interpreter between the bytes and the rename).

        A slot that is not mapped is written with ``write`` (``isl_append_fd``); its header
        is kept in ``slot.head``.

        Returns
        -------
        bool
            Whether it is published. ``False``: encoded, not published (the rename failed, or
            the flush): the caller publishes it with :meth:`publish`, which names the error.

        Raises
        ------
        OSError
            A slot that is not mapped could not be written, or a slot could not be flushed
            (``fsync``: ``ENOSPC``, ``EIO``): its file is deleted, nothing is published (a
            flush tried again would report success: Linux reports a write-back error once).
        """
        noreplace, sync = 0 if overwrite else 1, 1 if fsync else 0
        by_fd = slot.mm is None and self._append_fd is not None
        if not by_fd:
            rc = self._append(slot.addr, *frame.args, slot.fd, slot.pooled_b, final, noreplace,
                              sync)
        else:
            rc = self._append_fd(self._head, *frame.args, slot.fd, slot.pooled_b, final,
                                 noreplace, sync)
        if rc > 0:  # (not written or not flushed: a file that must not be published)
            self.discard(slot)
            if rc in NO_ROOM:
                self.drop_made()  # (see _out_of_room)
            raise OSError(rc, f"{os.strerror(rc)} (the frame was not published)",
                          os.fsdecode(final))
        if by_fd:
            slot.head = self._head.raw
        return self._published_if(rc == 0, slot, final)

    def _published_if(self, published: bool, slot: Slot, final: bytes) -> bool:
        if published:
            self._published_as(slot, os.fsdecode(final))
        return published

    def _publish(self, slot: Slot, final: str, key: str, *, overwrite: bool) -> None:
        try:
            publish_file(slot.path, final, key, overwrite=overwrite)
        except BaseException:
            self.discard(slot)
            raise
        self._published_as(slot, final)

    def _published_as(self, slot: Slot, final: str) -> None:
        slot.path = final
        slot.pooled = False
        if not self.recycle:  # never rewritten nor retired by us: let go of it soon (an
            self._slots.pop(slot.ino, None)  # unbounded stream would otherwise hold a
            self._published.append(slot)  # descriptor and a mapping per frame, until EMFILE)

    @contextlib.contextmanager
    def _out_of_room(self) -> Iterator[None]:
        """Give up the files made ahead when the block finds the file system out of room: a
        file being made ahead would take the room freed next (see :meth:`drop_made`)."""
        try:
            yield
        except OSError as exc:
            if exc.errno in NO_ROOM:
                self.drop_made()
            raise

    def drop_made(self) -> None:
        """Give up the files made ahead — the one mapped for the next frame, the one a helper
        is making — so that the room they hold goes back to the file system (a producer whose
        disk is full, or that writes its end marker last)."""
        mapped, self._mapped = self._mapped, None
        if mapped is not None:
            self.discard(mapped)
        self._spare.close()

    def release_published(self) -> None:
        """Close the files of a pool that does not recycle, once published.

        Unmapping a frame costs ~0.15 ms; the producer calls this after the publication is
        recorded (:meth:`prepare` does), so that it is not between a frame's rename and its
        announcement to other nodes.
        """
        while self._published:
            self._published.pop().close()

    def discard(self, slot: Slot) -> None:
        """Forget a slot whose frame was not published (a failed write): delete its file."""
        self._slots.pop(slot.ino, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(slot.path)
        slot.close()

    # ------------------------------------------------------------------ retiring
    def retire(self, ino: int) -> None:
        """Unpublish a frame: its key disappears in one rename; the file waits for reuse.

        Without recycling (or when the key was already removed by someone else) the file is
        deleted instead.
        """
        slot = self._slots.get(ino)
        if slot is None:  # (without recycling, published files are not kept: nothing to do)
            return
        if not self.recycle:
            self._slots.pop(ino)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(slot.path)
            slot.close()
            return
        target = f"{self._pool_s}/{slot.pool_name}"
        try:
            try:
                os.rename(slot.path, target)
            except FileNotFoundError:
                if not os.path.lexists(slot.path):
                    raise
                # the key is there, the pool directory is not (removed under us): made
                # again, so that the frame does not stay published past its retention
                self.pool_dir.mkdir(parents=True, exist_ok=True)
                self._hold_alive_again()  # (its alive file went with it)
                os.rename(slot.path, target)
        except FileNotFoundError:  # the key was deleted under us: the file is gone
            self._slots.pop(ino)
            slot.close()
            return
        if os.lstat(target).st_ino != ino:
            # Not our file: another producer's, published under the key since (a re-run with
            # overwrite=True while this one still ran). Given back (never over a file that
            # appeared there), and this slot let go of: its own file was unlinked by that
            # publication, and the file here must never be rewritten as one of our frames.
            with contextlib.suppress(OSError):
                os.link(target, slot.path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(target)
            self._slots.pop(ino)
            slot.close()
            return
        slot.path = target
        slot.pooled = True
        self._free.append(ino)

    def _hold_alive_again(self) -> None:
        """Make the alive file again (the pool directory was removed and made again)."""
        old, self._alive = self._alive, _hold_alive(self.pool_dir, self._owner)
        if old >= 0:
            os.close(old)

    def withdraw(self, slot: Slot) -> None:
        """Take back a frame published a moment ago whose publication could not be recorded:
        its key goes (where it is still there) and its file returns to the pool, or is
        deleted by a pool that does not recycle."""
        if slot.ino in self._slots:
            self.retire(slot.ino)
            return
        with contextlib.suppress(FileNotFoundError):  # (not recycled: published files are
            os.unlink(slot.path)  # only kept until prepare closes them)
        self._published = [p for p in self._published if p is not slot]
        slot.close()

    def forget_published(self) -> None:
        """Close the producer's hold on published files (they stay published)."""
        for ino in list(self._slots):
            slot = self._slots[ino]
            if not slot.pooled:
                self._slots.pop(ino)
                slot.close()

    def close(self) -> None:
        """Delete the pooled (unpublished) files and close every mapping.

        In a forked child (a copy of the producer's pool) only the child's descriptors and
        mappings are closed: the files are the producer's, which goes on using them.
        """
        self.release_published()
        mine = self._forks == forks()
        for slot in self._slots.values():
            if slot.pooled and mine:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(slot.path)
            slot.close()
        self._slots.clear()
        self._free.clear()
        self._mapped = self._next = None  # (pooled slots: deleted above)
        self._spare.close()
        if self._alive >= 0:
            if mine:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{self._pool_s}/{_ALIVE}{self._owner}")
            os.close(self._alive)
            self._alive = -1

    @property
    def spare_ready(self) -> bool:
        """Whether a file asked for by :meth:`prepare` is made (not yet mapped)."""
        return self._spare.ready

    @property
    def files(self) -> int:
        """Frame files this producer owns (published and pooled)."""
        return len(self._slots)


class KeyOpener(Protocol):
    """Opens keys read-only beneath one managed directory, refusing symbolic links (what
    :class:`~instride.paths.ConfinedOpener` does)."""

    root: str

    def dirfd(self) -> int:
        """The directory's descriptor for ``openat2`` beneath it, or -1 where there is none."""

    def acquire_dirfd(self) -> int:
        """:meth:`dirfd`, not closed before the matching :meth:`release_dirfd`."""

    def release_dirfd(self) -> None:
        """End a use begun with :meth:`acquire_dirfd`."""

    def open(self, key: str) -> int:
        """A descriptor of ``key``'s file (a regular file, reached without links)."""


def _address(mm: mmap.mmap) -> int:
    """Where ``mm`` (writable or read-only) is mapped (the temporary export is dropped at
    once: ``mm`` stays closable)."""
    view = np.frombuffer(mm, np.uint8, count=1)
    try:
        return int(view.__array_interface__["data"][0])
    finally:
        del view


#: a producer's file in its pool directory, locked (``flock``) for as long as it runs
_ALIVE = "alive-"
#: seconds after which an alive file made aside and left unlocked is a killed producer's
_ASIDE_AGE = 60.0
#: the pools of this process, whose alive-file locks a forked child must not keep
_LIVE_POOLS: weakref.WeakSet[SlotPool] = weakref.WeakSet()


def _forget_alive() -> None:
    """In a forked child: close the copies of the pools' alive files (the lock belongs to
    the open file, which the child shares; kept, a child that outlives its producer would
    keep the producer's files from being collected). The parent's lock stays."""
    for pool in list(_LIVE_POOLS):
        if pool._alive >= 0:
            with contextlib.suppress(OSError):
                os.close(pool._alive)
            pool._alive = -1


os.register_at_fork(after_in_child=_forget_alive)


def _hold_alive(pool_dir: Path, owner: str) -> int:
    """Make ``pool_dir``'s file saying producer ``owner`` runs, locked by this process (its
    lock goes when the process does, however it ends); return its descriptor. It appears
    under its name already locked (made aside, then renamed), so no collector ever finds it
    unlocked while the producer runs."""
    aside = pool_dir / f".{_ALIVE}{owner}"
    fd = os.open(aside, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(aside, pool_dir / f"{_ALIVE}{owner}")
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)
        raise
    return fd


def _slot_owner(name: str) -> str | None:
    """The producer named in a pool file's name (``slot-<owner>-<n>``), or ``None``."""
    parts = name.split("-")
    if len(parts) == 3 and parts[0] == "slot" and parts[2].isdigit():
        return parts[1]
    return None


def _running(pool_dir: Path, owner: str) -> bool:
    """Whether producer ``owner`` of ``pool_dir`` still runs: its alive file is locked.

    A lock, not a process id: process ids mean nothing across PID namespaces (a producer in
    a container, a collector outside it, both on one file system) and are reused. Owners
    named by a bare process id (files of an older instride) are judged by that id; a lock
    that cannot be told (another user's file, no ``flock``) counts as running.
    """
    if owner.isdigit():
        return int(owner) == os.getpid() or pid_alive(int(owner))
    # (a shared probe conflicts with the producer's exclusive lock just the same, and takes
    # a descriptor open for reading also where flock is emulated, NFS)
    return lock_held(pool_dir / f"{_ALIVE}{owner}", exclusive=False) is not False


def collect_pool(pool_dir: Path) -> list[Path]:
    """Delete the pooled files of producers that are no longer running; return them.

    A producer killed mid-frame leaves its unfinished frame (and its retired files) only in
    the pool: nothing of it was ever visible under a key. A producer runs while it holds the
    lock of its alive file in the pool (see :func:`_running`).
    """
    removed: list[Path] = []
    try:
        names = os.listdir(pool_dir)
    except FileNotFoundError:
        return removed
    running: dict[str, bool] = {}
    for name in names:
        if name.startswith(f".{_ALIVE}"):
            # An alive file made aside and never renamed (its producer killed in between):
            # no later run of that owner, nor a collector judging by it, would remove it.
            # Gone once unlocked and a minute old (made, it is locked within microseconds).
            aside = pool_dir / name
            with contextlib.suppress(FileNotFoundError):
                if lock_held(aside, exclusive=True) is False \
                        and time.time() - aside.lstat().st_mtime > _ASIDE_AGE:
                    aside.unlink()
                    removed.append(aside)
            continue
        owner = _slot_owner(name) or (name[len(_ALIVE):] if name.startswith(_ALIVE) else None)
        if owner is None:
            continue
        if owner not in running:
            running[owner] = _running(pool_dir, owner)
        if not running[owner]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(pool_dir / name)
                removed.append(pool_dir / name)
    return removed


def collect_pools(root: Path) -> list[Path]:
    """:func:`collect_pool` for every stream under the managed directory ``root``."""
    removed: list[Path] = []
    base = root / ".instride" / "streams"
    for dirpath, dirnames, _files in os.walk(base):
        if "pool" in dirnames and dirpath.endswith(".stream"):
            removed.extend(collect_pool(Path(dirpath) / "pool"))
    return removed


class Taken(NamedTuple):
    """A frame file held by :meth:`Leases.take`."""

    buf: memoryview
    """The file's bytes (its kept, read-only mapping)."""
    release: Callable[[], None]
    """Ends the hold (once)."""
    checked: bool
    """The frame passed every check of :func:`~instride.frames.decode_frame` in the native
    call (the payload's checksum too, where asked): it needs parsing only."""
    waited: float
    """0.0: there at the first look; else when it was found (``time.monotonic()``)."""
    copied: bool
    """Copied into the caller's arrays and released; ``buf``: the frame's header, valid
    until the next :meth:`Leases.take`."""


class Leases:
    """A reader's holds on frame files, with its mappings kept for reuse.

    Parameters
    ----------
    keep
        Mappings kept after release, by inode (0: unmap on release). A recycled file is
        mapped once and its pages stay mapped, so reading it again costs no page faults;
        a kept mapping keeps its inode alive, so the inode number cannot name another file
        meanwhile.
    confined
        The opener of the managed directory's keys, for :meth:`open_key`.
    """

    def __init__(self, keep: int = 0, confined: KeyOpener | None = None) -> None:
        self.keep = keep
        self._maps: OrderedDict[tuple[int, int], mmap.mmap] = OrderedDict()
        self._confined = confined
        self._prefix = "" if confined is None else confined.root + "/"
        self._out = (ctypes.c_int64 * 22)()  # (isl_take: 6 values, then a frame's header)
        #: a lease's descriptor the native call handed over (out[0]), -1 once it is recorded
        #: or closed: a child forked meanwhile closes it (see _forget_holds)
        self._out[0] = -1
        self._out_header = memoryview(self._out).cast("B")[48:]  # (that header's bytes)
        # the kept mappings as isl_take looks them up: {st_dev, st_ino, size, address} each
        self._table = (ctypes.c_int64 * (4 * max(1, keep)))()
        self._table_idents: list[tuple[int, int]] = []
        self._gone = (ctypes.c_int * _GONE_CAP)()
        self._gone_n = ctypes.c_int(0)
        #: the holds handed out and not released yet (see :meth:`release_all`), and their
        #: descriptors (a forked child closes its copies: see _forget_holds)
        self._held: dict[int, Callable[[], None]] = {}
        self._hold_fds: dict[int, tuple[int, int, int]] = {}  # serial -> (fd, dev, ino)
        self._serial = 0
        _LEASES.add(self)
        #: native takes under way (their table names kept mappings: none is unmapped then),
        #: the mappings to unmap once they are done, and whether close() waits for them
        self._mu = threading.Lock()
        self._taking = 0
        self._unmap_later: list[mmap.mmap] = []
        self._close_later = False

    def open_key(self, key: str, path: str) -> tuple[memoryview | bytes, Callable[[], None]] | None:
        """:meth:`open` for the key ``key`` of the managed directory of ``confined``, whose
        file is ``path``: the open, the lock and the checks in one native call
        (``isl_lease``) where it can; the same results and errors as :meth:`open`."""
        confined = self._confined
        assert confined is not None, "open_key needs the managed directory's opener"
        lib = library()
        if lib is None or path != self._prefix + key:  # (a frame kept elsewhere: portable)
            return self.open(path, lambda: confined.open(key))
        # (without the GIL: the managed directory made again meanwhile, its descriptor let
        # go of, is not closed under the call -- see acquire_dirfd)
        dirfd = confined.acquire_dirfd()
        try:
            rc = -1 if dirfd < 0 else lib.isl_lease(dirfd, os.fsencode(key), self._out)
        finally:
            confined.release_dirfd()
        if dirfd < 0:  # (no openat2: the portable checks)
            return self.open(path, lambda: confined.open(key))
        out = self._out
        if rc == _LEASE_HELD:
            fd = out[0]
            try:
                mm = self._map(fd, out[1], out[2], out[3])
                release = self._releaser(fd, mm, out[1], out[2])
            except BaseException:
                os.close(fd)
                raise
            finally:
                out[0] = -1  # (recorded, or closed)
            return memoryview(mm), release
        if rc in (_LEASE_ABSENT, _LEASE_RETIRED):
            return None
        return self.open(path, lambda: confined.open(key))  # the slow path names the problem

    def take(self, ifd: int, keys: ctypes.Array[ctypes.c_char_p], timeout: float,
             window: tuple[float, float], verify: bool,
             into: tuple[np.ndarray, np.ndarray | None] | None = None,
             box: np.ndarray | None = None) -> Taken | int | list[int] | None:
        """Wait for ``keys[0]``, hold it and check the frame in the kept mapping of its file,
        in one native call (``isl_take``, GIL released); or copy it into arrays of the
        caller's, checked on the way, and let it go in the same call.

        Parameters
        ----------
        ifd
            The calling thread's inotify descriptor, with a watch on the keys' directory
            (:func:`~instride.store.wait.armed`).
        keys
            The frame's key, then keys whose publication ends the wait too (the end marker).
        timeout
            Seconds to wait at most.
        window
            Seconds from now between which to poll instead of sleeping (``(0, 0)``: never).
        verify
            Check the payload's checksum too (the header's is always checked).
        into
            The positions and ids arrays (C-contiguous, of the layout's types) to copy a
            frame of their size into; a frame of another size is held instead.
        box
            A C-contiguous ``(3, 3)`` float64 array for the box vectors of a frame that
            passed the checks (:attr:`Taken.checked`).

        Returns
        -------
        Taken | int | list[int] | None
            The frame held (:class:`Taken`); ``TAKE_OTHER``, ``TAKE_TIMEOUT`` or
            ``TAKE_INTERRUPTED``: nothing held, the caller looks the usual way; the watch
            descriptors that went away (an empty list: the event queue overflowed), to
            forget before the next wait; ``None`` where there is no native library or
            ``openat2``.
        """
        lib = library()
        confined = self._confined
        if lib is None or confined is None:
            return None
        # (the wait may be long, without the GIL: the managed directory made again meanwhile,
        # its descriptor let go of, is not closed under the call — see acquire_dirfd)
        dirfd = confined.acquire_dirfd()
        try:
            if dirfd < 0:
                return None
            return self._take(lib, ifd, dirfd, keys, timeout, window, verify, into, box)
        finally:
            confined.release_dirfd()

    def _take(self, lib: Any, ifd: int, dirfd: int, keys: ctypes.Array[ctypes.c_char_p],
              timeout: float, window: tuple[float, float], verify: bool,
              into: tuple[np.ndarray, np.ndarray | None] | None,
              box: np.ndarray | None) -> Taken | int | list[int]:
        """:meth:`take` beneath the directory descriptor ``dirfd``."""
        out = self._out
        if into is None:
            pos = ids = None
            natoms = 0
        else:
            pos = into[0].__array_interface__["data"][0]
            ids = None if into[1] is None else into[1].__array_interface__["data"][0]
            natoms = len(into[0])
        box_at = None if box is None else box.__array_interface__["data"][0]
        # (the call reads the kept mappings its table names, without the GIL: another thread
        # that closes the reader meanwhile must not unmap them under it — SIGSEGV)
        with self._mu:
            self._taking += 1
        try:
            rc = lib.isl_take(ifd, dirfd, keys, len(keys), int(timeout * 1e6),
                              int(window[0] * 1e6), int(window[1] * 1e6), self._table,
                              len(self._table_idents), 1 if verify else 0, pos, ids, natoms,
                              box_at, self._gone, _GONE_CAP, ctypes.byref(self._gone_n), out)
            return self._taken(rc, keys)
        finally:
            with self._mu:
                self._taking -= 1
                if not self._taking:
                    later, self._unmap_later = self._unmap_later, []
                    for mm in later:
                        _close_quietly(mm)
                    if self._close_later:
                        self._close_later = False
                        self._close_maps()

    def _taken(self, rc: int, keys: ctypes.Array[ctypes.c_char_p]) -> Taken | int | list[int]:
        """What :meth:`take` returns for ``isl_take``'s result ``rc`` (in :attr:`_out`)."""
        out = self._out
        if rc == TAKE_COPIED:  # (a kept mapping's file: keep it the most recently used)
            self._maps.move_to_end(self._table_idents[out[4]])
            return Taken(self._out_header, _noop, True, out[5] / 1e6, True)
        if rc == TAKE_HELD:
            fd, at = out[0], out[4]
            try:
                if at >= 0:  # checked in the mapping kept for it
                    ident = self._table_idents[at]
                    mm = self._maps[ident]
                    self._maps.move_to_end(ident)
                else:
                    mm = self._map(fd, out[1], out[2], out[3])
                release = self._releaser(fd, mm, out[1], out[2])
            except BaseException:
                os.close(fd)
                raise
            finally:
                out[0] = -1  # (recorded, or closed)
            return Taken(memoryview(mm), release, at >= 0, out[5] / 1e6, False)
        if rc == TAKE_REARM:
            n = self._gone_n.value
            return list(self._gone[:n]) if n > 0 else []
        if rc < 0:
            raise OSError(-rc, f"waiting for {keys[0].decode(errors='replace')}: "
                          f"{os.strerror(-rc)}")
        return rc

    def open(
        self, path: str | Path, opener: Callable[[], int] | None = None,
    ) -> tuple[memoryview | bytes, Callable[[], None]] | None:
        """Hold the file published at ``path``; ``None`` if there is none (any more).

        Returns the file's bytes (a read-only mapping; ``bytes`` for an empty file) and the
        function that releases the hold.

        Parameters
        ----------
        path
            The frame file.
        opener
            Opens ``path`` read-only and returns the descriptor, refusing symbolic links on the
            way (a :class:`~instride.paths.ConfinedOpener`); default: ``open`` with
            ``O_NOFOLLOW`` (the last component only).

        Raises
        ------
        UnsafePathError
            ``path`` is a symbolic link (never followed), or reached through one.
        FileTypeError
            ``path`` is a directory or a special file.
        """
        global _opening
        with _opened:  # (a fork waits until its hold is recorded: _no_open_under_way)
            if _forking:  # (one is waiting for the opens under way: this one after it)
                _opened.wait_for(lambda: not _forking, _FORK_WAIT)
            _opening += 1
        try:
            return self._open(path, opener)
        finally:
            with _opened:
                _opening -= 1
                if not _opening:
                    _opened.notify_all()

    def _open(
        self, path: str | Path, opener: Callable[[], int] | None,
    ) -> tuple[memoryview | bytes, Callable[[], None]] | None:
        try:
            fd = _with_more_files(
                opener if opener is not None else lambda: os.open(
                    path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC),
                len(self._maps))
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP and not isinstance(exc, UnsafePathError):
                raise UnsafePathError(str(path), "it is a symbolic link; frames never follow "
                                      "links") from None
            raise
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # the producer is rewriting it: it was retired
                os.close(fd)
                return None
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                code = errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL
                raise FileTypeError(str(path), "it is not a regular file; only regular files "
                                    "are read", code)
            try:
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is None or now.st_ino != st.st_ino or now.st_dev != st.st_dev:
                os.close(fd)  # retired between our open and our lock
                return None
            if st.st_size == 0:
                os.close(fd)
                return b"", _noop
            mm = self._map(fd, st.st_dev, st.st_ino, st.st_size)
            release = self._releaser(fd, mm, st.st_dev, st.st_ino)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        return memoryview(mm), release

    def _releaser(self, fd: int, mm: mmap.mmap, dev: int, ino: int) -> Callable[[], None]:
        """The function that ends the hold ``fd`` on the file ``(dev, ino)`` mapped as ``mm``
        (once)."""
        done = False
        self._serial = serial = self._serial + 1
        held, fds = self._held, self._hold_fds

        def release() -> None:
            nonlocal done
            if done:
                return
            done = True
            held.pop(serial, None)
            if serial in fds:  # (not a forked child's closed copy)
                with contextlib.suppress(OSError):
                    os.close(fd)  # drops the shared lock
                # (recorded until closed: a child forked in between closes its copy)
                fds.pop(serial, None)
            if not self.keep:
                with contextlib.suppress(BufferError):
                    mm.close()

        held[serial] = release
        fds[serial] = (fd, dev, ino)
        return release

    def _forget_holds(self) -> None:
        """In a child made by ``fork``: close the copies of the holds' descriptors. A hold's
        lock is its open file's, shared with the parent's descriptor: kept open in the child
        (a ``multiprocessing`` worker), the parent's release no longer let the file go, and
        its producer could not reuse it while the child lived. The hold stays the parent's;
        the child's releases close nothing (the numbers may name its own files by then).

        A hold being taken in another thread at the fork — opened and locked, not recorded
        yet — is closed too: the native take hands its descriptor over in ``out[0]`` (a fork
        waits while a native lease has it only in a local: take.c's ``fork_guard``); the
        portable path's, a fork waits for (:func:`_no_open_under_way`)."""
        for fd, dev, ino in self._hold_fds.values():
            _close_if(fd, dev, ino)
        self._hold_fds.clear()
        out = self._out
        if out[0] >= 0:
            _close_if(out[0], out[1], out[2])
            out[0] = -1

    def holding(self) -> bool:
        """Whether a hold handed out is not released yet."""
        return bool(self._held)

    def release_all(self) -> None:
        """End every hold handed out and not released (the frames a reader took with
        ``read()`` or ``stream[i]`` and never released, when it closes): each would keep its
        descriptor and lock for the life of the process, and its producer could never reuse
        the file (its pool growing past its bound)."""
        for release in list(self._held.values()):
            release()

    def _map(self, fd: int, dev: int, ino: int, size: int) -> mmap.mmap:
        ident = (dev, ino)
        mm = self._maps.get(ident)
        if mm is not None and len(mm) == size:
            self._maps.move_to_end(ident)
            return mm
        # A mapping keeps its open file description alive, and with it any flock on it: map
        # through a second open of the same file, so closing ``fd`` really ends the hold.
        def mapped() -> mmap.mmap:
            mfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
            try:  # (mmap keeps a copy of the descriptor: one open file per kept mapping)
                return mmap.mmap(mfd, size, flags=mmap.MAP_SHARED | _POPULATE,
                                 prot=mmap.PROT_READ)
            finally:
                os.close(mfd)

        mm = _with_more_files(mapped, len(self._maps))
        if self.keep:
            old = self._maps.pop(ident, None)
            self._maps[ident] = mm
            if old is not None:
                self._unmap(old)
            while len(self._maps) > self.keep:
                self._unmap(self._maps.popitem(last=False)[1])
            self._tabulate()
        return mm

    def _unmap(self, mm: mmap.mmap) -> None:
        """Unmap a kept mapping, once no native take that may read it is under way."""
        with self._mu:
            if self._taking:
                self._unmap_later.append(mm)
                return
        _close_quietly(mm)

    def _tabulate(self) -> None:
        """Write the kept mappings into the table :meth:`take` hands to ``isl_take``."""
        table, idents = self._table, []
        for i, ((dev, ino), mm) in enumerate(self._maps.items()):
            table[4 * i : 4 * i + 4] = [dev, ino, len(mm), _address(mm)]
            idents.append((dev, ino))
        self._table_idents = idents

    def close(self) -> None:
        """Drop every kept mapping (views still in use keep theirs alive) — once the native
        takes under way (another thread's) are done."""
        with self._mu:
            if self._taking:
                self._close_later = True
                return
            self._close_maps()

    def _close_maps(self) -> None:
        for mm in self._maps.values():
            _close_quietly(mm)
        self._maps.clear()
        self._table_idents = []


def _close_quietly(mm: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view still uses it: the GC unmaps it later
        mm.close()


def _noop() -> None:
    return None
