"""What an archive format implements, and the lookup of a format by file suffix."""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import os
from pathlib import Path
from typing import Protocol

import numpy as np

from ..errors import ArchiveError, ConfigError
from ..frames import Frame

#: file suffix -> "module:Writer,Reader" of the format
FORMATS: dict[str, str] = {
    ".h5": "instride.archive.h5md:H5mdWriter,H5mdReader",
    ".h5md": "instride.archive.h5md:H5mdWriter,H5mdReader",
}


class ArchiveWriter(Protocol):
    """Appends frames of one stream to an archive file; reopening an existing file resumes it.

    One writer per file at a time (:func:`lock_writer`); a file that is not an archive of
    the stream, or that holds frames of another run of it, is refused
    (:class:`~instride.errors.ArchiveError`).
    """

    #: the id of the stream's run whose frames are appended (:meth:`instride.Stream.run_id`),
    #: recorded in a new file; ``None`` until known (set before the first append)
    run: str | None

    def append(self, index: int, frame: Frame) -> None:
        """Append stream frame ``index``: all of it, or (raising) nothing."""

    def flush(self) -> None:
        """Make every appended frame durable: it survives a crash of this process."""

    def indices(self) -> np.ndarray:
        """Stream indices of the frames in the file, ascending."""

    def close(self) -> None:
        """Flush and close."""

    @staticmethod
    def check_own(path: Path, stream: str) -> None:
        """Raise :class:`~instride.errors.ArchiveError` unless ``path`` is an archive that
        names ``stream`` (not a regular file, not one of this format, another stream's, one
        that names no stream)."""


class ArchiveReader(Protocol):
    """Random access to the frames of an archive (also while it is being written)."""

    def run(self) -> str | None:
        """The id of the stream's run whose frames the file holds (``None``: not recorded)."""

    def indices(self) -> np.ndarray:
        """Stream indices of the frames in the file, ascending (refreshed on each call)."""

    def read(self, index: int) -> Frame | None:
        """Stream frame ``index``; ``None`` if the file does not hold it."""

    def close(self) -> None:
        """Close the file."""


def _classes(path: str | os.PathLike[str]) -> tuple[type, type]:
    suffix = Path(path).suffix.lower()
    target = FORMATS.get(suffix)
    if target is None:
        raise ConfigError("archive", os.fspath(path), f"unknown archive format; suffixes: {sorted(FORMATS)}")
    module, _, names = target.partition(":")
    writer, reader = names.split(",")
    mod = importlib.import_module(module)
    return getattr(mod, writer), getattr(mod, reader)


def open_writer(path: str | os.PathLike[str], stream: str, *,
                lock: int | None = None, run: str | None = None) -> ArchiveWriter:
    """The writer of the format named by ``path``'s suffix (creating or resuming the file)
    of stream ``stream``'s frames; ``lock``: the file's writer lock, taken already
    (:func:`lock_writer`), which the writer holds from then on (let go of with it, also when
    it fails to open); ``run``: the stream's run (see :class:`ArchiveWriter`)."""
    try:
        writer = _classes(path)[0]
    except BaseException:
        if lock is not None:
            unlock_writer(Path(path), lock)
        raise
    return writer(Path(path), stream, lock=lock, run=run)  # type: ignore[no-any-return]


def remove_earlier_run(path: str | os.PathLike[str], stream: str, lock: int) -> None:
    """Remove ``stream``'s archive ``path`` for a new run of the stream (``overwrite=True``:
    resumed, it would keep the earlier run's frames). Only an archive of that very stream, and
    only under the file's writer lock ``lock`` (:func:`lock_writer`, taken by the caller, who
    keeps it): no archiver writes it meanwhile. Nothing there (a link to nothing, too): nothing
    to remove.

    Raises
    ------
    ArchiveError
        It is not an archive of ``stream`` (not a regular file, not an archive, another
        stream's, one that names no stream, one this process or another holds open so that
        it cannot be looked at), or it cannot be removed: it is left as it is.
    """
    path = Path(path)
    if not os.path.exists(path):
        return
    try:
        _classes(path)[0].check_own(path, stream)
    except ArchiveError as exc:
        if not os.path.exists(path):  # (gone meanwhile: nothing to keep)
            return
        raise ArchiveError(stream, path, "cannot replace it with overwrite=True, left as it "
                                         f"is: {exc.detail}", busy=exc.busy) from None
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # (a read-only file system, an immutable file: named, typed)
        raise ArchiveError(stream, path, f"cannot replace it with overwrite=True: "
                                         f"{exc.strerror}") from None


def check_format(path: str | os.PathLike[str]) -> None:
    """Raise :class:`~instride.errors.ConfigError` where ``path``'s suffix names no format."""
    _classes(path)


def open_reader(path: str | os.PathLike[str], stream: str | None = None) -> ArchiveReader:
    """The reader of the format named by ``path``'s suffix; ``stream``: refuse an archive of
    another stream."""
    return _classes(path)[1](Path(path), stream)  # type: ignore[no-any-return]


def check_run(stream: str, path: str | os.PathLike[str], held: str | None, frames: int,
              run: str | None) -> None:
    """Refuse an archive that holds ``frames`` frames of run ``held`` to be continued with
    frames of the stream's run ``run`` (``None``: no producer started yet, so ``held`` is an
    earlier one; ``""``: a producer that records no run, and ``held`` ``None``: a file that
    records none — no check then).

    Raises
    ------
    ArchiveError
        The file holds frames of another run of the stream.
    """
    if held and frames and run != "" and held != run:
        now = ("the stream has no producer now, so an earlier run's" if run is None
               else f"the stream's run now is {run}")
        raise ArchiveError(stream, path,
                           f"it holds {frames} frame(s) of another run of the stream (run {held};"
                           f" {now}): resumed, it would keep that run's frames and skip this "
                           "run's as far as that one went. Give each run its own file, or "
                           "remove this one")


def _lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


def lock_writer(path: Path, stream: str) -> int:
    """Become the one writer of archive ``path``: an exclusive ``flock`` on ``.NAME.lock``
    beside it, held until :func:`unlock_writer` (or until the process ends, however it ends).

    Returns
    -------
    int
        The lock file's descriptor.

    Raises
    ------
    ArchiveError
        Another writer (an archiver of any stream or group) holds ``path``, its directory
        does not exist (it is not made), or the lock file cannot be made.
    """
    lock = _lock_path(path)
    # (missing directories are not made: a failed or mistyped archive would leave them behind)
    # (one that is not a directory: refused by the open below)
    if not lock.parent.exists():
        raise ArchiveError(stream, path, f"its directory {lock.parent} does not exist")
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ArchiveError(stream, path, f"cannot make its writer's lock file {lock}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            st = os.fstat(fd)
            try:
                now = os.stat(lock, follow_symlinks=False)
            except FileNotFoundError:
                now = None
        except BlockingIOError:
            os.close(fd)
            raise ArchiveError(stream, path, f"another archiver is writing it (it holds {lock})") from None
        except BaseException:
            os.close(fd)
            raise
        if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            return fd
        os.close(fd)  # its writer removed it as it let go: lock the file there now


def unlock_writer(path: Path, fd: int) -> None:
    """Let go of the lock :func:`lock_writer` took (its file removed first, while held)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_lock_path(path))
    os.close(fd)
