"""Run under ``mpiexec -n 2``: rank 1's block cannot be sent, or cannot be received.

Arguments: PSF DCD OUTDIR. Rank R writes OUTDIR/unpicklable<R>.json: for each case, the type
name of the error the rank raised and its message; ``"after"``: the frames of a good run
made after them (the collectives still line up).
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

warnings.simplefilter("ignore")

import numpy as np  # noqa: E402
from MDAnalysis.analysis.base import AnalysisBase  # noqa: E402
from MDAnalysis.analysis.results import ResultsGroup  # noqa: E402
from mpi4py import MPI  # noqa: E402

from instride.parallel import AnalysisBaseAdapter, analyze  # noqa: E402

psf, dcd, outdir = sys.argv[1:4]
rank = MPI.COMM_WORLD.rank


def _explode() -> None:
    raise ValueError("cannot be rebuilt here")


class Unloadable:
    """Pickles, but raises when unpickled (on rank 0)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_explode, ())


class Odd(AnalysisBase):
    """Rank 1 keeps ``extra`` in its results; ``extra`` is set per case."""

    _analysis_algorithm_is_parallelizable = True
    extra: Any = None

    @classmethod
    def get_supported_backends(cls) -> tuple[str, ...]:
        return ("serial", "multiprocessing")

    def __init__(self, ag: Any, **kw: Any) -> None:
        super().__init__(ag.universe.trajectory, **kw)
        self.ag = ag

    def _prepare(self) -> None:
        self.results.x = np.zeros(self.n_frames)
        if rank == 1 and self.extra is not None:
            self.results.extra = self.extra

    def _single_frame(self) -> None:
        self.results.x[self._frame_index] = self.ag.positions[0, 0]

    def _get_aggregator(self) -> ResultsGroup:
        return ResultsGroup(lookup={"x": ResultsGroup.ndarray_hstack})


res: dict[str, Any] = {}
for case, extra in (("pickle", lambda: None), ("unpickle", Unloadable())):
    Odd.extra = extra
    try:
        analyze(AnalysisBaseAdapter(Odd, select="name CA"), dcd, psf, backend="mpi")
        res[case] = None
    except BaseException as exc:  # noqa: BLE001 - what each rank raised is the result
        res[case] = [type(exc).__name__, str(exc)]
Odd.extra = None
run = analyze(AnalysisBaseAdapter(Odd, select="name CA"), dcd, psf, backend="mpi")
res["after"] = None if run is None else len(run.frames)

with open(f"{outdir}/unpicklable{rank}.json", "w") as fh:
    json.dump(res, fh)
