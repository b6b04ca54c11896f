"""The H5MD archive file: whole frames or none, files that are not the stream's archive refused,
one writer per file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest

from instride.archive import open_reader, open_writer
from instride.errors import ArchiveError
from instride.frames import Frame, FrameHeader

NATOMS = 4
BOX = np.diag([30.0, 31.0, 32.0])
NO_BOX = np.zeros((3, 3))


def _frame(i: int, natoms: int = NATOMS, dtype: type = np.float32, box: np.ndarray = BOX) -> Frame:
    pos = np.full((natoms, 3), float(i), dtype=dtype)
    header = FrameHeader(natoms=natoms, step=10 * i, time=0.5 * i, box=box, layout="xyz32",
                         payload_nbytes=pos.nbytes, payload_checksum=0)
    return Frame(header, pos)


def _lengths(path: Path) -> dict[str, int]:
    """Rows of every per-frame dataset of the file, as on disk."""
    out: dict[str, int] = {}
    with h5py.File(path, "r", libver="latest", swmr=True) as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj.shape[0])
                     if isinstance(obj, h5py.Dataset) else None)
    return out


def _written(path: Path, n: int, stream: str = "s") -> None:
    w = open_writer(path, stream)
    for i in range(n):
        w.append(i, _frame(i))
    w.close()


def _assert_frames(path: Path, n: int) -> None:
    rd = open_reader(path, "s")
    try:
        assert list(rd.indices()) == list(range(n))
        for i in range(n):
            frame = rd.read(i)
            assert frame is not None and frame.step == 10 * i and frame.time == 0.5 * i
            np.testing.assert_array_equal(frame.positions, np.full((NATOMS, 3), float(i), np.float32))
            np.testing.assert_array_equal(frame.box, BOX)
        assert rd.read(n) is None
    finally:
        rd.close()


@pytest.mark.parametrize(("bad", "why"), [
    (_frame(2, natoms=5), "has 5 atoms"),
    (_frame(2, dtype=np.float64), "float64 coordinates"),
    (_frame(1), "not after the archive's last frame"),
])
def test_a_frame_that_does_not_fit_is_refused_before_the_file_is_touched(
        tmp_path: Path, bad: Frame, why: str) -> None:
    dest = tmp_path / "a.h5"
    w = open_writer(dest, "s")
    w.append(0, _frame(0))
    w.append(1, _frame(1))
    w.flush()
    index = 1 if "not after" in why else 2
    with pytest.raises(ArchiveError, match=why):
        w.append(index, bad)
    assert set(_lengths(dest).values()) == {2}
    w.append(2, _frame(2))  # the writer goes on where it was
    w.close()
    _assert_frames(dest, 3)
    w = open_writer(dest, "s")  # and so does one resuming the file
    w.append(3, _frame(3))
    w.close()
    _assert_frames(dest, 4)


def test_a_box_in_an_archive_started_without_one_is_refused(tmp_path: Path) -> None:
    dest = tmp_path / "nobox.h5"
    w = open_writer(dest, "s")
    w.append(0, _frame(0, box=NO_BOX))
    with pytest.raises(ArchiveError, match="has a box"):
        w.append(1, _frame(1))
    w.append(1, _frame(1, box=NO_BOX))
    assert list(w.indices()) == [0, 1]
    w.close()


def test_an_append_failing_midway_takes_its_rows_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "full.h5"
    w = open_writer(dest, "s")
    w.append(0, _frame(0))
    w.append(1, _frame(1))
    put = h5py.Dataset.__setitem__
    calls: list[str] = []

    def disk_full(ds: h5py.Dataset, key: object, value: object) -> None:
        calls.append(ds.name)
        if len(calls) == 3:  # positions and step of the frame written, then no room
            raise OSError(28, "No space left on device")
        put(ds, key, value)

    monkeypatch.setattr(h5py.Dataset, "__setitem__", disk_full)
    with pytest.raises(OSError, match="No space"):
        w.append(2, _frame(2))
    monkeypatch.undo()
    assert calls[:2] == ["/particles/trajectory/position/value", "/particles/trajectory/position/step"]
    w.flush()
    assert set(_lengths(dest).values()) == {2}
    w.append(2, _frame(2))
    w.close()
    _assert_frames(dest, 3)


KILLED_MID_APPEND = textwrap.dedent(
    """
    import os, signal, sys
    import h5py, numpy as np
    from instride.archive import open_writer
    from instride.frames import Frame, FrameHeader

    def frame(i):
        pos = np.full((4, 3), float(i), np.float32)
        box = np.diag([30.0, 31.0, 32.0])
        return Frame(FrameHeader(4, 10 * i, 0.5 * i, box, "xyz32", pos.nbytes, 0), pos)

    w = open_writer(sys.argv[1], "s")
    w.append(0, frame(0))
    w.append(1, frame(1))
    w.flush()
    put, calls = h5py.Dataset.__setitem__, []
    def put_then_die(ds, key, value):
        put(ds, key, value)
        calls.append(ds.name)
        if len(calls) == 5:  # positions, step, time, box: all of frame 2 but its index row
            ds.file.flush()  # (as if HDF5 had written them out before the kill)
            os.kill(os.getpid(), signal.SIGKILL)
    h5py.Dataset.__setitem__ = put_then_die
    w.append(2, frame(2))
    """
)


def test_a_writer_killed_mid_append_leaves_a_file_cut_back_on_resume(tmp_path: Path) -> None:
    dest = tmp_path / "killed.h5"
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_APPEND, str(dest)],
                          capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    lengths = _lengths(dest)
    assert lengths["instride/index"] == 2 and lengths["particles/trajectory/position/value"] == 3
    assert lengths["particles/trajectory/box/edges/value"] == 3
    _assert_frames(dest, 2)  # a reader sees only the frames the index covers
    w = open_writer(dest, "s")  # resuming: left open by a dead writer, rows of frame 2 cut
    assert list(w.indices()) == [0, 1]
    w.flush()
    assert set(_lengths(dest).values()) == {2}
    w.append(2, _frame(2))
    w.append(3, _frame(3))
    w.close()
    _assert_frames(dest, 4)
    assert sorted(os.listdir(tmp_path)) == ["killed.h5"]  # no copy, no lock file left behind


def test_a_file_that_is_not_hdf5_is_refused(tmp_path: Path) -> None:
    dest = tmp_path / "notes.h5"
    dest.write_text("my notes\n")
    with pytest.raises(ArchiveError, match=r"notes\.h5.*not an HDF5 file"):
        open_writer(dest, "s")
    with pytest.raises(ArchiveError, match="not an HDF5 file"):
        open_reader(dest)
    assert dest.read_text() == "my notes\n"
    assert sorted(os.listdir(tmp_path)) == ["notes.h5"]


@pytest.mark.parametrize("libver", ["earliest", "latest"])
def test_an_hdf5_file_that_is_not_an_archive_is_refused(tmp_path: Path, libver: str) -> None:
    dest = tmp_path / "other.h5"
    with h5py.File(dest, "w", libver=libver) as f:
        f["data"] = np.arange(3)
    before = dest.read_bytes()
    with pytest.raises(ArchiveError, match="not an instride archive"):
        open_writer(dest, "s")
    with pytest.raises(ArchiveError, match="not an instride archive"):
        open_reader(dest)
    assert dest.read_bytes() == before


def test_the_archive_of_another_stream_is_refused(tmp_path: Path) -> None:
    dest = tmp_path / "a.h5"
    _written(dest, 3, stream="s")
    before = dest.read_bytes()
    with pytest.raises(ArchiveError, match="the archive of stream 's'"):
        open_writer(dest, "t")
    with pytest.raises(ArchiveError, match="the archive of stream 's'"):
        open_reader(dest, "t")
    assert dest.read_bytes() == before
    _assert_frames(dest, 3)


def test_an_archive_that_names_no_stream_is_read_but_not_resumed(tmp_path: Path) -> None:
    dest = tmp_path / "old.h5"
    _written(dest, 2)
    with h5py.File(dest, "r+") as f:  # as an instride before the stream check wrote it
        del f["instride"].attrs["stream"]
    with pytest.raises(ArchiveError, match="names no stream"):
        open_writer(dest, "s")
    _assert_frames(dest, 2)  # readers (given the stream) still read it
    with h5py.File(dest, "r+") as f:  # the way docs/streams.md gives to resume it
        f["instride"].attrs["stream"] = "s"
    w = open_writer(dest, "s")
    w.append(2, _frame(2))
    w.close()
    _assert_frames(dest, 3)


def test_one_writer_per_file(tmp_path: Path) -> None:
    dest = tmp_path / "one.h5"
    first = open_writer(dest, "s")
    first.append(0, _frame(0))
    first.flush()
    with pytest.raises(ArchiveError, match="another archiver is writing it"):
        open_writer(dest, "s")
    with pytest.raises(ArchiveError, match="another archiver is writing it"):
        open_writer(dest, "t")
    first.append(1, _frame(1))
    first.close()
    assert sorted(os.listdir(tmp_path)) == ["one.h5"]  # the lock file goes with its writer
    second = open_writer(dest, "s")
    second.append(2, _frame(2))
    second.close()
    _assert_frames(dest, 3)


def test_an_archive_path_that_cannot_be_written_is_refused(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("x")
    with pytest.raises(ArchiveError, match="cannot make its writer's lock file"):
        open_writer(tmp_path / "plain" / "a.h5", "s")  # (its directory is a file)
    (tmp_path / "dir.h5").mkdir()
    with pytest.raises(ArchiveError, match="not a regular file"):
        open_writer(tmp_path / "dir.h5", "s")
    assert sorted(os.listdir(tmp_path)) == ["dir.h5", "plain"]
