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
    structures in float64 first, and is given the reference first), so without weights the
    value is bit for bit that of ``MDAnalysis.analysis.rms.RMSD`` with ``ref_frame=0``.

    Parameters
    ----------
    atomgroup
        Atoms to fit and measure, e.g. ``u.select_atoms("protein and name CA")``.
    weights
        ``None`` (equal weights), ``"mass"``, or an array of per-atom weights.
    reference
        Positions ``(len(atomgroup), 3)`` in Å of a fixed reference structure, used instead
        of the first analysed frame (parallel analysis passes the trajectory's ``ref_frame``:
        each rank's first frame differs).
    **kwargs
        Passed to :class:`~MDAnalysis.analysis.base.AnalysisBase`.

    Attributes
    ----------
    results.rmsd : numpy.ndarray
        RMSD of each frame in Å (0 for the first frame when it is the reference).

    Raises
    ------
    ValueError
        Unknown ``weights``, or a ``reference`` whose shape does not match the atom group.
    """

    columns = ("rmsd",)

    def __init__(
        self,
        atomgroup: Any,
        weights: str | np.ndarray | None = None,
        reference: np.ndarray | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(atomgroup.universe.trajectory, **kwargs)
        self.atomgroup = atomgroup
        if isinstance(weights, str):
            if weights != "mass":
                raise ValueError(f"weights must be None, 'mass' or an array, got {weights!r}")
            weights = atomgroup.masses
        self.weights = None if weights is None else np.asarray(weights, dtype=np.float64)
        self._fixed: np.ndarray | None = None
        if reference is not None:
            self._fixed = np.asarray(reference, dtype=np.float64)
            if self._fixed.shape != (len(atomgroup), 3):
                raise ValueError(f"reference has shape {self._fixed.shape}, the atom group "
                                 f"{(len(atomgroup), 3)}")
        self._reference = self._fixed

    def reset(self) -> None:
        super().reset()
        self._reference = self._fixed

    def compute(self) -> tuple[float]:
        positions = self.atomgroup.positions.astype(np.float64)
        if self._reference is None:
            self._reference = positions
            return (0.0,)
        return (
            float(rms.rmsd(self._reference, positions, weights=self.weights, superposition=True)),
        )
