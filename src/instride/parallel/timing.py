"""Per-rank timing, speed-up, efficiency, stragglers — the quantities of the paper's Table 3.

Khoshlessan et al. (2020), *Parallel performance of molecular dynamics trajectory analysis*,
define, per MPI rank: ``t_opening_trajectory`` (open the files, build the data structures),
``t_I/O`` (sum over the rank's frames of the time to read one frame), ``t_comp`` (sum of the
per-frame compute times), ``t_end_loop`` (leaving the loop, closing the trajectory),
``t_comm`` (the gather to rank 0) and ``t_N`` (the rank's total); the run's time to solution is
``t_total = max_rank t_N``; speed-up ``S(N) = t_total(1) / t_total(N)``, efficiency
``E(N) = S(N) / N``; ``R_comp/IO = t_comp / t_I/O`` of the serial run (compute- vs. I/O-bound)
and ``R_comp/comm`` from rank averages.

Here, per rank (:class:`RankTiming`):

============  ============================================================================
``t_open``    open the input, topology and selections, read the reference frame
``t_io``      sum of per-frame reads
``t_comp``    sum of per-frame computations (including any injected straggler delay)
``t_end_loop`` leaving the loop, closing the input
``t_work``    the rank's own work, from its start to the end of its block (the paper's
              ``t_RMSD``); ``t_overhead = t_work - t_open - t_io - t_comp - t_end_loop``
``t_wait``    MPI only: waiting at a barrier for the slowest rank before the gather (the
              paper's ``t_comm`` includes this wait; it is split out here)
``t_comm``    the gather itself (multiprocessing: from the worker returning its block to
              the parent holding it)
``t_total``   ``t_work + t_wait + t_comm`` (the paper's ``t_N``)
============  ============================================================================

A **straggler** is a rank whose ``t_work`` exceeds ``factor`` (1.5) times the median
``t_work`` of all ranks. ``t_work`` and not ``t_total`` is compared, because every rank's
``t_total`` includes waiting for the slowest one at the gather, which would hide it.
"""

from __future__ import annotations

import csv
import json
import math
import os
import secrets
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any

import numpy as np


@dataclass
class RankTiming:
    """Timing of one rank (seconds); see the module docstring for the definitions."""

    rank: int
    start: int = 0
    stop: int = 0
    host: str = ""
    t_open: float = 0.0
    t_io: float = 0.0
    t_comp: float = 0.0
    t_end_loop: float = 0.0
    t_work: float = 0.0
    t_wait: float = 0.0
    t_comm: float = 0.0

    @property
    def n_frames(self) -> int:
        """Frames in this rank's block."""
        return self.stop - self.start

    @property
    def t_overhead(self) -> float:
        """Time in the rank's work not in any measured phase (``t_Overhead`` of Table 3)."""
        return max(0.0, self.t_work - self.t_open - self.t_io - self.t_comp - self.t_end_loop)

    @property
    def t_total(self) -> float:
        """The rank's time to completion, ``t_N``."""
        return self.t_work + self.t_wait + self.t_comm

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(n_frames=self.n_frames, t_overhead=self.t_overhead, t_total=self.t_total)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RankTiming:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def write_atomic(path: str | os.PathLike[str], write: Callable[[IO[str]], object]) -> Path:
    """Write a text file under a temporary name in its directory, then rename it into place.

    A reader sees the old file or the whole new one, never a part; on failure the temporary
    file is removed and ``path`` is left as it was.

    Parameters
    ----------
    path
        The file to write.
    write
        Called with the open temporary file (text, ``newline=""``).

    Returns
    -------
    Path
        ``path``.
    """
    path = Path(path)
    # (a name nobody can guess, made exclusively: never through a link planted there in a
    # shared directory, never another thread's)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "x", newline="") as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (``inf``, ``nan``) replaced by ``None``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def find_stragglers(t_work: list[float] | np.ndarray, factor: float = 1.5) -> list[int]:
    """Indices of the ranks whose time exceeds ``factor`` × the median time.

    Parameters
    ----------
    t_work
        One time per rank (index = rank).
    factor
        Threshold relative to the median (the issue's 1.5).

    Examples
    --------
    >>> find_stragglers([1.0, 1.1, 0.9, 3.0])
    [3]
    """
    t = np.asarray(t_work, dtype=float)
    if t.size == 0:
        return []
    med = float(np.median(t))
    return [int(i) for i in np.flatnonzero(t > factor * med)]


