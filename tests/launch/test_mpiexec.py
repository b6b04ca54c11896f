"""``instride job --hostfile``: the services started with a real ``mpiexec`` (MPICH's Hydra).

The hosts are the emulated Slurm nodes, reached through an ``ssh`` stand-in that enters a
node's namespace under its host name (what ``ssh`` does on a real cluster); Slurm itself is
not used. MPI ranks (mpi4py) on two nodes exchange a file through instride.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from instride.emulate.slurm import EmulatedSlurm
from instride.launch import LaunchError, NoAllocationError, services
from instride.launch.mpiexec import read_hostfile

from .conftest import PY, settle, tree


def test_read_hostfile_mpich_and_openmpi_forms(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("# the job's hosts\nnode1:4\nnode2 slots=8\n\nnode1\n10.0.0.3  # comment\n")
    assert read_hostfile(path) == ["node1", "node2", "10.0.0.3"]
    path.write_text("# nothing\n")
    with pytest.raises(NoAllocationError, match="lists no host"):
        read_hostfile(path)
    with pytest.raises(NoAllocationError, match="cannot read host file"):
        read_hostfile(tmp_path / "missing")


def test_two_names_of_one_machine_are_refused(tmp_path: Path) -> None:
    """``localhost`` and ``127.0.0.1`` in one host file: refused before anything starts (two
    services on one machine collided on its managed directory, with a misleading error)."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost\n127.0.0.1\n")
    svc = services("mpiexec", hostfile=hosts, mpiexec=str(Path(PY).parent / "mpiexec"))
    with pytest.raises(LaunchError, match="hosts 'localhost' and '127.0.0.1' .* are one machine"):
        svc.detect()


def test_slurm_no_allocation_is_a_clear_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    with pytest.raises(NoAllocationError, match="no allocation"):
        services(env=env)
    with pytest.raises(NoAllocationError, match="SLURM_JOB_ID is not set"):
        services("slurm", env=env).up()
    proc = subprocess.run([PY, "-m", "instride", "job", "--", "true"], env=env,
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2
    assert "no allocation" in proc.stderr


def test_failed_start_leaves_no_launcher_files(tmp_path: Path) -> None:
    """A start that fails after the launcher made its temporary directory (Redis given but
    unreachable) removes it."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "INSTRIDE_"))}
    env.update(TMPDIR=str(temp), INSTRIDE_REDIS_URL="redis://127.0.0.1:1/0",
               INSTRIDE_JOB_STATE_DIR=str(tmp_path / "states"))
    proc = subprocess.run([PY, "-m", "instride", "job", "--hostfile", str(hosts),
                           "--mpiexec", str(Path(PY).parent / "mpiexec"), "--", "true"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 6, proc.stderr
    assert "metadata service redis://127.0.0.1:1/0 unavailable" in proc.stderr
    assert list(temp.iterdir()) == []  # the launcher's instride-job<id>-* directory went
    assert not (tmp_path / "states").exists()


@pytest.mark.root
def test_mpiexec_hostfile_on_emulated_slurm_nodes(
    slurm: EmulatedSlurm, tmp_path: Path, scratch: Path
) -> None:
    states = tmp_path / "states"
    hosts = tmp_path / "hosts"
    hosts.write_text(f"{slurm.node(1).ip}\n{slurm.node(2).ip}:4\n")
    rank = tmp_path / "rank.py"
    rank.write_text(textwrap.dedent("""
        import os, instride
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        if comm.rank == 0:
            with instride.open("r/k", "wb") as f:
                f.write(("from-" + os.environ["INSTRIDE_NODE"]).encode())
        comm.Barrier()
        data = instride.open("r/k", timeout=30).read().decode()
        print("rank", comm.rank, os.environ["INSTRIDE_NODE"], data, flush=True)
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "INSTRIDE_"))}
    # SLURMD_NODENAME as inside a Slurm job: mpiexec forwards it to every rank (and agent),
    # where it names the wrong node; neither the agents nor $INSTRIDE_NODE_ENV trust it.
    env.update(HYDRA_LAUNCHER="ssh", HYDRA_LAUNCHER_EXEC=str(slurm.ssh_script()),
               HYDRA_IFACE="eth0", INSTRIDE_JOB_STATE_DIR=str(states), SLURMD_NODENAME="node1")
    mpiexec = Path(PY).parent / "mpiexec"
    cmd = [PY, "-m", "instride", "job", "--hostfile", str(hosts),
           "--dir", f"{scratch}/%n/job%j", "--", "sh", "-c",
           f'{mpiexec} -f {hosts} -ppn 1 -n 2 "$INSTRIDE_NODE_ENV" {PY} {rank}']
    proc = subprocess.run(slurm.node_command(1, cmd), env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "services up on 2 node(s)" in proc.stderr
    assert sorted(proc.stdout.split("\n"))[1:] == ["rank 0 node1 from-node1",
                                                  "rank 1 node2 from-node1"]
    assert settle(slurm) == {}
    assert tree(scratch) == []
    assert tree(states) == []
