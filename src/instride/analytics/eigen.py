"""Largest eigenvalue of the distance matrix of chosen substructures.

The in situ analytics of the DYAD study (seed 001, Figure 1) follow interacting secondary
structures of a protein: for each substructure (a helix, or a pair of helices such as
"helix 1-2" and "helix 1-3") the matrix of pairwise distances between its atoms is built
every frame, and its largest eigenvalue is tracked over time. A distance matrix is symmetric
with a zero diagonal; its largest eigenvalue (the Perron root) grows with the size and
elongation of the substructure, so sudden changes in the molecular model show up as jumps.

Examples
--------
>>> from instride.analytics import DistanceMatrixEigenvalue     # doctest: +SKIP
>>> helices = {"H1-H2": "resid 3:10 14:19 and name CA", "H1-H3": "resid 3:10 22:32 and name CA"}
>>> DistanceMatrixEigenvalue(u, helices).run().results.lambda_H1_H2
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np
from MDAnalysis.lib.distances import distance_array

from ..errors import ConfigError
from .base import FrameAnalysis

__all__ = [
    "VILLIN_HELICES",
    "VILLIN_SUBSTRUCTURES",
    "DistanceMatrixEigenvalue",
    "largest_eigenvalue",
]

#: the three helices of villin HP35 in OpenMM's ``test.pdb`` numbering (C-alpha atoms)
VILLIN_HELICES: dict[str, str] = {
    "H1": "resid 3:10 and name CA",
    "H2": "resid 14:19 and name CA",
    "H3": "resid 22:32 and name CA",
}
#: the substructures of the study's Figure 1: each helix, and helix pairs 1-2 and 1-3
VILLIN_SUBSTRUCTURES: dict[str, str] = {
    **VILLIN_HELICES,
    "H1-H2": "(resid 3:10 or resid 14:19) and name CA",
    "H1-H3": "(resid 3:10 or resid 22:32) and name CA",
}


def largest_eigenvalue(positions: np.ndarray) -> float:
    """Largest eigenvalue (Å) of the Euclidean distance matrix of ``positions`` (n x 3)."""
    pos = np.asarray(positions, dtype=np.float64)
    matrix = distance_array(pos, pos)
    return float(np.linalg.eigvalsh(matrix)[-1])


class DistanceMatrixEigenvalue(FrameAnalysis):
    """Largest eigenvalue of the distance matrix of each substructure, per frame.

    Parameters
    ----------
    universe
        The universe the selections are made in.
    substructures
        Name -> MDAnalysis selection string or AtomGroup; default
        :data:`VILLIN_SUBSTRUCTURES`. Distances ignore periodic images (the substructure must
        be whole, as in OpenMM's output).
    **kwargs
        Passed to :class:`~MDAnalysis.analysis.base.AnalysisBase`.

    Attributes
    ----------
    results["lambda_<name>"] : numpy.ndarray
        Largest eigenvalue of each frame (Å), one array per substructure; characters of the
        name that are not valid in a Python identifier become ``_`` (``"H1-H2"`` ->
        ``results.lambda_H1_H2``).

    Raises
    ------
    ConfigError
        A selection matches fewer than two atoms, an AtomGroup belongs to another universe,
        or two names make one column.
    """

    def __init__(
        self,
        universe: Any,
        substructures: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(universe.trajectory, **kwargs)
        spec = VILLIN_SUBSTRUCTURES if substructures is None else substructures
        self.groups: dict[str, Any] = {}
        for name, sel in spec.items():
            group = universe.select_atoms(sel) if isinstance(sel, str) else sel
            if getattr(group, "universe", None) is not universe:  # (it would never move:
                # every frame would get the first frame's value)
                raise ConfigError("substructures", {name: sel},
                                  "an AtomGroup of another universe: select it in the one "
                                  "analysed")
            if len(group) < 2:
                raise ConfigError("substructures", {name: sel},
                                  f"it selects {len(group)} atom(s); a distance matrix needs 2")
            self.groups[name] = group
        self.columns = tuple("lambda_" + re.sub(r"\W", "_", name) for name in self.groups)
        if len(set(self.columns)) != len(self.columns):  # ("A-B" and "A B": one column)
            raise ConfigError("substructures", list(self.groups),
                              f"two names make one column {self.columns}: rename one")

    def compute(self) -> tuple[float, ...]:
        return tuple(largest_eigenvalue(g.positions) for g in self.groups.values())
