"""The bounded 8 pairs of ``bench_cluster.py`` (section 4) alone, for A/B runs of a change.

Builds a 4-node emulated cluster, publishes one JAC frame per pair for the raw TCP pairs to
send, then runs ``--rounds`` times: 8 producer/consumer-group pairs on bounded streams
(``retain=16``, positions recorded every 4 frames; producers on nodes 1-2, readers on nodes 3-4),
``--frames`` frames each, flat out; right after, 8 raw TCP pairs (``sendfile`` ->
``recv_into``) moving as many frames between the same nodes. Prints frames per second, the
ratio to the raw pairs (and to raw pairs whose servers send 16 files in turn, as many as
the streams' rings hold: not the one file the caches keep), and the whole machine's CPU per
frame and context switches per frame for both (``/proc/stat``). Alternate two trees
(``PYTHONPATH=<other tree>/src``) run by run: this VM's speed drifts by tens of percent over
minutes. Needs root, iproute2 and redis-server
(``make test`` installs them).

``--unbounded``: the bench's first 8-pairs row instead (unbounded streams, consumers waiting
for and consuming each key into a kept copy), also against raw TCP pairs that keep every frame
in a new file on both nodes.

Usage: ``python benchmarks/probe_pairs.py [--frames N] [--rounds R] [--unbounded]``
"""

from __future__ import annotations

import argparse

from bench_cluster import PRODUCE, _popen, raw_tcp_pairs, stream_span
from common import CpuMeter, header
from instride.emulate import EmulatedCluster
from instride.frames import frame_size

JAC_ATOMS = 23_558
#: files each raw TCP pair's server sends in turn in the second raw run (a bounded stream's
#: frames come from as many files: not one file the caches keep)
ROTATE = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=1500,
                    help="frames per pair (default 1500, as bench_cluster.py)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--unbounded", action="store_true",
                    help="unbounded streams (every frame kept, consumers waiting for and consuming"
                         " each key), as the bench's first 8-pairs row")
    args = ap.parse_args()
    header("8 bounded producer/consumer-group pairs vs 8 raw TCP pairs (bench_cluster section 4)")
    jac = frame_size(JAC_ATOMS, "paper")
    pairs = [(1 + i % 2, 3 + (i // 2) % 2) for i in range(8)]
    n = args.frames
    with EmulatedCluster(nodes=4) as c:
        for i, (p, _q) in enumerate(pairs):  # frames per pair for the raw TCP servers
            _popen(c, p, PRODUCE, f"seed/p{i}", ROTATE, JAC_ATOMS, 0.0).communicate(timeout=120)
        files = [[str(c.node(p).dir / "seed" / f"p{i}" / f"frame_{k:09d}.isf") for k in range(ROTATE)]
                 for i, (p, _q) in enumerate(pairs)]
        for r in range(args.rounds):
            ours, raw = CpuMeter(), CpuMeter()
            _, span = stream_span(c, f"probe{r}", n, JAC_ATOMS, pairs, bounded=not args.unbounded,
                                  meter=ours)
            raw_mbps = raw_tcp_pairs(c, pairs, [f[0] for f in files], jac, n, meter=raw)
            rot_mbps = raw_tcp_pairs(c, pairs, files, jac, n)
            mbps = 8 * n * jac / span / 1e6
            if args.unbounded:  # (every frame kept on both nodes: raw pairs that do the same)
                kept = raw_tcp_pairs(c, pairs, [f[0] for f in files], jac, n, store=True)
                print(f"round {r}: raw TCP pairs keeping every frame in a new file on both nodes"
                      f" {kept:.0f} MB/s ({kept / raw_mbps:.2f} of raw TCP); ratio to them"
                      f" {mbps / kept:.2f}", flush=True)
            u, v = ours.per(8 * n), raw.per(8 * n)
            print(f"round {r}: {8 * n / span:.0f} frames/s, ratio {mbps / raw_mbps:.2f} to raw TCP"
                  f" ({raw_mbps:.0f} MB/s; {mbps / rot_mbps:.2f} to raw TCP sending {ROTATE} files in"
                  f" turn, {rot_mbps:.0f} MB/s); per frame: {u['user_ms']:.2f} + {u['system_ms']:.2f} ms"
                  f" (user + kernel), {u['context_switches']:.1f} context switches, cores"
                  f" {u['busy']:.0%} busy; raw TCP pairs {v['user_ms']:.2f} + {v['system_ms']:.2f} ms,"
                  f" {v['context_switches']:.1f}", flush=True)


if __name__ == "__main__":
    main()
