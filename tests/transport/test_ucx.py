"""The UCX transport: the shared transport contract, UCX's own scenarios, selection by name,
and an end-to-end run of two emulated nodes whose ``instride serve`` speaks UCX.

* :class:`TestUcxContract` runs :class:`~tests.transport.contract.TransportContract` against
  the server half started by name (``get_server("ucx", ...)``) on one node;
* :class:`UcxScenarios` checks which carrier UCX chose and kills a peer while a body is on
  its way: on one node over shared memory (:class:`TestUcxSharedMemory`) and between emulated
  nodes over UCX's TCP transport (:class:`TestUcxAcrossNodes`), with a real
  ``python -m instride.transport.ucx`` server process;
* :func:`test_two_nodes_serve_over_ucx`: ``INSTRIDE_TRANSPORT=ucx`` for a whole emulated
  cluster (data servers, producer, consumer), keys and a stream, checksums verified.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import xxhash

from instride.config import Settings
from instride.errors import ConfigError, InstrideError, PeerUnavailable, TransferError
from instride.record import Record
from instride.transport import get_server, get_transport
from instride.transport import ucx as ucx_mod
from instride.transport.ucx import UcxServer, UcxTransport
from tests.conftest import free_port, stop_process
from tests.nodes import stats, until

from .contract import TransportContract, wait_ready

PY = sys.executable
TOKEN = "ucx-test-token"
#: seconds a fetch waits for a reply in these tests (INSTRIDE_CONNECT_TIMEOUT)
TIMEOUT = 1.5
#: sizes around UCX's protocol switches (short, eager copy, zero-copy, rendezvous)
SIZES = {"empty": 0, "one": 1, "small": 8185, "eager": 8193, "mid": 300_000, "big": 3_000_017}


def payload(name: str, size: int) -> bytes:
    return (name.encode() * (size // max(1, len(name)) + 1))[:size] if size < 64 else os.urandom(size)


def checksum(data: bytes) -> str:
    return "xxh3:" + xxhash.xxh3_64_hexdigest(data)


@dataclass
class Peer:
    """A UCX data server process serving ``dir``; ``owner`` is the record's owner address."""

    proc: subprocess.Popen
    dir: Path
    owner: str
    files: dict[str, bytes] = field(default_factory=dict)
    killed: bool = False

    def record(self, key: str, *, data: bytes | None = None, checksum_of: bytes | None = None) -> Record:
        data = self.files[key] if data is None else data
        return Record(key, self.owner, len(data), checksum(checksum_of if checksum_of is not None else data),
                      1, time.time(), "owner")

    def announced(self, timeout: float = 30) -> str:
        """The next ``reply KEY SIZE`` line the server printed (before handing a body to UCX)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("reply "):
                return line
            if not line:
                break
        raise AssertionError("the server announced no reply")

    def kill(self) -> None:
        """Kill the server (SIGKILL) and wait for it."""
        self.killed = True
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        """Stop the server with SIGTERM; unless the test killed it, it must exit cleanly."""
        hung = False
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                hung = True
                self.proc.kill()
                self.proc.wait()
        err = self.proc.stderr.read() if self.proc.stderr is not None else ""
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        if not self.killed:
            assert not hung and self.proc.returncode == 0, (self.proc.returncode, err[-2000:])


@dataclass
class Outcome:
    """What one fetch did: ``error`` is the exception's class name (``None`` on success)."""

    error: str | None
    bases: list[str]
    message: str
    digest: str | None
    dest_exists: bool
    elapsed: float
    info: str = ""


def _start_server(argv: list[str], env: dict[str, str], directory: Path, owner: str,
                  files: dict[str, bytes]) -> Peer:
    directory.mkdir(parents=True, exist_ok=True)
    for key, data in files.items():
        (directory / key).parent.mkdir(parents=True, exist_ok=True)
        (directory / key).write_bytes(data)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peer = Peer(proc, directory, owner, dict(files))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ready "):
        err = proc.stderr.read() if proc.stderr else ""
        peer.kill()
        peer.stop()
        raise AssertionError(f"UCX server did not start: {line!r} {err}")
    return peer


def run_fetch(transport: UcxTransport, record: Record, dest: Path | None) -> Outcome:
    """One fetch (to ``dest``, or into memory when ``None``) and what came of it."""
    t0 = time.monotonic()
    digest = None
    try:
        if dest is not None:
            transport.fetch(record, dest)
            digest = checksum(dest.read_bytes())
        else:
            digest = checksum(bytes(transport.fetch_bytes(record)))
        error, bases, message = None, [], ""
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error, bases, message = type(exc).__name__, [c.__name__ for c in type(exc).__mro__], str(exc)
    elapsed = time.monotonic() - t0
    return Outcome(error, bases, message, digest, dest is not None and dest.exists(), elapsed,
                   transport.endpoint_info(record))


