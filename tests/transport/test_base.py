"""``fetch_to_new_file``: how every transport's ``fetch(record, dest)`` makes its file. The
transports' own tests (``contract.py``) fetch from real owners; here a transport stand-in
writes the body itself, so that the test can look at ``dest`` in the middle of a transfer."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from instride.errors import TransferError
from instride.record import Record
from instride.transport.base import fetch_to_new_file

RECORD = Record(key="t/a.bin", owner="127.0.0.1:1", size=6, checksum="xxh3:0", version=1,
                time=time.time())


class Writer:
    """``fetch_into`` writes ``first``, calls ``between`` (the test's look, or a failure),
    then writes ``rest``."""

    def __init__(self, between: Callable[[], object], first: bytes = b"abc",
                 rest: bytes = b"def") -> None:
        self.between, self.first, self.rest = between, first, rest
        self.calls = 0

    def fetch_into(self, record: Record, fd: int) -> None:
        self.calls += 1
        os.write(fd, self.first)
        self.between()
        os.write(fd, self.rest)


def test_nothing_is_at_dest_until_the_whole_body_is_there(tmp_path: Path) -> None:
    dest = tmp_path / "a.bin"
    seen: list[list[str]] = []
    fetch_to_new_file(Writer(lambda: seen.append(os.listdir(tmp_path))), RECORD, dest)
    assert len(seen) == 1 and "a.bin" not in seen[0]  # mid-transfer: a hidden name alone
    assert [n for n in seen[0] if n.startswith(".a.bin.instride-")] == seen[0]
    assert dest.read_bytes() == b"abcdef"
    assert os.listdir(tmp_path) == ["a.bin"]


def test_a_failed_transfer_leaves_no_file(tmp_path: Path) -> None:
    def cut() -> None:
        raise TransferError("t/a.bin", "connection closed after 3 of 6 bytes")

    with pytest.raises(TransferError, match="after 3 of 6"):
        fetch_to_new_file(Writer(cut), RECORD, tmp_path / "a.bin")
    assert os.listdir(tmp_path) == []


def test_an_existing_dest_is_never_replaced(tmp_path: Path) -> None:
    dest = tmp_path / "a.bin"
    dest.write_bytes(b"theirs")
    writer = Writer(lambda: None)
    with pytest.raises(FileExistsError):
        fetch_to_new_file(writer, RECORD, dest)
    assert writer.calls == 0 and dest.read_bytes() == b"theirs"
    # ... nor one another process makes while the body comes
    other = tmp_path / "b.bin"
    with pytest.raises(FileExistsError):
        fetch_to_new_file(Writer(lambda: other.write_bytes(b"theirs")), RECORD, other)
    assert other.read_bytes() == b"theirs"
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "b.bin"]
