"""instride gc: a running writer's temporary file is left alone, judged from any PID namespace."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from instride.interception.preload import c_library_path, preload_path
from instride.keys import TMP_PATTERN
from tests.conftest import build_shim

#: a writer through instride's file API (argv[1] "api") or an unmodified Python program under
#: the preload library ("plain": the builtin open on the managed path), holding its file open
WRITER = textwrap.dedent(
    """
    import os, sys
    kind, root = sys.argv[1], sys.argv[2]
    if kind == "api":
        import instride
        fh = instride.open("held/k.bin", "wb")
    else:
        fh = open(os.path.join(root, "held", "k.bin"), "wb")
    fh.write(b"x" * 100_000)
    fh.flush()
    print("writing", flush=True)
    sys.stdin.readline()
    fh.write(b"y")
    fh.close()
    print("closed", flush=True)
    """
)


def _temps(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if TMP_PATTERN.match(p.name)]


@pytest.mark.parametrize("kind", ["api", "plain"])
def test_gc_in_another_pid_namespace_leaves_a_running_writers_file(managed_dir: Path,
                                                                   kind: str) -> None:
    # the writer locks its temporary file (shared) while it writes: a gc run where its process
    # id names nothing (a new PID namespace) leaves the file, and the writer publishes it
    unshare = shutil.which("unshare")
    assert unshare is not None, "util-linux's unshare is needed (apt-get install util-linux)"
    assert os.geteuid() == 0, "a new PID namespace needs root"
    env = dict(os.environ)
    if kind == "plain":
        (managed_dir / "held").mkdir()
        env["LD_PRELOAD"] = str(preload_path())
    proc = subprocess.Popen([sys.executable, "-c", WRITER, kind, str(managed_dir)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "writing"
        [temp] = _temps(managed_dir / "held")
        assert str(proc.pid) in temp.name
        gc = [unshare, "--pid", "--fork", sys.executable, "-m", "instride", "gc"]
        out = subprocess.run(gc, capture_output=True, text=True, check=True)
        assert temp.exists(), out.stdout
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "closed"
        assert (managed_dir / "held" / "k.bin").read_bytes() == b"x" * 100_000 + b"y"
        assert _temps(managed_dir / "held") == []
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_gc_removes_a_killed_writers_file_from_another_pid_namespace(managed_dir: Path) -> None:
    # the lock goes with the writer however it ends: killed, its file is collected, also by a
    # gc that cannot see its process id (the id then looks dead: a new PID namespace)
    unshare = shutil.which("unshare")
    assert unshare is not None, "util-linux's unshare is needed (apt-get install util-linux)"
    assert os.geteuid() == 0, "a new PID namespace needs root"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, "api", str(managed_dir)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        [temp] = _temps(managed_dir / "held")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        gc = [unshare, "--pid", "--fork", sys.executable, "-m", "instride", "gc"]
        out = subprocess.run(gc, capture_output=True, text=True, check=True)
        assert str(temp) in out.stdout and not temp.exists()
        assert not (managed_dir / "held" / "k.bin").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


#: a writer that publishes ``k/<kind>.bin`` and exits: instride's file API, an unmodified
#: Python program under the preload library (open/close, dup2 over it, close_range, fopen/fclose
#: and freopen through ctypes, a file moved in from another file system) and a program of the C API
#: (instride_create/instride_commit through ctypes)
PUBLISHER = textwrap.dedent(
    """
    import ctypes, os, sys
    kind, root, api = sys.argv[1], sys.argv[2], sys.argv[3]
    path = os.path.join(root, "k", kind + ".bin")
    if kind == "api":
        import instride
        with instride.open(f"k/{kind}.bin", "wb") as fh:
            fh.write(b"x" * 1000)
    elif kind == "plain":
        with open(path, "wb") as fh:
            fh.write(b"x" * 1000)
    elif kind == "dup2":  # a descriptor closed by dup2 over it: its last close publishes
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        assert os.write(fd, b"x" * 1000) == 1000
        nul = os.open(os.devnull, os.O_RDONLY)
        os.dup2(nul, fd)
        os.close(fd)
        os.close(nul)
    elif kind == "closerange":  # closed with a range of descriptors (close_range)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        assert os.write(fd, b"x" * 1000) == 1000
        os.closerange(fd, fd + 2)
    elif kind == "copied":  # moved in from another file system: the library copies it in
        src = os.path.join(sys.argv[4], "outside.bin")
        with open(src, "wb") as fh:
            fh.write(b"x" * 1000)
        os.rename(src, path)
    elif kind in ("fopen", "freopen"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fopen.restype = ctypes.c_void_p
        libc.fwrite.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        fp = libc.fopen(path.encode(), b"wb")
        assert fp, os.strerror(ctypes.get_errno())
        assert libc.fwrite(b"x" * 1000, 1, 1000, fp) == 1000
        if kind == "freopen":  # the stream reopened on another file: its file is closed
            libc.freopen.restype = ctypes.c_void_p
            libc.freopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p]
            fp = libc.freopen(os.devnull.encode(), b"r", fp)
            assert fp, os.strerror(ctypes.get_errno())
        assert libc.fclose(fp) == 0, os.strerror(ctypes.get_errno())
    else:
        lib = ctypes.CDLL(api, use_errno=True)
        w = ctypes.c_void_p()
        assert lib.instride_create(path.encode(), 0, 0o644, ctypes.byref(w)) == 0
        assert os.write(lib.instride_writer_fd(w), b"x" * 1000) == 1000
        assert lib.instride_commit(w) == 0, os.strerror(ctypes.get_errno())
    """
)


@pytest.fixture(scope="module")
def rename_probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``c/rename_probe.c`` built: records whether a temporary file is locked when renamed."""
    return build_shim(Path(__file__).resolve().parent / "c" / "rename_probe.c",
                      tmp_path_factory.mktemp("probe"))


