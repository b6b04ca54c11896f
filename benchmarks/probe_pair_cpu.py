"""Where the CPU of the bounded 8 pairs (``bench_cluster.py`` section 4) goes, per process.

``probe_pairs.py`` gives the whole machine's CPU per frame; this splits it: each producer and
each group reader reads its own ``os.times()`` and ``getrusage()`` around its loop (user and
kernel µs per frame of its own, voluntary and involuntary context switches per frame), and
the data servers' and Redis's CPU and context switches come from ``/proc`` around the run
(their threads' switches are counted while they live: a server's connection threads end with
the run, so theirs are not). Frames per second over all pairs beside them. Alternate two trees
(``PYTHONPATH=<other tree>/src``) run by run to compare a change: this VM's speed drifts by
tens of percent over minutes. Needs root, iproute2 and redis-server (``make test`` installs
them).

Usage: ``python benchmarks/probe_pair_cpu.py [--frames N] [--pairs P] [--rounds R]``
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import tempfile
from typing import Any

import bench_cluster
from bench_cluster import stream_span
from common import header
from instride.emulate import EmulatedCluster

JAC_ATOMS = 23_558
#: what each producer and reader adds to its script: its own CPU and context switches around
#: its loop, printed to stderr as "TIMES P|R user system voluntary involuntary"
_START = "import os as _os, resource as _res, sys as _sys\n"
_MARK = "_t0, _r0 = _os.times(), _res.getrusage(_res.RUSAGE_SELF)\n"
#: (one write of the whole line, to a file opened for appending: lines of 16 processes never
#: interleave -- print() writes the line and its end apart, and a run now and then lost one)
_REPORT = ("_t1, _r1 = _os.times(), _res.getrusage(_res.RUSAGE_SELF); "
           "_os.write(2, ('TIMES {who} %r %r %d %d\\n' % (_t1.user - _t0.user, "
           "_t1.system - _t0.system, _r1.ru_nvcsw - _r0.ru_nvcsw, "
           "_r1.ru_nivcsw - _r0.ru_nivcsw)).encode())\n")


def _instrumented() -> tuple[str, str]:
    """The bench's producer and group reader scripts, measuring their loops."""
    produce = bench_cluster.PRODUCE.replace("out = []  # printed", _MARK + "out = []  # printed")
    produce = produce.replace('print(" ".join(map(str, out)), flush=True)\n',
                              _REPORT.format(who="P") + 'print(" ".join(map(str, out)), flush=True)\n',
                              1)
    consume = bench_cluster.CONSUME_GROUP.replace("t0 = time.perf_counter()\n",
                                                  "t0 = time.perf_counter()\n" + _MARK)
    consume = consume.replace("print(time.perf_counter() - t0)\n",
                              _REPORT.format(who="R") + "print(time.perf_counter() - t0)\n")
    if _MARK not in produce or _MARK not in consume or "TIMES" not in produce + consume:
        raise SystemExit("bench_cluster's scripts changed: this probe must follow them")
    return _START + produce, _START + consume


def _pids(pattern: str) -> list[int]:
    """Processes whose command line holds ``pattern``."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as fh:
                    if pattern in fh.read().replace(b"\0", b" ").decode(errors="replace"):
                        out.append(int(d))
            except OSError:
                continue
    return out


def _proc(pids: list[int]) -> dict[int, tuple[int, int, int, int]]:
    """(user ticks, kernel ticks, voluntary, involuntary context switches) of each live pid."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                f = fh.read().rsplit(")", 1)[1].split()
            v = i = 0
            for status in glob.glob(f"/proc/{pid}/task/*/status"):
                with open(status) as fh:
                    for line in fh:
                        if line.startswith("voluntary_ctxt_switches"):
                            v += int(line.split()[1])
                        elif line.startswith("nonvoluntary_ctxt_switches"):
                            i += int(line.split()[1])
            out[pid] = (int(f[11]), int(f[12]), v, i)
        except OSError:
            continue
    return out


def _mean(rows: list[tuple[float, ...]], k: int) -> float:
    return sum(r[k] for r in rows) / max(len(rows), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=1500, help="frames per pair (default 1500)")
    ap.add_argument("--pairs", type=int, default=8, help="producer/reader pairs (default 8)")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    header(f"CPU per frame of each process of {args.pairs} bounded pairs (bench_cluster section 4)")
    bench_cluster.PRODUCE, bench_cluster.CONSUME_GROUP = _instrumented()
    pairs = [(1 + i % 2, 3 + (i // 2) % 2) for i in range(args.pairs)]
    n, tick = args.frames, os.sysconf("SC_CLK_TCK")
    with EmulatedCluster(nodes=4) as c:
        others = _pids("instride serve") + _pids("redis-server")
        popen = c.popen
        for r in range(args.rounds):
            with tempfile.TemporaryFile("a+") as err:  # (appends: lines never interleave)
                def to_err(*a: Any, _err: Any = err, **k: Any) -> Any:
                    k["stderr"] = _err
                    return popen(*a, **k)

                c.popen = to_err  # type: ignore[method-assign]
                before = _proc(others)
                try:
                    _, span = stream_span(c, f"cpu{r}", n, JAC_ATOMS, pairs, bounded=True)
                finally:
                    c.popen = popen  # type: ignore[method-assign]
                after = _proc(others)
                err.seek(0)
                text = err.read()
            found = {w: [tuple(map(float, m)) for m in
                         re.findall(rf"TIMES {w} (\S+) (\S+) (\d+) (\d+)\n", text)] for w in "PR"}
            if any(len(v) != len(pairs) for v in found.values()):
                raise SystemExit(f"not every process reported:\n{text[-3000:]}")
            print(f"round {r}: {n * len(pairs) / span:.0f} frames/s")
            for who, rows in (("producer", found["P"]), ("reader", found["R"])):
                print(f"  {who}: {_mean(rows, 0) / n * 1e6:.0f} + {_mean(rows, 1) / n * 1e6:.0f} µs"
                      f" (user + kernel) per frame of its own, context switches"
                      f" {_mean(rows, 2) / n:.2f} voluntary + {_mean(rows, 3) / n:.2f} involuntary")
            total = n * len(pairs)
            for pid in others:
                if pid in before and pid in after:
                    d = [b - a for a, b in zip(before[pid], after[pid], strict=True)]
                    with open(f"/proc/{pid}/cmdline", "rb") as fh:
                        name = "redis" if b"redis" in fh.read() else "data server"
                    print(f"  {name} {pid}: {d[0] / tick / total * 1e6:.0f} + "
                          f"{d[1] / tick / total * 1e6:.0f} µs per frame of all pairs, context"
                          f" switches {d[2] / total:.2f} + {d[3] / total:.2f} (threads alive at"
                          " the end)")


if __name__ == "__main__":
    main()
