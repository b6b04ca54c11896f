"""Run under ``mpiexec -n N``: the correctness and bad-input checks of one launch.

Arguments: PSF DCD H5 OUTDIR. Every rank writes OUTDIR/rank<R>.json.
"""

from __future__ import annotations

import json
import sys
import warnings

warnings.simplefilter("ignore")

from mpi4py import MPI  # noqa: E402

from instride.parallel import ADK_CORE_CA, AnalysisBaseAdapter, analyze  # noqa: E402

psf, dcd, h5, outdir = sys.argv[1:5]
comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
res: dict = {"rank": rank, "size": size, "rmsd": {}, "timing": {}, "none_on_rank": {},
             "errors": {}}

for name, traj in (("dcd", dcd), ("h5md", h5), ("stream", "instride://adk")):
    run = analyze("rmsd", traj, psf, backend="mpi", timeout=60,
                  baseline="serial" if name == "dcd" else None)
    res["none_on_rank"][name] = run is None
    if run is not None:
        res["rmsd"][name] = run.data["rmsd"].tolist()
        res["frames"] = run.frames.tolist()
        res["timing"][name] = run.timing.to_dict()

if size == 2:  # an MDAnalysis AnalysisBase class through the adapter, over MPI
    run = analyze(AnalysisBaseAdapter("MDAnalysis.analysis.rms:RMSD", select=ADK_CORE_CA),
                  h5, psf, backend="mpi")
    if run is not None:
        res["adapter"] = run.result_object.results.rmsd.tolist()


def error_of(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # the type name is what the test checks, on every rank
        return type(exc).__name__
    return None


res["errors"]["selection"] = error_of(
    lambda: analyze("rmsd", dcd, psf, select="name NOPE", backend="mpi"))
res["errors"]["missing"] = error_of(
    lambda: analyze("rmsd", outdir + "/missing.dcd", psf, backend="mpi"))
if size > 1:
    res["errors"]["more_ranks_than_frames"] = error_of(
        lambda: analyze("rmsd", "instride://one", psf, backend="mpi", timeout=60))
    res["errors"]["workers_mismatch"] = error_of(
        lambda: analyze("rmsd", dcd, psf, backend="mpi", workers=size + 1))

with open(f"{outdir}/rank{rank}.json", "w") as fh:
    json.dump(res, fh)
