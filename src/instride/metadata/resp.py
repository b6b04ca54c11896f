"""A minimal Redis connection for the per-frame commands (RESP2 over one TCP socket).

Each publication and each lookup is one Redis command; through redis-py's general client
(connection pool, retry wrapper, observability hooks, response callbacks) it cost several times
the round trip itself in CPU on the producer and the consumer. This connection packs commands
and parses replies with ``hiredis`` (the C parser redis-py itself uses), pipelines several
commands in one ``sendall``, and nothing more. It is used for plain ``redis://`` URLs only;
anything else (TLS, Unix sockets) keeps to redis-py. Errors are the builtin ``OSError`` /
``ConnectionError`` (the caller retries) and :class:`redis.ResponseError` for an error reply.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import itertools
import math
import os
import select
import socket
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import hiredis
import redis

from ..busypoll import arrived, recv_polling
from ..perthread import pid

#: seconds of silence on a connection waited on (a subscriber) before it is asked a PING,
#: and seconds the answer may take before the connection is taken for lost: a connection
#: whose far end went without a word (the Redis host crashed or was cut off) would
#: otherwise be waited on for ever, its subscriptions long gone
PROBE_AFTER = 10.0
PROBE_WAIT = 5.0

#: every connection of this process (a forked child closes its copies of their sockets)
_live: weakref.WeakSet[RespConnection] = weakref.WeakSet()
#: Linux's ioctl for the bytes a TCP socket has not sent yet (``linux/sockios.h``), its argument
_SIOCOUTQNSD, _INT0 = 0x894B, b"\0\0\0\0"


def _close_inherited() -> None:
    """In a child made by ``fork``: close this process's descriptors of the parent's
    connections (not shut down: the parent keeps using them). A descriptor kept open in a
    child would hold a connection, and its subscriptions, in Redis for as long as the child
    lives, even after the parent closed it; and a child never uses them (its threads get
    connections of their own: :mod:`instride.perthread`)."""
    for conn in list(_live):
        sock, conn.sock = conn.sock, None
        conn._held = 0  # (the parent's socket holds them: its own)
        conn._held_sizes.clear()
        conn._soon.clear()
        conn._unanswered.clear()  # (the parent's to send again, not the child's)
        conn._on_reply.clear()
        conn._failed = None
        conn._parsed.clear()
        conn.patterns.clear()
        if sock is not None:
            sock.close()


os.register_at_fork(after_in_child=_close_inherited)

#: error replies of a server that cannot answer for now (loading its data back after a
#: restart, busy with a script, a replica without its master, a cluster slot moving): raised
#: as :class:`redis.BusyLoadingError` (a :class:`redis.ConnectionError`, as redis-py raises
#: the first), which callers retry like a lost connection, never returned as an answer
UNAVAILABLE = ("LOADING", "BUSY", "MASTERDOWN", "TRYAGAIN")
#: how Redis at its ``maxclients`` turns a new connection away: this reply, then it closes
#: the connection, having run nothing sent on it (redis-py raises it as a ConnectionError)
TURNED_AWAY = "ERR max number of clients reached"


class TurnedAway(redis.ConnectionError):
    """Redis turned the connection away (:data:`TURNED_AWAY`): nothing sent on it ran."""


def not_now(reply: Exception) -> redis.ConnectionError | None:
    """The connection error to raise for Redis's error ``reply`` when it means "not now"
    (:data:`UNAVAILABLE`, :data:`TURNED_AWAY`: callers try again, as after a lost
    connection), or ``None`` for an answer."""
    text = str(reply)
    if text.startswith(TURNED_AWAY):
        return TurnedAway(text)
    if text.split(" ", 1)[0] in UNAVAILABLE:
        return redis.BusyLoadingError(text)
    return None

# A socket with a timeout is non-blocking underneath (Python keeps it so in timeout mode), yet
# polls before every send and recv: what can go at once goes through its descriptor directly
# (and what has come, :func:`~instride.busypoll.arrived`) — a poll() less per command and per
# reply (a stream's producer sends one per frame).


#: seconds without a write after which :meth:`RespConnection.fresh` looks for Redis's close
FRESH_AFTER = 0.025
#: the peer shut its side down (Linux's ``POLLRDHUP``: its FIN is in)
_RDHUP = getattr(select, "POLLRDHUP", 0x2000)


def _written(sock: socket.socket, data: bytes) -> int:
    """How much of ``data`` went out at once (0: none; the caller sends the rest the usual
    way, which waits)."""
    if not sock.gettimeout():
        return 0  # (blocking, or non-blocking by choice: the usual way)
    try:
        return os.write(sock.fileno(), data)
    except (BlockingIOError, InterruptedError):
        return 0


class RespConnection:
    """One socket to Redis, connected on first use and re-connected after any failure.

    Parameters
    ----------
    host, port, db, username, password
        Where and as whom to connect (from the Redis URL).
    timeout
        Seconds a reply may take.
    connect_timeout
        Seconds connecting may take.
    """

    def __init__(self, host: str, port: int, db: int, username: str | None, password: str | None,
                 timeout: float, connect_timeout: float) -> None:
        self.host, self.port, self.db = host, port, db
        self.username, self.password = username, password
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.sock: socket.socket | None = None
        self.reader: Any = None
        # :meth:`defer`'d commands whose replies are not read yet (packed): sent again first
        # on the next connection if this one fails before them; beside each, what its answer
        # is given to (``on_reply``), if anything
        self._unanswered: deque[bytes] = deque()
        self._on_reply: deque[Callable[[Any], None] | None] = deque()
        self._parsed: deque[Any] = deque()  # (replies parsed by answered(), in order)
        #: the first error answer to a deferred command not reported yet: raised by the next
        #: :meth:`defer` or :meth:`raise_deferred`, never by an unrelated call
        self._failed: Exception | None = None
        # the replies :meth:`call_soon` functions will read (their count, where they go), in
        # the order they were sent
        self._soon: deque[tuple[int, list[list[Any]]]] = deque()
        #: writes sent whole, ever (a caller's command went out when this moved on; not
        #: counted: a new connection's own, its login and the deferred commands sent again)
        self.sent = 0
        #: patterns this connection is subscribed to, in order of use (gone with the socket)
        self.patterns: dict[str, None] = {}
        #: ``time.monotonic()`` by which a reply must have come (a caller's own deadline:
        #: :class:`TimeoutError` then, the connection closed); ``None``: the socket timeout
        self.until: float | None = None
        self._heard = 0.0  # (time.monotonic() when it last received something)
        self._wrote = 0.0  # (... when it last sent something)
        self._poller: Any = None
        self._probed: float | None = None  # (when a PING went out unanswered so far)
        #: the thread that uses it (a connection is a thread's own: see :meth:`close`)
        self._owner = threading.current_thread()
        #: the newest :meth:`call_soon` functions whose commands are held back in the socket
        #: (``hold``): not pushed out yet
        self._held = 0
        #: the sizes of the held-back commands, per :meth:`call_soon` call (each command's:
        #: Redis answers each one as soon as it has it whole), oldest first (see :meth:`_quiet`)
        self._held_sizes: deque[list[int]] = deque()
        #: whether the last :meth:`call_soon` held its commands back (it was asked to, and
        #: the connection was :meth:`_quiet`)
        self.held_last = False
        _live.add(self)

    def _connect(self) -> socket.socket:
        sent = self.sent  # (its own writes are no caller's command: see sent)
        try:
            return self._open()
        finally:
            self.sent = sent

    def _open(self) -> socket.socket:
        """:meth:`_connect`'s work: connect, log in, send the deferred commands again."""
        sock = socket.create_connection((self.host, self.port), timeout=self._left(
            self.connect_timeout))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.timeout)
        self.sock, self.reader = sock, hiredis.Reader()
        self._poller: Any = None  # (fresh()'s, made on first use)
        self._heard, self._probed = time.monotonic(), None
        setup: list[tuple[Any, ...]] = []
        if self.password:
            setup.append(("AUTH", self.username, self.password) if self.username
                         else ("AUTH", self.password))
        if self.db:
            setup.append(("SELECT", self.db))
        if setup:  # (answered before the replies owed to call_soon: theirs are not sent yet)
            self.send(setup, settle=False)
            for command, reply in zip(setup, self._replies(len(setup), deferred=False),
                                      strict=True):
                if isinstance(reply, Exception):
                    self.close()
                    # a refused AUTH is the URL's credentials; a refused SELECT (a database
                    # Redis does not have) an error reply like any other, not a login failure
                    raise (redis.AuthenticationError if command[0] == "AUTH"
                           else redis.ResponseError)(str(reply))
        if self._unanswered:  # (deferred on a connection that failed before their replies:
            self._send_packed(b"".join(self._unanswered))  # again, in order)
        return sock

    @property
    def deferred(self) -> int:
        """The number of :meth:`defer`'d commands whose replies are not read yet."""
        return len(self._unanswered)

    def call(self, commands: Sequence[tuple[Any, ...] | bytes]) -> list[Any]:
        """Send ``commands`` in one write and return their replies, in order.

        An error reply is returned as an exception instance (``hiredis.ReplyError``), not
        raised, so that the caller can handle e.g. ``NOSCRIPT``. A connection failure closes
        the socket and raises (the next call reconnects).
        """
        self.send(commands)
        return self._replies(len(commands))

    def call_soon(self, commands: Sequence[tuple[Any, ...] | bytes], *,
                  hold: bool = False) -> Callable[[], list[Any]]:
        """Send ``commands`` now; the function returned reads their replies (as :meth:`call`).

        The round trip overlaps the caller's work until the function is called. Several may
        be owed at once (each ``call_soon`` sends without reading the replies owed before
        it); any other use of the connection first reads all owed replies and keeps them for
        their functions, so replies never go to the wrong caller — also when a function is
        never called. The function raises :class:`ConnectionError` if the connection was
        lost before its replies were read.

        ``hold``: the commands are written to the socket with ``MSG_MORE``, so the kernel
        holds them back, to go out in one segment with what is written next: several
        commands, one wake-up of Redis. Any later write on this connection (without
        ``hold``), a read that waits for a reply, and :meth:`flush_held` push them out; if
        none comes, Linux sends them ~0.2 s after the first (TCP's cork ceiling), and at the latest
        when the socket is closed (also by the process's exit). Held or not, everything
        goes out in the order it was written. They are held only while every command sent
        out before them is answered, its reply taken in (:meth:`_quiet`; else they go at
        once: :attr:`held_last` says which): a process that ends without a word (``SIGKILL``,
        ``os._exit``) then leaves nothing unread on the socket, and the kernel's close sends
        what it holds — TCP resets a socket closed with bytes unread, dropping what it holds.
        """
        box: list[list[Any]] = []
        entry = (len(commands), box)
        hold = hold and self._quiet()
        self.held_last = hold
        self._soon.append(entry)  # (first: a reply can never arrive for nobody)
        try:
            if hold:
                if _let_go_registered != pid():  # (the kept pid: no system call per record)
                    _register_let_go()
                parts = [c if c.__class__ is bytes else hiredis.pack_command(tuple(c))
                         for c in commands]
                packed = b"".join(parts)
                self._send_packed(packed, more=True)
                self._held += 1
                self._held_sizes.append([len(part) for part in parts])
            else:
                self.send(commands, settle=False)
            if hold:
                # (an answer come in since _quiet looked — to held bytes an ACK or Linux's
                # timer pushed out meanwhile — must not stay unread beside these: taken in
                # now; one that comes later pushes them out, TCP_NODELAY)
                self._take_in()
        except BaseException:
            # Sent or not (an interrupt — Ctrl-C, a signal handler's exception — may land
            # right after the write): the connection goes, so that no reply can go to
            # another caller; the functions owed replies find it closed, their commands are
            # sent again (a record, as the same publication)
            self.close()
            raise

        def replies() -> list[Any]:
            while not box and any(b is box for _, b in self._soon):
                self._settle_one()
            if not box:
                raise ConnectionError("the connection to Redis was closed before the reply")
            return box[0]

        return replies

    def push(self) -> None:
        """:meth:`flush_held` from any thread: from another than the connection's own, the
        socket is pushed (a ``setsockopt``, which the kernel serializes with the owner's
        writes) and the owner's count of held commands is left as it is (a confirmation
        from another thread sends its record again on a connection of its own: the original
        must not come after it)."""
        if self._owner is threading.current_thread():
            self.flush_held()
            return
        sock = self.sock
        if sock is not None and self._held:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def flush_held(self) -> None:
        """Push out the commands :meth:`call_soon` holds back (nothing when none is held):
        setting ``TCP_NODELAY`` sends what the socket holds (Linux).

        Raises
        ------
        OSError
            The socket failed (the connection is closed).
        """
        if self._held:
            self._held = 0
            self._held_sizes.clear()
            sock = self.sock
            if sock is not None:
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except BaseException:
                    self.close()
                    raise

    def answered(self) -> bool:
        """Whether every reply owed to the oldest :meth:`call_soon` function (or none is owed)
        can be read without waiting: received already (also what comes ahead of them: the
        deferred commands' replies). What has come is taken in and parsed, without waiting;
        a reply that came alone of the function's several (a ``PING`` answered while Redis
        holds writes back, ``CLIENT PAUSE WRITE``) is not enough; nor is a function whose
        commands are held back (``hold``: perhaps not sent yet)."""
        if not self._soon:
            return True
        if self._held >= len(self._soon):
            return False
        if len(self._parsed) >= len(self._unanswered) + self._soon[0][0]:
            return True  # (taken in by an earlier look: no read; a producer confirming several
            # frames' records in a row looks once)
        if self.sock is None or not self._take_in():
            return True  # (a closed connection: its function answers at once, with an error)
        return len(self._parsed) >= len(self._unanswered) + self._soon[0][0]

    def _quiet(self) -> bool:
        """Whether Redis owes this connection no reply it has not taken in: to none of the
        commands written without ``hold``, nor to any held one that left the socket whole —
        the kernel sends each full segment of held bytes at once (a 1,500-byte MTU carries
        four frame records), Linux the rest after ~0.2 s, another thread's :meth:`push`
        all of them (``SIOCOUTQNSD``: the bytes not sent yet). What has come is taken in
        now, without waiting (and again right after the held write, for an answer come in
        meanwhile). What comes in after that pushes the held bytes out (any segment that
        acknowledges sent data sets off a send; the socket has ``TCP_NODELAY``)."""
        sock = self.sock
        if sock is None:
            return False
        held, gone = self._held, 0
        if held:
            try:
                unsent = struct.unpack("i", fcntl.ioctl(sock.fileno(), _SIOCOUTQNSD, _INT0))[0]
            except OSError:
                return False
            sent = sum(map(sum, self._held_sizes)) - unsent
            for sizes in self._held_sizes:  # (each held command sent whole is owed its reply)
                for size in sizes:
                    if sent < size:
                        break
                    sent -= size
                    gone += 1
                else:
                    continue
                break
        owed = len(self._unanswered) + sum(n for n, _ in self._soon) + gone \
            - sum(n for n, _ in itertools.islice(reversed(self._soon), held))
        if len(self._parsed) >= owed:
            return True
        return self._take_in() and len(self._parsed) >= owed

    def _take_in(self) -> bool:
        """Take in and parse what has come on the socket, without waiting; ``False`` where
        the socket failed or Redis closed it (the read that follows raises
        :class:`ConnectionError`)."""
        sock = self.sock
        assert sock is not None
        try:  # (a producer asks per frame: one read, no poll object)
            if sock.gettimeout():
                chunk = os.read(sock.fileno(), 1 << 16)
            else:
                poller = select.poll()  # (not select(): descriptors past 1023 are common here)
                poller.register(sock.fileno(), select.POLLIN)
                chunk = sock.recv(1 << 16) if poller.poll(0) else None
        except (BlockingIOError, InterruptedError):
            chunk = None  # nothing more yet
        except OSError:
            return False  # (reset)
        try:  # (bytes read and not taken in, an interrupt: the next replies would go astray)
            if chunk is not None:
                if not chunk:
                    return False
                self._feed(chunk)
            while (reply := self.reader.gets()) is not False:
                self._parsed.append(reply)
        except BaseException:
            self.close()
            raise
        return True

    def _settle_one(self) -> None:
        """Read the replies the oldest :meth:`call_soon` function is owed, into its box."""
        n, box = self._soon[0]
        try:
            box.append(self._replies(n))
        finally:
            if self._soon and self._soon[0][1] is box:
                self._soon.popleft()
            self._held = min(self._held, len(self._soon))  # (held ones are the newest)
            while len(self._held_sizes) > self._held:
                self._held_sizes.popleft()

    def _settle(self) -> None:
        """Read the replies every :meth:`call_soon` function is owed, into their boxes."""
        while self._soon:
            self._settle_one()

    def _replies(self, n: int, *, deferred: bool = True, drain: bool = False) -> list[Any]:
        """The next ``n`` replies (after the deferred commands' owed before them, taken in);
        ``drain``: also until no deferred command's reply is owed."""
        sock = self.sock
        try:
            if sock is None:
                raise ConnectionError("the connection to Redis was closed")
            out: list[Any] = []
            while len(out) < n or (drain and self._unanswered):
                reply = self._parsed.popleft() if self._parsed else self.reader.gets()
                if reply is False:
                    self.flush_held()  # (what is awaited may be held back: out first)
                    chunk = arrived(sock, 1 << 16) or self._recv(sock)
                    if not chunk:
                        raise ConnectionError("Redis closed the connection")
                    self._feed(chunk)
                    continue
                if isinstance(reply, Exception) and (busy := not_now(reply)) is not None:
                    raise busy  # (the connection is closed)
                if deferred and self._unanswered:  # replies come in order: the deferred
                    self._deferred_answered(reply)  # commands' first
                    continue
                out.append(reply)
        except BaseException:
            self.close()
            raise
        return out

    def raise_deferred(self) -> None:
        """Raise the first error answer to a :meth:`defer`'d command read so far (once).

        Such an answer is kept until then, not raised by the call that happened to read it:
        that call's own command succeeded (a publication raising for a failed cursor commit
        would have its caller undo a publication Redis had stored).

        Raises
        ------
        redis.ResponseError
            A deferred command failed (e.g. ``WRONGTYPE``, ``OOM``).
        """
        failed, self._failed = self._failed, None
        if failed is not None:
            raise redis.ResponseError(f"a deferred Redis command failed: {failed}")

    def _left(self, limit: float) -> float:
        """``limit`` seconds, or less if :attr:`until` comes sooner (:class:`TimeoutError`
        if it has passed)."""
        if self.until is None:
            return limit
        left = self.until - time.monotonic()
        if left <= 0:
            raise TimeoutError("Redis did not answer before the caller's deadline")
        return min(limit, left)

    def _recv(self, sock: socket.socket) -> bytes:
        if self.until is None:
            return sock.recv(1 << 16)
        sock.settimeout(self._left(self.timeout))
        try:
            return sock.recv(1 << 16)
        finally:
            sock.settimeout(self.timeout)

    def _deferred_answered(self, reply: Any) -> None:
        """The answer to the oldest deferred command, read: it goes to its ``on_reply``; an
        error is also kept (theirs to hear: see :meth:`raise_deferred`)."""
        self._unanswered.popleft()
        on_reply = self._on_reply.popleft()
        if isinstance(reply, Exception) and self._failed is None:
            self._failed = reply
        if on_reply is not None:
            on_reply(reply)

    def take_deferred(self, wait: float = 0.0) -> bool:
        """Take in the answers to :meth:`defer`'d commands that have come: each goes to its
        ``on_reply`` (an error is also kept for :meth:`raise_deferred`). A look at the socket
        (``poll``), and a read where something came; nothing where no answer is owed.
        ``wait``: for at most that many seconds, those still on their way too. Nothing is
        raised and the connection is left as it is (a failed one is found by the next call,
        which sends them again). (Their answers come before those of any :meth:`call_soon`
        function: :meth:`defer` reads those first.)

        Returns
        -------
        bool
            Whether no answer to a deferred command is owed now.
        """
        until = time.monotonic() + wait
        while self._unanswered:
            sock = self.sock
            if sock is None:
                return False
            if len(self._parsed) < len(self._unanswered):
                if self._poller is None:  # (a look first: a read that finds nothing costs 3x)
                    self._poller = select.poll()
                    self._poller.register(sock.fileno(), select.POLLIN | _RDHUP)
                left = until - time.monotonic()
                if not self._poller.poll(max(0, math.ceil(left * 1000)) if wait else 0) \
                        or not self._take_in():
                    return False  # (none came in time, or the socket failed)
            while self._parsed and self._unanswered:
                reply = self._parsed[0]
                if isinstance(reply, Exception) and not_now(reply) is not None:
                    self.close()  # (as a call would: they go again on the next connection)
                    return False
                try:  # (a reply taken and its command not: interrupted, the connection goes)
                    self._parsed.popleft()
                    self._deferred_answered(reply)
                except BaseException:
                    self.close()
                    raise
            if not wait:
                break
        return not self._unanswered

    def defer(self, commands: Sequence[tuple[Any, ...]], *,
              on_reply: Callable[[Any], None] | None = None) -> None:
        """Send ``commands`` now and read their replies with the next :meth:`call`.

        For updates nobody waits on (a stream's head counters): the round trip overlaps the
        caller's next work. An error reply surfaces as :class:`redis.ResponseError` from the
        next :meth:`defer` (before it sends anything) or :meth:`raise_deferred`, not from other
        calls, which read it. If the connection breaks before their replies are read (Redis restarted,
        or closed an idle connection), they may or may not have run: they are sent again
        first on the next connection, so they must be commands that may run twice (an
        ``HSET`` of values, not of increments; an ``EVAL`` of a script that checks what it may
        still do). ``on_reply``: given each command's answer when it is read (by a call, or
        :meth:`take_deferred`), an error's as its exception; it must not raise, nor use the
        connection (it runs while the connection reads).
        """
        packed = [hiredis.pack_command(tuple(c)) for c in commands]
        self.raise_deferred()
        self._settle()  # (replies still owed to a call_soon come first)
        if self.sock is None:
            self._connect()  # (which sends the deferred commands still owed first)
        # (counted as owed before the write: an interrupt right after it must not leave
        # their replies to other callers; not sent, they go with the next connection's)
        self._unanswered.extend(packed)
        self._on_reply.extend([on_reply] * len(packed))
        try:
            self._send_packed(b"".join(packed))
        except BaseException:
            self.close()
            raise

    def send(self, commands: Sequence[tuple[Any, ...] | bytes], *, settle: bool = True) -> None:
        """Send ``commands`` in one write without reading replies (subscriptions).
        ``settle=False``: the replies owed to :meth:`call_soon` functions are left unread.
        A command given as ``bytes`` is packed already (a constant one: packing costs a
        process woken from idle ~5–10 µs per command)."""
        if settle:
            self._settle()  # (replies still owed to a call_soon come first)
        self._send_packed(self._packed(commands))

    @staticmethod
    def _packed(commands: Sequence[tuple[Any, ...] | bytes]) -> bytes:
        return b"".join(c if c.__class__ is bytes else hiredis.pack_command(tuple(c))
                        for c in commands)

    def _send_packed(self, data: bytes, *, more: bool = False) -> None:
        """Write ``data`` whole; ``more``: with ``MSG_MORE`` (see :meth:`call_soon`), else
        pushing out whatever is held back with it."""
        sock = self.sock or self._connect()
        try:
            if more:
                sock.sendall(data, socket.MSG_MORE)
            else:
                sent = _written(sock, data)
                if sent < len(data):
                    sock.sendall(memoryview(data)[sent:])
                self._held = 0
                self._held_sizes.clear()
        except BaseException:
            self.close()
            raise
        self.sent += 1
        self._wrote = time.monotonic()

    def read(self, timeout: float, spin: float = 0.0) -> Any | None:
        """The next reply or pushed message, or ``None`` if none came within ``timeout`` s.

        With ``spin``, the socket is busy-polled that long (within ``timeout``) before the
        thread sleeps in ``recv`` (:mod:`instride.busypoll`).
        """
        if self._parsed:  # (parsed already by answered())
            return self._parsed.popleft()
        reply = self.reader.gets() if self.sock is not None else False
        if reply is not False:
            return reply
        self.flush_held()
        sock = self.sock or self._connect()
        try:
            chunk = recv_polling(sock, 1 << 16, min(spin, timeout))
            if chunk is None:
                sock.settimeout(max(timeout, 1e-3))
                try:
                    chunk = sock.recv(1 << 16)
                except TimeoutError:
                    chunk = None
                finally:
                    sock.settimeout(self.timeout)
        except BaseException:
            self.close()
            raise
        if chunk is None:
            self._probe()
            return None
        if not chunk:
            self.close()
            raise ConnectionError("Redis closed the connection")
        try:  # (bytes read and not taken in, an interrupt: the next replies would go astray)
            self._feed(chunk)
            reply = self.reader.gets()
        except BaseException:
            self.close()
            raise
        return None if reply is False else reply

    def _feed(self, chunk: bytes) -> None:
        """Take in what was received (and note that the connection is alive)."""
        self.reader.feed(chunk)
        self._heard, self._probed = time.monotonic(), None

    def _probe(self) -> None:
        """After a :meth:`read` that heard nothing: a PING once the connection has been
        silent :data:`PROBE_AFTER` seconds (a subscriber answers ``["pong", ""]``, which its
        readers skip); :class:`ConnectionError` (the connection closed) when that PING has
        gone unanswered :data:`PROBE_WAIT` seconds."""
        now = time.monotonic()
        if self._probed is None:
            if now - self._heard >= PROBE_AFTER:
                self._send_packed(b"*1\r\n$4\r\nPING\r\n")
                self._probed = now
        elif now - self._probed >= PROBE_WAIT:
            self.close()
            raise ConnectionError(f"Redis did not answer a PING within {PROBE_WAIT:g} s: the "
                                  "connection is lost")

    def pending(self) -> list[Any]:
        """The replies and pushed messages already received, without waiting for more."""
        out: list[Any] = list(self._parsed)  # (parsed already by answered())
        self._parsed.clear()
        sock = self.sock
        if sock is None:
            return out
        # A socket with a timeout polls before recv, even under MSG_DONTWAIT. Its descriptor
        # is non-blocking underneath (Python keeps it so in timeout mode): read from that
        # directly — two ioctl() less per drain than switching the socket to non-blocking
        # and back (a stream's reader drains once per frame).
        fd = sock.fileno()
        direct = bool(sock.gettimeout())
        if not direct:
            sock.settimeout(0.0)
        try:
            while True:
                reply = self.reader.gets()
                if reply is not False:
                    out.append(reply)
                    continue
                try:
                    chunk = os.read(fd, 1 << 16) if direct else sock.recv(1 << 16)
                except BlockingIOError:
                    return out
                if not chunk:
                    raise ConnectionError("Redis closed the connection")
                self._feed(chunk)
        except BaseException:
            self.close()
            raise
        finally:
            if self.sock is not None and not direct:
                sock.settimeout(self.timeout)

    def fresh(self) -> None:
        """Drop the connection now if Redis closed it (restarted, stopped, or closed it while
        it was idle: its FIN is in), so that the next command goes out on a new one, or fails
        to connect. Written to the closed one, it would go nowhere, and its failure could not
        tell a command Redis never got from one it ran before the connection broke (see
        ``RedisMetadata.publish``). One ``poll``, without waiting (~9 µs of a process woken
        from idle); nothing is read. Only once nothing was written to it for
        :data:`FRESH_AFTER` seconds (Redis rarely closes a connection just written to: one
        closed within that time is found when the command's answer fails, as before; the time
        of the last answer read would not do: answers are read late, those of a stream's
        frames at its close). The answers owed on it
        (to :meth:`call_soon` functions, to deferred commands) are read first, as a call would
        before writing (:class:`ConnectionError` here if they cannot be).

        Raises
        ------
        ConnectionError
            The deferred commands' answers could not be read (the connection is closed).
        """
        if self.sock is not None and (self._soon or self._unanswered):
            # (the answers owed before anything written now are read first: a connection that
            # cannot give them fails here, before the command)
            self._settle()
            self._replies(0, drain=True)
        sock = self.sock
        if sock is None or time.monotonic() - self._wrote < FRESH_AFTER or self._parsed:
            return
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(sock.fileno(), select.POLLIN | _RDHUP)
        events = self._poller.poll(0)
        if events and events[0][1] & (_RDHUP | select.POLLHUP | select.POLLERR):
            self.close()

    def __del__(self) -> None:
        # (collected unclosed, e.g. with the thread whose connection it was: the socket's own
        # finalizer would close it with replies unread, a reset that drops what it holds)
        sock = self.__dict__.get("sock")
        if sock is not None and self.__dict__.get("_held"):
            _let_go(sock)

    def close(self) -> None:
        """Close the socket (a later :meth:`call` reconnects).

        From another thread while the one that uses it lives, the socket is only shut down:
        that thread may be in a call on it at this moment (in a ``recv`` that closing would
        not wake, or about to use its descriptor number, which another file could have taken
        by then). The shutdown wakes a blocked read at once, and Redis sees the connection
        closed (its subscriptions end); the thread finds it closed at its next read or write,
        closes it then and reconnects. Until then, or until that thread ends and the
        connection is collected, the descriptor stays open. (A connection made on a thread
        that Python did not start counts as its thread's while the process lives.)
        """
        owner = self._owner
        if owner is not threading.current_thread() and owner.is_alive():
            sock = self.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            return
        sock, self.sock = self.sock, None
        if sock is not None and self._held:
            _let_go(sock)
        # (the deferred commands not answered stay: sent again on the next connection)
        self._held = 0
        self._held_sizes.clear()
        self._soon.clear()  # (a call_soon function then finds its box empty)
        self._parsed.clear()
        self.patterns.clear()  # (and so do subscriptions)
        if sock is not None:
            sock.close()


