"""The node agent: the Unix-socket face of ``instride serve`` for thin clients.

The C preload library and other local processes connect to ``$INSTRIDE_DIR/.instride/node.sock``
(mode 0600 from its creation on, in a 0700 ``.instride/``) and send one text line per request::

    CONSUME <timeout_ms or -1> <key>   ->  [WAIT <ms> ...] OK <absolute path> | ERR <errno> <message>
    PUBLISH <key>                      ->  OK <absolute path>  |  ERR <errno> <message>
    OVERWRITE <key>                    ->  OK <absolute path>  |  ERR <errno> <message>
    DELETE <key>                       ->  OK <absolute path>  |  ERR <errno> <message>
    PING                               ->  OK pong
    STATS                              ->  OK <one-line JSON object of counters>

``CONSUME`` waits for the key, fetches it from its owner if needed (through the node's
:class:`~instride.client.Client`, so exactly as a Python consumer would) and answers once the
file is local (``-1``: the server's ``INSTRIDE_TIMEOUT``, forever when unset). The timeout bounds
the wait for the key's publication, not the fetch of its bytes from its owner node that follows
(a large file on a slow link may take longer): while the request runs past its timeout — a
fetch under way — and :data:`PROGRESS_INTERVAL` after its arrival at the earliest, the server
sends a progress line ``WAIT <milliseconds since the request>`` about every
:data:`PROGRESS_INTERVAL`, then the answer. A thin client waits for the answer its timeout and
a grace, re-armed by each progress line (``csrc/core/agent.c``): a transfer that goes on is
waited for, a server that stops reporting still ends the wait. A request answered sooner (any
key fetched in less than its timeout) gets its one line and nothing more. ``PUBLISH``
records a regular file the client already placed under its key atomically, **write-once**: if
another node already published the key (or this node, other bytes), the local file is removed
and the answer is ``ERR 17`` (EEXIST); the very file recorded already (this node, the same
bytes: a repeated ``PUBLISH``, or one that settles an unsettled publication) is confirmed.
``OVERWRITE`` records it as a new version replacing any earlier one (what a shim run
with ``INSTRIDE_OVERWRITE=1`` sends). ``DELETE`` tells that a client removed the key's file on
this node (a shim's ``unlink``/``remove``, or its rename away): where that file was this node's
original, the key's record is deleted, only while it is the record looked up (a publication
made meanwhile stays, and no file is ever removed here; other nodes no longer see the key;
it may be published again); a fetched copy
removed, a file in place again, or a key of another node keep their records (see
:meth:`LocalAgent._unpublish`). Every answer is one line (``CONSUME``'s after its
progress lines, if any): newlines in error messages are flattened. A client that disconnects
while its ``CONSUME`` waits gets no reply and its wait ends within about a second; waits still
pending at shutdown are answered ``ERR 103`` (ECONNABORTED).

Resource bounds: waits run in a pool of ``workers`` threads, in slices of at most a second, so
an abandoned or cancelled wait frees its thread promptly; ``PUBLISH``/``OVERWRITE``/``DELETE`` and
``CONSUME`` of a key already on this node use a separate small pool that waits can never starve.
A ``CONSUME``'s timeout runs from its arrival (one of a key not on the node still queued when it
ends: ``ERR 110``). A connection must send a whole line within :data:`LINE_TIMEOUT` of
connecting or of its last answer (``ERR 110``, closed), and at most a quarter as many
connections as the process may open files are served at once (``ERR 24``). A request that
is not UTF-8 is refused (``ERR 22``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import json
import logging
import os
import resource
import select
import socket
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from .client import Client
from .config import Settings
from .errors import AgentError, ConsumeTimeout, InstrideError, KeyNotServed, ServeError
from .keys import key_path
from .store.served import check_real

log = logging.getLogger("instride.server")

#: Longest request line accepted on the Unix socket, its newline aside (a longer one is
#: answered ``E2BIG`` and its connection closed; the reader's buffer limit is twice this, so
#: that pipelined lines fit: the bound is checked on each line read).
MAX_LINE = 4096
#: Longest error message put in a reply (the shim's reply buffer is PATH_MAX + 128).
MAX_MESSAGE = 1000
#: Seconds any write to a client may take.
SEND_TIMEOUT = 60.0
#: Longest single blocking call of a wait; cancellation is noticed between slices.
WAIT_SLICE = 1.0
#: How often a pending wait checks whether its client is gone.
WATCH_INTERVAL = 0.2
#: Threads for publications and for consumptions of keys already on this node.
QUICK_WORKERS = 4
#: Seconds a connection may take to send a whole request line, from its connection or its
#: last answer on (a client that sends half a line, or nothing, is dropped, not held forever).
LINE_TIMEOUT = 60.0
#: Longest timeout a ``CONSUME`` may ask for, in milliseconds (~31 years).
MAX_TIMEOUT_MS = 10**12
#: Seconds between the progress lines (``WAIT <ms>``) of a ``CONSUME`` whose fetch runs past
#: its timeout; the first comes this long after the request at the earliest (none on the fast
#: path). A thin client re-arms its wait for the answer on each (5 s in ``csrc/core/agent.c``).
PROGRESS_INTERVAL = 1.0

T = TypeVar("T")


class _WaitCancelled(InstrideError):
    """Raised in a worker thread when its wait was cancelled between slices (never leaves
    the agent)."""


class _ShuttingDown(InstrideError):
    """A wait ended because the server is stopping (answered ``ERR 103``, never raised out)."""


class _Answer:
    """Who answers one ``CONSUME``: the worker thread that has the path, straight into the
    client's socket, or the event loop (an error, a shutdown, a client gone, a reply of the
    connection still in the loop's buffer). The side that claims the answer first writes it;
    the other writes nothing.

    The worker's own answer spares the hop back to the event loop (its wake-up, a task
    switch, the write): through the preload library across two emulated nodes the median
    went from 1.99 to 1.74 ms in alternating runs (RESULTS.md, round 31).
    """

    def __init__(self, fd: int | None) -> None:
        # a duplicate of the client's socket (non-blocking), closed once the worker's job
        # has ended or was called off: a connection the loop closes meanwhile keeps its
        # socket until then (its client sees the end of it only then, at most a wait slice
        # later, after the loop's answer), and its number, if reused, is not the worker's;
        # None: the loop answers
        self.fd = None if fd is None else os.dup(fd)
        self._claimed = threading.Lock()

    def claim(self) -> bool:
        """Take the answer (``False``: the other side has)."""
        return self._claimed.acquire(blocking=False)

    def close(self, _done: object = None) -> None:
        """Close the worker's socket (called once its job has ended or was called off)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def send(self, path: Path) -> bytes | None:
        """In the worker: ``OK <path>`` written to the client if the worker may (``None``
        where it may not: the loop answers); the bytes the socket did not take (``b""``: all
        sent, or the client is gone), for the loop to write after them."""
        if self.fd is None or not self.claim():
            return None
        line = f"OK {path}\n".encode()
        try:
            return line[os.write(self.fd, line):]
        except BlockingIOError:  # (a client that reads no replies: the loop waits for it)
            return line
        except OSError:  # the client went away: its connection ends at the next read
            return b""


