"""instride imd-serve: unmodified imd:// readers (MDAnalysis + imdclient) consume a stream,
checked frame by frame against a direct read of the source trajectory."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import MDAnalysis as mda
import numpy as np
import pytest
from imdclient.IMDClient import IMDClient
from MDAnalysis.analysis import rms
from MDAnalysisTests.datafiles import DCD, GRO, PSF, XTC

import instride
from instride.errors import ServeError
from instride.md.imd_bridge import bridge
from instride.md.imd_protocol import MsgType, encode_header
from instride.md.imd_server import IMDServer
from tests.conftest import finish, free_port

READER = Path(__file__).with_name("imd_reader.py")


def _publish(name: str, u: mda.Universe, pause: float = 0.0) -> None:
    with instride.Stream(name, mode="w") as s:
        for ts in u.trajectory:
            box = None if ts.dimensions is None else ts.triclinic_dimensions
            s.append(u.atoms.positions, step=int(ts.data.get("step", ts.frame)), time=ts.time, box=box)
            time.sleep(pause)


def _reader(top: str, port: int, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(READER), top, f"imd://127.0.0.1:{port}", str(out), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


@pytest.fixture
def server_factory(managed_dir: Path):
    servers: list[IMDServer] = []

    def make(stream: str, **kw: object) -> IMDServer:
        srv = IMDServer(stream, **kw).start()  # type: ignore[arg-type]
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        srv.close()


def test_mdanalysis_readers_follow_a_live_stream(server_factory, tmp_path: Path) -> None:
    """Two MDAnalysis imd:// readers connect before the first frame and read while it is written."""
    srv = server_factory("adk")
    outs = [tmp_path / f"r{i}.npz" for i in range(2)]
    readers = [_reader(GRO, srv.port, out, "select=protein") for out in outs]
    try:
        deadline = time.monotonic() + 60  # (connected before the first frame, as documented)
        while len(srv._sessions) < 2:
            assert time.monotonic() < deadline and all(p.poll() is None for p in readers)
            time.sleep(0.05)
        _publish("adk", mda.Universe(GRO, XTC), pause=0.1)
        for p in readers:
            rc, out, err = finish(p, timeout=120)
            assert rc == 0, err
            assert "10 frames" in out
    finally:
        for p in readers:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert srv.wait_clients(2, timeout=30)
    assert all(r.ended and r.frames == 10 for r in srv.reports), srv.reports
    ref = mda.Universe(GRO, XTC)  # the direct read
    protein = ref.select_atoms("protein")
    first = None
    for out in outs:
        got = np.load(out)
        assert len(got["positions"]) == len(ref.trajectory)
        worst = np.zeros(4)
        for i, ts in enumerate(ref.trajectory):
            np.testing.assert_array_equal(got["positions"][i], ref.atoms.positions)
            assert got["time"][i] == pytest.approx(ts.time)
            assert got["step"][i] == ts.data["step"]
            np.testing.assert_allclose(got["dimensions"][i], ts.dimensions, rtol=1e-5)
            assert got["rg"][i] == pytest.approx(protein.radius_of_gyration(), rel=1e-6)
            if first is None:
                first = protein.positions.copy()
            ref_rmsd = rms.rmsd(protein.positions, first, superposition=True)
            assert got["rmsd"][i] == pytest.approx(ref_rmsd, abs=1e-4)
            worst = np.maximum(worst, [np.abs(got["positions"][i] - ref.atoms.positions).max(),
                                       np.abs(got["dimensions"][i] - ts.dimensions).max(),
                                       abs(got["rg"][i] - protein.radius_of_gyration()),
                                       abs(got["rmsd"][i] - ref_rmsd)])
        print(f"imd-serve vs XTC: max |diff| positions {worst[0]:.2g} A, box {worst[1]:.2g}, "
              f"Rg {worst[2]:.2g} A, RMSD {worst[3]:.2g} A; RMSD up to {got['rmsd'].max():.2f} A")
        # dt: from consecutive frames (time / step), 0.0 for the first
        assert got["dt"][0] == 0.0
        assert got["dt"][1:] == pytest.approx(ref.trajectory.dt / 50000, rel=1e-5)


