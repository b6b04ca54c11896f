"""Channels (bounded flow streams): retention, back-pressure, a stalled or dead consumer, early return."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import instride
from instride.errors import InstrideError
from instride.flow import FlowError, Graph, GraphError, ModuleFailed, PortBlocked, Ports, run
from instride.flow.launchers import LocalLauncher
from instride.flow.ports import PortPolicy, encode_message, port_policy

from . import modules

RETAIN = 4


def test_long_chain_stays_bounded_and_loses_nothing(flow_env: dict[str, Path]) -> None:
    out = flow_env["out"]
    n = 2000
    g = Graph("long", retain=RETAIN)
    src = g.module("src", modules.count, outputs=["frames"], params={"n": n, "every": 1})
    sink = g.module("sink", modules.watch_dirs, inputs={"in": "frame"},
                    params={"streams": ["src.0/frames"]})
    g.connect(src.output("frames"), sink.input("in"))
    result = run(g, out=out, timeout=600)
    watch = json.loads((out / "watch.json").read_text())
    assert watch["steps"] == list(range(n))  # every frame arrived, in order
    # the managed directory never held more than retain + 1 frames of the stream
    assert 1 <= watch["most"]["src.0/frames"] <= RETAIN + 1
    stats = result.instance("src")["outputs"]["frames"]
    assert (stats["retain"], stats["groups"], stats["msgs"]) == (RETAIN, ["sink.0.in"], n)
    assert result.instance("sink")["inputs"]["in"]["group"] == "sink.0.in"
    assert not (flow_env["managed"] / ".instride" / "streams" / "flow").exists()


def test_message_stream_bounded_and_early_return_does_not_hold_it(
        flow_env: dict[str, Path]) -> None:
    out = flow_env["out"]
    n = 200
    g = Graph("early", retain=2, put_timeout=60)
    src = g.module("src", modules.numbers, outputs={"out": "array"}, params={"n": n})
    early = g.module("early", modules.take_then_return, inputs={"in": "array"})
    sink = g.module("sink", modules.watch_dirs, inputs={"in": "array"},
                    params={"streams": ["src.0/out"]})
    g.connect(src.output("out"), early.input("in"))
    g.connect(src.output("out"), sink.input("in"))
    run(g, out=out, timeout=300)
    assert json.loads((out / "early.json").read_text()) == 3
    watch = json.loads((out / "watch.json").read_text())
    assert watch["steps"] == [10 * k for k in range(n)]
    assert 1 <= watch["most"]["src.0/out"] <= 3


def test_stalled_consumer_fails_the_producer_naming_port_and_group(
        flow_env: dict[str, Path]) -> None:
    g = Graph("stalled", retain=2, put_timeout=2)
    g.module("src", modules.numbers, outputs={"out": "array"}, params={"n": 50})
    g.module("hang", modules.stall, inputs={"in": "array"})
    g.connect("src.out", "hang.in")
    with pytest.raises(ModuleFailed) as info:
        run(g, timeout=300)
    err = info.value
    assert (err.module, err.instance) == ("src", 0)
    assert "PortBlocked" in err.log and "'out'" in err.log and "hang.0.in" in err.log


def test_killed_consumer_makes_put_raise_port_blocked(
        flow_env: dict[str, Path], tmp_path: Path) -> None:
    g = Graph("killed", retain=3, put_timeout=1.5)
    g.module("src", modules.numbers, outputs={"out": "array"})
    g.module("sink", modules.record, inputs={"in": "array"})
    g.connect("src.out", "sink.in")
    prefix = f"flow/killed-{os.getpid()}"
    spec = {"graph": g.to_dict(), "prefix": prefix, "state": None, "out": None,
            "trace": False}
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    ready = tmp_path / "ready"
    code = textwrap.dedent(f"""
        import pathlib, time
        from instride.flow import from_env
        ports = from_env()
        ports.wait(); ports.get("in")
        pathlib.Path({str(ready)!r}).write_text("took one")
        time.sleep(600)
    """)
    env = {**os.environ, "INSTRIDE_FLOW_SPEC": str(spec_path), "INSTRIDE_FLOW_MODULE": "sink",
           "INSTRIDE_FLOW_INSTANCE": "0"}
    producer = Ports(spec, "src", 0)
    consumer = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        producer.put("out", np.array([0.0]), step=0)
        for _ in range(600):
            if ready.exists() or consumer.poll() is not None:
                break
            time.sleep(0.1)
        assert ready.exists(), "the consumer did not start"
        os.kill(consumer.pid, signal.SIGKILL)
        consumer.wait()
        with pytest.raises(PortBlocked) as info:
            for k in range(1, 50):
                producer.put("out", np.array([float(k)]), step=k)
        err = info.value
        assert isinstance(err, InstrideError) and isinstance(err, TimeoutError)
        assert (err.module, err.instance, err.port, err.groups) == ("src", 0, "out", ["sink.0.in"])
        assert "sink.0.in" in str(err) and "'out'" in str(err)
    finally:
        if consumer.poll() is None:
            os.kill(consumer.pid, signal.SIGKILL)
            consumer.wait()
        producer.close()
        LocalLauncher().cleanup(prefix)


def test_port_policies_follow_the_connections() -> None:
    g = Graph("policies", retain=8)
    src = g.module("src", modules.count, outputs=["frames", "only_sampled"])
    a = g.module("a", modules.record, inputs=["in"])
    b = g.module("b", modules.record, inputs=["in"], instances=2)
    s = g.module("s", modules.record, inputs=["in", "other"])
    cmd = g.module("cmd", command=["true"], inputs=["in"])
    g.connect(src.output("frames"), a.input("in"), stride=3)
    g.connect(src.output("frames"), b.input("in"))  # broadcast: one group per instance
    g.connect(src.output("frames"), s.input("in"), sampling="newest")
    g.connect(src.output("only_sampled"), s.input("other"), sampling="newest")
    mixed = port_policy(g, "src", 0, "frames")
    assert mixed == PortPolicy(8, "block", ("a.0.in", "b.0.in", "b.1.in"))
    assert port_policy(g, "src", 0, "only_sampled") == PortPolicy(1, "latest", ())
    g2 = Graph.from_dict(g.to_dict())  # the retention survives the trip to the instances
    assert port_policy(g2, "src", 0, "frames") == mixed
    # a connection asking for more wins; a program reading the stream keeps everything
    g.connect(src.output("frames"), cmd.input("in"))
    assert port_policy(g, "src", 0, "frames").retain is None
    h = Graph("more", retain=8)
    p = h.module("p", modules.numbers, outputs={"out": "array"})
    q = h.module("q", modules.record, inputs={"in": "array"})
    h.connect(p.output("out"), q.input("in"), retain=100)
    assert port_policy(h, "p", 0, "out").retain == 100
    with pytest.raises(GraphError, match="retain"):
        Graph("bad", retain=0)


def test_values_a_port_cannot_carry_are_refused_naming_the_port() -> None:
    with pytest.raises(FlowError, match="array of Python objects"):
        encode_message("array", np.array([{"a": 1}, None], dtype=object), 0, 0.0)
    with pytest.raises(FlowError, match="float32 as JSON"):
        encode_message("json", np.float32(1.5), 0, 0.0)
    with pytest.raises(FlowError, match="set as JSON"):
        encode_message("any", {1, 2}, 0, 0.0)
    with pytest.raises(FlowError, match="str as bytes"):
        encode_message("bytes", "text", 0, 0.0)


@pytest.mark.parametrize(("kind", "what"), [("array", "objects"), ("json", "float32")])
def test_unsendable_value_fails_its_producer(flow_env: dict[str, Path], kind: str,
                                             what: str) -> None:
    g = Graph(f"unsendable-{kind}")
    g.module("src", modules.send_unsendable, outputs={"out": kind}, params={"what": what})
    g.module("sink", modules.record, inputs={"in": kind})
    g.connect("src.out", "sink.in")
    with pytest.raises(ModuleFailed) as info:
        run(g, timeout=120)
    err = info.value
    assert (err.module, err.instance) == ("src", 0)  # the producer, not its consumer
    assert f"module 'src' instance 0 output 'out' ({kind})" in err.log


def test_a_step_that_is_no_whole_number_fails_its_producer(flow_env: dict[str, Path]) -> None:
    """``put(..., step=7.9)`` was truncated to step 7 (merged with step 7 downstream, as in
    ``synchronize``) where the docs promise a FlowError; a whole float (``7.0``) and numpy's
    integers are steps."""
    g = Graph("steps")
    g.module("src", modules.send_steps, outputs={"out": "array"},
             params={"steps": [1, 7.0, 8, 7.9]})
    g.module("sink", modules.record, inputs={"in": "array"})
    g.connect("src.out", "sink.in")
    with pytest.raises(ModuleFailed) as info:
        run(g, timeout=120)
    assert info.value.module == "src"
    assert "step must be a whole number" in info.value.log and "7.9" in info.value.log


def test_a_frame_consumer_that_forked_and_returned_early_releases_its_producer(
        flow_env: dict[str, Path]) -> None:
    """A frame consumer that returns early with a child it forked still alive: its port's
    close took the group again to finish it, the child held the group's lock (inherited),
    the group stayed where it was, and the producer waited for it until PortBlocked. The
    group is finished through the reader's own cursor now."""
    g = Graph("forked", retain=4, put_timeout=20)
    g.module("src", modules.count, outputs=["frames"], params={"n": 40})
    g.module("early", modules.fork_then_return, inputs={"in": "frame"})
    g.connect("src.frames", "early.in")
    result = run(g, timeout=60)
    assert result.instance("src")["outputs"]["frames"]["msgs"] == 40


