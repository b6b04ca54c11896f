"""Recycled receive files: the storage of dropped copies, reused for the next fetch (one node).

A consumer node that drops the copies it fetched (a bounded stream's frames once released,
copies evicted beyond ``INSTRIDE_CACHE_BYTES``) would otherwise free their pages and
allocate new ones for the next fetch. On a VM that gives free memory back to its host, every
new page costs a fault in the host too: writing a JAC frame (644 KiB) into a new file took
~0.41 ms here, into an existing one ~0.09 ms. So a dropped copy is not deleted but renamed
into the node's hidden pool (``.instride/recv/``, its key gone in that one step), and the
next fetch of a frame claims a pooled file, overwrites it in place and renames it to its key.

A pooled file is rewritten only by the process that claimed it (a rename, so two fetches never
claim the same file), and only once nobody holds it any more. What "holds" means depends on how
the copy was read, which the dropping side says:

* a bounded stream's frame (``locked=True``): its readers hold a shared ``flock`` while they
  hold the frame (:class:`~instride.store.ring.Leases`), so the file is reused when an exclusive
  lock can be taken without waiting — as the producer's ring reuses retired frames, a reader's
  released mapping may then show the new frame's bytes;
* any other copy (an eviction beyond ``INSTRIDE_CACHE_BYTES``; ``locked=False``): its readers
  (a path from ``consume``, an open file, a ``consume_bytes`` mapping) take no lock, so the file
  is reused only when no other descriptor or mapping of it exists anywhere. The test is a write
  lease (``F_SETLEASE``, ``F_WRLCK``), which the kernel grants only then; it is released at once
  (the claimed file has no key any more, so nobody can open it meanwhile). Where leases are not
  available (``fs.leases-enable=0``, a file system without them) such a file is never reused.

A file still held stays in the pool, untouched, for a later fetch. The pool is bounded
(:data:`KEEP_FILES` files, :data:`KEEP_BYTES` bytes or less); beyond that a dropped copy is
deleted as before.

A node that keeps every copy (no cache bound) has nothing to recycle: each fetch needs new
pages. When two fetches in a row of the same size (up to :data:`AHEAD_BYTES`) find no pooled
file, the pool has the next one made ahead, of that size, by a helper thread of this process
that runs only when the CPU is otherwise idle (:mod:`~instride.store.spare`; the file has no
name until a fetch takes it): the next fetch of that size — a stream's next frame — receives
into pages already allocated (between a stream's frames there is idle time) instead of taking
a fault per page while the bytes arrive.

A file made ahead has its pages written twice (zeros, then the bytes). Beside a transfer the
helper's zeros take the memory bandwidth the transfer needs: STMV frames fetched one after the
other into new files came to 0.58-0.81 of raw TCP that way on the development VM, 0.99-1.10
with no file made ahead. So the helper writes only in the pauses between transfers: while no
receive of this process is under way and from 2 ms after the last (the TCP and UCX engines
count them: :data:`instride.native.RECEIVING`). Even so, large frames fetched one after the
other came to about a tenth less with files made ahead (0.85-0.95 against 0.93-1.00 of raw
TCP, alternating runs, before the 2 ms rule; with it, runs in a phase of expensive fresh
memory could not tell the two apart), while a stream of STMV frames 300 ms apart gained from
them on a VM that hands free memory back to its host (p90 34-39 ms per frame, against up to
114 ms without).
Files are made ahead for fetches up to ``INSTRIDE_AHEAD_BYTES`` (default 4 MiB: a JAC frame's
latency gains; flat-out throughput of large frames does not pay); raise it where large frames
come paced and fresh memory is expensive.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import mmap
import os
from pathlib import Path

from ..config import AHEAD_BYTES
from .ring import MADV_POPULATE_WRITE, prefault_works
from .spare import SpareMaker

#: at most this many files in a node's receive pool
KEEP_FILES = 16
#: and at most this many bytes
KEEP_BYTES = 1 << 30

_names = itertools.count()


class ReceivePool:
    """Dropped copies of one node, kept for reuse by the next fetches.

    Parameters
    ----------
    pool_dir
        The node's hidden pool directory, on the managed directory's file system (a pooled
        file is renamed to its key).
    keep_files, keep_bytes
        Bounds of the pool; a copy that would exceed them is deleted.
    ahead
        Have the next file made ahead when a fetch finds nothing pooled (a node that keeps
        every copy; with a cache bound the evicted copies are the next files, and a file
        made ahead would be made for nothing).
    ahead_bytes
        Only for fetches of at most this many bytes (``INSTRIDE_AHEAD_BYTES``).
    """

    def __init__(self, pool_dir: Path, *, keep_files: int = KEEP_FILES,
                 keep_bytes: int = KEEP_BYTES, ahead: bool = False,
                 ahead_bytes: int = AHEAD_BYTES) -> None:
        self.pool_dir = pool_dir
        self.ahead = ahead
        self.ahead_bytes = ahead_bytes
        self._pool_s = str(pool_dir)
        self.keep_files = keep_files
        self.keep_bytes = keep_bytes
        #: files this process claimed from the pool (for tests and benchmarks)
        self.reused = 0
        #: files made ahead by the idle helper that fetches received into
        self.spares_used = 0
        self._spare = SpareMaker()
        self._last_size = -1  # of the last fetch that found nothing pooled

    def _entries(self) -> list[os.DirEntry[str]]:
        try:
            with os.scandir(self._pool_s) as it:
                return [e for e in it if e.name.startswith("copy-")]
        except FileNotFoundError:
            return []

    def give(self, path: str, *, locked: bool = False) -> bool:
        """Move the dropped copy at ``path`` into the pool (its name disappears at once).

        ``locked``: every reader of the copy holds a shared ``flock`` while it holds it (a
        stream's frames); otherwise the file is reused only when nobody has it open or mapped.
        Returns ``False`` (``path`` untouched) when the pool is full or ``path`` is not a
        regular file; the caller deletes it then.
        """
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return True  # gone already: nothing to drop
        if not st.st_size or (st.st_mode & 0o170000) != 0o100000:
            return False
        entries = self._entries()
        if len(entries) >= self.keep_files:
            return False
        held = 0
        for e in entries:
            with contextlib.suppress(FileNotFoundError):
                held += e.stat(follow_symlinks=False).st_size
        if held + st.st_size > self.keep_bytes:
            return False
        target = self._name("lock" if locked else "free")
        try:
            try:
                os.rename(path, target)
            except FileNotFoundError:
                os.makedirs(self._pool_s, exist_ok=True)
                os.rename(path, target)
        except FileNotFoundError:
            return True  # the copy itself went meanwhile
        except OSError:
            return False  # (e.g. the pool on another file system): the caller deletes it
        return True

    def take(self, staged: str, size: int) -> int | None:
        """Claim a pooled file as ``staged`` (a temporary name beside its key), ``size`` bytes.

        Returns a descriptor open for reading and writing at offset 0 (it may be mapped:
        :func:`map_to_receive`), or ``None`` when the pool has no
        file that nobody holds (the caller makes a new file). A claimed file that someone still
        has open or mapped goes back into the pool, untouched.
        """
        for entry in self._entries():
            try:
                os.rename(entry.path, staged)  # the claim: no other process can have it now
            except FileNotFoundError:
                continue  # claimed by another process first
            try:
                fd = os.open(staged, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            except BaseException:
                # (EMFILE: another thread took the last descriptor since the listing) the
                # claimed file goes back into the pool, untouched: left under the temporary
                # name, it was clutter beside its key that no gc removed while we ran
                self._unclaim(staged, kind=entry.name.split("-", 2)[1])
                raise
            try:
                kind = entry.name.split("-", 2)[1]
                reusable = _unlocked(fd) if kind == "lock" else unshared(fd)
                now = os.fstat(fd).st_size if reusable else size
                if now > size and kind == "lock":
                    # (never shrunk: unlocked is not unmapped — a reader that kept the arrays
                    # of a frame it released still maps its length, and a page past the new
                    # end would kill it, SIGBUS: the file goes, its mappings stay whole)
                    os.close(fd)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(staged)
                    continue
                if now != size:
                    os.ftruncate(fd, size)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(staged)
                raise
            if not reusable:  # a reader still holds it: back into the pool, for later
                os.close(fd)
                self._unclaim(staged, kind=kind)
                continue
            self.reused += 1
            return fd
        return self._take_spare(staged, size) if self.ahead else None

    def _unclaim(self, staged: str, *, kind: str) -> None:
        """Give the claimed file ``staged`` back to the pool (deleted where it cannot be)."""
        try:
            os.rename(staged, self._name(kind))
        except OSError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged)

    def _take_spare(self, staged: str, size: int) -> int | None:
        """The file made ahead for a fetch of ``size`` bytes, named ``staged``, if it is ready;
        the next one is asked for after two fetches in a row of that size (nothing pooled: this
        node keeps its copies)."""
        fd = self._spare.take(size, staged)
        if fd is not None:
            self.spares_used += 1
        if size == self._last_size and 0 < size <= self.ahead_bytes and not self._spare.pending:
            with contextlib.suppress(OSError):
                os.makedirs(self._pool_s, exist_ok=True)
                self._spare.ask(self._pool_s, size)
        self._last_size = size
        return fd

    @property
    def spare_ready(self) -> bool:
        """Whether the file asked for ahead is made."""
        return self._spare.ready

    def close(self) -> None:
        """Give up the file being made ahead (deleted)."""
        self._spare.close()

    def _name(self, kind: str) -> str:
        """A new name in the pool for a file whose readers are checked the ``kind`` way."""
        return f"{self._pool_s}/copy-{kind}-{os.getpid()}-{next(_names)}"

    def clear(self) -> list[Path]:
        """Delete every pooled file (``instride gc``); return them."""
        removed = []
        for entry in self._entries():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        return removed


def map_to_receive(fd: int, size: int) -> mmap.mmap | None:
    """A writable shared mapping of the first ``size`` bytes of the receive file ``fd`` (open
    for reading and writing), its page tables filled, for a fetch to receive into: each piece
    of the body lands in the file's pages as it comes off the socket (no copy through a
    buffer, no ``write``). Only a file whose pages are all allocated already (a pooled file, one
    made ahead) is mapped, so a store into the mapping can never find the file system full
    (a ``SIGBUS``); for any other file, and where mapping fails, ``None``: the bytes are
    written as before (on a VM, faulting in a new file's pages through a mapping cost about
    twice what writing them does). The page tables are filled before the fetch starts
    (``MADV_POPULATE_WRITE``, where the kernel has it), while the caller waits for the bytes
    anyway.
    """
    try:
        st = os.fstat(fd)
        if size <= 0 or st.st_size < size or st.st_blocks * 512 < size:
            return None
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError):
        return None
    if prefault_works():
        with contextlib.suppress(OSError):
            mm.madvise(MADV_POPULATE_WRITE)
    return mm


def _unlocked(fd: int) -> bool:
    """Whether no reader holds a lock on ``fd``'s file (the exclusive lock, taken without
    waiting, stays with the descriptor until it is closed)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def unshared(fd: int) -> bool:
    """Whether no other descriptor or memory mapping of ``fd``'s file exists anywhere.

    A write lease is granted only then; it is released again at once. ``False`` also where
    leases are not available (then nothing can be proven, and nothing is reused).
    """
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except OSError:
        return False  # EAGAIN: open or mapped elsewhere; EINVAL, EACCES: no leases here
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    return True


__all__ = ["AHEAD_BYTES", "KEEP_BYTES", "KEEP_FILES", "ReceivePool", "map_to_receive", "unshared"]
