"""TCP transport, server half: serve this node's managed directory to peers.

The server is ``libinstride_tcp.so`` (C, loaded with :mod:`ctypes`): one thread per peer
connection, blocking I/O with deadlines, ``sendfile`` for the bodies. Each request is a
length-prefixed JSON header signed with an HMAC of the job token
(:mod:`instride.transport.wire`). The C engine answers on its own only the common case — a
plain, correctly signed, fresh ``fetch`` of a plain key that opens as a regular file beneath the
directory (``openat2`` with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``) — and framing errors.
Every other request is handed to :meth:`TcpServer.decide`, written here in Python with the
protocol's own functions: that is where keys are validated (traversal or absolute paths get an
error reply, never bytes), where only regular files are served (:mod:`instride.store.served`: a
symbolic link, a FIFO, a device or a directory under a key gets a ``KeyNotFoundError`` reply, and
so does a file whose resolved path is outside the managed directory), and where forged,
malformed and replayed requests are refused, logged and counted. (Cold Python costs ~0.5 ms per
request on an idle VM; the C path answers a fetch in tens of µs.)

Resource bounds: at most ``max_peers`` connections are served at once: at that bound one is
closed to make room -- first the one that has waited the longest (0.1 s at least, nothing
unread) for a request that never came whole (no token needed to hold a place so: a port scan,
a header sent a byte at a time), then the one idle the longest between two requests (kept
alive by its client) -- and only when there is none does a new one get a ``PeerUnavailable``
"busy" reply (its client tries again, within its connect timeout); a new connection must send
its first request within ``request_timeout`` seconds, only then does it get the long
keep-alive (:data:`IDLE_TIMEOUT`);
every write to a peer has a deadline (``send_timeout``, plus size / 50 MB/s for a file body),
so a peer that stops reading cannot pin a transfer, and other connections are served meanwhile
(each has its own thread: no head-of-line blocking).

Security notes: requests are authenticated with the job token (HMAC-SHA256 over op, key,
nonce and timestamp) and must be within :data:`~instride.transport.wire.MAX_SKEW` (300 s) of
the server's clock. Each nonce is accepted once (one replay guard, in the C engine, used by
both paths; same rules as :class:`~instride.transport.replay.ReplayGuard`: remembered for that
window, bounded in memory), so a captured request sent again is refused with an
``AuthenticationError`` reply. A fetch that waits for its key spends its nonce before the
wait, so a copy sent while it waits is refused at once rather than held beside it. Requests
and replies are not encrypted: an observer on the network sees the file's bytes in the
original reply. The token protects against fetching keys
without it, not against eavesdropping: run the cluster traffic on a trusted network. Hard links
are not detected: a hard link under the managed directory to a file readable by the server's
user is served like any other regular file.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from ...config import SERVE_AUTO_PREEMPT_MS, Settings, parse_addr
from ...errors import InstrideError, KeyNotFoundError, KeyNotServed, WireError
from ...keys import normalize_key
from ...store.served import open_served
from .. import wire
from .engine import DECIDE, LOG, EngineStats, load_library

log = logging.getLogger("instride.server")
#: lines a second about requests refused before their token was checked (malformed, not
#: signed with the job's token, stale, replayed): anyone who reaches the port may send them,
#: so past this many the rest are counted and said in one line (as the C engine's own)
_PEER_LINES = 20


class _PeerLog:
    """Warnings about unauthenticated peers, at most :data:`_PEER_LINES` a second: the
    first ones of each second kept, the others counted and reported in one line by the
    next one allowed (a log that anyone could grow without bound would fill the disk)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._second, self._lines, self._suppressed = 0, 0, 0

    def warning(self, msg: str, *args: Any) -> None:
        now = int(time.monotonic())
        with self._lock:
            if now != self._second:
                self._second, self._lines = now, 0
            if self._lines >= _PEER_LINES:
                self._suppressed += 1
                return
            self._lines += 1
            suppressed, self._suppressed = self._suppressed, 0
        if suppressed:
            log.warning("suppressed %d more refused or malformed peer message(s)", suppressed)
        log.warning(msg, *args)


_peer_log = _PeerLog()

#: Longest error message put in a reply.
MAX_MESSAGE = 1000
#: Seconds a new peer connection has to send its first request (and any request its header).
REQUEST_TIMEOUT = 10.0
#: Seconds an idle kept-alive peer connection stays open after a successful request.
IDLE_TIMEOUT = 300.0
#: Seconds any write to a peer may take; a file body gets this plus size / SEND_RATE.
SEND_TIMEOUT = 60.0
#: Bytes per second a peer is assumed to sustain at least, for a body's deadline.
SEND_RATE = 50e6
#: Peer connections served at once.
MAX_PEERS = 512
_KEEP = 1
#: callbacks of servers stopped while connection threads were still closing (kept alive)
_ORPHANED: list[tuple[Any, Any]] = []

def _error(err: str, message: str) -> dict[str, Any]:
    return {"ok": False, "error": err, "message": message[:MAX_MESSAGE]}


