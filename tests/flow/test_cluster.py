"""A graph across emulated nodes (network namespaces, cluster mode: Redis + a data server per
node): messages cross nodes, placement is honoured, nothing is left on any node."""

from __future__ import annotations

import json
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from instride.emulate import EmulatedCluster
from instride.flow import EmulatedLauncher, Graph, UnknownNodeError, patterns, run

from . import modules
from .test_runner import SENT, programs_and_sinks

pytestmark = pytest.mark.root


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmulatedCluster]:
    with EmulatedCluster(nodes=2, name="flow" + secrets.token_hex(4)) as c:
        yield c


def test_graph_across_emulated_nodes(cluster: EmulatedCluster, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INSTRIDE_FLOW_STATE", str(tmp_path / "state"))
    out = tmp_path / "out"
    g = Graph("xnode")
    src = g.module("src", modules.ranked, outputs={"out": "array"}, nodes=["node1", "node2"],
                   per_node=1, params={"n": 3})
    frames = g.module("frames", modules.count, outputs=["frames"], nodes=["node1"],
                      params={"n": 3})
    tot = g.module("tot", modules.total, inputs=["frames"], outputs={"sums": "array"},
                   nodes=["node2"])
    g.connect(frames.output("frames"), tot.input("frames"))  # a frame stream node1 -> node2
    g.connect(tot.output("sums"), g.module("rec_sums", modules.record, inputs={"in": "array"},
                                            nodes=["node1"], params={"name": "sums"})
              .input("in"))
    both = patterns.gather(g, "gather", src.output("out"))
    g.connect(both, g.module("rec", modules.record, inputs={"in": "array"}, nodes=["node2"],
                             params={"name": "gathered"}).input("in"))
    result = run(g, out=out, launcher=EmulatedLauncher(cluster), timeout=180)

    assert json.loads((out / "gathered-0.json").read_text()) == [
        [10 * k, [float(k), 100.0 + k]] for k in range(3)]
    assert json.loads((out / "sums-0.json").read_text()) == [
        [10 * k, [12.0 * k]] for k in range(3)]
    assert result.instance("src", 1)["node"] == "node2"
    assert result.instance("tot")["node"] == "node2"
    # nothing left: no record in Redis, no file under any node's managed directory
    code = "from instride.client import get_client; print(len(get_client().list('flow/')))"
    left = cluster.run(1, [sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert left.returncode == 0 and left.stdout.strip() == "0", left.stderr
    for node in cluster.nodes:
        assert not (Path(node.dir) / "flow").exists()


def test_programs_that_exit_without_closing_their_ports(
        cluster: EmulatedCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cluster mode: what a program (``command=``) that exited with status 0 without
    ``ports.close()`` left open is closed on its node, its streams' heads and groups in Redis:
    its outputs end (read on another node), and a program that stopped reading early gives its
    consumer group back (its lease freed at once: its holder, of this node, has exited), so its
    producer goes on to its end."""
    monkeypatch.setenv("INSTRIDE_FLOW_STATE", str(tmp_path / "state"))
    out = tmp_path / "out"
    g = programs_and_sinks("xnoclose", 3, nodes=(["node1"], ["node2"]))
    src = g.module("src", modules.numbers, outputs={"out": "array"}, nodes=["node1"],
                   params={"n": 20})
    code = "from instride.flow import from_env; p = from_env(); p.wait(); p.get('in')"
    early = g.module("early", command=[sys.executable, "-c", code], inputs={"in": "array"},
                     nodes=["node2"])
    g.connect(src.output("out"), early.input("in"), retain=2)
    result = run(g, out=out, launcher=EmulatedLauncher(cluster), timeout=180)
    for i, want in enumerate([SENT, SENT, {"frames": [], "in": []}]):
        assert json.loads((out / f"got-{i}.json").read_text()) == want, i
    assert result.instance("src")["outputs"]["out"]["msgs"] == 20


def test_placement_on_unknown_node_is_refused(cluster: EmulatedCluster) -> None:
    g = Graph("where")
    g.module("src", modules.numbers, outputs={"out": "array"}, nodes=["node7"])
    with pytest.raises(UnknownNodeError, match="node 'node7'.*node1"):
        run(g, launcher=EmulatedLauncher(cluster))
