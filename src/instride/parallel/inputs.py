"""Trajectory sources for split-apply-combine analysis.

Three kinds of input, one small contract (:class:`FrameSource`): the number of frames and atoms,
an MDAnalysis :class:`~MDAnalysis.core.universe.Universe` for atom selections whose current
positions are the frame being analysed, random access to one frame's positions
(:meth:`FrameSource.read`) and sequential loading of a contiguous block of frames into that
universe (:meth:`FrameSource.iter_block`), so that :mod:`instride.analytics`' analyses run
unchanged on every input. Each rank opens its own source, so the time to open it is
that rank's ``t_open``.

* ``instride://NAME`` (or :class:`SourceSpec` with ``kind="stream"``): an instride stream. Frames
  are read with the public API (:class:`instride.Stream`), so a stream produced on another node
  is fetched from its owner in cluster mode. Split-apply-combine needs the total frame count,
  so a stream is analysed once its producer has closed it (the rank waits for the end marker,
  up to ``timeout``).
* an H5MD file (``.h5``, ``.h5md``, ``.hdf5`` with an ``h5md`` group): read with h5py, every
  rank opening the file independently and reading only its own slice of
  ``particles/<group>/position/value``. Parallel HDF5 (the ``mpio`` driver) is not needed for
  independent reads of a file nobody writes; it matters for collective writes and for
  metadata-heavy access on a parallel file system, which this analysis does not do.
  Positions and box edges are converted to Å and times to ps from their ``unit`` attributes
  (a position or time dataset without one is refused, as MDAnalysis's H5MD reader does);
  a scalar ``time`` dataset is H5MD 1.1's fixed interval (time of frame ``i`` =
  ``offset + i * time``); without a ``time`` dataset, a frame's time is its index.
* anything else: a trajectory MDAnalysis reads (DCD, XTC, TRR, ...) with ``topology``.

Every source sets the universe's ``dimensions`` from each frame's box (``None`` for a frame
without one), as MDAnalysis's readers do.

Examples
--------
>>> from MDAnalysisTests.datafiles import PSF, DCD        # doctest: +SKIP
>>> src = open_source(source_spec(DCD, PSF))              # doctest: +SKIP
>>> src.n_frames, src.n_atoms                             # doctest: +SKIP
(98, 3341)
"""

from __future__ import annotations

import abc
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import Stream
from ..analytics.reader import SCHEME, stream_name, wait_for_end
from ..errors import InstrideError
from .analysis_errors import SelectionError, TrajectoryNotFoundError, UnsupportedInputError

H5MD_SUFFIXES = (".h5", ".h5md", ".hdf5", ".hdf")

#: H5MD length units (https://nongnu.org/h5md/modules/units.html) -> Å per unit.
LENGTH_UNITS = {"nm": 10.0, "Angstrom": 1.0, "angstrom": 1.0, "A": 1.0, "pm": 0.01}
#: H5MD time units -> ps per unit.
TIME_UNITS = {"fs": 1e-3, "ps": 1.0, "ns": 1e3, "s": 1e12, "second": 1e12, "sec": 1e12}

#: Cα atoms of the adenylate kinase CORE domain (146 atoms): the RMSD selection of the paper.
ADK_CORE_CA = "name CA and (resid 1-29 or resid 60-121 or resid 160-214)"


@dataclass(frozen=True)
class SourceSpec:
    """What to open: a picklable description every rank turns into a :class:`FrameSource`.

    Parameters
    ----------
    trajectory
        ``instride://NAME``, an H5MD file or any trajectory file MDAnalysis reads.
    topology
        Topology file (PSF, PDB, GRO, ...) for atom selections and masses.
    kind
        ``"stream"``, ``"h5md"`` or ``"mdanalysis"``; see :func:`source_spec`.
    timeout
        Seconds to wait for a stream's frames and end marker (default: ``INSTRIDE_TIMEOUT``).
    """

    trajectory: str
    topology: str | None
    kind: str
    timeout: float | None = None

    @property
    def stream_name(self) -> str:
        """The stream name of a ``kind="stream"`` source."""
        t = self.trajectory
        return stream_name(t) if t.startswith(SCHEME) else t


