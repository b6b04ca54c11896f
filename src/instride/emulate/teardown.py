"""Teardown of emulated clusters that a signal cannot cut short or skip.

* :class:`TornDownOnSigterm`: inside a ``with`` block, a SIGTERM (``timeout``, a batch
  system, a stopped CI job) takes the cluster down first, then ends the process as the signal
  would have: without it, the process would die at once and leave its namespaces and daemons
  behind. Only where nobody else handles SIGTERM, and only in the main thread (where Python
  runs handlers).
* :func:`signals_held`: SIGTERM, SIGINT and SIGHUP held back while a teardown runs (a second
  signal, or one raised as an exception by the ``instride`` command, would otherwise interrupt
  it half-way); the first one delivered again once it is done.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any, Protocol


class _Downable(Protocol):
    def down(self) -> None: ...


#: clusters inside a ``with`` block of this process's main thread, innermost last
_LIVE: list[_Downable] = []
#: with-blocks of _LIVE taking their cluster down right now; a SIGTERM meanwhile waits for them
_EXITING = [0]
#: a SIGTERM that came while a with-block took its cluster down (re-delivered after it)
_PENDING: list[int] = []


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGTERM, SIGINT and SIGHUP back in the block: taken in by a handler that notes
    them (not masked: a mask is the calling thread's only, and the programs started meanwhile
    would inherit it); the first one that came goes, after the block, to the handler the
    program had. Only in the main thread (where Python runs handlers). A signal the program
    ignores stays ignored (SIGHUP under ``nohup``: the programs started inherit that)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []

    def note(signum: int, frame: Any) -> None:
        came.append(signum)

    # (SIGHUP too: the `instride` command raises it as an exception, as it does SIGTERM)
    previous = {s: signal.signal(s, note)
                for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
                if signal.getsignal(s) != signal.SIG_IGN}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if came:  # (the program's handler called here: a signal sent again to this process
            handler = previous[came[0]]  # could reach another thread after a later reset)
            if callable(handler):
                handler(came[0], None)
            elif handler == signal.SIG_DFL:
                signal.signal(came[0], signal.SIG_DFL)
                os.kill(os.getpid(), came[0])


def _unwind(signum: int, frame: Any) -> None:
    """SIGTERM inside ``with``: take every such cluster down, then die of the signal, as it
    would have ended the process (a handler that raised instead could be swallowed by a
    program that catches every exception, and its cluster left up)."""
    if _EXITING[0]:  # (one is being taken down: let it finish, then die)
        _PENDING.append(signum)
        return
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (a second SIGTERM does not cut it short)
    for cluster in reversed(_LIVE):
        with contextlib.suppress(Exception):
            cluster.down()
    _LIVE.clear()
    _die(signum)


def _die(signum: int) -> None:
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    raise SystemExit(128 + signum)  # (only if the signal is blocked in this thread)


class TornDownOnSigterm:
    """``with`` support for a cluster with ``up()`` and ``down()``: taken down by a SIGTERM
    inside the block (see the module docstring)."""

    def __enter__(self) -> Any:
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, _unwind):
            signal.signal(signal.SIGTERM, _unwind)
            _LIVE.append(self)  # (before up(): a SIGTERM during it removes what it made)
        try:
            return self.up()  # type: ignore[attr-defined]
        except BaseException:
            self._leave()
            raise

    def __exit__(self, *exc: object) -> None:
        _EXITING[0] += 1
        try:
            self.down()  # type: ignore[attr-defined]
        finally:
            _EXITING[0] -= 1
            self._leave()
            if _PENDING and not _EXITING[0]:  # (a SIGTERM came meanwhile: as it would have)
                _unwind(_PENDING.pop(), None)

    def _leave(self) -> None:
        """Out of the with-block: no longer taken down by a SIGTERM; the default handling of
        SIGTERM back after the last such block (unless the program set its own meanwhile)."""
        if self in _LIVE:
            _LIVE.remove(self)
            if not _LIVE and signal.getsignal(signal.SIGTERM) is _unwind:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
