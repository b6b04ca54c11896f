"""Typed errors of parallel trajectory analysis.

Each one subclasses :class:`~instride.errors.InstrideError` and the builtin it refines, so
``except FileNotFoundError`` or ``except ValueError`` still work. All of them pickle and unpickle
to the same type and message, so an error raised in a worker process (multiprocessing) or on
another MPI rank reaches the caller unchanged.
"""

from __future__ import annotations

import errno as _errno
from typing import Any

from ..errors import InstrideError


class _Picklable:
    """Rebuild from the constructor arguments (exceptions pickle ``args`` by default)."""

    _init_args: tuple[Any, ...] = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self._init_args)


class TrajectoryNotFoundError(_Picklable, InstrideError, FileNotFoundError):
    """A topology or trajectory file named as input does not exist."""

    errno = _errno.ENOENT

    def __init__(self, path: str, what: str = "trajectory") -> None:
        self._init_args = (path, what)
        self.path = path
        self.what = what
        super().__init__(_errno.ENOENT, f"{what} file {path!r} does not exist")

    def __str__(self) -> str:
        return f"{self.what} file {self.path!r} does not exist"


class UnsupportedInputError(_Picklable, InstrideError, ValueError):
    """An input the analysis cannot read (unknown format, wrong layout, missing topology...)."""

    errno = _errno.EINVAL

    def __init__(self, source: str, reason: str) -> None:
        self._init_args = (source, reason)
        self.source = source
        self.reason = reason
        super().__init__(f"cannot analyse {source!r}: {reason}")


class SelectionError(_Picklable, InstrideError, ValueError):
    """An atom selection matches no atoms (or cannot be parsed)."""

    errno = _errno.EINVAL

    def __init__(self, selection: str, reason: str = "matches no atoms") -> None:
        self._init_args = (selection, reason)
        self.selection = selection
        self.reason = reason
        super().__init__(f"selection {selection!r} {reason}")


class DecompositionError(_Picklable, InstrideError, ValueError):
    """The frames cannot be split into the requested number of blocks (more ranks than frames)."""

    errno = _errno.EINVAL

    def __init__(self, n_frames: int, n_ranks: int) -> None:
        self._init_args = (n_frames, n_ranks)
        self.n_frames = n_frames
        self.n_ranks = n_ranks
        super().__init__(
            "the input has no frames: there is nothing to analyze" if n_frames == 0 else
            f"cannot split {n_frames} frame(s) into {n_ranks} blocks: every rank needs at least "
            f"one frame; use at most {n_frames} worker(s)"
        )


class BackendError(_Picklable, InstrideError, RuntimeError):
    """A parallel backend cannot run as asked (no mpi4py/mpiexec, worker count mismatch...)."""

    errno = _errno.EINVAL

    def __init__(self, backend: str, reason: str) -> None:
        self._init_args = (backend, reason)
        self.backend = backend
        self.reason = reason
        super().__init__(f"backend {backend!r}: {reason}")


class RankFailedError(_Picklable, InstrideError, RuntimeError):
    """Another rank (or worker) failed; carries its rank and the text of its error."""

    def __init__(self, rank: int, detail: str) -> None:
        self._init_args = (rank, detail)
        self.rank = rank
        self.detail = detail
        super().__init__(f"rank {rank} failed: {detail}")
