"""Recycled receive files: the storage of dropped copies, reused for the next fetch (one node).

A consumer node that drops the copies it fetched (a bounded stream's frames once released,
copies evicted beyond ``INSTRIDE_CACHE_BYTES``) would otherwise free their pages and
allocate new ones for the next fetch. On a VM that gives free memory back to its host, every
new page costs a fault in the host too: writing a JAC frame (644 KiB) into a new file took
~0.41 ms here, into an existing one ~0.09 ms. So a dropped copy is not deleted but renamed
into the node's hidden pool (``.instride/recv/``, its key gone in that one step), and the
next fetch of a frame claims a pooled file, overwrites it in place and renames it to its key.

A reader that still holds the old copy keeps a shared ``flock`` on it (see
:class:`~instride.store.ring.Leases`); a pooled file is rewritten only by the process that
claimed it (a rename, so two fetches never claim the same file) and only under an exclusive
lock taken without waiting: a file still held is deleted instead (the holder's mapping stays
valid). The pool is bounded (:data:`KEEP_FILES` files, :data:`KEEP_BYTES` bytes); beyond
that a dropped copy is deleted as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
from pathlib import Path

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
    """

    def __init__(self, pool_dir: Path, *, keep_files: int = KEEP_FILES,
                 keep_bytes: int = KEEP_BYTES) -> None:
        self.pool_dir = pool_dir
        self._pool_s = str(pool_dir)
        self.keep_files = keep_files
        self.keep_bytes = keep_bytes
        #: files this process claimed from the pool (for tests and benchmarks)
        self.reused = 0

    def _entries(self) -> list[os.DirEntry[str]]:
        try:
            with os.scandir(self._pool_s) as it:
                return [e for e in it if e.name.startswith("copy-")]
        except FileNotFoundError:
            return []

    def give(self, path: str) -> bool:
        """Move the dropped copy at ``path`` into the pool (its name disappears at once).

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
        target = f"{self._pool_s}/copy-{os.getpid()}-{next(_names)}"
        try:
            os.rename(path, target)
        except FileNotFoundError:
            try:
                os.makedirs(self._pool_s, exist_ok=True)
                os.rename(path, target)
            except FileNotFoundError:
                return True  # the copy itself went meanwhile
        return True

    def take(self, staged: str, size: int) -> int | None:
        """Claim a pooled file as ``staged`` (a temporary name beside its key), ``size`` bytes.

        Returns a descriptor open for writing at offset 0, holding the file's exclusive lock
        (dropped when it is closed), or ``None`` when the pool has no file nobody holds (the
        caller makes a new file). A claimed file that a reader still holds is deleted.
        """
        for entry in self._entries():
            try:
                os.rename(entry.path, staged)  # the claim: no other process can have it now
            except FileNotFoundError:
                continue  # claimed by another process first
            fd = os.open(staged, os.O_WRONLY | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.fstat(fd).st_size != size:
                    os.ftruncate(fd, size)
            except BaseException as exc:
                os.close(fd)
                os.unlink(staged)  # a reader still holds it: leave it to the reader
                if isinstance(exc, (BlockingIOError, OSError)):
                    continue
                raise
            self.reused += 1
            return fd
        return None

    def clear(self) -> list[Path]:
        """Delete every pooled file (``instride gc``); return them."""
        removed = []
        for entry in self._entries():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        return removed


__all__ = ["KEEP_BYTES", "KEEP_FILES", "ReceivePool"]
