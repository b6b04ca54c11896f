"""Ports: FlowVR's ``wait`` / ``get`` / ``put`` over instride streams.

Inside a module, :class:`Ports` is the whole API:

* ``wait()`` blocks until every connected **blocking** input port has a message; it returns
  ``False`` once an input's producer ended its stream and no message is left (end of stream
  propagates: the module returns, its own outputs end).
* ``get(port)`` returns the oldest message of an input port (:class:`Message`, stamped with the
  MD step); on a **non-blocking** port it returns ``None`` when nothing arrived (control
  messages), and an unconnected non-blocking port always returns ``None``.
* ``put(port, data, step=...)`` sends a message on an output port; every input connected to it
  receives it (broadcast). An unconnected output drops it.

Each output port is one stream: frames go into an :class:`instride.Stream` (so any instride
consumer, or MDAnalysis through ``instride://``, can read it); arrays, bytes and JSON values go
into keys ``<stream>/msg_<index>.bin`` with the same end-of-stream marker. Every input keeps its
own cursor, so one stream feeds any number of inputs.

Examples
--------
A module function::

    def gyration(ports, selection="all"):
        while ports.wait():
            msg = ports.get("frames")
            ports.put("rg", radius_of_gyration(msg.data), step=msg.step)
"""

from __future__ import annotations

import json
import os
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..client import Client, get_client
from ..frames import Frame, frame_size
from ..stream import END_NAME, Stream
from .errors import FlowError
from .graph import Graph, Input
from .trace import Recorder

_MAGIC = b"IFLM"
_MSG_FORMAT = "msg_{:09d}.bin"
_MSG_RE = re.compile(r"msg_(\d{9})\.bin$")
STATS_INTERVAL = 0.5  # seconds between two stats files of one instance


@dataclass
class Message:
    """A message received on an input port.

    Attributes
    ----------
    step
        The MD step it belongs to (``-1`` for an initial token).
    time
        Simulation time (ps) for frames; what the sender passed otherwise.
    data
        Positions (``(natoms, 3)`` array) for frames; the array, bytes or JSON value sent.
    frame
        The whole :class:`instride.Frame` (box, header) for frame ports, else ``None``.
    index
        Position of the message in its stream.
    token
        ``True`` for an initial token (an empty message that unlocks a cycle).
    """

    step: int
    time: float
    data: Any
    frame: Frame | None = None
    index: int = 0
    token: bool = False


def stream_name(prefix: str, module: str, instance: int, port: str) -> str:
    """Name of the stream behind output ``port`` of ``module[instance]``."""
    return f"{prefix}/{module}.{instance}/{port}"


# ---------------------------------------------------------------------- message codec
def encode_message(kind: str, data: Any, step: int, time: float, token: bool = False) -> bytes:
    """Encode a non-frame message: magic, header length, JSON header, payload."""
    if kind == "any":
        kind = (
            "array" if isinstance(data, np.ndarray)
            else "bytes" if isinstance(data, (bytes, bytearray, memoryview)) else "json"
        )
    header: dict[str, Any] = {"kind": kind, "step": int(step), "time": float(time)}
    if token:
        header["token"] = True
        payload = b""
    elif kind == "array":
        arr = np.ascontiguousarray(data)
        header.update(dtype=arr.dtype.str, shape=list(arr.shape))
        payload = arr.tobytes()
    elif kind == "bytes":
        payload = bytes(data)
    elif kind == "json":
        payload = json.dumps(data).encode()
    else:
        raise FlowError(f"cannot send {type(data).__name__} on a {kind!r} port")
    head = json.dumps(header).encode()
    return _MAGIC + struct.pack("<I", len(head)) + head + payload


def decode_message(buf: memoryview | bytes, index: int) -> Message:
    """Decode what :func:`encode_message` wrote."""
    buf = memoryview(buf)
    if bytes(buf[:4]) != _MAGIC:
        raise FlowError(f"message {index} is not a flow message")
    (n,) = struct.unpack("<I", buf[4:8])
    header = json.loads(bytes(buf[8 : 8 + n]))
    payload = buf[8 + n :]
    step, t = header["step"], header["time"]
    if header.get("token"):
        return Message(step, t, None, index=index, token=True)
    kind = header["kind"]
    if kind == "array":
        data: Any = np.frombuffer(payload, dtype=header["dtype"]).reshape(header["shape"]).copy()
    elif kind == "bytes":
        data = bytes(payload)
    else:
        data = json.loads(bytes(payload))
    return Message(step, t, data, index=index)


