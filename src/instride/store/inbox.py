"""A stream reader's inbox: frames fetched from another node into reusable memory of its own.

A bounded stream's group reader drops each frame it fetched once it moves on, so storing the
frame as a file on its node (a staged file, a rename to the key, a sidecar, a lock, the receive
pool, then all of it undone at the release) buys nothing but system calls — ~40 per frame. The
reader instead receives each frame straight into a shared mapping of an anonymous memory file
(``memfd``), mapped once and reused — no copy through a buffer, no ``write``, no page faults
after the first frame: the bytes are hashed on the way in as always, and the frame's arrays are views of the
mapping until the reader moves on or releases the frame, as with a frame read in place.

A buffer is reused only once its frame was released; a reader that holds several frames at once
(``Stream.read`` without iterating) gets a buffer per frame it holds. A buffer grows for a larger
frame but never shrinks, so a stale view of a released frame never faults.
"""

from __future__ import annotations

import contextlib
import mmap
import os


class InboxBuffer:
    """One reusable buffer: a memory file and a shared mapping of it."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("instride-frame", os.MFD_CLOEXEC)
        self._map: mmap.mmap | None = None
        self._mapped = 0
        self.held = False

    def rewound(self) -> int:
        """The descriptor, at offset 0 (a fetch that does not fit :meth:`writable` writes the
        frame from there)."""
        os.lseek(self.fd, 0, os.SEEK_SET)
        return self.fd

    def writable(self, size: int) -> memoryview:
        """The buffer's memory, at least ``size`` bytes, to receive a frame into (its pages are
        allocated by the first frame and reused by the next ones)."""
        if size > self._mapped or self._map is None:
            self._remap(size)
        assert self._map is not None
        return memoryview(self._map)

    def view(self, size: int) -> memoryview:
        """The frame's ``size`` bytes (received into memory, or written through the descriptor)."""
        if size > self._mapped or self._map is None:
            self._remap(size)
        assert self._map is not None
        return memoryview(self._map)[:size]

    def _remap(self, size: int) -> None:
        """Map ``size`` bytes anew (grown, never shrunk: a stale view of an earlier, smaller
        frame stays within the file)."""
        if os.fstat(self.fd).st_size < size:
            os.ftruncate(self.fd, size)
        self._map = mmap.mmap(self.fd, size)
        self._mapped = size

    def release(self) -> None:
        """The frame in it is released: the buffer may take the next one."""
        self.held = False

    def close(self) -> None:
        """Close the descriptor (a mapping still viewed stays valid until its views go)."""
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self._map = None


class Inbox:
    """The reusable receive buffers of one stream reader."""

    def __init__(self) -> None:
        self._buffers: list[InboxBuffer] = []

    def take(self) -> InboxBuffer:
        """A buffer no frame is held in (a new one if every buffer holds one), now held."""
        for buf in self._buffers:
            if not buf.held:
                buf.held = True
                return buf
        buf = InboxBuffer()
        buf.held = True
        self._buffers.append(buf)
        return buf

    def close(self) -> None:
        """Close every buffer."""
        for buf in self._buffers:
            buf.close()
        self._buffers.clear()


__all__ = ["Inbox", "InboxBuffer"]
