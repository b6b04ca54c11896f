"""Confinement: symbolic links, directory keys, special files and trailing slashes are refused
with typed errors, and nothing is ever created, read or removed outside the managed directory.
"""

from __future__ import annotations

import errno
import gc
import os
import time
from pathlib import Path

import pytest

import instride
from instride.errors import FileTypeError, KeyValidationError, UnsafePathError
from instride.paths import confined_path, managed_key_of


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    d = tmp_path / "elsewhere"
    d.mkdir()
    (d / "secret.bin").write_bytes(b"not yours")
    return d


def test_write_through_a_linked_directory_creates_nothing_outside(
    client: instride.Client, managed_dir: Path, outside: Path
) -> None:
    (managed_dir / "s").mkdir()
    (managed_dir / "s" / "link").symlink_to(outside)
    before = _tree(outside)
    for mode in ("wb", "w", "xb", "w+b"):
        with pytest.raises(UnsafePathError, match="'s/link' is a symbolic link") as info:
            with instride.open("s/link/evil.bin", mode) as fh:
                fh.write(b"x" if "b" in mode else "x")
        assert info.value.errno == errno.ELOOP
        assert isinstance(info.value, PermissionError)
    with pytest.raises(UnsafePathError):
        instride.open("s/link/deeper/evil.bin", "wb")
    src = managed_dir.parent / "src.bin"
    src.write_bytes(b"payload")
    with pytest.raises(UnsafePathError):
        client.publish(src, "s/link/evil.bin")
    assert src.exists()  # left untouched
    assert _tree(outside) == before


def test_linked_key_is_neither_read_nor_overwritten(
    client: instride.Client, managed_dir: Path, outside: Path
) -> None:
    (managed_dir / "k.bin").symlink_to(outside / "secret.bin")
    with pytest.raises(UnsafePathError, match="symbolic link"):
        instride.open("k.bin").read()
    with pytest.raises(UnsafePathError):
        instride.consume("k.bin", timeout=0.01)
    with pytest.raises(UnsafePathError):
        instride.consume_bytes("k.bin", timeout=0.01)
    with pytest.raises(UnsafePathError):
        instride.open("k.bin", "wb", overwrite=True)
    with pytest.raises(UnsafePathError):
        client.delete("k.bin")
    assert (outside / "secret.bin").read_bytes() == b"not yours"


def test_consume_through_a_linked_directory_refuses_at_once(
    client: instride.Client, managed_dir: Path, outside: Path
) -> None:
    (managed_dir / "s").symlink_to(outside)
    t0 = time.monotonic()
    with pytest.raises(UnsafePathError):
        instride.consume("s/secret.bin", timeout=30)  # exists outside: never returned
    with pytest.raises(UnsafePathError):
        instride.consume("s/not-yet.bin", timeout=30)  # never waited for through the link
    with pytest.raises(UnsafePathError):
        client.delete("s/secret.bin")
    assert time.monotonic() - t0 < 10
    assert (outside / "secret.bin").exists()
    assert not (outside / "not-yet.bin").exists()


def test_link_replacing_a_directory_after_first_use(
    client: instride.Client, managed_dir: Path, outside: Path
) -> None:
    with instride.open("run/a.bin", "wb") as fh:
        fh.write(b"a")
    os.rename(managed_dir / "run", managed_dir / "run.old")
    (managed_dir / "run").symlink_to(outside)
    with pytest.raises(UnsafePathError):
        instride.open("run/b.bin", "wb")
    with pytest.raises(UnsafePathError):
        instride.open("run/secret.bin")
    assert sorted(p.name for p in outside.iterdir()) == ["secret.bin"]


@pytest.mark.parametrize("key", ["dir/", "run7/frames/", "dir/.", "a//", "./"])
def test_trailing_slash_is_a_key_validation_error(managed_dir: Path, key: str) -> None:
    with pytest.raises(KeyValidationError, match="ends with '/'|empty"):
        instride.open(key, "wb")
    with pytest.raises(KeyValidationError):
        instride.consume(key, timeout=0.01)
    with pytest.raises(KeyValidationError):
        instride.open(f"{managed_dir}/{key}", "wb")
    assert _tree(managed_dir) == []


