"""Fault cases in cluster mode on loopback: real ``instride serve`` processes and a real Redis.

A data server killed mid-transfer, Redis restarted mid-run, bit flips at rest and in transit,
wrong/missing/replayed tokens, a stalled peer, the wire protocol fuzzed, and path traversal
and symbolic links through the data server and cluster consumers.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from instride.client import Client
from instride.errors import (
    AuthenticationError,
    ConsumeTimeout,
    FileTypeError,
    IntegrityError,
    KeyValidationError,
    PeerUnavailable,
    TransferError,
    UnsafePathError,
)
from instride.frames import HEADER_SIZE
from instride.record import FRAME_CHECKSUM
from instride.stream import Stream
from instride.transport import wire
from tests.conftest import LoopbackNode, RedisServer, free_port, running_nodes

from .harness import HANG_MARGIN, CaseResult, bounded, digest, file_digest, leftovers, payload, timed

TOKEN = "fault-token"
#: Typed errors a consumer may see when a transfer or its owner fails.
TRANSFER_ERRORS = (PeerUnavailable, TransferError, IntegrityError, ConsumeTimeout)


@contextlib.contextmanager
def nodes(work: Path, count: int, redis_url: str | None = None) -> Iterator[list[LoopbackNode]]:
    """``count`` loopback nodes (and a Redis unless ``redis_url`` is given); all stopped after."""
    redis = None if redis_url else RedisServer().start()
    url = redis_url or redis.url  # type: ignore[union-attr]
    try:
        with running_nodes(work, url, TOKEN, range(1, count + 1), sig=signal.SIGKILL) as made:
            yield made
    finally:
        if redis is not None:
            redis.stop()


def _publish(client: Client, key: str, data: bytes, overwrite: bool = False) -> None:
    with client.open(key, "wb", overwrite=overwrite) as fh:
        fh.write(data)


def _consumed_ok(res: CaseResult, path: Path, want: str) -> bool:
    if file_digest(path) != want:
        res.corrupted += 1
        return False
    return True


def _nothing_left(res: CaseResult, node: LoopbackNode, key: str) -> None:
    """A failed consume must leave no file under the key and no temporary file."""
    if (node.dir / key).exists() or leftovers(node.dir):
        res.corrupted += 1
        res.notes.append(f"left behind on {node.dir}: {key} / {leftovers(node.dir)}")


# ------------------------------------------------------------------ server killed mid-transfer
def case_server_killed(work: Path, trials: int, size: int = 48 << 20, seed: int = 7) -> CaseResult:
    """The owner's data server is SIGKILLed while a consumer fetches a 48 MiB file from it.

    Checks: the consumer gets the whole file or a typed error, with nothing stored under the
    key; once the server is back, the same consume succeeds and verifies.
    """
    res = CaseResult("data server killed mid-transfer")
    rng = random.Random(seed)
    data = payload(seed, size)
    want = digest(data)
    with timed(res), nodes(work / "srvkill", 2) as (n1, n2):
        c1, c2 = n1.client(), n2.client()
        for t in range(trials):
            res.trials += 1
            key = f"big/t{t}.bin"
            _publish(c1, key, data)
            box: dict[str, object] = {}
            th = threading.Thread(target=lambda k=key, box=box: box.update(r=bounded(
                lambda: c2.consume(k, timeout=30), 30 + HANG_MARGIN)), daemon=True)
            th.start()
            time.sleep(rng.uniform(0.0, 0.05))
            assert n1.proc is not None
            n1.proc.send_signal(signal.SIGKILL)
            n1.proc.wait()
            th.join(40 + HANG_MARGIN)
            state, value = box.get("r", ("hang", None))  # type: ignore[misc]
            if state == "hang":
                res.hangs += 1
            elif state == "ok":
                if _consumed_ok(res, value, want):  # type: ignore[arg-type]
                    res.saw("transfer completed before the kill")
            elif isinstance(value, TRANSFER_ERRORS):
                res.saw(type(value).__name__)
                _nothing_left(res, n2, key)
            else:
                res.corrupted += 1
                res.notes.append(f"untyped: {value!r}")
            n1.stop()
            n1.start()
            state, value = bounded(lambda k=key: c2.consume(k, timeout=30), 30 + HANG_MARGIN)
            if state == "ok" and _consumed_ok(res, value, want):  # type: ignore[arg-type]
                res.saw("consumed and verified once the server is back")
            elif state == "hang":
                res.hangs += 1
            else:
                res.lost += 1
                res.notes.append(f"after restart: {value!r}")
            c2.delete(key)
        c1.close()
        c2.close()
    return res


# ------------------------------------------------------------------ Redis restarted mid-run
class PersistentRedis:
    """A redis-server with an append-only file fsynced on every write (records survive)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PersistentRedis:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "",
             "--protected-mode", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", self.port), timeout=0.2):
                return self
            time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def case_redis_restart(work: Path, trials: int, seed: int = 8) -> CaseResult:
    """Redis (append-only file, fsync always) is stopped (SIGTERM, or SIGKILL on odd trials)
    and restarted while a consumer waits and a producer publishes.

    Checks: a record published before the restart is still consumable after it; a consumer
    waiting across the restart gets the key published after it; producers' publications
    during the outage are retried (or fail with a typed error: then nothing is published).
    """
    res = CaseResult("Redis restarted mid-run")
    redis = PersistentRedis(work / "redis-aof").start()
    try:
        with timed(res), nodes(work / "rrestart", 2, redis.url) as (n1, n2):
            c1, c2 = n1.client(), n2.client()
            for t in range(trials):
                res.trials += 1
                before, after = f"r/t{t}-before.bin", f"r/t{t}-after.bin"
                d_before, d_after = payload(seed + 2 * t, 100_000), payload(seed + 2 * t + 1, 100_000)
                _publish(c1, before, d_before)
                box: dict[str, object] = {}
                th = threading.Thread(target=lambda k=after, box=box: box.update(r=bounded(
                    lambda: c2.consume(k, timeout=30), 30 + HANG_MARGIN)), daemon=True)
                th.start()
                time.sleep(0.3)
                redis.stop(signal.SIGKILL if t % 2 else signal.SIGTERM)
                time.sleep(0.5)
                redis.start()
                try:
                    _publish(c1, after, d_after)
                except Exception as exc:  # noqa: BLE001 - a typed failure is acceptable here
                    res.saw(f"publish during outage: {type(exc).__name__}")
                    _publish(c1, after, d_after)
                th.join(40 + HANG_MARGIN)
                state, value = box.get("r", ("hang", None))  # type: ignore[misc]
                if state == "hang":
                    res.hangs += 1
                elif state == "ok" and _consumed_ok(res, value, digest(d_after)):  # type: ignore[arg-type]
                    res.saw("waiter survived the restart and got the new key")
                else:
                    res.lost += 1
                    res.notes.append(f"waiter: {value!r}")
                state, value = bounded(lambda k=before: c2.consume(k, timeout=10), 10 + HANG_MARGIN)
                if state == "ok" and _consumed_ok(res, value, digest(d_before)):  # type: ignore[arg-type]
                    res.saw("record from before the restart persisted (AOF)")
                elif state == "hang":
                    res.hangs += 1
                else:
                    res.lost += 1
                    res.notes.append(f"before-key: {value!r}")
            c1.close()
            c2.close()
    finally:
        redis.stop()
    return res


