"""GROMACS, unmodified, as a producer: gmx mdrun --IMD--> instride imd-bridge --> stream,
compared with the .trr mdrun writes in the same run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import MDAnalysis as mda
import numpy as np
import pytest

import instride
from instride.md.imd_bridge import EngineUnavailable, IMDProtocolError, bridge, natoms_from_gro
from tests.conftest import finish, free_port

NSTEPS, NSTXOUT = 40, 10

MDP = f"""
integrator = md
dt = 0.002
nsteps = {NSTEPS}
nstxout = {NSTXOUT}
nstvout = 0
nstfout = 0
nstenergy = 0
nstlog = 0
nstcalcenergy = 10
cutoff-scheme = Verlet
coulombtype = PME
rcoulomb = 1.0
rvdw = 1.0
tcoupl = v-rescale
tc-grps = System
tau-t = 0.1
ref-t = 300
gen-vel = yes
gen-temp = 300
gen-seed = 7
IMD-group = System
"""
# gmx solvate tiles spc216.gro into the box, leaving close contacts at the seams: minimize first
EM_MDP = """
integrator = steep
nsteps = 200
emtol = 500
cutoff-scheme = Verlet
coulombtype = PME
rcoulomb = 1.0
rvdw = 1.0
"""


def _gmx() -> str:
    exe = shutil.which("gmx")
    if exe is None:
        raise RuntimeError("GROMACS is not installed: `make test` installs it (apt-get install gromacs)")
    return exe


@pytest.fixture(scope="module")
def water_box(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3 nm SPC/E water box (gmx solvate) and its run input md.tpr (IMD-group = System)."""
    gmx = _gmx()
    d = tmp_path_factory.mktemp("gmx")
    subprocess.run([gmx, "-quiet", "solvate", "-cs", "spc216.gro", "-box", "3", "3", "3",
                    "-o", "box.gro"], cwd=d, check=True, capture_output=True)
    natoms = natoms_from_gro(d / "box.gro")
    (d / "topol.top").write_text(
        '#include "oplsaa.ff/forcefield.itp"\n#include "oplsaa.ff/spce.itp"\n'
        f"[ system ]\nwater\n[ molecules ]\nSOL {natoms // 3}\n"
    )
    (d / "em.mdp").write_text(EM_MDP)
    (d / "md.mdp").write_text(MDP)
    for cmd in (
        ["grompp", "-f", "em.mdp", "-c", "box.gro", "-p", "topol.top", "-o", "em.tpr"],
        ["mdrun", "-s", "em.tpr", "-deffnm", "em", "-nt", "1"],
        ["grompp", "-f", "md.mdp", "-c", "em.gro", "-p", "topol.top", "-o", "md.tpr"],
    ):
        subprocess.run([gmx, "-quiet", *cmd, *(["-maxwarn", "2"] if cmd[0] == "grompp" else [])],
                       cwd=d, check=True, capture_output=True)
    return d


def _mdrun(d: Path, port: int, name: str) -> subprocess.Popen:
    return subprocess.Popen(
        [_gmx(), "-quiet", "mdrun", "-s", "md.tpr", "-deffnm", name, "-imdport", str(port),
         "-imdwait", "-imdterm", "-nt", "1"],
        cwd=d, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


@pytest.mark.slow
def test_gromacs_imd_bridge_end_to_end(managed_dir: Path, water_box: Path) -> None:
    natoms = natoms_from_gro(water_box / "box.gro")
    port = free_port()
    bridge_proc = subprocess.Popen(
        [sys.executable, "-m", "instride", "imd-bridge", f"127.0.0.1:{port}", "gmx/water",
         "--gro", str(water_box / "box.gro"), "--dt", "0.002", "--connect-timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    mdrun = _mdrun(water_box, port, "run1")
    try:
        frames = []
        for frame in instride.Stream("gmx/water", timeout=120):  # consumed while mdrun runs
            frames.append((frame.step, frame.time, np.array(frame.positions)))
        rc, out, err = finish(bridge_proc, timeout=60)
        assert rc == 0, err
        assert f"{NSTEPS + 1} frames" in out and "IMD v2" in out
        assert mdrun.wait(60) == 0
    finally:
        _stop(bridge_proc)
        _stop(mdrun)
    # GROMACS sends every step, 0..NSTEPS, with all atoms of the IMD group
    assert [s for s, _, _ in frames] == list(range(NSTEPS + 1))
    assert all(p.shape == (natoms, 3) for _, _, p in frames)
    assert frames[10][1] == pytest.approx(0.02)
    # the positions are in Å and equal to the .trr frames mdrun wrote at the same steps
    trr = mda.Universe(str(water_box / "box.gro"), str(water_box / "run1.trr"))
    assert len(trr.trajectory) == NSTEPS // NSTXOUT + 1
    worst = 0.0
    for ts in trr.trajectory:
        step = int(ts.data["step"])
        np.testing.assert_allclose(frames[step][2], trr.atoms.positions, atol=1e-4)
        worst = max(worst, float(np.abs(frames[step][2] - trr.atoms.positions).max()))
    print(f"GROMACS v2 via imd-bridge vs trr: max |diff| positions {worst:.2g} A")


@pytest.mark.slow
def test_wrong_atom_count_is_a_protocol_error_and_no_end_of_stream(
    managed_dir: Path, water_box: Path
) -> None:
    port = free_port()
    mdrun = _mdrun(water_box, port, "run2")
    try:
        with pytest.raises(IMDProtocolError, match="natoms=10"):
            bridge(f"127.0.0.1:{port}", "gmx/bad", 10, connect_timeout=60, timeout=60)
        assert not instride.Stream("gmx/bad").ended
    finally:
        _stop(mdrun)


def test_no_engine_is_engine_unavailable(managed_dir: Path) -> None:
    with pytest.raises(EngineUnavailable, match="no IMD engine"):
        bridge(f"127.0.0.1:{free_port()}", "nobody", 100, connect_timeout=0.3)
    assert not instride.Stream("nobody").ended
    with pytest.raises(instride.ConfigError):
        bridge("localhost", "nobody", 100)
    with pytest.raises(instride.ConfigError, match="natoms"):
        bridge("localhost:1", "nobody", 0)


def test_natoms_from_gro(tmp_path: Path) -> None:
    (tmp_path / "a.gro").write_text("title\n 2652\n")
    assert natoms_from_gro(tmp_path / "a.gro") == 2652
    (tmp_path / "b.gro").write_text("title\nnot a number\n")
    with pytest.raises(ValueError, match="atom count"):
        natoms_from_gro(tmp_path / "b.gro")
