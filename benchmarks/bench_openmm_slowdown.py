"""How much does publishing frames into instride slow an OpenMM simulation down?

One run measures, on the same Simulation (villin in water, 8,867 atoms, OpenMM CPU platform):

* ``none``      — no reporter (the baseline);
* ``instride``  — :class:`instride.md.openmm.FrameReporter` publishing every N steps;
* ``dcd``       — OpenMM's own ``DCDReporter`` writing every N steps (same storage as the
  managed directory);

at two output frequencies: the DYAD study's (one frame every 0.82 s of wall time; N is
chosen from the steps/s measured here) and a high one (every ``--high`` steps). Each
configuration is run ``--reps`` times, interleaved, and the median steps/s is reported with
its ratio to ``none``. The process CPU time per step (all threads) is reported too: on a
shared machine it is much less sensitive than wall time to other users' load.

Usage::

    python benchmarks/bench_openmm_slowdown.py [--steps 150] [--reps 3] [--high 1] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import shutil
import statistics
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="MD steps per measurement")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of each configuration")
    ap.add_argument("--high", type=int, default=1, help="high-frequency interval (steps)")
    ap.add_argument("--threads", type=int, default=1, help="OpenMM CPU threads")
    ap.add_argument("--paper-seconds", type=float, default=0.82,
                    help="wall seconds between frames at the study's frequency")
    args = ap.parse_args(argv)

    import openmm
    from openmm.app import DCDReporter

    root = tempfile.mkdtemp(prefix="instride-bench-omm-",
                            dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    os.environ["INSTRIDE_DIR"] = os.path.join(root, "managed")
    os.environ.pop("INSTRIDE_REDIS_URL", None)
    from instride.md.openmm import FrameReporter, make_simulation

    print("## OpenMM slowdown from publishing frames (FrameReporter vs DCDReporter)\n")
    print(f"- command: `{shlex.join([sys.executable, *sys.argv])}`")
    print(f"- machine: {machine()}")
    print(f"- OpenMM {openmm.__version__}, villin + water (8,867 atoms), CPU platform, "
          f"{args.threads} thread(s); managed directory and DCD files on {root}")
    print(f"- {args.steps} steps per measurement, {args.reps} interleaved repetitions, "
          "median reported\n")
    sys.stdout.flush()

    sim = make_simulation(seed=11, threads=args.threads)
    sim.step(20)  # warm-up: context and PME plans

    counter = [0]

    def run(kind: str, interval: int) -> tuple[float, float]:
        counter[0] += 1
        sim.reporters.clear()
        reporter = None
        if kind == "instride":
            reporter = FrameReporter(f"bench/run{counter[0]}", interval)
            sim.reporters.append(reporter)
        elif kind == "dcd":
            sim.reporters.append(DCDReporter(os.path.join(root, f"run{counter[0]}.dcd"),
                                             interval))
        t0, c0 = time.perf_counter(), time.process_time()
        sim.step(args.steps)
        if reporter is not None:
            reporter.close()
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        sim.reporters.clear()
        return args.steps / elapsed, 1e3 * cpu / args.steps

    try:
        base = statistics.median(run("none", 1)[0] for _ in range(2))
        paper_n = max(1, round(base * args.paper_seconds))
        print(f"measured {base:.1f} steps/s without output -> the study's output frequency "
              f"(one frame per {args.paper_seconds} s) is every N = {paper_n} steps\n")
        configs = [("none", 1), ("instride", paper_n), ("dcd", paper_n),
                   ("instride", args.high), ("dcd", args.high)]
        samples: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
        cpu: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
        for _ in range(args.reps):
            for c in configs:
                rate, ms = run(*c)
                samples[c].append(rate)
                cpu[c].append(ms)
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
        for n in (paper_n, args.high):
            i = statistics.median(samples[("instride", n)])
            d = statistics.median(samples[("dcd", n)])
            ic = statistics.median(cpu[("instride", n)])
            dc = statistics.median(cpu[("dcd", n)])
            print(f"- every {n} steps: steps/s instride / none = {i / ref:.3f}, dcd / none = "
                  f"{d / ref:.3f}, instride / dcd = {i / d:.3f}; CPU per step instride / none = "
                  f"{ic / ref_cpu:.3f}, dcd / none = {dc / ref_cpu:.3f}, instride / dcd = "
                  f"{ic / dc:.3f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
