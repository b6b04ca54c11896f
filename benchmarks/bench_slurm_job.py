"""What ``instride job`` costs a Slurm job: starting and stopping the services.

On a real Slurm of emulated nodes (:class:`instride.emulate.slurm.EmulatedSlurm`), for 2 and 4
nodes, measures in one run:

1. baseline: a batch job running ``srun -N <nodes> true`` (submit to COMPLETED);
2. the same step inside ``instride job``: the whole job's wall time, and inside it the time
   from ``instride job`` starting to the command starting (Redis, one data server per node,
   registration) and from the command ending to ``instride job`` returning (teardown: every
   agent stops its server and removes its directory, then Redis stops).

Needs root, slurm-wlm, munge, redis-server (``make test`` installs them).
Usage: ``python benchmarks/bench_slurm_job.py [--repeats N]``
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import header, save, summary
from instride.emulate.slurm import EmulatedSlurm

PY = sys.executable


def run_job(slurm: EmulatedSlurm, body: str, nodes: int, out: Path) -> tuple[float, str]:
    t0 = time.perf_counter()
    job = slurm.sbatch(f"#!/bin/sh\n{body}\n", "-N", str(nodes), f"--output={out}")
    state = slurm.wait(job, timeout=300)
    wall = time.perf_counter() - t0
    if state != "COMPLETED":
        raise SystemExit(f"job {job} ended {state}:\n{out.read_text()}")
    return wall, out.read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    machine = header("instride job on Slurm: services start/stop vs a plain job")
    scratch = Path(tempfile.mkdtemp(prefix="isl-bench-", dir="/tmp"))
    result: dict = {"machine": machine, "repeats": args.repeats, "nodes": {}}
    try:
        with EmulatedSlurm(nodes=4, kill_wait=10) as slurm:
            for nodes in (2, 4):
                base, whole, start, stop = [], [], [], []
                for rep in range(args.repeats):
                    out = scratch / f"base-{nodes}-{rep}.out"
                    base.append(run_job(slurm, f"srun -N {nodes} true", nodes, out)[0])
                    body = (
                        f"export INSTRIDE_JOB_STATE_DIR={scratch}/states\n"
                        "echo t0 $(date +%s.%N)\n"
                        f"{PY} -m instride job --dir {scratch}/%n-%j -- sh -c "
                        f"'echo t1 $(date +%s.%N); srun -N {nodes} true; echo t2 $(date +%s.%N)'\n"
                        "echo t3 $(date +%s.%N)")
                    wall, text = run_job(slurm, body, nodes, scratch / f"job-{nodes}-{rep}.out")
                    t = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                         if line[:2] in ("t0", "t1", "t2", "t3")}
                    whole.append(wall)
                    start.append(t["t1"] - t["t0"])
                    stop.append(t["t3"] - t["t2"])
                left = [p for p in scratch.iterdir() if p.suffix != ".out" and p.name != "states"]
                entry = {
                    "plain_job_s": summary(base), "instride_job_s": summary(whole),
                    "services_start_s": summary(start), "services_stop_s": summary(stop),
                    "ratio_job_wall": statistics.median(whole) / statistics.median(base),
                    "left_behind": [str(p) for p in left],
                }
                result["nodes"][nodes] = entry
                print(f"{nodes} nodes: plain job {entry['plain_job_s']['median']:.2f} s, "
                      f"with instride job {entry['instride_job_s']['median']:.2f} s "
                      f"(x{entry['ratio_job_wall']:.2f}); services start "
                      f"{entry['services_start_s']['median']:.2f} s, stop "
                      f"{entry['services_stop_s']['median']:.2f} s (medians of "
                      f"{args.repeats}); left behind: {len(left)}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    save("slurm_job", result)


if __name__ == "__main__":
    main()