# ------------------------------------------------------------------ bit flips
class FlippingProxy:
    """A TCP proxy that flips one bit of the server-to-client stream of armed connections."""

    def __init__(self, listen_port: int, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.sock = socket.create_server(("127.0.0.1", listen_port))
        self.armed_at: int | None = None  # offset in the next connection's reply stream
        #: (instead) offset in the body of the next connection's first reply, after its header
        self.armed_in_body: int | None = None
        self.flipped = 0
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            at, self.armed_at = self.armed_at, None
            body, self.armed_in_body = self.armed_in_body, None
            threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, at, body), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, flip_at: int | None,
              in_body: int | None = None) -> None:
        seen, prefix = 0, b""
        try:
            while True:
                chunk = src.recv(1 << 16)
                if not chunk:
                    break
                if in_body is not None and len(prefix) < 4:  # (the reply header's length)
                    prefix += chunk[: 4 - len(prefix)]
                    if len(prefix) == 4:
                        flip_at = 4 + wire.parse_length(prefix) + in_body
                if flip_at is not None and seen <= flip_at < seen + len(chunk):
                    buf = bytearray(chunk)
                    buf[flip_at - seen] ^= 0x10
                    chunk = bytes(buf)
                    self.flipped += 1
                seen += len(chunk)
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self._stop = True
        self.sock.close()


