"""Renames under the managed directory that would make keys without publication
(csrc/preload/rename.c): a directory renamed there, ``renameat2(RENAME_EXCHANGE)`` and
``RENAME_WHITEOUT``; and files with other hard links, published as copies (all or nothing).

A key appears only by publication (complete at once, write-once checked, recorded in cluster
mode). A directory renamed into the managed directory, or within it, is refused with EXDEV, on
which ``mv`` and ``shutil.move`` copy the tree file by file -- and each file is published; an
exchange that names a key is refused with EINVAL.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from instride.emulate import EmulatedCluster

from .conftest import Builder, Shim, run_preloaded


def _tree(root: Path) -> None:
    """``root/f.txt`` ("result") and ``root/sub/g.txt`` ("sub")."""
    (root / "sub").mkdir(parents=True)
    (root / "f.txt").write_text("result")
    (root / "sub" / "g.txt").write_text("sub")


def _files(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*"))
            if p.is_file()}


TREE = {"f.txt": "result", "sub/g.txt": "sub"}


@pytest.mark.parametrize("case", ["dir", "root", "exchange", "whiteout"])
def test_directory_renames_and_exchanges_naming_keys_are_refused(shim: Shim, build: Builder,
                                                                  case: str) -> None:
    """A directory renamed under the managed directory (from outside or within it) made its
    files keys without publication, or renamed keys without their records; one renamed over
    the managed directory replaced it; RENAME_EXCHANGE swapped a published key's bytes;
    RENAME_WHITEOUT replaced a published key (no write-once check) or left a whiteout device as
    the key. They fail (EXDEV; EINVAL for an exchange or a whiteout) and nothing moves. See
    tests/preload/c/renames.c."""
    _tree(shim.outside / "res")
    (shim.outside / "empty").mkdir()
    (shim.outside / "src.txt").write_text("outside")
    (shim.outside / "other.txt").write_text("other")
    if case != "root":
        (shim.dir / "pub").mkdir()
        (shim.dir / "pub" / "k.txt").write_text("published")
        (shim.dir / "pub" / "k2.txt").write_text("second")
    proc = shim.run([build("renames.c"), shim.dir, shim.outside, case], timeout=60)
    assert proc.stdout.decode().strip() == "ok", (proc.stdout, proc.stderr[-2000:])
    assert proc.returncode == 0
    expected = {} if case == "root" else {"pub/k.txt": "published", "pub/k2.txt": "second"}
    assert _files(shim.dir) == expected
    assert _files(shim.outside / "res") == TREE


def test_mv_and_shutil_move_of_a_directory_copy_it_file_by_file(shim: Shim) -> None:
    """``mv`` and ``shutil.move`` of a directory into the managed directory, and within it, get
    EXDEV from its rename and move the tree file by file (each file published), then remove
    the source: the same tree arrives, nothing is left behind."""
    _tree(shim.outside / "a")
    _tree(shim.outside / "b")
    _tree(shim.outside / "c")
    shim.run(["mv", shim.outside / "a", f"{shim.dir}/"], check=True)
    shim.run(["mv", shim.outside / "b", shim.dir / "b"], check=True)
    shim.run(["mv", shim.dir / "b", shim.dir / "moved"], check=True)  # within
    code = (
        "import errno, os, shutil, sys\n"
        "src, dst, within = sys.argv[1:]\n"
        "try:\n"
        "    os.rename(src, dst)\n"
        "    print('renamed')\n"
        "except OSError as exc:\n"
        "    print(errno.errorcode[exc.errno])\n"
        "shutil.move(src, dst)\n"
        "shutil.move(dst, within)\n"
    )
    proc = shim.run([sys.executable, "-I", "-c", code, shim.outside / "c", shim.dir / "c",
                     shim.dir / "c2"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().split() == ["EXDEV"]
    assert _files(shim.dir / "a") == TREE
    assert _files(shim.dir / "moved") == TREE
    assert _files(shim.dir / "c2") == TREE
    assert sorted(p.name for p in shim.dir.iterdir()) == ["a", "c2", "moved"]
    assert list(shim.outside.iterdir()) == []
    assert shim.temps() == []






def test_a_directory_moved_in_is_seen_on_another_node(nodes: EmulatedCluster) -> None:
    """Cluster mode: the files of a directory ``mv``'d or ``shutil.move``'d into the managed
    directory on node 1, or moved within it, were never recorded (libc renamed the directory):
    a reader of them on node 2 waited until its timeout (ETIMEDOUT). Each file is published
    now, and node 2 reads it."""
    d1, d2 = nodes.node(1).dir, nodes.node(2).dir
    tmp_path = nodes.base_dir / "outside"  # (the nodes' file system: a real rename, no EXDEV)
    tmp_path.mkdir()
    _tree(tmp_path / "mvd")
    _tree(tmp_path / "shd")
    assert run_preloaded(nodes, 1, ["mv", tmp_path / "mvd", f"{d1}/"]).returncode == 0
    move = "import shutil, sys; shutil.move(sys.argv[1], sys.argv[2])"
    assert run_preloaded(nodes, 1, [sys.executable, "-I", "-c", move, tmp_path / "shd",
                           d1 / "shd"]).returncode == 0
    assert run_preloaded(nodes, 1, ["mv", d1 / "shd", d1 / "within"]).returncode == 0
    for key in ("mvd/f.txt", "mvd/sub/g.txt", "within/f.txt", "within/sub/g.txt"):
        proc = run_preloaded(nodes, 2, ["cat", d2 / key], timeout_s="5")
        assert proc.returncode == 0, (key, proc.stderr)
        assert proc.stdout.decode() == TREE[key.split("/", 1)[1]]


def test_a_file_with_other_hard_links_renamed_to_a_key_is_published_as_a_copy(
        shim: Shim) -> None:
    """A regular file with other hard links (``ln a b; mv a $D/k``) was published by link +
    unlink, keeping its inode: a later ``echo x >> b`` changed the published key's bytes under
    its readers. It is published as a copy now (``mv`` and ``os.rename`` alike, and a key
    renamed within the directory): the key has its own inode, the source name is gone, and the
    other link keeps the file."""
    code = (
        "import os, sys\n"
        "src, dst = sys.argv[1:]\n"
        "os.rename(src, dst)\n"
    )
    for name, move in (("mv", ["mv"]), ("py", [sys.executable, "-I", "-c", code])):
        a, b = shim.outside / f"{name}.a", shim.outside / f"{name}.b"
        a.write_text("first")
        os.link(a, b)
        shim.run([*move, a, shim.dir / name], check=True)
        with open(b, "a") as fh:
            fh.write(" and more")
        assert (shim.dir / name).read_text() == "first", name
        assert os.stat(shim.dir / name).st_nlink == 1
        assert not a.exists()
        assert b.read_text() == "first and more"
    # a key hard-linked outside (link.c lets a new name outside be made), renamed within
    os.link(shim.dir / "mv", shim.outside / "key.link")
    shim.run(["mv", shim.dir / "mv", shim.dir / "within"], check=True)
    with open(shim.outside / "key.link", "a") as fh:
        fh.write("!")
    assert (shim.dir / "within").read_text() == "first"
    assert not (shim.dir / "mv").exists()
    # write-once: a copy onto a published key is refused, and nothing moves
    c, d = shim.outside / "c", shim.outside / "d"
    c.write_text("second")
    os.link(c, d)
    proc = shim.run(["mv", "-T", c, shim.dir / "py"])  # (-T: never into a directory)
    assert proc.returncode != 0
    assert (shim.dir / "py").read_text() == "first"
    assert c.read_text() == "second"
    assert shim.temps() == []


def test_symlinks_and_special_files_renamed_to_a_key_are_refused(shim: Shim) -> None:
    """A symbolic link, FIFO or socket renamed to a key's place (``mv o/sl $D/sl``) went to
    libc: a key every reader refuses (ELOOP, EINVAL) that blocked the real publication
    (EEXIST). Refused now as symlink() there is (EPERM) -- EINVAL for a FIFO or socket, what an
    open of such a key answers -- and nothing moves; within the managed directory too."""
    code = (
        "import errno, os, socket, sys\n"
        "out, d = sys.argv[1:]\n"
        "os.symlink('/etc/hostname', f'{out}/sl')\n"
        "os.mkfifo(f'{out}/fifo')\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "s.bind(f'{out}/sock')\n"
        "os.mkfifo(f'{d}/made.fifo')  # (mkfifo is libc's: a special file already there)\n"
        "moves = [(f'{out}/sl', f'{d}/sl'), (f'{out}/fifo', f'{d}/fifo'),\n"
        "         (f'{out}/sock', f'{d}/sock'), (f'{d}/made.fifo', f'{d}/moved.fifo')]\n"
        "for src, dst in moves:\n"
        "    try:\n"
        "        os.rename(src, dst)\n"
        "        print('renamed')\n"
        "    except OSError as exc:\n"
        "        print(errno.errorcode[exc.errno])\n"
    )
    proc = shim.run([sys.executable, "-I", "-c", code, shim.outside, shim.dir])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().split() == ["EPERM", "EINVAL", "EINVAL", "EINVAL"]
    assert sorted(p.name for p in shim.dir.iterdir()) == ["made.fifo"]
    assert sorted(p.name for p in shim.outside.iterdir()) == ["fifo", "sl", "sock"]
    # the key's real publication is not blocked
    (shim.outside / "real").write_text("real")
    shim.run(["mv", shim.outside / "real", shim.dir / "sl"], check=True)
    assert (shim.dir / "sl").read_text() == "real"


@contextlib.contextmanager
def _unremovable(path: Path) -> Iterator[None]:
    """``path`` stays readable but cannot be unlinked: immutable for root (``chattr +i``:
    unlink EPERM), else in a directory made read-only (EACCES)."""
    if os.geteuid() == 0:
        chattr = shutil.which("chattr")
        assert chattr, "e2fsprogs' chattr is needed (apt-get install e2fsprogs)"
        subprocess.run([chattr, "+i", path], check=True)
        try:
            yield
        finally:
            subprocess.run([chattr, "-i", path], check=True)
    else:
        path.parent.chmod(0o555)
        try:
            yield
        finally:
            path.parent.chmod(0o755)


def test_a_copy_whose_source_cannot_be_removed_publishes_nothing(shim: Shim,
                                                                build: Builder) -> None:
    """A file with other hard links renamed to a key is published as a copy, then its name
    removed. When that removal failed (an immutable file, a directory the user cannot write),
    the rename failed -- but the copy was already published: ``mv`` said "cannot move", the key
    was there all the same, and moving it again failed (EEXIST, write-once). The rename fails
    now with nothing published, the source where it was; libc's own rename would have. (The
    name goes first now: a publication that fails after it, here a failed fsync, puts it
    back.)"""
    a, b = shim.outside / "a", shim.outside / "b"
    a.write_text("bytes")
    os.link(a, b)
    code = (
        "import errno, os, sys\n"
        "try:\n"
        "    os.rename(*sys.argv[1:])\n"
        "    print('renamed')\n"
        "except OSError as exc:\n"
        "    print(errno.errorcode[exc.errno])\n"
    )
    with _unremovable(a):
        proc = shim.run([sys.executable, "-I", "-c", code, a, shim.dir / "k"])
        mv = shim.run(["mv", "-T", a, shim.dir / "k2"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().split() == ["EPERM" if os.geteuid() == 0 else "EACCES"]
    assert mv.returncode != 0
    assert sorted(p.name for p in shim.dir.iterdir()) == []
    assert a.read_text() == "bytes" and os.stat(a).st_nlink == 2
    # a publication that fails (INSTRIDE_FSYNC=1, fsync EIO) once the name went: it is back
    eio = shim.with_env(INSTRIDE_FSYNC="1")
    eio.env["LD_PRELOAD"] = f"{build('fsync_eio.c', '-shared', '-fPIC', name='fsync_eio.so')}:" \
                            f"{eio.env['LD_PRELOAD']}"
    proc = eio.run([sys.executable, "-I", "-c", code, a, shim.dir / "k"])
    assert proc.stdout.decode().split() == ["EIO"], proc.stderr
    assert sorted(p.name for p in shim.dir.iterdir()) == []
    assert a.read_text() == "bytes" and os.stat(a).st_ino == os.stat(b).st_ino
    # the same rename, once the source can go, publishes it
    shim.run([sys.executable, "-I", "-c", code, a, shim.dir / "k"], check=True)
    assert (shim.dir / "k").read_text() == "bytes"
    assert not a.exists() and b.read_text() == "bytes"
    assert shim.temps() == []


def test_mv_of_a_tree_with_hard_links_from_another_file_system(shim: Shim) -> None:
    """``mv`` of a tree holding hard links from another file system (/dev/shm) into the managed
    directory: GNU mv renames file by file, each rename of a name with other links publishes a
    copy, and the last name is published by the EXDEV copy -- mv never calls link() between the
    new names (which the managed directory refuses, EXDEV). It succeeds: every name is a key of
    its own, the source tree is gone."""
    src = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        if os.stat(src).st_dev == os.stat(shim.dir).st_dev:
            pytest.fail("/dev/shm is on the managed directory's file system here: this test needs a "
                        "source on another file system")
        _tree(src / "t")
        os.link(src / "t" / "f.txt", src / "t" / "sub" / "f.link")
        os.link(src / "t" / "f.txt", src / "t" / "f2.txt")
        shim.run(["mv", src / "t", f"{shim.dir}/"], check=True)
        assert _files(shim.dir / "t") == {**TREE, "sub/f.link": "result", "f2.txt": "result"}
        assert all(os.stat(p).st_nlink == 1 for p in (shim.dir / "t").rglob("*") if p.is_file())
        assert not (src / "t").exists()
        assert shim.temps() == []
    finally:
        shutil.rmtree(src)


def test_a_key_renamed_as_a_copy_takes_its_record_along(nodes: EmulatedCluster) -> None:
    """Cluster mode: a key with another hard link (made without the library) renamed to another
    key is published there as a copy, and its old name goes with its record: node 2 reads the
    new key, and may publish the old one again (EEXIST while the record stayed)."""
    d1, d2 = nodes.node(1).dir, nodes.node(2).dir
    src = nodes.base_dir / "copy-src"
    src.write_text("first")
    assert run_preloaded(nodes, 1, ["cp", src, d1 / "cp-old"]).returncode == 0
    os.link(d1 / "cp-old", nodes.base_dir / "cp-old.link")
    proc = run_preloaded(nodes, 1, ["mv", d1 / "cp-old", d1 / "cp-new"])
    assert proc.returncode == 0, proc.stderr
    assert (nodes.base_dir / "cp-old.link").read_text() == "first"
    proc = run_preloaded(nodes, 2, ["cat", d2 / "cp-new"])
    assert proc.returncode == 0 and proc.stdout == b"first", proc.stderr
    src.write_text("again")
    proc = run_preloaded(nodes, 2, ["cp", src, d2 / "cp-old"])
    assert proc.returncode == 0, proc.stderr
    proc = run_preloaded(nodes, 1, ["cat", d1 / "cp-old"])
    assert proc.returncode == 0 and proc.stdout == b"again", proc.stderr


_RENAME = (
    "import errno, os, sys\n"
    "try:\n"
    "    os.rename(*sys.argv[1:])\n"
    "    print('renamed')\n"
    "except OSError as exc:\n"
    "    print(errno.errorcode[exc.errno])\n"
)


def test_a_move_from_another_file_system_whose_source_cannot_go_publishes_nothing(
        shim: Shim) -> None:
    """A file renamed into the managed directory from another file system (/dev/shm here) is
    copied beside the key and published, then its name removed -- and a removal that failed
    (an immutable file, a directory the user cannot write) was ignored: rename() said 0, the
    key was published and the source stayed, where libc's rename (and mv) would have failed.
    The source name goes first now, to a hidden name beside it: refused, the rename fails
    with nothing published; a publication that fails then (the key published meanwhile:
    EEXIST) puts the name back."""
    src = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        if os.stat(src).st_dev == os.stat(shim.dir).st_dev:
            pytest.fail("/dev/shm is on the managed directory's file system here: this test needs a "
                        "source on another file system")
        f = src / "f"
        f.write_text("bytes")
        with _unremovable(f):
            proc = shim.run([sys.executable, "-I", "-c", _RENAME, f, shim.dir / "k"])
        assert proc.stdout.decode().split() == ["EPERM" if os.geteuid() == 0 else "EACCES"], \
            proc.stderr
        assert list(shim.dir.iterdir()) == []
        assert os.listdir(src) == ["f"] and f.read_text() == "bytes"
        # the key published meanwhile (write-once): the source back under its name
        (shim.outside / "other").write_text("other")
        shim.run(["cp", shim.outside / "other", shim.dir / "k"], check=True)
        proc = shim.run([sys.executable, "-I", "-c", _RENAME, f, shim.dir / "k"])
        assert proc.stdout.decode().split() == ["EEXIST"], proc.stderr
        assert os.listdir(src) == ["f"] and f.read_text() == "bytes"
        assert (shim.dir / "k").read_text() == "other"
        # a source that can go: moved, nothing left beside it
        proc = shim.run([sys.executable, "-I", "-c", _RENAME, f, shim.dir / "k2"])
        assert proc.stdout.decode().split() == ["renamed"], proc.stderr
        assert os.listdir(src) == [] and (shim.dir / "k2").read_text() == "bytes"
        assert shim.temps() == []
    finally:
        shutil.rmtree(src)


@contextlib.contextmanager
def _unwritable_dir(path: Path) -> Iterator[None]:
    """No name in the directory ``path`` can be removed (its files can still be linked
    elsewhere): immutable for root (``chattr +i``), else made read-only."""
    if os.geteuid() == 0:
        chattr = shutil.which("chattr")
        assert chattr, "e2fsprogs' chattr is needed (apt-get install e2fsprogs)"
        subprocess.run([chattr, "+i", path], check=True)
        try:
            yield
        finally:
            subprocess.run([chattr, "-i", path], check=True)
    else:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)


def test_a_move_whose_source_name_cannot_go_publishes_nothing(shim: Shim) -> None:
    """On the managed directory's file system a write-once move was link(source, key) then
    unlink(source), the unlink's failure ignored: from a directory whose names cannot be removed
    rename() said 0 and both names stayed, one file -- the source name still writable in place,
    so the published key's bytes changed under its readers (``echo x >> source``). The move
    is one atomic no-replace rename now (link + unlink only where the file system has none,
    the link undone when the unlink fails): refused as libc's rename, nothing published."""
    sub = shim.outside / "ro"
    sub.mkdir()
    f = sub / "f"
    f.write_text("bytes")
    with _unwritable_dir(sub):
        proc = shim.run([sys.executable, "-I", "-c", _RENAME, f, shim.dir / "k"])
    assert proc.stdout.decode().split() == ["EPERM" if os.geteuid() == 0 else "EACCES"], \
        proc.stderr
    assert list(shim.dir.iterdir()) == []
    assert f.read_text() == "bytes" and os.stat(f).st_nlink == 1
    proc = shim.run([sys.executable, "-I", "-c", _RENAME, f, shim.dir / "k"])
    assert proc.stdout.decode().split() == ["renamed"], proc.stderr
    assert not f.exists() and (shim.dir / "k").read_text() == "bytes"
    assert os.stat(shim.dir / "k").st_nlink == 1


