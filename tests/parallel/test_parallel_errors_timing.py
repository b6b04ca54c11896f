"""Bad inputs raise typed errors; timing arithmetic (S, E, stragglers, R_comp/IO) is right."""

from __future__ import annotations

import errno
import pickle
from pathlib import Path

import h5py
import numpy as np
import pytest

from instride import errors
from instride.errors import InstrideError
from instride.parallel import (
    BackendError,
    DecompositionError,
    RankFailedError,
    RankTiming,
    SelectionError,
    TimingReport,
    TrajectoryNotFoundError,
    UnsupportedInputError,
    analyze,
    block_bounds,
    find_stragglers,
    rmsd,
)

from .conftest import AdkData


def test_missing_files(adk: AdkData, tmp_path: Path) -> None:
    with pytest.raises(TrajectoryNotFoundError) as exc:
        analyze("rmsd", tmp_path / "nope.dcd", adk.psf, workers=2)
    assert isinstance(exc.value, FileNotFoundError) and isinstance(exc.value, InstrideError)
    assert "nope.dcd" in str(exc.value)
    with pytest.raises(TrajectoryNotFoundError, match="topology"):
        analyze("rmsd", adk.dcd, tmp_path / "nope.psf")


def test_selection_matching_no_atoms(adk: AdkData) -> None:
    for workers in (1, 2):
        with pytest.raises(SelectionError, match="matches no atoms"):
            analyze(rmsd(select="name NOPE"), adk.dcd, adk.psf, workers=workers)
    with pytest.raises(SelectionError, match="cannot be parsed"):
        analyze("rmsd", adk.h5, adk.psf, select="resid 1 and and")


def test_more_ranks_than_frames(adk: AdkData) -> None:
    with pytest.raises(DecompositionError, match="at most 98 worker"):
        analyze("rmsd", adk.dcd, adk.psf, workers=99)
    with pytest.raises(DecompositionError):
        analyze("rmsd", "instride://one", adk.psf, workers=2, timeout=30)


