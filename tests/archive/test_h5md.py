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


#: a writer's subprocess with frames 0 and 1 flushed (what the test's script kills it in follows)
WRITER_OF_TWO = textwrap.dedent(
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
    """
)
KILLED_MID_APPEND = WRITER_OF_TWO + textwrap.dedent(
    """
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


KILLED_AFTER_INDEX_RESIZE = WRITER_OF_TWO + textwrap.dedent(
    """
    resize = h5py.Dataset.resize
    def resize_then_die(ds, size, axis=None):
        resize(ds, size, axis)
        if ds.name == "/instride/index":  # every row of frame 2 written, its index row reserved
            ds.file.flush()  # (as if HDF5 had written the new extent out before the kill)
            os.kill(os.getpid(), signal.SIGKILL)
    h5py.Dataset.resize = resize_then_die
    w.append(2, frame(2))
    """
)


def test_an_index_row_reserved_but_never_written_is_no_frame(tmp_path: Path) -> None:
    """A writer killed between the resize of ``/instride/index`` and the write of its row left
    a row that read back as 0 (no fill value): readers and a resuming writer took it for
    frame 0, after frame 1 (the index no longer ascending), and the writer went on after it."""
    dest = tmp_path / "torn.h5"
    proc = subprocess.run([sys.executable, "-c", KILLED_AFTER_INDEX_RESIZE, str(dest)],
                          capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert set(_lengths(dest).values()) == {3}  # the index's row of frame 2 too, not written
    _assert_frames(dest, 2)  # a reader sees frames 0 and 1 only
    w = open_writer(dest, "s")  # resuming: the unwritten row is no frame, and is cut
    assert list(w.indices()) == [0, 1]
    w.flush()
    assert set(_lengths(dest).values()) == {2}
    w.append(2, _frame(2))
    w.append(3, _frame(3))
    w.close()
    _assert_frames(dest, 4)
    with h5py.File(dest, "r") as f:  # rows never written read as no real value
        for name in ("instride/index", "particles/trajectory/position/step"):
            assert f[name].fillvalue == -1
        assert np.isnan(f["particles/trajectory/position/time"].fillvalue)
    assert sorted(os.listdir(tmp_path)) == ["torn.h5"]


def test_an_unwritten_index_row_of_an_older_archive_is_no_frame(tmp_path: Path) -> None:
    """The same row in a file of an instride before the fill value: it reads as 0, so not
    ascending after frame 1."""
    dest = tmp_path / "old.h5"
    _written(dest, 2)
    with h5py.File(dest, "r+", libver="latest") as f:  # as an older writer killed after the index's resize
        del f["instride/index"]
        index = f["instride"].create_dataset("index", shape=(3,), maxshape=(None,), dtype=np.int64,
                                             chunks=(4096,))
        index[:2] = [0, 1]
        for name in ("position/value", "position/step", "position/time", "box/edges/value",
                     "box/edges/step", "box/edges/time"):
            f[f"particles/trajectory/{name}"].resize(3, axis=0)
    _assert_frames(dest, 2)
    w = open_writer(dest, "s")
    assert list(w.indices()) == [0, 1]
    w.append(2, _frame(2))
    w.close()
    _assert_frames(dest, 3)


KILLED_CREATING = textwrap.dedent(
    """
    import os, signal, sys
    import h5py, numpy as np
    from instride.archive import open_writer
    from instride.frames import Frame, FrameHeader

    pos = np.zeros((4, 3), np.float32)
    first = Frame(FrameHeader(4, 0, 0.0, np.diag([30.0, 31.0, 32.0]), "xyz32", pos.nbytes, 0), pos)
    create, calls = h5py.Group.create_dataset, []
    def create_then_die(group, *args, **kwargs):
        ds = create(group, *args, **kwargs)
        calls.append(1)
        if len(calls) == 3:  # the positions' value, step and time made; no box, no index
            group.file.flush()  # (as if HDF5 had written them out before the kill)
            os.kill(os.getpid(), signal.SIGKILL)
        return ds
    h5py.Group.create_dataset = create_then_die
    open_writer(sys.argv[1], "s").append(0, first)
    """
)


def test_a_writer_killed_creating_the_file_leaves_none(tmp_path: Path) -> None:
    """A writer killed while it laid the new file out left a file of some of the groups and
    datasets: the next writer refused it (not an instride archive), for good."""
    dest = tmp_path / "new.h5"
    proc = subprocess.run([sys.executable, "-c", KILLED_CREATING, str(dest)],
                          capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    _written(dest, 3)  # (the file is made under another name, given its own when complete)
    _assert_frames(dest, 3)
    assert sorted(os.listdir(tmp_path)) == ["new.h5"]  # the one left half made is gone


def test_a_created_file_left_under_both_names_is_resumed_whole(tmp_path: Path) -> None:
    """Killed between giving the new file its name and taking the temporary one away: the
    next writer resumes the file, and takes the other name away without touching it."""
    dest = tmp_path / "both.h5"
    _written(dest, 2)
    os.link(dest, tmp_path / ".both.h5.create")
    w = open_writer(dest, "s")
    assert sorted(os.listdir(tmp_path)) == [".both.h5.lock", "both.h5"]
    w.append(2, _frame(2))
    w.close()
    _assert_frames(dest, 3)


def test_a_copy_a_killed_writer_left_while_resuming_is_removed(tmp_path: Path) -> None:
    """A writer killed while copying a file left open (to resume it) left its copy,
    ``.NAME.PID.recover``, for good: the next writer of the file removes it."""
    dest = tmp_path / "rec.h5"
    _written(dest, 2)
    (tmp_path / ".rec.h5.4242.recover").write_bytes(b"half a copy")
    (tmp_path / ".other.h5.4242.recover").write_bytes(b"another file's")
    w = open_writer(dest, "s")
    w.close()
    assert sorted(os.listdir(tmp_path)) == [".other.h5.4242.recover", "rec.h5"]


HOLDING_READER = textwrap.dedent(
    """
    import sys
    from instride.archive import open_reader
    rd = open_reader(sys.argv[1], "s")
    print(len(rd.indices()), flush=True)
    sys.stdin.readline()
    print(len(rd.indices()), flush=True)
    rd.close()
    """
)


def test_a_reader_holding_the_archive_stops_its_resume_typed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HDF5's file lock: a reader in another process holding the archive made the resuming
    writer fail with HDF5's words ("unable to lock file, errno = 11"); a reader of this
    process, with "file is already open for read-only"."""
    monkeypatch.setenv("HDF5_USE_FILE_LOCKING", "TRUE")  # (the default; a site may turn it off)
    dest = tmp_path / "held.h5"
    _written(dest, 2)
    before = dest.read_bytes()
    reader = subprocess.Popen([sys.executable, "-c", HOLDING_READER, str(dest)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert reader.stdout is not None and reader.stdin is not None
        assert reader.stdout.readline().strip() == "2"
        with pytest.raises(ArchiveError, match=r"held\.h5.*another process holds it open.*close it"):
            open_writer(dest, "s")
        assert dest.read_bytes() == before
        reader.stdin.write("\n")
        reader.stdin.flush()
        out, err = reader.communicate(timeout=60)
        assert reader.returncode == 0 and out.strip() == "2", err
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    rd = open_reader(dest, "s")
    with pytest.raises(ArchiveError, match=r"held\.h5.*this process holds it open.*close it"):
        open_writer(dest, "s")
    rd.close()
    assert dest.read_bytes() == before
    w = open_writer(dest, "s")  # its readers gone, it resumes
    w.append(2, _frame(2))
    w.close()
    _assert_frames(dest, 3)
    assert sorted(os.listdir(tmp_path)) == ["held.h5"]


KILLED_AFTER_FLUSH = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    from instride.archive import open_writer
    from instride.frames import Frame, FrameHeader

    w = open_writer(sys.argv[1], "s")
    for i in range(2):
        pos = np.full((4, 3), float(i), np.float32)
        box = np.diag([30.0, 31.0, 32.0])
        w.append(i, Frame(FrameHeader(4, 10 * i, 0.5 * i, box, "xyz32", pos.nbytes, 0), pos))
    w.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_reader_of_a_file_replaced_by_its_resume_reads_the_new_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without HDF5's file lock, a writer resuming a file its killed writer left "open" (which
    it copies into a fresh file, renamed into place) goes on beside a reader holding the file:
    that reader kept reading the old file, and never saw another frame."""
    monkeypatch.setenv("HDF5_USE_FILE_LOCKING", "FALSE")
    dest = tmp_path / "moved.h5"
    proc = subprocess.run([sys.executable, "-c", KILLED_AFTER_FLUSH, str(dest)], capture_output=True,
                          timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    inode = os.stat(dest).st_ino
    reader = subprocess.Popen([sys.executable, "-c", HOLDING_READER, str(dest)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert reader.stdout is not None and reader.stdin is not None
        assert reader.stdout.readline().strip() == "2"
        w = open_writer(dest, "s")
        assert os.stat(dest).st_ino != inode  # (copied, the copy renamed into place)
        w.append(2, _frame(2))
        w.flush()
        reader.stdin.write("\n")
        reader.stdin.flush()
        out, err = reader.communicate(timeout=60)
        assert reader.returncode == 0 and out.strip() == "3", err
        w.close()
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    _assert_frames(dest, 3)
