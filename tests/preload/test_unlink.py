"""Cluster mode: a key's file removed by an unmodified program (``unlink``, ``unlinkat``,
``remove``, or a rename of the key away) also removes the key's record
(csrc/preload/unlink.c, the node server's ``DELETE``), as the Python client's ``delete`` does.

Before, the file went and the record stayed: other nodes still saw the key, fetched it and
failed, and a re-publication of the key (write-once) was refused ``EEXIST`` everywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from instride.emulate import EmulatedCluster
from instride.interception.preload import preload_path

from .conftest import run_preloaded


def _publish(c: EmulatedCluster, node: int, key: str, text: str) -> None:
    src = c.base_dir / f"src-{node}-{key.replace('/', '_')}"
    src.write_text(text)
    proc = run_preloaded(c, node, ["cp", src, c.node(node).dir / key])
    assert proc.returncode == 0, (key, proc.stderr)


def _read(c: EmulatedCluster, node: int, key: str, timeout_s: str = "10"
          ) -> subprocess.CompletedProcess:
    return run_preloaded(c, node, ["cat", c.node(node).dir / key], timeout_s=timeout_s)


REMOVE = (
    "import os, sys\n"
    "how, path = sys.argv[1:]\n"
    "if how == 'unlinkat':\n"
    "    d = os.open(os.path.dirname(path), os.O_RDONLY)\n"
    "    os.unlink(os.path.basename(path), dir_fd=d)\n"
    "else:\n"
    "    os.remove(path)\n"
)


def test_a_key_removed_on_its_node_is_unpublished_across_the_cluster(
        nodes: EmulatedCluster) -> None:
    """``rm``, ``unlinkat``, ``remove`` and ``mv`` (away, or within) of a key on the node that
    published it: the key is no longer published anywhere -- node 2 publishes it anew (it was
    refused EEXIST) and node 1 reads node 2's bytes; a key renamed within is published under
    its new name only."""
    d1 = nodes.node(1).dir
    out = nodes.base_dir / "moved-out"
    out.mkdir()
    cases = {
        "rm/k": ["rm", d1 / "rm/k"],
        "unlinkat/k": [sys.executable, "-I", "-c", REMOVE, "unlinkat", d1 / "unlinkat/k"],
        "remove/k": [sys.executable, "-I", "-c", REMOVE, "remove", d1 / "remove/k"],
        "away/k": ["mv", d1 / "away/k", out / "k"],
        "within/k": ["mv", d1 / "within/k", d1 / "within/k2"],
    }
    for key, remove in cases.items():
        _publish(nodes, 1, key, f"first {key}")
        proc = run_preloaded(nodes, 1, remove)
        assert proc.returncode == 0, (key, proc.stderr)
        assert not (d1 / key).exists()
        _publish(nodes, 2, key, f"again {key}")  # (EEXIST before: the record stayed)
        proc = _read(nodes, 1, key)
        assert proc.returncode == 0, (key, proc.stderr)
        assert proc.stdout.decode() == f"again {key}"
    assert (out / "k").read_text() == "first away/k"
    proc = _read(nodes, 2, "within/k2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode() == "first within/k"


def test_a_fetched_copy_removed_leaves_the_key_published(nodes: EmulatedCluster) -> None:
    """A copy fetched by node 2 and removed there is this node's cache only: the key stays
    published by node 1 (node 2 reads it again; a publication of it there is EEXIST), and a
    key still being written is dropped without any request (nothing was published)."""
    _publish(nodes, 1, "copy/k", "original")
    assert _read(nodes, 2, "copy/k").stdout.decode() == "original"
    assert run_preloaded(nodes, 2, ["rm", nodes.node(2).dir / "copy/k"]).returncode == 0
    proc = _read(nodes, 2, "copy/k")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode() == "original"
    src = nodes.base_dir / "other"
    src.write_text("other")
    assert run_preloaded(nodes, 2, ["cp", src, nodes.node(2).dir / "copy/k"]).returncode != 0
    assert _read(nodes, 1, "copy/k").stdout.decode() == "original"


def test_a_removal_that_took_effect_succeeds_whatever_the_node_server_says(
        nodes: EmulatedCluster, tmp_path: Path) -> None:
    """The file is gone: ``rm`` succeeds (it failed, ``ECONNREFUSED``, where no node server
    could be told -- a job's cleanup after its services stopped -- and ``EINVAL`` for a file
    whose name no key can have, a TAB in it, made without the library: it never had a
    record, yet the server refused its ``DELETE``; a failure that cannot be retried, for a
    removal that happened). The record stays where the server was not reached (said with
    ``INSTRIDE_DEBUG=1``)."""
    d1 = nodes.node(1).dir
    _publish(nodes, 1, "nosrv/k", "x")
    env = {"LD_PRELOAD": str(preload_path()), "INSTRIDE_SOCKET": str(tmp_path / "none.sock"),
           "INSTRIDE_DEBUG": "1"}
    proc = nodes.run(1, ["rm", str(d1 / "nosrv/k")], env=env, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not (d1 / "nosrv/k").exists()
    assert b"refused" in proc.stderr.lower(), proc.stderr  # (INSTRIDE_DEBUG: told)
    odd = os.path.join(os.fsencode(d1), b"tab\there")
    with open(odd, "wb") as fh:  # (an untar's, a tool's run without the library)
        fh.write(b"x")
    proc = run_preloaded(nodes, 1, ["rm", os.fsdecode(odd)])
    assert proc.returncode == 0, proc.stderr
    assert not os.path.lexists(odd)


def test_a_directory_of_keys_moved_out_is_unpublished_key_by_key(
        nodes: EmulatedCluster) -> None:
    """``mv $D/run1 /archive/`` in cluster mode: the directory went whole (libc's rename), and
    every key in it **kept its record** -- other nodes fetched missing files, and a new
    publication of any of them was refused ``EEXIST``. The rename is refused ``EXDEV``: ``mv``
    moves the files one by one, each source's removal taking its record along."""
    d1 = nodes.node(1).dir
    _publish(nodes, 1, "out1/k", "first")
    out = nodes.base_dir / "archive-dir"
    out.mkdir()
    proc = run_preloaded(nodes, 1, ["mv", d1 / "out1", out / "out1"])
    assert proc.returncode == 0, proc.stderr
    assert (out / "out1" / "k").read_text() == "first" and not (d1 / "out1").exists()
    _publish(nodes, 2, "out1/k", "again")  # (EEXIST before: the record stayed)
    proc = run_preloaded(nodes, 1, ["cat", d1 / "out1/k"])
    assert proc.returncode == 0 and proc.stdout == b"again", proc.stderr


def test_a_key_moved_to_one_of_instrides_own_names_keeps_its_record(
        nodes: EmulatedCluster) -> None:
    """A key renamed to one of instride's own names under the managed directory (the Python
    package under the library: a bounded stream's producer retires each frame into its pool
    beneath ``.instride/``, its record forgotten with its next publication) is instride's own
    bookkeeping: the shim told the node server to delete the record (a round trip per
    retired frame, the record gone before the producer's own step). It keeps it."""
    d1 = nodes.node(1).dir
    _publish(nodes, 1, "own/k", "first")
    pool = d1 / ".instride" / "streams" / "own-test.stream" / "pool"
    pool.mkdir(parents=True, exist_ok=True)
    proc = run_preloaded(nodes, 1, ["mv", d1 / "own/k", pool / "slot"])
    assert proc.returncode == 0, proc.stderr
    # (the record stays: a write-once publication of the key elsewhere is still refused)
    src = nodes.base_dir / "src-own-again"
    src.write_text("again")
    proc = run_preloaded(nodes, 2, ["cp", src, nodes.node(2).dir / "own/k"])
    assert proc.returncode != 0 and b"exists" in proc.stderr, proc.stderr
