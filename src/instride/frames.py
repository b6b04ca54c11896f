"""The MD frame file format (``.isf``).

A frame file is a fixed 128-byte little-endian header followed by the coordinates.

======  ====  ==========================================================
offset  size  field
======  ====  ==========================================================
0       4     magic ``b"ISF1"``
4       2     format version (1)
6       2     layout: 1 = ``xyz32``, 2 = ``paper``, 3 = ``paper-soa``
8       8     number of atoms (uint64)
16      8     MD step (int64)
24      8     simulation time in ps (float64)
32      72    box vectors, 3 x 3 float64 in Å (all zero: no box)
104     8     payload size in bytes (uint64)
112     8     payload checksum, xxh3-64
120     8     header checksum, xxh3-64 of bytes 0-119
======  ====  ==========================================================

Layouts:

* ``xyz32`` — 3 x float32 per atom (12 B/atom), the compact default.
* ``paper`` — int32 atom id + 3 x float64 (28 B/atom), the serialization of the DYAD study,
  which gives its Table I frame sizes (23,558 atoms -> 644.29 KiB, Table I: 644.21 KiB;
  1,066,628 atoms -> 28.48 MiB).
* ``paper-soa`` — the same bytes per atom as ``paper`` (so the same frame sizes), stored as
  arrays instead of records: all coordinates (``natoms x 3`` float64), then all ids (int32).
  Coordinates are then one contiguous array: writing and copying them run at memory speed,
  where the interleaved ``paper`` records cost a strided pass each way.

Positions are in Å, as in MDAnalysis. Reading verifies both checksums and raises
:class:`~instride.errors.IntegrityError` on any mismatch; coordinates are returned as numpy
views of the buffer read (no copy).

Examples
--------
>>> import numpy as np, io
>>> buf = io.BytesIO()
>>> _ = write_frame(buf, np.zeros((3, 3), dtype=np.float32), step=10, time=0.02)
>>> read_frame(buf.getvalue()).step
10
"""

from __future__ import annotations

import ctypes
import io as _io
import mmap
import os
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO, NamedTuple

import numpy as np
import xxhash

from .errors import IntegrityError
from .native import library

MAGIC = b"ISF1"
VERSION = 1
HEADER_SIZE = 128
#: Frame files at least this large are memory-mapped by :func:`read_frame` instead of read.
MMAP_THRESHOLD = 1 << 20
_HEADER = struct.Struct("<4sHHQqd9dQQ")  # 120 bytes, followed by the header checksum
_HCHECK = struct.Struct("<Q")
assert _HEADER.size + _HCHECK.size == HEADER_SIZE

LAYOUTS: dict[str, int] = {"xyz32": 1, "paper": 2, "paper-soa": 3}
_LAYOUT_NAMES = {v: k for k, v in LAYOUTS.items()}
PAPER_DTYPE = np.dtype([("id", "<i4"), ("xyz", "<f8", (3,))])
assert PAPER_DTYPE.itemsize == 28
_XYZ32 = np.dtype("<f4")
_F64 = np.dtype("<f8")
_I32 = np.dtype("<i4")
#: Paper records with the coordinates as one opaque 24-byte field: assigning a contiguous
#: (natoms, 3) float64 array through it is one 24-byte copy per atom (about 1.7x faster
#: than through the (3,) float64 sub-array field).
_PAPER_RAW = np.dtype([("id", "<i4"), ("xyz", "V24")])
#: Atoms encoded and hashed per chunk, so each chunk is hashed while still in the CPU cache.
_CHUNK_BYTES = 1 << 18
#: the C codec of the paper layout writes and reads little-endian records in native order
_NATIVE_LE = sys.byteorder == "little"

_open = _io.open  # the builtin, captured before instride.interception.pyopen may patch it


_BYTES_PER_ATOM = {"xyz32": 12, "paper": 28, "paper-soa": 28}


def bytes_per_atom(layout: str) -> int:
    """Bytes of payload per atom for ``layout`` (``"xyz32"``: 12, ``"paper"``: 28).

    Raises
    ------
    ValueError
        An unknown layout.
    """
    try:
        return _BYTES_PER_ATOM[layout]
    except KeyError:  # (a bare KeyError named no layout)
        raise ValueError(f"unknown layout {layout!r}; expected one of {sorted(LAYOUTS)}") from None


