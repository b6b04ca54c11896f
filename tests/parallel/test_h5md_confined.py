"""Exports into the managed directory are published under their key, never written in place
and never through a symbolic link."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import instride
from instride.errors import KeyValidationError, UnsafePathError
from instride.parallel import export_h5md


@pytest.fixture
def stream(managed_dir: Path) -> str:
    with instride.Stream("exp", mode="w") as s:
        for i in range(3):
            s.append(np.full((4, 3), float(i), dtype=np.float32), step=i)
    return "instride://exp"


def test_export_into_managed_dir_is_published(stream: str, managed_dir: Path) -> None:
    out = export_h5md(stream, managed_dir / "exports" / "exp.h5", timeout=10)
    assert out == managed_dir / "exports" / "exp.h5"
    path = instride.consume("exports/exp.h5", timeout=1)
    assert path.read_bytes()[:8] == b"\x89HDF\r\n\x1a\n"
    leftovers = [p.name for p in managed_dir.rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []


def test_export_through_a_link_or_to_a_reserved_name_is_refused(
    stream: str, managed_dir: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (managed_dir / "lnk").symlink_to(outside)
    with pytest.raises(UnsafePathError):
        export_h5md(stream, managed_dir / "lnk" / "exp.h5", timeout=10)
    assert list(outside.iterdir()) == []
    with pytest.raises(KeyValidationError):
        export_h5md(stream, managed_dir / ".instride" / "exp.h5", timeout=10)
