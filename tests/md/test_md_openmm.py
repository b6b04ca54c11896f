"""OpenMM producer -> instride stream -> analytics consumer in another process, checked
against MDAnalysis on the DCD file OpenMM wrote from the same states."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import MDAnalysis as mda
import numpy as np
import pytest
from MDAnalysis.analysis import rms
from openmm.app import DCDReporter

import instride
from instride.analytics import VILLIN_SUBSTRUCTURES, largest_eigenvalue, read_table
from instride.md.openmm import FrameReporter, make_simulation, villin_pdb
from tests.conftest import files_held, finish

STEPS, INTERVAL = 150, 10

CONSUMER = textwrap.dedent(
    """
    import sys, warnings
    warnings.filterwarnings("ignore")
    from instride.analytics import analyze_stream, VILLIN_SUBSTRUCTURES
    from instride.md.openmm import villin_pdb
    print("waiting", flush=True)
    r = analyze_stream(villin_pdb(), sys.argv[1], sys.argv[2], timeout=120,
                       substructures=VILLIN_SUBSTRUCTURES)
    print(r.frames, r.wait_seconds, flush=True)
    """
)


@pytest.mark.slow
def test_openmm_stream_analysed_concurrently_matches_dcd(
    managed_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "analytics"
    consumer = subprocess.Popen(
        [sys.executable, "-c", CONSUMER, "villin", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        assert consumer.stdout.readline().strip() == b"waiting"  # consumer first
        simulation = make_simulation(seed=7, threads=1)
        dcd = tmp_path / "villin.dcd"
        reporter = FrameReporter("villin", INTERVAL)
        protein = FrameReporter("villin-protein", 50, atom_indices=np.arange(584))
        with reporter, protein:
            simulation.reporters += [reporter, protein, DCDReporter(str(dcd), INTERVAL)]
            simulation.step(STEPS)
            assert consumer.poll() is None  # analysing while the simulation runs
        simulation.reporters.clear()
        rc, stdout, err = finish(consumer, timeout=120)
    finally:
        if consumer.poll() is None:
            consumer.kill()
            consumer.communicate()
    assert rc == 0, err
    nframes = STEPS // INTERVAL
    assert int(stdout.split()[-2]) == nframes
    assert reporter.frames == nframes and reporter.publish_seconds > 0
    assert reporter.bytes == nframes * instride.frames.frame_size(8867)

    table = read_table(out / "analytics.csv")
    np.testing.assert_array_equal(table["step"], INTERVAL * np.arange(1, nframes + 1))
    np.testing.assert_allclose(table["time_ps"], 0.002 * table["step"], rtol=1e-9)

    u = mda.Universe(str(villin_pdb()), str(dcd))
    assert len(u.trajectory) == nframes
    want = rms.RMSD(u, select="protein and name CA").run().results.rmsd[:, 2]
    np.testing.assert_allclose(table["rmsd"], want, atol=1e-4)
    protein_atoms = u.select_atoms("protein")
    rgyr, lam = [], {name: [] for name in VILLIN_SUBSTRUCTURES}
    for _ in u.trajectory:
        rgyr.append(protein_atoms.radius_of_gyration())
        for name, sel in VILLIN_SUBSTRUCTURES.items():
            lam[name].append(largest_eigenvalue(u.select_atoms(sel).positions))
    np.testing.assert_allclose(table["rgyr"], rgyr, atol=1e-4)
    np.testing.assert_allclose(table["lambda_H1_H3"], lam["H1-H3"], atol=1e-3)
    np.testing.assert_allclose(table["lambda_H2"], lam["H2"], atol=1e-3)
    for png in ("rmsd", "rgyr", "lambda_H1_H2", "lambda_H1_H3"):
        assert (out / f"{png}.png").stat().st_size > 1000

    # positions, box and the atom subset against the DCD, frame by frame
    stream = instride.Stream("villin")
    sub = instride.Stream("villin-protein")
    assert stream.ended and len(sub) == STEPS // 50
    for i, ts in enumerate(u.trajectory):
        frame = stream.read(i)
        np.testing.assert_allclose(frame.positions, u.atoms.positions, atol=1e-4)
        np.testing.assert_allclose(np.diag(frame.box), ts.dimensions[:3], rtol=1e-5)
        if frame.step % 50 == 0:
            np.testing.assert_array_equal(sub.read(frame.step // 50 - 1).positions,
                                          frame.positions[:584])


def test_reporter_end_of_stream_rules(managed_dir: Path) -> None:
    aborted = FrameReporter("aborted", 10)
    aborted.stream.append(np.zeros((1000, 3)))  # (a frame, as report() appends one)
    aborted.abort()
    aborted.abort()  # idempotent
    assert files_held(managed_dir) == []  # the stream let go of, not held till the end
    assert not instride.Stream("aborted").ended
    # a with block whose close fails (Redis out of reach): abandoned on the way out, the
    # error raised
    def refuse() -> None:
        raise instride.MetadataUnavailable("redis://gone", "out of reach")

    with pytest.raises(instride.MetadataUnavailable), FrameReporter("unended", 10) as failing:
        failing.stream.append(np.zeros((1000, 3)))
        failing.stream.close = refuse  # type: ignore[method-assign]
    assert files_held(managed_dir) == []
    with pytest.raises(ValueError, match="interval"):
        FrameReporter("x", 0)
    with pytest.raises(ValueError, match="opened for reading"):
        FrameReporter(instride.Stream("x", mode="r"), 10)
    with pytest.raises(RuntimeError), FrameReporter("crashed", 10):
        raise RuntimeError("simulation blew up")
    assert not instride.Stream("crashed").ended  # a crashed run does not look complete
    reporter = FrameReporter("fine", 10)
    reporter.close()
    reporter.close()  # idempotent
    assert instride.Stream("fine").ended and len(instride.Stream("fine")) == 0
    with pytest.raises(ValueError, match="closed"):
        reporter.report(None, None)


def test_atom_indices_that_name_no_atom_are_refused(managed_dir: Path) -> None:
    """A negative atom index wrapped round to another atom without a word; one past the
    system's atoms raised an ``IndexError`` in the middle of ``simulation.step``. Both are a
    ``ConfigError`` naming ``atom_indices`` now, before anything is published."""
    with pytest.raises(instride.ConfigError, match="atom_indices"):
        FrameReporter("neg", 10, atom_indices=[0, -1])
    with pytest.raises(instride.ConfigError, match="atom_indices"):
        FrameReporter("flat", 10, atom_indices=[[0, 1]])
    with pytest.raises(instride.ConfigError, match="atom_indices"):  # (frames of no atom)
        FrameReporter("none", 10, atom_indices=np.array([], dtype=int))
    for bad in (float("inf"), True, 2.5, "10"):  # (inf: a bare OverflowError; True: 1)
        with pytest.raises(ValueError, match="interval"):
            FrameReporter("iv", bad)  # type: ignore[arg-type]
    simulation = make_simulation(seed=3, threads=1)
    with pytest.raises(instride.ConfigError, match="has 8867 atoms"), \
            FrameReporter("past", 5, atom_indices=[0, 8867]) as past:
        simulation.reporters.append(past)
        simulation.step(5)
    assert len(instride.Stream("past")) == 0