def test_directory_key_is_refused(client: instride.Client, managed_dir: Path) -> None:
    with instride.open("dir/frame.bin", "wb") as fh:
        fh.write(b"f")
    for call in (lambda: instride.consume("dir", timeout=0.01),
                 lambda: instride.consume_bytes("dir", timeout=0.01),
                 lambda: instride.open("dir").read(),
                 lambda: instride.open("dir", "wb", overwrite=True)):
        with pytest.raises(FileTypeError, match="a directory") as info:
            call()
        assert info.value.errno == errno.EISDIR
    with pytest.raises(FileTypeError, match="not a directory") as info:
        instride.open("dir/frame.bin/x", "wb")  # a file where a directory is needed
    assert info.value.errno == errno.ENOTDIR
    assert _tree(managed_dir) == ["dir", "dir/frame.bin"]


def test_special_files_are_refused_without_blocking(client: instride.Client, managed_dir: Path) -> None:
    os.mkfifo(managed_dir / "fifo")
    t0 = time.monotonic()
    with pytest.raises(FileTypeError, match="a FIFO"):
        instride.consume("fifo", timeout=5)
    with pytest.raises(FileTypeError, match="a FIFO"):
        instride.open("fifo").read()  # the open of a FIFO with no writer must not block
    with pytest.raises(FileTypeError):
        instride.open("fifo", "wb", overwrite=True)
    with pytest.raises(FileTypeError):
        client.register("fifo")
    assert time.monotonic() - t0 < 4


def test_confined_path_unit(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"")
    assert confined_path(tmp_path, "d/f", for_write=False) == tmp_path / "d" / "f"
    assert confined_path(tmp_path, "new/dir/f", for_write=True) == tmp_path / "new" / "dir" / "f"
    (tmp_path / "l").symlink_to(tmp_path / "d")
    with pytest.raises(UnsafePathError, match="'l' is a symbolic link"):
        confined_path(tmp_path, "l/f", for_write=False)


def test_managed_key_of(tmp_path: Path, managed_dir: Path) -> None:
    assert managed_key_of(managed_dir, tmp_path / "out.h5") is None
    assert managed_key_of(managed_dir, managed_dir / "run" / "out.h5") == "run/out.h5"
    (tmp_path / "alias").symlink_to(managed_dir)  # looks outside, is inside
    assert managed_key_of(managed_dir, tmp_path / "alias" / "out.h5") == "out.h5"
    with pytest.raises(KeyValidationError):
        managed_key_of(managed_dir, managed_dir / ".instride" / "x")


@pytest.mark.parametrize("kernel_checks", [True, False], ids=["openat2", "portable"])
def test_reads_are_confined_with_and_without_openat2(
    client: instride.Client, managed_dir: Path, outside: Path, monkeypatch: pytest.MonkeyPatch,
    kernel_checks: bool,
) -> None:
    from instride.paths import ConfinedOpener

    if not kernel_checks:  # an old kernel, or a seccomp filter refusing openat2
        monkeypatch.setattr(ConfinedOpener, "_syscall", None)
    else:
        assert ConfinedOpener._syscall is not None, "openat2 expected on this kernel"
    with instride.open("ok/k.bin", "wb") as fh:
        fh.write(b"fine")
    (managed_dir / "s").mkdir()
    (managed_dir / "s" / "link").symlink_to(outside)
    (managed_dir / "lnk").symlink_to(outside / "secret.bin")
    os.mkfifo(managed_dir / "fifo")
    assert client.open("ok/k.bin").read() == b"fine"
    assert client.open("ok/k.bin", "r").read() == "fine"
    for key, err in (("s/link/secret.bin", UnsafePathError), ("lnk", UnsafePathError),
                     ("fifo", FileTypeError), ("ok", FileTypeError)):
        with pytest.raises(err):
            client.open(key).read()
    with pytest.raises(FileNotFoundError):
        client._open_read("ok/none.bin", managed_dir / "ok" / "none.bin", "rb", -1, None, None,
                          None)


