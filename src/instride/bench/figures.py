"""Stacked bars of data movement and idle time per configuration, like the paper's Figures 5-12.

Each figure has two panels, production and consumption; for every x value (pairs, model,
stride...) one bar per backend, its data movement (red, hatched ``//``) under its idle time
(blue, hatched ``\\\\``), in milliseconds per frame.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

MOVEMENT_COLOR = "#d62728"
IDLE_COLOR = "#1f77b4"


def plot_experiment(
    rows: Sequence[dict[str, Any]],
    title: str,
    path: str | Path,
    *,
    xlabel: str = "",
) -> Path:
    """Draw one experiment's figure.

    Parameters
    ----------
    rows
        One dict per configuration with keys ``x``, ``backend``, ``producer_movement_ms``,
        ``producer_idle_ms``, ``consumer_movement_ms``, ``consumer_idle_ms`` (and optionally
        ``*_std_ms``), in x order.
    title
        Figure title.
    path
        PNG file to write.
    xlabel
        Label of the x axis.

    Returns
    -------
    Path
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    xs: list[str] = []
    backends: list[str] = []
    for row in rows:
        if row["x"] not in xs:
            xs.append(row["x"])
        if row["backend"] not in backends:
            backends.append(row["backend"])
    by = {(r["x"], r["backend"]): r for r in rows}
    width = 0.8 / max(len(backends), 1)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, role in zip(axes, ("producer", "consumer"), strict=True):
        base = np.arange(len(xs))
        top = 0.0
        for b, backend in enumerate(backends):
            pos = base + (b - (len(backends) - 1) / 2) * width
            cells = [by.get((x, backend), {}) for x in xs]
            mov = np.array([c.get(f"{role}_movement_ms", np.nan) for c in cells])
            idle = np.array([c.get(f"{role}_idle_ms", np.nan) for c in cells])
            ax.bar(pos, mov, width, color="white", edgecolor=MOVEMENT_COLOR, hatch="//",
                   label="data movement" if b == 0 else None)
            ax.bar(pos, idle, width, bottom=mov, color="white", edgecolor=IDLE_COLOR,
                   hatch="\\\\", label="idle" if b == 0 else None)
            stacked = np.nan_to_num(mov) + np.nan_to_num(idle)
            top = max(top, float(stacked.max()) if stacked.size else 0.0)
            for p, m, i in zip(pos, mov, idle, strict=True):
                if np.isfinite(m):
                    ax.text(p, m + (i if np.isfinite(i) else 0), backend, ha="center",
                            va="bottom", fontsize=7, rotation=90)
        ax.set_xticks(base, xs)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ms per frame")
        ax.set_title("(a) production" if role == "producer" else "(b) consumption")
        ax.set_ylim(0, top * 1.3 if top > 0 else 1.0)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


__all__ = ["IDLE_COLOR", "MOVEMENT_COLOR", "plot_experiment"]
