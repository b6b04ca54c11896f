"""Shared helpers of the benchmark scripts: machine description, statistics, reporting.

Every benchmark prints the command that ran it, the machine (cores, memory, kernel, Python),
its measurements and a ratio against a baseline measured in the same run.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    """Cores, memory and software of this machine."""
    mem_kib = 0
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    cpu = platform.processor()
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kib / 1024 / 1024, 1),
        "cpu": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "interpreter": interpreter(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def interpreter() -> str:
    """The running interpreter's file and whether it calls into a shared ``libpython``.

    Most of instride's per-frame CPU outside the kernel is Python, so the interpreter's build
    shows in the cluster benchmarks: Debian's ``/usr/bin/python3`` (built with PGO and LTO,
    libpython linked in) took 15–25 % less user CPU per frame for it than a default pyenv build
    (no PGO, a shared libpython) on the development VM. Benchmarks print it beside their
    results.
    """
    shared = False
    with open("/proc/self/maps") as fh:
        shared = any("/libpython" in line for line in fh)
    return f"{os.path.realpath(sys.executable)} (libpython {'shared' if shared else 'static'})"


def header(title: str) -> dict[str, Any]:
    """Print the benchmark's title, command and machine; return the machine description."""
    m = machine()
    print(f"# {title}")
    print(f"command: {' '.join(shlex.quote(a) for a in [sys.executable, *sys.argv])}")
    print(f"machine: {m['cores']} cores, {m['memory_gib']} GiB, {m['cpu']}, Linux {m['kernel']}, "
          f"Python {m['python']}, load {m['load_avg_1m']}")
    print(f"interpreter: {m['interpreter']}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    return m


def new_pages_GBps(directory: str | os.PathLike[str], mib: int = 128) -> float:
    """GB/s of writing a new file of ``mib`` MiB (128 KiB per ``write``) in ``directory``, then
    deleting it: how fast the machine hands out new pages there at this moment.

    Every design that keeps each frame as a file pays this per byte. On a VM it depends on the
    host as much as on the guest (pages the host must back anew cost far more than ones the
    guest reuses), so benchmarks that store frames in new files print it beside their results.
    """
    piece = memoryview(bytearray(os.urandom(1 << 17)))
    path = Path(directory) / f".new-pages-probe-{os.getpid()}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        t0 = time.perf_counter()
        for _ in range(mib * 8):
            done = 0
            while done < len(piece):
                done += os.write(fd, piece[done:])
        took = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
    return mib * 2**20 / took / 1e9


def pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``."""
    data = sorted(values)
    if not data:
        return float("nan")
    k = (len(data) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (k - lo)


def summary(values: list[float]) -> dict[str, float]:
    """Median, p99, mean, min and count of ``values``."""
    return {
        "median": statistics.median(values),
        "p99": pct(values, 99),
        "mean": statistics.fmean(values),
        "min": min(values),
        "n": len(values),
    }


def save(name: str, result: dict[str, Any]) -> Path:
    """Write ``result`` as JSON to ``benchmarks/results/<name>.json``."""
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"saved {path}")
    return path


def _proc_stat() -> tuple[list[int], int, int]:
    """The ``cpu`` line of ``/proc/stat`` (clock ticks), context switches and interrupts."""
    cpu: list[int] = []
    ctxt = intr = 0
    with open("/proc/stat") as fh:
        for line in fh:
            name, _, rest = line.partition(" ")
            if name == "cpu":
                cpu = [int(x) for x in rest.split()]
            elif name == "ctxt":
                ctxt = int(rest)
            elif name == "intr":
                intr = int(rest.split()[0])
    return cpu, ctxt, intr


class CpuMeter:
    """The whole machine's CPU use over a ``with`` block, from ``/proc/stat``: where a run's
    time went when all cores are busy (user, kernel), and how many context switches and
    interrupts it took. System-wide, so it counts every process of the run (servers and
    Redis included) and anything else running then; the clock ticks are 10 ms."""

    def __enter__(self) -> CpuMeter:
        self._start = _proc_stat()
        self._t = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self._end = _proc_stat()
        self.seconds = time.monotonic() - self._t

    def per(self, units: int) -> dict[str, float]:
        """CPU per unit of work (``units``: e.g. the frames moved): user and kernel
        milliseconds (the kernel's including interrupts), context switches, interrupts, and
        the share of all cores that was busy."""
        (c0, x0, i0), (c1, x1, i1) = self._start, self._end
        d = [b - a for a, b in zip(c0, c1, strict=False)]
        tick = os.sysconf("SC_CLK_TCK")
        user, system = (d[0] + d[1]) / tick, (d[2] + d[5] + d[6]) / tick  # user+nice, sys+irq+softirq
        idle = (d[3] + d[4]) / tick
        return {
            "user_ms": user / units * 1e3,
            "system_ms": system / units * 1e3,
            "context_switches": (x1 - x0) / units,
            "interrupts": (i1 - i0) / units,
            "busy": (user + system) / max(user + system + idle, 1e-9),
        }
