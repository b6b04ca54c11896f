"""Emulated nodes: real network namespaces, a real bridge, real Redis, real processes.

Needs root, iproute2 and redis-server (``make test`` installs them); without them the cluster
raises ClusterError and these tests fail loudly.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from instride.emulate import ClusterError, EmulatedCluster, mounts
from instride.emulate import emulated as em
from instride.emulate import netns as nn
from instride.errors import ConfigError, InstrideError

pytestmark = pytest.mark.root

PY = sys.executable


def unique() -> str:
    return "t" + secrets.token_hex(5)


def leftovers(cluster: EmulatedCluster) -> list[str]:
    return [ns for ns in nn.list_netns() if ns.startswith(cluster.prefix)]


def py(c: EmulatedCluster, node: int, code: str, timeout: float = 20, **kw: object) -> str:
    """Run Python code on a node; return its stdout (assert it succeeded)."""
    proc = c.run(node, [PY, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                 timeout=timeout, **kw)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def cluster2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatedCluster]:
    """Two nodes with Redis, no data servers (shared by the tests of this module)."""
    c = EmulatedCluster(nodes=2, name=unique(), base_dir=tmp_path_factory.mktemp("c2") / "base",
                        serve=False)
    with c:
        yield c
    assert leftovers(c) == []


# ---------------------------------------------------------------------- life cycle
def test_up_down_leaves_nothing_behind() -> None:
    host_links = nn.links()
    c = EmulatedCluster(nodes=2, name=unique(), serve=False)
    c.up()
    try:
        assert set(leftovers(c)) == {c.hub, c.nodes[0].netns, c.nodes[1].netns}
        assert all(len(ns) <= nn.IFNAMSIZ for ns in leftovers(c))
        assert {"lo", "br0", "n1", "n2"} <= set(nn.links(c.hub))
        assert set(nn.links(c.nodes[0].netns)) == {"lo", "eth0"}
        addr = nn.ip("-n", c.nodes[1].netns, "-o", "-4", "addr", "show", "eth0").stdout
        assert f"{c.nodes[1].ip}/24" in addr
        assert nn.links() == host_links  # nothing created in the host's namespace
        redis_pid = c._pids["redis"][0]
        assert em._alive(redis_pid, None)
        base = c.base_dir
        assert base.is_dir() and c.shared_dir.is_dir() and c.node(2).dir.is_dir()
        state = json.loads(c.state_path.read_text())
        assert state["status"] == "up" and state["pids"]["redis"][0] == redis_pid
        straggler = c.popen(1, ["sleep", "60"])  # a user process still running at down()
    finally:
        c.down()
    assert straggler.wait(5) == -9
    assert leftovers(c) == []
    assert nn.links() == host_links
    assert not em._alive(redis_pid, None)
    assert not base.exists()
    assert not c.state_path.exists()
    c.down()  # idempotent


def test_down_after_failed_up_removes_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a real "redis-server" that exits at once: up() fails after namespaces and dirs exist
    monkeypatch.setattr(em, "_require_redis", lambda: "/bin/false")
    base = tmp_path / "base"
    c = EmulatedCluster(nodes=2, name=unique(), base_dir=base, serve=False)
    with pytest.raises(ClusterError, match="Redis redis exited"):
        c.up()
    assert leftovers(c) == []
    assert not base.exists()
    assert not c.state_path.exists()
    c.down()


def test_destroy_from_another_process_and_without_state(tmp_path: Path) -> None:
    c = EmulatedCluster(nodes=1, name=unique(), base_dir=tmp_path / "b", serve=False).up()
    pid = c._pids["redis"][0]
    # another process tears it down through the state file
    proc = subprocess.run([PY, "-m", "instride", "cluster", "down", "--name", c.name],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "removed" in proc.stdout
    assert leftovers(c) == [] and not em._alive(pid, None) and not (tmp_path / "b").exists()
    # leftovers of a crashed run with no state file: namespaces are still found by name
    orphan = EmulatedCluster(nodes=1, name=unique(), serve=False)
    nn.add_netns(orphan.nodes[0].netns)
    assert EmulatedCluster.destroy(orphan.name) is True
    assert leftovers(orphan) == []
    assert EmulatedCluster.destroy(orphan.name) is False


def test_a_huge_page_tmpfs_under_a_path_through_a_link_is_unmounted(tmp_path: Path) -> None:
    """``--base-dir`` through a symbolic link (a scratch directory linked elsewhere, common on
    clusters) or with a '..': the kernel lists the mount under its real path, down() compared
    the path as given, and the tmpfs stayed mounted (its frames holding memory) while the
    command said the cluster was removed."""
    (tmp_path / "real").mkdir()
    (tmp_path / "linked").symlink_to(tmp_path / "real")
    for base in (tmp_path / "linked" / "hp", tmp_path / "real" / ".." / "real" / "hp2"):
        c = EmulatedCluster(nodes=1, name=unique(), base_dir=base, serve=False,
                            huge_pages=True).up()
        real = base.resolve()
        try:
            assert mounts.is_mount(real)
        finally:
            c.down()
        assert not mounts.is_mount(real) and not real.exists()


def test_a_cluster_on_huge_pages_has_its_own_tmpfs_until_down(tmp_path: Path) -> None:
    """huge_pages: the base directory is a tmpfs of its own mounted with huge=within_size,
    which the nodes' files are on; it is recorded in the state file, so that a down() from
    another process unmounts it; a base directory that is not empty is refused, and nothing is
    left behind."""
    c = EmulatedCluster(nodes=1, name=unique(), serve=False, huge_pages=True).up()
    base = c.base_dir
    try:
        assert "huge=within_size" in (mounts.mount_options(base) or "")
        out = py(c, 1, """
            import os
            path = os.path.join(os.environ["INSTRIDE_DIR"], "big")
            with open(path, "wb") as fh:
                os.posix_fallocate(fh.fileno(), 0, 4 << 20)
            print(os.stat(path).st_dev)
        """)
        assert int(out) == os.stat(base).st_dev != os.stat(base.parent).st_dev
        state = json.loads(c.state_path.read_text())
        assert state["huge_pages"] is True and state["mounted"] == [str(base)]
        assert c.status()["huge_pages"] is True
    finally:
        proc = subprocess.run([PY, "-m", "instride", "cluster", "down", "--name", c.name],
                              capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert not mounts.is_mount(base) and not base.exists() and leftovers(c) == []
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine").write_text("kept")
    refused = EmulatedCluster(nodes=1, name=unique(), base_dir=full, serve=False, huge_pages=True)
    with pytest.raises(ClusterError, match="not an empty directory"):
        refused.up()
    assert (full / "mine").read_text() == "kept" and not mounts.is_mount(full)
    assert leftovers(refused) == [] and not refused.state_path.exists()


def test_name_is_exclusive(cluster2: EmulatedCluster) -> None:
    twin = EmulatedCluster(nodes=1, name=cluster2.name, serve=False)
    with pytest.raises(ClusterError, match="already exists"):
        twin.up()
    twin.down()  # a refused object owns nothing: this must not touch the running cluster
    assert len(leftovers(cluster2)) == 3  # the running cluster is untouched
    assert cluster2.state_path.exists()


def test_bad_input_is_typed() -> None:
    with pytest.raises(ConfigError):
        EmulatedCluster(nodes=0)
    with pytest.raises(ConfigError):
        EmulatedCluster(nodes=2, name="has space")
    c = EmulatedCluster(nodes=2, name=unique())
    with pytest.raises(ConfigError):
        c.node(3)
    assert c.node("node2") is c.node(2)
    with pytest.raises(ConfigError):
        c.command(1, "not a list")
    with pytest.raises(ClusterError):
        EmulatedCluster.attach(unique())


def test_missing_redis_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    c = EmulatedCluster(nodes=1, name=unique(), serve=False)
    with pytest.raises(ClusterError, match="make test") as info:
        c.up()
    assert isinstance(info.value, InstrideError) and isinstance(info.value, RuntimeError)
    assert not c.state_path.exists()


# ---------------------------------------------------------------------- networking
def test_tcp_from_node1_to_node2(cluster2: EmulatedCluster) -> None:
    server = cluster2.popen(2, [PY, "-c", textwrap.dedent("""
        import socket, sys
        s = socket.create_server((sys.argv[1], 5000))
        print("ready", flush=True)
        conn, peer = s.accept()
        data = conn.recv(100)
        conn.sendall(data.upper() + b" from " + peer[0].encode())
    """), cluster2.node(2).ip], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        out = py(cluster2, 1, f"""
            import socket
            with socket.create_connection(("{cluster2.node(2).ip}", 5000), timeout=5) as s:
                s.sendall(b"ping")
                print(s.recv(100).decode())
        """)
        assert out.strip() == f"PING from {cluster2.node(1).ip}"
        assert server.wait(10) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    # the node addresses exist only inside the cluster's namespaces
    host = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    assert cluster2.node(2).ip not in host


def test_redis_reachable_from_every_node(cluster2: EmulatedCluster) -> None:
    for node in cluster2.nodes:
        out = py(cluster2, node.index, """
            import os, redis
            r = redis.Redis.from_url(os.environ["INSTRIDE_REDIS_URL"], socket_timeout=5)
            assert r.ping()
            r.set("hello:" + os.environ["INSTRIDE_NODE"], os.environ["INSTRIDE_ADDR"])
            print(sorted(k.decode() for k in r.keys("hello:*")))
        """)
        assert f"hello:{node.name}" in out
    assert "hello:node1" in out and "hello:node2" in out  # one Redis for all nodes


def test_restart_redis_on_same_address(cluster2: EmulatedCluster) -> None:
    host, port = cluster2.hub_ip, em.REDIS_PORT
    cluster2.stop_redis()
    assert not nn.can_connect(cluster2.node(1).netns, host, port, 0.3)
    cluster2.start_redis()
    out = py(cluster2, 1, """
        import os, redis
        print(redis.Redis.from_url(os.environ["INSTRIDE_REDIS_URL"], socket_timeout=5).ping())
    """)
    assert out.strip() == "True"


# ---------------------------------------------------------------------- node environment
def test_node_env(cluster2: EmulatedCluster) -> None:
    n2 = cluster2.node(2)
    assert n2.env["INSTRIDE_NODE"] == "node2"
    assert n2.env["INSTRIDE_ADDR"] == f"{n2.ip}:7437"
    assert n2.env["INSTRIDE_DIR"] == str(cluster2.base_dir / "node2")
    assert n2.env["INSTRIDE_TOKEN"] == cluster2.token
    assert n2.env["INSTRIDE_REDIS_URL"] == cluster2.redis_url
    assert n2.env["PATH"] == os.environ["PATH"]
    out = py(cluster2, 2, """
        import os, socket
        print(os.environ["INSTRIDE_NODE"], os.environ["INSTRIDE_DIR"], os.environ["INSTRIDE_ADDR"])
    """, env={"EXTRA": "1"})
    assert out.split() == ["node2", str(n2.dir), n2.env["INSTRIDE_ADDR"]]
    assert n2.env["UCX_POSIX_DIR"] == str(cluster2.ucx_dir) and cluster2.ucx_dir.is_dir()


def test_ucx_makes_its_segments_in_the_clusters_directory(cluster2: EmulatedCluster) -> None:
    """A UCX process on a node makes its shared-memory segments in the cluster's own
    directory (removed by ``down`` with anything a killed process left), not in ``/dev/shm``."""
    proc = cluster2.popen(2, [PY, "-m", "instride.transport.ucx"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("ready "), (line, proc.stderr.read() if proc.poll() else "")
        fds = Path(f"/proc/{proc.pid}/fd")
        held = [os.readlink(fd) for fd in fds.iterdir()]
        segments = [t for t in held if "ucx_shm_posix_" in t]
        assert segments, held
        assert all(t.startswith(f"{cluster2.ucx_dir}/") for t in segments), segments
    finally:
        proc.terminate()
        proc.communicate(timeout=15)
    assert proc.returncode == 0


#: The same producer and consumer programs run in local mode and in cluster mode.
PRODUCER = """
import instride
with instride.open("run1/frame_0.dat", "wb") as f:
    f.write(b"payload from " + instride.get_client().settings.node.encode())
