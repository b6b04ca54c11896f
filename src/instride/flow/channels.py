"""Channels: the bounded streams behind flow ports, and the messages they carry.

Each output port is one bounded stream: frames go into an :class:`instride.Stream`; arrays,
bytes and JSON values into keys ``<stream>/msg_<index>.bin`` (a small JSON header and the
payload) with the same head, consumer groups and end-of-stream marker (:class:`Writer`). Every
connected consumer instance reads the stream as its own consumer group (:class:`Reader`), so a
message is retired only when every consumer took it; a newest-message sampler reads without a
group. :func:`port_policy` decides a port's retention, ``on_full`` and groups from the graph.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import struct
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..client import Client
from ..errors import ConsumeTimeout, GroupBusy, KeyExistsError, StreamFull
from ..frames import Frame, frame_size
from ..store.streamstate import GROUP_DONE, Policy
from ..stream import END_NAME, Stream
from .errors import FlowError, PortBlocked
from .graph import Edge, Graph

_MAGIC = b"IFLM"
_MSG_FORMAT = "msg_{:09d}.bin"


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
    """Encode a non-frame message: magic, header length, JSON header, payload.

    Raises
    ------
    FlowError
        ``data`` cannot travel as ``kind``: an array of Python objects (its bytes would be
        pointers), a ragged sequence, a value JSON cannot encode (a numpy scalar, a set).
    """
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
        try:
            arr = np.ascontiguousarray(data)
        except (TypeError, ValueError) as exc:
            raise FlowError(f"cannot send {type(data).__name__} as an array: {exc}") from None
        if arr.dtype.hasobject:
            raise FlowError(f"cannot send an array of Python objects (dtype {arr.dtype}) on an "
                            "'array' port: send numbers, or use a 'json' port")
        header.update(dtype=arr.dtype.str, shape=list(arr.shape))
        payload = arr.tobytes()
    elif kind == "bytes":
        try:
            payload = bytes(data)
        except TypeError as exc:
            raise FlowError(f"cannot send {type(data).__name__} as bytes: {exc}") from None
    elif kind == "json":
        try:
            payload = json.dumps(data).encode()
        except (TypeError, ValueError) as exc:  # numpy scalars, sets, circular references
            raise FlowError(f"cannot send {type(data).__name__} as JSON: {exc} (convert "
                            "numpy values with .item() or .tolist())") from None
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
DONE = GROUP_DONE
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
            self.client._retire(self.key(self.oldest - 1))

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
        FlowError
            ``data`` cannot travel on this port's type (named in the error).
        """
        if self._stream is not None:
            if isinstance(data, Frame):
                step, time, box = data.step, data.time, data.box if box is None else box
                data = data.positions
            positions = np.asarray(data)
            if positions.ndim != 2 or positions.shape[1] != 3 or positions.dtype.kind not in "fiu":
                module, instance, port = self.owner
                raise FlowError(f"module {module!r} instance {instance} output {port!r} (frame): "
                                "positions must be a numeric array of shape (natoms, 3), got "
                                f"{positions.dtype} of shape {positions.shape}")
            self._blocked(self._stream.append, positions, step=step, time=time, box=box)
            self.count += 1
            self.bytes += frame_size(len(positions), self._stream.layout)
        else:
            try:
                body = encode_message(self.kind, data, step, time)
            except FlowError as exc:
                module, instance, port = self.owner
                raise FlowError(f"module {module!r} instance {instance} output {port!r} "
                                f"({self.kind}): {exc}") from None
            self._publish(body)

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


def end_stream(client: Client, name: str) -> int | None:
    """End the stream ``name`` for its producer, gone without ending it (a program run with
    ``command=`` that exited with status 0 without ``ports.close()``).

    Publishes the end-of-stream marker :meth:`Writer.close` would have, counting the messages
    the stream's head says were published (none if the producer never started it): its
    readers take every message, then the end. Call it only once the producer is gone (else a
    message could follow the end).

    Returns
    -------
    int or None
        The messages the stream ended with; ``None`` when it had ended already (the marker
        is left as it is).
    """
    end_key = f"{name}/{END_NAME}"
    if client.exists(end_key):
        return None
    share = client.engine.stream_state(client.key(name))
    try:
        head = share.head()
    finally:
        share.close()
    written = 0 if head is None else head[1]
    try:
        with client.open(end_key, "wb") as fh:
            fh.write(json.dumps({"frames": written}).encode())
    except KeyExistsError:  # (ended meanwhile: write-once, the marker there stands)
        return None
    return written


def release_group(client: Client, name: str, group: str) -> bool:
    """Release consumer group ``group`` of stream ``name`` as :meth:`Reader.close` does, for a
    reader gone without closing: the group takes nothing more, so the producer no longer
    waits for it.

    A lease the gone reader still holds (cluster mode) is freed at once where that reader
    was a process of this machine (``open_group``), else waited for until it runs out. (A
    child the reader forked, reading on after it on the cursor it inherited, does not hold the
    lease in cluster mode: it names the reader, and the child raises ``GroupLeaseLost`` once
    it is taken.)

    Returns
    -------
    bool
        Whether it was released; ``False`` when a live reader holds the group (its lease
        renewed past its lifetime, or its lock held on this node: a child the reader left
        running).
    """
    share = client.engine.stream_state(client.key(name))
    try:
        deadline = time.monotonic() + float(getattr(share, "lease_s", 0.0)) + 1.0
        while True:
            try:
                cursor = share.open_group(group, 0)
                break
            except GroupBusy:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.1)
        try:
            cursor.commit(DONE)
        finally:
            cursor.close()
        return True
    finally:
        share.close()


def wait_any(readers: list[Reader]) -> list[int]:
    """Block until at least one of ``readers`` is :meth:`~Reader.ready`; return the positions
    of those that are (a ``wait`` or ``take`` on them does not block for a message).

    Raises
    ------
    ConsumeTimeout
        Nothing came within ``INSTRIDE_TIMEOUT`` (when set); names the first reader's next key.
    """
    client = readers[0].client
    timeout = client.settings.timeout
    start = time.monotonic()
    while True:
        ready = [i for i, r in enumerate(readers) if r.ready()]
        if ready:
            return ready
        keys = [k for r in readers for k in r.next_keys()]
        waited = time.monotonic() - start
        if timeout is not None and waited >= timeout:
            raise ConsumeTimeout(keys[0], waited)
        part = _SLICE if timeout is None else min(_SLICE, timeout - waited)
        with contextlib.suppress(ConsumeTimeout):
            client.wait_any(keys, timeout=part)


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
        wait_any([self])
        return self.available()

    def ready(self) -> bool:
        """Whether a message is available or the stream ended (a :meth:`wait` would not
        block)."""
        return self.available() or self.client.exists(self.end_key)

    def next_keys(self) -> tuple[str, str]:
        """The keys whose publication makes this reader :meth:`ready`: the next message's
        and the end marker's."""
        return self.key(max(self.cursor, self.written())), self.end_key

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
            # (through the stream's own cursor: taken again after its close, the group's lock
            # may be held by a child this process forked — the group was left where it was,
            # and its producer waited for it until PortBlocked)
            self._stream.leave_group()
        if self._cursor_file is not None:
            self._cursor_file.commit(DONE)
            self._cursor_file.close()
            self._cursor_file = None
        self.share.close()
