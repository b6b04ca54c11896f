"""Files made ahead, while the CPU is idle: the next frame file, the next fetched copy.

A stream without retention writes each frame into a new file, and a node that keeps every
fetched copy receives each into a new file: their pages must be allocated (and, on a VM that
gives free memory back to its host, faulted in the host too: ~0.7 ms for a JAC frame of
644 KiB, ~13 ms for STMV's 28.5 MiB on the development VM). The producer had the next file made
right after a publication (:meth:`~instride.store.ring.SlotPool.prepare`), by itself: off the
path from ``append`` to publication, but still its own time (STMV appends took 21.7-22.4 ms,
8.3-9.0 ms since); a fetch paid the faults while the bytes arrived (the file API's cross-node
JAC latency: 3.3 ms on that VM, 1.5-1.7 ms since, :class:`~instride.store.recvpool.ReceivePool`).

So a helper thread makes the file, at ``SCHED_IDLE`` (it runs only when no other thread wants
the CPU): it creates the file and writes zeros into it (``pwrite``: every page allocated and
touched — one only ``fallocate``'d is cleared at its first use, by the producer — and no memory
mapping of the process involved). The helper is a native thread (``csrc/local/spare.c``): a
Python thread must take the GIL to return from the system call, and a starved idle thread
holding the GIL would stop the producer (tried: the next ``append`` waited ~0.5 ms for it).
Nobody waits for the helper: a file not ready yet is made the usual way, and the helper's file
goes to a later frame.
"""

from __future__ import annotations

import os
from typing import Any

from ..native import library

__all__ = ["SpareMaker"]


class SpareMaker:
    """A file of ``size`` bytes made at a time by a ``SCHED_IDLE`` helper thread.

    :meth:`ask` for one (the path to create), :meth:`take` it once it is ready (a descriptor
    open read-write, its pages allocated), :meth:`close` to stop: a file made and not taken
    is deleted. Without ``libinstride_local.so`` nothing is made (:meth:`take` says so).
    """

    def __init__(self) -> None:
        self._lib = library()
        self._handle: Any = None  # the helper's handle, while a file is asked for
        self._path, self._size = "", 0

    @property
    def pending(self) -> bool:
        """Whether a file was asked for and not taken yet (made or not)."""
        return self._handle is not None

    @property
    def ready(self) -> bool:
        """Whether the file asked for is made (:meth:`take` returns it at once)."""
        return self._handle is not None and bool(self._lib.isl_spare_ready(self._handle))

    def ask(self, path: str, size: int) -> None:
        """Have the helper make the file ``path`` of ``size`` bytes (unless one is pending)."""
        if self._handle is not None or self._lib is None:
            return
        self._handle = self._lib.isl_spare_start(os.fsencode(path), size) or None
        self._path, self._size = path, size

    def take(self, size: int) -> tuple[str, int] | None:
        """The file made, as ``(path, descriptor)``, if it is ready and of ``size`` bytes;
        else ``None`` (a ready file of another size, or one that failed, is dropped; one not
        ready yet stays asked for)."""
        if not self.ready:
            return None
        if self._size != size:
            self.close()
            return None
        handle, self._handle = self._handle, None
        fd = self._lib.isl_spare_take(handle)
        return None if fd < 0 else (self._path, fd)

    def close(self) -> None:
        """Give up the file asked for: deleted now if made, else by the helper once done."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._lib.isl_spare_drop(handle)
