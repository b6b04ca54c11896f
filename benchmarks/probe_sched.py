"""The data servers' scheduling policy, ``SCHED_BATCH`` against ``SCHED_OTHER``, interleaved.

``instride serve`` runs its threads under ``SCHED_BATCH`` by default (``--sched``,
``INSTRIDE_SERVE_SCHED``; see docs/design.md). This probe measures what that gains and costs on
one emulated cluster whose servers are switched between the two policies round by round
(``chrt -a -p``: every thread, and the threads they start later):

* ``--what pairs``: the bounded 8 pairs of ``bench_cluster.py`` (section 4; 4 nodes), then 8 raw
  TCP pairs right after: frames per second, the ratio to raw TCP, context switches per frame;
* ``--what latency``: the JAC latency sections of ``bench_cluster.py`` (2 nodes, frames 20 ms
  apart): publish start on node 1 -> bytes on node 2 for the file API, a bounded stream's
  reader asleep and with ``spin="auto"``, and the preload library's 4 KiB keys.

Rounds alternate which policy goes first: this VM's speed drifts by tens of percent over
minutes. Needs root, iproute2, redis-server and util-linux's ``chrt`` (``make test`` installs
them).

Usage: ``python benchmarks/probe_sched.py [--what pairs|latency] [--rounds R] [--frames N]``
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import bench_cluster as bc
from bench_preload_overhead import EXCHANGE_C, compile_c
from common import CpuMeter, header, summary
from instride.emulate import EmulatedCluster
from instride.frames import frame_size
from instride.interception.preload import preload_path

JAC_ATOMS = 23_558
POLICIES = {"batch": "-b", "normal": "-o"}


def set_servers(c: EmulatedCluster, policy: str) -> None:
    """Put every thread of every node's data server under ``policy``."""
    chrt = shutil.which("chrt")
    assert chrt is not None, "util-linux's chrt is needed (apt-get install util-linux)"
    for node in c.status()["nodes"]:
        subprocess.run([chrt, "-a", "-p", POLICIES[policy], "0", str(node["server"]["pid"])],
                       check=True, capture_output=True)


def pairs_round(c: EmulatedCluster, name: str, n: int, paths: list[str]) -> str:
    pairs = [(1 + i % 2, 3 + (i // 2) % 2) for i in range(8)]
    ours = CpuMeter()
    _, span = bc.stream_span(c, name, n, JAC_ATOMS, pairs, bounded=True, meter=ours)
    raw = bc.raw_tcp_pairs(c, pairs, paths, frame_size(JAC_ATOMS, "paper"), n)
    mbps = 8 * n * frame_size(JAC_ATOMS, "paper") / span / 1e6
    u = ours.per(8 * n)
    return (f"{8 * n / span:5.0f} frames/s, ratio {mbps / raw:.2f} to raw TCP ({raw:.0f} MB/s),"
            f" {u['context_switches']:.1f} context switches per frame")


def latency_round(c: EmulatedCluster, name: str, n: int, exchange: Path) -> str:
    out = {}
    _, lat = bc.stream_run(c, f"{name}f", n, JAC_ATOMS, 0.02, [(1, 2)])
    out["file API"] = summary(lat[0])["median"]
    _, lat = bc.stream_run(c, f"{name}b", n, JAC_ATOMS, 0.02, [(1, 2)], bounded=True)
    out["bounded"] = summary(lat[0])["median"]
    _, lat = bc.stream_run(c, f"{name}a", n, JAC_ATOMS, 0.02, [(1, 2)], bounded=True, auto=True)
    out["bounded, spin=auto"] = summary(lat[0])["median"]
    shim = {"LD_PRELOAD": str(preload_path())}
    where = f"{name}s"
    cons = c.popen(2, [str(exchange), "consume", str(c.node(2).dir / where), str(n), "0"],
                   env=shim, stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    subprocess.run(c.command(1, [str(exchange), "produce", str(c.node(1).dir / where), str(n),
                                 "3000"]), env={**c.node(1).env, **shim}, check=True)
    got, _ = cons.communicate(timeout=600)
    out["preload"] = summary([int(x) / 1e3 for x in got.split()])["median"]
    return ", ".join(f"{k} {v:.0f} µs" for k, v in out.items()) + " (medians)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", choices=["pairs", "latency"], default="pairs")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of both policies (default 3)")
    ap.add_argument("--frames", type=int, default=None,
                    help="frames per pair (pairs, default 1000) or per latency run (default 300)")
    args = ap.parse_args()
    header(f"data servers under SCHED_BATCH vs SCHED_OTHER, interleaved: {args.what}")
    with tempfile.TemporaryDirectory(prefix="instride-probe-sched-") as work, \
            EmulatedCluster(nodes=4 if args.what == "pairs" else 2) as c:
        if args.what == "pairs":
            n = args.frames or 1000
            for i in range(8):  # one frame per pair for the raw TCP servers to send
                p = 1 + i % 2
                bc._popen(c, p, bc.PRODUCE, f"seed/p{i}", 1, JAC_ATOMS, 0.0).communicate(timeout=120)
            paths = [str(c.node(1 + i % 2).dir / "seed" / f"p{i}" / "frame_000000000.isf")
                     for i in range(8)]
        else:
            n = args.frames or 300
            exchange = compile_c(EXCHANGE_C, Path(work) / "exchange")
        for r in range(args.rounds):
            for policy in (("batch", "normal") if r % 2 == 0 else ("normal", "batch")):
                set_servers(c, policy)
                name = f"r{r}{policy}"
                line = pairs_round(c, name, n, paths) if args.what == "pairs" \
                    else latency_round(c, name, n, exchange)
                print(f"round {r}, {policy:6s}: {line}", flush=True)
        set_servers(c, "batch")


if __name__ == "__main__":
    main()