def _is_h5md(path: Path) -> bool:
    if path.suffix.lower() not in H5MD_SUFFIXES:
        return False
    import h5py

    try:
        with h5py.File(path, "r") as f:
            return "h5md" in f and "particles" in f
    except OSError as exc:
        raise UnsupportedInputError(str(path), f"not a readable HDF5 file ({exc})") from None


def source_spec(
    trajectory: str | os.PathLike[str],
    topology: str | os.PathLike[str] | None = None,
    *,
    timeout: float | None = None,
) -> SourceSpec:
    """Classify and check an input; return its :class:`SourceSpec`.

    Parameters
    ----------
    trajectory
        ``instride://NAME`` for a stream, else a file path.
    topology
        Topology file; required for H5MD and stream inputs (they carry no atom names).
    timeout
        Seconds a stream reader waits for frames.

    Raises
    ------
    TrajectoryNotFoundError
        A named file does not exist.
    UnsupportedInputError
        An ``.h5`` file that is not H5MD, or a stream/H5MD input without a topology.
    """
    traj = os.fspath(trajectory)
    top = None if topology is None else os.fspath(topology)
    if top is not None and not Path(top).exists():
        raise TrajectoryNotFoundError(top, "topology")
    if traj.startswith(SCHEME):
        kind = "stream"
        if not traj[len(SCHEME):].strip("/"):
            raise UnsupportedInputError(traj, "empty stream name")
    else:
        path = Path(traj)
        if not path.exists():
            raise TrajectoryNotFoundError(traj)
        if path.suffix.lower() in H5MD_SUFFIXES:
            if not _is_h5md(path):
                raise UnsupportedInputError(traj, "HDF5 file without the H5MD 'h5md' and "
                                            "'particles' groups")
            kind = "h5md"
        else:
            kind = "mdanalysis"
    if top is None:
        raise UnsupportedInputError(traj, "a topology file is needed (--topology)")
    return SourceSpec(traj, top, kind, timeout)


def frame_universe(spec: SourceSpec, n_atoms: int) -> Any:
    """The topology of ``spec`` with a one-frame in-memory trajectory that sources fill.

    Raises
    ------
    UnsupportedInputError
        The topology's atom count is not ``n_atoms``.
    """
    import MDAnalysis as mda
    from MDAnalysis.coordinates.memory import MemoryReader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "No coordinate reader found" for a PSF alone
        u = mda.Universe(spec.topology)
    _check_atoms(spec, u, n_atoms)
    u.load_new(np.zeros((1, n_atoms, 3), dtype=np.float32), format=MemoryReader)
    return u


def box_dimensions(edges: np.ndarray) -> np.ndarray:
    """MDAnalysis ``dimensions`` ``[a, b, c, alpha, beta, gamma]`` of H5MD box ``edges``.

    ``edges`` is a 3-vector (the space diagonal of a cuboid) or a 3 × 3 matrix whose rows are
    the box vectors (Å).
    """
    from MDAnalysis.lib.mdamath import triclinic_box

    edges = np.asarray(edges, dtype=np.float64)
    if edges.shape == (3,):
        return np.array([*edges, 90.0, 90.0, 90.0], dtype=np.float32)
    return triclinic_box(*edges)


