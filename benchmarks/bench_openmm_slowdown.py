"""How much does publishing frames into instride slow an OpenMM simulation down?

One run measures, on the same Simulation (by default villin in water, 8,867 atoms, OpenMM CPU
platform):

* ``none``      — no reporter (the baseline);
* ``instride``  — :class:`instride.md.openmm.FrameReporter` publishing every N steps;
* ``dcd``       — OpenMM's own ``DCDReporter`` writing every N steps (same storage as the
  managed directory);

at the DYAD study's output frequency (one frame every 0.82 s of wall time; N is chosen from
the steps/s measured here) and at high ones (every ``--high`` steps; a comma-separated list
measures several). Each configuration is run ``--reps`` times, interleaved, and the median
steps/s is reported with its ratio to ``none``. The process CPU time per step (all threads) is
reported too: on a shared machine it is much less sensitive than wall time to other users' load.

GPUs: ``--platform CUDA`` (or ``OpenCL``) runs the same measurement on a GPU, where an MD step
is ~100x faster and the cost of taking frames off the device is much more visible.
``--precision`` sets the GPU platform's precision (default: the platform's own, ``single``).
A GPU platform runs asynchronously, so every measurement there ends with a ``getState`` of the
positions, which waits for the device (the same for all outputs; the CPU platform needs none).
``--system water:L`` replaces villin by a cubic box of TIP3P-FB water with an edge of ``L`` nm
(about 100 atoms per nm^3: ``water:10`` is ~100,000 atoms), built with OpenMM's ``Modeller``
and energy-minimised (100 iterations) before the warm-up, for a system big enough to keep a
large GPU busy. Frame files and DCD files are deleted after each measurement (outside its
timing), so long runs at every step do not fill the managed directory's file system.
``--retain K`` publishes into bounded streams (``retain=K``, recycled frame files) instead of
unbounded ones. Note: the producer of an unbounded stream keeps two file descriptors (and a
mapping) per published frame, so one measurement must publish fewer than about
``ulimit -n`` / 2 frames (it fails with ``OSError: [Errno 24] Too many open files``).

Usage::

    python benchmarks/bench_openmm_slowdown.py [--steps 150] [--reps 3] [--high 1] [--threads 1]
    python benchmarks/bench_openmm_slowdown.py --platform CUDA --steps 20000 --reps 3 \\
        --high 1,10,100 [--system water:10] [--precision mixed]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def machine() -> str:
    cpu = "unknown CPU"
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as fh:
        mem_kb = int(fh.readline().split()[1])
    load = os.getloadavg()
    return (f"{os.cpu_count()} cores ({cpu}), {mem_kb / 2**20:.1f} GiB RAM, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
            f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


def gpu_name() -> str:
    """The GPUs nvidia-smi lists (name, driver), or a note that it is not there."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "nvidia-smi not available"
    return "; ".join(line.strip() for line in out.splitlines()) or "nvidia-smi lists no GPU"


