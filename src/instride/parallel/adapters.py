"""Analyses adapted to split-apply-combine: what every rank runs on its block of frames.

A :class:`ParallelAnalysis` is a small picklable object. Every rank opens the input itself
(:meth:`ParallelAnalysis.open`), prepares (:meth:`ParallelAnalysis.setup`: selections,
reference), then runs its contiguous block of frames (:meth:`ParallelAnalysis.run_block`),
timing the read of each frame (``t_IO``) apart from the computation on it (``t_comp``), as in
Table 3 of Khoshlessan et al. (2020). Rank 0 joins the blocks (:meth:`ParallelAnalysis.combine`).

There is one analysis stack: the analyses are :mod:`instride.analytics`' classes (one
:class:`~instride.analytics.base.FrameAnalysis` base, one RMSD, one radius of gyration, one
distance-matrix eigenvalue), the same ones the in situ consumers run. Two adapters:

* :class:`FrameAnalysisAdapter` — any :class:`~instride.analytics.base.FrameAnalysis`
  subclass, on every input kind (stream, H5MD through h5py, any MDAnalysis trajectory).
  :func:`rmsd` and :func:`radius_of_gyration` build the two built-in ones (``instride
  analyze rmsd`` / ``rg``). The RMSD is the QCP fit of MDAnalysis
  (:func:`MDAnalysis.analysis.rms.rmsd`, float64 centring, reference first), so it equals
  :class:`MDAnalysis.analysis.rms.RMSD` bit for bit on the same float32 positions.
* :class:`AnalysisBaseAdapter` — any :class:`MDAnalysis.analysis.base.AnalysisBase` subclass
  that declares itself parallelizable (MDAnalysis >= 2.8), results merged with its own
  ``_get_aggregator()``.

Examples
--------
>>> from instride.analytics import DistanceMatrixEigenvalue             # doctest: +SKIP
>>> from instride.parallel import FrameAnalysisAdapter, analyze, rmsd
>>> run = analyze(rmsd(select="name CA"), DCD, PSF, workers=2)           # doctest: +SKIP
>>> run.data["rmsd"][:3]                                                # doctest: +SKIP
>>> eig = FrameAnalysisAdapter(DistanceMatrixEigenvalue,
...                            kwargs={"substructures": {"A": "resid 1:10 and name CA"}})
>>> analyze(eig, DCD, PSF, workers=2).data["lambda_A"]                  # doctest: +SKIP
"""

from __future__ import annotations

import abc
import importlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .analysis_errors import UnsupportedInputError
from .inputs import ADK_CORE_CA, FrameSource, MDAnalysisSource, SourceSpec, open_source

if TYPE_CHECKING:
    from .timing import RankTiming

__all__ = [
    "BUILTIN",
    "AnalysisBaseAdapter",
    "Block",
    "Combined",
    "FrameAnalysisAdapter",
    "ParallelAnalysis",
    "load_class",
    "per_frame_columns",
    "radius_of_gyration",
    "rmsd",
]


@dataclass
class Block:
    """What one rank sends to rank 0: its frames, times and per-frame values (or results)."""

    start: int
    stop: int
    frames: np.ndarray
    times: np.ndarray
    values: np.ndarray | None = None  # (n, n_columns) for FrameAnalysisAdapter
    results: Any = None  # MDAnalysis Results for AnalysisBaseAdapter


@dataclass
class Combined:
    """The joined output of all blocks, in frame order."""

    frames: np.ndarray
    times: np.ndarray
    data: dict[str, np.ndarray]
    result_object: Any = None


class ParallelAnalysis(abc.ABC):
    """What :func:`~instride.parallel.execute.analyze` runs on every rank.

    Subclasses set :attr:`name` and implement :meth:`setup`, :meth:`run_block` and
    :meth:`combine`. Instances are pickled to the ranks before :meth:`setup`, so they carry
    parameters only.
    """

    name: str = "analysis"

    def open(self, spec: SourceSpec) -> FrameSource:
        """Open the input on this rank (counted in ``t_open``)."""
        return open_source(spec)

    @abc.abstractmethod
    def setup(self, source: FrameSource) -> None:
        """Prepare on this rank after opening (counted in ``t_open``)."""

    @abc.abstractmethod
    def run_block(
        self,
        source: FrameSource,
        start: int,
        stop: int,
        timing: RankTiming,
        *,
        delay: float = 0.0,
        progress: Any = None,
    ) -> Block:
        """Analyse frames ``start <= frame < stop``; add ``t_IO``, ``t_comp``, ``t_end_loop``.

        ``delay`` seconds of sleep are added to every frame's computation (the straggler
        injection of :func:`~instride.parallel.execute.analyze`, for tests and diagnostics).
        """

    @abc.abstractmethod
    def combine(self, blocks: Sequence[Block]) -> Combined:
        """Join the blocks of all ranks (on rank 0, after its own :meth:`setup`)."""