def _let_go(sock: socket.socket) -> None:
    """Before a socket with commands held back (``MSG_MORE``) is closed: push them out, and
    drop what was received unread. Closed with unread data, a TCP socket is reset, not
    closed, and what it still held to send is thrown away (RFC 2525): held commands would be
    lost, where a close otherwise sends them (ahead of a command torn by a failure, if any:
    Redis drops that one at the end of the connection)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # (not recv: a socket with a timeout waits that long first, even under MSG_DONTWAIT;
        # its descriptor is non-blocking underneath, see pending)
        fd, direct = sock.fileno(), bool(sock.gettimeout())
        while (os.read(fd, 1 << 16) if direct else sock.recv(1 << 16, socket.MSG_DONTWAIT)):
            pass


@atexit.register
def _let_go_at_exit() -> None:
    """At the interpreter's exit: the commands connections hold back go out (see
    :func:`_let_go`; a process killed, or ended by ``os._exit``, leaves them to the kernel:
    reset, its socket drops them when replies it had not read are in)."""
    for conn in list(_live):
        sock = conn.sock
        if sock is not None and conn._held:
            _let_go(sock)
            conn._held = 0
            conn._held_sizes.clear()


#: the process that registered :func:`_let_go_at_exit` with :mod:`multiprocessing` (0: none)
_let_go_registered = 0


def _register_let_go() -> None:
    """On a process's first held command: :mod:`multiprocessing`'s children end with
    ``os._exit`` (no ``atexit``), after running its finalizers: one lets go of what is held."""
    global _let_go_registered
    import multiprocessing.util

    _let_go_registered = pid()
    multiprocessing.util.Finalize(None, _let_go_at_exit, exitpriority=0)


def hash_fields(reply: Any) -> dict[bytes, bytes]:
    """An ``HGETALL`` reply (a flat list ``[field, value, ...]``) as a dict."""
    if isinstance(reply, Exception):
        raise redis.ResponseError(str(reply))
    return dict(zip(reply[::2], reply[1::2], strict=True))


__all__ = ["RespConnection", "TurnedAway", "hash_fields", "not_now"]
