"""The record of a published key and the checksum rule (instride.record)."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from instride.errors import IntegrityError
from instride.frames import HEADER_SIZE, encode_frame, header_checksum
from instride.record import FRAME_CHECKSUM, Record, checksum_of, frame_checksum


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


def _frame(seed: int, natoms: int = 1_000) -> bytes:
    pos = np.random.default_rng(seed).random((natoms, 3))
    header, payload = encode_frame(pos, step=seed, layout="paper")
    return bytes(header) + bytes(payload)


def test_a_frames_record_is_its_header_checksum_and_covers_the_whole_file() -> None:
    """An ``isf:`` record (a stream's frame): the digest covers the payload, the header is
    checked by the record; any byte changed, a frame cut short or another frame fails, each
    with a message that names what."""
    data = _frame(1)
    rec = Record("s/frame_000000001.isf", "o:1", len(data), frame_checksum(header_checksum(data)),
                 3, 0.0)
    assert rec.checksum.startswith(f"{FRAME_CHECKSUM}:") and rec.digest_from == HEADER_SIZE
    assert Record("k", "o", 1, checksum_of(b"x"), 1, 0.0).digest_from == 0
    payload = xxhash.xxh3_64_hexdigest(data[HEADER_SIZE:])
    rec.verify(payload, len(data), data)  # matches: no error
    rec.verify(payload, len(data), memoryview(data)[:HEADER_SIZE])  # the header alone will do
    with pytest.raises(IntegrityError, match="needs the frame's header"):
        rec.verify(payload, len(data))
    with pytest.raises(IntegrityError, match="payload checksum"):
        rec.verify(xxhash.xxh3_64_hexdigest(data), len(data), data)  # (all bytes hashed)
    for where in (0, 30, HEADER_SIZE - 1):  # magic, a field, the header checksum itself
        bad = bytearray(data)
        bad[where] ^= 1
        with pytest.raises(IntegrityError, match="header checksum mismatch"):
            rec.verify(payload, len(data), bad)
    other = _frame(2)
    with pytest.raises(IntegrityError, match="differs from the record's"):
        rec.verify(xxhash.xxh3_64_hexdigest(other[HEADER_SIZE:]), len(other), other)
    cut = Record(rec.key, rec.owner, len(data) - 28, rec.checksum, 3, 0.0)  # one atom short
    with pytest.raises(IntegrityError, match="the frame's header says"):
        cut.verify(xxhash.xxh3_64_hexdigest(data[HEADER_SIZE:-28]), len(data) - 28, data)
    tiny = Record(rec.key, rec.owner, 10, rec.checksum, 3, 0.0)
    with pytest.raises(IntegrityError, match="too short"):
        tiny.verify(payload, 10, data[:10])
