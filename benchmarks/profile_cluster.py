"""CPU profile of the cluster data plane: where the time per frame goes, process by process.

Runs, on this machine without network namespaces (loopback), a Redis server, the data server
of "node 1" (``instride serve``), a producer on node 1 appending JAC-sized frames to a stream
and a consumer on "node 2" (another managed directory) waiting for and fetching each frame —
each Python process under :mod:`cProfile` with a CPU-time clock (so time spent blocked or
preempted by other processes is not counted). Prints, per process, the CPU time per frame
(``time.process_time``; a CPU-time measure, meaningful on a loaded machine) and the functions
with the most own time.

Usage: ``python benchmarks/profile_cluster.py [--frames N] [--atoms N] [--retain N] [--top K]
[--out DIR] [--no-profile]``
"""

from __future__ import annotations

import argparse
import os
import pstats
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

PY = sys.executable

PRODUCER = textwrap.dedent(
    """
    import cProfile, sys, time, numpy as np, instride
    name, n, atoms, gap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    out, retain = sys.argv[5], int(sys.argv[6])
    bounded = dict(retain=retain, groups=["prof"]) if retain else {}
    pos = np.random.default_rng(0).random((atoms, 3))
    instride.get_client().exists("warm-up")
    prof = cProfile.Profile(time.process_time) if out != "-" else None
    cpu = 0.0
    with instride.Stream(name, mode="w", layout="paper", **bounded) as s:
        for i in range(n):
            time.sleep(gap)
            c0 = time.process_time()
            prof and prof.enable()
            s.append(pos, step=i)
            prof and prof.disable()
            cpu += time.process_time() - c0
    prof and prof.dump_stats(out)
    print(cpu / n)
    """
)
CONSUMER = textwrap.dedent(
    """
    import cProfile, sys, time, instride
    name, n, out, retain = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    s = instride.Stream(name, timeout=120, **(dict(group="prof") if retain else {}))
    c = instride.get_client()
    c.exists("warm-up")
    prof = cProfile.Profile(time.process_time) if out != "-" else None
    print("ready", flush=True)
    c0 = time.process_time()
    prof and prof.enable()
    for i, _frame in zip(range(n), s):  # each frame released when the next is taken
        pass
    prof and prof.disable()
    cpu = time.process_time() - c0
    prof and prof.dump_stats(out)
    print(cpu / n)
    """
)
SERVER = textwrap.dedent(
    """
    import cProfile, runpy, sys, time
    out = sys.argv[1]
    sys.argv = ["instride", "serve"]
    prof = cProfile.Profile(time.process_time) if out != "-" else None
    prof and prof.enable()
    try:
        runpy.run_module("instride", run_name="__main__")
    finally:
        if prof:
            prof.disable()
            prof.dump_stats(out)
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=300)
    ap.add_argument("--atoms", type=int, default=23_558, help="atoms per frame (JAC: 23,558)")
    ap.add_argument("--gap", type=float, default=0.005, help="seconds between frames")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--retain", type=int, default=0,
                    help="a bounded stream: retain=N frames, one consumer group (0: unbounded)")
    ap.add_argument("--out", default=None, help="keep the .prof files here")
    ap.add_argument("--no-profile", action="store_true",
                    help="only the CPU time per frame, without the profiler's own overhead")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="instride-prof-", dir="/dev/shm"))
    out = Path(args.out) if args.out else work
    out.mkdir(parents=True, exist_ok=True)
    rport, sport = free_port(), free_port()
    procs: list[subprocess.Popen] = []
    try:
        redis = subprocess.Popen(["redis-server", "--port", str(rport), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
        procs.append(redis)
        base = {**os.environ, "INSTRIDE_REDIS_URL": f"redis://127.0.0.1:{rport}/0",
                "INSTRIDE_TOKEN": secrets.token_hex(16)}
        env1 = {**base, "INSTRIDE_DIR": str(work / "node1"), "INSTRIDE_NODE": "node1",
                "INSTRIDE_ADDR": f"127.0.0.1:{sport}"}
        env2 = {**base, "INSTRIDE_DIR": str(work / "node2"), "INSTRIDE_NODE": "node2",
                "INSTRIDE_ADDR": f"127.0.0.1:{free_port()}"}
        tag = (lambda role: "-") if args.no_profile else (lambda role: str(out / f"{role}.prof"))
        srv = subprocess.Popen([PY, "-c", SERVER, tag("server")], env=env1,
                               stderr=subprocess.DEVNULL)
        procs.append(srv)
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", sport), timeout=1).close()
                socket.create_connection(("127.0.0.1", rport), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        srv_cpu0 = _cpu(srv.pid)
        cons = subprocess.Popen([PY, "-c", CONSUMER, "prof", str(args.frames), tag("consumer"),
                                 str(args.retain)],
                                env=env2, stdout=subprocess.PIPE, text=True)
        procs.append(cons)
        assert cons.stdout is not None and cons.stdout.readline().strip() == "ready"
        prod = subprocess.run([PY, "-c", PRODUCER, "prof", str(args.frames), str(args.atoms), str(args.gap),
                               tag("producer"), str(args.retain)],
                              env=env1, capture_output=True, text=True, check=True)
        c_out = cons.communicate(timeout=600)[0].split()
        srv_cpu = (_cpu(srv.pid) - srv_cpu0) / args.frames
        srv.send_signal(signal.SIGTERM)
        srv.wait(30)
        per = {"producer": float(prod.stdout.split()[-1]), "consumer": float(c_out[-1]), "server": srv_cpu}
        print(f"# CPU time per frame ({args.atoms} atoms, {args.frames} frames, load "
              f"{os.getloadavg()[0]:.1f})")
        for role, t in per.items():
            print(f"{role:9s} {t * 1e6:8.0f} µs")
        print(f"total     {sum(per.values()) * 1e6:8.0f} µs")
        for role in () if args.no_profile else ("producer", "consumer", "server"):
            print(f"\n## {role}: top functions by own time")
            st = pstats.Stats(str(out / f"{role}.prof"))
            st.sort_stats("tottime").print_stats(args.top)
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        shutil.rmtree(work, ignore_errors=True)  # (with --out the profiles went there)


def _cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