def one_line(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` on one line: CR, LF and other line breaks become spaces; cut at ``limit``."""
    flat = " ".join(text.splitlines()) if text else ""
    flat = "".join(" " if ord(c) < 0x20 or c == "\x7f" else c for c in flat)
    return flat[:limit]


def _answers(path: Path, timeout: float = 2.0) -> bool:
    """Whether something accepts connections on the Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
            return False  # nothing there, or a socket nobody listens on any more
        except TimeoutError:
            return True  # a listener with a full backlog: alive
        except OSError as exc:
            # EAGAIN: a full backlog, alive; anything else (not a socket, no permission):
            # replaced, or refused when it is unlinked
            return exc.errno == errno.EAGAIN
        return True


def _err(code: int | None, message: object) -> str:
    return f"ERR {code or errno.EIO} {one_line(str(message))}"


class LocalAgent:
    """Answer thin clients on this node's Unix socket.

    Parameters
    ----------
    settings
        The node's settings (directory, socket path, default timeout).
    client
        The client whose engine consumes and records keys.
    workers
        Threads for waiting ``CONSUME`` requests (each pending wait holds one).
    send_timeout
        Seconds a write to a client may take.
    stats
        Called by ``STATS`` for the counters to report (default: this agent's own).
    """

    def __init__(
        self,
        settings: Settings,
        client: Client,
        *,
        workers: int = 64,
        send_timeout: float = SEND_TIMEOUT,
        stats: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.settings = settings
        self.client = client
        self.send_timeout = send_timeout
        self.root_real = os.path.realpath(settings.dir)
        self.waits = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="instride-wait")
        self.quick = ThreadPoolExecutor(max_workers=QUICK_WORKERS, thread_name_prefix="instride-quick")
        self._report = stats or self.snapshot
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._idle: set[asyncio.Task[Any]] = set()  # connections waiting for a request
        self._cancels: set[threading.Event] = set()  # one per pending wait
        self._closing = False
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket we made
        self._lock = threading.Lock()
        self._busy = 0  # jobs running in worker threads
        self._waiting = 0  # of which waits (CONSUME)
        self.stats = {"local": 0, "abandoned": 0, "errors": 0, "stalled": 0,
                      "answered_at_once": 0, "idle_closed": 0, "refused_connections": 0,
                      "progress_lines": 0}
        #: most connections served at once (a quarter of the process's descriptors: a waiting
        #: CONSUME holds a second one, a duplicate its worker may answer on, and the rest is
        #: for files, sockets to peers, Redis); one more is answered ``ERR 24`` and closed
        self.max_connections = max(64, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Create the socket (mode 0600, in a 0700 directory) and listen on it.

        A socket left at that path by a server that is gone is replaced; one that a running
        server still answers on is left alone.

        Raises
        ------
        ServeError
            Another server answers on the socket (``EADDRINUSE``), or the managed directory's
            path holds a control character (``EINVAL``).
        """
        if any(ord(ch) < 0x20 or ch == "\x7f" for ch in str(self.settings.dir)):
            raise ServeError(f"{str(self.settings.dir)!r}: the path of a managed directory served "
                             "to local clients may not hold a line break or another control "
                             "character (its files' paths are sent as lines)", errno.EINVAL)
        internal = self.settings.internal_dir
        internal.mkdir(mode=0o700, parents=True, exist_ok=True)
        if os.stat(internal).st_uid == os.getuid():
            os.chmod(internal, 0o700)
        sock = self.settings.socket
        sock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if await asyncio.to_thread(_answers, sock):
            raise ServeError(f"{sock}: another data server answers on this socket (stop it "
                             "first, or give this one its own INSTRIDE_DIR or --socket)",
                             errno.EADDRINUSE)
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(os.lstat(sock).st_mode):
                # (a path mistyped, INSTRIDE_SOCKET naming a user's file: never removed)
                raise ServeError(f"{sock}: exists and is not a socket (name a path for the "
                                 "server's socket with --socket or INSTRIDE_SOCKET)",
                                 errno.EEXIST)
            sock.unlink()  # left by a server that is gone
        old_umask = os.umask(0o177)  # the socket is 0600 from the moment it exists
        try:
            self._server = await asyncio.start_unix_server(self._track, str(sock),
                                                           limit=MAX_LINE * 2)
        finally:
            os.umask(old_umask)
        os.chmod(sock, 0o600)
        st = os.stat(sock)
        self._socket_id = (st.st_dev, st.st_ino)

    async def _track(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._tasks) >= self.max_connections:
            self.stats["refused_connections"] += 1
            writer.write(f"ERR {errno.EMFILE} too many connections to this node server "
                         f"({self.max_connections})\n".encode())
            writer.close()
            return
        self._tasks.add(task)
        try:
            await self._handle_local(reader, writer)
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

    @property
    def busy(self) -> int:
        """Jobs currently running in worker threads."""
        return self._busy

    async def stop(self, grace: float) -> None:
        """Stop accepting; cancel waits; give in-flight requests ``grace`` seconds; remove the
        socket; stop the worker pools."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for cancel in list(self._cancels):  # pending waits end within a slice
            cancel.set()
        for task in list(self._idle):  # connections with nothing in flight
            task.cancel()
        if self._tasks:
            log.info("waiting for %d in-flight request(s)", len(self._tasks))
            _done, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        self._remove_socket()
        for pool in (self.waits, self.quick):
            pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + WAIT_SLICE + 2.0
        while self._busy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._busy:
            log.warning("%d worker job(s) still running at exit", self._busy)

    def _remove_socket(self) -> None:
        """Remove the socket, if the path still holds the one this agent made (never a
        later server's)."""
        made, self._socket_id = self._socket_id, None
        if made is None:
            return
        sock = self.settings.socket
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(sock)
            if (st.st_dev, st.st_ino) == made:
                sock.unlink()
            else:
                log.info("%s is another server's socket now: left in place", sock)

    def snapshot(self) -> dict[str, Any]:
        """Counters plus the current numbers of waits and worker jobs, and (cluster mode) of
        the keys fetched for thin clients: ``fetched``, of which ``fetched_early`` were asked
        of their owner while the wait lasted (see :meth:`_consume_sliced`)."""
        engine = self.client.engine
        return {**self.stats, "waiting": self._waiting, "workers_busy": self._busy,
                "fetched": getattr(engine, "transfers", 0),
                "fetched_early": getattr(engine, "early_transfers", 0)}

    async def _drain(self, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.wait_for(writer.drain(), self.send_timeout)
        except asyncio.TimeoutError:
            self.stats["stalled"] += 1
            log.warning("a local client stopped reading; connection dropped")
            writer.transport.abort()
            raise ConnectionResetError("client stopped reading") from None

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

    def _consume_sliced(self, key: str, deadline: float | None, start: float,
                        cancel: threading.Event) -> Path:
        """``client.consume`` in slices of at most :data:`WAIT_SLICE`, checking ``cancel``.

        A key not on this node is waited for first (``client.wait_any``), as a Python
        consumer walking a stream does: in cluster mode, after this node fetched the key
        before it (``k000006`` before ``k000007``) from another node, that owner is asked for
        the key while the wait lasts and sends it as it is published, so the bytes do not wait
        for a request sent once the publication is heard (RESULTS.md, round 31)."""
        with self._lock:
            self._busy += 1
            self._waiting += 1
        try:
            # (deadline and start: from the request's arrival, not from when a worker took it)
            here = key_path(key, self.settings.dir)
            while True:
                if cancel.is_set():
                    raise _WaitCancelled()
                left = WAIT_SLICE if deadline is None else deadline - time.monotonic()
                try:
                    if not os.path.exists(here):  # (one here: no round trip to wait for it)
                        self.client.wait_any([key], timeout=max(0.0, min(WAIT_SLICE, left)))
                        if deadline is not None:
                            left = deadline - time.monotonic()
                    return self.client.consume(key, timeout=max(0.0, min(WAIT_SLICE, left)))
                except ConsumeTimeout:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise ConsumeTimeout(key, time.monotonic() - start) from None
        finally:
            with self._lock:
                self._busy -= 1
                self._waiting -= 1

    def _consume_answering(self, key: str, deadline: float | None, start: float,
                           cancel: threading.Event, answer: _Answer) -> tuple[Path, bytes | None]:
        """:meth:`_consume_sliced`, then the answer sent from this thread where it may be
        (:class:`_Answer`): the path, and what :meth:`_Answer.send` returned."""
        path = self._consume_sliced(key, deadline, start, cancel)
        rest = answer.send(path)
        if rest == b"":
            with self._lock:
                self.stats["answered_at_once"] += 1
        return path, rest

    @staticmethod
    def _gone(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Whether the client closed its connection: a hang-up of the socket, seen also while
        requests it sent after this one wait unread (a client that only shut down its sending
        side still waits for its answer: not gone)."""
        if reader.exception() is not None or writer.transport.is_closing():
            return True
        sock = writer.get_extra_info("socket")
        if sock is None:
            return reader.at_eof()
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLHUP | select.POLLERR)
        return any(ev & (select.POLLHUP | select.POLLERR) for _fd, ev in poller.poll(0))

    async def _wait(
        self, key: str, timeout: float | None, reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> Path | bytes | None:
        """Run a sliced wait; ``None`` when the client went away (the wait is cancelled).

        The path, for the loop to answer; or, where the worker answered the client itself,
        the bytes of that answer its socket did not take (for the loop to write; ``b""``:
        nothing left). Past the request's timeout, while its job still runs (a fetch of the
        published key), progress lines are written to the client (see the module's
        docstring): the loop then takes the answer from the worker, so that no progress line
        can follow it."""
        if self._closing:
            raise _ShuttingDown()
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        # (an original of this node: answered at once. A copy fetched from another node may
        # be outdated — the key overwritten since — and its consume then waits on a fetch
        # from a peer, which must not hold one of the few quick threads PUBLISH needs)
        is_copy = getattr(self.client.engine, "is_copy", None)
        local = os.path.exists(key_path(key, self.settings.dir)) and not (
            is_copy is not None and is_copy(key))
        pool = self.quick if local else self.waits
        cancel = threading.Event()
        sock = writer.get_extra_info("socket")
        # (the worker may answer only while no earlier reply of this connection waits in the
        # loop's buffer: it would overtake it)
        direct = sock is not None and not writer.transport.is_closing() \
            and writer.transport.get_write_buffer_size() == 0
        try:
            answer = _Answer(sock.fileno() if direct else None)
        except OSError:  # (no descriptor to spare: the loop answers)
            answer = _Answer(None)
        try:
            job = pool.submit(self._consume_answering, key, deadline, start, cancel, answer)
        except BaseException:
            answer.close()
            raise
        job.add_done_callback(answer.close)  # (run, or called off before it started)
        fut = asyncio.wrap_future(job)
        self._cancels.add(cancel)
        # when the next progress line is due (past the timeout, a PROGRESS_INTERVAL after the
        # request at the earliest); whether the loop took the answer from the worker to send one
        due = None if deadline is None else max(deadline, start + PROGRESS_INTERVAL)
        mine = False
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=WATCH_INTERVAL)
                if done:
                    try:
                        path, rest = fut.result()
                    except _WaitCancelled:
                        raise _ShuttingDown() from None
                    return path if rest is None else rest
                now = time.monotonic()
                if deadline is not None and now > deadline and not local and job.cancel():
                    # (still queued behind busy workers when its time ran out: never started;
                    # a key on this node is answered once a quick thread is free, as ever)
                    raise ConsumeTimeout(key, now - start)
                if self._closing or self._gone(reader, writer):
                    if not (mine or answer.claim()):  # the worker has the path and is answering
                        path, rest = await fut
                        return path if rest is None else rest
                    if self._closing:
                        raise _ShuttingDown()
                    self.stats["abandoned"] += 1
                    log.debug("client gone; wait for %s cancelled", key)
                    return None
                # Past its timeout and still running: fetching the published key (a wait for
                # the publication ends at the timeout), which may take longer on a slow link.
                # Told so, the thin client waits on (a worker answering now: no line).
                if due is not None and now >= due and job.running() and (mine or answer.claim()):
                    mine = True
                    writer.write(f"WAIT {int((now - start) * 1000)}\n".encode())
                    self.stats["progress_lines"] += 1
                    due = now + PROGRESS_INTERVAL
        finally:
            if not fut.done():
                answer.claim()  # (the worker answers no more: the connection may end now)
                cancel.set()
                fut.cancel()  # a queued job never starts; a running one ends at its next slice
            self._cancels.discard(cancel)

    # ------------------------------------------------------------------ requests
    async def _handle_local(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        while True:
            self._idle.add(task)
            try:
                # (a whole request line within LINE_TIMEOUT of connecting or of the last
                # answer: a timer, not a wait_for, which costs a task per request)
                timer = asyncio.get_running_loop().call_later(LINE_TIMEOUT, task.cancel)
                try:
                    line = await reader.readuntil(b"\n")
                finally:
                    timer.cancel()
                if len(line) > MAX_LINE + 1:  # (within the buffer's limit, over the line's)
                    raise asyncio.LimitOverrunError("request line too long", len(line))
            except asyncio.LimitOverrunError:
                writer.write(f"ERR {errno.E2BIG} request line too long\n".encode())
                await self._drain(writer)
                return
            except asyncio.CancelledError:
                if self._closing or timer.when() > asyncio.get_running_loop().time():
                    raise  # (a shutdown's cancel, not the timer's)
                self.stats["idle_closed"] += 1
                writer.write(f"ERR {errno.ETIMEDOUT} no whole request line within "
                             f"{LINE_TIMEOUT:g} s\n".encode())
                await self._drain(writer)
                return
            except asyncio.IncompleteReadError:
                return
            finally:
                self._idle.discard(task)
            try:
                text = line[:-1].decode("utf-8")
            except UnicodeDecodeError:  # (never a key replaced by another: answered, not mended)
                reply: str | bytes | None = _err(errno.EINVAL, "request is not valid UTF-8 (a key "
                                                 "must be)")
            else:
                reply = await self._local_request(text, reader, writer)
            if reply is None:  # the client went away: nobody to answer
                return
            if isinstance(reply, str):
                writer.write(reply.encode() + b"\n")
            elif reply:  # (answered by the worker: what the socket did not take)
                writer.write(reply)
            await self._drain(writer)
            if self._closing:
                return

    def _in_place(self, key: str) -> Path:
        """The path of ``key`` if it holds a regular file inside the managed directory."""
        path = key_path(key, self.settings.dir)
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise AgentError(errno.ENOENT,
                              f"{key} is not in place under the managed directory") from None
        if not stat.S_ISREG(st.st_mode):
            raise AgentError(errno.EINVAL, f"{key} is not a regular file (symbolic links, "
                              "directories and special files cannot be published)")
        try:
            check_real(self.root_real, key, os.path.realpath(path))
        except KeyNotServed as exc:
            raise AgentError(errno.EINVAL, f"{key} cannot be published: {exc.reason}") from None
        return path

    def _unpublish(self, key: str) -> None:
        """``DELETE``: a thin client removed the file of ``key`` on this node. Where that file
        was this node's original (the record names this node), the key's record is deleted:
        other nodes no longer see it, and it may be published again.

        Nothing else is deleted: a key whose file is in place (published again here since), a
        fetched copy removed (this node's cache: the key stays its owner's), or a file the
        engine removed as the loser of a write-once race (the record is the winner's, on
        another node) -- the Python package may itself run under the preload library, and
        its own removals of such files must not unpublish another node's key. Only the
        record goes, and only while it is the one looked up (a publication of the key made
        meanwhile, here or elsewhere, is a new version: it stays, and so does its file).
        """
        path = key_path(key, self.settings.dir)
        mine = getattr(self.client.engine, "_mine", None)
        delete_if = getattr(self.client.metadata, "delete_if", None)
        if mine is None or delete_if is None or os.path.lexists(path):
            return
        record = self.client.lookup(key)
        if record is not None and mine(record.owner) and not os.path.lexists(path):
            delete_if(record)

    async def _local_request(
        self, line: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> str | bytes | None:
        """Answer one line; ``None`` means: send nothing (the client is gone); bytes: the
        rest of an answer a worker thread sent itself (usually none)."""
        self.stats["local"] += 1
        verb, _, rest = line.partition(" ")
        try:
            if verb == "PING":
                return "OK pong"
            if verb == "STATS":
                return "OK " + json.dumps(self._report(), separators=(",", ":"))
            if verb == "CONSUME":
                raw_timeout, _, key = rest.partition(" ")
                try:
                    ms = int(raw_timeout)
                except ValueError:
                    return _err(errno.EINVAL, f"bad timeout {raw_timeout[:50]!r} (milliseconds or -1)")
                if ms < -1 or ms > MAX_TIMEOUT_MS:
                    return _err(errno.EINVAL, f"bad timeout {raw_timeout[:50]!r} (milliseconds "
                                f"up to {MAX_TIMEOUT_MS}, or -1)")
                key = self.client.key(key)
                # -1: the server's INSTRIDE_TIMEOUT (forever when unset); 0: do not wait
                timeout = self.settings.timeout if ms == -1 else ms / 1000.0
                got = await self._wait(key, timeout, reader, writer)
                return f"OK {got}" if isinstance(got, Path) else got
            if verb == "LOOKUP":  # whether the key is published, without a wait: recorded,
                # or an original of this node without a record (a Redis restarted without its
                # data: a read serves it); a fetched copy of a key no longer recorded is dropped
                # (a key made here next must not find it in its way)
                key = self.client.key(rest)
                here = await self._in_pool(self.quick, self.client.exists, key)
                return "OK 1" if here else "OK 0"
            if verb == "DELETE":
                key = self.client.key(rest)
                if self._closing:
                    raise _ShuttingDown()
                await self._in_pool(self.quick, self._unpublish, key)
                return f"OK {key_path(key, self.settings.dir)}"
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
        except AgentError as exc:
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


__all__ = ["LocalAgent", "MAX_LINE", "MAX_MESSAGE", "PROGRESS_INTERVAL", "one_line"]
