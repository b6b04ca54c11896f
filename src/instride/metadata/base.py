"""The metadata backend contract.

A backend records which keys are published, by whom, and wakes up waiters. Local mode uses
the file system itself (:mod:`instride.metadata.files`); cluster mode uses Redis
(:mod:`instride.metadata.redis`). Both pass the same contract test suite
(``tests/metadata/contract.py``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable


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
        1 for the first publication, bumped by every overwrite.
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
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Record:
        return cls(**json.loads(text))


@runtime_checkable
class MetadataBackend(Protocol):
    """Five operations every metadata backend provides."""

    def publish(self, record: Record, *, overwrite: bool = True) -> Record:
        """Record a publication and wake its waiters; return the record as stored (version set).

        With ``overwrite`` false, raise :class:`~instride.errors.KeyExistsError` if the key is
        already recorded.
        """

    def lookup(self, key: str) -> Record | None:
        """Return the record of ``key``, or ``None`` when it is not published."""

    def wait_any(self, keys: Sequence[str], timeout: float | None) -> Record:
        """Block until one of ``keys`` is published and return its record.

        Raises :class:`~instride.errors.ConsumeTimeout` naming the first key after ``timeout``.
        """

    def delete(self, key: str) -> None:
        """Forget ``key`` (no error when unknown)."""

    def list(self, prefix: str = "") -> list[str]:
        """Return the published keys starting with ``prefix``, sorted."""

    def close(self) -> None:
        """Release connections."""
