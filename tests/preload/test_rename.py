"""Renames under the managed directory that would make keys without publication
(csrc/preload/rename.c): a directory renamed there, and ``renameat2(RENAME_EXCHANGE)``.

A key appears only by publication (complete at once, write-once checked, recorded in cluster
mode). A directory renamed into the managed directory, or within it, is refused with EXDEV, on
which ``mv`` and ``shutil.move`` copy the tree file by file -- and each file is published; an
exchange that names a key is refused with EINVAL.
"""

from __future__ import annotations

import os
import sys
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


@pytest.mark.parametrize("case", ["dir", "root", "exchange"])
def test_directory_renames_and_exchanges_naming_keys_are_refused(shim: Shim, build: Builder,
                                                                  case: str) -> None:
    """A directory renamed under the managed directory (from outside or within it) made its
    files keys without publication, or renamed keys without their records; one renamed over
    the managed directory replaced it; RENAME_EXCHANGE swapped a published key's bytes. They
    fail (EXDEV; EINVAL for the exchange) and nothing moves. See tests/preload/c/renames.c."""
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
