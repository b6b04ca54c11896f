"""Dataflow graphs as plain data: modules, ports, connections, placement; validated before a run.

A :class:`Graph` lists **modules** (a Python function or an unmodified command, run as
``instances`` processes placed on nodes) with named, typed **ports**, and the **connections**
between an output port of one module instance and an input port of another. Like a Dask graph it
is plain data (:meth:`Graph.to_dict` / :meth:`Graph.from_dict`) and :meth:`Graph.validate`
rejects a graph that could not run before anything starts.

Examples
--------
>>> from instride.flow import Graph, Input
>>> g = Graph("demo")
>>> sim = g.module("sim", "mypkg.modules:simulate", outputs={"frames": "frame"})
>>> rg = g.module("rg", "mypkg.modules:gyration", inputs={"frames": "frame"},
...               outputs={"rg": "array"})
>>> g.connect(sim.output("frames"), rg.input("frames"))
>>> g.validate()                  # imports mypkg.modules: GraphError if it cannot
"""

from __future__ import annotations

import copy
import inspect
import json
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import (
    DeadlockError,
    GraphError,
    PortTypeError,
    UnconnectedInputError,
    UnknownModuleError,
    UnknownNodeError,
)
from .resolve import GRAPH_MODULE, resolve

#: Message types a port can carry: MD frames (positions + step, time, box; an instride stream),
#: numpy arrays, raw bytes, JSON values; ``any`` accepts every type except frames.
PORT_TYPES = ("frame", "array", "bytes", "json", "any")
#: How a connection hands messages to its input: every message in order, or only the newest.
SAMPLINGS = ("all", "newest")


@dataclass(frozen=True)
class Input:
    """An input port's declaration.

    Parameters
    ----------
    type
        Message type (one of :data:`PORT_TYPES`).
    blocking
        ``True``: ``wait()`` blocks until a message is there and the port must be connected.
        ``False``: ``get()`` returns ``None`` when nothing arrived (for low-rate control
        messages); the port may stay unconnected.
    """

    type: str = "frame"
    blocking: bool = True


@dataclass(frozen=True)
class PortRef:
    """One port of a module (all its instances, or one when ``instance`` is set)."""

    module: str
    port: str
    direction: str  # "in" or "out"
    instance: int | None = None

    def __getitem__(self, instance: int) -> PortRef:
        return PortRef(self.module, self.port, self.direction, int(instance))


@dataclass
class Module:
    """A module of a graph (plain data).

    Attributes
    ----------
    name
        Unique name; instances are ``name.0``, ``name.1`` ...
    target
        ``"package.module:function"`` or ``"file:/path/graph.py:function"`` (a Python
        module), or ``None`` for a command.
    command
        argv of an unmodified program (``None`` for a Python module).
    inputs, outputs
        Port name -> :class:`Input` / message type.
    instances
        Number of processes.
    nodes
        Node of each instance (``None``: the launcher's first node... in turn).
    params
        JSON keyword arguments for the function.
    mpi
        Start the instances as the ranks of one ``mpiexec -n <instances>`` (rank = instance).
    """

    name: str
    target: str | None
    command: list[str] | None
    inputs: dict[str, Input]
    outputs: dict[str, str]
    instances: int = 1
    nodes: list[str] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    mpi: bool = False

    def input(self, port: str, instance: int | None = None) -> PortRef:
        """Reference to input ``port`` (of one instance when given)."""
        if port not in self.inputs:
            raise UnknownModuleError(
                f"module {self.name!r} has no input port {port!r} (inputs: {sorted(self.inputs)})"
            )
        return PortRef(self.name, port, "in", instance)

    def output(self, port: str, instance: int | None = None) -> PortRef:
        """Reference to output ``port`` (of one instance when given)."""
        if port not in self.outputs:
            raise UnknownModuleError(
                f"module {self.name!r} has no output port {port!r} "
                f"(outputs: {sorted(self.outputs)})"
            )
        return PortRef(self.name, port, "out", instance)


@dataclass(frozen=True)
class Edge:
    """A connection from one instance's output port to one instance's input port.

    ``initial`` tokens (empty messages) are on the connection when the graph starts, which
    unlocks a cycle; ``sampling="newest"`` hands the input only the newest message, skipping
    older ones; ``stride=k`` hands it every k-th message.
    """

    src: str
    src_instance: int
    src_port: str
    dst: str
    dst_instance: int
    dst_port: str
    initial: int = 0
    sampling: str = "all"
    stride: int = 1
    retain: int | None = None