def load_class(path: str) -> type:
    """Import ``"package.module:Class"`` (or ``"package.module.Class"``)."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise UnsupportedInputError(path, f"cannot import analysis class: {exc}") from None


def _on_universe(value: Any, universe: Any, name: str, arg: str) -> Any:
    """``value`` with every AtomGroup in it (itself, or in a dict, list or tuple) taken again
    on ``universe`` by its atoms' indices.

    Raises
    ------
    UnsupportedInputError
        An AtomGroup of a universe with another number of atoms.
    """
    from MDAnalysis.core.groups import AtomGroup

    if isinstance(value, AtomGroup):
        if value.universe is universe:
            return value
        if value.universe.atoms.n_atoms != universe.atoms.n_atoms:
            raise UnsupportedInputError(
                name, f"{arg}: an AtomGroup of a system of {value.universe.atoms.n_atoms} atoms, "
                      f"the input has {universe.atoms.n_atoms}")
        return universe.atoms[value.indices]
    if isinstance(value, dict):
        return {k: _on_universe(v, universe, name, arg) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_on_universe(v, universe, name, arg) for v in value)
    return value


def _trajectory_id(universe: Any) -> str | None:
    """What names the trajectory ``universe`` reads: its file's real path, or its
    ``instride://`` name; ``None`` for one read from memory."""
    from ..analytics.reader import SCHEME, stream_name

    name = getattr(universe.trajectory, "filename", None)
    if not isinstance(name, str) or not name:
        return None
    if name.startswith(SCHEME):  # (instride://adk and instride:///adk/ are one stream)
        try:
            return SCHEME + stream_name(name)
        except ValueError:
            return None
    return os.path.realpath(name)


def _follow_frames(value: Any, universe: Any, name: str, arg: str) -> Any:
    """``value`` (an AtomGroup, or a dict, list or tuple holding some) for an MDAnalysis
    class's keyword argument on this rank's ``universe``.

    An AtomGroup of a universe reading the same trajectory is taken again on ``universe`` (by
    its atoms' indices), so that it follows the frames as in a serial run; one of a
    single-frame universe (a reference structure, such as ``RMSD(reference=...)``) stays
    where it is, as in a serial run.

    Raises
    ------
    UnsupportedInputError
        An AtomGroup of another trajectory: which frames it should follow is not known.
    """
    from MDAnalysis.core.groups import AtomGroup

    if isinstance(value, AtomGroup):
        own = value.universe
        if own is universe or own.trajectory.n_frames == 1:
            return value
        mine = _trajectory_id(universe)
        if mine is not None and _trajectory_id(own) == mine:
            return _on_universe(value, universe, name, arg)
        raise UnsupportedInputError(
            name, f"{arg}: an AtomGroup of a universe reading another trajectory "
                  f"({getattr(own.trajectory, 'filename', None)!r}, {own.trajectory.n_frames} "
                  "frames) than the input: it would not follow the input's frames; build the "
                  "object on the rank's universe with factory=")
    if isinstance(value, dict):
        return {k: _follow_frames(v, universe, name, arg) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_follow_frames(v, universe, name, arg) for v in value)
    return value


