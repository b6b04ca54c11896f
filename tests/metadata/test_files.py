"""Local-mode metadata (the file system) passes the metadata contract."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from instride.config import Settings
from instride.metadata.base import Record
from instride.metadata.files import FileMetadata
from instride.store import publish_file

from .contract import MetadataContract, Put


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[FileMetadata]:
    b = FileMetadata(Settings(dir=tmp_path))
    yield b
    b.close()


@pytest.fixture
def put(backend: FileMetadata) -> Put:
    def _put(key: str, data: bytes) -> Record:
        final = backend.root / key
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.instride-1-ab.tmp")
        tmp.write_bytes(data)
        publish_file(tmp, final, key, overwrite=True)
        return backend.publish(Record(key, "here", len(data), None, 1, time.time()))

    return _put


class TestFileMetadata(MetadataContract):
    pass


def test_list_names_only_keys(backend: FileMetadata, put: Put) -> None:
    """Files that no key can name — put there by other tools — are not listed: a hidden
    ``.instride*`` file (a reserved name: instride's own), a name with a control character,
    one of bytes that are no UTF-8. They were: ``instride ls`` showed them, and ``lookup`` or
    ``open`` of what it listed raised ``KeyValidationError``."""
    import os

    from instride.keys import normalize_key

    put("ls/a", b"x")
    for name in (b"ls/.instriderc", b"ls/.instride-notes", b"ls/ctl\x01x", b"ls/bad\xff",
                 b"ls/.instride-dir/b"):
        path = os.path.join(os.fsencode(backend.root), name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"x")
    listed = backend.list("ls/")
    assert listed == ["ls/a"] == backend.list()
    for key in listed:
        assert normalize_key(key, backend.root) == key