class FrameSource(abc.ABC):
    """Base class of trajectory sources: what an analysis rank reads.

    Subclasses set :attr:`n_frames`, :attr:`n_atoms` and implement :meth:`read`,
    :meth:`iter_block` and :meth:`universe`. Frames are loaded into the universe's current
    timestep, where AtomGroups (and so every :mod:`instride.analytics` analysis) see them.
    """

    spec: SourceSpec
    n_frames: int
    n_atoms: int

    @abc.abstractmethod
    def universe(self) -> Any:
        """The MDAnalysis Universe of this source (selections, masses, current positions)."""

    @abc.abstractmethod
    def read(self, index: int) -> np.ndarray:
        """Positions (Å, ``(n_atoms, 3)``) of frame ``index`` (a copy)."""

    @abc.abstractmethod
    def iter_block(self, start: int, stop: int) -> Iterator[tuple[int, float]]:
        """Load frames ``start <= frame < stop`` in order into :meth:`universe`.

        Yields ``(frame, time)`` once the frame's positions are the universe's current ones
        (``universe().atoms.positions``); they are replaced by the next frame's.
        """

    def close(self) -> None:  # noqa: B027 - optional hook; sources with nothing to release
        """Release files and handles."""

    def __enter__(self) -> FrameSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def select(self, selection: str) -> Any:
        """The AtomGroup of ``selection``; :class:`SelectionError` if it matches no atoms."""
        try:
            group = self.universe().select_atoms(selection)
        except Exception as exc:  # MDAnalysis raises SelectionError/ValueError/KeyError
            raise SelectionError(selection, f"cannot be parsed: {exc}") from None
        if group.n_atoms == 0:
            raise SelectionError(selection)
        return group

    def _check_index(self, index: int) -> int:
        if not -self.n_frames <= index < self.n_frames:
            raise UnsupportedInputError(
                self.spec.trajectory, f"frame {index} out of range (0..{self.n_frames - 1})"
            )
        return index % self.n_frames


class MDAnalysisSource(FrameSource):
    """Any trajectory MDAnalysis reads, opened as ``Universe(topology, trajectory)``."""

    def __init__(self, spec: SourceSpec) -> None:
        import MDAnalysis as mda

        self.spec = spec
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                if spec.kind == "h5md":  # MDAnalysis's own H5MD reader, whatever the suffix
                    self._u = mda.Universe(spec.topology, spec.trajectory, format="H5MD")
                elif spec.kind == "stream":
                    import instride.analytics  # noqa: F401 - registers the instride:// reader

                    # post-hoc analysis splits the whole stream: wait for its end (up to
                    # the timeout: ConsumeTimeout)
                    self._u = mda.Universe(spec.topology, spec.trajectory, length="final",
                                           timeout=spec.timeout)
                else:
                    self._u = mda.Universe(spec.topology, spec.trajectory)
        except InstrideError:  # typed already (ConsumeTimeout, EndOfStream, ...)
            raise
        except (ValueError, OSError, TypeError, KeyError, IndexError) as exc:
            # (KeyError: h5py's, for an H5MD dataset MDAnalysis's reader needs, such as
            # position/time, that the file lacks)
            hint = ""
            raise UnsupportedInputError(
                spec.trajectory, f"MDAnalysis cannot read it: {str(exc).splitlines()[0]}{hint}"
            ) from None
        self.n_frames = self._u.trajectory.n_frames
        self.n_atoms = self._u.atoms.n_atoms

    def universe(self) -> Any:
        return self._u

    def read(self, index: int) -> np.ndarray:
        return self._u.trajectory[self._check_index(index)].positions.copy()

    def iter_block(self, start: int, stop: int) -> Iterator[tuple[int, float]]:
        for ts in self._u.trajectory[start:stop]:
            yield ts.frame, ts.time

    def close(self) -> None:
        self._u.trajectory.close()


