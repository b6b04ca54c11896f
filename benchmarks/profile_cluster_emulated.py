"""Where the time of a cross-node JAC frame goes: a profile of the cluster data path.

Runs the producer/consumer scripts of ``bench_cluster.py`` (JAC frames, 644 KiB) on an
emulated 4-node cluster, with timers wrapped around the functions of the path (nothing in the
package is changed: the wrappers are installed by the scripts), and reads

* per process: CPU time (user + system), minor page faults, context switches (getrusage,
  counted from the first call of the path on: imports and start-up excluded);
* the data servers and Redis: CPU time from ``/proc/<pid>/stat``; Redis: calls per command
  (``INFO commandstats``);

for (a) one pair, frames paced 20 ms apart (the consumer waits: latency) and (b) 8 pairs on
4 nodes flat out (throughput). Everything is reported per frame.

Needs root (network namespaces), iproute2 and redis-server.
Usage: ``python benchmarks/profile_cluster_emulated.py [--frames N] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from bench_cluster import CONSUME, PRODUCE
from common import header
from instride.emulate import EmulatedCluster
from instride.emulate import netns as nn

PY = sys.executable
TICK = os.sysconf("SC_CLK_TCK")

#: functions timed in every process: (module, attribute path)
WRAP = [
    ("instride.stream", "Stream.append"),
    ("instride.stream", "Stream.read"),
    ("instride.stream", "encode_into"),
    ("instride.stream", "frame_checksum"),
    ("instride.client", "Client.wait_any"),
    ("instride.client", "Client.exists"),
    ("instride.client", "Client.consume"),
    ("instride.store.ring", "SlotPool.publish"),
    ("instride.metadata.redis", "RedisMetadata.publish"),
    ("instride.metadata.redis", "RedisMetadata.lookup"),
    ("instride.metadata.redis", "RedisMetadata.wait_any"),
    ("instride.engine.cluster", "ClusterEngine._current"),
    ("instride.engine.cluster", "ClusterEngine._fetch"),
    ("instride.engine.cluster", "ClusterEngine.fetch_when_published"),
    ("instride.engine.cluster", "ClusterEngine._remember"),
    ("instride.engine.cluster", "ClusterEngine.evict"),
    ("instride.transport.tcp", "TcpTransport.fetch_into"),
    ("instride.transport.tcp", "TcpTransport.fetch_when_published"),
    ("instride.transport.tcp", "TcpTransport._request"),
    ("instride.transport.tcp", "TcpTransport._stream_to_file"),
    ("os", "fsync"),
    ("redis.client", "Redis.execute_command"),
    ("redis.client", "Pipeline.execute"),
]

PREAMBLE = f"""
import atexit, functools, importlib, json, resource, time
_PROF = {{}}
_BASE = []
def _usage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return [r.ru_utime + r.ru_stime, r.ru_minflt, r.ru_nvcsw + r.ru_nivcsw]
def _wrap(modname, qual):
    obj = importlib.import_module(modname)
    parts = qual.split(".")
    for p in parts[:-1]:
        obj = getattr(obj, p)
    fn = getattr(obj, parts[-1])
    @functools.wraps(fn)
    def timed(*a, **k):
        if not _BASE:  # the first call of the path: imports and start-up are behind us
            _BASE.append(_usage())
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            e = _PROF.setdefault(qual, [0, 0.0]); e[0] += 1; e[1] += time.perf_counter() - t
    setattr(obj, parts[-1], timed)
for _m, _q in {WRAP!r}:
    _wrap(_m, _q)
def _report():
    end, base = _usage(), (_BASE or [[0, 0, 0]])[0]
    print("PROF " + json.dumps({{"funcs": _PROF, "cpu": end[0] - base[0], "minflt": end[1] - base[1],
                                "csw": end[2] - base[2]}}), flush=True)
