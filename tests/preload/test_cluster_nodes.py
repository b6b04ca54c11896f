"""Unmodified programs across two emulated nodes in cluster mode, through the real data servers.

Producers run on node 1 and consumers on node 2 (network namespaces, one Redis, one
``instride serve`` per node): the shim on each node asks its own server over the Unix socket,
which fetches from the owner node. Nothing here imports instride in the coupled programs.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from instride.emulate import EmulatedCluster
from instride.interception.preload import preload_path

from .conftest import HOLDING_READER, Builder


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {"LD_PRELOAD": str(preload_path())}
    env.update(extra or {})
    return env


def start(c: EmulatedCluster, node: int, argv: list[str], **extra: str) -> subprocess.Popen:
    return c.popen(node, [str(a) for a in argv], env=_env(extra), stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen, timeout: float = 60) -> bytes:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err.decode(errors="replace")
    return out


def run(c: EmulatedCluster, node: int, argv: list[str], **extra: str) -> bytes:
    return finish(start(c, node, argv, **extra))


def test_cp_on_node1_cat_on_node2_consumer_first(nodes: EmulatedCluster, tmp_path: Path) -> None:
    src = tmp_path / "payload.bin"
    src.write_bytes(bytes(range(256)) * 40_000)
    key1 = nodes.node(1).dir / "tools" / "cp.bin"
    key2 = nodes.node(2).dir / "tools" / "cp.bin"  # same key, node 2's managed directory
    cat = start(nodes, 2, ["cat", key2])
    time.sleep(0.5)
    assert cat.poll() is None, "cat on node 2 must wait for the publication on node 1"
    run(nodes, 1, ["cp", src, key1])
    assert finish(cat) == src.read_bytes()
    assert key2.read_bytes() == src.read_bytes()  # stored locally on node 2 under the same key


def test_dd_across_nodes(nodes: EmulatedCluster) -> None:
    key1 = nodes.node(1).dir / "tools" / "dd.bin"
    run(nodes, 1, ["dd", "if=/dev/urandom", f"of={key1}", "bs=64k", "count=32", "status=none"])
    out = run(nodes, 2, ["dd", f"if={nodes.node(2).dir / 'tools' / 'dd.bin'}", "bs=1M",
                         "status=none"])
    assert out == key1.read_bytes() and len(out) == 32 * 65536


def test_python_without_instride_across_nodes(nodes: EmulatedCluster) -> None:
    writer = "import sys; open(sys.argv[1], 'w').write('from node 1 ' * 1000)"
    reader = "import sys; print(open(sys.argv[1]).read()[:12]); print('instride' in sys.modules)"
    r = start(nodes, 2, [sys.executable, "-c", reader, nodes.node(2).dir / "py" / "t.txt"])
    time.sleep(0.3)
    run(nodes, 1, [sys.executable, "-c", writer, nodes.node(1).dir / "py" / "t.txt"])
    assert finish(r).decode().split("\n")[:2] == ["from node 1 ", "False"]


def test_a_read_only_create_reads_another_nodes_key_or_makes_it(nodes: EmulatedCluster,
                                                                  tmp_path: Path) -> None:
    """``open(O_RDONLY|O_CREAT)`` (util-linux ``flock(1)``'s lock file) waited for good for a
    key not published yet. A key published on another node is read (never an empty one made
    over it); a key published nowhere is made here, empty, and published at the close."""
    src = tmp_path / "p.txt"
    src.write_bytes(b"node 1's")
    run(nodes, 1, ["cp", src, nodes.node(1).dir / "rc" / "pub.txt"])
    reader = ("import os, sys; fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT, 0o644); "
              "sys.stdout.buffer.write(os.read(fd, 100)); os.close(fd)")
    out = run(nodes, 2, [sys.executable, "-I", "-c", reader, nodes.node(2).dir / "rc" / "pub.txt"],
              INSTRIDE_TIMEOUT="5")
    assert out == b"node 1's"
    out = run(nodes, 2, [sys.executable, "-I", "-c", reader,
                         nodes.node(2).dir / "rc" / "new.lock"], INSTRIDE_TIMEOUT="5")
    assert out == b""
    assert run(nodes, 1, ["cat", nodes.node(1).dir / "rc" / "new.lock"],
               INSTRIDE_TIMEOUT="5") == b""
    # removed by its owner (node 2: its record goes), node 1's copy of it stays: made again,
    # on node 1 (the copy of a key no longer recorded is no publication in the way)
    run(nodes, 2, ["rm", nodes.node(2).dir / "rc" / "new.lock"])
    out = run(nodes, 1, [sys.executable, "-I", "-c", reader,
                         nodes.node(1).dir / "rc" / "new.lock"], INSTRIDE_TIMEOUT="5")
    assert out == b""
    assert (nodes.node(1).dir / "rc" / "new.lock").exists()


def test_c_scenarios_through_the_real_server(nodes: EmulatedCluster, build: Builder,
                                             tmp_path: Path) -> None:
    exe = build("calls.c")
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("open", "openat", "creat", "fopen", "freopen", "dup", "rdwr", "rename"):
        out = run(nodes, 1, [exe, name, nodes.node(1).dir, outside], INSTRIDE_TIMEOUT="5")
        assert out.decode().strip() == f"PASS {name}"
    # what the C program published on node 1 is recorded in Redis and readable on node 2
    published = sorted(p for p in (nodes.node(1).dir).rglob("*") if p.is_file()
                       and ".instride" not in p.parts and not p.name.startswith("."))
    assert published
    probe = published[0].relative_to(nodes.node(1).dir)
    assert run(nodes, 2, ["cat", nodes.node(2).dir / probe]) == published[0].read_bytes()


def test_multithreaded_c_program_in_cluster_mode(nodes: EmulatedCluster, build: Builder,
                                                 tmp_path: Path) -> None:
    exe = build("threads.c")
    outside = tmp_path / "thr"
    outside.mkdir()
    root = nodes.node(1).dir / "threads"
    root.mkdir()
    out = run(nodes, 1, [exe, root, outside, "4", "25"])
    assert out.decode().strip() == "PASS threads 4 x 25"
    keys = sorted(root.rglob("k*.bin"))
    assert len(keys) == 100
    some = keys[-1].relative_to(nodes.node(1).dir)
    assert run(nodes, 2, ["cat", nodes.node(2).dir / some]) == keys[-1].read_bytes()


def test_cpp_streams_across_nodes(nodes: EmulatedCluster, build: Builder) -> None:
    exe = build("streams.cpp")
    consumer = nodes.popen(2, [str(exe), "consume", str(nodes.node(2).dir / "cpp" / "f.txt")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(0.3)
    res = nodes.run(1, [str(exe), "produce", str(nodes.node(1).dir / "cpp" / "f.txt"), "500"],
                    capture_output=True)
    assert res.returncode == 0, res.stderr
    assert finish(consumer).decode() == "".join(f"line {i}\n" for i in range(500))


def test_rename_into_managed_dir_publishes_cluster_wide(nodes: EmulatedCluster, tmp_path: Path) -> None:
    tmp = tmp_path / "scratch.dat"
    tmp.write_bytes(b"renamed in " * 100)
    run(nodes, 1, ["mv", tmp, nodes.node(1).dir / "mv" / "done.dat"])
    assert run(nodes, 2, ["cat", nodes.node(2).dir / "mv" / "done.dat"]) == b"renamed in " * 100


def test_exclusive_create_stays_write_once_across_nodes(nodes: EmulatedCluster) -> None:
    # Node 1 publishes a key. On node 2, with INSTRIDE_OVERWRITE=1, an O_EXCL create of the
    # same key is still write-once for the whole cluster: its close fails with EEXIST, its
    # local file is removed, and node 1 stays the owner.
    run(nodes, 1, ["sh", "-c", f"echo first > {nodes.node(1).dir / 'excl' / 'k'}"])
    code = textwrap.dedent(
        """
        import errno, os, sys
        fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, b"second")
        try:
            os.close(fd)
            print("published")
        except OSError as e:
            print(errno.errorcode[e.errno])
        """
    )
    out = run(nodes, 2, [sys.executable, "-c", code, nodes.node(2).dir / "excl" / "k"],
              INSTRIDE_OVERWRITE="1")
    assert out.decode().strip() == "EEXIST"
    assert not (nodes.node(2).dir / "excl" / "k").exists()
    assert run(nodes, 2, ["cat", nodes.node(2).dir / "excl" / "k"]) == b"first\n"


def test_a_transfer_longer_than_the_timeout_and_its_grace_is_read_whole(
        nodes: EmulatedCluster) -> None:
    """INSTRIDE_TIMEOUT bounds the wait for a key's publication, not the transfer of its bytes:
    a program on node 2 reading a 24 MiB file published on node 1, over a link of 20 Mbit/s
    (~10 s), with INSTRIDE_TIMEOUT=1, reads it whole. The shim waits for its node server's
    answer INSTRIDE_TIMEOUT + 5 s, re-armed by each progress line the server sends while the
    fetch goes on (it gave up after 6 s, ETIMEDOUT, on a transfer going well)."""
    key1 = nodes.node(1).dir / "slowlink" / "big.bin"
    run(nodes, 1, ["dd", "if=/dev/urandom", f"of={key1}", "bs=1M", "count=24", "status=none"])
    # (what node 2 receives, at the hub's end of its link; removed after, for the module's
    # other tests)
    tc = ["tc", "-n", nodes.hub, "qdisc"]
    subprocess.run([*tc, "replace", "dev", "n2", "root", "tbf", "rate", "20mbit", "burst",
                    "64kb", "latency", "100ms"], check=True)
    try:
        start = time.monotonic()
        run(nodes, 2, ["cmp", key1, nodes.node(2).dir / "slowlink" / "big.bin"],
            INSTRIDE_TIMEOUT="1")
        assert time.monotonic() - start > 7, "the transfer was not slow: the test shows nothing"
    finally:
        subprocess.run([*tc, "del", "dev", "n2", "root"], check=False)


_BOUNDED_PRODUCER = textwrap.dedent("""
    import os, sys, numpy as np, instride
    pos = np.zeros((500, 3), np.float32)
    with instride.Stream(sys.argv[1], mode="w", retain=2, on_full="drop-oldest") as s:
        s.append(pos, step=0)
        root = instride.get_client().root
        print(os.stat(root / s.frame_key(0)).st_ino, flush=True)
        sys.stdin.readline()
        for i in range(1, 40):
            s.append(pos, step=i)
        print(int((root / s.frame_key(0)).exists()),
              *(os.stat(root / s.frame_key(i)).st_ino for i in (38, 39)), flush=True)
        sys.stdin.readline()
        inodes = []
        for i in range(40, 60):
            s.append(pos, step=i)
            inodes.append(os.stat(root / s.frame_key(i)).st_ino)
        print(*inodes, flush=True)
