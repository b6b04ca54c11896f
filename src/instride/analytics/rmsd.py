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
from MDAnalysis.lib import qcprot

from ..errors import ConfigError
from .base import FrameAnalysis

__all__ = ["RMSDToFirst"]


class RMSDToFirst(FrameAnalysis):
    """RMSD (Å) of an atom group to its own first analysed frame, after optimal superposition.

    The superposition is the quaternion characteristic polynomial (QCP) fit, with the
    arithmetic of :func:`MDAnalysis.analysis.rms.rmsd` with ``superposition=True`` (both
    structures centred in float64, the reference given first to
    :func:`MDAnalysis.lib.qcprot.CalcRMSDRotationalMatrix`), so without weights the value is
    bit for bit that of ``MDAnalysis.analysis.rms.RMSD`` with ``ref_frame=0``.

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
    ConfigError
        An atom group of fewer than 2 atoms; unknown ``weights``, or weights that are not
        one finite number >= 0 per atom with a positive sum; a ``reference`` whose shape does
        not match the atom group.
    """

    columns = ("rmsd",)
    reference_first = True

    def __init__(
        self,
        atomgroup: Any,
        weights: str | np.ndarray | None = None,
        reference: np.ndarray | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(atomgroup.universe.trajectory, **kwargs)
        self.atomgroup = atomgroup
        if len(atomgroup) < 2:  # (gave NaN after the first frame: no superposition of 0 or 1)
            raise ConfigError("atomgroup", f"{len(atomgroup)} atom(s)",
                              "an RMSD after superposition needs at least 2 atoms")
        if isinstance(weights, str):
            if weights != "mass":
                raise ConfigError("weights", weights, "expected None, 'mass' or an array")
            weights = atomgroup.masses
        self.weights = None if weights is None else _checked_weights(weights, len(atomgroup))
        # QCP takes weights relative to their mean, as MDAnalysis.analysis.rms.rmsd passes them
        self._qcp_weights = None if self.weights is None else self.weights / self.weights.mean()
        self._mobile = np.empty((len(atomgroup), 3), dtype=np.float64)
        self._fixed: np.ndarray | None = None
        if reference is not None:
            fixed = np.asarray(reference, dtype=np.float64)
            if fixed.shape != (len(atomgroup), 3):
                raise ConfigError("reference", f"an array of shape {fixed.shape}",
                                  f"the atom group's positions have shape {(len(atomgroup), 3)}")
            self._fixed = self._centred(fixed)
        self._reference = self._fixed

    def _centred(self, positions: np.ndarray) -> np.ndarray:
        return positions - np.average(positions, axis=0, weights=self.weights)

    def reset(self) -> None:
        super().reset()
        self._reference = self._fixed

    def forget_last(self) -> None:
        """:meth:`FrameAnalysis.forget_last`; the first frame forgotten is no reference."""
        super().forget_last()
        if not self._rows:
            self._reference = self._fixed

    def compute(self) -> tuple[float]:
        # The arithmetic of MDAnalysis.analysis.rms.rmsd(reference, positions, weights,
        # superposition=True), with the centred reference kept and the buffer reused.
        mobile = self._mobile
        mobile[:] = self.atomgroup.positions
        mobile -= np.average(mobile, axis=0, weights=self.weights)
        if self._reference is None:
            self._reference = mobile.copy()
            return (0.0,)
        return (float(qcprot.CalcRMSDRotationalMatrix(
            self._reference, mobile, len(mobile), None, self._qcp_weights)),)


def _checked_weights(weights: Any, n_atoms: int) -> np.ndarray:
    """``weights`` as float64, refused here (not with numpy's errors at the first frame)
    unless one finite number >= 0 per atom, with a positive sum."""
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError):
        raise ConfigError("weights", weights, "expected None, 'mass' or an array of numbers") \
            from None
    if w.shape != (n_atoms,):
        raise ConfigError("weights", f"an array of shape {w.shape}",
                          f"expected one weight per atom, shape {(n_atoms,)}")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or not w.sum() > 0:
        raise ConfigError("weights", f"an array of sum {w.sum()}",
                          "expected finite weights >= 0 with a positive sum")
    return w