class TcpServer:
    """Serve the regular files of one managed directory to peers over TCP.

    Parameters
    ----------
    settings
        The node's settings: directory, address (``INSTRIDE_ADDR``), token.
    max_peers
        TCP connections served at once; more get a "busy" error reply.
    request_timeout
        Seconds a new peer connection has to send its first request.
    send_timeout
        Seconds a write to a peer may take (a file body: plus size / 50 MB/s).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        max_peers: int = MAX_PEERS,
        request_timeout: float = REQUEST_TIMEOUT,
        send_timeout: float = SEND_TIMEOUT,
    ) -> None:
        self.settings = settings
        self.max_peers = max_peers
        self.request_timeout = request_timeout
        self.send_timeout = send_timeout
        self.root_real = str(Path(settings.dir).resolve())
        self._token = (settings.token or "").encode()
        self._handle: ctypes.c_void_p | None = None
        self._lock = threading.Lock()
        #: decisions counted here (the C engine counts transfers, framing errors and gauges)
        self.stats = {"refused": 0, "errors": 0}
        self._final: dict[str, int] = {}  # the engine's counters when it was stopped
        # the callbacks must outlive every C thread that may call them: kept on the instance
        self._decide_cb = DECIDE(self._decide_c)
        self._log_cb = LOG(self._log_c)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Listen on ``settings.addr``.

        Raises
        ------
        OSError
            The address cannot be resolved or listened on (e.g. in use).
        ConfigError
            ``libinstride_tcp.so`` is missing.
        """
        lib = load_library()
        host, port = parse_addr(self.settings.addr)
        err = ctypes.create_string_buffer(512)
        handle = ctypes.c_void_p()
        rc = lib.iss_start(
            host.encode(), port, str(self.settings.dir).encode(), self._token, len(self._token),
            self.max_peers, int(self.request_timeout * 1000), int(IDLE_TIMEOUT * 1000),
            int(self.send_timeout * 1000), SEND_RATE, self._decide_cb, self._log_cb, None,
            ctypes.byref(handle), err, len(err))
        if rc != 0:
            raise OSError(-rc, err.value.decode(errors="replace") or "cannot start the data server")
        if self.settings.serve_sched == "auto":  # (see instride.server.set_policy)
            lib.iss_preempt_after(handle, SERVE_AUTO_PREEMPT_MS)
        self._handle = handle

    @property
    def port(self) -> int:
        """The port listened on (the one asked for, or the kernel's choice for port 0)."""
        if self._handle is None:
            raise RuntimeError("the server is not started")
        return int(load_library().iss_port(self._handle))

    def replay_held(self) -> int:
        """How many nonces the replay guard remembers: those of the requests accepted in the
        last 300 s (the window of a request's timestamp), at most a million."""
        if self._handle is None:
            raise RuntimeError("the server is not started")
        return int(load_library().iss_replay_held(self._handle))

    async def stop(self, grace: float) -> None:
        """Stop accepting, drop idle connections, give transfers ``grace`` seconds."""
        handle, self._handle = self._handle, None
        if handle is None:
            return
        final = EngineStats()
        left = await asyncio.to_thread(load_library().iss_stop, handle, int(grace * 1000),
                                       ctypes.byref(final))
        self._final = {name: int(getattr(final, name)) for name, _ in EngineStats._fields_}
        if left:  # their threads may still call back: the callbacks must outlive them
            _ORPHANED.append((self._decide_cb, self._log_cb))
            log.warning("%d peer connection(s) still closing after the grace period", left)

    def _engine_stats(self, handle: ctypes.c_void_p) -> dict[str, int]:
        out = EngineStats()
        load_library().iss_stats_get(handle, ctypes.byref(out))
        return {name: int(getattr(out, name)) for name, _ in EngineStats._fields_}

    def snapshot(self) -> dict[str, Any]:
        """Counters plus the number of peer connections being served."""
        handle = self._handle
        engine = self._engine_stats(handle) if handle is not None else dict(self._final, peers=0)
        with self._lock:
            mine = dict(self.stats)
        out: dict[str, Any] = {"fetches": 0, "bytes_sent": 0, "refused": 0, "errors": 0, "busy": 0,
                               "stalled": 0, **engine}
        for name, value in mine.items():
            out[name] = out.get(name, 0) + value
        out.setdefault("peers", 0)
        return out

    # ------------------------------------------------------------------ decisions
    def _count(self, name: str) -> None:
        with self._lock:
            self.stats[name] += 1

    def _replay(self, handle: ctypes.c_void_p, nonce: str, ts: float) -> str | None:
        raw = nonce.encode()
        rc = load_library().iss_replay_check(handle, raw, len(raw), ts, time.time())
        if rc == 0:
            return None
        if rc == 1:
            return "replayed request (nonce already used)"
        if rc == 2:
            return "request too old for the replay window (resend it)"
        return "server out of memory for its replay guard"

    def decide(self, body: bytes, peer: str,
               spent: bool = False) -> tuple[dict[str, Any], int | None, int, bool]:
        """Answer a request the C engine did not serve on its own.

        Parameters
        ----------
        body
            The request's JSON header (after the length prefix).
        peer
            The peer's address, for the log.
        spent
            The engine verified this request and accepted its nonce already (it spends a
            fetch's nonce before waiting for the key, then hands a miss here): not checked
            against the replay guard again.

        Returns
        -------
        (dict, int or None, int, bool)
            The reply header, the descriptor of the file to send after it (the engine sends
            and closes it) or ``None``, its size, and whether the connection may serve
            another request.
        """
        try:
            req = wire.parse_header(body)
        except WireError as exc:
            self._count("refused")
            _peer_log.warning("malformed request from %s: %s", peer, exc)
            return _error("WireError", str(exc)), None, 0, False
        # (a request the engine verified and held while it waited: its window was checked
        # as it arrived; a miss after a long wait is a miss, not a stale request)
        reason = wire.verify(self.settings.token, req, window=not spent)
        if reason is None and not spent:  # [replay] a captured request sent again is refused
            handle = self._handle
            if handle is None:  # (in flight while stop() lets transfers finish)
                return _error("PeerUnavailable", "server is stopping"), None, 0, False
            reason = self._replay(handle, req["nonce"], float(req["ts"]))
        if reason is not None:
            self._count("refused")
            _peer_log.warning("refused request from %s: %s", peer, reason)
            return _error("AuthenticationError", reason), None, 0, False
        op = req["op"]  # a str, checked by verify
        if op == "ping":
            return {"ok": True, "node": self.settings.node}, None, 0, True
        if op != "fetch":
            self._count("refused")
            return _error("WireError", f"unknown op {op[:100]!r}"), None, 0, False
        try:
            key = normalize_key(req["key"], self.settings.dir)
            fd, st = open_served(self.settings.dir, self.root_real, key)
        except KeyNotFoundError as exc:
            if isinstance(exc, KeyNotServed):
                self._count("refused")
                log.warning("refused to serve to %s: %s", peer, exc)
                return _error("KeyNotFoundError", str(exc)), None, 0, False
            log.debug("not serving to %s: %s", peer, exc)
            # a plain miss (say, a stream's next frame not published within the request's
            # wait): the connection stays usable
            return _error("KeyNotFoundError", str(exc)), None, 0, True
        except InstrideError as exc:
            self._count("refused")
            log.warning("refused key from %s: %s", peer, exc)
            return _error(type(exc).__name__, str(exc)), None, 0, False
        except OSError as exc:  # (out of descriptors or memory: RESOURCE_ERRORS)
            self._count("errors")
            log.warning("cannot serve %s to %s now: %s", key, peer, exc.strerror)
            return _error("PeerUnavailable", f"cannot open {key} now: {exc.strerror}"), None, 0, \
                False
        if req.get("count") is not None:
            # (several keys are sent by the C engine only: this key appeared after it looked,
            # or needed normalizing; the asker takes a miss as the end and fetches it again)
            os.close(fd)
            return _error("KeyNotFoundError", "not published in time"), None, 0, True
        log.debug("sending %s (%d bytes) to %s", key, st.st_size, peer)
        # "published": when its producer published it (its stamp), as the C engine says
        reply = {"ok": True, "key": key, "size": st.st_size, "published": st.st_mtime}
        return reply, fd, st.st_size, True

    def _decide_c(self, _ctx: Any, hdr: int, length: int, peer: bytes, spent: int, reply: int,
                  cap: int, reply_len: Any, fd: Any, size: Any) -> int:
        """The C engine's callback: :meth:`decide`, its reply copied into the engine's buffer."""
        out_fd = None
        try:
            answer, out_fd, nbytes, keep = self.decide(ctypes.string_at(hdr, length),
                                                       peer.decode(errors="replace"), bool(spent))
            data = json.dumps(answer, separators=(",", ":")).encode()
            if len(data) > cap:  # (messages are bounded; this is a last resort)
                data = json.dumps(_error(answer.get("error", "WireError"), "reply too long")).encode()
            ctypes.memmove(reply, data, len(data))
            reply_len[0] = len(data)
            fd[0] = -1 if out_fd is None else out_fd
            size[0] = nbytes
            return _KEEP if keep else 0
        except BaseException:  # never let one request take the server down
            self._count("errors")
            log.exception("unexpected error while serving a peer")
            if out_fd is not None:
                os.close(out_fd)
            reply_len[0] = 0
            fd[0] = -1
            return 0

    @staticmethod
    def _log_c(_ctx: Any, level: int, message: bytes) -> None:
        log.log(level, "%s", message.decode(errors="replace"))


__all__ = ["IDLE_TIMEOUT", "MAX_PEERS", "REQUEST_TIMEOUT", "SEND_RATE", "SEND_TIMEOUT", "TcpServer"]
