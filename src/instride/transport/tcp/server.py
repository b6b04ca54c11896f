"""TCP transport, server half: serve this node's managed directory to peers.

Each request is a length-prefixed JSON header signed with an HMAC of the job token
(:mod:`instride.transport.wire`); the reply header is followed by the body, sent with
``sendfile``. Keys are validated by the server itself: traversal or absolute paths get an
error reply, never bytes. Only regular files are served (:mod:`instride.store.served`): a
symbolic link, a FIFO, a device or a directory under a key gets a ``KeyNotFoundError`` reply,
and so does a file whose resolved path is outside the managed directory.

Resource bounds: at most ``max_peers`` connections are served at once (others get a
``WireError`` "busy" reply); a new connection must send its first request within
``request_timeout`` seconds, only then does it get the long keep-alive (:data:`IDLE_TIMEOUT`);
every write to a peer has a deadline (``send_timeout``, plus size / 50 MB/s for a file body),
so a peer that stops reading cannot pin a transfer.

Security notes: requests are authenticated with the job token (HMAC-SHA256 over op, key,
nonce and timestamp) and must be within :data:`~instride.transport.wire.MAX_SKEW` (300 s) of
the server's clock. Each nonce is accepted once (:class:`~instride.transport.replay.ReplayGuard`
remembers them for that window, bounded in memory), so a captured request sent again is
refused with an ``AuthenticationError`` reply. Requests and replies are not encrypted: an
observer on the network sees the file's bytes in the original reply. The token protects
against fetching keys without it, not against eavesdropping: run the cluster traffic on a
trusted network. Hard links are not detected: a hard link under the managed directory to a
file readable by the server's user is served like any other regular file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from ...config import Settings, parse_addr
from ...errors import InstrideError, KeyNotFoundError, KeyNotServed, WireError
from ...keys import normalize_key
from ...store.served import open_served
from .. import wire
from ..replay import ReplayGuard

log = logging.getLogger("instride.server")

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

_T = TypeVar("_T")


async def _within(aw: Awaitable[_T], seconds: float) -> _T:
    """``await aw`` with a deadline; :class:`asyncio.TimeoutError` past it.

    ``asyncio.timeout`` (Python 3.11+) cancels in place; ``wait_for`` wraps the awaitable in a
    new task, which cost a noticeable share of the server's CPU per request.
    """
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await aw
    return await asyncio.wait_for(aw, seconds)  # pragma: no cover - Python 3.10


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
        self.root_real = os.path.realpath(settings.dir)
        self.replays = ReplayGuard()  # [replay] each signed request is accepted once
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._idle: set[asyncio.Task[Any]] = set()  # connections waiting for a request
        self._closing = False
        self._peers = 0
        self.stats = {"fetches": 0, "bytes_sent": 0, "refused": 0, "errors": 0, "busy": 0,
                      "stalled": 0}

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Listen on ``settings.addr``."""
        host, port = parse_addr(self.settings.addr)
        self._server = await asyncio.start_server(self._track, host, port, reuse_address=True,
                                                  limit=wire.MAX_HEADER * 2)

    async def _track(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._handle_peer(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        except Exception:  # never let one peer take the server down
            self.stats["errors"] += 1
            log.exception("unexpected error while serving a peer")
        finally:
            self._tasks.discard(task)
            writer.close()
            # Cancelled here too at loop shutdown: end quietly, never as a cancelled task.
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def stop(self, grace: float) -> None:
        """Stop accepting, drop idle connections, give transfers ``grace`` seconds."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for task in list(self._idle):
            task.cancel()
        if self._tasks:
            log.info("waiting for %d in-flight transfer(s)", len(self._tasks))
            _done, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)

    def snapshot(self) -> dict[str, Any]:
        """Counters plus the number of peer connections being served."""
        return {**self.stats, "peers": self._peers}

    # ------------------------------------------------------------------ requests
    async def _drain(self, writer: asyncio.StreamWriter) -> None:
        try:
            await _within(writer.drain(), self.send_timeout)
        except asyncio.TimeoutError:
            self.stats["stalled"] += 1
            log.warning("%s stopped reading; connection dropped", writer.get_extra_info("peername"))
            writer.transport.abort()
            raise ConnectionResetError("peer stopped reading") from None

    async def _reply_error(self, writer: asyncio.StreamWriter, err: str, message: str) -> None:
        writer.write(wire.pack({"ok": False, "error": err, "message": message[:MAX_MESSAGE]}))
        await self._drain(writer)

    async def _handle_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve requests on one connection until the peer closes it, errs, or idles out."""
        peer = writer.get_extra_info("peername")
        if self._peers >= self.max_peers:
            self.stats["busy"] += 1
            log.warning("refused connection from %s: %d connections already", peer, self._peers)
            await self._reply_error(writer, "WireError", "busy: too many connections, retry later")
            return
        self._peers += 1
        task = asyncio.current_task()
        assert task is not None
        wait = self.request_timeout  # the long keep-alive only after a successful request
        try:
            while True:
                self._idle.add(task)
                try:
                    prefix = await _within(reader.readexactly(4), wait)
                except asyncio.IncompleteReadError as exc:
                    if exc.partial:
                        await self._refuse(writer, peer, "truncated length prefix")
                    return
                except asyncio.TimeoutError:
                    log.debug("connection from %s idle for %.0f s: closed", peer, wait)
                    return
                finally:
                    self._idle.discard(task)
                if not await self._peer_request(prefix, reader, writer) or self._closing:
                    return
                wait = IDLE_TIMEOUT
        finally:
            self._peers -= 1

    async def _refuse(self, writer: asyncio.StreamWriter, peer: Any, reason: str) -> None:
        self.stats["refused"] += 1
        log.warning("malformed request from %s: %s", peer, reason)
        await self._reply_error(writer, "WireError", reason)

    async def _peer_request(
        self, prefix: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer one request; return whether the connection may serve another."""
        peer = writer.get_extra_info("peername")
        try:
            n = wire.parse_length(prefix)
            body = await _within(reader.readexactly(n), self.request_timeout)
            req = wire.parse_header(body)
        except WireError as exc:
            await self._refuse(writer, peer, str(exc))
            return False
        except asyncio.IncompleteReadError as exc:
            await self._refuse(writer, peer, f"truncated header ({len(exc.partial)} bytes)")
            return False
        except asyncio.TimeoutError:
            await self._refuse(writer, peer, "timed out reading the request header")
            return False
        reason = wire.verify(self.settings.token, req)
        if reason is None:  # [replay] a captured request sent again is refused
            reason = self.replays.check(req["nonce"], float(req["ts"]), now=time.time())
        if reason is not None:
            self.stats["refused"] += 1
            log.warning("refused request from %s: %s", peer, reason)
            await self._reply_error(writer, "AuthenticationError", reason)
            return False
        op = req["op"]  # a str, checked by verify
        if op == "ping":
            writer.write(wire.pack({"ok": True, "node": self.settings.node}))
            await self._drain(writer)
            return True
        if op != "fetch":
            self.stats["refused"] += 1
            await self._reply_error(writer, "WireError", f"unknown op {op[:100]!r}")
            return False
        try:
            key = normalize_key(req["key"], self.settings.dir)
            fd, st = open_served(self.settings.dir, self.root_real, key)
        except KeyNotFoundError as exc:
            if isinstance(exc, KeyNotServed):
                self.stats["refused"] += 1
                log.warning("refused to serve to %s: %s", peer, exc)
            else:
                log.debug("not serving to %s: %s", peer, exc)
            await self._reply_error(writer, "KeyNotFoundError", str(exc))
            return False
        except InstrideError as exc:
            self.stats["refused"] += 1
            log.warning("refused key from %s: %s", peer, exc)
            await self._reply_error(writer, type(exc).__name__, str(exc))
            return False
        with open(fd, "rb") as fh:  # takes over fd
            size = st.st_size
            writer.write(wire.pack({"ok": True, "key": key, "size": size}))
            if not size:
                await self._drain(writer)
            else:
                # loop.sendfile flushes the reply header first; between its os.sendfile calls
                # (each bounded by the socket's send buffer) the loop serves other peers, so a
                # large body does not hold back small ones.
                loop = asyncio.get_running_loop()
                try:
                    await _within(loop.sendfile(writer.transport, fh, 0, size),
                                  self.send_timeout + size / SEND_RATE)
                except asyncio.TimeoutError:
                    self.stats["stalled"] += 1
                    log.warning("transfer of %s (%d bytes) to %s stalled; connection dropped",
                                key, size, peer)
                    writer.transport.abort()
                    return False
            self.stats["fetches"] += 1
            self.stats["bytes_sent"] += size
        log.debug("sent %s (%d bytes) to %s", key, size, peer)
        return True


__all__ = ["IDLE_TIMEOUT", "MAX_PEERS", "REQUEST_TIMEOUT", "SEND_RATE", "SEND_TIMEOUT", "TcpServer"]
