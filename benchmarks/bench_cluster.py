"""Cluster mode between emulated nodes (network namespaces on one machine).

Measures, in one run, on an emulated cluster made for the purpose:

1. cross-node transfer of STMV-sized frames (28.48 MiB): consumer on node 2 fetching frames
   published on node 1, vs a raw TCP transfer (``os.sendfile`` -> ``recv_into``) of the same
   bytes between the same two namespaces;
2. cross-node consume latency of JAC-sized frames: publish on node 1 -> bytes local on node 2
   (median, p99);
3. publish -> remote wake-up latency through Redis (a tiny key; median, p99);
4. aggregate throughput of 8 producer/consumer pairs across 4 nodes (producers on nodes 1-2,
   consumers on nodes 3-4) moving JAC-sized frames as fast as they can;
5. publish -> consume latency through the preload library across nodes: unmodified C
   programs (open/write/close on node 1, open/read on node 2) exchanging 4 KiB keys;
6. the data server's start-up time (process start to listening);
7. transports side by side on the same published frames (STMV and JAC, node 1 -> node 2):
   the TCP and the UCX transport (UCX over TCP on the veth), each fetch verified and stored,
   beside raw TCP measured again right then, and ADIOS2 SST (a peer middleware) streaming
   frames of the same sizes between the same two namespaces (``benchmarks/peers.py``).

Needs root (network namespaces), iproute2 and redis-server (``make test`` installs them).
Usage: ``python benchmarks/bench_cluster.py [--quick] [--transports-only]``
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
import time

from common import header, save, summary
from instride.emulate import EmulatedCluster

PY = sys.executable

RAW_SERVER = textwrap.dedent(
    """
    import os, socket, sys
    path, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    srv = socket.create_server((host, port))
    print("ready", flush=True)
    conn, _ = srv.accept()
    n = int(conn.recv(16).decode())
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        for _ in range(n):
            off = 0
            while off < size:
                off += os.sendfile(conn.fileno(), fh.fileno(), off, size - off)
    conn.close()
    """
)
RAW_CLIENT = textwrap.dedent(
    """
    import socket, sys, time
    host, port, size, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    s = socket.create_connection((host, port))
    buf = bytearray(size); view = memoryview(buf)
    t = time.perf_counter()
    s.sendall(str(n).encode().ljust(16))
    for _ in range(n):
        got = 0
        while got < size:
            got += s.recv_into(view[got:], min(size - got, 4 << 20))
    print(time.perf_counter() - t)
    """
)
PRODUCE = textwrap.dedent(
    """
    import sys, time, numpy as np, instride
    name, n, atoms, gap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    pos = np.random.default_rng(0).random((atoms, 3))
    instride.get_client().exists("warm-up")
    with instride.Stream(name, mode="w", layout="paper") as s:
        for i in range(n):
            if gap:
                time.sleep(gap)
            t = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            s.append(pos, step=i)
            print(t, flush=True)
    """
)
CONSUME = textwrap.dedent(
    """
    import sys, time, instride
    s = instride.Stream(sys.argv[1], timeout=120)
    c = instride.get_client()
    c.exists("warm-up")  # connect to Redis before the clock starts
    out = []
    i = 0
    print("ready", flush=True)
    t0 = time.perf_counter()
    while True:
        key = s.frame_key(i)
        got = c.wait_any([key, s.end_key], timeout=120)
        if got != key and not c.exists(key):
            break
        c.consume(key)
        out.append(time.clock_gettime_ns(time.CLOCK_MONOTONIC))
        i += 1
    print(time.perf_counter() - t0)
    print(" ".join(map(str, out)))
    """
)
WAKE_CONSUMER = textwrap.dedent(
    """
    import sys, time, instride
    c = instride.get_client()
    c.exists("warm-up")
    n = int(sys.argv[1]); out = []
    print("ready", flush=True)
    for i in range(n):
        c.wait_any([f"wake/k{i}"], timeout=60)
        out.append(time.clock_gettime_ns(time.CLOCK_MONOTONIC))
    print(" ".join(map(str, out)))
    """
)
WAKE_PRODUCER = textwrap.dedent(
    """
    import sys, time, instride
    n = int(sys.argv[1]); out = []
    instride.get_client().exists("warm-up")
    for i in range(n):
        time.sleep(0.003)
        t = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        with instride.open(f"wake/k{i}", "wb") as fh:
            fh.write(b"x")
        out.append(t)
    print(" ".join(map(str, out)))
    """
)


def _ready(proc: subprocess.Popen) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", line


def _popen(c: EmulatedCluster, node: int, code: str, *args: object) -> subprocess.Popen:
    return c.popen(node, [PY, "-c", code, *map(str, args)], stdout=subprocess.PIPE, text=True)


def raw_tcp(c: EmulatedCluster, path: str, size: int, n: int) -> float:
    port = 7600
    srv = _popen(c, 1, RAW_SERVER, path, c.node(1).ip, port)
    _ready(srv)
    out = subprocess.run(c.command(2, [PY, "-c", RAW_CLIENT, c.node(1).ip, str(port), str(size), str(n)]),
                         capture_output=True, text=True, env=c.node(2).env, check=True).stdout
    srv.wait(30)
    return n * size / float(out) / 1e6


def stream_run(c: EmulatedCluster, name: str, n: int, atoms: int, gap: float,
               pairs: list[tuple[int, int]]) -> tuple[float, list[list[float]]]:
    cons = [_popen(c, q, CONSUME, f"{name}/p{i}") for i, (_p, q) in enumerate(pairs)]
    for p in cons:
        _ready(p)
    t0 = time.perf_counter()
    prods = [_popen(c, p, PRODUCE, f"{name}/p{i}", n, atoms, gap) for i, (p, _q) in enumerate(pairs)]
    starts = [[int(x) for x in p.communicate(timeout=600)[0].split()] for p in prods]
    lat = []
    for i, p in enumerate(cons):
        out = p.communicate(timeout=600)[0].splitlines()
        wakes = [int(x) for x in out[1].split()]
        lat.append([(w - s) / 1e3 for w, s in zip(wakes, starts[i], strict=False)])
    return time.perf_counter() - t0, lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--transports-only", action="store_true",
                    help="run sections 1, 2 and 7 only (transports and peers); results are not saved")
    args = ap.parse_args()
    m = header("instride cluster mode between emulated nodes")
    result: dict = {"machine": m}
    stmv_atoms, jac_atoms = 1_066_628, 23_558
    from instride.frames import frame_size

    stmv = frame_size(stmv_atoms, "paper")
    jac = frame_size(jac_atoms, "paper")
    n_stmv = 8 if args.quick else 24
    n_jac = 100 if args.quick else 500
    with EmulatedCluster(nodes=4) as c:
        # 1. STMV throughput vs raw TCP: frames already published on node 1, node 2 consumes
        prod = _popen(c, 1, PRODUCE, "stmv/p0", n_stmv, stmv_atoms, 0.0)
        prod.communicate(timeout=600)
        cons = _popen(c, 2, CONSUME, "stmv/p0")
        _ready(cons)
        elapsed = float(cons.communicate(timeout=600)[0].splitlines()[0])
        ours = n_stmv * stmv / elapsed / 1e6
        src = c.node(1).dir / "stmv" / "p0" / "frame_000000000.isf"
        raw = raw_tcp(c, str(src), stmv, n_stmv)
        result["stmv_throughput_MBps"] = {"instride": ours, "raw_tcp_sendfile": raw, "ratio": ours / raw}
        print(f"\n## cross-node STMV frames ({stmv / 2**20:.2f} MiB x {n_stmv}), node1 -> node2")
        print(f"instride consume (wait+fetch+verify+store): {ours:8.0f} MB/s")
        print(f"raw TCP sendfile -> recv_into:               {raw:8.0f} MB/s")
        print(f"ratio: {ours / raw:.2f}  (target >= 0.85)")

        # 2. JAC consume latency, frames paced so the consumer is waiting
        _, lat = stream_run(c, "jac", n_jac, jac_atoms, 0.02, [(1, 2)])
        s = summary(lat[0])
        result["jac_consume_latency_us"] = s
        print(f"\n## cross-node consume latency, JAC frames ({jac / 1024:.1f} KiB), publish start on"
              f" node1 -> bytes local on node2")
        print(f"median {s['median']:.0f} µs   p99 {s['p99']:.0f} µs   min {s['min']:.0f} µs   (n={s['n']})")

        if args.transports_only:
            transports(c, result, stmv, jac, n_stmv, args.quick)
            return
        # 3. remote wake-up through Redis
        n = 300 if args.quick else 1000
        w = _popen(c, 2, WAKE_CONSUMER, n)
        _ready(w)
        p = _popen(c, 1, WAKE_PRODUCER, n)
        starts = [int(x) for x in p.communicate(timeout=300)[0].split()]
        wakes = [int(x) for x in w.communicate(timeout=300)[0].split()]
        s = summary([(a - b) / 1e3 for a, b in zip(wakes, starts, strict=True)])
        result["remote_wakeup_us"] = s
        print("\n## publish (node1) -> remote wake-up (node2) through Redis, 1-byte keys")
        print(f"median {s['median']:.0f} µs   p99 {s['p99']:.0f} µs   (n={s['n']}; FACTS.md: Redis"
              f" RPUSH->BLPOP 158 µs median)")

        # 4. aggregate, 8 pairs across 4 nodes
        pairs = [(1 + i % 2, 3 + (i // 2) % 2) for i in range(8)]
        nf = 50 if args.quick else 150
        elapsed, _ = stream_run(c, "agg", nf, jac_atoms, 0.0, pairs)
        agg = 8 * nf * jac / elapsed / 1e6
        result["aggregate_8_pairs_MBps"] = agg
        print(f"\n## aggregate: 8 pairs (producers on nodes 1-2, consumers on nodes 3-4), {nf} JAC"
              f" frames each")
        print(f"{agg:.0f} MB/s in {elapsed:.2f} s ({8 * nf / elapsed:.0f} frames/s) on {m['cores']} cores")
        # 5. through the preload library, node 1 -> node 2 (unmodified C programs)
        import tempfile
        from pathlib import Path

        from bench_preload_overhead import EXCHANGE_C, compile_c
        from instride.interception.preload import preload_path

        n_keys = 200 if args.quick else 1000
        work = Path(tempfile.mkdtemp(prefix="instride-bench-ex-"))
        ex = compile_c(EXCHANGE_C, work / "exchange")
        shim = {"LD_PRELOAD": str(preload_path())}
        cons = c.popen(2, [str(ex), "consume", str(c.node(2).dir / "shimlat"), str(n_keys), "0"],
                       env=shim, stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)
        subprocess.run(c.command(1, [str(ex), "produce", str(c.node(1).dir / "shimlat"),
                                     str(n_keys), "3000"]),
                       env={**c.node(1).env, **shim}, check=True)
        out, _ = cons.communicate(timeout=600)
        s = summary([int(x) / 1e3 for x in out.split()])
        result["shim_cross_node_latency_us"] = s
        print("\n## preload library across nodes: close() on node1 -> read() returns on node2 (4 KiB)")
        print(f"median {s['median']:.0f} µs   p99 {s['p99']:.0f} µs   (n={s['n']})")

        # 6. server start-up
        starts = []
        for _ in range(3 if args.quick else 5):
            c.stop_server(2)
            t = time.perf_counter()
            c.start_server(2)
            starts.append(time.perf_counter() - t)
        result["server_start_s"] = summary(starts)
        med = summary(starts)["median"]
        print(f"\n## data server start-up (process start -> accepting): median {med:.2f} s"
              " (requirement: under a second)")
        transports(c, result, stmv, jac, n_stmv, args.quick)
    save("cluster", result)


def transports(c: EmulatedCluster, result: dict, stmv: int, jac: int, n_stmv: int, quick: bool) -> None:
    """7. TCP and UCX transports on the same frames, raw TCP, ADIOS2 SST; adds to ``result``."""
    from peers import sst_rows, transport_rows

    d1 = c.node(1).dir
    print("\n## transports, node1 -> node2, same published frames (fetch + verify + store as a file)")
    print("UCX over TCP (UCX_TLS=tcp, UCX_NET_DEVICES=eth0); ADIOS2 SST with DataTransport=WAN on eth0")
    sets = (("stmv", stmv, n_stmv), ("jac", jac, 100 if quick else 300))
    for label, size, n_keys in sets:
        keys = sorted(str(p.relative_to(d1)) for p in (d1 / label / "p0").glob("frame_*.isf"))[:n_keys]
        raw = raw_tcp(c, str(d1 / keys[0]), size, len(keys))
        rows = transport_rows(c, keys)
        sst = sst_rows(c, len(keys), size)
        entry = {
            "frame_bytes": size, "frames": len(keys), "raw_tcp_sendfile": raw,
            "tcp": rows["tcp"]["MBps"], "ucx": rows["ucx"]["MBps"], "adios2_sst": sst["MBps"],
            "ratio_tcp_vs_raw": rows["tcp"]["MBps"] / raw, "ratio_ucx_vs_raw": rows["ucx"]["MBps"] / raw,
            "ratio_ucx_vs_tcp": rows["ucx"]["MBps"] / rows["tcp"]["MBps"],
            "ratio_best_instride_vs_sst": max(rows["tcp"]["MBps"], rows["ucx"]["MBps"]) / sst["MBps"],
            "fetch_latency_us": {name: rows[name]["fetch_latency_us"] for name in ("tcp", "ucx")},
            "sst_step_latency_us": sst["step_latency_us"],
        }
        result[f"transports_{label}_MBps"] = entry
        print(f"\n{label.upper()} frames ({size / 2**10:.1f} KiB x {len(keys)}):")
        print(f"  raw TCP sendfile -> recv_into   {raw:8.0f} MB/s")
        for name in ("tcp", "ucx"):
            lat = rows[name]["fetch_latency_us"]
            print(f"  instride {name} transport       {rows[name]['MBps']:8.0f} MB/s  ratio vs raw"
                  f" {rows[name]['MBps'] / raw:.2f}   fetch median {lat['median']:.0f} µs"
                  f" p99 {lat['p99']:.0f} µs")
        print(f"  ADIOS2 SST (WAN)                {sst['MBps']:8.0f} MB/s   step median"
              f" {sst['step_latency_us']['median']:.0f} µs")
        print(f"  UCX / TCP transport: {entry['ratio_ucx_vs_tcp']:.2f}   best instride / SST:"
              f" {entry['ratio_best_instride_vs_sst']:.2f} (target >= 1.2)")


if __name__ == "__main__":
    main()
