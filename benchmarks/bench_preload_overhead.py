"""Cost of libinstride_preload.so: pass-through overhead and publish -> wake-up latency.

1. open+close loop (N calls) on paths OUTSIDE the managed directory, the same C
   program run without and with LD_PRELOAD in the same run, alternating, median of
   several repetitions: absolute path, relative path (the shim must getcwd), and a
   published key inside the managed directory (the consume fast path: one stat).
2. publish -> consumer wake-up latency in local mode: a C producer writes
   CLOCK_MONOTONIC into each key right before close(); a C consumer, already blocked
   in open() on that key, reads it and records now - stamp. Median and p99.

Usage:  python benchmarks/bench_preload_overhead.py [--n 200000] [--reps 7] [--keys 2000]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

OPENCLOSE_C = r"""
#define _GNU_SOURCE 1
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
int main(int argc, char **argv) {
    long n = atol(argv[1]);
    const char *path = argv[2];
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) {
        int fd = open(path, O_RDONLY);
        if (fd < 0) { perror(path); return 1; }
        close(fd);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%.3f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n);
    return 0;
}
"""

EXCHANGE_C = r"""
#define _GNU_SOURCE 1
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
static long long now_ns(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}
int main(int argc, char **argv) {
    /* exchange produce|consume <dir> <n> <gap_us> */
    int n = atoi(argv[3]), gap = atoi(argv[4]);
    char path[4096];
    for (int i = 0; i < n; i++) {
        snprintf(path, sizeof path, "%s/k%06d", argv[2], i);
        if (argv[1][0] == 'p') {
            usleep(gap); /* let the consumer block on this key first */
            int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
            if (fd < 0) { perror(path); return 1; }
            char pad[4096]; memset(pad, 'p', sizeof pad);
            if (write(fd, pad, sizeof pad) != sizeof pad) return 1;
            long long t = now_ns();
            if (write(fd, &t, sizeof t) != sizeof t) return 1;
            if (close(fd) != 0) { perror("close"); return 1; }
        } else {
            int fd = open(path, O_RDONLY);
            if (fd < 0) { perror(path); return 1; }
            char buf[4096 + 8];
            ssize_t got = 0, r;
            while ((r = read(fd, buf + got, sizeof buf - got)) > 0) got += r;
            long long t;
            memcpy(&t, buf + 4096, sizeof t);
            printf("%lld\n", now_ns() - t);
            close(fd);
        }
    }
    return 0;
}
"""


def machine() -> str:
    mem = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{os.cpu_count()} cores ({cpu}), {mem} RAM, Linux {platform.release()}, "
            f"glibc {platform.libc_ver()[1]}; load average at start {load}")


def fs_type(path: Path) -> str:
    best, kind = "", "?"
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        if str(path).startswith(parts[1]) and len(parts[1]) > len(best):
            best, kind = parts[1], parts[2]
    return kind


def compile_c(src: str, out: Path) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        sys.exit("gcc is required")
    c = out.with_suffix(".c")
    c.write_text(textwrap.dedent(src))
    subprocess.run([gcc, "-O2", "-o", str(out), str(c)], check=True)
    return out


def lib_path() -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from instride.preload import preload_path

    return preload_path()


def openclose(exe: Path, n: int, path: str, env: dict, cwd: str) -> float:
    out = subprocess.run([str(exe), str(n), path], env=env, cwd=cwd, check=True,
                         capture_output=True, text=True).stdout
    return float(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000, help="open+close calls per run")
    ap.add_argument("--reps", type=int, default=7, help="repetitions (median reported)")
    ap.add_argument("--keys", type=int, default=2000, help="publications for the latency test")
    ap.add_argument("--gap-us", type=int, default=1500, help="producer pause before each key")
    args = ap.parse_args()

    lib = lib_path()
    # where the default managed directory lives: tmpfs when available
    shm = Path("/dev/shm")
    root = str(shm) if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else None
    work = Path(tempfile.mkdtemp(prefix="instride-bench-", dir=root))
    try:
        managed = work / "managed"
        managed.mkdir()
        plain_dir = work / "plain"
        plain_dir.mkdir()
        target = plain_dir / "file.txt"
        target.write_text("x")
        (managed / "published.txt").write_text("x")
        oc = compile_c(OPENCLOSE_C, work / "openclose")
        ex = compile_c(EXCHANGE_C, work / "exchange")
        base = {k: v for k, v in os.environ.items()
                if not k.startswith("INSTRIDE_") and k != "LD_PRELOAD"}
        base["INSTRIDE_DIR"] = str(managed)
        shimmed = dict(base, LD_PRELOAD=str(lib))

        print(f"machine: {machine()}")
        print(f"python:  {sys.version.split()[0]}; library: {lib}")
        print(f"managed directory: {managed} ({fs_type(managed)})")
        print(f"command: {' '.join([sys.executable, *sys.argv])}")
        print()
        cases = [
            ("non-managed, absolute path", str(target), str(work)),
            ("non-managed, relative path", "file.txt", str(plain_dir)),
            ("managed, published key (consume fast path)", str(managed / "published.txt"),
             str(work)),
        ]
        print(f"open+close, N={args.n}, median of {args.reps} runs (ns per open+close)")
        print(f"{'case':48s} {'no shim':>9s} {'shim':>9s} {'ratio':>7s} {'+ns':>7s}"
              f"   (min: no shim / shim)")
        for label, path, cwd in cases:
            without, with_ = [], []
            for _ in range(args.reps):  # alternate to share any drift
                without.append(openclose(oc, args.n, path, base, cwd))
                with_.append(openclose(oc, args.n, path, shimmed, cwd))
            a, b = statistics.median(without), statistics.median(with_)
            print(f"{label:48s} {a:9.1f} {b:9.1f} {b / a:7.2f} {b - a:7.1f}"
                  f"   ({min(without):.1f} / {min(with_):.1f})")
            print(f"  cmd: [LD_PRELOAD={lib}] INSTRIDE_DIR={managed} {oc} {args.n} {path}"
                  f"  (cwd {cwd})")

        print()
        keys_dir = managed / "lat"
        consumer = subprocess.Popen([str(ex), "consume", str(keys_dir), str(args.keys), "0"],
                                    env=shimmed, stdout=subprocess.PIPE, text=True)
        producer = subprocess.run(
            [str(ex), "produce", str(keys_dir), str(args.keys), str(args.gap_us)],
            env=shimmed, check=True)
        out, _ = consumer.communicate(timeout=600)
        assert producer.returncode == 0 and consumer.returncode == 0
        lat = sorted(int(x) / 1000 for x in out.split())
        assert len(lat) == args.keys
        p99 = lat[min(len(lat) - 1, int(round(0.99 * len(lat))) - 1)]
        print(f"publish -> wake-up latency, local mode, {args.keys} keys of 4 KiB "
              f"(stamp taken before close(); includes link+unlink, inotify wake-up, "
              f"stat, open, read)")
        print(f"  median {statistics.median(lat):.1f} us   p99 {p99:.1f} us   "
              f"min {lat[0]:.1f} us   max {lat[-1]:.1f} us")
        print(f"  cmd: {ex} consume|produce {keys_dir} {args.keys} {args.gap_us} "
              f"(both with LD_PRELOAD)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
