"""What the JAC latency of a local stream would be with no Python in the per-frame path.

Issue 12 asks for a median latency of at most 0.5× ADIOS2 SST's for JAC frames (one node, a
paced writer, publish start → coordinates in the reader's arrays). ``instride.Stream`` stays
at 0.6–0.8× on the test machine, and per-step probes found every stage 5–25× slower after a
20 ms pause than flat out (cold caches and branch predictors of this VM). This probe measures
how far a per-frame path in C would get: ``lean_path.c`` (compiled here with ``cc``) does per
frame what a ``Stream(retain=16, layout="paper-soa", groups=[...])`` writer and group reader do
on one node — retire, exclusive lock, copy + xxh3 into the recycled mapping, rename to publish;
wait (inotify, or polling), open, shared lock, mapping kept by inode, copy + verify into arrays
of the reader's own, the group's position written — with no interpreter in between. Beside it,
in the same rounds and on the same machine: instride's ``paper-soa`` reader (views, then
``np.array``), its ``spin="auto"`` copying reader and ADIOS2 SST, run by ``bench_vs_adios2.py``'s
own harness. The rounds are interleaved (each runs every way once, in turn); ratios to SST are
medians of the rounds' ratios.

Usage: ``python benchmarks/probe_lean_path.py [--rounds 3] [--frames 200]``
Results: ``benchmarks/results/lean_path.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench_vs_adios2 import paced_run
from common import header, save, summary

HERE = Path(__file__).resolve().parent
INTERVAL_MS = 20.0  # as bench_vs_adios2.py paces JAC frames
PEERS = ("instride-soa", "instride-soa-copy", "instride-soa-copy-auto", "adios2-sst")


def build(work: Path) -> Path:
    """Compile ``lean_path.c`` (needs a C compiler and xxhash.h: the README's setup has both)."""
    exe = work / "lean_path"
    subprocess.run(["cc", "-O2", "-o", str(exe), str(HERE / "lean_path.c")], check=True)
    return exe


def lean_run(exe: Path, frames: int, spin: bool) -> list[float]:
    """One paced run of the C path: each frame's latency in µs."""
    where = Path(tempfile.mkdtemp(prefix="lean-", dir="/dev/shm"))
    try:
        out = subprocess.run([str(exe), str(where), str(frames), str(int(INTERVAL_MS * 1000)),
                              "1" if spin else "0"], capture_output=True, text=True, timeout=600,
                             check=False)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    if out.returncode:
        raise RuntimeError(f"lean_path failed (rc {out.returncode}): {out.stderr[-2000:]}")
    return [float(x) for x in json.loads(out.stdout)["lat_us"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--frames", type=int, default=200, help="paced JAC frames per way and round")
    args = ap.parse_args()
    m = header("JAC latency: a per-frame path in C vs instride.Stream vs ADIOS2 SST (one node)")
    work = Path(tempfile.mkdtemp(prefix="lean-build-"))
    ways = ["c-lean", "c-lean-polling", *PEERS]
    lat: dict[str, list[list[float]]] = {w: [] for w in ways}
    try:
        exe = build(work)
        for rnd in range(args.rounds):
            for way in ways:
                if way.startswith("c-lean"):
                    got = lean_run(exe, args.frames, spin=way.endswith("polling"))
                else:
                    got = paced_run(way, "JAC", args.frames, INTERVAL_MS)["lat"]
                lat[way].append(got[1:])  # (the first frame: both sides starting up)
                print(f"  round {rnd + 1}/{args.rounds} {way}: median {statistics.median(got):.0f} µs",
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sst = [statistics.median(r) for r in lat["adios2-sst"]]
    result: dict[str, Any] = {"machine": m, "interval_ms": INTERVAL_MS, "frames": args.frames,
                              "rounds": args.rounds, "ways": {}}
    print(f"\n{'way':26s} {'median µs':>10s} {'p99 µs':>8s}  vs SST (rounds)")
    for way in ways:
        medians = [statistics.median(r) for r in lat[way]]
        ratios = [a / b for a, b in zip(medians, sst, strict=True)]
        all_lat = [x for r in lat[way] for x in r]
        result["ways"][way] = {"latency_us": summary(all_lat), "latency_median_us_rounds": medians,
                               "latency_vs_sst": statistics.median(ratios),
                               "latency_vs_sst_rounds": ratios}
        s = result["ways"][way]["latency_us"]
        print(f"{way:26s} {s['median']:10.0f} {s['p99']:8.0f}  {statistics.median(ratios):.2f} "
              f"({', '.join(f'{r:.2f}' for r in ratios)})")
    save("lean_path", result)


if __name__ == "__main__":
    main()
