"""Every wrapped call, from C programs compiled in the session (tests/preload/c)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from .conftest import Builder, Shim

SCENARIOS = [
    "open", "open64", "openat", "openat64", "relative", "creat", "fopen", "freopen", "dup",
    "rdwr", "rename", "rename_open", "fork", "vfork", "eexist", "refuse", "timeout", "unmanaged",
    "ifd_closed", "fortran", "mmap", "mkstemp", "rdonly_creat",
]


def run_scenario(shim: Shim, exe: Path, name: str, outside: Path | None = None) -> None:
    proc = shim.with_env(INSTRIDE_TIMEOUT="0.5").run(
        [exe, name, shim.dir, outside or shim.outside], timeout=30
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().strip() == f"PASS {name}"


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario(shim: Shim, build: Builder, name: str) -> None:
    run_scenario(shim, build("calls.c"), name)
    assert shim.temps() == []


@pytest.mark.parametrize("setting", ["INSTRIDE_FSYNC", "INSTRIDE_OVERWRITE"])
@pytest.mark.parametrize("name", ["open", "creat", "fopen", "dup", "rdwr", "fork", "rename_xdev",
                                  "rename_open", "mmap", "mkstemp"])
def test_scenario_with_setting(shim: Shim, build: Builder, name: str, setting: str) -> None:
    """The publishing paths also work with fsync on, and in overwrite mode."""
    exe = build("calls.c")
    outside = shim.outside
    shm = None
    if name == "rename_xdev":
        shm = Path("/dev/shm") / f"instride-src-{uuid.uuid4().hex}"
        shm.mkdir()
        outside = shm
    try:
        run_scenario(shim.with_env(**{setting: "1"}), exe, name, outside=outside)
    finally:
        if shm is not None:
            shutil.rmtree(shm)
    assert shim.temps() == []


def test_overwrite_replaces_and_rename_replaces(shim: Shim) -> None:
    ow = shim.with_env(INSTRIDE_OVERWRITE="1")
    key = shim.dir / "ow" / "a.txt"
    code = (
        "import os\n"
        f"for i in range(3):\n"
        f"    open({str(key)!r}, 'w').write(f'v{{i}}')\n"
        f"    assert open({str(key)!r}).read() == f'v{{i}}'\n"
        f"src = {str(shim.outside / 's.txt')!r}\n"
        "open(src, 'w').write('renamed')\n"
        f"os.rename(src, {str(key)!r})\n"
        f"assert open({str(key)!r}).read() == 'renamed'\n"
    )
    ow.py(code, check=True)
    assert key.read_text() == "renamed"
    assert shim.temps() == []


def test_scenarios_leave_expected_files(shim: Shim, build: Builder) -> None:
    """Re-check, without the shim, what the programs published."""
    exe = build("calls.c")
    for name in ("open", "creat", "fopen", "dup", "rdwr", "rename", "fork"):
        run_scenario(shim, exe, name)
    d = shim.dir
    assert (d / "open/a.txt").read_text() == "via open\n"
    assert (d / "creat/a.txt").read_text() == "via creat\n"
    assert (d / "creat/b.txt").read_text() == "via creat64\n"
    assert (d / "fopen/a.txt").read_text() == "via fopen 42\n"
    assert (d / "dup/a.txt").read_text() == "abcdef"
    assert (d / "rdwr/a.bin").read_text() == "read me back"
    assert (d / "ren/a.txt").read_text() == "renamed in\n"
    assert (d / "fork/a.txt").read_text() == "parent"
    assert shim.temps() == []


def test_mapping_left_at_exit_is_not_published(shim: Shim, build: Builder) -> None:
    """A process that exits with a shared writable mapping of a key still there: the key is
    not published (as for a producer killed before its close); its temp is left for gc."""
    run_scenario(shim, build("calls.c"), "mmap_exit")
    assert not (shim.dir / "mmap/exit.bin").exists()
    temps = shim.temps()
    assert [p.name.startswith(".exit.bin.instride-") for p in temps] == [True]
    assert temps[0].read_bytes() == b"exit"


def test_negative_timeout_refuses_every_read(shim: Shim, build: Builder) -> None:
    """INSTRIDE_TIMEOUT=-1: open, fopen and freopen of a key, published or not, fail with
    EINVAL (fopen of a published key used to succeed)."""
    (shim.dir / "bad").mkdir()
    (shim.dir / "bad" / "a.txt").write_text("published")
    proc = shim.with_env(INSTRIDE_TIMEOUT="-1").run(
        [build("calls.c"), "timeout_bad", shim.dir, shim.outside], timeout=30)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().strip() == "PASS timeout_bad"
    assert (shim.dir / "bad" / "a.txt").read_text() == "published"


def test_dup2_over_a_losing_writer_logs_under_debug(shim: Shim, build: Builder) -> None:
    """dup2 cannot return a publication failure (POSIX dup2 loses close errors too): it
    returns newfd, nothing is replaced, and INSTRIDE_DEBUG=1 says why."""
    exe = build("calls.c")
    proc = shim.with_env(INSTRIDE_DEBUG="1").run([exe, "dup2_eexist", shim.dir, shim.outside])
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"key d2/a.txt was published by someone else first" in proc.stderr
    assert (shim.dir / "d2" / "a.txt").read_text() == "first"
    assert shim.temps() == []


def test_close_from_atexit_handler_publishes(shim: Shim, build: Builder) -> None:
    """Runtimes (libgfortran, ...) close their files while the process exits."""
    run_scenario(shim, build("calls.c"), "atexit")
    assert (shim.dir / "atexit/a.txt").read_text() == "closed at exit"
    assert shim.temps() == []


def test_rename_across_file_systems_c(shim: Shim, build: Builder) -> None:
    shm = Path("/dev/shm") / f"instride-src-{uuid.uuid4().hex}"
    shm.mkdir()
    try:
        assert shm.stat().st_dev != shim.dir.stat().st_dev, "needs /dev/shm and /tmp to differ"
        run_scenario(shim, build("calls.c"), "rename_xdev", outside=shm)
        assert (shim.dir / "xdev/a.txt").read_text() == "across file systems\n"
        assert list(shm.iterdir()) == []
    finally:
        shutil.rmtree(shm)


@pytest.mark.parametrize(
    ("flags", "symbols"),
    [
        (("-O2", "-D_FORTIFY_SOURCE=2"), ("__open_2", "__openat_2")),
        (("-O2", "-D_FORTIFY_SOURCE=2", "-D_FILE_OFFSET_BITS=64"), ("__open64_2", "__openat64_2")),
    ],
    ids=["fortify", "fortify-lfs"],
)
def test_fortified_variants(shim: Shim, build: Builder, flags: tuple, symbols: tuple) -> None:
    exe = build("calls.c", *flags, name="calls-" + "-".join(f.strip("-")[:8] for f in flags))
    undefined = subprocess.run(["nm", "-D", "--undefined-only", exe], capture_output=True,
                               text=True, check=True).stdout
    for sym in symbols:  # the program really calls the fortified entry points
        assert sym in undefined, undefined
    run_scenario(shim, exe, "fortified")
    assert (shim.dir / "fort/a.txt").read_text() == "fortified"


def test_threads(shim: Shim, build: Builder) -> None:
    exe = build("threads.c")
    proc = shim.run([exe, shim.dir, shim.outside, "8", "60"], timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert proc.stdout.decode().strip() == "PASS threads 8 x 60"
    keys = sorted(shim.dir.rglob("k*.bin"))
    assert len(keys) == 8 * 60
    assert shim.temps() == []
    # the plain-I/O threads wrote ordinary files outside
    assert len(list(shim.outside.glob("plain*.txt"))) == 16
    assert all(p.read_text() == "xy" for p in shim.outside.glob("plain*.txt"))


def test_gfortran_open_without_action(shim: Shim, build: Builder) -> None:
    """gfortran's OPEN without ACTION= opens read-write, then retries read-only on EROFS: a
    reader with STATUS='OLD' or 'UNKNOWN' reads a published key (it was EPERM / EEXIST), and
    with STATUS='OLD' waits for a key not yet published."""
    exe = build("fortran_io.f90")
    key = shim.dir / "f" / "in.dat"
    shim.run([exe, "write", key, "written by fortran"], check=True)
    assert key.read_text() == "written by fortran\n"
    for status in ("old", "unknown"):
        proc = shim.run([exe, "read", key, status], check=True)
        assert proc.stdout.decode().strip() == "written by fortran"
    assert key.read_text() == "written by fortran\n"
    late = shim.dir / "f" / "late.dat"
    reader = shim.popen([exe, "read", late, "old"])
    time.sleep(0.5)
    assert reader.poll() is None
    shim.run([exe, "write", late, "later"], check=True)
    out, err = reader.communicate(timeout=30)
    assert reader.returncode == 0, err
    assert out.decode().strip() == "later"
    assert shim.temps() == []


def test_a_failed_fsync_is_not_published(shim: Shim, build: Builder) -> None:
    """INSTRIDE_FSYNC=1 and a disk whose write-back fails (fsync: EIO): the close fails with
    EIO and the key is not published, by close() and by fclose() (the failure was ignored and
    the file published: Linux reports a write-back error once, to that fsync)."""
    eio = build("fsync_eio.c", "-shared", "-fPIC", name="fsync_eio.so")
    writer = build("stdio_write.c")
    env = shim.with_env(INSTRIDE_FSYNC="1")
    env.env["LD_PRELOAD"] = f"{eio}:{env.env['LD_PRELOAD']}"
    proc = env.py(f"""
