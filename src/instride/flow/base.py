"""Modules written as classes: a template method over ``wait`` / ``get`` / ``put``.

A subclass of :class:`ModuleBase` implements :meth:`~ModuleBase.process` (one message from
each blocking input in, a dict of output values out); the loop, the MD step stamp and end of
stream are handled for it, as MDAnalysis's ``AnalysisBase`` does for ``_single_frame``. Give
the class where a module function goes: ``graph.module("rg", RadiusOfGyration, ...)``; its
parameters are the constructor's keyword arguments.

Examples
--------
>>> class Scale(ModuleBase):                                     # doctest: +SKIP
...     def __init__(self, factor=2.0):
...         self.factor = factor
...     def process(self, msgs):
...         return {"out": msgs["in"].data * self.factor}
"""

from __future__ import annotations

from typing import Any

from .ports import Message, Ports


class ModuleBase:
    """Base class of class-based modules.

    Override :meth:`process`, and :meth:`setup` / :meth:`finish` when needed. The step and
    time of the first input's message stamp the outputs.
    """

    ports: Ports

    def setup(self, ports: Ports) -> None:
        """Called once before the first message."""

    def process(self, msgs: dict[str, Message | None]) -> dict[str, Any] | None:
        """One step: ``msgs`` holds one message per input (``None`` on a non-blocking input
        with nothing new); return ``{output_port: value}`` (or ``None`` to send nothing)."""
        raise NotImplementedError

    def finish(self, ports: Ports) -> None:
        """Called once after the inputs ended."""

    def __call__(self, ports: Ports) -> None:
        self.ports = ports
        self.setup(ports)
        blocking = [p for p, spec in ports.input_specs.items() if spec.blocking]
        if not blocking:
            raise TypeError(f"{type(self).__name__}: a ModuleBase module needs a blocking input")
        while ports.wait():
            msgs = {p: ports.get(p) for p in ports.input_specs}
            first = msgs[blocking[0]]
            if first is None:
                break
            out = self.process(msgs)
            for port, value in (out or {}).items():
                ports.put(port, value, step=first.step, time=first.time)
        self.finish(ports)
