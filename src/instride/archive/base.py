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
    the stream is refused (:class:`~instride.errors.ArchiveError`).
    """

    def append(self, index: int, frame: Frame) -> None:
        """Append stream frame ``index``: all of it, or (raising) nothing."""

    def flush(self) -> None:
        """Make every appended frame durable: it survives a crash of this process."""

    def indices(self) -> np.ndarray:
        """Stream indices of the frames in the file, ascending."""

    def close(self) -> None:
        """Flush and close."""


class ArchiveReader(Protocol):
    """Random access to the frames of an archive (also while it is being written)."""

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
                lock: int | None = None) -> ArchiveWriter:
    """The writer of the format named by ``path``'s suffix (creating or resuming the file)
    of stream ``stream``'s frames; ``lock``: the file's writer lock, taken already
    (:func:`lock_writer`), which the writer holds from then on (let go of with it, also when
    it fails to open)."""
    try:
        writer = _classes(path)[0]
    except BaseException:
        if lock is not None:
            unlock_writer(Path(path), lock)
        raise
    return writer(Path(path), stream, lock=lock)  # type: ignore[no-any-return]


def check_format(path: str | os.PathLike[str]) -> None:
    """Raise :class:`~instride.errors.ConfigError` where ``path``'s suffix names no format."""
    _classes(path)


def open_reader(path: str | os.PathLike[str], stream: str | None = None) -> ArchiveReader:
    """The reader of the format named by ``path``'s suffix; ``stream``: refuse an archive of
    another stream."""
    return _classes(path)[1](Path(path), stream)  # type: ignore[no-any-return]


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
        Another writer (an archiver of any stream or group) holds ``path``, or the lock
        file cannot be made.
    """
    lock = _lock_path(path)
    while True:
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
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