def frame_size(natoms: int, layout: str = "xyz32") -> int:
    """Size in bytes of a frame file.

    Parameters
    ----------
    natoms
        Number of atoms.
    layout
        ``"xyz32"``, ``"paper"`` or ``"paper-soa"``.

    Returns
    -------
    int
        Header plus payload bytes.

    Raises
    ------
    ValueError
        An unknown layout.

    Examples
    --------
    >>> frame_size(23_558, "paper")
    659752
    """
    return HEADER_SIZE + natoms * bytes_per_atom(layout)


class FrameHeader(NamedTuple):
    """The header fields of a frame, readable without touching the payload.

    (A named tuple: a reader makes one per frame, in a single step.)
    """

    natoms: int
    step: int
    time: float
    box: np.ndarray  # (3, 3) float64, zeros when there is no box
    layout: str
    payload_nbytes: int
    payload_checksum: int

    @property
    def has_box(self) -> bool:
        """Whether the frame carries box vectors."""
        return bool(np.any(self.box))


@dataclass(frozen=True)
class Frame:
    """A decoded frame: header fields plus coordinates.

    Attributes
    ----------
    header
        The :class:`FrameHeader`.
    positions
        ``(natoms, 3)`` array in Å: float32 for ``xyz32``, float64 (a strided view) for ``paper``.
    ids
        ``(natoms,)`` int32 atom ids for the ``paper`` layout, else ``None``.
    """

    header: FrameHeader
    positions: np.ndarray
    ids: np.ndarray | None = None
    #: Called by :meth:`release`: lets the storage behind the views be reused.
    releaser: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def release(self) -> None:
        """Give the frame's storage back; its arrays must not be used afterwards.

        Frames read from a stream with retention are views of the mapped frame file. The
        file is never changed while a reader holds it; :class:`~instride.Stream` releases
        the previous frame when the reader moves on, or call this (or use the frame as a
        context manager) to release it earlier. Copy arrays you want to keep
        (``frame.positions.copy()``). No-op for frames that own their memory.
        """
        if self.releaser is not None:
            self.releaser()

    def __enter__(self) -> Frame:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @property
    def natoms(self) -> int:
        """Number of atoms."""
        return self.header.natoms

    @property
    def step(self) -> int:
        """MD step."""
        return self.header.step

    @property
    def time(self) -> float:
        """Simulation time (ps)."""
        return self.header.time

    @property
    def box(self) -> np.ndarray:
        """``(3, 3)`` box vectors in Å (zeros: no box)."""
        return self.header.box


