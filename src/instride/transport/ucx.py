"""UCX transport: both halves, over UCP active messages in C (``libinstride_ucx.so``).

The protocol is the TCP transport's, carried by UCX instead of a socket: a request is the
same signed JSON header (:func:`instride.transport.wire.sign`, HMAC-SHA256 of the job token
over op, key, nonce and timestamp, checked with :func:`~instride.transport.wire.verify`),
the reply a JSON header followed by the file as one message body. UCX chooses how the body
moves: shared memory between processes of one node, TCP between nodes on Ethernet, RDMA
(InfiniBand, RoCE) where the hardware has it — the same code, configured by UCX's own
variables (``UCX_TLS``, ``UCX_NET_DEVICES``). Every body is checked against the record
(size and xxh3) before anything is written at its destination; a failed, short or corrupt
transfer leaves nothing there.

Selection: ``INSTRIDE_TRANSPORT=ucx`` (default ``tcp``; see :func:`selected_transport`).
A node's UCX data server listens on the host of its ``INSTRIDE_ADDR`` at that port plus
:data:`PORT_OFFSET` (7438 by default), so a record's owner address names both servers.

Needs UCX (Debian ``libucx-dev`` when instride is built, ``libucx0`` at run time); without
it, selecting the transport raises :class:`~instride.errors.ConfigError` naming the package.

Security is the TCP transport's: requests are authenticated (job token, timestamp within
:data:`~instride.transport.wire.MAX_SKEW`), nonces are not remembered (a captured request can
be replayed within that window) and nothing is encrypted: run the traffic on a trusted network.

Examples
--------
Serve a managed directory over UCX and fetch a key from it (normally the node server and
the cluster engine do this)::

    from instride.transport.ucx import UcxTransport, start_server
    server = start_server(settings)                 # listens on INSTRIDE_ADDR's port + 1
    UcxTransport(settings).fetch(record, dest)      # record: from the metadata backend
    server.stop()

Run a UCX data server alone (what tests and benchmarks do until ``instride serve`` starts
transports by name)::

    python -m instride.transport.ucx --help
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import logging
import os
import signal
import socket
import stat
import sys
import threading
from collections.abc import Mapping
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
    PeerUnavailable,
    TransferError,
)
from ..keys import key_path, normalize_key
from ..metadata.base import Record
from . import wire

log = logging.getLogger("instride.transport.ucx")

#: The UCX data server of a node listens at its ``INSTRIDE_ADDR`` port plus this.
PORT_OFFSET = 1
#: Names ``INSTRIDE_TRANSPORT`` accepts.
TRANSPORTS = ("tcp", "ucx")
#: Debian packages that provide UCX (build and run time).
INSTALL_HINT = ("apt-get install libucx-dev ucx-utils, then reinstall instride "
                "(pip install -e .) so that libinstride_ucx.so is built")
#: Seconds any send of a reply may take, plus size / :data:`SEND_RATE` for its body.
SEND_TIMEOUT = 60.0
#: Bytes per second a peer is assumed to sustain at least, for a body's deadline.
SEND_RATE = 50e6
_ERR = 512
_REPLY_CAP = wire.MAX_HEADER + 1


def selected_transport(env: Mapping[str, str] | None = None) -> str:
    """The transport named by ``INSTRIDE_TRANSPORT`` (``tcp`` when unset or empty).

    Raises
    ------
    ConfigError
        For a name that is not a known transport.
    """
    env = os.environ if env is None else env
    name = env.get("INSTRIDE_TRANSPORT", "").strip().lower() or "tcp"
    if name not in TRANSPORTS:
        raise ConfigError("INSTRIDE_TRANSPORT", name, f"expected one of {', '.join(TRANSPORTS)}")
    return name


def ucx_address(owner: str) -> tuple[str, int]:
    """``(IPv4 address, port)`` of the UCX data server of the node whose TCP address is ``owner``."""
    host, port = parse_addr(owner, "owner")
    if port + PORT_OFFSET > 65535:
        raise ConfigError("owner", owner, "no room for the UCX port (port + 1 > 65535)")
    try:
        ip = socket.gethostbyname(host)
    except OSError as exc:
        raise PeerUnavailable(owner, f"cannot resolve {host}: {exc}") from None
    return ip, port + PORT_OFFSET


# ---------------------------------------------------------------------- the C library
_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()
#: buffers UCX may still write into (a body that could not be cancelled): never reused
_stuck: list[Any] = []


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
        path = library_path()
        if not path.exists():
            raise ConfigError("INSTRIDE_TRANSPORT", "ucx",
                              f"UCX support was not built ({path.name} is missing); {INSTALL_HINT}")
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise ConfigError("INSTRIDE_TRANSPORT", "ucx",
                              f"cannot load {path.name} ({exc}); {INSTALL_HINT}") from None
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
            "isu_server_start": (vp, [cp, ctypes.c_int, cp, sz]),
            "isu_server_port": (ctypes.c_int, [vp]),
            "isu_server_stats": (None, [vp, ctypes.POINTER(u64)]),
            "isu_server_wake": (None, [vp]),
            "isu_server_next": (ctypes.c_int, [vp, cp, sz, i64]),
            "isu_server_reply": (ctypes.c_int, [vp, cp, sz, ctypes.c_int, u64, i64, cp, sz]),
            "isu_server_pending": (ctypes.c_int, [vp]),
            "isu_server_close": (None, [vp, i64]),
        }
        for name, (res, args) in sigs.items():
            fn = getattr(lib, name)
            fn.restype = res
            fn.argtypes = args
        _lib = lib
        return lib


def _msg(buf: ctypes.Array[ctypes.c_char]) -> str:
    return buf.value.decode(errors="replace")


# ---------------------------------------------------------------------- client half
def _check(record: Record, digest: str, size: int) -> None:
    """Compare a received size and xxh3 digest with the record."""
    if size != record.size:
        raise IntegrityError(record.key, f"size {size} differs from the record's {record.size}")
    if record.checksum is not None:
        algo, _, expected = record.checksum.partition(":")
        if algo != "xxh3":
            raise IntegrityError(record.key, f"unknown checksum algorithm {algo!r}")
        if digest != expected:
            raise IntegrityError(record.key, f"checksum {digest} differs from the record's {expected}")


class _Worker:
    """One UCP worker and its endpoints, used by one thread only."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        err = ctypes.create_string_buffer(_ERR)
        handle = lib.isu_client_new(err, _ERR)
        if not handle:
            raise ConfigError("INSTRIDE_TRANSPORT", "ucx", f"cannot start UCX: {_msg(err)}")
        self.handle: int | None = handle
        self.reply = ctypes.create_string_buffer(_REPLY_CAP)
        self.buffer: bytearray | None = None  # reused for bodies written to files

    def close(self) -> None:
        if self.handle:
            self.lib.isu_client_close(self.handle)
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
        self._local = threading.local()
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()

    def _worker(self) -> _Worker:
        w = getattr(self._local, "worker", None)
        if w is None or w.handle is None:
            w = self._local.worker = _Worker(self.lib)
            with self._lock:
                self._workers.append(w)
        return w

    # ------------------------------------------------------------------ requests
    def _request(self, w: _Worker, record: Record, op: str = "fetch") -> tuple[dict[str, Any], int]:
        """Send a signed request; return the reply header and the size of the body to come."""
        node = f"{record.node or record.owner} ({record.owner})"
        host, port = ucx_address(record.owner)
        header = wire.sign(self.settings.token or "", op, record.key)
        header["version"] = record.version
        payload = json.dumps(header, separators=(",", ":")).encode()
        if len(payload) > wire.MAX_HEADER:
            raise TransferError(record.key, f"request header of {len(payload)} bytes is too long")
        err = ctypes.create_string_buffer(_ERR)
        body = ctypes.c_uint64(0)
        reused = ctypes.c_int(0)
        timeout_ms = int(self.settings.connect_timeout * 1000)
        for _attempt in range(2):
            rc = self.lib.isu_client_request(w.handle, host.encode(), port, payload, len(payload),
                                             w.reply, _REPLY_CAP, ctypes.byref(body),
                                             ctypes.byref(reused), timeout_ms, err, _ERR)
            if rc == 0:
                break
            if rc == -errno.ECONNRESET and reused.value:
                continue  # a kept-alive endpoint to a restarted owner: retry once on a new one
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
        w = self._worker()
        _reply, size = self._request(w, record)
        buf = self._scratch(w, size)
        self._receive(w, record, buf, size)
        view = memoryview(buf)[:size]
        _check(record, xxhash.xxh3_64_hexdigest(view), size)
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            done = 0
            while done < size:
                done += os.write(fd, view[done:])
            if self.settings.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(dest)
            raise
        os.close(fd)

    def fetch_bytes(self, record: Record) -> bytearray:
        """Receive ``record.key`` into a new ``bytearray`` and verify it."""
        w = self._worker()
        _reply, size = self._request(w, record)
        buf = bytearray(size)
        self._receive(w, record, buf, size)
        _check(record, xxhash.xxh3_64_hexdigest(buf), size)
        return buf

    def endpoint_info(self, record: Record) -> str:
        """UCX's description of this thread's endpoint to ``record``'s owner (which transports
        carry the traffic); empty when there is none. For diagnostics and tests."""
        w = self._worker()
        host, port = ucx_address(record.owner)
        out = ctypes.create_string_buffer(1 << 16)
        rc = self.lib.isu_client_ep_info(w.handle, host.encode(), port, out, len(out))
        return _msg(out) if rc == 0 else ""

    def close(self) -> None:
        """Close every thread's worker and endpoints (call when no fetch is running)."""
        with self._lock:
            workers, self._workers = self._workers, []
        for w in workers:
            w.close()


