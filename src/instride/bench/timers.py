"""Named timing regions, in the spirit of Caliper annotations.

Each rank owns one :class:`RegionTimer`; code marks regions with ``with timer.region(name,
frame)``; every region entered produces one row (rank, frame, region, start, duration). The
paper splits production and consumption time into *data movement* and *idle* (synchronization)
time; :data:`CATEGORY` says which region is which:

====================  ==========  =====================================================
region                category    what it covers
====================  ==========  =====================================================
produce.md            compute     the MD sleep of one stride
produce.serialize     compute     building the frame (coordinates, header, checksums)
produce.write         movement    open + write + close (publication included)
produce.sync          idle        the pairwise barrier after the write (file systems)
produce.sync_done     idle        file systems, serialized: the barrier until the consumer
                                  has read and analysed the frame
consume.wait          idle        instride: until the key is published
consume.sync          idle        file systems: the pairwise barrier before the read
consume.fetch         movement    instride: bringing the file to this node (0 when local)
consume.store         movement    instride: storing a fetched copy (folded into fetch)
consume.read          movement    open + read + close
consume.deserialize   compute     parsing the frame and verifying its checksums
consume.analytics     compute     the analytics sleep
consume.sync_done     idle        file systems, serialized: the barrier after the analytics
                                  that lets the producer go on
====================  ==========  =====================================================

Data movement is the time in the storage calls, as the paper defines it (time spent in POSIX
calls); building a frame (producer) and parsing and verifying it (consumer) are compute on
both sides.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

CATEGORY: dict[str, str] = {
    "produce.md": "compute",
    "produce.serialize": "compute",
    "produce.write": "movement",
    "produce.sync": "idle",
    "produce.sync_done": "idle",
    "consume.wait": "idle",
    "consume.sync": "idle",
    "consume.fetch": "movement",
    "consume.store": "movement",
    "consume.read": "movement",
    "consume.deserialize": "compute",
    "consume.analytics": "compute",
    "consume.sync_done": "idle",
}

#: Columns of a row, in order.
FIELDS = ("rank", "role", "pair", "node", "frame", "region", "category", "start_s", "duration_s")


@dataclass
class RegionTimer:
    """Records named regions of one rank.

    Parameters
    ----------
    rank, role, pair, node
        Who this timer belongs to; copied into every row.
    origin
        ``time.perf_counter()`` value that ``start_s`` is measured from.
    """

    rank: int
    role: str
    pair: int
    node: str
    origin: float = field(default_factory=time.perf_counter)
    rows: list[tuple] = field(default_factory=list)

    def record(self, name: str, frame: int, start: float, duration: float) -> None:
        """Add a region measured elsewhere (``start`` on the ``perf_counter`` clock)."""
        if name not in CATEGORY:
            raise ValueError(f"unknown region {name!r}")
        self.rows.append(
            (self.rank, self.role, self.pair, self.node, frame, name, CATEGORY[name],
             start - self.origin, duration)
        )

    @contextmanager
    def region(self, name: str, frame: int) -> Iterator[None]:
        """Time the body of the ``with`` block as region ``name`` of ``frame``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, frame, start, time.perf_counter() - start)

    def mark(self, name: str, frame: int) -> None:
        """Record a zero-duration region (a phase that costs nothing in this configuration)."""
        now = time.perf_counter()
        self.record(name, frame, now, 0.0)


__all__ = ["CATEGORY", "FIELDS", "RegionTimer"]
