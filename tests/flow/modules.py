"""Module functions used by the flow tests (importable, so instances can find them)."""

from __future__ import annotations

import json
import os
import time

import numpy as np

from instride.flow import ModuleBase


def count(ports, n=5, natoms=4, every=10, delay=0.0):
    """Source: ``n`` frames at steps 0, every, 2*every ...; positions filled with the index."""
    for k in range(n):
        ports.put("frames", np.full((natoms, 3), float(k), dtype=np.float32), step=k * every,
                  time=k * 0.02)
        if delay:
            time.sleep(delay)


def numbers(ports, n=5, every=10, delay=0.0, port="out"):
    """Source of arrays ``[k]`` at steps ``k * every``."""
    for k in range(n):
        ports.put(port, np.array([float(k)]), step=k * every)
        if delay:
            time.sleep(delay)


def quits(ports, n=3):
    """Source of arrays ``[k]`` at steps ``k``, then out by ``os._exit(0)``: no ``close()``."""
    for k in range(n):
        ports.put("out", np.array([float(k)]), step=k)
    os._exit(0)


def total(ports):
    """frames -> array: the sum of the positions, same step."""
    while ports.wait():
        msg = ports.get("frames")
        ports.put("sums", np.array([float(msg.data.sum())]), step=msg.step)


def record(ports, name="record", port="in"):
    """Write every message received on ``port`` (step, data) to ``out_dir/<name>.json``."""
    got = []
    while ports.wait():
        msg = ports.get(port)
        data = msg.data.tolist() if isinstance(msg.data, np.ndarray) else msg.data
        got.append([msg.step, data])
    (ports.out_dir / f"{name}-{ports.instance}.json").write_text(json.dumps(got))


def slow_record(ports, name="slow", port="in", delay=0.2):
    """Like :func:`record`, but slow: sleeps after every message."""
    got = []
    while ports.wait():
        msg = ports.get(port)
        got.append(msg.step)
        time.sleep(delay)
    (ports.out_dir / f"{name}.json").write_text(json.dumps(got))