CLIENT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from instride.config import Settings
    from instride.record import Record
    from instride.transport.ucx import UcxTransport
    sys.path.insert(0, sys.argv[2])
    from tests.transport.test_ucx import run_fetch
    spec = json.loads(sys.argv[1])
    transports = {}
    for op in spec["ops"]:
        t = transports.get(op["token"])
        if t is None:
            s = Settings(dir=Path(spec["dir"]), token=op["token"], connect_timeout=spec["timeout"],
                         fsync=False)
            t = transports[op["token"]] = UcxTransport(s)
        out = run_fetch(t, Record(**op["record"]), Path(op["dest"]) if op["dest"] else None)
        print(json.dumps(out.__dict__), flush=True)
    for t in transports.values():
        t.close()
    """
)


# ---------------------------------------------------------------------- the shared contract
_DYING = """
import os, signal, sys
from pathlib import Path
from instride.config import Settings
from instride.transport.ucx import UcxServer

class Dying(UcxServer):
    def _reply(self, handle, header, fd=-1, size=0):
        super()._reply(handle, header, fd, size)
        if size:  # the reply header is out, the body handed to UCX: die before it is taken
            os.kill(os.getpid(), signal.SIGKILL)

settings = Settings.from_env()
(settings.dir / "t").mkdir(parents=True, exist_ok=True)
(settings.dir / "t" / "cut.bin").write_bytes(Path(sys.argv[1]).read_bytes())
Dying(settings).open()
print("ready", flush=True)
signal.pause()
"""


class TestUcxContract(TransportContract):
    """The contract on one node (UCX picks shared memory), server half started by name."""

    name = "ucx"

    @pytest.fixture(autouse=True)
    def _one_node(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for var in ("UCX_TLS", "UCX_NET_DEVICES"):
            monkeypatch.delenv(var, raising=False)

    def test_owner_dying_mid_transfer_leaves_nothing(self, dying_owner: Any, consumer: Any,
                                                     tmp_path: Path) -> None:
        """UCX hands a reply's body to the wire as one message, so an owner that dies right
        after may or may not have got it out: either the consumer gets a typed error and
        nothing under the key, or the whole verified body — never a partial or wrong file.
        (Death in the middle of a body is forced, with a throttled link, in UcxScenarios.)"""
        body = os.urandom(1 << 20)
        addr = dying_owner(body, len(body) // 3)
        record = Record("t/cut.bin", addr, len(body), "xxh3:" + xxhash.xxh3_64_hexdigest(body), 1,
                        time.time(), "dying")
        dest = tmp_path / "cut.bin"
        try:
            consumer.fetch(record, dest)
        except (TransferError, PeerUnavailable):
            assert not dest.exists()
        else:
            assert dest.read_bytes() == body

    @pytest.fixture
    def dying_owner(self, tmp_path: Path) -> Iterator:
        """A UCX server that dies right after handing a reply's body to UCX.

        UCX sends a body as one message, so the cut cannot be placed at a byte: the consumer
        has the reply header (the body announced) when the owner dies, before the body came.
        """
        procs: list[subprocess.Popen] = []

        def start(body: bytes, cut: int) -> str:
            src = tmp_path / f"body-{len(procs)}.bin"
            src.write_bytes(body)
            addr = f"127.0.0.1:{free_port()}"
            env = dict(os.environ, INSTRIDE_DIR=str(tmp_path / f"dying-{len(procs)}"),
                       INSTRIDE_ADDR=addr, INSTRIDE_TOKEN="contract-token")
            proc = subprocess.Popen([PY, "-c", _DYING, str(src)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            procs.append(proc)
            assert wait_ready(proc), "the dying owner did not start"
            return addr

        yield start
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            assert proc.stdout is not None and proc.stderr is not None
            proc.stdout.close()
            proc.stderr.close()


# ---------------------------------------------------------------------- UCX's own scenarios
class UcxScenarios:
    """Transfers, integrity, peer death, authentication and timeouts where UCX is configured
    as a deployment would be, checking which carrier it chose.

    Subclasses implement :meth:`start_peer`, :meth:`fetch_all`, :meth:`client_dir` and
    :meth:`die_mid_transfer`, and set :attr:`lanes` (transport names UCX must have chosen).
    """

    #: UCX transports the endpoint must use, and must not use
    lanes: tuple[str, ...] = ()
    not_lanes: tuple[str, ...] = ()

    def start_peer(self, files: dict[str, bytes]) -> Peer:
        raise NotImplementedError

    def fetch_all(self, ops: list[tuple[Record, Path | None, str]]) -> list[Outcome]:
        raise NotImplementedError

    def client_dir(self) -> Path:
        raise NotImplementedError

    def die_mid_transfer(self, peer: Peer, record: Record, dest: Path) -> Outcome:
        raise NotImplementedError

    @pytest.fixture
    def peer(self) -> Iterator[Peer]:
        files = {f"run/{name}.bin": payload(name, size) for name, size in SIZES.items()}
        p = self.start_peer(files)
        try:
            yield p
        finally:
            p.stop()

    # ------------------------------------------------------------------ transfer
    def test_transfer(self, peer: Peer) -> None:
        out = self.client_dir()
        ops: list[tuple[Record, Path | None, str]] = []
        for key in peer.files:
            ops.append((peer.record(key), out / (key.replace("/", "_") + ".got"), TOKEN))
            ops.append((peer.record(key), None, TOKEN))
        results = self.fetch_all(ops)
        for (record, dest, _), res in zip(ops, results, strict=True):
            assert res.error is None, (record.key, res.message)
            assert res.digest == record.checksum, record.key
            if dest is not None:
                assert res.dest_exists and dest.stat().st_size == record.size
        lanes = "\n".join(line for line in results[-1].info.splitlines() if "lane[" in line)
        for name in self.lanes:  # the traffic went where the test says it goes...
            assert name in lanes, lanes
        for name in self.not_lanes:  # ... and nowhere else
            assert name not in lanes, lanes

    def test_missing_key(self, peer: Peer) -> None:
        rec = Record("run/nope.bin", peer.owner, 3, checksum(b"abc"), 1, 0.0)
        dest = self.client_dir() / "nope.got"
        (res,) = self.fetch_all([(rec, dest, TOKEN)])
        assert res.error == "KeyNotFoundError" and not res.dest_exists

    # ------------------------------------------------------------------ integrity
    def test_integrity_failure(self, peer: Peer) -> None:
        key = "run/mid.bin"
        good = peer.files[key]
        wrong_sum = peer.record(key, checksum_of=good[:-1] + bytes([good[-1] ^ 1]))
        wrong_size = Record(key, peer.owner, len(good) + 1, checksum(good), 1, 0.0)
        out = self.client_dir()
        ops = [(wrong_sum, out / "sum.got", TOKEN), (wrong_sum, None, TOKEN),
               (wrong_size, out / "size.got", TOKEN), (peer.record(key), out / "after.got", TOKEN)]
        res = self.fetch_all(ops)
        for r in res[:3]:
            assert r.error == "IntegrityError" and "IntegrityError" in r.bases and "OSError" in r.bases, r
            assert not r.dest_exists
        assert res[3].error is None and res[3].digest == checksum(good)  # the endpoint still works

    # ------------------------------------------------------------------ authentication
    def test_auth_failure(self, peer: Peer) -> None:
        rec = peer.record("run/mid.bin")
        out = self.client_dir()
        res = self.fetch_all([(rec, out / "bad.got", "not-the-token"), (rec, None, ""),
                              (rec, out / "good.got", TOKEN)])
        for r in res[:2]:
            assert r.error == "AuthenticationError" and "PermissionError" in r.bases, r
            assert not r.dest_exists
        assert "bad mac" in res[0].message
        assert res[2].error is None

    # ------------------------------------------------------------------ peer death
    def test_peer_death_mid_transfer(self, peer: Peer) -> None:
        dest = self.client_dir() / "dead.got"
        res = self.die_mid_transfer(peer, peer.record("run/big.bin"), dest)
        assert res.error == "TransferError", res
        assert "InstrideError" in res.bases
        assert not res.dest_exists
        # and a fetch from the dead peer fails fast with a typed error, leaving nothing
        (again,) = self.fetch_all([(peer.record("run/mid.bin"), dest, TOKEN)])
        assert again.error in ("PeerUnavailable", "TransferError"), again
        assert not again.dest_exists
        assert again.elapsed < TIMEOUT + 5

    # ------------------------------------------------------------------ timeouts
    def test_timeout(self, peer: Peer) -> None:
        """A peer that stops answering (SIGSTOP) costs a bounded wait and a typed error."""
        rec = peer.record("run/mid.bin")
        dest = self.client_dir() / "late.got"
        self.fetch_all([(rec, None, TOKEN)])  # connected and working
        stop_process(peer.proc.pid)  # (returns once it has stopped)
        try:
            (res,) = self.fetch_all([(rec, dest, TOKEN)])
        finally:
            os.kill(peer.proc.pid, signal.SIGCONT)
        assert res.error == "PeerUnavailable", res
        assert "ConnectionError" in res.bases
        assert TIMEOUT * 0.9 <= res.elapsed < TIMEOUT + 5
        assert not dest.exists()
        (again,) = self.fetch_all([(rec, dest, TOKEN)])  # the resumed peer serves again
        assert again.error is None and again.digest == rec.checksum

    def test_unreachable_peer(self, tmp_path: Path) -> None:
        """Nobody listening: PeerUnavailable at once, not after a timeout."""
        peer = self.start_peer({})
        peer.stop()
        rec = Record("run/x", peer.owner, 1, checksum(b"x"), 1, 0.0)
        (res,) = self.fetch_all([(rec, self.client_dir() / "x.got", TOKEN)])
        assert res.error == "PeerUnavailable", res
        assert res.elapsed < TIMEOUT + 5


# ---------------------------------------------------------------------- one node, shm
class TestUcxSharedMemory(UcxScenarios):
    """Server and client on one node: UCX moves the bytes through shared memory."""

    lanes = ("sysv", "cma")
    not_lanes = ("tcp/",)

    @pytest.fixture(autouse=True)
    def _node(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        for var in ("UCX_TLS", "UCX_NET_DEVICES", "INSTRIDE_UCX_PEER_ERRORS"):
            monkeypatch.delenv(var, raising=False)
        self.tmp = tmp_path
        self.transports: dict[str, UcxTransport] = {}
        yield
        for t in self.transports.values():
            t.close()

    def test_a_replayed_request_is_refused(self, peer: Peer,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
        """A request captured and sent again (its nonce, within the timestamp window) is
        refused, as over TCP."""
        rec = peer.record("run/mid.bin")
        header = ucx_mod.wire.sign(TOKEN, "fetch", rec.key)
        monkeypatch.setattr(ucx_mod.wire, "sign", lambda *_a, **_k: dict(header))
        first, again = self.fetch_all([(rec, None, TOKEN), (rec, None, TOKEN)])
        assert first.error is None and first.digest == rec.checksum
        assert again.error == "AuthenticationError" and "replayed" in again.message, again

    def test_a_threads_worker_goes_with_the_thread(self, peer: Peer) -> None:
        """Each thread fetches with its own UCP worker; a thread that ended leaves no worker,
        endpoint or descriptor behind."""
        import gc
        import threading

        transport = self._transport(TOKEN)
        rec = peer.record("run/mid.bin")
        got: list[Outcome] = []

        def in_a_thread() -> None:
            th = threading.Thread(target=lambda: got.append(run_fetch(transport, rec, None)))
            th.start()
            th.join()
            gc.collect()

        in_a_thread()
        base = len(os.listdir("/proc/self/fd"))
        for _ in range(5):
            in_a_thread()
        assert all(o.error is None for o in got), got
        assert len(os.listdir("/proc/self/fd")) <= base + 2
        assert len(transport._workers) <= 1

    def start_peer(self, files: dict[str, bytes]) -> Peer:
        addr = f"127.0.0.1:{free_port()}"
        env = dict(os.environ, INSTRIDE_DIR=str(self.tmp / "owner"), INSTRIDE_TOKEN=TOKEN,
                   INSTRIDE_ADDR=addr)
        return _start_server([PY, "-m", "instride.transport.ucx", "--announce"],
                             env, self.tmp / "owner", addr, files)

    def client_dir(self) -> Path:
        d = self.tmp / "consumer"
        d.mkdir(exist_ok=True)
        return d

    def _transport(self, token: str) -> UcxTransport:
        if token not in self.transports:
            s = Settings(dir=self.client_dir(), token=token, connect_timeout=TIMEOUT, fsync=False)
            self.transports[token] = UcxTransport(s)
        return self.transports[token]

    def fetch_all(self, ops: list[tuple[Record, Path | None, str]]) -> list[Outcome]:
        return [run_fetch(self._transport(tok), rec, dest) for rec, dest, tok in ops]

    def die_mid_transfer(self, peer: Peer, record: Record, dest: Path) -> Outcome:
        """The reply header arrives, then the server dies before the body is taken."""
        t = self._transport(TOKEN)
        w = t._worker()
        t0 = time.monotonic()
        _reply, size = t._request(w, record)
        peer.announced()
        peer.kill()
        try:
            t._receive(w, record, bytearray(size), size)
        except InstrideError as exc:
            return Outcome(type(exc).__name__, [c.__name__ for c in type(exc).__mro__], str(exc), None,
                           dest.exists(), time.monotonic() - t0)
        return Outcome(None, [], "received", None, dest.exists(), time.monotonic() - t0)


def test_an_on_reply_that_fails_leaves_no_request_unanswered(tmp_path: Path) -> None:
    """``on_reply`` (diagnostics) raising: the request is answered all the same, and the
    served file is not left open."""
    owner = tmp_path / "owner"
    (owner / "k").mkdir(parents=True)
    data = os.urandom(50_000)
    (owner / "k" / "a.bin").write_bytes(data)

    def broken(_key: str, _size: int) -> None:
        raise BrokenPipeError("stdout closed")

    addr = f"127.0.0.1:{free_port()}"
    server = UcxServer(Settings(dir=owner, token=TOKEN, addr=addr), on_reply=broken)
    client = UcxTransport(Settings(dir=tmp_path, token=TOKEN, connect_timeout=TIMEOUT))
    with server:
        try:
            rec = Record("k/a.bin", addr, len(data), checksum(data), 1, 0.0)
            for _ in range(3):
                assert bytes(client.fetch_bytes(rec)) == data
        finally:
            client.close()
        held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}")]
        assert str(owner / "k" / "a.bin") not in held


def _places_given_back(tmp_path: Path, requests: list[bytes], wait_ms: int,
                       answered: bool) -> None:
    """Peers send ``requests`` (one connection each) to a server of as many places; each
    connection is closed, its place given back, and a real client is served afterwards."""
    import ctypes

    owner = tmp_path / "owner"
    (owner / "k").mkdir(parents=True)
    data = b"served after the others"
    (owner / "k" / "a.bin").write_bytes(data)
    addr = f"127.0.0.1:{free_port()}"
    port = int(addr.rsplit(":", 1)[1])
    server = UcxServer(Settings(dir=owner, token=TOKEN, addr=addr), max_peers=len(requests),
                       request_timeout=1.0)
    client = UcxTransport(Settings(dir=tmp_path, token=TOKEN, connect_timeout=TIMEOUT))
    peers = [ucx_mod._Worker(client.lib) for _ in requests]
    with server:
        try:
            body, reused = ctypes.c_uint64(0), ctypes.c_int(0)
            err = ctypes.create_string_buffer(512)
            for w, req in zip(peers, requests, strict=True):
                client.lib.isu_client_request(w.handle, b"127.0.0.1", port, req, len(req),
                                              w.reply, ucx_mod._REPLY_CAP, ctypes.byref(body),
                                              ctypes.byref(reused), wait_ms, err, 512)
                assert (b"ok" in w.reply.value) == answered
            until(lambda: server.snapshot()["peers"] == 0, 10, "their connections closed")
            rec = Record("k/a.bin", addr, len(data), checksum(data), 1, 0.0)
            assert bytes(client.fetch_bytes(rec)) == data
        finally:
            client.close()
            for w in peers:
                w.close()


def test_connections_that_send_nothing_valid_give_their_place_back(tmp_path: Path) -> None:
    """Connections that send a malformed request (dropped by the C library, with no reply) are
    closed, so peers that never send a valid request cannot hold every one of the server's
    places: a real client is served afterwards."""
    _places_given_back(tmp_path, [b""] * 4, 300, answered=False)  # (no JSON header at all)


def test_connections_refused_for_their_token_give_their_place_back(tmp_path: Path) -> None:
    """Connections that send a well-formed request with a wrong token (or bad JSON) got an
    error reply and stayed open: past their first request no time bound applied, so peers
    without the token held every place of the server for good, and every real client was
    rejected. A refused request's connection is closed once its answer is sent."""
    from instride.transport import wire

    wrong = json.dumps(wire.sign("not the token", "fetch", "k/a.bin")).encode()
    _places_given_back(tmp_path, [wrong, b"{not json"], 2000, answered=True)


