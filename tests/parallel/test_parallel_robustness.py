"""Streams, boxes, H5MD units, typed errors across processes, file descriptors and outputs.

Small synthetic inputs (a few atoms, a PDB topology written here) in a fresh managed
directory; every command a test starts runs this checkout's sources (``PYTHONPATH`` passed on).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from MDAnalysis.analysis.base import AnalysisBase

from instride import ConsumeTimeout, Stream
from instride.analytics.base import FrameAnalysis
from instride.parallel import (
    AnalysisBaseAdapter,
    BackendError,
    FrameAnalysisAdapter,
    RankFailedError,
    UnsupportedInputError,
    analyze,
    export_h5md,
)
from instride.parallel.analysis_errors import DecompositionError
from instride.parallel.execute import AnalysisRun, block_bounds
from instride.parallel.timing import RankTiming, TimingReport, write_atomic
from tests.conftest import files_held

from .conftest import instride_cmd, mpiexec, run

HERE = Path(__file__).parent
N_ATOMS = 6


def _env() -> dict[str, str]:
    """The test's environment, ``PYTHONPATH`` led by this checkout's ``src``."""
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [src, env.get("PYTHONPATH", "")] if p)
    return env


@pytest.fixture
def top(tmp_path: Path) -> str:
    """A PDB topology of ``N_ATOMS`` carbon atoms."""
    import MDAnalysis as mda

    u = mda.Universe.empty(N_ATOMS, n_residues=1, atom_resindex=[0] * N_ATOMS,
                           trajectory=True)
    u.add_TopologyAttr("name", ["CA"] * N_ATOMS)
    u.add_TopologyAttr("type", ["C"] * N_ATOMS)
    u.add_TopologyAttr("resname", ["ALA"])
    u.add_TopologyAttr("resid", [1])
    path = tmp_path / "top.pdb"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        u.atoms.write(str(path))
    return str(path)


def _positions(i: int) -> np.ndarray:
    return (np.arange(N_ATOMS * 3, dtype=np.float32).reshape(N_ATOMS, 3) * (1 + i % 7)
            + np.float32(i))


def _box(i: int) -> np.ndarray:
    """Frame ``i``'s box vectors: orthorhombic for even frames, triclinic for odd ones."""
    box = np.diag([10.0 + i, 20.0, 30.0])
    if i % 2:
        box[1, 0] = 5.0
    return box


def _write_stream(name: str, n: int, boxed: bool = False) -> None:
    with Stream(name, mode="w", layout="xyz32") as s:
        for i in range(n):
            s.append(_positions(i), step=10 * i, time=0.5 * i, box=_box(i) if boxed else None)


class BoxDimensions(FrameAnalysis):
    """The universe's ``dimensions`` per frame (NaN when the frame has no box)."""

    columns = ("a", "b", "c", "alpha", "beta", "gamma")

    def __init__(self, atomgroup: Any, **kwargs: Any) -> None:
        super().__init__(atomgroup.universe.trajectory, **kwargs)
        self._universe = atomgroup.universe

    def compute(self) -> tuple[float, ...]:
        d = self._universe.dimensions
        return (float("nan"),) * 6 if d is None else tuple(float(x) for x in d)


class TimesOutInWorkers(FrameAnalysis):
    """Fails with a :class:`ConsumeTimeout` in a worker process (not in the parent)."""

    columns = ("x",)

    def __init__(self, atomgroup: Any, **kwargs: Any) -> None:
        if multiprocessing.parent_process() is not None:
            raise ConsumeTimeout("run/frame_000007", 2.5)
        super().__init__(atomgroup.universe.trajectory, **kwargs)

    def compute(self) -> tuple[float, ...]:
        return (0.0,)


def _dims(run: AnalysisRun) -> np.ndarray:
    return np.column_stack([run.data[c] for c in BoxDimensions.columns])


# ------------------------------------------------------------------ streams: descriptors, timeouts
def test_stream_analysis_releases_every_frame(managed_dir: Path, top: str,
                                              tmp_path: Path) -> None:
    """450 frames with at most 256 open files: each frame read is released (was: EMFILE)."""
    _write_stream("long", 450)
    out = tmp_path / "out"
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)); "
            "from instride.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = run([sys.executable, "-c", code, "analyze", "rg", "--select", "all",
                "--topology", top, "--trajectory", "instride://long", "--backend", "serial",
                "--timeout", "30", "--out", str(out), "--no-plot"], env=_env())
    assert proc.returncode == 0, proc.stderr
    rows = (out / "rg.csv").read_text().splitlines()
    assert [int(r.split(",")[0]) for r in rows[1:]] == list(range(450))  # each frame once


def test_stream_source_closes_its_stream(managed_dir: Path, top: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from instride.parallel import inputs, open_source, source_spec

    closed: list[str] = []

    class Recording(Stream):
        def close(self) -> None:
            closed.append(self.name)
            super().close()

    monkeypatch.setattr(inputs, "Stream", Recording)
    _write_stream("few", 60)
    src = open_source(source_spec("instride://few", top, timeout=10))
    before = files_held(managed_dir, maps=False)
    for i in range(60):
        np.testing.assert_array_equal(src.read(i), _positions(i))
    # no file held per frame read (counted under the managed directory: a socket another
    # test's thread opens meanwhile is not this source's)
    assert len(files_held(managed_dir, maps=False)) <= len(before)
    assert closed == []
    src.close()
    assert closed == ["few"]
    # a failed open closes its stream too: the topology's atom count does not match
    with Stream("wide", mode="w") as s:
        s.append(np.zeros((N_ATOMS + 1, 3), np.float32))
    with pytest.raises(UnsupportedInputError, match="atoms per frame"):
        open_source(source_spec("instride://wide", top, timeout=10))
    assert closed == ["few", "wide"]


def test_never_ending_stream_times_out_typed(managed_dir: Path, top: str,
                                             tmp_path: Path) -> None:
    """A stream whose producer never closes it: ConsumeTimeout (exit status 3) after --timeout,
    for the built-ins and for an MDAnalysis class, on every backend (was: a hang for ``mda``,
    exit status 1 under MPI)."""
    with Stream("live", mode="w", layout="xyz32") as producer:
        for i in range(4):
            producer.append(_positions(i), step=i, time=float(i))
        with pytest.raises(ConsumeTimeout):
            analyze(AnalysisBaseAdapter("MDAnalysis.analysis.rms:RMSD"), "instride://live", top,
                    timeout=0.5)
        with pytest.raises(ConsumeTimeout):
            analyze("rg", "instride://live", top, select="all", timeout=0.5, workers=2)
        cases = [
            ("mda", ["--class", "MDAnalysis.analysis.rms:RMSD"], []),
            ("rg", [], ["--workers", "2"]),
            ("rg", [], ["--backend", "mpi", "--workers", "2"]),  # self-launched mpiexec
            ("mda", ["--class", "MDAnalysis.analysis.rms:RMSD"],
             ["--backend", "mpi", "--workers", "2"]),
        ]
        for analysis, extra, backend in cases:
            proc = run(instride_cmd("analyze", analysis, *extra, "--topology", top,
                                    "--trajectory", "instride://live", "--timeout", "1",
                                    "--out", str(tmp_path / "o"), *backend), env=_env())
            assert proc.returncode == 3, (analysis, backend, proc.stderr)
            assert "timed out" in proc.stderr and "Traceback" not in proc.stderr
            assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ errors across processes
def test_multiprocessing_worker_error_keeps_its_type(managed_dir: Path, top: str) -> None:
    _write_stream("ok", 4)
    with pytest.raises(ConsumeTimeout) as exc:
        analyze(FrameAnalysisAdapter(TimesOutInWorkers, select="all"), "instride://ok", top,
                workers=2, timeout=10)
    assert exc.value.key == "run/frame_000007" and exc.value.waited == 2.5


class ExitsInWorkers(FrameAnalysis):
    """Leaves by ``sys.exit(0)`` in a worker process (user code), at its first frame."""

    columns = ("x",)

    def __init__(self, atomgroup: Any, **kwargs: Any) -> None:
        super().__init__(atomgroup.universe.trajectory, **kwargs)

    def compute(self) -> tuple[float, ...]:
        if multiprocessing.parent_process() is not None:
            sys.exit(0)
        return (0.0,)


def test_a_worker_that_exits_is_a_failed_rank_not_the_parents_exit(
        managed_dir: Path, top: str) -> None:
    """User code calling ``sys.exit(0)`` in a worker: the run fails with ``RankFailedError``
    (the worker's interruption reached the parent as its own: ``SystemExit(0)``, a silent
    exit 0 of ``instride analyze`` that wrote nothing)."""
    _write_stream("exits", 4)
    with pytest.raises(RankFailedError, match="SystemExit"):
        analyze(FrameAnalysisAdapter(ExitsInWorkers, select="all"), "instride://exits", top,
                workers=2, timeout=10)


def test_mpi_rank_errors_reach_every_rank(tmp_path: Path, top: str) -> None:
    """One rank fails: it raises its own error, the other the same type (or RankFailedError
    for an error that cannot travel); an interrupted rank still takes part in the collectives
    (was: the other ranks waited forever)."""
    traj = tmp_path / "t.h5"
    with h5py.File(traj, "w") as f:
        f.create_group("h5md")
        pos = f.create_group("particles/trajectory/position")
        pos.create_dataset("value", data=np.stack([_positions(i) for i in range(4)]))
        pos["value"].attrs["unit"] = "Angstrom"
    proc = run([mpiexec(), "-n", "2", sys.executable, str(HERE / "mpi_failures.py"), top,
                str(traj), str(tmp_path)], timeout=150, env=_env())
    assert proc.returncode == 0, proc.stderr
    ranks = [json.loads((tmp_path / f"failures{r}.json").read_text()) for r in range(2)]
    failing, other = ranks[1], ranks[0]
    assert failing["timeout"] == ["ConsumeTimeout", "original"]
    assert other["timeout"] == ["ConsumeTimeout", "timed out after 2.500 s waiting for key 'k'"]
    assert failing["unpicklable"][0] == "Unpicklable"
    assert other["unpicklable"] == ["RankFailedError", "rank 1 failed: Unpicklable: 1 2"]
    for kind in ("KeyboardInterrupt", "SystemExit"):
        assert failing[kind][0] == kind
        assert other[kind][0] == "RankFailedError" and kind in other[kind][1]
    assert ranks[0]["after"] == [0.0, 1.0, 2.0, 3.0]  # the collectives still line up after them


# ------------------------------------------------------------------ boxes
def test_box_of_every_frame_on_every_input(managed_dir: Path, top: str, tmp_path: Path) -> None:
    """Stream and H5MD set the universe's dimensions from each frame's box, as DCD (MDAnalysis)
    does (was: always None)."""
    import MDAnalysis as mda
    from MDAnalysis.lib.mdamath import triclinic_box

    _write_stream("boxed", 6, boxed=True)
    h5 = export_h5md("instride://boxed", tmp_path / "boxed.h5", timeout=10)
    expected = np.array([triclinic_box(*_box(i)) for i in range(6)], dtype=np.float64)
    u = mda.Universe(top, str(h5), format="H5MD")
    mda_dims = np.array([ts.dimensions.copy() for ts in u.trajectory], dtype=np.float64)
    np.testing.assert_allclose(mda_dims, expected, rtol=1e-6)
    for traj in ("instride://boxed", str(h5)):
        for workers in (1, 2):
            result = analyze(FrameAnalysisAdapter(BoxDimensions, select="all"), traj, top,
                             workers=workers, timeout=10)
            assert result is not None
            np.testing.assert_allclose(_dims(result), expected, rtol=1e-6, err_msg=traj)
    _write_stream("unboxed", 3)
    result = analyze(FrameAnalysisAdapter(BoxDimensions, select="all"), "instride://unboxed",
                     top, timeout=10)
    assert result is not None and np.isnan(_dims(result)).all()


def _h5md(path: Path, *, pos_unit: str | None = "nm", time: Any = "explicit",
          time_unit: str | None = "fs", box: str | None = None, n: int = 5) -> Path:
    """A hand-written H5MD file of ``n`` frames in ``pos_unit`` with times in ``time_unit``."""
    with h5py.File(path, "w") as f:
        f.create_group("h5md").attrs["version"] = np.array([1, 1])
        traj = f.create_group("particles/trajectory")
        pos = traj.create_group("position")
        pos.create_dataset("value", data=np.stack([_positions(i) for i in range(n)]))
        if pos_unit is not None:
            pos["value"].attrs["unit"] = pos_unit
        pos["step"] = np.arange(n) * 10
        if time == "explicit":
            pos["time"] = np.arange(n) * 100.0
        elif time == "fixed":
            pos["time"] = 100.0  # H5MD 1.1: a scalar interval, with an offset
            pos["time"].attrs["offset"] = 1000.0
        if time is not None and time_unit is not None:
            pos["time"].attrs["unit"] = time_unit
        b = traj.create_group("box")
        b.attrs["dimension"] = 3
        if box == "fixed":
            b["edges"] = np.array([3.0, 4.0, 5.0])
            b["edges"].attrs["unit"] = "nm"
        elif box == "time":
            b.create_group("edges")["value"] = np.array([np.diag([3.0 + i, 4.0, 5.0])
                                                         for i in range(n)])
            b["edges/value"].attrs["unit"] = "nm"
    return path


def test_h5md_units_fixed_time_and_box(top: str, tmp_path: Path) -> None:
    positions = np.stack([_positions(i) for i in range(5)])
    for kind, box in (("explicit", "time"), ("fixed", "fixed")):
        path = _h5md(tmp_path / f"{kind}.h5", time=kind, box=box)
        result = analyze(FrameAnalysisAdapter(BoxDimensions, select="all"), path, top)
        assert result is not None
        expected_t = (np.arange(5) * 100.0 if kind == "explicit"
                      else 1000.0 + np.arange(5) * 100.0) * 1e-3  # fs -> ps
        np.testing.assert_allclose(result.times, expected_t, rtol=1e-12)
        edges = [30.0 + 10 * i if box == "time" else 30.0 for i in range(5)]  # nm -> Å
        np.testing.assert_allclose(result.data["a"], edges, rtol=1e-6)
        np.testing.assert_allclose(result.data["c"], 50.0, rtol=1e-6)
        got = analyze(FrameAnalysisAdapter(RawX, select="all"), path, top)
        assert got is not None
        np.testing.assert_allclose(got.data["x"], positions[:, 1, 0] * 10.0, rtol=1e-6)  # nm
    ns = analyze("rg", _h5md(tmp_path / "ns.h5", time_unit="ns"), top, select="all")
    assert ns is not None
    np.testing.assert_allclose(ns.times, np.arange(5) * 100.0 * 1e3)
    none = analyze("rg", _h5md(tmp_path / "none.h5", time=None), top, select="all")
    assert none is not None and none.times.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


class RawX(FrameAnalysis):
    """The x coordinate of atom 1 (to check the length unit)."""

    columns = ("x",)

    def __init__(self, atomgroup: Any, **kwargs: Any) -> None:
        super().__init__(atomgroup.universe.trajectory, **kwargs)
        self._atoms = atomgroup

    def compute(self) -> tuple[float, ...]:
        return (float(self._atoms.positions[1, 0]),)


def test_h5md_without_units_or_with_bad_layout_is_refused(top: str, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedInputError, match="position/value has no 'unit'"):
        analyze("rg", _h5md(tmp_path / "a.h5", pos_unit=None), top, select="all")
    with pytest.raises(UnsupportedInputError, match="position/time has no 'unit'"):
        analyze("rg", _h5md(tmp_path / "b.h5", time_unit=None), top, select="all")
    with pytest.raises(UnsupportedInputError, match="unknown length unit 'furlong'"):
        analyze("rg", _h5md(tmp_path / "c.h5", pos_unit="furlong"), top, select="all")
    with pytest.raises(UnsupportedInputError, match="unknown time unit 'week'"):
        analyze("rg", _h5md(tmp_path / "d.h5", time_unit="week"), top, select="all")
    short = _h5md(tmp_path / "e.h5", box="time")
    with h5py.File(short, "a") as f:
        del f["particles/trajectory/box/edges/value"]
        f["particles/trajectory/box/edges/value"] = np.ones((2, 3))
        f["particles/trajectory/box/edges/value"].attrs["unit"] = "nm"
    with pytest.raises(UnsupportedInputError, match="2 boxes for 5 frames"):
        analyze("rg", short, top, select="all")


# ------------------------------------------------------------------ export
def test_export_refuses_a_box_on_some_frames_only(managed_dir: Path, tmp_path: Path) -> None:
    for name, boxes in (("late", [None, _box(1)]), ("early", [_box(0), None])):
        with Stream(name, mode="w") as s:
            for i, box in enumerate(boxes):
                s.append(_positions(i), step=i, box=box)
        out = tmp_path / f"{name}.h5"
        with pytest.raises(UnsupportedInputError, match="frame 1.*every frame or for none"):
            export_h5md(name, out, timeout=10)
        assert [p.name for p in tmp_path.iterdir() if name in p.name] == []  # nor a temp file


def test_export_bad_source_or_directory_exit_4(managed_dir: Path, top: str,
                                               tmp_path: Path) -> None:
    junk = tmp_path / "junk.nosuchformat"
    junk.write_text("not a trajectory\n")
    with pytest.raises(UnsupportedInputError, match="MDAnalysis cannot read it"):
        export_h5md(junk, tmp_path / "x.h5", topology=top)
    _write_stream("src", 2)
    with pytest.raises(UnsupportedInputError, match="output directory .* does not exist"):
        export_h5md("src", tmp_path / "nodir" / "x.h5", timeout=10)
    for args in (["export", "--h5md", str(junk), str(tmp_path / "y.h5"), "--topology", top],
                 ["export", "--h5md", "src", str(tmp_path / "nodir" / "y.h5")]):
        proc = run(instride_cmd(*args, "--quiet"), env=_env())
        assert proc.returncode == 4, proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "nodir").exists() and not (tmp_path / "y.h5").exists()


