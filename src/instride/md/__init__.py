"""Producers: real MD engines writing frames into instride streams.

* :class:`instride.md.openmm.FrameReporter` — an OpenMM reporter publishing every N steps;
* :mod:`instride.md.imd_bridge` — a bridge that receives frames from an unmodified engine
  (GROMACS, LAMMPS) over its IMD socket, v2 or v3, and publishes them
  (``instride imd-bridge HOST:PORT STREAM``);
* :mod:`instride.md.imd_server` — an IMD v3 server over a stream, for any number of unmodified
  ``imd://`` clients such as MDAnalysis (``instride imd-serve STREAM --port P``);
* :mod:`instride.md.imd_protocol` — the IMD wire format (v2 and v3) the server speaks;
* :mod:`instride.md.demo` — ``instride demo``: two OpenMM replicas, each with a concurrent
  analytics consumer, compared with a node-local file system plus explicit barriers.

OpenMM is imported only when :class:`FrameReporter` is used.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FrameReporter", "make_simulation"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import openmm

        return getattr(openmm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
