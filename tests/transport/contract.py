"""The transport contract every transport passes (run by test_tcp.py, and by each new one).

A transport's test module subclasses :class:`TransportContract`, sets ``name`` (its registry
name) and provides a ``dying_owner`` fixture: a callable ``(body, cut) -> owner address`` that
starts a process speaking the transport's protocol which accepts one fetch, sends a valid reply
announcing ``len(body)`` bytes, sends the first ``cut`` bytes of ``body`` and then dies
(SIGKILL). Everything else runs against the transport's real server half, started by name
(:func:`instride.transport.get_server`) in a child process, and its real client half
(:func:`instride.transport.get_transport`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from instride.client import Client
from instride.config import Settings
from instride.errors import (
    AuthenticationError,
    IntegrityError,
    KeyNotFoundError,
    PeerUnavailable,
    TransferError,
)
from instride.frames import encode_frame, header_checksum
from instride.record import Record, checksum_of, frame_checksum
from instride.transport import Transport, TransportServer, get_transport
from tests.conftest import free_port, stop_process, wait_ready

TOKEN = "contract-token"
DyingOwner = Callable[[bytes, int], str]

_SERVE = """
import asyncio, sys
from instride.config import Settings
from instride.transport import get_server

async def main():
    server = get_server(sys.argv[1], Settings.from_env(), request_timeout=5.0, send_timeout=5.0)
    await server.start()
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def _frame_bytes(seed: int) -> bytes:
    """A frame file's bytes (paper layout, 5,000 atoms)."""
    pos = np.random.default_rng(seed).random((5_000, 3))
    header, payload = encode_frame(pos, step=seed, layout="paper")
    return bytes(header) + bytes(payload)


