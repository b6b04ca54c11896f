"""Ready-made MD modules: an OpenMM simulation that can be steered, and small analyses.

:func:`openmm_producer` is FlowVR's instrumented simulation loop: it advances OpenMM by
``interval`` steps, ``put``\\ s the positions on its ``frames`` port stamped with the MD step,
and reads its non-blocking ``control`` port between chunks: ``{"interval": n}`` changes the
output interval, ``{"stop": true}`` ends the run early (its stream then ends and the rest of the
graph finishes). Wire it with::

    sim = g.module("sim", openmm_producer, outputs={"frames": "frame"},
                   inputs={"control": Input("json", blocking=False)},
                   params={"steps": 2000, "interval": 100})
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

from .ports import Ports

__all__ = ["gyration", "openmm_producer", "protein_indices", "radius_of_gyration", "rmsd"]


def protein_indices(topology: Any) -> np.ndarray:
    """Indices of the atoms of standard amino-acid residues in an OpenMM topology."""
    amino = {
        "ALA", "ARG", "ASN", "ASP", "CYS", "GLN", "GLU", "GLY", "HIS", "ILE", "LEU", "LYS",
        "MET", "PHE", "PRO", "SER", "THR", "TRP", "TYR", "VAL", "ACE", "NME", "NLE", "HID",
        "HIE", "HIP",
    }
    return np.array([a.index for a in topology.atoms() if a.residue.name in amino],
                    dtype=np.intp)


def radius_of_gyration(positions: np.ndarray) -> float:
    """Radius of gyration (unweighted) of a set of positions."""
    centred = positions - positions.mean(axis=0)
    return float(np.sqrt((centred**2).sum(axis=1).mean()))


def rmsd(a: np.ndarray, b: np.ndarray) -> float:
    """RMSD after optimal superposition (Kabsch) of two ``(n, 3)`` position sets."""
    a = a - a.mean(axis=0)
    b = b - b.mean(axis=0)
    u, s, vt = np.linalg.svd(a.T @ b)
    d = np.sign(np.linalg.det(u @ vt))
    s[-1] *= d
    e = (a**2).sum() + (b**2).sum() - 2 * s.sum()
    return float(np.sqrt(max(e, 0.0) / len(a)))


def openmm_producer(
    ports: Ports,
    steps: int = 1000,
    interval: int = 100,
    pdb: str | None = None,
    threads: int = 1,
    protein_only: bool = True,
    seed: int | None = None,
) -> None:
    """A steerable OpenMM simulation (module function).

    Ports: output ``frames`` (frame), optional non-blocking input ``control`` (json).
    Each instance runs its own replica (seed = ``seed`` or instance + 1). With ``out_dir``
    set it writes ``<module>-<instance>.json``: the steps it published, the interval in force
    at each, the control messages it obeyed, and the seconds of its loop, of MD
    (``step`` + ``getState``) and of ``put``.

    Parameters
    ----------
    steps
        MD steps to run at most.
    interval
        Steps between two published frames (changed by ``{"interval": n}``).
    pdb
        Solvated PDB (default: OpenMM's villin headpiece, 8,867 atoms).
    threads
        CPU threads of OpenMM.
    protein_only
        Publish only the protein atoms (the analyses' input; 10x smaller frames).
    seed
        Random seed (default: instance + 1).
    """
    from openmm import unit

    from ..md.openmm import make_simulation

    sim = make_simulation(pdb, seed=seed or ports.instance + 1, threads=threads)
    atoms = protein_indices(sim.topology) if protein_only else None
    log: dict[str, Any] = {"published": [], "controls": [], "md_seconds": 0.0}
    start, cpu = time.perf_counter(), time.process_time()
    while sim.currentStep < steps:
        ctl = ports.get("control") if "control" in ports.readers else None
        if ctl is not None:
            log["controls"].append([sim.currentStep, ctl.data])
            if ctl.data.get("stop"):
                break
            if "interval" in ctl.data:
                interval = max(1, int(ctl.data["interval"]))
        t0 = time.perf_counter()
        sim.step(min(interval, steps - sim.currentStep))
        state = sim.context.getState(getPositions=True, enforcePeriodicBox=False)
        log["md_seconds"] += time.perf_counter() - t0
        pos = state.getPositions(asNumpy=True).value_in_unit(unit.angstrom)
        if atoms is not None:
            pos = pos[atoms]
        box = state.getPeriodicBoxVectors(asNumpy=True).value_in_unit(unit.angstrom)
        ports.put("frames", np.asarray(pos, dtype=np.float32), step=int(sim.currentStep),
                  time=float(state.getTime().value_in_unit(unit.picosecond)), box=box)
        log["published"].append([int(sim.currentStep), interval])
    log["loop_seconds"] = time.perf_counter() - start
    log["loop_cpu_seconds"] = time.process_time() - cpu
    log["put_seconds"] = ports.recorder.seconds["put"]
    if ports.out_dir is not None:
        path = ports.out_dir / f"{ports.module}-{ports.instance}.json"
        path.write_text(json.dumps(log))


def gyration(ports: Ports) -> None:
    """Per-frame radius of gyration: ``frames`` (frame) -> ``rg`` (array ``[rg]``)."""
    while ports.wait():
        msg = ports.get("frames")
        ports.put("rg", np.array([radius_of_gyration(msg.data)]), step=msg.step, time=msg.time)