class H5MDSource(FrameSource):
    """An H5MD file read with h5py, independently by every rank (no MPI-IO, no ``mpio``)."""

    def __init__(self, spec: SourceSpec) -> None:
        import h5py

        from .h5md import position_group

        self.spec = spec
        self._file = h5py.File(spec.trajectory, "r")
        try:
            group = position_group(self._file)
        except KeyError as exc:
            self._file.close()
            raise UnsupportedInputError(spec.trajectory, str(exc)) from None
        try:
            self._value = group["value"]
            if self._value.ndim != 3 or self._value.shape[2] != 3:
                raise UnsupportedInputError(spec.trajectory, f"{self._value.name} of shape "
                                            f"{self._value.shape}: not (frames, atoms, 3)")
            self.n_frames, self.n_atoms = int(self._value.shape[0]), int(self._value.shape[1])
            self._scale = self._unit(self._value, LENGTH_UNITS, "length")
            self._time = group.get("time")
            self._time_scale = 1.0
            if self._time is not None:
                self._time_scale = self._unit(self._time, TIME_UNITS, "time")
                if self._time.shape != () and self._time.shape[0] < self.n_frames:
                    raise UnsupportedInputError(
                        spec.trajectory, f"{self._time.name} holds {self._time.shape[0]} "
                        f"times for {self.n_frames} frames")
            self._step = group.get("step")
            if self._step is not None and self._step.shape != () \
                    and self._step.shape[0] < self.n_frames:
                raise UnsupportedInputError(
                    spec.trajectory, f"{self._step.name} holds {self._step.shape[0]} steps "
                    f"for {self.n_frames} frames")
            self._box, self._edges = self._open_box(group.parent)
            self._u = frame_universe(spec, self.n_atoms)
        except BaseException:
            self._file.close()
            raise

    def _unit(self, ds: Any, table: dict[str, float], what: str) -> float:
        """The factor from the ``unit`` attribute of ``ds`` to Å or ps."""
        unit = ds.attrs.get("unit")
        if unit is None:
            raise UnsupportedInputError(
                self.spec.trajectory, f"{ds.name} has no 'unit' attribute: its {what} unit is "
                "unknown (H5MD files without units are refused, as by MDAnalysis)")
        unit = unit.decode() if isinstance(unit, bytes) else str(unit)
        try:
            return table[unit]
        except KeyError:
            raise UnsupportedInputError(
                self.spec.trajectory, f"unknown {what} unit {unit!r} of {ds.name} "
                f"(known: {', '.join(table)})") from None

    def _open_box(self, particles: Any) -> tuple[np.ndarray | None, Any]:
        """``(dimensions of a fixed box, None)``, ``(None, time-dependent edges dataset)``, or
        ``(None, None)`` without box edges."""
        import h5py

        box = particles.get("box")
        edges = None if box is None else box.get("edges")
        if edges is None:
            return None, None
        value = edges.get("value") if isinstance(edges, h5py.Group) else edges
        if not isinstance(value, h5py.Dataset):
            raise UnsupportedInputError(self.spec.trajectory,
                                        f"{edges.name} is a group without a 'value' dataset")
        fixed = not isinstance(edges, h5py.Group)
        shape = value.shape if fixed else value.shape[1:]
        if shape not in ((3,), (3, 3)):
            raise UnsupportedInputError(self.spec.trajectory, f"box edges {value.name} of "
                                        f"shape {value.shape}: only 3-D boxes are supported")
        scale = self._unit(value, LENGTH_UNITS, "length")
        if fixed:
            return box_dimensions(value[()] * scale), None
        if value.shape[0] < self.n_frames:
            raise UnsupportedInputError(self.spec.trajectory, f"{value.name} holds "
                                        f"{value.shape[0]} boxes for {self.n_frames} frames")
        self._edges_scale = scale
        return None, value

    def _times(self, start: int, stop: int) -> np.ndarray:
        """Times (ps) of frames ``start <= frame < stop``."""
        if self._time is None:
            return np.arange(start, stop, dtype=np.float64)
        if self._time.shape == ():  # H5MD 1.1 fixed interval: time = offset + i * interval
            offset = float(self._time.attrs.get("offset", 0.0))
            t = offset + np.arange(start, stop, dtype=np.float64) * float(self._time[()])
        else:
            t = np.asarray(self._time[start:stop], dtype=np.float64)
        return t * self._time_scale

    def _steps(self, start: int, stop: int) -> np.ndarray | None:
        """MD steps of frames ``start <= frame < stop``; ``None`` without a ``step``
        dataset."""
        if self._step is None:
            return None
        if self._step.shape == ():  # H5MD 1.1 fixed interval: step = offset + i * interval
            offset = int(self._step.attrs.get("offset", 0))
            return offset + np.arange(start, stop, dtype=np.int64) * int(self._step[()])
        return np.asarray(self._step[start:stop], dtype=np.int64)

    def universe(self) -> Any:
        return self._u

    def _read_into(self, index: int, out: np.ndarray) -> np.ndarray:
        self._value.read_direct(out, source_sel=np.s_[index])
        if self._scale != 1.0:
            out *= self._scale
        return out

    def read(self, index: int) -> np.ndarray:
        out = np.empty((self.n_atoms, 3), dtype=np.float32)
        return self._read_into(self._check_index(index), out)

    def iter_block(self, start: int, stop: int) -> Iterator[tuple[int, float]]:
        ts = self._u.trajectory.ts
        times = self._times(start, stop)
        steps = self._steps(start, stop)
        if steps is None:
            ts.data.pop("step", None)
        edges = None if self._edges is None else self._edges[start:stop] * self._edges_scale
        for i in range(start, stop):
            self._read_into(i, ts.positions)  # straight into the universe's frame
            ts.dimensions = self._box if edges is None else box_dimensions(edges[i - start])
            ts.frame = i
            # (the time and step an analysis reads from the timestep, as MDAnalysis's
            # readers set them)
            t = float(times[i - start])
            ts.time = t
            if steps is not None:
                ts.data["step"] = int(steps[i - start])
            yield i, t

    def close(self) -> None:
        if self._file.id.valid:
            self._file.close()


