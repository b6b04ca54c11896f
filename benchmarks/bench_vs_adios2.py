"""One node: instride streams vs ADIOS2 SST vs a plain write + rename, on the same frames.

A writer process appends frames in the paper's layout (int32 atom id + 3 × float64 per atom:
JAC 23,558 atoms = 644 KiB, STMV 1,066,628 atoms = 28.5 MiB); a reader process receives each
frame and copies it into arrays of its own, as a new user's analysis would. Three ways, all
in the same run:

* ``instride`` — ``instride.Stream`` with ``retain`` (the queue bound) and a consumer group,
  ``layout="paper"`` (interleaved records, as the paper serialized them), managed directory on
  tmpfs; ``instride-soa`` — the same with ``layout="paper-soa"`` (the same bytes per atom as
  arrays: coordinates, then ids);
* ``instride-copy``, ``instride-soa-copy`` — the reader takes each frame as arrays of its own
  with ``Stream(copy=True)`` (copied and verified in one pass) instead of views + ``np.array``;
  ``instride-soa-copy-spin`` — the same reader with ``spin=1.0`` (it busy-polls for the next
  frame instead of sleeping in inotify: no wake-up of a sleeping thread, a core kept busy);
  ``instride-soa-copy-auto``, ``instride-copy-auto`` — copying readers with ``spin="auto"``
  (hybrid polling: asleep until shortly before the next frame is due, polling around then);
* ``adios2-sst`` — the ADIOS2 SST staging engine (PyPI ``adios2``), the peer users would pick;
  ``QueueLimit`` and ``QueueFullPolicy=Block`` bound the writer like instride's retention;
* ``rename`` — the naive baseline: write the frame bytes to a temporary file in /dev/shm and
  ``os.rename`` it into place; the reader polls for the next file every 1 ms.

Measured per way and frame size:

* throughput — frames/s and GB/s from the writer's first append to the reader's last copy,
  writer flat out (median of ``--repeats`` repetitions);
* latency — a paced writer (one frame every 20 ms for JAC, 200 ms for STMV, so the reader is
  idle and waiting): monotonic time from the start of the writer's append to the frame's
  coordinates being in the reader's numpy arrays, median and p99 over ``--rounds`` runs; the
  ratio to SST is the median of the rounds' ratios;
* writer cost — seconds per append in the flat-out run (median over frames).

The runs are interleaved: each flat-out repetition and each latency round runs every way once,
in turn, so a slower minute of the machine falls on all ways alike.

Usage: ``python benchmarks/bench_vs_adios2.py [--sizes JAC,STMV] [--repeats 5] [--rounds 3]
[--ways ...] [--quick]``
Results: ``benchmarks/results/vs_adios2.json`` and ``benchmarks/results/vs_adios2.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from common import header, save, summary

SIZES = {"JAC": 23_558, "STMV": 1_066_628}

# Each child prints one JSON line: {"t": [per-frame monotonic ns ...], ...}.
# Shared by all writers: frame i = random positions (fixed seed), ids 0..n-1, step i.
COMMON = textwrap.dedent(
    """
    import json, os, sys, time
    import numpy as np
    way, role, natoms, nframes, interval, where, queue = sys.argv[1:8]
    natoms, nframes, interval, queue = int(natoms), int(nframes), float(interval), int(queue)
    now = time.monotonic_ns
    def frames():
        rng = np.random.default_rng(7)
        pos = rng.random((natoms, 3)) * 100.0
        ids = np.arange(natoms, dtype=np.int32)
        for i in range(nframes):
            pos[0, 0] = i  # every frame differs; the reader checks it
            yield i, pos, ids
    def pace(t0, i):
        if interval > 0:
            target = t0 + int(i * interval * 1e6)
            while now() < target:
                time.sleep(max(0.0, (target - now()) / 1e9 - 0.0005))
    """
)

INSTRIDE = COMMON + textwrap.dedent(
    """
    import instride
    layout = "paper-soa" if "soa" in way else "paper"
    # a reader that busy-polls between frames, or polls only around when the next one is due
    spin = 1.0 if "spin" in way else "auto" if "auto" in way else 0.0
    copy = "copy" in way  # frames delivered as the reader's own arrays (copied + verified once)
    if role == "w":
        t, cost = [], []
        with instride.Stream("bench", mode="w", layout=layout, retain=queue, groups=["bench"],
                             timeout=120) as s:
            t0 = now()
            for i, pos, ids in frames():
                pace(t0, i)
                a = now(); t.append(a)
                s.append(pos, step=i, ids=ids)
                cost.append(now() - a)
        print(json.dumps({"t": t, "cost": cost}))
    else:
        t, check, cpu = [], 0, time.process_time()
        print("ready", flush=True)
        for f in instride.Stream("bench", group="bench", timeout=120, spin=spin, copy=copy):
            if copy:
                xyz, ids = f.positions, f.ids
            else:
                xyz = np.array(f.positions); ids = np.array(f.ids)
            t.append(now()); check += int(xyz[0, 0] == f.step)
            if len(t) == 1:
                cpu = time.process_time()  # the reader's CPU from its first frame on
        print(json.dumps({"t": t, "ok": check, "cpu": time.process_time() - cpu}))
    """
)

ADIOS2 = COMMON + textwrap.dedent(
    """
    import adios2.bindings as ab
    os.chdir(where)
    adios = ab.ADIOS()
    io = adios.DeclareIO("bench")
    io.SetEngine("SST")
    io.SetParameters({"RendezvousReaderCount": "1", "QueueLimit": str(queue),
                      "QueueFullPolicy": "Block", "OpenTimeoutSecs": "60"})
    if role == "w":
        vx = io.DefineVariable("xyz", np.zeros((natoms, 3)), [], [], [natoms, 3], ab.ConstantDims)
        vi = io.DefineVariable("id", np.zeros(natoms, np.int32), [], [], [natoms], ab.ConstantDims)
        vs = io.DefineVariable("step", np.zeros(1, np.int64), [], [], [1], ab.ConstantDims)
        eng = io.Open("bench", ab.Mode.Write)
        t, cost = [], []
        t0 = now()
        for i, pos, ids in frames():
            pace(t0, i)
            a = now(); t.append(a)
            eng.BeginStep()
            eng.Put(vx, pos, ab.Mode.Sync); eng.Put(vi, ids, ab.Mode.Sync)
            eng.Put(vs, np.array([i], np.int64), ab.Mode.Sync)
            eng.EndStep()
            cost.append(now() - a)
        eng.Close()
        print(json.dumps({"t": t, "cost": cost}))
    else:
        print("ready", flush=True)
        eng = io.Open("bench", ab.Mode.Read)
        t, check = [], 0
        while eng.BeginStep(ab.StepMode.Read, 120.0) == ab.StepStatus.OK:
            xyz = np.empty((natoms, 3)); ids = np.empty(natoms, np.int32); st = np.empty(1, np.int64)
            eng.Get(io.InquireVariable("xyz"), xyz, ab.Mode.Sync)
            eng.Get(io.InquireVariable("id"), ids, ab.Mode.Sync)
            eng.Get(io.InquireVariable("step"), st, ab.Mode.Sync)
            eng.EndStep()
            t.append(now()); check += int(xyz[0, 0] == st[0])
        eng.Close()
        print(json.dumps({"t": t, "ok": check}))
    """
)

RENAME = COMMON + textwrap.dedent(
    """
    dtype = np.dtype([("id", "<i4"), ("xyz", "<f8", (3,))])
    if role == "w":
        rec = np.empty(natoms, dtype)
        t, cost = [], []
        t0 = now()
        for i, pos, ids in frames():
            pace(t0, i)
            a = now(); t.append(a)
            rec["id"] = ids; rec["xyz"] = pos
            tmp = os.path.join(where, f".tmp{i}")
            with open(tmp, "wb") as fh:
                fh.write(rec.data)
            os.rename(tmp, os.path.join(where, f"frame{i}"))
            cost.append(now() - a)
        print(json.dumps({"t": t, "cost": cost}))
    else:
        print("ready", flush=True)
        t, check = [], 0
        for i in range(nframes):
            path = os.path.join(where, f"frame{i}")
            while not os.path.exists(path):
                time.sleep(0.001)
            rec = np.fromfile(path, dtype)
            xyz = np.array(rec["xyz"]); ids = np.array(rec["id"])
            t.append(now()); check += int(xyz[0, 0] == i)
        print(json.dumps({"t": t, "ok": check}))
    """
)

WAYS = {way: INSTRIDE for way in ("instride", "instride-soa", "instride-copy", "instride-soa-copy",
                                   "instride-soa-copy-spin", "instride-soa-copy-auto",
                                   "instride-copy-auto")}
WAYS.update({"adios2-sst": ADIOS2, "rename": RENAME})


def run_pair(way: str, natoms: int, nframes: int, interval: float, queue: int = 16) -> dict[str, Any]:
    """Run one writer and one reader of ``way``; return their per-frame timestamps."""
    where = Path(tempfile.mkdtemp(prefix=f"bench-{way}-", dir="/dev/shm"))
    env = dict(os.environ, INSTRIDE_DIR=str(where / "managed"), INSTRIDE_FSYNC="0")
    env.pop("INSTRIDE_REDIS_URL", None)
    args = [way, "", str(natoms), str(nframes), str(interval), str(where), str(queue)]
    code = WAYS[way]
    try:
        reader = subprocess.Popen(
            [sys.executable, "-c", code, *args[:1], "r", *args[2:]],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=where,
        )
        assert reader.stdout is not None
        if reader.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{way} reader did not start")
        writer = subprocess.run(
            [sys.executable, "-c", code, *args[:1], "w", *args[2:]],
            env=env, capture_output=True, text=True, cwd=where, timeout=600, check=False,
        )
        out, err = reader.communicate(timeout=600)
        if writer.returncode or reader.returncode:
            raise RuntimeError(f"{way}: writer rc={writer.returncode} reader rc={reader.returncode}\n"
                               f"writer: {writer.stderr[-2000:]}\nreader: {err[-2000:]}")
        w = json.loads(writer.stdout.strip().splitlines()[-1])
        r = json.loads(out.strip().splitlines()[-1])
    finally:
        shutil.rmtree(where, ignore_errors=True)
    if len(r["t"]) != nframes or r["ok"] != nframes:
        raise RuntimeError(f"{way}: reader got {len(r['t'])} frames, {r['ok']} verified, of {nframes}")
    return {"w": w, "r": r}


def throughput_run(way: str, name: str, nframes: int) -> tuple[float, list[float]]:
    """One flat-out run of ``way``: frames/s and the writer's seconds per append."""
    run = run_pair(way, SIZES[name], nframes, 0.0)
    span = (run["r"]["t"][-1] - run["w"]["t"][0]) / 1e9
    return nframes / span, [c / 1e9 for c in run["w"]["cost"]]