""")


@pytest.mark.parametrize("opener", ["preload", "c-api"])
def test_a_bounded_streams_frame_opened_by_path_is_held_in_cluster_mode(
    nodes: EmulatedCluster, build: Builder, opener: str,
) -> None:
    """Cluster mode (the path comes from the node's server): a program on the producer's
    node that opens a bounded stream's frame holds it while open, so the retired frame's file
    is not rewritten under it; closed, the file is reused. Opened by an unmodified program
    under the preload library, or by ``instride_open_read`` of the C API."""
    stream = f"cheld-{opener}"  # (one stream per test: the cluster is the module's)
    prod = nodes.popen(1, [sys.executable, "-c", _BOUNDED_PRODUCER, stream], stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reader = None
    try:
        assert prod.stdin is not None and prod.stdout is not None
        ino = int(prod.stdout.readline())
        frame = str(nodes.node(1).dir / stream / "frame_000000000.isf")
        if opener == "preload":
            argv, env = [sys.executable, "-I", "-c", HOLDING_READER, frame], _env()
        else:
            argv, env = [str(build("api_hold.c", api=True)), frame], {}
        reader = nodes.popen(1, argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        assert reader.stdin is not None and reader.stdout is not None
        assert reader.stdout.readline() == "read\n"
        prod.stdin.write("more\n")
        prod.stdin.flush()
        there, *latest = map(int, prod.stdout.readline().split())
        assert there == 0 and ino not in latest  # retired, and its file not reused
        reader.stdin.write("go\n")
        reader.stdin.flush()
        assert finish(reader).split() == ["same"]
        prod.stdin.write("more\n")
        prod.stdin.flush()
        line = prod.stdout.readline()
        assert line, prod.communicate(timeout=60)[1]  # (the producer's error)
        assert ino in map(int, line.split())  # closed: reused
        finish(prod)
    finally:
        for p in (prod, reader):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
