"""``instride demo``: real MD with in situ analytics, against files plus explicit barriers.

What it runs, on one machine in local mode:

1. **instride** — ``replicas`` OpenMM replicas (different seeds) of the solvated villin
   headpiece shipped with OpenMM (``openmm/app/data/test.pdb``, 8,867 atoms; 1 CPU thread
   each), each publishing a frame every ``interval`` steps with
   :class:`~instride.md.openmm.FrameReporter`. For each replica an analytics consumer runs
   concurrently in its own process: ``MDAnalysis.Universe(pdb, "instride://...")`` iterated as
   frames arrive; RMSD (QCP) to the first frame, radius of gyration, and the largest
   eigenvalue of the distance matrices of the helices and helix pairs (the study's Figure 1).
   No synchronization in user code: the consumer just opens the next frame.
2. **localfs + barrier** — the same workflow the way the DYAD study's baseline did it: the
   producer writes each frame as a plain file (``open``/``write``/``close``) into a node-local
   directory and then enters a barrier shared with its consumer; the consumer enters the
   barrier, then reads the file. The barrier is a ``multiprocessing.Barrier(2)`` per
   producer/consumer pair (the study used ``MPI_Barrier``).

Per replica it writes ``analytics.csv`` (one flushed row per frame) and one PNG per quantity
in ``OUT/<workflow>/replica<i>/``, overlays of the replicas in ``OUT/<workflow>/``, and a
summary (frames, bytes moved, producer overhead = time spent publishing, consumer idle time =
time spent waiting for frames) printed and saved as ``OUT/summary.csv`` and
``OUT/summary.txt``.

The managed directory is ``INSTRIDE_DIR`` when set (the demo's keys are removed afterwards),
else a temporary directory on ``/dev/shm`` that is deleted. Child processes are stopped (by
PID) on Ctrl-C or when any of them fails.
"""

from __future__ import annotations

import contextlib
import csv
import math
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, InstrideError
from ..store.streamstate import state_dir

__all__ = ["BarrierFileReporter", "DemoError", "DemoRow", "run_demo"]

WORKFLOWS = ("instride", "localfs+barrier")


class DemoError(InstrideError, RuntimeError):
    """A process of the demo failed (its traceback was printed to stderr)."""


@dataclass
class DemoRow:
    """One producer/consumer pair of one workflow."""

    workflow: str
    replica: int
    frames: int
    bytes: int
    steps_per_second: float
    producer_overhead_s: float  #: time the producer spent publishing (incl. barrier waits)
    consumer_idle_s: float  #: time the consumer spent waiting for frames
    consumer_read_s: float  #: time the consumer spent reading + verifying frames
    analysis_s: float
    producer_wall_s: float
    consumer_wall_s: float


# ---------------------------------------------------------------------------- producers
class BarrierFileReporter:
    """OpenMM reporter of the baseline: a plain file per frame, then a pairwise barrier.

    Parameters
    ----------
    directory
        Node-local directory for ``frame_%09d.isf`` files (not managed by instride).
    interval
        Steps between frames.
    barrier
        A ``multiprocessing.Barrier(2)`` shared with the consumer of this producer.
    timeout
        Seconds to wait in the barrier before ``threading.BrokenBarrierError``.
    """

    def __init__(self, directory: str | os.PathLike[str], interval: int, barrier: Any,
                 timeout: float | None = None) -> None:
        self.directory = Path(directory)
        self.interval = int(interval)
        self.barrier = barrier
        self.timeout = timeout
        self.frames = 0
        self.bytes = 0
        self.publish_seconds = 0.0

    def describeNextReport(  # noqa: N802 - OpenMM's reporter protocol
        self, simulation: Any
    ) -> tuple[int, bool, bool, bool, bool, None]:
        """Next report in ``interval`` steps; positions only."""
        return (self.interval - simulation.currentStep % self.interval, True, False, False,
                False, None)

    def report(self, simulation: Any, state: Any) -> None:
        """Write the frame with plain file I/O, then wait for the consumer at the barrier."""
        from openmm import unit

        from ..frames import write_frame

        t0 = time.perf_counter()
        positions = state.getPositions(asNumpy=True).value_in_unit(unit.angstrom)
        box = state.getPeriodicBoxVectors(asNumpy=True).value_in_unit(unit.angstrom)
        path = self.directory / f"frame_{self.frames:09d}.isf"
        self.bytes += write_frame(  # plain open / write / close
            path, positions, step=int(simulation.currentStep),
            time=round(float(state.getTime().value_in_unit(unit.picosecond)), 9), box=box,
        )
        self.barrier.wait(self.timeout)
        self.frames += 1
        self.publish_seconds += time.perf_counter() - t0


