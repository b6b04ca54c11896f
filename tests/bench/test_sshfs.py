"""The sshfs ``sharedfs``: a storage server on the emulated network, mounted on every node.

Real sshd, real sshfs (FUSE), real network namespaces, real MPI ranks. The runs check that every
frame arrives intact *and* that its bytes crossed the storage server's network interface; the
tear-down tests check that no mount, process, namespace or key survives a run, a failed run or
a failed start.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from instride.bench import sshfs
from instride.bench.backends import make_backend
from instride.bench.molecules import BenchConfigError
from instride.bench.workflow_run import BenchRunError, RunConfig, run
from instride.emulate import EmulatedCluster
from instride.emulate import netns as nn

pytestmark = pytest.mark.root

FRAMES = 4
PAIRS = 2
ATOMS = 500
FRAME_BYTES = 128 + 28 * ATOMS


def _require() -> None:
    lacking = sshfs.missing()
    if not (shutil.which("ip") or os.path.exists("/usr/sbin/ip")):
        lacking.append("iproute2 (ip)")
    if lacking:
        raise RuntimeError(f"the sshfs sharedfs tests need {', '.join(lacking)} "
                           "(apt-get install sshfs openssh-server iproute2; run as root)")


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmulatedCluster]:
    """Two emulated nodes without data servers or Redis (sharedfs needs neither)."""
    _require()
    with EmulatedCluster(nodes=2, serve=False, redis=False) as c:
        yield c


def _eth0_bytes(netns: str) -> tuple[int, int]:
    """(received, sent) bytes of ``eth0`` in ``netns``."""
    info = json.loads(nn.ip("-j", "-s", "-n", netns, "link", "show", "eth0").stdout)[0]
    return info["stats64"]["rx"]["bytes"], info["stats64"]["tx"]["bytes"]


def _sshfs_mounts() -> set[str]:
    with open("/proc/self/mountinfo") as fh:
        return {line.split()[4] for line in fh if " - fuse.sshfs " in line}


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text.encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def _assert_gone(storage_ip: str, netns: str, run_dirs: list[Path]) -> None:
    assert not nn.netns_exists(netns)
    assert _processes_mentioning(f"root@{storage_ip}:") == []  # no sshfs left
    for run_dir in run_dirs:
        assert not any(m.startswith(str(run_dir)) for m in _sshfs_mounts())
        assert not run_dir.exists()  # keys, config, export, mount points
        assert _processes_mentioning(str(run_dir / "sshd_config")) == []  # no sshd left


def _config(**kw) -> RunConfig:
    base = dict(atoms=ATOMS, frames=FRAMES, pairs=PAIRS, nodes=2, backend="sharedfs",
                sharedfs_kind="sshfs", time_scale=0.005, timeout=60.0)
    base.update(kw)
    return RunConfig(**base)


def test_every_frame_crosses_the_network(cluster: EmulatedCluster, tmp_path: Path) -> None:
    with sshfs.SshfsStorage(cluster) as storage:
        rx0, tx0 = _eth0_bytes(storage.netns)
        out = tmp_path / "out"
        summary = run(_config(), out, cluster=cluster, storage=storage, progress=False)
        rx1, tx1 = _eth0_bytes(storage.netns)
        # every frame arrived intact (the consumers verify checksums, steps and atom counts)
        assert summary["frames"] == {"expected": PAIRS * FRAMES, "verified": PAIRS * FRAMES}
        assert summary["config"]["sharedfs_mount"] == "sshfs"
        # each rank went through its own node's mount of the storage server
        spec = json.loads((out / "raw" / "rep0" / "spec.json").read_text())
        assert spec["root"] == f"{storage.mount_template}/bench"
        assert spec["placement"] == ["node1"] * PAIRS + ["node2"] * PAIRS
        # the frames' bytes crossed the storage server's network interface both ways
        total = PAIRS * FRAMES * FRAME_BYTES
        assert rx1 - rx0 >= total  # producers' writes
        assert tx1 - tx0 >= total  # consumers' reads
        # the run removed its directory from the storage server
        assert list((storage.export / "bench").iterdir()) == []
        netns, ip, run_dir = storage.netns, storage.ip, storage.run_dir
    _assert_gone(ip, netns, [run_dir])


def test_run_sets_up_and_tears_down_its_own_storage(cluster: EmulatedCluster,
                                                    tmp_path: Path) -> None:
    before = set(Path("/dev/shm").glob("instride-sshfs-*"))
    summary = run(_config(pairs=1), tmp_path / "out", cluster=cluster, progress=False)
    assert summary["frames"]["verified"] == FRAMES
    spec = json.loads((tmp_path / "out" / "raw" / "rep0" / "spec.json").read_text())
    run_dir = Path(spec["root"]).parents[2]  # <run dir>/mnt/{node}/bench
    assert run_dir.name.startswith("instride-sshfs-") and run_dir not in before
    storage = sshfs.SshfsStorage(cluster)
    _assert_gone(storage.ip, storage.netns, [run_dir])


def test_failed_run_tears_down(cluster: EmulatedCluster, tmp_path: Path) -> None:
    storage = sshfs.SshfsStorage(cluster)
    before = set(Path("/dev/shm").glob("instride-sshfs-*"))
    # the consumer's first barrier waits a whole frame period (41 ms) for the producer:
    # a 5 ms timeout fails the run in its ranks
    with pytest.raises(BenchRunError):
        run(_config(pairs=1, frames=2, time_scale=0.05, timeout=0.005), tmp_path / "out",
            cluster=cluster, progress=False)
    new = sorted(set(Path("/dev/shm").glob("instride-sshfs-*")) - before)
    _assert_gone(storage.ip, storage.netns, new)
    assert new == []


def test_failed_start_tears_down(cluster: EmulatedCluster, monkeypatch: pytest.MonkeyPatch
                                 ) -> None:
    # sshd starts and listens, then the first sshfs refuses to mount: up() must undo it all
    monkeypatch.setattr(sshfs, "MOUNT_OPTIONS", (*sshfs.MOUNT_OPTIONS, "no_such_option"))
    storage = sshfs.SshfsStorage(cluster)
    with pytest.raises(sshfs.SharedFsError, match="sshd|sshfs"):
        storage.up()
    _assert_gone(storage.ip, storage.netns, [storage.run_dir])
    assert storage.pids == {}


def test_no_stale_reads_across_nodes(cluster: EmulatedCluster) -> None:
    """What node 1 writes (rewrites, deletes) node 2 sees at once: no cache hides it."""
    code = (
        "import os, sys\n"
        "op, path = sys.argv[1], sys.argv[2]\n"
        "if op == 'write':\n"
        "    with open(path, 'wb') as fh: fh.write(sys.argv[3].encode() * 4096)\n"
        "elif op == 'read':\n"
        "    print(open(path, 'rb').read()[:1].decode(), os.path.getsize(path))\n"
        "elif op == 'exists':\n"
        "    print(os.path.exists(path), sorted(os.listdir(os.path.dirname(path))))\n"
        "elif op == 'rm':\n"
        "    os.unlink(path)\n"
    )

    def on(node: int, *args: str) -> str:
        res = cluster.run(node, [sys.executable, "-c", code, *args], capture_output=True,
                          text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        return res.stdout.strip()

    with sshfs.SshfsStorage(cluster) as storage:
        p1, p2 = storage.mountpoint(1) / "f", storage.mountpoint(2) / "f"
        assert on(2, "exists", str(p2)) == "False []"  # node 2 looks first (negative entry)
        on(1, "write", str(p1), "a")
        assert on(2, "exists", str(p2)) == "True ['f']"
        assert on(2, "read", str(p2)) == "a 4096"
        on(1, "write", str(p1), "b")  # same size, new content
        assert on(2, "read", str(p2)) == "b 4096"
        on(1, "write", str(p1), "cc")  # new size
        assert on(2, "read", str(p2)) == "c 8192"
        on(1, "rm", str(p1))
        assert on(2, "exists", str(p2)) == "False []"
        assert (storage.export / "f").exists() is False


def test_bad_settings() -> None:
    with pytest.raises(BenchConfigError, match="nodes >= 2"):
        RunConfig(backend="sharedfs", nodes=1, sharedfs_kind="sshfs").validate()
    with pytest.raises(BenchConfigError, match="sharedfs_kind"):
        RunConfig(backend="sharedfs", nodes=2, sharedfs_kind="nfs").validate()
    assert RunConfig(backend="sharedfs", nodes=2).sharedfs_mount() == "sshfs"
    assert RunConfig(backend="sharedfs", nodes=1).sharedfs_mount() == "dir"
    assert RunConfig(backend="sharedfs", nodes=2, sharedfs_kind="dir").name.startswith(
        "sharedfs_dir-")


def test_per_node_root_needs_a_node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("INSTRIDE_NODE", raising=False)
    with pytest.raises(BenchConfigError, match="INSTRIDE_NODE"):
        make_backend("sharedfs", str(tmp_path / "{node}"))
    monkeypatch.setenv("INSTRIDE_NODE", "node2")
    assert make_backend("sharedfs", str(tmp_path / "{node}")).root == tmp_path / "node2"
