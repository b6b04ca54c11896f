"""Turning the ranks' timing rows into a tidy table and a summary.

``timings.csv`` has one row per repetition x rank x frame x region with the columns
``rep, rank, role, pair, node, frame, region, category, start_s, duration_s``. The summary
(``summary.json``) gives, for each role (``producer``, ``consumer``), the paper's two
components per frame — ``movement_s`` (data movement) and ``idle_s`` (synchronization) — plus
their sum ``overall_s``, the MD / analytics ``compute_s``, the idle time without the first frame
(``idle_steady_s``), standard deviations over repetitions, and every region's mean.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from .timers import CATEGORY

ROLES = ("producer", "consumer")
_COLUMNS = ("rep", "rank", "role", "pair", "node", "frame", "region", "category", "start_s",
            "duration_s")


def expected_regions(backend: str, role: str) -> tuple[str, ...]:
    """The regions every frame of a ``role`` rank records with ``backend``."""
    if role == "producer":
        base = ("produce.md", "produce.serialize", "produce.write")
        return base if backend == "instride" else (*base, "produce.sync")
    if backend == "instride":
        return ("consume.wait", "consume.fetch", "consume.store", "consume.read",
                "consume.analytics")
    return ("consume.sync", "consume.read", "consume.analytics")


def merge_repetition(raw: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Read the per-rank files of one repetition: (timing rows, rank facts)."""
    timings: list[dict[str, Any]] = []
    ranks: list[dict[str, Any]] = []
    for path in sorted(raw.glob("rank*.json")):
        ranks.append(json.loads(path.read_text()))
    for path in sorted(raw.glob("rank*.csv")):
        with open(path, newline="") as fh:
            for row in csv.DictReader(fh):
                timings.append({
                    "rep": int(row["rep"]), "rank": int(row["rank"]), "role": row["role"],
                    "pair": int(row["pair"]), "node": row["node"], "frame": int(row["frame"]),
                    "region": row["region"], "category": row["category"],
                    "start_s": float(row["start_s"]), "duration_s": float(row["duration_s"]),
                })
    return timings, ranks


def _role_summary(rows: list[dict[str, Any]], facts: list[dict[str, Any]], frames: int
                  ) -> dict[str, Any]:
    per_rank: dict[tuple[int, int], dict[str, float]] = defaultdict(
        lambda: {"movement": 0.0, "idle": 0.0, "compute": 0.0, "idle_first": 0.0}
    )
    regions: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        acc = per_rank[(row["rep"], row["rank"])]
        acc[row["category"]] += row["duration_s"]
        if row["category"] == "idle" and row["frame"] == 0:
            acc["idle_first"] += row["duration_s"]
        regions[row["region"]].append(row["duration_s"])
    if not per_rank:
        return {}
    reps = sorted({rep for rep, _ in per_rank})

    def per_frame(key: str) -> tuple[float, float]:
        by_rep = [np.mean([v[key] for (r, _), v in per_rank.items() if r == rep]) / frames
                  for rep in reps]
        return float(np.mean(by_rep)), float(np.std(by_rep))

    movement, movement_std = per_frame("movement")
    idle, idle_std = per_frame("idle")
    compute, _ = per_frame("compute")
    steady = [(v["idle"] - v["idle_first"]) / max(frames - 1, 1) for v in per_rank.values()]
    walls = [f["wall_s"] for f in facts]
    return {
        "movement_s": movement,
        "idle_s": idle,
        "overall_s": movement + idle,
        "compute_s": compute,
        "movement_s_std": movement_std,
        "idle_s_std": idle_std,
        "idle_first_s": float(np.mean([v["idle_first"] for v in per_rank.values()])),
        "idle_steady_s": float(np.mean(steady)),
        "movement_total_s": float(np.mean([v["movement"] for v in per_rank.values()])),
        "idle_total_s": float(np.mean([v["idle"] for v in per_rank.values()])),
        "wall_s": float(np.mean(walls)) if walls else 0.0,
        "ranks": len(per_rank),
        "regions": {
            name: {"mean_s": float(np.mean(vals)), "median_s": float(np.median(vals)),
                   "max_s": float(np.max(vals)), "count": len(vals)}
            for name, vals in sorted(regions.items())
        },
    }


def summarize(timings: list[dict[str, Any]], ranks: list[dict[str, Any]], config: dict[str, Any]
              ) -> dict[str, Any]:
    """The JSON summary of one configuration (all repetitions)."""
    frames = int(config["frames"])
    out: dict[str, Any] = {"config": config}
    for role in ROLES:
        rows = [r for r in timings if r["role"] == role]
        facts = [f for f in ranks if f["role"] == role]
        out[role] = _role_summary(rows, facts, frames)
    expected = int(config["repetitions"]) * int(config["pairs"]) * frames
    out["frames"] = {
        "expected": expected,
        "verified": int(sum(f["frames_verified"] for f in ranks if f["role"] == "consumer")),
    }
    out["categories"] = sorted(set(CATEGORY.values()))
    return out


def write_tables(out: Path, timings: list[dict[str, Any]], ranks: list[dict[str, Any]],
                 summary: dict[str, Any]) -> None:
    """Write ``timings.csv``, ``ranks.csv`` and ``summary.json`` under ``out``."""
    with open(out / "timings.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=_COLUMNS)
        writer.writeheader()
        writer.writerows(timings)
    rank_cols = ("rep", "rank", "role", "pair", "node", "wall_s", "frames_verified",
                 "bytes_written", "mode", "pid", "netns")
    with open(out / "ranks.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=rank_cols, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(sorted(ranks, key=lambda f: (f["rep"], f["rank"])))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))


def read_timings(path: str | Path) -> list[dict[str, Any]]:
    """Read a ``timings.csv`` back (numbers converted)."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    for row in rows:
        for k in ("rep", "rank", "pair", "frame"):
            row[k] = int(row[k])
        for k in ("start_s", "duration_s"):
            row[k] = float(row[k])
    return rows


__all__ = ["ROLES", "expected_regions", "merge_repetition", "read_timings", "summarize",
           "write_tables"]
