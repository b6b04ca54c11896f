"""An unmodified MDAnalysis ``imd://`` reader, run as its own process by the IMD tests.

Usage: ``python imd_reader.py TOPOLOGY imd://HOST:PORT OUT.npz [select=SEL] [universe
keyword=value ...]``. Iterates the whole stream and saves, per frame: positions (all atoms),
time, step, dt, dimensions, the radius of gyration of the selection (default: all atoms) and
its RMSD (MDAnalysis.analysis.rms.rmsd, superposed) to the first frame received.
"""

from __future__ import annotations

import sys

import MDAnalysis as mda
import numpy as np
from MDAnalysis.analysis import rms


def main(argv: list[str]) -> None:
    top, url, out, *extra = argv
    kwargs = dict(item.split("=", 1) for item in extra)
    select = kwargs.pop("select", "all")
    u = mda.Universe(top, url, **kwargs)
    sel = u.select_atoms(select)
    pos, times, steps, dts, dims, rg, rmsd = [], [], [], [], [], [], []
    for ts in u.trajectory:
        pos.append(u.atoms.positions.copy())
        times.append(ts.time)
        steps.append(ts.data.get("step", -1))
        dts.append(ts.data.get("dt", np.nan))
        dims.append(np.zeros(6) if ts.dimensions is None else ts.dimensions.copy())
        rg.append(sel.radius_of_gyration())
        rmsd.append(rms.rmsd(sel.positions, pos[0][sel.indices], superposition=True))
    np.savez(out, positions=np.array(pos), time=np.array(times), step=np.array(steps),
             dt=np.array(dts), dimensions=np.array(dims), rg=np.array(rg), rmsd=np.array(rmsd))
    print(f"{len(pos)} frames")


if __name__ == "__main__":
    main(sys.argv[1:])
