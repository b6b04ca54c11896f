"""Serve an instride stream over IMD v3, to unmodified ``imd://`` clients (MDAnalysis, imdclient).

MDAnalysis reads a running simulation with ``mda.Universe(topology, "imd://host:port")`` (its
IMD reader, built on the ``imdclient`` package, speaks IMD version 3). An engine accepts one
such client; :class:`IMDServer` puts an IMD server in front of an instride stream instead, so
any number of clients can connect, each with its own position in the stream: from the first
frame (default) or from the newest one published when it connects. Each client gets time,
step and box (when the stream's frames have one) with the positions, at its own pace: it
pauses the server when its buffer fills (PAUSE / RESUME) and may ask for every n-th frame
(TRATE). When the producer closes the stream, the server sends the last frame, then shuts
its side of the connection down and waits for the client to close, so the client's iteration
ends cleanly (``StopIteration``) after the last frame.

Command line::

    instride imd-serve run7 --port 8889

then, in any number of Python sessions::

    import MDAnalysis as mda
    u = mda.Universe("conf.gro", "imd://localhost:8889")
    for ts in u.trajectory:
        ...

IMD carries no atom names, so the client brings a topology with the stream's atom count.
Messages meant to steer an engine are not passed on: MDCOMM forces and WAIT are read and
ignored, and KILL ends only that client's session (like DISCONNECT), not the stream's
producer. IMD has no authentication: the server listens on 127.0.0.1 unless told otherwise
(``host="0.0.0.0"`` for clients on other nodes).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import math
import socket
import struct
import termios
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..errors import ConfigError, ConsumeTimeout, InstrideError, ServeError
from ..frames import Frame
from ..stream import Stream
from .imd_protocol import (
    HEADER_SIZE,
    VERSIONS,
    MsgType,
    SessionInfo,
    client_body_size,
    decode_header,
    encode_frame_packets,
    encode_handshake,
    recv_exact,
)

__all__ = ["ClientReport", "IMDServer", "serve"]

log = logging.getLogger(__name__)

_POLL = 0.25  # seconds between checks of the stop flag while waiting
#: seconds a client may take no bytes of a frame being sent (and, once it has begun a message,
#: send none of the rest) before its session ends; ``timeout`` raises it when longer
_CLIENT_STALL_S = 60.0
#: seconds a client has to answer the handshake with IMD_GO
_GO_WAIT_S = 30.0
#: the reports of ended sessions an :class:`IMDServer` keeps (:attr:`IMDServer.reports`)
_REPORTS_KEPT = 1000
#: bytes read at a time from a message body the server ignores (MDCOMM forces)
_DISCARD_CHUNK = 1 << 16
#: sessions an IMD server holds at once by default (each: two threads and a socket)
DEFAULT_MAX_CLIENTS = 64
#: bytes per send of a frame (each may wait the stall time: see _send_all)
_SEND_CHUNK = 1 << 20
#: seconds before accepting again after accept() failed (out of descriptors)
_ACCEPT_RETRY_S = 0.1


def _real(value: object) -> bool:
    """Whether ``value`` is a real number (not a bool, not a string)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _unsent(conn: socket.socket) -> int:
    """Bytes this end wrote to ``conn`` that its peer has not acknowledged yet (``SIOCOUTQ``;
    0 where it cannot be told)."""
    try:
        return struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    except OSError:
        return 0


