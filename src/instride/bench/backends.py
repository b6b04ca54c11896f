"""The three data-management configurations of the paper, behind one small protocol.

=============  ==============================================  ============================
backend        the paper's configuration                       synchronization
=============  ==============================================  ============================
``instride``   DYAD: local mode on one node, cluster mode      none in user code: the
               (Redis metadata + per-node data servers)        consumer's open waits
               across emulated nodes
``localfs``    XFS: one node-local directory                   pairwise MPI barrier / frame
``sharedfs``   Lustre: a storage server every emulated node    pairwise MPI barrier / frame
               mounts over the network (sshfs,
               :mod:`instride.bench.sshfs`), or one plain
               directory every node sees (``--sharedfs-kind
               dir``, and always on one node)
=============  ==============================================  ============================

Every backend moves frames with ordinary Python file I/O. The file-system backends call the
builtin :func:`open`; the instride backend calls :func:`instride.open` (``"wb"`` publishes on
close; ``"rb"`` waits until the key is published and local). It uses ``instride.open`` rather
than the builtin ``open`` under ``instride.intercept()`` because the timing must split the
consumer's open into its parts (wait for publication, fetch, read), which an intercepted
builtin ``open`` would hide in one call; the bytes go through the same file objects either way.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Protocol

from ..frames import Frame, read_frame
from .molecules import BenchConfigError
from .timers import RegionTimer

BACKENDS = ("instride", "localfs", "sharedfs")


class Backend(Protocol):
    """How a producer writes a frame and a consumer reads it.

    ``explicit_sync`` tells the workflow to add the pairwise barrier (file systems).
    """

    name: str
    explicit_sync: bool

    def write(self, key: str, header: bytes, payload: memoryview) -> None:
        """Write one frame under ``key`` and make it visible (timed as ``produce.write``)."""

    def consume(self, key: str, frame: int, timer: RegionTimer) -> Frame:
        """Read and verify frame ``key``, recording the consume regions on ``timer``.

        The read (``consume.read``, data movement) and the parsing with its checksum checks
        (``consume.deserialize``, compute) are timed apart, as the producer's serialization
        is timed apart from its write.
        """

    def discard(self, key: str) -> None:
        """Remove a consumed frame (untimed, keeps the run's footprint bounded)."""

    def warmup(self) -> None:
        """Open connections before the clock starts (untimed)."""

    def prepare(self, directory: str) -> None:
        """Create what a producer needs before its first write (untimed)."""


class FileSystemBackend:
    """A plain directory: builtin ``open``, no synchronization of its own.

    Parameters
    ----------
    root
        The directory frames are written to (node-local for ``localfs``, shared for
        ``sharedfs``).
    name
        ``"localfs"`` or ``"sharedfs"``.
    fsync
        ``fsync`` each frame before closing it.
    """

    explicit_sync = True

    def __init__(self, root: str | os.PathLike[str], name: str = "localfs", fsync: bool = False):
        self.root = Path(root)
        self.name = name
        self.fsync = fsync

    def write(self, key: str, header: bytes, payload: memoryview) -> None:
        path = self.root / key
        with open(path, "wb") as fh:
            fh.write(header)
            fh.write(payload)
            if self.fsync:
                fh.flush()
                os.fsync(fh.fileno())

    def consume(self, key: str, frame: int, timer: RegionTimer) -> Frame:
        with timer.region("consume.read", frame):
            with open(self.root / key, "rb") as fh:
                data = fh.read()
        with timer.region("consume.deserialize", frame):
            return read_frame(data)

    def discard(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.root / key)

    def warmup(self) -> None:
        """Nothing to connect to."""

    def prepare(self, directory: str) -> None:
        """Create the run's sub-directory (before the first write)."""
        (self.root / directory).mkdir(parents=True, exist_ok=True)


class InstrideBackend:
    """instride: ``instride.open(key, "wb")`` publishes; the consumer's open waits.

    The consumer's time splits into ``consume.wait`` (until the key is published: the
    synchronization), ``consume.fetch`` (cluster mode: the transfer from the producer's node,
    stored under the key locally and verified against its checksum by instride;
    ``consume.store`` is recorded as 0 because the transfer writes straight into the local
    file), ``consume.read`` (open + read) and ``consume.deserialize`` (parsing the frame and
    verifying its own checksums: compute). In local mode the frame is already on this node, so
    fetch and store are 0-duration regions.

    In cluster mode the wait is a wait for the key's metadata record alone
    (``client.metadata.wait_any``), the wait inside ``instride.open(key, "rb")``. The
    client's :meth:`~instride.client.Client.wait_any` is not used there: after a frame
    fetched from a node, it asks that node for the next frame while it waits, so the transfer
    would end inside the wait and be counted as idle time, not data movement.

    Parameters
    ----------
    timeout
        Seconds any single wait may take; ``None``: no limit.
    """

    name = "instride"
    explicit_sync = False

    def __init__(self, timeout: float | None = None) -> None:
        import instride

        self._instride = instride
        self.client = instride.get_client()
        # instride reads None as "INSTRIDE_TIMEOUT"; here None means no limit, which is inf
        self.timeout = float("inf") if timeout is None else timeout
        # the metadata's own wait reads None as "forever"
        self._wait_limit = None if math.isinf(self.timeout) else self.timeout
        self.cluster = self.client.mode == "cluster"

    def warmup(self) -> None:
        """Connect to the metadata service before the clock starts (like ``dyad_init``)."""
        self.client.lookup("bench-warmup/none")
        if self.cluster:
            _ = self.client.cluster

    def write(self, key: str, header: bytes, payload: memoryview) -> None:
        with self._instride.open(key, "wb") as fh:
            fh.write(header)
            fh.write(payload)

    def consume(self, key: str, frame: int, timer: RegionTimer) -> Frame:
        nkey = self.client.key(key)
        if self.cluster:
            with timer.region("consume.wait", frame):  # publication only: nothing moves
                self.client.metadata.wait_any([nkey], self._wait_limit)
            with timer.region("consume.fetch", frame):  # the record's lookup + the transfer
                self._instride.consume(nkey, timeout=self.timeout)
        else:
            with timer.region("consume.wait", frame):
                self.client.wait_any([nkey], timeout=self.timeout)
            timer.mark("consume.fetch", frame)
        timer.mark("consume.store", frame)
        with timer.region("consume.read", frame):
            with self._instride.open(nkey, "rb", timeout=self.timeout) as fh:
                data = fh.read()
        with timer.region("consume.deserialize", frame):
            return read_frame(data)

    def discard(self, key: str) -> None:
        self.client.delete(key)

    def prepare(self, directory: str) -> None:
        """Nothing to prepare: publishing creates the key's directories."""


def make_backend(
    name: str, root: str | os.PathLike[str] | None = None, *, fsync: bool = False,
    timeout: float | None = None,
) -> FileSystemBackend | InstrideBackend:
    """Build backend ``name`` (``root`` is the directory of the file-system backends).

    ``timeout`` bounds every single wait of the instride backend (``None``: no limit).

    ``{node}`` in ``root`` stands for this process's node (``INSTRIDE_NODE``): with a sshfs
    ``sharedfs`` every node reaches the storage server through its own mount point.
    """
    if name == "instride":
        return InstrideBackend(timeout=timeout)
    if name in ("localfs", "sharedfs"):
        if root is None:
            raise BenchConfigError("backend", f"{name} needs a directory")
        root = os.fspath(root)
        if "{node}" in root:
            node = os.environ.get("INSTRIDE_NODE", "").strip()
            if not node:
                raise BenchConfigError(
                    "backend", f"{name} directory {root!r} is per node but INSTRIDE_NODE is unset"
                )
            root = root.replace("{node}", node)
        return FileSystemBackend(root, name, fsync=fsync)
    raise BenchConfigError("backend", f"unknown backend {name!r}; expected one of {BACKENDS}")


__all__ = ["BACKENDS", "Backend", "FileSystemBackend", "InstrideBackend", "make_backend"]