#: Renames argv[2] to argv[3] under the preload library, holding (argv[1]: "copy") the
#: cross-file-system copy's first copy_file_range in the kernel for good, argv[4] made once it
#: waits there -- or ("written") appending to the source as the copy begins -- or
#: ("noreplace") on a file system without RENAME_NOREPLACE
#: (renameat2 fails EINVAL), another writer publishing the key (a hard link of argv[4], made
#: by a raw linkat) and another file taking the source's name ("intruder") once the copy
#: waits beside the key and the source's name is free. Prints "renamed" or the errno's name.
_HELD_RENAME = r'''
import ctypes, errno, glob, os, sys
from seccomp_hold import NUMBERS, hold_calls
import platform

how, src, key, arg = sys.argv[1:5]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
managed = os.path.dirname(key)


def copy_held(name, n):
    open(arg, "w").close()
    return False


writer = []


def written_meanwhile(name, n):
    # (another process appends: one of this process's own threads would wait for the
    # library's read lease on the source, which this held copy keeps -- until the kernel's
    # lease-break-time, 45 s; see test_rename_writers.py)
    if n == 1 and not writer:
        import subprocess, time
        ino = os.stat(src).st_ino
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        writer.append(subprocess.Popen([sys.executable, "-I", "-c",
                                        "import sys; open(sys.argv[1], 'ab').write(b'more')",
                                        src], env=env))
        deadline = time.monotonic() + 30
        while writer[0].poll() is None and time.monotonic() < deadline:
            with open("/proc/locks") as fh:  # (its open waits for the lease: breaking)
                if any(f":{ino} " in line and "BREAKING" in line for line in fh):
                    break
            time.sleep(0.01)


def others_meanwhile(name, n):
    if name == "linkat" and glob.glob(f"{managed}/.*.instride-*.tmp") \
            and not os.path.lexists(src) and not os.path.lexists(key):
        assert libc.syscall(NUMBERS[platform.machine()]["linkat"], -100, arg.encode(), -100,
                            key.encode(), 0) == 0
        with open(src, "w") as fh:
            fh.write("intruder")


if how == "copy":
    hold_calls({"copy_file_range": None}, copy_held)
elif how == "written":
    hold_calls({"copy_file_range": None}, written_meanwhile)
else:
    hold_calls({"renameat2": errno.EINVAL, "linkat": None}, others_meanwhile)
try:
    os.rename(src, key)
    print("renamed")
except OSError as exc:
    print(errno.errorcode[exc.errno])
if writer:
    writer[0].wait(60)
'''


