"""The per-node data server (``instride serve``).

It has two faces:

* **peers** (TCP, ``INSTRIDE_ADDR``): other nodes fetch files of this node's managed
  directory. Each request is a length-prefixed JSON header signed with an HMAC of the job
  token; the reply header is followed by the body, sent with ``sendfile``. Keys are validated
  by the server itself: traversal or absolute paths get an error reply, never bytes. Only
  regular files are served: a symbolic link (as the key's last component or as a directory
  on the way), a FIFO, a device or a directory under a key gets a ``KeyNotFoundError`` reply,
  and so does a file whose resolved path is outside the managed directory.
* **thin clients** (Unix socket, ``$INSTRIDE_DIR/.instride/node.sock``, mode 0600 from its
  creation on, in a 0700 ``.instride/``): the C preload library and other local processes
  send one text line per request::

      CONSUME <timeout_ms or -1> <key>   ->  OK <absolute path>   |  ERR <errno> <message>
      PUBLISH <key>                      ->  OK <absolute path>   |  ERR <errno> <message>
      OVERWRITE <key>                    ->  OK <absolute path>   |  ERR <errno> <message>
      PING                               ->  OK pong
      STATS                              ->  OK <one-line JSON object of counters>

  ``CONSUME`` waits for the key, fetches it from its owner if needed and answers once the file
  is local (``-1``: the server's ``INSTRIDE_TIMEOUT``, forever when unset). ``PUBLISH``
  records a regular file the client already placed under its key atomically, **write-once**:
  if another node already published the key, the local file is removed and the answer is
  ``ERR 17`` (EEXIST). ``OVERWRITE`` records it as a new version replacing any earlier one
  (what a shim run with ``INSTRIDE_OVERWRITE=1`` sends). Replies are always one line: newlines
  in error messages are flattened. A client that disconnects while its ``CONSUME`` waits gets
  no reply and its wait ends within about a second; waits still pending at shutdown are
  answered ``ERR 103`` (ECONNABORTED).

Resource bounds: waits run in a pool of ``workers`` threads, in slices of at most a second, so
an abandoned or cancelled wait frees its thread promptly; ``PUBLISH``/``OVERWRITE`` and
``CONSUME`` of a key already on this node use a separate small pool that waits can never
starve. At most ``max_peers`` TCP connections are served at once (others get a ``WireError``
"busy" reply); a new connection must send its first request within ``request_timeout``
seconds, only then does it get the long keep-alive (:data:`IDLE_TIMEOUT`); every write to a
peer has a deadline (``send_timeout``, plus size / 50 MB/s for a file body), so a peer that
stops reading cannot pin a transfer.

Security notes: requests are authenticated with the job token (HMAC-SHA256 over op, key,
nonce and timestamp) and must be within :data:`~instride.transport.wire.MAX_SKEW` (300 s) of
the server's clock. Each nonce is accepted once (:class:`~instride.transport.replay.ReplayGuard`
remembers them for that window, bounded in memory), so a captured request sent again is
refused with an ``AuthenticationError`` reply. Requests and replies are not encrypted: an
observer on the network sees the file's bytes in the original reply. The token protects
against fetching keys without it, not against eavesdropping: run the cluster traffic on a
trusted network. Hard links are not detected: a hard link under the managed directory to a
file readable by the server's user is served like any other regular file.

SIGTERM and SIGINT stop accepting, cancel pending waits, let in-flight requests finish for a
grace period, then exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import json
import logging
import os
import signal
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from .client import Client
from .config import Settings, parse_addr
from .errors import ConsumeTimeout, InstrideError, KeyNotFoundError
from .keys import key_path, normalize_key
from .transport import wire
from .transport.replay import ReplayGuard

log = logging.getLogger("instride.server")

#: Longest line accepted on the Unix socket.
MAX_LINE = 4096
#: Longest error message put in a reply (the shim's reply buffer is PATH_MAX + 128).
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
#: Longest single blocking call of a wait; cancellation is noticed between slices.
WAIT_SLICE = 1.0
#: How often a pending wait checks whether its client is gone.
WATCH_INTERVAL = 0.2
#: Threads for publications and for consumptions of keys already on this node.
QUICK_WORKERS = 4

T = TypeVar("T")


class _WaitCancelled(Exception):
    """Raised in a worker thread when its wait was cancelled between slices."""


class _ShuttingDown(Exception):
    """A wait ended because the server is stopping."""


def one_line(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` on one line: CR, LF and other line breaks become spaces; cut at ``limit``."""
    flat = " ".join(text.splitlines()) if text else ""
    flat = "".join(" " if ord(c) < 0x20 or c == "\x7f" else c for c in flat)
    return flat[:limit]