@pytest.mark.parametrize("kind", ["api", "plain", "dup2", "closerange", "fopen", "freopen",
                                  "copied", "capi"])
def test_a_writers_lock_is_held_until_its_file_has_its_name(managed_dir: Path, tmp_path: Path,
                                                            rename_probe: Path, kind: str) -> None:
    # between a writer's close and the rename that publishes its file, gc must not see the
    # file unlocked (a collector in another PID namespace would take it): the writer keeps a
    # descriptor, so its lock, until the file has its name; the probe looks at the rename
    (managed_dir / "k").mkdir()
    record = tmp_path / "renames.txt"
    preload = [str(preload_path())] if kind not in ("api", "capi") else []
    env = dict(os.environ, RENAME_PROBE_OUT=str(record),
               LD_PRELOAD=":".join([*preload, str(rename_probe)]))
    # (a directory on another file system than the managed one, for "copied": /dev/shm)
    other = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        assert other.stat().st_dev != managed_dir.stat().st_dev, "need two file systems"
        subprocess.run([sys.executable, "-c", PUBLISHER, kind, str(managed_dir),
                        str(c_library_path()), str(other)], env=env, check=True, timeout=60)
    finally:
        shutil.rmtree(other)
    assert (managed_dir / "k" / f"{kind}.bin").read_bytes() == b"x" * 1000
    seen = record.read_text().splitlines()
    assert seen, "the probe saw no rename of a temporary file"
    assert all(line.startswith("held ") for line in seen), seen
    assert _temps(managed_dir / "k") == []


def test_a_file_claimed_a_moment_ago_is_not_old(managed_dir: Path) -> None:
    """``gc --min-age``: a receive file claimed from the pool (an old file renamed to a fetch's
    temporary name, not locked yet: a few microseconds) was judged by its last write, and
    removed under the fetch. Its rename counts as recent now."""
    import time

    from instride.keys import tmp_path
    from instride.store.gc import collect_garbage

    (managed_dir / "k").mkdir()
    pooled = managed_dir / "k" / "pooled.bin"
    pooled.write_bytes(b"an old copy")
    os.utime(pooled, (time.time() - 3600, time.time() - 3600))
    claimed = tmp_path(managed_dir / "k" / "new.bin")
    os.rename(pooled, claimed)  # the claim
    assert collect_garbage(managed_dir, min_age=60) == []
    assert claimed.exists()
    claimed.unlink()


