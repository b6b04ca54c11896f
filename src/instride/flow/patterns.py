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

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .errors import FlowError, GraphError
from .graph import Edge, Graph, Input, PortRef, _target_of
from .ports import Message, Ports
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


def sync_module(ports: Ports, n: int, combine: str, max_pending: int = 1024) -> None:
    """Synchronizer: sends ``combine([...])``, stamped with the step, for every MD step a
    message of which comes on every input; drops the steps some input never has.

    The steps of each input only grow, so a message is dropped as soon as another input is
    past its step. An input that shares no module upstream with another is read one message
    at a time, so when it runs ahead its producer is held back (back-pressure). Inputs that
    share a module upstream (one a filtered or strided branch of the other's source) cannot
    be held back so: the one ahead would fill the common source's stream, and the branch
    behind, which needs that source to go on, would never send the step waited for. Their
    messages are read as they come and kept (frames copied) until their step is settled, up
    to ``max_pending`` per input. One more, while an input it shares a source with has none,
    is a :class:`FlowError` rather than a deadlock; while only inputs from elsewhere in the
    graph are awaited, it is held back like them.
    """
    fn = resolve(combine)
    names = [f"in{k}" for k in range(n)]
    shares = _sharing(ports.graph, ports.module, ports.instance, names)
    limits = [max_pending if shares[k] else 1 for k in range(n)]
    pending: list[deque[Message]] = [deque() for _ in range(n)]
    ended = [False] * n
    while True:
        for msgs in _settle(pending):
            ports.put("out", fn([m.data for m in msgs]), step=msgs[0].step, time=msgs[0].time)
        if any(ended[k] and not pending[k] for k in range(n)):
            return  # (a step that input never sent cannot be matched any more)
        awaited = {j for j in range(n) if not pending[j] and not ended[j]}
        # read: what has room; and a full input one of whose sharers is awaited — holding it
        # back could stall them, so one more message of it is an error, not a wait
        read = [k for k in range(n) if not ended[k]
                and (len(pending[k]) < limits[k] or shares[k] & awaited)]
        full = []
        for name in ports.wait_any([names[k] for k in read]):
            k = int(name[2:])
            if len(pending[k]) >= limits[k]:
                full.append(k)  # (after the others: one of them may be the step awaited)
                continue
            msg = ports.get(name)
            if msg is None:
                ended[k] = True
            else:
                pending[k].append(msg if limits[k] == 1 else _kept(msg))
        awaited = {j for j in range(n) if not pending[j] and not ended[j]}
        for k in full:
            if not shares[k] & awaited:
                continue  # (what it waited for came in the same batch: read once settled)
            name = names[k]
            msg = ports.get(name)
            if msg is None:
                ended[k] = True
            else:
                behind = [names[j] for j in sorted(shares[k] & awaited)]
                raise FlowError(
                    f"{ports.module}: input {name} has {len(pending[k]) + 1} messages (up to "
                    f"step {msg.step}) waiting for {', '.join(behind)}, which "
                    f"share{'s' * (len(behind) == 1)} a source upstream with it: holding "
                    f"{name} back would stall that source; raise max_pending "
                    f"(patterns.synchronize(..., max_pending=N), now {max_pending}) or "
                    "filter less")


def _settle(pending: list[deque[Message]]) -> Iterator[list[Message]]:
    """Take from the heads of ``pending`` (one queue per input, steps growing) what is
    settled: a step every queue's head has is yielded (one message per input) and taken;
    a head whose step another head is past is dropped. Stops when a queue is empty."""
    while all(pending):
        target = max(q[0].step for q in pending)
        for q in pending:
            while q and q[0].step < target:
                q.popleft()
        # (a queue's next head may be past the target: then the target goes up, round again)
        if all(q and q[0].step == target for q in pending):
            yield [q.popleft() for q in pending]


def _kept(msg: Message) -> Message:
    """``msg`` owning its data: a frame's arrays are views of storage its producer reuses
    once the next message of the port is taken."""
    if msg.frame is None:
        return msg  # (arrays, bytes and JSON values own the buffer they were received in)
    frame = dataclasses.replace(
        msg.frame, header=msg.frame.header._replace(box=msg.frame.header.box.copy()),
        positions=msg.frame.positions.copy(),
        ids=None if msg.frame.ids is None else msg.frame.ids.copy(), releaser=None)
    return dataclasses.replace(msg, data=frame.positions, frame=frame)


def _sharing(g: Graph, module: str, instance: int, names: list[str]) -> list[set[int]]:
    """For each input of ``names`` of ``module[instance]``, the positions of the others that
    share a module instance upstream with it (every connection followed back, feedback
    included)."""
    ups: list[set[tuple[str, int]]] = []
    for name in names:
        seen: set[tuple[str, int]] = set()
        todo = [(e.src, e.src_instance) for e in g.edges_into(module, instance)
                if e.dst_port == name]
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo += [(e.src, e.src_instance) for e in g.edges_into(*node)]
        ups.append(seen)
    return [{j for j, other in enumerate(ups) if j != k and up & other}
            for k, up in enumerate(ups)]


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

    Raises
    ------
    GraphError
        ``src`` stands for several instances (an input takes one connection: name one
        instance, ``src[i]``, or merge them first with :func:`gather` or :func:`reduce_tree`).
    """
    if src.instance is None and (n := g._module(src.module).instances) != 1:
        raise GraphError(
            f"broadcast: {src.module}.{src.port} has {n} instances and an input takes one "
            f"connection: broadcast one instance ({src.module}.output({src.port!r}, i)), or "
            "merge them first (patterns.gather, patterns.reduce_tree)")
    edges: list[Edge] = []
    for d in dsts:
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
                combine: Fn = stack, type: str | None = None,  # noqa: A002
                max_pending: int = 1024) -> PortRef:
    """Merge N inputs by MD step: for every step present on all of them, one message
    ``combine([value_0, ..., value_N-1])`` stamped with that step; return its output.

    The output's type (``type``) defaults to what :func:`stack` makes of the sources:
    ``"array"`` for frame and array sources (a stacked array), ``"json"`` for JSON sources
    (a list), else ``"any"``.

    Inputs from disjoint parts of the graph are read in step: the one ahead is held back.
    Inputs that share a module upstream (a filtered or strided branch of a source beside the
    source itself) cannot be held back without stalling that source, so the synchronizer
    keeps the messages of the one ahead (frames copied) until their step is settled:
    ``max_pending`` per input at most (memory: that many messages per such input). One more,
    while an input sharing its source has none, fails the module with a :class:`FlowError`
    naming the inputs; while only inputs from elsewhere are awaited, it is held back.
    """
    if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
        raise GraphError(f"synchronize: max_pending must be a whole number >= 1, got {max_pending!r}")
    refs = _expand(g, sources)
    kinds = {_type(g, r) for r in refs}
    if type is None:
        type = ("array" if kinds <= {"frame", "array"}
                else "json" if kinds == {"json"} else "any")
    m = g.module(name, sync_module,
                 inputs={f"in{k}": Input(_type(g, r)) for k, r in enumerate(refs)},
                 outputs={"out": type}, params={"n": len(refs), "combine": _fn(combine),
                                                "max_pending": max_pending})
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
