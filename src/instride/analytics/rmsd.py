"""RMSD to the first frame after optimal superposition (QCP).

Examples
--------
>>> import MDAnalysis as mda                                     # doctest: +SKIP
>>> from instride.analytics import RMSDToFirst
>>> r = RMSDToFirst(u.select_atoms("protein and name CA")).run()
>>> r.results.rmsd                                               # Å, one value per frame
"""

from __future__ import annotations

from typing import Any

import numpy as np
from MDAnalysis.analysis import rms

from .base import FrameAnalysis

__all__ = ["RMSDToFirst"]


class RMSDToFirst(FrameAnalysis):
    """RMSD (Å) of an atom group to its own first analysed frame, after optimal superposition.

    The superposition is the quaternion characteristic polynomial (QCP) fit of
    :func:`MDAnalysis.analysis.rms.rmsd` with ``superposition=True`` (which centers both
    structures first), so the value is the same as ``MDAnalysis.analysis.rms.RMSD`` with
    ``ref_frame=0``.

    Parameters
    ----------
    atomgroup
        Atoms to fit and measure, e.g. ``u.select_atoms("protein and name CA")``.
    weights
        ``None`` (equal weights), ``"mass"``, or an array of per-atom weights.
    **kwargs
        Passed to :class:`~MDAnalysis.analysis.base.AnalysisBase`.

    Attributes
    ----------
    results.rmsd : numpy.ndarray
        RMSD of each frame in Å (0 for the first frame).
    """

    columns = ("rmsd",)

    def __init__(
        self, atomgroup: Any, weights: str | np.ndarray | None = None, **kwargs: Any
    ) -> None:
        super().__init__(atomgroup.universe.trajectory, **kwargs)
        self.atomgroup = atomgroup
        if isinstance(weights, str):
            if weights != "mass":
                raise ValueError(f"weights must be None, 'mass' or an array, got {weights!r}")
            weights = atomgroup.masses
        self.weights = None if weights is None else np.asarray(weights, dtype=np.float64)
        self._reference: np.ndarray | None = None

    def reset(self) -> None:
        super().reset()
        self._reference = None

    def compute(self) -> tuple[float]:
        positions = self.atomgroup.positions.astype(np.float64)
        if self._reference is None:
            self._reference = positions
            return (0.0,)
        return (
            float(rms.rmsd(positions, self._reference, weights=self.weights, superposition=True)),
        )