class Owner:
    """A node's managed directory served by the transport's real server half (a child process)."""

    def __init__(self, root: Path, name: str, addr: str | None = None) -> None:
        self.dir = root / "owner"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.addr = addr or f"127.0.0.1:{free_port()}"
        self.env = {**os.environ, "INSTRIDE_DIR": str(self.dir), "INSTRIDE_ADDR": self.addr,
                    "INSTRIDE_TOKEN": TOKEN, "INSTRIDE_TRANSPORT": name, "INSTRIDE_NODE": "owner"}
        self.env.pop("INSTRIDE_REDIS_URL", None)
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVE, name], env=self.env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if not wait_ready(self.proc):
            if self.proc.poll() is None:
                self.proc.kill()
            assert self.proc.stderr is not None
            err = self.proc.stderr.read()  # before stop() closes the pipes
            self.stop()
            raise RuntimeError(f"{name} server half did not start: {err[-3000:]!r}")

    def put(self, key: str, data: bytes) -> Record:
        """Publish ``data`` under ``key`` on the owner node; return its cluster record."""
        client = Client(Settings.from_env(self.env))
        with client.open(key, "wb") as fh:
            fh.write(data)
        return Record(key=key, owner=self.addr, size=len(data), checksum=checksum_of(data),
                      version=1, time=time.time(), node="owner")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # by its PID; also ends a stopped (SIGSTOP) process
        self.proc.wait(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


class TransportContract:
    """Transfer, integrity, peer death, authentication and timeouts, for one transport."""

    #: the transport's registry name
    name: str

    @pytest.fixture
    def owner(self, tmp_path: Path) -> Iterator[Owner]:
        node = Owner(tmp_path, self.name)
        yield node
        node.stop()

    @pytest.fixture
    def consumer(self, tmp_path: Path) -> Iterator[Transport]:
        transport = get_transport(self.name, self.consumer_settings(tmp_path))
        yield transport
        transport.close()

    def consumer_settings(self, tmp_path: Path, token: str = TOKEN) -> Settings:
        return Settings(dir=tmp_path / "consumer", token=token, connect_timeout=1.0,
                        transport=self.name, node="consumer")

    # ------------------------------------------------------------------ registry
    def test_both_halves_are_found_by_name(self, consumer: Transport, tmp_path: Path) -> None:
        assert isinstance(consumer, Transport) and consumer.name == self.name
        server = type(consumer).server_class()(self.consumer_settings(tmp_path), max_peers=4,
                                              request_timeout=1.0, send_timeout=1.0)
        assert isinstance(server, TransportServer)

    # ------------------------------------------------------------------ transfer
    @pytest.mark.parametrize("size", [0, 1, 3 << 20])
    def test_fetch_transfers_the_exact_bytes(self, owner: Owner, consumer: Transport, tmp_path: Path,
                                             size: int) -> None:
        data = os.urandom(size)
        record = owner.put(f"t/{size}.bin", data)
        dest = tmp_path / f"got-{size}.bin"
        consumer.fetch(record, dest)
        assert dest.read_bytes() == data
        assert bytes(consumer.fetch_bytes(record)) == data
        consumer.fetch(record, tmp_path / f"again-{size}.bin")  # a kept-alive connection, reused
        assert (tmp_path / f"again-{size}.bin").read_bytes() == data

    def test_fetch_into_overwrites_an_existing_file_in_place(self, owner: Owner, consumer: Transport,
                                                              tmp_path: Path) -> None:
        """``fetch_into`` writes into a given (recycled) file from its offset, verified; a
        corrupted body raises and the caller discards the file."""
        data = os.urandom(700_000)
        record = owner.put("t/into.bin", data)
        dest = tmp_path / "recycled.bin"
        dest.write_bytes(b"old frame " * 70_000)
        ino = dest.stat().st_ino
        fd = os.open(dest, os.O_WRONLY)
        try:
            consumer.fetch_into(record, fd)
        finally:
            os.close(fd)
        assert dest.read_bytes() == data and dest.stat().st_ino == ino
        flipped = bytearray(data)
        flipped[123] ^= 1
        (owner.dir / "t" / "into.bin").write_bytes(flipped)
        fd = os.open(dest, os.O_WRONLY)
        try:
            with pytest.raises(IntegrityError, match="checksum"):
                consumer.fetch_into(record, fd)
        finally:
            os.close(fd)

    def test_concurrent_fetches_are_all_exact(self, owner: Owner, consumer: Transport,
                                              tmp_path: Path) -> None:
        """Many fetches at once (one large, several small, from threads) all arrive verified."""
        sizes = [8 << 20] + [100_000] * 7
        records = [(owner.put(f"t/many-{i}.bin", data), data)
                   for i, data in enumerate(os.urandom(n) for n in sizes)]

        def fetch(item: tuple[Record, bytes]) -> bool:
            record, data = item
            dest = tmp_path / f"many-{record.key.rsplit('/', 1)[1]}"
            consumer.fetch(record, dest)
            return dest.read_bytes() == data

        with ThreadPoolExecutor(len(records)) as pool:
            assert all(pool.map(fetch, records))

    # ------------------------------------------------------------------ integrity
    def test_wrong_checksum_in_record_is_integrity_error(self, owner: Owner, consumer: Transport,
                                                         tmp_path: Path) -> None:
        record = owner.put("t/sum.bin", b"the real bytes")
        forged = Record(**{**record.__dict__, "checksum": checksum_of(b"other bytes!!!")})
        dest = tmp_path / "sum.bin"
        with pytest.raises(IntegrityError):
            consumer.fetch(forged, dest)
        assert not dest.exists()
        with pytest.raises(IntegrityError):
            consumer.fetch_bytes(forged)

    def test_corrupted_bytes_are_integrity_error(self, owner: Owner, consumer: Transport,
                                                 tmp_path: Path) -> None:
        data = os.urandom(100_000)
        record = owner.put("t/flip.bin", data)
        flipped = bytearray(data)
        flipped[50_000] ^= 0xFF
        (owner.dir / "t" / "flip.bin").write_bytes(flipped)  # corrupted at rest, same size
        dest = tmp_path / "flip.bin"
        with pytest.raises(IntegrityError, match="checksum"):
            consumer.fetch(record, dest)
        assert not dest.exists()
        assert list(tmp_path.glob("*flip*")) == []

    def test_a_frame_is_verified_by_its_own_header_checksum(self, owner: Owner, consumer: Transport,
                                                             tmp_path: Path) -> None:
        """A stream's frame carries an ``isf:`` record (its header checksum): fetched into a
        file and into memory it passes; a byte flipped at rest in its header or its payload,
        or a record naming another frame, is an IntegrityError that leaves no file."""
        frame = _frame_bytes(1)
        record = owner.put("t/frame_000000001.isf", frame)
        record = Record(**{**record.__dict__, "checksum": frame_checksum(header_checksum(frame))})
        dest = tmp_path / "frame.isf"
        consumer.fetch(record, dest)
        assert dest.read_bytes() == frame
        assert bytes(consumer.fetch_bytes(record)) == frame
        other = Record(**{**record.__dict__,
                          "checksum": frame_checksum(header_checksum(_frame_bytes(2)))})
        with pytest.raises(IntegrityError, match="differs from the record"):
            consumer.fetch(other, tmp_path / "other.isf")
        assert not (tmp_path / "other.isf").exists()
        with pytest.raises(IntegrityError, match="differs from the record"):
            consumer.fetch_bytes(other)
        for where, why in [(20, "header checksum mismatch"), (len(frame) - 3, "payload checksum")]:
            bad = bytearray(frame)
            bad[where] ^= 0x10
            (owner.dir / "t" / "frame_000000001.isf").write_bytes(bad)  # at rest, same size
            dest = tmp_path / f"bad-{where}.isf"
            with pytest.raises(IntegrityError, match=why):
                consumer.fetch(record, dest)
            assert not dest.exists()
            with pytest.raises(IntegrityError, match=why):
                consumer.fetch_bytes(record)

    def test_a_fetch_is_counted_as_a_receive(self, owner: Owner, consumer: Transport,
                                             tmp_path: Path) -> None:
        """A fetch's receive is counted while it is under way and stamps its end (the helper
        making a file ahead waits for both: instride.store.spare)."""
        from instride.native import RECEIVING

        record = owner.put("t/counted.bin", os.urandom(300_000))
        consumer.fetch(record, tmp_path / "first.bin")  # (the engine loaded: the count handed to it)
        before = RECEIVING[1]
        consumer.fetch(record, tmp_path / "counted.bin")
        assert RECEIVING[0] == 0 and RECEIVING[1] > before
        before = RECEIVING[1]
        assert len(consumer.fetch_bytes(record)) == record.size  # (into memory: counted too)
        assert RECEIVING[0] == 0 and RECEIVING[1] > before

    def test_size_differing_from_record_is_integrity_error(self, owner: Owner, consumer: Transport,
                                                           tmp_path: Path) -> None:
        record = owner.put("t/size.bin", b"12345")
        dest = tmp_path / "size.bin"
        with pytest.raises(IntegrityError):
            consumer.fetch(Record(**{**record.__dict__, "size": 6}), dest)
        assert not dest.exists()

    def test_missing_key_is_key_not_found(self, owner: Owner, consumer: Transport,
                                          tmp_path: Path) -> None:
        record = Record("t/absent.bin", owner.addr, 3, checksum_of(b"abc"), 1, time.time(), "owner")
        dest = tmp_path / "absent.bin"
        with pytest.raises(KeyNotFoundError):
            consumer.fetch(record, dest)
        assert not dest.exists()

    # ------------------------------------------------------------------ authentication
    @pytest.mark.parametrize("token", ["wrong-token", ""])
    def test_wrong_token_is_authentication_error(self, owner: Owner, tmp_path: Path, token: str) -> None:
        record = owner.put("t/secret.bin", b"secret")
        thief = get_transport(self.name, self.consumer_settings(tmp_path).with_(token=token or None))
        dest = tmp_path / "stolen.bin"
        try:
            with pytest.raises(AuthenticationError):
                thief.fetch(record, dest)
            with pytest.raises(AuthenticationError):
                thief.fetch_bytes(record)
        finally:
            thief.close()
        assert not dest.exists()

    # ------------------------------------------------------------------ peer death, timeouts
    def test_dead_owner_is_peer_unavailable(self, owner: Owner, consumer: Transport,
                                            tmp_path: Path) -> None:
        record = owner.put("t/dead.bin", b"gone with its node")
        consumer.fetch(record, tmp_path / "first.bin")  # a kept-alive connection to a live owner
        owner.proc.kill()
        owner.proc.wait(10)
        dest = tmp_path / "dead.bin"
        start = time.monotonic()
        with pytest.raises(PeerUnavailable):
            consumer.fetch(record, dest)
        assert time.monotonic() - start < 10
        assert not dest.exists()

    def test_owner_dying_mid_transfer_leaves_nothing(self, dying_owner: DyingOwner, consumer: Transport,
                                                     tmp_path: Path) -> None:
        body = os.urandom(1 << 20)
        addr = dying_owner(body, len(body) // 3)
        record = Record("t/cut.bin", addr, len(body), checksum_of(body), 1, time.time(), "dying")
        dest = tmp_path / "cut.bin"
        with pytest.raises((TransferError, PeerUnavailable)):
            consumer.fetch(record, dest)
        assert not dest.exists()
        with pytest.raises((TransferError, PeerUnavailable)):
            consumer.fetch_bytes(Record(**{**record.__dict__, "owner": dying_owner(body, 1000)}))

    def test_silent_owner_times_out(self, owner: Owner, consumer: Transport, tmp_path: Path) -> None:
        record = owner.put("t/silent.bin", os.urandom(1000))
        stop_process(owner.proc.pid)  # alive (the kernel accepts), never answers
        dest = tmp_path / "silent.bin"
        start = time.monotonic()
        try:
            with pytest.raises((PeerUnavailable, TransferError)):
                consumer.fetch(record, dest)
            took = time.monotonic() - start
        finally:
            os.kill(owner.proc.pid, signal.SIGCONT)
        assert took < 1.0 + 5  # the consumer's connect timeout (1 s) bounds it, not forever
        assert not dest.exists()
        consumer.fetch(record, dest)  # the owner is back: a fresh connection works
        assert dest.stat().st_size == 1000
