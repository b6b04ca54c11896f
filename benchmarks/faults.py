"""The full fault-injection and fuzzing run, with figures.

Runs every case of the fault suite (``tests/faults/``) with the trial counts of the
reliability issue — producer SIGKILLed at random points of a write (200 trials), the wire
protocol fuzzed (100,000 messages), frame headers fuzzed (200,000), and so on — on real
processes, servers, Redis and network namespaces. For each case it reports trials, frames
lost, frames corrupted, hangs and the typed errors or recoveries observed, writes
``benchmarks/results/faults.json`` and ``faults.md`` (the table of docs/reliability.md), and
draws ``docs/figures/faults_summary.png`` (trials and failures per case) and
``docs/figures/faults_outcomes.png`` (a bar chart of observed outcomes per case).

There is no speed baseline here: the figure of merit is the count of lost, corrupted and hung
frames, which must be zero; wall time per case is reported for planning.

Needs root (a tmpfs mount, network namespaces) and redis-server, like the emulated-node tests.

Usage:  python benchmarks/faults.py [--scale 1.0] [--only NAME ...] [--list]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from tests.faults import cluster_cases as C  # noqa: E402
from tests.faults import local_cases as L  # noqa: E402
from tests.faults import netns_cases as N  # noqa: E402
from tests.faults.harness import CaseResult  # noqa: E402

from common import header, save  # noqa: E402

#: name -> (function, full trial count, how to run it alone)
CASES: dict[str, tuple[Callable[[Path, int], CaseResult], int]] = {
    "sigkill": (L.case_producer_sigkill, 200),
    "server-kill": (C.case_server_killed, 20),
    "redis-restart": (C.case_redis_restart, 10),
    "partition": (N.case_partition, 10),
    "enospc": (L.case_enospc, 20),
    "bitflip": (C.case_bitflip, 40),
    "waiters": (L.case_many_waiters, 3),
    "slow-consumer": (L.case_slow_consumer, 3),
    "stalled-peer": (C.case_stalled_peer, 3),
    "tokens": (C.case_tokens, 10),
    "wire-fuzz": (C.case_wire_fuzz, 100_000),
    "frame-fuzz": (L.case_frame_fuzz, 200_000),
    "paths-local": (L.case_paths_local, 3),
    "paths-cluster": (C.case_paths_cluster, 3),
}
#: the pytest check of each case (its lean version)
TEST = {
    "sigkill": "test_producer_sigkilled_mid_write", "server-kill": "test_data_server_killed_mid_transfer",
    "redis-restart": "test_redis_restarted_mid_run", "partition": "test_network_partition",
    "enospc": "test_enospc_on_a_small_tmpfs", "bitflip": "test_bit_flip_in_a_staged_frame",
    "waiters": "test_thousand_waiters_on_one_key", "slow-consumer": "test_slow_stream_consumer",
    "stalled-peer": "test_stalled_peer", "tokens": "test_wrong_missing_and_replayed_tokens",
    "wire-fuzz": "test_wire_protocol_fuzzed", "frame-fuzz": "test_frame_headers_fuzzed",
    "paths-local": "test_paths_and_symlinks_local_interfaces",
    "paths-cluster": "test_paths_and_symlinks_data_server",
}


def markdown(results: dict[str, CaseResult]) -> str:
    rows = ["| case | trials | lost | corrupted | hangs | typed error / recovery observed (count) "
            "| run it |", "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for name, r in results.items():
        seen = "; ".join(f"{k} ({v:,})" for k, v in r.outcomes.most_common())
        rows.append(f"| {r.name} | {r.trials:,} | {r.lost} | {r.corrupted} | {r.hangs} | {seen} | "
                    f"`benchmarks/faults.py --only {name}`; "
                    f"`pytest tests/faults -k {TEST[name]}` |")
    return "\n".join(rows) + "\n"


def figures(results: dict[str, CaseResult], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    names = list(results)
    rs = [results[n] for n in names]
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rs) + 1.5))
    y = range(len(rs))
    ax.barh(y, [r.trials for r in rs], color="#4c72b0", label="trials")
    bad = [r.lost + r.corrupted + r.hangs for r in rs]
    ax.barh(y, [max(b, 0) for b in bad], color="#c44e52", label="lost + corrupted + hangs")
    for i, r in enumerate(rs):
        ax.text(r.trials * 1.1, i, f"{r.trials:,} trials · {r.lost} lost · {r.corrupted} "
                f"corrupted · {r.hangs} hangs", va="center", fontsize=8)
    ax.set_yticks(list(y), [r.name for r in rs], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(0.7, max(r.trials for r in rs) * 5000)
    ax.invert_yaxis()
    ax.set_xlabel("trials (log scale)")
    total_bad = sum(bad)
    ax.set_title("instride fault injection and fuzzing: trials per case, and failures "
                 f"({'none' if total_bad == 0 else total_bad})")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    summary = out / "faults_summary.png"
    fig.savefig(summary, dpi=120)
    plt.close(fig)

    cols = 2
    rows = (len(rs) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(16, 3.2 * rows), layout="constrained")
    for ax, r in zip(axes.flat, rs, strict=False):
        items = r.outcomes.most_common(6)
        # each outcome in full, wrapped (the table in docs/reliability.md has the same text)
        labels = [textwrap.fill(k, 60) for k, _ in items]
        ax.barh(range(len(items)), [v for _, v in items], color="#55a868")
        ax.set_yticks(range(len(items)), labels, fontsize=6.5)
        ax.invert_yaxis()
        ax.set_title(f"{r.name}\n{r.trials:,} trials, {r.lost} lost, {r.corrupted} corrupted, "
                     f"{r.hangs} hangs", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    for ax in list(axes.flat)[len(rs):]:
        ax.axis("off")
    fig.suptitle("What each injected fault led to (counts of observed outcomes)", fontsize=10)
    outcomes = out / "faults_outcomes.png"
    fig.savefig(outcomes, dpi=110)
    plt.close(fig)
    return [summary, outcomes]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0,
                    help="multiply every trial count (0.05 for a quick look)")
    ap.add_argument("--only", nargs="+", choices=sorted(CASES), help="run only these cases")
    ap.add_argument("--figures", default=str(ROOT / "docs" / "figures"),
                    help="directory of the PNG figures (default docs/figures)")
    ap.add_argument("--list", action="store_true", help="list the cases and their trial counts")
    ap.add_argument("--replot", action="store_true",
                    help="redraw the figures and table from benchmarks/results/faults.json")
    args = ap.parse_args()
    if args.list:
        for name, (fn, n) in CASES.items():
            print(f"{name:14} {n:>8,}  {fn.__doc__.strip().splitlines()[0]}")
        return 0
    if args.replot:
        saved = json.loads((ROOT / "benchmarks" / "results" / "faults.json").read_text())
        results = {}
        for name, d in saved["cases"].items():
            r = CaseResult(d["name"], d["trials"], d["lost"], d["corrupted"], d["hangs"],
                           Counter(d["outcomes"]), d["notes"], d["seconds"])
            results[name] = r
        for path in figures(results, Path(args.figures)):
            print(f"wrote {path}")
        return 0
    machine = header("fault injection and fuzzing (benchmarks/faults.py)")
    names = args.only or list(CASES)
    results: dict[str, CaseResult] = {}
    with tempfile.TemporaryDirectory(prefix="irl-faults-") as tmp:
        for name in names:
            fn, full = CASES[name]
            trials = max(1, round(full * args.scale))
            work = Path(tmp) / name
            work.mkdir()
            t0 = time.monotonic()
            print(f"\n## {name}: {trials:,} trials", flush=True)
            res = fn(work, trials)
            res.seconds = time.monotonic() - t0
            results[name] = res
            print(f"{res.trials:,} trials, {res.lost} lost, {res.corrupted} corrupted, "
                  f"{res.hangs} hangs, {res.seconds:.1f} s", flush=True)
            for outcome, count in res.outcomes.most_common():
                print(f"   {count:>8,}  {outcome}")
            for note in res.notes:
                print(f"   note: {note}")
    table = markdown(results)
    print("\n" + table)
    ok = all(r.ok for r in results.values())
    save("faults", {"machine": machine, "scale": args.scale, "ok": ok,
                    "cases": {n: r.as_dict() for n, r in results.items()}})
    (ROOT / "benchmarks" / "results" / "faults.md").write_text(table)
    for path in figures(results, Path(args.figures)):
        print(f"wrote {path}")
    print("all cases: 0 lost, 0 corrupted, 0 hangs" if ok else "FAILURES: see the table above")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
