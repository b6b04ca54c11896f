"""Parallel RMSD / Rg equal MDAnalysis's serial results, for every input kind and backend.

The adk trajectory (MDAnalysisTests PSF/DCD, 98 frames) is read as the DCD, as an H5MD file
and as an instride stream (xyz32, float32 like the DCD). The positions are the same float32
numbers and the arithmetic is MDAnalysis's, so the results are checked for exact equality as
well as the required 1e-5 Å.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from instride.parallel import (
    ADK_CORE_CA,
    AnalysisBaseAdapter,
    UnsupportedInputError,
    analyze,
    radius_of_gyration,
)

from .conftest import AdkData, mpiexec, run

HERE = Path(__file__).parent
KINDS = ("dcd", "h5md", "stream")


def _traj(adk: AdkData, kind: str) -> str:
    return {"dcd": adk.dcd, "h5md": adk.h5, "stream": "instride://adk"}[kind]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_mpi_rmsd_equals_mdanalysis(adk: AdkData, tmp_path: Path, n: int) -> None:
    """One mpiexec launch per N: three input kinds, the adapter (N=2), bad inputs."""
    proc = run([mpiexec(), "-n", str(n), sys.executable, str(HERE / "mpi_script.py"),
                adk.psf, adk.dcd, adk.h5, str(tmp_path)], timeout=150)
    assert proc.returncode == 0, proc.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]
    assert [r["size"] for r in ranks] == [n] * n
    root = ranks[0]
    ref = adk.rmsd[:, 2]
    for kind in KINDS:
        got = np.array(root["rmsd"][kind])
        assert got.shape == ref.shape
        assert np.abs(got - ref).max() <= 1e-5, kind
        assert np.array_equal(got, ref), f"{kind}: not bit-identical to MDAnalysis"
        timing = root["timing"][kind]
        assert timing["n_ranks"] == n and timing["backend"] == "mpi"
        blocks = [(r["start"], r["stop"]) for r in timing["ranks"]]
        assert blocks[0][0] == 0 and blocks[-1][1] == adk.n_frames
        assert all(a[1] == b[0] for a, b in zip(blocks[:-1], blocks[1:], strict=True))  # contiguous
        for r in timing["ranks"]:
            assert r["t_io"] > 0 and r["t_comp"] > 0 and r["t_open"] > 0
        # result only on rank 0
        assert [r["none_on_rank"][kind] for r in ranks] == [False] + [True] * (n - 1)
    assert root["frames"] == list(range(adk.n_frames))
    dcd = root["timing"]["dcd"]
    assert dcd["baseline"] is not None and dcd["speedup"] > 0
    assert dcd["efficiency"] == pytest.approx(dcd["speedup"] / n)
    assert dcd["r_comp_io_source"] == "serial run"
    if n == 2:
        np.testing.assert_allclose(np.array(root["adapter"]), adk.rmsd, atol=1e-5, rtol=0)
    for r in ranks:  # typed errors on every rank, no deadlock
        assert r["errors"]["selection"] == "SelectionError"
        assert r["errors"]["missing"] == "TrajectoryNotFoundError"
        if n > 1:
            assert r["errors"]["more_ranks_than_frames"] == "DecompositionError"
            assert r["errors"]["workers_mismatch"] == "BackendError"


@pytest.mark.parametrize("workers", [2, 4])
def test_multiprocessing_rmsd_equals_mdanalysis(adk: AdkData, workers: int) -> None:
    ref = adk.rmsd[:, 2]
    for kind in KINDS:
        result = analyze("rmsd", _traj(adk, kind), adk.psf, workers=workers, timeout=60)
        assert result is not None
        assert np.array_equal(result.data["rmsd"], ref), kind
        np.testing.assert_allclose(result.times, adk.rmsd[:, 1], rtol=0, atol=1e-9)
        assert result.timing.n_ranks == workers
        assert result.timing.backend == "multiprocessing"
        assert sum(r.n_frames for r in result.timing.ranks) == adk.n_frames


def test_serial_backend_and_rg(adk: AdkData) -> None:
    result = analyze(radius_of_gyration(), "instride://adk", adk.psf, workers=2, timeout=60)
    assert result is not None
    np.testing.assert_allclose(result.data["rg"], adk.rg, rtol=0, atol=1e-5)
    serial = analyze("rmsd", adk.h5, adk.psf, backend="serial")
    assert serial is not None and serial.timing.n_ranks == 1
    assert np.array_equal(serial.data["rmsd"], adk.rmsd[:, 2])


def test_analysisbase_adapter_multiprocessing(adk: AdkData) -> None:
    for traj in (adk.dcd, adk.h5, "instride://adk"):
        result = analyze(
            AnalysisBaseAdapter("MDAnalysis.analysis.rms:RMSD", select=ADK_CORE_CA),
            traj, adk.psf, workers=2,
        )
        assert result is not None
        np.testing.assert_allclose(result.result_object.results.rmsd, adk.rmsd, atol=1e-5,
                                   rtol=0)
        np.testing.assert_array_equal(result.data["rmsd"], adk.rmsd[:, 2])
        assert [r.n_frames for r in result.timing.ranks] == [49, 49]


def test_adapter_refuses_non_parallelizable_class() -> None:
    with pytest.raises(UnsupportedInputError, match="parallelizable"):
        AnalysisBaseAdapter("MDAnalysis.analysis.align:AlignTraj")


def test_one_stack_runs_the_analytics_classes(adk: AdkData) -> None:
    """The built-ins are instride.analytics' classes; any FrameAnalysis runs on every input."""
    import MDAnalysis as mda

    from instride.analytics import DistanceMatrixEigenvalue, RadiusOfGyration, RMSDToFirst
    from instride.parallel import FrameAnalysisAdapter, rmsd

    run = analyze(rmsd(), adk.h5, adk.psf, workers=2)
    assert run is not None and type(run.result_object) is RMSDToFirst
    assert np.array_equal(run.result_object.results.rmsd, adk.rmsd[:, 2])

    run = analyze(RadiusOfGyration, "instride://adk", adk.psf, select="protein", workers=2,
                  timeout=60)
    assert run is not None and run.analysis == "radiusofgyration"
    np.testing.assert_allclose(run.data["rgyr"], adk.rg, rtol=0, atol=1e-5)

    helices = {"A": "resid 1:10 and name CA", "A-B": "(resid 1:10 or resid 30:40) and name CA"}
    u = mda.Universe(adk.psf, adk.dcd)
    serial = DistanceMatrixEigenvalue(u, helices).run().results
    for traj in (adk.dcd, adk.h5, "instride://adk"):
        run = analyze(FrameAnalysisAdapter(DistanceMatrixEigenvalue, kwargs={"substructures":
                                                                             helices}),
                      traj, adk.psf, workers=2, timeout=60)
        assert run is not None and list(run.data) == ["lambda_A", "lambda_A_B"]
        for col in run.data:
            np.testing.assert_allclose(run.data[col], serial[col], rtol=1e-6, atol=0)
        assert [r.n_frames for r in run.timing.ranks] == [49, 49]


