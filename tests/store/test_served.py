"""Which files of the managed directory may be served or recorded (instride.store.served)."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Any

import pytest

from instride.errors import KeyNotFoundError, KeyNotServed
from instride.store.served import NO_FLOCK, check_real, open_served


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


def test_a_served_file_is_held_and_one_being_rewritten_or_renamed_away_is_not_served(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What is sent is held (a shared lock until the descriptor closes: a stream's producer
    cannot rewrite it meanwhile); a file under an exclusive lock (a producer rewriting a retired
    frame's file) is not found, nor one whose name names another file by the time it is locked
    (retired and its key given to nothing, or to another file, since the open)."""
    root = tmp_path / "m"
    root.mkdir()
    (root / "f").write_bytes(b"frame")
    real = os.path.realpath(root)
    fd, _ = open_served(root, real, "f")
    try:
        other = os.open(root / "f", os.O_RDONLY)
        with pytest.raises(BlockingIOError):  # held: no exclusive lock while it is sent
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(other)
    finally:
        os.close(fd)
    writer = os.open(root / "f", os.O_RDWR)
    fcntl.flock(writer, fcntl.LOCK_EX)
    with pytest.raises(KeyNotFoundError):
        open_served(root, real, "f")
    os.close(writer)
    fd, _ = open_served(root, real, "f")  # (released: served again)
    os.close(fd)
    # renamed away between the open and the lock: the name now names another file
    opened = os.open

    def open_then_replace(path: Any, flags: int, *args: Any) -> int:
        got = opened(path, flags, *args)
        os.rename(root / "f", root / "retired")
        (root / "f").write_bytes(b"other")
        return got

    monkeypatch.setattr(os, "open", open_then_replace)
    with pytest.raises(KeyNotFoundError):
        open_served(root, real, "f")


@pytest.mark.parametrize("err", [errno.ENOLCK, errno.EIO])
def test_a_file_system_without_locks_serves_unheld_and_another_lock_failure_refuses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int) -> None:
    """``flock`` saying the file system has no locks (ENOLCK, EOPNOTSUPP, ...): the file is
    served unheld, after the name check; any other failure of the lock: refused, with why."""
    root = tmp_path / "m"
    root.mkdir()
    (root / "f").write_bytes(b"frame")

    def no_lock(fd: int, op: int) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(fcntl, "flock", no_lock)
    if err in NO_FLOCK:
        fd, st = open_served(root, os.path.realpath(root), "f")
        assert st.st_size == 5 and os.read(fd, 10) == b"frame"
        os.close(fd)
    else:
        with pytest.raises(KeyNotServed, match="cannot be locked"):
            open_served(root, os.path.realpath(root), "f")


def test_check_real_names_the_reason() -> None:
    check_real("/m", "a/b", "/m/a/b")
    with pytest.raises(KeyNotServed, match="outside"):
        check_real("/m", "a/b", "/etc/passwd")
    with pytest.raises(KeyNotServed, match="symbolic link"):
        check_real("/m", "a/b", "/m/c/b")
