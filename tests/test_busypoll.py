"""Busy-polling before sleeping (instride.busypoll): what INSTRIDE_SPIN and Stream(spin=) use."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from instride.busypoll import (
    LEAD_MAX,
    LEAD_MIN,
    Cadence,
    arrived,
    poll_paths,
    poll_readable,
    recv_polling,
)


def test_poll_paths_sees_a_file_renamed_into_place(tmp_path: Path) -> None:
    target = tmp_path / "frame"
    other = tmp_path / "end"

    def publish() -> None:
        (tmp_path / "tmp").write_bytes(b"x")
        (tmp_path / "tmp").rename(target)

    timer = threading.Timer(0.05, publish)
    timer.start()
    start = time.monotonic()
    assert poll_paths([str(target), str(other)], 5.0) == str(target)
    assert time.monotonic() - start < 4.0
    timer.join()
    assert poll_paths([other], 0.05) is None  # nothing comes: None once the time is up
    assert poll_paths([target], 0.0) is None  # no spin asked: no look either


def test_recv_polling_gets_data_nothing_or_the_close() -> None:
    a, b = socket.socketpair()
    try:
        a.settimeout(7.0)
        assert recv_polling(a, 100, 0.05) is None  # nothing sent
        assert a.gettimeout() == 7.0  # the socket's timeout is restored
        threading.Timer(0.05, lambda: b.sendall(b"hello")).start()
        assert recv_polling(a, 100, 5.0) == b"hello"
        b.close()
        assert recv_polling(a, 100, 1.0) == b""  # the peer closed it
    finally:
        a.close()
        b.close()


def test_poll_readable_leaves_the_data_to_the_next_recv() -> None:
    a, b = socket.socketpair()
    try:
        a.settimeout(3.0)
        assert poll_readable(a, 0.05) is False
        b.sendall(b"reply")
        assert poll_readable(a, 1.0) is True
        assert a.gettimeout() == 3.0
        assert a.recv(100) == b"reply"  # peeked, not consumed
    finally:
        a.close()
        b.close()


def test_cadence_predicts_the_next_frame_from_the_ones_waited_for() -> None:
    c = Cadence()
    for i in range(3):  # two gaps: not enough to go by
        c.arrived(i, 10.0 + 0.02 * i, waited=True)
        assert c.window(i + 1) is None
    c.arrived(3, 10.06, waited=True)
    start, end = c.window(4)  # due at 10.08; a regular producer: 5 % of the gap either side
    assert abs((start + end) / 2 - 10.08) < 1e-9 and abs((end - start) / 2 - 0.001) < 1e-9
    start, end = c.window(6)  # two frames ahead: two gaps on
    assert abs((start + end) / 2 - 10.12) < 1e-9
    assert c.window(3) is None  # (the one it has)
    c.arrived(4, 10.50, waited=False)  # there already: the reader was behind
    assert c.window(5) is None  # nothing to count from
    c.arrived(5, 10.52, waited=True)  # no gap measured across the frame found there ...
    start, end = c.window(6)  # ... the cadence is still the one learned
    assert abs((start + end) / 2 - 10.54) < 1e-9


def test_cadence_polls_longer_for_an_irregular_producer_within_bounds() -> None:
    c = Cadence()
    for i, t in enumerate([0.0, 0.010, 0.021, 0.030, 0.041, 0.050]):  # gaps 10, 11, 9, 11, 9 ms
        c.arrived(i, t, waited=True)
    start, end = c.window(6)  # 5 % of 10 ms plus three deviations of 1 ms
    assert abs((end - start) / 2 - 0.0035) < 1e-9
    fast = Cadence()
    for i in range(5):  # frames every 100 µs: at least LEAD_MIN
        fast.arrived(i, 1e-4 * i, waited=True)
    start, end = fast.window(5)
    assert abs((end - start) / 2 - LEAD_MIN) < 1e-12
    slow = Cadence()
    for i in range(5):  # every 10 s: at most LEAD_MAX
        slow.arrived(i, 10.0 * i, waited=True)
    start, end = slow.window(5)
    assert abs((end - start) / 2 - LEAD_MAX) < 1e-9


def test_cadence_does_not_mix_arrival_and_publication_clocks() -> None:
    """A reader that found one frame on its node, then fetches the next ones, learns anew from
    their publication times (a wall clock) instead of mixing them with monotonic arrivals."""
    c = Cadence()
    for i in range(4):
        c.arrived(i, 100.0 + 0.02 * i, waited=True)
    assert c.window(4) is not None
    c.arrived(4, 100.09, waited=True, published=1.7e9)  # now fetched: publication times
    assert c.window(5) is None  # (only one such frame: nothing learned yet)
    for i in range(5, 9):
        c.arrived(i, 100.09 + 0.02 * (i - 4), waited=True, published=1.7e9 + 0.02 * (i - 4))
    start, end = c.window(9)
    assert abs((start + end) / 2 - (100.09 + 0.02 * 5)) < 1e-6  # on the arrival clock


def test_arrived_takes_what_is_there_and_never_waits() -> None:
    a, b = socket.socketpair()
    try:
        a.settimeout(5)
        t0 = time.monotonic()
        assert arrived(a, 10) == b""  # nothing yet: at once, not after the timeout
        assert time.monotonic() - t0 < 4
        b.sendall(b"hello world")
        deadline = time.monotonic() + 5
        got = b""
        while len(got) < 11 and time.monotonic() < deadline:
            got += arrived(a, 4 if not got else 100)
        assert got == b"hello world"
        b.sendall(b"x")
        a.settimeout(None)  # a blocking socket: left to the caller's usual receive
        assert arrived(a, 10) == b""
        assert a.recv(10) == b"x"
        a.settimeout(5)
        b.close()
        assert arrived(a, 10) == b""  # (the peer closed: the usual receive says so)
        assert a.recv(10) == b""
    finally:
        a.close()
        b.close()
