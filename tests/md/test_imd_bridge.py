"""imd-bridge against a scripted IMD v3 engine: how its connection ends decides whether the
stream is complete (end of stream written) or broken (a typed error, no end marker)."""

from __future__ import annotations

import contextlib
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import instride
from instride.md.imd_bridge import EngineUnavailable, IMDProtocolError, bridge
from instride.md.imd_protocol import HEADER_SIZE, SessionInfo, encode_frame_packets, encode_handshake
from tests.conftest import files_held, finish

NATOMS = 50


def _frame(i: int, info: SessionInfo) -> bytes:
    pos = np.full((NATOMS, 3), float(i))
    return b"".join(encode_frame_packets(3, pos, step=i, time=0.5 * i, dt=0.5, box=np.eye(3) * 9,
                                         session=info, order="<"))


@pytest.fixture
def engine() -> Iterator[Callable[..., int]]:
    """``engine(script, info)``: a one-client IMD v3 engine on a free port; after the handshake
    and the client's GO it calls ``script(conn)``, then closes."""
    threads: list[threading.Thread] = []
    listeners: list[socket.socket] = []

    def start(script: Callable[[socket.socket], None], info: SessionInfo = SessionInfo(),
              handshake_after: float = 0.0) -> int:
        listener = socket.create_server(("127.0.0.1", 0))
        listeners.append(listener)

        def serve() -> None:
            conn, _ = listener.accept()
            with conn, contextlib.suppress(OSError):  # (a client that gave up: gone)
                time.sleep(handshake_after)
                conn.sendall(encode_handshake(3, "<", info))
                conn.recv(HEADER_SIZE)  # (GO)
                script(conn)

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        threads.append(t)
        return listener.getsockname()[1]

    yield start
    for listener in listeners:
        listener.close()
    for t in threads:
        t.join(10)


def test_a_run_that_ends_between_frames_is_complete(managed_dir: Path, engine) -> None:
    port = engine(lambda c: c.sendall(_frame(0, SessionInfo()) + _frame(1, SessionInfo())))
    report = bridge(f"127.0.0.1:{port}", "whole", NATOMS, connect_timeout=10, timeout=10)
    assert report.frames == 2
    s = instride.Stream("whole")
    assert s.ended and [f.step for f in s] == [0, 1]


def test_no_timeout_waits_for_a_slow_engine(managed_dir: Path, engine) -> None:
    """``timeout=inf`` (``--timeout inf``: wait for the engine as long as it runs) bridges a
    run whose frames come with pauses; it used to fail before connecting (imdclient compared
    the missing limit with a number: ``TypeError``)."""
    import math
    import time

    def slow(c: socket.socket) -> None:
        c.sendall(_frame(0, SessionInfo()))
        time.sleep(1.5)  # (a pause between frames)
        c.sendall(_frame(1, SessionInfo()))

    port = engine(slow)
    report = bridge(f"127.0.0.1:{port}", "endless", NATOMS, connect_timeout=10, timeout=math.inf)
    assert report.frames == 2
    s = instride.Stream("endless")
    assert s.ended and [f.step for f in s] == [0, 1]


def test_a_handshake_waits_as_long_as_connect_timeout(managed_dir: Path, engine) -> None:
    """An engine slow to send its handshake is waited for within ``connect_timeout``, not
    imdclient's own 5 s (after which the bridge used to drop the connection and retry)."""
    port = engine(lambda c: c.sendall(_frame(0, SessionInfo())), handshake_after=6.0)
    report = bridge(f"127.0.0.1:{port}", "slowhs", NATOMS, connect_timeout=30, timeout=10)
    assert report.frames == 1 and instride.Stream("slowhs").ended
    # ... and no longer than it: an engine that never sends one is given up on in time
    port = engine(lambda c: None, handshake_after=3.0)
    t0 = time.monotonic()
    with pytest.raises(EngineUnavailable, match="no IMD handshake"):
        bridge(f"127.0.0.1:{port}", "nohs", NATOMS, connect_timeout=1.0, timeout=10)
    assert time.monotonic() - t0 < 4.5  # (imdclient's 5 s would have been waited out)


