"""Ensemble: OpenMM replicas -> per-replica analytics -> N-to-1 reduction -> ensemble statistics.

    instride flow run examples/flow/ensemble.py --out ensemble-out
    instride flow run examples/flow/ensemble.py --out ensemble-out -p replicas=8 -p steps=2000

Graph (``instride flow draw examples/flow/ensemble.py``)::

    sim x R --frames--> rg x R --rg--> reduction tree (arity 2) --+--> stats   (every step)
                                                                  +--> live    (newest only)

* ``sim``: R replicas of the solvated villin headpiece (OpenMM, different seeds), each
  publishing its protein atoms every ``interval`` steps;
* ``rg``: per replica, the radius of gyration of each frame;
* the reduction tree gathers the R values of one MD step into one message
  (``patterns.reduce_tree`` with ``patterns.concatenate``);
* ``stats``: mean and spread over the ensemble per step -> ``ensemble.csv``, ``ensemble.png``;
* ``live``: a slow live plot (``live.png`` redrawn for every message it takes) fed through
  greedy newest-message sampling: it never falls behind, it skips what it has no time for.
"""

from __future__ import annotations

import json

import numpy as np

from instride.flow import Graph, patterns
from instride.flow.md import gyration, openmm_producer


def _plot(path, steps, values, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = np.asarray(values)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in range(values.shape[1]):
        ax.plot(steps, values[:, r], lw=0.8, alpha=0.6, label=f"replica {r}")
    ax.plot(steps, values.mean(axis=1), "k-", lw=2, label="ensemble mean")
    ax.set_xlabel("MD step")
    ax.set_ylabel("radius of gyration (Å)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def ensemble_stats(ports, replicas=0):
    """Every step's R values -> mean and standard deviation (ensemble.csv, ensemble.png)."""
    steps, rows = [], []
    with open(ports.out_dir / "ensemble.csv", "w") as csv:
        csv.write("step,mean_rg,std_rg," + ",".join(
            f"rg{r}" for r in range(replicas)) + "\n")
        while ports.wait():
            msg = ports.get("rg")
            v = msg.data
            csv.write(f"{msg.step},{v.mean():.4f},{v.std():.4f},"
                      + ",".join(f"{x:.4f}" for x in v) + "\n")
            csv.flush()
            steps.append(msg.step)
            rows.append(v.copy())  # a message is a view valid until the next get(): keep a copy
    if rows:
        _plot(ports.out_dir / "ensemble.png", steps, rows, "ensemble radius of gyration")


def live_plot(ports, replicas=0):
    """Redraw live.png with every message it takes (slow on purpose: ~0.2 s a picture)."""
    steps, rows = [], []
    while ports.wait():
        msg = ports.get("rg")
        steps.append(msg.step)
        rows.append(msg.data.copy())
        _plot(ports.out_dir / "live.png", steps, rows, f"live: step {msg.step}")
    (ports.out_dir / "live.json").write_text(json.dumps({"steps_drawn": steps}))


def build(replicas=4, steps=400, interval=50, arity=2, threads=1):
    g = Graph("ensemble")
    sim = g.module("sim", openmm_producer, outputs={"frames": "frame"}, instances=replicas,
                   params={"steps": steps, "interval": interval, "threads": threads})
    rg = g.module("rg", gyration, inputs={"frames": "frame"}, outputs={"rg": "array"},
                  instances=replicas)
    g.connect(sim.output("frames"), rg.input("frames"))  # replica i -> analysis i
    total = patterns.reduce_tree(g, "gather", rg.output("rg"), merge=patterns.concatenate,
                                 arity=arity)
    stats = g.module("stats", ensemble_stats, inputs={"rg": "array"},
                     params={"replicas": replicas})
    live = g.module("live", live_plot, inputs={"rg": "array"}, params={"replicas": replicas})
    g.connect(total, stats.input("rg"))  # every message
    patterns.sample_newest(g, total, live.input("rg"))  # only the newest
    return g