def _one_key_server(tmp_path: Path, **kw: Any) -> tuple[UcxServer, Record, bytes]:
    """A UCX server (not started) of one key, and that key's record."""
    owner = tmp_path / "owner"
    (owner / "k").mkdir(parents=True)
    data = os.urandom(200_000)
    (owner / "k" / "a.bin").write_bytes(data)
    addr = f"127.0.0.1:{free_port()}"
    server = UcxServer(Settings(dir=owner, token=TOKEN, addr=addr), **kw)
    return server, Record("k/a.bin", addr, len(data), checksum(data), 1, 0.0), data


def _client(tmp_path: Path, timeout: float = TIMEOUT) -> UcxTransport:
    return UcxTransport(Settings(dir=tmp_path, token=TOKEN, connect_timeout=timeout))


@pytest.fixture
def peer_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Endpoints with peer failure handling on this one host (as between nodes): a closed
    connection is told to its other side."""
    for var in ("UCX_TLS", "UCX_NET_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("INSTRIDE_UCX_PEER_ERRORS", "1")


def test_at_max_peers_an_idle_kept_connection_makes_room(tmp_path: Path, peer_errors: None) -> None:
    """Clients keep their connection for their next request. A server whose places were all
    held by such idle connections rejected every new client (PeerUnavailable at once). At
    max_peers the one idle the longest is closed now; its client's next request goes again
    on a new connection."""
    server, rec, data = _one_key_server(tmp_path, max_peers=1)
    first, second = _client(tmp_path), _client(tmp_path)
    with server:
        try:
            assert bytes(first.fetch_bytes(rec)) == data
            assert bytes(second.fetch_bytes(rec)) == data  # (first's connection made room)
            assert bytes(first.fetch_bytes(rec)) == data  # (and now second's)
            until(lambda: server.snapshot()["evicted"] >= 2, 5, "two connections evicted")
            assert server.snapshot()["busy"] == 0
        finally:
            first.close()
            second.close()


def test_a_client_rejected_while_every_place_answers_tries_again(tmp_path: Path,
                                                                 peer_errors: None) -> None:
    """At max_peers with every connection answering, UCX rejects a new one: the client tries
    again for up to its connect timeout (as over TCP), not PeerUnavailable at once."""
    import threading

    entered, release = threading.Event(), threading.Event()

    def slow(_key: str, _size: int) -> None:
        if not entered.is_set():
            entered.set()
            release.wait(10)

    server, rec, data = _one_key_server(tmp_path, max_peers=1, on_reply=slow)
    first, second = _client(tmp_path, timeout=5.0), _client(tmp_path, timeout=5.0)
    got: list[bytes] = []
    with server:
        th = threading.Thread(target=lambda: got.append(bytes(first.fetch_bytes(rec))))
        try:
            th.start()
            assert entered.wait(10)
            threading.Timer(0.5, release.set).start()
            t0 = time.monotonic()
            assert bytes(second.fetch_bytes(rec)) == data  # rejected, then served
            assert 0.3 < time.monotonic() - t0 < 5.0
            th.join(10)
            assert got == [data]
            assert server.snapshot()["busy"] >= 1
        finally:
            release.set()
            th.join(10)
            first.close()
            second.close()


def test_a_timed_out_endpoint_gives_its_place_back(tmp_path: Path, peer_errors: None) -> None:
    """A fetch that timed out kept its endpoint until its thread ended: a connection place on
    the owner for each timeout (an overloaded owner got more connections with each). With
    peer failure handling (between nodes) it is closed at once now."""
    import threading

    release = threading.Event()

    def slow(_key: str, _size: int) -> None:
        release.wait(10)

    server, rec, _data = _one_key_server(tmp_path, on_reply=slow)
    client = _client(tmp_path, timeout=0.5)
    with server:
        try:
            with pytest.raises(PeerUnavailable, match="no reply"):
                client.fetch_bytes(rec)
            release.set()
            until(lambda: server.snapshot()["peers"] == 0, 10, "the connection closed")
        finally:
            release.set()
            client.close()


class _FailingReply:
    """The C library, but the first reply with a body fails as a refused memory map would."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self.failed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def isu_server_reply(self, handle: int, body: bytes, n: int, fd: int, size: int,
                         deadline: int, err: Any, errlen: int) -> int:
        if fd >= 0 and not self.failed:
            self.failed += 1
            os.close(fd)  # (taken over, as by the C)
            err.value = b"mmap: Cannot allocate memory"
            return -12
        return self._lib.isu_server_reply(handle, body, n, fd, size, deadline, err, errlen)


