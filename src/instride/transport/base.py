"""The transport contract: fetch a published file from its owner's data server."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from ..metadata.base import Record


@runtime_checkable
class Transport(Protocol):
    """Client side of a data plane. Every fetch is authenticated and verified.

    Implementations raise :class:`~instride.errors.PeerUnavailable` when the owner cannot be
    reached, :class:`~instride.errors.TransferError` when a transfer breaks off, and
    :class:`~instride.errors.IntegrityError` when the bytes do not match ``record``; in every
    failure nothing is left at ``dest``.
    """

    def fetch(self, record: Record, dest: Path) -> None:
        """Write the content of ``record.key`` to the new file ``dest`` and verify it."""

    def fetch_bytes(self, record: Record) -> bytearray:
        """Return the verified content of ``record.key`` in memory."""

    def close(self) -> None:
        """Release resources."""
