"""Run under ``mpiexec -n 2``: rank 1 fails in several ways; every rank records what it raised.

Arguments: TOPOLOGY H5MD OUTDIR. Rank R writes OUTDIR/failures<R>.json: for each case, the
type name of the error the rank raised and its message (``"original"`` when the failing rank
raised the very object that failed it).
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

warnings.simplefilter("ignore")

from mpi4py import MPI  # noqa: E402

from instride import ConsumeTimeout  # noqa: E402
from instride.analytics.gyration import RadiusOfGyration  # noqa: E402
from instride.parallel import FrameAnalysisAdapter, analyze  # noqa: E402

top, h5, outdir = sys.argv[1:4]
rank = MPI.COMM_WORLD.rank


class Unpicklable(Exception):
    """Pickles, but cannot be rebuilt (its arguments are not its ``args``)."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a} {b}")


class FailOnRank1(FrameAnalysisAdapter):
    """Raises ``error`` in rank 1's setup."""

    error: BaseException | None = None

    def setup(self, source: Any) -> None:
        super().setup(source)
        if rank == 1 and self.error is not None:
            raise self.error


res: dict[str, Any] = {}
for case, error in (("timeout", ConsumeTimeout("k", 2.5)), ("unpicklable", Unpicklable(1, 2)),
                    ("KeyboardInterrupt", KeyboardInterrupt()), ("SystemExit", SystemExit(7))):
    ana = FailOnRank1(RadiusOfGyration, select="all")
    ana.error = error
    try:
        analyze(ana, h5, top, backend="mpi")
        res[case] = None
    except BaseException as exc:  # noqa: BLE001 - what each rank raised is the result
        res[case] = [type(exc).__name__, "original" if exc is error else str(exc)]

run = analyze(FrameAnalysisAdapter(RadiusOfGyration, select="all"), h5, top, backend="mpi")
res["after"] = None if run is None else run.times.tolist()

with open(f"{outdir}/failures{rank}.json", "w") as fh:
    json.dump(res, fh)