def test_a_reply_whose_body_cannot_be_sent_is_answered(tmp_path: Path) -> None:
    """A reply whose body UCX could not be handed (its memory map refused) was never
    answered: the client waited out its whole timeout and blamed the owner. It gets an
    answer at once now (PeerUnavailable, saying why), and the next fetch is served."""
    server, rec, data = _one_key_server(tmp_path)
    server.lib = _FailingReply(server.lib)  # type: ignore[assignment]
    client = _client(tmp_path, timeout=5.0)
    with server:
        try:
            t0 = time.monotonic()
            with pytest.raises(PeerUnavailable, match="cannot send k/a.bin now"):
                client.fetch_bytes(rec)
            assert time.monotonic() - t0 < 2.5
            assert bytes(client.fetch_bytes(rec)) == data
        finally:
            client.close()


CLOSE_UNDER_A_FETCH = textwrap.dedent(
    """
    import os, sys, threading, time
    from pathlib import Path
    from instride.config import Settings
    from instride.record import Record
    from instride.transport.ucx import UcxServer, UcxTransport
    import xxhash
    tmp = Path(sys.argv[1])
    (tmp / "owner" / "k").mkdir(parents=True)
    data = os.urandom(3_000_000)
    (tmp / "owner" / "k" / "a.bin").write_bytes(data)
    entered = threading.Event()
    def slow(key, size):
        entered.set()
        time.sleep(1.0)
    addr = "127.0.0.1:" + sys.argv[2]
    server = UcxServer(Settings(dir=tmp / "owner", token="t", addr=addr), on_reply=slow)
    client = UcxTransport(Settings(dir=tmp, token="t", connect_timeout=10))
    rec = Record("k/a.bin", addr, len(data), "xxh3:" + xxhash.xxh3_64_hexdigest(data), 1, 0.0)
    got = []
    with server:
        def fetch():
            client.fetch_bytes(rec)  # (the thread's worker, connected)
            got.append(bytes(client.fetch_bytes(rec)))
            got.append(threading.current_thread()._ucx_worker.handle)
        def run():
            threading.current_thread()._ucx_worker = client._worker()
            fetch()
        th = threading.Thread(target=run)
        th.start()
        assert entered.wait(20)
        entered.clear()
        assert entered.wait(20)  # the second fetch waits for its reply
        client.close()  # from another thread, under that fetch
        th.join(30)
    print("ok" if got == [data, None] else f"bad {got[1:]!r}")
    """
)


