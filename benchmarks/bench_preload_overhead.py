"""Cost of libinstride_preload.so: pass-through overhead and publish -> wake-up latency.

1. open+close loop (N calls) on paths OUTSIDE the managed directory, the same C
   program run without and with LD_PRELOAD in the same run, alternating, median of
   several repetitions: absolute path, relative path (the shim must getcwd), and a
   published key inside the managed directory (the consume fast path: one stat).
2. publish -> consumer wake-up latency in local mode: a C producer writes
   CLOCK_MONOTONIC into each key right before close(); a C consumer, already blocked
   in open() on that key, reads it and records now - stamp. Median and p99, next to a
   baseline run in the same invocation: the same exchange hand-written without the shim
   (temp + link + unlink; a consumer with one persistent inotify watch).

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
import time
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
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
static long long now_ns(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}
/* exchange produce|consume|rawproduce|rawconsume <dir> <n> <gap_us>
 * produce/consume: plain open/write/close and open/read, meant to run under the shim.
 * raw*: the same exchange hand-written without the shim (temp + link + unlink, and a
 * consumer with one persistent inotify watch): the baseline. */
int main(int argc, char **argv) {
    int n = atoi(argv[3]), gap = atoi(argv[4]);
    int raw = strncmp(argv[1], "raw", 3) == 0;
    int prod = argv[1][raw ? 3 : 0] == 'p';
    char path[4096], tmp[4096], pad[4096], buf[4096 + 8], ev[4096];
    memset(pad, 'p', sizeof pad);
    int ifd = -1;
    if (raw && !prod) {
        mkdir(argv[2], 0777);
        ifd = inotify_init1(IN_NONBLOCK);
        inotify_add_watch(ifd, argv[2], IN_CREATE | IN_MOVED_TO);
    }
    for (int i = 0; i < n; i++) {
        snprintf(path, sizeof path, "%s/k%06d", argv[2], i);
        if (prod) {
            usleep(gap); /* let the consumer block on this key first */
            snprintf(tmp, sizeof tmp, "%s/.k%06d.tmp", argv[2], i);
            int fd = open(raw ? tmp : path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
            if (fd < 0) { perror(path); return 1; }
            if (write(fd, pad, sizeof pad) != sizeof pad) return 1;
            long long t = now_ns();
            if (write(fd, &t, sizeof t) != sizeof t) return 1;
            if (close(fd) != 0) { perror("close"); return 1; }
            if (raw && (link(tmp, path) != 0 || unlink(tmp) != 0)) { perror("link"); return 1; }
        } else {
            if (raw) {
                struct stat st;
                while (stat(path, &st) != 0) {
                    struct pollfd p = {ifd, POLLIN, 0};
                    poll(&p, 1, -1);
                    while (read(ifd, ev, sizeof ev) > 0) {}
                }
            }
            int fd = open(path, O_RDONLY);
            if (fd < 0) { perror(path); return 1; }
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
    from instride.interception.preload import preload_path

    return preload_path()


def openclose(exe: Path, n: int, path: str, env: dict, cwd: str) -> tuple[float, float]:
    """(wall ns per open+close, user-space CPU ns per open+close) of one run."""
    proc = subprocess.Popen([str(exe), str(n), path], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, f"{exe} {path} failed"
    return float(out), usage.ru_utime * 1e9 / n


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
        print(f"open+close, N={args.n}, median of {args.reps} alternating runs, ns per "
              f"open+close: wall clock, and user-space CPU (where the shim's own work shows; "
              f"the kernel's share is the same with and without it)")
        print(f"{'case':46s} {'no shim':>8s} {'shim':>8s} {'ratio':>6s} {'+ns':>7s}"
              f" | {'user ns: no shim':>16s} {'shim':>6s} {'+ns':>6s}")
        for label, path, cwd in cases:
            without, with_ = [], []
            for _ in range(args.reps):  # alternate to share any drift
                without.append(openclose(oc, args.n, path, base, cwd))
                with_.append(openclose(oc, args.n, path, shimmed, cwd))
            a = statistics.median(w for w, _ in without)
            b = statistics.median(w for w, _ in with_)
            ua = statistics.median(u for _, u in without)
            ub = statistics.median(u for _, u in with_)
            print(f"{label:46s} {a:8.1f} {b:8.1f} {b / a:6.2f} {b - a:7.1f}"
                  f" | {ua:16.1f} {ub:6.1f} {ub - ua:6.1f}")
            print(f"  cmd: [LD_PRELOAD={lib}] INSTRIDE_DIR={managed} {oc} {args.n} {path}"
                  f"  (cwd {cwd})")

        print()
        print(f"publish -> wake-up latency, local mode, {args.keys} keys of 4 KiB each, "
              f"producer pauses {args.gap_us} us before each key (consumer already blocked)")
        print("  stamp taken before close(); latency includes the publish (link+unlink), "
              "the inotify wake-up, stat, open and read")
        print(f"{'':34s} {'median':>9s} {'p99':>9s} {'min':>9s} {'max':>9s}  (us)")
        for label, env, prefix in (("shim (plain open/close)", shimmed, ""),
                                   ("baseline: hand-written, no shim", base, "raw")):
            keys_dir = managed / f"lat-{prefix or 'shim'}"
            consumer = subprocess.Popen(
                [str(ex), prefix + "consume", str(keys_dir), str(args.keys), "0"],
                env=env, stdout=subprocess.PIPE, text=True)
            if prefix:
                time.sleep(0.2)  # the raw consumer arms its watch before the first key
            subprocess.run([str(ex), prefix + "produce", str(keys_dir), str(args.keys),
                            str(args.gap_us)], env=env, check=True)
            out, _ = consumer.communicate(timeout=600)
            assert consumer.returncode == 0
            lat = sorted(int(x) / 1000 for x in out.split())
            assert len(lat) == args.keys
            p99 = lat[min(len(lat) - 1, int(round(0.99 * len(lat))) - 1)]
            print(f"{label:34s} {statistics.median(lat):9.1f} {p99:9.1f} {lat[0]:9.1f} "
                  f"{lat[-1]:9.1f}")
            print(f"  cmd: [{'LD_PRELOAD=...' if not prefix else 'no shim'}] {ex} "
                  f"{prefix}consume|{prefix}produce {keys_dir} {args.keys} {args.gap_us}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