# ---------------------------------------------------------------------- server half
class UcxServer:
    """Serve the files of a managed directory to peers over UCX.

    One thread runs the UCP worker: it authenticates each request (the job token), opens the
    key's file (a regular file inside the directory, reached without symbolic links) and
    hands it to UCX, which sends it from a memory map while the thread answers the next
    request, so a large body does not hold up small ones.

    Parameters
    ----------
    settings
        The node's settings: managed directory, job token, ``INSTRIDE_ADDR``.
    host, port
        Where to listen; default: ``INSTRIDE_ADDR``'s host and port + :data:`PORT_OFFSET`.
        Port 0 picks a free port (see :attr:`port`).
    on_reply
        Called with ``(key, size)`` before each body is handed to UCX (diagnostics).
    """

    def __init__(self, settings: Settings, host: str | None = None, port: int | None = None,
                 on_reply: Any = None) -> None:
        self.settings = settings
        default_host, default_port = ucx_address(settings.addr)
        self.host = socket.gethostbyname(host) if host else default_host
        self.port = default_port if port is None else port
        self.on_reply = on_reply
        self.root_real = os.path.realpath(settings.dir)
        self.lib = load_library()
        self.stats = {"fetches": 0, "refused": 0, "errors": 0}
        self._handle: int | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.grace = 10.0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> UcxServer:
        """Start listening (in the serving thread) and return once it listens.

        Raises
        ------
        ConfigError
            When UCX cannot listen there (address in use, not an address of this node).
        """
        # like the TCP server's SO_REUSEADDR: a restarted server gets its port back at once
        # (UCX reads its variables when the server's context is created)
        os.environ.setdefault("UCX_TCP_CM_REUSEADDR", "y")
        os.environ.setdefault("UCX_RDMA_CM_REUSEADDR", "y")
        self._thread = threading.Thread(target=self._run, name="instride-ucx", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        """Stop listening; let bodies in flight finish for up to ``grace`` seconds."""
        self._stop.set()
        if self._handle:
            self.lib.isu_server_wake(self._handle)
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> UcxServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        err = ctypes.create_string_buffer(_ERR)
        handle = self.lib.isu_server_start(self.host.encode(), self.port, err, _ERR)
        if not handle:
            self._error = ConfigError("UCX listen address", f"{self.host}:{self.port}", _msg(err))
            self._ready.set()
            return
        self._handle = handle
        self.port = self.lib.isu_server_port(handle)
        self._ready.set()
        log.info("serving %s over UCX on %s:%d", self.settings.dir, self.host, self.port)
        buf = ctypes.create_string_buffer(_REPLY_CAP)
        try:
            while not self._stop.is_set():
                n = self.lib.isu_server_next(handle, buf, _REPLY_CAP, 500)
                if n <= 0:
                    continue  # timeout slice or woken to stop
                try:
                    self._answer(handle, buf.raw[:n])
                except Exception:  # never let one request take the server down
                    self.stats["errors"] += 1
                    log.exception("unexpected error answering a UCX request")
        finally:
            self._handle = None
            self.lib.isu_server_close(handle, int(self.grace * 1000))
            log.info("UCX server stopped; stats %s", self.stats)

    # ------------------------------------------------------------------ requests
    def _reply(self, handle: int, header: dict[str, Any], fd: int = -1, size: int = 0) -> None:
        body = json.dumps(header, separators=(",", ":")).encode()
        err = ctypes.create_string_buffer(_ERR)
        deadline_ms = int((SEND_TIMEOUT + size / SEND_RATE) * 1000)
        rc = self.lib.isu_server_reply(handle, body, len(body), fd, size, deadline_ms, err, _ERR)
        if rc != 0:
            log.debug("reply not sent: %s", _msg(err))

    def _refuse(self, handle: int, error: str, message: str) -> None:
        self.stats["refused"] += 1
        self._reply(handle, {"ok": False, "error": error, "message": message[:1000]})

    def _answer(self, handle: int, raw: bytes) -> None:
        try:
            req = wire.parse_header(raw)
        except wire.WireError as exc:
            self._refuse(handle, "WireError", str(exc))
            return
        reason = wire.verify(self.settings.token, req)
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
            fd, st = self._open_served(key)
        except KeyNotFoundError as exc:
            self._reply(handle, {"ok": False, "error": "KeyNotFoundError", "message": str(exc)})
            return
        except InstrideError as exc:
            self._refuse(handle, type(exc).__name__, str(exc))
            return
        if self.on_reply is not None:
            self.on_reply(key, st.st_size)
        self.stats["fetches"] += 1
        self._reply(handle, {"ok": True, "key": key, "size": st.st_size}, fd, st.st_size)

    def _open_served(self, key: str) -> tuple[int, os.stat_result]:
        """Open ``key``: a regular file inside the managed directory, no symbolic link."""
        path = key_path(key, self.settings.dir)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise KeyNotFoundError(key) from None
        except OSError as exc:
            detail = "it is a symbolic link" if exc.errno == errno.ELOOP else os.strerror(exc.errno or 5)
            raise _not_served(key, detail) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _not_served(key, "it is not a regular file")
            try:
                real = os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)")
            except OSError:
                real = os.path.realpath(path)
            if real != os.path.join(self.root_real, key):
                raise _not_served(key, "it resolves outside the managed directory or through a link")
        except BaseException:
            os.close(fd)
            raise
        return fd, st


