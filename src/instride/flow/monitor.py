"""Counters of running graphs, as ``instride top`` shows them.

Every module instance writes its counters (messages and bytes per port, seconds in
wait/get/put/compute) to the run's state directory twice a second (:meth:`Ports.flush`); this
module reads them back and joins them: the queue depth of an input is the number of messages
its stream has written minus the input's consumer-group cursor (read from the stream's head;
an output shows the messages its bounded stream holds over its retention).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from .runner import HEARTBEAT, HEARTBEAT_FILE, host, state_roots

COLUMNS = ("instance", "node", "port", "dir", "msgs", "rate/s", "queue", "idle%", "MiB")
#: Seconds without a sign of life (the run's start, an instance's counters) after which a run
#: recorded by another host — whose runner's pid cannot be checked here — is called stale.
#: (An instance writes its counters only as it gets and puts messages: a run whose instances
#: all compute for longer, or all wait, is quiet that long too.)
STALE_AFTER = 60.0
#: Seconds without the runner's heartbeat (:data:`~instride.flow.runner.HEARTBEAT`) after
#: which a run of another host is called dead (six beats missed: a loaded file server or a
#: clock a little apart is not death).
HEARTBEAT_LOST = 6 * HEARTBEAT


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def runner_alive(info: dict[str, Any]) -> bool | None:
    """Whether the runner of a run (its ``run.json``) is alive; ``None``: recorded by another
    host, where its pid cannot be checked."""
    if info.get("host", host()) != host():
        return None
    return _alive(int(info["pid"]))


def _records(root: Path | None) -> list[tuple[dict[str, Any], Path]]:
    """The readable ``run.json`` of every run (in ``root``, else every state root)."""
    found = []
    for base in [root] if root is not None else state_roots():
        for path in base.glob("*/run.json") if base.is_dir() else []:
            with contextlib.suppress(OSError, ValueError):
                info = json.loads(path.read_text())
                if isinstance(info, dict):
                    found.append((info, path.parent))
    return found


def other_hosts_runs(root: Path | None = None) -> list[tuple[Path, str]]:
    """The runs recorded by other hosts (alive or not: that cannot be checked from here), and
    their hosts, oldest first."""
    runs = []
    for info, path in _records(root):
        with contextlib.suppress(KeyError, TypeError, ValueError):
            if runner_alive(info) is None:
                runs.append((float(info["started"]), path, str(info["host"])))
    return [(p, h) for _, p, h in sorted(runs)]


def last_sign_of_life(snap: dict[str, Any]) -> float:
    """The latest time (epoch s) a :func:`snapshot` shows its run alive: its start, its
    runner's heartbeat, or an instance's counters written."""
    times = [0.0]
    for when in [snap["run"].get("started"), snap.get("heartbeat")] \
            + [s.get("updated") for s in snap["stats"]]:
        if isinstance(when, (int, float)) and not isinstance(when, bool):
            times.append(float(when))
    return max(times)


def remote_state(snap: dict[str, Any], now: float | None = None) -> str | None:
    """What can be said of a run recorded by another host, whose runner's pid cannot be
    checked here (``None`` for a run of this host): that, and how long nothing of the run has
    changed; ``STALE`` past :data:`STALE_AFTER` s (killed there, most likely)."""
    info = snap["run"]
    if runner_alive(info) is not None:
        return None
    now = time.time() if now is None else now
    age = max(0.0, now - last_sign_of_life(snap))
    who = f"runner pid {info.get('pid')} on host {info.get('host')}"
    beat = snap.get("heartbeat")
    if isinstance(beat, float):  # (a runner that beats: alive or dead, not a guess)
        since = max(0.0, now - beat)
        if since > HEARTBEAT_LOST:
            return (f"DEAD: {who} last showed a sign of life {since:.0f} s ago (it does every "
                    f"{HEARTBEAT:g} s while the graph runs): it was killed there")
        return f"{who}: alive (its last sign of life {since:.0f} s ago)"
    if age > STALE_AFTER:
        return (f"STALE: {who} cannot be checked from this host, and nothing of the run has "
                f"changed for {age:.0f} s: it was killed there, or all its instances are "
                f"quiet (run `instride top` on {info.get('host')} to know)")
    return f"{who} cannot be checked from this host; last sign of life {age:.0f} s ago"


def live_runs(root: Path | None = None) -> list[Path]:
    """State directories of the runs in progress whose runner runs on this host, oldest first
    (in ``root``, default every :func:`~instride.flow.runner.state_roots` directory)."""
    runs = []
    for info, path in _records(root):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
            if runner_alive(info):
                runs.append((info["started"], path))
    return [p for _, p in sorted(runs)]


def snapshot(run: Path) -> dict[str, Any]:
    """The run's description and the latest counters of every instance."""
    info = json.loads((run / "run.json").read_text())
    stats = []
    for path in sorted((run / "stats").glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            stats.append(json.loads(path.read_text()))
    try:  # (the runner's last sign of life, where it keeps one: see runner.HEARTBEAT)
        beat: float | None = (run / HEARTBEAT_FILE).stat().st_mtime
    except OSError:
        beat = None
    return {"run": info, "stats": stats, "taken": time.time(), "heartbeat": beat}


def rows(snap: dict[str, Any], previous: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per (instance, port): messages, rate, queue depth, idle %, MiB.

    Parameters
    ----------
    snap
        A :func:`snapshot`.
    previous
        An earlier snapshot: rates are computed over the interval; without it, over the
        instance's lifetime.
    """
    produced: dict[str, int] = {}
    for s in snap["stats"]:
        for port in s["outputs"].values():
            if port:
                produced[port["stream"]] = port["msgs"]
    before: dict[tuple[str, int, str, str], tuple[float, int]] = {}
    for s in (previous or {}).get("stats", []):
        for direction in ("inputs", "outputs"):
            for name, port in s[direction].items():
                if port:
                    before[(s["module"], s["instance"], direction, name)] = (
                        s["updated"], port["msgs"])
    out = []
    for s in snap["stats"]:
        elapsed = max(1e-9, s["updated"] - s["started"])
        idle = 100.0 * s["seconds"].get("wait", 0.0) / elapsed
        for direction in ("inputs", "outputs"):
            for name, port in s[direction].items():
                if not port:
                    continue
                key = (s["module"], s["instance"], direction, name)
                if key in before and s["updated"] > before[key][0]:
                    rate = (port["msgs"] - before[key][1]) / (s["updated"] - before[key][0])
                else:
                    rate = port["msgs"] / elapsed
                queue = ""
                if direction == "inputs":  # the stream's head: written - the group's cursor
                    depth = port.get("queue")
                    if depth is None:  # no head yet (or an older instance): its producer's count
                        depth = max(0, produced.get(port["stream"], 0) - port["cursor"])
                    queue = str(depth)
                elif port.get("retain"):  # messages the bounded stream holds / its bound
                    queue = f"{port.get('retained', 0)}/{port['retain']}"
                out.append({
                    "instance": f"{s['module']}[{s['instance']}]" + ("" if not s.get("done")
                                                                      else " done"),
                    "node": s["node"], "port": name, "dir": direction[:-1].replace("put", ""),
                    "msgs": port["msgs"], "rate/s": f"{rate:.1f}", "queue": queue,
                    "idle%": f"{idle:.0f}", "MiB": f"{port['bytes'] / 2**20:.2f}",
                })
    return out


def render(table: list[dict[str, Any]], title: str = "") -> str:
    """The rows as a fixed-width text table."""
    cells = [[str(r[c]) for c in COLUMNS] for r in table]
    widths = [max([len(c)] + [len(row[k]) for row in cells]) for k, c in enumerate(COLUMNS)]
    lines = [title] if title else []
    lines.append("  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True)))
    for row in cells:
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
    return "\n".join(lines)
