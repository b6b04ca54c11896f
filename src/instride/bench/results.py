"""Turning the ranks' timing rows into a tidy table and a summary.

``timings.csv`` has one row per repetition x rank x frame x region with the columns
``rep, rank, role, pair, node, frame, region, category, start_s, duration_s``. The summary
(``summary.json``) gives, for each role (``producer``, ``consumer``), the paper's two
components per frame — ``movement_s`` (data movement) and ``idle_s`` (synchronization) — plus
their sum ``overall_s`` and the MD / analytics / (de)serialization ``compute_s``; the idle time
of the first frame (``idle_first_s``) and of the frames after it (``idle_steady_s``, per frame,
and ``overall_steady_s`` = ``movement_s + idle_steady_s``); a standard deviation over
repetitions for each of these means (``<name>_std``); and every region's mean.

The first frame's wait is not like the others: every consumer waits there for the producer's
whole first MD stride, whatever the synchronization. With the paper's 128 frames it is under 1 %
of the total; with the 16 frames of the ``small`` preset it can dominate the mean. The study
report therefore compares the steady-state values.

Results are written through :func:`staged_output`: into a hidden staging directory first, moved
into place only when complete, so a failed run never leaves a partial result beside an earlier
run's valid-looking one.
"""

from __future__ import annotations

import contextlib
import csv
import json
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .timers import CATEGORY

#: What :func:`instride.bench.workflow_run.run` writes, ``summary.json`` (the mark of a
#: complete run) last.
RUN_OUTPUTS = ("raw", "timings.csv", "ranks.csv", "summary.json")

ROLES = ("producer", "consumer")
_COLUMNS = ("rep", "rank", "role", "pair", "node", "frame", "region", "category", "start_s",
            "duration_s")


def expected_regions(backend: str, role: str, sync: str = "serialized") -> tuple[str, ...]:
    """The regions every frame of a ``role`` rank records with ``backend``.

    Parameters
    ----------
    backend
        ``instride``, ``localfs`` or ``sharedfs``.
    role
        ``producer`` or ``consumer``.
    sync
        The file systems' synchronization (``serialized`` or ``pipelined``).

    Returns
    -------
    tuple of str
        Region names, in the order a frame records them.
    """
    done = backend != "instride" and sync == "serialized"
    if role == "producer":
        base = ("produce.md", "produce.serialize", "produce.write")
        if backend == "instride":
            return base
        return (*base, "produce.sync", "produce.sync_done") if done else (*base, "produce.sync")
    if backend == "instride":
        return ("consume.wait", "consume.fetch", "consume.store", "consume.read",
                "consume.deserialize", "consume.analytics")
    base = ("consume.sync", "consume.read", "consume.deserialize", "consume.analytics")
    return (*base, "consume.sync_done") if done else base


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
    totals: dict[tuple[int, int], dict[str, float]] = defaultdict(
        lambda: {"movement": 0.0, "idle": 0.0, "compute": 0.0, "idle_first": 0.0}
    )
    regions: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        acc = totals[(row["rep"], row["rank"])]
        acc[row["category"]] += row["duration_s"]
        if row["category"] == "idle" and row["frame"] == 0:
            acc["idle_first"] += row["duration_s"]
        regions[row["region"]].append(row["duration_s"])
    if not totals:
        return {}
    # what each rank spent per frame (the first frame's idle: that frame's total)
    per_rank: dict[tuple[int, int], dict[str, float]] = {}
    for key, acc in totals.items():
        steady = ((acc["idle"] - acc["idle_first"]) / (frames - 1) if frames > 1
                  else float("nan"))  # a single frame has no steady state
        per_rank[key] = {
            "movement": acc["movement"] / frames, "idle": acc["idle"] / frames,
            "overall": (acc["movement"] + acc["idle"]) / frames,
            "compute": acc["compute"] / frames, "idle_first": acc["idle_first"],
            "idle_steady": steady, "overall_steady": acc["movement"] / frames + steady,
        }
    reps = sorted({rep for rep, _ in per_rank})
    out: dict[str, Any] = {}
    for name in ("movement", "idle", "overall", "compute", "idle_first", "idle_steady",
                 "overall_steady"):
        # the mean over a repetition's ranks, then mean and spread over repetitions
        by_rep = [float(np.mean([v[name] for (r, _), v in per_rank.items() if r == rep]))
                  for rep in reps]
        out[f"{name}_s"] = _finite(float(np.mean(by_rep)))
        out[f"{name}_s_std"] = _finite(float(np.std(by_rep)))
    totals_list = list(totals.values())
    walls = [f["wall_s"] for f in facts]
    return {
        **out,
        "movement_total_s": float(np.mean([v["movement"] for v in totals_list])),
        "idle_total_s": float(np.mean([v["idle"] for v in totals_list])),
        "wall_s": float(np.mean(walls)) if walls else 0.0,
        "ranks": len(per_rank),
        "regions": {
            name: {"mean_s": float(np.mean(vals)), "median_s": float(np.median(vals)),
                   "max_s": float(np.max(vals)), "count": len(vals)}
            for name, vals in sorted(regions.items())
        },
    }


def _finite(value: float) -> float | None:
    """``value``, or ``None`` (JSON ``null``) when it is not a number."""
    return value if np.isfinite(value) else None


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


@contextlib.contextmanager
def staged_output(out: str | Path, names: Sequence[str]) -> Iterator[Path]:
    """Build results in a hidden staging directory; move them into ``out`` when complete.

    Inside the ``with`` block the caller writes its results under the yielded directory
    (``out/.partial-*``). When the block ends normally, the stale entries ``names`` of an
    earlier run are removed from ``out`` (the last name first: it marks a complete result) and
    the new ones moved in (the last name last); anything else in ``out`` is left alone. When
    the block raises, the staging directory is removed and ``out`` keeps what it had.

    Parameters
    ----------
    out
        The result directory (created when missing).
    names
        The entries (files or directories) that make up a result, its completion mark last.

    Yields
    ------
    Path
        The staging directory.
    """
    outp = Path(out)
    made = not outp.exists()
    outp.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=outp))
    done = False
    try:
        yield staging
        # The swap: renames only, under held signals (Ctrl-C or SIGTERM during an rmtree of the
        # old result removed the new one with the staging directory, both results lost); the
        # old result's entries go aside first, the new ones in, the old ones are deleted last.
        from ..emulate.teardown import signals_held

        with signals_held():
            aside = Path(tempfile.mkdtemp(prefix=".old-", dir=outp))
            for name in reversed(names):
                stale = outp / name
                if stale.exists() or stale.is_symlink():
                    stale.rename(aside / name)
            for name in names:
                if (staging / name).exists():
                    (staging / name).rename(outp / name)
        shutil.rmtree(aside, ignore_errors=True)
        done = True
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if made and not done:  # (a run that failed leaves no empty result directory behind)
            with contextlib.suppress(OSError):
                outp.rmdir()


def write_tables(out: Path, timings: list[dict[str, Any]], ranks: list[dict[str, Any]],
                 summary: dict[str, Any]) -> None:
    """Write ``timings.csv``, ``ranks.csv`` and ``summary.json`` under ``out``."""
    with open(out / "timings.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=_COLUMNS)
        writer.writeheader()
        writer.writerows(timings)
    rank_cols = ("rep", "rank", "role", "pair", "node", "wall_s", "frames_verified",
                 "bytes_written", "mode", "pid", "netns", "origin_s")
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


__all__ = ["ROLES", "RUN_OUTPUTS", "expected_regions", "merge_repetition", "read_timings",
           "staged_output", "summarize", "write_tables"]
