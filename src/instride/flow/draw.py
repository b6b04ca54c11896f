"""Draw a graph as a picture: one box per module (instances and node), one arrow per
module-to-module connection, feedback connections dashed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .errors import GraphError
from .graph import Graph


def _levels(g: Graph) -> dict[str, int]:
    """Column of each module: longest path from a source over forward connections."""
    forward: dict[str, set[str]] = {m: set() for m in g.modules}
    for e in g.edges:
        back = e.initial > 0 or not g.modules[e.dst].inputs[e.dst_port].blocking
        if not back and e.src != e.dst:
            forward[e.src].add(e.dst)
    level = {m: 0 for m in g.modules}
    for _ in range(len(g.modules)):
        changed = False
        for src, dsts in forward.items():
            for d in dsts:
                if level[d] < level[src] + 1:
                    level[d] = level[src] + 1
                    changed = True
        if not changed:
            break
    return level


def draw(g: Graph, path: str | Path, title: str | None = None) -> Path:
    """Write a PNG (or any format matplotlib knows, by suffix) of the graph.

    Parameters
    ----------
    g
        The graph.
    path
        Output file.
    title
        Figure title (default: the graph's name).

    Returns
    -------
    pathlib.Path

    Raises
    ------
    GraphError
        The graph has no modules.
    ConfigError
        ``path``'s suffix names no format matplotlib writes.
    """
    if not g.modules:
        raise GraphError(f"graph {g.name!r} has no modules: nothing to draw")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    known = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    if fmt not in known:
        raise ConfigError("output", str(path), f"no drawing format {fmt!r}; use one of "
                                               f"{', '.join(sorted(known))}")
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    level = _levels(g)
    columns: dict[int, list[str]] = {}
    for m in g.modules:
        columns.setdefault(level[m], []).append(m)
    height = max(len(c) for c in columns.values())
    pos = {}
    for x, names in columns.items():
        for k, name in enumerate(names):
            pos[name] = (x * 3.2, (height - 1) / 2 - k * 1.4 + (len(names) - 1) * 0.7)
    fig, ax = plt.subplots(figsize=(max(6, 3.0 * len(columns)), max(3, 1.3 * height + 1)))
    w, h = 2.2, 0.8
    for name, (x, y) in pos.items():
        m = g.modules[name]
        label = name + (f" ×{m.instances}" if m.instances > 1 else "")
        where = ",".join(sorted(set(map(str, m.nodes)))) if m.nodes else ""  # names or indices
        color = "#dbe8f6" if m.target else "#f6e3cf"
        ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h,
                                    boxstyle="round,pad=0.05", fc=color, ec="#333333"))
        ax.text(x, y + (0.12 if where else 0), label, ha="center", va="center", fontsize=9,
                weight="bold")
        if where:
            ax.text(x, y - 0.2, where, ha="center", va="center", fontsize=7, color="#555555")
    groups: dict[tuple[str, str], list[Any]] = {}
    for e in g.edges:
        groups.setdefault((e.src, e.dst), []).append(e)
    for (src, dst), edges in groups.items():
        back = all(
            e.initial > 0 or not g.modules[e.dst].inputs[e.dst_port].blocking for e in edges
        )
        (x0, y0), (x1, y1) = pos[src], pos[dst]
        start = (x0 + w / 2, y0) if x1 > x0 else (x0, y0 - h / 2)
        end = (x1 - w / 2, y1) if x1 > x0 else (x1, y1 - h / 2)
        style = "arc3,rad=0.0" if not back else "arc3,rad=-0.45"
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12,
                                     connectionstyle=style, lw=1.2,
                                     ls="--" if back else "-",
                                     color="#c44e52" if back else "#333333"))
        labels = []
        for e in edges:
            label = e.src_port if e.src_port == e.dst_port else f"{e.src_port}→{e.dst_port}"
            if e.sampling == "newest":
                label += " (newest)"
            if e.stride > 1:
                label += f" (1/{e.stride})"
            if e.initial:
                label += f" ({e.initial} token)"
            if label not in labels:
                labels.append(label)
        if len(labels) > 2:
            labels = [labels[0], "…"]
        mx, my = (start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + (0.12 if not back else -0.55)
        ax.text(mx, my, ", ".join(labels), ha="center", fontsize=7, color="#444444")
    xs = [p[0] for p in pos.values()]
    ys = [p[1] for p in pos.values()]
    ax.set_xlim(min(xs) - 1.6, max(xs) + 1.6)
    ax.set_ylim(min(ys) - 1.2, max(ys) + 0.9)
    ax.set_axis_off()
    ax.set_title(title if title is not None else f"graph {g.name}")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
