"""A reader keeping up with a producer whose stream drops frames (``on_full="drop-oldest"``,
``"latest"``): how many frames it gets, and how long it ever waits.

A producer process appends ``--frames`` JAC-sized frames (23,558 atoms, paper layout) to a
stream with ``retain=1``, one every ``pace`` (busy-waited, so the pace is exact); a reader
process iterates the stream (``on_gap="count"``) and notes when each frame arrives. Printed
and saved, per policy and pace: frames read and missed (their sum is every frame), the share
of frames read, and the longest gap between two frames the reader got — against the same
pace on a stream that blocks for a consumer group (``on_full="block"``: every frame read,
none dropped), measured in the same run. A frame can be published and dropped while the
reader is not running; the reader must notice from the stream's head, not wait for a file
that is gone.

Usage: ``python benchmarks/bench_drop_policies.py [--frames 2000]``
Results: ``benchmarks/results/drop_policies.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from common import header, save

PRODUCER = textwrap.dedent(
    """
    import sys, time, numpy as np, instride
    n, pace, policy = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    pos = np.random.default_rng(1).random((23558, 3))
    kw = dict(groups=["g"], retain=16) if policy == "block" else dict(retain=1)
    with instride.Stream("s", mode="w", on_full=policy, timeout=60, **kw) as s:
        for i in range(n):
            s.append(pos, step=i)
            t = time.perf_counter()
            while time.perf_counter() - t < pace:
                pass
    """
)
READER = textwrap.dedent(
    """
    import json, sys, time, instride
    kw = dict(group="g") if sys.argv[1] == "block" else dict(on_gap="count")
    s = instride.Stream("s", timeout=60, **kw)
    print("ready", flush=True)
    arrivals = [time.monotonic() for _ in s]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    print(json.dumps({"read": len(arrivals), "missed": s.missed,
                      "max_gap_ms": 1e3 * max(gaps, default=0.0),
                      "gaps_over_100ms": sum(g > 0.1 for g in gaps)}))
    """
)


def run(root: Path, policy: str, pace: float, frames: int) -> dict[str, Any]:
    """One producer/reader pair on a fresh managed directory."""
    env = {**os.environ, "INSTRIDE_DIR": str(root)}
    env.pop("INSTRIDE_REDIS_URL", None)
    reader = subprocess.Popen([sys.executable, "-c", READER, policy], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == "ready"
        subprocess.run([sys.executable, "-c", PRODUCER, str(frames), str(pace), policy], env=env,
                       check=True, timeout=300)
        out = reader.communicate(timeout=120)[0]
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait(10)
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    result["share_read"] = result["read"] / frames
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=2000)
    args = parser.parse_args()
    machine = header("drop policies: a reader keeping up with a paced producer (local mode)")
    result: dict[str, Any] = {"machine": machine, "frames": args.frames, "runs": []}
    base = Path(tempfile.mkdtemp(prefix="bench-drop-", dir="/dev/shm"))
    try:
        for pace in (0.0005, 0.002):
            for policy in ("block", "drop-oldest", "latest"):
                r = run(base / f"{policy}-{pace}", policy, pace, args.frames)
                r.update(policy=policy, pace_ms=pace * 1e3)
                result["runs"].append(r)
                print(f"pace {pace * 1e3:.1f} ms, {policy:11s}: read {r['read']:5d}, missed"
                      f" {r['missed']:5d} ({100 * r['share_read']:5.1f} % read), longest gap"
                      f" {r['max_gap_ms']:6.1f} ms, gaps over 100 ms: {r['gaps_over_100ms']}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for pace in (0.5, 2.0):
        block = next(r for r in result["runs"] if r["policy"] == "block" and r["pace_ms"] == pace)
        for r in result["runs"]:
            if r["pace_ms"] == pace and r["policy"] != "block":
                r["longest_gap_vs_block"] = r["max_gap_ms"] / block["max_gap_ms"]
                print(f"pace {pace} ms, {r['policy']}: longest gap {r['longest_gap_vs_block']:.1f}x"
                      " that of the blocking stream's group reader")
    save("drop_policies", result)


if __name__ == "__main__":
    main()