def test_a_frame_cut_short_is_a_protocol_error_and_no_end(managed_dir: Path, engine) -> None:
    port = engine(lambda c: c.sendall(_frame(0, SessionInfo()) + _frame(1, SessionInfo())[:-20]))
    with pytest.raises(IMDProtocolError, match="middle of frame 1") as info:
        bridge(f"127.0.0.1:{port}", "cut", NATOMS, connect_timeout=10, timeout=10)
    # the stream it opened is let go of: nothing held, while the traceback (which holds the
    # stream object) is alive
    assert info.value is not None and files_held(managed_dir) == []
    s = instride.Stream("cut", timeout=0)
    assert not s.ended and s.published() == [0]  # (the whole frame is kept, no end)


def test_a_reset_connection_is_a_protocol_error_and_no_end(managed_dir: Path, engine) -> None:
    def reset(c: socket.socket) -> None:
        c.sendall(_frame(0, SessionInfo()))
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close: RST

    port = engine(reset)
    with pytest.raises(IMDProtocolError, match="reset"):
        bridge(f"127.0.0.1:{port}", "reset", NATOMS, connect_timeout=10, timeout=10)
    assert not instride.Stream("reset").ended


def test_a_session_without_positions_is_refused(managed_dir: Path, engine) -> None:
    info = SessionInfo(positions=False)
    port = engine(lambda c: c.sendall(_frame(0, info)), info)
    with pytest.raises(IMDProtocolError, match="no positions"):
        bridge(f"127.0.0.1:{port}", "nopos", NATOMS, connect_timeout=10, timeout=10)
    assert not instride.Stream("nopos").ended


def test_timeouts_are_checked(managed_dir: Path) -> None:
    for bad in (0, -1, float("nan")):
        with pytest.raises(instride.ConfigError, match="timeout"):
            bridge("127.0.0.1:1", "t", NATOMS, timeout=bad)
    for bad in (float("inf"), 1e7):  # (1e7 s: poll()'s milliseconds overflowed, a traceback)
        with pytest.raises(instride.ConfigError, match="connect_timeout"):
            bridge("127.0.0.1:1", "t", NATOMS, connect_timeout=bad)
    # whole numbers: every=1.5 truncated the steps silently, natoms=4.0 was a TypeError
    for name, bad in (("every", 1.5), ("natoms", 4.0), ("first_step", -5), ("every", True)):
        with pytest.raises(instride.ConfigError, match=name):
            bridge("127.0.0.1:1", "t", **{"natoms": NATOMS, name: bad})  # type: ignore[arg-type]
    for bad in (float("nan"), float("inf"), -0.002):  # (went out as every frame's time)
        with pytest.raises(instride.ConfigError, match="dt"):
            bridge("127.0.0.1:1", "t", NATOMS, dt=bad, connect_timeout=0.3)
    # the command line: 0 is refused (usage, status 2); nothing listening is "unavailable" (6)
    for args, status in ((["--timeout", "0"], 2), (["--connect-timeout", "0.3"], 6)):
        proc = subprocess.Popen([sys.executable, "-m", "instride", "imd-bridge", "127.0.0.1:1", "t",
                                 "--natoms", "5", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        rc, _out, err = finish(proc, timeout=60)
        assert rc == status, err
    assert not instride.Stream("t").ended


def test_a_bridge_without_a_limit_has_the_kernel_probe_its_engine() -> None:
    """``timeout=inf`` waited on a socket with no keepalive: an engine whose host crashed or
    was cut off sends no FIN, and the bridge waited for ever. The connection is probed."""
    import socket

    from instride.md.imd_bridge import KEEPALIVE_COUNT, KEEPALIVE_IDLE, _keepalive

    with socket.socket() as s:
        _keepalive(s)
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == KEEPALIVE_COUNT
