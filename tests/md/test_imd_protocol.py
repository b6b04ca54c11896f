"""The IMD wire format instride writes, parsed by imdclient's own client (both byte orders)."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
from imdclient.IMDClient import IMDClient

from instride.md.imd_protocol import (
    MsgType,
    SessionInfo,
    client_body_size,
    decode_header,
    encode_frame_packets,
    encode_handshake,
    encode_header,
)


@pytest.mark.parametrize("order", ["<", ">"])
def test_v3_frame_with_every_part_reads_back_in_imdclient(order: str) -> None:
    rng = np.random.default_rng(1)
    natoms = 5
    pos, vel, frc = (rng.normal(size=(natoms, 3)).astype(np.float32) for _ in range(3))
    box = np.diag([10.0, 11.0, 12.0])
    info = SessionInfo(time=True, energies=True, box=True, positions=True, velocities=True,
                       forces=True)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(encode_handshake(3, order, info))
            assert decode_header(conn.recv(8))[0] == MsgType.GO
            conn.sendall(b"".join(encode_frame_packets(
                3, pos, step=42, time=0.084, dt=0.002, box=box, velocities=vel, forces=frc,
                session=info, order=order)))
            conn.shutdown(socket.SHUT_WR)
            while conn.recv(4096):
                pass

    t = threading.Thread(target=serve)
    t.start()
    try:
        client = IMDClient("127.0.0.1", port, natoms, multithreaded=False, timeout=10)
        s = client.get_imdsessioninfo()
        assert (s.version, s.endianness, s.velocities, s.forces, s.energies) == (3, order, True, True, True)
        f = client.get_imdframe()
        assert (f.step, f.time, f.dt) == (42, pytest.approx(0.084), pytest.approx(0.002))
        np.testing.assert_array_equal(f.positions, pos)
        np.testing.assert_array_equal(f.velocities, vel)
        np.testing.assert_array_equal(f.forces, frc)
        np.testing.assert_allclose(f.box, box)
        assert f.energies["step"] == 42
        with pytest.raises(EOFError):
            client.get_imdframe()
    finally:
        t.join(10)
        listener.close()


def test_handshake_and_client_messages() -> None:
    with pytest.raises(ValueError, match="IMD version"):
        encode_handshake(4)
    v2 = encode_handshake(2, "<")
    assert len(v2) == 8 and decode_header(v2[:4] + b"\0\0\0\0")[0] == MsgType.HANDSHAKE
    assert int.from_bytes(v2[4:], "little") == 2
    assert client_body_size(MsgType.MDCOMM, 3) == 48  # 3 indices + 9 floats
    assert client_body_size(MsgType.PAUSE, 0) == 0
    assert encode_header(MsgType.TRATE, 5) == b"\0\0\0\x08\0\0\0\x05"