def _checksum(data: bytes | memoryview | np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(data)


def _box_vector(box: np.ndarray | None) -> list[float]:
    boxv = np.zeros(9) if box is None else np.asarray(box, dtype=np.float64).reshape(-1)
    if boxv.size == 3:  # orthorhombic lengths
        boxv = np.diag(boxv).reshape(-1)
    if boxv.size != 9:
        raise ValueError("box must be None, 3 lengths or a 3 x 3 matrix of box vectors")
    return boxv.tolist()  # type: ignore[no-any-return]


def _checked_ids(ids: np.ndarray, natoms: int) -> np.ndarray:
    """``ids`` as an array of ``natoms`` ids; :class:`ValueError` for another shape."""
    ids = np.asarray(ids)
    if ids.shape != (natoms,):
        raise ValueError(f"ids must have shape ({natoms},), got {ids.shape}")
    return ids


def _step(step: int) -> int:
    """``step`` as the int64 a frame's header holds; :class:`ValueError` outside it (ctypes
    wrapped such a step silently on the native path: ``2**63`` stored as ``-2**63``)."""
    value = int(step)
    if not -(1 << 63) <= value < (1 << 63):
        raise ValueError(f"step {value} does not fit a frame's header (a signed 64-bit integer)")
    return value


def _pack_header(
    natoms: int, step: int, time: float, box: np.ndarray | None, layout: str, nbytes: int, psum: int
) -> bytes:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {sorted(LAYOUTS)}")
    head = _HEADER.pack(
        MAGIC, VERSION, LAYOUTS[layout], natoms, _step(step), float(time), *_box_vector(box), nbytes,
        psum
    )
    return head + _HCHECK.pack(_checksum(head))


def encode_header(
    natoms: int,
    step: int,
    time: float,
    box: np.ndarray | None,
    layout: str,
    payload: memoryview,
) -> bytes:
    """Build the 128-byte header for ``payload`` (checksums included).

    Parameters
    ----------
    natoms, step, time
        Header fields.
    box
        ``None``, 3 lengths or a 3 x 3 matrix of box vectors (Å).
    layout
        ``"xyz32"``, ``"paper"`` or ``"paper-soa"``.
    payload
        The payload bytes.

    Returns
    -------
    bytes
        The header.
    """
    return _pack_header(natoms, step, time, box, layout, payload.nbytes, _checksum(payload))


_ARANGE: dict[int, np.ndarray] = {}


def _default_ids(natoms: int) -> np.ndarray:
    ids = _ARANGE.get(natoms)
    if ids is None:
        ids = np.arange(natoms, dtype=np.int32)
        ids.flags.writeable = False
        _ARANGE.clear()
        _ARANGE[natoms] = ids
    return ids


def _check_positions(positions: np.ndarray) -> np.ndarray:
    pos = np.asarray(positions)
    if pos.ndim != 2 or pos.shape[1] != 3:
        raise ValueError(f"positions must have shape (natoms, 3), got {pos.shape}")
    return pos


def encoded_size(natoms: int, layout: str) -> int:
    """Alias of :func:`frame_size`: bytes of a whole frame file (header included)."""
    return frame_size(natoms, layout)


def encode_into(
    buf: memoryview | mmap.mmap | bytearray | np.ndarray,
    positions: np.ndarray,
    *,
    step: int = 0,
    time: float = 0.0,
    box: np.ndarray | None = None,
    layout: str = "xyz32",
    ids: np.ndarray | None = None,
) -> int:
    """Encode a whole frame straight into a writable buffer (e.g. a mapped frame file).

    The coordinates are copied once, from ``positions`` into ``buf``, in chunks that are
    hashed while they are still in the CPU cache; the header goes in last. No intermediate
    array is built (for ``float64`` positions in the paper layouts, ``float32`` for
    ``xyz32``; other dtypes are converted on the way).

    Parameters
    ----------
    buf
        Writable buffer of at least :func:`frame_size` bytes.
    positions
        ``(natoms, 3)`` coordinates in Å.
    step, time, box, layout, ids
        As for :func:`encode_frame`.

    Returns
    -------
    int
        Bytes written (header + payload).

    Raises
    ------
    ValueError
        Bad shapes, an unknown layout, or a buffer too small.
    """
    pos = _check_positions(positions)
    natoms = pos.shape[0]
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {sorted(LAYOUTS)}")
    nbytes = natoms * bytes_per_atom(layout)
    view = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf.cast("B")
    if view.nbytes < HEADER_SIZE + nbytes:
        raise ValueError(f"buffer of {view.nbytes} bytes is too small for {HEADER_SIZE + nbytes}")
    if ids is not None and layout != "xyz32":
        ids = _checked_ids(ids, natoms)
    payload = view[HEADER_SIZE : HEADER_SIZE + nbytes]
    hasher = xxhash.xxh3_64()
    if layout == "xyz32":
        out = np.frombuffer(payload, _XYZ32).reshape(natoms, 3)
        _copy_hashed(out, pos, payload, 12, hasher)
    elif layout == "paper":
        out8 = np.frombuffer(payload, np.uint8)
        lib = library() if _NATIVE_LE and out8.flags.writeable else None
        if lib is not None:  # one C pass: interleave and hash (csrc/local/paper.c)
            src64 = np.ascontiguousarray(pos, dtype=_F64)
            id32 = None if ids is None else np.ascontiguousarray(ids, dtype=_I32)
            digest = lib.isl_paper_encode(out8.ctypes.data, src64.ctypes.data,
                                          None if id32 is None else id32.ctypes.data, natoms)
            view[:HEADER_SIZE] = _pack_header(natoms, step, time, box, layout, nbytes, digest)
            return HEADER_SIZE + nbytes
        rec = np.frombuffer(payload, _PAPER_RAW)
        src = np.ascontiguousarray(pos, dtype=_F64).view("V24").reshape(natoms)
        idv = _default_ids(natoms) if ids is None else ids
        step_atoms = max(1, _CHUNK_BYTES // 28)
        for lo in range(0, natoms, step_atoms):
            hi = min(natoms, lo + step_atoms)
            part = rec[lo:hi]
            part["id"] = idv[lo:hi]
            part["xyz"] = src[lo:hi]
            hasher.update(payload[lo * 28 : hi * 28])
    else:  # paper-soa: coordinates, then ids
        xyz = np.frombuffer(payload[: 24 * natoms], _F64).reshape(natoms, 3)
        _copy_hashed(xyz, pos, payload, 24, hasher)
        idout = np.frombuffer(payload[24 * natoms :], _I32)
        idout[:] = _default_ids(natoms) if ids is None else ids
        hasher.update(payload[24 * natoms :])
    view[:HEADER_SIZE] = _pack_header(natoms, step, time, box, layout, nbytes, hasher.intdigest())
    return HEADER_SIZE + nbytes


class NativeFrame:
    """A frame's arguments of the one-call C encode (``isl_append``, see
    :meth:`~instride.store.ring.SlotPool.write_and_publish`), after the destination address.

    Holds the arrays whose addresses it passes (``keep``) for as long as it lives.
    """

    __slots__ = ("args", "keep", "reuse")

    def __init__(self, args: tuple[object, ...], keep: tuple[object, ...],
                 reuse: tuple[object, ...] | None = None) -> None:
        self.args = args
        self.keep = keep
        #: what the arrays passed were (the objects, shapes, strides, dtypes), where the
        #: next frame may take the addresses again (see :func:`native_frame`'s ``last``)
        self.reuse = reuse


_NO_BOX = (ctypes.c_double * 9)()
#: layout -> (code, dtype of the positions) the C encode takes (little-endian machines only)
_NATIVE_LAYOUTS = {"xyz32": (1, _XYZ32), "paper": (2, _F64), "paper-soa": (3, _F64)} \
    if _NATIVE_LE else {}


def native_frame(
    positions: np.ndarray, *, step: int, time: float, box: np.ndarray | None, layout: str,
    ids: np.ndarray | None, last: NativeFrame | None = None,
) -> NativeFrame | None:
    """The frame as :class:`NativeFrame`, or ``None`` where :func:`encode_into` must encode it
    (no native library, a big-endian machine, positions of another dtype or not contiguous,
    bad shapes — whose error :func:`encode_into` raises).

    Parameters
    ----------
    positions, step, time, box, layout, ids
        As for :func:`encode_into`.
    last
        The producer's previous frame of this layout: where ``positions`` and ``ids`` are the
        very arrays it was made of (rewritten in place, the usual way of an MD code), with
        the same shapes, strides and dtypes, their checks and addresses are taken from it.
        (An array's data moves only through ``ndarray.resize``, which changes its shape, or
        through an in-place change of dtype; both are compared.)
    """
    # (a producer calls this once per frame, after tens of ms idle: every line costs; a
    # frame of the same arrays as the last one costs a few comparisons)
    if last is not None and (reuse := last.reuse) is not None and positions is reuse[0] \
            and ids is reuse[1] and positions.shape == reuse[2] \
            and positions.strides == reuse[3] and positions.dtype is reuse[4] \
            and (ids is None or (ids.shape == reuse[5] and ids.strides == reuse[6]
                                 and ids.dtype is reuse[7])):
        boxv = _NO_BOX if box is None else (ctypes.c_double * 9)(*_box_vector(box))
        return NativeFrame((*last.args[:4], _step(step), float(time), boxv), last.keep, reuse)
    native = _NATIVE_LAYOUTS.get(layout)
    if native is None or library() is None:
        return None
    pos = positions if type(positions) is np.ndarray else np.asarray(positions)
    if pos.dtype != native[1] or pos.ndim != 2 or pos.shape[1] != 3 \
            or not pos.flags.c_contiguous:
        return None
    natoms = pos.shape[0]
    id32 = None
    if ids is not None and native[0] != 1:
        id32 = ids if type(ids) is np.ndarray else np.asarray(ids)
        if id32.shape != (natoms,):
            return None
        id32 = np.ascontiguousarray(id32, dtype=_I32)
    boxv = _NO_BOX if box is None else (ctypes.c_double * 9)(*_box_vector(box))
    args = (native[0], natoms, _data_address(pos),
            None if id32 is None else _data_address(id32), _step(step), float(time), boxv)
    reuse = None
    if pos is positions and id32 is ids:  # (not copies made here)
        reuse = (pos, ids, pos.shape, pos.strides, pos.dtype,
                 *((None,) * 3 if ids is None else (ids.shape, ids.strides, ids.dtype)))
    return NativeFrame(args, (pos, id32), reuse)


_char_at = ctypes.c_char.from_buffer
_addressof = ctypes.addressof


def _data_address(arr: np.ndarray) -> int:
    """Where the C-contiguous ``arr``'s data starts: through the buffer protocol where ``arr``
    is writable and not empty (a quarter of the time of ``__array_interface__``, which builds
    a dict; ``.ctypes.data`` runs several Python frames), else ``__array_interface__``."""
    try:
        return _addressof(_char_at(arr))  # (the export ends with the temporary)
    except (TypeError, ValueError):  # read-only or empty
        return int(arr.__array_interface__["data"][0])


def _copy_hashed(
    out: np.ndarray, pos: np.ndarray, payload: memoryview, per_atom: int, hasher: xxhash.xxh3_64
) -> None:
    step_atoms = max(1, _CHUNK_BYTES // per_atom)
    for lo in range(0, len(out), step_atoms):
        hi = min(len(out), lo + step_atoms)
        out[lo:hi] = pos[lo:hi]
        hasher.update(payload[lo * per_atom : hi * per_atom])


def encode_payload(positions: np.ndarray, layout: str, ids: np.ndarray | None = None) -> np.ndarray:
    """Return the payload array for ``positions`` (no copy when already in the right dtype).

    Parameters
    ----------
    positions
        ``(natoms, 3)`` coordinates in Å.
    layout
        ``"xyz32"`` (float32) or ``"paper"`` (int32 id + 3 float64).
    ids
        Atom ids for ``"paper"`` (default ``0..natoms-1``).

    Returns
    -------
    numpy.ndarray
    """
    pos = np.asarray(positions)
    if pos.ndim != 2 or pos.shape[1] != 3:
        raise ValueError(f"positions must have shape (natoms, 3), got {pos.shape}")
    if layout == "xyz32":
        return np.ascontiguousarray(pos, dtype=_XYZ32)
    if ids is not None:  # (a scalar or a short array was broadcast: every atom one id)
        ids = _checked_ids(ids, pos.shape[0])
    if layout == "paper":
        out = np.empty(pos.shape[0], dtype=PAPER_DTYPE)
        out["id"] = np.arange(pos.shape[0], dtype=np.int32) if ids is None else ids
        out["xyz"] = pos
        return out
    if layout == "paper-soa":
        out = np.empty(pos.shape[0] * 28, dtype=np.uint8)
        np.frombuffer(out, _F64, count=3 * pos.shape[0]).reshape(-1, 3)[:] = pos
        np.frombuffer(out, _I32, offset=24 * pos.shape[0])[:] = (
            _default_ids(pos.shape[0]) if ids is None else ids
        )
        return out
    raise ValueError(f"unknown layout {layout!r}; expected one of {sorted(LAYOUTS)}")


def encode_frame(
    positions: np.ndarray,
    *,
    step: int = 0,
    time: float = 0.0,
    box: np.ndarray | None = None,
    layout: str = "xyz32",
    ids: np.ndarray | None = None,
) -> tuple[bytes, memoryview]:
    """Serialize a frame as ``(header, payload)`` buffers, ready for two ``write`` calls.

    Parameters
    ----------
    positions
        ``(natoms, 3)`` coordinates in Å.
    step, time
        MD step and time (ps).
    box
        ``None``, 3 lengths or a 3 x 3 matrix of box vectors (Å).
    layout
        ``"xyz32"`` or ``"paper"``.
    ids
        Atom ids for ``"paper"``.

    Returns
    -------
    tuple of (bytes, memoryview)
        The header and a view of the payload (no copy of ``float32`` positions).
    """
    arr = encode_payload(positions, layout, ids)
    payload = memoryview(arr.reshape(-1).view(np.uint8))
    header = encode_header(len(positions), step, time, box, layout, payload)
    return header, payload


def write_frame(
    dest: BinaryIO | str | os.PathLike[str],
    positions: np.ndarray,
    *,
    step: int = 0,
    time: float = 0.0,
    box: np.ndarray | None = None,
    layout: str = "xyz32",
    ids: np.ndarray | None = None,
) -> int:
    """Write a frame to a binary file object or path.

    Writing to a path is *not* a publication; use :func:`instride.open` (or
    :class:`instride.Stream`) for that.

    Parameters
    ----------
    dest
        A binary file object or a path.
    positions, step, time, box, layout, ids
        As for :func:`encode_frame`.

    Returns
    -------
    int
        Bytes written.
    """
    header, payload = encode_frame(positions, step=step, time=time, box=box, layout=layout, ids=ids)
    if isinstance(dest, (str, os.PathLike)):
        with _open(dest, "wb") as fh:
            fh.write(header)
            fh.write(payload)
    else:
        dest.write(header)
        dest.write(payload)
    return len(header) + payload.nbytes


def decode_header(buf: bytes | memoryview, what: str = "frame", *, checked: bool = False) -> FrameHeader:
    """Parse and verify a frame header from the first 128 bytes of ``buf``.

    Parameters
    ----------
    buf
        At least the header's bytes.
    what
        Name used in errors.
    checked
        The header's checksum was checked already (by ``isl_take``): not computed again.

    Returns
    -------
    FrameHeader

    Raises
    ------
    IntegrityError
        Truncated, bad magic or version, unknown layout, header checksum mismatch, or a payload
        size that does not match the atom count.
    """
    fields = _checked_fields(buf, what, checked)
    box = np.array(fields[6:15], dtype=np.float64).reshape(3, 3)
    return FrameHeader(fields[3], fields[4], fields[5], box, _LAYOUT_NAMES[fields[2]],
                       fields[15], fields[16])


def header_payload(buf: bytes | memoryview, what: str = "frame") -> tuple[int, int]:
    """The payload's size and checksum a frame header announces, the header verified as by
    :func:`decode_header` (its other fields are not decoded: no array is made — a fetched
    frame checked against its record, right after the bytes came, on a CPU that was idle).

    Raises
    ------
    IntegrityError
        As :func:`decode_header`.
    """
    fields = _checked_fields(buf, what, False)
    return fields[15], fields[16]


def _checked_fields(buf: bytes | memoryview, what: str, checked: bool) -> tuple[Any, ...]:
    """A frame header's fields (``_HEADER``), verified (see :func:`decode_header`)."""
    view = memoryview(buf)
    if view.nbytes < HEADER_SIZE:
        raise IntegrityError(what, f"truncated header ({view.nbytes} < {HEADER_SIZE} bytes)")
    head = view[: _HEADER.size]
    (hsum,) = _HCHECK.unpack_from(view, _HEADER.size)
    if not checked and _checksum(head) != hsum:
        raise IntegrityError(what, "header checksum mismatch")
    fields = _HEADER.unpack(head)
    magic, version, layout, natoms = fields[:4]
    nbytes = fields[15]
    if magic != MAGIC:
        raise IntegrityError(what, f"bad magic {magic!r}")
    if version != VERSION:
        raise IntegrityError(what, f"unsupported format version {version}")
    if layout not in _LAYOUT_NAMES:
        raise IntegrityError(what, f"unknown layout code {layout}")
    if nbytes != natoms * bytes_per_atom(_LAYOUT_NAMES[layout]):
        raise IntegrityError(what, f"payload size {nbytes} does not match {natoms} atoms")
    return fields


def header_checksum(buf: bytes | memoryview | mmap.mmap) -> int:
    """The header checksum a frame file carries (the 8 bytes after its header fields), as
    stored: not checked here (:func:`decode_header` checks it)."""
    (hsum,) = _HCHECK.unpack_from(buf, _HEADER.size)
    return int(hsum)


def checked_header(buf: bytes | memoryview, box: np.ndarray) -> FrameHeader:
    """The header of a frame that passed :func:`decode_header`'s checks already (in
    ``isl_take``): only parsed. ``box``: its box vectors, filled in already."""
    f = _HEADER.unpack_from(buf)
    return FrameHeader(f[3], f[4], f[5], box, _LAYOUT_NAMES[f[2]], f[15], f[16])


def decode_frame(
    buf: bytes | memoryview | mmap.mmap, what: str = "frame", *, verify: bool = True,
    copy: bool = False, releaser: Callable[[], None] | None = None, checked: bool = False,
) -> Frame:
    """Decode and verify a frame held in memory; coordinates are views of ``buf``.

    Parameters
    ----------
    buf
        The whole frame file's bytes (or a memory map of it).
    what
        Name used in errors.
    verify
        Check the payload checksum (the header's own checksum is always checked).
    copy
        Return arrays of their own instead of views of ``buf``: the payload is copied and
        verified in one pass, chunk by chunk (each chunk is hashed while it is in the CPU
        cache), instead of a checksum pass over ``buf`` followed by the caller's copy.
    releaser
        The frame's :attr:`Frame.releaser` (what lets the storage behind its views go).
    checked
        ``buf`` passed these checks already, both checksums included where ``verify`` (in
        ``isl_take``, on the held file): only parsed.

    Returns
    -------
    Frame

    Raises
    ------
    IntegrityError
        Any header problem (see :func:`decode_header`), a short payload, or a payload
        checksum mismatch.
    """
    view = memoryview(buf)
    header = decode_header(view, what, checked=checked)
    verify = verify and not checked
    payload = view[HEADER_SIZE:]
    if payload.nbytes != header.payload_nbytes:
        raise IntegrityError(
            what, f"payload is {payload.nbytes} bytes, header says {header.payload_nbytes}"
        )
    if copy:
        positions, ids, digest = _copy_payload(payload, header, verify)
        if verify and digest != header.payload_checksum:
            raise IntegrityError(what, "payload checksum mismatch")
        return Frame(header, positions, ids)
    if verify and _checksum(payload) != header.payload_checksum:
        raise IntegrityError(what, "payload checksum mismatch")
    return frame_views(view, header, releaser)


def frame_views(buf: memoryview, header: FrameHeader,
                releaser: Callable[[], None] | None = None) -> Frame:
    """The frame in ``buf`` (the whole frame file's bytes, checked against ``header``) as
    views of ``buf``."""
    n = header.natoms
    if header.layout == "xyz32":
        positions = np.frombuffer(buf, _XYZ32, 3 * n, HEADER_SIZE).reshape(n, 3)
        return Frame(header, positions, None, releaser)
    if header.layout == "paper":
        rec = np.frombuffer(buf, PAPER_DTYPE, n, HEADER_SIZE)
        return Frame(header, rec["xyz"], rec["id"], releaser)
    xyz = np.frombuffer(buf, _F64, 3 * n, HEADER_SIZE).reshape(n, 3)
    return Frame(header, xyz, np.frombuffer(buf, _I32, n, HEADER_SIZE + 24 * n), releaser)


def frame_arrays(layout: str, natoms: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Empty positions and ids arrays (``None`` for ``xyz32``) for a copy of a frame, their
    pages touched now: a reader makes them between frames, so that the copy into them takes
    no page faults.

    Parameters
    ----------
    layout, natoms
        The frame's layout and atom count.
    """
    positions = np.empty((natoms, 3), _XYZ32 if layout == "xyz32" else _F64)
    ids = None if layout == "xyz32" else np.empty(natoms, _I32)
    for arr in (positions, ids):
        if arr is not None and arr.nbytes:
            arr.reshape(-1).view(np.uint8)[:: mmap.PAGESIZE] = 0
    return positions, ids


def _copy_payload(
    payload: memoryview, header: FrameHeader, verify: bool
) -> tuple[np.ndarray, np.ndarray | None, int | None]:
    """Copy a frame's payload into new arrays, hashing each chunk as it passes the cache.

    Returns the positions, the ids (``None`` for ``xyz32``) and the payload's xxh3 digest
    (``None`` when ``verify`` is false).
    """
    n = header.natoms
    hasher = xxhash.xxh3_64() if verify else None
    if header.layout == "paper":  # interleaved records: hash a chunk, then split it out
        positions = np.empty((n, 3), _F64)
        ids: np.ndarray | None = np.empty(n, _I32)
        lib = library() if _NATIVE_LE else None
        if lib is not None:  # one C pass (csrc/local/paper.c)
            src8 = np.frombuffer(payload, np.uint8)
            digest = lib.isl_paper_decode(src8.ctypes.data, n, positions.ctypes.data,
                                          ids.ctypes.data, 1 if verify else 0)  # type: ignore[union-attr]
            return positions, ids, digest if verify else None
        rec = np.frombuffer(payload, dtype=_PAPER_RAW)
        xyz_raw = positions.view("V24").reshape(n)
        step = max(1, _CHUNK_BYTES // 28)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            if hasher is not None:
                hasher.update(payload[lo * 28 : hi * 28])
            part = rec[lo:hi]
            xyz_raw[lo:hi] = part["xyz"]
            ids[lo:hi] = part["id"]  # type: ignore[index]
        return positions, ids, None if hasher is None else hasher.intdigest()
    if header.layout == "xyz32":
        positions = np.empty((n, 3), _XYZ32)
        ids = None
        parts = [positions]
    else:  # paper-soa: the coordinates, then the ids, each one contiguous copy
        positions = np.empty((n, 3), _F64)
        ids = np.empty(n, _I32)
        parts = [positions, ids]
    src = np.frombuffer(payload, np.uint8)
    at = 0
    for arr in parts:
        dst = arr.reshape(-1).view(np.uint8)
        for lo in range(0, dst.nbytes, _CHUNK_BYTES):
            hi = min(dst.nbytes, lo + _CHUNK_BYTES)
            chunk = dst[lo:hi]
            chunk[:] = src[at + lo : at + hi]
            if hasher is not None:
                hasher.update(chunk)  # the copy, still in cache: what the caller gets
        at += dst.nbytes
    return positions, ids, None if hasher is None else hasher.intdigest()


def read_frame(source: str | os.PathLike[str] | bytes | memoryview | mmap.mmap) -> Frame:
    """Read and verify a frame from a path or a buffer.

    A path of :data:`MMAP_THRESHOLD` bytes or more is memory-mapped read-only, so the
    returned arrays share the page cache; a smaller one is read in one call.

    Raises
    ------
    IntegrityError
        On a bad magic, truncation, or any checksum mismatch.
    """
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        with _open(path, "rb", buffering=0) as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < HEADER_SIZE:
                raise IntegrityError(str(path), f"truncated header ({size} < {HEADER_SIZE} bytes)")
            if size < MMAP_THRESHOLD:  # small frames: one read beats mapping and unmapping
                return decode_frame(fh.read(), str(path))
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        return decode_frame(mm, str(path))
    return decode_frame(source)


def read_header(source: str | os.PathLike[str] | BinaryIO) -> FrameHeader:
    """Read and verify only the header of a frame file (the payload is not read).

    Parameters
    ----------
    source
        A path or a binary file object positioned at the frame's start.

    Returns
    -------
    FrameHeader

    Raises
    ------
    IntegrityError
        See :func:`decode_header`.
    """
    if isinstance(source, (str, os.PathLike)):
        with _open(source, "rb") as fh:
            return decode_header(fh.read(HEADER_SIZE), os.fspath(source))
    return decode_header(source.read(HEADER_SIZE))