def crash_after(ports, n=2, after_pid_of=None):
    """Consume ``n`` messages, then fail.

    With ``after_pid_of``, fail only once that module has written its pid file (so a test
    knows which process the runner must stop, however slowly the sibling started).
    """
    for _ in range(n):
        ports.wait()
        ports.get("in")
    deadline = time.monotonic() + 60
    while after_pid_of and not list(ports.out_dir.glob(f"{after_pid_of}-*.pid")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{after_pid_of} never started")
        time.sleep(0.05)
    raise RuntimeError("boom: analysis diverged")


def sleeper(ports):
    """Never returns on its own (stopped by the runner)."""
    open(ports.out_dir / f"sleeper-{os.getpid()}.pid", "w").close()
    while True:
        time.sleep(0.1)


def ping(ports, n=5):
    """Loop head: waits on ``back`` (blocking), sends ``k`` on ``out``; ``n`` rounds."""
    seen = []
    for k in range(n):
        if not ports.wait():
            break
        msg = ports.get("back")
        seen.append([msg.step, msg.token])
        ports.put("out", {"k": k}, step=k)
    (ports.out_dir / "ping.json").write_text(json.dumps(seen))


def pong(ports):
    """Loop tail: echoes every ``in`` message back on ``out``."""
    while ports.wait():
        msg = ports.get("in")
        ports.put("out", msg.data, step=msg.step)


def steerable(ports, n=200, every=1, delay=0.01):
    """Source with a non-blocking ``control`` input: {"every": k} changes its interval,
    {"stop": true} stops it; writes the steps it sent."""
    sent, controls = [], []
    step = 0
    while step < n:
        ctl = ports.get("control")
        if ctl is not None:
            controls.append(ctl.data)
            if ctl.data.get("stop"):
                break
            every = int(ctl.data.get("every", every))
        ports.put("out", np.array([float(step)]), step=step)
        sent.append(step)
        step += every
        time.sleep(delay)
    (ports.out_dir / "steerable.json").write_text(json.dumps({"sent": sent, "controls": controls}))


def controller(ports, switch_at=3, stop_at=8):
    """Receives ``in``; after ``switch_at`` messages asks for every=5, after ``stop_at`` stops."""
    k = 0
    while ports.wait():
        ports.get("in")
        k += 1
        if k == switch_at:
            ports.put("control", {"every": 5}, step=k)
        if k == stop_at:
            ports.put("control", {"stop": True}, step=k)


def ranked(ports, n=4, every=10):
    """Source of arrays ``[100 * instance + k]`` at steps ``k * every``."""
    for k in range(n):
        ports.put("out", np.array([100.0 * ports.instance + k]), step=k * every)


def every_twenty(msg):
    """Filter predicate: steps that are multiples of 20."""
    return msg.step % 20 == 0


def every_hundred(msg):
    """Filter predicate: steps that are multiples of 100."""
    return msg.step % 100 == 0


def every_thirty(msg):
    """Filter predicate: steps that are multiples of 30."""
    return msg.step % 30 == 0


class ScaleModule(ModuleBase):
    """A class-based module: multiplies ``in`` by ``factor`` onto ``out``."""

    def __init__(self, factor=2.0):
        self.factor = factor
        self.seen = 0

    def process(self, msgs):
        self.seen += 1
        return {"out": msgs["in"].data * self.factor}

    def finish(self, ports):
        (ports.out_dir / "scale.json").write_text(str(self.seen))


def relay_steps(ports):
    """frames -> array ``[step]``: a middle stage whose own stream is a message stream."""
    while ports.wait():
        msg = ports.get("frames")
        ports.put("out", np.array([msg.step]), step=msg.step)


def watch_dirs(ports, streams=(), delay=0.0005, port="in"):
    """Slow sink: after every message, counts the published messages of each of ``streams``
    (``"<module>.<instance>/<port>"`` of this run); writes the steps and the largest counts."""
    root = ports.client.root / ports.spec["prefix"]
    steps, most = [], dict.fromkeys(streams, 0)
    while ports.wait():
        msg = ports.get(port)
        steps.append(int(msg.step))
        for name in streams:
            with os.scandir(root / name) as it:
                n = sum(1 for e in it if e.name.startswith(("frame_", "msg_")))
            most[name] = max(most[name], n)
        time.sleep(delay)
    (ports.out_dir / "watch.json").write_text(json.dumps({"steps": steps, "most": most}))


def take_then_return(ports, n=3, port="in"):
    """Take ``n`` messages, then return early (its producer must not wait for it any more)."""
    for _ in range(n):
        if not ports.wait():
            break
        ports.get(port)
    (ports.out_dir / "early.json").write_text(json.dumps(n))


def stall(ports, port="in"):
    """Take one message, then hang without taking more (a stalled consumer)."""
    ports.wait()
    ports.get(port)
    time.sleep(600)


def json_numbers(ports, n=3, every=10):
    """Source of JSON objects ``{"k": k}`` at steps ``k * every``."""
    for k in range(n):
        ports.put("out", {"k": k}, step=k * every)


def send_unsendable(ports, what="objects"):
    """Sends one value its port's type cannot carry (the producer must fail, naming it)."""
    value = {"objects": np.array([{"a": 1}, None], dtype=object), "float32": np.float32(1.5),
             "set": {1, 2}}[what]
    ports.put("out", value, step=0)


def send_steps(ports, steps=(0,)):
    """Sends one array message per step of ``steps`` (a step that is no whole number must
    fail the producer, naming it)."""
    for step in steps:
        ports.put("out", np.array([1.0]), step=step)


def count_then_exit(ports, n=3):
    """Source: ``n`` frames, then ``sys.exit(0)`` (its outputs are ended all the same)."""
    import sys

    count(ports, n=n)
    sys.exit(0)


def record_ports(ports, name="got"):
    """Write every message of every input (``{port: [[step, data], ...]}``, in step) to
    ``out_dir/<name>-<instance>.json``; ends with the first input that ends."""
    got = {port: [] for port in ports.readers}
    while ports.wait():
        for port, seen in got.items():
            msg = ports.get(port)
            seen.append([msg.step, np.asarray(msg.data).tolist()])
    (ports.out_dir / f"{name}-{ports.instance}.json").write_text(json.dumps(got))


def fork_then_return(ports, n=2, port="in"):
    """Fork a child that outlives this module by a while (a fork-started pool not yet shut
    down), take ``n`` messages, then return early."""
    child = os.fork()
    if child == 0:
        time.sleep(8)
        os._exit(0)
    for _ in range(n):
        if not ports.wait():
            break
        ports.get(port)
