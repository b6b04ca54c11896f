"""Reusable graph patterns: functions that add modules and connections to a graph.

=====================  ===================================================================
pattern                what it builds
=====================  ===================================================================
:func:`broadcast`      one output to many inputs; every consumer gets every message
:func:`reduce_tree`    N-to-1 reduction tree of merge modules with a given arity (FlowVR's
                       ``generateNto1``); :func:`gather` is the flat tree (arity N)
:func:`n_to_n`         instance ``i`` to instance ``i`` (parallel pipelines)
:func:`scatter`        1-to-N: messages dealt round-robin to N instances
:func:`sample_newest`  greedy sampling for a slow consumer: it gets the newest message,
                       older ones are skipped
:func:`stride`         every k-th message
:func:`filter`         a filter module keeping the messages a predicate accepts
:func:`synchronize`    N inputs merged by MD step (steps present on every input)
:func:`feedback`       a control connection back upstream (steering), non-blocking or
                       unlocked by initial tokens
=====================  ===================================================================

Merge, combine and predicate functions are given as top-level functions (or
``"package.module:function"``); they run inside the pattern's modules.

Examples
--------
>>> from instride.flow import Graph, patterns                         # doctest: +SKIP
>>> g = Graph("ensemble")
>>> rg = g.module("rg", gyration, inputs=["frames"], outputs={"rg": "array"}, instances=8)
>>> total = patterns.reduce_tree(g, "sum", rg.output("rg"), merge=patterns.add, arity=2)
>>> g.connect(total, plot.input("rg"))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .errors import FlowError, GraphError
from .graph import Edge, Graph, Input, PortRef, _target_of
from .ports import Ports
from .resolve import resolve

Fn = Callable[..., Any] | str


def _fn(f: Fn) -> str:
    return f if isinstance(f, str) else _target_of(f)


def _expand(g: Graph, sources: PortRef | Sequence[PortRef]) -> list[PortRef]:
    """Instance-level references: a module-level output becomes one per instance."""
    refs = [sources] if isinstance(sources, PortRef) else list(sources)
    out: list[PortRef] = []
    for r in refs:
        if r.direction != "out":
            raise GraphError(f"{r.module}.{r.port} is not an output port")
        if r.instance is None:
            out.extend(r[i] for i in range(g._module(r.module).instances))
        else:
            out.append(r)
    if not out:
        raise GraphError("a pattern needs at least one source")
    return out


def _type(g: Graph, ref: PortRef) -> str:
    g._module(ref.module).output(ref.port)  # raises for an unknown port
    return g.modules[ref.module].outputs[ref.port]


def _node(g: Graph, ref: PortRef) -> list[str] | None:
    nodes = g.modules[ref.module].nodes
    return [nodes[(ref.instance or 0) % len(nodes)]] if nodes else None


# ---------------------------------------------------------------------- merge functions
def concatenate(values: list[Any]) -> Any:
    """Default merge: concatenate arrays (``np.concatenate``), bytes, or JSON lists."""
    first = values[0]
    if isinstance(first, np.ndarray):
        return np.concatenate([np.atleast_1d(v) for v in values])
    if isinstance(first, (bytes, bytearray)):
        return b"".join(values)
    return [x for v in values for x in (v if isinstance(v, list) else [v])]


def add(values: list[Any]) -> Any:
    """Merge by element-wise sum."""
    return sum(values[1:], values[0])


def stack(values: list[Any]) -> Any:
    """Combine by stacking (arrays: ``np.stack``; others: a list)."""
    if isinstance(values[0], np.ndarray):
        return np.stack(values)
    return list(values)


# ---------------------------------------------------------------------- module functions
def merge_module(ports: Ports, n: int, merge: str) -> None:
    """Merge module of a reduction tree: one message from each of ``in0..in<n-1>`` -> ``out``.

    Its inputs must be in step: a message with a different MD step on one input is an error
    (use :func:`synchronize` for inputs at different rates).
    """
    fn = resolve(merge)
    while ports.wait():
        msgs = [ports.get(f"in{k}") for k in range(n)]
        if any(m is None for m in msgs):
            break
        steps = {m.step for m in msgs if m is not None}
        if len(steps) != 1:
            raise FlowError(f"{ports.module}: inputs out of step {sorted(steps)}; "
                            "use patterns.synchronize for inputs at different rates")
        ports.put("out", fn([m.data for m in msgs if m is not None]), step=msgs[0].step,
                  time=msgs[0].time)


def sync_module(ports: Ports, n: int, combine: str) -> None:
    """Synchronizer: waits for a message of the same MD step on every input, drops the steps
    that some input never has, and sends ``combine([...])`` stamped with that step."""
    fn = resolve(combine)
    current: list[Any] = [None] * n
    while True:
        for k in range(n):
            if current[k] is None:
                current[k] = ports.get(f"in{k}")
                if current[k] is None:
                    return
        target = max(m.step for m in current)
        if all(m.step == target for m in current):
            ports.put("out", fn([m.data for m in current]), step=target, time=current[0].time)
            current = [None] * n
            continue
        for k in range(n):
            while current[k] is not None and current[k].step < target:
                current[k] = ports.get(f"in{k}")
            if current[k] is None:
                return


def scatter_module(ports: Ports, n: int) -> None:
    """Deals the messages of ``in`` round-robin to ``out0..out<n-1>``."""
    k = 0
    while ports.wait():
        msg = ports.get("in")
        data = msg.frame if msg.frame is not None else msg.data
        ports.put(f"out{k % n}", data, step=msg.step, time=msg.time)
        k += 1


def filter_module(ports: Ports, predicate: str) -> None:
    """Forwards the messages of ``in`` for which ``predicate(message)`` is true."""
    keep = resolve(predicate)
    while ports.wait():
        msg = ports.get("in")
        if keep(msg):
            data = msg.frame if msg.frame is not None else msg.data
            ports.put("out", data, step=msg.step, time=msg.time)


# ---------------------------------------------------------------------- patterns
def broadcast(g: Graph, src: PortRef, dsts: Sequence[PortRef], **connect: Any) -> list[Edge]:
    """Connect one output to every input of ``dsts`` (each gets every message).

    Parameters
    ----------
    g
        The graph.
    src
        An output port.
    dsts
        Input ports (module-level references reach every instance).
    **connect
        ``initial``, ``sampling``, ``stride`` for :meth:`Graph.connect`.
    """
    edges: list[Edge] = []
    for d in dsts:
        if src.instance is None and g._module(src.module).instances != 1:
            for i in range(g.modules[src.module].instances):
                edges += g.connect(src[i], d, **connect)
        else:
            edges += g.connect(src, d, **connect)
    return edges


def reduce_tree(
    g: Graph,
    name: str,
    sources: PortRef | Sequence[PortRef],
    merge: Fn = concatenate,
    arity: int = 2,
    type: str | None = None,  # noqa: A002 - the port type, as in Graph.module
) -> PortRef:
    """Build an N-to-1 reduction tree and return the output of its root.

    Level by level, groups of ``arity`` messages (one per source, same MD step) are merged by
    a merge module running ``merge(list_of_values)``; the last level has one module. Each
    merge module is placed on the node of its first input.

    Parameters
    ----------
    g
        The graph.
    name
        Prefix of the merge modules' names (``<name>_l<level>_<j>``).
    sources
        Output ports (a module-level reference stands for all its instances).
    merge
        The merge function (default :func:`concatenate`; :func:`add` sums).
    arity
        Inputs per merge module (>= 2).
    type
        Port type of the merged messages (default: the sources' type).

    Returns
    -------
    PortRef
        The root's output port (the single source itself when there is one).
    """
    if arity < 2:
        raise GraphError(f"reduce_tree arity must be >= 2, got {arity}")
    level = _expand(g, sources)
    kind = type or _type(g, level[0])
    target = _fn(merge)
    depth = 0
    while len(level) > 1:
        nxt: list[PortRef] = []
        for j in range(math.ceil(len(level) / arity)):
            chunk = level[j * arity : (j + 1) * arity]
            m = g.module(
                f"{name}_l{depth}_{j}", merge_module,
                inputs={f"in{k}": Input(_type(g, chunk[k])) for k in range(len(chunk))},
                outputs={"out": kind}, nodes=_node(g, chunk[0]),
                params={"n": len(chunk), "merge": target},
            )
            for k, ref in enumerate(chunk):
                g.connect(ref, m.input(f"in{k}"))
            nxt.append(m.output("out", 0))
        level = nxt
        depth += 1
    return level[0]


def gather(g: Graph, name: str, sources: PortRef | Sequence[PortRef], merge: Fn = concatenate,
           type: str | None = None) -> PortRef:  # noqa: A002
    """Flat N-to-1: one merge module with one input per source (a tree of arity N)."""
    refs = _expand(g, sources)
    return reduce_tree(g, name, refs, merge, arity=max(2, len(refs)), type=type)


def n_to_n(g: Graph, src: PortRef, dst: PortRef, **connect: Any) -> list[Edge]:
    """Instance ``i`` of ``src`` to instance ``i`` of ``dst`` (same number of instances)."""
    s, d = g._module(src.module), g._module(dst.module)
    if s.instances != d.instances:
        raise GraphError(f"n_to_n: {src.module!r} has {s.instances} instances, "
                         f"{dst.module!r} {d.instances}")
    return g.connect(src, dst, **connect)


def scatter(g: Graph, name: str, src: PortRef, dst: PortRef) -> None:
    """1-to-N: deal the messages of ``src`` round-robin to the instances of ``dst``."""
    n = g._module(dst.module).instances
    kind = _type(g, src)
    m = g.module(name, scatter_module, inputs={"in": Input(kind)},
                 outputs={f"out{k}": kind for k in range(n)}, params={"n": n},
                 nodes=_node(g, src))
    g.connect(src, m.input("in"))
    for k in range(n):
        g.connect(m.output(f"out{k}", 0), dst[k])


def sample_newest(g: Graph, src: PortRef, dst: PortRef) -> list[Edge]:
    """Greedy sampling: each ``get()`` of ``dst`` returns the newest message of ``src``,
    skipping the ones it had no time for (a slow consumer never falls behind)."""
    return g.connect(src, dst, sampling="newest")


def stride(g: Graph, src: PortRef, dst: PortRef, every: int) -> list[Edge]:
    """``dst`` receives every ``every``-th message of ``src`` (the first, then each k-th)."""
    return g.connect(src, dst, stride=every)


def filter(g: Graph, name: str, src: PortRef, predicate: Fn) -> PortRef:  # noqa: A001
    """Insert a filter module after ``src``; return its output (the accepted messages).

    ``predicate(message) -> bool`` receives the :class:`Message` (step, data, frame).
    """
    kind = _type(g, src)
    m = g.module(name, filter_module, inputs={"in": Input(kind)}, outputs={"out": kind},
                 params={"predicate": _fn(predicate)}, nodes=_node(g, src))
    g.connect(src, m.input("in"))
    return m.output("out", 0)


def synchronize(g: Graph, name: str, sources: PortRef | Sequence[PortRef],
                combine: Fn = stack, type: str | None = None) -> PortRef:  # noqa: A002
    """Merge N inputs by MD step: for every step present on all of them, one message
    ``combine([value_0, ..., value_N-1])`` stamped with that step; return its output.

    The output's type (``type``) defaults to what :func:`stack` makes of the sources:
    ``"array"`` for frame and array sources (a stacked array), ``"json"`` for JSON sources
    (a list), else ``"any"``.
    """
    refs = _expand(g, sources)
    kinds = {_type(g, r) for r in refs}
    if type is None:
        type = ("array" if kinds <= {"frame", "array"}
                else "json" if kinds == {"json"} else "any")
    m = g.module(name, sync_module,
                 inputs={f"in{k}": Input(_type(g, r)) for k, r in enumerate(refs)},
                 outputs={"out": type}, params={"n": len(refs), "combine": _fn(combine)})
    for k, r in enumerate(refs):
        g.connect(r, m.input(f"in{k}"))
    return m.output("out", 0)


def feedback(g: Graph, src: PortRef, dst: PortRef, initial: int = 0) -> list[Edge]:
    """A control connection back upstream (steering). ``dst`` should be a non-blocking input
    (``Input("json", blocking=False)``); a blocking one needs ``initial`` tokens, or the cycle
    is refused as a deadlock by :meth:`Graph.validate`."""
    return g.connect(src, dst, initial=initial)


__all__ = [
    "add", "broadcast", "concatenate", "feedback", "filter", "gather", "n_to_n",
    "reduce_tree", "sample_newest", "scatter", "stack", "stride", "synchronize",
]
