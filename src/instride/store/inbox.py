"""A stream reader's inbox: frames fetched from another node into reusable memory of its own.

A bounded stream's group reader drops each frame it fetched once it moves on, so storing the
frame as a file on its node (a staged file, a rename to the key, a sidecar, a lock, the receive
pool, then all of it undone at the release) buys nothing but system calls — ~40 per frame. The
reader instead receives each frame straight into a shared mapping of an anonymous memory file
(``memfd``), mapped once and reused — no copy through a buffer, no ``write``, no page faults
after the first frame: the bytes are hashed on the way in as always, and the frame's arrays are views of the
mapping until the reader moves on or releases the frame, as with a frame read in place.

A buffer is reused only once its frame was released; a reader that holds several frames at once
(``Stream.read`` without iterating) gets a buffer per frame it holds, and the free ones beyond
two are closed as those frames are released. A child made by ``fork`` never receives into its
parent's buffers (shared mappings: the parent's frames would change under it): it makes its
own. A buffer grows for a larger frame but never shrinks, so a stale view of a released frame
never faults. The frame's arrays are read-only views, as those of a frame read in place.

A buffer's pages are allocated (``fallocate``) before it is mapped, as a frame file's are
(:func:`~instride.store.dirs.allocate`): where the memory for them cannot be had, growing the
buffer raises ``OSError`` (``ENOMEM``, ``ENOSPC``) naming it, instead of a ``SIGBUS`` at the
first store into a page that has none, which kills the reader.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from collections.abc import Callable

from ..perthread import forks
from .dirs import allocate

#: what an error about a buffer calls it (a memory file has no path)
NAME = "memfd:instride-frame (a stream reader's receive buffer)"
#: free buffers an inbox keeps for the next frames (more are closed as frames are released)
KEEP_FREE = 2


class InboxBuffer:
    """One reusable buffer: a memory file, a writable shared mapping to receive into, and a
    read-only one the frame's arrays are views of."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("instride-frame", os.MFD_CLOEXEC)
        self._closer = weakref.finalize(self, os.close, self.fd)
        self._rw: mmap.mmap | None = None
        self._ro: mmap.mmap | None = None
        self._mapped = 0
        self.held = False
        #: the address of the writable mapping (for a native receive into it), 0 unmapped
        self.address = 0
        self._pin: ctypes.c_char | None = None  # (what holds that address valid)

    def rewound(self) -> int:
        """The descriptor, at offset 0 (a fetch that does not fit :meth:`writable` writes the
        frame from there)."""
        os.lseek(self.fd, 0, os.SEEK_SET)
        return self.fd

    def writable(self, size: int) -> memoryview:
        """The buffer's memory, at least ``size`` bytes, to receive a frame into (its pages are
        allocated by the first frame and reused by the next ones)."""
        self._fit(size)
        assert self._rw is not None
        return memoryview(self._rw)

    def view(self, size: int) -> memoryview:
        """The frame's ``size`` bytes, read-only (received into memory, or written through the
        descriptor)."""
        self._fit(size)
        assert self._ro is not None
        return memoryview(self._ro)[:size]

    def _fit(self, size: int) -> None:
        """Map at least ``size`` bytes (grown, never shrunk: a stale view of an earlier, smaller
        frame stays within the file), their pages allocated first.

        Raises
        ------
        OSError
            The memory for the pages cannot be allocated (``ENOMEM``, ``ENOSPC``).
        """
        if size <= self._mapped and self._rw is not None:
            return
        size = max(size, 1)
        if os.fstat(self.fd).st_size < size:
            allocate(self.fd, size, NAME)
        self._rw = mmap.mmap(self.fd, size)
        self._ro = mmap.mmap(self.fd, size, prot=mmap.PROT_READ)
        self._mapped = size
        self._pin = ctypes.c_char.from_buffer(self._rw)
        self.address = ctypes.addressof(self._pin)

    def close(self) -> None:
        """Close the descriptor (a mapping still viewed stays valid until its views go)."""
        self._closer()
        self._rw = self._ro = self._pin = None
        self.address = 0


class Inbox:
    """The reusable receive buffers of one stream reader."""

    def __init__(self) -> None:
        self._buffers: list[InboxBuffer] = []
        self._forks = forks()  # (of the process the buffers are mapped for)

    def take(self) -> tuple[InboxBuffer, Callable[[], None]]:
        """A buffer no frame is held in (a new one if every buffer holds one), now held, and
        the function that releases it — once: a second call does nothing (the buffer may hold
        another frame by then)."""
        if self._forks != forks():
            # A forked child: every buffer is a mapping shared with the parent, whose frames
            # (and next frames) are in them. Its copies are closed (views of them stay valid).
            self._forks = forks()
            self.close()
        buf = next((b for b in self._buffers if not b.held), None)
        if buf is None:
            buf = InboxBuffer()
            self._buffers.append(buf)
        buf.held = True
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                buf.held = False
                self._trim()

        return buf, release

    def _trim(self) -> None:
        """Close free buffers beyond :data:`KEEP_FREE` (after many frames were held at once)."""
        free = [b for b in self._buffers if not b.held]
        for extra in free[KEEP_FREE:]:
            extra.close()
            self._buffers.remove(extra)

    def close(self) -> None:
        """Close every buffer."""
        for buf in self._buffers:
            buf.close()
        self._buffers.clear()


__all__ = ["Inbox", "InboxBuffer"]
