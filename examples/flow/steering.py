"""Steering: an analysis module sends control messages back to the OpenMM simulation.

    instride flow run examples/flow/steering.py --out steering-out
    instride flow run examples/flow/steering.py --out steering-out -p densify_at=0.6

Graph::

    sim --frames--> watch
     ^                 |
     +----control------+   (non-blocking input: no token needed, no deadlock)

``watch`` computes the RMSD of the protein to its first frame. When it passes ``densify_at``
(Å) it asks the simulation for frames ``factor`` times more often (``{"interval": n}``); when
it passes ``stop_at``, or after ``max_frames`` frames, it stops the simulation
(``{"stop": true}``). The simulation obeys between two chunks of MD steps, ends its stream,
and the end of stream ends ``watch``. ``sim-0.json`` lists the steps published and the
interval in force at each; ``watch.csv`` the RMSD per step and the messages sent.
"""

from __future__ import annotations

from instride.flow import Graph, Input
from instride.flow.md import openmm_producer, rmsd


def watch(ports, interval=50, factor=5, densify_at=0.5, stop_at=2.0, max_frames=40):
    first = None
    densified = stopped = False
    frames = 0
    with open(ports.out_dir / "watch.csv", "w") as out:
        out.write("step,rmsd,sent\n")
        while ports.wait():
            msg = ports.get("frames")
            frames += 1
            if first is None:
                first = msg.data.copy()
            value = rmsd(msg.data, first)
            sent = ""
            if not densified and value > densify_at:
                sent = {"interval": max(1, interval // factor)}
                densified = True
            elif not stopped and (value > stop_at or frames >= max_frames):
                sent = {"stop": True}
                stopped = True
            if sent:
                ports.put("control", sent, step=msg.step)
            out.write(f"{msg.step},{value:.4f},{sent or ''}\n")


def build(steps=5000, interval=50, factor=5, densify_at=0.5, stop_at=2.0, max_frames=40,
          threads=1):
    g = Graph("steering")
    sim = g.module("sim", openmm_producer, outputs={"frames": "frame"},
                   inputs={"control": Input("json", blocking=False)},
                   params={"steps": steps, "interval": interval, "threads": threads})
    w = g.module("watch", watch, inputs={"frames": "frame"}, outputs={"control": "json"},
                 params={"interval": interval, "factor": factor, "densify_at": densify_at,
                         "stop_at": stop_at, "max_frames": max_frames})
    g.connect(sim.output("frames"), w.input("frames"))
    g.connect(w.output("control"), sim.input("control"))  # the feedback loop
    return g