@dataclass
class FrameAnalysisAdapter(ParallelAnalysis):
    """Run an :mod:`instride.analytics` :class:`~instride.analytics.base.FrameAnalysis` by
    split-apply-combine.

    Each rank builds ``analysis_class(universe.select_atoms(select), **kwargs)`` (or
    ``analysis_class(universe, **kwargs)`` without ``select``) on the universe of its own
    input, and calls :meth:`~instride.analytics.base.FrameAnalysis.compute` on each frame of
    its block; rank 0 stacks the values in frame order.

    Parameters
    ----------
    analysis_class
        A :class:`~instride.analytics.base.FrameAnalysis` subclass, or its import path
        ``"instride.analytics:RadiusOfGyration"``.
    select
        Selection whose AtomGroup is the first argument; ``None``: the universe is.
    kwargs
        Keyword arguments of the class.
    reference_frame
        Pass ``reference=`` the positions of the selection in this frame of the input (read
        during setup, in ``t_open``). Needed by analyses that otherwise compare with the
        first frame *they* see, such as
        :class:`~instride.analytics.rmsd.RMSDToFirst`: each rank sees a different first frame.
        For those (:attr:`~instride.analytics.base.FrameAnalysis.reference_first`) it is 0,
        the input's first frame, unless given (or ``kwargs`` has a ``reference``), so that
        any number of ranks gives what one gives.
    name
        Name of the run and of its CSV file (default: the class name, lower case).
    columns
        Names of the output columns, in the class's order (default: the class's
        :attr:`~instride.analytics.base.FrameAnalysis.columns`).

    Raises
    ------
    UnsupportedInputError
        ``analysis_class`` is not a FrameAnalysis subclass (or cannot be imported).
    """

    analysis_class: type | str = ""
    select: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    reference_frame: int | None = None
    name: str = ""
    columns: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        from ..analytics.base import FrameAnalysis

        cls = self.cls
        if not (isinstance(cls, type) and issubclass(cls, FrameAnalysis)):
            raise UnsupportedInputError(
                getattr(cls, "__name__", str(cls)),
                "not an instride.analytics FrameAnalysis subclass",
            )
        if not self.name:
            self.name = cls.__name__.lower()
        if self.reference_frame is None and "reference" not in self.kwargs \
                and getattr(cls, "reference_first", False):
            self.reference_frame = 0

    @property
    def cls(self) -> type:
        if isinstance(self.analysis_class, str):
            return load_class(self.analysis_class)
        return self.analysis_class

    def setup(self, source: FrameSource) -> None:
        # (an AtomGroup given as an argument belongs to the caller's universe, or to a copy of
        # it: taken again on the universe the frames are loaded into, by its atoms' indices)
        kwargs = {k: _on_universe(v, source.universe(), self.name, k)
                  for k, v in self.kwargs.items()}
        target = source.universe() if self.select is None else source.select(self.select)
        if self.reference_frame is not None:
            indices = target.indices if self.select is not None else slice(None)
            kwargs["reference"] = source.read(self.reference_frame)[indices]
        self._analysis = self.cls(target, **kwargs)
        names = tuple(self._analysis.columns)
        if self.columns is not None and len(self.columns) != len(names):
            raise UnsupportedInputError(
                self.name, f"{len(self.columns)} column names for {len(names)} columns {names}"
            )
        self._columns = names if self.columns is None else tuple(self.columns)

    def run_block(
        self,
        source: FrameSource,
        start: int,
        stop: int,
        timing: RankTiming,
        *,
        delay: float = 0.0,
        progress: Any = None,
    ) -> Block:
        analysis = self._analysis
        analysis.reset()
        n = stop - start
        values = np.empty((n, len(self._columns)), dtype=np.float64)
        frames = np.empty(n, dtype=np.int64)
        times = np.empty(n, dtype=np.float64)
        it = source.iter_block(start, stop)
        clock = time.perf_counter
        t_io = t_comp = 0.0
        for j in range(n):
            t0 = clock()
            frame, t = next(it)  # the frame's positions are now the universe's
            t1 = clock()
            values[j] = analysis.compute()
            if delay:
                time.sleep(delay)
            t2 = clock()
            t_io += t1 - t0
            t_comp += t2 - t1
            frames[j] = frame
            times[j] = t
            if progress is not None:
                progress.update(1)
        t3 = clock()
        it.close()
        timing.t_end_loop += clock() - t3
        timing.t_io += t_io
        timing.t_comp += t_comp
        return Block(start, stop, frames, times, values=values)

    def combine(self, blocks: Sequence[Block]) -> Combined:
        blocks = sorted(blocks, key=lambda b: b.start)
        values = np.concatenate([b.values for b in blocks])  # type: ignore[misc]
        analysis = self._analysis
        for j, name in enumerate(analysis.columns):  # as after FrameAnalysis.run()
            analysis.results[name] = values[:, j].copy()
        data = {c: values[:, j].copy() for j, c in enumerate(self._columns)}
        return Combined(np.concatenate([b.frames for b in blocks]),
                        np.concatenate([b.times for b in blocks]), data,
                        result_object=analysis)

    def __getstate__(self) -> dict[str, Any]:  # ship only the parameters to the ranks
        return {"analysis_class": self.analysis_class, "select": self.select,
                "kwargs": self.kwargs, "reference_frame": self.reference_frame,
                "name": self.name, "columns": self.columns}