@pytest.mark.parametrize("kernel_checks", [True, False], ids=["openat2", "portable"])
def test_a_held_open_refuses_a_file_retired_or_being_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel_checks: bool,
) -> None:
    """``hold=True`` takes the shared lock a stream's reader takes, and only on the file still
    published under the key: a file locked for rewriting (a bounded stream's producer reusing
    it) or renamed away between the open and the lock is refused, its descriptor closed."""
    import fcntl

    from instride.paths import ConfinedOpener, _hold

    if not kernel_checks:
        monkeypatch.setattr(ConfinedOpener, "_syscall", None)
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "frame_000000001.isf").write_bytes(b"frame")
    opener = ConfinedOpener(tmp_path)
    fd = opener.open("s/frame_000000001.isf", hold=True)
    try:  # held: an exclusive lock (the producer's) is refused now
        probe = os.open(tmp_path / "s" / "frame_000000001.isf", os.O_RDONLY)
        with pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(probe)
    finally:
        os.close(fd)
    rewriting = os.open(tmp_path / "s" / "frame_000000001.isf", os.O_RDONLY)
    fcntl.flock(rewriting, fcntl.LOCK_EX)
    with pytest.raises(FileNotFoundError, match="being reused"):
        opener.open("s/frame_000000001.isf", hold=True)
    os.close(rewriting)
    fd = os.open(tmp_path / "s" / "frame_000000001.isf", os.O_RDONLY)
    os.rename(tmp_path / "s" / "frame_000000001.isf", tmp_path / "pooled")  # retired
    with pytest.raises(FileNotFoundError, match="retired"):
        _hold(fd, "s/frame_000000001.isf", f"{tmp_path}/s/frame_000000001.isf", None)
    with pytest.raises(OSError) as info:  # (closed by the refusal)
        os.fstat(fd)
    assert info.value.errno == errno.EBADF
    opener.close()


def test_reads_go_on_after_the_managed_directory_is_made_again(managed_dir: Path) -> None:
    """A process that had read a key kept a descriptor of the managed directory, beneath which
    its reads look: the directory removed and made again (between two runs, by hand), every
    read of that process failed with KeyNotFoundError — the key's file there all the same."""
    import shutil

    with instride.open("a.txt", "w") as fh:
        fh.write("first")
    with instride.open("a.txt") as fh:  # (the directory's descriptor kept from here)
        assert fh.read() == b"first"
    shutil.rmtree(managed_dir)
    managed_dir.mkdir()
    with instride.open("b.txt", "w") as fh:
        fh.write("second")
    with instride.open("b.txt") as fh:
        assert fh.read() == b"second"


def test_closing_an_opener_never_frees_a_descriptor_under_another_thread(
        managed_dir: Path) -> None:
    """``Client.close()`` closed the managed directory's descriptor that other threads' opens
    were using: an untyped EBADF, or, its number taken by another file meanwhile, a key
    resolved beneath another directory. It is let go of now, closed with the opener."""
    from instride.paths import _RETIRED_KEPT, ConfinedOpener

    with instride.open("held/a.txt", "w") as fh:
        fh.write("a")
    opener = ConfinedOpener(managed_dir)
    first = opener.dirfd()
    opener.close()
    here = os.stat(managed_dir)
    held = os.fstat(first)  # (still open, still the directory: an openat2 beneath it goes on)
    assert (held.st_dev, held.st_ino) == (here.st_dev, here.st_ino)
    os.close(opener.open("held/a.txt"))  # (opened again beneath a new one)
    assert opener.dirfd() != first
    for _ in range(3 * _RETIRED_KEPT):  # (a few kept, the older ones closed: no leak)
        opener.close()
        opener.dirfd()
    assert len(opener._retired) == _RETIRED_KEPT


def test_threads_reading_while_the_managed_directory_is_made_again_leak_nothing(
        tmp_path: Path) -> None:
    """Threads waiting on one opener for a key while the managed directory was removed and
    made again each found the kept descriptor stale and opened a new one; all but the last
    were lost (about one descriptor leaked per recreation), and a thread that read the
    descriptor while another let go of it opened beneath -1: an untyped EBADF."""
    import threading

    from instride.paths import ConfinedOpener

    root = tmp_path / "m"
    root.mkdir()
    gc.collect()  # (what earlier tests left to the collector closes its files now, not below)
    before = len(os.listdir("/proc/self/fd"))
    untyped: list[OSError] = []
    for _ in range(100):
        opener = ConfinedOpener(root)
        with pytest.raises(FileNotFoundError):
            opener.open("k")  # (the directory's descriptor kept from here)
        stop = threading.Event()

        def reader(opener: ConfinedOpener = opener, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                try:
                    os.close(opener.open("k"))
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    untyped.append(exc)

        threads = [threading.Thread(target=reader) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.002)
        root.rmdir()
        root.mkdir()
        time.sleep(0.01)
        stop.set()
        for t in threads:
            t.join()
        del opener, reader  # (the opener closes its descriptors)
    assert not untyped, untyped[:3]
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before  # (a leak: one or more per recreation)
