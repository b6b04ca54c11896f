"""The record of a published key and the checksum rule (instride.record)."""

from __future__ import annotations

import pytest

from instride.errors import IntegrityError
from instride.record import Record, checksum_of


def test_round_trip_and_verification() -> None:
    data = b"some bytes"
    rec = Record("k/a", "127.0.0.1:7437", len(data), checksum_of(data), 2, 1.5, "n1")
    assert Record.from_json(rec.to_json()) == rec
    digest = rec.checksum.partition(":")[2]
    rec.verify(digest, len(data))  # matches: no error
    with pytest.raises(IntegrityError, match="size"):
        rec.verify(digest, len(data) + 1)
    with pytest.raises(IntegrityError, match="checksum"):
        rec.verify("0" * 16, len(data))
    with pytest.raises(IntegrityError, match="algorithm"):
        Record("k/a", "o", 10, "md5:abc", 1, 0.0).verify(digest, 10)
    Record("k/a", "o", 10, None, 1, 0.0).verify("anything", 10)  # local records carry no sum
