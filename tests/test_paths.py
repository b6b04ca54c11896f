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


#: Makes the calling thread's ``openat2`` calls wait in the kernel (a seccomp filter's user
#: notification, ``tests/preload/seccomp_hold.py``) until a supervisor thread lets each go on:
#: ``on_call(n)`` runs first, with the call's number; one that returns False never lets it go
#: (only a signal ends that call). Exits 77 where seccomp filters cannot be set (the tests
#: below fail then, saying so). Its scripts need :data:`SECCOMP_HOLD_DIR` on their path.
_PAUSE_OPENAT2 = r'''
from seccomp_hold import hold_calls


def pause_openat2(on_call):
    hold_calls({"openat2": None}, lambda _name, n: on_call(n))
'''
#: where ``seccomp_hold`` is
SECCOMP_HOLD_DIR = Path(__file__).parent / "preload"


def _run_paused(tmp_path: Path, script: str) -> str:
    """Run ``script`` (with :data:`_PAUSE_OPENAT2` importable) in a process of its own; its
    output. Fails, saying why, where the kernel has no ``openat2`` or seccomp filters cannot
    be set (Linux 5.6+ with seccomp user notifications: what the project's machines run)."""
    import subprocess
    import sys

    from instride.paths import ConfinedOpener

    if ConfinedOpener._syscall is None:
        pytest.fail("this kernel has no openat2 (Linux 5.6+): the test needs it")
    (tmp_path / "pause_openat2.py").write_text(_PAUSE_OPENAT2)
    (tmp_path / "script.py").write_text(script)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path), str(SECCOMP_HOLD_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run([sys.executable, str(tmp_path / "script.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode == 77:
        pytest.fail("seccomp user notifications are not available here (needed to hold an "
                    "openat2 in the kernel)")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


_SIGNALLED_OPEN = r'''
import os, signal, sys, threading
from pause_openat2 import pause_openat2
from instride.paths import ConfinedOpener

root = sys.argv[1] + "/m"
os.mkdir(root)
with open(f"{root}/k", "wb") as fh:
    fh.write(b"data")
signal.signal(signal.SIGUSR1, lambda *_: None)  # (Python's: no SA_RESTART, as setitimer's)
main = threading.main_thread().ident


def on_call(n):
    if n == 1:  # a signal while the first call waits in the kernel: it ends with EINTR
        signal.pthread_kill(main, signal.SIGUSR1)
        return False
    return True


opener = ConfinedOpener(root)
pause_openat2(on_call)
fd = opener.open("k")
print(os.read(fd, 10).decode())
'''


def test_a_signal_during_a_confined_open_does_not_fail_it(tmp_path: Path) -> None:
    """``openat2`` is called through ctypes, which does not retry a call a signal interrupts
    as Python's own ``os.open`` does (PEP 475): a signal arriving while a read's open ran (a
    timer's, SIGCHLD, a profiler's; an open on a slow or FUSE file system) failed the read
    with an ``InterruptedError``. Here the open waits in the kernel (a seccomp user
    notification) until a real signal interrupts it."""
    assert _run_paused(tmp_path, _SIGNALLED_OPEN).strip() == "data"


_OPEN_ACROSS_RECREATIONS = r'''
import os, shutil, sys, threading
from pause_openat2 import pause_openat2
from instride.paths import ConfinedOpener

base = sys.argv[1]
root, other = f"{base}/m", f"{base}/other"
for d, data in ((root, b"right"), (other, b"WRONG")):
    os.mkdir(d)
    with open(f"{d}/k", "wb") as fh:
        fh.write(data)
spare = os.open(base, os.O_PATH)  # (a number below the directory descriptor's: see below)
opener = ConfinedOpener(root)
os.close(opener.open("k"))
first = opener.dirfd()
paused, go = threading.Event(), threading.Event()
got = []


def on_call(n):
    if n == 1:  # the reader's first call: held until the directory was made again
        paused.set()
        go.wait(60)


def reader():
    pause_openat2(on_call)  # (this thread's calls only)
    try:
        fd = opener.open("k")
        got.append(os.read(fd, 10).decode())
    except OSError as exc:
        got.append(repr(exc))


t = threading.Thread(target=reader)
t.start()
assert paused.wait(60)
for i in range(5):  # the managed directory removed and made again, read after each time
    if i == 4:  # (the descriptor opened next takes this number, not one freed then)
        os.close(spare)
    shutil.rmtree(root)
    os.mkdir(root)
    with open(f"{root}/k", "wb") as fh:
        fh.write(b"right")
    os.close(opener.open("k"))
taken = []
for _ in range(64):  # another directory's descriptors take the numbers freed
    taken.append(os.open(other, os.O_PATH | os.O_DIRECTORY))
    if taken[-1] == first:
        break
go.set()
t.join(60)
print(got[0] if got else "no answer")
for fd in taken:
    os.close(fd)
print(len(opener._retired))
'''


def test_a_read_under_way_keeps_its_directory_descriptor_across_recreations(
        tmp_path: Path) -> None:
    """A reader in ``openat2`` beneath the managed directory's descriptor while the directory
    was removed and made again five times: the opener let go of it each time and closed the
    oldest of those it let go of, the reader's among them, under the reader -- whose open then
    went on beneath whatever took that number: here another directory, whose file it read as
    the key's. Descriptors in use are closed only once no read uses them."""
    out = _run_paused(tmp_path, _OPEN_ACROSS_RECREATIONS).split()
    assert out[0] == "right", out
    from instride.paths import _RETIRED_KEPT

    assert int(out[1]) == _RETIRED_KEPT  # (the rest closed once the read was done: no leak)


def test_a_directory_descriptor_acquired_is_not_closed_before_it_is_released(
        tmp_path: Path) -> None:
    """A native caller's use of :meth:`ConfinedOpener.dirfd` (a stream reader's lease or take,
    beneath it without the GIL) spans no ``open``: with :meth:`acquire_dirfd` it is not closed
    under the caller however often the directory is made again meanwhile."""
    from instride.paths import _RETIRED_KEPT, ConfinedOpener

    root = tmp_path / "m"
    root.mkdir()
    opener = ConfinedOpener(root)
    held = opener.acquire_dirfd()
    try:
        was = os.fstat(held)
        for _ in range(3 * _RETIRED_KEPT):  # (made again; another thread's read each time)
            root.rmdir()
            root.mkdir()
            with pytest.raises(FileNotFoundError):
                opener.open("k")
        now = os.fstat(held)  # (still that directory's: not closed, not reused)
        assert (now.st_dev, now.st_ino) == (was.st_dev, was.st_ino)
    finally:
        opener.release_dirfd()
    assert len(opener._retired) == _RETIRED_KEPT  # (closed once released)
    assert held not in opener._retired
    del opener
