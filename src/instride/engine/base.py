"""The engine contract: how a :class:`~instride.client.Client` reaches published keys.

A client holds exactly one engine, chosen once at construction from the settings
(``local`` when ``INSTRIDE_REDIS_URL`` is unset, ``cluster`` when it is set). Everything that
differs between the modes lives behind these few methods; the client, the streams and the
server never ask which mode they are in.

=====================  =====================================================================
method                 job
=====================  =====================================================================
``ready(key)``         the local path (str) of a key readable right now, else ``None``
``consume(key, t)``    wait until the key is published and on this node; its local path
``consume_bytes``      its content in memory (zero copy when local)
``wait_any(keys, t)``  wait until one of the keys is published; which one (may fetch it too)
``exists(key)``        whether the key is published (anywhere)
``published(key, o)``  a local atomic publication just happened: record it
``register(key, o)``   record a file already in place under its key; the record
``retired(key)``       a stream frame's file was taken away from its key: forget its record
``drop_copy(key)``     remove this node's fetched copy of a key (never an original)
``is_copy(key)``       whether this node's file of a key is a fetched copy, not an original
``frame_path(key)``    where a key's file is on this node, if it can be opened without a fetch
``stream_state(s)``    a stream's head, policy and consumer groups (files, or Redis)
``close()``            release connections (the engine stays usable)
=====================  =====================================================================
"""

from __future__ import annotations

import io
import mmap
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..metadata.base import MetadataBackend
from ..record import Record
from ..store.streamstate import StreamState

_open = io.open  # the builtin, captured before instride.interception.pyopen may patch it


@runtime_checkable
class Engine(Protocol):
    """What a client needs from its mode."""

    #: ``"local"`` or ``"cluster"`` (the registry name).
    name: str
    #: The metadata backend this engine records publications in.
    metadata: MetadataBackend

    def ready(self, key: str) -> str | None:
        """The local path of ``key`` if it may be read now without waiting, else ``None``.

        A string, not a :class:`~pathlib.Path`: this is the hot path of every read.
        """

    def consume(self, key: str, timeout: float | None) -> Path:
        """Wait until ``key`` is published and present on this node; return its local path.

        Raises :class:`~instride.errors.ConsumeTimeout` after ``timeout`` seconds.
        """

    def consume_bytes(self, key: str, timeout: float | None) -> memoryview:
        """Wait for ``key``; return its content (read-only), with no second copy on disk."""

    def wait_any(self, keys: Sequence[str], timeout: float | None) -> str:
        """Wait until one of ``keys`` is published; return it (an engine may bring it to this
        node on the way, as the cluster engine does for a stream's next key)."""

    def exists(self, key: str) -> bool:
        """Whether ``key`` is published."""

    #: whether :meth:`published` can use a checksum computed by the writer while writing
    wants_checksum: bool

    #: whether :meth:`consume` returns only files it checked to be regular files reached
    #: without a symbolic link (the client then checks nothing after the wait)
    confines: bool

    def published(self, key: str, overwrite: bool, checksum: str | None = None,
                  size: int | None = None, *, then: Sequence[tuple[Any, ...]] = ()) -> None:
        """Called after ``key`` was atomically published on this node (writer closed).

        ``checksum`` (``"xxh3:<hex>"``, or a stream frame's ``"isf:<hex>"``: see
        :mod:`instride.record`) and ``size`` are the writer's, computed while writing,
        or ``None`` (the engine computes what it needs). ``then``: metadata commands to run in
        the same step as the record (from a stream state's ``along_publication``; only
        engines that keep records in a metadata service get any).
        """

    def register(self, key: str, *, overwrite: bool, checksum: str | None = None,
                 size: int | None = None) -> Record:
        """Record the file in place under ``key``; return the record as stored."""

    def retired(self, key: str) -> None:
        """Called after a stream frame's file was moved away from ``key`` on this node."""

    def drop_copy(self, key: str) -> None:
        """Remove this node's fetched copy of ``key``; an original is never removed."""

    def is_copy(self, key: str) -> bool:
        """Whether this node's file of ``key`` is a copy fetched from another node."""

    def frame_path(self, key: str) -> str | None:
        """Where ``key``'s file is on this node if it can be opened without a fetch."""

    def stream_state(self, stream: str) -> StreamState:
        """The head, policy and consumer groups of ``stream`` as this mode shares them."""

    def close(self) -> None:
        """Release connections; the engine stays usable (they are re-made on demand)."""


def map_file(path: str | Path, opener: Any = None) -> memoryview:
    """A read-only memory map of ``path`` (an empty view for an empty file).

    ``opener`` (as for :func:`open`) opens it: engines pass one that refuses symbolic links,
    directories and special files (:class:`~instride.paths.ConfinedOpener`).
    """
    with _open(path, "rb", opener=opener) as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))


__all__ = ["Engine", "map_file"]
