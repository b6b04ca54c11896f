"""The frame file format: sizes of the paper's Table I, round trips, corruption detection."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import instride
from instride.errors import IntegrityError
from instride.frames import (
    HEADER_SIZE,
    encode_frame,
    frame_size,
    read_frame,
    read_header,
    write_frame,
)

KIB = 1024
MIB = 1024 * 1024


def test_paper_layout_reproduces_table_one_sizes(tmp_path: Path) -> None:
    jac = np.random.default_rng(0).random((23_558, 3))
    path = tmp_path / "jac.isf"
    n = write_frame(path, jac, layout="paper")
    assert path.stat().st_size == n == frame_size(23_558, "paper")
    assert abs(n - 644.21 * KIB) <= KIB
    # Table I gives STMV as 28.48 MiB, rounded to 0.01 MiB (10 KiB): 28 B/atom lands in that
    # rounding interval (28.482 MiB), 2.1 KiB above its midpoint.
    assert round(frame_size(1_066_628, "paper") / MIB, 2) == 28.48


def test_stmv_sized_frame_roundtrip(tmp_path: Path) -> None:
    pos = np.random.default_rng(1).random((1_066_628, 3)) * 100
    path = tmp_path / "stmv.isf"
    write_frame(path, pos, step=28, time=0.056, layout="paper")
    assert round(path.stat().st_size / MIB, 2) == 28.48
    frame = read_frame(path)
    assert frame.natoms == 1_066_628
    np.testing.assert_array_equal(frame.positions, pos)
    np.testing.assert_array_equal(frame.ids, np.arange(1_066_628))


def test_header_without_payload(tmp_path: Path) -> None:
    box = np.diag([10.0, 20.0, 30.0])
    path = tmp_path / "h.isf"
    write_frame(path, np.ones((5, 3)), step=7, time=1.5, box=box)
    head = read_header(path)
    assert (head.natoms, head.step, head.time, head.layout) == (5, 7, 1.5, "xyz32")
    np.testing.assert_array_equal(head.box, box)
    assert head.has_box
    # Only the header is needed: a truncated payload does not matter to read_header.
    data = path.read_bytes()
    path.write_bytes(data[:HEADER_SIZE])
    assert read_header(path).natoms == 5
    with pytest.raises(IntegrityError):
        read_frame(path)


def test_reading_returns_views_not_copies(tmp_path: Path) -> None:
    header, payload = encode_frame(np.zeros((100, 3), dtype=np.float32))
    buf = bytearray(header + bytes(payload))
    frame = read_frame(memoryview(buf))
    assert np.shares_memory(frame.positions, np.frombuffer(buf, dtype=np.uint8))


def test_every_flipped_byte_is_detected(tmp_path: Path) -> None:
    header, payload = encode_frame(
        np.random.default_rng(2).random((16, 3)), step=3, time=0.5, box=[5.0, 5.0, 5.0],
        layout="paper",
    )
    good = header + bytes(payload)
    read_frame(good)
    for i in range(len(good)):
        bad = bytearray(good)
        bad[i] ^= 0x01
        with pytest.raises(IntegrityError):
            read_frame(bytes(bad))


def test_corrupted_published_frame_raises_on_read(client: instride.Client) -> None:
    s = instride.Stream("corrupt", mode="w", client=client)
    s.append(np.ones((1000, 3)))
    s.close()
    path = client.consume("corrupt/frame_000000000.isf")
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 500] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="payload checksum"):
        next(iter(instride.Stream("corrupt", client=client)))


def test_truncated_and_foreign_files(tmp_path: Path) -> None:
    for content in (b"", b"ISF1", b"not a frame at all" * 20):
        p = tmp_path / "x.isf"
        p.write_bytes(content)
        with pytest.raises(IntegrityError):
            read_frame(p)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        encode_frame(np.zeros((3, 2)))
    with pytest.raises(ValueError):
        encode_frame(np.zeros((3, 3)), layout="pdb")
    with pytest.raises(ValueError):
        encode_frame(np.zeros((3, 3)), box=[1.0, 2.0])


@settings(max_examples=100, deadline=None)
@given(
    pos=hnp.arrays(np.float32, st.tuples(st.integers(0, 50), st.just(3)),
                   elements=st.floats(-1e4, 1e4, width=32)),
    step=st.integers(-(2**62), 2**62),
    time=st.floats(allow_nan=False, allow_infinity=False),
    layout=st.sampled_from(["xyz32", "paper"]),
)
def test_property_roundtrip(pos: np.ndarray, step: int, time: float, layout: str) -> None:
    buf = io.BytesIO()
    write_frame(buf, pos, step=step, time=time, layout=layout)
    frame = read_frame(buf.getvalue())
    assert frame.step == step
    assert frame.time == time
    assert frame.natoms == len(pos)
    np.testing.assert_array_equal(frame.positions, pos.astype(frame.positions.dtype))


@pytest.mark.parametrize("layout", ["xyz32", "paper", "paper-soa"])
def test_copy_decode_owns_its_arrays_and_verifies_in_the_same_pass(layout: str) -> None:
    from instride.frames import decode_frame

    rng = np.random.default_rng(5)
    n = 70_000  # several chunks of the copy loop
    header, payload = encode_frame(rng.random((n, 3)) * 50, step=9, layout=layout,
                                   ids=None if layout == "xyz32" else rng.permutation(n).astype(np.int32))
    buf = bytearray(header + bytes(payload))
    views = decode_frame(memoryview(buf))
    copied = decode_frame(memoryview(buf), copy=True)
    assert copied.step == 9
    assert np.array_equal(copied.positions, views.positions)
    assert not np.shares_memory(copied.positions, np.frombuffer(buf, dtype=np.uint8))
    assert copied.positions.flags.c_contiguous and copied.positions.flags.writeable
    if layout == "xyz32":
        assert copied.ids is None
    else:
        assert copied.ids is not None and np.array_equal(copied.ids, views.ids)
        assert not np.shares_memory(copied.ids, np.frombuffer(buf, dtype=np.uint8))
    # a flipped payload byte is caught by the copy's own checksum ...
    for where in (HEADER_SIZE, HEADER_SIZE + len(payload) // 2, len(buf) - 1):
        bad = bytearray(buf)
        bad[where] ^= 0x10
        with pytest.raises(IntegrityError, match="payload checksum"):
            decode_frame(memoryview(bad), copy=True)
        # ... and not looked for with verify=False (the header is still checked)
        decode_frame(memoryview(bad), copy=True, verify=False)


def _paper_both_ways(
    monkeypatch: pytest.MonkeyPatch, pos: np.ndarray, ids: np.ndarray | None, layout: str = "paper"
) -> tuple[bytearray, bytearray]:
    """A frame encoded by the C codec and by numpy (the library hidden)."""
    from instride import frames, native
    from instride.frames import encode_into

    assert native.library() is not None, "libinstride_local.so is missing: reinstall instride"
    n = pos.shape[0]
    by_c, by_numpy = bytearray(frame_size(n, layout)), bytearray(frame_size(n, layout))
    encode_into(by_c, pos, step=7, time=1.5, layout=layout, ids=ids)
    with monkeypatch.context() as m:
        m.setattr(frames, "library", lambda: None)
        encode_into(by_numpy, pos, step=7, time=1.5, layout=layout, ids=ids)
    return by_c, by_numpy


@settings(max_examples=40, deadline=None)
@given(n=st.sampled_from([0, 1, 2, 9361, 9362, 9363, 23_558]), with_ids=st.booleans(),
       seed=st.integers(0, 2**16))
def test_paper_codec_in_c_matches_numpy(n: int, with_ids: bool, seed: int) -> None:
    # the C codec (csrc/local/paper.c) writes the same bytes and digest as the numpy path, and
    # reads back the same arrays; sizes around its 9,362-atom chunks
    from instride import frames
    from instride.frames import decode_frame

    rng = np.random.default_rng(seed)
    pos = rng.normal(size=(n, 3)) * 50
    ids = rng.integers(-(2**31), 2**31 - 1, size=n, dtype=np.int64).astype(np.int32) if with_ids else None
    with pytest.MonkeyPatch.context() as mp:
        by_c, by_numpy = _paper_both_ways(mp, pos, ids)
        assert by_c == by_numpy
        got_c = decode_frame(memoryview(by_c), "k", copy=True)
        mp.setattr(frames, "library", lambda: None)
        got_numpy = decode_frame(memoryview(by_c), "k", copy=True)
    for got in (got_c, got_numpy):
        assert np.array_equal(got.positions, pos)
        assert np.array_equal(got.ids, np.arange(n, dtype=np.int32) if ids is None else ids)


@pytest.mark.parametrize("layout", ["paper", "paper-soa", "xyz32"])
def test_codecs_in_c_detect_a_flipped_byte(monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    from instride.frames import decode_frame

    pos = np.random.default_rng(3).random((1000, 3))
    by_c, _ = _paper_both_ways(monkeypatch, pos, None, layout)
    for at in (HEADER_SIZE, (HEADER_SIZE + len(by_c)) // 2 + 1, len(by_c) - 1):
        bad = bytearray(by_c)
        bad[at] ^= 0x10
        with pytest.raises(IntegrityError, match="checksum"):
            decode_frame(memoryview(bad), "k", copy=True)
    # not verifying: the bytes as they are, no error
    good = decode_frame(memoryview(by_c), "k", copy=True).positions
    bad = bytearray(by_c)
    bad[HEADER_SIZE + 6] ^= 0x10
    assert not np.array_equal(decode_frame(memoryview(bad), "k", verify=False, copy=True).positions, good)


def test_paper_encode_into_a_read_only_buffer_is_refused() -> None:
    # the C codec never writes through a read-only buffer: numpy's path refuses it
    from instride.frames import encode_into

    pos = np.zeros((10, 3))
    with pytest.raises((TypeError, ValueError)):
        encode_into(bytes(frame_size(10, "paper")), pos, layout="paper")


@pytest.mark.parametrize("dispatch", ["1", "0"])
def test_the_c_codec_hashes_alike_with_and_without_libxxhash_dispatch(dispatch: str) -> None:
    # csrc/common/ins_xxh.h: the streaming xxh3 goes to libxxhash's run-time dispatch where the
    # library is there (AVX2 here), else to the inlined code (INSTRIDE_XXH_DISPATCH=0 forces
    # it): the same digest as the Python package either way, across several chunks
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import numpy as np, xxhash
        from instride.frames import HEADER_SIZE, decode_frame, encode_into, frame_size
        n = 30_000
        pos = np.random.default_rng(5).normal(size=(n, 3))
        buf = bytearray(frame_size(n, "paper"))
        encode_into(buf, pos, layout="paper")
        frame = decode_frame(memoryview(buf), "k", copy=True)  # verified by the C decoder
        assert np.array_equal(frame.positions, pos)
        print(frame.header.payload_checksum == xxhash.xxh3_64_intdigest(bytes(buf[HEADER_SIZE:])))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, INSTRIDE_XXH_DISPATCH=dispatch))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"]


@settings(max_examples=30, deadline=None)
@given(layout=st.sampled_from(["xyz32", "paper", "paper-soa"]),
       n=st.sampled_from([0, 1, 10_922, 10_923, 21_845, 21_846, 23_558]), with_ids=st.booleans(),
       with_box=st.booleans(), seed=st.integers(0, 2**16))
def test_the_one_call_encode_writes_the_bytes_of_encode_into(
    layout: str, n: int, with_ids: bool, with_box: bool, seed: int
) -> None:
    # isl_append (csrc/local/frame.c), the bounded stream's one-call encode, writes the same
    # header and payload as encode_into, across its 256 KiB chunks
    from instride import native
    from instride.frames import decode_frame, encode_into, native_frame

    lib = native.library()
    assert lib is not None, "libinstride_local.so is missing: reinstall instride"
    rng = np.random.default_rng(seed)
    pos = rng.normal(size=(n, 3)) * 50
    if layout == "xyz32":
        pos = pos.astype(np.float32)
    ids = rng.permutation(n).astype(np.int32) if with_ids else None
    box = np.array([10.0, 20.0, 30.0]) if with_box else None
    expected = bytearray(frame_size(n, layout))
    encode_into(expected, pos, step=-3, time=2.5, box=box, layout=layout, ids=ids)
    got = bytearray(frame_size(n, layout))
    native = native_frame(pos, step=-3, time=2.5, box=box, layout=layout, ids=ids)
    assert native is not None
    dst = np.frombuffer(got, np.uint8)
    assert lib.isl_append(dst.ctypes.data, *native.args, -1, None, None, 0, 0) == 0
    assert got == expected
    back = decode_frame(memoryview(got), "k", copy=True)
    assert np.array_equal(back.positions, pos)
    if layout != "xyz32":
        assert np.array_equal(back.ids, np.arange(n, dtype=np.int32) if ids is None else ids)


def test_arrays_the_one_call_encode_cannot_take_go_the_numpy_way() -> None:
    from instride.frames import native_frame

    pos = np.zeros((10, 3))
    kw = {"step": 0, "time": 0.0, "box": None, "ids": None}
    assert native_frame(pos, layout="paper-soa", **kw) is not None
    assert native_frame(pos, layout="xyz32", **kw) is None  # float64 for xyz32: converted
    assert native_frame(pos.astype(np.float32), layout="paper", **kw) is None
    assert native_frame(np.zeros((10, 6))[:, ::2], layout="paper", **kw) is None  # strided
    assert native_frame(pos, layout="paper", **{**kw, "ids": np.arange(9)}) is None
    assert native_frame(pos, layout="nope", **kw) is None  # encode_into names the error
    with pytest.raises(ValueError, match="box"):
        native_frame(pos, layout="paper", **{**kw, "box": np.zeros(4)})


def test_a_frame_of_the_last_frames_arrays_takes_their_checks_and_addresses_again() -> None:
    # a producer that rewrites its arrays in place passes the same objects every frame:
    # native_frame(last=) reuses their addresses, and sees every change that would move or
    # retype the data (a resize, an in-place dtype change, a copy it had to make)
    from instride import native
    from instride.frames import NativeFrame, encode_into, native_frame

    lib = native.library()
    assert lib is not None, "libinstride_local.so is missing: reinstall instride"

    def encoded(frame: NativeFrame, n: int) -> bytes:
        got = bytearray(frame_size(n, "paper"))
        dst = np.frombuffer(got, np.uint8)
        assert lib.isl_append(dst.ctypes.data, *frame.args, -1, None, None, 0, 0) == 0
        return bytes(got)

    def expected(pos: np.ndarray, ids: np.ndarray, step: int) -> bytes:
        out = bytearray(frame_size(len(pos), "paper"))
        encode_into(out, pos, step=step, time=0.0, box=None, layout="paper", ids=ids)
        return bytes(out)

    pos, ids = np.zeros((10, 3)), np.arange(10, dtype=np.int32)
    kw = {"time": 0.0, "box": None, "layout": "paper"}
    first = native_frame(pos, step=0, ids=ids, **kw)
    assert first is not None and first.reuse is not None
    pos[:] = 5.0  # rewritten in place
    ids[3] = 99
    again = native_frame(pos, step=1, ids=ids, last=first, **kw)
    assert again is not None and again.keep is first.keep  # reused
    assert encoded(again, 10) == expected(pos, ids, 1)
    # another array of the same values: not the same object, not reused
    other = native_frame(pos.copy(), step=2, ids=ids, last=again, **kw)
    assert other is not None and other.keep is not again.keep
    # resized in place (its data moved): not reused, the new data encoded
    pos.resize((20, 3), refcheck=False)
    ids = np.arange(20, dtype=np.int32)
    moved = native_frame(pos, step=3, ids=ids, last=first, **kw)
    assert moved is not None and moved.keep is not first.keep
    assert encoded(moved, 20) == expected(pos, ids, 3)
    # ids of another dtype are converted (a copy): never reused, later changes seen
    ids64 = np.arange(20, dtype=np.int64)
    converted = native_frame(pos, step=4, ids=ids64, last=moved, **kw)
    assert converted is not None and converted.reuse is None
    ids64[0] = 7
    after = native_frame(pos, step=5, ids=ids64, last=converted, **kw)
    assert after is not None and encoded(after, 20) == expected(pos, ids64.astype(np.int32), 5)
    # the dtype changed in place: no longer a frame the native encode takes
    pos.dtype = np.int64
    assert native_frame(pos, step=6, ids=ids, last=moved, **kw) is None


@pytest.mark.parametrize("layout", ["xyz32", "paper", "paper-soa"])
def test_a_checked_frame_parsed_alone_is_the_decoded_frame(layout: str) -> None:
    # what a reader builds after isl_take checked the frame: the header parsed, the box taken
    # from the array the native call filled, views of the file's bytes
    from instride.frames import checked_header, decode_frame, encode_frame, frame_arrays, frame_views

    pos = np.random.default_rng(5).random((50, 3)).astype(np.float32 if layout == "xyz32" else np.float64)
    box = np.diag([1.0, 2.0, 3.0])
    head, payload = encode_frame(pos, step=9, time=1.5, box=box, layout=layout)
    buf = memoryview(head + bytes(payload))
    full = decode_frame(buf)
    header = checked_header(buf, box.copy())
    assert header.natoms == 50 and header.step == 9 and header.layout == layout
    assert header[:3] == full.header[:3] and header[4:] == full.header[4:]
    assert np.array_equal(header.box, full.box)
    views = frame_views(buf, header)
    assert np.array_equal(views.positions, full.positions)
    assert (views.ids is None) == (full.ids is None)
    positions, ids = frame_arrays(layout, 50)
    assert positions.shape == (50, 3) and positions.dtype == pos.dtype
    assert (ids is None) == (layout == "xyz32") and (ids is None or ids.dtype == np.int32)


def test_a_headers_payload_fields_are_those_decode_header_checks() -> None:
    # what a fetched frame is checked against its record by (no array made): the same checks
    from instride.frames import decode_header, encode_frame, header_payload

    head, payload = encode_frame(np.random.default_rng(6).random((40, 3)), step=2, layout="paper")
    header = decode_header(head)
    assert header_payload(head) == (header.payload_nbytes, header.payload_checksum)
    for i in range(HEADER_SIZE):  # every flipped byte of the header, as decode_header
        bad = bytearray(head)
        bad[i] ^= 0x01
        with pytest.raises(IntegrityError):
            header_payload(bytes(bad), "k/frame")
    with pytest.raises(IntegrityError, match="truncated header"):
        header_payload(head[:100])


def test_a_step_outside_int64_is_refused(managed_dir: Path) -> None:
    """A step past a signed 64-bit integer: the native path stored it wrapped (2**63 as
    -2**63, 2**64 + 5 as 5), and verified; the numpy path raised a bare struct.error."""
    import instride

    pos = np.zeros((10, 3), dtype=np.float32)
    with instride.Stream("big", mode="w") as s:
        for bad in (1 << 63, (1 << 64) + 5, -(1 << 63) - 1):
            with pytest.raises(ValueError, match="64-bit"):
                s.append(pos, step=bad)
        s.append(pos, step=(1 << 63) - 1)
    assert instride.Stream("big").read(0).step == (1 << 63) - 1


@pytest.mark.parametrize("layout", ["paper", "paper-soa"])
def test_ids_of_another_shape_are_refused_by_every_encoder(layout: str) -> None:
    """``encode_payload`` (and ``encode_frame`` and ``write_frame``, through it) broadcast
    ids of shape ``(1,)`` or a scalar: every atom given the same id, silently, where
    ``encode_into`` and ``Stream.append`` refuse them."""
    from instride.frames import encode_payload

    for ids in (np.array([1], dtype=np.int32), 5):
        with pytest.raises(ValueError, match="ids must have shape"):
            encode_payload(np.zeros((4, 3)), layout=layout, ids=ids)


def test_sizes_of_an_unknown_layout_are_a_value_error() -> None:
    """``frame_size(n, "pdb")`` (and ``bytes_per_atom``) raised a bare KeyError: 'pdb', where
    every other function of the module names the layouts with a ValueError."""
    from instride.frames import bytes_per_atom, frame_size

    for call in (lambda: frame_size(10, "pdb"), lambda: bytes_per_atom("pdb")):
        with pytest.raises(ValueError, match="unknown layout 'pdb'; expected one of"):
            call()
    assert [bytes_per_atom(x) for x in ("xyz32", "paper", "paper-soa")] == [12, 28, 28]
