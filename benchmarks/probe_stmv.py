"""STMV frames into new files on node 2, flat out and paced: the probe behind round 23.

Builds a 2-node emulated cluster and runs, ``--runs`` times:

- **flat out** (``bench_cluster.py`` section 1 alone): node 2 consumes STMV frames (28.5 MiB)
  published on node 1, one after the other, into new files (a node that keeps every copy),
  three rounds alternating with raw TCP (``sendfile`` -> ``recv_into``) and raw TCP that also
  writes each frame to a new file; prints each round's ratio;
- **paced** (``--paced``): a producer on node 1 publishes STMV frames 300 ms apart, node 2 waits
  for and consumes each (the file API); prints the median and p90 of publish start -> bytes
  local, per round of 25 frames (the first 3 of each left out).

Compare ``INSTRIDE_AHEAD_BYTES`` settings run by run (e.g. ``INSTRIDE_AHEAD_BYTES=67108864``:
files made ahead for STMV-sized fetches too): this VM's speed drifts by tens of percent over
minutes, and its fresh memory is cheap or expensive by phases. Needs root, iproute2 and
redis-server (``make test`` installs them).

Usage: ``python benchmarks/probe_stmv.py [--runs N] [--paced]``
"""

from __future__ import annotations

import argparse
import os
import statistics

from bench_cluster import PRODUCE, WARM_STMV, _popen, stmv_rounds, stream_run
from common import header
from instride.emulate import EmulatedCluster
from instride.frames import frame_size

STMV_ATOMS = 1_066_628
#: frames per flat-out run (three rounds)
FRAMES = 24
#: seconds between paced frames, frames per paced round
GAP, PACED = 0.3, 25


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--paced", action="store_true", help="paced frames (latency) instead of flat out")
    args = ap.parse_args()
    header("STMV frames into new files on node 2, " + ("paced" if args.paced else "flat out"))
    print(f"INSTRIDE_AHEAD_BYTES={os.environ.get('INSTRIDE_AHEAD_BYTES', '(default)')}")
    size = frame_size(STMV_ATOMS, "paper")
    with EmulatedCluster(nodes=2) as c:
        if not args.paced:
            # (each run consumes the same frames again: its copies are dropped after each round)
            for name, frames in (("stmv/p0", FRAMES + 3), ("stmv/p1", FRAMES + 3 + WARM_STMV)):
                _popen(c, 1, PRODUCE, name, frames, STMV_ATOMS, 0.0).communicate(timeout=600)
        src = c.node(1).dir / "stmv" / "p0" / "frame_000000000.isf"
        for r in range(args.runs):
            if args.paced:
                _, lat = stream_run(c, f"paced{r}", PACED, STMV_ATOMS, GAP, [(1, 2)])
                ms = sorted(x / 1e3 for x in lat[0][3:])
                print(f"run {r}: publish start -> bytes local, median {statistics.median(ms):.1f} ms,"
                      f" p90 {ms[int(0.9 * len(ms))]:.1f} ms, min {ms[0]:.1f} ms", flush=True)
                continue
            rounds = stmv_rounds(c, "stmv/p0", "stmv/p1", str(src), size, FRAMES, 3)
            each = {k: " / ".join(f"{x[k]:.2f}" for x in rounds)
                    for k in ("ratio", "ratio_to_stored", "ratio_recycled")}
            print(f"run {r}: into new files vs raw TCP {each['ratio']}; vs raw TCP that also stores"
                  f" {each['ratio_to_stored']}; recycled {each['ratio_recycled']}", flush=True)


if __name__ == "__main__":
    main()