_REF_RE = re.compile(r"^([A-Za-z0-9_-]+)(?:\[(\d+)\])?\.([A-Za-z0-9_-]+)$")


def _ref(ref: PortRef | str, direction: str) -> PortRef:
    if isinstance(ref, PortRef):
        return ref
    m = _REF_RE.match(str(ref))
    if not m:
        raise GraphError(f"port reference {ref!r}: expected 'module.port' or 'module[i].port'")
    inst = int(m.group(2)) if m.group(2) is not None else None
    return PortRef(m.group(1), m.group(3), direction, inst)


def _target_of(fn: Callable[..., Any]) -> str:
    if inspect.ismethod(fn) and not inspect.isclass(fn.__self__):
        # (recorded as Class.method, the instance dropped: each instance called it with its
        # ports as `self`, a TypeError at run time)
        raise GraphError(f"module function {fn!r} is a method bound to an instance, which "
                         "cannot travel to the module's processes: use a top-level function "
                         "(with params=) or a classmethod")
    mod = getattr(fn, "__module__", None)
    qual = getattr(fn, "__qualname__", None)
    if not mod or not qual or "<locals>" in qual or "<lambda>" in qual:
        raise GraphError(
            f"module function {fn!r} must be defined at the top level of a module or graph file"
        )
    if mod in ("__main__", GRAPH_MODULE):
        source = inspect.getsourcefile(fn) or getattr(sys.modules.get(mod), "__file__", None)
        if not source:
            raise GraphError(f"cannot find the file that defines {qual!r}")
        return f"file:{Path(source).resolve()}:{qual}"
    return f"{mod}:{qual}"


