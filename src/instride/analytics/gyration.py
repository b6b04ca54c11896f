"""Radius of gyration.

Examples
--------
>>> from instride.analytics import RadiusOfGyration            # doctest: +SKIP
>>> RadiusOfGyration(u.select_atoms("protein")).run().results.rgyr
"""

from __future__ import annotations

from typing import Any

from .base import FrameAnalysis

__all__ = ["RadiusOfGyration"]


class RadiusOfGyration(FrameAnalysis):
    """Mass-weighted radius of gyration (Å) of an atom group, per frame.

    Uses :meth:`MDAnalysis.core.groups.AtomGroup.radius_of_gyration` on unwrapped positions:
    the group must be whole in the trajectory (true for OpenMM's output, which wraps whole
    molecules).

    Parameters
    ----------
    atomgroup
        Atoms to measure, e.g. ``u.select_atoms("protein")``.
    **kwargs
        Passed to :class:`~MDAnalysis.analysis.base.AnalysisBase`.

    Attributes
    ----------
    results.rgyr : numpy.ndarray
        Radius of gyration of each frame in Å.
    """

    columns = ("rgyr",)

    def __init__(self, atomgroup: Any, **kwargs: Any) -> None:
        super().__init__(atomgroup.universe.trajectory, **kwargs)
        self.atomgroup = atomgroup

    def compute(self) -> tuple[float]:
        return (float(self.atomgroup.radius_of_gyration()),)