def _simulate(reporter: Any, seed: int, steps: int, interval: int, threads: int,
              progress: Any, ready: Any = None) -> tuple[float, int]:
    from .openmm import make_simulation

    # deterministic forces: both workflows then simulate the same trajectory for the same seed
    simulation = make_simulation(seed=seed, threads=threads, deterministic=True)
    simulation.reporters.append(reporter)
    if ready is not None:  # (the system built: what is waited for from here is the frames)
        ready()
    t0 = time.perf_counter()
    for _ in range(steps // interval):
        simulation.step(interval)
        progress.value = reporter.frames
    return time.perf_counter() - t0, simulation.currentStep


def _producer_instride(stream: str, seed: int, steps: int, interval: int, threads: int,
                       progress: Any, results: Any) -> None:
    from .openmm import FrameReporter

    reporter = FrameReporter(stream, interval)
    with reporter:
        wall, done = _simulate(reporter, seed, steps, interval, threads, progress)
    results.put(("producer", {
        "frames": reporter.frames, "bytes": reporter.bytes, "steps": done, "wall": wall,
        "overhead": reporter.publish_seconds,
    }))


def _producer_localfs(directory: str, barrier: Any, seed: int, steps: int, interval: int,
                      threads: int, timeout: float, progress: Any, results: Any) -> None:
    reporter = BarrierFileReporter(directory, interval, barrier, timeout)
    # both sides ready before the first step (neither the consumer's start-up nor the
    # producer's building of the system is charged to the frames)
    wall, done = _simulate(reporter, seed, steps, interval, threads, progress,
                           ready=lambda: barrier.wait(timeout))
    results.put(("producer", {
        "frames": reporter.frames, "bytes": reporter.bytes, "steps": done, "wall": wall,
        "overhead": reporter.publish_seconds,
    }))


# ---------------------------------------------------------------------------- consumers
def _analytics_kwargs() -> dict[str, Any]:
    from ..analytics.eigen import VILLIN_SUBSTRUCTURES

    return {"selection": "protein and name CA", "rgyr_selection": "protein",
            "substructures": VILLIN_SUBSTRUCTURES}


def _consumer_instride(stream: str, out_dir: str, replica: int, timeout: float, progress: Any,
                       results: Any) -> None:
    warnings.filterwarnings("ignore")
    from ..analytics.live import analyze_stream
    from ..analytics.table_plots import plot_table
    from .openmm import villin_pdb

    def tick(row: dict[str, float]) -> None:
        progress.value += 1

    report = analyze_stream(villin_pdb(), stream, out_dir, timeout=timeout, on_frame=tick,
                            plot=False, **_analytics_kwargs())
    if report.table is not None:
        plot_table(report.table, out_dir, title=f"instride, replica {replica}")
    results.put(("consumer", {
        "frames": report.frames, "bytes": report.bytes, "idle": report.wait_seconds,
        "read": report.read_seconds, "analysis": report.analysis_seconds,
        "wall": report.wall_seconds,
    }))


def _consumer_localfs(directory: str, barrier: Any, nframes: int, out_dir: str, replica: int,
                      timeout: float, progress: Any, results: Any) -> None:
    warnings.filterwarnings("ignore")
    import MDAnalysis as mda
    from MDAnalysis.lib.mdamath import triclinic_box

    from ..analytics.live import InSituAnalytics
    from ..analytics.table_plots import plot_table
    from ..frames import frame_size, read_frame
    from .openmm import villin_pdb

    t_start = time.perf_counter()
    universe = mda.Universe(str(villin_pdb()))
    table = Path(out_dir) / "analytics.csv"
    analytics = InSituAnalytics(universe, table=table, **_analytics_kwargs())
    ts = universe.trajectory.ts
    idle = read = 0.0
    nbytes = 0
    barrier.wait(timeout)  # both sides ready
    try:
        for index in range(nframes):
            t0 = time.perf_counter()
            barrier.wait(timeout)
            t1 = time.perf_counter()
            frame = read_frame(Path(directory) / f"frame_{index:09d}.isf")
            ts.positions[:] = frame.positions
            ts.dimensions = triclinic_box(*frame.box)
            ts.frame = index
            ts.data["step"] = frame.step
            ts.data["time"] = frame.time
            nbytes += frame_size(frame.natoms)
            t2 = time.perf_counter()
            idle += t1 - t0
            read += t2 - t1
            analytics.process(ts)
            progress.value += 1
    finally:
        analytics.finish()
    plot_table(table, out_dir, title=f"localfs+barrier, replica {replica}")
    results.put(("consumer", {
        "frames": analytics.frames, "bytes": nbytes, "idle": idle, "read": read,
        "analysis": analytics.analysis_seconds, "wall": time.perf_counter() - t_start,
    }))


# ---------------------------------------------------------------------------- orchestration
def _node_local_tmp() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else None


@contextlib.contextmanager
def _environment(**values: str | None) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _stop(procs: list[Any]) -> None:
    """Terminate (then kill) every child still running, by its own PID (those not started,
    a start interrupted, are passed over)."""
    procs = [p for p in procs if p.pid is not None]
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(2)


def _run_workflow(name: str, pairs: list[tuple[Any, Any]], nframes: int,
                  progress: list[tuple[Any, Any]], results: list[Any],
                  aborters: list[Any], timeout: float) -> list[tuple[dict, dict]]:
    from ..progress import progress as bar_for

    procs = [p for pair in pairs for p in pair]
    bars = []
    for i in range(len(pairs)):
        for j, what in enumerate(("produced", "analysed")):
            bars.append(bar_for(total=nframes, desc=f"{name} r{i} {what}", unit="frame",
                             position=2 * i + j, leave=True, mininterval=0.5))
    counters = [c for pair in progress for c in pair]
    try:
        for p in procs:
            p.start()
        last_change = time.monotonic()
        seen = [0] * len(counters)
        while any(p.is_alive() for p in procs):
            for k, (bar, counter) in enumerate(zip(bars, counters, strict=True)):
                value = counter.value
                if value != seen[k]:
                    bar.update(value - seen[k])
                    seen[k] = value
                    last_change = time.monotonic()
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            if failed:
                raise DemoError(
                    f"{name}: process {failed[0].name} (pid {failed[0].pid}) exited with code "
                    f"{failed[0].exitcode}; see its traceback above"
                )
            if time.monotonic() - last_change > timeout + 60:
                raise DemoError(f"{name}: no progress for {timeout + 60:.0f} s")
            time.sleep(0.2)
        for k, (bar, counter) in enumerate(zip(bars, counters, strict=True)):
            bar.update(counter.value - seen[k])
        failed = [p for p in procs if p.exitcode != 0]
        if failed:
            raise DemoError(
                f"{name}: process {failed[0].name} exited with code {failed[0].exitcode}"
            )
        out = []
        for queue in results:
            got = dict(queue.get(timeout=10) for _ in range(2))
            out.append((got["producer"], got["consumer"]))
        return out
    except BaseException:
        for abort in aborters:
            with contextlib.suppress(Exception):
                abort()
        _stop(procs)
        raise
    finally:
        for bar in bars:
            bar.close()


def run_demo(
    out: str | os.PathLike[str] = "demo-output",
    *,
    steps: int = 1500,
    interval: int = 15,
    replicas: int = 2,
    threads: int = 1,
    baseline: bool = True,
    timeout: float = 300.0,
) -> list[DemoRow]:
    """Run the demo (see the module documentation); return and save the summary rows.

    Parameters
    ----------
    out
        Output directory (created).
    steps
        MD steps per replica (2 fs each; the default 1500 is 3 ps).
    interval
        Steps between frames.
    replicas
        Producer/consumer pairs, each with its own seed.
    threads
        OpenMM CPU threads per replica.
    baseline
        Also run the localfs + barrier workflow.
    timeout
        Seconds a consumer waits for one frame (and a barrier for its partner).

    Raises
    ------
    ConfigError
        A bad step count, interval, replica or thread count, timeout, or INSTRIDE_DIR.
    DemoError
        A producer or consumer failed.
    """
    for name, value, ok in (("interval", interval, interval >= 1),
                            # (a multiple: the rest was never simulated, while the banner
                            # said it was)
                            ("steps", steps, steps >= interval and steps % max(1, interval) == 0),
                            ("replicas", replicas, replicas >= 1),
                            ("threads", threads, threads >= 1)):
        if not ok:
            raise ConfigError(f"--{name}", value, "need steps >= interval >= 1 (steps a "
                              "multiple of interval), replicas >= 1 and threads >= 1")
    if not (math.isfinite(timeout) and timeout > 0):  # (NaN: no barrier's wait would end)
        raise ConfigError("--timeout", timeout, "expected a finite number of seconds above 0")
    out_dir = Path(out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    nframes = steps // interval
    run_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    user_dir = os.environ.get("INSTRIDE_DIR", "").strip()
    temp_root = tempfile.mkdtemp(prefix="instride-demo-", dir=_node_local_tmp())
    try:  # (from here on, the temporary directory goes whatever happens)
        managed = user_dir or os.path.join(temp_root, "managed")
        try:
            os.makedirs(managed, exist_ok=True)
        except OSError as exc:
            raise ConfigError("INSTRIDE_DIR", managed,
                              f"cannot be made a directory: {exc.strerror or exc}") from None
        ctx = mp.get_context("spawn")
        rows: list[DemoRow] = []
        print(f"instride demo: {replicas} OpenMM replicas x {steps} steps of 2 fs = "
              f"{steps * 0.002:g} ps simulated each (a frame every {interval} steps = {nframes} "
              f"frames of villin, 8,867 atoms); managed directory {managed}")
        with _environment(INSTRIDE_DIR=managed, INSTRIDE_REDIS_URL=None):
            # -- instride
            pairs, progress, results = [], [], []
            for i in range(replicas):
                prog = (ctx.Value("i", 0), ctx.Value("i", 0))
                queue = ctx.Queue()
                stream = f"{run_id}/replica{i}"
                rdir = out_dir / "instride" / f"replica{i}"
                pairs.append((
                    ctx.Process(target=_producer_instride, name=f"instride-producer{i}",
                                args=(stream, 1000 + i, steps, interval, threads, prog[0], queue)),
                    ctx.Process(target=_consumer_instride, name=f"instride-consumer{i}",
                                args=(stream, str(rdir), i, timeout, prog[1], queue)),
                ))
                progress.append(prog)
                results.append(queue)
            got = _run_workflow("instride", pairs, nframes, progress, results, [], timeout)
            rows += _rows("instride", got)
            _overlay(out_dir / "instride", replicas, "instride")

            # -- localfs + barrier
            if baseline:
                localfs = Path(temp_root) / "localfs"
                pairs, progress, results, aborters = [], [], [], []
                for i in range(replicas):
                    prog = (ctx.Value("i", 0), ctx.Value("i", 0))
                    queue = ctx.Queue()
                    barrier = ctx.Barrier(2)
                    fdir = localfs / f"replica{i}"
                    fdir.mkdir(parents=True)
                    rdir = out_dir / "localfs+barrier" / f"replica{i}"
                    pairs.append((
                        ctx.Process(target=_producer_localfs, name=f"localfs-producer{i}",
                                    args=(str(fdir), barrier, 1000 + i, steps, interval,
                                          threads, timeout, prog[0], queue)),
                        ctx.Process(target=_consumer_localfs, name=f"localfs-consumer{i}",
                                    args=(str(fdir), barrier, nframes, str(rdir), i,
                                          timeout, prog[1], queue)),
                    ))
                    progress.append(prog)
                    results.append(queue)
                    aborters.append(barrier.abort)
                got = _run_workflow("localfs", pairs, nframes, progress, results,
                                    aborters, timeout)
                rows += _rows("localfs+barrier", got)
                _overlay(out_dir / "localfs+barrier", replicas, "localfs+barrier")
    finally:
        shutil.rmtree(temp_root, ignore_errors=True)
        if user_dir:
            shutil.rmtree(os.path.join(user_dir, run_id), ignore_errors=True)
            # (and the streams' state beside them: heads, policies, run ids — left behind by
            # every run before)
            shutil.rmtree(state_dir(Path(user_dir), f"{run_id}/replica0").parent,
                          ignore_errors=True)
    text = format_summary(rows)
    if baseline:
        text += "\n\n" + format_comparison(compare_workflows(out_dir, replicas))
    print(text)
    _save_summary(rows, text, out_dir)
    plot_performance(rows, out_dir / "performance.png")
    print(f"tables, plots (performance.png: the cost of moving frames) and summary in {out_dir}")
    return rows


def compare_workflows(out_dir: str | os.PathLike[str], replicas: int) -> dict[int, dict[str, float]]:
    """Largest difference of each analysed quantity between the two workflows, per replica.

    Both workflows run the same seeds on OpenMM's CPU platform with deterministic forces, and
    store frames identically (float32 Å), so they simulate the same trajectory and the tables
    ``OUT/instride/replica<i>/analytics.csv`` and ``OUT/localfs+barrier/replica<i>/analytics.csv``
    are equal.

    Returns
    -------
    dict
        replica -> {column: max |difference|} (``frames`` too: the frame count difference).
    """
    import numpy as np

    from ..analytics.table import read_table

    out = {}
    for i in range(replicas):
        a = read_table(Path(out_dir) / "instride" / f"replica{i}" / "analytics.csv")
        b = read_table(Path(out_dir) / "localfs+barrier" / f"replica{i}" / "analytics.csv")
        n = min(len(a["frame"]), len(b["frame"]))
        diffs = {"frames": float(abs(len(a["frame"]) - len(b["frame"])))}
        for col in a:
            if col in b and col != "frame":
                diffs[col] = float(np.max(np.abs(a[col][:n] - b[col][:n]))) if n else 0.0
        out[i] = diffs
    return out


def format_comparison(diffs: dict[int, dict[str, float]]) -> str:
    """One line per replica: are the two workflows' trajectories the same?"""
    lines = ["same seed, same trajectory? largest difference between the workflows' analytics:"]
    for i, d in diffs.items():
        if not any(d.values()):
            lines.append(f"  replica {i}: same (every frame, every quantity identical)")
            continue
        parts = ", ".join(f"{k} {v:.2g}" for k, v in d.items())
        lines.append(f"  replica {i}: DIFFERENT ({parts})")
    return "\n".join(lines)


def plot_performance(rows: list[DemoRow], path: str | os.PathLike[str]) -> Path:
    """A bar chart of the cost of moving frames, per workflow and replica (ms per frame)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import numpy as np

    metrics = (("producer_overhead_s", "producer: publish (+ barrier)"),
               ("consumer_idle_s", "consumer: idle, waiting for frames"),
               ("consumer_read_s", "consumer: read + verify"))
    labels = [f"{r.workflow}\nreplica {r.replica}" for r in rows]
    x = np.arange(len(rows))
    width = 0.8 / len(metrics)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.8 * len(rows)), 4.8))
    for k, (attr, name) in enumerate(metrics):
        values = [1e3 * getattr(r, attr) / max(r.frames, 1) for r in rows]
        ax.bar(x + (k - (len(metrics) - 1) / 2) * width, values, width, label=name)
    ax.set_xticks(x, labels)
    ax.set_ylabel("ms per frame")
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set_title("moving frames from the simulation to the analytics")
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def _rows(workflow: str, got: list[tuple[dict, dict]]) -> list[DemoRow]:
    rows = []
    for i, (prod, cons) in enumerate(got):
        rows.append(DemoRow(
            workflow=workflow, replica=i, frames=cons["frames"], bytes=cons["bytes"],
            steps_per_second=prod["steps"] / prod["wall"] if prod["wall"] else 0.0,
            producer_overhead_s=prod["overhead"], consumer_idle_s=cons["idle"],
            consumer_read_s=cons["read"], analysis_s=cons["analysis"],
            producer_wall_s=prod["wall"], consumer_wall_s=cons["wall"],
        ))
    return rows


def _overlay(directory: Path, replicas: int, title: str) -> None:
    from ..analytics.table_plots import plot_overlay

    tables = {f"replica {i}": directory / f"replica{i}" / "analytics.csv" for i in range(replicas)}
    plot_overlay(tables, directory, title=title)


_HEADER = ("workflow", "replica", "frames", "MB moved", "steps/s", "producer overhead s",
           "overhead/frame ms", "consumer idle s", "consumer read s")


def format_summary(rows: list[DemoRow]) -> str:
    """The summary as an aligned text table, with per-workflow ratios at the end."""
    body = []
    for r in rows:
        body.append((
            r.workflow, str(r.replica), str(r.frames), f"{r.bytes / 1e6:.2f}",
            f"{r.steps_per_second:.1f}", f"{r.producer_overhead_s:.3f}",
            f"{1e3 * r.producer_overhead_s / max(r.frames, 1):.2f}",
            f"{r.consumer_idle_s:.2f}", f"{r.consumer_read_s:.3f}",
        ))
    widths = [max(len(h), *(len(b[j]) for b in body)) if body else len(h)
              for j, h in enumerate(_HEADER)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(_HEADER, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    by = {w: [r for r in rows if r.workflow == w] for w in WORKFLOWS}
    if by["instride"] and by["localfs+barrier"]:
        def total(w: str, attr: str) -> float:
            return sum(getattr(r, attr) for r in by[w])

        ov = total("localfs+barrier", "producer_overhead_s") / max(
            total("instride", "producer_overhead_s"), 1e-12)
        rd = total("localfs+barrier", "consumer_read_s") / max(
            total("instride", "consumer_read_s"), 1e-12)
        lines.append("")
        lines.append(f"producer overhead, localfs+barrier / instride: {ov:.2f}x "
                     "(the barrier makes the producer wait for its consumer)")
        lines.append(f"consumer read time, localfs+barrier / instride: {rd:.2f}x")
    return "\n".join(lines)


def _save_summary(rows: list[DemoRow], text: str, out_dir: Path) -> None:
    with open(out_dir / "summary.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        fields = list(DemoRow.__dataclass_fields__)
        writer.writerow(fields)
        for r in rows:
            writer.writerow([getattr(r, f) for f in fields])
    (out_dir / "summary.txt").write_text(text + "\n")

