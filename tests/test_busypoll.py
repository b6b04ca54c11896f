"""Busy-polling before sleeping (instride.busypoll): what INSTRIDE_SPIN and Stream(spin=) use."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from instride.busypoll import poll_paths, poll_readable, recv_polling


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