def test_a_temporary_name_with_an_impossible_pid_is_collected(managed_dir: Path) -> None:
    """A file named like a temporary file whose number is no process id (beyond any pid_t,
    or 0) made ``gc`` fail with an ``OverflowError`` (the number handed to ``kill``), or kept
    the file for ever (``kill(0, 0)`` signals the caller's own process group: "alive"). No
    process has such an id: the file is a dead writer's."""
    from instride.store.gc import collect_garbage, pid_alive

    huge = managed_dir / ".x.instride-99999999999999999999-ab.tmp"
    zero = managed_dir / ".y.instride-0-ab.tmp"
    for path in (huge, zero):
        path.write_bytes(b"left over")
    assert sorted(collect_garbage(managed_dir)) == sorted([huge, zero])
    assert not huge.exists() and not zero.exists()
    assert not pid_alive(0) and not pid_alive(1 << 64) and not pid_alive(-1)
    assert pid_alive(os.getpid())


def _opened(directory: Path, name: str, timeout: float) -> None:
    """Wait until a process opens ``directory/name`` (inotify, IN_OPEN): a gc's lock probe."""
    import ctypes
    import select
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    ifd = libc.inotify_init1(os.O_CLOEXEC | os.O_NONBLOCK)
    assert ifd >= 0, os.strerror(ctypes.get_errno())
    try:
        assert libc.inotify_add_watch(ifd, os.fsencode(directory), 0x20) >= 0  # IN_OPEN
        poller = select.poll()
        poller.register(ifd, select.POLLIN)
        names: list[str] = []  # ("": the directory itself, listed)
        while name not in names:
            assert poller.poll(timeout * 1000), f"nobody opened {name}"
            data = os.read(ifd, 65536)
            while data:
                _wd, _mask, _cookie, n = struct.unpack_from("iIII", data)
                names.append(data[16:16 + n].rstrip(b"\0").decode())
                data = data[16 + n:]
    finally:
        os.close(ifd)


def test_gc_in_another_pid_namespace_leaves_a_writers_file_not_locked_yet(
        managed_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer makes its temporary file, then locks it: a gc where its process id names
    nothing (another PID namespace) that looked between the two found the file unlocked and
    removed it under the writer, whose publication then failed (its data lost). The window is
    widened here (the writer's lock waits until the gc has probed the file): a file changed
    less than a moment ago that is not locked is probed again once that moment is over."""
    import threading

    import instride
    import instride.store.publish as publish

    unshare = shutil.which("unshare")
    assert unshare is not None, "util-linux's unshare is needed (apt-get install util-linux)"
    assert os.geteuid() == 0, "a new PID namespace needs root"
    made, probed = threading.Event(), threading.Event()
    lock = publish.mark_writing

    def late_lock(fd: int) -> None:
        made.set()
        probed.wait(30)
        lock(fd)

    monkeypatch.setattr(publish, "mark_writing", late_lock)
    (managed_dir / "late").mkdir()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            with instride.open("late/k.bin", "wb") as fh:
                fh.write(b"x" * 1000)
        except BaseException as exc:  # (seen by the test's thread)
            errors.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert made.wait(30)
        [temp] = _temps(managed_dir / "late")
        gc = subprocess.Popen([unshare, "--pid", "--fork", sys.executable, "-m", "instride", "gc"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _opened(managed_dir / "late", temp.name, 30)
        finally:
            probed.set()  # (the writer locks its file now)
            out, err = gc.communicate(timeout=60)
        assert gc.returncode == 0, err
        assert str(temp) not in out
    finally:
        probed.set()
        writer.join(30)
    assert errors == []
    assert (managed_dir / "late" / "k.bin").read_bytes() == b"x" * 1000
    assert _temps(managed_dir / "late") == []
