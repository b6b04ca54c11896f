"""A stream reader's inbox: frames fetched from another node into reusable memory of its own.

A bounded stream's group reader drops each frame it fetched once it moves on, so storing the
frame as a file on its node (a staged file, a rename to the key, a sidecar, a lock, the receive
pool, then all of it undone at the release) buys nothing but system calls — ~40 per frame. The
reader instead receives each frame into an anonymous memory file (``memfd``) mapped once and
reused: the bytes are hashed on the way in as always, and the frame's arrays are views of the
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
    """One reusable buffer: a memory file and its read-only mapping."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("instride-frame", os.MFD_CLOEXEC)
        self._map: mmap.mmap | None = None
        self._mapped = 0
        self.held = False

    def rewound(self) -> int:
        """The descriptor, at offset 0 (a fetch writes the next frame from there)."""
        os.lseek(self.fd, 0, os.SEEK_SET)
        return self.fd

    def view(self, size: int) -> memoryview:
        """The first ``size`` bytes written (a larger frame than before maps the buffer anew)."""
        if size > self._mapped or self._map is None:
            self._map = mmap.mmap(self.fd, size, prot=mmap.PROT_READ)
            self._mapped = size
        return memoryview(self._map)[:size]

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