# ---------------------------------------------------------------------- writers and readers
class Writer:
    """The sending end of one output port: one stream, any number of readers."""

    def __init__(self, client: Client, name: str, kind: str, tokens: int = 0) -> None:
        self.client, self.name, self.kind = client, name, kind
        self.count = 0
        self.bytes = 0
        self._stream = Stream(name, mode="w", client=client) if kind == "frame" else None
        for _ in range(tokens):
            self._publish(encode_message(kind, None, -1, 0.0, token=True))

    def _publish(self, body: bytes) -> None:
        key = f"{self.name}/{_MSG_FORMAT.format(self.count)}"
        with self.client.open(key, "wb") as fh:
            fh.write(body)
        self.count += 1
        self.bytes += len(body)

    def put(self, data: Any, step: int, time: float = 0.0, box: Any = None) -> None:
        """Publish one message."""
        if self._stream is not None:
            if isinstance(data, Frame):
                step, time, box = data.step, data.time, data.box if box is None else box
                data = data.positions
            positions = np.asarray(data)
            self._stream.append(positions, step=step, time=time, box=box)
            self.count += 1
            self.bytes += frame_size(len(positions), self._stream.layout)
        else:
            self._publish(encode_message(self.kind, data, step, time))

    def close(self) -> None:
        """Publish end-of-stream."""
        if self._stream is not None:
            self._stream.close()
        else:
            with self.client.open(f"{self.name}/{END_NAME}", "wb") as fh:
                fh.write(json.dumps({"frames": self.count}).encode())


class Reader:
    """The receiving end of one connection: its own cursor in the source's stream."""

    def __init__(
        self,
        client: Client,
        name: str,
        kind: str,
        start: int = 0,
        sampling: str = "all",
        stride: int = 1,
    ) -> None:
        self.client, self.name, self.kind = client, name, kind
        self.cursor = start
        self.sampling, self.stride = sampling, stride
        self.count = 0
        self.bytes = 0
        self.end_key = f"{name}/{END_NAME}"
        self._stream = Stream(name, mode="r", client=client) if kind == "frame" else None

    def key(self, index: int) -> str:
        if self._stream is not None:
            return self._stream.frame_key(index)
        return f"{self.name}/{_MSG_FORMAT.format(index)}"

    def available(self) -> bool:
        """Whether the next message is published."""
        return self.client.exists(self.key(self.cursor))

    def wait(self) -> bool:
        """Block until the next message is published (``True``) or the stream ended (``False``)."""
        key = self.key(self.cursor)
        if self.client.exists(key):
            return True
        got = self.client.wait_any([key, self.end_key])
        return got == key or self.client.exists(key)

    def _published(self) -> list[int]:
        if self._stream is not None:
            return self._stream.published()
        out = []
        for key in self.client.list(f"{self.name}/msg_"):
            m = _MSG_RE.search(key)
            if m and key.rpartition("/")[0] == self.name:
                out.append(int(m.group(1)))
        return out

    def take(self) -> Message:
        """Read the message at the cursor (or the newest one) and move past it."""
        index = self.cursor
        if self.sampling == "newest":
            index = max([i for i in self._published() if i >= self.cursor], default=index)
        if self._stream is not None:
            frame = self._stream.read(index)
            msg = Message(frame.step, frame.time, frame.positions, frame, index)
            size = frame_size(frame.natoms, frame.header.layout)
        else:
            buf = self.client.consume_bytes(self.key(index))
            size = len(buf)
            msg = decode_message(buf, index)
        self.cursor = index + (1 if self.sampling == "newest" else self.stride)
        self.count += 1
        self.bytes += size
        return msg


