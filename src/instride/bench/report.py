"""The study report: tables, figures, and our ratios beside the paper's.

:func:`write_report` turns the results of :func:`instride.bench.study.run_study` into

- ``tables/<experiment>.csv``: one row per configuration (milliseconds per frame);
- ``figures/<experiment>.png``: stacked bars of data movement and idle time (Figures 5-12);
- ``report.md``: the machine and command, every ratio the paper reports next to ours, and for
  each of the five findings whether it reproduces here and why.

Ratios are "baseline / instride" (above 1: instride is faster) unless said otherwise; an
experiment's ratio is the geometric mean over its configurations, with the range beside it.
"""

from __future__ import annotations

import csv
import math
import os
import platform
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from .figures import plot_experiment
from .molecules import get_model, paper_data

_TITLES = {
    "single_node": ("Single node, JAC: instride vs localfs (paper Fig. 5)", "pairs"),
    "two_node": ("Two nodes, JAC: instride vs sharedfs (paper Fig. 6)", "pairs"),
    "multi_node": ("Multiple nodes, JAC: instride vs sharedfs (paper Fig. 7)", "pairs / nodes"),
    "model_scaling": ("Molecular models on two nodes (paper Fig. 8)", "model"),
    "stride_scaling": ("Stride scaling on two nodes (paper Figs. 11-12)", "stride"),
}
_TABLE_COLS = (
    "experiment", "group", "x", "backend", "model", "atoms", "stride", "pairs", "nodes", "frames",
    "repetitions", "time_scale", "producer_movement_ms", "producer_idle_ms",
    "producer_movement_std_ms", "consumer_movement_ms", "consumer_idle_ms",
    "consumer_idle_steady_ms", "consumer_movement_std_ms", "consumer_overall_ms",
    "consumer_fetch_ms", "consumer_read_ms", "frames_verified", "frames_expected",
    "sharedfs_mount", "frame_period_ms",
)


def _row(result: dict[str, Any]) -> dict[str, Any]:
    s = result["summary"]
    cfg = s["config"]
    prod, cons = s["producer"], s["consumer"]
    regions = cons.get("regions", {})
    return {
        "experiment": result["experiment"], "group": result["group"], "x": result["x"],
        "backend": cfg["backend"], "model": cfg["model_name"], "atoms": cfg["atoms"],
        "stride": cfg["stride"], "pairs": cfg["pairs"], "nodes": cfg["nodes"],
        "frames": cfg["frames"], "repetitions": cfg["repetitions"],
        "time_scale": cfg["time_scale"],
        "producer_movement_ms": 1e3 * prod["movement_s"],
        "producer_idle_ms": 1e3 * prod["idle_s"],
        "producer_movement_std_ms": 1e3 * prod["movement_s_std"],
        "consumer_movement_ms": 1e3 * cons["movement_s"],
        "consumer_idle_ms": 1e3 * cons["idle_s"],
        "consumer_idle_steady_ms": 1e3 * cons["idle_steady_s"],
        "consumer_movement_std_ms": 1e3 * cons["movement_s_std"],
        "consumer_overall_ms": 1e3 * cons["overall_s"],
        "consumer_fetch_ms": 1e3 * regions.get("consume.fetch", {}).get("mean_s", 0.0),
        "consumer_read_ms": 1e3 * regions.get("consume.read", {}).get("mean_s", 0.0),
        "frames_verified": s["frames"]["verified"],
        "frames_expected": s["frames"]["expected"],
        "sharedfs_mount": cfg.get("sharedfs_mount") or "",
        "frame_period_ms": 1e3 * cfg["frame_period_s"],
    }


def _gmean(values: list[float]) -> float:
    vals = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return "n/a"
    return f"{v:.2f}" if v < 10 else f"{v:.1f}"


def _rng(values: list[float]) -> str:
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return "n/a"
    return f"{_fmt(min(vals))}–{_fmt(max(vals))}"