def water_box(edge_nm: float, path: str) -> str:
    """Write a cubic box of TIP3P-FB water with an edge of ``edge_nm`` nm to ``path`` (PDB)."""
    import openmm
    from openmm import app, unit

    forcefield = app.ForceField("amber14-all.xml", "amber14/tip3pfb.xml")
    modeller = app.Modeller(app.Topology(), [])
    modeller.addSolvent(forcefield, model="tip3p",
                        boxSize=openmm.Vec3(edge_nm, edge_nm, edge_nm) * unit.nanometer)
    with open(path, "w") as fh:
        app.PDBFile.writeFile(modeller.topology, modeller.positions, fh)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="MD steps per measurement")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of each configuration")
    ap.add_argument("--high", default="1",
                    help="high-frequency interval(s) in steps, comma-separated (e.g. 1,10,100)")
    ap.add_argument("--threads", type=int, default=1, help="OpenMM CPU threads")
    ap.add_argument("--platform", choices=("CPU", "CUDA", "OpenCL"), default="CPU",
                    help="OpenMM platform")
    ap.add_argument("--precision", choices=("single", "mixed", "double"), default=None,
                    help="precision of a GPU platform (default: the platform's own)")
    ap.add_argument("--system", default="villin",
                    help="'villin' (8,867 atoms) or 'water:L', a cubic water box of edge L nm")
    ap.add_argument("--retain", type=int, default=None,
                    help="publish into bounded streams keeping this many frames (recycled "
                         "files) instead of unbounded ones (default)")
    ap.add_argument("--paper-seconds", type=float, default=0.82,
                    help="wall seconds between frames at the study's frequency")
    args = ap.parse_args(argv)
    highs = [int(v) for v in str(args.high).split(",") if v.strip()]
    if not highs or min(highs) < 1:
        ap.error("--high needs positive intervals")
    if args.system != "villin" and not args.system.startswith("water:"):
        ap.error("--system is 'villin' or 'water:L'")
    if args.precision and args.platform == "CPU":
        ap.error("--precision applies to CUDA and OpenCL")

    import openmm
    from openmm.app import DCDReporter

    root = tempfile.mkdtemp(prefix="instride-bench-omm-",
                            dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    os.environ["INSTRIDE_DIR"] = os.path.join(root, "managed")
    os.environ.pop("INSTRIDE_REDIS_URL", None)
    from instride import Stream
    from instride.md.openmm import FrameReporter, make_simulation

    if args.system == "villin":
        pdb, system_name = None, "villin + water"
    else:
        edge = float(args.system.split(":", 1)[1])
        pdb, system_name = water_box(edge, os.path.join(root, "water.pdb")), \
            f"a {edge:g} nm cubic box of TIP3P-FB water"
    props = {"Precision": args.precision} if args.precision else None
    sim = make_simulation(pdb, seed=11, threads=args.threads, platform=args.platform,
                          properties=props)
    if pdb is not None:
        sim.minimizeEnergy(maxIterations=100)
    natoms = sim.system.getNumParticles()
    plat = sim.context.getPlatform()
    plat_props = ", ".join(f"{name}={plat.getPropertyValue(sim.context, name)}"
                           for name in plat.getPropertyNames()
                           if name in ("Threads", "DeviceName", "Precision", "DeviceIndex",
                                       "OpenCLPlatformName"))
    gpu = args.platform != "CPU"

    print("## OpenMM slowdown from publishing frames (FrameReporter vs DCDReporter)\n")
    print(f"- command: `{shlex.join([sys.executable, *sys.argv])}`")
    print(f"- machine: {machine()}")
    if gpu:
        print(f"- GPU (nvidia-smi): {gpu_name()}")
    threads = f", {args.threads} thread(s)" if not gpu else ""
    print(f"- OpenMM {openmm.__version__}, {system_name} ({natoms:,} atoms), {plat.getName()} "
          f"platform{threads} ({plat_props}); managed directory and DCD files on {root}")
    retention = ("unbounded streams" if args.retain is None
                 else f"bounded streams (retain={args.retain}, recycled frame files)")
    print(f"- {args.steps} steps per measurement, {args.reps} interleaved repetitions, "
          f"median reported; FrameReporter publishes into {retention}\n")
    sys.stdout.flush()

    sim.step(20)  # warm-up: context and PME plans
    if gpu:
        sim.context.getState(getPositions=True)

    counter = [0]

    def run(kind: str, interval: int) -> tuple[float, float]:
        counter[0] += 1
        sim.reporters.clear()
        reporter = None
        if kind == "instride":
            name = f"bench/run{counter[0]}"
            stream = name if args.retain is None else Stream(name, mode="w", retain=args.retain)
            reporter = FrameReporter(stream, interval)
            sim.reporters.append(reporter)
        elif kind == "dcd":
            sim.reporters.append(DCDReporter(os.path.join(root, f"run{counter[0]}.dcd"),
                                             interval))
        t0, c0 = time.perf_counter(), time.process_time()
        sim.step(args.steps)
        if gpu:
            sim.context.getState(getPositions=True)  # wait for the device
        if reporter is not None:
            reporter.close()
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        sim.reporters.clear()
        # drop this run's frame files and DCD file (outside the timing): long runs at every
        # step would fill the file system
        shutil.rmtree(os.path.join(root, "managed", "bench", f"run{counter[0]}"),
                      ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(root, f"run{counter[0]}.dcd"))
        return args.steps / elapsed, 1e3 * cpu / args.steps

    try:
        base = statistics.median(run("none", 1)[0] for _ in range(2))
        paper_n = max(1, round(base * args.paper_seconds))
        print(f"measured {base:.1f} steps/s without output -> the study's output frequency "
              f"(one frame per {args.paper_seconds} s) is every N = {paper_n} steps\n")
        measured = [paper_n, *highs]
        if paper_n > args.steps:
            # a measurement would publish no frame at all: it would only time the baseline
            print(f"(N = {paper_n} > --steps {args.steps}: a measurement would publish no frame "
                  "at the study's frequency, so it is skipped; use more steps to measure it)\n")
            measured = highs
        intervals = list(dict.fromkeys(measured))
        configs = [("none", 1)] + [(kind, n) for n in intervals for kind in ("instride", "dcd")]
        samples: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
        cpu: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
        for rep in range(args.reps):
            t_rep = time.perf_counter()
            for c in configs:
                rate, ms = run(*c)
                samples[c].append(rate)
                cpu[c].append(ms)
                print(f"  {c[0]} every {c[1]}: {rate:.2f} steps/s, {ms:.2f} CPU ms/step",
                      file=sys.stderr, flush=True)
            print(f"repetition {rep + 1}/{args.reps}: {time.perf_counter() - t_rep:.1f} s",
                  file=sys.stderr, flush=True)
        ref = statistics.median(samples[("none", 1)])
        ref_cpu = statistics.median(cpu[("none", 1)])
        print("| output | every N steps | frames/s | steps/s (median) | runs | steps/s ratio "
              "to none | CPU ms/step (median) | CPU ratio to none |")
        print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
        for kind, n in configs:
            med = statistics.median(samples[(kind, n)])
            med_cpu = statistics.median(cpu[(kind, n)])
            runs = ", ".join(f"{v:.1f}" for v in samples[(kind, n)])
            fps = "-" if kind == "none" else f"{med / n:.2f}"
            nn = "-" if kind == "none" else str(n)
            print(f"| {kind} | {nn} | {fps} | {med:.2f} | {runs} | {med / ref:.3f} | "
                  f"{med_cpu:.1f} | {med_cpu / ref_cpu:.3f} |")
        print()
        for n in intervals:
            i = statistics.median(samples[("instride", n)])
            d = statistics.median(samples[("dcd", n)])
            ic = statistics.median(cpu[("instride", n)])
            dc = statistics.median(cpu[("dcd", n)])
            # wall time each frame adds to the run: (1/rate - 1/rate_none) per step, n steps
            i_ms, d_ms = (1e3 * n * (1 / r - 1 / ref) for r in (i, d))
            print(f"- every {n} steps: steps/s instride / none = {i / ref:.3f}, dcd / none = "
                  f"{d / ref:.3f}, instride / dcd = {i / d:.3f}; CPU per step instride / none = "
                  f"{ic / ref_cpu:.3f}, dcd / none = {dc / ref_cpu:.3f}, instride / dcd = "
                  f"{ic / dc:.3f}; wall ms added per frame: instride {i_ms:.2f}, dcd {d_ms:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
