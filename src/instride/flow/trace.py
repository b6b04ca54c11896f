"""Traces of a graph run: wait/get/compute/put regions per module instance.

Every module instance records the regions it spends in ``wait()``, ``get()``, ``put()`` and in
its own code between them ("compute"). The runner merges them into one file in the Chrome trace
event format (``trace.json``: one process per module, one thread per instance, complete events
``"ph": "X"`` with microsecond timestamps, and flow arrows from the ``put`` of each message to
every ``get`` of it), which https://ui.perfetto.dev and
``chrome://tracing`` open, and draws a timeline picture (``timeline.png``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: Colours of the regions in the timeline picture.
COLORS = {"wait": "#d9d9d9", "get": "#4c72b0", "compute": "#55a868", "put": "#c44e52"}
#: Events one instance keeps at most (older regions are dropped past it, counted).
MAX_EVENTS = 200_000


class Recorder:
    """Regions of one module instance, as ``[name, start_us, duration_us]`` lists.

    Parameters
    ----------
    enabled
        Record nothing when ``False`` (regions still time the counters).
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.events: list[list[Any]] = []
        self.dropped = 0
        self._last_end: float | None = None
        self.seconds: dict[str, float] = {"wait": 0.0, "get": 0.0, "put": 0.0, "compute": 0.0}

    def _add(self, name: str, start: float, end: float, message: str | None = None) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + (end - start)
        if not self.enabled:
            return
        if len(self.events) >= MAX_EVENTS:
            self.dropped += 1
            return
        event: list[Any] = [name, round(start * 1e6, 1), round((end - start) * 1e6, 1)]
        if message is not None:
            event.append(message)
        self.events.append(event)

    @contextmanager
    def region(self, name: str) -> Iterator[dict[str, Any]]:
        """Time a region; the gap since the previous region is recorded as ``compute``.

        The caller may set ``info["message"]`` (``"<stream>#<index>"``) inside the block: the
        trace then links the ``put`` of that message to every ``get`` of it.
        """
        start = time.time()
        if self._last_end is not None and start > self._last_end:
            self._add("compute", self._last_end, start)
        info: dict[str, Any] = {}
        try:
            yield info
        finally:
            end = time.time()
            self._add(name, start, end, info.get("message"))
            self._last_end = end

    def dump(self, path: Path, meta: Mapping[str, Any]) -> None:
        """Write the regions and ``meta`` (module, instance, node) to ``path`` atomically."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**meta, "events": self.events, "dropped": self.dropped}))
        os.replace(tmp, path)
        self.dumped = True

    #: whether :meth:`dump` wrote the regions (a program's ports closed)
    dumped = False


def merge(parts: Sequence[Mapping[str, Any]], modules: Sequence[str]) -> dict[str, Any]:
    """Merge the instances' regions into one Chrome trace (``{"traceEvents": [...]}``).

    Parameters
    ----------
    parts
        What :meth:`Recorder.dump` wrote, one per instance.
    modules
        Module names in graph order (process ids follow it).
    """
    pids = {name: k + 1 for k, name in enumerate(modules)}
    events: list[dict[str, Any]] = []
    puts: dict[str, tuple[int, int, float]] = {}
    gets: list[tuple[str, int, int, float]] = []
    for name, pid in pids.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
    for part in parts:
        pid, tid = pids.get(part["module"], 0), int(part["instance"])
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                       "args": {"name": f"{part['module']}[{tid}] on {part.get('node', '?')}"}})
        for region, ts, dur, *message in part["events"]:
            events.append({"ph": "X", "name": region, "cat": "flow", "pid": pid, "tid": tid,
                           "ts": ts, "dur": dur})
            if message and region == "put":
                puts[message[0]] = (pid, tid, ts)  # its start: surely before publication
            elif message and region == "get":
                gets.append((message[0], pid, tid, ts + dur / 2))
    # data movements: an arrow from the put of each message to every get of it
    for n, (message, pid, tid, ts) in enumerate(gets):
        if message not in puts:
            continue
        spid, stid, sts = puts[message]
        common = {"name": "message", "cat": "message", "id": n + 1}
        events.append({**common, "ph": "s", "pid": spid, "tid": stid, "ts": sts,
                       "args": {"message": message}})
        events.append({**common, "ph": "f", "bp": "e", "pid": pid, "tid": tid, "ts": ts})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def timeline(trace: Mapping[str, Any], path: Path, title: str = "") -> Path:
    """Draw one row per module instance with its wait/get/compute/put regions.

    Parameters
    ----------
    trace
        A trace from :func:`merge`.
    path
        The PNG to write.
    title
        Figure title.

    Returns
    -------
    pathlib.Path
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names: dict[tuple[int, int], str] = {}
    rows: dict[tuple[int, int], dict[str, list[tuple[float, float]]]] = {}
    t0 = min((e["ts"] for e in trace["traceEvents"] if e["ph"] == "X"), default=0.0)
    for e in trace["traceEvents"]:
        key = (e["pid"], e["tid"])
        if e["ph"] == "M" and e["name"] == "thread_name":
            names[key] = e["args"]["name"]
        elif e["ph"] == "X":
            rows.setdefault(key, {}).setdefault(e["name"], []).append(
                ((e["ts"] - t0) / 1e6, e["dur"] / 1e6)
            )
    order = sorted(names)
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(order) + 1.5))
    for y, key in enumerate(order):
        for region, spans in rows.get(key, {}).items():
            ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=COLORS.get(region, "k"))
    ax.set_yticks(range(len(order)), [names[k] for k in order])
    ax.invert_yaxis()
    ax.set_xlabel("time since start (s)")
    ax.set_title(title or "graph timeline")
    ax.legend(handles=[Patch(color=c, label=r) for r, c in COLORS.items()],
              loc="upper center", bbox_to_anchor=(0.5, -0.15 if len(order) > 3 else -0.3),
              ncol=4, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
