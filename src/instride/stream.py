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
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from .client import Client, get_client
from .errors import EndOfStream, KeyValidationError
from .frames import Frame, encode_frame, read_frame
from .paths import confined_path

FRAME_FORMAT = "frame_{:09d}.isf"
END_NAME = "end_of_stream.json"
_FRAME_RE = re.compile(r"frame_(\d{9})\.isf$")


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
        Seconds a consumer waits for the next frame before :class:`ConsumeTimeout`
        (default: ``INSTRIDE_TIMEOUT``, else forever).
    layout
        Frame layout written by :meth:`append`: ``"xyz32"`` or ``"paper"``.
    overwrite
        Let a producer replace an earlier stream of the same name: its first :meth:`append`
        deletes the old frames and end marker.
    client
        The :class:`~instride.client.Client` to use (default: from the environment).
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
    ) -> None:
        self.client = client or get_client()
        self.name = self.client.key(name)
        if mode not in (None, "r", "w"):
            raise ValueError(f"mode must be 'r', 'w' or None, got {mode!r}")
        self.mode = mode
        self.timeout = timeout
        self.layout = layout
        self.overwrite = overwrite
        self._cursor = 0  # next frame a consumer reads
        self._written = 0  # frames a producer appended
        self._closed = False

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

        Parameters
        ----------
        positions
            ``(natoms, 3)`` coordinates in Å.
        step, time
            MD step and time (ps); default: the frame index and 0.0.
        box
            ``(3, 3)`` box vectors or 3 lengths in Å.
        ids
            Atom ids for the ``paper`` layout (default ``0..natoms-1``).
        """
        if self.mode == "r":
            raise ValueError(f"stream {self.name!r} was opened for reading")
        if self._closed:
            raise ValueError(f"stream {self.name!r} is closed")
        if self._written == 0 and self.overwrite:
            # A re-run under the same name: its consumers must see neither the old run's end
            # marker nor its frames past the new run's length.
            for key in self.client.list(f"{self.name}/"):
                if key.rpartition("/")[0] == self.name:
                    self.client.delete(key)
        self.mode = "w"
        index = self._written
        header, payload = encode_frame(
            positions,
            step=index if step is None else step,
            time=0.0 if time is None else time,
            box=box,
            layout=self.layout,
            ids=ids,
        )
        with self.client.open(self.frame_key(index), "wb", overwrite=self.overwrite) as fh:
            fh.write(header)
            fh.write(payload)
        self._written += 1
        return index

    def close(self) -> None:
        """End the stream (producer): publish the end-of-stream marker. No-op for a consumer."""
        if self._closed:
            return
        self._closed = True
        if self.mode == "w":
            body = json.dumps({"frames": self._written}).encode()
            with self.client.open(self.end_key, "wb", overwrite=self.overwrite) as fh:
                fh.write(body)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # a crashed producer does not claim a complete stream
            self._closed = True

    # ------------------------------------------------------------------ consumer
    def _end_count(self) -> int | None:
        if not self.client.exists(self.end_key):
            return None
        data = bytes(self.client.consume_bytes(self.end_key, timeout=self.timeout))
        return int(json.loads(data)["frames"])

    @property
    def ended(self) -> bool:
        """Whether the producer has closed the stream."""
        return self.client.exists(self.end_key)

    def published(self) -> list[int]:
        """Indices of the frames published so far, sorted."""
        out = []
        for key in self.client.list(f"{self.name}/frame_"):
            m = _FRAME_RE.search(key)
            if m and key.rpartition("/")[0] == self.name:
                out.append(int(m.group(1)))
        return sorted(out)

    def __len__(self) -> int:
        """Number of frames published so far."""
        return len(self.published())

    def read(self, index: int) -> Frame:
        """Return frame ``index``, waiting for it.

        Parameters
        ----------
        index
            Frame number; negative counts from the newest published frame.

        Returns
        -------
        Frame
            The verified frame.

        Raises
        ------
        EndOfStream
            The stream ended before frame ``index``.
        ConsumeTimeout
            The producer fell silent longer than the stream's timeout.
        IntegrityError
            The frame is corrupt.
        """
        if index < 0:
            index += len(self)
            if index < 0:
                raise IndexError(f"frame index out of range for stream {self.name!r}")
        key = self.frame_key(index)
        if self.client.mode == "local":
            try:  # adaptive: a frame already here costs just its read
                return read_frame(confined_path(self.client.root, key, for_write=False))  # [confine]
            except FileNotFoundError:
                pass
        got = self.client.wait_any([key, self.end_key], timeout=self.timeout)
        if got != key:
            count = self._end_count()
            if count is not None and index >= count:
                raise EndOfStream(self.name, index)
        return read_frame(self.client.consume(key, timeout=self.timeout))

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

    def __iter__(self) -> Iterator[Frame]:
        return self

    def __next__(self) -> Frame:
        if self.mode is None:
            self.mode = "r"
        try:
            frame = self.read(self._cursor)
        except EndOfStream:
            raise StopIteration from None
        self._cursor += 1
        return frame

    def latest(self) -> Frame:
        """Return the newest published frame not older than the cursor, skipping older ones.

        Waits when no frame at or past the cursor is published yet; the cursor moves past the
        frame returned.

        Raises
        ------
        EndOfStream
            The stream ended and no frame at or past the cursor exists.
        """
        if self.mode is None:
            self.mode = "r"
        indices = [i for i in self.published() if i >= self._cursor]
        if not indices:
            self.read(self._cursor)  # waits; raises EndOfStream at the end
            indices = [i for i in self.published() if i >= self._cursor] or [self._cursor]
        newest = max(indices)
        frame = self.read(newest)
        self._cursor = newest + 1
        return frame
