"""Per-frame analyses run by split-apply-combine.

An analysis is a small picklable object. Every rank opens the input itself
(:meth:`FrameAnalysis.open`), prepares (:meth:`FrameAnalysis.setup`: selections, reference),
then runs its contiguous block of frames (:meth:`FrameAnalysis.run_block`), timing the read of
each frame (``t_IO``) apart from the computation on it (``t_comp``), as in Table 3 of
Khoshlessan et al. (2020). Rank 0 joins the blocks (:meth:`FrameAnalysis.combine`).

Built in:

* :class:`RMSD` — RMSD after optimal superposition (QCP) of a selection onto the same selection
  in a reference frame; the paper's test case with :data:`~instride.parallel.inputs.ADK_CORE_CA`.
  Same arithmetic as :class:`MDAnalysis.analysis.rms.RMSD` (unweighted, float64 QCP).
* :class:`RadiusOfGyration` — mass-weighted radius of gyration, as
  :meth:`MDAnalysis.core.groups.AtomGroup.radius_of_gyration`.
* :class:`AnalysisBaseAdapter` — any :class:`MDAnalysis.analysis.base.AnalysisBase` subclass
  that declares itself parallelizable (MDAnalysis >= 2.8), results merged with its own
  ``_get_aggregator()``.

Examples
--------
>>> from instride.parallel import analyze, RMSD                     # doctest: +SKIP
>>> run = analyze(RMSD(select="name CA"), DCD, PSF, workers=2)       # doctest: +SKIP
>>> run.data["rmsd"][:3]                                            # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .analysis_errors import UnsupportedInputError
from .inputs import ADK_CORE_CA, FrameSource, MDAnalysisSource, SourceSpec, open_source

if TYPE_CHECKING:
    from .timing import RankTiming


@dataclass
class Block:
    """What one rank sends to rank 0: its frames, times and per-frame values (or results)."""

    start: int
    stop: int
    frames: np.ndarray
    times: np.ndarray
    values: np.ndarray | None = None  # (n, n_columns) for FrameAnalysis
    results: Any = None  # MDAnalysis Results for the adapter


@dataclass
class Combined:
    """The joined output of all blocks, in frame order."""

    frames: np.ndarray
    times: np.ndarray
    data: dict[str, np.ndarray]
    result_object: Any = None


class FrameAnalysis:
    """Base class: an analysis computing a fixed number of values per frame.

    Subclasses set :attr:`name` and :attr:`columns` and implement :meth:`setup` and
    :meth:`single_frame`.
    """

    name: ClassVar[str] = "analysis"
    columns: tuple[str, ...] = ()

    def open(self, spec: SourceSpec) -> FrameSource:
        """Open the input on this rank (counted in ``t_open``)."""
        return open_source(spec)

    def setup(self, source: FrameSource) -> None:
        """Prepare on this rank after opening (counted in ``t_open``)."""

    def single_frame(self, positions: np.ndarray) -> float | Sequence[float]:
        """The values of one frame, given all its positions ``(n_atoms, 3)`` in Å."""
        raise NotImplementedError

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
        n = stop - start
        values = np.empty((n, len(self.columns)), dtype=np.float64)
        frames = np.empty(n, dtype=np.int64)
        times = np.empty(n, dtype=np.float64)
        it = source.iter_block(start, stop)
        clock = time.perf_counter
        t_io = t_comp = 0.0
        for j in range(n):
            t0 = clock()
            frame, t, pos = next(it)
            t1 = clock()
            values[j] = self.single_frame(pos)
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
        """Join the blocks of all ranks (on rank 0)."""
        blocks = sorted(blocks, key=lambda b: b.start)
        values = np.concatenate([b.values for b in blocks])  # type: ignore[misc]
        data = {c: values[:, i].copy() for i, c in enumerate(self.columns)}
        return Combined(
            np.concatenate([b.frames for b in blocks]),
            np.concatenate([b.times for b in blocks]),
            data,
        )


class RMSD(FrameAnalysis):
    """RMSD of a selection after optimal superposition onto a reference frame.

    Parameters
    ----------
    select
        MDAnalysis selection (default: Cα of the adenylate kinase CORE domain).
    ref_frame
        Index of the reference frame in the same trajectory (MDAnalysis's default, 0).

    Notes
    -----
    Identical arithmetic to :class:`MDAnalysis.analysis.rms.RMSD` without weights: both
    selections are centred on their (float64) centroid and
    :func:`MDAnalysis.lib.qcprot.CalcRMSDRotationalMatrix` is called on float64 copies, so the
    result equals MDAnalysis's bit for bit when the positions are the same float32 numbers.
    """

    name = "rmsd"
    columns = ("rmsd",)

    def __init__(self, select: str = ADK_CORE_CA, ref_frame: int = 0) -> None:
        self.select = select
        self.ref_frame = ref_frame

    def setup(self, source: FrameSource) -> None:
        from MDAnalysis.lib import qcprot

        self._qcp = qcprot.CalcRMSDRotationalMatrix
        self._idx = source.select(self.select).indices
        ref = source.read(self.ref_frame)[self._idx]
        self._ref64 = (ref - ref.astype(np.float64).mean(axis=0)).astype(np.float64)
        self._mob64 = np.empty_like(self._ref64)

    def single_frame(self, positions: np.ndarray) -> float:
        mobile = positions[self._idx]
        com = mobile.astype(np.float64).mean(axis=0)
        self._mob64[:] = mobile
        self._mob64 -= com
        return self._qcp(self._ref64, self._mob64, len(self._idx), None, None)

    def __getstate__(self) -> dict[str, Any]:  # ship only the parameters to the ranks
        return {"select": self.select, "ref_frame": self.ref_frame}


class RadiusOfGyration(FrameAnalysis):
    """Mass-weighted radius of gyration of a selection (Å).

    Parameters
    ----------
    select
        MDAnalysis selection (default ``"protein"``).
    """

    name = "rg"
    columns = ("rg",)

    def __init__(self, select: str = "protein") -> None:
        self.select = select

    def setup(self, source: FrameSource) -> None:
        group = source.select(self.select)
        self._idx = group.indices
        self._masses = group.masses.astype(np.float64)
        self._total = group.total_mass()

    def single_frame(self, positions: np.ndarray) -> float:
        x = positions[self._idx]
        com = (np.einsum("ij,ij->j", x.astype(np.float64), self._masses[:, None])
               / self._masses.sum())
        d = x - com
        return float(np.sqrt(np.einsum("i,i->", self._masses, np.einsum("ij,ij->i", d, d))
                             / self._total))

    def __getstate__(self) -> dict[str, Any]:
        return {"select": self.select}


#: name -> class of the built-in analyses (the ``instride analyze NAME`` subcommands).
BUILTIN: dict[str, type[FrameAnalysis]] = {"rmsd": RMSD, "rg": RadiusOfGyration}


def load_class(path: str) -> type:
    """Import ``"package.module:Class"`` (or ``"package.module.Class"``)."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise UnsupportedInputError(path, f"cannot import analysis class: {exc}") from None


@dataclass
class AnalysisBaseAdapter(FrameAnalysis):
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
        Keyword arguments of the class.
    factory
        A picklable callable ``factory(universe) -> AnalysisBase`` for classes whose
        constructor does not take an AtomGroup first.

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
            self._obj = self.cls(source.select(self.select), **self.kwargs)
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


def per_frame_columns(results: Any, n_frames: int) -> dict[str, np.ndarray]:
    """Columns for a CSV from an MDAnalysis ``Results``: every array with one row per frame.

    A 1-D array becomes column ``name``; an ``(n_frames, k)`` array columns ``name_0`` ...
    ``name_{k-1}``, except :class:`MDAnalysis.analysis.rms.RMSD`'s ``(frame, time, rmsd)``
    layout, whose last column becomes ``rmsd``.
    """
    out: dict[str, np.ndarray] = {}
    for key, value in dict(results).items():
        arr = np.asarray(value) if isinstance(value, np.ndarray) else None
        if arr is None or arr.ndim == 0 or arr.shape[0] != n_frames:
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