def test_close_from_another_thread_waits_for_its_fetch(tmp_path: Path) -> None:
    """``UcxTransport.close()`` closed every thread's worker from the caller's thread, also
    one under a fetch (UCX then used freed memory). A worker under a fetch is closed by its
    own thread once the fetch ends; the fetch completes."""
    res = subprocess.run([PY, "-c", CLOSE_UNDER_A_FETCH, str(tmp_path), str(free_port())],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, (res.returncode, res.stderr[-3000:])
    assert res.stdout.strip() == "ok", res.stderr[-3000:]


def test_a_peer_flooding_requests_loses_its_connection(tmp_path: Path, peer_errors: None) -> None:
    """A client waits for each reply; a peer that sends request after request without waiting
    had every one queued (no bound: the server's memory). Past 8 queued on one connection, the
    connection goes, its requests unanswered; the server serves on."""
    import shutil

    gcc = shutil.which("gcc")
    assert gcc is not None, "gcc is required (apt-get install build-essential)"
    exe = tmp_path / "ucx_flood"
    src = Path(__file__).parent / "c" / "ucx_flood.c"
    subprocess.run([gcc, "-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-o", str(exe),
                    str(src), "-lucp", "-lucs"], check=True, capture_output=True, text=True)
    server, rec, data = _one_key_server(tmp_path)
    port = int(rec.owner.rsplit(":", 1)[1])
    client = _client(tmp_path)
    with server:
        try:
            out = subprocess.run([str(exe), "127.0.0.1", str(port), "200"], capture_output=True,
                                 text=True, timeout=60).stdout.split()
            assert out[:2] == ["replies", out[1]] and out[2:] == ["closed", "1"], out
            assert int(out[1]) <= 8, out  # (all 200 were answered)
            until(lambda: server.snapshot()["peers"] == 0, 10, "the flooding peer's connection closed")
            assert bytes(client.fetch_bytes(rec)) == data
        finally:
            client.close()


# ---------------------------------------------------------------------- two emulated nodes
#: namespaces do not isolate shared memory: without UCX_TLS=tcp, processes of two emulated
#: nodes would silently talk through sysv/cma. Each node names its own veth (eth0).
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from instride.emulate import EmulatedCluster

    with EmulatedCluster(nodes=2, serve=False, redis=False, token=TOKEN, env=UCX_ENV) as c:
        yield c


@pytest.mark.root
class TestUcxAcrossNodes(UcxScenarios):
    """Server on node 1, client on node 2, UCX over TCP on each node's own veth."""

    lanes = ("tcp/eth0",)
    not_lanes = ("sysv", "posix", "cma", "tcp/lo")

    @pytest.fixture(autouse=True)
    def _nodes(self, cluster: Any, tmp_path: Path) -> None:
        self.c = cluster
        self.tmp = tmp_path

    def start_peer(self, files: dict[str, bytes]) -> Peer:
        node = self.c.node(1)
        return _start_server(self.c.command(1, [PY, "-m", "instride.transport.ucx", "--announce"]),
                             node.env, node.dir, node.addr, files)

    def client_dir(self) -> Path:
        d = self.c.node(2).dir / self.tmp.name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _client(self, ops: list[tuple[Record, Path | None, str]]) -> subprocess.Popen:
        spec = {"dir": str(self.c.node(2).dir), "timeout": TIMEOUT,
                "ops": [{"record": rec.__dict__, "dest": str(dest) if dest else None, "token": tok}
                        for rec, dest, tok in ops]}
        root = str(Path(__file__).resolve().parents[2])
        return self.c.popen(2, [PY, "-c", CLIENT, json.dumps(spec), root],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    @staticmethod
    def _outcomes(proc: subprocess.Popen, n: int) -> list[Outcome]:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"client timed out: {err}") from None
        assert proc.returncode == 0, err
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert len(lines) == n, (out, err)
        return [Outcome(**d) for d in lines]

    def fetch_all(self, ops: list[tuple[Record, Path | None, str]]) -> list[Outcome]:
        return self._outcomes(self._client(ops), len(ops))

    def die_mid_transfer(self, peer: Peer, record: Record, dest: Path) -> Outcome:
        """Node 1's link is slowed to 20 Mbit/s, so the body is still flowing when it dies."""
        ns = self.c.node(1).netns
        subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
                        "20mbit", "burst", "32kb", "latency", "400ms"], check=True)
        try:
            proc = self._client([(record, dest, TOKEN)])
            peer.announced()
            time.sleep(0.3)  # the body (~1.2 s at this rate) is on its way
            peer.kill()
            (res,) = self._outcomes(proc, 1)
        finally:
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", "eth0", "root"], check=False)
        return res