@dataclass
class TimingReport:
    """Timing of a whole run: per-rank breakdown, S(N), E(N), stragglers, R_comp/IO.

    Parameters
    ----------
    analysis, source, backend
        What ran, on which input kind and backend.
    n_frames
        Frames analysed.
    ranks
        One :class:`RankTiming` per rank, by rank.
    wall
        Wall-clock time of the parallel run as seen by the caller (includes starting worker
        processes; MPI: from the common start barrier to the end of the gather, on rank 0).
    baseline
        The serial (N = 1) run's rank timing when it was run in the same invocation.
    baseline_total
        ``t_total(1)``: from ``baseline``, or given by the user; ``None`` when unknown.
    straggler_factor
        Stragglers are ranks with ``t_work > straggler_factor × median``.
    straggle
        Injected per-frame delays ``{rank: seconds}`` (testing/diagnostics), recorded so a
        report never passes an injected slowdown off as a measurement.
    """

    analysis: str
    source: str
    backend: str
    n_frames: int
    ranks: list[RankTiming]
    wall: float = 0.0
    baseline: RankTiming | None = None
    baseline_total: float | None = None
    straggler_factor: float = 1.5
    straggle: dict[int, float] = field(default_factory=dict)

    @property
    def n_ranks(self) -> int:
        return len(self.ranks)

    @property
    def t_total(self) -> float:
        """Time to solution, ``max_rank t_N``."""
        return max(r.t_total for r in self.ranks)

    def mean(self, name: str) -> float:
        """Average of a per-rank quantity over ranks (Eqs. 4–6)."""
        return float(np.mean([getattr(r, name) for r in self.ranks]))

    @property
    def speedup(self) -> float | None:
        """``S(N) = t_total(1) / t_total(N)``, or ``None`` without a baseline."""
        if not self.baseline_total:
            return None
        return self.baseline_total / self.t_total

    @property
    def efficiency(self) -> float | None:
        """``E(N) = S(N) / N``."""
        s = self.speedup
        return None if s is None else s / self.n_ranks

    @property
    def stragglers(self) -> list[int]:
        """Ranks whose ``t_work`` exceeds ``straggler_factor`` × the median ``t_work``."""
        return find_stragglers([r.t_work for r in self.ranks], self.straggler_factor)

    @property
    def r_comp_io(self) -> float:
        """``R_comp/IO``: from the serial baseline when run (the paper's definition), else the
        ratio of the rank averages of this run (see :attr:`r_comp_io_source`)."""
        if self.baseline is not None and self.baseline.t_io > 0:
            return self.baseline.t_comp / self.baseline.t_io
        io = self.mean("t_io")
        return self.mean("t_comp") / io if io > 0 else float("inf")

    @property
    def r_comp_io_source(self) -> str:
        return "serial run" if self.baseline is not None else f"{self.n_ranks}-rank averages"

    @property
    def r_comp_comm(self) -> float:
        """``R_comp/comm``: average ``t_comp`` over average ``t_comm`` (Eq. 8)."""
        comm = self.mean("t_comm")
        return self.mean("t_comp") / comm if comm > 0 else float("inf")

    # ------------------------------------------------------------------ output
    def to_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready (derived quantities included).

        A ratio that is not finite (``r_comp_comm`` of a run without communication, such as
        a serial one: ``t_comm = 0``) is ``None`` (JSON ``null``).
        """
        return _json_safe({
            "analysis": self.analysis,
            "source": self.source,
            "backend": self.backend,
            "n_frames": self.n_frames,
            "n_ranks": self.n_ranks,
            "wall": self.wall,
            "t_total": self.t_total,
            "baseline_total": self.baseline_total,
            "speedup": self.speedup,
            "efficiency": self.efficiency,
            "straggler_factor": self.straggler_factor,
            "stragglers": self.stragglers,
            "straggle_injected": {str(k): v for k, v in self.straggle.items()},
            "r_comp_io": self.r_comp_io,
            "r_comp_io_source": self.r_comp_io_source,
            "r_comp_comm": self.r_comp_comm,
            "mean": {k: self.mean(k) for k in ("t_open", "t_io", "t_comp", "t_comm", "t_wait",
                                              "t_total")},
            "ranks": [r.to_dict() for r in self.ranks],
            "baseline": None if self.baseline is None else self.baseline.to_dict(),
        })

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TimingReport:
        return cls(
            analysis=d["analysis"], source=d["source"], backend=d["backend"],
            n_frames=d["n_frames"], ranks=[RankTiming.from_dict(r) for r in d["ranks"]],
            wall=d.get("wall", 0.0),
            baseline=None if d.get("baseline") is None else RankTiming.from_dict(d["baseline"]),
            baseline_total=d.get("baseline_total"),
            straggler_factor=d.get("straggler_factor", 1.5),
            straggle={int(k): v for k, v in d.get("straggle_injected", {}).items()},
        )

    def format(self) -> str:
        """A human-readable report: per-rank table, then the run's aggregates."""
        lines = [
            f"{self.analysis} on {self.source} — backend {self.backend}, {self.n_ranks} rank(s), "
            f"{self.n_frames} frames",
            f"{'rank':>4} {'frames':>7} {'t_open':>8} {'t_IO':>8} {'t_comp':>8} {'t_end':>7} "
            f"{'t_ovh':>7} {'t_wait':>7} {'t_comm':>7} {'t_N':>8}  host",
        ]
        strag = set(self.stragglers)
        for r in self.ranks:
            lines.append(
                f"{r.rank:>4} {r.n_frames:>7} {r.t_open:8.4f} {r.t_io:8.4f} {r.t_comp:8.4f} "
                f"{r.t_end_loop:7.4f} {r.t_overhead:7.4f} {r.t_wait:7.4f} {r.t_comm:7.4f} "
                f"{r.t_total:8.4f}  {r.host}{'  STRAGGLER' if r.rank in strag else ''}"
            )
        lines.append(f"t_total (max t_N) = {self.t_total:.4f} s; wall = {self.wall:.4f} s")
        if self.baseline_total:
            lines.append(
                f"S({self.n_ranks}) = {self.speedup:.3f}, E({self.n_ranks}) = "
                f"{self.efficiency:.3f} (t_total(1) = {self.baseline_total:.4f} s)"
            )
        else:
            lines.append("S(N), E(N): no serial baseline (use --baseline-serial or "
                         "--baseline-time)")
        lines.append(f"R_comp/IO = {self.r_comp_io:.3f} ({self.r_comp_io_source}); "
                     f"R_comp/comm = {self.r_comp_comm:.3g}")
        if strag:
            lines.append(f"stragglers (t_work > {self.straggler_factor} x median): "
                         f"{sorted(strag)}")
        else:
            lines.append(f"stragglers (t_work > {self.straggler_factor} x median): none")
        if self.straggle:
            lines.append(f"NOTE: injected per-frame delays (diagnostic): {self.straggle}")
        return "\n".join(lines)

    def write(self, outdir: str | os.PathLike[str], plot: bool = True) -> dict[str, Path]:
        """Write ``timing.json``, ``timing.txt``, ``timing_ranks.csv`` (and ``timing.png``).

        Each file is written under a temporary name and renamed into place
        (:func:`write_atomic`); ``timing.json`` is strict JSON (no ``Infinity``/``NaN``).
        """
        out = Path(outdir)
        out.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False)
        rows = [r.to_dict() for r in self.ranks]

        def ranks_csv(fh: IO[str]) -> None:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)

        paths = {
            "json": write_atomic(out / "timing.json", lambda fh: fh.write(text)),
            "txt": write_atomic(out / "timing.txt", lambda fh: fh.write(self.format() + "\n")),
            "ranks_csv": write_atomic(out / "timing_ranks.csv", ranks_csv),
        }
        if plot:
            from .timing_plots import plot_ranks

            paths["png"] = plot_ranks(self, out / "timing.png")
        return paths