def test_slow_client_pauses_the_server_and_misses_nothing(server_factory) -> None:
    """imdclient with a buffer of a few frames sends PAUSE/RESUME; every frame arrives, in order."""
    u = mda.Universe(PSF, DCD)
    _publish("dcd", u)
    srv = server_factory("dcd")
    natoms = len(u.atoms)
    client = IMDClient("127.0.0.1", srv.port, natoms, buffer_size=8 * natoms * 12, timeout=30)
    info = client.get_imdsessioninfo()
    assert (info.version, info.time, info.box, info.positions) == (3, True, False, True)
    got = []
    try:
        while True:
            try:
                f = client.get_imdframe()
            except EOFError:
                break
            got.append((f.step, f.positions.copy()))
            time.sleep(0.02)  # slower than the server: its buffer fills
    finally:
        client.stop()
    assert [s for s, _ in got] == [ts.data["step"] for ts in u.trajectory]  # 1, 2, ...
    for ts in u.trajectory:
        np.testing.assert_array_equal(got[ts.frame][1], u.atoms.positions)
    assert srv.wait_clients(1, timeout=30) and srv.reports[0].ended
    assert srv.reports[0].pauses >= 1  # the client's buffer did fill up


def test_newest_start_and_a_client_leaving_early(server_factory) -> None:
    u = mda.Universe(PSF, DCD)
    _publish("dcd", u)
    n = len(u.trajectory)
    srv = server_factory("dcd", start="newest")
    client = IMDClient("127.0.0.1", srv.port, len(u.atoms), multithreaded=False, timeout=30)
    frames = []
    while True:
        try:
            frames.append(client.get_imdframe().step)
        except EOFError:
            break
    assert frames == [u.trajectory[-1].data["step"]]  # only the newest frame, then end of stream
    # a client that leaves after 2 frames: its session ends, the server keeps serving
    first = server_factory("dcd")
    c1 = IMDClient("127.0.0.1", first.port, len(u.atoms), multithreaded=False, timeout=30)
    c1.get_imdframe()
    c1.get_imdframe()
    c1.stop()
    assert first.wait_clients(1, timeout=30)
    assert not first.reports[0].ended and first.reports[0].error
    c2 = IMDClient("127.0.0.1", first.port, len(u.atoms), multithreaded=False, timeout=30)
    count = 0
    while True:
        try:
            c2.get_imdframe()
            count += 1
        except EOFError:
            break
    assert count == n


@pytest.mark.parametrize("version", [2, 3])
def test_bridge_receives_both_versions(server_factory, version: int) -> None:
    """stream -> imd-serve (IMD v2 or v3) -> imd-bridge -> stream: same frames; v3 keeps step,
    time and box, v2 numbers frames itself."""
    u = mda.Universe(GRO, XTC)
    _publish("src", u)
    srv = server_factory("src", version=version)
    report = bridge(f"127.0.0.1:{srv.port}", f"copy{version}", len(u.atoms), dt=0.002,
                    first_step=5, every=10, connect_timeout=10, timeout=30)
    assert (report.frames, report.imd_version) == (len(u.trajectory), version)
    copy = list(instride.Stream(f"copy{version}", timeout=5))
    assert len(copy) == len(u.trajectory)
    for frame, ts in zip(copy, u.trajectory, strict=True):
        np.testing.assert_array_equal(frame.positions, u.atoms.positions)
        if version == 3:
            assert (frame.step, frame.time) == (ts.data["step"], pytest.approx(ts.time))
            np.testing.assert_allclose(frame.box, ts.triclinic_dimensions, rtol=1e-6, atol=1e-4)
        else:
            assert frame.step == 5 + 10 * ts.frame
            assert frame.time == pytest.approx(frame.step * 0.002)
            assert not frame.header.has_box


def test_bad_settings_are_typed_errors(managed_dir: Path) -> None:
    with pytest.raises(instride.ConfigError, match="version"):
        IMDServer("s", version=4)
    with pytest.raises(instride.ConfigError, match="start"):
        IMDServer("s", start="middle")
    with pytest.raises(instride.KeyValidationError):
        IMDServer("../outside")
    for bad in (float("nan"), -1.0, 0, "5", True):  # (a session's stall limit:
        with pytest.raises(instride.ConfigError, match="timeout"):  # every session failed)
            IMDServer("s", timeout=bad)  # type: ignore[arg-type]
    # inf: no limit, as everywhere else (it was refused); whole numbers for version and port
    # (3.0 passed, then every session failed packing its handshake; 8889.0 a bare TypeError)
    with IMDServer("s", timeout=float("inf")) as server:
        assert server.timeout is None
        for bad in (float("nan"), -1.0):  # (NaN spun a core until close())
            with pytest.raises(instride.ConfigError, match="timeout"):
                server.wait_clients(1, timeout=bad)
        assert server.wait_clients(1, timeout=0.05) is False
    for name, bad in (("version", 3.0), ("port", 8889.0), ("port", "0"), ("version", True)):
        with pytest.raises(instride.ConfigError, match=name):
            IMDServer("s", **{name: bad})  # type: ignore[arg-type]
    for bad in (float("nan"), -0.5, float("inf")):  # (it goes out in every frame's TIME)
        with pytest.raises(instride.ConfigError, match="dt"):
            IMDServer("s", dt=bad)
    with IMDServer("s") as busy:  # (a ServeError: exit status 6, as for `instride serve`)
        with pytest.raises(ServeError, match="the IMD server could not start: cannot listen"):
            IMDServer("s", port=busy.port)


