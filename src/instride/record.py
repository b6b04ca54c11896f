"""Shared value types: the record of one published key, and the checksum rules.

Neutral ground for every layer: the metadata backends store records, the transports verify
received bytes against them, the engines build them. This module does no I/O.

A record's checksum is one of two kinds:

``"xxh3:<16 hex digits>"``
    The xxh3-64 of the whole content (any key).
``"isf:<16 hex digits>"``
    A frame file's own header checksum (:mod:`instride.frames`): the xxh3-64 of its header,
    which holds the payload's length and xxh3-64. Bytes match such a record when their header
    hashes to it and their payload to what the header says: the whole file is covered, as by
    ``xxh3``, and the producer computes it with no pass over the frame beyond the one that
    encodes it (a second pass costs ~1.5 ms per STMV frame, on the simulation's own time).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import xxhash

from .errors import IntegrityError
from .frames import HEADER_SIZE, header_checksum, header_payload

#: The checksum of any content: ``"xxh3:<16 hex digits>"``, of all its bytes.
CHECKSUM_ALGORITHM = "xxh3"
#: The checksum of a frame file: ``"isf:<16 hex digits>"``, its own header checksum.
FRAME_CHECKSUM = "isf"
_FRAME_PREFIX = f"{FRAME_CHECKSUM}:"


def checksum_of(data: bytes | bytearray | memoryview) -> str:
    """Return the record checksum (``"xxh3:<hex>"``) of ``data``."""
    return f"{CHECKSUM_ALGORITHM}:{xxhash.xxh3_64_hexdigest(data)}"


def frame_checksum(hsum: int) -> str:
    """Return the record checksum (``"isf:<hex>"``) of a frame file whose header checksum (the
    8 bytes after its header fields, :func:`instride.frames.header_checksum`) is ``hsum``."""
    return f"{FRAME_CHECKSUM}:{hsum:016x}"


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
        ``"xxh3:<16 hex digits>"`` of the content, or ``"isf:<16 hex digits>"`` for a stream's
        frame (its own header checksum, see the module's docstring); ``None`` when not
        computed (local mode).
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

    @property
    def digest_from(self) -> int:
        """Offset of the first byte the digest given to :meth:`verify` covers: 0 (all of
        them), or the header's size for a frame's record (``"isf:"``: its payload)."""
        checksum = self.checksum
        return HEADER_SIZE if checksum is not None and checksum.startswith(_FRAME_PREFIX) else 0

    def verify(self, digest: str, size: int, head: bytes | memoryview | None = None) -> None:
        """Check received bytes against this record.

        Parameters
        ----------
        digest
            The xxh3-64 hex digest of the bytes from :attr:`digest_from` on.
        size
            How many bytes there are.
        head
            Their first :data:`~instride.frames.HEADER_SIZE` bytes (or more), needed for a
            frame's record (``"isf:"``); ignored for the others.

        Raises
        ------
        IntegrityError
            The size differs, the checksum differs, the bytes are not the frame the record
            names, or the record names an unknown algorithm.
        """
        if size != self.size:
            raise IntegrityError(self.key, f"size {size} differs from the record's {self.size}")
        if self.checksum is None:
            return
        algo, _, expected = self.checksum.partition(":")
        if algo == FRAME_CHECKSUM:
            self._verify_frame(expected, digest, size, head)
            return
        if algo != CHECKSUM_ALGORITHM:
            raise IntegrityError(self.key, f"unknown checksum algorithm {algo!r} (recorded by"
                                           " another version of instride? every node of a job"
                                           " must run the same one)")
        if digest != expected:
            raise IntegrityError(self.key, f"checksum {digest} differs from the record's {expected}")

    def _verify_frame(self, expected: str, digest: str, size: int,
                      head: bytes | memoryview | None) -> None:
        if head is None:  # (a caller that hashed all the bytes: it cannot tell)
            raise IntegrityError(self.key, "a frame's record needs the frame's header to verify it")
        if size < HEADER_SIZE or len(head) < HEADER_SIZE:
            raise IntegrityError(self.key, f"{size} bytes: too short for a frame ({HEADER_SIZE}-byte header)")
        nbytes, psum = header_payload(head, self.key)  # (its own checksum checked: IntegrityError)
        hsum = f"{header_checksum(head):016x}"  # (just checked against the fields)
        if hsum != expected:
            raise IntegrityError(self.key, f"frame header checksum {hsum} differs from the"
                                           f" record's {expected}")
        if HEADER_SIZE + nbytes != size:
            raise IntegrityError(self.key, f"{size} bytes, the frame's header says"
                                           f" {HEADER_SIZE + nbytes}")
        if digest != f"{psum:016x}":
            raise IntegrityError(self.key, f"payload checksum {digest} differs from the frame"
                                           f" header's {psum:016x}")


__all__ = ["CHECKSUM_ALGORITHM", "FRAME_CHECKSUM", "Record", "checksum_of", "frame_checksum"]
