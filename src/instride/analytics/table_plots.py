"""Plots of analysis tables: one PNG per quantity over time (matplotlib, Agg backend).

Examples
--------
>>> plot_table("out/replica0/analytics.csv", "out/replica0")        # doctest: +SKIP
[PosixPath('out/replica0/rmsd.png'), PosixPath('out/replica0/rgyr.png'), ...]
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from .table import read_table

__all__ = ["LABELS", "plot_overlay", "plot_table"]

#: axis labels of the known columns
LABELS = {
    "rmsd": "RMSD to first frame (Å)",
    "rgyr": "radius of gyration (Å)",
    "time_ps": "time (ps)",
    "step": "MD step",
    "frame": "frame",
}
_INDEX_COLUMNS = ("frame", "step", "time_ps")


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _label(column: str) -> str:
    if column.startswith("lambda_"):
        return f"largest eigenvalue, {column[len('lambda_'):]} (Å)"
    return LABELS.get(column, column)


def plot_overlay(
    tables: Mapping[str, str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    x: str = "time_ps",
    columns: Sequence[str] | None = None,
    prefix: str = "",
    title: str | None = None,
) -> list[Path]:
    """Write one PNG per quantity, with one line per table (e.g. per replica).

    Parameters
    ----------
    tables
        Legend label -> CSV path written by :class:`~instride.analytics.table.StreamingTable`.
    out_dir
        Directory for the PNG files (created).
    x
        Column used as the horizontal axis.
    columns
        Quantities to plot (default: every column except frame/step/time).
    prefix
        File name prefix: ``<prefix><column>.png``.
    title
        Figure title prefix.

    Returns
    -------
    list of Path
        The PNG files written.
    """
    plt = _pyplot()
    data = {label: read_table(path) for label, path in tables.items()}
    if not data:
        return []
    first = next(iter(data.values()))
    cols = list(columns) if columns is not None else [c for c in first if c not in _INDEX_COLUMNS]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for col in cols:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for label, table in data.items():
            ax.plot(table[x], table[col], label=label, linewidth=1.2)
        ax.set_xlabel(_label(x))
        ax.set_ylabel(_label(col))
        if title:
            ax.set_title(f"{title}: {col}")
        if len(data) > 1:
            ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / f"{prefix}{col}.png"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # (whole or not at all)
        try:
            fig.savefig(tmp, dpi=110, format="png")
            os.replace(tmp, path)
        finally:
            plt.close(fig)
            tmp.unlink(missing_ok=True)
        written.append(path)
    return written


def plot_table(
    table: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    x: str = "time_ps",
    columns: Sequence[str] | None = None,
    title: str | None = None,
) -> list[Path]:
    """Write one PNG per quantity of one table (``<column>.png`` in ``out_dir``)."""
    return plot_overlay({Path(table).stem: table}, out_dir, x=x, columns=columns, title=title)
