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

Each output port is one **bounded** stream: frames go into an :class:`instride.Stream` (so any
instride consumer, or MDAnalysis through ``instride://``, can read it); arrays, bytes and JSON
values go into keys ``<stream>/msg_<index>.bin`` with the same head, consumer groups and
end-of-stream marker. The stream keeps at most the graph's ``retain`` messages (one more while
the newest is being published); every connected consumer instance reads it as its own consumer
group (``<module>.<instance>.<port>``), registered by the producer before its first message,
and a message is retired only when every group has taken it (``on_full="block"``), so a slow
consumer holds its producer back (back-pressure) and nothing is lost. A newest-message sampler
reads without a group (it never holds the producer back); a port read only by samplers keeps
just its newest message (``on_full="latest"``).

A message received is a view: frames point into the mapped frame file, which the producer
reuses once the group moved on, so ``msg.data`` is valid until the next ``get()`` on the same
port. A module that keeps a message longer keeps a copy (``msg.data.copy()``).

Examples
--------
A module function::

    def gyration(ports, selection="all"):
        while ports.wait():
            msg = ports.get("frames")
            ports.put("rg", radius_of_gyration(msg.data), step=msg.step)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..client import Client, get_client
from ..errors import ConsumeTimeout, GroupBusy, StreamFull
from ..frames import Frame, frame_size
from ..store.streamstate import Policy
from ..stream import END_NAME, Stream
from .errors import FlowError, PortBlocked
from .graph import Edge, Graph, Input
from .trace import Recorder

_MAGIC = b"IFLM"
_MSG_FORMAT = "msg_{:09d}.bin"
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
        Arrays (frame positions included) are read-only views of the received message,
        valid until the next ``get()`` on the same port: copy what you keep.
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
        # a read-only view of the message (zero copy): valid as long as it is referenced
        data: Any = np.frombuffer(payload, dtype=header["dtype"]).reshape(header["shape"])
    elif kind == "bytes":
        data = bytes(payload)
    else:
        data = json.loads(bytes(payload))
    return Message(step, t, data, index=index)


# ---------------------------------------------------------------------- bounded streams
#: A group cursor past every message: a consumer that returned takes nothing more, so its
#: producer no longer waits for it.
DONE = 2**62
#: Longest single wait of a reader before it looks at the stream's head again.
_SLICE = 0.25


def group_name(edge: Edge) -> str:
    """The consumer group the destination of ``edge`` reads its source's stream as:
    ``<module>.<instance>.<port>`` (shortened with a hash past 64 characters)."""
    name = f"{edge.dst}.{edge.dst_instance}.{edge.dst_port}"
    if len(name) > 64:
        name = f"{name[:47]}-{hashlib.sha1(name.encode()).hexdigest()[:16]}"
    return name


@dataclass(frozen=True)
class PortPolicy:
    """How the stream of one output port is bounded.

    Attributes
    ----------
    retain
        Messages kept at most (``None``: every message, until the run ends).
    on_full
        ``"block"`` (the producer waits for every group) or ``"latest"`` (only newest-message
        samplers read the port: keep the newest message only, never wait).
    groups
        One consumer group per connected consumer instance that takes every message.
    """

    retain: int | None
    on_full: str
    groups: tuple[str, ...]


def port_policy(graph: Graph, module: str, instance: int, port: str) -> PortPolicy:
    """The retention, policy and consumer groups of the stream of ``module[instance].port``."""
    edges = [e for e in graph.edges_from(module, instance) if e.src_port == port]
    groups = tuple(group_name(e) for e in edges if e.sampling != "newest")
    if edges and not groups:  # newest-message samplers only: FlowVR's greedy filter
        return PortPolicy(1, "latest", ())
    return PortPolicy(graph.retention(module, instance, port), "block", groups)


