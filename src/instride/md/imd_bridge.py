"""A bridge from an unmodified MD engine's IMD socket into an instride stream.

GROMACS, LAMMPS and NAMD can stream coordinates while they run through the *Interactive
Molecular Dynamics* (IMD) protocol. :func:`bridge` connects to the engine as an IMD client
(the ``imdclient`` package, which speaks IMD v2 and v3), receives every frame the engine sends
and publishes it into an instride stream; when the engine terminates (it closes the socket
after its last step) the stream is closed, so consumers' iterations end.

**IMD v3** (LAMMPS ``fix imd ... version 3``, GROMACS >= 2025, NAMD 3) announces in its
handshake what each frame carries; frames with time, step and box are published with them as
is (positions and box in Å for GROMACS and NAMD; LAMMPS sends its own length units). Velocities
and forces, when sent, are received but not stored: instride frames hold positions.

**IMD v2** (GROMACS 2022, Debian's LAMMPS 2021) frames carry positions and, from GROMACS, an
energy block, but no step, time or box. The bridge numbers v2 frames itself: frame ``n`` is
step ``first_step + n * every``; its time is ``step * dt`` when ``dt`` (ps per step) is given
(else 0.0), and it has no box. GROMACS sends every step from step 0 (``first_step=0``; the
energy block's ``tstep`` is not used: with GROMACS 2022 it is one more than the step of the
coordinates it accompanies, as checked against the ``.trr`` of the same run); LAMMPS sends
every ``trate`` steps from step 1 (``first_step=1``, as checked against a dump of the same run).

GROMACS side (mdp ``IMD-group = System``)::

    gmx mdrun -s md.tpr -imdport 8888 -imdwait -imdterm -nt 1

LAMMPS side (input script)::

    fix 2 all imd 8888 version 3 time on box on coordinates on velocities off forces off

instride side::

    instride imd-bridge localhost:8888 gmx/run1 --gro conf.gro --dt 0.002
    instride imd-bridge localhost:8888 lmp/run1 --natoms 4000

Errors are typed: an engine that never accepts the connection raises
:class:`EngineUnavailable`; an engine that stops sending for ``timeout`` seconds raises
:class:`~instride.errors.ConsumeTimeout`; a protocol mismatch (wrong atom count, no positions
in a v3 session, a frame cut short, a connection reset) raises :class:`IMDProtocolError`. In
all these cases the stream is left without end-of-stream, so consumers do not mistake a
broken run for a complete one. Limitation: IMD has no "run finished" message, so an engine
that crashes between two frames also just closes its socket, and the bridge then ends the
stream after the last frame it received; check the engine's exit status.
"""

from __future__ import annotations

import math
import os
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import Stream
from ..config import MAX_SECONDS, parse_addr
from ..errors import ConfigError, ConsumeTimeout, InstrideError
from ..frames import frame_size

__all__ = [
    "BridgeReport",
    "EngineUnavailable",
    "IMDProtocolError",
    "bridge",
    "natoms_from_gro",
]


class EngineUnavailable(InstrideError, ConnectionError):
    """The MD engine's IMD port did not accept a connection (or no handshake) in time."""

    def __init__(self, address: str, detail: str) -> None:
        self.address = address
        self.detail = detail
        super().__init__(f"no IMD engine at {address}: {detail}")


class IMDProtocolError(InstrideError, ValueError):
    """The engine sent something the bridge cannot use (wrong atom count, bad packet...)."""

    def __init__(self, address: str, detail: str) -> None:
        self.address = address
        self.detail = detail
        super().__init__(f"IMD protocol error from {address}: {detail}")


@dataclass
class BridgeReport:
    """What :func:`bridge` moved."""

    stream: str
    frames: int
    bytes: int
    seconds: float  #: from connection to end of stream
    publish_seconds: float  #: time spent publishing into instride
    imd_version: int


def natoms_from_gro(path: str | os.PathLike[str]) -> int:
    """Atom count of a ``.gro`` file (its second line).

    Raises
    ------
    ValueError
        When the second line is not an integer.
    """
    with open(path) as fh:
        fh.readline()
        line = fh.readline()
    try:
        return int(line.strip())
    except ValueError:
        raise ValueError(f"{path}: second line {line.strip()!r} is not an atom count") from None


def _causes(exc: BaseException) -> list[BaseException]:
    chain = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    return chain


