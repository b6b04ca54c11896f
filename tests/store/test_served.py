"""Which files of the managed directory may be served or recorded (instride.store.served)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from instride.errors import KeyNotFoundError, KeyNotServed
from instride.store.served import check_real, open_served


def test_only_regular_files_inside_the_directory_are_served(tmp_path: Path) -> None:
    root = tmp_path / "m"
    (root / "d").mkdir(parents=True)
    (root / "d" / "real.bin").write_bytes(b"inside")
    (root / "d" / "link").symlink_to(root / "d" / "real.bin")
    (root / "alias").symlink_to(root / "d")
    os.mkfifo(root / "d" / "fifo")
    real = os.path.realpath(root)
    fd, st = open_served(root, real, "d/real.bin")
    try:
        assert st.st_size == 6 and os.read(fd, 10) == b"inside"
    finally:
        os.close(fd)
    for key, reason in [("d/link", "symbolic link"), ("d/fifo", "not a regular file"),
                        ("alias/real.bin", "symbolic link"), ("d", "not a regular file")]:
        with pytest.raises(KeyNotServed, match=reason):
            open_served(root, real, key)
    with pytest.raises(KeyNotFoundError) as info:
        open_served(root, real, "d/absent")
    assert not isinstance(info.value, KeyNotServed)


def test_check_real_names_the_reason() -> None:
    check_real("/m", "a/b", "/m/a/b")
    with pytest.raises(KeyNotServed, match="outside"):
        check_real("/m", "a/b", "/etc/passwd")
    with pytest.raises(KeyNotServed, match="symbolic link"):
        check_real("/m", "a/b", "/m/c/b")
