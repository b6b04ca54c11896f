"""``instride analyze`` and ``instride export`` as a user runs them (real processes, real MPI)."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from .conftest import AdkData, instride_cmd, mpiexec, run


def _rmsd_csv(path: Path) -> tuple[list[str], np.ndarray]:
    with open(path) as fh:
        rows = list(csv.reader(fh))
    return rows[0], np.array([float(r[rows[0].index("rmsd")]) for r in rows[1:]])


def test_cli_multiprocessing_csv_and_report(adk: AdkData, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run(instride_cmd("analyze", "rmsd", "--topology", adk.psf, "--trajectory", adk.dcd,
                            "--workers", "2", "--backend", "multiprocessing",
                            "--baseline-serial", "--out", str(out)))
    assert proc.returncode == 0, proc.stderr
    header, rmsd = _rmsd_csv(out / "rmsd.csv")
    assert header == ["frame", "time", "rmsd"]
    np.testing.assert_allclose(rmsd, adk.rmsd[:, 2], rtol=0, atol=1e-5)
    report = json.loads((out / "timing.json").read_text())
    assert report["n_ranks"] == 2 and report["baseline"] is not None
    assert report["speedup"] > 0 and report["efficiency"] == report["speedup"] / 2
    assert report["r_comp_io"] > 0 and report["r_comp_io_source"] == "serial run"
    assert (out / "timing.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "S(2) =" in proc.stdout and "R_comp/IO" in proc.stdout


def test_cli_under_mpiexec_stream(adk: AdkData, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run([mpiexec(), "-n", "2", *instride_cmd(
        "analyze", "rmsd", "--topology", adk.psf, "--trajectory", "instride://adk",
        "--backend", "mpi", "--timeout", "60", "--out", str(out), "--no-plot")])
    assert proc.returncode == 0, proc.stderr
    _, rmsd = _rmsd_csv(out / "rmsd.csv")
    assert np.array_equal(rmsd, adk.rmsd[:, 2])  # repr() round-trips float64 exactly
    report = json.loads((out / "timing.json").read_text())
    assert report["backend"] == "mpi" and report["n_ranks"] == 2 and report["source"] == "stream"
    assert proc.stdout.count("t_total (max t_N)") == 1  # only rank 0 reports


def test_cli_mpi_self_launch_flags_injected_straggler(adk: AdkData, tmp_path: Path) -> None:
    """--backend mpi without a launcher starts mpiexec itself; rank 1 slowed on purpose."""
    out = tmp_path / "out"
    proc = run(instride_cmd("analyze", "rmsd", "--topology", adk.psf, "--trajectory", adk.h5,
                            "--backend", "mpi", "--workers", "2", "--straggle", "1:0.05",
                            "--out", str(out)))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "timing.json").read_text())
    assert report["backend"] == "mpi" and report["n_ranks"] == 2
    assert report["stragglers"] == [1], proc.stdout
    assert report["straggle_injected"] == {"1": 0.05}
    slow, fast = report["ranks"][1], report["ranks"][0]
    assert slow["t_comp"] >= 49 * 0.05
    assert fast["t_wait"] > slow["t_wait"]  # rank 0 waited for the straggler at the barrier
    assert "STRAGGLER" in proc.stdout
    assert (out / "timing.png").exists()


def test_cli_export_h5md_readable_by_mdanalysis(adk: AdkData, tmp_path: Path) -> None:
    import MDAnalysis as mda

    from instride.parallel.h5md import register_h5_extension

    out = tmp_path / "out.h5"
    proc = run(instride_cmd("export", "--h5md", "adk", str(out), "--timeout", "60", "--quiet"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    ref = mda.Universe(adk.psf, adk.dcd)
    register_h5_extension()  # MDAnalysis maps only *.h5md to its H5MD reader by extension
    for u in (mda.Universe(adk.psf, str(out)),
              mda.Universe(adk.psf, str(out), format="H5MD")):  # plain MDAnalysis
        assert u.trajectory.n_frames == adk.n_frames
        for ts, ts_ref in zip(u.trajectory, ref.trajectory, strict=True):
            assert np.array_equal(ts.positions, ts_ref.positions)
            assert ts.time == ts_ref.time
            assert ts.dimensions is None
    # exporting again refuses to overwrite
    again = run(instride_cmd("export", "--h5md", "adk", str(out), "--quiet"))
    assert again.returncode == 4 and "exists" in again.stderr  # invalid input


def test_cli_bad_input_exit_code(adk: AdkData, tmp_path: Path) -> None:
    proc = run(instride_cmd("analyze", "rmsd", "--topology", adk.psf, "--trajectory",
                            str(tmp_path / "missing.dcd"), "--out", str(tmp_path / "o")))
    assert proc.returncode == 4  # invalid input
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def _children(pid: int) -> list[int]:
    """The PIDs of ``pid``'s children (``/proc``)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def _gone(pids: list[int], within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [p for p in pids if Path(f"/proc/{p}").exists()
                 and Path(f"/proc/{p}/stat").read_text().split(") ")[1][0] != "Z"]
        if not alive:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize(("backend", "sig"), [
    (["--workers", "2"], signal.SIGTERM),
    (["--workers", "2"], signal.SIGKILL),
    (["--backend", "mpi", "--workers", "2"], signal.SIGTERM),
])
def test_a_stopped_analyze_stops_what_it_started(adk: AdkData, tmp_path: Path,
                                                 backend: list[str], sig: int) -> None:
    """SIGTERM to `instride analyze` (a batch system cancelling it) stops the processes it
    started — the pool's workers, a self-launched mpiexec and its ranks — and exits 143, at
    once, not after their blocks; SIGKILL takes the workers along too. They used to run on
    (workers blocked for ever on a pipe nobody read, ranks writing the output for nobody)."""
    # (1 s of extra work per frame on each rank: ~50 s per block of 49 frames)
    proc = subprocess.Popen(instride_cmd(
        "analyze", "rmsd", "--topology", adk.psf, "--trajectory", adk.dcd, "--straggle", "0:1",
        "--straggle", "1:1", "--out", str(tmp_path / "o"), "--no-plot", *backend),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        family: list[int] = []
        while time.monotonic() < deadline:  # (the workers, or mpiexec and its ranks, started)
            family = _children(proc.pid)
            family += [g for c in family for g in _children(c)]
            if len(family) >= 2:
                break
            time.sleep(0.1)
        assert len(family) >= 2, family
        time.sleep(1.0)  # (at work)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=20)  # (well before the blocks' ~50 s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == (143 if sig == signal.SIGTERM else -sig), err
    assert _gone(family, within=15), family
    assert not (tmp_path / "o").exists()
