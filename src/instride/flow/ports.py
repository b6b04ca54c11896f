"""Ports: FlowVR's ``wait`` / ``get`` / ``put`` over instride streams.

Inside a module, :class:`Ports` is the whole API:

* ``wait()`` blocks until every connected **blocking** input port has a message; it returns
  ``False`` once an input's producer ended its stream and no message is left (end of stream
  propagates: the module returns, its own outputs end).
* ``get(port)`` returns the oldest message of an input port (:class:`Message`, stamped with the
  MD step); on a **non-blocking** port it returns ``None`` when nothing arrived (control
  messages), and an unconnected non-blocking port always returns ``None``.
* ``wait_any(ports)`` blocks until at least one of the input ``ports`` has a message or has
  ended, and returns those (for a module reading its inputs as they come, not in step).
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

import atexit
import contextlib
import json
import numbers
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..client import Client, get_client
from ..stream import END_NAME
from .channels import (
    Message,
    PortPolicy,
    Reader,
    Writer,
    decode_message,
    encode_message,
    end_stream,
    group_name,
    port_policy,
    release_group,
    stream_name,
    wait_any,
)
from .errors import FlowError
from .graph import Graph, Input
from .trace import Recorder

STATS_INTERVAL = 0.5  # seconds between two stats files of one instance

__all__ = [
    "Message", "PortPolicy", "Ports", "Reader", "Writer", "decode_message", "encode_message",
    "end_instance", "from_env", "group_name", "port_policy", "stream_name",
]


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

    def wait_any(self, ports: Sequence[str]) -> list[str]:
        """Block until at least one of the input ``ports`` has a message or has ended.

        For a module that reads its inputs as they come rather than in step (a synchronizer
        buffering the inputs that run ahead): ``get`` on a port returned does not block.

        Returns
        -------
        list of str
            The ports of ``ports`` ready: a message is there (``get`` returns it), or the
            stream ended (``get`` returns ``None``). An unconnected port is always ready.

        Raises
        ------
        FlowError
            A port is not an input of this module.
        ConsumeTimeout
            Nothing came within ``INSTRIDE_TIMEOUT`` (when set).
        """
        for port in ports:
            if port not in self.readers:
                raise FlowError(f"module {self.module!r} has no input port {port!r}")
        unconnected = [p for p in ports if self.readers[p] is None]
        if unconnected or not ports:
            return unconnected
        readers = [self.readers[p] for p in ports]
        with self.recorder.region("wait"):
            ready = wait_any(readers)  # type: ignore[arg-type]
        self._maybe_flush()
        return [ports[i] for i in ready]

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
        FlowError
            ``data`` cannot travel on the port's type (an array of Python objects on an
            ``array`` port, a numpy scalar or a set on a ``json`` port); names the port.
        """
        if port not in self.writers:
            raise FlowError(f"module {self.module!r} has no output port {port!r}")
        writer = self.writers[port]
        if writer is None:
            return
        try:
            # (7.9 is no step: truncated, it would be merged with step 7 downstream)
            whole = int(step) if isinstance(step, numbers.Integral) \
                or float(step).is_integer() else None
            when = float(time)
        except (TypeError, ValueError, OverflowError):
            whole = None
        if whole is None:
            raise FlowError(f"module {self.module!r} output {port!r}: step must be a whole "
                            f"number and time a number, got step={step!r}, time={time!r}")
        step, time = whole, when
        with self.recorder.region("put") as info:
            info["message"] = f"{writer.name}#{writer.count}"
            writer.put(data, step, time, box)
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
            self.recorder.dump(*self._trace_part())

    def _trace_part(self) -> tuple[Path, dict[str, Any]]:
        """Where this instance's regions go in the run's state, and what names them."""
        assert self._state is not None
        return (self._state / "trace" / f"{self.module}.{self.instance}.json",
                {"module": self.module, "instance": self.instance, "node": self.node})


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
    ports = Ports(spec, module, _instance_from_env(), client)
    if ports._state is not None:  # (a program that exits without close(): see _trace_at_exit)
        if _unclosed[0] != os.getpid():  # (one hook per process, not in a forked child)
            _unclosed[:] = [os.getpid()]
            atexit.register(_trace_at_exit)
        _unclosed.append((ports.recorder, *ports._trace_part()))
    return ports


#: the process whose exit :func:`_trace_at_exit` serves, then the recorders of its ports made
#: by :func:`from_env` with where their regions go (the recorder alone is kept, not the ports
#: and their streams)
_unclosed: list[Any] = [0]


def _trace_at_exit() -> None:
    """At a program's exit, its ports' regions into the run's trace unless their ``close()``
    wrote them: the runner ends what it left open once it has exited (:func:`end_instance`),
    and its part of ``trace.json`` comes from here (the latest ports' last, where several
    write the same part). Nothing in a child forked from it (its copy of the recorder is
    not the program's, nor is its exit the program's)."""
    if _unclosed[0] != os.getpid():
        return
    for recorder, path, meta in _unclosed[1:]:
        if not recorder.dumped:
            with contextlib.suppress(OSError):
                recorder.dump(path, meta)


def end_instance(spec: dict[str, Any], module: str, instance: int,
                 client: Client | None = None) -> dict[str, int]:
    """What :meth:`Ports.close` does, for an instance gone without it: a program run with
    ``command=`` that exited with status 0 without ``ports.close()``.

    Ends every connected output stream the instance left open
    (:func:`~instride.flow.channels.end_stream`, with the messages it published), releases its
    inputs' consumer groups (:func:`~instride.flow.channels.release_group`; those of streams
    not ended yet, whose producers may wait for it) and marks its counters done. The runner
    calls it (``python -m instride.flow.worker --end``, on the instance's node) once the
    instance has exited, so that no message can follow the end. A stream the instance ended
    itself is left as it is.

    Parameters
    ----------
    spec
        The run's spec (``INSTRIDE_FLOW_SPEC``'s content).
    module, instance
        The instance.
    client
        The instride client (default: the environment's).

    Returns
    -------
    dict of str to int
        The output ports ended here, each with the messages its stream ended with.
    """
    graph = Graph.from_dict(spec["graph"])
    prefix = spec["prefix"]
    client = client or get_client()
    ended: dict[str, int] = {}
    # outputs first: the consumers end as soon as they can
    for port in sorted({e.src_port for e in graph.edges_from(module, instance)}):
        count = end_stream(client, stream_name(prefix, module, instance, port))
        if count is not None:
            ended[port] = count
    for e in graph.edges_into(module, instance):
        name = stream_name(prefix, e.src, e.src_instance, e.src_port)
        # (a sampler reads without a group; a producer that ended its stream waits for none)
        if e.sampling != "newest" and not client.exists(f"{name}/{END_NAME}") \
                and not release_group(client, name, group_name(e)):
            print(f"instride flow: {module}[{instance}]'s consumer group {group_name(e)!r} of "
                  f"{name!r} is still held by a live process (one the program left running?): "
                  "not released; its producer waits for that process", file=sys.stderr)
    state = spec.get("state")
    path = Path(state) / "stats" / f"{module}.{instance}.json" if state else None
    if path is not None and path.is_file():  # (none: the program never built its ports)
        stats: Any = None
        with contextlib.suppress(OSError, ValueError):
            stats = json.loads(path.read_text())
        if isinstance(stats, dict) and not stats.get("done"):
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps({**stats, "done": True}))
            os.replace(tmp, path)
    return ended
