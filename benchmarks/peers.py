"""Transports and a peer middleware between two emulated nodes, for ``bench_cluster.py``.

* :func:`transport_rows`: the TCP and UCX transports fetching the same published frames
  (node 1 -> node 2, records from Redis, each body verified and written as a file on node 2),
  one transport after the other in the same client process, twice, beside raw TCP; each into
  new files and into recycled ones (``fetch_into`` an existing file, overwritten in place, as
  a node's receive pool does with the storage of dropped copies).
* :func:`sst_rows`: ADIOS2's SST engine (PyPI ``adios2``, ``DataTransport=WAN``: EVPath over
  TCP on ``eth0``) streaming frames of the same size from node 1 to node 2.

UCX runs with ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES=eth0``: network namespaces do not isolate
shared memory, and without them two emulated nodes would talk through sysv/cma. Node 1's
``instride serve`` keeps serving TCP on its address (port 7437); a stand-alone UCX data server
(``python -m instride.transport.ucx``) serves the same directory beside it on
:data:`UCX_PORT`, and the UCX fetches use the records with that port as owner.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from common import summary

PY = sys.executable
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
#: Port of the UCX data server beside node 1's TCP one (the records name the TCP one).
UCX_PORT = 7438

FETCH = textwrap.dedent(
    """
    import dataclasses, json, os, sys, time
    from pathlib import Path
    from instride.config import Settings
    from instride.metadata import get_backend
    from instride.transport import get_transport
    keys, out, rounds = json.loads(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    ucx_port = sys.argv[4]
    settings = Settings.from_env()
    meta = get_backend("redis", settings)
    tcp_records = [meta.lookup(k) for k in keys]
    assert all(tcp_records), "missing records"
    # the UCX server of the owner node listens beside its TCP server, on ucx_port
    ucx_records = [dataclasses.replace(r, owner=r.owner.rpartition(":")[0] + ":" + ucx_port)
                   for r in tcp_records]
    by_name = {"tcp": tcp_records, "ucx": ucx_records}
    transports = {name: get_transport(name, settings) for name in ("tcp", "ucx")}
    modes = [(name, recycled) for name in transports for recycled in (False, True)]
    res = {name + ("_recycled" if recycled else ""): {"seconds": 0.0, "bytes": 0, "lat_us": []}
           for name, recycled in modes}
    out.mkdir(parents=True, exist_ok=True)

    def into(t, rec, path):
        # what a node's receive pool does with a dropped copy's file: overwrite it in place
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.ftruncate(fd, rec.size)
            t.fetch_into(rec, fd)
        finally:
            os.close(fd)

    for name, t in transports.items():  # warm-up: connections, buffers, the recycled files
        t.fetch(by_name[name][0], out / "warm"); os.unlink(out / "warm")
        for j in range(2):
            into(t, by_name[name][0], out / f"{name}-r{j}")
    for _ in range(rounds):
        for name, recycled in modes:
            t = transports[name]
            r = res[name + ("_recycled" if recycled else "")]
            for i, rec in enumerate(by_name[name]):
                dest = out / (f"{name}-r{i % 2}" if recycled else f"{name}-{i}")
                t0 = time.perf_counter()
                if recycled:
                    into(t, rec, dest)
                else:
                    t.fetch(rec, dest)
                dt = time.perf_counter() - t0
                r["seconds"] += dt; r["bytes"] += rec.size; r["lat_us"].append(dt * 1e6)
                if not recycled:
                    os.unlink(dest)
    for name in transports:
        for j in range(2):
            os.unlink(out / f"{name}-r{j}")
    for t in transports.values():
        t.close()
    print(json.dumps(res))
    """
)

SST_WRITE = textwrap.dedent(
    """
    import sys, numpy as np, adios2
    n, size = int(sys.argv[1]), int(sys.argv[2])
    io = adios2.Adios().declare_io("writer")
    io.set_engine("SST")
    io.set_parameters({"DataTransport": "WAN", "NetworkInterface": "eth0", "RendezvousReaderCount": "1",
                       "QueueLimit": "4", "QueueFullPolicy": "Block"})
    data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    var = io.define_variable("frame", data, [size], [0], [size], True)
    eng = io.open("frames", adios2.Mode.Write)
    for i in range(n):
        eng.begin_step(); eng.put(var, data); eng.end_step()
    eng.close()
    """
)
SST_READ = textwrap.dedent(
    """
    import json, sys, time, numpy as np, adios2
    size = int(sys.argv[1])
    io = adios2.Adios().declare_io("reader")
    io.set_engine("SST")
    io.set_parameters({"DataTransport": "WAN", "NetworkInterface": "eth0"})
    eng = io.open("frames", adios2.Mode.Read)
    buf = np.empty(size, np.uint8)
    lat, t0 = [], time.perf_counter()
    while True:
        t = time.perf_counter()
        if eng.begin_step() != adios2.StepStatus.OK:
            break
        eng.get(io.inquire_variable("frame"), buf, adios2.Mode.Sync)
        eng.end_step()
        lat.append((time.perf_counter() - t) * 1e6)
    elapsed = time.perf_counter() - t0
    eng.close()
    print(json.dumps({"frames": len(lat), "seconds": elapsed, "lat_us": lat}))
    """
)


def start_ucx_server(c: Any, node: int) -> subprocess.Popen:
    """Start a UCX data server on ``node`` (serving its managed directory); wait until ready."""
    proc = c.popen(node, [PY, "-m", "instride.transport.ucx", "--port", str(UCX_PORT)], env=UCX_ENV,
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("ready"):
        proc.kill()
        raise RuntimeError(f"UCX server did not start: {line!r} {proc.stderr.read()}")
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def transport_rows(c: Any, keys: list[str], rounds: int = 2) -> dict[str, Any]:
    """Fetch ``keys`` (published on node 1) from node 2 with each transport; MB/s and latency."""
    server = start_ucx_server(c, 1)
    try:
        out = c.node(2).dir / ".bench-fetch"
        proc = c.run(2, [PY, "-c", FETCH, json.dumps(keys), str(out), str(rounds), str(UCX_PORT)],
                     env=UCX_ENV,
                     capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"fetch benchmark failed: {proc.stderr[-3000:]}")
        res = json.loads(proc.stdout.splitlines()[-1])
    finally:
        stop(server)
    rows = {}
    for name, r in res.items():
        rows[name] = {"MBps": r["bytes"] / r["seconds"] / 1e6, "fetch_latency_us": summary(r["lat_us"])}
    return rows


def sst_rows(c: Any, n: int, size: int) -> dict[str, Any]:
    """Stream ``n`` frames of ``size`` bytes from node 1 to node 2 with ADIOS2 SST."""
    work = Path(tempfile.mkdtemp(prefix="instride-bench-sst-"))  # the contact file lives here
    try:
        writer = c.popen(1, [PY, "-c", SST_WRITE, str(n), str(size)], cwd=work,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        reader = c.run(2, [PY, "-c", SST_READ, str(size)], cwd=work, capture_output=True, text=True,
                       timeout=900)
        _out, err = writer.communicate(timeout=120)
        if reader.returncode != 0 or writer.returncode != 0:
            raise RuntimeError(f"SST failed: {reader.stderr[-2000:]} {err[-2000:]}")
        res = json.loads(reader.stdout.splitlines()[-1])
    finally:
        for p in work.iterdir():
            p.unlink()
        work.rmdir()
    if res["frames"] != n:
        raise RuntimeError(f"SST delivered {res['frames']} of {n} frames")
    return {"MBps": n * size / res["seconds"] / 1e6, "step_latency_us": summary(res["lat_us"])}