def _held_rename(shim: Shim, how: str, src: Path, key: Path, arg: Path,
                 ) -> subprocess.Popen[bytes]:
    env = dict(shim.env, PYTHONPATH=str(Path(__file__).parent), INSTRIDE_DEBUG="1")
    return subprocess.Popen([sys.executable, "-c", _HELD_RENAME, how, str(src), str(key),
                             str(arg)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_move_killed_during_its_copy_leaves_the_source_under_its_name(shim: Shim) -> None:
    """A file renamed into the managed directory from another file system is copied beside the
    key. Its name went first, renamed to a hidden name of instride's temporary files
    (``.<name>.instride-<pid>-<hex>.tmp``), for the whole copy (minutes, for GBs): a process
    killed meanwhile (a job's time limit, the OOM killer) left the user's file under that name
    only, and ``instride gc`` removed it as a dead writer's temporary file. The copy is made
    from the source under its own name now; its name goes (to a name gc never takes) only
    once the copy is whole, just before the key is published. Here the copy waits in the
    kernel (a seccomp user notification) until the process is killed."""
    from instride.store.gc import collect_garbage

    src = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        if os.stat(src).st_dev == os.stat(shim.dir).st_dev:
            pytest.fail("/dev/shm is on the managed directory's file system here: this test needs a "
                        "source on another file system")
        (src / "f").write_bytes(b"bytes" * 1000)
        held = shim.outside / "held"
        proc = _held_rename(shim, "copy", src / "f", shim.dir / "k", held)
        try:
            deadline = time.monotonic() + 60
            while not held.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert held.exists(), proc.communicate(timeout=60)
        finally:
            proc.kill()
            _, err = proc.communicate(timeout=60)
        assert proc.returncode != 77, "seccomp user notifications are not available here"
        assert os.listdir(src) == ["f"] and (src / "f").read_bytes() == b"bytes" * 1000, err
        assert collect_garbage(src) == []
        # beside the key: the dead writer's temporary copy, which gc takes; nothing published
        assert collect_garbage(shim.dir) != [] and list(shim.dir.iterdir()) == []
        assert os.listdir(src) == ["f"]
    finally:
        shutil.rmtree(src)


def test_a_source_put_back_without_renameat2_never_replaces_a_file(shim: Shim) -> None:
    """A move from another file system whose publication fails (another writer published the
    key first: write-once) puts the source back under its name. Where the file system has no
    ``RENAME_NOREPLACE`` (NFS, Lustre and GPFS often; emulated here: renameat2 fails EINVAL)
    that was a plain rename, which replaced a file that had taken the name meanwhile: its
    bytes were lost. It is link + unlink now, which replaces nothing: the source stays under
    its hidden name, which the error message gives, and which gc never takes."""
    from instride.store.gc import collect_garbage

    src = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        if os.stat(src).st_dev == os.stat(shim.dir).st_dev:
            pytest.fail("/dev/shm is on the managed directory's file system here: this test needs a "
                        "source on another file system")
        (src / "f").write_text("bytes")
        other = shim.outside / "other"
        other.write_text("other")
        proc = _held_rename(shim, "noreplace", src / "f", shim.dir / "k", other)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode != 77, "seccomp user notifications are not available here"
        assert out.decode().split() == ["EEXIST"], err
        assert (shim.dir / "k").read_text() == "other"
        assert (src / "f").read_text() == "intruder"
        hidden = [n for n in os.listdir(src) if n != "f"]
        assert len(hidden) == 1 and (src / hidden[0]).read_text() == "bytes", hidden
        assert collect_garbage(src) == []
        assert hidden[0] in err.decode()  # (INSTRIDE_DEBUG=1: the message printed)
        assert shim.temps() == []
    finally:
        shutil.rmtree(src)


def test_a_source_written_to_during_its_copy_is_not_published(shim: Shim) -> None:
    """A file renamed into the managed directory from another file system while a program
    still appends to it (a log, a trajectory being written): the copy beside the key took
    whatever the source held when each part was read, and was published as the key -- bytes
    the source never held all at once. A source changed (or replaced) during the copy fails
    the rename now (EBUSY), nothing published, the source where it was."""
    src = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        if os.stat(src).st_dev == os.stat(shim.dir).st_dev:
            pytest.fail("/dev/shm is on the managed directory's file system here: this test needs a "
                        "source on another file system")
        (src / "f").write_bytes(b"bytes" * 1000)
        proc = _held_rename(shim, "written", src / "f", shim.dir / "k", shim.outside / "x")
        out, err = proc.communicate(timeout=60)
        assert proc.returncode != 77, "seccomp user notifications are not available here"
        assert out.decode().split() == ["EBUSY"], err
        assert os.listdir(src) == ["f"] and (src / "f").read_bytes() == b"bytes" * 1000 + b"more"
        assert list(shim.dir.iterdir()) == []
    finally:
        shutil.rmtree(src)
