"""The durable tier of streams: archive file formats (the archiver is :mod:`instride.archiver`).

An archiver reads a stream as the consumer group ``"archive"`` and appends every frame to a
file (H5MD, which MDAnalysis reads). It acknowledges a frame (moves its group on) only after
the frame is flushed to the file, so frames retired from memory stay readable: a stream's
:meth:`~instride.Stream.read` — and so ``mda.Universe(top, "instride://run")`` — serves
recent frames from memory and older ones from the archive.

Formats plug in by file suffix (:data:`FORMATS`): a writer and a reader behind the small
protocols of :mod:`instride.archive.base`.
"""

from __future__ import annotations

from .base import FORMATS, ArchiveReader, ArchiveWriter, open_reader, open_writer
from .process import start_archiver

__all__ = ["FORMATS", "ArchiveReader", "ArchiveWriter", "open_reader", "open_writer", "start_archiver"]