print(instride.get_client().mode)
"""
CONSUMER = """
import instride
with instride.open("run1/frame_0.dat", timeout=20) as f:
    print(f.read().decode())
"""


def produce_consume(c: EmulatedCluster, producer: int, consumer: int) -> str:
    """Start the consumer first (it waits), then the producer; return what the consumer read."""
    cons = c.popen(consumer, [PY, "-c", CONSUMER], stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE, text=True)
    try:
        mode = py(c, producer, PRODUCER).strip()
        assert mode == ("cluster" if c.redis_url else "local")
        out, err = cons.communicate(timeout=30)
    finally:
        if cons.poll() is None:
            cons.kill()
            cons.communicate()
    assert cons.returncode == 0, err
    return out.strip()


def test_local_mode_producer_consumer_within_one_node(tmp_path: Path) -> None:
    with EmulatedCluster(nodes=1, name=unique(), base_dir=tmp_path / "b", serve=False,
                         redis=False) as c:
        assert "INSTRIDE_REDIS_URL" not in c.node(1).env
        assert produce_consume(c, 1, 1) == "payload from node1"
        assert (c.node(1).dir / "run1" / "frame_0.dat").read_bytes() == b"payload from node1"


# ---------------------------------------------------------------------- data servers
def test_data_servers_listen_and_restart(tmp_path: Path) -> None:
    """Needs `python -m instride serve` (src/instride/server.py, cli_serve.py)."""
    with EmulatedCluster(nodes=2, name=unique(), base_dir=tmp_path / "b") as c:
        info = c.status()
        assert [n["server"]["listening"] for n in info["nodes"]] == [True, True]
        c.stop_server(1)
        assert not nn.can_connect(c.node(2).netns, c.node(1).ip, em.SERVER_PORT, 0.3)
        assert nn.can_connect(c.node(1).netns, c.node(2).ip, em.SERVER_PORT, 0.5)
        c.start_server(1)
        assert nn.can_connect(c.node(2).netns, c.node(1).ip, em.SERVER_PORT, 0.5)
        # the unchanged local-mode programs, now across nodes: node 2 pulls from node 1
        assert produce_consume(c, 1, 2) == "payload from node1"
        assert (c.node(2).dir / "run1" / "frame_0.dat").read_bytes() == b"payload from node1"
        pids = [c._pids[n.name][0] for n in c.nodes]
    assert not any(em._alive(pid, None) for pid in pids)
    assert leftovers(c) == []


def test_a_sigterm_inside_the_with_block_takes_the_cluster_down() -> None:
    # `timeout`, a batch system or a stopped CI job ends a benchmark with SIGTERM: by default
    # that ended the process at once and left the namespaces, Redis and the data servers up.
    # Now every cluster inside a with-block (nested ones too) is taken down first, and the
    # process still dies of the signal (a program that swallows exceptions cannot keep it).
    import signal

    code = textwrap.dedent(
        """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (whatever the parent had)
        from instride.emulate import EmulatedCluster
        with EmulatedCluster(nodes=2) as a, EmulatedCluster(nodes=1) as b:
            print(a.name, a.prefix, b.name, b.prefix, flush=True)
            while True:
                try:
                    time.sleep(120)
                except BaseException:  # (swallowed: the signal must still end it)
                    pass
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    names: list[str] = []
    try:
        assert proc.stdout is not None
        got = proc.stdout.readline().split()
        names, prefixes = got[0::2], got[1::2]
        assert len(names) == 2 and all(em.state_path(n).exists() for n in names)
        assert all(any(ns.startswith(p) for ns in nn.list_netns()) for p in prefixes)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == -signal.SIGTERM  # (died of it)
        assert not any(em.state_path(n).exists() for n in names)
        assert not [ns for ns in nn.list_netns() if ns.startswith(tuple(prefixes))]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for n in names:  # (failed: not left behind either)
            if em.state_path(n).exists():
                EmulatedCluster.attach(n).down()


