"""A file still open for writing renamed into the managed directory (csrc/core/publish.c,
csrc/preload/rename.c): refused with ``EBUSY`` while another process has it open for writing,
and whenever a writer opens it while it is being moved -- a published key never changes, and
nothing partial is ever visible. (The renamer's own descriptors: "write, rename, close" moves
it as before.)

The library holds a read lease (``F_SETLEASE``, ``F_RDLCK``) on the source while it moves it:
the kernel grants it only while no descriptor (or shared writable mapping) has the file open for
writing, and an open for writing meanwhile breaks it (the writer waits until the move is over).
Every writer here is a real process that never loads the library.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ..writers import HOLDER
from .conftest import Builder, Shim

#: Renames argv[1] to argv[2] (with argv[3] "self": while holding argv[1] open for writing
#: itself); prints "renamed" or the errno's name.
_RENAME = r'''
import errno, os, sys
src, key, how = sys.argv[1:4]
held = open(src, "ab") if how == "self" else None
try:
    os.rename(src, key)
    print("renamed")
except OSError as exc:
    print(errno.errorcode[exc.errno])
'''

#: Renames argv[2] to argv[3] under the library, the system call argv[1] ("copy_file_range":
#: the copy across file systems; "renameat2": the move on one file system) held in the kernel
#: at its first call until a writer -- another process, started then, that opens the source
#: for writing, rewrites its bytes in place (same size) and sets its modification time back,
#: as a tool that keeps times does -- has opened it, or waits to (a lease break: /proc/locks
#: says BREAKING). Prints the rename's result ("renamed" or the errno's name), then the
#: writer's ("rewritten"), and exits 0: a lease break that killed it (SIGIO) is seen.
_HELD = r'''
import errno, os, subprocess, sys, time, traceback
from seccomp_hold import hold_calls

call, src, key = sys.argv[1:4]
writer = []
WRITE = """
import os, sys
path = sys.argv[1]
st = os.stat(path)
with open(path, "r+b") as fh:
    fh.write(b"B" * st.st_size)
os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
print("rewritten", flush=True)
"""


def breaking(ino):
    with open("/proc/locks") as fh:
        return any(f":{ino} " in line and "BREAKING" in line for line in fh)


def on_call(name, n):
    if n != 1 or writer:
        return
    try:
        ino = os.stat(src).st_ino
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        writer.append(subprocess.Popen([sys.executable, "-I", "-c", WRITE, src], env=env,
                                       stdout=subprocess.PIPE, text=True))
        deadline = time.monotonic() + 30
        while writer[0].poll() is None and not breaking(ino) and time.monotonic() < deadline:
            time.sleep(0.01)
    except BaseException:
        traceback.print_exc()


hold_calls({call: None}, on_call)
try:
    os.rename(src, key)
    print("renamed", flush=True)
except OSError as exc:
    print(errno.errorcode[exc.errno], flush=True)
print(writer[0].communicate(timeout=60)[0].strip() if writer else "no writer", flush=True)
'''


def _plain_env() -> dict[str, str]:
    """The environment of a process that never loads the library."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def _where(shim: Shim, shm: Path, fs: str) -> tuple[Shim, Path]:
    """The shim and the source's directory: both on ext4 (tmp_path), both on tmpfs, or the
    source on tmpfs and the managed directory on tmp_path (a copy across file systems)."""
    if os.stat(shim.dir).st_dev == os.stat(shm).st_dev:
        pytest.fail("/dev/shm is on the managed directory's file system here: these tests need "
                    "two file systems")
    if fs == "ext4":
        return shim, shim.outside
    if fs == "cross":
        return shim, shm
    managed, outside = shm / "managed", shm / "outside"
    managed.mkdir()
    outside.mkdir()
    return Shim(managed, outside, dict(shim.env, INSTRIDE_DIR=str(managed))), outside


