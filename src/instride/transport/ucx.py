"""UCX transport: both halves, over UCP active messages in C (``libinstride_ucx.so``).

The protocol is the TCP transport's, carried by UCX instead of a socket: a request is the
same signed JSON header (:func:`instride.transport.wire.sign`, HMAC-SHA256 of the job token
over op, key, nonce and timestamp, checked with :func:`~instride.transport.wire.verify`),
the reply a JSON header followed by the file as one message body. UCX chooses how the body
moves: shared memory between processes of one node, TCP between nodes on Ethernet, RDMA
(InfiniBand, RoCE) where the hardware has it — the same code, configured by UCX's own
variables (``UCX_TLS``, ``UCX_NET_DEVICES``). Every body is checked against the record
(:meth:`Record.verify <instride.record.Record.verify>`: size and xxh3) before anything is
written at its destination; a failed, short or corrupt transfer leaves nothing there.

Selection: ``INSTRIDE_TRANSPORT=ucx`` (:attr:`Settings.transport
<instride.config.Settings.transport>`, default ``tcp``) makes the cluster engine fetch with
:class:`UcxTransport` and ``instride serve`` serve with :class:`UcxServer`, both found by name
in :data:`instride.transport.REGISTRY`. The transport is a job-wide choice: every node of a
job must use the same one.

Address: a node's UCX server listens on ``INSTRIDE_ADDR`` itself (UCX's connection manager
takes that TCP port; the TCP transport is not served then), and records name it as the
owner, so a consumer connects to ``record.owner`` as with TCP. The host must be an IPv4
address (or a name resolving to one) of an interface UCX can use: on InfiniBand, the node's
IPoIB address.

Needs UCX (Debian ``libucx-dev`` when instride is built, ``libucx0`` at run time); without
it, selecting the transport (building either half) raises
:class:`~instride.errors.ConfigError` naming the package. ``import instride`` never loads it.

Security is the TCP transport's: requests are authenticated (job token, timestamp within
:data:`~instride.transport.wire.MAX_SKEW`), each nonce is accepted once within that window (a
captured request sent again is refused: :class:`~instride.transport.replay.ReplayGuard`), and
nothing is encrypted: run the traffic on a trusted network.

Examples
--------
``INSTRIDE_TRANSPORT=ucx instride serve`` on every node, and the same variable for every
producer and consumer of the job. From Python (what the node server and the cluster engine
do)::

    from instride.transport import get_server, get_transport
    server = get_server("ucx", settings)            # await server.start() in an asyncio loop
    get_transport("ucx", settings).fetch(record, dest)

A data server for peers alone (no node agent), for diagnostics and benchmarks::

    python -m instride.transport.ucx --help
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import errno
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash

from ..config import Settings, parse_addr
from ..errors import (
    AuthenticationError,
    ConfigError,
    InstrideError,
    IntegrityError,
    KeyNotFoundError,
    KeyNotServed,
    PeerUnavailable,
    TransferError,
)
from ..keys import normalize_key
from ..native import RECEIVING
from ..perthread import PerThread, forks
from ..record import Record
from ..store.served import open_served
from . import wire
from .base import Backoff, fetch_to_new_file, open_engine
from .replay import ReplayGuard

log = logging.getLogger("instride.transport.ucx")

#: Debian packages that provide UCX (build and run time).
INSTALL_HINT = ("apt-get install libucx-dev ucx-utils, then reinstall instride "
                "(pip install -e .) so that libinstride_ucx.so is built")
#: Seconds any send of a reply may take, plus size / :data:`SEND_RATE` for its body.
SEND_TIMEOUT = 60.0
#: Bytes per second a peer is assumed to sustain at least, for a body's deadline.
SEND_RATE = 50e6
#: Peer connections served at once (also the C library's ceiling).
MAX_PEERS = 512
#: Seconds a new connection has to send its first request (a UCX request arrives whole, as
#: one message), as the TCP server's; a connection is never closed for idling between
#: requests (UCX 1.13 does not tell every client's kept endpoint that the server closed it).
REQUEST_TIMEOUT = 10.0
#: Seconds :meth:`UcxServer.close` waits for its serving thread beyond the grace it gives
#: bodies in flight (closing every connection may take ~2 s each at most).
STOP_MARGIN = 10.0
_ERR = 512
_REPLY_CAP = wire.MAX_HEADER + 1


def ucx_address(owner: str) -> tuple[str, int]:
    """``(IPv4 address, port)`` of the UCX data server at ``owner`` (``host:port``).

    Raises
    ------
    ConfigError
        ``owner`` is not ``host:port``.
    PeerUnavailable
        The host name does not resolve.
    """
    host, port = parse_addr(owner, "owner")
    try:
        ip = socket.gethostbyname(host)
    except OSError as exc:
        raise PeerUnavailable(owner, f"cannot resolve {host}: {exc}") from None
    return ip, port


# ---------------------------------------------------------------------- the C library
_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()
#: buffers UCX may still write into (a body that could not be cancelled): never reused
_stuck: list[Any] = []


#: UCX's own handlers of signals, off unless the user sets them (read once, as UCX loads):
#: ``UCX_DEBUG_SIGNO`` (SIGHUP by default) took SIGHUP from the process — a terminal or ssh
#: session closing no longer reached the program's handler (``instride job``'s, a flow
#: runner's: their teardown never ran) — and ``UCX_ERROR_SIGNALS`` (SIGSEGV, SIGBUS, ...)
#: replaced Python's ``faulthandler`` with a handler that frees memory inside the signal: a
#: fault, or a SIGHUP, that came in ``malloc`` left the process hung for ever, not crashed.
_UCX_SIGNALS_OFF = {"UCX_DEBUG_SIGNO": "0", "UCX_ERROR_SIGNALS": ""}


def library_path() -> Path:
    """Where ``libinstride_ucx.so`` is installed (next to the package's modules)."""
    return Path(__file__).resolve().parent.parent / "libinstride_ucx.so"


def load_library() -> ctypes.CDLL:
    """Load ``libinstride_ucx.so`` once.

    Raises
    ------
    ConfigError
        When it was not built (UCX headers missing at install time) or cannot be loaded
        (UCX libraries missing); the message names the Debian packages.
    """
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        for var, value in _UCX_SIGNALS_OFF.items():
            os.environ.setdefault(var, value)  # (before UCX loads: see _UCX_SIGNALS_OFF)
        lib = open_engine(library_path(), "ucx", "UCX support was not built", INSTALL_HINT)
        vp, cp, sz, i64, u64 = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int64, \
            ctypes.c_uint64
        sigs: dict[str, tuple[Any, list[Any]]] = {
            "isu_client_new": (vp, [cp, sz]),
            "isu_client_request": (ctypes.c_int, [vp, cp, ctypes.c_int, cp, sz, cp, sz,
                                                  ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_int),
                                                  i64, cp, sz]),
            "isu_client_receive": (ctypes.c_int, [vp, vp, u64, i64, cp, sz]),
            "isu_client_discard": (None, [vp]),
            "isu_client_ep_info": (ctypes.c_int, [vp, cp, ctypes.c_int, cp, sz]),
            "isu_client_close": (None, [vp]),
            "isu_server_start": (vp, [cp, ctypes.c_int, ctypes.c_int, cp, sz]),
            "isu_server_port": (ctypes.c_int, [vp]),
            "isu_server_stats": (None, [vp, ctypes.POINTER(u64)]),
            "isu_server_wake": (None, [vp]),
            "isu_server_next": (ctypes.c_int, [vp, cp, sz, i64]),
            "isu_server_reply": (ctypes.c_int, [vp, cp, sz, ctypes.c_int, u64, i64, cp, sz]),
            "isu_server_close_after": (None, [vp]),
            "isu_server_pending": (ctypes.c_int, [vp]),
            "isu_server_close": (None, [vp, i64]),
            "isu_server_limits": (None, [vp, i64, i64]),
            "isu_server_idle_closed": (u64, [vp]),
            "isu_server_evicted": (u64, [vp]),
        }
        for name, (res, args) in sigs.items():
            fn = getattr(lib, name, None)
            if fn is None:  # (a library left from an older build)
                raise ConfigError("INSTRIDE_TRANSPORT", "ucx",
                                  f"{library_path()} is from another version of instride (it "
                                  f"has no {name}): reinstall instride (pip install -e .) so "
                                  "that it is built again")
            fn.restype = res
            fn.argtypes = args
        # receives counted where a helper making a file ahead can see them (it waits for them)
        count = getattr(lib, "isu_count_receives", None)  # (optional: an older build lacks it)
        if count is not None:
            count.restype, count.argtypes = None, [vp]
            count(ctypes.addressof(RECEIVING))
        _lib = lib
        return lib


