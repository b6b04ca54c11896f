"""In situ analyses (RMSD/QCP, radius of gyration, distance-matrix eigenvalues), the
streaming table and the plots, checked against independent computations."""

from __future__ import annotations

from pathlib import Path

import MDAnalysis as mda
import numpy as np
import pytest
from MDAnalysis.analysis import rms
from MDAnalysisTests.datafiles import DCD, PSF

import instride
from instride.analytics import (
    DistanceMatrixEigenvalue,
    InSituAnalytics,
    RadiusOfGyration,
    RMSDToFirst,
    StreamingTable,
    analyze_stream,
    largest_eigenvalue,
    plot_table,
    read_table,
)

HELICES = {"A": "resid 1:10 and name CA", "A-B": "(resid 1:10 or resid 30:40) and name CA"}


@pytest.fixture
def adk() -> mda.Universe:
    return mda.Universe(PSF, DCD)


def test_rmsd_to_first_matches_mdanalysis(adk) -> None:
    got = RMSDToFirst(adk.select_atoms("name CA")).run(stop=15).results.rmsd
    want = rms.RMSD(mda.Universe(PSF, DCD), select="name CA").run(stop=15).results.rmsd[:, 2]
    assert got[0] == 0.0
    np.testing.assert_allclose(got, want, atol=1e-5)
    mass = RMSDToFirst(adk.select_atoms("name CA"), weights="mass").run(stop=5).results.rmsd
    assert mass.shape == (5,) and np.all(mass[1:] > 0)
    with pytest.raises(ValueError, match="weights"):
        RMSDToFirst(adk.atoms, weights="charge")


def test_radius_of_gyration_matches_formula(adk) -> None:
    protein = adk.select_atoms("protein")
    got = RadiusOfGyration(protein).run(stop=5).results.rgyr
    want = []
    for _ in adk.trajectory[:5]:
        x, m = protein.positions.astype(np.float64), protein.masses
        com = (x * m[:, None]).sum(0) / m.sum()
        want.append(np.sqrt((m * ((x - com) ** 2).sum(1)).sum() / m.sum()))
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_distance_matrix_eigenvalue_matches_numpy(adk) -> None:
    ana = DistanceMatrixEigenvalue(adk, HELICES).run(stop=4)
    assert ana.columns == ("lambda_A", "lambda_A_B")
    for i, _ in enumerate(adk.trajectory[:4]):
        for col, sel in zip(ana.columns, HELICES.values(), strict=True):
            x = adk.select_atoms(sel).positions.astype(np.float64)
            d = np.sqrt(((x[:, None, :] - x[None, :, :]) ** 2).sum(-1))
            assert ana.results[col][i] == pytest.approx(np.linalg.eigvalsh(d).max(), rel=1e-6)
    # a straight line of n points spaced 1 apart: known Perron root for n = 2 is 1
    assert largest_eigenvalue(np.array([[0, 0, 0], [1, 0, 0]])) == pytest.approx(1.0)
    with pytest.raises(instride.ConfigError, match="selects 0 atom"):
        DistanceMatrixEigenvalue(adk, {"none": "resname XYZ"})
    # two names that make one column: refused (the first one's values were lost)
    with pytest.raises(instride.ConfigError, match="one column"):
        DistanceMatrixEigenvalue(adk, {"A-B": "name CA", "A B": "name CB"})


