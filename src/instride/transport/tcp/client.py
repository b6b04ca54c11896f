"""TCP transport, client half.

Connections to each owner are kept alive per thread. A body is received in chunks by C code
(``libinstride_tcp.so``, :mod:`.engine`): each chunk is hashed (xxh3, streaming) and written to
the destination while it is still in the CPU cache, and the digest is compared with the record
before the file is published. (Receiving into a memory map of a fresh file cost twice as much here: allocating
and mapping its pages dominated.)
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import math
import os
import re
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ...busypoll import arrived, poll_readable, poll_readable_in
from ...config import Settings, parse_addr
from ...errors import (
    AuthenticationError,
    InstrideError,
    IntegrityError,
    KeyNotFoundError,
    PeerUnavailable,
    TransferError,
)
from ...frames import HEADER_SIZE
from ...perthread import PerThread, forks
from ...record import Record
from .. import wire
from ..base import Backoff, Received, fetch_to_new_file
from .engine import load_library

if TYPE_CHECKING:
    from .server import TcpServer

#: the largest milliseconds a C int carries (a wait or stall given to the native calls)
_INT_MAX = 2**31 - 1

#: every connection to an owner this process opened and has not dropped (kept alive, asked
#: ahead on, handed to a caller): a forked child closes its copies of them at once
_OPENED: weakref.WeakSet[socket.socket] = weakref.WeakSet()


def _close_inherited() -> None:
    """In a forked child: close its copies of the parent's connections. The child never uses
    them (its transports start empty: :class:`~instride.perthread.PerThread`), but a copy
    kept open (a ``multiprocessing`` worker that never touches instride) kept the connection
    open at its owner: the parent closing one (a reader's frames asked ahead, dropped) ended
    nothing there -- the owner held the request and sent frames nobody reads until the
    child ended. Closing the child's descriptor leaves the parent's connection as it is."""
    for sock in list(_OPENED):
        sock.close()
    _OPENED.clear()


os.register_at_fork(after_in_child=_close_inherited)


def _prefix(key: str) -> str:
    """The directory of ``key`` (a stream's frames share it)."""
    return key.rpartition("/")[0]


def _batch(owner: str, key: str) -> str:
    """The name of what a thread asked ``owner`` for ahead with ``key``: per owner *and*
    stream — one per owner made two streams read in turn by a thread (two replicas, two
    groups) close each other's, every frame a new connection and its batch thrown away."""
    return f"{owner}|{_prefix(key)}"


def _recv_exact(sock: socket.socket, n: int, key: str, have: bytes = b"",
                began: bool = False) -> bytes:
    """``n`` bytes of a reply's head (``have``: its first ones, there already). ``began``:
    bytes of the reply came before these (its length prefix).

    Before a byte of the reply, a closed connection or a stall is no reply at all: the
    ``OSError`` (the caller's ``PeerUnavailable``). After one, it is a transfer that began and
    did not finish: :class:`TransferError`, as for a body cut short."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = len(have)
    view[:got] = have
    stall = sock.gettimeout()
    waited, came = 0.0, 0  # (the pace since it was last reckoned, as the C receives keep it)
    while got < n:
        t0 = time.monotonic()
        try:
            k = sock.recv_into(view[got:], n - got)
        except OSError as exc:
            if not began and got == 0:
                raise
            what = "stalled" if isinstance(exc, TimeoutError) else os.strerror(exc.errno or 0)
            raise TransferError(key, f"{what} after {got} of {n} header bytes") from None
        if k == 0:
            if not began and got == 0:
                # (closed before a byte of the reply: no reply at all — PeerUnavailable, as on
                # the native path, not a transfer cut short)
                raise ConnectionAbortedError(errno.ECONNABORTED,
                                             "connection closed before the reply")
            raise TransferError(key, f"connection closed after {got} of {n} header bytes")
        if began or got > 0:  # (the wait for a reply's first byte is no transfer's)
            waited += time.monotonic() - t0
        got += k
        came += k
        if stall is not None and waited >= stall and got < n:
            if came < _min_rate() * waited:
                raise TransferError(key, f"{_too_slow()} after {got} of {n} header bytes")
            waited, came = 0.0, 0
    return bytes(buf)


def _min_rate() -> int:
    """The pace a reply must keep once it began (bytes per second of waiting for them, over
    each stall time): the C receives' ``ISC_MIN_RATE``. A stall alone (nothing for the
    connection's timeout) let a peer that sent a byte just before each stall hold a transfer
    for as long as it went on."""
    return int(load_library().isc_min_rate())


def _too_slow() -> str:
    """How a reply that fell below :func:`_min_rate` is named in its error."""
    return f"too slow (under {_min_rate() // 1024} KiB/s)"


def _head_for(digest_from: int) -> ctypes.Array[ctypes.c_char] | None:
    """Where a receive into a file copies the bytes before ``digest_from`` (a frame's header,
    which its record's check needs: :meth:`Record.verify`); ``None`` when there are none."""
    return ctypes.create_string_buffer(digest_from) if digest_from else None


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether an idle kept-alive connection can no longer carry a request: its owner closed
    it (a restart, an idle timeout) or sent something nobody asked for."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLRDHUP)
    return bool(poller.poll(0))


def _hint(owner: Record, key: str) -> Record:
    """What a request for ``key`` needs of a record: the owner of a key beside it."""
    return Record(key=key, owner=owner.owner, size=0, checksum="", version=0, time=0.0, node=owner.node)


def _receive_error(key: str, err: int, got: int, size: int) -> TransferError:
    """The error of a receive that ended early with ``errno`` ``err``."""
    if err == errno.ETIMEDOUT:
        return TransferError(key, f"stalled after {got} of {size} bytes")
    if err == errno.ETIME:
        return TransferError(key, f"{_too_slow()} after {got} of {size} bytes")
    if err == errno.ECONNRESET:
        return TransferError(key, f"connection closed after {got} of {size} bytes")
    return TransferError(key, f"{os.strerror(err)} after {got} of {size} bytes")


def _header_error(key: str, err: int, got: int) -> TransferError:
    """The error of a reply whose head (length prefix and header) ended early, with ``errno``
    ``err``, after ``got`` of its bytes: a transfer that began, as :func:`_receive_error`."""
    what = {errno.ETIMEDOUT: "stalled", errno.ECONNRESET: "connection closed"}.get(
        err, _too_slow() if err == errno.ETIME else os.strerror(err))
    return TransferError(key, f"{what} after {got} bytes of the reply's header")


def _numbered_after(key: str, n: int) -> list[str]:
    """The ``n`` numbered keys after ``key`` (its last component's last run of digits plus
    1, 2, ..., same width: a stream's next frames), or none when ``key`` is not numbered or
    the number would need another digit (as the owner's server counts, csrc/tcp/serve.c)."""
    n = min(n, wire.MAX_COUNT - 1)
    head, _, base = key.rpartition("/")
    m = re.search(r"(\d+)(\D*)$", base)
    if n <= 0 or m is None:
        return []
    digits, width = m.group(1), len(m.group(1))
    if int(digits) + n >= 10**width:
        return []
    stem = (head + "/" if head else "") + base[: m.start(1)]
    return [f"{stem}{int(digits) + i:0{width}d}{m.group(2)}" for i in range(1, n + 1)]


def _wait_ms(wait: float | None) -> int | None:
    return None if wait is None else max(0, min(wire.MAX_WAIT_MS, int(wait * 1000)))


def _size(reply: dict[str, Any], record: Record) -> int:
    """The body size ``reply`` announces: a whole number of bytes, never negative nor past
    what a file can hold (a size taken as given would be handed to the native receive as an
    unsigned count, 2**64 + 5 as 5)."""
    size = reply.get("size")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size < 1 << 63:
        raise TransferError(record.key, f"malformed reply from {record.owner}: body size "
                            f"{size!r} is not a byte count ({str(reply)[:200]})")
    return size


def _seconds(value: object) -> float | None:
    """A reply's publication time as seconds, ``None`` where it is none (or no finite number:
    a peer's 400-digit integer would raise ``OverflowError`` out of the receive)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        seconds = float(value)
    except OverflowError:
        return None
    return seconds if math.isfinite(seconds) else None


class _ReplyScratch:
    """Buffers a thread's native reply reads fill in (``isc_recv_reply``)."""

    __slots__ = ("got", "header", "header_len", "hexdigest", "published", "size")

    def __init__(self) -> None:
        self.header = ctypes.create_string_buffer(wire.MAX_HEADER)
        self.header_len = ctypes.c_int32(-1)
        self.hexdigest = ctypes.create_string_buffer(17)
        self.got, self.size = ctypes.c_uint64(0), ctypes.c_uint64(0)
        self.published = ctypes.c_double(0.0)  # (isc_recv_frame)


class _Pool(dict[str, socket.socket]):
    """A thread's kept-alive connections (owner address -> socket); a ``dict`` a transport
    can hold weakly, to close it from another thread (:meth:`TcpTransport.close`)."""

    __slots__ = ("__weakref__",)


class _Batches(dict[str, tuple[socket.socket, list[str]]]):
    """A thread's batches asked ahead (see :meth:`TcpTransport._batches`), held weakly as
    :class:`_Pool`."""

    __slots__ = ("__weakref__",)


class _Named:
    """A reader's own batch (``batch=``): its calls take turns (``lock``), and ``dropped``
    says it was dropped (:meth:`TcpTransport.drop_ahead`) while one was under way -- that
    call closes what it would have kept, as the drop would have."""

    __slots__ = ("book", "dropped", "homes", "lock")

    def __init__(self, homes: dict[str, dict[str, Any]], book: threading.Lock) -> None:
        # (re-entrant: a signal handler that reads the same reader must not hang for ever)
        self.lock = threading.RLock()
        self.dropped = False
        #: the process's table of where batches are kept, and the lock under which this
        #: reader's batch is kept or dropped (see TcpTransport._process_state): its own
        #: process's, looked up once for the reader's calls (none per frame)
        self.homes, self.book = homes, book


_T = TypeVar("_T")


def _alive(table: weakref.WeakValueDictionary[int, _T]) -> list[_T]:
    """The values of ``table`` still alive, read in one step (``valuerefs`` copies the
    references without running Python code: no thread changes the table in between)."""
    return [v for v in (r() for r in table.valuerefs()) if v is not None]


class TcpTransport:
    """Fetch files from other nodes' data servers over TCP.

    A thread's connections are its own (kept alive per owner). A stream reader's batch of
    frames asked ahead (``batch=``) may be read from any thread, and from two at once: its
    calls then take turns (a lock; the usual uncontended case costs no system call), so that
    no frame is taken twice and no batch asked twice; :meth:`close` closes every thread's.

    Parameters
    ----------
    settings
        Supplies the job token and the connect timeout.
    """

    name = "tcp"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # per thread (and process): owner address -> kept-alive socket
        self._per_thread = PerThread()
        # a batch's name -> the thread's dict of batches it is in (a reader's named batch is
        # dropped from any thread: see drop_ahead); a reader's batch name -> its _Named; the
        # lock under which a reader's batch is kept or dropped (one step each): this
        # process's alone
        self._homes_of: tuple[int, dict[str, dict[str, Any]], dict[str, _Named],
                              threading.Lock] = (forks(), {}, {}, threading.Lock())
        # every thread's pool and batches, for close() (weakly: a thread that ended takes
        # them along; keyed by a count, a dict being no member of a set)
        self._pools: weakref.WeakValueDictionary[int, _Pool] = weakref.WeakValueDictionary()
        self._all_batches: weakref.WeakValueDictionary[int, _Batches] = \
            weakref.WeakValueDictionary()
        self._made = itertools.count()

    def _process_state(self) -> tuple[dict[str, dict[str, Any]], dict[str, _Named],
                                      threading.Lock]:
        made_in, homes, named, book = self._homes_of
        if made_in != forks():  # (a forked child's: its parent's threads are not its own,
            homes, named, book = {}, {}, threading.Lock()  # nor the locks they held)
            self._homes_of = (forks(), homes, named, book)
        return homes, named, book

    @property
    def _homes(self) -> dict[str, dict[str, Any]]:
        return self._process_state()[0]

    def _named(self, name: str) -> _Named:
        """The turn-taking of the reader's batch ``name`` (made on its first use)."""
        homes, table, book = self._process_state()
        named = table.get(name)
        if named is None:  # (one, if two threads make it at once)
            named = table.setdefault(name, _Named(homes, book))
        return named

    def _connect(self, record: Record) -> socket.socket:
        host, port = parse_addr(record.owner, "owner")
        try:
            sock = socket.create_connection((host, port), timeout=self.settings.connect_timeout)
        except OSError as exc:
            raise PeerUnavailable(f"{record.node or record.owner} ({record.owner})", str(exc)) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _OPENED.add(sock)  # (per connection, not per request)
        return sock

    def _pool(self) -> dict[str, socket.socket]:
        local = self._per_thread.get()
        pool = getattr(local, "pool", None)
        if pool is None:
            pool = local.pool = _Pool()
            self._pools[next(self._made)] = pool
        return pool

    def _request(self, record: Record, op: str = "fetch", wait: float | None = None,
                 until: str | None = None,
                 window: tuple[float, float] | None = None,
                 count: int | None = None) -> tuple[socket.socket, dict[str, Any]]:
        """Send a signed request and read the reply header, reusing a kept-alive connection.

        ``wait`` (seconds): the owner holds the fetch that long for a key not published yet,
        unless ``until`` (a name beside the key) is there or appears. ``window``: when the
        reply is expected (``time.monotonic()``, from, to): asleep until then, polled in it.
        The returned socket is positioned at the body; give it back with :meth:`_release` once
        the body is read completely, or close it.
        """
        wait_ms = _wait_ms(wait)
        sock, reused = self._send(record, op, wait_ms, until, count)
        busy: Backoff | None = None
        while True:
            try:
                if window is not None:  # hybrid polling: only around when the reply is due
                    poll_readable_in(sock, window)
                    window = None
                else:
                    poll_readable(sock, self.settings.spin)  # INSTRIDE_SPIN: poll, then sleep
                reply = self._reply(sock, record, wait_ms)
            except (OSError, wire.WireError, PeerUnavailable) as exc:
                sock.close()
                if reused and not isinstance(exc, TimeoutError | TransferError):
                    # the owner closed an idle connection: retry once on a new one (not after
                    # a reply that never came: a stalled owner, whose wait would double; nor
                    # after one that began: the connection was not idle)
                    reused = False
                    sock = self._send_new(record, op, wait_ms, until, count)
                    continue
                if isinstance(exc, TransferError | PeerUnavailable):
                    raise
                node = record.node or record.owner
                raise PeerUnavailable(f"{node} ({record.owner})", f"no valid reply: {exc}") from None
            except BaseException:
                sock.close()
                raise
            if not reply.get("ok") and reply.get("error") == "PeerUnavailable" and str(
                    reply.get("message", "")).startswith("busy"):
                # (every connection the owner serves at once is answering: a moment later)
                busy = busy or Backoff(self.settings.connect_timeout)
                if not busy.again():
                    break
                sock.close()
                sock, reused = self._send_new(record, op, wait_ms, until, count), False
                continue
            break
        return sock, self._accepted(sock, reply, record)

    def _send(self, record: Record, op: str, wait_ms: int | None,
              until: str | None, count: int | None = None) -> tuple[socket.socket, bool]:
        """Send a signed request on this thread's kept-alive connection to the owner (a new
        one if there is none or it is gone); return the socket and whether it was kept."""
        sock = self._pool().pop(record.owner, None)
        if sock is not None and _closed_by_peer(sock):
            sock.close()  # (found now, not by a request that fails after it was sent)
            sock = None
        if sock is not None:
            try:
                sock.sendall(self._signed(record, op, wait_ms, until, count))
                return sock, True
            except OSError:
                sock.close()  # (closed by the owner while idle)
            except BaseException:
                sock.close()
                raise
        return self._send_new(record, op, wait_ms, until, count), False

    def _send_new(self, record: Record, op: str, wait_ms: int | None, until: str | None,
                  count: int | None = None) -> socket.socket:
        sock = self._connect(record)
        try:
            sock.sendall(self._signed(record, op, wait_ms, until, count))
        except BaseException as exc:
            sock.close()
            if not isinstance(exc, OSError):
                raise
            node = record.node or record.owner
            raise PeerUnavailable(f"{node} ({record.owner})", f"no valid reply: {exc}") from None
        return sock

    def _signed(self, record: Record, op: str, wait_ms: int | None, until: str | None,
                count: int | None = None) -> bytes:
        header = wire.sign(self.settings.token or "", op, record.key, wait_ms, until, count)
        header["version"] = record.version
        return wire.pack(header)

    @staticmethod
    def _reply(sock: socket.socket, record: Record, wait_ms: int | None) -> dict[str, Any]:
        """Read a reply header (a held fetch's may come ``wait_ms`` later than usual)."""
        # (usually there already: a caller polled for it, and a server sends it whole)
        prefix = arrived(sock, 4)
        if len(prefix) == 4:
            pass
        elif wait_ms:
            stall = sock.gettimeout()
            sock.settimeout(None if stall is None else stall + wait_ms / 1000)
            try:
                prefix = _recv_exact(sock, 4, record.key, prefix)
            finally:
                sock.settimeout(stall)
        else:
            prefix = _recv_exact(sock, 4, record.key, prefix)
        n = wire.parse_length(prefix)
        header = arrived(sock, n)
        if len(header) < n:
            header = _recv_exact(sock, n, record.key, header, began=True)
        return wire.parse_header(header)

    def _accepted(self, sock: socket.socket, reply: dict[str, Any], record: Record) -> dict[str, Any]:
        """``reply`` if it says yes; else the typed error (a miss keeps the connection)."""
        if reply.get("ok"):
            return reply
        node = record.node or record.owner
        err = str(reply.get("error"))
        message = str(reply.get("message", "refused"))
        if err == "KeyNotFoundError":  # e.g. deleted or evicted at the owner meanwhile
            self._release(record.owner, sock)  # a miss: the connection stays usable
            raise KeyNotFoundError(record.key)
        sock.close()
        if err == "AuthenticationError":
            raise AuthenticationError(f"{node}: {message}")
        if err == "PeerUnavailable":  # (stopping, or out of descriptors: RESOURCE_ERRORS)
            raise PeerUnavailable(f"{node} ({record.owner})", message)
        raise TransferError(record.key, f"{node} refused: {reply.get('error')}: {message}")

    def _release(self, owner: str, sock: socket.socket) -> None:
        old = self._pool().pop(owner, None)
        if old is not None:
            old.close()
        self._pool()[owner] = sock

    def fetch(self, record: Record, dest: Path) -> None:
        """Receive ``record.key`` into the new file ``dest``; remove it on any failure."""
        fetch_to_new_file(self, record, dest)

    def fetch_into(self, record: Record, fd: int) -> None:
        """Receive ``record.key`` into the open file ``fd`` (from its offset), verified."""
        sock, reply = self._request(record)
        complete = False
        try:
            size = _size(reply, record)
            if size != record.size:
                raise IntegrityError(record.key, f"owner has {size} bytes, record says {record.size}")
            head = _head_for(record.digest_from)
            digest = self._stream_to_file(sock, fd, size, record.key, record.digest_from, head)
            complete = True  # the whole body was read: the connection can be reused
            record.verify(digest, size, None if head is None else head.raw)
            if self.settings.fsync:
                os.fsync(fd)
        finally:
            if complete:
                self._release(record.owner, sock)
            else:
                sock.close()

    def fetch_when_published(self, owner: Record, key: str, fd: int, wait: float,
                             until: str | None = None,
                             on_reply: Callable[[], object] | None = None,
                             window: tuple[float, float] | None = None,
                             into: memoryview | None = None,
                             ahead: int = 0, digest_from: int = 0,
                             batch: str | None = None) -> Received | None:
        """Receive ``key`` from ``owner``'s node into ``fd`` as soon as it is published there.

        The owner's data server holds the request up to ``wait`` seconds for a key that is not
        there yet (a stream's next frame), then sends it like any fetch: no metadata round
        trip and no separate request on the frame's path. The bytes are not verified here —
        the key's record may not even exist yet: the caller compares them with the record, or
        checks a frame by its own checksums (``digest_from``).

        Parameters
        ----------
        owner
            A record of a key of the same owner (its address and node name are used).
        key
            The key to receive.
        fd
            Open file to write the bytes into (from its offset).
        wait
            Seconds the owner may hold the request.
        until
            A name in the key's directory (a stream's end marker): while it exists, the
            owner does not hold the request.
        on_reply
            Called when the owner's reply arrives, before the bytes are received (the caller
            asks for the key's record meanwhile).
        window
            ``(from, to)`` on the ``time.monotonic()`` clock: when the reply is expected
            (hybrid polling, ``Stream(spin="auto")``): the socket is slept on until ``from``,
            then busy-polled until ``to``, then slept on again.
        into
            Writable memory to receive the bytes into instead of ``fd`` when they fit (a
            stream reader's inbox: no copy through a buffer, no ``write``).
        ahead
            Also ask for the ``ahead`` numbered keys after ``key`` (a stream's next frames,
            for a reader that will take them in order): the owner sends each as it is
            published, on this connection, and the calls for them send no request — one
            request per ``1 + ahead`` frames. Asking for any other key next drops the rest.
        digest_from
            The digest leaves out the bytes before this offset (a frame file's header, which
            carries the checksum of the rest, for a reader that checks frames against it).

        Returns
        -------
        Received or None
            The size, the xxh3 hex digest (from ``digest_from`` on) and the publication time
            (the owner's file's modification time, which a stream's producer stamps as it
            publishes a frame) of the bytes received, or ``None`` when the key was not
            published there within ``wait`` (or something else appeared beside it, or
            ``until`` is there).

        Raises
        ------
        TransferError
            The owner's reply names another key, or the body broke off.
        PeerUnavailable
            The owner cannot be reached, or sent no valid reply.
        AuthenticationError
            The owner refused the job token.
        """
        if batch is None:
            return self._when_published(owner, key, fd, wait, until, on_reply, window, into,
                                        ahead, digest_from, None, None)
        named = self._named(batch)
        with named.lock:  # (one call of a reader's batch at a time, whichever threads)
            # (dropped as this thread waited for its turn -- the reader closed or refused a
            # frame on another thread: this frame alone, nothing asked ahead nor kept)
            return self._when_published(owner, key, fd, wait, until, on_reply, window, into,
                                        0 if named.dropped else ahead, digest_from, batch,
                                        named)

    def _when_published(self, owner: Record, key: str, fd: int, wait: float,
                        until: str | None, on_reply: Callable[[], object] | None,
                        window: tuple[float, float] | None, into: memoryview | None,
                        ahead: int, digest_from: int, batch: str | None,
                        named: _Named | None) -> Received | None:
        """:meth:`fetch_when_published`; ``named``: the turn of ``batch``, taken."""
        hint = _hint(owner, key)
        batches = self._batches()
        name = batch or _batch(owner.owner, key)
        asked = batches.pop(name, None)
        if asked is None and batch is not None:
            asked = self._adopted(name, batches)
        try:
            body = None
            if asked is not None and asked[1][0] == key:  # asked for with an earlier key
                sock, rest = asked[0], asked[1][1:]
                if into is not None and window is None and on_reply is None:
                    # (header and body: one native call)
                    reply, body = self._reply_into(sock, hint, wait, into, digest_from)
                else:
                    reply = self._reply_asked(sock, hint, wait, window)
            else:
                if asked is not None:
                    asked[0].close()  # (the owner stops sending what was asked for)
                rest = _numbered_after(key, ahead)
                sock, reply = self._request(hint, wait=wait, until=until, window=window,
                                            count=1 + len(rest) if rest else None)
        except KeyNotFoundError:
            return None  # (the last the owner sends for a request: the connection is free)
        return self._received(owner, key, sock, rest, reply, body, fd, on_reply, into,
                              digest_from, batches, name, named)

    def _adopted(self, name: str, batches: dict[str, tuple[socket.socket, list[str]]],
                 ) -> tuple[socket.socket, list[str]] | None:
        """The reader ``name``'s batch asked for on another thread of this process (a reader
        read from one thread, then from another: an executor's), taken from that thread's
        batches: it goes on here, or is closed, never left held at its owner beside a new
        one (the reader's drop reaches only the batch its name was last kept with).
        Only for a reader's own name: the default one (owner and stream) is not one
        reader's, and two threads reading a stream each keep their own."""
        home = self._homes.get(name)
        if home is None or home is batches:
            return None
        return home.pop(name, None)

    def _received(self, owner: Record, key: str, sock: socket.socket, rest: list[str],
                  reply: dict[str, Any], body: tuple[int, str] | None, fd: int,
                  on_reply: Callable[[], object] | None, into: memoryview | None,
                  digest_from: int,
                  batches: dict[str, tuple[socket.socket, list[str]]], name: str,
                  named: _Named | None) -> Received:
        """The end of :meth:`fetch_when_published`, from the owner's reply (``ok``) on: the
        body received (``body``: already, its size and digest), the connection kept for
        what was asked ahead (``rest``) or for the next request."""
        if reply.get("key") != key:  # (an ahead batch out of step: never trusted)
            sock.close()
            raise TransferError(key, f"{owner.node or owner.owner} sent {reply.get('key')!r}")
        if body is None:
            size, digest, head = self._body(sock, reply, _hint(owner, key), fd, on_reply, into,
                                            keep=not rest, digest_from=digest_from)
        else:
            size, digest = body
            head = bytes(into[:digest_from]) if into is not None and digest_from else None
            if not rest:
                self._release(owner.owner, sock)
        if rest:
            self._keep_asked(batches, name, sock, rest, named)
        published = reply.get("published")
        return Received(size, digest, _seconds(published), head)

    def _keep_asked(self, batches: dict[str, tuple[socket.socket, list[str]]], name: str,
                    sock: socket.socket, rest: list[str], named: _Named | None) -> None:
        """Keep ``sock``, on which ``rest`` is still to come, as the batch ``name`` of this
        thread -- or close it, for a reader's batch dropped from another thread while this
        call had it (the reader closed there: kept, it would be held at its owner, never
        read nor dropped again)."""
        if named is None:  # (this thread's alone)
            batches[name] = (sock, rest)
            self._homes[name] = batches
            return
        with named.book:  # (a drop sees it kept, or this call sees the drop)
            if not named.dropped:
                batches[name] = (sock, rest)
                named.homes[name] = batches
                return
        sock.close()

    def next_asked(self, owner: Record, key: str, into: memoryview, address: int,
                   fd: Callable[[], int], wait: float,
                   batch: str | None = None) -> tuple[Received, bool] | bool | None:
        """A stream reader's common case of :meth:`fetch_when_published`, in one native call:
        ``key`` is the next of the frames this thread asked ``owner`` for ahead, received into
        ``into`` (the memory at ``address``), and checked as a frame there when it is one.

        Returns
        -------
        tuple, bool or None
            ``(received, checked)`` -- the frame, checked by its own checksums when
            ``checked`` (else as :meth:`fetch_when_published` returns it: the caller checks);
            ``False`` when ``key`` was not asked for ahead (nothing was read: the caller goes
            the usual way); ``None`` when it was not published in time, or came and is not a
            frame that passes (the rest asked ahead is dropped), or the batch was dropped
            from another thread as this one took it (:meth:`drop_ahead` with ``batch``).

        Raises
        ------
        TransferError, PeerUnavailable, AuthenticationError
            As :meth:`fetch_when_published`. ``fd``: gives the file to receive into, for a
            body that does not fit ``into``.
        """
        if batch is None:
            return self._next_asked(owner, key, into, address, fd, wait, None, None)
        named = self._named(batch)
        with named.lock:  # (as fetch_when_published)
            if named.dropped:  # (dropped from another thread as this one waited its turn)
                return None
            return self._next_asked(owner, key, into, address, fd, wait, batch, named)

    def _next_asked(self, owner: Record, key: str, into: memoryview, address: int,
                    fd: Callable[[], int], wait: float, batch: str | None,
                    named: _Named | None) -> tuple[Received, bool] | bool | None:
        """:meth:`next_asked`; ``named``: the turn of ``batch``, taken."""
        batches = self._batches()
        name = batch or _batch(owner.owner, key)
        asked = batches.get(name)
        if asked is None or asked[1][0] != key or self.settings.spin:
            return False
        if batches.pop(name, None) is not asked:
            # (dropped from another thread meanwhile -- the reader closed there -- its
            # connection closed: the usual way, if this reader goes on at all)
            return None
        sock, rest = asked
        del rest[0]  # (the list is this call's now: no copy of what is still to come)
        scratch = self._scratch()
        try:
            rc = self._native_reply(sock, owner, key, wait, address, len(into), HEADER_SIZE,
                                    frame=True)
            if rc == 0:  # a frame that passed
                if rest:
                    self._keep_asked(batches, name, sock, rest, named)
                else:
                    self._release(owner.owner, sock)
                return Received(scratch.size.value, scratch.hexdigest.value.decode(),
                                scratch.published.value, None), True
            if rc == 3:  # came whole, not a frame that passes: refused, as a failed check
                sock.close()
                return None
            reply, body = self._reply_parsed(sock, _hint(owner, key), 0 if rc == 2 else 1)
            dest = -1 if body is not None else fd()  # (the file: only for a body still to come)
        except KeyNotFoundError:
            return None  # (the owner's last reply for the request: the connection is pooled)
        except BaseException:
            sock.close()  # (closed already where the receive failed; not where fd() did)
            raise
        return self._received(owner, key, sock, rest, reply, body, dest, None, into, HEADER_SIZE,
                              batches, name, named), False

    def drop_ahead(self, owner: str | None = None, key: str | None = None,
                   batch: str | None = None) -> None:
        """Drop what this thread asked for ahead (:meth:`fetch_when_published`'s ``ahead``) —
        of ``owner`` (its address) alone, when given, and of the keys beside ``key`` (a
        stream's frames) alone, when given too: the connections are closed, so the owners
        stop sending (a stream's reader that stops, or that refused a frame). ``batch``: the
        batch of that name alone, whichever thread asked for it (a reader closed from
        another thread, or collected)."""
        if batch is not None:
            homes, table, book = self._process_state()
            with book:  # (a call of the reader under way closes what it would keep)
                named = table.pop(batch, None)
                if named is not None:
                    named.dropped = True
                home = homes.pop(batch, None)
                got = None if home is None else home.pop(batch, None)
            if got is not None:
                got[0].close()
            return
        batches = self._batches()
        if owner is not None and key is not None:
            names = [_batch(owner, key)]
        elif owner is not None:
            names = [name for name in batches if name.partition("|")[0] == owner]
        elif key is not None:
            names = [name for name in batches if name.partition("|")[2] == _prefix(key)]
        else:
            names = list(batches)
        for name in names:
            got = batches.pop(name, None)
            if got is not None:
                got[0].close()

    def _batches(self) -> dict[str, tuple[socket.socket, list[str]]]:
        """This thread's connections on which keys were asked for ahead: owner and the keys'
        directory (one stream's frames; see :func:`_batch`) -> (socket, the keys whose replies
        are still to come, in order)."""
        local = self._per_thread.get()
        batches = getattr(local, "batches", None)
        if batches is None:
            batches = local.batches = _Batches()
            self._all_batches[next(self._made)] = batches
        return batches

    def _reply_asked(self, sock: socket.socket, hint: Record, wait: float,
                     window: tuple[float, float] | None) -> dict[str, Any]:
        """The owner's reply for a key asked for ahead (see :meth:`fetch_when_published`)."""
        wait_ms = _wait_ms(wait)
        try:
            if window is not None:
                poll_readable_in(sock, window)
            else:
                poll_readable(sock, self.settings.spin)
            reply = self._reply(sock, hint, wait_ms)
        except BaseException as exc:
            sock.close()
            if isinstance(exc, OSError | wire.WireError) and not isinstance(exc, InstrideError):
                node = hint.node or hint.owner
                raise PeerUnavailable(f"{node} ({hint.owner})", f"no valid reply: {exc}") from None
            raise
        return self._accepted(sock, reply, hint)

    def _reply_into(self, sock: socket.socket, hint: Record, wait: float, into: memoryview,
                    digest_from: int) -> tuple[dict[str, Any], tuple[int, str] | None]:
        """:meth:`_reply_asked` and, when the reply says yes and its body fits ``into``, the
        body into ``into`` in the same native call (``isc_recv_reply``); returns the reply and
        the body's size and digest (from ``digest_from`` on), or ``None`` for a body still to
        be received (it does not fit). A failure closes the socket."""
        try:
            base = (ctypes.c_char * len(into)).from_buffer(into)  # (no copy: its address)
        except BaseException:
            sock.close()  # (a read-only ``into``: the connection is neither kept nor pooled)
            raise
        try:
            rc = self._native_reply(sock, hint, hint.key, wait, ctypes.addressof(base),
                                    len(into), digest_from)
        finally:
            del base
        return self._reply_parsed(sock, hint, rc)

    def _native_reply(self, sock: socket.socket, owner: Record, key: str, wait: float,
                      address: int, cap: int, digest_from: int, *, frame: bool = False) -> int:
        """The native half of :meth:`_reply_into`: ``isc_recv_reply`` (``frame``:
        ``isc_recv_frame``, which also checks a frame) into this thread's scratch buffers and
        the ``cap`` bytes at ``address``; returns its code, 0 or more (a failure raises, the
        socket closed: :class:`TransferError` for a body that broke off,
        :class:`PeerUnavailable` for no valid reply)."""
        try:
            if self.settings.spin:
                poll_readable(sock, self.settings.spin)
            lib, scratch = load_library(), self._scratch()
            timeout = sock.gettimeout()
            stall_ms = -1 if timeout is None else max(1, int(timeout * 1000))
            first_ms = -1 if timeout is None else stall_ms + (_wait_ms(wait) or 0)
            stall_ms, first_ms = min(stall_ms, _INT_MAX), min(first_ms, _INT_MAX)
            began = time.monotonic()
            while True:
                if frame:
                    rc = lib.isc_recv_frame(sock.fileno(), first_ms, stall_ms, key.encode(),
                                            scratch.header, wire.MAX_HEADER, scratch.header_len,
                                            address, cap, scratch.hexdigest, scratch.got,
                                            scratch.size, scratch.published)
                else:
                    rc = lib.isc_recv_reply(sock.fileno(), first_ms, stall_ms, scratch.header,
                                            wire.MAX_HEADER, scratch.header_len, address, cap,
                                            digest_from, scratch.hexdigest, scratch.got,
                                            scratch.size)
                if rc != -errno.EINTR:
                    break
                # (a signal before any of the reply came: its handler runs now, as for
                # any wait on a socket — and may raise — then the wait goes on, for what
                # is left of it: signals more often than the wait made it endless)
                if first_ms >= 0:
                    spent = int((time.monotonic() - began) * 1000)
                    first_ms = max(0, first_ms - spent)
                    began += spent / 1000
            n = scratch.header_len.value
            if rc < 0 and n >= 0 and rc != -errno.EBADMSG:  # the body broke off
                raise _receive_error(key, -rc, scratch.got.value, scratch.size.value)
            if rc < 0 and n < 0 and scratch.got.value > 0:  # the header broke off (it began)
                raise _header_error(key, -rc, scratch.got.value)
            if rc < 0:
                reason = f"header length {n} out of range (1..{wire.MAX_HEADER})" \
                    if rc == -errno.EBADMSG else os.strerror(-rc)
                node = owner.node or owner.owner
                raise PeerUnavailable(f"{node} ({owner.owner})", f"no valid reply: {reason}")
        except BaseException:
            sock.close()
            raise
        return rc  # type: ignore[no-any-return]

    def _reply_parsed(self, sock: socket.socket, hint: Record,
                      rc: int) -> tuple[dict[str, Any], tuple[int, str] | None]:
        """The rest of :meth:`_reply_into` once ``isc_recv_reply`` returned ``rc`` (0 or 1):
        the reply header parsed and accepted (a refusal raises its typed error)."""
        scratch = self._scratch()
        try:
            try:
                reply = wire.parse_header(ctypes.string_at(scratch.header, scratch.header_len.value))
            except wire.WireError as exc:
                node = hint.node or hint.owner
                raise PeerUnavailable(f"{node} ({hint.owner})", f"no valid reply: {exc}") from None
            if rc == 0 and _size(reply, hint) != scratch.size.value:  # (two "size" fields?)
                raise TransferError(hint.key, f"malformed reply from {hint.owner}: {reply!r}")
        except BaseException:
            sock.close()
            raise
        reply = self._accepted(sock, reply, hint)
        if rc == 1:
            return reply, None
        return reply, (scratch.size.value, scratch.hexdigest.value.decode())

    def _scratch(self) -> _ReplyScratch:
        """This thread's buffers for :meth:`_reply_into` (made once)."""
        local = self._per_thread.get()
        scratch = getattr(local, "reply_scratch", None)
        if scratch is None:
            scratch = local.reply_scratch = _ReplyScratch()
        return scratch

    def ask_when_published(self, owner: Record, key: str, wait: float,
                           until: str | None = None) -> socket.socket:
        """The first half of :meth:`fetch_when_published`: send the request and return the
        socket its reply will come on, for a caller that waits for something else meanwhile
        (it polls the socket). Finish with :meth:`receive_asked`, or close the socket to
        withdraw the request (the owner's server then drops it without a reply).

        Raises
        ------
        PeerUnavailable
            The owner's data server cannot be reached.
        """
        sock, _ = self._send(_hint(owner, key), "fetch", _wait_ms(wait), until)
        return sock

    def receive_asked(self, sock: socket.socket, owner: Record, key: str, fd: int,
                      wait: float, digest_from: int = 0,
                      into: memoryview | None = None) -> Received | None:
        """The second half of :meth:`fetch_when_published`: the owner's reply to
        :meth:`ask_when_published` and the bytes into ``fd``; ``None`` if the owner answered
        that the key was not published in time (``digest_from``, ``into``: as for
        :meth:`fetch_when_published`; with ``into``, reply and body are received in one
        native call). The socket is consumed (kept for the next
        request, or closed). A kept-alive connection the owner had closed is not used for
        the request (:meth:`ask_when_published` checks first); one it closes in the moment
        between that check and the request is not retried here, unlike a fetch: the request
        fails (:class:`PeerUnavailable`: no valid reply) and the caller waits the usual way."""
        hint = _hint(owner, key)
        body = None
        try:
            if into is not None:
                reply, body = self._reply_into(sock, hint, wait, into, digest_from)
            else:
                try:
                    reply = self._reply(sock, hint, _wait_ms(wait))
                except BaseException as exc:
                    sock.close()
                    if isinstance(exc, OSError | wire.WireError) \
                            and not isinstance(exc, InstrideError):  # (typed, as _reply_asked)
                        node = hint.node or hint.owner
                        raise PeerUnavailable(f"{node} ({hint.owner})",
                                              f"no valid reply: {exc}") from None
                    raise
                reply = self._accepted(sock, reply, hint)
        except KeyNotFoundError:
            return None
        if reply.get("key") != key:  # (as fetch_when_published: a reply for another key)
            sock.close()
            raise TransferError(key, f"{owner.node or owner.owner} sent {reply.get('key')!r}")
        if body is None:
            size, digest, head = self._body(sock, reply, hint, fd, None, digest_from=digest_from)
            return Received(size, digest, None, head)
        self._release(owner.owner, sock)
        head = bytes(into[:digest_from]) if into is not None and digest_from else None
        return Received(body[0], body[1], None, head)

    def _body(self, sock: socket.socket, reply: dict[str, Any], hint: Record, fd: int,
              on_reply: Callable[[], object] | None,
              into: memoryview | None = None, keep: bool = True,
              digest_from: int = 0) -> tuple[int, str, bytes | None]:
        """Receive the body announced by ``reply`` into ``fd`` — or into the writable memory
        ``into`` when it is large enough; the connection is kept after a whole body (for
        the next request; ``keep=False``: left to the caller, more replies are due on it),
        else closed. Returns its size, digest (of the bytes from ``digest_from`` on) and the
        bytes before ``digest_from`` (``None`` when there are none)."""
        head = None
        complete = False
        try:
            size = _size(reply, hint)
            if on_reply is not None:
                on_reply()
            if into is not None and size <= len(into):
                digest = self._stream_to_memory(sock, into, size, hint.key, digest_from)
                head = bytes(into[:digest_from]) if digest_from else None
            else:
                buf = _head_for(digest_from)
                digest = self._stream_to_file(sock, fd, size, hint.key, digest_from, buf)
                head = None if buf is None else buf.raw
            complete = True
        finally:
            if not complete:
                sock.close()
            elif keep:
                self._release(hint.owner, sock)
        return size, digest, head

    def _stream_to_memory(self, sock: socket.socket, into: memoryview, size: int, key: str,
                          digest_from: int = 0) -> str:
        """:meth:`_stream_to_file` into the writable memory ``into`` (``isc_recv_mem``)."""
        lib = load_library()
        timeout = sock.gettimeout()
        stall_ms = -1 if timeout is None else max(1, int(timeout * 1000))
        hexdigest = ctypes.create_string_buffer(17)
        got = ctypes.c_uint64(0)
        base = (ctypes.c_char * len(into)).from_buffer(into)  # (no copy: its address)
        try:
            rc = lib.isc_recv_mem(sock.fileno(), ctypes.addressof(base), size, digest_from,
                                  stall_ms, hexdigest, ctypes.byref(got))
        finally:
            del base
        if rc == 0:
            return hexdigest.value.decode()
        raise _receive_error(key, -rc, got.value, size)

    def _stream_to_file(self, sock: socket.socket, fd: int, size: int, key: str,
                        digest_from: int = 0, head: ctypes.Array[ctypes.c_char] | None = None) -> str:
        """Receive ``size`` bytes into ``fd``, hashing on the way (from byte ``digest_from``
        on); return the xxh3 hex digest. ``head`` (``digest_from`` bytes) receives a copy of
        the bytes before ``digest_from`` (a frame's header, for its record's check).

        The loop is C (``isc_recv_file`` in ``libinstride_tcp.so``, GIL released): each piece is
        hashed while it is in cache and written to the file (``write`` reports a full disk as
        ``OSError``); nothing arriving for the socket's timeout is a stall.
        """
        lib = load_library()
        timeout = sock.gettimeout()
        stall_ms = -1 if timeout is None else max(1, int(timeout * 1000))
        hexdigest = ctypes.create_string_buffer(17)
        got, where = ctypes.c_uint64(0), ctypes.c_int(0)
        rc = lib.isc_recv_file(sock.fileno(), fd, size, digest_from, stall_ms, hexdigest,
                               ctypes.byref(got), ctypes.byref(where), head)
        if rc == 0:
            return hexdigest.value.decode()
        err = -rc
        if where.value:  # the file: a full disk, a quota, ... (named: the key and how far)
            raise OSError(err, f"{os.strerror(err)}: writing the copy of {key!r} fetched here "
                               f"(after {got.value} of {size} bytes)")
        raise _receive_error(key, err, got.value, size)

    def fetch_bytes(self, record: Record) -> bytearray:
        """Receive ``record.key`` into memory and verify it."""
        sock, reply = self._request(record)
        try:
            size = _size(reply, record)
            if size != record.size:
                raise IntegrityError(record.key, f"owner has {size} bytes, record says {record.size}")
            buf = bytearray(size)
            # (the native loop: hashed on the way, and counted as a receive of this process)
            digest = self._stream_to_memory(sock, memoryview(buf), size, record.key,
                                            record.digest_from)
        except BaseException:
            sock.close()
            raise
        self._release(record.owner, sock)
        record.verify(digest, size, buf)
        return buf

    @classmethod
    def server_class(cls) -> type[TcpServer]:
        """The server half, :class:`~instride.transport.tcp.server.TcpServer`."""
        from .server import TcpServer

        return TcpServer

    def close(self) -> None:
        """Close the kept-alive connections of every thread of this process, and those keys
        were asked for ahead on (their owners stop sending).

        A connection another thread is using as this runs is that thread's to keep or close
        when its call ends; a reader's batch is closed then (its drop is marked).
        """
        homes, table, book = self._process_state()
        with book:
            for named in table.values():
                named.dropped = True
            table.clear()
            homes.clear()
        # (a snapshot taken in one step: threads making their first pool or batches
        # meanwhile would change the tables under an iteration -- RuntimeError)
        for batches in _alive(self._all_batches):  # (each entry whole: popitem)
            while batches:
                try:
                    _, (sock, _rest) = batches.popitem()
                except KeyError:  # (its thread took the last one meanwhile)
                    break
                sock.close()
        for pool in _alive(self._pools):
            while pool:
                try:
                    _, sock = pool.popitem()
                except KeyError:
                    break
                sock.close()
        self.drop_ahead()  # (this thread's batches, were they of a dict made elsewhere)
