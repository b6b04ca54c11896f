"""Parallel trajectory analysis: split-apply-combine with MPI or multiprocessing.

Reproduces the approach of Khoshlessan et al. (2020), *Parallel performance of molecular
dynamics trajectory analysis* (seed 002): every rank opens the trajectory, analyses one
contiguous block of frames, and rank 0 gathers the results; each rank's time is broken down
into opening, reading (I/O), computing and communication (the paper's Table 3), from which the
run reports speed-up, efficiency, stragglers and R_comp/IO.

The analyses are :mod:`instride.analytics`' (one stack: the in situ consumers and the parallel
runs use the same classes); :class:`FrameAnalysisAdapter` runs any of them here, e.g.
``analyze(RadiusOfGyration, DCD, PSF, select="protein", workers=2)``.

Inputs: an instride stream (``instride://NAME``), an H5MD file (read by every rank
independently with h5py), or any trajectory MDAnalysis reads.

Examples
--------
>>> from MDAnalysisTests.datafiles import PSF, DCD                       # doctest: +SKIP
>>> from instride.parallel import analyze, rmsd
>>> run = analyze(rmsd(), DCD, PSF, workers=2, baseline="serial")        # doctest: +SKIP
>>> run.data["rmsd"].shape                                               # doctest: +SKIP
(98,)
>>> print(run.timing.format())                                           # doctest: +SKIP

Under MPI (``mpiexec -n 4 python script.py``), every rank calls the same function with
``backend="mpi"``; rank 0 gets the result, the others ``None``.

Command line: ``instride analyze rmsd --topology TOP --trajectory TRAJ --workers N --out DIR``
and ``instride export --h5md STREAM out.h5``; see ``docs/analysis.md``.
"""

from __future__ import annotations

from .adapters import (
    BUILTIN,
    AnalysisBaseAdapter,
    FrameAnalysisAdapter,
    ParallelAnalysis,
    radius_of_gyration,
    rmsd,
)
from .analysis_errors import (
    BackendError,
    DecompositionError,
    RankFailedError,
    SelectionError,
    TrajectoryNotFoundError,
    UnsupportedInputError,
)
from .execute import AnalysisRun, analyze, block_bounds, launch_mpi, under_mpi_launcher
from .h5md import export_h5md
from .inputs import ADK_CORE_CA, FrameSource, SourceSpec, open_source, source_spec
from .timing import RankTiming, TimingReport, find_stragglers

__all__ = [
    "ADK_CORE_CA",
    "BUILTIN",
    "AnalysisBaseAdapter",
    "AnalysisRun",
    "BackendError",
    "DecompositionError",
    "FrameAnalysisAdapter",
    "FrameSource",
    "ParallelAnalysis",
    "RankFailedError",
    "RankTiming",
    "SelectionError",
    "SourceSpec",
    "TimingReport",
    "TrajectoryNotFoundError",
    "UnsupportedInputError",
    "analyze",
    "block_bounds",
    "export_h5md",
    "find_stragglers",
    "launch_mpi",
    "open_source",
    "radius_of_gyration",
    "rmsd",
    "source_spec",
    "under_mpi_launcher",
]
