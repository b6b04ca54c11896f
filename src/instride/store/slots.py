"""Node-wide try-locks by name, all on one file: one byte of it per name.

A consumer of a node that asks a key's owner early takes such a lock, without waiting, so that
one consumer of the node (a thread or a process) asks for a key at a time; one that fetches a
key takes the key's lock on another file, waiting for it (:meth:`ClusterEngine._lock
<instride.engine.cluster.ClusterEngine._lock>` tries again until its deadline), so that one
transfer of each key reaches the node. A lock file made and
removed per request costs tens of µs on the frame's path (create, lock, check, unlink, close);
here each name is a byte range of one file that is never removed — its offset the name's
CRC-32 — locked with a POSIX record lock (``fcntl``'s ``F_SETLK``): one system call to take it,
one to let go of it.

POSIX record locks belong to the process, not to a descriptor or a thread, so:

- threads of one process are kept apart by the process's own set of held names;
- closing any descriptor of the file would let go of every lock the process holds on it, so a
  process opens the file once and never closes it (:func:`slot_locks` hands every caller of
  a process the same object for a path);
- a child made by ``fork`` holds none of its parent's locks (nor thinks it does) and locks
  through the descriptor it inherited, as its own process.

Two names whose CRC-32s are equal share a lock (one in 2³² pairs): one of them is then refused
while the other is held, which only makes its caller take the usual way.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

from instride.perthread import forks


class SlotLocks:
    """Try-locks by name across the processes of a node, on the file ``path``.

    Parameters
    ----------
    path
        The lock file (made on first use; never removed).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1
        self._forks = forks()
        self._held: set[int] = set()
        self._mu = threading.Lock()

    def _open(self) -> int:
        if self._fd < 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        return self._fd

    @contextlib.contextmanager
    def held(self, name: str) -> Iterator[bool]:
        """Take the lock of ``name`` if nobody of the node holds it, and let go of it on exit.

        Yields
        ------
        bool
            Whether this caller holds it (``False``: another thread or process does; nothing
            to let go of).
        """
        slot = zlib.crc32(name.encode())
        with self._mu:
            if self._forks != forks():  # a forked child: its parent's locks are not its own
                self._forks, self._held = forks(), set()
            taken = slot not in self._held
            if taken:
                try:
                    fcntl.lockf(self._open(), fcntl.LOCK_EX | fcntl.LOCK_NB, 1, slot)
                except OSError:  # (held by another process: EAGAIN or EACCES)
                    taken = False
                else:
                    self._held.add(slot)
        try:
            yield taken
        finally:
            if taken:
                with self._mu:
                    if slot in self._held:  # (not after a fork in between)
                        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, slot)
                        self._held.discard(slot)

    def holder(self, name: str) -> int | None:
        """The PID of the other process of the node that holds the lock of ``name``, or
        ``None``: nobody else holds it, or this process does (a thread of it), or the holder is
        a process this one cannot name (another PID namespace: the kernel says 0)."""
        slot = zlib.crc32(name.encode())
        # (struct flock: l_type, l_whence, l_start, l_len, l_pid, as C lays it out)
        asked = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, slot, 1, 0)
        try:
            got = fcntl.fcntl(self._open(), fcntl.F_GETLK, asked)
        except OSError:
            return None
        kind, _, _, _, pid = struct.unpack(_FLOCK, got)
        return pid if kind != fcntl.F_UNLCK and pid > 0 else None

    def wait_free(self, name: str, until: float) -> bool:
        """Wait until nobody of the node holds the lock of ``name`` (taken and let go of at
        once), at most until ``until`` (``time.monotonic()``); whether it was free by then."""
        delay = 0.0002
        while True:
            with self.held(name) as taken:
                if taken:
                    return True
            if time.monotonic() + delay > until:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.005)


#: ``struct flock`` (``fcntl(F_GETLK)``'s argument), with the padding C gives it
_FLOCK = "hhqqi4x"

_made: dict[str, SlotLocks] = {}
_made_mu = threading.Lock()


def _after_fork_in_child() -> None:
    """A child made by ``fork`` while another thread held a lock of this module would wait
    for it for ever: it gets new ones, and holds none of its parent's names."""
    global _made_mu
    _made_mu = threading.Lock()
    for locks in _made.values():
        locks._mu, locks._held, locks._forks = threading.Lock(), set(), forks()


os.register_at_fork(after_in_child=_after_fork_in_child)


def slot_locks(path: Path) -> SlotLocks:
    """The process's one :class:`SlotLocks` for the file ``path`` (see the module's notes:
    a second descriptor of the file, once closed, would let go of the first one's locks)."""
    real = os.path.realpath(path)
    with _made_mu:
        locks = _made.get(real)
        if locks is None:
            locks = _made[real] = SlotLocks(Path(real))
        return locks


__all__ = ["SlotLocks", "slot_locks"]
