"""The metadata backend contract.

A backend records which keys are published, by whom, and wakes up waiters. Local mode uses
the file system itself (:mod:`instride.metadata.files`); cluster mode uses Redis
(:mod:`instride.metadata.redis`). Both pass the same contract test suite
(``tests/metadata/contract.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from ..record import Record


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


class PendingRecord:
    """A record sent without waiting for Redis's answer (:meth:`RedisMetadata.publish_soon`).

    Call it for the stored record (it waits for the answer, and raises what
    :meth:`RedisMetadata.publish` would); :meth:`answered` says whether that would not wait.
    """

    def __init__(self, confirm: Callable[[], Record], answered: Callable[[], bool]) -> None:
        # (the Redis backend's subclass overrides __call__ and answered and does not call
        # this: an attribute added here must be set there too)
        self._confirm, self._answered = confirm, answered
        #: once called: the fields of the hash the publication was asked to read back in
        #: the same step (``report``), or ``None``
        self.reported: dict[bytes, bytes] | None = None
        #: whether the record is held back, to go with the next ones (``hold``)
        self.held = False

    def __call__(self) -> Record:
        return self._confirm()

    def answered(self) -> bool:
        """Whether calling it returns without waiting for Redis (the answer is here, or
        none will come: the record is then sent again, as the same publication)."""
        return self._answered()


__all__ = ["MetadataBackend", "PendingRecord", "Record"]
