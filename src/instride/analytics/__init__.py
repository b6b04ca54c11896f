"""In situ analytics for instride streams, built on MDAnalysis.

Importing this package registers the ``instride://`` trajectory reader with MDAnalysis
(:class:`~instride.analytics.reader.InstrideReader`, ``format="INSTRIDE"``), so afterwards
``MDAnalysis.Universe(topology, "instride://NAME")`` reads a stream while it is produced.

Analyses (MDAnalysis ``AnalysisBase`` subclasses, usable offline with ``.run()`` or in situ
through :class:`InSituAnalytics`):

* :class:`RMSDToFirst` — RMSD to the first frame after optimal (QCP) superposition;
* :class:`RadiusOfGyration` — mass-weighted radius of gyration;
* :class:`DistanceMatrixEigenvalue` — largest eigenvalue of the distance matrix of
  substructures (helices, helix pairs), as in the DYAD study's Figure 1.

Results stream to CSV (:class:`StreamingTable`, one flushed row per frame) and are plotted at
the end (:func:`plot_table`). :func:`analyze_stream` does all of it for one stream.

Examples
--------
>>> import MDAnalysis as mda                                        # doctest: +SKIP
>>> import instride.analytics
>>> from MDAnalysis.analysis.rms import RMSD
>>> u = mda.Universe("protein.pdb", "instride://run7")
>>> RMSD(u, select="name CA").run().results.rmsd                   # frames published so far
"""

from __future__ import annotations

from .base import FrameAnalysis
from .eigen import (
    VILLIN_HELICES,
    VILLIN_SUBSTRUCTURES,
    DistanceMatrixEigenvalue,
    largest_eigenvalue,
)
from .gyration import RadiusOfGyration
from .live import AnalyticsReport, InSituAnalytics, analyze_stream
from .reader import InstrideReader
from .rmsd import RMSDToFirst
from .table import StreamingTable, read_table
from .table_plots import plot_overlay, plot_table

__all__ = [
    "VILLIN_HELICES",
    "VILLIN_SUBSTRUCTURES",
    "AnalyticsReport",
    "DistanceMatrixEigenvalue",
    "FrameAnalysis",
    "InSituAnalytics",
    "InstrideReader",
    "RMSDToFirst",
    "RadiusOfGyration",
    "StreamingTable",
    "analyze_stream",
    "largest_eigenvalue",
    "plot_overlay",
    "plot_table",
    "read_table",
]