def test_frame_analysis_adapter_refusals(adk: AdkData) -> None:
    from instride.analytics import RadiusOfGyration
    from instride.parallel import FrameAnalysisAdapter

    with pytest.raises(UnsupportedInputError, match="not an instride.analytics FrameAnalysis"):
        FrameAnalysisAdapter("MDAnalysis.analysis.rms:RMSD")
    with pytest.raises(UnsupportedInputError, match="cannot import"):
        FrameAnalysisAdapter("instride.analytics:NoSuchAnalysis")
    with pytest.raises(UnsupportedInputError, match="2 column names for 1 columns"):
        analyze(FrameAnalysisAdapter(RadiusOfGyration, select="protein", columns=("a", "b")),
                adk.dcd, adk.psf, backend="serial")


def test_rmsd_to_first_gives_the_same_with_any_number_of_workers(adk: AdkData) -> None:
    """``analyze(RMSDToFirst, ...)`` compares every frame with the input's first frame,
    however many workers split it (each used its own block's first frame: frames 49 on read
    0 Å at 2 workers, up to 4.7 Å off)."""
    from instride.analytics.rmsd import RMSDToFirst

    one = analyze(RMSDToFirst, adk.dcd, adk.psf, select="name CA", workers=1)
    two = analyze(RMSDToFirst, adk.dcd, adk.psf, select="name CA", workers=2)
    assert np.array_equal(one.frames, two.frames)
    np.testing.assert_allclose(two.data["rmsd"], one.data["rmsd"], atol=1e-4)
    assert two.data["rmsd"][0] < 1e-4 and (two.data["rmsd"][1:] > 0.1).all()