def _msg(buf: ctypes.Array[ctypes.c_char]) -> str:
    return buf.value.decode(errors="replace")


# ---------------------------------------------------------------------- client half
def _close_worker(lib: ctypes.CDLL, handle: int, made_after: int) -> None:
    """Close a worker, in the process that made it (a fork's child leaves its parent's)."""
    if forks() == made_after:
        lib.isu_client_close(handle)


#: the fork count (:func:`~instride.perthread.forks`) of the process that started UCX's client
#: side first; ``None``: not started in this process or an ancestor
_started: int | None = None


def started_here() -> bool:
    """Whether this process started UCX (a child it forks from now on cannot use it)."""
    return _started is not None and _started == forks()


class _Worker:
    """One UCP worker and its endpoints, used by one thread only.

    ``busy`` is held while a fetch uses it: :meth:`UcxTransport.close`, called from another
    thread, closes a worker only between fetches (closed under a fetch, UCX would use freed
    memory); one in use is marked :attr:`retire` and closed by its thread once its fetch ends.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        global _started
        if _started is not None and _started != forks():
            # (UCX does not survive a fork: every fetch of the child waited out its timeout
            # and blamed a healthy owner, PeerUnavailable)
            raise ConfigError(
                "INSTRIDE_TRANSPORT", "ucx",
                "UCX was started in this process's parent before it forked, and UCX cannot "
                "be used after a fork: start worker processes with the 'spawn' or "
                "'forkserver' method, or fork before the first fetch")
        self.lib = lib
        err = ctypes.create_string_buffer(_ERR)
        handle = lib.isu_client_new(err, _ERR)
        if not handle:
            raise ConfigError("INSTRIDE_TRANSPORT", "ucx", f"cannot start UCX: {_msg(err)}")
        if _started is None:
            _started = forks()
        self.handle: int | None = handle
        self.reply = ctypes.create_string_buffer(_REPLY_CAP)
        self.buffer: bytearray | None = None  # reused for bodies written to files
        self.busy = threading.Lock()
        self.retire = False
        # closed once nothing refers to it: its thread ended (the thread's locals went), and
        # the transport keeps only weak references (not at the interpreter's exit: the
        # process's end releases it; never in a forked child, which forgets its parent's
        # workers without touching their connections)
        self._closer = weakref.finalize(self, _close_worker, lib, handle, forks())
        self._closer.atexit = False

    def close(self) -> None:
        if self.handle:
            self._closer()
            self.handle = None


class UcxTransport:
    """Fetch files from other nodes' UCX data servers.

    Each thread gets its own UCP worker (UCX's model: a worker per thread) with kept-alive
    endpoints to the owners it fetched from.

    Parameters
    ----------
    settings
        Supplies the job token, the connect timeout (also the bound on waiting for a reply
        header and on a stalled body), and whether to fsync fetched files.

    Raises
    ------
    ConfigError
        When UCX support is not installed (names the Debian packages).
    """

    name = "ucx"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.lib = load_library()
        self._per_thread = PerThread()  # a forked child makes its own worker
        # (weak: a thread's worker goes with the thread, its endpoints and descriptors too)
        self._workers: weakref.WeakSet[_Worker] = weakref.WeakSet()
        self._lock = threading.Lock()

    def _worker(self) -> _Worker:
        local = self._per_thread.get()
        w = getattr(local, "worker", None)
        if w is None or w.handle is None or w.retire:  # (one close() let go of: a new one)
            w = local.worker = _Worker(self.lib)
            with self._lock:
                self._workers.add(w)
        return w

    @contextlib.contextmanager
    def _using(self) -> Iterator[_Worker]:
        """This thread's worker, held for one fetch (see :class:`_Worker`)."""
        while True:
            w = self._worker()
            with w.busy:
                if w.handle is None:  # closed by another thread's close() meanwhile
                    continue
                yield w
            # (looked at once the fetch let go of it: a close() that found it busy marked it
            # before it tried, so one of the two closes it)
            if w.retire and w.busy.acquire(blocking=False):
                try:
                    w.close()
                finally:
                    w.busy.release()
            return

    # ------------------------------------------------------------------ requests
    def _request(self, w: _Worker, record: Record, op: str = "fetch") -> tuple[dict[str, Any], int]:
        """Send a signed request; return the reply header and the size of the body to come."""
        node = f"{record.node or record.owner} ({record.owner})"
        host, port = ucx_address(record.owner)
        err = ctypes.create_string_buffer(_ERR)
        body = ctypes.c_uint64(0)
        reused = ctypes.c_int(0)
        timeout_ms = int(self.settings.connect_timeout * 1000)
        busy: Backoff | None = None
        retried = False
        while True:
            # (signed anew for each attempt: a server spends a request's nonce when it
            # receives it, and refuses the same one again as a replay)
            header = wire.sign(self.settings.token or "", op, record.key)
            header["version"] = record.version
            payload = json.dumps(header, separators=(",", ":")).encode()
            if len(payload) > wire.MAX_HEADER:
                raise TransferError(record.key, f"request header of {len(payload)} bytes is too long")
            rc = self.lib.isu_client_request(w.handle, host.encode(), port, payload, len(payload),
                                             w.reply, _REPLY_CAP, ctypes.byref(body),
                                             ctypes.byref(reused), timeout_ms, err, _ERR)
            if rc == 0:
                break
            if rc == -errno.ECONNRESET and reused.value and not retried:
                retried = True
                continue  # a kept-alive endpoint to a restarted owner: retry once on a new one
            if rc == -errno.EAGAIN:
                # (the owner rejected the connection: at its max_peers, every connection
                # answering; a moment later, within the connect timeout, as over TCP)
                busy = busy or Backoff(self.settings.connect_timeout)
                if busy.again():
                    continue
                raise PeerUnavailable(node, f"busy: {_msg(err)}")
            if rc == -errno.ETIMEDOUT:
                raise PeerUnavailable(node, f"no reply within {self.settings.connect_timeout:g} s")
            raise PeerUnavailable(node, _msg(err))
        try:
            reply = wire.parse_header(w.reply.value)
        except wire.WireError as exc:
            self.lib.isu_client_discard(w.handle)
            raise TransferError(record.key, f"malformed reply from {node}: {exc}") from None
        if not reply.get("ok"):
            self.lib.isu_client_discard(w.handle)
            err_name = str(reply.get("error"))
            message = str(reply.get("message", "refused"))
            if err_name == "AuthenticationError":
                raise AuthenticationError(f"{node}: {message}")
            if err_name == "KeyNotFoundError":
                raise KeyNotFoundError(record.key)
            if err_name == "PeerUnavailable":  # (the owner cannot open files now)
                raise PeerUnavailable(node, message)
            raise TransferError(record.key, f"{node} refused: {err_name}: {message}")
        if reply.get("size") != body.value:
            self.lib.isu_client_discard(w.handle)
            raise TransferError(record.key, f"reply announces {reply.get('size')!r} bytes, body has"
                                            f" {body.value}")
        if body.value != record.size:
            self.lib.isu_client_discard(w.handle)
            raise IntegrityError(record.key, f"owner has {body.value} bytes, record says {record.size}")
        return reply, body.value

    def _receive(self, w: _Worker, record: Record, buf: Any, size: int) -> None:
        """Receive the announced body into ``buf`` (a writable buffer of at least ``size`` bytes)."""
        err = ctypes.create_string_buffer(_ERR)
        timeout_ms = int((self.settings.connect_timeout + size / SEND_RATE) * 1000)
        if size == 0:
            self.lib.isu_client_discard(w.handle)
            return
        address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        rc = self.lib.isu_client_receive(w.handle, address, size, timeout_ms, err, _ERR)
        if rc == 0:
            return
        if rc == -errno.EBUSY:
            _stuck.append(buf)  # UCX may still write into it: keep it alive, never reuse it
            if w.buffer is buf:
                w.buffer = None
        raise TransferError(record.key, _msg(err))

    def _scratch(self, w: _Worker, size: int) -> bytearray:
        """The thread's reused receive buffer, grown to at least ``size`` bytes."""
        if w.buffer is None or len(w.buffer) < size:
            w.buffer = bytearray(max(size, 1 << 20))
        return w.buffer

    # ------------------------------------------------------------------ the contract
    def fetch(self, record: Record, dest: Path) -> None:
        """Receive ``record.key``, verify it, then write it to the new file ``dest``.

        The body lands in a reused buffer first (no page faults of a fresh file while UCX
        writes), is hashed there, and only a verified body is written to ``dest``.

        Raises
        ------
        PeerUnavailable, TransferError, IntegrityError, AuthenticationError, KeyNotFoundError
            As the transport contract says; ``dest`` does not exist afterwards.
        """
        fetch_to_new_file(self, record, dest)

    def fetch_into(self, record: Record, fd: int) -> None:
        """Receive ``record.key`` into the reused buffer, verify it, write it to ``fd``."""
        with self._using() as w:
            _reply, size = self._request(w, record)
            buf = self._scratch(w, size)
            self._receive(w, record, buf, size)
        view = memoryview(buf)[:size]  # (the buffer stays the thread's: only it fetches into it)
        record.verify(xxhash.xxh3_64_hexdigest(view[record.digest_from:]), size, view)
        done = 0
        while done < size:
            done += os.write(fd, view[done:])
        if self.settings.fsync:
            os.fsync(fd)

    def fetch_bytes(self, record: Record) -> bytearray:
        """Receive ``record.key`` into a new ``bytearray`` and verify it."""
        with self._using() as w:
            _reply, size = self._request(w, record)
            buf = bytearray(size)
            self._receive(w, record, buf, size)
        record.verify(xxhash.xxh3_64_hexdigest(memoryview(buf)[record.digest_from:]), size, buf)
        return buf

    def endpoint_info(self, record: Record) -> str:
        """UCX's description of this thread's endpoint to ``record``'s owner (which transports
        carry the traffic); empty when there is none. For diagnostics and tests."""
        host, port = ucx_address(record.owner)
        out = ctypes.create_string_buffer(1 << 16)
        with self._using() as w:
            rc = self.lib.isu_client_ep_info(w.handle, host.encode(), port, out, len(out))
        return _msg(out) if rc == 0 else ""

    @classmethod
    def server_class(cls) -> type[UcxServer]:
        """The server half: :class:`UcxServer`."""
        return UcxServer

    def close(self) -> None:
        """Close every thread's worker and endpoints.

        A worker whose thread is fetching now is closed by that thread once its fetch ends
        (the fetch goes on undisturbed); a thread that fetches after this gets a new worker.
        """
        with self._lock:
            workers = list(self._workers)
            self._workers.clear()
        for w in workers:
            w.retire = True  # (first: a fetch ending now sees it, and closes it itself)
            if w.busy.acquire(blocking=False):
                try:
                    w.close()
                finally:
                    w.busy.release()


# ---------------------------------------------------------------------- server half
class UcxServer:
    """Serve the files of a managed directory to peers over UCX.

    One thread runs the UCP worker: it authenticates each request (the job token), opens the
    key's file (:func:`~instride.store.served.open_served`: a regular file inside the
    directory, reached without symbolic links) and hands it to UCX, which sends it from a
    memory map while the thread answers the next request, so a large body does not hold up
    small ones. The asyncio methods (:meth:`start`, :meth:`stop`) are the
    :class:`~instride.transport.base.TransportServer` protocol, used by ``instride serve``;
    :meth:`open` and :meth:`close` do the same without an event loop.

    Parameters
    ----------
    settings
        The node's settings: managed directory, job token, ``INSTRIDE_ADDR`` (where to
        listen, unless ``host``/``port`` say otherwise).
    max_peers
        Peer connections served at once (at most :data:`MAX_PEERS`); more are rejected by
        UCX and counted as ``busy``.
    request_timeout
        Seconds a new connection has to send its first request, else it is closed (counted
        as ``idle_closed``); one that sends a malformed request is closed too.
    send_timeout
        Seconds a reply may take to be taken by its peer, plus size / 50 MB/s for a body;
        a peer that does not take it in time is disconnected (counted as ``stalled``).
    host, port
        Override the listen address; port 0 picks a free port (see :attr:`port`).
    on_reply
        Called with ``(key, size)`` before each body is handed to UCX (diagnostics).

    Raises
    ------
    ConfigError
        When UCX support is not installed (names the Debian packages).
    """

    def __init__(self, settings: Settings, *, max_peers: int = MAX_PEERS,
                 request_timeout: float = REQUEST_TIMEOUT, send_timeout: float = SEND_TIMEOUT,
                 host: str | None = None, port: int | None = None, on_reply: Any = None) -> None:
        self.settings = settings
        self.lib = load_library()
        default_host, default_port = parse_addr(settings.addr)
        self.host = host or default_host
        self.port = default_port if port is None else port
        self.max_peers = max_peers
        self.request_timeout = request_timeout
        self.send_timeout = send_timeout
        self.on_reply = on_reply
        self.root_real = os.path.realpath(settings.dir)
        self.stats = {"fetches": 0, "bytes_sent": 0, "refused": 0, "errors": 0, "busy": 0,
                      "stalled": 0, "idle_closed": 0, "evicted": 0}
        self._peers = 0
        self._c_refused = 0  # requests the C library dropped (malformed at the UCX level)
        self._replay = ReplayGuard()  # (the serving thread alone uses it)
        self._handle: int | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.grace = 10.0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Listen on ``INSTRIDE_ADDR`` (the serving thread starts; returns once it listens).

        Raises
        ------
        ConfigError
            When UCX cannot listen there (address in use, not an address of this node).
        """
        await asyncio.to_thread(self.open)

    async def stop(self, grace: float) -> None:
        """Stop listening; let bodies in flight finish for up to ``grace`` seconds."""
        self.grace = grace
        await asyncio.to_thread(self.close)

    def snapshot(self) -> dict[str, Any]:
        """The counters plus ``peers`` (connections open); refreshed by the serving thread at
        least every half second."""
        return {**self.stats, "refused": self.stats["refused"] + self._c_refused,
                "peers": self._peers}

    def open(self) -> UcxServer:
        """Start serving in a thread and return once it listens (see :meth:`start`)."""
        # like the TCP server's SO_REUSEADDR: a restarted server gets its port back at once
        # (UCX reads its variables when the server's context is created)
        os.environ.setdefault("UCX_TCP_CM_REUSEADDR", "y")
        os.environ.setdefault("UCX_RDMA_CM_REUSEADDR", "y")
        try:
            ip = socket.gethostbyname(self.host)
        except OSError as exc:
            raise ConfigError("INSTRIDE_ADDR", self.settings.addr,
                              f"cannot resolve {self.host}: {exc}") from None
        self._thread = threading.Thread(target=self._run, args=(ip,), name="instride-ucx",
                                        daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def close(self) -> None:
        """Stop listening; let bodies in flight finish for up to :attr:`grace` seconds."""
        self._stop.set()
        handle = self._handle
        if handle:
            self.lib.isu_server_wake(handle)
        if self._thread is not None:
            # bounded: a UCX worker wedged inside its progress (a local peer that died in the
            # middle of a message can leave UCX's shared-memory transport so) must not keep
            # the process from stopping; the thread is a daemon
            self._thread.join(self.grace + STOP_MARGIN)
            if self._thread.is_alive():
                log.error("the UCX serving thread did not stop within %.0f s; left behind",
                          self.grace + STOP_MARGIN)

    def __enter__(self) -> UcxServer:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _refresh(self, handle: int) -> None:
        """Copy the C library's counters (serving thread only)."""
        out = (ctypes.c_uint64 * 5)()
        self.lib.isu_server_stats(handle, out)
        self.stats["bytes_sent"] = out[0]
        self.stats["stalled"] = out[1]
        self.stats["busy"] = out[3]
        self.stats["idle_closed"] = self.lib.isu_server_idle_closed(handle)
        self.stats["evicted"] = self.lib.isu_server_evicted(handle)
        self._peers = out[4]
        self._c_refused = out[2]

    def _run(self, ip: str) -> None:
        err = ctypes.create_string_buffer(_ERR)
        handle = self.lib.isu_server_start(ip.encode(), self.port, self.max_peers, err, _ERR)
        if not handle:
            self._error = ConfigError("INSTRIDE_ADDR", f"{self.host}:{self.port}",
                                      f"UCX cannot listen there: {_msg(err)}")
            self._ready.set()
            return
        self._handle = handle
        self.lib.isu_server_limits(handle, int(self.request_timeout * 1000), -1)
        self.port = self.lib.isu_server_port(handle)
        self._ready.set()
        log.info("serving %s over UCX on %s:%d", self.settings.dir, ip, self.port)
        buf = ctypes.create_string_buffer(_REPLY_CAP)
        try:
            while not self._stop.is_set():
                n = self.lib.isu_server_next(handle, buf, _REPLY_CAP, 500)
                if n > 0:
                    try:
                        self._answer(handle, buf.raw[:n])
                    except Exception:  # never let one request take the server down
                        self.stats["errors"] += 1
                        log.exception("unexpected error answering a UCX request")
                self._refresh(handle)
        finally:
            self._handle = None
            self._refresh(handle)
            self.lib.isu_server_close(handle, int(self.grace * 1000))
            self._peers = 0
            log.info("UCX server stopped; stats %s", self.stats)

    # ------------------------------------------------------------------ requests
    def _reply(self, handle: int, header: dict[str, Any], fd: int = -1, size: int = 0) -> None:
        body = json.dumps(header, separators=(",", ":")).encode()
        err = ctypes.create_string_buffer(_ERR)
        deadline_ms = int((self.send_timeout + size / SEND_RATE) * 1000)
        rc = self.lib.isu_server_reply(handle, body, len(body), fd, size, deadline_ms, err, _ERR)
        if rc == 0 or rc in (-errno.ENOTCONN, -errno.ECONNRESET):
            if rc:
                log.debug("reply not sent: %s", _msg(err))
            return
        # (the body could not be handed to UCX: its memory map refused, out of memory) an
        # answer all the same, without a body, or the client waited out its timeout
        log.warning("cannot send %s over UCX now: %s", header.get("key"), _msg(err))
        self.stats["errors"] += 1
        failed = json.dumps({"ok": False, "error": "PeerUnavailable",
                             "message": f"cannot send {header.get('key')} now: {_msg(err)}"},
                            separators=(",", ":")).encode()
        rc = self.lib.isu_server_reply(handle, failed, len(failed), -1, 0, deadline_ms, err, _ERR)
        if rc != 0:
            log.debug("reply not sent: %s", _msg(err))

    def _refuse(self, handle: int, error: str, message: str) -> None:
        """Answer a refused request, then close its connection once the answer is sent (as
        the TCP server does): kept open, refused peers held their places among
        ``max_peers`` for good, and every valid client was rejected."""
        self.stats["refused"] += 1
        self._reply(handle, {"ok": False, "error": error, "message": message[:1000]})
        self.lib.isu_server_close_after(handle)

    def _answer(self, handle: int, raw: bytes) -> None:
        try:
            req = wire.parse_header(raw)
        except wire.WireError as exc:
            self._refuse(handle, "WireError", str(exc))
            return
        reason = wire.verify(self.settings.token, req)
        if reason is None:  # [replay] a captured request sent again is refused, as over TCP
            reason = self._replay.check(req["nonce"], float(req["ts"]), now=time.time())
        if reason is not None:
            log.warning("refused UCX request: %s", reason)
            self._refuse(handle, "AuthenticationError", reason)
            return
        op = req["op"]
        if op == "ping":
            self._reply(handle, {"ok": True, "node": self.settings.node})
            return
        if op != "fetch":
            self._refuse(handle, "WireError", f"unknown op {op[:100]!r}")
            return
        try:
            key = normalize_key(req["key"], self.settings.dir)
            fd, st = open_served(self.settings.dir, self.root_real, key)
        except KeyNotFoundError as exc:
            if isinstance(exc, KeyNotServed):
                self.stats["refused"] += 1
                log.warning("refused to serve over UCX: %s", exc)
            self._reply(handle, {"ok": False, "error": "KeyNotFoundError", "message": str(exc)})
            return
        except InstrideError as exc:
            self._refuse(handle, type(exc).__name__, str(exc))
            return
        except OSError as exc:  # (out of descriptors or memory: RESOURCE_ERRORS)
            log.warning("cannot serve %s over UCX now: %s", key, exc.strerror)
            self._reply(handle, {"ok": False, "error": "PeerUnavailable",
                                 "message": f"cannot open {key} now: {exc.strerror}"})
            return
        if self.on_reply is not None:
            try:
                self.on_reply(key, st.st_size)
            except Exception:  # (diagnostics: never a request left unanswered, a file open)
                log.warning("on_reply failed for %s", key, exc_info=True)
        self.stats["fetches"] += 1
        self._reply(handle, {"ok": True, "key": key, "size": st.st_size}, fd, st.st_size)


# ---------------------------------------------------------------------- stand-alone server
def main(argv: list[str] | None = None) -> int:
    """``python -m instride.transport.ucx``: run a UCX data server until SIGTERM/SIGINT."""
    ap = argparse.ArgumentParser(
        prog="python -m instride.transport.ucx",
        description="Serve this node's managed directory (INSTRIDE_DIR) to peers over UCX, "
                    "authenticated with INSTRIDE_TOKEN, on INSTRIDE_ADDR (peers only: "
                    "`INSTRIDE_TRANSPORT=ucx instride serve` also serves local thin clients).",
    )
    ap.add_argument("--host", help="address to listen on (default: INSTRIDE_ADDR's host)")
    ap.add_argument("--port", type=int, help="port (default: INSTRIDE_ADDR's port; 0: any)")
    ap.add_argument("--announce", action="store_true",
                    help="print 'reply KEY SIZE' on stdout before each body is sent")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    settings = Settings.from_env()

    def announce(key: str, size: int) -> None:
        print(f"reply {key} {size}", flush=True)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server = UcxServer(settings, host=args.host, port=args.port,
                           on_reply=announce if args.announce else None)
        server.open()
    except InstrideError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"ready {server.host}:{server.port}", flush=True)
    while not stop.wait(0.5):
        pass
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
