"""Per-thread state that a forked child does not inherit.

Connections kept per thread (the lean Redis connection, a subscriber, kept-alive sockets to
peers) must not be shared with a child made by ``fork`` (``multiprocessing``'s default on
Linux): parent and child would write requests on one socket and read each other's replies —
the one that loses the race waits for a reply that never comes. :class:`PerThread` is a
``threading.local`` that starts empty again in a new process, so the child opens its own.

A fork is noticed through :func:`os.register_at_fork` (a count of the forks this process
descends from), not by comparing :func:`os.getpid` on every use: that is a system call, and a
stream's reader made seven of them per frame (a fork that bypasses Python's ``os.fork``, from
C, is not seen; its child must not use the parent's instride objects).
"""

from __future__ import annotations

import os
import threading

#: forks between the interpreter's start and this process (0 in the original process)
_forks = 0
#: this process's id (os.getpid is a system call each time), a forked child's own
_pid = os.getpid()


def _forked() -> None:
    global _forks, _pid
    _forks += 1
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def forks() -> int:
    """How many forks this process descends from (changes in a forked child)."""
    return _forks


def pid() -> int:
    """:func:`os.getpid` without its system call (kept, and set again in a forked child)."""
    return _pid


class PerThread:
    """A :class:`threading.local` per process: :meth:`get` is empty again after a fork."""

    def __init__(self) -> None:
        self._forks = _forks
        self._local = threading.local()

    def get(self) -> threading.local:
        """This thread's namespace in this process."""
        if self._forks != _forks:  # a forked child: forget the parent's objects (not close)
            self._forks, self._local = _forks, threading.local()
        return self._local


__all__ = ["PerThread", "forks"]