def test_two_sigterms_during_cluster_up_still_remove_everything() -> None:
    """`instride cluster up` stopped by SIGTERM while it starts, and again while it takes down
    what it made: the second one waits for the teardown (it used to interrupt it, leaving
    namespaces, the state file and directories behind)."""
    import signal
    import time

    name = f"t2s{secrets.token_hex(2)}"
    proc = subprocess.Popen([sys.executable, "-m", "instride", "cluster", "up", "-n", "8",
                             "--name", name], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while not em.state_path(name).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        prefix = json.loads(em.state_path(name).read_text())["prefix"]
        time.sleep(0.3)  # (namespaces being made)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # (during the teardown)
        _, err = proc.communicate(timeout=120)
        # (stopped before it was up, after its teardown: 143; or, when the teardown was over
        # before the second signal came, killed by it as the command ended: nothing left)
        assert proc.returncode in (143, -signal.SIGTERM), err
        assert not em.state_path(name).exists()
        assert not [ns for ns in nn.list_netns() if ns.startswith(prefix)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if em.state_path(name).exists():
            EmulatedCluster.attach(name).down()


def test_a_with_block_leaves_sigterm_as_it_found_it() -> None:
    # the handler is installed for the with-blocks only: the default comes back after the
    # last, and a handler the program had set is never replaced (in a fresh interpreter: this
    # module's fixtures hold clusters of their own)
    code = textwrap.dedent(
        """
        import signal
        from instride.emulate import EmulatedCluster
        from instride.emulate import teardown as em
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        with EmulatedCluster(nodes=1, serve=False, redis=False):
            assert signal.getsignal(signal.SIGTERM) is em._unwind
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and em._LIVE == []

        def mine(signum, frame):
            raise AssertionError("not expected")

        signal.signal(signal.SIGTERM, mine)
        with EmulatedCluster(nodes=1, serve=False, redis=False):
            assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGTERM) is mine
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_an_incomplete_state_file_is_reported_not_a_traceback() -> None:
    """A state file cut short or not written by instride (valid JSON, fields missing): `status`
    and `down` report it and go on (they died with a KeyError)."""
    name = f"cut{secrets.token_hex(2)}"
    path = em.state_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"name": name}))
    try:
        with pytest.raises(ClusterError, match="corrupt state file"):
            EmulatedCluster.attach(name)
        for args in (["status"], ["down", "--name", name]):
            proc = subprocess.run([sys.executable, "-m", "instride", "cluster", *args],
                                  capture_output=True, text=True, timeout=60)
            assert "corrupt state file" in proc.stdout + proc.stderr, proc
            assert "Traceback" not in proc.stderr
    finally:
        path.unlink(missing_ok=True)


def test_a_stray_file_of_the_state_directory_is_reported_the_others_listed() -> None:
    """A file of the state directory whose name is no cluster's (`bad name.json`): its
    name's check raised ConfigError, which `status` and `down --all` did not take for a
    corrupt state file: the command stopped (status 2) and skipped every other cluster."""
    path = em.state_path("x").parent / f"bad name {secrets.token_hex(2)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{}")
    c = EmulatedCluster(nodes=1, name=unique(), serve=False, redis=False).up()
    try:
        proc = subprocess.run([sys.executable, "-m", "instride", "cluster", "status"],
                              capture_output=True, text=True, timeout=60)
        assert c.name in proc.stdout and "bad name" in proc.stderr, proc
        assert "Traceback" not in proc.stderr
    finally:
        c.down()
        path.unlink(missing_ok=True)


def test_down_leaves_a_newer_cluster_of_the_same_name_alone() -> None:
    """A cluster destroyed from another process, its name then taken by a new cluster: the
    first one's down() (its with-block ending) used to delete the new one's namespaces and
    state file. Only what is still its own goes."""
    name = f"own{secrets.token_hex(2)}"
    first = EmulatedCluster(nodes=1, name=name, serve=False, redis=False).up()
    second = None
    try:
        assert EmulatedCluster.destroy(name)
        second = EmulatedCluster(nodes=1, name=name, serve=False, redis=False).up()
        first.down()
        assert em.state_path(name).exists()
        assert second.hub in nn.list_netns()
        assert EmulatedCluster.attach(name).status()["status"] == "up"
    finally:
        first.down()
        if second is not None:
            second.down()
    assert not em.state_path(name).exists()
    assert not [ns for ns in nn.list_netns() if ns.startswith(first.prefix)]


def test_signals_held_notes_them_without_masking() -> None:
    """A teardown's held SIGTERM: noted, not masked (a mask held only the main thread, and the
    programs started meanwhile inherited it), and sent again after the block."""
    import signal

    from instride.emulate.teardown import signals_held

    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        with signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            assert got == []  # (held)
            blocked = subprocess.run(["grep", "SigBlk", "/proc/self/status"],
                                     capture_output=True, text=True, check=True).stdout
            assert int(blocked.split()[1], 16) == 0, blocked  # (a child blocks nothing)
        assert got == [signal.SIGTERM]  # (delivered after it, to the program's handler)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_signals_held_holds_sighup_too() -> None:
    """The `instride` command raises SIGHUP (a closed terminal) as an exception too: it cut a
    cluster's teardown short (servers or namespaces left, exit 129) as it was not held."""
    import signal

    from instride.emulate.teardown import signals_held

    got: list[int] = []
    previous = signal.signal(signal.SIGHUP, lambda signum, frame: got.append(signum))
    try:
        with signals_held():
            os.kill(os.getpid(), signal.SIGHUP)
            assert got == []  # (held)
        assert got == [signal.SIGHUP]  # (delivered after it, to the program's handler)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        with signals_held():  # (an ignored one stays ignored: the programs started inherit it)
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