def _check_edge(e: Edge) -> None:
    """A connection's own fields (a graph rebuilt from data skips :meth:`Graph.connect`)."""
    what = f"connection {e.src}.{e.src_port} -> {e.dst}.{e.dst_port}"
    for name in ("stride", "initial", "src_instance", "dst_instance"):
        value = getattr(e, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise GraphError(f"{what}: {name} must be a whole number, got {value!r}")
    if e.stride < 1 or e.initial < 0:
        raise GraphError(f"{what}: stride must be >= 1 and initial >= 0, got stride "
                         f"{e.stride} and initial {e.initial}")
    if e.sampling not in SAMPLINGS:
        raise GraphError(f"{what}: sampling must be one of {SAMPLINGS}, got {e.sampling!r}")
    if e.retain is not None and (isinstance(e.retain, bool) or not isinstance(e.retain, int)
                                 or e.retain < 1):
        raise GraphError(f"{what}: retain must be a whole number >= 1, got {e.retain!r}")


#: module, port and graph names: ASCII letters, digits, ``-``, ``_``, not first ``-`` (a
#: consumer group's name is made of them, and follows the same rule)
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*\Z")


def _name_ok(name: str) -> bool:
    """The rule of module, port and graph names (see :data:`_NAME_RE`)."""
    return isinstance(name, str) and _NAME_RE.match(name) is not None


def _check_ports(module: str, inputs: Iterable[str], outputs: Iterable[str]) -> None:
    """Refuse port names that are not names, or that only differ in case among a module's
    inputs (or outputs): they would share an ``INSTRIDE_FLOW_IN_<PORT>`` variable."""
    for direction, ports in (("input", list(inputs)), ("output", list(outputs))):
        seen: dict[str, str] = {}
        for port in ports:
            if not _name_ok(port):
                raise GraphError(f"module {module!r}: {direction} port name {port!r}: use "
                                 "ASCII letters, digits, '-', '_' (not first '-')")
            # (`-` is also given as `_`, as a shell reads it: my-port and my_port would share it)
            var = port.upper().replace("-", "_")
            if var in seen:
                raise GraphError(
                    f"module {module!r}: {direction} ports {seen[var]!r} and {port!r} "
                    f"differ only in case or in '-' for '_' (both would be INSTRIDE_FLOW_"
                    f"{'IN' if direction == 'input' else 'OUT'}_{var})"
                )
            seen[var] = port


def _check_module(key: str, m: Module) -> None:
    """A module's own fields (a graph rebuilt from data skips :meth:`Graph.module`)."""
    if not _name_ok(m.name) or key != m.name:
        raise GraphError(f"module name {m.name!r}: use ASCII letters, digits, '-', '_' (not "
                         "first '-')" if key == m.name else
                         f"module {key!r} is recorded under the name {m.name!r}")
    if isinstance(m.instances, bool) or not isinstance(m.instances, int) or m.instances < 1:
        raise GraphError(f"module {m.name!r}: instances must be a whole number >= 1, "
                         f"not {m.instances!r}")
    if m.nodes is not None and (not isinstance(m.nodes, list) or not all(
            isinstance(n, str | int) and not isinstance(n, bool) for n in m.nodes)):
        raise GraphError(f"module {m.name!r}: nodes must be a list of node names or indices, "
                         f"not {m.nodes!r}")
    if not isinstance(m.params, dict):
        raise GraphError(f"module {m.name!r}: params must be a mapping of names to values, "
                         f"not {m.params!r}")
    if (m.target is None) == (m.command is None) or (
            m.target is not None and not isinstance(m.target, str)) or (
            m.command is not None and (not isinstance(m.command, list) or not m.command
                                       or not all(isinstance(a, str) for a in m.command))):
        raise GraphError(f"module {m.name!r}: needs a function target or a command (a "
                         "non-empty list of strings), one of the two")


def _check_params(module: str, params: Mapping[str, Any]) -> None:
    """Refuse parameters that are not JSON: they travel to the instances in the run's spec."""
    try:
        json.dumps(params)
    except (TypeError, ValueError) as exc:
        raise GraphError(f"module {module!r}: params must be JSON-serializable (numbers, "
                         f"strings, lists, dicts; not numpy scalars or sets): {exc}") from None


def _inputs(spec: Mapping[str, str | Input] | Sequence[str] | None) -> dict[str, Input]:
    if spec is None:
        return {}
    items = spec.items() if isinstance(spec, Mapping) else ((n, "frame") for n in spec)
    out: dict[str, Input] = {}
    for name, value in items:
        port = value if isinstance(value, Input) else Input(str(value))
        out[str(name)] = port
    return out


def _outputs(spec: Mapping[str, str] | Sequence[str] | None) -> dict[str, str]:
    if spec is None:
        return {}
    if isinstance(spec, Mapping):
        return {str(k): str(v) for k, v in spec.items()}
    return {str(name): "frame" for name in spec}


#: Messages an output port's stream keeps by default (``Graph(retain=...)``).
DEFAULT_RETAIN = 64


def _check_retain(retain: int | None) -> None:
    if retain is not None and (isinstance(retain, bool) or not isinstance(retain, int) or retain < 1):
        raise GraphError(f"retain must be an integer >= 1 (or None: unbounded), got {retain!r}")


class Graph:
    """A dataflow graph: modules, their ports, connections and placement.

    Parameters
    ----------
    name
        Name of the graph; names its streams (``flow/<name>-<run id>/...``) and its run.
    retain
        Messages each output port's stream keeps at most (one more while the newest is being
        published) before its producer waits for the consumers (back-pressure). ``None``:
        unbounded, every message is kept until the run ends. A connection may ask for more
        (``connect(..., retain=k)``).
    put_timeout
        Seconds a ``put`` blocked by a full stream waits for its consumers before the
        producer fails with :class:`~instride.flow.errors.PortBlocked` (default: the run's
        ``timeout``, else ``INSTRIDE_TIMEOUT``, else forever).
    """

    def __init__(self, name: str = "graph", *, retain: int | None = DEFAULT_RETAIN,
                 put_timeout: float | None = None) -> None:
        if not _name_ok(name):
            raise GraphError(f"graph name {name!r}: use ASCII letters, digits, '-', '_' "
                             "(not first '-')")
        _check_retain(retain)
        if put_timeout is not None and not put_timeout > 0:
            raise GraphError(f"put_timeout must be > 0 seconds, got {put_timeout!r}")
        self.name = name
        self.retain = retain
        self.put_timeout = put_timeout
        self.modules: dict[str, Module] = {}
        self.edges: list[Edge] = []

    # ------------------------------------------------------------------ building
    def module(
        self,
        name: str,
        fn: Callable[..., Any] | str | None = None,
        *,
        command: Sequence[str] | None = None,
        inputs: Mapping[str, str | Input] | Sequence[str] | None = None,
        outputs: Mapping[str, str] | Sequence[str] | None = None,
        instances: int | None = None,
        nodes: Sequence[str] | None = None,
        per_node: int | None = None,
        params: Mapping[str, Any] | None = None,
        mpi: bool = False,
    ) -> Module:
        """Add a module and return it.

        Parameters
        ----------
        name
            Unique module name (ASCII letters, digits, ``-``, ``_``; not first ``-``).
        fn
            The module's function ``fn(ports, **params)`` (or its ``"pkg.mod:func"`` name);
            it loops on ``ports.wait()`` / ``ports.get()`` / ``ports.put()``.
        command
            Instead of ``fn``: argv of a program; it finds its ports in the environment
            (``INSTRIDE_FLOW_IN_<PORT>`` / ``INSTRIDE_FLOW_OUT_<PORT>`` stream names, or
            :func:`instride.flow.ports.from_env`).
        inputs
            Input ports: names (frames, blocking) or name -> type or :class:`Input`.
        outputs
            Output ports: names (frames) or name -> type.
        instances
            Number of processes (default 1, or ``per_node * len(nodes)``).
        nodes
            Placement: the nodes its instances run on, in turn: names, or indices into the
            launcher's node list (``nodes=[0]``: the first node of a Slurm allocation).
        per_node
            Instances per node of ``nodes`` (instance ``i`` on ``nodes[i // per_node]``).
        params
            JSON-serializable keyword arguments for ``fn``.
        mpi
            Start the instances with the native MPI launcher, as the ranks of one
            ``mpiexec -n <instances>`` on one node; each finds its instance in its rank
            (``PMI_RANK``), as FlowVR modules inherit the rank ``mpirun`` gives them.

        Returns
        -------
        Module

        Raises
        ------
        GraphError
            A bad name, port name (or two port names that differ only in case), placement,
            instance count, or parameters that are not JSON.
        """
        if not _name_ok(name):
            raise GraphError(f"module name {name!r}: use ASCII letters, digits, '-', '_' "
                             "(not first '-')")
        if name in self.modules:
            raise GraphError(f"module {name!r} is already in graph {self.name!r}")
        if (fn is None) == (command is None):
            raise GraphError(f"module {name!r}: give exactly one of fn= and command=")
        target = None
        if fn is not None:
            target = fn if isinstance(fn, str) else _target_of(fn)
        if isinstance(nodes, str):
            raise GraphError(f"module {name!r}: nodes must be a list of node names or "
                             f"indices, got the string {nodes!r} (write nodes=[{nodes!r}])")
        placement = list(nodes) if nodes is not None else None
        if per_node is not None:
            if not placement or per_node < 1:
                raise GraphError(f"module {name!r}: per_node needs nodes= and a count >= 1")
            count = per_node * len(placement)
            if instances is not None and instances != count:
                raise GraphError(
                    f"module {name!r}: instances={instances} != per_node * len(nodes) = {count}"
                )
            instances = count
            placement = [n for n in placement for _ in range(per_node)]
        instances = 1 if instances is None else int(instances)
        if instances < 1:
            raise GraphError(f"module {name!r}: instances must be >= 1, got {instances}")
        ins, outs = _inputs(inputs), _outputs(outputs)
        _check_ports(name, ins, outs)
        _check_params(name, params or {})
        mod = Module(
            name=name,
            target=target,
            command=[str(a) for a in command] if command is not None else None,
            inputs=ins,
            outputs=outs,
            instances=instances,
            nodes=placement,
            params=dict(params or {}),
            mpi=bool(mpi),
        )
        if mod.mpi and placement and len(set(placement)) > 1:
            raise GraphError(f"module {name!r}: an mpi module runs on one node, got {placement}")
        self.modules[name] = mod
        return mod

    def _module(self, name: str) -> Module:
        try:
            return self.modules[name]
        except KeyError:
            raise UnknownModuleError(
                f"graph {self.name!r} has no module {name!r} (modules: {sorted(self.modules)})"
            ) from None

    def connect(
        self,
        src: PortRef | str,
        dst: PortRef | str,
        *,
        initial: int = 0,
        sampling: str = "all",
        stride: int = 1,
        retain: int | None = None,
    ) -> list[Edge]:
        """Connect an output port to an input port.

        Module-level references connect instance ``i`` to instance ``i`` (same number of
        instances) or one source instance to every destination instance (broadcast); an
        ``N``-to-``M`` connection needs a pattern (:mod:`instride.flow.patterns`). An output
        port may feed any number of inputs (every one gets every message); an input port takes
        one connection.

        Parameters
        ----------
        src, dst
            ``module.output(port)`` and ``module.input(port)`` (indexable by instance), or
            strings ``"module.port"`` / ``"module[instance].port"``.
        initial
            Initial tokens (empty messages) on the connection: unlock a cycle.
        sampling
            ``"all"`` (every message, in order) or ``"newest"`` (skip to the newest).
        stride
            Hand over every ``stride``-th message.
        retain
            Messages the source port's stream keeps at most (default: the graph's
            ``retain``); the port takes the largest value its connections ask for.

        Returns
        -------
        list of Edge
            The instance-level connections added.
        """
        src, dst = _ref(src, "out"), _ref(dst, "in")
        if src.direction != "out" or dst.direction != "in":
            raise GraphError(f"connect(output, input): got {src} -> {dst}")
        if sampling not in SAMPLINGS:
            raise GraphError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
        if stride < 1 or initial < 0:
            raise GraphError("stride must be >= 1 and initial >= 0")
        _check_retain(retain)
        s, d = self._module(src.module), self._module(dst.module)
        s.output(src.port)
        d.input(dst.port)
        pairs: list[tuple[int, int]]
        if src.instance is not None and dst.instance is not None:
            pairs = [(src.instance, dst.instance)]
        elif src.instance is not None:
            pairs = [(src.instance, j) for j in range(d.instances)]
        elif dst.instance is not None:
            if s.instances != 1:
                raise GraphError(
                    f"{src.module}.{src.port} has {s.instances} instances: name one, "
                    f"or use a pattern to merge them into {dst.module}.{dst.port}[{dst.instance}]"
                )
            pairs = [(0, dst.instance)]
        elif s.instances == d.instances:
            pairs = [(i, i) for i in range(s.instances)]
        elif s.instances == 1:
            pairs = [(0, j) for j in range(d.instances)]
        else:
            raise GraphError(
                f"cannot connect {s.instances} instances of {src.module!r} to {d.instances} of "
                f"{dst.module!r} directly: use a pattern (reduce_tree, gather, scatter)"
            )
        edges = [
            Edge(src.module, i, src.port, dst.module, j, dst.port, initial, sampling, stride,
                 retain)
            for i, j in pairs
        ]
        self.edges.extend(edges)
        return edges

    # ------------------------------------------------------------------ queries
    def instances(self) -> list[tuple[str, int]]:
        """Every module instance as ``(module, instance)``, in declaration order."""
        return [(m.name, i) for m in self.modules.values() for i in range(m.instances)]

    def placement(self, nodes: Sequence[str]) -> dict[tuple[str, int], str]:
        """The node of every instance: its module's ``nodes`` in turn, else ``nodes`` in turn."""
        out: dict[tuple[str, int], str] = {}
        k = 0
        for m in self.modules.values():
            for i in range(m.instances):
                if m.nodes:
                    n = m.nodes[i % len(m.nodes)]
                    out[(m.name, i)] = nodes[n] if isinstance(n, int) else n  # index or name
                else:
                    out[(m.name, i)] = nodes[k % len(nodes)]
                    k += 1
        return out

    def edges_into(self, module: str, instance: int) -> list[Edge]:
        """Connections into one instance."""
        return [e for e in self.edges if e.dst == module and e.dst_instance == instance]

    def edges_from(self, module: str, instance: int) -> list[Edge]:
        """Connections out of one instance."""
        return [e for e in self.edges if e.src == module and e.src_instance == instance]

    def retention(self, module: str, instance: int, port: str) -> int | None:
        """Messages the stream of ``module[instance].port`` keeps at most (``None``: all).

        The largest ``retain`` its connections ask for, else the graph's; never less than its
        initial tokens plus one (the tokens are messages too), nor than the largest
        ``stride`` of its connections plus one. A port feeding a program
        (``command=``) without an explicit ``retain`` on that connection keeps every message:
        the program may read the stream without its consumer group (e.g. through MDAnalysis),
        and the producer would wait for it forever.
        """
        edges = [e for e in self.edges_from(module, instance) if e.src_port == port]
        if any(e.retain is None and self.modules[e.dst].command for e in edges):
            return None
        asked = [e.retain for e in edges if e.retain is not None]
        retain = max(asked) if asked else self.retain
        if retain is None:
            return None
        # a reader that takes every k-th message waits for one k ahead of the last it took,
        # whose place is given back only at its next take: the stream keeps k + 1, or the
        # producer and that reader wait for each other for ever
        strides = [e.stride for e in edges if e.stride > 1]
        return max(retain, self.tokens(module, instance, port) + 1, *(k + 1 for k in strides))

    def tokens(self, module: str, instance: int, port: str) -> int:
        """Initial tokens the output stream of ``module[instance].port`` starts with."""
        return max(
            (e.initial for e in self.edges_from(module, instance) if e.src_port == port),
            default=0,
        )

    # ------------------------------------------------------------------ validation
    def validate(self, nodes: Iterable[str] | None = None) -> None:
        """Check that the graph can run; raise before anything starts.

        Besides the structure, every module function is imported (its ``"pkg.mod:func"``
        target resolved), as the instances will.

        Parameters
        ----------
        nodes
            The launcher's node names; placement on any other node is an error.

        Raises
        ------
        UnknownModuleError
            A connection names a module, port or instance the graph does not have.
        PortTypeError
            A connection joins ports of different types.
        UnconnectedInputError
            A blocking input has no connection.
        DeadlockError
            A cycle of blocking connections has no initial token.
        UnknownNodeError
            A module is placed on a node the launcher does not have.
        GraphError
            Anything else: an input with two connections, tokens on a frame port, an
            empty graph, a module function that cannot be imported, a bad port name,
            parameters that are not JSON.
        """
        if not self.modules:
            raise GraphError(f"graph {self.name!r} has no modules")
        for key, m in self.modules.items():
            _check_module(key, m)
            _check_ports(m.name, m.inputs, m.outputs)
            _check_params(m.name, m.params)
        seen: dict[tuple[str, int, str], Edge] = {}
        for e in self.edges:
            _check_edge(e)
            s, d = self._module(e.src), self._module(e.dst)
            s.output(e.src_port)
            d.input(e.dst_port)
            for mod, inst in ((s, e.src_instance), (d, e.dst_instance)):
                if not 0 <= inst < mod.instances:
                    raise UnknownModuleError(
                        f"module {mod.name!r} has {mod.instances} instance(s), not {inst}"
                    )
            out_type, in_port = s.outputs[e.src_port], d.inputs[e.dst_port]
            compatible = out_type == in_port.type or (
                "any" in (out_type, in_port.type) and "frame" not in (out_type, in_port.type)
            )
            if not compatible:
                raise PortTypeError(
                    f"{e.src}.{e.src_port} sends {out_type!r} messages but "
                    f"{e.dst}.{e.dst_port} expects {in_port.type!r}"
                )
            if e.initial and out_type == "frame":
                raise GraphError(
                    f"initial tokens on {e.src}.{e.src_port} -> {e.dst}.{e.dst_port}: tokens "
                    "are empty messages and need a non-frame port (array, bytes, json)"
                )
            key = (e.dst, e.dst_instance, e.dst_port)
            if key in seen:
                raise GraphError(
                    f"input {e.dst}[{e.dst_instance}].{e.dst_port} has two connections (from "
                    f"{seen[key].src} and {e.src}): merge them with a pattern"
                )
            seen[key] = e
        for m in self.modules.values():
            for port, spec in m.inputs.items():
                if spec.type not in PORT_TYPES:
                    raise PortTypeError(f"{m.name}.{port}: unknown type {spec.type!r}")
                if not spec.blocking:
                    continue
                for i in range(m.instances):
                    if (m.name, i, port) not in seen:
                        raise UnconnectedInputError(
                            f"blocking input {m.name}[{i}].{port} is not connected: its "
                            "wait() would block forever (connect it, or declare it "
                            "Input(..., blocking=False))"
                        )
            for port, typ in m.outputs.items():
                if typ not in PORT_TYPES:
                    raise PortTypeError(f"{m.name}.{port}: unknown type {typ!r}")
            if m.nodes is not None and nodes is not None:
                known = list(nodes)
                for n in m.nodes:
                    index = isinstance(n, int) and not isinstance(n, bool)
                    if (index and not 0 <= n < len(known)) or (not index and n not in known):
                        raise UnknownNodeError(
                            f"module {m.name!r} is placed on node {n!r}, which this launcher "
                            f"does not have (nodes: {known})"
                        )
        self._check_deadlock()
        for m in self.modules.values():
            if m.target is not None:
                resolve(m.target)  # an unknown function fails here, before anything starts

    def _check_deadlock(self) -> None:
        # A cycle whose every connection is blocking and holds no token can never start.
        succ: dict[tuple[str, int], list[tuple[str, int]]] = {}
        for e in self.edges:
            if e.initial == 0 and self.modules[e.dst].inputs[e.dst_port].blocking:
                succ.setdefault((e.src, e.src_instance), []).append((e.dst, e.dst_instance))
        # depth first, with a stack of its own (a chain of thousands of modules is deeper
        # than Python's recursion): 1 = on the current path, 2 = done
        state: dict[tuple[str, int], int] = {}
        for root in self.instances():
            if root in state:
                continue
            path: list[tuple[str, int]] = [root]
            todo = [iter(succ.get(root, []))]
            state[root] = 1
            while todo:
                nxt = next(todo[-1], None)
                if nxt is None:
                    state[path.pop()] = 2
                    todo.pop()
                elif state.get(nxt) == 1:
                    cycle = path[path.index(nxt):] + [nxt]
                    where = " -> ".join(f"{m}[{i}]" for m, i in cycle)
                    raise DeadlockError(
                        f"cycle {where} has no initial token: every module in it waits for "
                        "another (add initial=1 to one connection, or make an input "
                        "non-blocking)"
                    )
                elif nxt not in state:
                    state[nxt] = 1
                    path.append(nxt)
                    todo.append(iter(succ.get(nxt, [])))

    # ------------------------------------------------------------------ plain data
    def to_dict(self) -> dict[str, Any]:
        """The graph as JSON-serializable plain data."""
        return {
            "name": self.name,
            "retain": self.retain,
            "put_timeout": self.put_timeout,
            "modules": [
                {**asdict(m), "inputs": {k: asdict(v) for k, v in m.inputs.items()}}
                for m in self.modules.values()
            ],
            "edges": [asdict(e) for e in self.edges],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Graph:
        """Rebuild a graph from :meth:`to_dict` data.

        Raises
        ------
        GraphError
            The data is not a graph's (a field missing, unknown or of the wrong type).
        """
        try:
            g = cls(data["name"], retain=data.get("retain", DEFAULT_RETAIN),
                    put_timeout=data.get("put_timeout"))
            for m in data["modules"]:
                m = copy.deepcopy(dict(m))
                m["inputs"] = {k: Input(**v) for k, v in m["inputs"].items()}
                g.modules[m["name"]] = Module(**m)
            g.edges = [Edge(**e) for e in data["edges"]]
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            if isinstance(exc, GraphError):
                raise
            raise GraphError(f"not the data of a graph: {type(exc).__name__}: {exc}") from None
        return g

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, modules={len(self.modules)}, edges={len(self.edges)})"


def load_graph(path: str | Path, params: Mapping[str, Any] | None = None) -> Graph:
    """Load a graph file: a Python file defining ``graph`` or ``build(**params) -> Graph``.

    Parameters
    ----------
    path
        The graph file.
    params
        Keyword arguments for ``build``.

    Returns
    -------
    Graph

    Raises
    ------
    GraphError
        The file does not exist, does not compile, defines no graph, or ``build`` does not
        take ``params``.
    """
    from .resolve import load_file

    module = load_file(Path(path))
    build = getattr(module, "build", None)
    if callable(build):
        try:
            inspect.signature(build).bind(**dict(params or {}))
        except TypeError as exc:  # an unknown or missing parameter
            raise GraphError(f"{path}: build() does not take these parameters "
                             f"({sorted(dict(params or {}))}): {exc}") from None
        graph = build(**dict(params or {}))
    elif params:
        raise GraphError(f"{path}: parameters given but the file defines no build() function")
    else:
        graph = getattr(module, "graph", None)
    if not isinstance(graph, Graph):
        raise GraphError(f"{path} must define `graph = Graph(...)` or `def build(**params)`")
    return graph
