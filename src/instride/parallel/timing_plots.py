"""Per-rank stacked bar charts of a run's timing, like Fig. 2d of Khoshlessan et al. (2020).

Examples
--------
>>> from instride.parallel.timing import TimingReport     # doctest: +SKIP
>>> plot_ranks(report, "timing.png")                       # doctest: +SKIP
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: the stacked components of a rank's bar, bottom to top (attributes of a rank's timing)
COMPONENTS = ("t_open", "t_io", "t_comp", "t_end_loop", "t_overhead", "t_wait", "t_comm")
_LABELS = {
    "t_open": "open / setup",
    "t_io": "I/O (read frames)",
    "t_comp": "compute",
    "t_end_loop": "end of loop",
    "t_overhead": "overhead",
    "t_wait": "wait (barrier)",
    "t_comm": "communication",
}
_COLORS = {
    "t_open": "#4c72b0",
    "t_io": "#dd8452",
    "t_comp": "#55a868",
    "t_end_loop": "#8172b3",
    "t_overhead": "#937860",
    "t_wait": "#c0c0c0",
    "t_comm": "#c44e52",
}


def plot_ranks(report: Any, path: str | os.PathLike[str],
               components: Sequence[str] | None = None) -> Path:
    """Draw one stacked bar per rank (time per component) and save a PNG; return its path.

    Stragglers are outlined in red and named in the title; the title also gives S(N), E(N)
    and R_comp/IO when known.

    Parameters
    ----------
    report
        A :class:`~instride.parallel.timing.TimingReport` (this module draws it and does not
        import it: the report imports this module to write its PNG).
    path
        The PNG file to write.
    components
        Quantities of each rank to stack (default :data:`COMPONENTS`).

    Returns
    -------
    Path
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comps = list(components or COMPONENTS)
    ranks = report.ranks
    strag = set(report.stragglers)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * len(ranks) + 3), 4))
    x = list(range(len(ranks)))
    bottom = [0.0] * len(ranks)
    for c in comps:
        h = [getattr(r, c) for r in ranks]
        ax.bar(x, h, bottom=bottom, color=_COLORS.get(c), label=_LABELS.get(c, c), width=0.7)
        bottom = [b + v for b, v in zip(bottom, h, strict=True)]
    for i, r in enumerate(ranks):
        if r.rank in strag:
            ax.bar(i, bottom[i], width=0.7, fill=False, edgecolor="red", linewidth=2)
    ax.set_xticks(x, [str(r.rank) for r in ranks])
    ax.set_xlabel("rank")
    ax.set_ylabel("time (s)")
    title = f"{report.analysis}, {report.source}, {report.backend}, N={report.n_ranks}"
    extra = []
    if report.speedup is not None:
        extra.append(f"S={report.speedup:.2f} E={report.efficiency:.2f}")
    extra.append(f"R_comp/IO={report.r_comp_io:.2f}")
    if strag:
        extra.append(f"stragglers {sorted(strag)}")
    ax.set_title(title + "\n" + ", ".join(extra), fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    out = Path(path)
    # (under a temporary name, renamed into place: never a partial PNG; a name nobody can
    # guess, made exclusively: never through a link planted there, never another thread's)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    made = False  # (a file that was already there is not ours to remove)
    try:
        with open(tmp, "xb") as fh:
            made = True
            fig.savefig(fh, dpi=100, format="png")
        os.replace(tmp, out)
    except BaseException:
        if made:
            tmp.unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return out
