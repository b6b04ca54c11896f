"""The common shape of instride's in situ analyses.

Each analysis is an MDAnalysis :class:`~MDAnalysis.analysis.base.AnalysisBase` whose
per-frame work is one method, :meth:`FrameAnalysis.compute`, returning one value per named
column. That makes every analysis usable three ways, with one implementation:

* offline, unchanged: ``RMSDToFirst(u.select_atoms("name CA")).run()`` on any trajectory
  (including an ``instride://`` one, over the frames published so far);
* in situ: :class:`instride.analytics.live.InSituAnalytics` calls :meth:`FrameAnalysis.update`
  for each frame as it arrives, with no need to know the number of frames in advance;
* in parallel over a whole trajectory (split-apply-combine, MPI or multiprocessing):
  :class:`instride.parallel.FrameAnalysisAdapter` builds the analysis on every rank and calls
  :meth:`FrameAnalysis.compute` on each frame of the rank's block.

Results are in ``results.<column>`` (one array per column) after ``run()`` or
:meth:`FrameAnalysis.finish`.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np
from MDAnalysis.analysis.base import AnalysisBase

__all__ = ["FrameAnalysis"]


class FrameAnalysis(AnalysisBase, metaclass=abc.ABCMeta):
    """Base of analyses that produce a fixed set of scalar columns per frame.

    Subclasses set :attr:`columns` and implement :meth:`compute`.

    Parameters
    ----------
    trajectory
        The trajectory (``universe.trajectory``) iterated by :meth:`run`.
    **kwargs
        Passed to :class:`~MDAnalysis.analysis.base.AnalysisBase` (``verbose``).
    """

    #: names of the values :meth:`compute` returns, in order
    columns: tuple[str, ...] = ()
    #: whether it compares each frame with the first one it analyses unless given a
    #: ``reference=`` (a parallel run then passes the input's first frame: each rank's own
    #: first frame differs; see :class:`~instride.parallel.adapters.FrameAnalysisAdapter`)
    reference_first: bool = False

    def __init__(self, trajectory: Any, **kwargs: Any) -> None:
        super().__init__(trajectory, **kwargs)
        self._rows: list[tuple[float, ...]] = []

    # -- the one method a subclass writes -------------------------------------------------
    @abc.abstractmethod
    def compute(self) -> tuple[float, ...]:
        """Values of :attr:`columns` for the current frame (the universe's current positions)."""

    # -- in situ use -------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every frame seen (the next frame becomes the first)."""
        self._rows = []

    def forget_last(self) -> None:
        """Forget the last frame :meth:`update` remembered (one that, with the other analyses
        of the same frame, did not complete)."""
        if self._rows:
            self._rows.pop()

    def update(self) -> dict[str, float]:
        """Analyse the current frame, remember it, and return its values by column."""
        row = tuple(float(v) for v in self.compute())
        self._rows.append(row)
        return dict(zip(self.columns, row, strict=True))

    def finish(self) -> FrameAnalysis:
        """Store the values of every frame seen in ``results`` (one array per column)."""
        self._conclude()
        return self

    # -- AnalysisBase template methods ------------------------------------------------------
    def _prepare(self) -> None:
        self.reset()

    def _single_frame(self) -> None:
        self.update()

    def _conclude(self) -> None:
        values = np.asarray(self._rows, dtype=np.float64)
        values = values.reshape(len(self._rows), len(self.columns))
        for j, name in enumerate(self.columns):
            self.results[name] = values[:, j]
