"""Shared value types: the record of one published key, and the checksum rule.

Neutral ground for every layer: the metadata backends store records, the transports verify
received bytes against them, the engines build them. This module does no I/O.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import xxhash

from .errors import IntegrityError

#: The one checksum algorithm records carry: ``"xxh3:<16 hex digits>"``.
CHECKSUM_ALGORITHM = "xxh3"


def checksum_of(data: bytes | bytearray | memoryview) -> str:
    """Return the record checksum (``"xxh3:<hex>"``) of ``data``."""
    return f"{CHECKSUM_ALGORITHM}:{xxhash.xxh3_64_hexdigest(data)}"


@dataclass(frozen=True)
class Record:
    """What is known about one published key.

    Attributes
    ----------
    key
        The key.
    owner
        ``host:port`` of the data server of the node holding the original.
    size
        Size in bytes.
    checksum
        ``"xxh3:<16 hex digits>"`` of the content, or ``None`` when not computed (local mode).
    version
        Increases with every publication of the key: in cluster mode, the number of the
        publication among all of the cluster's (so a key deleted and published again never
        gets a version it had before); in local mode, 1.
    time
        Publication time, seconds since the epoch.
    node
        Name of the owner node (for messages).
    """

    key: str
    owner: str
    size: int
    checksum: str | None
    version: int
    time: float
    node: str = ""

    def to_json(self) -> str:
        """Serialize to a compact JSON object."""
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Record:
        """Rebuild a record from :meth:`to_json` output."""
        return cls(**json.loads(text))

    def verify(self, digest: str, size: int) -> None:
        """Check received bytes (their xxh3 hex ``digest`` and ``size``) against this record.

        Raises
        ------
        IntegrityError
            The size differs, the checksum differs, or the record names an unknown algorithm.
        """
        if size != self.size:
            raise IntegrityError(self.key, f"size {size} differs from the record's {self.size}")
        if self.checksum is not None:
            algo, _, expected = self.checksum.partition(":")
            if algo != CHECKSUM_ALGORITHM:
                raise IntegrityError(self.key, f"unknown checksum algorithm {algo!r}")
            if digest != expected:
                raise IntegrityError(self.key, f"checksum {digest} differs from the record's {expected}")


__all__ = ["CHECKSUM_ALGORITHM", "Record", "checksum_of"]
