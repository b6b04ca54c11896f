"""Renames under the managed directory that would make keys without publication
(csrc/preload/rename.c): a directory renamed there, and ``renameat2(RENAME_EXCHANGE)``.

A key appears only by publication (complete at once, write-once checked, recorded in cluster
mode). A directory renamed into the managed directory, or within it, is refused with EXDEV, on
which ``mv`` and ``shutil.move`` copy the tree file by file -- and each file is published; an
exchange that names a key is refused with EINVAL.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from instride.emulate import EmulatedCluster
from instride.interception.preload import preload_path

from .conftest import Builder, Shim


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


@pytest.fixture(scope="module")
def nodes() -> Iterator[EmulatedCluster]:
    with EmulatedCluster(nodes=2, env={"INSTRIDE_TIMEOUT": "30"}) as c:
        yield c


def _run(c: EmulatedCluster, node: int, argv: list, timeout_s: str = "30"
         ) -> subprocess.CompletedProcess:
    env = {"LD_PRELOAD": str(preload_path()), "INSTRIDE_TIMEOUT": timeout_s}
    return c.run(node, [str(a) for a in argv], env=env, capture_output=True, timeout=120)


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
    assert _run(nodes, 1, ["mv", tmp_path / "mvd", f"{d1}/"]).returncode == 0
    move = "import shutil, sys; shutil.move(sys.argv[1], sys.argv[2])"
    assert _run(nodes, 1, [sys.executable, "-I", "-c", move, tmp_path / "shd",
                           d1 / "shd"]).returncode == 0
    assert _run(nodes, 1, ["mv", d1 / "shd", d1 / "within"]).returncode == 0
    for key in ("mvd/f.txt", "mvd/sub/g.txt", "within/f.txt", "within/sub/g.txt"):
        proc = _run(nodes, 2, ["cat", d2 / key], timeout_s="5")
        assert proc.returncode == 0, (key, proc.stderr)
        assert proc.stdout.decode() == TREE[key.split("/", 1)[1]]