def _stream_frame(client: Client, name: str, natoms: int, seed: int) -> tuple[str, bytes]:
    """Publish one frame of a new stream ``name`` (its record: the frame's own header checksum,
    ``isf:``); return its key and its file's bytes."""
    positions = np.random.default_rng(seed).random((natoms, 3)) * 50.0
    with Stream(name, mode="w", layout="paper", client=client) as s:
        s.append(positions)
        key = s.frame_key(0)
    record = client.lookup(key)
    assert record is not None and record.checksum.startswith(FRAME_CHECKSUM), record
    return key, (client.root / key).read_bytes()


def case_bitflip(work: Path, trials: int, seed: int = 9) -> CaseResult:
    """A bit flips in a staged file or a stream's frame: in the owner's file at rest or in
    transit through a proxy. Trials take turns: a file at rest, a file in transit, a frame at
    rest, a frame in transit. A frame's record is its header's own checksum (``isf:``): its
    trials flip the frame's header and its coordinates in turn (header at rest, coordinates in
    transit, then the other way round). Consumed with ``Client.consume``.

    Checks: the consumer raises ``IntegrityError`` (or, for a flip in the reply header, a
    typed transfer error) and stores nothing; the consume after the owner repairs its copy
    (a file re-published, a frame's byte put back: its ``isf:`` record stays) or through a
    clean connection (in transit) verifies.
    """
    res = CaseResult("bit flip in a staged frame")
    rng = random.Random(seed)
    size = 1 << 20
    natoms = size // 28  # (a frame of about the files' size: 28 bytes per atom)
    with timed(res), nodes(work / "bitflip", 2) as (n1, n2):
        n3 = LoopbackNode(work / "bitflip", 3, n1.env["INSTRIDE_REDIS_URL"], TOKEN)
        real = free_port()
        proxy = FlippingProxy(n3.port, real)  # the address n3 advertises is the proxy's
        n3.start("--listen", f"127.0.0.1:{real}")
        c1, c2, c3 = n1.client(), n2.client(), n3.client()
        try:
            for t in range(trials):
                res.trials += 1
                at_rest, frame = t % 2 == 0, t % 4 >= 2
                in_header = frame and (t // 4 + t) % 2 == 0
                owner = c1 if at_rest else c3
                if frame:
                    key, data = _stream_frame(owner, f"flipf/t{t}", natoms, seed * 1000 + t)
                else:
                    data = payload(seed * 1000 + t, size)
                    key = f"flip/t{t}.bin"
                    _publish(owner, key, data)
                # (a frame's header, its coordinates, or anywhere in a file at rest; a file in
                # transit: the proxy's own count of the bytes it passes, below)
                off = rng.randrange(HEADER_SIZE) if in_header else \
                    rng.randrange(HEADER_SIZE if frame else 0, len(data)) if at_rest or frame else 0
                flipped = proxy.flipped
                if at_rest:
                    with open(n1.dir / key, "r+b") as fh:
                        fh.seek(off)
                        byte = fh.read(1)[0]
                        fh.seek(off)
                        fh.write(bytes([byte ^ (1 << rng.randrange(8))]))
                else:
                    c2.close()  # a fresh connection, through the proxy's armed path
                    if frame:
                        proxy.armed_in_body = off
                    else:
                        proxy.armed_at = rng.randrange(100, len(data))
                state, value = bounded(lambda k=key: c2.consume(k, timeout=20), 20 + HANG_MARGIN)
                if state == "hang":
                    res.hangs += 1
                elif state == "ok":
                    res.corrupted += 1  # a flipped file must never verify
                    res.notes.append(f"trial {t}: flipped bytes accepted")
                elif isinstance(value, (IntegrityError, TransferError, PeerUnavailable)):
                    where = "at rest" if at_rest else "in transit"
                    what = ("frame header " if in_header else "frame coordinates ") if frame else ""
                    res.saw(f"{type(value).__name__} ({what}{where})")
                    _nothing_left(res, n2, key)
                else:
                    res.corrupted += 1
                    res.notes.append(f"trial {t}: untyped {value!r}")
                if not at_rest and proxy.flipped == flipped:
                    res.corrupted += 1  # (not the trial it says it is)
                    res.notes.append(f"trial {t}: the proxy flipped nothing")
                if at_rest and frame:  # the owner repairs its copy (its isf: record stays)
                    with open(n1.dir / key, "r+b") as fh:
                        fh.seek(off)
                        fh.write(data[off:off + 1])
                elif at_rest:
                    _publish(c1, key, data, overwrite=True)
                state, value = bounded(lambda k=key: c2.consume(k, timeout=20), 20 + HANG_MARGIN)
                if state == "ok" and _consumed_ok(res, value, digest(data)):  # type: ignore[arg-type]
                    res.saw("refetched and verified after the flip")
                elif state == "hang":
                    res.hangs += 1
                else:
                    res.lost += 1
                    res.notes.append(f"trial {t}: refetch failed: {value!r}")
        finally:
            for c in (c1, c2, c3):
                c.close()
            n3.stop(signal.SIGKILL)
            proxy.close()
    return res


# ------------------------------------------------------------------ tokens
def _raw_exchange(port: int, payload_bytes: bytes, timeout: float = 10.0) -> tuple[dict, bytes]:
    """Send ``payload_bytes``, half-close, read the reply header and everything after it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload_bytes)
        try:
            s.shutdown(socket.SHUT_WR)
        except OSError as exc:  # the server answered and closed before we were done sending
            if exc.errno != errno.ENOTCONN:
                raise
            raise ConnectionResetError(exc.errno, "closed by the server") from None
        data = b""
        while True:
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            data += chunk
    if len(data) < 4:
        return {}, data
    (n,) = struct.unpack(">I", data[:4])
    try:
        return json.loads(data[4:4 + n]), data[4 + n:]
    except ValueError:
        return {"unparsable": True}, data


def case_tokens(work: Path, trials: int, seed: int = 10) -> CaseResult:
    """Consumers with a wrong or a missing job token, and a captured request sent again.

    Checks: ``AuthenticationError`` each time, nothing stored; a replayed request (same
    nonce) gets an ``AuthenticationError`` reply and no bytes.
    """
    res = CaseResult("wrong, missing and replayed tokens")
    data = payload(seed, 50_000)
    with timed(res), nodes(work / "tokens", 2) as (n1, n2):
        c1 = n1.client()
        for t in range(trials):
            key = f"tok/t{t}.bin"
            _publish(c1, key, data)
            for label, token in (("wrong token", "not-the-token"), ("missing token", None)):
                res.trials += 1
                bad = Client(n2.settings().with_(token=token))
                state, value = bounded(lambda k=key, b=bad: b.consume(k, timeout=10), 10 + HANG_MARGIN)
                bad.close()
                if state == "hang":
                    res.hangs += 1
                elif isinstance(value, AuthenticationError):
                    res.saw(f"AuthenticationError ({label})")
                    _nothing_left(res, n2, key)
                else:
                    res.corrupted += 1
                    res.notes.append(f"{label}: {state} {value!r}")
            res.trials += 1
            request = wire.pack(wire.sign(TOKEN, "fetch", key))
            first, body = _raw_exchange(n1.port, request)
            again, body2 = _raw_exchange(n1.port, request)
            if first.get("ok") and digest(body) == digest(data):
                res.saw("original request served")
            else:
                res.notes.append(f"original request: {first}")
            if again.get("error") == "AuthenticationError" and not body2:
                res.saw("AuthenticationError (replayed request)")
            else:
                res.corrupted += 1
                res.notes.append(f"replay answered {again} with {len(body2)} bytes")
        c1.close()
    return res


# ------------------------------------------------------------------ stalled peer
def case_stalled_peer(work: Path, trials: int, seed: int = 11) -> CaseResult:
    """A peer requests a 64 MiB file and stops reading; others keep fetching meanwhile.

    Checks: the other consumers are served and verify; the server drops the stalled
    connection after its send deadline (``--send-timeout 1`` + size / 50 MB/s).
    """
    res = CaseResult("slow (stalled) consumer at the data server")
    big = payload(seed, 64 << 20)
    small = payload(seed + 1, 200_000)
    with timed(res), nodes(work / "stall", 2) as (n1, n2):
        n1.stop()
        n1.start("--send-timeout", "1")
        c1, c2 = n1.client(), n2.client()
        _publish(c1, "stall/big.bin", big)
        for t in range(trials):
            res.trials += 1
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", n1.port))
            s.sendall(wire.pack(wire.sign(TOKEN, "fetch", "stall/big.bin")))
            key = f"stall/t{t}.bin"
            _publish(c1, key, small)
            state, value = bounded(lambda k=key: c2.consume(k, timeout=20), 20 + HANG_MARGIN)
            if state == "ok" and _consumed_ok(res, value, digest(small)):  # type: ignore[arg-type]
                res.saw("other consumers served while one peer stalls")
            elif state == "hang":
                res.hangs += 1
            else:
                res.lost += 1
                res.notes.append(f"consumer beside the stalled peer: {value!r}")
            time.sleep(1 + (64 << 20) / 50e6 + 1.0)  # past the server's send deadline
            got, dropped = 0, False
            s.settimeout(5)
            try:
                while True:  # what is left is what the server had sent before giving up
                    chunk = s.recv(1 << 20)
                    if not chunk:
                        dropped = got < (64 << 20)
                        break
                    got += len(chunk)
            except (ConnectionResetError, BrokenPipeError):
                dropped = True
            except TimeoutError:
                dropped = False
            s.close()
            if dropped:
                res.saw("stalled connection dropped by the server's send deadline")
            else:
                res.hangs += 1
                res.notes.append("the stalled connection was never dropped")
        c1.close()
        c2.close()
    return res


# ------------------------------------------------------------------ wire protocol fuzzed
_SECRET = b"OUTSIDE-SECRET-7f3a"
_KEYS = ["fz/ok.bin", "fz//ok.bin", "./fz/ok.bin", "../secret", "/etc/passwd", "fz/link/secret",
         "fz/lnk", "fz/dir", "fz/fifo", "fz/", "", "a\x00b", ".instride/node.sock", "x" * 5000,
         "\ud800", "fz/../../secret", "fz/missing.bin", "\u00e9t\u00e9/k", 7, None, ["fz/ok.bin"]]
_OPS = ["fetch", "ping", "FETCH", "put", "", "fetch\n", 3]


def _fuzz_message(rng: random.Random) -> tuple[str, bytes]:
    kind = rng.randrange(8)
    if kind == 0:
        return "random bytes", rng.randbytes(rng.randrange(0, 48))
    if kind == 1:
        body = rng.randbytes(rng.randrange(1, 200))
        return "random body", struct.pack(">I", len(body)) + body
    if kind == 2:
        n = rng.choice([0, wire.MAX_HEADER + 1, 2**32 - 1, rng.randrange(2**31)])
        return "length out of range", struct.pack(">I", n) + rng.randbytes(rng.randrange(0, 16))
    if kind == 3:
        return "truncated prefix", rng.randbytes(rng.randrange(1, 4))
    if kind == 4:  # JSON of random shape, unsigned or badly signed
        fields: dict[str, object] = {}
        for name in rng.sample(["v", "op", "key", "nonce", "ts", "mac", "version", "x"],
                               rng.randrange(0, 8)):
            fields[name] = rng.choice([None, 0, -1, 1e308, "a" * rng.randrange(100), [], {},
                                       True, "0" * 64, float("nan") if rng.random() < 0.1 else 1.5,
                                       time.time(), "f" * 64])
        try:
            body = json.dumps(fields).encode()
        except ValueError:
            body = b"{}"
        return "malformed fields", struct.pack(">I", len(body)) + body
    if kind == 5:  # properly signed, hostile key or op
        key = rng.choice(_KEYS)
        op = rng.choice(_OPS)
        try:
            header = wire.sign(TOKEN, op, key)  # type: ignore[arg-type]
        except (UnicodeEncodeError, TypeError, AttributeError):
            header = wire.sign(TOKEN, "fetch", "fz/ok.bin")
            header.update(key=key, op=op)
        try:
            return "signed hostile key", wire.pack(header)
        except (wire.WireError, UnicodeEncodeError, ValueError):
            return "signed hostile key", struct.pack(">I", 2) + b"{}"
    if kind == 6:  # valid signature, one field changed afterwards
        header = wire.sign(TOKEN, "fetch", "fz/ok.bin")
        field = rng.choice(["key", "nonce", "ts", "mac", "op"])
        header[field] = {"key": "fz/lnk", "nonce": "00", "ts": header["ts"] - 1000,
                         "mac": "0" * 64, "op": "ping"}[field]
        return "tampered signed request", wire.pack(header)
    return "valid fetch", wire.pack(wire.sign(TOKEN, "fetch", "fz/ok.bin"))


def case_wire_fuzz(work: Path, trials: int, seed: int = 12, threads: int = 4) -> CaseResult:
    """``trials`` generated messages against a real data server (TCP), plus one line in ten of
    that count against its Unix socket.

    Checks: every message gets an error reply or a clean close, never bytes of anything but
    the one published key (``fz/ok.bin``, exact), never the secret outside the managed
    directory; no reply takes longer than 10 s; the server never logs an unexpected error and
    still answers at the end.
    """
    res = CaseResult("wire protocol fuzzed")
    ok_data = payload(seed, 3000)
    with timed(res), nodes(work / "fuzz", 1) as (n1,):
        n1.stop()  # "CONSUME -5" waits for the server's default: make it 1 s, not forever
        n1.env["INSTRIDE_TIMEOUT"] = "1"
        n1.start()
        c1 = n1.client()
        _publish(c1, "fz/ok.bin", ok_data)
        outside = work / "fuzz" / "outside"
        outside.mkdir(parents=True, exist_ok=True)
        (outside / "secret").write_bytes(_SECRET)
        (work / "fuzz" / "secret").write_bytes(_SECRET)
        (n1.dir / "fz" / "link").symlink_to(outside)
        (n1.dir / "fz" / "lnk").symlink_to(outside / "secret")
        (n1.dir / "fz" / "dir").mkdir()
        os.mkfifo(n1.dir / "fz" / "fifo")
        lock = threading.Lock()
        per_thread = trials // threads

        def worker(index: int) -> None:
            rng = random.Random(seed * 7919 + index)
            local = CaseResult("part")
            for _ in range(per_thread):
                kind, msg = _fuzz_message(rng)
                local.trials += 1
                try:
                    reply, body = _raw_exchange(n1.port, msg, timeout=10)
                except TimeoutError:
                    local.hangs += 1
                    local.notes.append(f"no reply within 10 s to {kind}: {msg[:120]!r}")
                    continue
                except ConnectionResetError:
                    local.saw("connection reset")
                    continue
                if _SECRET in body:
                    local.corrupted += 1
                if reply.get("ok") and "size" in reply:
                    if reply.get("key") != "fz/ok.bin" or body != ok_data:
                        local.corrupted += 1
                    else:
                        local.saw("served the published key exactly")
                elif reply.get("ok"):
                    local.saw("ping answered")
                elif reply.get("error"):
                    local.saw(f"{reply['error']} reply")
                    if body:
                        local.corrupted += 1
                else:
                    local.saw("closed without reply" if not reply else "unparsable reply")
            with lock:
                res.trials += local.trials
                res.hangs += local.hangs
                res.corrupted += local.corrupted
                res.outcomes.update(local.outcomes)
                res.notes.extend(local.notes[:5])

        pool = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join()
        # the Unix-socket protocol: random lines, many per connection
        rng = random.Random(seed)
        verbs = ["CONSUME", "PUBLISH", "OVERWRITE", "PING", "STATS", "consume", "", "X" * 50]
        sock_path = str(n1.dir / ".instride" / "node.sock")
        lines = max(100, trials // 10)
        sent = 0
        while sent < lines:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(10)
                s.connect(sock_path)
                f = s.makefile("rwb")
                for _ in range(100):
                    verb = rng.choice(verbs)
                    key = rng.choice([k for k in _KEYS if isinstance(k, str)]).replace("\x00", "")
                    arg = (f"{rng.choice(['0', '-5', 'x', '10', '1e3', '-0'])} {key}"
                           if verb == "CONSUME" else key)
                    line = f"{verb} {arg}".encode("utf-8", "replace")[:3000]
                    f.write(line.replace(b"\n", b" ") + b"\n")
                    f.flush()
                    sent += 1
                    res.trials += 1
                    try:
                        reply = f.readline()
                    except TimeoutError:
                        res.hangs += 1
                        res.notes.append(f"unix: no reply within 10 s to {line[:120]!r}")
                        break
                    if _SECRET in reply:
                        res.corrupted += 1
                    if reply.startswith(b"OK ") or reply.startswith(b"ERR "):
                        res.saw(f"unix {reply.split()[0].decode()} reply")
                    else:
                        res.corrupted += 1
                        res.notes.append(f"unix reply {reply[:80]!r} to {line[:80]!r}")
                        break
        with socket.create_connection(("127.0.0.1", n1.port), timeout=10) as s:
            s.sendall(wire.pack(wire.sign(TOKEN, "ping", "")))
            alive = s.recv(100)
        if b'"ok":true' not in alive:
            res.hangs += 1
            res.notes.append("server does not answer after the fuzz")
        log = n1.log.read_text()
        if "Traceback" in log or "unexpected error" in log:
            res.corrupted += 1
            res.notes.append("server logged an unexpected error: " + log[-1500:])
        c1.close()
    return res


# ------------------------------------------------------------------ paths through the cluster
def case_paths_cluster(work: Path, trials: int = 1, seed: int = 13) -> CaseResult:
    """Traversal and symbolic links through the data server (TCP, signed requests), its Unix
    socket, and cluster-mode consumers whose own directory holds a link where the owner has
    a directory.

    Checks: error replies and typed errors; never a byte from outside; nothing written
    outside the consumer's managed directory.
    """
    res = CaseResult("path traversal and symlinks (data server, cluster consumers)")
    with timed(res), nodes(work / "cpaths", 2) as (n1, n2):
        outside = work / "cpaths" / "outside"
        outside.mkdir(parents=True, exist_ok=True)
        (outside / "secret").write_bytes(_SECRET)
        c1, c2 = n1.client(), n2.client()
        _publish(c1, "s/link/data.bin", payload(seed, 1000))  # a real directory on node1
        (n1.dir / "lnk").symlink_to(outside / "secret")
        (n1.dir / "adir").mkdir()
        (n2.dir / "s").mkdir(parents=True, exist_ok=True)
        (n2.dir / "s" / "link").symlink_to(outside)  # node2: the same path is a link
        before = sorted(p.name for p in outside.iterdir())
        for _ in range(trials):
            for key in ("../secret", "/etc/passwd", str(outside / "secret"), "lnk", "adir",
                        "lnk/", "s/../../outside/secret"):
                res.trials += 1
                reply, body = _raw_exchange(n1.port, wire.pack(wire.sign(TOKEN, "fetch", key)))
                if not reply.get("ok") and not body:
                    res.saw(f"server: {reply.get('error')} reply")
                else:
                    res.corrupted += 1
                    res.notes.append(f"server served {key!r}: {reply}")
            for line in ("CONSUME 0 lnk", "CONSUME 0 ../secret", "PUBLISH lnk", "PUBLISH adir",
                         "CONSUME 0 adir", "OVERWRITE lnk"):
                res.trials += 1
                with socket.socket(socket.AF_UNIX) as s:
                    s.settimeout(10)
                    s.connect(str(n1.dir / ".instride" / "node.sock"))
                    s.sendall(line.encode() + b"\n")
                    reply = s.makefile("rb").readline()
                if reply.startswith(b"ERR ") and _SECRET not in reply:
                    res.saw("unix socket: ERR reply")
                else:
                    res.corrupted += 1
                    res.notes.append(f"{line!r} -> {reply!r}")
            res.trials += 1
            state, value = bounded(lambda: c2.consume("s/link/data.bin", timeout=5), 5 + HANG_MARGIN)
            if isinstance(value, UnsafePathError):
                res.saw("cluster consumer: UnsafePathError before any fetch")
            else:
                res.corrupted += 1
                res.notes.append(f"cluster consume through a link: {state} {value!r}")
            res.trials += 1
            state, value = bounded(lambda: c2.consume("lnk", timeout=5), 5 + HANG_MARGIN)
            if isinstance(value, (ConsumeTimeout, KeyValidationError, FileTypeError,
                                  UnsafePathError)):
                res.saw(f"cluster consumer of an unpublished link: {type(value).__name__}")
            else:
                res.corrupted += 1
                res.notes.append(f"consume lnk: {state} {value!r}")
        if sorted(p.name for p in outside.iterdir()) != before:
            res.corrupted += 1
            res.notes.append(f"outside changed: {sorted(p.name for p in outside.iterdir())}")
        c1.close()
        c2.close()
    return res
