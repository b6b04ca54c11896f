"""Dataflow graphs (``instride.flow``): reduction trees, broadcast, and the simulation's slowdown.

One run measures, with real processes in local mode (managed directory on ``/dev/shm``):

1. **N-to-1**: N producers (8 and 16) each send ``--msgs`` arrays of 8 KiB as fast as they can;
   a reduction tree (arity 2 and 4) or a flat gather (one merge module with N inputs) merges
   each step's N arrays into one message for a sink. Reported: merged messages/s at the sink
   (from the producers' start to the last message) and producer messages/s (x N); ratio to the flat
   gather of the same N. Every process is started and has built its ports before the
   producers begin (a start barrier), so start-up is not measured.
2. **Broadcast**: one producer sends ``--frames`` villin-sized frames (8,867 atoms, 104 KiB)
   as fast as it can to 1, 2, 4, 8 consumers that each read every frame. Reported: frames/s
   per consumer (median, from the producer's start to its last frame) and the aggregate MB/s
   read; ratio to one consumer.
3. **Simulation slowdown**: R OpenMM replicas (villin, 1 thread each) publishing every
   ``--interval`` steps, (a) with their outputs unconnected (nothing is published: the
   baseline) and (b) inside the full ensemble graph of ``examples/flow/ensemble.py``
   (per-replica Rg, reduction tree, statistics, newest-sampled live plot). Reported: the
   simulation loop's wall time (median over ``--reps`` interleaved runs), the ratio, and
   the loop's process CPU time (less sensitive to other users of a shared machine), and
   the time spent in ``put`` as a share of the loop (instride's direct cost).

Usage: ``python benchmarks/bench_flow.py [--quick]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import header, save
from instride.flow import Graph, load_graph, patterns, run
from instride.flow.md import openmm_producer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "flow"


# ---------------------------------------------------------------------- module functions
def _barrier(ports):
    """Wait until every instance of the graph is up (each writes its counters on start), so
    producers start together and no consumer is still starting; return the start time."""
    total = len(ports.graph.instances())
    stats = Path(ports.spec["state"]) / "stats"
    while len([p for p in stats.iterdir() if not p.name.startswith(".")]) < total:
        time.sleep(0.005)
    start = time.time()
    (ports.out_dir / f"start-{ports.module}-{ports.instance}").write_text(str(start))
    return start


def source(ports, n=100, size=1024):
    data = np.zeros(size)
    _barrier(ports)
    for k in range(n):
        data[0] = k
        ports.put("out", data, step=k)


def frame_source(ports, n=200, natoms=8867):
    pos = np.random.default_rng(1).random((natoms, 3), dtype=np.float32) * 50
    _barrier(ports)
    for k in range(n):
        ports.put("frames", pos, step=k)


def sink(ports, port="in"):
    last = None
    count = nbytes = 0
    while ports.wait():
        msg = ports.get(port)
        last = time.time()
        count += 1
        nbytes += msg.data.nbytes
    (ports.out_dir / f"sink-{ports.module}-{ports.instance}.json").write_text(
        json.dumps({"last": last, "count": count, "bytes": nbytes}))


def _sinks(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("sink-*.json"))]


def _start(out: Path) -> float:
    return min(float(p.read_text()) for p in out.glob("start-*"))


# ---------------------------------------------------------------------- experiments
def n_to_1(producers: int, arity: int | None, msgs: int, tmp: Path) -> dict:
    g = Graph(f"nto1-{producers}-{arity or 'flat'}")
    src = g.module("src", source, outputs={"out": "array"}, instances=producers,
                   params={"n": msgs})
    if arity is None:
        root = patterns.gather(g, "merge", src.output("out"))
    else:
        root = patterns.reduce_tree(g, "merge", src.output("out"), arity=arity)
    g.connect(root, g.module("sink", sink, inputs={"in": "array"}).input("in"))
    out = tmp / g.name
    res = run(g, out=out, trace=False, timeout=900)
    (s,) = _sinks(out)
    assert s["count"] == msgs, s
    rate = msgs / (s["last"] - _start(out))
    return {"producers": producers, "layout": f"tree arity {arity}" if arity else "flat gather",
            "merge_modules": sum(m.startswith("merge") for m in g.modules),
            "merged_per_s": rate, "producer_msgs_per_s": rate * producers,
            "wall_s": res.seconds}


def broadcast(consumers: int, frames: int, tmp: Path) -> dict:
    g = Graph(f"bcast-{consumers}")
    src = g.module("src", frame_source, outputs={"frames": "frame"}, params={"n": frames})
    dst = g.module("sink", sink, inputs={"in": "frame"}, instances=consumers)
    g.connect(src.output("frames"), dst.input("in"))
    out = tmp / g.name
    res = run(g, out=out, trace=False, timeout=900)
    sinks = _sinks(out)
    assert len(sinks) == consumers and all(s["count"] == frames for s in sinks)
    t0 = _start(out)
    rates = [frames / (s["last"] - t0) for s in sinks]
    span = max(s["last"] for s in sinks) - t0
    total = sum(s["bytes"] for s in sinks)
    return {"consumers": consumers, "frames_per_s_each": statistics.median(rates),
            "aggregate_MB_s": total / span / 1e6, "wall_s": res.seconds}


def simulation(replicas: int, attached: bool, steps: int, interval: int, tmp: Path) -> dict:
    out = tmp / f"sim-{replicas}-{attached}-{time.monotonic_ns()}"
    if attached:
        g = load_graph(EXAMPLES / "ensemble.py",
                       {"replicas": replicas, "steps": steps, "interval": interval})
    else:
        g = Graph("baseline")
        g.module("sim", openmm_producer, outputs={"frames": "frame"}, instances=replicas,
                 params={"steps": steps, "interval": interval})
    run(g, out=out, trace=False, timeout=1800)
    logs = [json.loads((out / f"sim-{i}.json").read_text()) for i in range(replicas)]
    return {"loop_s": statistics.fmean(x["loop_seconds"] for x in logs),
            "loop_cpu_s": statistics.fmean(x["loop_cpu_seconds"] for x in logs),
            "put_s": statistics.fmean(x["put_seconds"] for x in logs),
            "frames": len(logs[0]["published"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer messages, one repetition")
    ap.add_argument("--msgs", type=int, default=200, help="messages per producer (N-to-1)")
    ap.add_argument("--frames", type=int, default=300, help="frames broadcast")
    ap.add_argument("--steps", type=int, default=400, help="MD steps per replica")
    ap.add_argument("--interval", type=int, default=20, help="steps between frames")
    ap.add_argument("--reps", type=int, default=2, help="repetitions of the slowdown runs")
    ap.add_argument("--parts", default="nto1,broadcast,slowdown",
                    help="comma-separated experiments to run (default: all three)")
    ap.add_argument("--name", default="bench_flow", help="results file name")
    args = ap.parse_args()
    if args.quick:
        args.msgs, args.frames, args.steps, args.reps = 40, 60, 100, 1
    m = header("instride.flow: N-to-1 trees, broadcast, simulation slowdown")
    os.environ.setdefault("INSTRIDE_DIR", tempfile.mkdtemp(prefix="bench-flow-", dir="/dev/shm"))
    result: dict = {"machine": m, "args": vars(args), "n_to_1": [], "broadcast": [],
                    "slowdown": []}
    with tempfile.TemporaryDirectory(prefix="bench-flow-") as tmpdir:
        tmp = Path(tmpdir)
        parts = set(args.parts.split(","))
        print("\n## N-to-1: reduction tree vs flat gather (8 KiB arrays)")
        print("producers | layout | merge modules | merged msg/s | producer msg/s | ratio to flat")
        for n in (8, 16) if "nto1" in parts else ():
            rows = [n_to_1(n, arity, args.msgs, tmp) for arity in (None, 2, 4)]
            for r in rows:
                r["ratio_to_flat"] = r["merged_per_s"] / rows[0]["merged_per_s"]
                print(f"{n} | {r['layout']} | {r['merge_modules']} | {r['merged_per_s']:.1f} | "
                      f"{r['producer_msgs_per_s']:.0f} | {r['ratio_to_flat']:.2f}", flush=True)
            result["n_to_1"] += rows

        print("\n## Broadcast of 104 KiB frames to 1..8 consumers")
        print("consumers | frames/s each (median) | aggregate MB/s | ratio to 1 consumer")
        for c in (1, 2, 4, 8) if "broadcast" in parts else ():
            r = broadcast(c, args.frames, tmp)
            base = result["broadcast"][0] if result["broadcast"] else r
            r["aggregate_ratio"] = r["aggregate_MB_s"] / base["aggregate_MB_s"]
            result["broadcast"].append(r)
            print(f"{c} | {r['frames_per_s_each']:.1f} | {r['aggregate_MB_s']:.0f} | "
                  f"{r['aggregate_ratio']:.2f}", flush=True)

        print("\n## OpenMM replicas with the full ensemble graph attached vs outputs unconnected")
        print("replicas | frames | loop s, unconnected | loop s, graph | slowdown | "
              "CPU s/replica, unconnected | CPU s, graph | CPU slowdown | put share")
        for replicas in (1, 2) if "slowdown" in parts else ():
            base, full = [], []
            for _ in range(args.reps):  # interleaved
                base.append(simulation(replicas, False, args.steps, args.interval, tmp))
                full.append(simulation(replicas, True, args.steps, args.interval, tmp))
            b = statistics.median(x["loop_s"] for x in base)
            f = statistics.median(x["loop_s"] for x in full)
            bc = statistics.median(x["loop_cpu_s"] for x in base)
            fc = statistics.median(x["loop_cpu_s"] for x in full)
            share = statistics.median(x["put_s"] / x["loop_s"] for x in full)
            row = {"replicas": replicas, "frames": full[0]["frames"], "baseline_loop_s": b,
                   "graph_loop_s": f, "slowdown": f / b - 1, "baseline_cpu_s": bc,
                   "graph_cpu_s": fc, "cpu_slowdown": fc / bc - 1, "put_share": share,
                   "runs": {"baseline": base, "graph": full}}
            result["slowdown"].append(row)
            print(f"{replicas} | {row['frames']} | {b:.2f} | {f:.2f} | "
                  f"{100 * row['slowdown']:+.1f} % | {bc:.2f} | {fc:.2f} | "
                  f"{100 * row['cpu_slowdown']:+.1f} % | {100 * share:.2f} %", flush=True)
    save(args.name, result)


if __name__ == "__main__":
    sys.exit(main())