atexit.register(_report)
"""


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid``."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def redis_stats(c: EmulatedCluster) -> dict[str, int]:
    import redis

    def read() -> dict[str, Any]:
        r = redis.Redis.from_url(c.redis_url)
        try:
            return r.info("commandstats")
        finally:
            r.close()

    stats = nn.in_netns(c.hub, read)
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()}


def run(c: EmulatedCluster, name: str, pairs: list[tuple[int, int]], n: int, gap: float) -> dict[str, Any]:
    servers = {node.name: c._pids[node.name][0] for node in c.nodes}  # noqa: SLF001
    redis_pid = c._pids["redis"][0]  # noqa: SLF001
    before = {role: proc_cpu(pid) for role, pid in servers.items()} | {"redis": proc_cpu(redis_pid)}
    cmds0 = redis_stats(c)
    cons = [c.popen(q, [PY, "-c", PREAMBLE + CONSUME, f"{name}/p{i}"], stdout=subprocess.PIPE, text=True)
            for i, (_p, q) in enumerate(pairs)]
    for p in cons:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    t0 = time.perf_counter()
    prods = [c.popen(p, [PY, "-c", PREAMBLE + PRODUCE, f"{name}/p{i}", str(n), "23558", str(gap)],
                     stdout=subprocess.PIPE, text=True) for i, (p, _q) in enumerate(pairs)]
    outs = {"producer": [p.communicate(timeout=900)[0] for p in prods],
            "consumer": [p.communicate(timeout=900)[0] for p in cons]}
    wall = time.perf_counter() - t0
    after = {role: proc_cpu(pid) for role, pid in servers.items()} | {"redis": proc_cpu(redis_pid)}
    cmds1 = redis_stats(c)
    frames = n * len(pairs)
    res: dict[str, Any] = {"frames": frames, "wall_s": wall, "frames_per_s": frames / wall, "roles": {}}
    for role, texts in outs.items():
        profs = [json.loads(line[5:]) for t in texts for line in t.splitlines() if line.startswith("PROF ")]
        assert len(profs) == len(texts), texts
        funcs: dict[str, list[float]] = {}
        for p in profs:
            for q, (k, s) in p["funcs"].items():
                e = funcs.setdefault(q, [0, 0.0])
                e[0] += k
                e[1] += s
        res["roles"][role] = {
            "cpu_ms_per_frame": 1e3 * sum(p["cpu"] for p in profs) / frames,
            "minflt_per_frame": sum(p["minflt"] for p in profs) / frames,
            "ctx_switches_per_frame": sum(p["csw"] for p in profs) / frames,
            "calls_per_frame": {q: k / frames for q, (k, _s) in funcs.items()},
            "ms_per_frame": {q: 1e3 * s / frames for q, (_k, s) in funcs.items()},
        }
    res["servers_cpu_ms_per_frame"] = {role: 1e3 * (after[role] - before[role]) / frames for role in servers}
    res["redis_cpu_ms_per_frame"] = 1e3 * (after["redis"] - before["redis"]) / frames
    res["redis_calls_per_frame"] = {k: (v - cmds0.get(k, 0)) / frames for k, v in cmds1.items()
                                    if v - cmds0.get(k, 0) > 0}
    return res


def show(title: str, r: dict[str, Any]) -> None:
    print(f"\n## {title}: {r['frames']} frames in {r['wall_s']:.2f} s ({r['frames_per_s']:.0f} frames/s)")
    total = sum(v["cpu_ms_per_frame"] for v in r["roles"].values())
    total += sum(r["servers_cpu_ms_per_frame"].values()) + r["redis_cpu_ms_per_frame"]
    print(f"CPU per frame, all processes: {total:.2f} ms")
    for role, v in r["roles"].items():
        print(f"  {role:9s} {v['cpu_ms_per_frame']:6.2f} ms CPU, {v['minflt_per_frame']:6.0f} minor faults,"
              f" {v['ctx_switches_per_frame']:5.1f} context switches")
    for role, ms in r["servers_cpu_ms_per_frame"].items():
        print(f"  server {role}: {ms:6.2f} ms CPU")
    print(f"  redis     {r['redis_cpu_ms_per_frame']:6.2f} ms CPU;  commands per frame: "
          + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["redis_calls_per_frame"].items())))
    for role, v in r["roles"].items():
        print(f"  {role} wall time inside (ms per frame, calls per frame):")
        for q, ms in sorted(v["ms_per_frame"].items(), key=lambda kv: -kv[1]):
            print(f"    {q:34s} {ms:7.3f} ms  x{v['calls_per_frame'][q]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=100, help="frames per pair (default 100)")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args()
    m = header("profile of the cluster data path (JAC frames)")
    out: dict[str, Any] = {"machine": m}
    with EmulatedCluster(nodes=4) as c:
        out["one_pair_paced"] = run(c, "prof1", [(1, 2)], args.frames, 0.02)
        show("one pair, node1 -> node2, 20 ms apart", out["one_pair_paced"])
        pairs = [(1 + i % 2, 3 + (i // 2) % 2) for i in range(8)]
        out["eight_pairs"] = run(c, "prof8", pairs, max(10, args.frames // 2), 0.0)
        show("8 pairs, nodes 1-2 -> nodes 3-4, flat out", out["eight_pairs"])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
