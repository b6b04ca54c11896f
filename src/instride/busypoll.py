"""Busy-polling before sleeping: the mechanism behind ``INSTRIDE_SPIN`` and ``Stream(spin=)``.

Waking a thread that sleeps in the kernel (in ``read`` on an inotify descriptor, in ``recv`` on
a socket) costs ~100–400 µs on an idle virtual machine, where the vCPU halted; a thread that
polls sees the event within a few µs, at the price of a core kept busy for as long as it polls —
the trade MPI progress engines and UCX make by default. Every wait of instride sleeps at once
unless a spin is asked for.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["poll_paths", "poll_readable", "recv_polling"]


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


def poll_readable(sock: socket.socket, seconds: float) -> bool:
    """Poll ``sock`` for up to ``seconds`` until it has data to read (or the peer closed it).

    Nothing is consumed (``MSG_PEEK``): the caller's next ``recv`` returns at once.
    """
    return recv_polling(sock, 1, seconds, socket.MSG_PEEK) is not None