def _client_class(deadline: float) -> type:
    """imdclient's client, its connection attempt and the handshake's wait bounded by
    ``deadline`` (``time.monotonic()``): imdclient connects without a timeout (a host that
    drops packets would hold it for minutes) and waits a fixed 5 s for the handshake, however
    long ``connect_timeout`` is."""
    from imdclient.IMDClient import IMDClient

    def left() -> float:
        return max(0.1, deadline - time.monotonic())

    class _Client(IMDClient):  # type: ignore[misc]
        def _connect_to_server(self, host: str, port: int, socket_bufsize: int | None) -> Any:
            conn = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                if socket_bufsize is not None:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, socket_bufsize)
                conn.settimeout(left())
                conn.connect((host, port))
                conn.settimeout(None)  # (imdclient sets its own timeouts from here on)
            except BaseException:
                conn.close()
                raise
            return conn

        def _await_IMD_handshake(self) -> Any:  # noqa: N802 - imdclient's name
            # the handshake's first bytes waited for within what is left of the budget, then
            # read by imdclient (its 5 s bound the rest of them, which come along)
            poller = select.poll()  # (not select(): descriptors past 1023 happen)
            poller.register(self._conn.fileno(), select.POLLIN)
            if not poller.poll(int(left() * 1000)):
                self._conn.close()
                raise ConnectionError("connected, but the engine sent no IMD handshake")
            return super()._await_IMD_handshake()

    return _Client


#: TCP keepalive of a bridge that waits without a limit (``timeout=inf``): probes after this
#: many seconds of silence, this many seconds apart, this many unanswered end it
KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 60, 10, 6


