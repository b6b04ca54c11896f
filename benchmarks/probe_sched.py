"""The data servers' scheduling policies (``auto``, ``batch``, ``normal``), interleaved.

``instride serve`` runs its threads under ``SCHED_BATCH``, and by default (``--sched auto``)
raises a thread whose fetch has waited 50 ms for its key to ``SCHED_OTHER`` with a short time
slice (``--sched``, ``INSTRIDE_SERVE_SCHED``; see docs/design.md). This probe measures what each
policy gains and costs: round by round, a cluster is started with its servers under each
policy in turn (``--policies``, default ``batch,auto``), and

* ``--what pairs``: the bounded 8 pairs of ``bench_cluster.py`` (section 4; 4 nodes), then 8 raw
  TCP pairs right after: frames per second, the ratio to raw TCP, context switches per frame;
* ``--what latency``: the JAC latency sections of ``bench_cluster.py`` (2 nodes, frames
  ``--gap`` seconds apart, default 0.02): publish start on node 1 -> bytes on node 2 for the
  file API, a bounded stream's reader asleep and with ``spin="auto"``, and the preload
  library's 4 KiB keys.

``--burners N`` keeps N processes spinning at normal priority meanwhile (a simulation that keeps
every core busy). Rounds alternate which policy goes first: this VM's speed drifts by tens of
percent over minutes. Needs root, iproute2 and redis-server (``make test`` installs them).

Usage: ``python benchmarks/probe_sched.py [--what pairs|latency] [--policies P,Q] [--rounds R]
[--frames N] [--gap S] [--burners N]``
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import bench_cluster as bc
from bench_preload_overhead import EXCHANGE_C, compile_c
from common import CpuMeter, header, summary
from instride.config import SERVE_POLICIES
from instride.emulate import EmulatedCluster
from instride.frames import frame_size
from instride.interception.preload import preload_path

JAC_ATOMS = 23_558


@contextlib.contextmanager
def burning(n: int) -> Iterator[None]:
    """``n`` processes spinning at normal priority (stopped by their own PIDs)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def pairs_round(c: EmulatedCluster, name: str, n: int) -> str:
    pairs = [(1 + i % 2, 3 + (i // 2) % 2) for i in range(8)]
    for i in range(8):  # one frame per pair for the raw TCP servers to send
        bc._popen(c, 1 + i % 2, bc.PRODUCE, f"seed/p{i}", 1, JAC_ATOMS, 0.0).communicate(timeout=120)
    paths = [str(c.node(1 + i % 2).dir / "seed" / f"p{i}" / "frame_000000000.isf") for i in range(8)]
    ours = CpuMeter()
    _, span = bc.stream_span(c, name, n, JAC_ATOMS, pairs, bounded=True, meter=ours)
    raw = bc.raw_tcp_pairs(c, pairs, paths, frame_size(JAC_ATOMS, "paper"), n)
    mbps = 8 * n * frame_size(JAC_ATOMS, "paper") / span / 1e6
    u = ours.per(8 * n)
    return (f"{8 * n / span:5.0f} frames/s, ratio {mbps / raw:.2f} to raw TCP ({raw:.0f} MB/s),"
            f" {u['context_switches']:.1f} context switches per frame")


def latency_round(c: EmulatedCluster, name: str, n: int, gap: float, exchange: Path) -> str:
    out = {}
    _, lat = bc.stream_run(c, f"{name}f", n, JAC_ATOMS, gap, [(1, 2)])
    out["file API"] = summary(lat[0])["median"]
    _, lat = bc.stream_run(c, f"{name}b", n, JAC_ATOMS, gap, [(1, 2)], bounded=True)
    out["bounded"] = summary(lat[0])["median"]
    _, lat = bc.stream_run(c, f"{name}a", n, JAC_ATOMS, gap, [(1, 2)], bounded=True, auto=True)
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
    ap.add_argument("--policies", default="batch,auto",
                    help=f"two or more of {', '.join(p for p in SERVE_POLICIES if p != 'inherit')},"
                         " comma-separated (default batch,auto)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every policy (default 3)")
    ap.add_argument("--frames", type=int, default=None,
                    help="frames per pair (pairs, default 1000) or per latency run (default 300)")
    ap.add_argument("--gap", type=float, default=0.02,
                    help="seconds between frames of the latency runs (default 0.02)")
    ap.add_argument("--burners", type=int, default=0,
                    help="processes spinning at normal priority meanwhile (default 0)")
    args = ap.parse_args()
    policies = [p.strip() for p in args.policies.split(",")]
    if len(policies) < 2 or any(p not in SERVE_POLICIES or p == "inherit" for p in policies):
        ap.error("--policies: two or more of auto, batch, normal")
    header(f"data servers under {' / '.join(policies)}, interleaved: {args.what}"
           f" (gap {args.gap} s, {args.burners} burners)")
    n = args.frames or (1000 if args.what == "pairs" else 300)
    with tempfile.TemporaryDirectory(prefix="instride-probe-sched-") as work:
        exchange = compile_c(EXCHANGE_C, Path(work) / "exchange") if args.what == "latency" else None
        for r in range(args.rounds):
            for policy in (policies if r % 2 == 0 else policies[::-1]):
                with EmulatedCluster(nodes=4 if args.what == "pairs" else 2,
                                     env={"INSTRIDE_SERVE_SCHED": policy}) as c, \
                        burning(args.burners):
                    name = f"r{r}{policy}"
                    line = pairs_round(c, name, n) if exchange is None \
                        else latency_round(c, name, n, args.gap, exchange)
                print(f"round {r}, {policy:6s}: {line}", flush=True)


if __name__ == "__main__":
    main()
