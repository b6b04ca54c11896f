"""Split-apply-combine over a trajectory, with MPI or multiprocessing, timed per rank.

Algorithm 1 of Khoshlessan et al. (2020): every rank opens the input itself, takes one
contiguous block of frames (the first ``n_frames % N`` ranks get one frame more, as
:func:`numpy.array_split`), computes per frame, and the blocks are gathered on rank 0.

Backends
--------
``"mpi"``
    The calling program runs under a launcher (``mpiexec -n N python ...``, ``srun``); every
    rank calls :func:`analyze` with the same arguments; rank 0 gets the :class:`AnalysisRun`,
    the others ``None``. Blocks go to rank 0 with ``MPI_Gather`` (mpi4py, pickled). Before
    gathering, ranks wait at a non-blocking barrier polled with short sleeps, so ranks that
    finished early do not spin on a core the slow ones need (MPICH's blocking collectives
    busy-poll); this wait is reported as ``t_wait``. The ``instride analyze --backend mpi``
    command, when not started by a launcher, starts ``mpiexec -n WORKERS`` on itself
    (:func:`launch_mpi`).
``"multiprocessing"``
    ``workers`` processes on this node (:class:`concurrent.futures.ProcessPoolExecutor`,
    ``fork`` start method on Linux); the parent checks the input first, so bad input raises
    before any process starts. ``workers=1`` runs in the calling process.
``"serial"``
    One rank, in the calling process.

Examples
--------
>>> from instride.parallel import analyze                              # doctest: +SKIP
>>> run = analyze("rmsd", "adk.dcd", "adk.psf", workers=2,
...               baseline="serial")                                    # doctest: +SKIP
>>> print(run.timing.format())                                          # doctest: +SKIP
>>> run.write("out/")                                                   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from ..config import read_variable
from ..orphans import die_with_parent, dies_with_me
from .adapters import BUILTIN, Block, Combined, FrameAnalysisAdapter, ParallelAnalysis
from .analysis_errors import (
    BackendError,
    DecompositionError,
    RankFailedError,
    UnsupportedInputError,
)
from .inputs import FrameSource, SourceSpec, source_spec
from .timing import RankTiming, TimingReport, write_atomic

BACKENDS = ("multiprocessing", "mpi", "serial")
#: environment variables a launcher sets in every rank (MPICH/Hydra, Open MPI, PMIx, Slurm PMI2)
LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")


@dataclass
class AnalysisRun:
    """The combined per-frame series and the timing report of one run.

    Attributes
    ----------
    analysis
        Analysis name (``"rmsd"``, ``"rg"``, ``"mda"``).
    frames, times
        Frame indices and times (ps) in order.
    data
        Column name -> per-frame values (``"rmsd"`` in Å for RMSD).
    timing
        The :class:`~instride.parallel.timing.TimingReport`.
    result_object
        The analysis object with the ``results`` of every frame, as after ``.run()``: the
        :mod:`instride.analytics` FrameAnalysis, or the MDAnalysis class of an
        :class:`~instride.parallel.adapters.AnalysisBaseAdapter`.
    """

    analysis: str
    frames: np.ndarray
    times: np.ndarray
    data: dict[str, np.ndarray]
    timing: TimingReport
    result_object: Any = None

    def to_csv(self, path: str | os.PathLike[str]) -> Path:
        """Write ``frame,time,<columns...>``, one row per frame.

        Numbers are written as floats (``repr``), a column of text (DSSP's secondary
        structure codes) as its text. The file is written under a temporary name and renamed
        into place (never partial).
        """
        cols = list(self.data)
        text = {c for c in cols if np.asarray(self.data[c]).dtype.kind in "US"}

        def cell(c: str, i: int) -> str:
            v = self.data[c][i]
            if c in text:
                return v.decode() if isinstance(v, bytes) else str(v)
            return repr(float(v))

        def rows(fh: IO[str]) -> None:
            w = csv.writer(fh)
            w.writerow(["frame", "time", *cols])
            for i in range(len(self.frames)):
                w.writerow([int(self.frames[i]), repr(float(self.times[i])),
                            *(cell(c, i) for c in cols)])

        return write_atomic(path, rows)

    def write(self, outdir: str | os.PathLike[str], plot: bool = True) -> dict[str, Path]:
        """Write ``<analysis>.csv`` and the timing report (json, txt, csv, png) to ``outdir``.

        The CSV and the timing report are written independently: one that cannot be written
        does not lose the other (the first error is raised once both were tried).
        """
        out = Path(outdir)
        out.mkdir(parents=True, exist_ok=True)
        paths: dict[str, Path] = {}
        failed: Exception | None = None
        for part in ("csv", "timing"):
            try:
                if part == "csv":
                    paths["csv"] = self.to_csv(out / f"{self.analysis}.csv")
                else:
                    paths.update(self.timing.write(out, plot=plot))
            except Exception as exc:  # (an interruption is not held back)
                failed = failed or exc
        if failed is not None:
            raise failed
        return paths


def block_bounds(n_frames: int, n_ranks: int, rank: int) -> tuple[int, int]:
    """The contiguous block ``[start, stop)`` of ``rank`` among ``n_ranks``.

    Raises
    ------
    DecompositionError
        More ranks than frames (a rank would get no frame).

    Examples
    --------
    >>> [block_bounds(10, 3, r) for r in range(3)]
    [(0, 4), (4, 7), (7, 10)]
    """
    if n_ranks < 1:
        raise BackendError("any", f"number of ranks must be >= 1, got {n_ranks}")
    if n_frames < n_ranks:
        raise DecompositionError(n_frames, n_ranks)
    q, r = divmod(n_frames, n_ranks)
    start = rank * q + min(rank, r)
    return start, start + q + (1 if rank < r else 0)


def make_analysis(analysis: ParallelAnalysis | type | str,
                  select: str | None = None) -> ParallelAnalysis:
    """What :func:`analyze` runs, from what it was given.

    Parameters
    ----------
    analysis
        A :class:`~instride.parallel.adapters.ParallelAnalysis` (returned as is), a built-in
        name (``"rmsd"``, ``"rg"``), or an :mod:`instride.analytics`
        :class:`~instride.analytics.base.FrameAnalysis` subclass (wrapped in a
        :class:`~instride.parallel.adapters.FrameAnalysisAdapter` on ``select``).
    select
        Selection of a built-in or of a FrameAnalysis class.

    Raises
    ------
    UnsupportedInputError
        An unknown name or a class that is not a FrameAnalysis.
    """
    if isinstance(analysis, ParallelAnalysis):
        return analysis
    if isinstance(analysis, type):
        return FrameAnalysisAdapter(analysis, select=select)
    try:
        factory = BUILTIN[analysis]
    except KeyError:
        raise UnsupportedInputError(analysis, f"unknown analysis; built in: {sorted(BUILTIN)}") \
            from None
    return factory() if select is None else factory(select=select)


def _portable(exc: BaseException, rank: int) -> BaseException:
    """What another process gets of ``exc``: itself if it survives pickling as the same type,
    else a :class:`RankFailedError` naming it.

    An interruption (``KeyboardInterrupt``, ``SystemExit``: not an ``Exception``) is always
    sent as a :class:`RankFailedError`, so it stops only the process it happened in.
    """
    if isinstance(exc, Exception):
        try:
            copy = pickle.loads(pickle.dumps(exc))
            if type(copy) is type(exc) and str(copy) == str(exc):
                return exc
        except Exception:
            pass
    return RankFailedError(rank, f"{type(exc).__name__}: {exc}")


def pack_block(block: Block, rank: int) -> bytes:
    """``block`` pickled to be sent to rank 0.

    Raises
    ------
    RankFailedError
        It cannot be pickled (results holding a lambda, a callback, an open handle; a block
        too large for memory).
    """
    try:
        return pickle.dumps(block, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise RankFailedError(rank, f"its block of results cannot be pickled to be sent to "
                                    f"rank 0: {type(exc).__name__}: {exc}") from None


def unpack_block(payload: bytes, rank: int) -> Block:
    """The block ``rank`` sent, unpickled.

    Raises
    ------
    RankFailedError
        It cannot be unpickled here.
    """
    try:
        return pickle.loads(payload)
    except Exception as exc:
        raise RankFailedError(rank, f"its block of results cannot be unpickled on rank 0: "
                                    f"{type(exc).__name__}: {exc}") from None


def warm_imports() -> None:
    """Import the libraries a rank needs before its clock starts.

    Python imports (MDAnalysis takes ~1 s) are not part of the paper's ``t_open``, which
    times opening the files and building the data structures.
    """
    import h5py  # noqa: F401
    import MDAnalysis  # noqa: F401
    from MDAnalysis.lib import qcprot  # noqa: F401


def _rank_work(
    analysis: ParallelAnalysis,
    spec: SourceSpec,
    rank: int,
    size: int,
    delay: float = 0.0,
    progress: bool = False,
    close: bool = True,
) -> tuple[Block, RankTiming, FrameSource]:
    """Open, set up and analyse this rank's block; the rank's ``t_work`` ends here."""
    clock = time.perf_counter
    t0 = clock()
    timing = RankTiming(rank=rank, host=socket.gethostname())
    source = analysis.open(spec)
    try:
        analysis.setup(source)
        timing.t_open = clock() - t0
        start, stop = block_bounds(source.n_frames, size, rank)
        timing.start, timing.stop = start, stop
        bar = None
        if progress:
            from ..progress import progress as tqdm

            bar = tqdm(total=stop - start, desc=f"{analysis.name} rank {rank}", unit="frame",
                       leave=False)
        try:
            block = analysis.run_block(source, start, stop, timing, delay=delay, progress=bar)
        finally:
            if bar is not None:
                bar.close()
    except BaseException:
        source.close()
        raise
    if close:
        t1 = clock()
        source.close()
        timing.t_end_loop += clock() - t1
    timing.t_work = clock() - t0
    return block, timing, source


def _result(
    analysis: ParallelAnalysis,
    combined: Combined,
    ranks: list[RankTiming],
    spec: SourceSpec,
    backend: str,
    wall: float,
    baseline: RankTiming | None,
    baseline_total: float | None,
    straggler_factor: float,
    straggle: Mapping[int, float],
) -> AnalysisRun:
    report = TimingReport(
        analysis=analysis.name, source=spec.kind, backend=backend,
        n_frames=len(combined.frames), ranks=sorted(ranks, key=lambda r: r.rank), wall=wall,
        baseline=baseline,
        baseline_total=baseline.t_total if baseline is not None else baseline_total,
        straggler_factor=straggler_factor, straggle=dict(straggle),
    )
    return AnalysisRun(analysis.name, combined.frames, combined.times, combined.data, report,
                       combined.result_object)


def _serial_baseline(analysis: ParallelAnalysis, spec: SourceSpec, progress: bool) -> RankTiming:
    _, timing, _ = _rank_work(analysis, spec, 0, 1, progress=progress)
    return timing


def _mp_worker(
    analysis: ParallelAnalysis, spec: SourceSpec, rank: int, size: int, delay: float,
    progress: bool = False,
) -> tuple[bytes | None, RankTiming | None, float, BaseException | None]:
    try:
        warm_imports()
        block, timing, _ = _rank_work(analysis, spec, rank, size, delay, progress)
        sent = time.time()  # (pickling is communication, in t_comm, as the pool's was)
        # (pickled here, where a failure is this rank's typed error, not the pool's raw one)
        return pack_block(block, rank), timing, sent, None
    except BaseException as exc:  # (an interruption too: a RankFailedError, not the parent's)
        return None, None, time.time(), _portable(exc, rank)


def quiet_barrier(comm: Any, poll: float = 2e-4) -> None:
    """An MPI barrier that sleeps while waiting instead of spinning on a core."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll)