def test_an_export_whose_file_cannot_be_made_closes_its_stream(
        managed_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The output file cannot be made (a full disk, no permission): the error is raised and
    the source stream is closed (it stayed open: the generator that would close it never
    started)."""
    import h5py

    _write_stream("unmade", 2)
    closed: list[str] = []
    real_close = Stream.close

    def close(self: Stream) -> None:
        closed.append(self.name)
        real_close(self)

    def no_room(*args: Any, **kw: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Stream, "close", close)
    monkeypatch.setattr(h5py, "File", no_room)
    with pytest.raises(OSError, match="No space"):
        export_h5md("unmade", tmp_path / "x.h5", timeout=10)
    assert "unmade" in closed


# ------------------------------------------------------------------ bad arguments
def test_bad_arguments_are_typed(managed_dir: Path, top: str, tmp_path: Path) -> None:
    _write_stream("args", 3)
    with pytest.raises(BackendError, match="baseline must be"):
        analyze("rg", "instride://args", top, baseline="fast")
    for delay in (-1.0, float("nan"), float("inf")):
        with pytest.raises(BackendError, match="straggle delay of rank 0"):
            analyze("rg", "instride://args", top, straggle={0: delay})
        with pytest.raises(BackendError, match="straggler_factor must be a finite number"):
            analyze("rg", "instride://args", top, straggler_factor=delay)
        with pytest.raises(BackendError, match="baseline must be a finite number"):
            analyze("rg", "instride://args", top, baseline=delay)
    with pytest.raises(DecompositionError, match="the input has no frames"):
        block_bounds(0, 1, 0)
    common = ["--topology", top, "--trajectory", "instride://args", "--out", str(tmp_path / "o")]
    for args in (["mda", "--class", "MDAnalysis.analysis.rms:RMSD", "--kwargs", "{", *common],
                 ["mda", "--class", "MDAnalysis.analysis.rms:RMSD", "--kwargs", "[1]", *common],
                 ["rg", "--straggle", "0:-1", *common],
                 ["rg", "--straggle", "0:nan", *common],
                 ["rg", "--workers", "-1", *common],
                 ["rg", "--workers", "0", *common],
                 ["rg", "--straggler-factor", "nan", *common],
                 ["rg", "--straggler-factor", "0", *common],
                 ["rg", "--baseline-time", "-5", *common]):
        proc = run(instride_cmd("analyze", *args), env=_env())
        assert proc.returncode == 2, (args, proc.stderr)  # usage
        assert "Traceback" not in proc.stderr and args[1] in proc.stderr, (args, proc.stderr)
    assert not (tmp_path / "o").exists()
    # refused before the analysis runs: an empty selection (it used to be the default's); an
    # --out that cannot be a directory (it used to fail once the work was done, untyped)
    (tmp_path / "file").write_text("")
    for args, why in ((["rg", *common, "--select", ""], "selection ''"),
                      (["rg", *common[:-1], str(tmp_path / "file")], "not a directory"),
                      (["rg", *common[:-1], str(tmp_path / "file" / "o")], "not a directory")):
        proc = run(instride_cmd("analyze", *args), env=_env())
        assert proc.returncode in (2, 4) and why in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()
    proc = run(instride_cmd("analyze", "mda", "--class", "MDAnalysis.analysis.rms:RMSD",
                            "--kwargs", '{"select": "all"}', "--timeout", "10", *common),
               env=_env())
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------ outputs
def test_outputs_are_written_whole_or_not_at_all(tmp_path: Path) -> None:
    target = tmp_path / "t.txt"
    target.write_text("old\n")

    def fails(fh: Any) -> None:
        fh.write("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_atomic(target, fails)
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]

    class Bad:
        def __float__(self) -> float:
            raise ValueError("no number")

    report = TimingReport("x", "stream", "serial", 2, [RankTiming(rank=0, stop=2)])
    good = AnalysisRun("x", np.arange(2), np.zeros(2), {"v": np.array([1.0, 2.0])}, report)
    good.to_csv(tmp_path / "x.csv")
    bad = AnalysisRun("x", np.arange(2), np.zeros(2), {"v": np.array([1.0, Bad()], object)},
                      report)
    with pytest.raises(ValueError, match="no number"):
        bad.to_csv(tmp_path / "x.csv")
    assert (tmp_path / "x.csv").read_text().splitlines()[-1] == "1,0.0,2.0"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_timing_json_is_strict_and_progress_shows_rank_0(managed_dir: Path, top: str,
                                                         tmp_path: Path) -> None:
    """A serial run has no communication: R_comp/comm is null in timing.json (was: Infinity);
    --progress with two worker processes reports rank 0's block (was: nothing)."""
    _write_stream("prog", 10)

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in timing.json")

    out = tmp_path / "serial"
    result = analyze("rg", "instride://prog", top, select="all", timeout=10)
    assert result is not None and result.timing.r_comp_comm == float("inf")
    paths = result.write(out, plot=False)
    report = json.loads(paths["json"].read_text(), parse_constant=refuse)
    assert report["r_comp_comm"] is None and report["r_comp_io"] > 0
    assert sorted(p.name for p in out.iterdir()) == ["rg.csv", "timing.json", "timing.txt",
                                                    "timing_ranks.csv"]
    proc = run(instride_cmd("analyze", "rg", "--select", "all", "--topology", top,
                            "--trajectory", "instride://prog", "--workers", "2", "--progress",
                            "--no-plot", "--out", str(tmp_path / "mp")), env=_env())
    assert proc.returncode == 0, proc.stderr
    assert "rg rank 0: 5/5 frame" in proc.stderr and "rank 1" not in proc.stderr


def test_rank_failed_error_is_what_cannot_travel() -> None:
    from instride.parallel.execute import _portable

    assert isinstance(_portable(KeyboardInterrupt(), 3), RankFailedError)
    err = ConsumeTimeout("k", 1.0)
    assert _portable(err, 0) is err


# ------------------------------------------------------------------ round 45's review
def test_a_stream_whose_atom_count_changes_is_a_typed_error(managed_dir: Path, top: str) -> None:
    """A later frame with another atom count than frame 0's: numpy's bare ValueError (could
    not broadcast) reached the caller; it is an UnsupportedInputError naming the frame."""
    with Stream("grows", mode="w", layout="xyz32") as s:
        s.append(_positions(0), step=0)
        s.append(np.zeros((N_ATOMS + 2, 3), np.float32), step=10)
    with pytest.raises(UnsupportedInputError, match=f"frame 1 has {N_ATOMS + 2} atoms"):
        analyze("rg", "instride://grows", top, select="all", backend="serial", timeout=10)


def test_mpiexec_settings_that_name_no_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """INSTRIDE_MPIEXEC of blanks (unset, as every setting reads it) was used as the program's
    name; one that names no program raised Popen's bare FileNotFoundError."""
    from instride.parallel.execute import find_mpiexec

    monkeypatch.setenv("INSTRIDE_MPIEXEC", "  ")
    assert os.path.isabs(find_mpiexec())  # (the venv's or the one on PATH)
    monkeypatch.setenv("INSTRIDE_MPIEXEC", "/no/such/mpiexec")
    with pytest.raises(BackendError, match="INSTRIDE_MPIEXEC"):
        find_mpiexec()
    with pytest.raises(BackendError, match="--mpiexec"):
        find_mpiexec("/no/such/mpirun")


# ------------------------------------------------------------------ blocks that cannot travel
def test_mpi_block_that_cannot_be_sent_fails_every_rank_typed(tmp_path: Path) -> None:
    """Rank 1's results hold a lambda (cannot be pickled), or an object rank 0 cannot
    unpickle: every rank raises a RankFailedError, and the next run still works (was: rank 1
    raised a raw AttributeError and left; rank 0 waited in the gather for ever)."""
    import signal
    import subprocess

    from MDAnalysisTests.datafiles import DCD, PSF

    cmd = [mpiexec(), "-n", "2", sys.executable, str(HERE / "mpi_unpicklable.py"), PSF, DCD,
           str(tmp_path)]
    # (its own process group: mpiexec and its ranks are killed together, by that id)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"mpiexec hung (killed)\nstdout: {out}\nstderr: {err}") from None
    assert proc.returncode == 0, err
    ranks = [json.loads((tmp_path / f"unpicklable{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(ranks):
        for case in ("pickle", "unpickle"):
            assert res[case] is not None, (r, case)
            kind, message = res[case]
            assert kind == "RankFailedError", (r, case, res[case])
            assert message.startswith("rank 1 failed:") and "pickl" in message, (r, case)
    assert "lambda" in ranks[0]["pickle"][1] and "rebuilt here" in ranks[1]["unpickle"][1]
    assert ranks[0]["after"] == 98 and ranks[1]["after"] is None


class KeepsALambda(AnalysisBase):
    """Results that cannot be pickled (a callback kept in them)."""

    _analysis_algorithm_is_parallelizable = True

    def __init__(self, ag: Any, **kw: Any) -> None:
        super().__init__(ag.universe.trajectory, **kw)
        self.ag = ag

    def _prepare(self) -> None:
        self.results.x = np.zeros(self.n_frames)
        self.results.callback = lambda: None

    def _single_frame(self) -> None:
        self.results.x[self._frame_index] = self.ag.positions[0, 0]


def test_multiprocessing_block_that_cannot_be_sent_is_typed(tmp_path: Path) -> None:
    """A worker whose block cannot be pickled: RankFailedError naming it (was: a raw
    AttributeError from the pool)."""
    from MDAnalysisTests.datafiles import DCD, PSF

    with pytest.raises(RankFailedError, match=r"rank \d failed: .*pickl.*lambda"):
        analyze(AnalysisBaseAdapter(KeepsALambda, select="name CA"), DCD, PSF, workers=2)


# ------------------------------------------------------------------ what an analysis sees
class TimeProbe(FrameAnalysis):
    """The current timestep's ``time`` and ``data["step"]`` (NaN without one)."""

    columns = ("ts_time", "ts_step")

    def __init__(self, universe: Any, **kwargs: Any) -> None:
        super().__init__(universe.trajectory, **kwargs)
        self._universe = universe

    def compute(self) -> tuple[float, ...]:
        ts = self._universe.trajectory.ts
        return (float(ts.time), float(ts.data.get("step", float("nan"))))


def test_time_and_step_of_each_frame_on_h5md_and_stream(managed_dir: Path, top: str,
                                                        tmp_path: Path) -> None:
    """An analysis reading ``ts.time`` / ``ts.data["step"]`` sees each frame's, on H5MD and
    stream inputs as on MDAnalysis's (was: time 0.0 for every frame, no step)."""
    _write_stream("timed", 6)
    h5 = _h5md(tmp_path / "timed.h5", n=6)  # times 0, 100, ... fs; steps 0, 10, ...
    for traj, times in (("instride://timed", 0.5 * np.arange(6)),
                        (str(h5), 0.1 * np.arange(6))):
        for workers in (1, 2):
            result = analyze(FrameAnalysisAdapter(TimeProbe), traj, top, workers=workers,
                             timeout=10)
            assert result is not None
            np.testing.assert_allclose(result.data["ts_time"], times, rtol=1e-12)
            np.testing.assert_allclose(result.times, times, rtol=1e-12)
            assert result.data["ts_step"].tolist() == [10.0 * i for i in range(6)], traj
    with h5py.File(h5, "a") as f:  # H5MD 1.1's fixed interval: step = offset + i * step
        del f["particles/trajectory/position/step"]
        f["particles/trajectory/position/step"] = 5
        f["particles/trajectory/position/step"].attrs["offset"] = 100
    result = analyze(FrameAnalysisAdapter(TimeProbe), h5, top, workers=2)
    assert result is not None
    assert result.data["ts_step"].tolist() == [100.0 + 5 * i for i in range(6)]
    with h5py.File(h5, "a") as f:
        del f["particles/trajectory/position/step"]
    result = analyze(FrameAnalysisAdapter(TimeProbe), h5, top, workers=2)
    assert result is not None and np.isnan(result.data["ts_step"]).all()


def test_mda_on_h5md_without_time_is_typed(top: str, tmp_path: Path) -> None:
    """MDAnalysis's H5MD reader cannot read a file without ``position/time``: an
    UnsupportedInputError (was: h5py's bare KeyError); instride's own reader takes it."""
    h5 = _h5md(tmp_path / "notime.h5", time=None)
    with pytest.raises(UnsupportedInputError, match="MDAnalysis cannot read it"):
        analyze(AnalysisBaseAdapter("MDAnalysis.analysis.rms:RMSD", select="all"), h5, top)
    result = analyze("rg", h5, top, select="all")
    assert result is not None and len(result.frames) == 5


def test_timing_png_is_not_written_through_a_planted_link(tmp_path: Path) -> None:
    """The PNG's temporary file has a name nobody can guess, made exclusively (was:
    ``.timing.png.<pid>.tmp``: a link planted there had its target overwritten, and the link
    renamed into place as timing.png)."""
    from instride.parallel.timing_plots import plot_ranks

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    planted = tmp_path / f".timing.png.{os.getpid()}.tmp"
    planted.symlink_to(victim)
    report = TimingReport("x", "stream", "serial", 2, [RankTiming(rank=0, stop=2)])
    out = plot_ranks(report, tmp_path / "timing.png")
    assert victim.read_bytes() == b"precious"
    assert not out.is_symlink() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert planted.is_symlink()  # (left alone)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [planted.name, "timing.png", "victim"])
