"""Dataflow composition in the FlowVR model: modules, ports, graphs, patterns, a runner.

A **module** is a Python function ``fn(ports, **params)`` (or an unmodified command) that
loops on ``ports.wait()`` / ``ports.get(port)`` / ``ports.put(port, data, step=...)``; a
**graph** lists modules, their instances and placement, and connects output ports to input
ports; **patterns** add reusable sub-graphs (reduction trees, sampling, synchronization); the
**runner** validates the graph, starts every instance through a launcher and stops the whole
graph, with a typed error naming the module, when one fails.

Examples
--------
>>> from instride import flow                                      # doctest: +SKIP
>>> g = flow.Graph("pipeline")
>>> sim = g.module("sim", produce, outputs={"frames": "frame"}, params={"n": 10})
>>> rg = g.module("rg", analyse, inputs={"frames": "frame"})
>>> g.connect(sim.output("frames"), rg.input("frames"))
>>> result = flow.run(g, out="results")                            # trace.json, timeline.png
"""

from __future__ import annotations

from .base import ModuleBase
from .errors import (
    DeadlockError,
    FlowError,
    FlowTimeout,
    GraphError,
    ModuleFailed,
    PortBlocked,
    PortTypeError,
    UnconnectedInputError,
    UnknownModuleError,
    UnknownNodeError,
    UnknownRunError,
)
from .graph import Edge, Graph, Input, Module, PortRef, load_graph
from .launchers import EmulatedLauncher, Launcher, LocalLauncher, SlurmLauncher
from .ports import Message, Ports, from_env
from .runner import RunResult, run

__all__ = [
    "DeadlockError",
    "Edge",
    "EmulatedLauncher",
    "FlowError",
    "FlowTimeout",
    "Graph",
    "GraphError",
    "Input",
    "Launcher",
    "LocalLauncher",
    "SlurmLauncher",
    "Message",
    "Module",
    "ModuleBase",
    "ModuleFailed",
    "PortBlocked",
    "PortRef",
    "PortTypeError",
    "Ports",
    "RunResult",
    "UnconnectedInputError",
    "UnknownModuleError",
    "UnknownNodeError",
    "UnknownRunError",
    "from_env",
    "load_graph",
    "run",
]