@pytest.mark.parametrize(("args", "what"), [
    (["imd-serve", "s", "--port", "0", "--clients", "0"], "--clients"),
    (["imd-serve", "s", "--port", "0", "--dt", "nan"], "--dt"),
    (["imd-serve", "s", "--port", "0", "--dt", "-1"], "--dt"),
    (["imd-serve", "s", "--port", "0", "--host", ""], "every interface"),
    (["imd-bridge", "localhost:1", "s", "--dt", "nan"], "--dt"),
    (["demo", "--timeout", "nan"], "--timeout"),
    (["demo", "--timeout", "0"], "--timeout"),
    (["top", "--interval", "-1"], "--interval"),
])
def test_numbers_and_addresses_that_mean_nothing_are_usage_errors(
        managed_dir: Path, args: list[str], what: str) -> None:
    """Exit status 2 with the option named, before anything runs (``--clients 0`` served
    nothing and exited 0, ``--dt nan`` went out as the TIME packet's dt, ``--host ""``
    listened on every interface, the demo's ``--timeout nan`` made a barrier wait for ever,
    ``top --interval -1`` crashed once a graph ran)."""
    proc = subprocess.run([sys.executable, "-m", "instride", *args], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert what in proc.stderr


def test_cli_imd_serve(managed_dir: Path) -> None:
    u = mda.Universe(PSF, DCD)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "instride", "imd-serve", "cli", "--port", str(port), "--clients", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        t = threading.Thread(target=_publish, args=("cli", u))
        t.start()
        deadline = time.monotonic() + 30
        while True:
            try:
                client = IMDClient("127.0.0.1", port, len(u.atoms), multithreaded=False, timeout=30)
                break
            except ConnectionError:
                assert time.monotonic() < deadline, "imd-serve did not start listening"
                time.sleep(0.1)
        count = 0
        while True:
            try:
                client.get_imdframe()
                count += 1
            except EOFError:
                break
        t.join()
        rc, out, err = finish(proc, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert rc == 0, err
    assert count == len(u.trajectory)
    assert f"imd://127.0.0.1:{port} (IMD v3" in out
    assert f"{len(u.trajectory)} frames" in out and "end of stream" in out and "served 1 clients" in out


@pytest.mark.parametrize(("signum", "status"),
                         [(signal.SIGTERM, 0), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_cli_imd_serve_stops_cleanly_on_sigterm(managed_dir: Path, signum: int, status: int) -> None:
    """SIGTERM stops the server (status 0), Ctrl-C interrupts it (130), SIGHUP (its terminal
    closed) 129 -- it was 130; sessions end every way."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "instride", "imd-serve", "nothing-yet", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        line = proc.stdout.readline().decode()
        assert "serving stream nothing-yet on imd://127.0.0.1:" in line
        port = int(line.split("imd://127.0.0.1:", 1)[1].split()[0])
        # a client waiting for a stream that has no frame yet is cut off by the shutdown
        client = IMDClient("127.0.0.1", port, 10, multithreaded=False, timeout=30)
        proc.send_signal(signum)
        # a session still in its handshake has up to 30 s for the client's answer
        rc, out, err = finish(proc, timeout=90)
        with pytest.raises(EOFError):
            client.get_imdframe()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert rc == status, err
    assert "imd-serve: stopped" in out


def _frames(name: str, n: int, natoms: int, pause: float = 0.0, **kw: object) -> None:
    """Publish ``n`` frames of ``natoms`` atoms (frame i: every coordinate i), then the end."""
    with instride.Stream(name, mode="w", **kw) as s:  # type: ignore[arg-type]
        for i in range(n):
            s.append(np.full((natoms, 3), float(i)), step=i)
            time.sleep(pause)


def _all_steps(client: IMDClient) -> list[int]:
    steps = []
    while True:
        try:
            steps.append(client.get_imdframe().step)
        except EOFError:
            return steps


def test_a_client_that_only_listens_outlasts_the_stall_limit(server_factory, monkeypatch) -> None:
    """A client that sends nothing after IMD_GO (it keeps up, so never pauses) is served for
    many times the limit on a stalled client, and gets every frame."""
    from instride.md import imd_server

    monkeypatch.setattr(imd_server, "_CLIENT_STALL_S", 0.5)
    srv = server_factory("quiet")
    client = IMDClient("127.0.0.1", srv.port, 10, multithreaded=False, timeout=30)
    producer = threading.Thread(target=_frames, args=("quiet", 8, 10, 0.4))
    producer.start()  # 8 frames over ~3.2 s: over 6 times the limit without a client message
    try:
        assert _all_steps(client) == list(range(8))
    finally:
        producer.join()
        client.stop()
    assert srv.wait_clients(1, timeout=30)
    assert srv.reports[0].ended and srv.reports[0].error is None, srv.reports


def test_a_client_that_stops_reading_is_disconnected(server_factory, monkeypatch) -> None:
    """A client that answers the handshake, then takes no bytes: its session ends once the
    socket's buffers are full and the limit has passed, with the reason; the server goes on."""
    from instride.md import imd_server

    monkeypatch.setattr(imd_server, "_CLIENT_STALL_S", 1.0)
    _frames("big", 40, 100_000)  # 40 × 1.2 MB: more than the socket buffers hold
    srv = server_factory("big")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(encode_header(MsgType.GO, 0))
        assert srv.wait_clients(1, timeout=60)
    report = srv.reports[0]
    assert not report.ended and report.error == "the client took no data for 1 s", report
    assert 0 < report.frames < 40
    client = IMDClient("127.0.0.1", srv.port, 100_000, multithreaded=False, timeout=30)
    assert _all_steps(client) == list(range(40))  # (the next client is served in full)


def test_ignored_bodies_are_skipped_without_holding_them(server_factory) -> None:
    """MDCOMM's forces are read past exactly (the DISCONNECT after them is understood), and an
    MDCOMM announcing 2^31 - 1 atoms (32 GiB) is not allocated: the session just ends."""
    _frames("steer", 3, 10)
    srv = server_factory("steer")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(encode_header(MsgType.GO, 0) + encode_header(MsgType.MDCOMM, 1000)
                     + bytes(16 * 1000) + encode_header(MsgType.DISCONNECT, 0))
        assert srv.wait_clients(1, timeout=30)
    assert srv.reports[0].error in (None, "the client disconnected"), srv.reports
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(encode_header(MsgType.GO, 0) + encode_header(MsgType.MDCOMM, 2**31 - 1))
        sock.sendall(bytes(1 << 20))  # (part of the announced body: read past, dropped)
    assert srv.wait_clients(2, timeout=30)
    assert srv.reports[1].error is None or "Error" not in srv.reports[1].error, srv.reports


def _files_open_under(root: Path) -> list[str]:
    """The regular files under ``root`` (a stream's frames) this process holds open."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        target = os.path.realpath(f"/proc/self/fd/{fd}")
        if target.startswith(f"{os.path.realpath(root)}/") and os.path.isfile(target):
            held.append(target)
    return held


def test_a_bounded_stream_is_served_from_its_oldest_frame(server_factory, managed_dir: Path) -> None:
    """On a stream that keeps 4 frames, a client starting at frame 0 after 6 were retired gets
    the 4 kept ones and is told how many it missed; sessions leave no descriptor open."""
    _frames("kept", 10, 10, retain=4, on_full="drop-oldest")
    srv = server_factory("kept")
    for i in range(5):
        client = IMDClient("127.0.0.1", srv.port, 10, multithreaded=False, timeout=30)
        assert _all_steps(client) == [6, 7, 8, 9]
        client.stop()
        assert srv.wait_clients(i + 1, timeout=30)
        assert _files_open_under(managed_dir / "kept") == []  # (each released its frames)
    assert all(r.ended and r.frames == 4 and r.missed == 6 for r in srv.reports), srv.reports


def test_a_slow_but_steady_client_is_not_taken_for_a_stalled_one(server_factory,
                                                                  monkeypatch) -> None:
    """The stall limit is on a client taking none of a frame's bytes, not on the time a whole
    frame takes: a client that reads steadily, but needs several times the limit for one large
    frame (a slow link), is served to the end. (``sendall`` bounded the whole frame by the
    limit: it was cut off after the limit with "took no data".)"""
    from instride.md import imd_server

    monkeypatch.setattr(imd_server, "_CLIENT_STALL_S", 1.0)
    _frames("steady", 1, 1_000_000)  # one frame of 12 MB of positions
    srv = server_factory("steady")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        sock.sendall(encode_header(MsgType.GO, 0))
        got = 0
        while chunk := sock.recv(1 << 16):  # ~3 MB/s: 12 MB take ~4 s
            got += len(chunk)
            time.sleep(0.02)
    assert got > 12_000_000
    assert srv.wait_clients(1, timeout=30)
    report = srv.reports[0]
    assert report.ended and report.error is None and report.frames == 1, report


def test_a_session_that_ends_closes_the_clients_connection_at_once(server_factory) -> None:
    """A session that ends on the server's side (here: no frame from the producer within the
    server's ``timeout``) shuts the client's connection down at once: the client reads the end
    of the connection, not silence until the server's blocked read gives up (60 s). While it
    lasts, the connection has TCP keep-alive on (a client that vanished without a word is
    found)."""
    srv = server_factory("nothing-comes", timeout=1.0)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as sock:
        sock.sendall(encode_header(MsgType.GO, 0))
        deadline = time.monotonic() + 10
        while not srv._sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        with srv._lock:
            conns = [s.conn for s in srv._sessions]
        if conns:  # (the session may have ended already: checked on the report below)
            with contextlib.suppress(OSError):
                assert conns[0].getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        while sock.recv(1 << 16):  # the handshake, then the end (a timeout: silence)
            pass
    assert srv.wait_clients(1, timeout=30)
    assert srv.reports[0].error == "no frame from the producer for 1.0 s", srv.reports


def test_an_error_after_the_end_is_not_reported_as_a_clean_end(server_factory) -> None:
    """A client that read every frame and the end, then sent a message of an unknown type:
    the report says what went wrong and does not also claim a clean end (it said both)."""
    _frames("done", 3, 10)
    srv = server_factory("done")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(encode_header(MsgType.GO, 0))
        while sock.recv(1 << 16):  # the handshake, 3 frames, then the end
            pass
        sock.sendall(struct.pack("!ii", 99, 0))  # (type 99: no IMD message)
    assert srv.wait_clients(1, timeout=30)
    report = srv.reports[0]
    assert report.frames == 3 and not report.ended, report
    assert report.error == "unknown IMD message type 99 (after the end of the stream was sent)"


def test_a_client_that_never_closes_after_the_end_is_no_clean_end(
        server_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that read every frame and the end but never closed its side: the server gave up
    waiting for it and reported a clean end (``ended``, no error), as for one that closed."""
    from instride.md import imd_server

    monkeypatch.setattr(imd_server, "_CLIENT_STALL_S", 1.0)
    _frames("open", 2, 10)
    srv = server_factory("open")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(encode_header(MsgType.GO, 0))
        while sock.recv(1 << 16):  # the handshake, 2 frames, then the end
            pass
        assert srv.wait_clients(1, timeout=30)  # (while this side stays open)
    report = srv.reports[0]
    assert report.frames == 2 and not report.ended, report
    assert "did not close within 1 s after the end" in (report.error or ""), report


class _AcceptFailsOnce:
    """A listener whose first ``accept`` fails as one does when the process is out of
    descriptors (``EMFILE``); then the real listener's."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener, self.failed = listener, False

    def accept(self) -> tuple[socket.socket, object]:
        if not self.failed:
            self.failed = True
            raise OSError(errno.EMFILE, "Too many open files")
        return self.listener.accept()

    def close(self) -> None:
        self.listener.close()


def test_a_failed_accept_loses_a_connection_not_the_server(managed_dir: Path) -> None:
    """An ``accept`` that fails for a reason other than the server closing (out of
    descriptors, a connection aborted first) is logged and accepting goes on: the next client
    is served. (The accepting thread used to end, the listener staying open: clients connected
    and waited for a handshake that never came.)"""
    _frames("acc", 2, 10)
    srv = IMDServer("acc")
    srv._listener = _AcceptFailsOnce(srv._listener)  # type: ignore[assignment]
    with srv.start():
        client = IMDClient("127.0.0.1", srv.port, 10, multithreaded=False, timeout=30)
        try:
            assert _all_steps(client) == [0, 1]
        finally:
            client.stop()
        assert srv._listener.failed  # type: ignore[attr-defined]


def test_a_session_whose_stream_cannot_be_opened_ends_with_the_reason(server_factory,
                                                                      monkeypatch) -> None:
    """The stream cannot be opened for a client (Redis out of reach in cluster mode, no
    descriptors left): that session ends with the reason in its report and the client's
    connection closed, instead of a thread dying with it open and the report never made."""
    from instride.errors import MetadataUnavailable
    from instride.md import imd_server

    class Unreachable(imd_server.Stream):  # type: ignore[name-defined,misc]
        def __init__(self, *args: object, **kw: object) -> None:
            raise MetadataUnavailable("redis://10.0.0.1:6379/0", "connection refused")

    srv = server_factory("away")
    monkeypatch.setattr(imd_server, "Stream", Unreachable)  # (for the sessions from now on)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as sock:
        assert sock.recv(1 << 16) == b""  # closed, no handshake
    assert srv.wait_clients(1, timeout=30)
    assert "connection refused" in (srv.reports[0].error or ""), srv.reports


def test_clients_beyond_max_clients_are_refused_and_served_later(server_factory) -> None:
    """Each session holds two threads and a socket: past ``max_clients`` sessions at once, a
    client's connection is closed before the handshake (it used to get a session of its own,
    without bound); once a session ends, the next client is served."""
    _frames("few", 3, 10)
    srv = server_factory("few", max_clients=1)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as first:
        assert first.recv(1 << 16)  # (its handshake: its session holds the one place)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as second:
            assert second.recv(1 << 16) == b""  # refused: closed, no handshake
    assert srv.wait_clients(1, timeout=30)  # (the first left without IMD_GO)
    client = IMDClient("127.0.0.1", srv.port, 10, multithreaded=False, timeout=30)
    try:
        assert _all_steps(client) == [0, 1, 2]
    finally:
        client.stop()
    with pytest.raises(instride.ConfigError, match="max_clients"):
        IMDServer("few", max_clients=0)


def _handshake_and_leave(port: int) -> None:
    """A client that takes the handshake and leaves before IMD_GO."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        assert sock.recv(1 << 16)


def test_reports_are_bounded_and_close_may_come_from_a_callback(server_factory,
                                                                monkeypatch) -> None:
    """A server that serves for ever keeps the reports of its last sessions, not of every
    session (it grew by one per client, without bound), while ``wait_clients`` counts them
    all; and ``on_client_done`` may close the server (it raised: a thread cannot join
    itself, and the other threads were left unjoined)."""
    from instride.md import imd_server

    monkeypatch.setattr(imd_server, "_REPORTS_KEPT", 2)
    _frames("kept", 2, 10)
    raised: list[BaseException] = []
    srv: IMDServer | None = None

    def done(report: object) -> None:
        assert srv is not None
        if srv._ended >= 3:  # (the third session: stop the server from its own thread)
            try:
                srv.close()
            except BaseException as exc:  # noqa: BLE001 (what it raised is the result)
                raised.append(exc)

    srv = server_factory("kept", on_client_done=done)
    for k in range(1, 4):
        _handshake_and_leave(srv.port)
        assert srv.wait_clients(k, timeout=30)
    assert srv._ended == 3 and len(srv.reports) == 2
    deadline = time.monotonic() + 10
    while not srv._stop.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv._stop.is_set() and raised == []


def test_a_session_thread_not_to_be_had_refuses_that_client_only(server_factory,
                                                                 monkeypatch) -> None:
    """No thread can be started for a client's session (the process is out of threads):
    that client's connection is closed, and the next one is served; ``close()`` works. The
    accepting thread died of it, its session kept a place for ever, and ``close()`` raised."""
    _frames("nothread", 2, 10)
    srv = server_factory("nothread", max_clients=1)
    real_start = threading.Thread.start
    refused = []

    def start(self: threading.Thread) -> None:
        if self.name.startswith("imd-127.") and not refused:
            refused.append(self.name)
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as sock:
        assert sock.recv(1 << 16) == b""  # closed, no handshake
    assert refused
    _handshake_and_leave(srv.port)  # (served: its handshake came)
    assert srv.wait_clients(1, timeout=30)
    srv.close()