# ---------------------------------------------------------------------- selection
def test_selected_by_settings(tmp_path: Path) -> None:
    """INSTRIDE_TRANSPORT=ucx names both halves; unknown names are typed errors."""
    settings = Settings.from_env({"INSTRIDE_DIR": str(tmp_path), "INSTRIDE_TOKEN": TOKEN,
                                  "INSTRIDE_TRANSPORT": " UCX "})
    assert settings.transport == "ucx"
    t = get_transport(settings.transport, settings)
    assert isinstance(t, UcxTransport)
    t.close()
    server = get_server(settings.transport, settings, max_peers=4, request_timeout=1.0,
                        send_timeout=2.0)
    assert isinstance(server, UcxServer) and server.max_peers == 4 and server.send_timeout == 2.0
    assert (server.host, server.port) == ("127.0.0.1", 7437)  # INSTRIDE_ADDR itself
    with pytest.raises(ConfigError, match="carrier-pigeon"):
        get_transport("carrier-pigeon", settings)


def test_import_instride_does_not_load_ucx() -> None:
    code = ("import sys, instride; print('instride.transport.ucx' in sys.modules, "
            "any('libinstride_ucx' in line for line in open('/proc/self/maps')))")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "INSTRIDE_TRANSPORT": "ucx"}).stdout
    assert out.split() == ["False", "False"]


