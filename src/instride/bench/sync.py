"""Explicit producer/consumer synchronization with MPI: one barrier per pair and frame.

This is the synchronization the paper's file-system baselines use (XFS, Lustre): the producer
writes a frame, then enters an ``MPI_Barrier`` with its consumer; the consumer enters the
barrier, then reads the frame. Each pair has its own two-rank communicator, made with
``MPI.COMM_WORLD.Split(color=pair)``.

The barrier is ``MPI_Ibarrier`` completed by a test-and-sleep loop rather than a blocking
``MPI_Barrier``: MPICH's blocking barrier spins on the CPU, and with up to 32 ranks on 2 cores a
spinning rank steals the core its partner needs to reach the barrier. Polling every
:data:`POLL_SECONDS` adds at most that much to each barrier's exit, counted as idle time.
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import InstrideError

#: Seconds between two tests of a pending barrier.
POLL_SECONDS = 5e-5

#: How the file-system backends synchronize a pair (instride needs no user synchronization):
#: see :mod:`instride.bench.workflow`. Here, not there: the package imports it, and the ranks
#: run ``python -m instride.bench.workflow``, which must not be imported before it runs.
SYNC_MODES = ("serialized", "pipelined")


class SyncTimeout(InstrideError, TimeoutError):
    """A barrier did not complete in time (a partner died or hung).

    Parameters
    ----------
    pair
        The pair of the rank that gave up.
    waited
        Seconds it waited.
    what
        Which barrier (``"barrier"``: the pair's; ``"start line"``, ``"end line"``: every
        rank's, see :func:`start_line`).
    """

    def __init__(self, pair: int, waited: float, what: str = "barrier") -> None:
        self.pair = pair
        self.waited = waited
        self.what = what
        super().__init__(f"pair {pair}: {what} not completed after {waited:.1f} s")


def start_line(comm: Any, pair: int, timeout: float | None, what: str = "start line") -> None:
    """A barrier of every rank of ``comm`` that sleeps instead of spinning while others come.

    Parameters
    ----------
    comm
        ``MPI.COMM_WORLD``; collective.
    pair
        This rank's pair (for the error).
    timeout
        Seconds to wait before :class:`SyncTimeout` (``None``: forever).
    what
        The barrier's name in the error.
    """
    req = comm.Ibarrier()
    start = time.perf_counter()
    while not req.Test():
        if timeout is not None and time.perf_counter() - start > timeout:
            # (the pending request is left to MPI_Abort, which the failed rank calls)
            raise SyncTimeout(pair, time.perf_counter() - start, what)
        time.sleep(POLL_SECONDS * 20)


class PairBarrier:
    """A barrier between the producer and the consumer of one pair.

    Parameters
    ----------
    comm
        ``MPI.COMM_WORLD`` (or any communicator holding every rank); collective.
    pair
        This rank's pair number (the ``color`` of the split).
    role_key
        Ordering within the pair: 0 for the producer, 1 for the consumer.
    timeout
        Seconds a barrier may take before :class:`SyncTimeout` (``None``: forever).
    """

    def __init__(self, comm: Any, pair: int, role_key: int, timeout: float | None = None) -> None:
        self.pair = pair
        self.timeout = timeout
        self.comm = comm.Split(pair, role_key)
        if self.comm.Get_size() != 2:
            raise InstrideError(
                f"pair {pair} has {self.comm.Get_size()} ranks; "
                "expected one producer + one consumer"
            )

    def wait(self) -> None:
        """Enter the barrier and return when the partner has entered it too."""
        req = self.comm.Ibarrier()
        if req.Test():
            return
        start = time.perf_counter()
        while not req.Test():
            if self.timeout is not None and time.perf_counter() - start > self.timeout:
                raise SyncTimeout(self.pair, time.perf_counter() - start)
            time.sleep(POLL_SECONDS)

    def free(self) -> None:
        """Release the pair communicator."""
        self.comm.Free()


__all__ = ["POLL_SECONDS", "SYNC_MODES", "PairBarrier", "SyncTimeout", "start_line"]