@pytest.mark.parametrize("fs", ["ext4", "tmpfs", "cross"])
@pytest.mark.parametrize("how", ["writer", "mapping"])
def test_a_file_open_for_writing_is_not_renamed_to_a_key(shim: Shim, shm: Path, fs: str,
                                                         how: str) -> None:
    """A file still open for writing by another process (a descriptor, or a shared writable
    mapping only) renamed to a key was published while it could still change: the writer kept
    writing through its descriptor and readers (and other nodes' copies) saw the key change.
    The rename fails now with EBUSY (``mv`` too), the message naming the file, nothing at the
    key, the source where it was; the same rename once the writer closed publishes it."""
    shim, src_dir = _where(shim, shm, fs)
    src, key = src_dir / "f", shim.dir / "run" / "k"
    src.write_bytes(b"bytes")
    holder = subprocess.Popen([sys.executable, "-I", "-c", HOLDER, str(src), how],
                              env=_plain_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"open\n"
        debug = shim.with_env(INSTRIDE_DEBUG="1")
        proc = debug.run([sys.executable, "-I", "-c", _RENAME, src, key, how])
        assert proc.stdout.decode().split() == ["EBUSY"], proc.stderr
        assert "open for writing elsewhere" in proc.stderr.decode()
        assert str(src) in proc.stderr.decode()
        mv = shim.run(["mv", src, key])
        assert mv.returncode != 0 and b"busy" in mv.stderr, mv.stderr
        assert not key.exists() and shim.temps() == []
        assert os.listdir(src_dir) == ["f"]
        assert src.read_bytes() == b"bytes more"
    finally:
        holder.communicate(b"\n", timeout=60)
    # closed: published
    proc = shim.run([sys.executable, "-I", "-c", _RENAME, src, key, "closed"])
    assert proc.stdout.decode().split() == ["renamed"], proc.stderr
    assert key.read_bytes() == b"bytes more"
    assert not src.exists()
    assert shim.temps() == [] and os.listdir(src_dir) == []


@pytest.mark.parametrize("fs", ["ext4", "tmpfs", "cross"])
def test_a_file_the_renamer_itself_still_holds_open_is_moved(shim: Shim, shm: Path,
                                                              fs: str) -> None:
    """"Write a temporary file, flush it, rename it into place, then close it" (Python's
    ``NamedTemporaryFile(delete=False)`` renamed inside its ``with``, C's ``mkstemp`` idiom):
    the renamer itself holds the file open for writing, done with it. Moved as before: the
    lease's refusal is not taken for another writer's when this process has a descriptor of
    the file open for writing."""
    shim, src_dir = _where(shim, shm, fs)
    src, key = src_dir / "f", shim.dir / "run" / "k"
    src.write_bytes(b"bytes")
    proc = shim.run([sys.executable, "-I", "-c", _RENAME, src, key, "self"])
    assert proc.stdout.decode().split() == ["renamed"], proc.stderr
    assert key.read_bytes() == b"bytes"
    assert not src.exists() and shim.temps() == [] and os.listdir(src_dir) == []


def test_a_file_with_other_hard_links_open_for_writing_is_not_copied_to_a_key(
        shim: Shim) -> None:
    """A file with other hard links is published as a copy: one still written through another
    of its names was copied as it was at that moment -- bytes it never held once its writer was
    done. The rename fails with EBUSY now, nothing published, both names kept; once the writer
    closed, the copy is published."""
    a, b, key = shim.outside / "a", shim.outside / "b", shim.dir / "k"
    a.write_bytes(b"bytes")
    os.link(a, b)
    holder = subprocess.Popen([sys.executable, "-I", "-c", HOLDER, str(b), "writer"],
                              env=_plain_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"open\n"
        proc = shim.run([sys.executable, "-I", "-c", _RENAME, a, key, "other"])
        assert proc.stdout.decode().split() == ["EBUSY"], proc.stderr
        assert not key.exists() and shim.temps() == []
        assert a.read_bytes() == b"bytes more" and os.stat(a).st_nlink == 2
    finally:
        holder.communicate(b"\n", timeout=60)
    proc = shim.run([sys.executable, "-I", "-c", _RENAME, a, key, "closed"])
    assert proc.stdout.decode().split() == ["renamed"], proc.stderr
    assert key.read_bytes() == b"bytes more" and not a.exists()
    assert b.read_bytes() == b"bytes more"


def _held(shim: Shim, call: str, src: Path, key: Path) -> subprocess.CompletedProcess[bytes]:
    env = dict(shim.env, PYTHONPATH=str(Path(__file__).parent))
    return subprocess.run([sys.executable, "-c", _HELD, call, str(src), str(key)], env=env,
                          capture_output=True, timeout=120)


def test_a_writer_opening_the_source_during_a_copy_across_file_systems(shim: Shim,
                                                                       shm: Path) -> None:
    """A file renamed to a key from another file system is copied beside the key; a writer that
    opened it during the copy and rewrote it in place at the same size, its modification time
    set back (as a tool keeping times does; a kernel before 6.13 shows any rewrite within one
    clock tick so), went unseen: the key was published with whatever the source held then. The
    writer's open breaks the library's read lease on the source now: the rename fails with
    EBUSY, nothing published, the source under its name; the writer, waiting meanwhile, then
    goes on -- and the renaming process survives the lease break's signal (SIGIO by default,
    whose default action kills). The copy waits in the kernel (a seccomp user notification)
    until the writer has opened the file, or waits to."""
    src, key = shm / "f", shim.dir / "k"
    src.write_bytes(b"A" * 5000)
    proc = _held(shim, "copy_file_range", src, key)
    assert proc.returncode != 77, "seccomp user notifications are not available here"
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.decode().split() == ["EBUSY", "rewritten"], proc.stderr[-2000:]
    assert list(shim.dir.iterdir()) == []
    assert os.listdir(shm) == ["f"] and src.read_bytes() == b"B" * 5000


def test_a_writer_opening_the_source_during_a_move_on_one_file_system(shim: Shim) -> None:
    """On one file system the source itself becomes the key: a writer whose open of it began
    while it was moved got a descriptor of the published key, and wrote to it under its
    readers. The open breaks the library's read lease: the rename fails with EBUSY, the file
    named back, nothing at the key; the renaming process survives the lease break. The move
    (renameat2) waits in the kernel until the writer waits for the lease."""
    src, key = shim.outside / "f", shim.dir / "k"
    src.write_bytes(b"A" * 5000)
    proc = _held(shim, "renameat2", src, key)
    assert proc.returncode != 77, "seccomp user notifications are not available here"
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.decode().split() == ["EBUSY", "rewritten"], proc.stderr[-2000:]
    assert list(shim.dir.iterdir()) == []
    assert os.listdir(shim.outside) == ["f"] and src.read_bytes() == b"B" * 5000


def test_write_then_rename_still_publishes(shim: Shim, shm: Path) -> None:
    """Unchanged: a file written, closed, then renamed (``os.rename``, ``mv``, ``shutil.move``),
    on one file system or across two, is published; nothing is left behind."""
    move = "import shutil, sys; shutil.move(sys.argv[1], sys.argv[2])"
    for i, src_dir in enumerate((shim.outside, shm)):
        for j, cmd in enumerate((["mv"], [sys.executable, "-I", "-c", move],
                                 [sys.executable, "-I", "-c", _RENAME])):
            src = src_dir / f"f{i}{j}"
            src.write_bytes(b"data %d" % j)
            extra = ["closed"] if cmd[-1] == _RENAME else []
            proc = shim.run([*cmd, src, shim.dir / f"k{i}{j}", *extra])
            assert proc.returncode == 0, proc.stderr
            assert (shim.dir / f"k{i}{j}").read_bytes() == b"data %d" % j
            assert not src.exists()
    assert shim.temps() == [] and os.listdir(shm) == []


@pytest.mark.parametrize("how", ["rw", "ro", "mprotect"])
def test_a_file_the_renamer_itself_maps_is_moved(shim: Shim, build: Builder, how: str) -> None:
    """The renamer's own shared mapping of the file, its descriptor (opened for writing)
    closed ("map, write, close, rename"): its own writer, moved as before -- not refused as
    "open for writing elsewhere" (the lease is refused for any writer: this process's mappings
    are looked at, /proc/self/maps, as its descriptors are; a read-only one, or one made so
    since, counts for the kernel as a writer too)."""
    src, key = shim.outside / "f", shim.dir / "k"
    src.write_bytes(b"hello")
    proc = shim.run([build("own_map.c"), src, key, how])
    assert proc.stdout.decode().split() == ["renamed"], proc.stderr
    assert key.read_bytes() == (b"hello" if how == "ro" else b"Xello") and not src.exists()


def test_a_read_only_mapping_of_the_renamer_hides_no_other_writer(
        shim: Shim, build: Builder) -> None:
    """The renamer's own read-only mapping, through a read-only descriptor (a checksum, a
    header look, ``numpy.memmap(mode="r")``), is no writer: another process still writing the
    file is not taken for it -- EBUSY, nothing published, as without the mapping."""
    src, key = shim.outside / "f", shim.dir / "k"
    src.write_bytes(b"hello")
    holder = subprocess.Popen([sys.executable, "-I", "-c", HOLDER, str(src), "writer"],
                              env=_plain_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"open\n"
        proc = shim.run([build("own_map.c"), src, key, "rdonly"])
        assert proc.stdout.decode().strip() == os.strerror(16), proc.stderr
        assert not key.exists() and src.exists()
    finally:
        holder.communicate(b"\n", timeout=60)


#: Renames argv[1] to argv[2] under the library, each renameat2 and copy_file_range held a
#: moment to print whether argv[1]'s name exists then and the names beside it; then the
#: rename's result.
_NAMES = r'''
import errno, os, sys
from seccomp_hold import hold_calls
src, key = sys.argv[1:3]


def on_call(name, n):
    print(name, os.path.lexists(src), sorted(os.listdir(os.path.dirname(src))), flush=True)


hold_calls({"renameat2": None, "copy_file_range": None}, on_call)
try:
    os.rename(src, key)
    print("renamed", flush=True)
except OSError as exc:
    print(errno.errorcode[exc.errno], flush=True)
'''


def _names(shim: Shim, src: Path, key: Path) -> list[str]:
    env = dict(shim.env, PYTHONPATH=str(Path(__file__).parent))
    proc = subprocess.run([sys.executable, "-c", _NAMES, str(src), str(key)], env=env,
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.decode().splitlines()


def test_a_move_across_file_systems_keeps_the_source_named_until_it_is_copied(
        shim: Shim, shm: Path) -> None:
    """A rename bound to fail with EXDEV (the copy's way then) hid the source first: its name
    was missing for nothing, and a file made under it meanwhile (a producer's next output)
    kept it from being named back -- rename() then said EXDEV, and ``mv`` copied that other
    file to the key, the user's own left hidden. The source keeps its name until the copy is
    whole; one bound for EEXIST (write-once, the key there) fails so before any copy, its
    name kept."""
    src, key = shm / "f", shim.dir / "k"
    src.write_bytes(b"data")
    lines = _names(shim, src, key)
    assert lines[-1] == "renamed", lines
    before_copy = lines[:next(i for i, line in enumerate(lines) if line.startswith("copy_file"))]
    assert before_copy and all(" True " in line for line in before_copy), lines
    assert key.read_bytes() == b"data"
    # a bind mount of the key's own file system: one device, and still EXDEV
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.fail("unshare (util-linux) is needed for a bind mount of one's own")
    bound, there = shim.outside / "bound", shim.outside / "there"
    bound.mkdir()
    there.mkdir()
    (there / "f").write_bytes(b"bound")
    env = dict(shim.env, PYTHONPATH=str(Path(__file__).parent))
    proc = subprocess.run([unshare, "--mount", "sh", "-c", 'mount --bind "$1" "$2" && shift 2 && '
                           'exec "$@"', "sh", str(there), str(bound), sys.executable, "-c", _NAMES,
                           str(bound / "f"), str(shim.dir / "kb")], env=env, capture_output=True,
                          timeout=120)
    lines = proc.stdout.decode().splitlines()
    assert proc.returncode == 0 and lines[-1] == "renamed", (lines, proc.stderr[-2000:])
    before_copy = lines[:next(i for i, line in enumerate(lines) if line.startswith("copy_file"))]
    assert before_copy and all(" True " in line for line in before_copy), lines
    assert (shim.dir / "kb").read_bytes() == b"bound"
    (shm / "f").write_bytes(b"again")  # (write-once, the key there: EEXIST before any copy)
    lines = _names(shim, shm / "f", key)
    assert lines[-1] == "EEXIST" and all(" True " in line for line in lines[:-1]), lines
    assert not any(line.startswith("copy_file_range") for line in lines), lines
    assert (shm / "f").read_bytes() == b"again" and key.read_bytes() == b"data"
    same = shim.outside / "f"  # (on the key's file system: moved, were the key not there)
    same.write_bytes(b"again")
    lines = _names(shim, same, key)
    assert lines[-1] == "EEXIST" and all(" True " in line for line in lines[:-1]), lines
    assert same.read_bytes() == b"again"


def test_a_key_renamed_to_another_is_never_a_third_key_meanwhile(shim: Shim) -> None:
    """A key renamed to another under the managed directory is hidden beside itself first:
    under a name that was itself a valid key, listed and consumed as one meanwhile (and left
    as one by a process killed then). The hidden name starts with ".instride", which no key
    does."""
    (shim.dir / "run").mkdir()
    a, b = shim.dir / "run" / "a", shim.dir / "run" / "b"
    proc = shim.run([sys.executable, "-I", "-c", "import sys; open(sys.argv[1], 'w').write('x')",
                     a])
    assert proc.returncode == 0, proc.stderr
    lines = _names(shim, a, b)
    assert lines[-1] == "renamed", lines
    hidden = [name for line in lines[:-1] for name in eval(line.split(" ", 2)[2])  # noqa: S307
              if name not in ("a", "b")]
    assert hidden and all(name.startswith(".instride-moving-") for name in hidden), lines
    assert b.read_bytes() == b"x" and not a.exists()


#: "write, rename, close" (argv[1] -> argv[2]) in a mount namespace whose /proc is a tmpfs: the
#: library cannot tell its own writer from another process's there
_NO_PROC = r"""mount -t tmpfs none /proc && exec "$@" """


def test_a_file_the_renamer_holds_open_is_moved_where_proc_is_missing(shim: Shim) -> None:
    """Without /proc (a container or chroot without it) the library cannot tell the
    renamer's own writer from another process's: it moves the file as before leases, rather
    than refuse "write, rename, close" (EBUSY) -- and so does ``Client.publish``."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.fail("unshare (util-linux) is needed to hide /proc from one program")
    src, key = shim.outside / "f", shim.dir / "k"
    src.write_bytes(b"bytes")
    proc = shim.run([unshare, "--mount", "sh", "-c", _NO_PROC, "sh", sys.executable, "-I", "-c",
                     _RENAME, src, key, "self"])
    assert proc.stdout.decode().split() == ["renamed"], proc.stderr
    assert key.read_bytes() == b"bytes" and not src.exists()
    g = shim.outside / "g"
    g.write_bytes(b"more bytes")
    code = ("import instride, sys\n"
            "held = open(sys.argv[1], 'ab')\n"
            "print(instride.Client().publish(sys.argv[1], 'k2'))\n")
    env = dict(_plain_env(), INSTRIDE_DIR=str(shim.dir))
    env.pop("INSTRIDE_REDIS_URL", None)
    proc = subprocess.run([unshare, "--mount", "sh", "-c", _NO_PROC, "sh", sys.executable, "-c",
                           code, str(g)], env=env, capture_output=True, timeout=120)
    assert proc.stdout.decode().split() == ["k2"], proc.stderr
    assert (shim.dir / "k2").read_bytes() == b"more bytes" and not g.exists()


#: Renames argv[1] to argv[2] under the library, write-once, its first renameat2 held until a
#: writer (another process) waits for the library's lease on the source; at each later
#: renameat2 (the source named back) prints whether the key exists then -- a reader woken by
#: its appearance could open it then. Then the rename's result.
_SEEN = r'''
import errno, os, subprocess, sys, time
from seccomp_hold import hold_calls
src, key = sys.argv[1:3]
writer = []
WRITE = "import sys; fh = open(sys.argv[1], 'r+b'); fh.write(b'B'); fh.close()"


def breaking(ino):
    with open("/proc/locks") as fh:
        return any(f":{ino} " in line and "BREAKING" in line for line in fh)


def on_call(name, n):
    if n == 1:
        ino = os.stat(src).st_ino
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        writer.append(subprocess.Popen([sys.executable, "-I", "-c", WRITE, src], env=env))
        deadline = time.monotonic() + 30
        while writer[0].poll() is None and not breaking(ino) and time.monotonic() < deadline:
            time.sleep(0.01)
    else:
        print("key there:", os.path.lexists(key), flush=True)


hold_calls({"renameat2": None}, on_call)
try:
    os.rename(src, key)
    print("renamed", flush=True)
except OSError as exc:
    print(errno.errorcode[exc.errno], flush=True)
writer[0].wait(60)
'''


def test_a_writer_during_a_move_never_sees_the_file_at_the_key(shim: Shim) -> None:
    """On one file system the file went to the key in one rename, and a writer seen after it
    made the library name it back: between the two it was at the key, where a reader woken by
    its appearance opened it -- and kept the file the writer then changed, though the rename
    said EBUSY. The source's name goes first, to a hidden name beside it; the lease is looked
    at then, before the file is the key: it never appears there."""
    src, key = shim.outside / "f", shim.dir / "k"
    src.write_bytes(b"AAAA")
    env = dict(shim.env, PYTHONPATH=str(Path(__file__).parent))
    proc = subprocess.run([sys.executable, "-c", _SEEN, str(src), str(key)], env=env,
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.decode().splitlines()
    assert lines[-1] == "EBUSY" and "key there: True" not in lines, (lines, proc.stderr[-2000:])
    assert not key.exists() and src.read_bytes() == b"BAAA"
    assert os.listdir(shim.outside) == ["f"]
