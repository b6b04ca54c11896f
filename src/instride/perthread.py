"""Per-thread state that a forked child does not inherit.

Connections kept per thread (the lean Redis connection, a subscriber, kept-alive sockets to
peers) must not be shared with a child made by ``fork`` (``multiprocessing``'s default on
Linux): parent and child would write requests on one socket and read each other's replies —
the one that loses the race waits for a reply that never comes. :class:`PerThread` is a
``threading.local`` that starts empty again in a new process, so the child opens its own.
"""

from __future__ import annotations

import os
import threading


class PerThread:
    """A :class:`threading.local` per process: :meth:`get` is empty again after a fork."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._local = threading.local()

    def get(self) -> threading.local:
        """This thread's namespace in this process."""
        if os.getpid() != self._pid:  # a forked child: forget the parent's objects (not close)
            self._pid, self._local = os.getpid(), threading.local()
        return self._local


__all__ = ["PerThread"]