class _MessageQueue:
    """The bounded producer side of a non-frame port: ``<stream>/msg_<index>.bin`` keys with
    the head, policy and consumer groups of an :class:`instride.Stream` (the same shared
    state, so ``Stream``'s groups, ``instride top`` and the cleanup treat both alike)."""

    def __init__(self, client: Client, name: str, policy: Policy, groups: tuple[str, ...],
                 timeout: float | None) -> None:
        self.client, self.name, self.policy, self.timeout = client, name, policy, timeout
        self.share = client.engine.stream_state(client.key(name))
        self.share.start(policy, groups, reset=False)
        self.oldest = 0
        self.written = 0

    def key(self, index: int) -> str:
        return f"{self.name}/{_MSG_FORMAT.format(index)}"

    def publish(self, body: bytes) -> None:
        """Publish the next message, first retiring old ones per the policy."""
        self._make_room(wait=True)
        with self.client.open(self.key(self.written), "wb") as fh:
            fh.write(body)
        self.written += 1
        self.share.set_head(self.oldest, self.written)
        self._make_room(wait=False)

    def _make_room(self, *, wait: bool) -> None:
        retain = self.policy.retain
        if retain is None:
            return
        start = time.monotonic()
        while self.written - self.oldest > retain:
            if not self.policy.drops:
                holders = sorted(g for g, c in self.share.cursors().items() if c <= self.oldest)
                if holders:
                    if not wait:
                        return
                    waited = time.monotonic() - start
                    if self.timeout is not None and waited >= self.timeout:
                        raise StreamFull(self.name, waited, holders)
                    self.share.wait_progress(
                        1.0 if self.timeout is None else min(1.0, self.timeout - waited))
                    continue
            self.oldest += 1
            self.share.set_head(self.oldest, self.written)  # first: a sampler sees why
            self.client.delete(self.key(self.oldest - 1))

    def close(self) -> None:
        with self.client.open(f"{self.name}/{END_NAME}", "wb") as fh:
            fh.write(json.dumps({"frames": self.written}).encode())
        self.share.close()