def rmsd(select: str = ADK_CORE_CA, ref_frame: int = 0) -> FrameAnalysisAdapter:
    """The built-in RMSD (``instride analyze rmsd``): column ``rmsd`` in Å.

    RMSD after optimal superposition (QCP) of ``select`` onto the same selection in frame
    ``ref_frame`` (:class:`~instride.analytics.rmsd.RMSDToFirst` with that reference); the
    default selection is the Cα atoms of the adenylate kinase CORE domain, the paper's test.
    """
    from ..analytics.rmsd import RMSDToFirst

    return FrameAnalysisAdapter(RMSDToFirst, select=select, reference_frame=ref_frame,
                                name="rmsd")


def radius_of_gyration(select: str = "protein") -> FrameAnalysisAdapter:
    """The built-in radius of gyration (``instride analyze rg``): column ``rg`` in Å.

    Mass-weighted, :class:`~instride.analytics.gyration.RadiusOfGyration` of ``select``.
    """
    from ..analytics.gyration import RadiusOfGyration

    return FrameAnalysisAdapter(RadiusOfGyration, select=select, name="rg", columns=("rg",))


#: name -> factory of the built-in analyses (the ``instride analyze NAME`` subcommands).
BUILTIN: dict[str, Callable[..., ParallelAnalysis]] = {"rmsd": rmsd, "rg": radius_of_gyration}


