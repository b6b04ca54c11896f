"""Patterns: reduction trees, gather, scatter, stride, filter, newest sampling, synchronizer.

One graph holds every pattern side by side, so a single run (one set of processes) tests them.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from instride.flow import Graph, GraphError, ModuleFailed, patterns, run
from instride.flow.channels import Message

from . import modules


def _rec(g: Graph, name: str, kind: str = "array", instances: int = 1):
    return g.module(f"rec_{name}", modules.record, inputs={"in": kind}, instances=instances,
                    params={"name": name})


def test_patterns_in_one_run(flow_env: dict[str, Path]) -> None:
    out = flow_env["out"]
    g = Graph("patterns")
    # N-to-1 tree: 5 sources, arity 2 -> levels of 3, 2, 1 merge modules; merge = sum
    src = g.module("src", modules.ranked, outputs={"out": "array"}, instances=5,
                   params={"n": 4})
    root = patterns.reduce_tree(g, "tree", src.output("out"), merge=patterns.add, arity=2)
    g.connect(root, _rec(g, "tree").input("in"))
    # flat gather of 3 more sources, concatenated in source order
    few = g.module("few", modules.ranked, outputs={"out": "array"}, instances=3,
                   params={"n": 2})
    g.connect(patterns.gather(g, "flat", few.output("out")), _rec(g, "flat").input("in"))
    # stride, filter, scatter off one broadcast source
    num = g.module("num", modules.numbers, outputs={"out": "array"}, params={"n": 7})
    patterns.stride(g, num.output("out"), _rec(g, "stride").input("in"), every=3)
    g.connect(patterns.filter(g, "f20", num.output("out"), modules.every_twenty),
              _rec(g, "filter").input("in"))
    patterns.scatter(g, "deal", num.output("out"), _rec(g, "scatter", instances=2).input("in"))
    # synchronizer: steps 0..50 by 10 and 0..40 by 20 meet at 0, 20, 40
    a = g.module("a", modules.numbers, outputs={"out": "array"}, params={"n": 6})
    b = g.module("b", modules.numbers, outputs={"out": "array"},
                 params={"n": 3, "every": 20})
    sync = patterns.synchronize(g, "sync", [a.output("out"), b.output("out")])
    g.connect(sync, _rec(g, "sync").input("in"))
    # greedy newest-frame sampling by a slow consumer
    fast = g.module("fast", modules.count, outputs=["frames"],
                    params={"n": 30, "delay": 0.02})
    slow = g.module("slow", modules.slow_record, inputs={"in": "frame"},
                    params={"delay": 0.25})
    patterns.sample_newest(g, fast.output("frames"), slow.input("in"))
    # synchronizer of JSON sources: by default its output is JSON too (a list per step)
    j1 = g.module("j1", modules.json_numbers, outputs={"out": "json"}, params={"n": 3})
    j2 = g.module("j2", modules.json_numbers, outputs={"out": "json"}, params={"n": 2})
    sync_json = patterns.synchronize(g, "syncj", [j1.output("out"), j2.output("out")])
    assert g.modules["syncj"].outputs == {"out": "json"}
    g.connect(sync_json, _rec(g, "syncj", kind="json").input("in"))

    assert sum(m.startswith("tree_") for m in g.modules) == 6
    run(g, out=out, timeout=180)

    def got(name: str, i: int = 0) -> list:
        return json.loads((out / f"{name}-{i}.json").read_text())

    assert got("tree") == [[10 * k, [1000.0 + 5 * k]] for k in range(4)]
    assert got("flat") == [[10 * k, [float(k), 100.0 + k, 200.0 + k]] for k in range(2)]
    assert [s for s, _ in got("stride")] == [0, 30, 60]
    assert [s for s, _ in got("filter")] == [0, 20, 40, 60]
    assert [s for s, _ in got("scatter", 0)] == [0, 20, 40, 60]
    assert [s for s, _ in got("scatter", 1)] == [10, 30, 50]
    assert got("sync") == [[0, [[0.0], [0.0]]], [20, [[2.0], [1.0]]], [40, [[4.0], [2.0]]]]
    assert got("syncj") == [[0, [{"k": 0}, {"k": 0}]], [10, [{"k": 1}, {"k": 1}]]]
    steps = json.loads((out / "slow.json").read_text())
    assert steps == sorted(set(steps)) and len(steps) < 30  # skipped what it had no time for
    assert set(steps) <= set(range(0, 300, 10))  # only steps the source sent (no tokens)
    assert steps[-1] == 290  # ... but always ends on the newest


def test_synchronize_a_sparse_branch_beside_its_own_source(flow_env: dict[str, Path]) -> None:
    # the source's frames and a filtered branch of them (1 in 10) meet in a synchronizer; the
    # source's stream keeps 3 messages, fewer than the branch skips: held back message by
    # message, the synchronizer's input ahead stalled the source and the branch never came
    out = flow_env["out"]
    g = Graph("reconverge", retain=3)
    src = g.module("src", modules.count, outputs=["frames"], params={"n": 41, "natoms": 3000})
    sparse = patterns.filter(g, "sparse", src.output("frames"), modules.every_hundred)
    sync = patterns.synchronize(g, "sync", [src.output("frames"), sparse])
    g.connect(sync, _rec(g, "sync").input("in"))
    run(g, out=out, timeout=120)
    got = json.loads((out / "sync-0.json").read_text())
    assert [s for s, _ in got] == [0, 100, 200, 300, 400]
    # each step's frames, both inputs' (the kept copies of the source's, not its storage,
    # which holds later frames by then)
    assert [np.shape(data) for _, data in got] == [(2, 3000, 3)] * 5
    assert [np.unique(data).tolist() for _, data in got] == [[s / 10] for s, _ in got]


def test_synchronize_past_max_pending_names_the_inputs(flow_env: dict[str, Path]) -> None:
    g = Graph("reconverge", retain=3)
    src = g.module("src", modules.numbers, outputs={"out": "array"}, params={"n": 41})
    sparse = patterns.filter(g, "sparse", src.output("out"), modules.every_hundred)
    sync = patterns.synchronize(g, "sync", [src.output("out"), sparse], max_pending=4)
    g.connect(sync, _rec(g, "sync").input("in"))
    with pytest.raises(ModuleFailed, match=r"sync: input in0 has 5 messages .*waiting for in1"
                                           r".*max_pending.*now 4"):
        run(g, out=flow_env["out"], timeout=120)


def test_synchronize_branches_and_an_independent_source(flow_env: dict[str, Path]) -> None:
    # two branches of one source, whose steps skip each other's (multiples of 30 and of 100:
    # a branch's next step is often past the other's), and an independent slow source
    out = flow_env["out"]
    g = Graph("branches", retain=3)
    src = g.module("src", modules.numbers, outputs={"out": "array"}, params={"n": 61})
    thirty = patterns.filter(g, "thirty", src.output("out"), modules.every_thirty)
    hundred = patterns.filter(g, "hundred", src.output("out"), modules.every_hundred)
    slow = g.module("slow", modules.numbers, outputs={"out": "array"},
                    params={"n": 7, "every": 100, "delay": 0.1})
    sync = patterns.synchronize(g, "sync", [thirty, hundred, slow.output("out")])
    g.connect(sync, _rec(g, "sync").input("in"))
    run(g, out=out, timeout=120)
    got = json.loads((out / "sync-0.json").read_text())
    assert got == [[s, [[s / 10], [s / 10], [s / 100]]] for s in (0, 300, 600)]


def _msgs(*steps: int) -> deque:
    return deque(Message(s, 0.0, s) for s in steps)


def test_settle_matches_only_equal_steps() -> None:
    from instride.flow.patterns import _settle

    # a head past the target after the others dropped to it: the target goes up
    pending = [_msgs(30, 60, 90, 120), _msgs(100)]
    assert list(_settle(pending)) == [] and [list(q) for q in pending] == [[Message(120, 0.0, 120)], []]
    pending = [_msgs(0, 10, 20, 30), _msgs(0, 30), _msgs(30)]
    assert [[m.step for m in ms] for ms in _settle(pending)] == [[30, 30, 30]]
    assert all(not q for q in pending)


def test_sharing_follows_every_connection_back() -> None:
    from instride.flow.patterns import _sharing

    g = Graph("sharing")
    src = g.module("src", modules.numbers, outputs={"out": "array"})
    other = g.module("other", modules.numbers, outputs={"out": "array"})
    f1 = patterns.filter(g, "f1", src.output("out"), modules.every_thirty)
    f2 = patterns.filter(g, "f2", f1, modules.every_hundred)  # (two hops from src)
    sync = patterns.synchronize(g, "sync", [src.output("out"), other.output("out"), f2])
    assert _sharing(g, "sync", 0, ["in0", "in1", "in2"]) == [{2}, set(), {0}]
    assert sync.module == "sync"


def test_pattern_errors() -> None:
    g = Graph("bad")
    src = g.module("src", modules.ranked, outputs={"out": "array"}, instances=2)
    with pytest.raises(GraphError, match="arity"):
        patterns.reduce_tree(g, "t", src.output("out"), arity=1)
    rec = g.module("rec", modules.record, inputs={"in": "array"}, instances=3)
    with pytest.raises(GraphError, match="n_to_n"):
        patterns.n_to_n(g, src.output("out"), rec.input("in"))
    with pytest.raises(GraphError, match="not an output"):
        patterns.gather(g, "x", [rec.input("in")])
    # a broadcast of several instances would give each input several connections
    with pytest.raises(GraphError, match=r"broadcast: src.out has 2 instances.*gather"):
        patterns.broadcast(g, src.output("out"), [rec.input("in")])
    assert len(patterns.broadcast(g, src.output("out")[1], [rec.input("in")])) == 3
    g.validate()
    for bad in (0, 1.5, True):
        with pytest.raises(GraphError, match="max_pending"):
            patterns.synchronize(g, "s", [src.output("out")], max_pending=bad)


class _ScriptedPorts:
    """The ports of a synchronizer whose inputs deliver what a script says, batch by batch
    (which inputs are ready at each ``wait_any``): the order of a batch's reads, alone."""

    def __init__(self, graph: Graph, batches: list[dict[str, list[int]]]) -> None:
        self.graph, self.module, self.instance = graph, "sync", 0
        self.queued: dict[str, deque] = {"in0": deque(), "in1": deque()}
        self.batches = batches
        self.sent: list[int] = []

    def wait_any(self, names: list[str]) -> list[str]:
        if self.batches:
            for name, steps in self.batches.pop(0).items():
                self.queued[name].extend(Message(s, 0.0, s) for s in steps)
        else:  # the script is over: every input ends
            for q in self.queued.values():
                q.append(None)
        return [n for n in names if self.queued[n]]

    def get(self, name: str) -> Message | None:
        return self.queued[name].popleft()

    def put(self, port: str, data: object, step: int, time: float) -> None:
        self.sent.append(step)


def test_synchronize_reads_what_settles_a_step_before_judging_a_full_input() -> None:
    """One batch holding both the full input's next message and the message the other input
    was awaited for: the full input was read first and the module failed (FlowError), though
    the other message settled a step and made room."""
    from instride.flow.patterns import sync_module

    g = Graph("batch")
    src = g.module("src", modules.numbers, outputs={"out": "array"})
    sparse = patterns.filter(g, "sparse", src.output("out"), modules.every_hundred)
    patterns.synchronize(g, "sync", [src.output("out"), sparse], max_pending=2)
    ports = _ScriptedPorts(g, [{"in0": [0]}, {"in0": [10]}, {"in0": [20], "in1": [0]}])
    sync_module(ports, 2, "instride.flow.patterns:stack", max_pending=2)  # type: ignore[arg-type]
    assert ports.sent == [0]
