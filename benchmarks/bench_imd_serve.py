"""How fast does `instride imd-serve` feed unmodified IMD clients, against reading the stream directly?

One run, on one stream (the solvated adenylate kinase of MDAnalysisTests, 47,681 atoms, its 10
XTC frames repeated to ``--frames``):

* ``direct``   — the baseline: one process iterates ``instride.Stream`` (read + verify);
* ``imd xK``   — an :class:`~instride.md.imd_server.IMDServer` and K client processes, each an
  ``imdclient.IMDClient`` (the library under MDAnalysis's ``imd://`` reader) receiving every
  frame; per client and aggregate frames/s, and the ratio to ``direct``.

Usage::

    python benchmarks/bench_imd_serve.py [--frames 200] [--clients 1,2,4] [--reps 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import header, save  # noqa: E402


def _client(port: int, natoms: int, queue: mp.Queue) -> None:
    from imdclient.IMDClient import IMDClient

    t0 = time.perf_counter()
    client = IMDClient("127.0.0.1", port, natoms, timeout=60)
    n = 0
    while True:
        try:
            client.get_imdframe()
        except EOFError:
            break
        n += 1
    client.stop()
    queue.put((n, time.perf_counter() - t0))


def _direct(name: str) -> tuple[int, float]:
    import instride

    t0 = time.perf_counter()
    n = sum(1 for _ in instride.Stream(name, timeout=60))
    return n, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--clients", default="1,2,4", help="comma-separated client counts")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",")]
    machine = header("instride imd-serve: frames/s to unmodified IMD clients")

    with tempfile.TemporaryDirectory(prefix="bench-imd-", dir="/dev/shm") as root:
        os.environ["INSTRIDE_DIR"] = root
        os.environ.pop("INSTRIDE_REDIS_URL", None)
        import MDAnalysis as mda
        from MDAnalysisTests.datafiles import GRO, XTC

        import instride
        from instride.md.imd_server import IMDServer

        u = mda.Universe(GRO, XTC)
        frames = [(u.atoms.positions.copy(), ts.triclinic_dimensions.copy()) for ts in u.trajectory]
        natoms = len(u.atoms)
        with instride.Stream("bench", mode="w") as s:
            for i in range(args.frames):
                pos, box = frames[i % len(frames)]
                s.append(pos, step=i, time=0.002 * i, box=box)
        mb = args.frames * (128 + 12 * natoms) / 1e6
        print(f"stream: {args.frames} frames x {natoms} atoms ({mb:.0f} MB)")

        ctx = mp.get_context("spawn")
        rows: dict[str, list[float]] = {"direct": []}
        for k in counts:
            rows[f"imd x{k}"] = []
            rows[f"imd x{k} aggregate"] = []
        for _ in range(args.reps):
            n, sec = _direct("bench")
            assert n == args.frames
            rows["direct"].append(n / sec)
            for k in counts:
                q: mp.Queue = ctx.Queue()
                with IMDServer("bench") as srv:
                    procs = [ctx.Process(target=_client, args=(srv.port, natoms, q)) for _ in range(k)]
                    for p in procs:
                        p.start()
                    got = [q.get(timeout=600) for _ in procs]
                    wall = max(sec for _, sec in got)  # from the first connect to the last frame
                    for p in procs:
                        p.join()
                assert all(n == args.frames for n, _ in got), got
                rows[f"imd x{k}"].append(statistics.median(args.frames / sec for _, sec in got))
                rows[f"imd x{k} aggregate"].append(k * args.frames / wall)

        base = statistics.median(rows["direct"])
        print(f"\n{'configuration':>22}  {'frames/s (median)':>17}  {'MB/s':>8}  {'vs direct':>9}")
        result = {"machine": machine, "frames": args.frames, "natoms": natoms, "rows": {}}
        for name, vals in rows.items():
            med = statistics.median(vals)
            per_frame_mb = mb / args.frames
            print(f"{name:>22}  {med:17.1f}  {med * per_frame_mb:8.0f}  {med / base:8.2f}x")
            result["rows"][name] = {"frames_per_s": vals, "median": med, "ratio": med / base}
        print("(per client: frames/s one client received, from its connection (handshake "
              "included) to end of stream; aggregate: all clients' frames / the slowest client's time)")
        save("imd_serve", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
