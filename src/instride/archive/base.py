"""What an archive format implements, and the lookup of a format by file suffix."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Protocol

import numpy as np

from ..errors import ConfigError
from ..frames import Frame

#: file suffix -> "module:Writer,Reader" of the format
FORMATS: dict[str, str] = {
    ".h5": "instride.archive.h5md:H5mdWriter,H5mdReader",
    ".h5md": "instride.archive.h5md:H5mdWriter,H5mdReader",
}


class ArchiveWriter(Protocol):
    """Appends frames to an archive file; reopening an existing file resumes it."""

    def append(self, index: int, frame: Frame) -> None:
        """Append stream frame ``index``."""

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


def open_writer(path: str | os.PathLike[str]) -> ArchiveWriter:
    """The writer of the format named by ``path``'s suffix (creating or resuming the file)."""
    return _classes(path)[0](Path(path))  # type: ignore[no-any-return]


def open_reader(path: str | os.PathLike[str]) -> ArchiveReader:
    """The reader of the format named by ``path``'s suffix."""
    return _classes(path)[1](Path(path))  # type: ignore[no-any-return]
