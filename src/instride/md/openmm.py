"""OpenMM producer: a reporter that publishes frames into an instride stream.

:class:`FrameReporter` is an ordinary OpenMM reporter. Every ``interval`` steps it takes the
positions and box vectors of the state OpenMM hands it, converts them to Å (the convention of
:mod:`instride.frames` and MDAnalysis) and appends them to a :class:`instride.Stream` together
with the step and the simulation time in ps. Consumers (``instride.Stream`` iteration, or
``MDAnalysis.Universe(topology, "instride://NAME")``) get each frame the moment it is published.

**End of stream.** OpenMM has no "simulation finished" hook: ``Simulation.step(n)`` simply
returns. The stream is therefore ended explicitly, in one of two ways:

* call :meth:`FrameReporter.close` after the last ``simulation.step(...)``, or
* use the reporter as a context manager; leaving the ``with`` block normally ends the stream.
  Leaving it with an exception does *not* publish end-of-stream (a crashed run must not look
  complete): consumers then stop with :class:`~instride.errors.ConsumeTimeout` when their
  timeout expires, instead of silently seeing a short trajectory.

Examples
--------
>>> from openmm.app import Simulation                          # doctest: +SKIP
>>> from instride.md.openmm import FrameReporter
>>> with FrameReporter("run7", interval=100) as reporter:
...     simulation.reporters.append(reporter)
...     simulation.step(10_000)
# end-of-stream is published here; consumers' loops finish
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from .. import Stream
from ..errors import ConfigError
from ..frames import frame_size

__all__ = ["FrameReporter", "make_simulation", "villin_pdb"]


class FrameReporter:
    """An OpenMM reporter that publishes positions and box vectors into an instride stream.

    Parameters
    ----------
    stream
        An :class:`instride.Stream` (opened for writing or undecided) or a stream name; a name
        is opened as ``Stream(name, mode="w", layout=layout, overwrite=overwrite)``.
    interval
        Publish a frame every ``interval`` steps (at steps ``interval``, ``2*interval`` ...,
        like OpenMM's ``DCDReporter``).
    layout
        Frame layout for a stream opened by name: ``"xyz32"`` (default) or ``"paper"``.
    enforce_periodic_box
        Passed to OpenMM as the reporter's ``periodic`` request: ``None`` (default, as
        ``DCDReporter``) wraps molecules into the box when the system is periodic; ``False``
        reports unwrapped positions.
    atom_indices
        Publish only these atoms (default: all), atom numbers from 0: a negative one, or one
        past the system's atoms (found at the first report, before it publishes), is a
        :class:`~instride.errors.ConfigError`. The consumer's topology must match.
    overwrite
        Replace the frames of an earlier stream of the same name (stream opened by name only).

    Attributes
    ----------
    frames : int
        Frames published so far.
    bytes : int
        Bytes published so far (frame files, header included).
    publish_seconds : float
        Wall time spent inside :meth:`report` (unit conversion + publication): the producer
        overhead instride adds to the simulation, excluding OpenMM's own ``getState``.

    Notes
    -----
    Positions are published in Å, box vectors in Å (3 x 3, rows are the vectors ``a, b, c``),
    time in ps, and the step is ``simulation.currentStep``. End the stream with
    :meth:`close` or a ``with`` block (see the module documentation).
    """

    def __init__(
        self,
        stream: Stream | str,
        interval: int,
        *,
        layout: str = "xyz32",
        enforce_periodic_box: bool | None = None,
        atom_indices: np.ndarray | list[int] | None = None,
        overwrite: bool = False,
    ) -> None:
        # (a whole number: inf was a bare OverflowError, True an interval of 1)
        if isinstance(interval, bool) or not isinstance(interval, int | np.integer) \
                or interval < 1:
            raise ValueError(f"interval must be a positive integer, got {interval!r}")
        self.interval = int(interval)
        # (checked first: a negative index wrapped round to another atom without a word; none
        # at all published frames of no atom)
        indices = None if atom_indices is None else np.asarray(atom_indices)
        if indices is not None and (indices.ndim != 1 or not np.issubdtype(indices.dtype, np.integer)
                                    or (indices < 0).any() or indices.size == 0):
            shown = atom_indices if indices.size < 8 else f"{indices.size} values"
            raise ConfigError("atom_indices", shown,
                              "expected atom numbers, 0 or more, in one dimension, at least one")
        if isinstance(stream, Stream):
            self.stream = stream
        else:
            self.stream = Stream(str(stream), mode="w", layout=layout, overwrite=overwrite)
        if self.stream.mode == "r":
            raise ValueError(f"stream {self.stream.name!r} was opened for reading")
        self.enforce_periodic_box = enforce_periodic_box
        self.atom_indices = None if indices is None else indices.astype(np.intp)
        self.frames = 0
        self.bytes = 0
        self.publish_seconds = 0.0
        self._periodic: bool | None = None
        self._closed = False

    # ------------------------------------------------------------------ OpenMM protocol
    def describeNextReport(  # noqa: N802 - OpenMM's reporter protocol
        self, simulation: Any
    ) -> tuple[int, bool, bool, bool, bool, bool | None]:
        """Tell OpenMM when the next report is due and that it needs positions.

        Returns the tuple form ``(steps, positions, velocities, forces, energies, periodic)``,
        which every OpenMM 8 release accepts.
        """
        steps = self.interval - simulation.currentStep % self.interval
        return (steps, True, False, False, False, self.enforce_periodic_box)

    def report(self, simulation: Any, state: Any) -> None:
        """Publish the positions and box of ``state`` as the next frame of the stream."""
        from openmm import unit

        if self._closed:
            raise ValueError(f"FrameReporter for stream {self.stream.name!r} is closed")
        t0 = time.perf_counter()
        positions = state.getPositions(asNumpy=True).value_in_unit(unit.angstrom)
        if self.atom_indices is not None:
            if self.frames == 0 and self.atom_indices.size \
                    and int(self.atom_indices.max()) >= len(positions):
                raise ConfigError("atom_indices", int(self.atom_indices.max()),
                                  f"the system has {len(positions)} atoms (nothing published)")
            positions = positions[self.atom_indices]
        if self._periodic is None:
            self._periodic = bool(simulation.system.usesPeriodicBoundaryConditions())
        box = None
        if self._periodic:
            box = state.getPeriodicBoxVectors(asNumpy=True).value_in_unit(unit.angstrom)
        self.stream.append(
            positions,
            step=int(simulation.currentStep),
            # OpenMM accumulates time as a float sum of steps (0.020000000000000004 ps): round
            # to a femtosecond's millionth so tables and plots show 0.02
            time=round(float(state.getTime().value_in_unit(unit.picosecond)), 9),
            box=box,
        )
        self.frames += 1
        self.bytes += frame_size(len(positions), self.stream.layout)
        self.publish_seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ end of stream
    def close(self) -> None:
        """End the stream: publish end-of-stream so consumers' iterations finish. Idempotent.
        If that fails (e.g. :class:`~instride.MetadataUnavailable`) the reporter stays open:
        ``close()`` again, or :meth:`abort`."""
        if self._closed:
            return
        t0 = time.perf_counter()
        self.stream.close()
        self._closed = True
        self.publish_seconds += time.perf_counter() - t0

    def abort(self) -> None:
        """Stop reporting without publishing end-of-stream (the run did not complete): the
        stream is abandoned (:meth:`instride.Stream.abandon`: its frames stay, what the
        producer holds is released). Idempotent; nothing happens after :meth:`close`."""
        if self._closed:
            return
        self._closed = True
        self.stream.abandon()

    def __enter__(self) -> FrameReporter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            try:
                self.close()
            except BaseException:
                self.abort()  # (the block is over: nothing can close it again)
                raise
        else:
            self.abort()

    def __repr__(self) -> str:
        return (
            f"FrameReporter({self.stream.name!r}, interval={self.interval}, frames={self.frames})"
        )


def villin_pdb() -> Path:
    """Path of the solvated villin headpiece that ships with OpenMM (8,867 atoms).

    ``openmm/app/data/test.pdb``: villin HP35 (N68H) in TIP3P water, 35 residues, three
    helices (residues 3-10, 14-19, 22-32 in the file's numbering).
    """
    import openmm.app

    return Path(os.path.dirname(openmm.app.__file__)) / "data" / "test.pdb"


def make_simulation(
    pdb: str | os.PathLike[str] | None = None,
    *,
    seed: int = 1,
    threads: int = 1,
    temperature: float = 300.0,
    timestep_fs: float = 2.0,
    platform: str = "CPU",
    deterministic: bool = False,
    properties: dict[str, str] | None = None,
) -> Any:
    """Build an OpenMM ``Simulation`` of a solvated PDB (default: :func:`villin_pdb`).

    Amber14 + TIP3P-FB, PME with a 1 nm cutoff, constraints on bonds to hydrogen, a Langevin
    middle integrator at ``temperature`` K with a 1/ps friction and a ``timestep_fs`` step.
    Velocities are drawn from ``seed`` and the integrator's random stream uses ``seed`` too,
    so two replicas with different seeds diverge.

    Parameters
    ----------
    pdb
        A solvated PDB file with a periodic box (CRYST1).
    seed
        Random seed (> 0) for velocities and the thermostat.
    threads
        CPU threads of the ``CPU`` platform.
    temperature, timestep_fs
        Thermostat temperature (K) and time step (fs).
    platform
        OpenMM platform name.
    deterministic
        Ask the ``CPU`` platform for deterministic forces (``DeterministicForces``): the same
        seed and thread count then give the same trajectory bit for bit, run after run.
        Without it, the order of the platform's float sums may change between runs, and MD's
        chaotic dynamics amplify that round-off (0.1 Å RMSD apart after 3 ps of villin).
    properties
        Further platform properties, e.g. ``{"Precision": "mixed"}`` for ``CUDA`` or
        ``OpenCL``; they override ``Threads`` and ``DeterministicForces``.

    Returns
    -------
    openmm.app.Simulation
    """
    import openmm
    from openmm import app, unit

    pdbfile = app.PDBFile(os.fspath(pdb or villin_pdb()))
    forcefield = app.ForceField("amber14-all.xml", "amber14/tip3pfb.xml")
    system = forcefield.createSystem(
        pdbfile.topology,
        nonbondedMethod=app.PME,
        nonbondedCutoff=1.0 * unit.nanometer,
        constraints=app.HBonds,
    )
    integrator = openmm.LangevinMiddleIntegrator(
        temperature * unit.kelvin, 1.0 / unit.picosecond, timestep_fs * unit.femtoseconds
    )
    integrator.setRandomNumberSeed(int(seed))
    plat = openmm.Platform.getPlatformByName(platform)
    props = {"Threads": str(int(threads))} if platform == "CPU" else {}
    if deterministic and platform == "CPU":
        props["DeterministicForces"] = "true"
    props.update(properties or {})
    simulation = app.Simulation(pdbfile.topology, system, integrator, plat, props)
    simulation.context.setPositions(pdbfile.positions)
    simulation.context.setVelocitiesToTemperature(temperature * unit.kelvin, int(seed))
    return simulation