def test_missing_library_is_a_typed_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without libinstride_ucx.so (UCX headers missing at install), selecting either half
    names the package."""
    monkeypatch.setattr(ucx_mod, "_lib", None)
    monkeypatch.setattr(ucx_mod, "library_path", lambda: tmp_path / "libinstride_ucx.so")
    settings = Settings(dir=tmp_path, token=TOKEN, transport="ucx")
    with pytest.raises(ConfigError, match="libucx-dev"):
        get_transport("ucx", settings)
    with pytest.raises(ConfigError, match="libucx-dev"):
        get_server("ucx", settings)
    (tmp_path / "libinstride_ucx.so").write_bytes(b"not a library")
    with pytest.raises(ConfigError, match="libucx-dev"):
        UcxTransport(settings)


# ---------------------------------------------------------------------- end to end
PRODUCE = """
import hashlib, sys, numpy as np, instride
payload = np.random.default_rng(1).integers(0, 256, 5_000_000, dtype=np.uint8).tobytes()
with instride.open("e2e/blob.bin", "wb") as fh:
    fh.write(payload)
print(hashlib.sha256(payload).hexdigest())
rng = np.random.default_rng(2)
with instride.Stream("e2e/run", mode="w", layout="paper") as s:
    for i in range(int(sys.argv[1])):
        pos = rng.random((2000, 3)) * 100
        s.append(pos, step=i)
        print(hashlib.sha256(pos.tobytes()).hexdigest())