@dataclass
class AnalysisBaseAdapter(ParallelAnalysis):
    """Run a parallelizable MDAnalysis ``AnalysisBase`` subclass by split-apply-combine.

    Each rank builds ``analysis_class(universe.select_atoms(select), **kwargs)`` (or
    ``factory(universe)``) on its own Universe, runs its block through the class's
    ``_prepare``/``_single_frame`` template, and rank 0 merges the ``results`` of all blocks
    with the class's ``_get_aggregator()`` before calling ``_conclude()`` — what
    ``AnalysisBase.run(backend=...)`` does, with the per-rank timing of Table 3 added.

    Parameters
    ----------
    analysis_class
        The class, or its import path ``"MDAnalysis.analysis.rms:RMSD"``. It must set
        ``_analysis_algorithm_is_parallelizable = True``.
    select
        Selection passed as the first argument (ignored when ``factory`` is given).
    kwargs
        Keyword arguments of the class. An AtomGroup among them (in a dict, list or tuple
        too) of a universe reading the input's trajectory is taken again, by its atoms'
        indices, on the universe each rank loads its frames into; one of a single-frame
        universe (a reference structure) is passed as it is.
    factory
        A picklable callable ``factory(universe) -> AnalysisBase`` for classes whose
        constructor does not take an AtomGroup first, or that need AtomGroups of the
        rank's universe that ``kwargs`` cannot give.

    Raises
    ------
    UnsupportedInputError
        The class is not parallelizable (or cannot be imported); in :meth:`setup`, an
        AtomGroup in ``kwargs`` of a universe reading another multi-frame trajectory than
        the input (its frames would not be the input's).

    Notes
    -----
    The input is opened by MDAnalysis (an H5MD file with its H5MD reader, each rank opening
    it independently; an ``instride://`` stream with instride's reader,
    :mod:`instride.analytics.reader`, after its end-of-stream).
    """

    analysis_class: type | str = ""
    select: str = "all"
    kwargs: dict[str, Any] = field(default_factory=dict)
    factory: Callable[[Any], Any] | None = None
    name: ClassVar[str] = "mda"

    def __post_init__(self) -> None:
        cls = self.cls
        if not getattr(cls, "_analysis_algorithm_is_parallelizable", False):
            raise UnsupportedInputError(
                getattr(cls, "__name__", str(cls)),
                "the class does not declare _analysis_algorithm_is_parallelizable = True",
            )

    @property
    def cls(self) -> type:
        if isinstance(self.analysis_class, str):
            return load_class(self.analysis_class)
        return self.analysis_class

    def open(self, spec: SourceSpec) -> FrameSource:
        return MDAnalysisSource(spec)

    def setup(self, source: FrameSource) -> None:
        u = source.universe()
        if self.factory is not None:
            self._obj = self.factory(u)
        else:
            # (an AtomGroup among the kwargs was unpickled with a copy of the caller's
            # universe: it would never see the rank's frames)
            cls_name = getattr(self.cls, "__name__", "analysis")
            kwargs = {k: _follow_frames(v, u, cls_name, k) for k, v in self.kwargs.items()}
            self._obj = self.cls(source.select(self.select), **kwargs)
        self._obj._setup_frames(self._obj._trajectory)

    def run_block(
        self,
        source: FrameSource,
        start: int,
        stop: int,
        timing: RankTiming,
        *,
        delay: float = 0.0,
        progress: Any = None,
    ) -> Block:
        obj = self._obj
        clock = time.perf_counter
        t0 = clock()
        obj._prepare_sliced_trajectory(slicer=np.arange(start, stop))
        obj._prepare()  # e.g. reads the reference frame: setup, so counted in t_open
        timing.t_open += clock() - t0
        it = iter(obj._sliced_trajectory)
        t_io = t_comp = 0.0
        for idx in range(stop - start):
            t0 = clock()
            ts = next(it)
            t1 = clock()
            obj._frame_index = idx
            obj._ts = ts
            obj.frames[idx] = ts.frame
            obj.times[idx] = ts.time
            obj._single_frame()
            if delay:
                time.sleep(delay)
            t2 = clock()
            t_io += t1 - t0
            t_comp += t2 - t1
            if progress is not None:
                progress.update(1)
        timing.t_io += t_io
        timing.t_comp += t_comp
        return Block(start, stop, np.asarray(obj.frames), np.asarray(obj.times),
                     results=obj.results)

    def combine(self, blocks: Sequence[Block]) -> Combined:
        blocks = sorted(blocks, key=lambda b: b.start)
        obj = self._obj
        obj._setup_frames(obj._trajectory)  # back to the whole run, as AnalysisBase.run
        obj.frames = np.hstack([b.frames for b in blocks])
        obj.times = np.hstack([b.times for b in blocks])
        obj.results = obj._get_aggregator().merge([b.results for b in blocks])
        obj._conclude()
        return Combined(obj.frames, obj.times, per_frame_columns(obj.results, len(obj.frames)),
                        result_object=obj)

    def __getstate__(self) -> dict[str, Any]:
        return {"analysis_class": self.analysis_class, "select": self.select,
                "kwargs": self.kwargs, "factory": self.factory}


#: dtype kinds :func:`per_frame_columns` keeps: booleans, integers, floats, text.
CSV_KINDS = "biufUS"


def per_frame_columns(results: Any, n_frames: int) -> dict[str, np.ndarray]:
    """Columns for a CSV from an MDAnalysis ``Results``: every array of numbers, booleans or
    text with one row per frame.

    A 1-D array becomes column ``name``; an ``(n_frames, k)`` array columns ``name_0`` ...
    ``name_{k-1}``, except :class:`MDAnalysis.analysis.rms.RMSD`'s ``(frame, time, rmsd)``
    layout, whose last column becomes ``rmsd``. Arrays of other types (objects, complex
    numbers) and of more dimensions are left out.
    """
    out: dict[str, np.ndarray] = {}
    for key, value in dict(results).items():
        arr = np.asarray(value) if isinstance(value, np.ndarray) else None
        if arr is None or arr.ndim == 0 or arr.shape[0] != n_frames:
            continue
        if arr.dtype.kind not in CSV_KINDS:  # (a CSV cell holds a number or a text)
            continue
        if arr.ndim == 1:
            out[key] = arr
        elif arr.ndim == 2:
            if key == "rmsd" and arr.shape[1] == 3:
                out["rmsd"] = arr[:, 2]
                continue
            for j in range(arr.shape[1]):
                out[f"{key}_{j}"] = arr[:, j]
    return out