def _keepalive(conn: socket.socket) -> None:
    """Have the kernel probe a connection that may be silent for ever: an engine whose host
    crashed or was cut off sends no FIN, and a wait without a limit would never end; with
    probes it ends in :data:`KEEPALIVE_IDLE` + :data:`KEEPALIVE_INTERVAL` ×
    :data:`KEEPALIVE_COUNT` s (a reset: :class:`IMDProtocolError`)."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        option = getattr(socket, name, None)
        if option is not None:
            conn.setsockopt(socket.IPPROTO_TCP, option, value)


def _connect(host: str, port: int, natoms: int, connect_timeout: float,
             timeout: float | None) -> Any:
    address = f"{host}:{port}"
    deadline = time.monotonic() + connect_timeout
    while True:
        try:
            # single-threaded: no signal handlers, no background thread; frames are read
            # straight from the socket when asked for
            client_class = _client_class(deadline)
            if timeout is not None:
                return client_class(host, port, natoms, multithreaded=False, timeout=timeout)
            # no limit: imdclient compares its timeout with a number (None would raise), so
            # its default goes in, and the socket waits without a limit from here on
            client = client_class(host, port, natoms, multithreaded=False)
            conn = getattr(client, "_conn", None)
            if conn is not None:
                conn.settimeout(None)
                _keepalive(conn)
            return client
        except OSError as exc:  # refused, reset, no handshake (ConnectionError), timeout
            if time.monotonic() >= deadline:
                raise EngineUnavailable(address, f"{type(exc).__name__}: {exc}") from None
            time.sleep(0.1)
        except ValueError as exc:  # handshake of an unknown IMD version
            raise IMDProtocolError(address, str(exc)) from None


def _next_frame_begins(conn: socket.socket, address: str) -> bool:
    """Wait (within the socket's timeout) for the next frame's first byte without taking it;
    ``False`` when the engine closed its connection instead."""
    try:
        return bool(conn.recv(1, socket.MSG_PEEK))
    except ConnectionResetError:
        raise IMDProtocolError(address, "the connection was reset") from None


def bridge(
    address: str,
    stream: str | Stream,
    natoms: int,
    *,
    dt: float | None = None,
    first_step: int = 0,
    every: int = 1,
    connect_timeout: float = 60.0,
    timeout: float = 600.0,
    layout: str = "xyz32",
    overwrite: bool = False,
    on_frame: Callable[[int], None] | None = None,
) -> BridgeReport:
    """Receive frames from an IMD engine and publish them into an instride stream.

    Parameters
    ----------
    address
        ``HOST:PORT`` of the engine's IMD socket (``gmx mdrun -imdport PORT``).
    stream
        Stream (name or :class:`instride.Stream`) to publish into; it is ended when the
        engine terminates. When the bridge fails, a stream it opened by name is abandoned
        (:meth:`instride.Stream.abandon`: no end marker, nothing held); a stream given is
        left to the caller.
    natoms
        Atoms per frame (the IMD group; for ``IMD-group = System``, the ``.gro`` atom count).
    dt
        Picoseconds per MD step, to fill the frame time when the protocol (v2) has none.
    first_step
        Step of the first frame when the protocol (v2) carries no step: 0 for GROMACS, 1 for
        LAMMPS, or where a continued run starts.
    every
        Steps between two frames when the protocol (v2) carries no step (the engine's
        transmission rate: LAMMPS ``trate``).
    connect_timeout
        Seconds to keep retrying the connection (the engine may still be starting), the wait
        for its handshake included.
    timeout
        Seconds without a frame before giving up with :class:`ConsumeTimeout` (more than 0;
        ``math.inf``: wait as long as the engine keeps its connection open).
    layout, overwrite
        Frame layout and overwrite flag of a stream opened by name.
    on_frame
        Called with the number of frames published so far, after each frame.

    Returns
    -------
    BridgeReport

    Raises
    ------
    EngineUnavailable
        Nothing accepted the connection within ``connect_timeout``.
    ConsumeTimeout
        The engine sent no frame for ``timeout`` seconds.
    IMDProtocolError
        The engine's frames do not match ``natoms`` or the protocol, a v3 engine sends no
        positions, a frame was cut short or the connection was reset.
    ConfigError
        A malformed ``address``; ``natoms``, ``every`` (>= 1) or ``first_step`` (>= 0) that is
        not a whole number; a ``timeout`` or ``connect_timeout`` that is not a number of
        seconds above 0 (``connect_timeout`` at most 2,147,483); a ``dt`` that is not a finite
        number of ps >= 0.
    """
    host, port = parse_addr(address, name="HOST:PORT")
    # (whole numbers: every=1.5 truncated the steps silently, natoms=4.0 was a TypeError
    # inside imdclient)
    for name, value, least in (("natoms", natoms, 1), ("every", every, 1),
                               ("first_step", first_step, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(name, value, f"must be a whole number >= {least}")
    if not connect_timeout <= MAX_SECONDS:
        # (its milliseconds must fit poll()'s int: 1e7 s was an OverflowError's traceback)
        raise ConfigError("connect_timeout", connect_timeout,
                          f"must be a number of seconds above 0, at most {MAX_SECONDS}")
    for name, value in (("timeout", timeout), ("connect_timeout", connect_timeout)):
        if not value > 0:  # (also NaN)
            raise ConfigError(name, value, "must be a number of seconds above 0")
    if not math.isfinite(connect_timeout):
        raise ConfigError("connect_timeout", connect_timeout, "must be finite")
    if dt is not None and not (isinstance(dt, int | float) and not isinstance(dt, bool)
                               and math.isfinite(dt) and dt >= 0):
        raise ConfigError("dt", dt, "must be a number of ps >= 0, or None")  # (as on the CLI)
    wait = None if math.isinf(timeout) else timeout
    owned = not isinstance(stream, Stream)
    out = Stream(stream, mode="w", layout=layout, overwrite=overwrite) if owned else stream
    t0 = time.perf_counter()
    try:
        client = _connect(host, port, natoms, connect_timeout, wait)
    except BaseException:
        if owned:  # (a stream opened here is let go of: no end marker, nothing held)
            out.abandon()
        raise
    frames = 0
    publish = 0.0
    last = time.monotonic()
    try:
        info = client.get_imdsessioninfo()
        version = int(info.version)
        conn = getattr(client, "_conn", None)  # (to tell a frame's end from the middle of one)
        if getattr(info, "positions", True) is False:
            raise IMDProtocolError(address, "the engine's IMD session sends no positions"
                                            " (LAMMPS: fix imd ... coordinates on)")
        while True:
            try:
                # The engine closes its connection after its last frame: that is the end of
                # the run only where it falls between two frames (imdclient reports a frame
                # cut short, or a reset, as the end too).
                if conn is not None and not _next_frame_begins(conn, address):
                    break
                imdf = client.get_imdframe()
            except (EOFError, RuntimeError, OSError) as exc:
                chain = _causes(exc)
                if any(isinstance(c, TimeoutError) for c in chain):
                    if wait is None:  # (no limit of ours: the kernel's keepalive gave up)
                        raise IMDProtocolError(address, "the engine's host stopped answering "
                                               "(TCP keepalive probes unanswered)") from None
                    raise ConsumeTimeout(f"imd://{address}", time.monotonic() - last) from None
                bad = [c for c in chain if isinstance(c, RuntimeError)]
                if bad:
                    raise IMDProtocolError(
                        address, f"{bad[-1]} (is natoms={natoms} the size of the IMD group?)"
                    ) from None
                reset = [c for c in chain if isinstance(c, ConnectionResetError)]
                if reset or conn is not None:
                    raise IMDProtocolError(
                        address, "the connection was reset" if reset else
                        f"the connection ended in the middle of frame {frames}") from None
                break  # the engine closed the connection: end of the run
            last = time.monotonic()
            p0 = time.perf_counter()
            step = int(imdf.step) if imdf.step is not None else first_step + frames * every
            when = float(imdf.time) if imdf.time is not None else (
                step * dt if dt is not None else 0.0
            )
            box = None if imdf.box is None else np.asarray(imdf.box, dtype=np.float64)
            out.append(imdf.positions, step=step, time=when, box=box)
            frames += 1
            publish += time.perf_counter() - p0
            if on_frame is not None:
                on_frame(frames)
        p0 = time.perf_counter()
        out.close()  # (a close that fails, or is interrupted, abandons it below)
        publish += time.perf_counter() - p0
    except BaseException:
        client.stop()
        if owned:  # (the frames published stay; no end marker: a broken run)
            out.abandon()
        raise
    client.stop()
    return BridgeReport(
        stream=out.name, frames=frames, bytes=frames * frame_size(natoms, out.layout),
        seconds=time.perf_counter() - t0, publish_seconds=publish, imd_version=version,
    )