def _not_served(key: str, reason: str) -> KeyNotFoundError:
    exc = KeyNotFoundError(key)
    exc.strerror = f"key {key!r} is not served: {reason}"
    return exc


def start_server(settings: Settings, host: str | None = None, port: int | None = None) -> UcxServer:
    """Start a :class:`UcxServer` for ``settings`` (what a node server calls); stop it with
    :meth:`UcxServer.stop`."""
    return UcxServer(settings, host, port).start()


# ---------------------------------------------------------------------- stand-alone server
def main(argv: list[str] | None = None) -> int:
    """``python -m instride.transport.ucx``: run a UCX data server until SIGTERM/SIGINT."""
    ap = argparse.ArgumentParser(
        prog="python -m instride.transport.ucx",
        description="Serve this node's managed directory (INSTRIDE_DIR) to peers over UCX, "
                    "authenticated with INSTRIDE_TOKEN, on INSTRIDE_ADDR's host and port + 1.",
    )
    ap.add_argument("--host", help="address to listen on (default: INSTRIDE_ADDR's host)")
    ap.add_argument("--port", type=int, help="port (default: INSTRIDE_ADDR's port + 1; 0: any)")
    ap.add_argument("--announce", action="store_true",
                    help="print 'reply KEY SIZE' on stdout before each body is sent")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    settings = Settings.from_env()

    def announce(key: str, size: int) -> None:
        print(f"reply {key} {size}", flush=True)

    server = UcxServer(settings, args.host, args.port, on_reply=announce if args.announce else None)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
    except InstrideError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"ready {server.host}:{server.port}", flush=True)
    while not stop.wait(0.5):
        pass
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
