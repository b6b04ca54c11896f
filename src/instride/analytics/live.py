"""In situ analytics: analyse each frame of a stream as it arrives, stream results to a table.

:class:`InSituAnalytics` runs the analyses of the study on every frame it is handed —
RMSD to the first frame after QCP superposition, radius of gyration, and, for the
substructures it is given (none by default), the largest eigenvalue of their distance
matrices — and appends one flushed CSV row per frame. :func:`analyze_stream` is the whole
consumer: open ``instride://NAME`` with MDAnalysis, iterate (blocking for each frame, ending
at end-of-stream), write the table, and plot each quantity over time at the end.

Examples
--------
>>> from instride.analytics import analyze_stream                      # doctest: +SKIP
>>> report = analyze_stream("protein.pdb", "run7", "out/run7", timeout=120)
>>> report.frames, report.wait_seconds
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from .base import FrameAnalysis
from .eigen import DistanceMatrixEigenvalue
from .gyration import RadiusOfGyration
from .rmsd import RMSDToFirst
from .table import StreamingTable
from .table_plots import plot_table

__all__ = ["AnalyticsReport", "InSituAnalytics", "analyze_stream"]

INDEX_COLUMNS = ("frame", "step", "time_ps")


def _select(universe: Any, selection: str, what: str) -> Any:
    group = universe.select_atoms(selection)
    if len(group) == 0:
        raise ConfigError(f"{what} selection", selection, "it matches no atom")
    return group


class InSituAnalytics:
    """RMSD, radius of gyration and distance-matrix eigenvalues, one frame at a time.

    Parameters
    ----------
    universe
        The MDAnalysis universe whose current frame :meth:`process` analyses.
    selection
        Atoms for the RMSD (fitted with QCP to the first frame processed).
    rgyr_selection
        Atoms for the radius of gyration.
    substructures
        Name -> selection for the distance-matrix eigenvalues (e.g.
        :data:`~instride.analytics.eigen.VILLIN_SUBSTRUCTURES`); ``None`` or empty: skipped.
    table
        CSV file to stream rows to (``frame, step, time_ps`` then one column per quantity);
        ``None``: keep results in memory only.

    Raises
    ------
    ConfigError
        A selection that matches no atom (or a substructure fewer than two).
    """

    def __init__(
        self,
        universe: Any,
        *,
        selection: str = "protein and name CA",
        rgyr_selection: str = "protein",
        substructures: Mapping[str, Any] | None = None,
        table: str | os.PathLike[str] | None = None,
    ) -> None:
        self.universe = universe
        self.analyses: list[FrameAnalysis] = [
            RMSDToFirst(_select(universe, selection, "RMSD")),
            RadiusOfGyration(_select(universe, rgyr_selection, "radius of gyration")),
        ]
        if substructures:
            self.analyses.append(DistanceMatrixEigenvalue(universe, substructures))
        self.columns: list[str] = [*INDEX_COLUMNS]
        for analysis in self.analyses:
            self.columns.extend(analysis.columns)
        self.table = None if table is None else StreamingTable(table, self.columns)
        self.frames = 0
        self.analysis_seconds = 0.0

    def process(self, ts: Any = None) -> dict[str, float]:
        """Analyse the universe's current frame; append its row to the table; return the row."""
        ts = self.universe.trajectory.ts if ts is None else ts
        t0 = time.perf_counter()
        row: dict[str, Any] = {
            "frame": int(ts.frame),
            "step": int(ts.data.get("step", ts.frame)),
            "time_ps": float(ts.time),
        }
        done: list[FrameAnalysis] = []
        try:
            for analysis in self.analyses:
                row.update(analysis.update())
                done.append(analysis)
        except BaseException:
            # (the frame is analysed by all or by none: the analyses that took it forget it,
            # or their columns came out longer than the others')
            for analysis in done:
                analysis.forget_last()
            raise
        if self.table is not None:
            self.table.append(row)
        self.frames += 1
        self.analysis_seconds += time.perf_counter() - t0
        return row

    def run(self, on_frame: Callable[[dict[str, float]], None] | None = None) -> InSituAnalytics:
        """Process every frame of the trajectory as it arrives (blocks until end-of-stream)."""
        for ts in self.universe.trajectory:
            row = self.process(ts)
            if on_frame is not None:
                on_frame(row)
        return self

    def finish(self) -> dict[str, np.ndarray]:
        """Close the table and return every quantity over the frames processed."""
        if self.table is not None:
            self.table.close()
        out: dict[str, np.ndarray] = {}
        for analysis in self.analyses:
            analysis.finish()
            for name in analysis.columns:
                out[name] = np.asarray(analysis.results[name])
        return out


@dataclass
class AnalyticsReport:
    """What one in situ consumer did."""

    stream: str
    frames: int
    bytes: int  #: bytes of the frames analysed (frames x frame file size)
    wait_seconds: float  #: idle: blocked until the next frame was published
    read_seconds: float  #: reading + verifying published frames
    analysis_seconds: float
    wall_seconds: float
    table: Path | None
    plots: list[Path] = field(default_factory=list)
    results: dict[str, np.ndarray] = field(default_factory=dict, repr=False)


def analyze_stream(
    topology: str | os.PathLike[str],
    stream: str,
    out_dir: str | os.PathLike[str] | None = None,
    *,
    selection: str = "protein and name CA",
    rgyr_selection: str = "protein",
    substructures: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    plot: bool = True,
    on_frame: Callable[[dict[str, float]], None] | None = None,
) -> AnalyticsReport:
    """Run the in situ analytics on a stream until its end; write table and plots.

    Parameters
    ----------
    topology
        A topology file MDAnalysis reads (PDB, PSF, GRO ...) matching the stream's atoms.
    stream
        Stream name (``instride://`` prefix optional).
    out_dir
        Where ``analytics.csv`` (streamed, flushed per frame) and one PNG per quantity go;
        ``None``: no files.
    selection, rgyr_selection, substructures
        See :class:`InSituAnalytics`.
    timeout
        Seconds to wait for each frame before :class:`~instride.errors.ConsumeTimeout`.
    plot
        Write the plots at the end (needs ``out_dir``).
    on_frame
        Called with each row as soon as it is computed (progress bars, monitoring).

    Returns
    -------
    AnalyticsReport
    """
    import MDAnalysis as mda

    from .reader import SCHEME

    t0 = time.perf_counter()
    url = stream if stream.startswith(SCHEME) else SCHEME + stream
    universe = mda.Universe(os.fspath(topology), url, timeout=timeout)
    reader = universe.trajectory
    out = None if out_dir is None else Path(out_dir)
    table = None if out is None else out / "analytics.csv"
    # (the reader closed however the run ends: its stream's head file stayed open and mapped
    # until the cyclic garbage collector happened to run, one more per call)
    try:
        analytics = InSituAnalytics(
            universe, selection=selection, rgyr_selection=rgyr_selection,
            substructures=substructures, table=table,
        )
        try:
            analytics.run(on_frame)
        finally:
            results = analytics.finish()
    finally:
        reader.close()
    plots = plot_table(table, out, title=url) if (plot and table is not None and out) else []
    return AnalyticsReport(
        stream=url, frames=analytics.frames, bytes=analytics.frames * reader.frame_nbytes,
        wait_seconds=reader.wait_seconds, read_seconds=reader.read_seconds,
        analysis_seconds=analytics.analysis_seconds, wall_seconds=time.perf_counter() - t0,
        table=table, plots=plots, results=results,
    )
