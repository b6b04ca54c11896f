"""The per-node data server (``instride serve``).

It has two faces:

* **peers** (TCP, ``INSTRIDE_ADDR``): other nodes fetch files of this node's managed
  directory. Each request is a length-prefixed JSON header signed with an HMAC of the job
  token; the reply header is followed by the body, sent with ``sendfile``. Keys are validated
  by the server itself: traversal or absolute paths get an error reply, never bytes.
* **thin clients** (Unix socket, ``$INSTRIDE_DIR/.instride/node.sock``): the C preload library
  and other local processes send one text line per request::

      CONSUME <timeout_ms or -1> <key>   ->  OK <absolute path>   |  ERR <errno> <message>
      PUBLISH <key>                      ->  OK <absolute path>   |  ERR <errno> <message>
      PING                               ->  OK pong

  ``CONSUME`` waits for the key, fetches it from its owner if needed and answers once the file
  is local; ``PUBLISH`` records a file the client already placed under its key atomically.

SIGTERM and SIGINT stop accepting, let in-flight requests finish for a grace period, then exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .client import Client
from .config import Settings, parse_addr
from .errors import InstrideError, KeyNotFoundError
from .keys import key_path, normalize_key
from .transport import wire

log = logging.getLogger("instride.server")

#: Longest line accepted on the Unix socket.
MAX_LINE = 4096
#: Seconds a peer has to send a request header once it started one.
REQUEST_TIMEOUT = 10.0
#: Seconds an idle kept-alive peer connection stays open.
IDLE_TIMEOUT = 300.0


class NodeServer:
    """Serve this node's managed directory to peers and local thin clients.

    Parameters
    ----------
    settings
        The node's settings (directory, address, token, Redis URL).
    grace
        Seconds in-flight requests may take to finish after SIGTERM.
    """

    def __init__(self, settings: Settings, *, grace: float = 10.0, workers: int = 64) -> None:
        self.settings = settings
        self.grace = grace
        self.client = Client(settings)
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="instride")
        self._servers: list[asyncio.base_events.Server] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._idle: set[asyncio.Task[Any]] = set()  # peer connections waiting for a request
        self._stopping = asyncio.Event()
        self.stats = {"fetches": 0, "bytes_sent": 0, "refused": 0, "errors": 0, "local": 0}

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start listening on TCP and on the Unix socket."""
        host, port = parse_addr(self.settings.addr)
        tcp = await asyncio.start_server(self._track(self._handle_peer), host, port,
                                         reuse_address=True, limit=wire.MAX_HEADER * 2)
        self._servers.append(tcp)
        sock = self.settings.socket
        sock.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        unix = await asyncio.start_unix_server(self._track(self._handle_local), str(sock),
                                               limit=MAX_LINE * 2)
        os.chmod(sock, 0o600)
        self._servers.append(unix)
        log.info("serving %s on %s:%d and %s (mode %s)", self.settings.dir, host, port, sock,
                 self.settings.mode)

    def _track(self, handler: Any) -> Any:
        async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._tasks.add(task)
            try:
                await handler(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
                pass
            except Exception:  # never let one client take the server down
                self.stats["errors"] += 1
                log.exception("unexpected error while serving a request")
            finally:
                self._tasks.discard(task)
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()

        return run

    async def stop(self) -> None:
        """Stop accepting; wait up to ``grace`` seconds for in-flight requests."""
        for srv in self._servers:
            srv.close()
        for task in list(self._idle):  # kept-alive connections with nothing in flight
            task.cancel()
        if self._tasks:
            log.info("waiting for %d in-flight request(s)", len(self._tasks))
            _done, pending = await asyncio.wait(set(self._tasks), timeout=self.grace)
            for task in pending:
                task.cancel()
        with contextlib.suppress(FileNotFoundError):
            self.settings.socket.unlink()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.client.close()
        log.info("stopped; stats %s", self.stats)

    async def run(self) -> None:
        """Serve until SIGTERM or SIGINT."""
        await self.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        print("instride serve: ready", flush=True)
        await self._stopping.wait()
        log.info("signal received, shutting down")
        await self.stop()

    # ------------------------------------------------------------------ peers (TCP)
    async def _reply_error(self, writer: asyncio.StreamWriter, err: str, message: str) -> None:
        writer.write(wire.pack({"ok": False, "error": err, "message": message[:1000]}))
        await writer.drain()

    async def _handle_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve requests on one connection until the peer closes it, errs, or idles out."""
        task = asyncio.current_task()
        while True:
            self._idle.add(task)  # type: ignore[arg-type]
            try:
                prefix = await asyncio.wait_for(reader.readexactly(4), IDLE_TIMEOUT)
            except (asyncio.IncompleteReadError, asyncio.TimeoutError):
                return
            finally:
                self._idle.discard(task)  # type: ignore[arg-type]
            if not await self._peer_request(prefix, reader, writer):
                return

    async def _peer_request(
        self, prefix: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer one request; return whether the connection may serve another."""
        peer = writer.get_extra_info("peername")
        try:
            n = wire.parse_length(prefix)
            req = wire.parse_header(await asyncio.wait_for(reader.readexactly(n), REQUEST_TIMEOUT))
        except wire.WireError as exc:
            self.stats["refused"] += 1
            log.warning("malformed request from %s: %s", peer, exc)
            await self._reply_error(writer, "WireError", str(exc))
            return False
        except asyncio.TimeoutError:
            log.warning("request from %s timed out", peer)
            return False
        reason = wire.verify(self.settings.token, req)
        if reason is not None:
            self.stats["refused"] += 1
            log.warning("refused request from %s: %s", peer, reason)
            await self._reply_error(writer, "AuthenticationError", reason)
            return False
        op = req.get("op")
        if op == "ping":
            writer.write(wire.pack({"ok": True, "node": self.settings.node}))
            await writer.drain()
            return True
        if op != "fetch":
            self.stats["refused"] += 1
            await self._reply_error(writer, "WireError", f"unknown op {op!r}")
            return False
        try:
            key = normalize_key(str(req.get("key")), self.settings.dir)
        except InstrideError as exc:
            self.stats["refused"] += 1
            log.warning("refused key from %s: %s", peer, exc)
            await self._reply_error(writer, type(exc).__name__, str(exc))
            return False
        path = key_path(key, self.settings.dir)
        try:
            fh = open(path, "rb")  # noqa: SIM115 - closed below, after sendfile
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            await self._reply_error(writer, "KeyNotFoundError", str(KeyNotFoundError(key)))
            return False
        with fh:
            size = os.fstat(fh.fileno()).st_size
            writer.write(wire.pack({"ok": True, "key": key, "size": size}))
            await writer.drain()
            if size:
                loop = asyncio.get_running_loop()
                await loop.sendfile(writer.transport, fh, 0, size)
            self.stats["fetches"] += 1
            self.stats["bytes_sent"] += size
        log.debug("sent %s (%d bytes) to %s", key, size, peer)
        return True

    # ------------------------------------------------------------------ thin clients (Unix)
    async def _handle_local(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.LimitOverrunError:
                writer.write(f"ERR {errno.E2BIG} request line too long\n".encode())
                await writer.drain()
                return
            except asyncio.IncompleteReadError:
                return
            reply = await self._local_request(line[:-1].decode("utf-8", errors="replace"))
            writer.write(reply.encode() + b"\n")
            await writer.drain()

    async def _local_request(self, line: str) -> str:
        self.stats["local"] += 1
        verb, _, rest = line.partition(" ")
        loop = asyncio.get_running_loop()
        try:
            if verb == "PING":
                return "OK pong"
            if verb == "CONSUME":
                raw_timeout, _, key = rest.partition(" ")
                ms = int(raw_timeout)
                timeout = None if ms < 0 else ms / 1000.0
                if timeout is None:
                    timeout = self.settings.timeout
                path = await loop.run_in_executor(self.executor, self.client.consume, key, timeout)
                return f"OK {path}"
            if verb == "PUBLISH":
                key = self.client.key(rest)
                path = key_path(key, self.settings.dir)
                if not path.is_file():
                    return f"ERR {errno.ENOENT} {key} is not in place under the managed directory"
                await loop.run_in_executor(self.executor, self.client._after_publish, key, path, True)
                return f"OK {path}"
            return f"ERR {errno.EINVAL} unknown request {verb!r}"
        except InstrideError as exc:
            return f"ERR {exc.errno} {exc}"
        except ValueError as exc:
            return f"ERR {errno.EINVAL} {exc}"
        except OSError as exc:
            return f"ERR {exc.errno or errno.EIO} {exc}"


def serve(settings: Settings | None = None, *, grace: float = 10.0) -> None:
    """Run a :class:`NodeServer` in the foreground until SIGTERM/SIGINT."""
    settings = settings or Settings.from_env()
    started = time.monotonic()
    server = NodeServer(settings, grace=grace)
    asyncio.run(server.run())
    log.info("ran %.1f s", time.monotonic() - started)
