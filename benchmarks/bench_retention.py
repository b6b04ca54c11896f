"""Bounded memory: a long STMV-sized stream with ``retain=16`` stays at 17 frames and flat RSS.

A producer process appends ``--frames`` frames of 1,066,628 atoms (paper layout, 28.5 MiB
each) to a stream with ``retain=16`` and a consumer group; a consumer process reads every
frame as that group, checks it and copies its coordinates. The parent samples, every 0.2 s,
the number of frame files in the managed directory, the bytes they hold, and the RSS of both
processes. Printed and saved: frames seen by the group (must be all), most frames on disk
(bound: 17), RSS at the start and end of the run and its maximum, and the throughput against
the same stream without retention (every frame in fresh pages: no recycling), measured in
the same run over ``--baseline-frames`` frames.

Usage: ``python benchmarks/bench_retention.py [--frames 2000] [--natoms 1066628]``
Results: ``benchmarks/results/retention.json`` and ``benchmarks/results/retention.png``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from common import header, save

PRODUCER = textwrap.dedent(
    """
    import sys, time, numpy as np, instride
    n, natoms, retain = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    pos = np.random.default_rng(1).random((natoms, 3)) * 100
    kw = dict(retain=retain, groups=["analysis"]) if retain else {}
    t0 = time.monotonic()
    with instride.Stream("long", mode="w", layout="paper", timeout=300, **kw) as s:
        for i in range(n):
            pos[0, 0] = i
            s.append(pos, step=i)
    print(time.monotonic() - t0, flush=True)
    """
)
CONSUMER = textwrap.dedent(
    """
    import sys, numpy as np, instride
    seen = 0
    print("ready", flush=True)
    for f in instride.Stream("long", group="analysis", timeout=300):
        assert f.positions[0, 0] == f.step == seen, (f.step, seen)
        xyz = np.array(f.positions)
        seen += 1
    print(seen, flush=True)
    """
)


def rss_mib(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (0 once it has exited)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return 0.0


def frames_on_disk(directory: Path) -> tuple[int, int]:
    """Frame files under ``directory`` and their total size in bytes."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith("frame_")]
    except FileNotFoundError:
        return 0, 0
    total = 0
    for n in names:
        try:
            total += os.stat(directory / n).st_size
        except FileNotFoundError:
            pass
    return len(names), total


def bounded_run(root: Path, frames: int, natoms: int) -> dict[str, Any]:
    """Producer + group consumer with retain=16; sample disk and RSS."""
    env = dict(os.environ, INSTRIDE_DIR=str(root), INSTRIDE_FSYNC="0")
    env.pop("INSTRIDE_REDIS_URL", None)
    consumer = subprocess.Popen([sys.executable, "-c", CONSUMER], env=env, stdout=subprocess.PIPE, text=True)
    assert consumer.stdout is not None and consumer.stdout.readline().strip() == "ready"
    producer = subprocess.Popen([sys.executable, "-c", PRODUCER, str(frames), str(natoms), "16"],
                                env=env, stdout=subprocess.PIPE, text=True)
    samples: list[tuple[float, int, int, float, float]] = []
    t0 = time.monotonic()
    try:
        from tqdm import tqdm

        with tqdm(total=frames, unit=" frames", desc="retain=16", disable=None) as bar:
            while producer.poll() is None or consumer.poll() is None:
                n, nbytes = frames_on_disk(root / "long")
                rss = rss_mib(producer.pid), rss_mib(consumer.pid)
                samples.append((time.monotonic() - t0, n, nbytes, *rss))
                try:
                    with open(root / ".instride/streams/long.stream/head", "rb") as fh:
                        written = int.from_bytes(fh.read(16)[8:16], "little")
                    bar.update(written - bar.n)
                except (FileNotFoundError, ValueError):
                    pass
                time.sleep(0.2)
        seconds = float(producer.stdout.read().strip())  # type: ignore[union-attr]
        seen = int(consumer.stdout.read().strip())
    finally:
        for p in (producer, consumer):
            if p.poll() is None:
                p.kill()
                p.wait()
    def rss(col: int) -> dict[str, float]:
        """RSS once the ring is full (a quarter into the run), near the end (95 %, before the
        processes unmap their files and exit), and the maximum."""
        alive = [s[col] for s in samples if s[col] > 0]
        return {"warm": alive[len(alive) // 4], "late": alive[len(alive) * 95 // 100], "max": max(alive)}

    return {
        "frames": frames,
        "seen_by_group": seen,
        "max_frames_on_disk": max(s[1] for s in samples),
        "max_bytes_on_disk": max(s[2] for s in samples),
        "producer_rss_mib": rss(3),
        "consumer_rss_mib": rss(4),
        "seconds": seconds,
        "frames_per_s": frames / seconds,
        "samples": samples,
    }


def unbounded_run(root: Path, frames: int, natoms: int) -> float:
    """Frames/s of the same producer without retention (fresh pages for every frame)."""
    env = dict(os.environ, INSTRIDE_DIR=str(root), INSTRIDE_FSYNC="0")
    env.pop("INSTRIDE_REDIS_URL", None)
    out = subprocess.run([sys.executable, "-c", PRODUCER, str(frames), str(natoms), "0"], env=env,
                         capture_output=True, text=True, check=True)
    return frames / float(out.stdout.strip())


def plot(result: dict[str, Any], path: Path) -> None:
    """Frames on disk and RSS over the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t, n, _, prss, crss = zip(*result["samples"], strict=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
    a.plot(t, n)
    a.axhline(17, color="gray", ls="--", lw=0.8, label="bound (retain + 1)")
    a.set_xlabel("s")
    a.set_ylabel("frame files on the node")
    a.legend(fontsize=8)
    b.plot(t, prss, label="producer")
    b.plot(t, crss, label="consumer")
    b.set_xlabel("s")
    b.set_ylabel("RSS (MiB)")
    b.legend(fontsize=8)
    title = f"{result['frames']} STMV-sized frames, retain=16: bounded storage, flat memory"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"saved {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=2000)
    parser.add_argument("--natoms", type=int, default=1_066_628)
    parser.add_argument("--baseline-frames", type=int, default=40)
    args = parser.parse_args()
    machine = header("bounded stream: retain=16 over a long run")
    root = Path(tempfile.mkdtemp(prefix="bench-retention-", dir="/dev/shm"))
    try:
        result = bounded_run(root / "bounded", args.frames, args.natoms)
        baseline = unbounded_run(root / "unbounded", args.baseline_frames, args.natoms)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["unbounded_frames_per_s"] = baseline
    result["throughput_vs_unbounded"] = result["frames_per_s"] / baseline
    result["machine"] = machine
    p, c = result["producer_rss_mib"], result["consumer_rss_mib"]
    print(f"frames seen by the group: {result['seen_by_group']} of {args.frames}")
    print(f"most frames on disk: {result['max_frames_on_disk']} (bound 17), "
          f"{result['max_bytes_on_disk'] / 2**20:.0f} MiB")
    print(f"RSS producer at 25 %/95 % of the run/max {p['warm']:.0f}/{p['late']:.0f}/{p['max']:.0f} MiB, "
          f"consumer {c['warm']:.0f}/{c['late']:.0f}/{c['max']:.0f} MiB")
    print(f"throughput {result['frames_per_s']:.1f} frames/s with recycling vs {baseline:.1f} without "
          f"(fresh pages per frame): {result['throughput_vs_unbounded']:.2f}x")
    out = Path(__file__).resolve().parent / "results"
    save("retention", result)
    plot(result, out / "retention.png")


if __name__ == "__main__":
    main()