def test_an_atomgroup_argument_follows_the_frames(adk: AdkData) -> None:
    """An AtomGroup given as an argument (a substructure of the distance-matrix eigenvalue) is
    read at each frame the run loads, as its selection string is (it was the caller's
    universe's: one value for every frame)."""
    import MDAnalysis as mda

    from instride.analytics.eigen import DistanceMatrixEigenvalue
    from instride.parallel import FrameAnalysisAdapter

    sel = "name CA and resid 1:40"
    u = mda.Universe(adk.psf, adk.dcd)
    by_name = analyze(FrameAnalysisAdapter(DistanceMatrixEigenvalue, kwargs={
        "substructures": {"A": sel}}, name="eig"), adk.dcd, adk.psf, workers=1)
    by_group = analyze(FrameAnalysisAdapter(DistanceMatrixEigenvalue, kwargs={
        "substructures": {"A": u.select_atoms(sel)}}, name="eig"), adk.dcd, adk.psf,
        workers=1)
    column = next(c for c in by_name.data if c.startswith("lambda"))
    np.testing.assert_allclose(by_group.data[column], by_name.data[column])
    assert len(np.unique(by_group.data[column])) > 1


def test_an_atomgroup_kwarg_of_an_mdanalysis_class_follows_the_frames(adk: AdkData) -> None:
    """An AtomGroup among an MDAnalysis class's ``kwargs`` (AtomicDistances' ``ag2``) is read
    at each frame the rank loads, as serial MDAnalysis reads it (was: it stayed on the
    caller's unpickled universe, frozen at one frame: distances off by up to ~10 Å, no
    error); a reference structure of another universe stays where it is; an AtomGroup of
    another trajectory is refused, pointing to ``factory=``."""
    import warnings

    import MDAnalysis as mda
    from MDAnalysis.analysis.atomicdistances import AtomicDistances
    from MDAnalysis.analysis.rms import RMSD
    from MDAnalysisTests.datafiles import CRD

    sel1, sel2 = "name CA and resid 1:20", "name CA and resid 101:120"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        u = mda.Universe(adk.psf, adk.dcd)
        ref = mda.Universe(adk.psf, CRD)  # a one-frame structure: a reference
    serial = AtomicDistances(u.select_atoms(sel1), u.select_atoms(sel2), pbc=False).run()
    for workers in (1, 2):
        ana = AnalysisBaseAdapter(AtomicDistances, select=sel1,
                                  kwargs={"ag2": u.select_atoms(sel2), "pbc": False})
        run = analyze(ana, adk.dcd, adk.psf, workers=workers)
        assert run is not None
        np.testing.assert_allclose(run.result_object.results.distances,
                                   serial.results.distances, rtol=1e-6, atol=1e-5)

    serial_rmsd = RMSD(u, reference=ref, select=ADK_CORE_CA).run().results.rmsd
    run = analyze(AnalysisBaseAdapter(RMSD, kwargs={"reference": ref.atoms,
                                                    "select": ADK_CORE_CA}),
                  adk.dcd, adk.psf, workers=2)
    assert run is not None
    np.testing.assert_allclose(run.result_object.results.rmsd, serial_rmsd, rtol=0,
                               atol=1e-5)
    assert run.result_object.reference.universe is not run.result_object.atomgroup.universe

    # (the caller's DCD universe, the run reading the H5MD export: which frames it should
    # follow is not known)
    with pytest.raises(UnsupportedInputError, match="factory="):
        analyze(AnalysisBaseAdapter(AtomicDistances, select=sel1,
                                    kwargs={"ag2": u.select_atoms(sel2), "pbc": False}),
                adk.h5, adk.psf, workers=1)


def test_a_text_result_per_frame_is_written_and_the_timing_kept(adk: AdkData,
                                                                  tmp_path: Path) -> None:
    """DSSP's per-frame ``results.dssp`` is text: it is written as text (was: the CSV
    writer's ``float()`` raised ValueError after the whole run, and no timing file was
    written); a CSV that cannot be written leaves the timing files written."""
    import csv

    run = analyze(AnalysisBaseAdapter("MDAnalysis.analysis.dssp:DSSP", select="protein"),
                  adk.dcd, adk.psf, workers=2)
    assert run is not None
    paths = run.write(tmp_path / "out", plot=False)
    with open(paths["csv"], newline="") as fh:
        rows = list(csv.reader(fh))
    header, first = rows[0], rows[1]
    assert len(rows) == 1 + adk.n_frames and "dssp_0" in header and "resids" not in header
    dssp = run.result_object.results.dssp
    assert first[header.index("dssp_0"):header.index("dssp_0") + dssp.shape[1]] == \
        [str(x) for x in dssp[0]]
    assert {"json", "txt", "ranks_csv"} <= set(paths)

    blocked = tmp_path / "blocked"
    (blocked / "mda.csv").mkdir(parents=True)  # (a directory where the CSV should go)
    with pytest.raises(IsADirectoryError):
        run.write(blocked, plot=False)
    assert sorted(p.name for p in blocked.iterdir()) == ["mda.csv", "timing.json",
                                                         "timing.txt", "timing_ranks.csv"]