"""
CONSUME = """
import hashlib, numpy as np, instride
out = [hashlib.sha256(instride.open("e2e/blob.bin", timeout=60).read()).hexdigest()]
for f in instride.Stream("e2e/run", timeout=60):
    out.append(hashlib.sha256(np.ascontiguousarray(f.positions).tobytes()).hexdigest())
engine = instride.get_client().cluster
out.append(f"{type(engine.transport).__name__} {engine.transfers}")
print("\\n".join(out))
"""


@pytest.mark.root
def test_two_nodes_serve_over_ucx() -> None:
    """Two emulated nodes, every process with INSTRIDE_TRANSPORT=ucx: ``instride serve``
    serves over UCX (TCP on the veth), a consumer on node 2 reads a key and a stream that a
    producer on node 1 writes, and every byte matches."""
    from instride.emulate import EmulatedCluster

    frames = 20
    env = {**UCX_ENV, "INSTRIDE_TRANSPORT": "ucx"}
    with EmulatedCluster(nodes=2, token=TOKEN, env=env) as c:
        consumer = c.popen(2, [PY, "-c", CONSUME], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
        produced = c.run(1, [PY, "-c", PRODUCE, str(frames)], capture_output=True, text=True,
                         timeout=120)
        assert produced.returncode == 0, produced.stderr
        try:
            out, err = consumer.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            consumer.kill()
            out, err = consumer.communicate()
            raise AssertionError(f"consumer timed out: {err}") from None
        assert consumer.returncode == 0, err
        got = out.splitlines()
        assert got[:-1] == produced.stdout.splitlines()  # the blob, then every frame
        assert len(got) == frames + 2
        name, transfers = got[-1].split()
        assert name == "UcxTransport" and int(transfers) >= frames + 1  # blob and every frame
        # node 1's `instride serve` sent them over UCX (its counters lag by at most 0.5 s)
        until(lambda: stats(c.node(1))["fetches"] >= frames + 1, 5, "node 1 counted the fetches")
        assert stats(c.node(1))["bytes_sent"] >= 5_000_000
        log = (c.base_dir / "node1.log").read_text()
        assert "over UCX on 10." in log and "(ucx)" in log, log[-3000:]


UCX_AFTER_FORK = textwrap.dedent(
    """
    import os, sys, tempfile
    from instride.config import Settings
    from instride.errors import ConfigError
    from instride.transport.ucx import UcxTransport, started_here
    t = UcxTransport(Settings(dir=tempfile.mkdtemp(), token="t"))
    t._worker()  # (as a first fetch starts it)
    assert started_here()
    child = os.fork()
    if child == 0:
        try:
            t._worker()
        except ConfigError as exc:
            os._exit(0 if "fork" in str(exc) and not started_here() else 2)
        os._exit(1)
    print(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
    t.close()
    """
)


def test_a_forked_child_is_told_at_once_that_ucx_does_not_survive_a_fork() -> None:
    """UCX started in a process, which then forks (a parallel analysis's workers, by
    default): every fetch of the child waited out its timeout and raised PeerUnavailable,
    blaming a healthy owner. The child's first fetch now raises a ConfigError that says why
    (and parallel analysis starts its workers from a fork server then)."""
    res = subprocess.run([sys.executable, "-c", UCX_AFTER_FORK], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "0"


_HUP_AFTER_UCX = """
import os, signal, sys, tempfile, time
from pathlib import Path
from instride.config import Settings
from instride.transport.ucx import UcxTransport
got = []
signal.signal(signal.SIGHUP, lambda signum, frame: got.append(signum))
transport = UcxTransport(Settings(dir=Path(tempfile.mkdtemp()), token="t" * 32,
                                  connect_timeout=2))
transport._worker()  # (UCX started in this process)
os.kill(os.getpid(), signal.SIGHUP)
time.sleep(0.2)
print(got, flush=True)
"""


def test_ucx_takes_no_signal_from_the_program() -> None:
    """UCX, once started in a process, took SIGHUP for its own debug mode
    (``UCX_DEBUG_SIGNO``): a terminal or ssh session that closed no longer reached the
    program's handler (``instride job``'s or a flow runner's teardown), and a SIGHUP — or a
    fault, ``UCX_ERROR_SIGNALS`` — that came inside ``malloc`` hung the process in UCX's
    handler (seen in the suite: a test hung in ``ucp_worker_create``). Those handlers are off
    unless the user sets the variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    res = subprocess.run([sys.executable, "-c", _HUP_AFTER_UCX], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[1]", (res.stdout, res.stderr)  # (the program's handler ran)
