"""Ordered streams of frames with end-of-stream and newest-frame sampling.

A stream named ``run7`` is the series of keys ``run7/frame_000000000.isf``,
``run7/frame_000000001.isf`` ... written by one producer, followed by an end marker
``run7/end_of_stream.json`` when the producer closes it. The same API works in local and
cluster mode; the settings choose.

Examples
--------
Producer::

    with instride.Stream("run7", mode="w") as s:
        for step in range(0, 1000, 10):
            s.append(positions, step=step, time=step * 0.002)

Consumer (another process, started before or after)::

    for frame in instride.Stream("run7", timeout=60):
        analyse(frame.positions)

Sampling the newest frame, skipping older ones (FlowVR's pattern)::

    s = instride.Stream("run7")
    frame = s.latest()

Bounded streams: keep at most 16 frames on the node; the producer waits (``on_full="block"``)
until every consumer group has taken a frame before it retires it::

    with instride.Stream("run7", mode="w", retain=16, groups=["analysis"]) as s:
        ...
    for frame in instride.Stream("run7", group="analysis"):   # resumes where the group left off
        ...

Frames are read in place: ``frame.positions`` is a view of the mapped frame file, valid until
the reader moves on to the next frame (or calls ``frame.release()``); copy what you keep.
A frame a reader holds is never rewritten under it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import json
import math
import os
import re
import subprocess
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from time import monotonic as _monotonic  # (append's argument `time` shadows the module)
from typing import Any

import numpy as np

from .archive.process import let_go
from .busypoll import Cadence, poll_paths
from .client import Client, get_client
from .config import parse_timeout
from .errors import (
    ArchiveError,
    ConfigError,
    ConsumeTimeout,
    EndOfStream,
    FramesMissed,
    GroupBusy,
    GroupLeaseLost,
    GroupReset,
    InstrideError,
    IntegrityError,
    KeyExistsError,
    KeyNotFoundError,
    KeyValidationError,
    MetadataUnavailable,
    PublicationUnsettled,
    StreamFull,
    StreamRerun,
)
from .frames import (
    HEADER_SIZE,
    LAYOUTS,
    Frame,
    NativeFrame,
    checked_header,
    decode_frame,
    encode_into,
    frame_arrays,
    frame_size,
    frame_views,
    header_checksum,
    native_frame,
)
from .metadata.base import PendingRecord
from .paths import check_confined
from .perthread import forks
from .record import Record, frame_checksum
from .store.inbox import Inbox
from .store.ring import Leases, SlotPool, Taken
from .store.streamstate import GROUP_DONE, Policy, check_group, cursors_of, state_dir
from .store.wait import armed, lost_watches, wait_keys
from .transport.base import Received

FRAME_FORMAT = "frame_{:09d}.isf"
END_NAME = "end_of_stream.json"
#: the names of a stream's files in its directory: its frames and its end marker
_STREAM_FILES = re.compile(r"frame_\d{9,}\.isf|" + re.escape(END_NAME))
_FRAME_RE = re.compile(r"frame_(\d{9})\.isf$")


#: Frames a reader keeps mapped beyond the stream's retention (recycled files in flight).
_MAP_SLACK = 8
#: Longest single wait of a reader before it looks at the stream's head again.
_SLICE = 0.5
#: ... where the stream may retire frames the reader has not read (its frame may be gone
#: before the reader's wake-up looks)
_GAP_SLICE = 0.02
#: seconds between two looks of a plain cluster reader at its stream's run (a round trip to
#: Redis; see ``Stream._same_run``)
_RUN_LOOK = 1.0
#: ... and after a read that took this long (it waited: a re-run's first frames come after a
#: wait, its producer started again — a process start, seconds; a producer paced faster than
#: every half second is not asked about per frame)
_RUN_WAITED = 0.5
#: seconds a look at the stream's run waits for Redis: advisory (Redis away: looked at again
#: at the next look; the reader's own wait goes on as it would have)
_RUN_ASK = 0.2
#: seconds a reading of the groups' cursors may be used to retire frames they are past
_GROUPS_FRESH = 0.05
#: frames a group reader on another node asks its owner for ahead of the one it reads (the
#: owner sends each as it is published: one request per 1 + that many frames), at most
#: (wire.MAX_COUNT - 1) and at least _AHEAD_MIN: as many as fit in _AHEAD_BYTES (see _ahead).
#: Since round 40 (3 before, whatever the frame's size): a request costs the reader a signed
#: header, its reply parsed and a wake-up, while a frame asked ahead comes in one native call
#: (isc_recv_frame); 8 bounded pairs of JAC frames moved ~5 % more frames per second with 15
#: ahead than with 3 (4 alternating runs each), and the reader's user CPU per frame went
#: ~125 -> ~100 µs with 12 ahead (JAC, the byte bound below) and isc_recv_frame together.
_AHEAD_MAX, _AHEAD_MIN = 63, 3
#: bytes of frames asked for ahead: about what TCP's buffers hold between the owner and the
#: reader. The owner sends each frame as it is published, and one that does not fit waits in
#: its send: a reader that then pauses longer than the owner's send timeout (60 s) has that
#: connection dropped (it takes the frame the usual way after), so no more is asked than fits
#: (12 JAC frames of 644 KiB, 3 STMV frames of 28.5 MiB, 63 small ones)
_AHEAD_BYTES = 8 << 20


def _ahead(frame_bytes: int) -> int:
    """How many frames after the next a group reader asks for ahead (see _AHEAD_BYTES)."""
    return max(_AHEAD_MIN, min(_AHEAD_MAX, _AHEAD_BYTES // max(frame_bytes, 1)))
#: a producer's frames whose records (cluster mode) may wait for Redis's answer at once: the
#: producer confirms the oldest when this many are pending besides those held back (an error
#: surfaces this many frames later at most, plus INSTRIDE_RECORD_BATCH - 1 while holding)
_UNCONFIRMED_MAX = 4
#: seconds since its last ``append`` returned after which a producer (cluster mode) gives its
#: CPU up once its frame is out and recorded (:func:`os.sched_yield`): a paced producer's
#: frame is awaited, and the data server that sends it, woken by the publication, may be
#: waiting for this very CPU (on a VM that packs threads onto busy vCPUs it usually is); a
#: producer appending back to back (flat out) keeps it (measured: JAC frames 20 ms apart,
#: publish -> bytes on another node 1.98 -> 1.80 ms, 7 of 8 alternating rounds, a bounded
#: stream's 1.80 -> 1.58 ms; 8 pairs flat out, yielding after every frame: -8 % frames/s)
_PACED_AFTER = 0.002
#: a producer appending flat out (its last append returned less than _PACED_AFTER ago) holds
#: the records of frames up to this size back and sends INSTRIDE_RECORD_BATCH in one write:
#: one wake-up of Redis for several frames (larger frames cost far more than their record; a
#: paced producer's frames are awaited); the first for _HOLD_AGE seconds at most, while it
#: goes on appending (when it stops, Linux sends them after ~0.2 s: RespConnection.call_soon)
_HOLD_BYTES = 4 << 20
_HOLD_AGE = 0.02
#: numbers the readers of this process (the names of their frames asked ahead)
_READERS = itertools.count()
_GAP_POLICIES = ("raise", "count")


class _OwnChecksums:
    """Checks a frame received into a reader's inbox by the checksums the frame file carries
    (its header's own, and the payload's against the digest of what was received after the
    header), instead of against the key's record in the metadata: a stream's remote reader
    needs no record per frame, so no announcement through Redis. Keeps the frame decoded."""

    __slots__ = ("buf", "copy", "frame", "key")

    def __init__(self, buf: Any, key: str, copy: bool) -> None:
        self.buf, self.key, self.copy = buf, key, copy
        self.frame: Frame | None = None

    def __call__(self, got: Received, checked: bool = False) -> bool:
        """Decode the frame received (``got``) and check it; ``checked``: its header and
        payload passed their checksums already (``isc_recv_frame``): decoded only."""
        try:
            frame = decode_frame(self.buf.view(got.size), self.key, verify=False, copy=self.copy,
                                 checked=checked)
        except IntegrityError:  # (not a frame file: the usual way reports it)
            return False
        if not checked and frame.header.payload_checksum != int(got.digest, 16):
            return False
        self.frame = frame
        return True


def _beside(path: str, key: str, nxt: str | None) -> list[str]:
    """``path`` (``key``'s file), and the file of ``nxt`` beside it when given."""
    return [path, path[: len(path) - len(key)] + nxt] if nxt else [path]



#: Seconds a reader of a retired frame tries again to open an archive held by its resuming
#: archiver (see :meth:`Stream._from_archive`).
_ARCHIVE_BUSY_S = 5.0
#: Seconds an archiver has to stop after SIGTERM before it is killed, and between two
#: SIGTERMs meanwhile (see :func:`_stop_archiver`).
_ARCHIVER_STOP_S, _ARCHIVER_RESIGNAL_S = 30.0, 2.0
#: Seconds a producer's ``close()`` waits at least for its archiver to take the last frames
#: (the stream's ``timeout`` bounds one frame's wait, and may be 0: not the archiver's drain)
_ARCHIVE_DRAIN_S = 60.0


def _stop_archiver(proc: subprocess.Popen) -> None:
    """Stop an ``archive=`` archiver: SIGTERM (it closes its archive file; not SIGINT, which
    a process started in the background of a shell script ignores), sent again every
    :data:`_ARCHIVER_STOP_S` s — Python drops the exception of a signal handler that runs
    inside a finalizer (``__del__``), and the archiver then waited on for ever — and SIGKILL
    once :data:`_ARCHIVER_STOP_S` s have passed (a warning then shows what it wrote)."""
    deadline = time.monotonic() + _ARCHIVER_STOP_S
    while True:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.communicate(timeout=max(0.0, min(_ARCHIVER_RESIGNAL_S,
                                                  deadline - time.monotonic())))
            let_go(proc)
            return
        except subprocess.TimeoutExpired:
            if time.monotonic() < deadline:
                continue
        proc.kill()
        _, err = proc.communicate()
        let_go(proc)
        warnings.warn(f"the archiver (pid {proc.pid}) did not stop within {_ARCHIVER_STOP_S:g} s"
                      f" of SIGTERM and was killed; it wrote: "
                      f"{(err or b'').decode(errors='replace')[-2000:]}", RuntimeWarning,
                      stacklevel=3)
        return

class Stream:
    """An ordered series of frames under one name.

    Parameters
    ----------
    name
        Stream name: a key prefix such as ``"run7"`` or ``"ensemble/replica3"``.
    mode
        ``"w"`` for the producer, ``"r"`` for a consumer; ``None`` decides on first use
        (:meth:`append` makes a producer).
    timeout
        Seconds a consumer waits for the next frame before :class:`ConsumeTimeout`, and a
        blocked producer waits for its consumer groups before :class:`StreamFull`
        (default: ``INSTRIDE_TIMEOUT``, else forever).
    layout
        Frame layout written by :meth:`append`: ``"xyz32"``, ``"paper"`` or ``"paper-soa"``.
    overwrite
        Let a producer replace an earlier stream of the same name: its first :meth:`append`
        deletes the old frames and end marker and sets every consumer group back to frame 0.
    client
        The :class:`~instride.client.Client` to use (default: from the environment).
    retain
        Producer: keep at most this many frames on the node (one more while the newest is
        being published); older frames are retired — their keys disappear and their storage
        is reused for new frames. ``None`` (default): keep every frame.
    retain_bytes
        Producer: the same bound in bytes of frame files. The newest frame is always kept,
        also one larger than the bound on its own (the older ones are retired then).
    on_full
        Producer, when the bound is reached: ``"block"`` (default) waits until every
        consumer group has taken the oldest frame; ``"drop-oldest"`` retires it at once;
        ``"latest"`` keeps only the newest frame (``retain=1``; FlowVR's greedy sampling).
    groups
        Producer: consumer groups to register before the first frame, so that under
        ``"block"`` no frame is retired before they have taken it (one name alone, a
        ``str``, is one group).
    group
        Consumer: read as this consumer group. Its position is kept on the node: a reader
        that restarts resumes at the first frame the group had not finished (the frame it
        held when it stopped is delivered again). One live reader per group.
    on_gap
        Consumer, when frames it had not read were dropped: ``"raise"`` (default) raises
        :class:`FramesMissed` (then goes on from the oldest frame kept), ``"count"`` skips
        them and adds their number to :attr:`missed`.
    verify
        Consumer: check each frame's payload checksum (default). ``False`` skips it (the
        header checksum is always checked). A frame this reader fetches from another node
        is verified as it arrives (against its record: the header's checksum, and the
        payload hashed while it is received) and not hashed a second time. A consumer group's reader of a
        bounded stream receives such frames into memory of its own (reused buffers), not
        into files on its node.
    archive
        Producer: also write every frame to this file (``.h5``: H5MD) while the run goes on,
        through an archiver process reading as consumer group ``"archive"``
        (:mod:`instride.archive`); :meth:`close` waits for it to finish (and raises
        :class:`~instride.errors.ArchiveError` if the archive ends short of the last frame).
        Frames retired from memory stay readable: :meth:`read` serves them from the archive.
        A file already there is refused at the first ``append`` (``ArchiveError``: a stream
        is never continued, so it holds an earlier run) unless ``overwrite=True`` replaces it.
    spin
        Consumer: seconds to busy-poll for the next frame on this node before sleeping in
        the kernel (default: ``INSTRIDE_SPIN``, else 0). A reader that polls sees a frame
        within a few µs instead of paying the wake-up of a sleeping thread (~100–400 µs on
        an idle virtual machine), at the cost of a core kept busy while it waits — the
        trade MPI's progress engines make; worth it for an analysis pinned to its own core.
        ``"auto"``: hybrid polling — once the reader has seen how regularly frames come
        (three gaps), it sleeps until shortly before the next frame is due and polls only
        around that moment (:class:`~instride.busypoll.Cadence`: 5 % of the gap plus the
        producer's jitter either side, 0.3–5 ms), waking at once if the frame comes earlier;
        a frame later than that is waited for asleep. About half the latency gained by
        polling all the time, for 10–15 % of a core with frames 20 ms apart (local mode,
        measured; the windows take a share of the gap). A reader
        on another node than the producer learns the pace from the frames' publication
        times and polls for the owner's reply in the window; one on the producer's node in
        cluster mode sleeps and polls where the next frame's file will appear, as in local
        mode.
    copy
        Consumer: deliver each frame as arrays of its own instead of views of the mapped
        file, copied and verified in one pass over the bytes (each chunk hashed while it is
        in the CPU cache); the frame's storage is released at once, so frames can be kept
        as long as wanted. Cheaper than views plus ``np.array`` for the interleaved
        ``paper`` layout (1.4–2× here), about even for the contiguous layouts.
    commit_every
        Consumer group: record the group's position every this many frames instead of after
        every frame (and always when the reader closes). In cluster mode each record is a
        message to Redis: with 4, 8 pairs across nodes moved about 11 % more frames (the
        test machine). A reader killed without closing then
        resumes up to ``commit_every - 1`` frames before the frame it held (they are
        delivered again; none is skipped). Never more than the producer's ``retain`` under
        ``"block"`` (its waits must see progress), and 1 where the producer bounds bytes
        (``retain_bytes``: how many frames fit is not known). Default 1.

    Raises
    ------
    ConfigError
        A retention below 1, an unknown ``on_full``, ``on_gap`` or ``layout``, an invalid
        group name, a ``commit_every`` below 1, a ``timeout`` that is NaN or negative.
    """

    def __init__(
        self,
        name: str,
        *,
        mode: str | None = None,
        timeout: float | None = None,
        layout: str = "xyz32",
        overwrite: bool = False,
        client: Client | None = None,
        retain: int | None = None,
        retain_bytes: int | None = None,
        on_full: str = "block",
        groups: str | Sequence[str] = (),
        group: str | None = None,
        on_gap: str = "raise",
        verify: bool = True,
        archive: str | os.PathLike[str] | None = None,
        spin: float | str | None = None,
        copy: bool = False,
        commit_every: int = 1,
    ) -> None:
        if isinstance(commit_every, bool) or not isinstance(commit_every, int) or commit_every < 1:
            raise ConfigError("commit_every", commit_every, "must be a whole number of frames >= 1")
        self.commit_every = commit_every
        self.client = client or get_client()
        #: hybrid polling (``spin="auto"``): when the next frame is due
        self._cadence = Cadence() if spin == "auto" else None
        #: windows around a due frame this reader polled in (``spin="auto"``)
        self.windows_polled = 0
        try:
            self.spin = 0.0 if spin == "auto" else self.client.settings.spin if spin is None \
                else math.nan if isinstance(spin, bool) else float(spin)
        except (TypeError, ValueError):
            self.spin = math.nan
        if not self.spin >= 0 or self.spin == float("inf"):
            raise ConfigError("spin", spin, 'must be a finite number of seconds >= 0, or "auto"')
        self.name = self.client.key(name)
        if mode not in (None, "r", "w"):
            raise ConfigError("mode", mode, "expected 'r', 'w' or None")
        if on_gap not in _GAP_POLICIES:
            raise ConfigError("on_gap", on_gap, f"expected one of {', '.join(_GAP_POLICIES)}")
        self.policy = Policy(
            retain=retain, retain_bytes=retain_bytes, on_full=on_full,
            archive=None if archive is None else os.path.abspath(archive),
        )
        # (one name alone is one group: iterated as a sequence, "analysis" registered a group
        # per letter, none of them ever read, and a producer under "block" waited for them
        # for good)
        self.register_groups = ((check_group(groups),) if isinstance(groups, str)
                                else tuple(check_group(g) for g in groups))
        if archive is not None and mode != "r":  # (None: a producer once it appends)
            from .archive.base import check_format

            # (at once: known only once the archiver ran, a wrong suffix was told at close(),
            # under a dropping policy after every frame had gone unarchived)
            check_format(archive)
            where = os.path.dirname(os.path.abspath(archive))
            if not os.path.isdir(where):  # (likewise: the archiver makes no directory)
                raise ArchiveError(self.name, archive, f"its directory {where} does not exist")
        if archive is not None and "archive" not in self.register_groups:
            self.register_groups += ("archive",)
        self.group = None if group is None else check_group(group)
        self.mode = mode
        # (None: INSTRIDE_TIMEOUT's, as documented; it too may be None: no limit. NaN, which
        # no wait ever reaches, and negative seconds are refused; inf is no limit)
        self.timeout = self.client.settings.timeout if timeout is None \
            else parse_timeout(timeout, "timeout")
        if layout not in LAYOUTS:
            raise ConfigError("layout", layout, f"expected one of {', '.join(sorted(LAYOUTS))}")
        self.layout = layout
        self.overwrite = overwrite
        self.on_gap = on_gap
        self.verify = verify
        self.copy = copy
        #: frames this consumer skipped because they were dropped before it got to them
        self.missed = 0
        self._cursor = 0  # next frame a consumer reads
        self._written = 0  # frames a producer appended
        self._closed = False
        self._made_in = forks()  # (the process this object was made in, as forks() counts)
        #: the name the frames this reader asks for ahead are kept under (its own: two readers
        #: of one thread, of one stream too, never take each other's)
        self._batch = f"reader-{next(_READERS)}"
        #: a close() whose end marker Redis may or may not have recorded (PublicationUnsettled):
        #: the marker's file stays, the next close() settles it, and no frame may follow it
        self._end_unsettled = False
        #: the stream's head, policy and consumer groups, as the mode shares them
        self._share = self.client.engine.stream_state(self.name)
        # producer
        self._pool: SlotPool | None = None
        #: why the archiver of ``archive=`` could not be started (its run begun: appends refuse)
        self._archive_start_failed: BaseException | None = None
        self._retained: deque[tuple[int, int, int]] = deque()  # (index, inode, bytes)
        self._retained_bytes = 0
        # cluster mode: the frames' records sent and not yet confirmed, oldest first (append)
        # (frame, its record, when it was sent)
        self._unconfirmed: deque[tuple[int, PendingRecord, float]] = deque()
        self._recorded = False  # a frame's record was confirmed (the first is waited for)
        #: the newest records held back (sent with the next ones: see _hold_for), since when
        self._holding = 0
        self._held_since = 0.0
        self._hold_thread = 0
        #: an unbounded stream reads the answers already in after a publication (off the
        #: frame's path); one of them raised: the next append reads them before its own
        self._answers_failed = False
        self._appended_at = -math.inf  # when the last append returned (monotonic seconds)
        # more than this many frames or bytes kept before a write: room to be made first
        self._keep_frames = math.inf if retain is None else retain
        self._keep_bytes = math.inf if retain_bytes is None else retain_bytes
        self._native: NativeFrame | None = None  # the last frame's native encode arguments
        self._nbytes = 0  # and its size
        self._oldest = 0
        self._head_shared: tuple[int, int] | None = None  # the head counters shared last
        # every group's cursor was past this frame when last read (at this monotonic time)
        self._groups_past = (0, -math.inf)
        self._archiver: Any = None
        self._archive_reader: Any = None
        self._archive_where: str | None = None  # (the file _archive_reader has open)
        # consumer
        self._leases: Leases | None = None
        self._old_leases: list[Leases] = []  # (tables replaced while frames of theirs were held)
        self._inbox: Inbox | None = None  # (a bounded stream's frames fetched from another node)
        self._reader_policy: Policy | None = None  # the producer's, once it is known
        self._held: Frame | None = None
        self._cursor_file: Any = None
        self._done: int | None = None  # the group finished every frame before this one
        #: the record of the last frame fetched from another node (for a frame received into
        #: the inbox: its owner, node, size and publication time; no checksum, no version):
        #: its owner is asked for the next frame before that is published (cluster mode, see
        #: ``read``)
        self._fetched_from: Record | None = None
        #: the frame its owner sends next on what this reader asked for ahead (the last one
        #: came so into the inbox): read() takes it from there without looking for a file here
        self._inbox_next = -1
        #: the subscription to the stream's announcements dropped since the last wait through
        #: the metadata (which leaves one): the inbox reader needs none
        self._unwatched = False
        #: cluster mode: where this node keeps the frames, when the last frame read was an
        #: original of this node (a producer here): the reader watches there for the next
        #: one, as in local mode, instead of waiting only through the metadata (also set in
        #: local mode, where it is not used)
        self._here: str | None = None
        self._here_waited = 0.0  # seconds waited there in vain since the last frame
        #: ``copy=True`` in local mode: the layout and atom count of the last frame, and the
        #: arrays made for the next one (see :meth:`_take_here`)
        self._copy_shape: tuple[str, int] | None = None
        self._into: tuple[np.ndarray, np.ndarray | None] | None = None
        self._box: np.ndarray | None = None  # (the next frame's box vectors, local mode)
        #: waits that ended on this node's inotify that way (for tests and benchmarks)
        self.woken_here = 0
        #: cluster mode: the stream's current run was looked up, and this node's copies of
        #: frames of another run dropped (see :meth:`_forget_other_runs`)
        self._run_known = False
        #: a plain reader: the mark of the stream's run it reads (see :meth:`_same_run`), when
        #: it was last looked at (monotonic seconds), whether a frame was returned
        self._run_mark: object = None
        self._run_looked = -math.inf
        self._handed = False
        self._rerun_seen = False  # (StreamRerun raised: every read raises it at once)
        self._read_began = 0.0  # (when the last read began: one that waited looks again)
        if self.group is not None:
            if mode == "w":
                raise ValueError("group= is for consumers; a producer registers groups with groups=")
            self.mode = "r"
            self._run_mark = self._run_now()  # (before: see _rejoin_group)
            self._cursor_file = self._share.open_group(self.group, start=0)
            self._cursor = self._cursor_file.value

    # ------------------------------------------------------------------ naming
    def frame_key(self, index: int) -> str:
        """The key of frame ``index``.

        Parameters
        ----------
        index
            Frame number, from 0.

        Returns
        -------
        str
            ``"<name>/frame_<index, 9 digits>.isf"``.
        """
        if index < 0:
            raise KeyValidationError(index, "frame index must be >= 0")
        return f"{self.name}/{FRAME_FORMAT.format(index)}"

    @property
    def end_key(self) -> str:
        """The key of the end-of-stream marker."""
        return f"{self.name}/{END_NAME}"

    def __repr__(self) -> str:
        return f"Stream({self.name!r}, mode={self.mode!r}, published={len(self)})"

    # ------------------------------------------------------------------ producer
    def append(
        self,
        positions: np.ndarray,
        *,
        step: int | None = None,
        time: float | None = None,
        box: np.ndarray | None = None,
        ids: np.ndarray | None = None,
    ) -> int:
        """Publish the next frame; return its index.

        The frame is encoded straight into its (recycled, already mapped) file: the
        coordinates are copied once and hashed on the way. Under retention the oldest frames
        are retired first, which may wait for consumer groups (``on_full="block"``).

        Parameters
        ----------
        positions
            ``(natoms, 3)`` coordinates in Å.
        step, time
            MD step and time (ps); default: the frame index and 0.0.
        box
            ``(3, 3)`` box vectors or 3 lengths in Å.
        ids
            Atom ids for the paper layouts (default ``0..natoms-1``).

        Raises
        ------
        StreamFull
            ``on_full="block"`` and the consumer groups did not take the oldest frame
            within the stream's timeout.
        ArchiveError
            ``archive=`` names a file that exists (first frame, without ``overwrite``), or
            the archiver this stream started exited while the stream waited for it.
        KeyExistsError
            The frame is already published (a stream of this name exists; see ``overwrite``).
        MetadataUnavailable
            Cluster mode: Redis could not record the frame, or one of the few before it.
            Only the first frame's record is waited for; each later frame's record is sent
            and its answer read by a later ``append`` (at most four frames later, 3 +
            ``INSTRIDE_RECORD_BATCH`` while records are held back) or by :meth:`close`,
            so an error in it surfaces there (a stream without retention reads
            the answers already in after its publication: an error read then is raised by
            the next ``append``, before it publishes). The frame whose record failed
            is not lost: the next ``append`` or ``close`` sends its record again before
            anything else (as the same publication, so it is stored once). Apart from a
            stream's first frame, whose record is waited for, this is raised before the
            frame is published, never after: a frame that was published stays so (a look at
            the groups' cursors that fails right after a publication retires nothing then;
            the next ``append`` looks again, before its publication).
        """
        # (after tens of ms idle, every line before the frame is out costs its latency)
        if self.mode == "r":
            raise ValueError(f"stream {self.name!r} was opened for reading")
        if self._closed:
            raise ValueError(f"stream {self.name!r} is closed")
        if self._end_unsettled:
            raise ValueError(f"stream {self.name!r} is ending: its end marker may be recorded "
                             "(PublicationUnsettled); call close() again to settle it")
        paced = _monotonic() - self._appended_at > _PACED_AFTER
        if self._unconfirmed:
            # (an unbounded stream: only the answers it must have now, unless reading the
            # others after the last publication raised — then before this one, so that what
            # recording a frame raised comes before a publication, never after)
            self._confirm_records(all_=False, answered=self.policy.bounded or self._answers_failed)
            self._answers_failed = False
        index = self._written
        step = index if step is None else step
        time_ps = 0.0 if time is None else time
        # one native call encodes and publishes (below); else numpy's encode, the same bytes
        last = self._native
        native = native_frame(positions, step=step, time=time_ps, box=box, layout=self.layout,
                              ids=ids, last=last)
        if native is None or last is None or native.keep is not last.keep:
            # (not the very arrays of the last frame, which passed these checks)
            pos = np.asarray(positions)
            if pos.ndim != 2 or pos.shape[1] != 3:
                raise ValueError(f"positions must have shape (natoms, 3), got {pos.shape}")
            self._nbytes = frame_size(pos.shape[0], self.layout)
        else:
            pos = positions
        self._native = native
        nbytes = self._nbytes
        self._refuse_after_a_failed_start()
        if self._pool is None:
            self._start_producing()
        assert self._pool is not None
        self.mode = "w"
        if self._retained and (len(self._retained) > self._keep_frames
                               or self._retained_bytes > self._keep_bytes):
            self._make_room(nbytes)
        engine = self.client.engine
        # Once a frame is published it stays so: a reader on another node may have it already
        # (its owner's server sends a frame asked for ahead as it appears). So what can fail
        # on the metadata comes before the publication, or cannot fail the append: the
        # answers to the records of the frames that may go right after this one (a record
        # sent again must never come back after its frame's retirement; usually answered
        # long ago: few records are pending at once) are read first; the look at the
        # groups' cursors (which frames do go) comes after, and where it fails nothing is
        # retired then (the next append looks again, before its publication, and raises).
        soon = getattr(engine, "published_soon", None) if self._recorded \
            and engine.wants_checksum else None
        if soon is not None:
            most = self._retirable(nbytes, look=False)
            # (not the answers come since the look above: it was moments ago, and a second
            # look is a read of the connection per frame that finds nothing)
            self._confirm_records(all_=False, before=self._retained[most - 1][0] + 1
                                  if most else 0, answered=False)
        try:
            slot = self._pool.take(nbytes)
        except OSError as exc:  # (no room for its file, in the pool: named by the frame's)
            if type(exc) is not OSError or exc.errno is None:
                raise
            raise OSError(exc.errno, f"{exc.strerror} (the frame was not published)",
                          os.fsdecode(self._final_b % index)) from None
        # one native call encodes and publishes; in cluster mode the record's checksum is the
        # frame's own header checksum ("isf:", see instride.record): no pass over the frame
        published = native is not None and self._pool.write_and_publish(
            slot, native, self._final_b % index, overwrite=self.overwrite,
            fsync=self.client.fsync)
        key = f"{self.name}/{FRAME_FORMAT.format(index)}"
        if not published:  # (native: encoded, not published; the slow path names the error)
            if native is None:
                try:
                    encode_into(self._pool.mapping(slot), pos, step=step, time=time_ps, box=box,
                                layout=self.layout, ids=ids)
                except BaseException:
                    self._pool.discard(slot)
                    raise
            self._pool.publish(slot, f"{self._frame_dir}/{FRAME_FORMAT.format(index)}", key,
                               overwrite=self.overwrite, fsync=self.client.fsync)
        checksum = frame_checksum(header_checksum(slot.mm if slot.head is None else slot.head)) \
            if engine.wants_checksum else None
        # The frames that can go now without waiting for a group; where the stream's state is
        # shared through the metadata (cluster mode), their records go and the head counters
        # are shared in the same step as the new record: one message to Redis per frame.
        try:
            going = self._retirable(nbytes)
        except MetadataUnavailable:
            going = 0  # (the look failed: none now; see above)
        except BaseException:  # (interrupted: taken back, as a record not sent is below)
            self._pool.withdraw(slot)
            raise
        then = self._share.along_publication(
            self._retained[going - 1][0] + 1 if going else self._oldest, index + 1,
            [self.frame_key(i) for i, _, _ in itertools.islice(self._retained, going)])
        self._retained.append((index, slot.ino, nbytes))
        self._retained_bytes += nbytes
        try:
            if soon is not None and checksum:
                # Sent, confirmed once Redis answered (a later append) or by close(): no round
                # trip per frame. (The records answered meanwhile, and those of the frames
                # this one retires, were confirmed before the publication, above.)
                # (the groups' cursors come back with the answer: see _confirm_records)
                report = self._share.cursors_key if self.policy.bounded \
                    and not self.policy.drops else None
                sent = _monotonic()
                pending = soon(key, self.overwrite, checksum, slot.size, then=then or (),
                               report=report, hold=self._hold_for(nbytes, paced, going))
                if not pending.held:  # (sent now, with any held before it)
                    self._holding = 0
                self._unconfirmed.append((index, pending, sent))
                if paced:  # (the frame is out and recorded: its server first, see _PACED_AFTER)
                    os.sched_yield()
            else:
                engine.published(key, self.overwrite, checksum, slot.size if checksum else None,
                                 then=then or ())
                self._recorded = True
        except BaseException:
            # not recorded (cluster mode: the metadata failed): the key goes again, and its
            # file back to the pool, so that the next append publishes this index afresh
            self._retained.pop()
            self._retained_bytes -= nbytes
            self._pool.withdraw(slot)
            raise
        self._written += 1
        for _ in range(going):
            self._retire_oldest(shared=then is not None)
        if then is not None:
            self._head_shared = (self._oldest, self._written)
        self._publish_head()
        if not self.policy.bounded and self._unconfirmed:
            # The answers already in, read now that the frame is out: after ~20 ms idle this
            # costs a producer ~0.1 ms, which before the publication was the frame's latency.
            # (A bounded stream reads them before: their groups' cursors say what may go.)
            try:
                self._confirm_records(all_=False)
            except Exception:  # noqa: BLE001 (raised again by the next append, before it publishes)
                self._answers_failed = True
        self._pool.prepare(nbytes)  # the next frame's file, between frames (unbounded streams)
        self._appended_at = _monotonic()
        return index

    def _confirm_records(self, *, all_: bool, before: int = 0, answered: bool = True) -> None:
        """Read Redis's answers to the frames' records sent without waiting (cluster mode),
        oldest first: those answered already (unless ``answered`` is false) and those of
        frames before ``before``; all of them with ``all_`` or while :data:`_UNCONFIRMED_MAX`
        are pending. Raise what recording one raised (e.g. :class:`MetadataUnavailable`): it
        stays pending, and is sent again, as the same publication, by the next call.
        """
        pending = self._unconfirmed
        # (the records held back are not counted: they go several at a time)
        while pending and (all_ or len(pending) - self._holding >= _UNCONFIRMED_MAX
                           or pending[0][0] < before or answered and pending[0][1].answered()):
            _, record, sent = pending[0]
            record()
            pending.popleft()
            # the groups' cursors as the record's publication read them (no round trip of
            # our own at the bound): as fresh as the moment it was sent
            if record.reported is not None and sent >= self._groups_past[1]:
                self._groups_past = (min(cursors_of(record.reported).values(), default=math.inf),
                                     sent)
        self._holding = min(self._holding, len(pending))

    def _hold_for(self, nbytes: int, paced: bool, going: int) -> bool:
        """Whether the record of the frame being appended is held back, to go to Redis with
        the next ones (else it goes now, with those held before it).

        Held while the producer appends frames of up to :data:`_HOLD_BYTES` flat out: up to
        ``INSTRIDE_RECORD_BATCH`` records in one write, the first held :data:`_HOLD_AGE` s at
        most. In a bounded stream with consumer groups, only while their cursors, as last
        reported, are past the frames this append and the next two retire, and one more
        (``going``: this one's): a record's answer brings the cursors, so held records bring them later, and
        a producer that does not know a group past a frame must look (a round trip)."""
        p = self.policy
        now = _monotonic()
        if self._holding and self._hold_thread != threading.get_ident():
            # (appended from another thread than the batch held: that one's connection holds
            # it, and this thread's records must not overtake it)
            self._push_held()
            self._holding = 0
        if (paced or nbytes > _HOLD_BYTES
                or self._holding >= self.client.settings.record_batch - 1
                or self._holding and now - self._held_since > _HOLD_AGE
                or p.bounded and not p.drops and self._groups_past[0] < self._oldest + going + 3):
            self._holding = 0
            return False
        if not self._holding:
            self._held_since, self._hold_thread = now, threading.get_ident()
        self._holding += 1
        return True

    def _push_held(self) -> None:
        """Push out the records held back, from whichever thread's connection holds them (a
        connection that fails now is closed: its records go again when confirmed)."""
        for _, record, _ in self._unconfirmed:
            push = getattr(record, "push", None)
            if push is not None:
                with contextlib.suppress(OSError):
                    push()

    def _start_producing(self) -> None:
        archive = self.policy.archive
        if archive is not None and not self.overwrite and os.path.lexists(archive):
            # A stream is never continued by a new producer, so a file there holds another
            # run (a managed directory made afresh, the file kept): resumed, its frames would
            # be served as this run's, and this run's skipped as far as it went. Refused
            # before anything is touched.
            raise ArchiveError(self.name, archive,
                               "the file exists: it holds an earlier run of the stream (or "
                               "another file); remove it, or pass overwrite=True to replace it")
        lock = None
        if archive is not None:
            from .archive.base import lock_writer, remove_earlier_run, unlock_writer

            # The file's writer lock, taken here and handed to the archiver: the file is this
            # producer's from now on. Taken by the archiver process alone, another producer's
            # archiver could take it first, in the moments before this one's had started.
            # (of the file the archiver writes: a link's target, as the archiver resolves it)
            target = Path(archive).resolve()
            lock = lock_writer(target, self.name)
            try:
                if self.overwrite:
                    # An earlier run's archive: resumed, it would keep that run's frames and
                    # skip this one's as far as that run went. Only this stream's (another
                    # stream's was removed, also under its live archiver); refused before
                    # anything is touched.
                    remove_earlier_run(target, self.name, lock)
            except BaseException:
                unlock_writer(target, lock)
                raise
        handed = [lock]  # (None once the archiver has it)
        try:
            self._start_run(archive, handed)
        except BaseException:
            if handed[0] is not None:
                unlock_writer(target, handed[0])
            raise

    def _refuse_after_a_failed_start(self) -> None:
        """Raise :class:`ArchiveError` once the archiver of ``archive=`` could not be started
        (the run was begun: begun again, its groups were reset under their readers)."""
        failed = self._archive_start_failed
        if failed is not None:
            raise ArchiveError(self.name, self.policy.archive, "its archiver could not be "
                               f"started: {failed}; abandon the stream (abandon()) and start "
                               "it again") from failed

    def _start_run(self, archive: str | None, lock: list[int | None]) -> None:
        """:meth:`_start_producing` once the archive file is this producer's (``lock``: its
        writer lock, handed to the archiver started here, which sets it to ``None``). A failed
        start of the archiver left a stream that appended on without one: every append refuses
        then (``ArchiveError``)."""
        earlier: list[str] = []
        if self.overwrite:
            # A re-run under the same name: its consumers must see neither the old run's end
            # marker nor its frames past the new run's length. This node's files go first;
            # their records go in the same step as the new run's start, so that a reader
            # sees either the earlier run's records whole or the new run without them.
            earlier = [key for key in self.client.list(f"{self.name}/")
                       if key.rpartition("/")[0] == self.name]
            for key in earlier:
                self.client._unlink(key)
        else:
            self._refuse_an_earlier_run()
        # A new producer never continues a stream: where an earlier run left its state (its
        # frames and end marker deleted, say: no overwrite= needed then), the groups start
        # over — their positions were that run's (a reader of the new run would skip its
        # frames up to them, and a producer under "block" retire them unread). Where none
        # ran, overwrite=True or not, the groups readers opened already are this run's.
        reset = self._share.run_id() is not None
        self._share.start(self.policy, self.register_groups, reset=reset, forget=earlier)
        pool_dir = state_dir(self.client.root, self.name) / "pool"
        frame_dir = self.client.root / self.name
        frame_dir.mkdir(parents=True, exist_ok=True)
        self._frame_dir = str(frame_dir)
        #: the path of frame ``i``: ``self._final_b % i`` (the native publication's argument;
        #: a "%" of the directory's own name escaped)
        self._final_b = os.fsencode(str(frame_dir)).replace(b"%", b"%%") + os.fsencode(
            "/" + FRAME_FORMAT.replace("{:09d}", "%09d"))
        pool = SlotPool(pool_dir, recycle=self.policy.bounded)
        if archive is not None:
            from .archive import start_archiver

            try:
                self._archiver = start_archiver(self.name, archive, self.client, lock=lock)
            except BaseException as exc:
                pool.close()
                # (the run is started: begun again at the next append, it reset the groups --
                # a group reader opened meanwhile got GroupReset; every append refuses now)
                self._archive_start_failed = exc
                raise
        self._pool = pool

    def _refuse_an_earlier_run(self) -> None:
        """A write-once stream whose name holds an earlier run (its end marker, or its last
        frame) is refused before anything is touched: a bounded one's first frames, retired,
        would publish again over a zeroed head, beside the earlier run's last frames and end.

        Raises
        ------
        KeyExistsError
            Names the earlier run's end marker or last frame (``overwrite=True`` replaces it).
        """
        if self.client.exists(self.end_key):
            raise KeyExistsError(self.end_key)
        head = self._share.head()
        if head is not None and head[1] > 0 and self.client.exists(self.frame_key(head[1] - 1)):
            raise KeyExistsError(self.frame_key(head[1] - 1))

    def _over(self, count: int, total: int, allowance: int) -> bool:
        """Whether ``count`` frames of ``total`` bytes exceed the bound by more than one frame
        of ``allowance`` bytes (before a write: the new frame; after it, 0: at all)."""
        p = self.policy
        if p.retain is not None and count > p.retain + (1 if allowance else 0):
            return True
        return p.retain_bytes is not None and total > p.retain_bytes + allowance

    def _holders(self, index: int) -> list[str]:
        """The consumer groups still holding frame ``index`` (none under the drop policies)."""
        if self.policy.drops:
            return []
        past, seen = self._groups_past
        # Cursors only move on, so frames before the lowest one read moments ago need no
        # new look (in cluster mode a round trip per frame); group names are re-read as
        # often as the local state re-reads them (a group registered meanwhile starts at 0).
        if index < past and time.monotonic() - seen < _GROUPS_FRESH:
            return []
        cursors = self._share.cursors()
        self._groups_past = (min(cursors.values(), default=math.inf), time.monotonic())
        return sorted(g for g, c in cursors.items() if c <= index)

    def _make_room(self, nbytes: int) -> None:
        """Before a write of ``nbytes``: retire old frames down to the bound (one frame over
        it at most, retired right after the write), waiting for groups under "block"."""
        if not self.policy.bounded:
            return
        start = time.monotonic()
        while self._retained and self._over(len(self._retained) + 1,
                                            self._retained_bytes + nbytes, nbytes):
            holders = self._holders(self._retained[0][0])
            if holders:
                self._wait_for_groups(start, holders)
                continue
            self._retire_oldest()

    def _retirable(self, nbytes: int, *, look: bool = True) -> int:
        """With a frame of ``nbytes`` about to join the retained ones: how many of the oldest
        frames go right after it, down to the bound, without waiting (up to the first a group
        still holds; ``look=False``: as if none held any, the most that may go)."""
        if not self.policy.bounded:
            return 0
        count, total, going = len(self._retained) + 1, self._retained_bytes + nbytes, 0
        # (never the frame written: one frame larger than the byte bound stays readable)
        for index, _ino, size in self._retained:
            if not self._over(count - going, total, 0) or (look and self._holders(index)):
                break
            going += 1
            total -= size
        return going

    def _wait_for_groups(self, start: float, holders: list[str]) -> None:
        proc = self._archiver
        if proc is not None and "archive" in holders and proc.poll() is not None:
            # (the archiver this stream started is gone: its group would hold it for ever)
            self._archiver = None
            err = proc.communicate()[1].decode(errors="replace").strip()
            let_go(proc)
            raise ArchiveError(self.name, self.policy.archive,
                               f"its archiver exited with status {proc.returncode}: {err}")
        timeout = self.client.settings.timeout if self.timeout is None else self.timeout
        waited = time.monotonic() - start
        if timeout is not None and waited >= timeout:
            raise StreamFull(self.name, waited, holders)
        self._share.wait_progress(1.0 if timeout is None else min(1.0, timeout - waited))

    def _publish_head(self) -> None:
        """Share the head counters, unless they are the ones shared last (a frame retired right
        after the write already shared them: one command per frame less in cluster mode)."""
        head = (self._oldest, self._written)
        if head != self._head_shared:
            self._share.set_head(*head)
            self._head_shared = head

    def _retire_oldest(self, *, shared: bool = False) -> None:
        """Retire the oldest frame: the head first (a reader that misses the file sees why),
        then its file, then its record — unless the record went and the head was shared
        along with the last publication already (``shared``)."""
        assert self._pool is not None
        index, ino, nbytes = self._retained.popleft()
        self._retained_bytes -= nbytes
        self._oldest = index + 1
        if not shared:
            self._publish_head()
        self._pool.retire(ino)
        if not shared:
            self.client.engine.retired(self.frame_key(index))

    def close(self) -> None:
        """End the stream (producer: publish the end-of-stream marker; consumer: release
        the held frame and the consumer group).

        A producer's close also confirms the last frames' records (cluster mode). If that or
        the end marker fails (e.g. :class:`MetadataUnavailable`), the stream stays open and
        ``close()`` may be called again. An end marker Redis may or may not have recorded
        (:class:`PublicationUnsettled`) stays in place: the next ``close()`` settles it
        (confirms its record, or records it), and no frame may be appended meanwhile.
        """
        if self._closed:
            return
        if self.mode == "w":  # (either raises with the stream still open: close() again)
            self._refuse_after_a_failed_start()
            if self._pool is None and self.overwrite:
                # (no frame appended: the run it replaces goes all the same — its frames,
                # end marker and groups — or readers would take it for this run)
                self._start_producing()
            if self._unconfirmed:
                self._confirm_records(all_=True)
            if self._pool is not None:  # (the room of files made ahead, for the end marker)
                self._pool.drop_made()
            if self._end_unsettled:  # (its file is in place: confirmed or recorded now)
                self.client.register(self.end_key, overwrite=self.overwrite)
            else:
                body = json.dumps({"frames": self._written}).encode()
                try:
                    with self.client.open(self.end_key, "wb", overwrite=self.overwrite) as fh:
                        fh.write(body)
                except PublicationUnsettled:
                    self._end_unsettled = True
                    raise
        self._closed = True
        self._release_resources()
        if self._archiver is not None:
            self._finish_archiver()

    def leave_group(self) -> None:
        """Close a consumer group's reader and finish the group: it takes no more frames, and
        a producer that waits for its groups no longer waits for it (what a reader that stops
        early, for good, does). For other readers, the same as :meth:`close`."""
        if self._cursor_file is not None and not self._closed:
            self._done = GROUP_DONE  # (what close() records as the group's position)
        self.close()

    def abandon(self) -> None:
        """Stop producing without ending the stream: the run broke off (its source failed).

        The frames published stay readable. No end-of-stream marker is written, so readers
        do not take the run for complete: they wait for a next frame, up to their timeout.
        No answer is waited for (cluster mode: the records sent stand, as Redis stores each
        as it reads it; those held back are sent now). What the producer holds is released —
        the files made ahead, mappings, descriptors, its share of the stream's state — and an
        archiver started with ``archive=`` is stopped (SIGTERM: it closes its file; ``instride
        archive`` resumes it). A producer's ``with`` block left by an exception does this.

        For a reader, the same as :meth:`close`. Nothing happens on a closed stream.
        """
        if self._closed:
            return
        if self.mode != "w":
            self.close()
            return
        if self._pool is not None:
            self._pool.drop_made()
        self._push_held()  # (the records held back go now: the frames stay readable)
        self._closed = True
        self._release_resources()
        proc, self._archiver = self._archiver, None
        if proc is not None:
            _stop_archiver(proc)

    def _finish_archiver(self) -> None:
        """Wait for the archiver to take the last frames (at least :data:`_ARCHIVE_DRAIN_S`
        s, or the stream's timeout where longer; an interruption stops it, SIGTERM first),
        then check that the archive holds the stream's last frame (an archiver stopped by a
        signal exits 0 too, its file short of the end).

        Raises
        ------
        ArchiveError
            The archiver failed, did not end in time, or left the archive short of the end.
        """
        proc, self._archiver = self._archiver, None
        timeout = self.client.settings.timeout if self.timeout is None else self.timeout
        wait = None if timeout is None else max(timeout, _ARCHIVE_DRAIN_S)
        try:
            _, err = proc.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            _stop_archiver(proc)
            raise ArchiveError(self.name, self.policy.archive,
                               f"its archiver did not take the last frames within {wait:g} s "
                               "of the end; it was stopped") from None
        except BaseException:
            _stop_archiver(proc)
            raise
        let_go(proc)
        if proc.returncode != 0:
            raise ArchiveError(self.name, self.policy.archive,
                               f"its archiver exited with status {proc.returncode}: "
                               f"{err.decode(errors='replace').strip()}")
        if self._written:
            from .archive import open_reader

            archive = open_reader(self.policy.archive, self.name)
            try:
                done = archive.indices()
            finally:
                archive.close()
            if not len(done) or int(done[-1]) < self._written - 1:
                last = int(done[-1]) if len(done) else None
                raise ArchiveError(self.name, self.policy.archive,
                                   f"its archiver ended with frames up to {last} archived of "
                                   f"0..{self._written - 1} (stopped by a signal?)")

    def run_id(self) -> str | None:
        """The id of the stream's current run: new with every producer's start, so a re-run
        under the same name (``overwrite=True``) has another.

        Returns
        -------
        str or None
            ``None`` before a producer started; ``""`` where the producer recorded none (an
            earlier instride's).
        """
        return self._share.run_id()

    # ------------------------------------------------------------------ archive
    def set_archive(self, path: str | os.PathLike[str]) -> None:
        """Record where this stream's archive is, so readers find retired frames there."""
        self._share.set_archive(self.client.settings.node, os.path.abspath(path))

    def archive_path(self) -> str | None:
        """The archive file readable from this node, if the stream has one."""
        found = self._share.archive()
        if found is None:
            return None
        node, where = found
        return where if node == self.client.settings.node or os.path.exists(where) else None

    def _from_archive(self, index: int) -> Frame | None:
        # (looked up each time: a re-run of the stream, overwrite=True, forgets the earlier
        # run's archive or records another — a reader kept from before served the earlier
        # run's frames as this run's)
        where = self.archive_path()
        if self._archive_reader is not None and where != self._archive_where:
            self._archive_reader.close()
            self._archive_reader = None
        self._archive_where = where
        if self._archive_reader is None:
            if where is None or not os.path.exists(where):
                return None
            from .archive import open_reader

            # An archiver resuming the file holds it for writing a moment (until it is in
            # SWMR mode): tried again then, within the stream's timeout (5 s at most)
            limit = _ARCHIVE_BUSY_S if self.timeout is None else min(self.timeout, _ARCHIVE_BUSY_S)
            deadline = time.monotonic() + limit
            while True:
                try:
                    self._archive_reader = open_reader(where, self.name)
                    break
                except ArchiveError as exc:
                    if not exc.busy or time.monotonic() >= deadline:
                        raise
                    time.sleep(0.02)
        held, run = self._archive_reader.run(), self.run_id()
        if held and run and held != run:
            return None  # (the file is another run's: not this run's frames)
        return self._archive_reader.read(index)  # type: ignore[no-any-return]

    def _release_resources(self) -> None:
        self._native = None  # (it holds the producer's last arrays)
        if self._pool is not None:
            self._pool.close()
        self._share.close()
        self._release_held()
        cursor, self._cursor_file = self._cursor_file, None
        try:
            # (recorded every commit_every frames; the group's new reader's; a forked child's
            # copy records nothing: the group's position is the parent's, which reads on)
            if cursor is not None and self._done is not None and self._made_in == forks():
                with contextlib.suppress(GroupLeaseLost):
                    cursor.commit(self._done)
        finally:  # (a last commit that failed — Redis unreachable — still lets go of the rest)
            if cursor is not None:
                cursor.close()
            self._release_readers()

    def _release_readers(self) -> None:
        """The rest of :meth:`_release_resources`: a reader's leases, inbox and archive."""
        old, self._old_leases = self._old_leases, []
        for leases in [*old, *([self._leases] if self._leases is not None else [])]:
            leases.release_all()  # (frames taken and never released: closed now)
            leases.close()
        if self._inbox is not None:
            drop = getattr(self.client.engine, "drop_ahead", None)
            if drop is not None:  # (its owner stops sending the frames asked for ahead: this
                drop(None, None, self._batch)  # reader's alone, from whichever thread it read)
            self._inbox.close()
            self._inbox = None
        if self._archive_reader is not None:
            self._archive_reader.close()
            self._archive_reader = None

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            try:
                self.close()
            except BaseException:
                self.abandon()  # (the block is over: nothing can close it again)
                raise
        else:  # a crashed producer does not claim a complete stream
            self.abandon()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self._pool is not None:
                self._pool.close()
        if getattr(self, "_inbox", None) is not None and not self._closed \
                and self._made_in == forks():
            # (a reader dropped without close(): the owner stops sending what it asked for
            # ahead, into a connection nobody reads — up to 8 MiB, a thread of its server)
            with contextlib.suppress(Exception):
                self.client.engine.drop_ahead(None, None, self._batch)  # type: ignore[attr-defined]
        cursor = getattr(self, "_cursor_file", None)
        if cursor is None or getattr(self, "_closed", True) or self._made_in != forks():
            return  # (a forked child's copy: the group's position is the parent's to record)
        # A group reader dropped without close() (`for f in Stream(..., group=g): ... break`,
        # or iterated to its end): its group's lock and lease go with it, not with the process
        # (a next reader of the group in this process got GroupBusy), its position recorded
        # as close() records it. (Frames it handed out stay held: their arrays may be in use.)
        with contextlib.suppress(Exception):
            self._cursor_file = None
            try:
                if self._done is not None:
                    cursor.commit(self._done)
            finally:
                cursor.close()

    def _check_open(self) -> None:
        """Raise ``ValueError`` on a closed stream (a closed reader holds nothing: a frame
        it took now would be held for good, and a group's frames taken outside its group)."""
        if self._closed:
            raise ValueError(f"stream {self.name!r} is closed")

    # ------------------------------------------------------------------ consumer
    def frame_count(self, *, wait: bool = False, timeout: float | None = None) -> int | None:
        """The number of frames of the ended stream, from its end-of-stream marker.

        This is the one place a stream's final length is computed; readers of closed streams
        (the MDAnalysis reader, the parallel inputs) ask here.

        Parameters
        ----------
        wait
            Wait until the producer closes the stream (else answer at once).
        timeout
            Seconds to wait (default: the stream's timeout).

        Returns
        -------
        int or None
            The frame count; ``None`` while the stream has not ended (``wait=False``).

        Raises
        ------
        ConsumeTimeout
            ``wait=True`` and the stream did not end within the timeout.
        """
        timeout = self.timeout if timeout is None else timeout
        if not wait and not self.client.exists(self.end_key):
            return None
        data = bytes(self.client.consume_bytes(self.end_key, timeout=timeout))
        return int(json.loads(data)["frames"])

    @property
    def ended(self) -> bool:
        """Whether the producer has closed the stream."""
        return self.client.exists(self.end_key)

    def has(self, index: int) -> bool:
        """Whether frame ``index`` is published (no waiting, nothing fetched)."""
        return self.client.exists(self.frame_key(index))

    def published(self) -> list[int]:
        """Indices of the frames published (and still retained) so far, sorted."""
        out = []
        for key in self.client.list(f"{self.name}/frame_"):
            m = _FRAME_RE.search(key)
            if m and key.rpartition("/")[0] == self.name:
                out.append(int(m.group(1)))
        return sorted(out)

    def __len__(self) -> int:
        """Number of frames written so far (retired ones included)."""
        if self.mode == "w":
            return self._written
        head = self._share.head()
        if head is not None:
            return head[1]
        found = self.published()
        return found[-1] + 1 if found else 0

    @property
    def oldest(self) -> int:
        """The oldest frame still retained on this node (0 for a stream without retention)."""
        head = self._share.head()
        return head[0] if head is not None else 0

    def _inbox_buffers(self) -> Inbox:
        if self._inbox is None:
            self._inbox = Inbox()
        return self._inbox

    def _lease_table(self) -> Leases:
        if self._leases is None or self._reader_policy is None:
            policy = self._share.policy()
            if self._leases is None or policy is not None:
                keep = (policy.retain or 16) + _MAP_SLACK if policy is not None and policy.bounded else 0
                if self._leases is not None:
                    if self._leases.holding():
                        # (frames taken before the policy was known: released at close, as
                        # every frame taken is)
                        self._old_leases.append(self._leases)
                    else:
                        self._leases.close()
                self._leases = Leases(keep, self.client.confined)
                self._reader_policy = policy
        return self._leases

    def _gap(self, index: int) -> Frame | None:
        """For a frame no longer retained: the archived copy, else :class:`FramesMissed`."""
        head = self._share.head()
        if head is not None and index < head[0]:
            archived = self._from_archive(index)
            if archived is not None:
                return archived
            raise FramesMissed(self.name, index, head[0] - index, head[0])
        return None

    def read(self, index: int, timeout: float | None = None) -> Frame:
        """Return frame ``index``, waiting for it.

        The frame's arrays are views of the mapped frame file, valid until
        :meth:`Frame.release` (iteration releases each frame when it moves on); with
        ``copy=True`` they are arrays of its own. A frame retired from memory is read from
        the stream's archive, if it has one.

        Parameters
        ----------
        index
            Frame number; negative counts from the newest frame written.
        timeout
            Seconds to wait for it (default: the stream's timeout).

        Returns
        -------
        Frame
            The verified frame.

        Raises
        ------
        EndOfStream
            The stream ended before frame ``index``.
        FramesMissed
            Frame ``index`` was dropped (the stream drops old frames) and is not archived.
        ConsumeTimeout
            The producer fell silent longer than the timeout.
        IntegrityError
            The frame is corrupt.
        StreamRerun
            A reader that has read frames (not a consumer group's): the stream was started
            over under its name since (``overwrite=True``), and frame ``index`` is the new
            run's (see :meth:`_same_run`).
        ValueError
            The stream was closed.
        """
        return self._rejoining(lambda: self._read_of_run(index, timeout))

    def _rejoining(self, take: Callable[[], Frame]) -> Frame:
        """``take()``; where it raised ``GroupReset`` and this group reader has returned no
        frame yet, the group taken again (see :meth:`_rejoin_group`) and ``take()`` again,
        at the new run's position. (``__next__`` does the same inline: its path is hot.)"""
        while True:
            try:
                return take()
            except GroupReset:
                if self._handed or self._closed:
                    raise
                self._rejoin_group()

    def _read_of_run(self, index: int, timeout: float | None) -> Frame:
        """:meth:`read`, a group reset by a re-run raised (``GroupReset``): iteration takes
        the group again at its new position, not at the frame number it asked for."""
        while True:
            try:
                frame = self._read(index, timeout)
            except (EndOfStream, ConsumeTimeout, FramesMissed):
                # (the new run's end, a frame it never made or already dropped)
                if self._rerun(always=True):
                    raise self._stale(index) from None
                raise
            if self._closed:  # (closed from another thread while it waited: takes nothing)
                frame.release()
                self._check_open()
            if self._same_run(frame, index):
                return frame

    def _stale(self, index: int) -> StreamRerun:
        """The error of a plain reader whose stream was re-run (raised from now on at once)."""
        self._rerun_seen = True
        return StreamRerun(self.name, index)

    def _run_now(self) -> object:
        """The stream's run mark (``StreamState.run_mark``), Redis given ``_RUN_ASK`` seconds
        at most: ``None`` where it does not answer in time — the look is advisory, made again
        at the next one (a Redis outage must not end a reader that waits through it)."""
        try:
            return self._share.run_mark(time.monotonic() + _RUN_ASK)
        except MetadataUnavailable as exc:
            if getattr(exc, "refused", None) is not None:  # (Redis's answer: a refusal)
                raise
            return None

    def _rerun(self, *, always: bool = False) -> bool:
        """Whether a plain reader that has returned frames finds its stream re-run since (a
        round trip to Redis in cluster mode: looked at only ``_RUN_LOOK`` after the last look,
        unless ``always``; not known — Redis away — is no)."""
        if self.group is not None or not self._handed:
            return False
        if self._rerun_seen:
            return True
        now = time.monotonic()
        if not (always or self._share.run_mark_cheap or now - self._run_looked >= _RUN_LOOK):
            return False
        mark = self._run_now()
        if mark is None:
            return False
        self._run_looked = now
        return mark != self._run_mark

    def _same_run(self, frame: Frame, index: int) -> bool:
        """Whether a plain reader may return ``frame``, of the stream's run it has read so far.

        A re-run of the stream under its name (``overwrite=True``) numbers its frames from 0
        again: a reader of the earlier run would read on at its own frame number in the new
        run, the new run's frames before it skipped. The stream's run mark is looked at after
        the frame was taken (a re-run counts it up before its first frame): in local mode for
        every frame (a mapped counter); in cluster mode, a round trip to Redis, after a read
        that waited (``_RUN_WAITED``: a re-run's first frames come after a wait) and at most
        every ``_RUN_LOOK`` seconds otherwise. A consumer group's
        reader is told by its group (``GroupReset``).

        Returns
        -------
        bool
            ``False``: the reader had returned no frame yet, and a re-run began since it first
            looked: ``frame`` is released, and the caller reads ``index`` again, of the new run.

        Raises
        ------
        StreamRerun
            The reader has returned frames of an earlier run (``frame`` is released).
        """
        if self.group is not None:
            if not self._handed:
                # (a group reset by a re-run since this reader opened it, looked at before its
                # first frame is returned — see _rejoin_group: on one node its cursor file
                # says so; in cluster mode Redis's answers to its commits would, only after
                # that frame, so the stream's run is asked)
                try:
                    if self._cursor_file is not None:
                        self._cursor_file.check()
                    mark = None if self._share.run_mark_cheap else self._run_now()
                except BaseException:
                    frame.release()
                    raise
                if mark is not None and self._run_mark is not None and mark != self._run_mark:
                    frame.release()
                    raise GroupReset(self.name, self.group)
            self._handed = True
            return True
        if self._rerun_seen:
            frame.release()
            raise StreamRerun(self.name, index)
        share, now = self._share, time.monotonic()
        if share.run_mark_cheap or now - self._run_looked >= _RUN_LOOK or self._run_mark is None \
                or now - self._read_began >= _RUN_WAITED or not self._handed:
            try:
                mark = self._run_now()
            except BaseException:
                frame.release()
                raise
            if mark is not None:
                self._run_looked = now
            if mark is not None and mark != self._run_mark:
                if self._handed:
                    frame.release()
                    raise self._stale(index)
                # (no frame returned yet: the run this reader reads is the one it finds now)
                first, self._run_mark = self._run_mark is None, mark
                if not first:  # (a re-run since the look before the take: take it again)
                    frame.release()
                    return False
        self._handed = True
        return True

    def _read(self, index: int, timeout: float | None) -> Frame:
        """:meth:`read`, without the check of the frame's run."""
        self._check_open()
        self._read_began = time.monotonic()
        if self._rerun_seen:
            raise StreamRerun(self.name, index)
        if self._run_mark is None and self.group is None and not self._handed:
            # (before the first frame is taken: a re-run that starts after this look is seen
            # once the frame is in — looked at again then, see _same_run)
            self._run_mark = self._run_now()
        if index < 0:
            index += len(self)
            if index < 0:
                raise IndexError(f"frame index out of range for stream {self.name!r}")
        timeout = self.timeout if timeout is None else parse_timeout(timeout, "timeout")
        key = self.frame_key(index)
        leases = self._lease_table()
        engine = self.client.engine
        start = time.monotonic()
        published_but_busy = False
        arrived = False  # fetched from another node in this call: verified on the way in
        looks = 0  # how often the frame was looked for (more than once: the reader waited)
        plan = None if self._cadence is None else self._cadence.window(index)
        if engine.name == "local" and self._no_gaps():
            frame = self._take_here(index, key, timeout, plan, leases)
            if frame is not None:
                return frame
            plan = None if self._cadence is None else self._cadence.window(index)
        self._inbox_next = -1  # (read directly: what __next__ would take next is not known)
        while True:
            if looks and self._cursor_file is not None:
                # (between slices of a wait: a group taken from this reader — by a re-run of
                # the stream, which may never reach this frame, or after a lost lease — says
                # so now, not once the frame comes)
                self._cursor_file.check()
            elif looks and self._rerun():  # (a plain reader's wait, likewise)
                raise self._stale(index)
            if not self._run_known:
                self._forget_other_runs()
            path = engine.frame_path(key)
            got = None if path is None else leases.open_key(key, path)  # [confine] no link
            looks += 1
            if got is not None:
                if self._cadence is not None and not arrived:  # (a fetched frame: noted above)
                    self._cadence.arrived(index, time.monotonic(), waited=looks > 1)
                # (a copy another reader here fetched says nothing of where the next comes)
                self._here = None if arrived or engine.is_copy(key) else path[: len(path) - len(key)]
                self._here_waited = 0.0
                buf, release = got
                # a bounded stream: a fetched copy goes when the frame does (none in local mode)
                done = self._dropping_copy(key, release) \
                    if leases.keep and engine.name != "local" else release
                try:
                    frame = decode_frame(buf, key, verify=self.verify and not arrived,
                                         copy=self.copy, releaser=None if self.copy else done)
                except BaseException:
                    release()
                    raise
                if self.copy:  # arrays of its own: the file is not needed any more
                    done()
                return frame
            like = self._fetched_from
            if path is None and like is not None and not published_but_busy and index > 0 \
                    and like.key == self.frame_key(index - 1) and self._no_gaps():
                # Streaming from another node: ask the owner of the last frame for this one
                # now; its data server sends it the moment it is published (no wake-up through
                # Redis, no request round trip). Nothing there in time: the usual way below.
                early = getattr(engine, "fetch_when_published", None)
                self._fetched_from = None  # (set again on success)
                waited = time.monotonic() - start
                part = _SLICE if timeout is None else min(_SLICE, timeout - waited)
                kw = {}
                if plan is not None:
                    # hybrid polling: the owner's reply slept for until the frame is due, then
                    # polled for; held past the window (a slow producer's frame is due later
                    # than a slice), never past the timeout
                    kw["window"] = plan
                    longer = plan[1] - time.monotonic() + _SLICE
                    part = max(part, longer if timeout is None else min(longer, timeout - waited))
                into = getattr(engine, "receive_when_published", None) if leases.keep else None
                got_early = None
                if into is not None and part > 0:
                    # A bounded stream's frame goes once the reader moves on: into memory of
                    # the reader's own, not a copy in a file (see instride.store.inbox)
                    frame = self._into_inbox(index, key, like, part, kw)
                else:
                    frame = None
                    got_early = None if early is None or part <= 0 \
                        else early(key, like, part, until=END_NAME, **kw)
                if plan is not None and time.monotonic() >= plan[0]:
                    self.windows_polled += 1
                    plan = None  # (a later frame is waited for asleep; before the window:
                    # a slow producer, the next slice still sleeps until it)
                if frame is not None:  # received into the inbox
                    return frame
                if got_early is not None:
                    self._fetched_from = got_early
                    arrived = True
                    if self._cadence is not None:  # (frames from another node: their
                        # publication times give the cadence, whether waited for or not)
                        self._cadence.arrived(index, time.monotonic(), waited=True,
                                              published=got_early.time)
                    continue
            self._unwatched = False  # (the usual way below may subscribe again)
            # (an unbounded stream retires nothing: no frame can be missing)
            policy = self._reader_policy
            archived = self._gap(index) if policy is None or policy.bounded else None
            if archived is not None:
                return archived
            # Wait in slices: a frame published and retired while we looked away shows up in
            # the head (a gap), not as a publication.
            if published_but_busy:
                time.sleep(0.0002)  # published, yet not ours to hold: being replaced
            waited = time.monotonic() - start
            if timeout is not None and waited >= timeout:
                # (a stream that ended before this frame: its end, also with a timeout of 0,
                # where no wait — the one place that looks at the end marker — was made)
                try:
                    count = self.frame_count(timeout=0)
                except InstrideError:  # (the end marker's fetch failed: still the timeout)
                    count = None
                if count is not None and index >= count:
                    raise EndOfStream(self.name, index)
                raise ConsumeTimeout(key, waited)
            part = _SLICE if timeout is None else min(_SLICE, timeout - waited)
            # where the frame's file will appear: its path here (local mode; cluster mode when
            # the last frame was one of this node's: the producer is here too)
            near = path if path is not None or self._here is None else self._here + key
            here = path is None and near is not None
            # A stream that may retire frames nobody read: the frame may come and go before
            # this reader looks (a local wait sees only files that are there). The next one
            # appearing says so; the head then tells (a gap) without waiting a slice.
            dropping = policy is not None and policy.bounded and not self._no_gaps()
            nxt = self.frame_key(index + 1) if dropping else None
            if plan is not None and near is not None:
                # hybrid polling: asleep until shortly before the frame is due (a slice at a
                # time), then polling; once the window is over, a later frame is waited for
                # asleep. The loop looks again either way (and keeps to the timeout).
                if self._sleep_then_poll(key, near, plan, part, here=here, nxt=nxt) is not None:
                    plan = None
                continue
            if nxt is not None and near is not None:
                # (and both may come and go while this reader is not running: woken by the
                # frames' files, a wait on this node still sees none — a short slice bounds
                # the miss; one through Redis is woken by the announcements themselves)
                part = min(part, _GAP_SLICE)
            if self.spin > 0 and near is not None:
                end = engine.frame_path(self.end_key)
                seen = poll_paths(_beside(near, key, nxt) + ([end] if end else []),
                                  min(self.spin, part))
                if seen is not None and seen != end:
                    continue  # seen while polling: look (an end marker: the wait says so)
            try:
                woke = self._wait_for(key, part, here=here, nxt=nxt)
            except ConsumeTimeout:
                continue
            if woke == nxt:
                # published, perhaps retired since: the head says (a gap); else looked at as
                # if it had woken us
                archived = self._gap(index)
                if archived is not None:
                    return archived
                if here and near is not None and not os.access(near, os.F_OK):
                    self._here = None  # neither retired nor here: made on another node
                    continue
                woke = key
            if woke != key:
                count = self.frame_count(timeout=timeout)
                if count is not None and index >= count:
                    raise EndOfStream(self.name, index)
                if count is not None:
                    # The stream ended after this frame, which is not here: retired (the head
                    # says so — whatever policy this reader saw first: a re-run may bound what
                    # an earlier run did not), else fetched below, or looked for again a
                    # moment later (every wait returns at once now: the end marker is there)
                    archived = self._gap(index)
                    if archived is not None:
                        return archived
                    if path is not None:
                        time.sleep(min(part, 0.002))
            elif here:
                continue  # its file is here now: the loop opens it
            if path is None:  # on another node: fetch it here
                try:
                    transfers = getattr(engine, "transfers", None)
                    self.client.consume(key, timeout=part)
                    fetched = getattr(engine, "last_fetched", None)
                    self._fetched_from = fetched if fetched is not None and fetched.key == key else None
                    arrived = self._fetched_from is not None and transfers is not None \
                        and getattr(engine, "transfers", None) != transfers
                    if arrived and self._cadence is not None:
                        self._cadence.arrived(index, time.monotonic(), waited=True,
                                              published=self._fetched_from.time)
                except (ConsumeTimeout, KeyNotFoundError):
                    continue  # retired meanwhile? the head tells, on the next turn
                except IntegrityError:  # rewritten by its owner under the transfer: retired
                    archived = self._gap(index)
                    if archived is not None:
                        return archived
                    raise
            published_but_busy = woke == key and path is not None

    def _into_inbox(self, index: int, key: str, like: Record, part: float,
                    kw: dict[str, Any]) -> Frame | None:
        """Frame ``index`` from its owner (``like``: the record of the frame before it), into
        a buffer of the reader's inbox, checked by its own checksums; ``None``: not there
        within ``part`` seconds, or refused (the usual way then). ``kw``: the hybrid polling's
        window (:meth:`read`)."""
        engine = self.client.engine
        buf, free = self._inbox_buffers().take()
        try:
            try:
                room: memoryview | None = buf.writable(like.size)
            except (OSError, ValueError):
                room = None  # (no memory to map: written through the descriptor)
            own = _OwnChecksums(buf, key, self.copy)
            got: Received | bool | None = False
            nxt = getattr(engine, "receive_next_asked", None)
            if room is not None and nxt is not None and not kw:
                # (the frame asked for ahead: received and checked in one native call)
                got = nxt(key, like, part, room, buf.address, buf.rewound, own,
                          unwatch=not self._unwatched, batch=self._batch)
            if got is False:
                got = engine.receive_when_published(
                    key, like, part, buf.rewound(), own, until=END_NAME, into=room,
                    ahead=_ahead(like.size), digest_from=HEADER_SIZE,
                    unwatch=not self._unwatched, batch=self._batch, **kw)
            self._unwatched = True
            frame = own.frame if got is not None else None
            if frame is not None:
                assert isinstance(got, Received)
                # its record, as far as a reader needs one (the owner's, for the next frames)
                self._fetched_from = Record(
                    key, like.owner, got.size, None, like.version,
                    like.time if got.published is None else got.published, like.node)
                if self._cadence is not None:
                    self._cadence.arrived(index, time.monotonic(), waited=True,
                                          published=got.published)
                else:  # the owner sends the next one on what was asked ahead: __next__ takes it
                    self._inbox_next = index + 1
        except BaseException:
            free()
            raise
        if frame is None:
            free()
            return None
        if self.copy:  # arrays of its own: the buffer takes the next frame
            free()
            return frame
        return Frame(frame.header, frame.positions, frame.ids, free)

    def _next_streamed(self) -> Frame | None:
        """The next frame of a stream read from another node, in the steady state: the one its
        owner sends next on what this reader asked for ahead, into the inbox — :meth:`read`'s
        way to it without the search before it (a file of it here, gaps, the head). ``None``:
        not sent in time (:meth:`read` then takes the usual way)."""
        index, like = self._cursor, self._fetched_from
        self._inbox_next, self._fetched_from = -1, None  # (set again on success)
        if like is None:
            return None
        part = _SLICE if self.timeout is None else min(_SLICE, self.timeout)
        return self._into_inbox(index, self.frame_key(index), like, part, {})

    def _take_here(self, index: int, key: str, timeout: float | None,
                   plan: tuple[float, float] | None, leases: Leases) -> Frame | None:
        """Local mode's common case in one native call (``isl_take``): wait for frame
        ``index`` (polling around when it is due, for ``spin``), hold it and check it in the
        kept mapping of its file. ``None`` for anything else — the end marker or something
        other than a frame under the key, a frame being replaced, a watch gone, no native
        library, a slice (``_SLICE``) without it — and :meth:`read` looks again the general
        way. Only where no frame is retired unread (:meth:`_no_gaps`), so the wait need not
        watch for later frames."""
        ifd = armed(self._here_dir)
        if ifd is None:
            return None
        part = _SLICE if timeout is None else min(_SLICE, timeout)
        now = time.monotonic()
        window = (0.0, min(self.spin, part)) if self.spin > 0 else (0.0, 0.0) if plan is None \
            else (plan[0] - now, plan[1] - now)
        keys = self._take_keys
        keys[0] = os.fsencode(key)
        # (made between frames, before the wait: not after the wake-up)
        if self.copy and self._into is None and self._copy_shape is not None:
            self._into = frame_arrays(*self._copy_shape)
        if self._box is None:
            self._box = np.empty((3, 3))
        got = leases.take(ifd, keys, part, window, self.verify, self._into, self._box)
        if not isinstance(got, Taken):
            if isinstance(got, list):
                lost_watches(got)
            return None
        if plan is not None:  # (when it was found: the native call's clock, if it waited)
            assert self._cadence is not None
            if (got.waited or time.monotonic()) >= plan[0]:
                self.windows_polled += 1
        if self._cadence is not None:
            self._cadence.arrived(index, got.waited, waited=got.waited > 0)
        if got.checked:  # (the header's bytes: their box vectors written into self._box)
            box, self._box = self._box, None
            header = checked_header(got.buf, box)
            if got.copied:  # into the arrays made for it, the file let go
                assert self._into is not None
                (positions, ids), self._into = self._into, None
                return Frame(header, positions, ids)
            if not self.copy:
                return frame_views(got.buf, header, got.release)
        try:
            frame = decode_frame(got.buf, key, verify=self.verify, copy=self.copy,
                                 releaser=None if self.copy else got.release, checked=got.checked)
        except BaseException:
            got.release()
            raise
        if self.copy:  # arrays of its own: the file is not needed any more
            got.release()
            self._copy_shape, self._into = (frame.header.layout, frame.natoms), None
        return frame

    @functools.cached_property
    def _here_dir(self) -> Path:
        """The directory of this stream's frames in local mode."""
        return self.client.root / self.name

    @functools.cached_property
    def _take_keys(self) -> ctypes.Array[ctypes.c_char_p]:
        """``isl_take``'s keys: the frame's (set per frame), then the end marker."""
        return (ctypes.c_char_p * 2)(b"", os.fsencode(self.end_key))

    def _wait_for(self, key: str, timeout: float, *, here: bool = False,
                  until_due: bool = False, nxt: str | None = None) -> str:
        """Sleep until ``key``, the end marker or ``nxt`` is published; return which.

        Parameters
        ----------
        key
            The frame waited for.
        timeout
            Seconds to wait at most.
        here
            Cluster mode, the producer on this node (the last frame was one of its files):
            its rename wakes the reader through inotify on this node, as in local mode,
            before the publication's round trip through Redis. After a wait slice
            (``_SLICE``) of nothing here since the last frame, later waits go through Redis
            again (the producer may have moved).
        until_due
            Only hybrid polling's sleep until the frame is due (it does not count).
        nxt
            The frame after ``key``, where ``key`` may be retired unread.

        Raises
        ------
        ConsumeTimeout
            None of them was published within ``timeout``.
        """
        keys = [key, self.end_key] + ([nxt] if nxt else [])
        if self.client.engine.name == "local":
            # (straight to the wait: no record to build from the file, which the caller opens)
            root = str(self.client.root)
            i = wait_keys(root, keys, timeout, label=key, spin=0.0,
                          refuse=functools.partial(check_confined, Path(root), for_write=False))
            return keys[i]
        if not here or self._here is None:
            return self.client.wait_any(keys, timeout=timeout)
        root = self._here[:-1]
        try:
            i = wait_keys(root, keys, timeout, label=key, spin=0.0,
                          refuse=functools.partial(check_confined, Path(root), for_write=False))
        except ConsumeTimeout:
            if not until_due:
                self._here_waited += timeout
                if self._here_waited >= _SLICE:
                    self._here = None
            raise
        self.woken_here += 1
        return keys[i]

    def _sleep_then_poll(self, key: str, path: str, plan: tuple[float, float],
                         most: float, *, here: bool = False, nxt: str | None = None) -> bool | None:
        """Sleep (woken at once by a publication) until ``plan[0]``, then poll for ``key``'s
        file until ``plan[1]``, within ``most`` seconds. Returns whether anything came, or
        ``None`` when ``most`` ran out before the window began (asleep all the time: the
        caller comes back with the next slice). ``here``, ``nxt``: see :meth:`_wait_for`."""
        start, end = plan
        now = time.monotonic()
        if now < start:
            try:
                self._wait_for(key, min(start - now, most), here=here, until_due=True, nxt=nxt)
                return True  # published while asleep (or the end): the caller looks
            except ConsumeTimeout:
                if time.monotonic() < start:
                    return None
        marker = self.client.engine.frame_path(self.end_key)
        left = min(end - time.monotonic(), most - (time.monotonic() - now))
        self.windows_polled += 1
        return poll_paths(_beside(path, key, nxt) + ([marker] if marker else []), left) is not None

    def _forget_other_runs(self) -> None:
        """Cluster mode, before this reader takes a frame file of this node: drop the node's
        copies of another run's frames (a re-run of the stream under its name numbers its
        frames from 0 again). Looked up until a producer has started."""
        run_of = getattr(self._share, "run", None)
        forget = getattr(self.client.engine, "forget_other_runs", None)
        if run_of is None or forget is None:
            self._run_known = True
            return
        run = run_of()
        if run is None:
            return  # (no producer started yet: looked up again before the next look)
        if run:
            forget(self.name, *run, _STREAM_FILES)
        self._run_known = True

    def _no_gaps(self) -> bool:
        """Whether this reader can never find a frame retired before it got there: an
        unbounded stream, or a consumer group of a stream that blocks for its groups. (Only
        then is a frame asked for early sure to come; a retired one would hold the request
        until the next publication.)"""
        policy = self._reader_policy
        return policy is not None and (not policy.bounded or (self.group is not None
                                                              and not policy.drops))

    def _dropping_copy(self, key: str, release: Any) -> Any:
        """For a bounded stream: drop this node's fetched copy when the frame is released."""
        engine = self.client.engine

        def release_and_drop() -> None:
            release()
            engine.drop_copy(key)

        return release_and_drop

    def __getitem__(self, index: int) -> Frame:
        try:
            return self.read(index)
        except EndOfStream as exc:
            raise IndexError(str(exc)) from None

    def seek(self, index: int) -> None:
        """Make ``index`` the next frame iteration returns.

        Parameters
        ----------
        index
            Frame number, from 0.
        """
        if index < 0:
            raise ValueError("seek index must be >= 0")
        self._cursor = index

    def tell(self) -> int:
        """The index of the next frame iteration returns."""
        return self._cursor

    def _release_held(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            held.release()

    def _move_on(self) -> None:
        """Release the frame held and record the group's progress (every ``commit_every``
        frames)."""
        self._release_held()
        if self._cursor_file is not None:
            self._cursor_file.check()  # (a cluster group's lease lost: no more frames as it)
            self._done = self._cursor
            if not 0 <= self._cursor - self._cursor_file.value < self._commit_step():
                self._cursor_file.commit(self._cursor)

    def _commit_step(self) -> int:
        """Frames between two records of the group's position: ``commit_every``, at most the
        producer's ``retain`` under "block" (1 where it is not known)."""
        step, policy = self.commit_every, self._reader_policy
        if step > 1 and (policy is None or not policy.drops):
            # (a byte bound may hold fewer frames than ``retain``: how many is not known)
            step = 1 if policy is None or (policy.bounded and policy.retain is None) \
                or policy.retain_bytes is not None else min(step, policy.retain or step)
        return step

    def __iter__(self) -> Iterator[Frame]:
        return self

    def __next__(self) -> Frame:
        while True:
            try:
                return self._next()
            except GroupReset:
                if self._handed or self._closed:
                    raise
                self._rejoin_group()

    def _rejoin_group(self) -> None:
        """A group reader that has returned no frame yet found its group reset by a re-run
        that began after it opened the group (a reader started before a producer with
        ``overwrite=True``, as a job script starts both): it has read nothing of the earlier
        run, so it takes the group again, at the new run's position, instead of raising
        :class:`GroupReset` — as a plain reader reads the run it finds at its first frame."""
        old, self._cursor_file = self._cursor_file, None
        if old is not None:
            with contextlib.suppress(Exception):  # (its lease went with the reset)
                old.close()
        self._inbox_next, self._fetched_from, self._done = -1, None, None
        self._run_known = False  # (this node's copies of the earlier run's frames: dropped)
        self._run_mark = self._run_now()
        cursor = self._share.open_group(self.group, start=0)
        if self._closed:  # (closed from another thread meanwhile: the group is not kept)
            cursor.close()
            self._check_open()
        self._cursor_file = cursor
        self._cursor = cursor.value

    def _next(self) -> Frame:
        self._check_open()
        if self.mode is None:
            self.mode = "r"
        self._move_on()
        timeout = None
        began: float | None = None  # (when a streamed wait began: read() goes on from there)
        while True:
            try:
                frame = None
                if self._cursor == self._inbox_next:  # streaming from another node
                    began = self._read_began = time.monotonic()
                    frame = self._next_streamed()
                    if frame is not None and not self._same_run(frame, self._cursor):
                        frame = None  # (a re-run before its first frame: read() takes it)
                    if frame is None and self.timeout is not None:  # (waited some of it)
                        timeout = max(0.0, self.timeout - (time.monotonic() - began))
                if frame is None:
                    try:
                        frame, timeout = self._read_of_run(self._cursor, timeout), None
                    except ConsumeTimeout as exc:
                        if began is None:
                            raise
                        # (the whole wait, not read()'s part of it: "after 0.000 s" after
                        # seconds of waiting for a streamed frame)
                        raise ConsumeTimeout(exc.key, time.monotonic() - began) \
                            from exc.__cause__
            except EndOfStream:
                self._move_on()
                raise StopIteration from None
            except FramesMissed as exc:
                timeout = None  # (the frame it resumes at is waited for afresh)
                self._cursor = exc.resume
                self._move_on()
                if self.on_gap == "raise":
                    raise
                self.missed += exc.missed
                continue
            if self._closed:  # (closed from another thread while it waited: takes nothing)
                frame.release()
                self._check_open()
            if self._cursor_file is not None:
                try:  # (a reader paused in its wait, its group taken over meanwhile; or a
                    self._cursor_file.check()  # forked child's copy: GroupBusy)
                except GroupBusy:
                    frame.release()
                    raise
            self._cursor += 1
            self._held = frame
            return frame

    def latest(self) -> Frame:
        """Return the newest frame not older than the cursor, skipping older ones.

        Waits when no frame at or past the cursor is published yet; the cursor moves past the
        frame returned (and, for a consumer group, the frames skipped count as taken).

        Raises
        ------
        EndOfStream
            The stream ended and no frame at or past the cursor exists.
        """
        return self._rejoining(self._latest)

    def _latest(self) -> Frame:
        """:meth:`latest`, a group reset by a re-run raised (``GroupReset``)."""
        self._check_open()
        if self.mode is None:
            self.mode = "r"
        self._move_on()
        while True:
            newest = len(self) - 1
            index = max(newest, self._cursor)
            try:  # (waits when nothing at or past the cursor exists yet)
                frame = self._read_of_run(index, None)
            except FramesMissed:
                continue  # retired between our look and our read: a newer frame exists
            break
        if self._cursor_file is not None:
            try:
                self._cursor_file.commit(index)
            except BaseException:  # (lost the group, or Redis: the frame is not this reader's)
                frame.release()
                raise
            self._done = index  # (what close() records: never behind the frames skipped)
        self._cursor = index + 1
        self._held = frame
        return frame

    def release(self) -> None:
        """Release the frame held by this consumer now (iteration does it when it moves on)."""
        self._release_held()