def _err(code: int | None, message: object) -> str:
    return f"ERR {code or errno.EIO} {one_line(str(message))}"


class NodeServer:
    """Serve this node's managed directory to peers and local thin clients.

    Parameters
    ----------
    settings
        The node's settings (directory, address, token, Redis URL).
    grace
        Seconds in-flight requests may take to finish after SIGTERM.
    workers
        Threads for waiting ``CONSUME`` requests (each pending wait holds one).
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
        grace: float = 10.0,
        workers: int = 64,
        max_peers: int = MAX_PEERS,
        request_timeout: float = REQUEST_TIMEOUT,
        send_timeout: float = SEND_TIMEOUT,
    ) -> None:
        self.settings = settings
        self.grace = grace
        self.max_peers = max_peers
        self.request_timeout = request_timeout
        self.send_timeout = send_timeout
        self.client = Client(settings)
        self.root_real = os.path.realpath(settings.dir)
        self.replays = ReplayGuard()  # [replay] each signed request is accepted once
        self.waits = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="instride-wait")
        self.quick = ThreadPoolExecutor(max_workers=QUICK_WORKERS, thread_name_prefix="instride-quick")
        self._servers: list[asyncio.base_events.Server] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._idle: set[asyncio.Task[Any]] = set()  # connections waiting for a request
        self._cancels: set[threading.Event] = set()  # one per pending wait
        self._stopping = asyncio.Event()
        self._closing = False
        self._lock = threading.Lock()
        self._busy = 0  # jobs running in worker threads
        self._waiting = 0  # of which waits (CONSUME)
        self._peers = 0
        self.stats = {"fetches": 0, "bytes_sent": 0, "refused": 0, "errors": 0, "local": 0,
                      "abandoned": 0, "busy": 0, "stalled": 0}

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start listening on TCP and on the Unix socket."""
        host, port = parse_addr(self.settings.addr)
        tcp = await asyncio.start_server(self._track(self._handle_peer), host, port,
                                         reuse_address=True, limit=wire.MAX_HEADER * 2)
        self._servers.append(tcp)
        internal = self.settings.internal_dir
        internal.mkdir(mode=0o700, parents=True, exist_ok=True)
        if os.stat(internal).st_uid == os.getuid():
            os.chmod(internal, 0o700)
        sock = self.settings.socket
        sock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        old_umask = os.umask(0o177)  # the socket is 0600 from the moment it exists
        try:
            unix = await asyncio.start_unix_server(self._track(self._handle_local), str(sock),
                                                   limit=MAX_LINE * 2)
        finally:
            os.umask(old_umask)
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
                # Cancelled here too at loop shutdown: end quietly, never as a cancelled task
                # (asyncio's stream callback would log its CancelledError as an error).
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.wait_for(writer.wait_closed(), 1.0)

        return run

    @property
    def busy(self) -> int:
        """Jobs currently running in worker threads."""
        return self._busy

    async def stop(self) -> None:
        """Stop accepting; cancel waits; wait up to ``grace`` seconds for in-flight requests."""
        self._closing = True
        for srv in self._servers:
            srv.close()
        for cancel in list(self._cancels):  # pending waits end within a slice
            cancel.set()
        for task in list(self._idle):  # connections with nothing in flight
            task.cancel()
        if self._tasks:
            log.info("waiting for %d in-flight request(s)", len(self._tasks))
            _done, pending = await asyncio.wait(set(self._tasks), timeout=self.grace)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        with contextlib.suppress(FileNotFoundError):
            self.settings.socket.unlink()
        for pool in (self.waits, self.quick):
            pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + WAIT_SLICE + 2.0
        while self._busy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._busy:
            log.warning("%d worker job(s) still running at exit", self._busy)
        else:
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

    def snapshot(self) -> dict[str, int]:
        """Counters, plus the current numbers of waits, worker jobs and peer connections."""
        return {**self.stats, "waiting": self._waiting, "workers_busy": self._busy,
                "peers": self._peers}

    # ------------------------------------------------------------------ worker threads
    async def _in_pool(self, pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            pool, functools.partial(self._counted, fn, *args))

    def _counted(self, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            self._busy += 1
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._busy -= 1

    def _consume_sliced(self, key: str, timeout: float | None, cancel: threading.Event) -> Path:
        """``client.consume`` in slices of at most :data:`WAIT_SLICE`, checking ``cancel``."""
        with self._lock:
            self._busy += 1
            self._waiting += 1
        try:
            start = time.monotonic()
            deadline = None if timeout is None else start + timeout
            while True:
                if cancel.is_set():
                    raise _WaitCancelled()
                left = WAIT_SLICE if deadline is None else deadline - time.monotonic()
                try:
                    return self.client.consume(key, timeout=max(0.0, min(WAIT_SLICE, left)))
                except ConsumeTimeout:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise ConsumeTimeout(key, time.monotonic() - start) from None
        finally:
            with self._lock:
                self._busy -= 1
                self._waiting -= 1

    @staticmethod
    def _gone(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Whether the client closed its connection (without reading anything from it)."""
        return reader.at_eof() or reader.exception() is not None or writer.transport.is_closing()

    async def _wait(
        self, key: str, timeout: float | None, reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> Path | None:
        """Run a sliced wait; ``None`` when the client went away (the wait is cancelled)."""
        if self._closing:
            raise _ShuttingDown()
        local = os.path.exists(key_path(key, self.settings.dir))
        pool = self.quick if local else self.waits
        cancel = threading.Event()
        self._cancels.add(cancel)
        fut = asyncio.get_running_loop().run_in_executor(pool, self._consume_sliced, key, timeout,
                                                         cancel)
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=WATCH_INTERVAL)
                if done:
                    try:
                        return fut.result()
                    except _WaitCancelled:
                        raise _ShuttingDown() from None
                if self._closing:
                    raise _ShuttingDown()
                if self._gone(reader, writer):
                    self.stats["abandoned"] += 1
                    log.debug("client gone; wait for %s cancelled", key)
                    return None
        finally:
            if not fut.done():
                cancel.set()
                fut.cancel()  # a queued job never starts; a running one ends at its next slice
            self._cancels.discard(cancel)

    # ------------------------------------------------------------------ peers (TCP)
    async def _drain(self, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.wait_for(writer.drain(), self.send_timeout)
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
                    prefix = await asyncio.wait_for(reader.readexactly(4), wait)
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

    def _open_served(self, key: str) -> tuple[int, os.stat_result]:
        """Open ``key`` for sending: a regular file, no symlink, inside the managed directory.

        Raises ``KeyNotFoundError`` (with the reason) for anything else.
        """
        path = key_path(key, self.settings.dir)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise KeyNotFoundError(key) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise KeyNotServed(key, "it is a symbolic link") from None
            raise KeyNotServed(key, os.strerror(exc.errno or errno.EIO)) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise KeyNotServed(key, "it is not a regular file")
            try:  # where the opened file really is (immune to changes after the open)
                real = os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)")
            except OSError:
                real = os.path.realpath(path)
            self._check_real(key, real)
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def _check_real(self, key: str, real: str) -> None:
        """Refuse a file whose resolved path is not exactly the key's path in the directory."""
        if real == os.path.join(self.root_real, key):
            return
        if not real.startswith(self.root_real.rstrip(os.sep) + os.sep):
            raise KeyNotServed(key, "it resolves outside the managed directory")
        raise KeyNotServed(key, "it is reached through a symbolic link")

    async def _peer_request(
        self, prefix: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer one request; return whether the connection may serve another."""
        peer = writer.get_extra_info("peername")
        try:
            n = wire.parse_length(prefix)
            body = await asyncio.wait_for(reader.readexactly(n), self.request_timeout)
            req = wire.parse_header(body)
        except wire.WireError as exc:
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
            fd, st = self._open_served(key)
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
            await self._drain(writer)
            if size:
                loop = asyncio.get_running_loop()
                try:
                    await asyncio.wait_for(loop.sendfile(writer.transport, fh, 0, size),
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

    # ------------------------------------------------------------------ thin clients (Unix)
    async def _handle_local(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        while True:
            self._idle.add(task)
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.LimitOverrunError:
                writer.write(f"ERR {errno.E2BIG} request line too long\n".encode())
                await self._drain(writer)
                return
            except asyncio.IncompleteReadError:
                return
            finally:
                self._idle.discard(task)
            reply = await self._local_request(line[:-1].decode("utf-8", errors="replace"),
                                              reader, writer)
            if reply is None:  # the client went away: nobody to answer
                return
            writer.write(reply.encode() + b"\n")
            await self._drain(writer)
            if self._closing:
                return

    def _in_place(self, key: str) -> Path:
        """The path of ``key`` if it holds a regular file inside the managed directory."""
        path = key_path(key, self.settings.dir)
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise _LocalError(errno.ENOENT,
                              f"{key} is not in place under the managed directory") from None
        if not stat.S_ISREG(st.st_mode):
            raise _LocalError(errno.EINVAL, f"{key} is not a regular file (symbolic links, "
                              "directories and special files cannot be published)")
        try:
            self._check_real(key, os.path.realpath(path))
        except KeyNotServed as exc:
            raise _LocalError(errno.EINVAL, f"{key} cannot be published: {exc.reason}") from None
        return path

    async def _local_request(
        self, line: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> str | None:
        """Answer one line; ``None`` means: send nothing (the client is gone)."""
        self.stats["local"] += 1
        verb, _, rest = line.partition(" ")
        try:
            if verb == "PING":
                return "OK pong"
            if verb == "STATS":
                return "OK " + json.dumps(self.snapshot(), separators=(",", ":"))
            if verb == "CONSUME":
                raw_timeout, _, key = rest.partition(" ")
                try:
                    ms = int(raw_timeout)
                except ValueError:
                    return _err(errno.EINVAL, f"bad timeout {raw_timeout[:50]!r} (milliseconds or -1)")
                key = self.client.key(key)
                timeout = self.settings.timeout if ms < 0 else ms / 1000.0
                path = await self._wait(key, timeout, reader, writer)
                return None if path is None else f"OK {path}"
            if verb in ("PUBLISH", "OVERWRITE"):
                key = self.client.key(rest)
                path = self._in_place(key)
                if self._closing:
                    raise _ShuttingDown()
                await self._in_pool(self.quick, functools.partial(
                    self.client.register, key, overwrite=verb == "OVERWRITE"))
                return f"OK {path}"
            return _err(errno.EINVAL, f"unknown request {verb[:50]!r}")
        except _ShuttingDown:
            return _err(errno.ECONNABORTED, "server is shutting down")
        except _LocalError as exc:
            return _err(exc.code, exc.message)
        except InstrideError as exc:
            return _err(exc.errno, exc)
        except ValueError as exc:
            return _err(errno.EINVAL, exc)
        except OSError as exc:
            return _err(exc.errno or errno.EIO, exc)
        except Exception as exc:  # a bug or an untranslated library error: answer, log it
            self.stats["errors"] += 1
            log.exception("unexpected error answering %r", line[:200])
            return _err(errno.EIO, f"internal error: {type(exc).__name__}: {exc}")


class _LocalError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class KeyNotServed(KeyNotFoundError):
    """A key's file exists but is not a regular file inside the managed directory.

    Peers get it as a ``KeyNotFoundError`` reply (with the reason).
    """

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(key)
        self.reason = reason
        self.strerror = f"key {key!r} is not served: {reason}"


def serve(
    settings: Settings | None = None,
    *,
    grace: float = 10.0,
    workers: int = 64,
    max_peers: int = MAX_PEERS,
    request_timeout: float = REQUEST_TIMEOUT,
    send_timeout: float = SEND_TIMEOUT,
) -> None:
    """Run a :class:`NodeServer` in the foreground until SIGTERM/SIGINT.

    Parameters are those of :class:`NodeServer`; ``settings`` default to the environment.
    """
    settings = settings or Settings.from_env()
    started = time.monotonic()
    server = NodeServer(settings, grace=grace, workers=workers, max_peers=max_peers,
                        request_timeout=request_timeout, send_timeout=send_timeout)
    asyncio.run(server.run())
    log.info("ran %.1f s", time.monotonic() - started)
    if server.busy:
        # A worker stuck in a blocking call would keep the interpreter from exiting (it joins
        # pool threads at exit); the server was asked to stop, so leave without them.
        logging.shutdown()
        os._exit(0)