def test_streaming_table_flushes_each_row(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    with StreamingTable(path, ["frame", "rmsd"]) as table:
        table.append({"frame": 0, "rmsd": 0.0})
        assert path.read_text().splitlines() == ["frame,rmsd", "0,0.0"]  # visible before close
        table.append([1, 0.125])
        assert read_table(path)["rmsd"].tolist() == [0.0, 0.125]
        with pytest.raises(ValueError, match="lacks columns"):
            table.append({"frame": 2})


def test_analyze_stream_writes_table_and_plots(managed_dir: Path, tmp_path: Path, adk) -> None:
    with instride.Stream("adk", mode="w") as stream:
        for ts in adk.trajectory[:8]:
            stream.append(adk.atoms.positions, step=ts.frame, time=ts.time)
    report = analyze_stream(PSF, "adk", tmp_path / "out", substructures=HELICES, timeout=30)
    assert report.frames == 8
    assert report.bytes == 8 * instride.frames.frame_size(adk.atoms.n_atoms)
    table = read_table(report.table)
    assert list(table) == ["frame", "step", "time_ps", "rmsd", "rgyr", "lambda_A", "lambda_A_B"]
    want = rms.RMSD(mda.Universe(PSF, DCD), select="protein and name CA").run(stop=8)
    np.testing.assert_allclose(table["rmsd"], want.results.rmsd[:, 2], atol=1e-4)
    names = sorted(p.name for p in report.plots)
    assert names == sorted(f"{c}.png" for c in ("rmsd", "rgyr", "lambda_A", "lambda_A_B"))
    for p in report.plots:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_in_situ_analytics_refuses_empty_selection(adk) -> None:
    with pytest.raises(instride.ConfigError, match="matches no atom"):
        InSituAnalytics(adk, selection="resname XYZ")


def test_plot_table_one_png_per_quantity(tmp_path: Path) -> None:
    with StreamingTable(tmp_path / "a.csv", ["frame", "step", "time_ps", "rmsd", "rgyr"]) as t:
        for i in range(5):
            t.append([i, 10 * i, 0.02 * i, 0.1 * i, 9.0])
    paths = plot_table(tmp_path / "a.csv", tmp_path / "plots")
    assert [p.name for p in paths] == ["rmsd.png", "rgyr.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


def test_rmsd_with_a_fixed_reference_is_mdanalysis_bit_for_bit(adk) -> None:
    """The reference given explicitly (what parallel ranks do): MDAnalysis's RMSD exactly."""
    ca = adk.select_atoms("name CA")
    reference = adk.trajectory[3].positions[ca.indices].copy()
    got = RMSDToFirst(ca, reference=reference).run(stop=8).results.rmsd
    want = rms.RMSD(mda.Universe(PSF, DCD), select="name CA", ref_frame=3).run(stop=8)
    assert np.array_equal(got, want.results.rmsd[:, 2])
    with pytest.raises(instride.ConfigError, match="reference.*shape"):
        RMSDToFirst(ca, reference=reference[:5])
    with pytest.raises(instride.ConfigError, match="weights"):
        RMSDToFirst(ca, weights="charge")
    mass = RMSDToFirst(ca, weights="mass", reference=reference).run(stop=4).results.rmsd
    want = [rms.rmsd(reference, ca.positions, weights=ca.masses, superposition=True)
            for _ in adk.trajectory[:4]]
    assert np.array_equal(mass, want)  # rms.rmsd's weighted arithmetic, exactly


def test_a_frame_one_analysis_fails_on_is_taken_by_none(adk) -> None:
    """The radius of gyration failing on a frame after the RMSD took it: finish() returned
    columns of different lengths (the RMSD one frame longer)."""
    live = InSituAnalytics(adk)
    live.process()
    adk.trajectory.next()
    failing = live.analyses[1]

    def broken() -> tuple[float, ...]:
        raise FloatingPointError("no mass")

    failing.compute = broken  # type: ignore[method-assign]
    with pytest.raises(FloatingPointError):
        live.process()
    got = live.finish()
    assert {len(v) for v in got.values()} == {1}, {k: len(v) for k, v in got.items()}


def test_a_first_frame_taken_by_none_is_no_rmsd_reference(adk) -> None:
    """The first frame failed in a later analysis: the RMSD forgot its row but kept that frame
    as its reference, so every RMSD after was measured against a frame no analysis took."""
    live = InSituAnalytics(adk)
    failing = live.analyses[1]
    plain = failing.compute

    def broken() -> tuple[float, ...]:
        raise FloatingPointError("no mass")

    failing.compute = broken  # type: ignore[method-assign]
    with pytest.raises(FloatingPointError):
        live.process()
    failing.compute = plain  # type: ignore[method-assign]
    adk.trajectory.next()
    row = live.process()
    assert row["rmsd"] == 0.0  # (the first frame taken is the reference)


def test_analyze_stream_closes_its_reader(managed_dir: Path, adk) -> None:
    """The universe's reader was never closed: the stream's head file stayed open and mapped
    (one more descriptor per call) until the cyclic garbage collector happened to run — also
    after a call that failed."""
    import gc

    from instride.errors import ConfigError
    from tests.conftest import files_held

    def held() -> list[str]:  # (descriptors, and mappings of files still there: a retired
        # frame's segment, unlinked already, may still be let go of by a prefetch meanwhile)
        return [f for f in files_held(managed_dir) if not f.endswith(" (deleted)")]

    gc.disable()  # (the collector would hide the leak)
    try:
        for i in range(3):
            with instride.Stream(f"s{i}", mode="w") as stream:
                for ts in adk.trajectory[:3]:
                    stream.append(adk.atoms.positions, step=ts.frame, time=ts.time)
            assert analyze_stream(PSF, f"s{i}", None, timeout=10).frames == 3
            assert held() == []
        with pytest.raises(ConfigError):  # (a selection that selects nothing)
            analyze_stream(PSF, "s0", None, selection="resname XYZ", timeout=10)
        assert held() == []
    finally:
        gc.enable()


def test_rmsd_refuses_groups_and_weights_it_cannot_use(adk) -> None:
    """An empty group gave [0, nan], one atom [0, nan, nan]; weights of the wrong length or
    summing to zero failed only at the first frame, with numpy's errors."""
    from instride.errors import ConfigError

    with pytest.raises(ConfigError, match="atomgroup"):
        RMSDToFirst(adk.select_atoms("resname XYZ"))
    with pytest.raises(ConfigError, match="atomgroup"):
        RMSDToFirst(adk.atoms[:1])
    ca = adk.select_atoms("name CA")
    for weights in (np.ones(len(ca) - 1), np.zeros(len(ca)), np.full(len(ca), np.nan),
                    -np.ones(len(ca)), np.ones((len(ca), 2))):
        with pytest.raises(ConfigError, match="weights"):
            RMSDToFirst(ca, weights=weights)
    got = RMSDToFirst(ca, weights=np.ones(len(ca))).run(stop=3).results.rmsd
    assert got.shape == (3,) and np.all(np.isfinite(got))


def test_distance_matrix_eigenvalue_refuses_a_group_of_another_universe(adk) -> None:
    """A group of another universe never moves: every frame got the first frame's value."""
    from instride.errors import ConfigError

    other = mda.Universe(PSF, DCD).select_atoms("resid 1:10 and name CA")
    with pytest.raises(ConfigError, match="another universe"):
        DistanceMatrixEigenvalue(adk, {"A": other})
    own = adk.select_atoms("resid 1:10 and name CA")
    values = DistanceMatrixEigenvalue(adk, {"A": own}).run(stop=3).results.lambda_A
    assert len(set(values.tolist())) == 3