def _whole(value: object) -> bool:
    """Whether ``value`` is a whole number of type ``int`` (not a bool, not a float)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class ClientReport:
    """What one client got."""

    peer: str
    frames: int = 0
    #: every frame up to end-of-stream was sent and the session closed cleanly
    ended: bool = False
    #: why the session ended early (the client left, a protocol error) or went wrong after
    #: the end was sent; ``None`` exactly when ``ended``
    error: str | None = None
    seconds: float = 0.0
    pauses: int = 0  #: PAUSE messages the client sent (its buffer was full)
    #: frames of a bounded stream retired before this client was sent them (skipped)
    missed: int = 0


@dataclass
class _Session:
    conn: socket.socket
    peer: str
    report: ClientReport
    go: threading.Event = field(default_factory=threading.Event)
    resumed: threading.Event = field(default_factory=threading.Event)
    gone: threading.Event = field(default_factory=threading.Event)
    trate: int = 1


class IMDServer:
    """An IMD server over one instride stream, for any number of clients.

    Parameters
    ----------
    stream
        Name of the stream to serve (it may not exist yet; clients wait for its frames).
    host, port
        Address to listen on; ``port=0`` picks a free port (see :attr:`port`).
    version
        IMD version to speak: 3 (MDAnalysis's ``imd://`` reader) or 2 (older clients, VMD).
    start
        Where a new client starts: ``"first"`` (frame 0) or ``"newest"`` (the newest frame
        published when it connects, or the first one when none is).
    timeout
        Seconds a client's session waits for the producer's next frame before it gives up and
        closes that connection (``None``: wait as long as the server runs). A client that
        takes none of a frame's bytes for 60 s (or ``timeout``, if longer) is disconnected
        too; one that only sends nothing is not (it need speak only to pause).
    dt
        Picoseconds per MD step for the TIME packet; by default estimated from consecutive
        frames (time difference over step difference; 0.0 until two frames were sent).
    on_client_done
        Called with each :class:`ClientReport` when a session ends.
    max_clients
        Sessions at once; a client that connects beyond them is refused (its connection
        closed at once, before the handshake) and may connect again later.

    Examples
    --------
    >>> with IMDServer("run7", port=0) as srv:         # doctest: +SKIP
    ...     u = mda.Universe("conf.gro", f"imd://localhost:{srv.port}")
    """

    def __init__(
        self,
        stream: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        version: int = 3,
        start: str = "first",
        timeout: float | None = None,
        dt: float | None = None,
        on_client_done: Callable[[ClientReport], None] | None = None,
        max_clients: int = DEFAULT_MAX_CLIENTS,
    ) -> None:
        # (whole numbers, not only equal ones: version 3.0 passed, then every session failed
        # packing its handshake; port 8889.0 or "0" was a bare TypeError from bind)
        if not _whole(version) or version not in VERSIONS:
            raise ConfigError("version", version, f"IMD version must be one of {VERSIONS}")
        if start not in ("first", "newest"):
            raise ConfigError("start", start, "must be 'first' or 'newest'")
        if not _whole(port) or not 0 <= port < 65536:
            raise ConfigError("port", port, "must be a whole number in 0..65535")
        if isinstance(max_clients, bool) or not isinstance(max_clients, int) or max_clients < 1:
            raise ConfigError("max_clients", max_clients, "must be a whole number >= 1")
        if timeout is not None and not (_real(timeout) and timeout > 0):
            raise ConfigError("timeout", timeout, "must be a number of seconds > 0, or None")
        if timeout is not None and math.isinf(timeout):
            timeout = None  # (no limit, as elsewhere)
        if dt is not None and not (_real(dt) and math.isfinite(dt) and dt >= 0):
            raise ConfigError("dt", dt, "must be a number of ps >= 0, or None")
        self.max_clients = max_clients
        self.stream = Stream(stream, mode="r").name  # validates the name
        self.host = host
        self.version = version
        self.start_at = start
        self.timeout = timeout
        self.dt = dt
        self.on_client_done = on_client_done
        #: the reports of the sessions that ended, the last :data:`_REPORTS_KEPT` (a server
        #: that serves for ever, clients coming and going, does not grow without bound)
        self.reports: deque[ClientReport] = deque(maxlen=_REPORTS_KEPT)
        self._ended = 0  # (sessions ended in all: what wait_clients counts)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._sessions: list[_Session] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as exc:
            self._listener.close()
            raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                             exc.errno or errno.EIO, what="the IMD server") from None
        except BaseException:
            self._listener.close()
            raise
        self._listener.listen(64)
        self._listener.settimeout(_POLL)
        self.port: int = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name="imd-accept", daemon=True)

    # ------------------------------------------------------------------ lifecycle
    @property
    def address(self) -> str:
        """``imd://host:port`` for clients."""
        return f"imd://{self.host}:{self.port}"

    def start(self) -> IMDServer:
        """Start accepting clients (in a background thread); return ``self``."""
        if not self._acceptor.is_alive():
            self._acceptor.start()
        return self

    def __enter__(self) -> IMDServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_clients(self, n: int, timeout: float | None = None) -> bool:
        """Block until ``n`` client sessions have ended; return whether they did in time.

        Raises
        ------
        ConfigError
            ``timeout`` is NaN or negative (``inf``: no limit, as ``None``).
        """
        if timeout is not None:
            if not (_real(timeout) and timeout >= 0):  # (NaN spun a core until close())
                raise ConfigError("timeout", timeout, "must be a number of seconds >= 0, or None")
            if math.isinf(timeout):
                timeout = None
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._done:
            while self._ended < n and not self._stop.is_set():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._done.wait(_POLL if left is None else min(left, _POLL))
            return self._ended >= n

    def close(self) -> None:
        """Stop accepting, end every session (closing its connection) and join the threads
        (but the calling one: ``on_client_done`` may close the server)."""
        self._stop.set()
        try:
            self._listener.close()
        except OSError:
            pass
        me = threading.current_thread()
        if self._acceptor.is_alive() and self._acceptor is not me:
            self._acceptor.join()  # (first: a session it took just before the stop is listed)
        with self._lock:
            sessions = list(self._sessions)
        for s in sessions:
            s.gone.set()
            s.resumed.set()
            try:
                s.conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in list(self._threads):
            if t is not me:
                t.join(timeout=5)

    # ------------------------------------------------------------------ accepting
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set() or exc.errno in (errno.EBADF, errno.EINVAL):
                    break  # closed
                # out of descriptors or buffers, a connection aborted before it was taken:
                # this one is lost, the server is not (the listener stays open, and a client
                # that connects meanwhile waits in its backlog)
                log.warning("imd server: cannot accept a connection: %s", exc)
                self._stop.wait(_ACCEPT_RETRY_S)
                continue
            peer = f"{addr[0]}:{addr[1]}"
            with self._lock:
                full = len(self._sessions) >= self.max_clients
            if full:  # (each session holds two threads and a socket: not without bound)
                log.warning("imd server: %s refused: %d clients are connected (max_clients)",
                            peer, self.max_clients)
                with contextlib.suppress(OSError):
                    conn.close()
                continue
            _keepalive(conn)  # (a peer that vanished without a word is found in minutes)
            session = _Session(conn, peer, ClientReport(peer))
            session.resumed.set()
            with self._lock:
                stopped = self._stop.is_set()  # (close() lists the sessions after this)
                if not stopped:
                    self._sessions.append(session)
            t = threading.Thread(target=self._serve_client, args=(session,), name=f"imd-{peer}",
                                 daemon=True)
            try:
                if stopped:
                    raise RuntimeError("the server is closing")
                t.start()
            except RuntimeError as exc:  # (closing; or no thread to be had: this client only)
                if not stopped:
                    log.warning("imd server: %s refused: %s", peer, exc)
                    with self._lock:
                        self._sessions.remove(session)
                with contextlib.suppress(OSError):
                    conn.close()
                continue
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    # ------------------------------------------------------------------ one client
    def _session_info(self, stream: Stream) -> SessionInfo:
        """What every frame of this session will carry, judged from the stream's first frame.

        A box is announced unless the first frame has none; velocities and forces only if
        the stream's frames carry them (an attribute ``velocities`` / ``forces`` that is not
        ``None``; today's frames hold positions and box only).
        """
        box, vel, forces = True, False, False
        for index in stream.published()[:1]:
            try:
                with stream.read(index) as first:  # (released: a bounded stream reuses it)
                    box = first.header.has_box
                    vel = getattr(first, "velocities", None) is not None
                    forces = getattr(first, "forces", None) is not None
            except InstrideError:  # (retired meanwhile: the defaults, as for no frame yet)
                pass
        return SessionInfo(time=True, energies=False, box=box, positions=True, velocities=vel,
                           forces=forces)

    def _serve_client(self, s: _Session) -> None:
        t0 = time.perf_counter()
        stream: Stream | None = None
        receiver: threading.Thread | None = None
        stall = _CLIENT_STALL_S if self.timeout is None else max(self.timeout, _CLIENT_STALL_S)
        try:
            # (frames a bounded stream retired before this client got them are skipped,
            # counted)
            stream = Stream(self.stream, mode="r", timeout=_POLL, on_gap="count")
            info = self._session_info(stream)
            # One timeout for the whole session, set before the receiver's first read: a
            # read under way keeps the timeout it began with, whatever is set later.
            s.conn.settimeout(stall)
            s.conn.sendall(encode_handshake(self.version, "<", info))
            rx = threading.Thread(target=self._receive, args=(s,), name=f"imd-rx-{s.peer}",
                                  daemon=True)
            rx.start()  # (a thread not to be had: RuntimeError, a bug's report below)
            receiver = rx
            go_by = time.monotonic() + _GO_WAIT_S
            while not s.go.wait(_POLL) and not s.gone.is_set():  # (close() sets gone)
                if time.monotonic() > go_by:
                    raise _SessionEnd(f"no IMD_GO from the client within {_GO_WAIT_S:g} s")
            if s.gone.is_set():
                raise _SessionEnd(s.report.error or "the client left before IMD_GO")
            self._send_frames(s, stream, info)
            s.report.ended = True
            # End of stream: shut our side down and wait until the client has read everything
            # and closed (closing at once can reset the connection while the client still has
            # unread frames and unanswered PAUSE/RESUME messages in flight) — not forever.
            s.conn.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + stall
            unsent = _unsent(s.conn)
            while not s.gone.wait(_POLL):
                if self._stop.is_set():
                    break
                left = _unsent(s.conn)
                if left < unsent:  # (still taking the last frames in: a slow, steady reader
                    unsent, deadline = left, time.monotonic() + stall  # is given its time)
                if time.monotonic() > deadline:  # (every frame sent, the close not clean)
                    s.report.ended = False
                    s.report.error = (f"the client did not close within {stall:g} s after the "
                                      "end of the stream")
                    break
        except _SessionEnd as exc:
            s.report.error = str(exc)
        except InstrideError as exc:  # (before OSError: some are OSErrors too)
            s.report.error = str(exc)
        except TimeoutError:
            s.report.error = f"the client took no data for {stall:g} s"
        except OSError as exc:  # reset, broken pipe: the client went away
            s.report.error = f"connection lost: {exc}"
        except Exception as exc:  # (a bug: reported and logged, the server serves on)
            s.report.error = f"{type(exc).__name__}: {exc}"
            log.exception("imd client %s", s.peer)
        finally:
            s.gone.set()
            try:  # (shut down first: a close alone would not wake the receiver's recv, and
                s.conn.shutdown(socket.SHUT_RDWR)  # the client would see no end until it
            except OSError:  # timed out)
                pass
            try:
                s.conn.close()
            except OSError:
                pass
            if receiver is not None:
                receiver.join(timeout=5)
            if s.report.ended and s.report.error is not None:
                # (something went wrong after the end was sent — the client reset the
                # connection, sent garbage: it may not have read the last frames)
                s.report.ended = False
                s.report.error += " (after the end of the stream was sent)"
            if stream is not None:
                try:
                    stream.close()  # (the frame it held goes back to a bounded stream)
                except InstrideError:
                    pass
                s.report.missed = stream.missed
            s.report.seconds = time.perf_counter() - t0
            with self._done:
                self._sessions.remove(s)
                self.reports.append(s.report)
                self._ended += 1
                self._done.notify_all()
            log.info("imd client %s: %d frames, %s", s.peer, s.report.frames,
                     "end of stream" if s.report.ended else s.report.error)
            if self.on_client_done is not None:
                self.on_client_done(s.report)

    def _next_frame(self, s: _Session, stream: Stream) -> Frame | None:
        """The stream's next frame, or ``None`` at its end; gives up after ``self.timeout``."""
        waited = 0.0
        while True:
            if s.gone.is_set() or self._stop.is_set():
                raise _SessionEnd(s.report.error or "the client left")
            try:
                return next(stream)  # (on_gap="count": retired frames skipped, counted)
            except StopIteration:
                return None
            except ConsumeTimeout:
                waited += _POLL
                if self.timeout is not None and waited >= self.timeout:
                    raise _SessionEnd(f"no frame from the producer for {self.timeout} s") from None

    def _send_frames(self, s: _Session, stream: Stream, info: SessionInfo) -> None:
        if self.start_at == "newest":
            published = stream.published()
            if published:
                stream.seek(published[-1])
        prev: tuple[int, float] | None = None
        dt = self.dt if self.dt is not None else 0.0
        seen = 0
        while True:
            frame = self._next_frame(s, stream)
            if frame is None:
                return
            seen += 1
            if (seen - 1) % max(s.trate, 1):
                continue
            while not s.resumed.wait(_POLL):  # paused by the client
                if s.gone.is_set() or self._stop.is_set():
                    raise _SessionEnd(s.report.error or "the client left")
            if self.dt is None:
                if prev is not None and frame.step != prev[0]:
                    dt = (frame.time - prev[1]) / (frame.step - prev[0])
                prev = (frame.step, frame.time)
            box = frame.box if info.box else None
            parts = encode_frame_packets(
                self.version, np.asarray(frame.positions), step=frame.step, time=frame.time, dt=dt,
                box=box, velocities=getattr(frame, "velocities", None),
                forces=getattr(frame, "forces", None), session=info, order="<",
            )
            _send_all(s.conn, b"".join(parts))
            s.report.frames += 1

    def _receive(self, s: _Session) -> None:
        """Read the client's messages until it closes (runs beside the sender)."""
        conn = s.conn
        try:
            while not s.gone.is_set():
                try:
                    first = conn.recv(HEADER_SIZE)
                except TimeoutError:
                    continue  # no message meanwhile: usual for a client that keeps up
                rest = recv_exact(conn, HEADER_SIZE - len(first)) if first else None
                if rest is None:
                    break
                kind, length = decode_header(first + rest)
                if not _discard(conn, client_body_size(kind, length)):
                    break
                if kind == MsgType.GO:
                    s.go.set()
                elif kind == MsgType.PAUSE:
                    if self.version == 2 and not s.resumed.is_set():
                        s.resumed.set()  # v2: PAUSE toggles
                    else:
                        s.resumed.clear()
                        s.report.pauses += 1
                elif kind == MsgType.RESUME:
                    s.resumed.set()
                elif kind == MsgType.TRATE:
                    s.trate = max(int(length), 1)
                elif kind in (MsgType.DISCONNECT, MsgType.KILL):
                    s.report.error = s.report.error or (
                        None if s.report.ended else "the client disconnected"
                    )
                    break
                elif kind in (MsgType.WAIT, MsgType.MDCOMM, MsgType.IOERROR):
                    pass  # engine controls: the stream's producer is not steered
                else:
                    s.report.error = f"unknown IMD message type {kind}"
                    break
        except TimeoutError:
            s.report.error = s.report.error or "a client message cut short"
        except (OSError, struct.error):
            pass
        finally:
            s.gone.set()
            s.resumed.set()
            s.go.set()  # (a handshake waiting for IMD_GO learns at once that the client left)


def _send_all(conn: socket.socket, data: bytes) -> None:
    """Send ``data`` whole; :class:`TimeoutError` only when the client takes none of it for
    the socket's timeout (the session's stall time). ``sendall`` bounds the whole call by
    that timeout: a large frame to a slow but steady client would count as a stall."""
    view = memoryview(data)
    while view:
        view = view[conn.send(view[:_SEND_CHUNK]):]  # (each send waits at most the timeout)


def _keepalive(conn: socket.socket) -> None:
    """TCP keep-alive on a client's connection: a peer that vanished without closing it (its
    host crashed, the network cut) is found after ~2 minutes of silence, also by a session
    that is paused or waits for a quiet producer without a timeout."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6)):
            if hasattr(socket, name):
                conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError:
        pass


def _discard(conn: socket.socket, n: int) -> bool:
    """Read and drop ``n`` bytes (a body the server ignores) without holding them all;
    ``False`` when the peer closed first."""
    buf = memoryview(bytearray(min(n, _DISCARD_CHUNK)))
    while n > 0:
        k = conn.recv_into(buf[:min(n, len(buf))])
        if k == 0:
            return False
        n -= k
    return True


class _SessionEnd(Exception):
    pass


def serve(
    stream: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    version: int = 3,
    start: str = "first",
    clients: int | None = None,
    timeout: float | None = None,
    dt: float | None = None,
    on_ready: Callable[[IMDServer], None] | None = None,
    on_client_done: Callable[[ClientReport], None] | None = None,
    max_clients: int = DEFAULT_MAX_CLIENTS,
) -> list[ClientReport]:
    """Serve ``stream`` over IMD until ``clients`` sessions have ended (or forever).

    Parameters
    ----------
    stream, host, port, version, start, timeout, dt, on_client_done, max_clients
        As for :class:`IMDServer`.
    clients
        Return after this many client sessions have ended (``None``: serve until interrupted).
    on_ready
        Called with the listening server (its :attr:`IMDServer.port` is known then).

    Returns
    -------
    list of ClientReport
        One per finished session (the last 1,000).

    Raises
    ------
    ConfigError
        A bad version, start, port or max_clients.
    ServeError
        The address cannot be bound.
    """
    server = IMDServer(stream, host=host, port=port, version=version, start=start, timeout=timeout,
                       dt=dt, on_client_done=on_client_done, max_clients=max_clients)
    with server:
        if on_ready is not None:
            on_ready(server)
        if clients is None:
            # Short sleeps, not one long one: the kernel may deliver SIGTERM to any of the
            # session threads, and then only the main thread's return to Python runs the
            # handler; a sleep of an hour would hold the stop back for up to an hour.
            while True:
                time.sleep(_POLL)
        server.wait_clients(clients)
    return list(server.reports)

