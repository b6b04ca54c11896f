"""MDAnalysis reader for instride streams: ``Universe(topology, "instride://NAME")``.

Importing :mod:`instride.analytics` (or this module) registers the reader with MDAnalysis
under ``format="INSTRIDE"``; its ``_format_hint`` makes MDAnalysis pick it for any string
starting with ``instride://``. The rest of the name is the stream name (a key prefix such as
``run7`` or ``ensemble/replica3``), resolved with the usual ``INSTRIDE_*`` settings (local or
cluster mode).

Semantics on a live stream
--------------------------
* **Opening** the universe waits for frame 0 (it is needed to know the atom count); a stream
  that ends with no frame raises :class:`~instride.errors.EndOfStream`.
* **Iteration** (``for ts in u.trajectory``) is the in situ path: it returns the frames in
  order, *blocking* for each next frame until the producer publishes it, and stops at
  end-of-stream. It is not limited to ``len(u.trajectory)``.
* **len() / n_frames** is, by default (``length="published"``), the number of frames published
  *at the moment you ask*: it only grows while the producer runs and is final once the stream
  has ended (:attr:`InstrideReader.ended`). This is what makes
  ``MDAnalysis.analysis.rms.RMSD(u).run()`` and ``RMSF(...).run()`` work unchanged on a live
  stream: ``run()`` takes the length once, then analyses exactly those frames (no waiting).
  Pass ``length="final"`` to make ``len()`` wait for end-of-stream instead, so that ``run()``
  covers the whole trajectory (it then starts only after the producer has finished); or call
  :meth:`InstrideReader.wait_for_end` first.
* **Random access** ``u.trajectory[i]`` works for every published frame (a published frame is
  immutable). Asking for a frame that is not published yet is refused with an ``IndexError``
  that says the stream is live, as MDAnalysis's IMD reader refuses what a socket cannot do.
* **Timeouts** (``timeout=`` or ``INSTRIDE_TIMEOUT``) raise
  :class:`~instride.errors.ConsumeTimeout` from the iteration; they never end it silently.
  A corrupt frame raises :class:`~instride.errors.IntegrityError`. (MDAnalysis's own
  ``ReaderBase.next`` turns every ``OSError`` into the end of the trajectory; this reader does
  not.)
* **Bounded streams** (``retain=N``) keep only their newest frames: a universe opened after
  frame 0 was dropped starts at the oldest frame kept (``ts.frame`` is the stream's index),
  and the end of a loop does not fail for want of the frame it would rewind to. A frame
  dropped before this reader got to it raises :class:`~instride.errors.FramesMissed`
  (``on_gap="count"``: the iteration skips them and counts them in
  :attr:`InstrideReader.missed`).
* **Consumer groups** (``group="name"``): the universe reads as one of the stream's consumer
  groups, which a producer under ``on_full="block"`` waits for, so no frame is dropped
  before the analysis took it. The trajectory starts at the group's position (a restarted
  analysis resumes where the group was: the frame it held when it stopped comes again), and
  iterating moves the position on (recorded every ``commit_every`` frames, and when the
  reader closes). Random access (``u.trajectory[i]``, the rewind at the end of a loop) does
  not move it, but the next frame iterated after it does: ``next()`` after
  ``u.trajectory[7]`` takes frame 8 as the group, frames before it counting as taken. A
  group's frames are taken once: a loop starts at the group's position (a loop after one
  that took an ended stream's every frame is empty, and a group that took them all opens
  with ``EndOfStream``). ``u.trajectory.close()`` records the position and lets the group
  go; a pickled copy (a parallel analysis's worker) and ``copy()`` read without the group.
* Velocities and forces are not carried by streams; ``ts.has_velocities`` is ``False``.

Examples
--------
>>> import MDAnalysis as mda                                  # doctest: +SKIP
>>> import instride.analytics                                 # registers the reader
>>> u = mda.Universe("protein.pdb", "instride://run7", timeout=120)
>>> for ts in u.trajectory:                                   # blocks for each frame
...     print(ts.frame, ts.time, u.atoms.radius_of_gyration())
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np
from MDAnalysis.coordinates.base import FrameIteratorSliced, ReaderBase
from MDAnalysis.lib.mdamath import triclinic_box
from MDAnalysis.lib.util import store_init_arguments

from .. import EndOfStream, Stream
from ..config import parse_timeout
from ..errors import ConsumeTimeout, FramesMissed
from ..frames import HEADER_SIZE, Frame

SCHEME = "instride://"
#: seconds of a wait for a frame before the reader looks at the stream's count again
_SLICE = 0.5

__all__ = ["SCHEME", "InstrideReader", "stream_name", "wait_for_end"]


def stream_name(filename: str) -> str:
    """The stream name of an ``instride://NAME`` URL.

    Raises
    ------
    ValueError
        When ``filename`` does not start with ``instride://`` or names no stream.
    """
    if not isinstance(filename, str) or not filename.startswith(SCHEME):
        raise ValueError(f"not an instride stream URL: {filename!r} (expected instride://NAME)")
    name = filename[len(SCHEME):].strip("/")
    if not name:
        raise ValueError(f"no stream name in {filename!r} (expected instride://NAME)")
    return name


def wait_for_end(stream: Stream, timeout: float | None = None) -> int:
    """Block until the producer of ``stream`` ends it; return its final frame count.

    The count is the stream's own (``len(stream)``, final once it has ended); the end marker
    is only waited for, never parsed here.

    Parameters
    ----------
    stream
        The :class:`instride.Stream` to wait on.
    timeout
        Seconds to wait (default ``INSTRIDE_TIMEOUT``, else forever).

    Raises
    ------
    ConsumeTimeout
        The stream did not end within ``timeout``.
    """
    if not stream.ended:
        # Stream has no public "wait for the end" yet: wait for its end key to be published.
        stream.client.consume(stream.end_key, timeout=timeout)
    return len(stream)


def _wait_published(stream: Stream, index: int) -> float | None:
    """Block until frame ``index`` of ``stream`` is published (or was, and is retired since),
    the stream ended, or the stream's timeout passed — the read after it tells which — waiting
    in slices of ``_SLICE`` for the frame's key or the end marker (a frame published and
    retired while the wait looked away shows in the stream's count of frames). Returns what
    is left of the timeout, for that read (``None``: no limit)."""
    key, end = stream.frame_key(index), stream.end_key
    deadline = None if stream.timeout is None else time.monotonic() + stream.timeout
    while not stream.has(index) and len(stream) <= index and not stream.ended:
        left = _SLICE if deadline is None else min(_SLICE, deadline - time.monotonic())
        if left <= 0:
            break
        with contextlib.suppress(ConsumeTimeout):
            stream.client.wait_any([key, end], timeout=left)
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class InstrideReader(ReaderBase):
    """Read the frames of an instride stream as an MDAnalysis trajectory.

    Parameters
    ----------
    filename
        ``"instride://NAME"``.
    n_atoms
        Expected atom count (MDAnalysis passes the topology's); checked against the stream.
    timeout
        Seconds to wait for a frame before :class:`~instride.errors.ConsumeTimeout`
        (default ``INSTRIDE_TIMEOUT``, else forever).
    length
        ``"published"`` (default): ``len()`` is the number of frames published when asked.
        ``"final"``: ``len()`` waits for end-of-stream and returns the final count.
    group
        Read as this consumer group of the stream (see :class:`instride.Stream`): start at
        its position and move it on while iterating.
    commit_every
        With ``group``: record its position every this many frames (default 1).
    on_gap
        Frames of a bounded stream dropped before the iteration got to them: ``"raise"``
        (default) raises :class:`~instride.errors.FramesMissed`, ``"count"`` skips them
        and adds their number to :attr:`missed`.
    **kwargs
        Passed to :class:`MDAnalysis.coordinates.base.ReaderBase` (``dt``, ``time_offset``).

    Attributes
    ----------
    wait_seconds : float
        Time spent blocked waiting for frames to be published (consumer idle time).
    read_seconds : float
        Time spent reading, verifying and copying published frames.
    bytes_read : int
        Bytes of frame files read (re-reads included: MDAnalysis reads frame 0 at open and
        again when an iteration starts or ends).
    frame_nbytes : int
        Size of one frame file of this stream.
    frames_read : int
        Frames read (random access included).
    missed : int
        Frames the iteration skipped because they were dropped first (``on_gap="count"``).

    Raises
    ------
    EndOfStream
        The stream ended without any frame.
    ConsumeTimeout
        No frame 0 within ``timeout``.
    ValueError
        ``n_atoms`` does not match the stream, or a bad URL / ``length``.
    ConfigError
        An invalid ``group`` name, ``commit_every`` or ``on_gap``.
    """

    format = "INSTRIDE"
    units = {"time": "ps", "length": "Angstrom"}

    @store_init_arguments
    def __init__(
        self,
        filename: str,
        n_atoms: int | None = None,
        *,
        timeout: float | None = None,
        length: str = "published",
        group: str | None = None,
        commit_every: int = 1,
        on_gap: str = "raise",
        **kwargs: Any,
    ) -> None:
        super().__init__(filename, **kwargs)
        if length not in ("published", "final"):
            raise ValueError(f"length must be 'published' or 'final', got {length!r}")
        self._name = stream_name(filename)
        # (NaN waited for ever, a negative number failed at once: refused, as everywhere)
        self._timeout = None if timeout is None else parse_timeout(timeout, "timeout")
        self._length = length
        self._group, self._commit_every, self._on_gap = group, commit_every, on_gap
        self.missed = 0
        self._rewinding = False
        self.wait_seconds = 0.0
        self.read_seconds = 0.0
        self.bytes_read = 0
        self.frames_read = 0
        self._count = 0  # frames known to be published (a prefix: a stream is written in order)
        self._final: int | None = None  # frame count once the stream has ended
        self._open_stream()
        # (a copy of this reader, ``copy()``, reads without the group: one reader per group)
        self._kwargs.pop("group", None)
        try:
            self._start = self._stream.tell()  # (a group's position; else 0)
            try:
                first = self._fetch(self._start, wait=True)
            except FramesMissed as exc:  # a bounded stream that no longer holds its first
                self._start = exc.resume  # frames: the trajectory starts at the oldest one
                first = self._fetch(self._start, wait=True)
            if n_atoms is not None and int(n_atoms) != first.natoms:
                raise ValueError(
                    f"InstrideReader: stream {self._name!r} has {first.natoms} atoms per frame "
                    f"but the topology has {n_atoms}"
                )
        except BaseException:
            self._stream.close()  # (a group let go at once, not when this is collected)
            raise
        self.n_atoms = first.natoms
        self.ts = self._Timestep(self.n_atoms, reader=self, **self._ts_kwargs)
        with first:  # (copied into the timestep, then let go of: held, the producer could
            self._load(self._start, first)  # never reuse its file)

    # ------------------------------------------------------------------ plumbing
    def _open_stream(self) -> None:
        self._stream = Stream(self._name, mode="r", timeout=self._timeout, group=self._group,
                              commit_every=self._commit_every, on_gap=self._on_gap)

    @staticmethod
    def _format_hint(thing: Any) -> bool:
        return isinstance(thing, str) and thing.startswith(SCHEME)

    @property
    def stream(self) -> Stream:
        """The :class:`instride.Stream` read."""
        return self._stream

    @property
    def ended(self) -> bool:
        """Whether the producer has ended the stream (``len()`` is then final)."""
        self._published_count()
        return self._final is not None

    def _published_count(self) -> int:
        """Frames published so far, as the stream counts them; final once it has ended."""
        if self._final is not None:
            return self._final
        stream = self._reopened()
        ended = stream.ended  # check first: once ended, every frame is published
        # (never fewer than this reader got: the head may be counted just before a frame's)
        self._count = max(self._count, len(stream))
        if ended:
            self._final = self._count
        return self._count

    def wait_for_end(self, timeout: float | None = None) -> int:
        """Block until the producer ends the stream; return the final frame count.

        Raises
        ------
        ConsumeTimeout
            The stream did not end within ``timeout`` (default: the reader's timeout).
        """
        if self._final is None:
            t0 = time.perf_counter()
            wait_for_end(self._reopened(), self._timeout if timeout is None else timeout)
            self.wait_seconds += time.perf_counter() - t0
        return self._published_count()

    @property
    def n_frames(self) -> int:  # type: ignore[override]
        """Frames published so far (``length="published"``) or in total (``"final"``)."""
        if self._length == "final":
            return self.wait_for_end()
        return self._published_count()

    def _fetch(self, index: int, *, wait: bool) -> Frame:
        """Return frame ``index``, waiting for it when ``wait`` (else refusing if unpublished).

        Frames are read with :meth:`instride.Stream.read`, which raises
        :class:`~instride.errors.EndOfStream` past the end. A frame not published yet is
        waited for first (its key or the stream's end, :meth:`instride.Client.wait_any`): the
        wait is idle time, the read after it — in cluster mode the transfer from the
        producer's node — is read time.
        """
        stream = self._reopened()
        if not wait and index >= self._published_count():
            raise IndexError(
                f"InstrideReader: frame {index} of stream {self._name!r} is not published "
                f"yet (the stream is live; {self._count} frames so far). "
                "Iterate the trajectory to wait for new frames, or open it with "
                "length='final'."
            )
        ready = index < self._count or stream.client.exists(stream.frame_key(index))
        left, waited = None, 0.0
        if not ready:  # blocked until published (or the end): idle time
            t0 = time.perf_counter()
            left = _wait_published(stream, index)
            waited = time.perf_counter() - t0
            self.wait_seconds += waited
        t0 = time.perf_counter()
        # (what is left of the timeout: the wait above had its share, not a second one)
        try:
            frame = stream.read(index) if left is None else stream.read(index, timeout=left)
        except ConsumeTimeout as exc:
            if not waited:
                raise
            # (the read's own wait was only what was left: the error names the whole wait)
            raise ConsumeTimeout(exc.key, waited + exc.waited) from exc.__cause__
        self.read_seconds += time.perf_counter() - t0
        self._count = max(self._count, index + 1)  # a stream is published in order
        self.frame_nbytes = frame_bytes(frame)
        self.bytes_read += self.frame_nbytes
        self.frames_read += 1
        return frame

    def _load(self, index: int, frame: Frame) -> Any:
        if frame.natoms != self.n_atoms:
            raise ValueError(
                f"InstrideReader: frame {index} of stream {self._name!r} has {frame.natoms} "
                f"atoms, earlier frames {self.n_atoms}"
            )
        ts = self.ts
        ts.frame = index
        np.copyto(ts.positions, frame.positions, casting="same_kind")
        if frame.header.has_box:
            ts.dimensions = triclinic_box(*frame.box)
        else:
            ts.dimensions = None
        ts.data["step"] = frame.step
        ts.data["time"] = frame.time
        return ts

    # ------------------------------------------------------------------ ReaderBase contract
    # (each frame is copied into the timestep, then released: a bounded stream's frame
    # holds a descriptor and a lock on its file until then)
    def _read_next_timestep(self, ts: Any = None) -> Any:
        index = self.ts.frame + 1
        stream = self._stream
        if self._group is not None and not self._rewinding and index >= stream.tell():
            # the group's next frame (past frames looked at by random access: they count as
            # taken), through the stream, which moves the group's position on
            if index > stream.tell():
                stream.seek(index)
            return self._next_of_group()
        while True:
            try:
                frame = self._fetch(index, wait=True)
                break
            except FramesMissed as exc:
                if self._on_gap != "count" or self._rewinding:  # (a rewind skips nothing)
                    if not self._rewinding:  # (raised once: the next frame read is the
                        self.ts.frame = exc.resume - 1  # oldest kept, as a stream's is)
                    raise
                if self._group is None:  # (a group's frames taken before, then dropped: no
                    self.missed += exc.missed  # frames missed by this reader)
                index = exc.resume
        with frame:
            return self._load(index, frame)

    def _next_of_group(self) -> Any:
        """The group's next frame, through the stream's iteration (which records the group's
        position, and skips dropped frames under ``on_gap="count"``)."""
        stream = self._stream
        key = stream.frame_key(stream.tell())
        ready = stream.client.exists(key)
        missed = stream.missed
        t0 = time.perf_counter()
        try:
            frame = next(stream)
        except StopIteration:
            raise EndOfStream(self._name, stream.tell()) from None
        elapsed = time.perf_counter() - t0
        if ready:
            self.read_seconds += elapsed
        else:  # (waited for, then read: the wait is not told apart from the read here)
            self.wait_seconds += elapsed
        self.missed += stream.missed - missed
        index = stream.tell() - 1
        self._count = max(self._count, index + 1)
        self.frame_nbytes = frame_bytes(frame)
        self.bytes_read += self.frame_nbytes
        self.frames_read += 1
        with frame:
            return self._load(index, frame)

    def _read_frame(self, frame: int) -> Any:
        with self._fetch(frame, wait=False) as got:
            return self._load(frame, got)

    def __getitem__(self, frame: Any) -> Any:
        """``u.trajectory[i]``, slices, fancy indexing: as every MDAnalysis reader; a frame
        index past the published ones is refused with an ``IndexError`` that says the
        stream is live (MDAnalysis would only say it exceeds the length)."""
        if isinstance(frame, (int, np.integer)) and frame >= self._published_count():
            self._fetch(int(frame), wait=False).release()  # (raises the live one's IndexError)
        if isinstance(frame, slice):
            # (a slice over every frame was MDAnalysis's FrameIteratorAll: the live, blocking
            # iteration, past the length it had just been given — ``timeseries()`` and
            # ``transfer_to_memory()`` size their arrays by that length: IndexError, or a
            # wait without end on a dead producer. Every slice stops where it was asked)
            return FrameIteratorSliced(self, slice(*self.check_slice_indices(
                frame.start, frame.stop, frame.step)))
        return super().__getitem__(frame)

    def _reopen(self) -> None:
        # (a group's trajectory goes on from the group's position: its frames before it are
        # taken, and may be gone)
        start = self._stream.tell() if self._group is not None else self._start
        self.ts.frame = start - 1

    def rewind(self) -> Any:
        """Go back to the first frame (a group's: its position), never waiting: MDAnalysis
        rewinds after every loop, slice and ``run()``. Where that frame is not there to load
        — a bounded stream dropped it, a group took every frame of an ended stream, or a
        group's next frame is not published yet — nothing is loaded, and the next frame
        read is that one (it raised :class:`FramesMissed`, ``EndOfStream``, or waited, after
        the whole analysis had run)."""
        start = self._stream.tell() if self._group is not None else self._start
        self._rewinding = True
        try:
            try:
                frame = self._fetch(start, wait=False)
            except (FramesMissed, EndOfStream, IndexError):
                self._reopen()
                return self.ts
            with frame:
                ts = self._load(start, frame)
        finally:
            self._rewinding = False
        for auxname in self.aux_list:
            ts = self._auxs[auxname].update_ts(ts)
        return self._apply_transformations(ts)

    def next(self) -> Any:
        """Advance to the next frame, blocking until it is published.

        Raises ``StopIteration`` at end-of-stream (and rewinds, like every MDAnalysis
        reader); a :class:`~instride.errors.ConsumeTimeout` or
        :class:`~instride.errors.IntegrityError` propagates instead of ending the loop.
        """
        try:
            ts = self._read_next_timestep()
        except EndOfStream:
            if self._rewinding:  # (the rewind's own next(): nothing to rewind to)
                raise
            try:
                self.rewind()
            except (FramesMissed, EndOfStream):  # (a bounded stream dropped the frame it
                # would rewind to, or a group took every frame: the loop ends all the same)
                self._reopen()
            raise StopIteration from None
        for auxname in self.aux_list:
            ts = self._auxs[auxname].update_ts(ts)
        return self._apply_transformations(ts)

    def _get_dt(self) -> float:
        # (the trajectory's first two frames, or a bounded stream's two oldest kept: frames 0
        # and 1 may be gone, and MDAnalysis reads dt anywhere)
        stream, index = self._reopened(), self._start
        for _ in range(3):
            if self._published_count() < index + 2:
                break
            try:
                with stream.read(index + 1) as second, stream.read(index) as first:
                    return second.time - first.time
            except FramesMissed as exc:
                index = exc.resume
        raise AttributeError("dt is unknown until two frames are published (and kept)")

    def close(self) -> None:
        """Record a consumer group's position and let the group go (``group=``), and let go of
        what the stream holds (its kept mappings, an archive file open, frames asked for
        ahead). A plain reader used again opens its stream again."""
        stream = getattr(self, "_stream", None)  # (none: the stream did not open)
        if stream is not None:
            stream.close()

    def _reopened(self) -> Stream:
        """The stream, opened again where :meth:`close` closed it (a plain reader)."""
        if getattr(self._stream, "_closed", False) and self._group is None:
            self._open_stream()
        return self._stream

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_stream", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # (a copy, e.g. in a parallel analysis's worker, reads without the group: one live
        # reader per group, and the frames it reads are the original's to take)
        self._group = None
        frame = self.ts.frame
        self._open_stream()
        if frame >= 0:
            self._read_frame(frame)

    def __repr__(self) -> str:
        state = "ended" if self._final is not None else "live"
        return (
            f"<InstrideReader {self.filename} ({state}, {self._count} frames published) "
            f"with {self.n_atoms} atoms>"
        )


def frame_bytes(frame: Frame) -> int:
    """Size in bytes of the frame file ``frame`` was read from."""
    return HEADER_SIZE + frame.header.payload_nbytes
