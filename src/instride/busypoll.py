"""Busy-polling before sleeping: the mechanism behind ``INSTRIDE_SPIN`` and ``Stream(spin=)``.

Waking a thread that sleeps in the kernel (in ``read`` on an inotify descriptor, in ``recv`` on
a socket) costs ~100–400 µs on an idle virtual machine, where the vCPU halted; a thread that
polls sees the event within a few µs, at the price of a core kept busy for as long as it polls —
the trade MPI progress engines and UCX make by default. Every wait of instride sleeps at once
unless a spin is asked for.

Between the two, :class:`Cadence` does what Linux's hybrid polling of fast block devices does
(sleep for about the expected wait, then poll): a stream's reader that learned how regularly
its frames come sleeps until shortly before the next one is due and polls only around that
moment — the latency of a polling reader for a small share of a core.
"""

from __future__ import annotations

import os
import select
import socket
import statistics
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Cadence", "poll_paths", "poll_readable", "poll_readable_in", "recv_polling"]

#: bounds of the time a :class:`Cadence` polls before (and after) a frame is due, seconds
LEAD_MIN, LEAD_MAX = 0.0003, 0.005


def poll_paths(paths: Sequence[str | Path], seconds: float) -> str | Path | None:
    """Poll for up to ``seconds`` until one of ``paths`` exists; return it, else ``None``."""
    if seconds <= 0:
        return None
    access, ok = os.access, os.F_OK  # not os.path.exists: it raises and catches per miss
    clock = time.monotonic
    end = clock() + seconds
    while True:
        for path in paths:
            if access(path, ok):
                return path
        if clock() >= end:
            return None


def recv_polling(sock: socket.socket, bufsize: int, seconds: float, flags: int = 0) -> bytes | None:
    """Poll ``sock`` for up to ``seconds`` with non-blocking ``recv`` (``flags`` passed on).

    Returns
    -------
    bytes or None
        What arrived (``b""``: the peer closed the connection), or ``None`` when nothing
        came within ``seconds``. The socket's timeout is restored either way.
    """
    if seconds <= 0:
        return None
    old = sock.gettimeout()
    sock.settimeout(0.0)
    clock = time.monotonic
    end = clock() + seconds
    try:
        while True:
            try:
                return sock.recv(bufsize, flags)
            except BlockingIOError:
                if clock() >= end:
                    return None
    finally:
        sock.settimeout(old)


def arrived(sock: socket.socket, n: int) -> bytes:
    """Up to ``n`` bytes that have arrived on ``sock`` already, without waiting (``b""``:
    nothing yet, the peer closed, or a socket without a timeout; the caller's usual receive,
    which waits, says which).

    A socket with a timeout is non-blocking underneath (Python keeps it so in timeout mode),
    yet its ``recv`` polls first, and changing its timeout costs an ``ioctl`` each way: this
    reads its descriptor directly — a stream's reader and producer do it once per frame.
    """
    if not sock.gettimeout():
        return b""
    try:
        return os.read(sock.fileno(), n)
    except (BlockingIOError, InterruptedError):
        return b""


def poll_readable_in(sock: socket.socket, window: tuple[float, float]) -> bool:
    """Sleep until ``sock`` has data to read or ``window[0]`` comes (``time.monotonic()``),
    then poll it until ``window[1]``; whether it has data (nothing is consumed)."""
    start, end = window
    left = start - time.monotonic()
    if left > 0:
        # poll() counts whole milliseconds, rounded up: up to 1 ms past the window's start
        # (as wide as a window may be). Whole ms asleep on the socket, the rest (< 1 ms,
        # before the window: nothing is due yet) in a precise sleep.
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        if poller.poll(int(min(left, 3600.0) * 1000)):
            return True
        rest = start - time.monotonic()
        if rest > 0:
            time.sleep(rest)
    return poll_readable(sock, end - time.monotonic())


def poll_readable(sock: socket.socket, seconds: float) -> bool:
    """Poll ``sock`` for up to ``seconds`` until it has data to read (or the peer closed it).

    Nothing is consumed (``MSG_PEEK``): the caller's next ``recv`` returns at once.
    """
    return recv_polling(sock, 1, seconds, socket.MSG_PEEK) is not None


class Cadence:
    """When a stream's next frame is due, learned from the arrivals of the last ones.

    Frames that arrive on their own (local mode): only frames a reader waited for count, as
    their arrival is (within a wake-up) their publication; a frame found already there says
    nothing about the producer's pace (the reader was behind), and no gap is measured across
    it. Frames fetched from another node carry their publication time (the producer's
    clock): every frame counts then, the gaps are taken between publication times, and the
    due time on this node's clock is the next publication plus the smallest delay seen
    lately between a publication and the frame's arrival here (clock offset and transfer;
    frames that waited here only add to it, so the smallest is the one to go by).

    Parameters
    ----------
    keep
        Gaps (and delays) remembered; the median gap is the cadence.
    """

    def __init__(self, keep: int = 8) -> None:
        self._gaps: deque[float] = deque(maxlen=keep)
        self._delays: deque[float] = deque(maxlen=keep)
        self._last: tuple[int, float] | None = None  # (index, arrival or publication time)
        self._published: bool | None = None  # which clock the times are on

    def arrived(self, index: int, when: float, *, waited: bool,
                published: float | None = None) -> None:
        """Frame ``index`` was seen at ``when`` (``time.monotonic()``); ``waited``: the reader
        had to wait for it; ``published``: its publication time (``time.time()`` of the
        producer), where known — then ``waited`` does not matter. Frames of one kind and the
        other (a reader that found one frame on its node and fetched the next) are not
        mixed: what was learned from the other kind is forgotten."""
        if self._published is not (published is not None):
            self._gaps.clear()
            self._delays.clear()
            self._last = None
            self._published = published is not None
        if published is not None:
            if self._last is not None and index > self._last[0]:
                self._gaps.append((published - self._last[1]) / (index - self._last[0]))
            self._delays.append(when - published)
            self._last = (index, published)
            return
        if waited and self._last is not None and index > self._last[0]:
            self._gaps.append((when - self._last[1]) / (index - self._last[0]))
        self._last = (index, when) if waited else None

    def window(self, index: int) -> tuple[float, float] | None:
        """``(start, end)`` on the ``time.monotonic()`` clock between which to poll for frame
        ``index`` (sleeping before), or ``None`` while the cadence is unknown (fewer than three
        gaps measured, or the last frame was not waited for).

        The window reaches ``lead`` either side of the frame's due time: 5 % of the gap plus
        three median absolute deviations of the recent gaps (how irregular the producer is),
        within :data:`LEAD_MIN` … :data:`LEAD_MAX`.
        """
        if len(self._gaps) < 3 or self._last is None or index <= self._last[0]:
            return None
        gap = statistics.median(self._gaps)
        spread = statistics.median(abs(g - gap) for g in self._gaps)
        lead = min(max(0.05 * gap + 3 * spread, LEAD_MIN), LEAD_MAX)
        due = self._last[1] + gap * (index - self._last[0])
        if self._delays:  # (publication times: onto this node's clock)
            due += min(self._delays)
        return due - lead, due + lead