class StreamSource(FrameSource):
    """A closed instride stream, read frame by frame with :class:`instride.Stream`."""

    def __init__(self, spec: SourceSpec) -> None:
        self.spec = spec
        self._stream = Stream(spec.stream_name, mode="r", timeout=spec.timeout)
        try:
            # Splitting needs the frame count: wait (up to timeout) for the producer to close.
            self.n_frames = wait_for_end(self._stream, spec.timeout)
            if self.n_frames == 0:
                raise UnsupportedInputError(spec.trajectory, "the stream holds no frames")
            with self._stream.read(0) as frame:
                self.n_atoms = frame.natoms
            self._u = frame_universe(spec, self.n_atoms)
        except BaseException:
            self._stream.close()
            raise

    def universe(self) -> Any:
        return self._u

    def read(self, index: int) -> np.ndarray:
        # Each frame is released once copied out: a held frame keeps its file open.
        with self._stream.read(self._check_index(index)) as frame:
            self._check_atoms(index, frame.natoms)
            return np.array(frame.positions, dtype=np.float32)

    def _check_atoms(self, index: int, natoms: int) -> None:
        """A frame of another atom count than frame 0's (the universe's) is unusable."""
        if natoms != self.n_atoms:
            raise UnsupportedInputError(
                self.spec.trajectory, f"frame {index} has {natoms} atoms, frame 0 has "
                                      f"{self.n_atoms}: a stream analysed as one trajectory "
                                      "keeps its atom count")

    def iter_block(self, start: int, stop: int) -> Iterator[tuple[int, float]]:
        from MDAnalysis.lib.mdamath import triclinic_box

        ts = self._u.trajectory.ts
        for i in range(start, stop):  # in cluster mode Stream.read fetches from the owner node
            with self._stream.read(i) as frame:
                self._check_atoms(i, frame.natoms)
                np.copyto(ts.positions, frame.positions, casting="same_kind")
                ts.dimensions = triclinic_box(*frame.box) if frame.header.has_box else None
                t, step = frame.time, frame.step
            ts.frame = i
            ts.time = t  # (as instride's MDAnalysis reader sets them)
            ts.data["step"] = step
            yield i, t

    def close(self) -> None:
        self._stream.close()


def _check_atoms(spec: SourceSpec, u: Any, n_atoms: int) -> None:
    if u.atoms.n_atoms != n_atoms:
        raise UnsupportedInputError(
            spec.trajectory,
            f"{n_atoms} atoms per frame but the topology {spec.topology!r} has {u.atoms.n_atoms}",
        )


_KINDS: dict[str, type[FrameSource]] = {
    "mdanalysis": MDAnalysisSource,
    "h5md": H5MDSource,
    "stream": StreamSource,
}


def open_source(spec: SourceSpec) -> FrameSource:
    """Open the :class:`FrameSource` described by ``spec`` (each rank calls this itself)."""
    try:
        cls = _KINDS[spec.kind]
    except KeyError:
        raise UnsupportedInputError(spec.trajectory, f"unknown source kind {spec.kind!r}") \
            from None
    return cls(spec)