@pytest.mark.parametrize("value", ["text", np.zeros(5), np.zeros((4, 2))])
def test_a_frame_port_refuses_what_is_no_frame_naming_the_port(
        flow_env: dict[str, Path], value: object) -> None:
    """A frame port passed the stream's bare ValueError (or appended a string's bytes)."""
    from instride.flow.channels import Writer, stream_name

    w = Writer(instride.get_client(), stream_name("flow/x", "m", 0, "out"), "frame",
               owner=("m", 0, "out"))
    try:
        with pytest.raises(FlowError, match=r"module 'm' instance 0 output 'out' \(frame\)"):
            w.put(value, 0)
    finally:
        w.close()
        shutil.rmtree(flow_env["managed"] / "flow", ignore_errors=True)
        shutil.rmtree(flow_env["managed"] / ".instride" / "streams" / "flow", ignore_errors=True)


def test_a_bounded_message_port_leaves_no_mark_per_message_in_redis(tmp_path: Path,
                                                                     redis_server) -> None:  # type: ignore[no-untyped-def]
    """A message port (arrays, bytes, JSON) is a bounded channel that retires its oldest
    message per message; retired with the user's ``delete``, each left a publication mark in
    Redis for 11 minutes (what keeps a retried publication from coming back over a delete):
    ~860,000 marks, ~150 MB, per port at its rate here. Its messages' publications were
    answered long before: they are retired without one."""
    import redis as redis_py

    from instride.client import Client
    from instride.config import Settings
    from instride.flow.channels import _MessageQueue
    from instride.store.streamstate import Policy

    client = Client(Settings(dir=tmp_path, redis_url=redis_server.url, addr="127.0.0.1:1",
                             connect_timeout=5))
    direct = redis_py.Redis.from_url(redis_server.url)
    try:
        queue = _MessageQueue(client, "port1", Policy(retain=4, on_full="drop-oldest"), (), 5)
        for _ in range(200):
            queue.publish(b"m" * 16)
        assert len(direct.keys("instride:rec:port1/*")) <= 5  # (bounded: retired as it goes)
        assert direct.keys("instride:was:*") == []
        # (the user's own delete still leaves its two: a retry of that publication, and one
        # of the delete itself, find them done)
        client.delete("port1/" + sorted(client.list("port1/"))[-1].rpartition("/")[2])
        marks = [k.decode() for k in direct.keys("instride:was:*")]
        assert len(marks) == 2, marks
        assert sum(m.startswith("instride:was:del:") for m in marks) == 1, marks
    finally:
        client.close()
        direct.close()