import errno
fh = open({str(shim.dir / "k.bin")!r}, "wb")
fh.write(b"data")
try:
    fh.close()
except OSError as exc:
    print("close", errno.errorcode[exc.errno])
""")
    assert proc.stdout.decode().split() == ["close", "EIO"], proc.stderr.decode()
    proc = env.run([writer, shim.dir / "s.txt", "data"])
    assert proc.returncode == 1 and proc.stdout.decode().strip() == "fclose Input/output error"
    assert sorted(p.name for p in shim.dir.iterdir() if not p.name.startswith(".")) == []
    # (and without the failing fsync, both publish)
    ok = shim.with_env(INSTRIDE_FSYNC="1")
    ok.run([writer, shim.dir / "s.txt", "data"], check=True)
    assert (shim.dir / "s.txt").read_text() == "data"


@pytest.mark.parametrize(("case", "said"), [
    ("fclose-eintr", "fclose -1 Interrupted system call"),
    ("freopen-efbig", "freopen NULL File too large"),
])
def test_a_stream_whose_last_bytes_fail_is_not_published(shim: Shim, build: Builder,
                                                         case: str, said: str) -> None:
    """A written stream whose buffered bytes cannot reach its file as it is closed: an
    ``fclose`` whose flush is interrupted (EINTR, an NFS or FUSE write), a ``freopen`` onto
    another file past the file size limit. The call fails with that error and nothing is
    published under the key (the first 0 or 1,000 of 3,000 bytes were, as the whole file;
    ``fclose``'s EINTR was taken for ``close(2)``'s, and ``freopen``'s flush went unchecked)."""
    exe = build("short_stream.c")
    proc = shim.run([exe, shim.dir / "short.bin", case])
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().splitlines() == [said, "absent"], proc.stdout.decode()
    assert shim.temps() == []


def test_a_readers_failed_wait_never_fails_a_writer(shim: Shim, build: Builder) -> None:
    """A reader that gives up on a key removes the directories its wait made; a writer that
    made (or found) that directory just before used to fail with ENOENT creating its file
    there (1 in 10 writes here). The writer makes the directory again."""
    race = build("dir_race.c")
    n = "4000"
    reader = shim.with_env(INSTRIDE_TIMEOUT="0").popen([race, "consume", shim.dir, n])
    writer = shim.run([race, "produce", shim.dir, n], timeout=120)
    reader.communicate(timeout=120)
    assert writer.returncode == 0 and writer.stdout.decode().strip() == "0", writer.stderr[-400:]
    assert len([p for p in shim.dir.glob("d*/k")]) == int(n) and shim.temps() == []


def test_a_wait_takes_no_low_descriptor_number(shim: Shim) -> None:
    """``close(0)`` then ``open(key)`` of a key published a moment later: the open gets 0, as
    without instride. The wait's inotify descriptor (kept for the thread) took 0 itself, and
    the program's stdin became that descriptor."""
    proc = shim.py(f"""
import os, threading, time
key = {str(shim.dir / "late.txt")!r}
def publish():
    time.sleep(0.5)
    fd = os.open(key, os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"late")
    os.close(fd)
threading.Thread(target=publish).start()
os.close(0)
fd = os.open(key, os.O_RDONLY)
print(fd, os.read(fd, 10).decode())
""")
    assert proc.stdout.decode().split() == ["0", "late"], proc.stderr.decode()


def test_a_signal_handler_calling_dup2_never_deadlocks(shim: Shim, build: Builder) -> None:
    """``dup``/``close`` of a produced file take the library's table lock; a signal handler
    calling ``dup2`` meanwhile (async-signal-safe) waited for that lock, held by its own
    thread: the program hung. Now it goes straight to libc."""
    exe = build("signal_dup.c")
    proc = shim.run([exe, shim.dir / "sig.txt"], timeout=60)
    assert proc.returncode == 0 and proc.stdout.decode().strip() == "done", proc.stderr
    assert (shim.dir / "sig.txt").read_text() == "x"


def test_close_range_beside_another_threads_opens_loses_no_key(shim: Shim,
                                                                build: Builder) -> None:
    """Keys closed with ``close_range`` while another thread opens files: that thread's open
    could get a number just freed before its entry was taken, take the entry for a file closed
    behind the library's back, and discard it (the key never published)."""
    exe = build("close_range_race.c")
    proc = shim.run([exe, shim.dir, "10000"], timeout=120)
    assert proc.returncode == 0 and proc.stdout.decode().strip() == "0", proc.stderr[-400:]
    assert shim.temps() == []


@pytest.mark.parametrize("case", ["share", "spin"])
def test_a_threads_inotify_fd_closed_by_the_program(shim: Shim, build: Builder,
                                                    case: str) -> None:
    """The program closes its descriptors (closefrom) under the library's per-thread inotify
    fds. "share": a thread took another thread's new fd, made on the number its own had, for
    its own — removing that thread's watch, eating its events: the other's wait never woke
    (hung for ever without INSTRIDE_TIMEOUT). "spin": a wait whose fd was closed under it
    spun on POLLNVAL until its deadline."""
    exe = build("inotify_closed.c")
    src = shim.outside / "src.bin"
    src.write_bytes(b"data")
    proc = shim.with_env(INSTRIDE_TIMEOUT="3").run([exe, shim.dir, src, case], timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    value = float(proc.stdout.decode().strip())
    if case == "share":
        assert 0 <= value < 2000, f"T2 woke after {value} ms (its key came at 300 ms)"
    else:
        assert value < 500, f"{value} ms of CPU in a 2.7 s wait"


@pytest.mark.parametrize("case", ["unlink", "remove", "fsize", "maprename", "maprace", "errno"])
def test_round_45_wrapper_cases(shim: Shim, build: Builder, case: str) -> None:
    """unlink/remove of a key being written (it was published by its close); a stream whose
    earlier flush failed (published with a hole); a key held only by a mapping, renamed
    (ENOENT, published under the old name); two threads' munmap and mmap (a key published
    while still mapped and stored into); errno changed by a call that succeeded. See
    tests/preload/c/wrappers45.c."""
    exe = build("wrappers45.c")
    proc = shim.run([exe, shim.dir, case], timeout=60)
    assert proc.stdout.decode().strip() == "ok", (proc.stdout, proc.stderr[-2000:])
    assert proc.returncode == 0
    assert shim.temps() == []


def test_gfortran_close_with_status_delete(shim: Shim, build: Builder) -> None:
    """``CLOSE(u, STATUS='DELETE')`` unlinks the file before closing it: the unlink failed
    (only the temp existed), gfortran stopped with "File cannot be deleted", and its exit's
    close published the file. The file goes, and the program goes on."""
    exe = build("fortran_io.f90")
    key = shim.dir / "f" / "scratch.dat"
    proc = shim.run([exe, "scratch", key, "thrown away"])
    assert proc.returncode == 0, proc.stderr
    assert not key.exists() and shim.temps() == []


def test_a_key_that_only_looks_like_a_temp_is_a_key(shim: Shim) -> None:
    """``run/.notes.instride-draft.tmp`` is a key to Python (no ``<pid>-<hex>``: no temp of
    instride's), but the preload library took it for one of instride's own names and left the
    write to libc: ``cp`` failed (ENOENT: no directory is made for it, as for a key), and
    where the directory was there, the file was written in place (seen half-written) and a
    second write replaced it (not write-once)."""
    key = shim.dir / "run" / ".notes.instride-draft.tmp"
    (shim.outside / "a").write_bytes(b"first")
    (shim.outside / "b").write_bytes(b"second")
    first = shim.run(["cp", shim.outside / "a", key])
    assert first.returncode == 0, first.stderr
    second = shim.run(["cp", shim.outside / "b", key])
    assert second.returncode != 0 and b"exists" in second.stderr, second
    assert key.read_bytes() == b"first"
    assert [p.name for p in key.parent.iterdir()] == [key.name]  # (no temp left)


_DEEP_MKSTEMP = """
import ctypes, errno, os
os.chdir({root!r})
name = "d" * 200
for _ in range({depth}):  # (a working directory whose path is PATH_MAX or longer)
    os.mkdir(name)
    os.chdir(name)
libc = ctypes.CDLL(None, use_errno=True)
for call, args, suffix in [("mkstemp", (), ""), ("mkstemp64", (), ""),
                           ("mkostemp", (0,), ""), ("mkostemp64", (0,), ""),
                           ("mkstemps", (2,), ".s"), ("mkstemps64", (2,), ".s"),
                           ("mkostemps", (2, 0), ".s"), ("mkostemps64", (2, 0), ".s")]:
    template = ctypes.create_string_buffer(("k" + call + "XXXXXX" + suffix).encode())
    fd = getattr(libc, call)(template, *args)
    print(call, "opened" if fd >= 0 else errno.errorcode[ctypes.get_errno()])
print(sorted(os.listdir(".")))
"""


def test_mkstemp_from_a_working_directory_too_deep_to_confine(shim: Shim) -> None:
    """mkstemp & co. of a relative template from a working directory under the managed
    directory whose path is PATH_MAX or longer: the library cannot confine it. Like open and
    creat there (ENAMETOOLONG), the call is refused; it went to libc, which made the file in
    place: a plain file under the managed directory, never published (seen while written)."""
    proc = shim.py(_DEEP_MKSTEMP.format(root=str(shim.dir), depth=21))
    lines = proc.stdout.decode().splitlines()
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[1] for line in lines[:-1]] == ["ENAMETOOLONG"] * 8, lines
    assert lines[-1] == "[]"


_DEEP_FREOPEN_RENAME = """
import ctypes, errno, os
os.chdir({root!r})
name = "d" * 200
for _ in range(21):
    os.mkdir(name)
    os.chdir(name)
os.mkdir("sub")  # (a directory is no key: moved by libc as anywhere)
libc = ctypes.CDLL(None, use_errno=True)
libc.fopen.restype = ctypes.c_void_p
libc.freopen.restype = ctypes.c_void_p
libc.freopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p]
stream = libc.fopen(b"/dev/null", b"r")
print("freopen", "opened" if libc.freopen(b"f.txt", b"w", stream)
      else errno.errorcode[ctypes.get_errno()])
for old, new in [({src!r}, "r.txt"), ("sub", "moved")]:
    try:
        os.rename(old, new)
        print("rename", "done")
    except OSError as exc:
        print("rename", errno.errorcode[exc.errno])
print(sorted(os.listdir(".")))
"""


def test_freopen_and_rename_from_a_working_directory_too_deep_to_confine(shim: Shim) -> None:
    """As open, creat, fopen and mkstemp there: freopen of a relative path from a working
    directory under the managed directory whose path is PATH_MAX or longer wrote the file in
    place (a plain file, seen while written), and rename moved a file there unpublished (not
    write-once). Both are refused (ENAMETOOLONG); a directory is still moved."""
    src = shim.outside / "src.txt"
    src.write_bytes(b"data")
    proc = shim.py(_DEEP_FREOPEN_RENAME.format(root=str(shim.dir), src=str(src)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().splitlines() == [
        "freopen ENAMETOOLONG", "rename ENAMETOOLONG", "rename done", "['moved']"]
    assert src.read_bytes() == b"data"


def _links_setup(shim: Shim) -> None:
    """A published key pub/k.txt, the directories l/ and s/ (so that libc, unwrapped, would
    succeed there), and outside/src.txt."""
    for sub in ("pub", "l", "s"):
        (shim.dir / sub).mkdir()
    (shim.dir / "pub" / "k.txt").write_text("published")
    (shim.outside / "src.txt").write_text("outside")


@pytest.mark.parametrize("case", ["link", "linkat", "linkkey", "symlink", "symlinkat", "outside",
                                  "truncate", "ftruncate"])
def test_links_and_truncate_of_keys(shim: Shim, build: Builder, case: str) -> None:
    """A hard link made as a key gave it a name without publication (not write-once checked,
    no record in cluster mode) and shared its inode with the program's file outside, which it
    went on changing; a symbolic link made as a key blocked the key with a link every reader
    refuses; truncate() of a published key emptied it under its readers. Links are refused
    (EXDEV, EPERM), truncate too (EPERM); links made outside stay libc's. See
    tests/preload/c/links.c."""
    _links_setup(shim)
    proc = shim.run([build("links.c"), shim.dir, shim.outside, case], timeout=60)
    assert proc.stdout.decode().strip() == "ok", (proc.stdout, proc.stderr[-2000:])
    assert proc.returncode == 0
    assert (shim.dir / "pub" / "k.txt").read_text() == "published"
    assert sorted(p.relative_to(shim.dir).as_posix() for p in shim.dir.rglob("*")) == (
        ["l", "pub", "pub/k.txt", "s"] if case != "truncate" else
        ["l", "pub", "pub/k.txt", "pub/w.txt", "s"])
    if case == "truncate":  # (its ftruncate'd write published as usual)
        assert (shim.dir / "pub" / "w.txt").read_text() == "abc"


def test_ln_into_the_managed_directory_is_refused_and_a_copy_publishes(shim: Shim) -> None:
    """``ln`` and ``ln -s`` of a file outside made a key appear without publication (sharing
    the file's inode: changed with it). They fail (EXDEV: "Invalid cross-device link"; EPERM)
    and nothing appears; what tools do on EXDEV, copy then rename, publishes the key."""
    _links_setup(shim)
    src, key = shim.outside / "src.txt", shim.dir / "l" / "k.txt"
    hard = shim.run(["ln", src, key])
    assert hard.returncode != 0 and b"Invalid cross-device link" in hard.stderr, hard.stderr
    soft = shim.run(["ln", "-s", src, key])
    assert soft.returncode != 0 and b"Operation not permitted" in soft.stderr, soft.stderr
    assert not key.exists() and not key.is_symlink()
    forced = shim.run(["ln", "-f", src, shim.dir / "pub" / "k.txt"])  # (no unlink first either)
    assert forced.returncode != 0 and b"Invalid cross-device link" in forced.stderr
    assert (shim.dir / "pub" / "k.txt").read_text() == "published"
    fallback = (
        "import errno, os, shutil\n"
        f"src, key = {str(src)!r}, {str(key)!r}\n"
        "try:\n"
        "    os.link(src, key)\n"
        "except OSError as exc:\n"
        "    assert exc.errno == errno.EXDEV, exc\n"
        "    shutil.copyfile(src, key + '.part')\n"
        "    os.rename(key + '.part', key)\n"
    )
    shim.py(fallback, check=True)
    src.write_text("changed outside")
    assert key.read_text() == "outside"
    assert shim.temps() == []


def test_os_truncate_of_a_published_key_is_refused(shim: Shim) -> None:
    """An unmodified Python program's ``os.truncate`` of a published key (truncate(2) by
    path) changed its bytes in place; it fails with EPERM, as a write open in place."""
    _links_setup(shim)
    key = shim.dir / "pub" / "k.txt"
    code = (
        "import errno, os\n"
        "try:\n"
        f"    os.truncate({str(key)!r}, 2)\n"
        "    print('truncated')\n"
        "except OSError as exc:\n"
        "    print(errno.errorcode[exc.errno])\n"
    )
    proc = shim.py(code)
    assert proc.stdout.decode().strip() == "EPERM", (proc.stdout, proc.stderr)
    assert key.read_text() == "published"


_NO_KEY_CALLS = """
import errno, os, sys
root, outside = os.fsencode(sys.argv[1]), os.fsencode(sys.argv[2])
def outcome(call, *args):
    try:
        call(*args)
        return "ok"
    except OSError as exc:
        return errno.errorcode[exc.errno]
def write(path):
    with open(path, "wb") as fh:
        fh.write(b"bytes")
def read(path):
    with open(path, "rb") as fh:
        fh.read()
for name in [b"a\\nb", b"run/a\\x7fb", b" ", "\\u3000".encode(), b"x" * 201, b"r\\xe9sultat",
             b"/".join([b"d" * 100] * 11), "r\\u00e9sultat\\x85".encode()]:
    with open(outside + b"/src", "wb") as fh:
        fh.write(b"moved")
    path = root + b"/" + name
    print(outcome(write, path), outcome(read, path), outcome(os.rename, outside + b"/src", path))
"""


def test_a_name_python_refuses_is_no_key_the_preload_library_publishes(shim: Shim) -> None:
    """Under the preload library, a file made under the managed directory with a name that
    ``keys.normalize_key`` refuses (a control character, whitespace only, a component over
    200 bytes, a key over 1,024 bytes, bytes that are no UTF-8, as a Latin-1 program writes
    them) was published as a key: a file no Python consumer can name (KeyValidationError).
    Writing, reading and renaming to it now fail at once (EINVAL; ENAMETOOLONG for the
    lengths), nothing is written; a name Python takes (U+0085 inside) still publishes."""
    proc = shim.with_env(INSTRIDE_TIMEOUT="0", INSTRIDE_DEBUG="1").run(
        [sys.executable, "-I", "-c", _NO_KEY_CALLS, shim.dir, shim.outside])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().splitlines() == [
        "EINVAL EINVAL EINVAL", "EINVAL EINVAL EINVAL", "EINVAL EINVAL EINVAL",
        "EINVAL EINVAL EINVAL", "ENAMETOOLONG ENAMETOOLONG ENAMETOOLONG",
        "EINVAL EINVAL EINVAL", "ENAMETOOLONG ENAMETOOLONG ENAMETOOLONG",
        "ok ok EEXIST",  # (a key: published by the write, so the rename's is write-once)
    ]
    assert b"contains a control character" in proc.stderr
    assert b"not valid UTF-8" in proc.stderr
    assert [p.name for p in shim.dir.rglob("*")] == ["r\u00e9sultat\x85"]
    assert shim.temps() == []