def under_mpi_launcher() -> bool:
    """Whether this process was started by an MPI launcher (mpiexec, srun with PMI/PMIx)."""
    return any(v in os.environ for v in LAUNCHER_VARS)


def _mpi_comm(comm: Any) -> Any:
    if comm is not None:
        return comm
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise BackendError("mpi", f"mpi4py is not importable ({exc}); pip install "
                           "'instride[mpi]'") from None
    return MPI.COMM_WORLD


def analyze(
    analysis: ParallelAnalysis | type | str,
    trajectory: str | os.PathLike[str],
    topology: str | os.PathLike[str] | None = None,
    *,
    select: str | None = None,
    workers: int | None = None,
    backend: str = "multiprocessing",
    comm: Any = None,
    baseline: str | float | None = None,
    straggle: Mapping[int, float] | None = None,
    straggler_factor: float = 1.5,
    timeout: float | None = None,
    start_method: str | None = None,
    progress: bool = False,
) -> AnalysisRun | None:
    """Run an analysis over a trajectory by split-apply-combine; return the combined run.

    Parameters
    ----------
    analysis
        A :class:`~instride.parallel.adapters.ParallelAnalysis` (``rmsd(...)``,
        ``radius_of_gyration(...)``, ``FrameAnalysisAdapter(...)``,
        ``AnalysisBaseAdapter(...)``), a built-in name ``"rmsd"`` / ``"rg"``, or an
        :mod:`instride.analytics` FrameAnalysis class (run on ``select``).
    trajectory
        ``instride://STREAM``, an H5MD file, or a trajectory MDAnalysis reads.
    topology
        Topology file (required).
    select
        Selection for a built-in analysis given by name, or for a FrameAnalysis class.
    workers
        Number of ranks. ``"mpi"``: default and required value is the communicator's size.
    backend
        ``"multiprocessing"`` (default), ``"mpi"`` or ``"serial"``.
    comm
        MPI communicator (default ``MPI.COMM_WORLD``).
    baseline
        ``"serial"``: run the analysis on one rank first (MPI: on rank 0 while the others
        wait) and report ``S(N)``, ``E(N)`` and the serial ``R_comp/IO``; a number: a known
        serial ``t_total(1)`` in seconds; ``None``: no speed-up is reported.
    straggle
        Testing/diagnostic option: ``{rank: seconds}`` of sleep added to every frame's
        computation on that rank, to make it a straggler on purpose (seconds: finite,
        ``>= 0``). Not applied to the serial baseline; recorded in the report.
    straggler_factor
        A rank is a straggler when its ``t_work`` exceeds this factor times the median.
    timeout
        Seconds a stream input waits for its frames and end marker.
    start_method
        Multiprocessing start method (default ``"fork"`` where available).
    progress
        Show a progress bar for rank 0's block (on stderr, written by the process that runs
        rank 0: a worker process with ``"multiprocessing"``).

    Returns
    -------
    AnalysisRun or None
        ``None`` on MPI ranks other than 0.

    Raises
    ------
    TrajectoryNotFoundError
        The trajectory or topology does not exist.
    SelectionError
        The selection matches no atoms.
    DecompositionError
        More workers than frames.
    BackendError
        Unknown backend, mpi4py missing, ``workers`` different from the MPI size, a
        ``baseline`` that is neither ``"serial"`` nor a number, or a negative or non-finite
        ``straggle`` delay.
    ConsumeTimeout
        A stream input did not end within ``timeout`` (MPI: on every rank; other errors of
        :mod:`instride.errors` that a rank meets reach every rank as themselves too).
    """
    if backend not in BACKENDS:
        raise BackendError(backend, f"unknown backend; choose one of {BACKENDS}")
    if workers is not None and workers < 1:
        raise BackendError(backend, f"workers must be >= 1, got {workers}")
    ana = make_analysis(analysis, select)
    straggle = dict(straggle or {})
    for r, delay in straggle.items():
        try:
            valid = math.isfinite(delay) and delay >= 0
        except TypeError:  # not a number
            valid = False
        if not valid:
            raise BackendError(backend, f"straggle delay of rank {r} must be a finite number "
                               f"of seconds >= 0, got {delay!r}")
    if isinstance(baseline, str) and baseline != "serial":
        raise BackendError(backend, f"baseline must be 'serial', a number or None: {baseline!r}")
    base_total = None if baseline in (None, "serial") else float(baseline)  # type: ignore[arg-type]
    for what, value in (("straggler_factor", straggler_factor), ("baseline", base_total)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise BackendError(backend, f"{what} must be a finite number above 0, got {value!r}")
    if backend == "mpi":
        return _run_mpi(ana, trajectory, topology, workers, comm, baseline == "serial",
                        base_total, straggle, straggler_factor, timeout, progress)
    spec = source_spec(trajectory, topology, timeout=timeout)
    warm_imports()
    n = 1 if backend == "serial" else (workers or 1)
    if backend == "serial" and workers not in (None, 1):
        raise BackendError("serial", f"runs one rank, got workers={workers}")
    base = _serial_baseline(ana, spec, progress) if baseline == "serial" else None
    if n == 1:
        t0 = time.perf_counter()
        block, timing, source = _rank_work(ana, spec, 0, 1, straggle.get(0, 0.0), progress,
                                           close=False)
        try:
            combined = ana.combine([block])
        finally:
            source.close()
        return _result(ana, combined, [timing], spec, "serial", time.perf_counter() - t0,
                       base, base_total, straggler_factor, straggle)
    return _run_multiprocessing(ana, spec, n, base, base_total, straggle, straggler_factor,
                                start_method, progress)


def _run_multiprocessing(
    ana: ParallelAnalysis,
    spec: SourceSpec,
    n: int,
    base: RankTiming | None,
    base_total: float | None,
    straggle: dict[int, float],
    straggler_factor: float,
    start_method: str | None,
    progress: bool = False,
) -> AnalysisRun:
    import multiprocessing as mp

    # Preflight in the parent: typed errors before any process starts; the parent's
    # analysis object (set up here) is the one that combines.
    source = ana.open(spec)
    try:
        ana.setup(source)
        block_bounds(source.n_frames, n, 0)
        # (fork, unless this process started UCX to read the input: UCX does not survive a
        # fork, and forked workers could fetch nothing; a fork server's children can)
        from ..transport.ucx import started_here

        method = start_method or ("forkserver" if started_here() else
                                  "fork" if "fork" in mp.get_all_start_methods() else None)
        ctx = mp.get_context(method)
        t0 = time.perf_counter()
        blocks: list[Block] = []
        ranks: list[RankTiming] = []
        # (the workers get SIGTERM if this process dies outright; stopped below if it is
        # interrupted: not left to finish their blocks for nobody, or to wait on a pipe)
        with ProcessPoolExecutor(max_workers=n, mp_context=ctx,
                                 initializer=_worker_init) as ex:
            try:
                futs = [ex.submit(_mp_worker, ana, spec, r, n, straggle.get(r, 0.0),
                                  progress and r == 0) for r in range(n)]
                for fut in as_completed(futs):
                    try:
                        payload, timing, sent, err = fut.result()
                    except BrokenProcessPool as exc:  # a worker died (signal, out of memory)
                        raise BackendError("multiprocessing", f"a worker process died: {exc}") \
                            from None
                    if err is not None:  # (the first: the others' blocks are not waited for)
                        raise err
                    assert payload is not None and timing is not None
                    blocks.append(unpack_block(payload, timing.rank))
                    timing.t_comm = max(0.0, time.time() - sent)
                    ranks.append(timing)
            except BaseException:
                _stop_workers(ex)
                raise
        wall = time.perf_counter() - t0
        combined = ana.combine(blocks)
    finally:
        source.close()
    return _result(ana, combined, ranks, spec, "multiprocessing", wall, base, base_total,
                   straggler_factor, straggle)


def _worker_init() -> None:
    """A pool worker: SIGTERM ends it (a forked worker inherits the command's handler, which
    turns SIGTERM into an exception its task loop catches: it would wait for tasks for ever),
    and it gets SIGTERM when its parent dies."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent(signal.SIGTERM)


def _stop_workers(ex: ProcessPoolExecutor) -> None:
    """Cancel what has not started and stop the workers at once (SIGTERM, SIGKILL after 5 s),
    so that leaving the executor's block does not wait for their blocks."""
    procs = list((getattr(ex, "_processes", None) or {}).values())  # (no public handle;
    ex.shutdown(wait=False, cancel_futures=True)  # taken first: shutdown() drops it)
    for proc in procs:
        with contextlib.suppress(OSError):
            proc.terminate()
    for proc in procs:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _run_mpi(
    ana: ParallelAnalysis,
    trajectory: str | os.PathLike[str],
    topology: str | os.PathLike[str] | None,
    workers: int | None,
    comm: Any,
    want_baseline: bool,
    base_total: float | None,
    straggle: dict[int, float],
    straggler_factor: float,
    timeout: float | None,
    progress: bool,
) -> AnalysisRun | None:
    comm = _mpi_comm(comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    if workers is not None and workers != size:
        raise BackendError(
            "mpi", f"--workers {workers} but the MPI communicator has {size} rank(s); launch "
            f"with `mpiexec -n {workers} ...` (or leave --workers out)"
        )
    clock = time.perf_counter
    err: BaseException | None = None
    spec: SourceSpec | None = None
    base: RankTiming | None = None
    try:
        spec = source_spec(trajectory, topology, timeout=timeout)
        warm_imports()
        if want_baseline and rank == 0:
            base = _serial_baseline(ana, spec, progress)
    except BaseException as exc:  # (an interruption too: the others wait in the collectives)
        err = exc
    quiet_barrier(comm)  # common start
    t0 = clock()
    payload: bytes | None = None
    t_pack = 0.0
    timing = RankTiming(rank=rank, host=socket.gethostname())
    source: FrameSource | None = None
    if err is None:
        try:
            assert spec is not None
            block, timing, source = _rank_work(ana, spec, rank, size, straggle.get(rank, 0.0),
                                               progress and rank == 0, close=rank != 0)
            # (pickled here, not by the gather: a block that cannot be pickled is this rank's
            # error, sent to the others below, not a rank leaving rank 0 in the gather;
            # counted in t_comm, as the gather's own pickling was)
            t4 = clock()
            payload = pack_block(block, rank)
            t_pack = clock() - t4
        except BaseException as exc:  # (an interruption too: the others wait in the collectives)
            err = exc
    if err is not None:
        timing.t_work = clock() - t0
    t1 = clock()
    quiet_barrier(comm)
    t2 = clock()
    payloads = comm.gather(payload, root=0)  # (bytes, or None from a rank that failed)
    blocks: list[Block] = []
    if rank == 0 and err is None and all(p is not None for p in payloads):
        try:  # (a failure here is rank 0's error, exchanged below like any other)
            blocks = [unpack_block(p, r) for r, p in enumerate(payloads)]
        except BaseException as exc:
            err = exc
    t3 = clock()
    timing.t_wait, timing.t_comm = t2 - t1, t3 - t2 + t_pack
    wall = t3 - t0
    # Only the copy sent to the others is made portable; this rank raises its own error.
    errors = comm.allgather(None if err is None else _portable(err, rank))
    timings = comm.gather(timing, root=0)
    try:
        if err is not None:
            raise err
        failed = [e for e in errors if e is not None]
        if failed:
            raise failed[0]  # the first failed rank's error, as itself where it can travel
        if rank != 0:
            return None
        assert spec is not None
        combined = ana.combine(blocks)
        return _result(ana, combined, timings, spec, "mpi", wall, base, base_total,
                       straggler_factor, straggle)
    finally:
        if source is not None:
            source.close()


def find_mpiexec(explicit: str | None = None) -> str:
    """The ``mpiexec`` to launch: ``explicit``, ``$INSTRIDE_MPIEXEC``, the one next to this
    Python (a venv with the ``mpich`` wheel), else the first on ``PATH``."""
    for cand, what in ((explicit, "--mpiexec"), (read_variable("INSTRIDE_MPIEXEC"),
                                                 "INSTRIDE_MPIEXEC")):
        if cand and cand.strip():
            found = shutil.which(cand.strip())
            if found is None:  # (else a bare FileNotFoundError from Popen)
                raise BackendError("mpi", f"{what}={cand!r} is no program that can be run")
            return found
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        raise BackendError("mpi", "no mpiexec found: pip install mpich (or set "
                           "INSTRIDE_MPIEXEC / --mpiexec)")
    return found


def launch_mpi(argv: Sequence[str], n: int, mpiexec: str | None = None) -> int:
    """Run ``mpiexec -n n python -m instride ARGV`` and return its exit status.

    Used by ``instride analyze --backend mpi --workers N`` when it was not itself started by
    a launcher.
    """
    cmd = [find_mpiexec(mpiexec), "-n", str(n), sys.executable, "-m", "instride", *argv]
    # (mpiexec passes SIGTERM on to the ranks: it gets one if this process dies outright, and
    # one when this process is interrupted, then SIGKILL 10 s later)
    try:
        proc = subprocess.Popen(cmd, preexec_fn=dies_with_me(signal.SIGTERM))
    except OSError as exc:  # (removed, or not executable, since it was found)
        raise BackendError("mpi", f"cannot start {cmd[0]}: {exc.strerror or exc}") from None
    try:
        return proc.wait()
    except BaseException:
        with contextlib.suppress(OSError):
            proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise
