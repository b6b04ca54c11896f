"""Graph building and validation: bad graphs are refused before anything starts."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from instride.errors import InstrideError
from instride.flow import (
    DeadlockError,
    Graph,
    GraphError,
    Input,
    PortTypeError,
    UnconnectedInputError,
    UnknownModuleError,
    UnknownNodeError,
)

from . import modules


def pipeline() -> Graph:
    g = Graph("p")
    src = g.module("src", modules.count, outputs=["frames"], instances=2)
    tot = g.module("tot", modules.total, inputs=["frames"], outputs={"sums": "array"},
                   instances=2)
    g.connect(src.output("frames"), tot.input("frames"))
    return g


def test_one_to_one_and_broadcast_expansion() -> None:
    g = pipeline()
    assert [(e.src_instance, e.dst_instance) for e in g.edges] == [(0, 0), (1, 1)]
    one = g.module("one", modules.numbers, outputs={"out": "array"})
    many = g.module("many", modules.record, inputs={"in": "array"}, instances=3)
    edges = g.connect(one.output("out"), many.input("in"))
    assert [(e.src_instance, e.dst_instance) for e in edges] == [(0, 0), (0, 1), (0, 2)]
    g.validate()


def test_plain_data_round_trip() -> None:
    g = pipeline()
    data = json.loads(json.dumps(g.to_dict()))
    back = Graph.from_dict(data)
    assert back.to_dict() == g.to_dict()
    assert back.modules["src"].target == "tests.flow.modules:count"


def test_unconnected_blocking_input() -> None:
    g = Graph("g")
    g.module("tot", modules.total, inputs=["frames"], outputs={"sums": "array"})
    with pytest.raises(UnconnectedInputError, match=r"tot\[0\]\.frames is not connected"):
        g.validate()
    # a non-blocking input may stay unconnected (FlowVR: get() returns nothing)
    g2 = Graph("g2")
    g2.module("s", modules.steerable, inputs={"control": Input("json", blocking=False)},
              outputs={"out": "array"})
    g2.validate()


def test_port_type_mismatch() -> None:
    g = Graph("g")
    a = g.module("a", modules.numbers, outputs={"out": "array"})
    b = g.module("b", modules.total, inputs=["frames"], outputs={"sums": "array"})
    g.connect(a.output("out"), b.input("frames"))
    with pytest.raises(PortTypeError, match="sends 'array' messages but b.frames expects 'frame'"):
        g.validate()


def test_cycle_without_token_is_a_deadlock() -> None:
    g = Graph("loop")
    a = g.module("a", modules.ping, inputs={"back": "json"}, outputs={"out": "json"})
    b = g.module("b", modules.pong, inputs={"in": "json"}, outputs={"out": "json"})
    g.connect(a.output("out"), b.input("in"))
    g.connect(b.output("out"), a.input("back"))
    with pytest.raises(DeadlockError, match=r"a\[0\] -> b\[0\] -> a\[0\]"):
        g.validate()
    g.edges.pop()
    g.connect(b.output("out"), a.input("back"), initial=1)
    g.validate()


def test_cycle_through_non_blocking_input_is_fine() -> None:
    g = Graph("steer")
    s = g.module("s", modules.steerable, inputs={"control": Input("json", blocking=False)},
                 outputs={"out": "array"})
    c = g.module("c", modules.controller, inputs={"in": "array"}, outputs={"control": "json"})
    g.connect(s.output("out"), c.input("in"))
    g.connect(c.output("control"), s.input("control"))
    g.validate()


def test_unknown_module_port_node() -> None:
    g = pipeline()
    with pytest.raises(UnknownModuleError, match="no module 'nope'"):
        g.connect("src.frames", "nope.x")
    with pytest.raises(UnknownModuleError, match="no input port 'x'"):
        g.connect("src[0].frames", "tot[1].x")
    g.module("placed", modules.numbers, outputs={"out": "array"}, nodes=["node9"])
    g.validate()  # no launcher nodes given: placement not checked
    with pytest.raises(UnknownNodeError, match="node 'node9'"):
        g.validate(nodes=["node1", "node2"])


def test_other_bad_graphs() -> None:
    g = Graph("g")
    a = g.module("a", modules.count, outputs=["frames"], instances=2)
    b = g.module("b", modules.total, inputs=["frames"], outputs={"sums": "array"},
                 instances=3)
    with pytest.raises(GraphError, match="use a pattern"):
        g.connect(a.output("frames"), b.input("frames"))
    with pytest.raises(GraphError, match="already in graph"):
        g.module("a", modules.count)
    with pytest.raises(GraphError, match="top level"):
        g.module("lam", lambda ports: None)
    c = g.module("c", modules.count, outputs=["frames"])
    g.connect(c.output("frames"), b.input("frames"))
    g.connect(a.output("frames", 0), b.input("frames", 0))
    with pytest.raises(GraphError, match="two connections"):
        g.validate()
    with pytest.raises(GraphError, match="tokens"):
        h = Graph("h")
        x = h.module("x", modules.count, outputs=["frames"])
        y = h.module("y", modules.total, inputs=["frames"], outputs={"sums": "array"})
        h.connect(x.output("frames"), y.input("frames"), initial=1)
        h.validate()
    assert issubclass(GraphError, InstrideError) and issubclass(GraphError, ValueError)


def test_per_node_placement() -> None:
    g = Graph("g")
    m = g.module("m", modules.numbers, outputs={"out": "array"}, nodes=["n1", "n2"], per_node=2)
    assert m.instances == 4
    assert g.placement(["n1", "n2"]) == {("m", 0): "n1", ("m", 1): "n1", ("m", 2): "n2",
                                         ("m", 3): "n2"}


def test_mpi_module_on_one_node() -> None:
    g = Graph("g")
    with pytest.raises(GraphError, match="mpi module runs on one node"):
        g.module("m", modules.numbers, instances=2, nodes=["n1", "n2"], mpi=True)


def test_port_names_and_node_lists_are_checked() -> None:
    g = Graph("g")
    with pytest.raises(GraphError, match=r"input port name '\.\./\.\./x'"):
        g.module("a", modules.record, inputs={"../../x": "array"})
    with pytest.raises(GraphError, match="'o' and 'O' differ only in case"):
        g.module("b", modules.numbers, outputs={"o": "array", "O": "array"})
    with pytest.raises(GraphError, match="'my-out' and 'my_out' differ only in case or in '-'"):
        g.module("b", modules.numbers, outputs={"my-out": "array", "my_out": "array"})
    with pytest.raises(GraphError, match=r"nodes=\['node1'\]"):
        g.module("c", modules.numbers, outputs={"out": "array"}, nodes="node1")
    assert g.modules == {}  # nothing was added
    # a graph from plain data is checked by validate()
    ok = Graph("ok")
    ok.module("src", modules.numbers, outputs={"out": "array"})
    data = ok.to_dict()
    data["modules"][0]["outputs"] = {"a/b": "array"}
    with pytest.raises(GraphError, match="output port name 'a/b'"):
        Graph.from_dict(data).validate()


def test_params_must_be_json() -> None:
    g = Graph("g")
    with pytest.raises(GraphError, match="module 'a': params must be JSON.*float32"):
        g.module("a", modules.numbers, outputs={"out": "array"}, params={"n": np.float32(1)})
    m = g.module("b", modules.numbers, outputs={"out": "array"})
    m.params["n"] = {1, 2}  # changed after the module was added
    with pytest.raises(GraphError, match="module 'b': params must be JSON.*set"):
        g.validate()


def test_validate_imports_module_functions() -> None:
    g = Graph("g")
    g.module("a", "nosuchpkg.mod:func")
    with pytest.raises(GraphError, match="cannot import 'nosuchpkg.mod'"):
        g.validate()
    h = Graph("h")
    h.module("a", "tests.flow.modules:does_not_exist")
    with pytest.raises(GraphError, match="no 'does_not_exist' there"):
        h.validate()


@pytest.mark.parametrize(("change", "match"), [
    (lambda m: m.update(name="../evil"), "module name"),
    (lambda m: m.update(params=[1]), "params"),
    (lambda m: m.update(instances="1"), "instances"),
    (lambda m: m.update(nodes="local"), "nodes"),
    (lambda m: m.update(unknown=1), "not the data of a graph"),
    (lambda m: m.pop("inputs"), "not the data of a graph"),
])
def test_a_graph_from_data_is_checked_module_by_module(change: Any, match: str) -> None:
    """A graph rebuilt from data skips Graph.module(): a module named ``../evil`` passed
    validate() (every instance failed, its log written outside the run's logs), other fields
    raised bare TypeError/KeyError or failed at run time."""
    g = Graph("data")
    g.module("src", modules.numbers, outputs={"out": "array"})
    data = g.to_dict()
    change(data["modules"][0])
    with pytest.raises(GraphError, match=match):
        Graph.from_dict(data).validate(["local"])


def test_a_method_bound_to_an_instance_is_refused() -> None:
    """``graph.module("x", Analyzer(2.0).run)`` was recorded as ``Analyzer.run``, the instance
    dropped: each instance called it with its ports as ``self``."""
    g = Graph("bound")
    with pytest.raises(GraphError, match="bound to an instance"):
        g.module("x", modules.ScaleModule(2.0).process, inputs={"in": "array"})


def test_flow_errors_pickle_to_themselves() -> None:
    """ModuleFailed and PortBlocked did not unpickle (a flow run in a process pool or an MPI
    rank raised TypeError instead)."""
    import pickle

    from instride.flow import ModuleFailed, PortBlocked

    for err in (ModuleFailed("m", 1, -9, "log tail"), PortBlocked("m", 0, "out", ["a.0.in"], 2.5)):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
        assert back.__dict__ == err.__dict__