# ---------------------------------------------------------------------- writers and readers
class Writer:
    """The sending end of one output port: one bounded stream, one consumer group per
    connected consumer instance.

    Parameters
    ----------
    client
        The instride client.
    name
        The stream name.
    kind
        The port's message type.
    tokens
        Initial tokens published at once.
    policy
        Retention, ``on_full`` and the consumer groups (registered before the first message,
        so none is retired before every group took it).
    timeout
        Seconds a ``put`` waits for a full stream's consumers (default: ``INSTRIDE_TIMEOUT``,
        else forever) before :class:`PortBlocked`.
    owner
        ``(module, instance, port)``, named by :class:`PortBlocked`.
    """

    def __init__(self, client: Client, name: str, kind: str, tokens: int = 0,
                 policy: PortPolicy | None = None, timeout: float | None = None,
                 owner: tuple[str, int, str] = ("?", 0, "?")) -> None:
        self.client, self.name, self.kind = client, name, kind
        self.policy = policy or PortPolicy(None, "block", ())
        self.owner = owner
        self.count = 0
        self.bytes = 0
        timeout = client.settings.timeout if timeout is None else timeout
        p = self.policy
        self._stream: Stream | None = None
        self._queue: _MessageQueue | None = None
        if kind == "frame":
            self._stream = Stream(name, mode="w", client=client, retain=p.retain,
                                  on_full=p.on_full, groups=p.groups, timeout=timeout)
        else:
            self._queue = _MessageQueue(client, name, Policy(retain=p.retain, on_full=p.on_full),
                                        p.groups, timeout)
        for _ in range(tokens):
            self._publish(encode_message(kind, None, -1, 0.0, token=True))

    def _publish(self, body: bytes) -> None:
        assert self._queue is not None
        self._blocked(self._queue.publish, body)
        self.count += 1
        self.bytes += len(body)

    def _blocked(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except StreamFull as exc:
            module, instance, port = self.owner
            raise PortBlocked(module, instance, port, exc.holders, exc.waited) from exc

    def put(self, data: Any, step: int, time: float = 0.0, box: Any = None) -> None:
        """Publish one message (waits while the stream is full: back-pressure).

        Raises
        ------
        PortBlocked
            The consumers did not take the oldest message within the timeout.
        """
        if self._stream is not None:
            if isinstance(data, Frame):
                step, time, box = data.step, data.time, data.box if box is None else box
                data = data.positions
            positions = np.asarray(data)
            self._blocked(self._stream.append, positions, step=step, time=time, box=box)
            self.count += 1
            self.bytes += frame_size(len(positions), self._stream.layout)
        else:
            self._publish(encode_message(self.kind, data, step, time))

    def head(self) -> tuple[int, int]:
        """``(oldest message retained, messages written)``."""
        if self._stream is not None:
            return self._stream.oldest, self.count
        assert self._queue is not None
        return self._queue.oldest, self._queue.written

    def close(self) -> None:
        """Publish end-of-stream."""
        if self._stream is not None:
            self._stream.close()
        elif self._queue is not None:
            self._queue.close()


class Reader:
    """The receiving end of one connection: reads the source's stream as its consumer group
    (or, sampling the newest message, without one: a sampler never holds the producer back).

    A message taken stays valid until the next :meth:`take` (or :meth:`close`): frames are
    views of the mapped frame file, which the producer may reuse once the group moved on.
    """

    def __init__(
        self,
        client: Client,
        name: str,
        kind: str,
        start: int = 0,
        sampling: str = "all",
        stride: int = 1,
        group: str | None = None,
    ) -> None:
        self.client, self.name, self.kind = client, name, kind
        self.sampling, self.stride = sampling, stride
        self.group = None if sampling == "newest" else group
        self.count = 0
        self.bytes = 0
        self.end_key = f"{name}/{END_NAME}"
        self.share = client.engine.stream_state(client.key(name))
        self._stream: Stream | None = None
        self._cursor_file: Any = None
        if kind == "frame":
            self._stream = Stream(name, mode="r", client=client, group=self.group,
                                  on_gap="count")
            self.cursor = max(start, self._stream.tell())
        else:
            self.cursor = start
            if self.group is not None:
                self._cursor_file = self.share.open_group(self.group, start)
                self.cursor = max(start, self._cursor_file.value)
                self._cursor_file.commit(self.cursor)

    def key(self, index: int) -> str:
        if self._stream is not None:
            return self._stream.frame_key(index)
        return f"{self.name}/{_MSG_FORMAT.format(index)}"

    def written(self) -> int:
        """Messages the producer has published so far (from the stream's head)."""
        head = self.share.head()
        return 0 if head is None else head[1]

    def queue(self) -> int | None:
        """Messages published that this reader has not taken yet (``None``: not known)."""
        head = self.share.head()
        return None if head is None else max(0, head[1] - self.cursor)

    def available(self) -> bool:
        """Whether a message at or past the cursor is published."""
        return self.written() > self.cursor or self.client.exists(self.key(self.cursor))

    def wait(self) -> bool:
        """Block until a message is available (``True``) or the stream ended (``False``).

        Raises
        ------
        ConsumeTimeout
            Nothing came within ``INSTRIDE_TIMEOUT`` (when set).
        """
        timeout = self.client.settings.timeout
        start = time.monotonic()
        while True:
            if self.available():
                return True
            if self.client.exists(self.end_key):
                return self.available()
            key = self.key(max(self.cursor, self.written()))  # the next one to come
            waited = time.monotonic() - start
            if timeout is not None and waited >= timeout:
                raise ConsumeTimeout(key, waited)
            part = _SLICE if timeout is None else min(_SLICE, timeout - waited)
            with contextlib.suppress(ConsumeTimeout):
                self.client.wait_any([key, self.end_key], timeout=part)

    def take(self) -> Message:
        """Take the message at the cursor (the newest one when sampling) and move past it.

        The message taken before is released: its group moves on, so the producer may retire
        it (and reuse a frame's storage).
        """
        if self._stream is not None:
            msg, size = self._take_frame()
        else:
            msg, size = self._take_message()
        self.count += 1
        self.bytes += size
        return msg

    def _take_frame(self) -> tuple[Message, int]:
        assert self._stream is not None
        self._stream.seek(self.cursor)
        if self.sampling == "newest":
            frame = self._stream.latest()
            index = self._stream.tell() - 1
            self.cursor = index + 1
        else:
            index = self.cursor
            frame = next(self._stream)  # releases the frame held, commits the group's cursor
            self.cursor = index + self.stride
        msg = Message(frame.step, frame.time, frame.positions, frame, index)
        return msg, frame_size(frame.natoms, frame.header.layout)

    def _take_message(self) -> tuple[Message, int]:
        if self.sampling == "newest":
            while True:
                index = max(self.cursor, self.written() - 1)
                try:  # a "latest" stream may retire it meanwhile: then a newer one exists
                    buf = self.client.consume_bytes(self.key(index), timeout=_SLICE)
                    break
                except ConsumeTimeout:
                    continue
            self.cursor = index + 1
        else:
            index = self.cursor
            if self._cursor_file is not None:
                self._cursor_file.commit(index)  # done with every message before this one
            buf = self.client.consume_bytes(self.key(index))
            self.cursor = index + self.stride
        return decode_message(buf, index), len(buf)

    def close(self) -> None:
        """Release the message held and the group; the group takes nothing more (its producer
        no longer waits for it)."""
        if self._stream is not None:
            self._stream.close()
            if self.group is not None:
                with contextlib.suppress(GroupBusy):
                    self._cursor_file = self.share.open_group(self.group, 0)
        if self._cursor_file is not None:
            self._cursor_file.commit(DONE)
            self._cursor_file.close()
            self._cursor_file = None
        self.share.close()


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
        # Outputs first: their consumer groups are registered before anything is read or sent.
        connected = {e.src_port for e in self.graph.edges_from(module, self.instance)}
        put_timeout = self.graph.put_timeout or spec.get("timeout")
        self.writers: dict[str, Writer | None] = {}
        for port, kind in mod.outputs.items():
            self.writers[port] = (
                Writer(self.client, stream_name(prefix, module, self.instance, port), kind,
                       tokens=self.graph.tokens(module, self.instance, port),
                       policy=port_policy(self.graph, module, self.instance, port),
                       timeout=put_timeout, owner=(module, self.instance, port))
                if port in connected else None
            )
        for e in self.graph.edges_into(module, self.instance):
            src_type = self.graph.modules[e.src].outputs[e.src_port]
            tokens = self.graph.tokens(e.src, e.src_instance, e.src_port)
            self.readers[e.dst_port] = Reader(
                self.client, stream_name(prefix, e.src, e.src_instance, e.src_port), src_type,
                start=tokens - e.initial, sampling=e.sampling, stride=e.stride,
                group=group_name(e),
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

        The message taken before on this port is released: its arrays (views of the received
        message; for frames, of storage the producer reuses) may change after this call, so
        copy what you keep beyond it.

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

        Waits while the port's stream is full (a consumer has not taken the oldest message
        yet): back-pressure.

        Parameters
        ----------
        port
            Output port name.
        data
            Positions or an :class:`instride.Frame` (frame ports), an array, bytes, or a JSON
            value, as the port's type says.
        step, time, box
            MD step, time (ps) and box (frames) of the message.

        Raises
        ------
        PortBlocked
            The stream stayed full longer than the graph's ``put_timeout`` (a consumer
            stalled or died); names the port and the consumer groups holding it.
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
        """End every output stream (end of stream propagates downstream), write stats, and
        release the inputs' consumer groups (their producers no longer wait for this one)."""
        if self._closed:
            return
        self._closed = True
        for w in self.writers.values():
            if w is not None:
                w.close()
        self.flush(done=True)
        for r in self.readers.values():
            if r is not None:
                r.close()

    # ------------------------------------------------------------------ counters
    def stats(self) -> dict[str, Any]:
        """Counters of this instance (what ``instride top`` shows)."""
        now = time.time()
        return {
            "module": self.module, "instance": self.instance, "node": self.node,
            "pid": os.getpid(), "started": self._started, "updated": now,
            "seconds": dict(self.recorder.seconds),
            "inputs": {p: None if r is None else {
                "stream": r.name, "msgs": r.count, "bytes": r.bytes, "cursor": r.cursor,
                "group": r.group, "queue": r.queue()}
                for p, r in self.readers.items()},
            "outputs": {p: None if w is None else {
                "stream": w.name, "msgs": w.count, "bytes": w.bytes,
                "retain": w.policy.retain, "on_full": w.policy.on_full,
                "groups": list(w.policy.groups), "retained": w.head()[1] - w.head()[0]}
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
