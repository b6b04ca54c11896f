"""Files made ahead, while the CPU is idle: the next frame file, the next fetched copy.

A stream without retention writes each frame into a new file, and a node that keeps every
fetched copy receives each into a new file: their pages must be allocated (and, on a VM that
gives free memory back to its host, faulted in the host too: ~0.7 ms for a JAC frame of
644 KiB, ~13 ms for STMV's 28.5 MiB on the development VM). The producer had the next file made
right after a publication (:meth:`~instride.store.ring.SlotPool.prepare`), by itself: off the
path from ``append`` to publication, but still its own time (STMV appends took 21.7-22.4 ms,
8.3-9.0 ms since); a fetch paid the faults while the bytes arrived (the file API's cross-node
JAC latency: 3.3 ms on that VM, 1.5-2.0 ms since, :class:`~instride.store.recvpool.ReceivePool`).

So a helper thread makes the file, at ``SCHED_IDLE`` (it runs only when no other thread wants
the CPU): it creates the file without a name (``O_TMPFILE``: nothing is left behind by a
process that dies or drops it; the taker names it) and writes zeros into it (``pwrite``: every
page allocated and touched — one only ``fallocate``'d is cleared at its first use, by the
producer — and no memory mapping of the process involved). The helper is a native thread
(``csrc/local/spare.c``): a Python thread must take the GIL to return from the system call,
and a starved idle thread holding the GIL would stop the producer (tried: the next ``append``
waited ~0.5 ms for it). Nobody waits for the helper: a file not ready yet is made the usual
way, and the helper's file goes to a later frame.

The helper writes only while no receive of its process is under way (the TCP and UCX engines
count them in :data:`instride.native.RECEIVING`; the helper looks before each 64 KiB and
sleeps 1 ms while one is, and until 2 ms after the last): its zeros are a second write of the
file's pages, and beside a transfer they would take the memory bandwidth the transfer needs
(:mod:`~instride.store.recvpool`).

The helper can also prefault a mapping first (:meth:`SpareMaker.ask`'s ``populate``): the
producer maps the file it takes without filling the page tables (``MAP_POPULATE`` cost ~70 µs
per JAC frame right after a publication) and the next helper fills them
(``MADV_POPULATE_WRITE``) while the CPU is idle. Such a mapping is unmapped only after the
function ``ask`` returned was called: it waits for a prefault under way, or calls off one not
started, so the helper never touches the range once it may hold something else. That wait
raises the helper to a normal thread, which Linux allows only with ``CAP_SYS_NICE`` or an
``RLIMIT_NICE`` that covers the thread's nice value; where neither holds (an unprivileged user
on a cluster node, usually), no mapping is given to the helper (:attr:`SpareMaker.prefault_safe`)
and the producer fills its page tables itself, as before.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable
from typing import Any

from ..native import library
from ..perthread import forks

__all__ = ["SpareMaker"]


class SpareMaker:
    """A file of ``size`` bytes made at a time by a ``SCHED_IDLE`` helper thread.

    The file has no name while it is made (``O_TMPFILE`` in the directory given): a process
    that dies, or drops it, leaves nothing behind. :meth:`ask` for one, :meth:`take` it once it
    is ready — it gets its name then — and :meth:`close` to drop it. Safe to share between
    threads (a node's receive pool is); a forked child does not touch its parent's file.
    Without ``libinstride_local.so``, or where the file system has no ``O_TMPFILE``, nothing
    is made (:meth:`take` says so).
    """

    def __init__(self) -> None:
        self._lib = library()
        self._lock = threading.Lock()
        self._handle: Any = None  # the helper's handle, while a file is asked for
        self._size = 0
        self._forks = forks()  # (of the process that asked)

    def _mine(self) -> Any:
        """The handle, if it was asked for in this process (a forked child forgets it: the
        parent's helper and file are not its own). Called with the lock held."""
        if self._handle is not None and self._forks != forks():
            self._handle = None
        return self._handle

    @property
    def pending(self) -> bool:
        """Whether a file was asked for and not taken yet (made or not)."""
        with self._lock:
            return self._mine() is not None

    @property
    def ready(self) -> bool:
        """Whether the file asked for is made (:meth:`take` returns it at once)."""
        with self._lock:
            handle = self._mine()
            return handle is not None and bool(self._lib.isl_spare_ready(handle))

    def ask(self, directory: str, size: int,
            populate: tuple[int, int] | None = None) -> Callable[[], None] | None:
        """Have the helper make a file of ``size`` bytes in ``directory`` (unless one is
        pending).

        ``populate``: ``(address, length)`` of a mapping of this process that the helper
        prefaults first (its page tables filled, writable; no byte written). The function
        returned must be called before that range is unmapped (it waits for a prefault under
        way, or calls off one not started); ``None``: nothing will prefault it (no helper
        started, or one was pending already).
        """
        with self._lock:
            if self._mine() is not None or self._lib is None:
                return None
            where = os.fsencode(directory)
            handle = self._lib.isl_spare_start(where, size) if populate is None else \
                self._lib.isl_spare_start_populating(where, size, *populate)
            self._handle = handle or None
            self._size, self._forks = size, forks()
            if populate is None or self._handle is None:
                return None
        return functools.partial(self._settle, handle)

    def _settle(self, handle: Any) -> None:
        """No prefault by ``handle``'s helper after this returns (a handle taken or dropped
        since had its prefault over already)."""
        with self._lock:
            if self._handle is handle and self._mine() is not None:
                self._lib.isl_spare_settle(handle)

    @property
    def prefault_safe(self) -> bool:
        """Whether a helper may prefault this thread's mappings (:meth:`ask`'s ``populate``):
        only where the thread may raise the helper out of ``SCHED_IDLE`` to finish a prefault
        it waits for (``CAP_SYS_NICE`` in the initial user namespace — not in a rootless
        container's, where it shows but does not count — or an ``RLIMIT_NICE`` that allows the
        thread's nice value; usually neither for an unprivileged user), and no such raise was
        refused. Else
        a helper starved in the middle of a prefault — holding the process's ``mmap_lock`` —
        could keep the producer waiting as long as other threads keep the CPU busy."""
        return self._lib is not None and bool(self._lib.isl_spare_prefault_safe())

    @property
    def populated(self) -> bool:
        """Whether the pending helper prefaulted the mapping it was given (tests)."""
        with self._lock:
            handle = self._mine()
            return handle is not None and bool(self._lib.isl_spare_populated(handle))

    def take(self, size: int, name: str) -> int | None:
        """The file made, named ``name`` now, as a descriptor open read-write — if it is ready
        and of ``size`` bytes; else ``None`` (a ready file of another size, or one that failed
        or cannot be named, is dropped; one not ready yet stays asked for)."""
        with self._lock:
            handle = self._mine()
            if handle is None or not self._lib.isl_spare_ready(handle):
                return None
            self._handle = None
            if self._size != size:
                self._lib.isl_spare_drop(handle)
                return None
            fd = self._lib.isl_spare_take(handle, os.fsencode(name))  # (named: linkat)
        return None if fd < 0 else fd

    def close(self) -> None:
        """Give up the file asked for (it has no name: gone with its descriptor)."""
        with self._lock:
            handle, self._handle = self._mine(), None
            if handle is not None:
                with contextlib.suppress(Exception):
                    self._lib.isl_spare_drop(handle)