def paced_run(way: str, name: str, nframes: int, interval: float) -> dict[str, Any]:
    """One paced run of ``way`` (a frame every ``interval`` ms, the reader idle and waiting):
    the latency of each frame (µs) and, where the reader reports it, its CPU while waiting."""
    run = run_pair(way, SIZES[name], nframes, interval)
    out: dict[str, Any] = {"lat": [(r - w) / 1e3 for w, r in zip(run["w"]["t"], run["r"]["t"],
                                                                  strict=True)]}
    if "cpu" in run["r"]:  # the reader's CPU per frame while paced (how much its waiting costs)
        out["cpu_per_frame_us"] = run["r"]["cpu"] / (nframes - 1) * 1e6
        out["cpu_share"] = run["r"]["cpu"] / ((run["r"]["t"][-1] - run["r"]["t"][0]) / 1e9)
    return out


def measure(ways: list[str], name: str, nframes: int, repeats: int, interval: float,
            rounds: int) -> dict[str, Any]:
    """Throughput (flat out, ``repeats`` runs per way), writer cost and paced latency
    (``rounds`` runs per way) for one size. The runs are interleaved — each repetition and
    each latency round runs every way once, in turn — so that a slower phase of the machine
    falls on all ways alike instead of on whichever ran then."""
    nbytes = SIZES[name] * 28
    rates: dict[str, list[float]] = {w: [] for w in ways}
    costs: dict[str, list[float]] = {w: [] for w in ways}
    for rep in range(repeats):
        for way in ways:
            fps, cost = throughput_run(way, name, nframes)
            rates[way].append(fps)
            costs[way].extend(cost)
            print(f"  {name} flat out {rep + 1}/{repeats} {way}: {fps:.0f} frames/s", flush=True)
    # 200 frames per way in all for STMV (as many as JAC's per round: 40 s per way at 200 ms)
    paced_n = max(20, min(nframes, 200 if name == "JAC" else -(-200 // rounds)))
    paced: dict[str, list[dict[str, Any]]] = {w: [] for w in ways}
    for rnd in range(rounds):
        for way in ways:
            paced[way].append(paced_run(way, name, paced_n, interval))
            print(f"  {name} latency round {rnd + 1}/{rounds} {way}: median"
                  f" {statistics.median(paced[way][-1]['lat']):.0f} µs", flush=True)
    per: dict[str, Any] = {}
    for way in ways:
        fps = statistics.median(rates[way])
        runs = paced[way]
        out: dict[str, Any] = {}
        if "cpu_share" in runs[0]:
            out["reader_cpu_per_frame_us"] = statistics.median(r["cpu_per_frame_us"] for r in runs)
            out["reader_cpu_share"] = statistics.median(r["cpu_share"] for r in runs)
        per[way] = out | {
            "frames_per_s": fps,
            "frames_per_s_runs": rates[way],
            "GB_per_s": fps * nbytes / 1e9,
            "writer_cost_s": summary(costs[way]),
            "latency_us": summary([x for r in runs for x in r["lat"]]),
            "latency_median_us_rounds": [statistics.median(r["lat"]) for r in runs],
            "frame_bytes": nbytes,
        }
    return per


def plot(results: dict[str, Any], path: Path) -> None:
    """Bar charts: throughput, median latency and writer cost per way and size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(results["sizes"])
    ways = [w for w in WAYS if all(w in results["sizes"][s] for s in sizes)]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    metrics = [
        ("frames_per_s", "throughput (frames/s)", lambda r: r["frames_per_s"]),
        ("latency", "publish → numpy, median (ms)", lambda r: r["latency_us"]["median"] / 1e3),
        ("cost", "writer cost per frame (ms)", lambda r: r["writer_cost_s"]["median"] * 1e3),
    ]
    width = 0.8 / len(ways)
    for ax, (_, title, get) in zip(axes, metrics, strict=True):
        for k, way in enumerate(ways):
            vals = [get(results["sizes"][s][way]) for s in sizes]
            ax.bar([i + k * width for i in range(len(sizes))], vals, width, label=way)
        ax.set_xticks([i + width * (len(ways) - 1) / 2 for i in range(len(sizes))], sizes)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle("One node, paper-layout frames: instride vs ADIOS2 SST vs write + rename", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"saved {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="JAC,STMV", help="comma-separated: JAC, STMV")
    parser.add_argument("--repeats", type=int, default=5, help="flat-out repetitions")
    parser.add_argument("--frames", type=str, default="JAC=3000,STMV=200",
                        help="frames per flat-out run (long enough for the steady state)")
    parser.add_argument("--ways", default=",".join(WAYS),
                        help="comma-separated subset of: " + ", ".join(WAYS))
    parser.add_argument("--rounds", type=int, default=3,
                        help="paced latency runs per way (interleaved; the ratio to SST is the"
                             " median of the rounds' ratios)")
    parser.add_argument("--quick", action="store_true", help="1 repetition, few frames")
    args = parser.parse_args()
    machine = header("instride vs ADIOS2 SST vs write + rename (one node)")
    frames = dict(item.split("=") for item in args.frames.split(","))
    repeats = 1 if args.quick else args.repeats
    rounds = 1 if args.quick else args.rounds
    results: dict[str, Any] = {"machine": machine, "sizes": {}}
    for name in args.sizes.split(","):
        n = 50 if args.quick else int(frames[name])
        interval = 20.0 if name == "JAC" else 200.0
        per = measure(args.ways.split(","), name, n, repeats, interval, rounds)
        for way, r in per.items():
            lat, cost = r["latency_us"], r["writer_cost_s"]["median"] * 1e3
            cpu = (f"  reader CPU {r['reader_cpu_share']:5.1%} of a core while paced"
                   if "reader_cpu_share" in r else "")
            print(f"{name:5} {way:12} {r['frames_per_s']:9.1f} frames/s {r['GB_per_s']:6.2f} GB/s  "
                  f"latency median {lat['median'] / 1e3:7.2f} ms p99 {lat['p99'] / 1e3:7.2f} ms  "
                  f"writer {cost:6.2f} ms{cpu}")
        sst, ren = per.get("adios2-sst"), per.get("rename")  # a --ways subset may lack either
        ratios: dict[str, Any] = {}
        for way in [w for w in per if w.startswith("instride")]:
            ins, tag = per[way], way.replace("instride", "").lstrip("-") or "paper"
            if sst is not None:
                ratios[f"{tag}_throughput_vs_sst"] = ins["frames_per_s"] / sst["frames_per_s"]
                # per latency round (the ways ran in turn), then their median: the headline
                each = [a / b for a, b in zip(ins["latency_median_us_rounds"],
                                              sst["latency_median_us_rounds"], strict=True)]
                ratios[f"{tag}_latency_vs_sst"] = statistics.median(each)
                ratios[f"{tag}_latency_vs_sst_rounds"] = each
            if ren is not None:
                ratios[f"{tag}_writer_cost_vs_rename"] = (
                    ins["writer_cost_s"]["median"] / ren["writer_cost_s"]["median"]
                )
                ratios[f"{tag}_throughput_vs_rename"] = ins["frames_per_s"] / ren["frames_per_s"]
        per["ratios"] = ratios
        print(f"{name:5} ratios: " + ", ".join(
            f"{k} {'/'.join(f'{x:.2f}' for x in v) if isinstance(v, list) else f'{v:.2f}'}"
            for k, v in ratios.items()))
        results["sizes"][name] = per
    save("vs_adios2", results)
    plot(results, Path(__file__).resolve().parent / "results" / "vs_adios2.png")


if __name__ == "__main__":
    main()
