"""The archiver: a consumer group that writes every frame of a stream to an archive file.

Examples
--------
Shell (runs until the stream ends; restart it after a crash and it resumes)::

    instride archive run7 --to run7.h5

Python, from the producer (starts the archiver process and waits for it at ``close``)::

    with instride.Stream("run7", mode="w", retain=16, archive="run7.h5") as s:
        ...
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from .archive import open_reader, open_writer
from .archive.base import check_format, check_run, lock_writer, unlock_writer
from .client import Client, get_client
from .errors import ConsumeTimeout, FramesMissed
from .stream import Stream

GROUP = "archive"


@dataclass
class ArchiveReport:
    """What an archiver run did."""

    stream: str
    path: Path
    frames: int  # frames appended by this run
    total: int  # frames in the file
    missed: int  # frames dropped by the stream before the archiver got them
    seconds: float
    ended: bool = True  # False: stopped before the stream's end (its lifeline closed)


def archive_stream(
    stream: str,
    path: str | os.PathLike[str],
    *,
    group: str = GROUP,
    timeout: float | None = None,
    client: Client | None = None,
    progress: bool = False,
    lifeline: int | None = None,
    lock: int | None = None,
) -> ArchiveReport:
    """Append every frame of ``stream`` to ``path`` until the stream ends.

    The archiver reads as consumer group ``group`` and acknowledges a frame (moves the group
    on) only after it is flushed to the file, so under ``on_full="block"`` no frame leaves
    memory before it is in the archive, and a killed archiver loses no acknowledged frame.
    Restarted, it resumes after the last frame in the file.

    The file is this archiver's alone while it runs, and it is refused if it holds anything
    but this stream's archive, before anything is written to it.

    Parameters
    ----------
    stream
        Stream name.
    path
        Archive file (``.h5``/``.h5md``: H5MD).
    group
        Consumer group name.
    timeout
        Seconds to wait for each frame (default ``INSTRIDE_TIMEOUT``, else forever).
    client
        Client to use.
    progress
        Show a progress line on stderr.
    lifeline
        The read end of a pipe whose write end the process that started this archiver
        holds (a producer's ``archive=``). Once no process holds the write end — that
        process died, however — the archiver takes the frames published by then and
        stops (``ended`` false in the report): the stream would never end.
    lock
        The file's writer lock (:func:`~instride.archive.base.lock_writer`'s descriptor),
        taken already by the process that started this archiver (a producer's ``archive=``):
        held from here on, let go of when this returns or raises.

    Returns
    -------
    ArchiveReport

    Raises
    ------
    GroupBusy
        Another live process reads the stream as ``group`` (another archiver of it, to
        another file).
    ArchiveError
        Another archiver writes ``path`` (of any stream or group: refused before this one
        registers its group); ``path`` is not an archive of ``stream`` (not HDF5,
        not an instride archive, another stream's, or one of an older instride that names
        no stream), or holds frames of another run of it (an earlier run's file: see
        :meth:`~instride.Stream.run_id`); a reader holds ``path`` open as it resumes it (HDF5's file lock: the
        readers must close it first); a frame does not fit the archive (another atom count or
        coordinate type): the file keeps every frame before it.
    """
    dest = Path(path).resolve()
    start = time.monotonic()
    try:
        client = client or get_client()
        check_format(dest)
        key = client.key(stream)
        # the run whose frames are archived: a file of another run is refused (and a new file
        # records it; not known before a producer started, then taken with the first frame)
        probe = Stream(stream, client=client)
        try:
            run = probe.run_id()
        finally:
            probe.close()
        if dest.exists():  # not this stream's archive (or run): refused before the group
            held = open_reader(dest, key)
            try:
                check_run(key, dest, held.run(), len(held.indices()), run)
            finally:
                held.close()
    except BaseException:
        if lock is not None:
            unlock_writer(dest, lock)  # (given, and refused before a writer took it over)
        raise
    # The file's writer lock (an flock beside it: the file untouched), then the group, then
    # the file: an archiver refused at the lock registers no group, which would hold the
    # stream's frames for ever (a producer under "block" would wait for it)
    if lock is None:
        lock = lock_writer(dest, key)
    writer = None
    if dest.exists():
        # An existing file is resumed, with every check, before the group is registered: a
        # refusal there (an archive that names no stream, a reader holding it, one that
        # cannot be opened) left a group nobody moves, and a producer under "block" waited
        # for it until StreamFull. (Resuming our own file, locked, harms nothing if the group
        # is then busy.) A new file is made after the group: a busy group makes none.
        writer = open_writer(dest, key, lock=lock, run=run)  # (it holds the lock from here)
    try:
        reader = Stream(stream, group=group, timeout=timeout, on_gap="count", client=client)
    except BaseException:
        if writer is not None:
            writer.close()
        else:
            unlock_writer(dest, lock)
        raise
    if writer is None:
        try:  # (the run checked again: the file may have changed since the look above)
            writer = open_writer(dest, reader.name, lock=lock, run=run)
        except BaseException:
            reader.close()
            raise
    try:  # (a failure here lets go of the writer's lock and file, and of the group)
        done = writer.indices()
        reader.set_archive(dest)
        if len(done) and reader.tell() <= int(done[-1]):
            reader.seek(int(done[-1]) + 1)  # flushed before the crash, not yet acknowledged
    except BaseException:
        reader.close()
        writer.close()
        raise
    appended = 0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc=f"archive {stream}", unit=" frames", disable=None)
    ended = True
    waits = _Waits(reader, timeout if timeout is not None else client.settings.timeout,
                   lifeline)
    try:
        while True:
            try:
                frame = next(reader)
            except StopIteration:
                break
            except FramesMissed:  # counted in reader.missed
                continue
            except ConsumeTimeout:
                if waits.go_on():
                    continue
                if waits.orphaned:
                    ended = False
                    break
                raise
            waits.took()
            if writer.run is None:
                writer.run = reader.run_id()
            writer.append(reader.tell() - 1, frame)
            writer.flush()  # durable before the next call acknowledges it
            appended += 1
            if bar is not None:
                bar.update(1)
    finally:
        try:
            if bar is not None:
                bar.close()
            reader.close()
        finally:  # (the file closed, its lock let go of, whatever the reader's close raised)
            try:
                total = len(writer.indices())
            finally:
                writer.close()
    return ArchiveReport(stream, dest, appended, total, reader.missed, time.monotonic() - start,
                         ended)


class _Waits:
    """An archiver's waits for frames, with a lifeline: in slices of :data:`_SLICE` s (the
    reader's timeout), between which it looks whether the lifeline's writers are gone; then
    once more without waiting (a frame published as they went), and it stops."""

    def __init__(self, reader: Stream, timeout: float | None, lifeline: int | None) -> None:
        self.reader, self.timeout, self.lifeline = reader, timeout, lifeline
        self.orphaned = False
        self._since = time.monotonic()
        if lifeline is not None:
            os.set_blocking(lifeline, False)
            self._slice()

    def _slice(self) -> None:
        left = None if self.timeout is None else self.timeout - (time.monotonic() - self._since)
        self.reader.timeout = _SLICE if left is None else max(0.0, min(_SLICE, left))

    def took(self) -> None:
        """A frame came: the next one's wait starts now."""
        if self.lifeline is not None:
            self._since = time.monotonic()
            if not self.orphaned:
                self._slice()

    def go_on(self) -> bool:
        """After a slice's timeout: whether to wait again (else the caller stops, when
        :attr:`orphaned`, or raises the timeout)."""
        if self.lifeline is None or self.orphaned:
            return False
        if _closed(self.lifeline):
            self.orphaned = True
            self.reader.timeout = 0.0  # (the frames published by then: taken without a wait)
            return True
        if self.timeout is not None and time.monotonic() - self._since >= self.timeout:
            return False
        self._slice()
        return True


#: Seconds of one wait of an archiver with a lifeline, between its looks at it
_SLICE = 1.0


def _closed(fd: int) -> bool:
    """Whether every writer of pipe ``fd`` (non-blocking) is gone."""
    try:
        return os.read(fd, 1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
