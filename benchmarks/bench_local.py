"""Local mode: publish -> wake-up latency, producer overhead, consumer read overhead.

Measures, in one run on one node (the managed directory on tmpfs unless INSTRIDE_DIR says
otherwise):

1. wake-up latency: a consumer process blocked in ``instride.consume`` is woken by a producer's
   publication, over >= 1,000 publications; baseline: the bare mechanism (``os.rename`` into a
   directory watched with inotify by a plain consumer that keeps one inotify instance);
2. producer overhead: writing + publishing a JAC-sized (644 KiB) and an STMV-sized (28.5 MiB)
   frame with ``instride.open`` vs a plain open/write/close of the same bytes in the same
   directory (with and without fsync on both sides);
3. consumer read: ``instride.open(key).read()`` of a published frame vs a plain
   ``open(path).read()`` of the same file.

Usage: ``python benchmarks/bench_local.py [--publications 2000] [--quick]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from common import header, save, summary

CONSUMER = textwrap.dedent(
    """
    import os, sys, time, instride
    n = int(sys.argv[1]); out = []
    print("ready", flush=True)
    for i in range(n):
        instride.consume(f"{os.path.basename(sys.argv[2])}/k{i}")
        out.append(time.clock_gettime_ns(time.CLOCK_MONOTONIC))
    print(" ".join(map(str, out)))
    """
)
RAW_CONSUMER = textwrap.dedent(
    """
    import os, sys, time
    from inotify_simple import INotify, flags
    n, d = int(sys.argv[1]), sys.argv[2]
    out = []
    ino = INotify()  # one instance for the whole run, as instride keeps one per thread
    ino.add_watch(d, flags.CREATE | flags.MOVED_TO)
    print("ready", flush=True)
    for i in range(n):
        p = os.path.join(d, f"k{i}")
        while not os.path.exists(p):
            ino.read()
        out.append(time.clock_gettime_ns(time.CLOCK_MONOTONIC))
    print(" ".join(map(str, out)))
    """
)
# The bare mechanism of INSTRIDE_SPIN: a consumer that busy-polls for the file.
POLL_CONSUMER = textwrap.dedent(
    """
    import os, sys, time
    n, d = int(sys.argv[1]), sys.argv[2]
    out = []
    print("ready", flush=True)
    for i in range(n):
        p = os.path.join(d, f"k{i}")
        while not os.path.exists(p):
            pass
        out.append(time.clock_gettime_ns(time.CLOCK_MONOTONIC))
    print(" ".join(map(str, out)))
    """
)


def latency(root: Path, n: int, raw: bool, spin: bool = False) -> list[float]:
    """Microseconds from publication (``close()`` / the rename) to the consumer's wake-up.

    With ``spin`` the consumer busy-polls instead of sleeping: ``INSTRIDE_SPIN=1`` for
    instride, a bare ``os.path.exists`` loop for the baseline.
    """
    env = dict(os.environ, INSTRIDE_DIR=str(root), INSTRIDE_SPIN="1" if spin else "0")
    d = root / (("raw" if raw else "lat") + ("-spin" if spin else ""))
    d.mkdir(parents=True, exist_ok=True)
    script = (POLL_CONSUMER if spin else RAW_CONSUMER) if raw else CONSUMER
    argv = [sys.executable, "-c", script, str(n), str(d)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    import instride

    client = instride.Client(instride.Settings.from_env(env))
    starts = []
    payload = b"x" * 4096
    time.sleep(0.2)
    for i in range(n):
        time.sleep(0.002)  # let the consumer block on key i
        # The clock starts when the producer publishes: at close() (instride: fsync, rename
        # into place) or at the rename (baseline), as in the C benchmark of the preload library.
        if raw:
            tmp = d.parent / f".k{i}.tmp"
            with open(tmp, "wb") as fh:
                fh.write(payload)
            t0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            os.rename(tmp, d / f"k{i}")
        else:
            fh = client.open(f"{d.name}/k{i}", "wb")
            fh.write(payload)
            fh.flush()
            t0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            fh.close()
        starts.append(t0)
    out, _ = proc.communicate(timeout=120)
    wakes = [int(x) for x in out.split()]
    return [(w - s) / 1000 for w, s in zip(wakes, starts, strict=True)]


def _time(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def producer_overhead(root: Path, natoms: int, reps: int) -> dict[str, float]:
    import numpy as np

    import instride
    from instride.frames import encode_frame

    header_b, payload = encode_frame(np.random.default_rng(0).random((natoms, 3)), layout="paper")
    d = root / f"prod{natoms}"
    d.mkdir(parents=True, exist_ok=True)
    res = {}
    for fsync in (False, True):
        client = instride.Client(instride.Settings.from_env(
            dict(os.environ, INSTRIDE_DIR=str(root), INSTRIDE_FSYNC="1" if fsync else "0")))
        counter = iter(range(10**9))

        def plain(counter=counter, fsync=fsync) -> None:  # type: ignore[no-untyped-def]
            with open(d / f"plain{next(counter)}", "wb") as fh:
                fh.write(header_b)
                fh.write(payload)
                if fsync:
                    fh.flush()
                    os.fsync(fh.fileno())

        def ours(counter=counter, client=client) -> None:  # type: ignore[no-untyped-def]
            with client.open(f"prod{natoms}/is{next(counter)}", "wb") as fh:
                fh.write(header_b)
                fh.write(payload)

        # interleave to share the machine's noise fairly
        p, o = [], []
        for _ in range(reps):
            p.append(_time(plain, 1))
            o.append(_time(ours, 1))
        tag = "fsync" if fsync else "nofsync"
        res[f"plain_{tag}_ms"] = statistics.median(p) * 1e3
        res[f"instride_{tag}_ms"] = statistics.median(o) * 1e3
        res[f"ratio_{tag}"] = res[f"instride_{tag}_ms"] / res[f"plain_{tag}_ms"]
        for f in d.iterdir():
            f.unlink()
    return res


def consumer_read(root: Path, natoms: int, reps: int) -> dict[str, float]:
    import numpy as np

    import instride

    client = instride.Client(instride.Settings.from_env(dict(os.environ, INSTRIDE_DIR=str(root))))
    key = f"read/frame{natoms}.isf"
    with instride.Stream(f"read{natoms}", mode="w", layout="paper", client=client) as s:
        s.append(np.random.default_rng(0).random((natoms, 3)))
    key = s.frame_key(0)
    path = root / key

    def plain() -> None:
        with open(path, "rb") as fh:
            fh.read()

    def ours() -> None:
        with client.open(key) as fh:
            fh.read()

    def ours_frame() -> None:
        instride.read_frame(client.consume(key))

    def plain_frame() -> None:
        instride.read_frame(path)

    p, o, pf, of = [], [], [], []
    for _ in range(reps):
        p.append(_time(plain, 1))
        o.append(_time(ours, 1))
        pf.append(_time(plain_frame, 1))
        of.append(_time(ours_frame, 1))
    return {
        "plain_read_ms": statistics.median(p) * 1e3,
        "instride_read_ms": statistics.median(o) * 1e3,
        "ratio_read": statistics.median(o) / statistics.median(p),
        "plain_read_frame_ms": statistics.median(pf) * 1e3,
        "instride_read_frame_ms": statistics.median(of) * 1e3,
        "ratio_read_frame": statistics.median(of) / statistics.median(pf),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--publications", type=int, default=2000)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args()
    m = header("instride local mode: wake-up latency, producer and consumer overhead")
    base = Path(os.environ.get("INSTRIDE_DIR") or tempfile.mkdtemp(prefix="instride-bench-", dir="/dev/shm"))
    root = base / "bench-local"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    result: dict = {"machine": m, "dir": str(root)}
    try:
        n = 300 if args.quick else args.publications
        ours = summary(latency(root, n, raw=False))
        raw = summary(latency(root, n, raw=True))
        ours_spin = summary(latency(root, n, raw=False, spin=True))
        raw_spin = summary(latency(root, n, raw=True, spin=True))
        result["wakeup_us"] = {"instride": ours, "raw_inotify_rename": raw,
                               "instride_spin": ours_spin, "raw_poll_rename": raw_spin}
        print(f"\n## publish -> wake-up latency ({n} publications of 4 KiB, µs from close() / rename"
              " to the consumer's return from consume())")
        print(f"{'':34}{'median':>10}{'p99':>10}{'min':>10}")
        for name, s in (("instride", ours), ("raw inotify + rename", raw),
                        ("instride, INSTRIDE_SPIN=1", ours_spin), ("raw busy-poll + rename", raw_spin)):
            print(f"{name:34}{s['median']:10.1f}{s['p99']:10.1f}{s['min']:10.1f}")
        print(f"ratio instride/raw (median): {ours['median'] / raw['median']:.2f}x sleeping, "
              f"{ours_spin['median'] / raw_spin['median']:.2f}x polling   target: median <= 100 µs")

        reps = {"JAC": 10 if args.quick else 60, "STMV": 4 if args.quick else 15}
        for model, natoms in (("JAC", 23_558), ("STMV", 1_066_628)):
            r = producer_overhead(root, natoms, reps[model])
            result[f"producer_{model}"] = r
            print(f"\n## producer: write + publish a {model} frame ({natoms} atoms, paper layout)")
            for tag in ("nofsync", "fsync"):
                print(f"{tag:8} plain {r[f'plain_{tag}_ms']:8.3f} ms   "
                      f"instride {r[f'instride_{tag}_ms']:8.3f} ms   ratio {r[f'ratio_{tag}']:.3f}x"
                      "   (target <= 1.10x; paper's DYAD: 1.4x)")
            c = consumer_read(root, natoms, reps[model] * 2)
            result[f"consumer_{model}"] = c
            print(f"## consumer: read a published {model} frame")
            print(f"bytes    plain {c['plain_read_ms']:8.3f} ms   instride {c['instride_read_ms']:8.3f} ms"
                  f"   ratio {c['ratio_read']:.3f}x   (target <= 1.05x)")
            print(f"frame    plain {c['plain_read_frame_ms']:8.3f} ms   "
                  f"instride {c['instride_read_frame_ms']:8.3f} ms   ratio {c['ratio_read_frame']:.3f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if not os.environ.get("INSTRIDE_DIR"):
            shutil.rmtree(base, ignore_errors=True)
    save("local", result)


if __name__ == "__main__":
    main()
