"""The IMD wire protocol, versions 2 and 3: message types, headers, handshake, frame packets.

IMD (*Interactive Molecular Dynamics*) is the socket protocol GROMACS, NAMD and LAMMPS use to
stream a running simulation. A message is an 8-byte header, two big-endian int32 (type,
length), followed by a body. The server (the engine, or :mod:`instride.md.imd_server`) opens
with a handshake: header type ``HANDSHAKE`` whose length field is the version, written in the
*server's* byte order (the client learns the byte order of all bodies from it). Version 3 then
sends ``SESSIONINFO`` (7 flag bytes: time, energies, box, positions, wrapped, velocities,
forces); the client answers ``GO``. Per frame, version 3 sends only the enabled parts, in the
order TIME, ENERGIES, BOX, FCOORDS, VELOCITIES, FORCES; version 2 sends (ENERGIES and)
FCOORDS. Clients may send PAUSE / RESUME (v3; in v2 PAUSE toggles), TRATE (send every n-th
frame), WAIT, MDCOMM (forces to apply; a body of ``n`` int32 indices and ``3n`` float32),
KILL and DISCONNECT.

Reference: the protocol description of the ``imdclient`` package (``protocol_v3``) and its
``IMDProtocol.py``; this module encodes what instride sends and parses what it receives, and
the bridge (:mod:`instride.md.imd_bridge`) receives through ``imdclient`` itself.
"""

from __future__ import annotations

import enum
import socket
import struct
from dataclasses import dataclass

import numpy as np

__all__ = [
    "HEADER_SIZE",
    "VERSIONS",
    "MsgType",
    "SessionInfo",
    "client_body_size",
    "encode_frame_packets",
    "encode_handshake",
    "encode_header",
    "decode_header",
    "recv_exact",
]

HEADER_SIZE = 8
VERSIONS = (2, 3)
_HEADER = struct.Struct("!ii")


class MsgType(enum.IntEnum):
    """IMD message types (header ``type`` field); 10-16 are new in version 3."""

    DISCONNECT = 0
    ENERGIES = 1
    FCOORDS = 2
    GO = 3
    HANDSHAKE = 4
    KILL = 5
    MDCOMM = 6
    PAUSE = 7
    TRATE = 8
    IOERROR = 9
    SESSIONINFO = 10
    RESUME = 11
    TIME = 12
    BOX = 13
    VELOCITIES = 14
    FORCES = 15
    WAIT = 16


@dataclass(frozen=True)
class SessionInfo:
    """What a v3 server sends with every frame (the SESSIONINFO flags)."""

    time: bool = True
    energies: bool = False
    box: bool = True
    positions: bool = True
    wrapped: bool = False
    velocities: bool = False
    forces: bool = False

    def encode(self, order: str = "<") -> bytes:
        """The SESSIONINFO message: header plus 7 flag bytes."""
        flags = (self.time, self.energies, self.box, self.positions, self.wrapped,
                 self.velocities, self.forces)
        return encode_header(MsgType.SESSIONINFO, 7) + struct.pack(f"{order}7B", *map(int, flags))


def encode_header(kind: MsgType, length: int) -> bytes:
    """An 8-byte IMD header (network byte order)."""
    return _HEADER.pack(int(kind), int(length))


def decode_header(buf: bytes) -> tuple[int, int]:
    """``(type, length)`` of an 8-byte header; the type is returned as an int (it may be unknown)."""
    kind, length = _HEADER.unpack(buf)
    return kind, length


def encode_handshake(version: int, order: str = "<", session: SessionInfo | None = None) -> bytes:
    """The server's opening: HANDSHAKE (version in the server's byte order), and for v3 SESSIONINFO.

    Raises
    ------
    ValueError
        An unsupported version.
    """
    if version not in VERSIONS:
        raise ValueError(f"IMD version must be one of {VERSIONS}, got {version}")
    out = struct.pack("!i", int(MsgType.HANDSHAKE)) + struct.pack(f"{order}i", version)
    if version == 3:
        out += (session or SessionInfo()).encode(order)
    return out


def _xyz(kind: MsgType, data: np.ndarray, order: str) -> list[bytes]:
    arr = np.ascontiguousarray(data, dtype=f"{order}f4")
    return [encode_header(kind, arr.shape[0]), arr.tobytes()]


def encode_frame_packets(
    version: int,
    positions: np.ndarray,
    *,
    step: int,
    time: float,
    dt: float,
    box: np.ndarray | None = None,
    velocities: np.ndarray | None = None,
    forces: np.ndarray | None = None,
    session: SessionInfo | None = None,
    order: str = "<",
) -> list[bytes]:
    """The messages of one frame, in protocol order (a list of byte strings to send).

    Parameters
    ----------
    version
        2 (positions only) or 3 (the parts ``session`` enables).
    positions
        ``(natoms, 3)`` coordinates in Å.
    step, time, dt
        MD step, time (ps) and ps per step (v3 TIME packet).
    box
        ``(3, 3)`` box vectors in Å (zeros when ``None``).
    velocities, forces
        ``(natoms, 3)`` arrays (zeros when ``None`` but enabled in ``session``).
    session
        The flags announced in the handshake (v3).
    order
        Byte order of the bodies, as announced in the handshake (``"<"`` or ``">"``).
    """
    if version == 2:
        return _xyz(MsgType.FCOORDS, positions, order)
    s = session or SessionInfo()
    parts: list[bytes] = []
    if s.time:
        parts += [encode_header(MsgType.TIME, 1), struct.pack(f"{order}ddq", dt, time, step)]
    if s.energies:  # instride frames carry no energies: step, then nine zeros
        parts += [encode_header(MsgType.ENERGIES, 1), struct.pack(f"{order}i9f", step, *([0.0] * 9))]
    if s.box:
        b = np.zeros((3, 3)) if box is None else np.asarray(box, dtype=np.float64).reshape(3, 3)
        parts += [encode_header(MsgType.BOX, 1), np.ascontiguousarray(b, dtype=f"{order}f4").tobytes()]
    n = positions.shape[0]
    if s.positions:
        parts += _xyz(MsgType.FCOORDS, positions, order)
    if s.velocities:
        parts += _xyz(MsgType.VELOCITIES, np.zeros((n, 3)) if velocities is None else velocities, order)
    if s.forces:
        parts += _xyz(MsgType.FORCES, np.zeros((n, 3)) if forces is None else forces, order)
    return parts


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """Receive exactly ``n`` bytes; ``None`` when the peer closed the connection first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def client_body_size(kind: int, length: int) -> int:
    """Bytes of body that follow a client message's header (only MDCOMM has one)."""
    if kind == MsgType.MDCOMM:
        return 16 * max(length, 0)  # n int32 atom indices + 3n float32 forces
    return 0