def _paper(value: Any) -> str:
    if isinstance(value, list):
        return f"{_fmt(value[0])}–{_fmt(value[1])}×"
    return f"{_fmt(float(value))}×"


def _pairs(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, dict[str, Any]]]:
    """(group, x) -> backend -> row."""
    out: dict[tuple[str, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        out[(r["group"], r["x"])][r["backend"]] = r
    return out


def _ratios(rows: list[dict[str, Any]], baseline: str, group: str | None = None
            ) -> dict[str, list[float]]:
    """Per-configuration ratios baseline/instride of the paper's metrics."""
    out: dict[str, list[float]] = defaultdict(list)
    for (g, _x), by in _pairs(rows).items():
        if group is not None and g != group:
            continue
        if "instride" not in by or baseline not in by:
            continue
        a, b = by["instride"], by[baseline]
        for metric in ("producer_movement_ms", "consumer_movement_ms", "consumer_overall_ms",
                       "consumer_idle_ms"):
            out[metric].append(b[metric] / a[metric] if a[metric] > 0 else float("inf"))
        out["instride_slowdown_producer"].append(
            a["producer_movement_ms"] / b["producer_movement_ms"]
            if b["producer_movement_ms"] > 0 else float("nan"))
        out["instride_slowdown_consumer"].append(
            a["consumer_movement_ms"] / b["consumer_movement_ms"]
            if b["consumer_movement_ms"] > 0 else float("nan"))
    return out


def sharedfs_kind(study: dict[str, Any]) -> str:
    """What the study's multi-node ``sharedfs`` was: ``"sshfs"``, ``"dir"``, ``"mixed"`` or ``""``.

    Studies written before sshfs existed record no kind: their ``sharedfs`` was a directory.
    """
    kinds = {r["summary"]["config"].get("sharedfs_mount") or "dir" for r in study["results"]
             if r["summary"]["config"]["backend"] == "sharedfs"
             and r["summary"]["config"]["nodes"] > 1}
    if not kinds:
        return ""
    return kinds.pop() if len(kinds) == 1 else "mixed"


def machine_info() -> dict[str, str]:
    """Cores, memory, CPU, kernel, Python and MPI of this machine."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    mpi = ""
    exe = Path(sys.executable).parent / "mpichversion"
    if exe.exists():
        out = subprocess.run([str(exe)], capture_output=True, text=True).stdout.splitlines()
        mpi = " ".join(line.split(":", 1)[1].strip() for line in out[:1] + out[3:4])
    return {
        "cores": str(os.cpu_count()), "memory": mem, "cpu": cpu,
        "kernel": platform.release(), "os": platform.platform(),
        "python": platform.python_version(), "mpi": f"MPICH {mpi}".strip(),
    }


def _table_md(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| x | backend | prod. movement | prod. idle | cons. movement | cons. idle "
        "| cons. overall | frames ok |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        x = f"{r['group']} {r['x']}".strip()
        lines.append(
            f"| {x} | {r['backend']} | {r['producer_movement_ms']:.3f} | "
            f"{r['producer_idle_ms']:.3f} | {r['consumer_movement_ms']:.3f} | "
            f"{r['consumer_idle_ms']:.3f} | {r['consumer_overall_ms']:.3f} | "
            f"{r['frames_verified']}/{r['frames_expected']} |"
        )
    return lines


def _verdict(ok: bool, partly: bool = False) -> str:
    if ok:
        return "**reproduces**"
    return "**partly reproduces**" if partly else "**does not reproduce**"


def write_report(study: dict[str, Any], out: str | Path) -> Path:
    """Write tables, figures and ``report.md`` for ``study`` under ``out``; return report.md."""
    outp = Path(out)
    (outp / "tables").mkdir(parents=True, exist_ok=True)
    paper = paper_data()["paper_results"]
    rows_by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for result in study["results"]:
        rows_by[result["experiment"]].append(_row(result))
    for exp, rows in rows_by.items():
        with open(outp / "tables" / f"{exp}.csv", "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=_TABLE_COLS)
            writer.writeheader()
            for r in rows:
                writer.writerow(
                    {k: (f"{v:.6f}" if isinstance(v, float) else v) for k, v in r.items()}
                )
        title, xlabel = _TITLES[exp]
        groups = sorted({r["group"] for r in rows})
        for group in groups:
            sub = [r for r in rows if r["group"] == group]
            name = exp if not group else f"{exp}_{group}"
            plot_experiment(sub, f"{title}{' — ' + group if group else ''}",
                            outp / "figures" / f"{name}.png", xlabel=xlabel)

    preset = study["preset"]
    info = machine_info()
    kind = sharedfs_kind(study)
    if kind == "sshfs":
        emulated = (
            "What is emulated here: nodes are network namespaces on one 2-core machine "
            "(instride cluster mode moves frames over veth/TCP between per-node data servers, "
            "with Redis metadata). `localfs` (XFS in the paper) is a plain directory on tmpfs. "
            "`sharedfs` (Lustre) is a real network file system: a storage server (its own "
            "namespace on the cluster's bridge, running sshd, exporting a tmpfs directory) that "
            "every node mounts with sshfs (FUSE + SFTP over one ssh connection per node, "
            "through the node's veth), with no attribute or directory caching; every byte a "
            "producer writes and a consumer reads crosses the emulated network and a server "
            "process, as with Lustre, but over one encrypted, mostly single-threaded ssh "
            "stream per node rather than Lustre's parallel RPCs to many servers. MPI barriers "
            "between emulated nodes still go through shared memory. All ranks, servers and "
            "FUSE daemons share 2 cores."
        )
        shared_desc = ("Here sharedfs is a storage server mounted with sshfs: every frame "
                       "crosses the emulated network twice (producer → server → consumer)")
    else:
        emulated = (
            "What is emulated here: nodes are network namespaces on one 2-core machine "
            "(instride cluster mode moves frames over veth/TCP between per-node data servers, "
            "with Redis metadata); `localfs` (XFS in the paper) and `sharedfs` (Lustre) are "
            "plain directories on tmpfs — a shared directory costs nothing to reach, so "
            "`sharedfs` models Lustre's synchronization, not its network data movement. MPI "
            "barriers between emulated nodes still go through shared memory. All ranks share "
            "2 cores."
        )
        shared_desc = ("Here sharedfs is a tmpfs directory every namespace sees: its "
                       "\"network\" costs nothing")
    md: list[str] = [
        "# instride reproduction of the DYAD data-movement study",
        "",
        f"Command: `{study.get('command') or '(library call)'}`",
        "",
        f"Machine: {info['cores']} cores ({info['cpu']}), {info['memory']} RAM, Linux "
        f"{info['kernel']}, Python {info['python']}, {info['mpi']}. Shared with other "
        "workloads while running; expect ±20–30 % noise.",
        "",
        f"Preset `{preset['name']}`: {preset['frames']} frames per pair (paper: 128), "
        f"{preset['repetitions']} repetition(s) (paper: 10), MD and analytics sleeps scaled by "
        f"{preset['time_scale']} (a frame every {0.82 * preset['time_scale'] * 1e3:.0f} ms instead "
        f"of 820 ms), ensemble sizes {list(preset['single_node_pairs'])} (one node), "
        f"{list(preset['two_node_pairs'])} (two nodes), nodes {list(preset['multi_node_nodes'])} "
        f"with {preset['pairs_per_producer_node']} pair(s) per producer node, "
        f"{preset['model_pairs']} pairs for model scaling and {preset['stride_pairs']} for stride "
        f"scaling (paper: 16). Wall time of the study: {study['elapsed_s'] / 60:.1f} min.",
        "",
        "Times are per frame and per rank, averaged over ranks and repetitions, in milliseconds. "
        "Data movement = write + close (publication included) for producers; wait-free "
        "fetch + open + read + deserialize (checksums verified) for consumers. Idle = the "
        "pairwise MPI barrier (file systems) or the wait for publication (instride). Ratios are "
        "baseline / instride (above 1: instride faster); an experiment's ratio is the geometric "
        "mean over its configurations, its range in parentheses.",
        "",
        emulated,
        "",
    ]
    verdicts: list[str] = []

    def ratio_line(label: str, paper_value: Any, values: list[float], unit: str = "×") -> str:
        return (f"- {label}: paper {_paper(paper_value)}; here {_fmt(_gmean(values))}{unit} "
                f"({_rng(values)})")

    def sharedfs_lines(p: dict[str, Any], r: dict[str, list[float]]) -> list[str]:
        """The three instride-vs-sharedfs ratios (producer, consumer, overall) beside the paper's."""
        return [
            ratio_line("producer data movement, instride faster than sharedfs by",
                       p["producer_movement_speedup_vs_sharedfs"], r["producer_movement_ms"]),
            ratio_line("consumer data movement, instride faster than sharedfs by",
                       p["consumer_movement_speedup_vs_sharedfs"], r["consumer_movement_ms"]),
            ratio_line("consumption overall, instride faster than sharedfs by",
                       p["consumer_overall_speedup_vs_sharedfs"], r["consumer_overall_ms"]),
        ]

    # -------------------------------------------------------------- single node
    if "single_node" in rows_by:
        rows = rows_by["single_node"]
        r = _ratios(rows, "localfs")
        p = paper["single_node"]
        md += ["## 1. Single node: instride vs localfs (paper Fig. 5)", "",
               "![single node](figures/single_node.png)", "", *_table_md(rows), "",
               ratio_line("producer data movement, instride slower than localfs by",
                          p["producer_movement_slowdown_vs_localfs"],
                          r["instride_slowdown_producer"]),
               ratio_line("consumer data movement, instride slower than localfs by",
                          p["consumer_movement_slowdown_vs_localfs"],
                          r["instride_slowdown_consumer"]),
               ratio_line("single-node consumption overall, instride faster than localfs by",
                          p["consumer_overall_speedup_vs_localfs"], r["consumer_overall_ms"]),
               ""]
        overall = _gmean(r["consumer_overall_ms"])
        inst = [x for x in rows if x["backend"] == "instride"]
        base = [x for x in rows if x["backend"] == "localfs"]
        pidle = sum(x["producer_idle_ms"] for x in base) / max(len(base), 1)
        ci = sum(x["consumer_idle_steady_ms"] for x in inst) / max(len(inst), 1)
        cb = sum(x["consumer_idle_steady_ms"] for x in base) / max(len(base), 1)
        ok = overall >= 2
        pslow = _gmean(r["instride_slowdown_producer"])
        idle_note = (
            f"after the first frame the instride consumer idles {ci:.3f} ms/frame waiting for "
            f"publication and the localfs consumer {cb:.3f} ms/frame in its barrier "
            f"({cb - ci:+.3f} ms)"
        )
        verdicts.append(
            f"1. *Adaptive synchronization pays on one node despite slower production* — "
            f"{_verdict(ok, overall > 1.1 and pslow >= 1)}. instride's producer pays "
            f"{_fmt(pslow)}× the plain write for publication (write to a hidden name, link to "
            f"the key; paper: 1.4×) and never waits, while the localfs producer idles "
            f"{pidle:.3f} ms/frame in the barrier. Consumption overall differs by "
            f"{_fmt(overall)}× (paper: 192.9×); {idle_note}. In this emulation both consumers "
            f"are paced by the same producer: it sleeps one frame period and then serializes "
            f"and writes, while the consumer's analytics sleep is exactly one frame period, so "
            f"every consumer waits for roughly the producer's serialize + write time each frame, "
            f"whichever backend it uses, and the barrier only adds its own small cost on top. "
            f"A barrier through MPICH shared memory (polled every "
            f"50 µs) is cheap; the paper's XFS consumers lost most of a frame period per "
            f"barrier, which is where its 192.9× came from, and that cost does not appear here."
        )

    # -------------------------------------------------------------- two nodes
    if "two_node" in rows_by:
        rows = rows_by["two_node"]
        r = _ratios(rows, "sharedfs")
        p = paper["two_node"]
        md += ["## 2. Two nodes: instride vs sharedfs (paper Fig. 6)", "",
               "![two nodes](figures/two_node.png)", "", *_table_md(rows), "",
               *sharedfs_lines(p, r),
               ""]
        one = {x["pairs"]: x for x in rows_by.get("single_node", []) if x["backend"] == "instride"}
        two = {x["pairs"]: x for x in rows if x["backend"] == "instride"}
        common = sorted(set(one) & set(two))
        growth = [two[k]["consumer_overall_ms"] / one[k]["consumer_overall_ms"] for k in common
                  if one[k]["consumer_overall_ms"] > 0]
        fetch = [two[k]["consumer_fetch_ms"] for k in common]
        if growth:
            g = _gmean(growth)
            md.append(f"- instride two nodes / one node, consumption overall at the same pairs "
                      f"({common}): {_fmt(g)}× ({_rng(growth)})")
            md.append("")
            verdicts.append(
                f"2. *Network data movement between two nodes has little effect* — "
                f"{_verdict(g <= 1.5, g <= 3)}. Going from one node to two, instride's "
                f"consumption time per frame changes by {_fmt(g)}×; the cross-node fetch "
                f"(Redis lookup + TCP transfer from the producer's data server + local store, "
                f"checksum verified) costs {_fmt(sum(fetch) / len(fetch))} ms/frame on average, "
                f"where the paper's RDMA transfer was nearly free."
            )
        else:
            verdicts.append("2. *Network has little effect* — not evaluated (needs the "
                            "single_node and two_node experiments).")

    # -------------------------------------------------------------- multi node
    if "multi_node" in rows_by:
        rows = rows_by["multi_node"]
        r = _ratios(rows, "sharedfs")
        p = paper["multi_node"]
        md += ["## 3. Multiple nodes: instride vs sharedfs (paper Fig. 7)", "",
               "![multi node](figures/multi_node.png)", "", *_table_md(rows), "",
               *sharedfs_lines(p, r),
               ""]
        pm, cm, co = (_gmean(r[k]) for k in ("producer_movement_ms", "consumer_movement_ms",
                                              "consumer_overall_ms"))
        verdicts.append(
            f"3. *Optimizing both data movement and synchronization matters at scale* — "
            f"{_verdict(pm > 1 and cm > 1 and co > 1, co > 1 or pm > 1)}. Across "
            f"{len(r['consumer_overall_ms'])} node counts instride is {_fmt(pm)}× / {_fmt(cm)}× "
            f"faster than sharedfs in producer / consumer data movement and {_fmt(co)}× in "
            f"overall consumption (below 1 = slower). {shared_desc}; instride's producer "
            f"writes locally and publishes a Redis "
            f"record, its consumer fetches the frame once over TCP from the producer's node"
            + ("." if kind == "sshfs" else
               ", so it cannot win on consumer data movement, unlike against Lustre.")
        )

    # -------------------------------------------------------------- models
    if "model_scaling" in rows_by:
        rows = rows_by["model_scaling"]
        r = _ratios(rows, "sharedfs")
        p = paper["model_scaling"]
        md += ["## 4. Molecular model scaling on two nodes (paper Fig. 8)", "",
               "![models](figures/model_scaling.png)", "", *_table_md(rows), "",
               *sharedfs_lines(p, r)]
        by = {(x["model"], x["backend"]): x for x in rows}
        data_growth = get_model("STMV").frame_bytes() / get_model("JAC").frame_bytes()
        growth = {}
        for backend in ("instride", "sharedfs"):
            a, b = by.get(("JAC", backend)), by.get(("STMV", backend))
            if a and b and a["consumer_movement_ms"] > 0:
                growth[backend] = b["consumer_movement_ms"] / a["consumer_movement_ms"]
        md.append(f"- data per frame grows JAC → STMV by: paper {p['data_growth_jac_to_stmv']}×; "
                  f"here {data_growth:.1f}×")
        if growth:
            md.append(f"- instride consumer data movement grows JAC → STMV by: paper "
                      f"{p['instride_movement_growth_jac_to_stmv']}×; here "
                      f"{_fmt(growth.get('instride', float('nan')))}×")
            md.append(f"- sharedfs consumer data movement grows JAC → STMV by: paper "
                      f"{p['sharedfs_movement_growth_jac_to_stmv']}×; here "
                      f"{_fmt(growth.get('sharedfs', float('nan')))}×")
        md.append("")
        cons = r["consumer_movement_ms"]
        widening = len(cons) >= 2 and cons[-1] > cons[0]
        sub_linear = growth.get("instride", float("inf")) < data_growth
        wins = bool(cons) and cons[-1] > 1
        outcome = ("wins for every model" if cons and all(c > 1 for c in cons) else
                   "wins for the largest model" if wins else "still loses in absolute terms")
        amortize = (
            "Large frames amortize instride's per-frame costs (Redis record, connection, "
            "checksum), so its relative position improves with size"
            if sub_linear else
            f"instride's own data movement grows faster than the data here, so the widening "
            f"comes from sharedfs growing faster still "
            f"({_fmt(growth.get('sharedfs', float('nan')))}×)"
        )
        verdicts.append(
            f"4. *Local resources and efficient communication scale better with data size* — "
            f"{_verdict(widening and sub_linear and wins, widening or sub_linear)}. "
            f"instride's consumer data movement grows "
            f"{_fmt(growth.get('instride', float('nan')))}× from JAC to STMV "
            f"for {data_growth:.1f}× more data (paper: 33.6× for 45.3×), and its ratio to "
            f"sharedfs goes from {_fmt(cons[0]) if cons else 'n/a'} (JAC) to "
            f"{_fmt(cons[-1]) if cons else 'n/a'} (STMV) (paper: 1.6 → 6.0). {amortize}"
            + (f"; against the sshfs storage server instride {outcome}."
               if kind == "sshfs" else
               f"; but against a shared directory that costs nothing to reach, the cross-node "
               f"copy is pure overhead, so instride {outcome}.")
        )

    # -------------------------------------------------------------- strides
    if "stride_scaling" in rows_by:
        rows = rows_by["stride_scaling"]
        p = paper["stride_scaling"]
        md += ["## 5. Stride scaling on two nodes (paper Figs. 11 and 12)", ""]
        for group in sorted({x["group"] for x in rows}):
            md += [f"![strides {group}](figures/stride_scaling_{group}.png)", ""]
        md += [*_table_md(rows), ""]
        rj = _ratios(rows, "sharedfs", "JAC")
        rs = _ratios(rows, "sharedfs", "STMV")
        md += [
            ratio_line("JAC producer data movement, instride faster than sharedfs by",
                       p["jac_producer_movement_speedup_vs_sharedfs"], rj["producer_movement_ms"]),
            ratio_line("JAC consumer data movement, instride faster than sharedfs by",
                       p["jac_consumer_movement_speedup_vs_sharedfs"], rj["consumer_movement_ms"]),
            ratio_line("STMV producer data movement, instride faster than sharedfs by",
                       p["stmv_producer_movement_speedup_vs_sharedfs"], rs["producer_movement_ms"]),
            ratio_line("STMV consumption overall, instride faster than sharedfs by",
                       p["stmv_consumer_overall_speedup_vs_sharedfs"], rs["consumer_overall_ms"]),
            "",
        ]
        trend = []
        for group in sorted({x["group"] for x in rows}):
            sub = sorted((x for x in rows if x["group"] == group), key=lambda x: x["stride"])
            ins = [x for x in sub if x["backend"] == "instride"]
            shf = [x for x in sub if x["backend"] == "sharedfs"]
            if len(ins) >= 2 and len(shf) >= 2:
                d_ins = ins[-1]["consumer_idle_ms"] - ins[0]["consumer_idle_ms"]
                d_shf = shf[-1]["consumer_idle_ms"] - shf[0]["consumer_idle_ms"]
                ratio_first = shf[0]["consumer_overall_ms"] / ins[0]["consumer_overall_ms"]
                ratio_last = shf[-1]["consumer_overall_ms"] / ins[-1]["consumer_overall_ms"]
                trend.append((group, d_ins, d_shf, ratio_first, ratio_last,
                              ins[0]["stride"], ins[-1]["stride"]))
                md.append(
                    f"- {group}: consumer idle grows from stride {ins[0]['stride']} to "
                    f"{ins[-1]['stride']} by {d_ins:+.3f} ms (instride) vs {d_shf:+.3f} ms "
                    f"(sharedfs); overall sharedfs/instride {_fmt(ratio_first)}× → "
                    f"{_fmt(ratio_last)}×"
                )
        md.append("")
        # the finding's signature: the barrier's idle time grows with the stride (more than
        # instride's wait does) and instride's overall advantage widens with it
        shows = [t[4] > 1.1 * t[3] and t[2] > 0 and t[2] > t[1] for t in trend]
        ok = bool(trend) and all(shows) and all(t[4] > 1 for t in trend)
        partly = any(shows)
        detail = "; ".join(
            f"{g}: overall ratio {_fmt(a)}× → {_fmt(b)}× from stride {s0} to {s1}, idle growth "
            f"{di:+.2f} ms instride vs {ds:+.2f} ms sharedfs"
            for g, di, ds, a, b, s0, s1 in trend
        )
        bound = []  # groups whose every frame period is shorter than sharedfs's movement
        for group in sorted({x["group"] for x in rows}):
            shf = [x for x in rows if x["group"] == group and x["backend"] == "sharedfs"]
            if shf and all(x["frame_period_ms"] < x["consumer_movement_ms"] for x in shf):
                bound.append(
                    f"{group}: frame periods {min(x['frame_period_ms'] for x in shf):.1f}–"
                    f"{max(x['frame_period_ms'] for x in shf):.1f} ms vs sharedfs consumer data "
                    f"movement {min(x['consumer_movement_ms'] for x in shf):.1f}–"
                    f"{max(x['consumer_movement_ms'] for x in shf):.1f} ms")
        bound_note = (
            f" Here every stride's frame period is shorter than one sharedfs transfer "
            f"({'; '.join(bound)}): the runs are bound by data movement, not by the frame "
            f"period, so the stride cannot show in the barrier's idle time."
            if bound else ""
        )
        verdicts.append(
            f"5. *Minimizing synchronization matters more as frames get rarer* — "
            f"{_verdict(ok, partly)}. {detail}. With a barrier, the producer and consumer "
            f"lock-step every frame, so the idle time scales with the frame period; instride's "
            f"consumer only waits for what is not yet published.{bound_note}"
        )

    md += ["## The five findings, here", "", *[v + "\n" for v in verdicts]]
    md += [
        "## Files",
        "",
        "- `tables/<experiment>.csv`: one row per configuration (ms per frame).",
        "- `figures/<experiment>.png`: stacked bars (data movement red `//`, idle blue `\\\\`).",
        "- `runs/<experiment>/<configuration>/`: `timings.csv` (one row per repetition × rank × "
        "frame × region), `ranks.csv`, `summary.json`, and the raw per-rank files.",
        "- `study.json`: every summary.",
        "",
    ]
    path = outp / "report.md"
    path.write_text("\n".join(md))
    return path


__all__ = ["machine_info", "sharedfs_kind", "write_report"]
