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