# ---------------------------------------------------------------------- the module API
class Ports:
    """The ports of one module instance: ``wait``, ``get``, ``put``.

    Built by the runner's worker (or :func:`from_env` in a command); not constructed by hand.

    Attributes
    ----------
    module, instance, node
        Who and where this is.
    params
        The module's parameters.
    out_dir
        The run's output directory (``instride flow run --out``), or ``None``.
    """

    def __init__(self, spec: dict[str, Any], module: str, instance: int,
                 client: Client | None = None) -> None:
        self.spec = spec
        self.graph = Graph.from_dict(spec["graph"])
        self.module, self.instance = module, int(instance)
        mod = self.graph.modules[module]
        self.params: dict[str, Any] = dict(mod.params)
        self.node = os.environ.get("INSTRIDE_NODE", "local")
        self.out_dir = Path(spec["out"]) if spec.get("out") else None
        self.client = client or get_client()
        prefix = spec["prefix"]
        self.input_specs: dict[str, Input] = dict(mod.inputs)
        self.readers: dict[str, Reader | None] = {p: None for p in mod.inputs}
        for e in self.graph.edges_into(module, self.instance):
            src_type = self.graph.modules[e.src].outputs[e.src_port]
            tokens = self.graph.tokens(e.src, e.src_instance, e.src_port)
            self.readers[e.dst_port] = Reader(
                self.client, stream_name(prefix, e.src, e.src_instance, e.src_port), src_type,
                start=tokens - e.initial, sampling=e.sampling, stride=e.stride,
            )
        connected = {e.src_port for e in self.graph.edges_from(module, self.instance)}
        self.writers: dict[str, Writer | None] = {}
        for port, kind in mod.outputs.items():
            self.writers[port] = (
                Writer(self.client, stream_name(prefix, module, self.instance, port), kind,
                       tokens=self.graph.tokens(module, self.instance, port))
                if port in connected else None
            )
        self.recorder = Recorder(enabled=bool(spec.get("trace", True)))
        state = spec.get("state")
        self._state = Path(state) if state else None
        self._started = time.time()
        self._flushed = 0.0
        self._closed = False
        self.flush()

    # ------------------------------------------------------------------ FlowVR API
    def wait(self) -> bool:
        """Block until every connected blocking input has a message.

        Returns
        -------
        bool
            ``False`` when a blocking input's stream ended with no message left: the module
            should return. A module without blocking inputs gets ``True`` at once.
        """
        with self.recorder.region("wait"):
            ok = all(
                r.wait() for p, r in self.readers.items()
                if r is not None and self.input_specs[p].blocking
            )
        self._maybe_flush()
        return ok

    def get(self, port: str) -> Message | None:
        """The oldest message of input ``port`` (the newest with ``sampling="newest"``).

        Returns
        -------
        Message or None
            ``None`` on a non-blocking port with no message, on an unconnected port, and at
            the end of the port's stream.
        """
        if port not in self.readers:
            raise FlowError(f"module {self.module!r} has no input port {port!r}")
        reader = self.readers[port]
        if reader is None:
            return None
        with self.recorder.region("get") as info:
            if self.input_specs[port].blocking:
                msg = reader.take() if reader.wait() else None
            else:
                msg = reader.take() if reader.available() else None
            if msg is not None:
                info["message"] = f"{reader.name}#{msg.index}"
        self._maybe_flush()
        return msg

    def put(self, port: str, data: Any, *, step: int, time: float = 0.0,
            box: Any = None) -> None:
        """Send ``data`` on output ``port``, stamped with the MD ``step``.

        Parameters
        ----------
        port
            Output port name.
        data
            Positions or an :class:`instride.Frame` (frame ports), an array, bytes, or a JSON
            value, as the port's type says.
        step, time, box
            MD step, time (ps) and box (frames) of the message.
        """
        if port not in self.writers:
            raise FlowError(f"module {self.module!r} has no output port {port!r}")
        writer = self.writers[port]
        if writer is None:
            return
        with self.recorder.region("put") as info:
            info["message"] = f"{writer.name}#{writer.count}"
            writer.put(data, int(step), float(time), box)
        self._maybe_flush()

    def connected(self, port: str) -> bool:
        """Whether ``port`` (input or output) has a connection."""
        return (self.readers.get(port) or self.writers.get(port)) is not None

    def close(self) -> None:
        """End every output stream (end of stream propagates downstream) and write stats."""
        if self._closed:
            return
        self._closed = True
        for w in self.writers.values():
            if w is not None:
                w.close()
        self.flush(done=True)

    # ------------------------------------------------------------------ counters
    def stats(self) -> dict[str, Any]:
        """Counters of this instance (what ``instride top`` shows)."""
        now = time.time()
        return {
            "module": self.module, "instance": self.instance, "node": self.node,
            "pid": os.getpid(), "started": self._started, "updated": now,
            "seconds": dict(self.recorder.seconds),
            "inputs": {p: None if r is None else {
                "stream": r.name, "msgs": r.count, "bytes": r.bytes, "cursor": r.cursor}
                for p, r in self.readers.items()},
            "outputs": {p: None if w is None else {
                "stream": w.name, "msgs": w.count, "bytes": w.bytes}
                for p, w in self.writers.items()},
        }

    def _maybe_flush(self) -> None:
        if self._state is not None and time.time() - self._flushed > STATS_INTERVAL:
            self.flush()

    def flush(self, done: bool = False) -> None:
        """Write the counters (and, when ``done``, the trace) into the run's state directory."""
        if self._state is None:
            return
        self._flushed = time.time()
        name = f"{self.module}.{self.instance}"
        path = self._state / "stats" / f"{name}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({**self.stats(), "done": done}))
        os.replace(tmp, path)
        if done:
            self.recorder.dump(self._state / "trace" / f"{name}.json",
                               {"module": self.module, "instance": self.instance,
                                "node": self.node})


def _instance_from_env() -> int:
    for var in ("INSTRIDE_FLOW_INSTANCE", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 0


def from_env(client: Client | None = None) -> Ports:
    """The :class:`Ports` of the module instance this process is (in a module command).

    Reads ``INSTRIDE_FLOW_SPEC`` (the run's spec file), ``INSTRIDE_FLOW_MODULE`` and the
    instance from ``INSTRIDE_FLOW_INSTANCE`` or the rank a native launcher gives
    (``PMI_RANK``, ``OMPI_COMM_WORLD_RANK``, ``SLURM_PROCID``).

    Raises
    ------
    FlowError
        Not started by ``instride flow run``.
    """
    spec_path = os.environ.get("INSTRIDE_FLOW_SPEC")
    module = os.environ.get("INSTRIDE_FLOW_MODULE")
    if not spec_path or not module:
        raise FlowError("not started by a flow runner (INSTRIDE_FLOW_SPEC/MODULE unset)")
    spec = json.loads(Path(spec_path).read_text())
    return Ports(spec, module, _instance_from_env(), client)