def test_other_bad_inputs(adk: AdkData, tmp_path: Path) -> None:
    not_h5md = tmp_path / "plain.h5"
    with h5py.File(not_h5md, "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(UnsupportedInputError, match="H5MD"):
        analyze("rmsd", not_h5md, adk.psf)
    with pytest.raises(UnsupportedInputError, match="topology"):
        analyze("rmsd", adk.dcd, None)
    with pytest.raises(BackendError):
        analyze("rmsd", adk.dcd, adk.psf, backend="threads")
    with pytest.raises(UnsupportedInputError, match="unknown analysis"):
        analyze("rmsf", adk.dcd, adk.psf)


def test_multiprocessing_straggler_detected(adk: AdkData) -> None:
    # 0.15 s per frame: a straggler by far also when the other ranks are slowed by a loaded machine
    result = analyze("rmsd", adk.dcd, adk.psf, workers=4, straggle={2: 0.15})
    assert result is not None
    assert result.timing.stragglers == [2]
    assert result.timing.ranks[2].t_comp >= 24 * 0.15
    assert np.array_equal(result.data["rmsd"], adk.rmsd[:, 2])  # delay changes no value


def test_block_bounds_cover_frames_contiguously() -> None:
    for n, size in [(98, 1), (98, 4), (10, 3), (5, 5)]:
        blocks = [block_bounds(n, size, r) for r in range(size)]
        assert blocks[0][0] == 0 and blocks[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(blocks[:-1], blocks[1:], strict=True))
        sizes = [b - a for a, b in blocks]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    with pytest.raises(DecompositionError):
        block_bounds(3, 4, 0)


def test_find_stragglers_uses_median_factor() -> None:
    assert find_stragglers([1.0, 1.0, 1.0, 1.6]) == [3]
    assert find_stragglers([1.0, 1.0, 1.0, 1.4]) == []
    assert find_stragglers([2.0, 1.0], factor=1.5) == []  # 2.0 < 1.5 * 1.5
    assert find_stragglers([4.0, 1.0]) == [0]


def test_timing_report_arithmetic() -> None:
    ranks = [RankTiming(rank=r, start=10 * r, stop=10 * r + 10, t_open=0.1, t_io=0.4,
                        t_comp=0.2, t_work=0.75, t_wait=0.05, t_comm=0.01) for r in range(3)]
    ranks[1].t_work = 2.0  # a straggler: > 1.5 x the median 0.75
    base = RankTiming(rank=0, start=0, stop=30, t_open=0.1, t_io=0.8, t_comp=0.4, t_work=1.35)
    rep = TimingReport("rmsd", "h5md", "mpi", 30, ranks, baseline=base,
                       baseline_total=base.t_total)
    assert rep.t_total == pytest.approx(2.06)
    assert rep.speedup == pytest.approx(1.35 / 2.06)
    assert rep.efficiency == pytest.approx(1.35 / 2.06 / 3)
    assert rep.r_comp_io == pytest.approx(0.5)  # from the serial run
    assert rep.r_comp_comm == pytest.approx(0.2 / 0.01)
    assert rep.stragglers == [1]
    assert ranks[0].t_overhead == pytest.approx(0.05)
    again = TimingReport.from_dict(rep.to_dict())
    assert again.to_dict() == rep.to_dict()
    no_base = TimingReport("rmsd", "h5md", "mpi", 30, ranks)
    assert no_base.speedup is None and "no serial baseline" in no_base.format()


def test_errors_survive_pickling() -> None:
    for exc in (TrajectoryNotFoundError("x.dcd"), SelectionError("name X"),
                DecompositionError(3, 4), BackendError("mpi", "r"), RankFailedError(2, "d"),
                UnsupportedInputError("s", "r")):
        copy = pickle.loads(pickle.dumps(exc))
        assert type(copy) is type(exc) and str(copy) == str(exc)


#: one instance of every class of instride.errors whose __init__ takes its own arguments
_CORE_ERRORS = [
    errors.KeyValidationError("a/../b", "'..' in a key"),
    errors.KeyExistsError("run/frame_000001"),
    errors.KeyNotFoundError("run/frame_000002"),
    errors.KeyNotServed("run/x", "a FIFO"),
    errors.UnsafePathError("run/x", "a symbolic link"),
    errors.FileTypeError("run", "a directory", errno.EISDIR),
    errors.ConsumeTimeout("run/end_of_stream.json", 1.25),
    errors.IntegrityError("run/frame_000003", "checksum mismatch"),
    errors.PeerUnavailable("node2", "connection refused"),
    errors.ServeError("address in use", errno.EADDRINUSE),
    errors.TransferError("run/frame_000004", "short body"),
    errors.AuthenticationError("bad HMAC"),
    errors.MetadataUnavailable("redis://h:6379", "timed out"),
    errors.PublicationUnsettled("redis://h:6379", "run/k.bin", "publish: timed out"),
    errors.EndOfStream("run", 98),
    errors.FramesMissed("run", 3, 5, 8),
    errors.StreamRerun("run", 7),
    errors.SourceBusy("/scratch/out.dat"),
    errors.SourceBusy("/scratch/out.dat", "it was opened for writing while it was moved"),
    errors.StreamFull("run", 2.0, ["g1", "g2"]),
    errors.GroupBusy("run", "g1"),
    errors.GroupLeaseLost("run", "g1", 30.0),
    errors.GroupReset("run", "g1"),
    errors.ArchiveError("run", Path("/tmp/run.h5"), "disk full"),
    errors.ArchiveError(None, "run.h5", "not an archive"),
    errors.ArchiveError("run", "run.h5", "held for writing", busy=True),
    errors.UnsupportedModeError("a", "published keys are immutable"),
    errors.ConfigError("INSTRIDE_TIMEOUT", "-1", "must be >= 0"),
    errors.AgentError(errno.ENOENT, "no such key"),
]


def test_core_errors_survive_pickling() -> None:
    """Each error of instride.errors unpickles as itself: type, message, errno, attributes
    (what lets an MPI rank or a worker process re-raise another's error)."""
    own_init = {cls for cls in vars(errors).values() if isinstance(cls, type)
                and issubclass(cls, errors.InstrideError) and "__init__" in vars(cls)}
    assert own_init == {type(e) for e in _CORE_ERRORS}  # a new class needs a case here
    for exc in _CORE_ERRORS:
        copy = pickle.loads(pickle.dumps(exc))
        assert type(copy) is type(exc), exc
        assert str(copy) == str(exc) and copy.args == exc.args, exc
        assert copy.errno == exc.errno and vars(copy) == vars(exc), exc
