"""The durable tier: archiver process, crash-safe H5MD, reads of retired frames from the archive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import instride
from instride.archive import open_reader
from instride.archiver import archive_stream
from instride.errors import ArchiveError, FramesMissed, GroupBusy, StreamRerun
from tests.conftest import finish

NATOMS = 500


def _pos(i: int) -> np.ndarray:
    pos = np.random.default_rng(i).random((NATOMS, 3)) * 50
    pos[0, 0] = i
    return pos


def test_stream_archive_option_keeps_every_frame(managed_dir: Path, tmp_path: Path) -> None:
    dest = tmp_path / "run.h5"
    box = np.diag([50.0, 51.0, 52.0])
    with instride.Stream("arch", mode="w", layout="paper", retain=4, archive=dest, timeout=60) as s:
        for i in range(30):
            s.append(_pos(i), step=10 * i, time=0.02 * i, box=box)
    on_disk = [n for n in os.listdir(managed_dir / "arch") if n.startswith("frame_")]
    assert len(on_disk) <= 5
    reader = instride.Stream("arch", timeout=10)
    assert len(reader) == 30
    for i in (0, 7, 25, 29, 3):  # random access: old ones from the archive, recent from memory
        frame = reader.read(i)
        assert frame.step == 10 * i and frame.time == pytest.approx(0.02 * i)
        np.testing.assert_array_equal(frame.positions, _pos(i))
        np.testing.assert_array_equal(frame.box, box)
    steps = [f.step for f in instride.Stream("arch", timeout=10)]
    assert steps == [10 * i for i in range(30)]  # iteration runs through the archive, no gap
    rd = open_reader(dest)
    assert list(rd.indices()) == list(range(30))
    rd.close()


def test_a_producer_that_fails_interrupts_its_archiver(managed_dir: Path, tmp_path: Path) -> None:
    # the archiver follows the stream to its end marker, which a failed producer never
    # writes: it used to be left running, waiting for frames that would never come
    dest = tmp_path / "broken.h5"
    with pytest.raises(RuntimeError, match="engine died"):
        with instride.Stream("broken", mode="w", retain=3, archive=dest, timeout=60) as s:
            for i in range(8):
                s.append(_pos(i), step=i)
            archiver = s._archiver
            raise RuntimeError("engine died")
    # stopped cleanly (0), or by the signal while still starting (-15); not waited out (-9)
    assert archiver is not None and archiver.returncode in (0, -signal.SIGTERM)
    assert not instride.Stream("broken", timeout=1).ended
    rd = open_reader(dest)  # what it archived before: a readable file, in order
    got = list(rd.indices())
    rd.close()
    assert got == list(range(len(got)))


def test_mdanalysis_reads_the_archive_file(managed_dir: Path, tmp_path: Path) -> None:
    import MDAnalysis as mda

    dest = tmp_path / "md.h5"
    with instride.Stream("mdarch", mode="w", retain=2, archive=dest, timeout=60) as s:
        for i in range(6):
            s.append(_pos(i).astype(np.float32), step=i, time=0.5 * i, box=[40.0, 40.0, 40.0])
    u = mda.Universe.empty(NATOMS, trajectory=False)
    u.load_new(str(dest), format="H5MD")
    assert len(u.trajectory) == 6
    u.trajectory[4]
    np.testing.assert_allclose(u.atoms.positions, _pos(4).astype(np.float32), rtol=1e-6)
    assert u.trajectory.ts.time == pytest.approx(2.0)


ARCHIVER_VICTIM = textwrap.dedent(
    """
    import sys, instride
    from instride import archiver
    from instride.archiver import archive_stream
    real = archiver.open_writer
    def slow_writer(*args, **kwargs):
        w = real(*args, **kwargs)
        flush = w.flush
        def slow():
            flush()
            print("flushed", flush=True)
        w.flush = slow
        return w
    archiver.open_writer = slow_writer
    archive_stream(sys.argv[2], sys.argv[1], timeout=60)
    """
)

PRODUCER = textwrap.dedent(
    """
    import sys, numpy as np, instride
    with instride.Stream(sys.argv[1], mode="w", retain=3, groups=["archive"], timeout=120) as s:
        for i in range(40):
            p = np.full((500, 3), float(i))
            s.append(p, step=i)
    """
)


def test_killed_archiver_loses_no_acknowledged_frame(managed_dir: Path, tmp_path: Path) -> None:
    dest = tmp_path / "crash.h5"
    producer = subprocess.Popen([sys.executable, "-c", PRODUCER, "crashy"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    victim = subprocess.Popen([sys.executable, "-c", ARCHIVER_VICTIM, str(dest), "crashy"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert victim.stdout is not None
        for _ in range(12):
            assert victim.stdout.readline().strip() == b"flushed"
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
        # restart: resumes after the last frame in the file
        rc, _, err = finish(subprocess.Popen(
            [sys.executable, "-m", "instride", "archive", "crashy", "--to", str(dest), "-q"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE), 120)
        assert rc == 0, err
        rc, _, err = finish(producer, 60)
        assert rc == 0, err
    finally:
        for p in (victim, producer):
            if p.poll() is None:
                p.kill()
                p.wait()
    rd = open_reader(dest)
    assert list(rd.indices()) == list(range(40))  # none lost, none twice
    assert rd.read(39).positions[0, 0] == 39.0
    rd.close()


ARCHIVER_KILLED_MID_APPEND = textwrap.dedent(
    """
    import os, signal, sys, h5py
    from instride import archiver
    from instride.archiver import archive_stream
    real = archiver.open_writer
    def dying_writer(*args, **kwargs):
        w = real(*args, **kwargs)
        flush, append, flushed = w.flush, w.append, []
        def counted():
            flush()
            flushed.append(1)
        def dying(index, frame):
            if len(flushed) < 12:
                return append(index, frame)
            put, calls = h5py.Dataset.__setitem__, []
            def put_then_die(ds, key, value):
                put(ds, key, value)
                calls.append(1)
                if len(calls) == 2:  # frame 12's positions and step written, its time, index not
                    ds.file.flush()  # (as if HDF5 had written them out before the kill)
                    os.kill(os.getpid(), signal.SIGKILL)
            h5py.Dataset.__setitem__ = put_then_die
            append(index, frame)
        w.flush, w.append = counted, dying
        return w
    archiver.open_writer = dying_writer
    archive_stream(sys.argv[2], sys.argv[1], timeout=60)
    """
)


def test_archiver_killed_mid_append_loses_no_frame(managed_dir: Path, tmp_path: Path) -> None:
    import h5py

    dest = tmp_path / "midway.h5"
    producer = subprocess.Popen([sys.executable, "-c", PRODUCER, "midway"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    victim = subprocess.Popen([sys.executable, "-c", ARCHIVER_KILLED_MID_APPEND, str(dest), "midway"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        rc, _, err = finish(victim, 120)
        assert rc == -signal.SIGKILL, err
        with h5py.File(dest, "r", libver="latest", swmr=True) as f:  # killed between two rows
            assert f["instride/index"].shape[0] == 12
            assert f["particles/trajectory/position/value"].shape[0] == 13
        rc, _, err = finish(subprocess.Popen(
            [sys.executable, "-m", "instride", "archive", "midway", "--to", str(dest), "-q"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE), 120)
        assert rc == 0, err
        rc, _, err = finish(producer, 60)
        assert rc == 0, err
    finally:
        for p in (victim, producer):
            if p.poll() is None:
                p.kill()
                p.wait()
    rd = open_reader(dest, "midway")
    assert list(rd.indices()) == list(range(40))
    for i in range(40):  # each row the frame of its index (frame 12 not the rows of the kill)
        frame = rd.read(i)
        assert frame is not None and frame.step == i and frame.positions[0, 0] == float(i)
    rd.close()
    assert sorted(os.listdir(tmp_path)) == ["managed", "midway.h5"]


def test_a_second_archiver_leaves_a_live_archive_alone(managed_dir: Path, tmp_path: Path) -> None:
    dest = tmp_path / "live.h5"
    with instride.Stream("live", mode="w", retain=100, groups=["archive"], timeout=60) as s:
        for i in range(10):
            s.append(_pos(i), step=i)
        first = subprocess.Popen([sys.executable, "-c", ARCHIVER_VICTIM, str(dest), "live"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert first.stdout is not None
            for _ in range(3):
                assert first.stdout.readline().strip() == b"flushed"
            inode = os.stat(dest).st_ino
            for group in ("archive", "other"):  # refused at the file's lock, before its group
                with pytest.raises(ArchiveError, match="another archiver is writing it"):
                    archive_stream("live", dest, group=group, timeout=10)
            with pytest.raises(GroupBusy):  # the same group, to another file: refused before
                archive_stream("live", tmp_path / "elsewhere.h5", timeout=10)  # it is made
            assert not (tmp_path / "elsewhere.h5").exists()
            assert os.stat(dest).st_ino == inode
            for i in range(10, 20):
                s.append(_pos(i), step=i)
        except BaseException:
            first.kill()
            first.wait()
            raise
    rc, _, err = finish(first, 120)
    assert rc == 0, err
    assert os.stat(dest).st_ino == inode  # the first archiver's file all along
    rd = open_reader(dest, "live")
    assert list(rd.indices()) == list(range(20))
    np.testing.assert_array_equal(rd.read(15).positions, _pos(15).astype(np.float32))
    rd.close()


def test_the_archive_of_another_stream_is_refused(managed_dir: Path, tmp_path: Path) -> None:
    dest = tmp_path / "one.h5"
    for name, first in (("one", 10), ("two", 20)):
        with instride.Stream(name, mode="w", groups=["archive"]) as s:
            for i in range(3):
                s.append(_pos(first + i), step=i)
    assert archive_stream("one", dest, timeout=10).total == 3
    with pytest.raises(ArchiveError, match="the archive of stream 'one'"):
        archive_stream("two", dest, timeout=10)
    rd = open_reader(dest, "one")
    assert list(rd.indices()) == [0, 1, 2]
    np.testing.assert_array_equal(rd.read(2).positions, _pos(12).astype(np.float32))
    rd.close()
    assert archive_stream("two", tmp_path / "two.h5", timeout=10).total == 3  # its group untouched


def test_a_refused_file_leaves_the_stream_without_an_archive_group(managed_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "notes.h5"
    bad.write_text("my notes\n")
    with instride.Stream("plain", mode="w", retain=2, timeout=0) as s:
        s.append(_pos(0), step=0)
        s.append(_pos(1), step=1)
        with pytest.raises(ArchiveError, match="not an HDF5 file"):
            archive_stream("plain", bad, timeout=0)
        for i in range(2, 6):  # no consumer group registered that holds the producer back
            s.append(_pos(i), step=i)
    assert bad.read_text() == "my notes\n"


def test_dropped_frames_without_archive_still_raise(managed_dir: Path) -> None:
    with instride.Stream("noarch", mode="w", retain=2, on_full="drop-oldest") as s:
        for i in range(5):
            s.append(_pos(i), step=i)
    with pytest.raises(FramesMissed):
        instride.Stream("noarch").read(0)


def test_archive_cli_help_and_bad_format(managed_dir: Path, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "instride", "archive", "--help"],
                         capture_output=True, text=True, check=True)
    assert "--to" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "instride", "archive", "x", "--to", str(tmp_path / "x.txt")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "unknown archive format" in bad.stderr
    assert not (tmp_path / "x.txt").exists()



def test_instride_url_reads_the_whole_run_memory_and_archive(managed_dir: Path, tmp_path: Path) -> None:
    import MDAnalysis as mda

    import instride.analytics  # noqa: F401  (registers the instride:// reader)

    with instride.Stream("whole", mode="w", retain=3, archive=tmp_path / "whole.h5", timeout=60) as s:
        for i in range(20):
            s.append(np.full((100, 3), float(i), np.float32), step=i, time=float(i))
    u = mda.Universe.empty(100, trajectory=True)
    u.load_new("instride://whole")
    assert len(u.trajectory) == 20
    for i in (2, 19, 0, 17, 5):  # random access across the archive (0-16) and memory (17-19)
        u.trajectory[i]
        assert u.atoms.positions[0, 0] == i and u.trajectory.ts.time == i


def test_an_overwritten_run_starts_a_new_archive(managed_dir: Path, tmp_path: Path) -> None:
    """A re-run with ``overwrite=True`` onto the same archive file: its archiver used to resume
    the earlier run's file, skip the new run's frames as far as that run went, and readers got
    the earlier run's frames from it."""
    dest = tmp_path / "rerun.h5"
    for first, overwrite in ((1.0, False), (2.0, True)):
        with instride.Stream("rerun", mode="w", retain=2, archive=dest, overwrite=overwrite,
                             timeout=60) as s:
            for i in range(5):
                s.append(np.full((NATOMS, 3), first + i), step=i)
    reader = instride.Stream("rerun", timeout=10)
    assert [reader.read(i).positions[0, 0] for i in range(5)] == [2.0, 3.0, 4.0, 5.0, 6.0]


def test_overwrite_replaces_only_the_streams_own_archive(managed_dir: Path,
                                                         tmp_path: Path) -> None:
    """``overwrite=True`` removed whatever file ``archive=`` named: another stream's archive,
    a file that is no archive at all. Those are refused now (``ArchiveError``) and left as
    they are, before anything is touched: the earlier run's frames are still there."""
    other = tmp_path / "other.h5"
    with instride.Stream("other", mode="w", archive=other, timeout=60) as s:
        for i in range(3):
            s.append(_pos(i), step=i)
    notes = tmp_path / "notes.h5"
    notes.write_text("not an archive\n")
    with instride.Stream("mine", mode="w", timeout=60) as s:  # (an earlier run, no archive)
        s.append(_pos(7), step=0)
    for dest, why in ((other, "it is the archive of stream 'other'"),
                      (notes, "not an HDF5 file")):
        again = instride.Stream("mine", mode="w", overwrite=True, archive=dest, timeout=60)
        with pytest.raises(ArchiveError, match=f"cannot replace it with overwrite=True, left as "
                                               f"it is: {why}"):
            again.append(_pos(8), step=0)
        again.abandon()
        assert instride.Stream("mine", timeout=10).read(0).positions[0, 0] == 7  # (untouched)
    assert notes.read_text() == "not an archive\n"
    rd = open_reader(other)
    assert list(rd.indices()) == [0, 1, 2]
    rd.close()


def test_overwrite_onto_a_link_to_nothing_makes_the_archive(managed_dir: Path,
                                                            tmp_path: Path) -> None:
    """``archive=`` a symbolic link to a file not made yet, with ``overwrite=True``: there is
    nothing to replace, and the first fix refused it ("no such file"); the archive is made
    where the link points."""
    link = tmp_path / "link.h5"
    link.symlink_to(tmp_path / "target.h5")
    with instride.Stream("linked", mode="w", overwrite=True, archive=link, timeout=60) as s:
        for i in range(3):
            s.append(_pos(i), step=i)
    rd = open_reader(tmp_path / "target.h5")
    assert list(rd.indices()) == [0, 1, 2]
    rd.close()
    assert not list(tmp_path.glob(".*.lock"))  # (the lock let go of, its file removed)


def test_overwrite_leaves_an_archive_its_archiver_writes(managed_dir: Path,
                                                         tmp_path: Path) -> None:
    """A producer with ``overwrite=True`` naming the file a live archiver writes removed it
    before its own archiver found the lock taken: the running stream's archive was lost
    (and its close failed, "no such file"). Refused now, the file and its archiver untouched
    -- also before that archiver's process has started (a review of the first fix: its
    archiver took the lock, and another producer's could take it first)."""
    dest = tmp_path / "live.h5"
    live = instride.Stream("live", mode="w", archive=dest, timeout=60)
    try:
        live.append(_pos(0), step=0)
        # at once (its archiver process may not have started: the producer took the file's
        # lock itself, and hands it over), then once the archiver has made the file
        for made in (False, True):
            while made and not dest.exists():
                time.sleep(0.01)
            with pytest.raises(ArchiveError, match="another archiver is writing it"):
                with instride.Stream(f"intruder{made:d}", mode="w", overwrite=True,
                                     archive=dest, timeout=60) as s:
                    s.append(_pos(9), step=0)
        for i in range(1, 5):
            live.append(_pos(i), step=i)
    finally:
        live.close()
    rd = open_reader(dest)
    assert list(rd.indices()) == [0, 1, 2, 3, 4]
    rd.close()


def test_an_archive_file_of_an_earlier_run_is_refused_not_resumed(
        managed_dir: Path, tmp_path: Path) -> None:
    """A new run of a stream whose archive file is there already (a managed directory made
    afresh for each job, the archive kept): refused before anything is touched. Its archiver
    resumed the earlier run's file: this run's first frames were never archived, and readers
    got the earlier run's from it."""
    dest = tmp_path / "kept.h5"
    with instride.Stream("kept", mode="w", retain=2, archive=dest, timeout=60) as s:
        for i in range(5):
            s.append(np.full((NATOMS, 3), 100.0 + i), step=i)
    import shutil

    shutil.rmtree(managed_dir / "kept")  # (the next job's managed directory: nothing of it)
    shutil.rmtree(managed_dir / ".instride" / "streams" / "kept.stream")
    again = instride.Stream("kept", mode="w", retain=2, archive=dest, timeout=60)
    with pytest.raises(ArchiveError, match="earlier run"):
        again.append(np.full((NATOMS, 3), 200.0), step=0)
    again.abandon()
    rd = open_reader(dest)
    assert list(rd.indices()) == list(range(5))  # (left as it was)
    rd.close()


def test_a_rerun_without_an_archive_does_not_serve_the_earlier_runs(
        managed_dir: Path, tmp_path: Path) -> None:
    """Run 1 archives its frames; run 2 (``overwrite=True``) has no archive: a retired frame
    of run 2 is missed, not read from run 1's archive (its location stayed recorded)."""
    with instride.Stream("stale", mode="w", retain=2, archive=tmp_path / "r1.h5",
                         timeout=60) as s:
        for i in range(5):
            s.append(np.full((NATOMS, 3), 100.0 + i), step=i)
    with instride.Stream("stale", mode="w", retain=2, on_full="drop-oldest",
                         overwrite=True) as s:
        for i in range(5):
            s.append(np.full((NATOMS, 3), 200.0 + i), step=i)
    reader = instride.Stream("stale", timeout=5)
    with pytest.raises(FramesMissed):
        reader.read(0)
    assert reader.read(4).positions[0, 0] == 204.0
    reader.close()


def test_close_waits_for_the_archiver_and_finds_it_stopped_short(
        managed_dir: Path, tmp_path: Path) -> None:
    """A producer with ``timeout=0``: its ``close()`` waits for the archiver to take the last
    frames (it was killed at once, no archive left, a bare TimeoutExpired raised). An archiver
    stopped by SIGTERM meanwhile (it exits 0): ``close()`` raises ArchiveError saying the
    archive is short of the end (it returned as if every frame were archived)."""
    dest = tmp_path / "zero.h5"
    with instride.Stream("zero", mode="w", retain=4, archive=dest, timeout=0) as s:
        for i in range(3):
            s.append(np.full((NATOMS, 3), float(i)), step=i)
    rd = open_reader(dest)
    assert list(rd.indices()) == [0, 1, 2]
    rd.close()
    s = instride.Stream("short", mode="w", retain=100, archive=tmp_path / "short.h5",
                        timeout=60)
    for i in range(3):
        s.append(np.full((NATOMS, 3), float(i)), step=i)
    proc = s._archiver
    assert proc is not None
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # (its three frames archived: then stopped)
        if (tmp_path / "short.h5").exists():
            probe = open_reader(tmp_path / "short.h5")
            n = len(probe.indices())
            probe.close()
            if n == 3:
                break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    for i in range(3, 6):
        s.append(np.full((NATOMS, 3), float(i)), step=i)
    with pytest.raises(ArchiveError, match="up to 2 archived of 0..5"):
        s.close()


def test_an_index_row_without_its_frame_is_no_frame(managed_dir: Path, tmp_path: Path) -> None:
    """An append's rollback cut short after it trimmed the coordinates but not the index: the
    index's last row has no frame behind it. Readers take the rows every dataset has (they
    raised a bare IndexError reading that frame)."""
    import h5py

    dest = tmp_path / "cut.h5"
    with instride.Stream("cut", mode="w", retain=8, archive=dest, timeout=60) as s:
        for i in range(3):
            s.append(_pos(i), step=i)
    with h5py.File(dest, "r+") as f:
        value = next(f[f"particles/{g}/position/value"] for g in f["particles"])
        value.resize(2, axis=0)  # (as a rollback interrupted before the index's trim)
    rd = open_reader(dest)
    try:
        assert list(rd.indices()) == [0, 1]
        assert rd.read(2) is None
        frame = rd.read(1)
        assert frame is not None and frame.step == 1
    finally:
        rd.close()


def test_a_dead_archiver_fails_its_producer(managed_dir: Path, tmp_path: Path) -> None:
    """The archiver a stream started dies: the producer, whose retention waits for the
    archive group, fails with ArchiveError and the archiver's status (it waited its whole
    timeout, or for ever, for a group nobody would move). A file whose writer's lock cannot
    be taken is refused at the first append, by the producer itself (it takes the lock
    before its archiver starts, and hands it over)."""
    (tmp_path / ".x.h5.lock").mkdir()  # (its writer's lock file cannot be made: EISDIR)
    s = instride.Stream("nolock", mode="w", retain=2, archive=tmp_path / "x.h5", timeout=30)
    with pytest.raises(ArchiveError, match="cannot make its writer's lock file"):
        s.append(_pos(0), step=0)
    s.abandon()
    s = instride.Stream("deadarch", mode="w", retain=2, archive=tmp_path / "y.h5", timeout=30)
    s.append(_pos(0), step=0)
    assert s._archiver is not None
    s._archiver.kill()
    with pytest.raises(ArchiveError, match="exited with status"):
        for i in range(1, 10):
            s.append(_pos(i), step=i)
    s.abandon()


def test_an_archiver_refused_at_the_file_registers_no_group(managed_dir: Path,
                                                           tmp_path: Path) -> None:
    """An archiver refused because another one writes the file (of another stream) had
    registered its consumer group first: a group nobody would ever move, which held the
    stream's frames, so its producer stopped at the bound (StreamFull after its timeout)."""
    from instride.archive.base import lock_writer, unlock_writer

    dest = tmp_path / "taken.h5"
    lock = lock_writer(dest, "another stream")  # (as another archiver writing the file)
    try:
        with instride.Stream("held", mode="w", retain=2, timeout=3) as s:
            s.append(_pos(0), step=0)
            with pytest.raises(ArchiveError, match="another archiver is writing it"):
                archive_stream("held", dest, group="late", timeout=5)
            for i in range(1, 8):  # past the bound: no group holds the frames
                s.append(_pos(i), step=i)
    finally:
        unlock_writer(dest, lock)
    assert not dest.exists()


def test_an_archiver_that_fails_to_start_lets_go_of_the_file(managed_dir: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure between opening the archive and the first frame (recording where the archive
    is: Redis out of reach) kept the file's writer lock: the next archiver of that file in the
    process was refused ("another archiver is writing it")."""
    with instride.Stream("startfail", mode="w") as s:
        s.append(_pos(0), step=0)
    dest = tmp_path / "sf.h5"

    def unreachable(self: instride.Stream, path: object) -> None:
        raise instride.MetadataUnavailable("redis://x", "out of reach")

    monkeypatch.setattr(instride.Stream, "set_archive", unreachable)
    for _ in range(2):  # (the second is refused for the same reason, not for a held lock)
        with pytest.raises(instride.MetadataUnavailable):
            archive_stream("startfail", dest, timeout=5)


ARCHIVER_KILLED_CREATING = textwrap.dedent(
    """
    import os, signal, sys, h5py
    from instride.archiver import archive_stream
    create, calls = h5py.Group.create_dataset, []
    def create_then_die(group, *args, **kwargs):
        ds = create(group, *args, **kwargs)
        calls.append(1)
        if len(calls) == 3:  # the positions' value, step and time made; no box, no index
            group.file.flush()  # (as if HDF5 had written them out before the kill)
            os.kill(os.getpid(), signal.SIGKILL)
        return ds
    h5py.Group.create_dataset = create_then_die
    archive_stream(sys.argv[2], sys.argv[1], timeout=60)
    """
)


def test_an_archiver_killed_creating_its_file_is_restarted(managed_dir: Path, tmp_path: Path) -> None:
    """An archiver killed while it laid out a new archive file left a file of some of its
    groups and datasets, which every later archiver of the path refused ("cannot be opened",
    or "not an instride archive"): the stream could not be archived there again."""
    dest = tmp_path / "new.h5"
    with instride.Stream("fresh", mode="w", groups=["archive"]) as s:
        for i in range(5):
            s.append(_pos(i), step=i)
    rc, _, err = finish(subprocess.Popen([sys.executable, "-c", ARCHIVER_KILLED_CREATING, str(dest), "fresh"],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE), 120)
    assert rc == -signal.SIGKILL, err
    report = archive_stream("fresh", dest, timeout=10)
    assert (report.frames, report.total) == (5, 5)
    rd = open_reader(dest, "fresh")
    assert list(rd.indices()) == list(range(5))
    for i in range(5):
        frame = rd.read(i)
        assert frame is not None and frame.step == i
        np.testing.assert_array_equal(frame.positions, _pos(i).astype(np.float32))
    rd.close()
    assert sorted(os.listdir(tmp_path)) == ["managed", "new.h5"]


HOLDING_READER = textwrap.dedent(
    """
    import sys
    from instride.archive import open_reader
    rd = open_reader(sys.argv[1])
    print(len(rd.indices()), flush=True)
    sys.stdin.readline()
    rd.close()
    """
)


def test_an_archive_held_by_a_reader_stops_the_resuming_archiver_typed(
        managed_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader holding the archive open (HDF5's file lock) when the archiver restarted: the
    archiver failed with HDF5's words ("unable to lock file, errno = 11")."""
    monkeypatch.setenv("HDF5_USE_FILE_LOCKING", "TRUE")  # (the default; a site may turn it off)
    dest = tmp_path / "held.h5"
    with instride.Stream("held", mode="w", groups=["archive"]) as s:
        for i in range(3):
            s.append(_pos(i), step=i)
    assert archive_stream("held", dest, group="first", timeout=10).total == 3
    reader = subprocess.Popen([sys.executable, "-c", HOLDING_READER, str(dest)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert reader.stdout is not None and reader.stdin is not None
        assert reader.stdout.readline().strip() == "3"
        rc, _, err = finish(subprocess.Popen(
            [sys.executable, "-m", "instride", "archive", "held", "--to", str(dest), "-q"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE), 60)
        assert rc != 0 and "Traceback" not in err, err
        assert f"({dest}) failed: another process holds it open" in err and "close it" in err, err
        reader.stdin.write("\n")
        reader.stdin.flush()
        assert reader.wait(timeout=60) == 0
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    report = archive_stream("held", dest, timeout=10)  # its reader gone, the archiver resumes
    assert (report.frames, report.total) == (0, 3)


HOLDS_FOR_WRITING = textwrap.dedent(
    """
    import sys, time, h5py
    with h5py.File(sys.argv[1], "a"):  # (as an archiver resuming it does, for a moment)
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
    """
)


def test_a_retired_frame_read_while_the_archive_is_held_for_writing_waits(
        managed_dir: Path, tmp_path: Path) -> None:
    """A reader of a retired frame opens the archive while another process holds it for
    writing (an archiver resuming it, until it is in SWMR mode): it tries again for a few
    seconds (it raised ArchiveError at once)."""
    dest = tmp_path / "held.h5"
    with instride.Stream("held", mode="w", retain=2, archive=dest, timeout=60) as s:
        for i in range(6):
            s.append(_pos(i), step=i)
    holder = subprocess.Popen([sys.executable, "-c", HOLDS_FOR_WRITING, str(dest), "1.0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        frame = instride.Stream("held", timeout=10).read(0)  # (retired: from the archive)
        assert frame.step == 0
        np.testing.assert_allclose(frame.positions, _pos(0), rtol=1e-6)  # (xyz32)
    finally:
        rc, _, err = finish(holder, 30)
    assert rc == 0, err


PRODUCER_KILLED = textwrap.dedent(
    """
    import sys, time, numpy as np, instride
    s = instride.Stream(sys.argv[1], mode="w", retain=3, archive=sys.argv[2], timeout=60)
    for i in range(6):
        s.append(np.full((500, 3), float(i)), step=i)
    print(s._archiver.pid, flush=True)
    time.sleep(600)  # (killed here, its stream open)
    """
)


def _exited(pid: int) -> bool:
    """Whether process ``pid`` (not a child of this one) has exited: gone, or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_an_archiver_stops_once_its_producer_is_killed(managed_dir: Path, tmp_path: Path) -> None:
    """A producer with ``archive=`` killed outright (SIGKILL: no teardown) left its archiver
    waiting for ever for frames and an end that would never come. It now takes the frames
    published by then, closes the file and stops."""
    dest = tmp_path / "orphan.h5"
    producer = subprocess.Popen([sys.executable, "-c", PRODUCER_KILLED, "orphaned", str(dest)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    archiver = None
    try:
        assert producer.stdout is not None
        archiver = int(producer.stdout.readline())
        producer.kill()
        producer.communicate(timeout=30)
        deadline = time.monotonic() + 30
        while not _exited(archiver) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _exited(archiver), "the archiver still runs 30 s after its producer was killed"
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.wait()
        if archiver is not None and not _exited(archiver):
            os.kill(archiver, signal.SIGKILL)
    rd = open_reader(dest)  # closed whole, every frame published in it
    try:
        assert list(rd.indices()) == list(range(6))
        assert rd.read(5).positions[0, 0] == 5.0
    finally:
        rd.close()
    assert not (tmp_path / ".orphan.h5.lock").exists()


def _archive_two_runs(dest: Path, client: object) -> None:
    """Run 1 of stream "twice" (6 frames) archived to ``dest`` by hand, then run 2 (10
    frames, ``overwrite=True``) and the same command onto the same file (as a batch script
    that is run again does)."""
    for run, n in ((1, 6), (2, 10)):
        with instride.Stream("twice", mode="w", overwrite=run > 1, client=client) as s:
            for i in range(n):
                s.append(np.full((NATOMS, 3), 100.0 * run + i), step=i)
        if run == 1:
            report = archive_stream("twice", dest, timeout=10, client=client)
            assert (report.frames, report.total) == (6, 6)


@pytest.mark.parametrize("mode", ["local", "cluster"])
def test_an_archive_of_an_earlier_run_is_not_resumed(mode: str, managed_dir: Path, tmp_path: Path,
                                                     request: pytest.FixtureRequest) -> None:
    """``instride archive`` run by hand onto the file of an earlier run of the stream (a
    re-run with ``overwrite=True``) resumed it: it kept that run's frames 0-5 as this run's
    and skipped this run's frames 0-5, never archived. The file records its run; another
    run's file is refused, untouched."""
    if mode == "cluster":
        from tests.conftest import LoopbackNode

        redis_server = request.getfixturevalue("redis_server")
        client = LoopbackNode(tmp_path, 1, redis_server.url, "test-token").client()
    else:
        client = instride.get_client()
    dest = tmp_path / "twice.h5"
    try:
        _archive_two_runs(dest, client)
        with pytest.raises(ArchiveError, match="another run of the stream"):
            archive_stream("twice", dest, timeout=10, client=client)
        rd = open_reader(dest)
        try:  # untouched: run 1's frames
            assert list(rd.indices()) == list(range(6))
            assert rd.read(5).positions[0, 0] == 105.0
        finally:
            rd.close()
        dest.unlink()  # this run's own file: every frame of it
        report = archive_stream("twice", dest, timeout=10, client=client)
        assert (report.frames, report.total) == (10, 10)
        again = archive_stream("twice", dest, timeout=10, client=client)  # the same run: resumed
        assert (again.frames, again.total) == (0, 10)
    finally:
        client.close()


# ---------------------------------------------------------------------- round 45's review
def test_a_reader_kept_from_an_earlier_run_does_not_serve_its_archive(
        managed_dir: Path, tmp_path: Path) -> None:
    """A reader that read a retired frame of run 1 (from its archive) kept that archive open:
    after a re-run without an archive it served run 1's frames as run 2's. (It raises
    StreamRerun now: it read run 1; the archive is also looked up again per retired frame.)"""
    with instride.Stream("rr", mode="w", retain=2, archive=tmp_path / "r1.h5", timeout=30) as s:
        for i in range(6):
            s.append(np.full((10, 3), 100.0 + i, np.float32), step=i)
    r = instride.Stream("rr", timeout=5)
    assert r.read(0).positions[0, 0] == 100.0  # (from the archive)
    with instride.Stream("rr", mode="w", overwrite=True, retain=2, on_full="drop-oldest",
                         timeout=30) as s:
        for i in range(6):
            s.append(np.full((10, 3), 200.0 + i, np.float32), step=i)
    with pytest.raises(StreamRerun):
        r.read(0)
    r.close()


def test_an_archive_group_of_an_earlier_run_does_not_hold_a_rerun(
        managed_dir: Path, tmp_path: Path) -> None:
    """A re-run (overwrite=True) without archive=, bounded, under "block": it waited for the
    earlier run's "archive" group, which nobody reads any more (StreamFull)."""
    with instride.Stream("ag", mode="w", retain=2, archive=tmp_path / "a.h5", timeout=30) as s:
        for i in range(4):
            s.append(_pos(i), step=i)
    with instride.Stream("ag", mode="w", retain=2, overwrite=True, timeout=3) as s:
        for i in range(6):
            s.append(_pos(i), step=i)
        assert "archive" not in s._share.cursors()


def test_an_archiver_refused_at_an_existing_file_registers_no_group(
        managed_dir: Path, tmp_path: Path) -> None:
    """An archive of an older instride (it names no stream) was refused only once the archiver
    had registered its group, which then held the producer's frames (StreamFull)."""
    import shutil

    import h5py

    dest = tmp_path / "old.h5"
    with instride.Stream("un", mode="w", retain=2, archive=dest, timeout=30) as s:
        for i in range(3):
            s.append(_pos(i), step=i)
    with h5py.File(dest, "r+") as f:
        del f["instride"].attrs["stream"]
        del f["instride"].attrs["run"]
    shutil.rmtree(managed_dir / "un")  # (a fresh managed directory: a new job)
    shutil.rmtree(managed_dir / ".instride" / "streams" / "un.stream")
    s = instride.Stream("un", mode="w", retain=2, timeout=3)
    try:
        s.append(_pos(0), step=0)
        with pytest.raises(ArchiveError):
            archive_stream("un", dest, timeout=1)
        assert "archive" not in s._share.cursors()
        for i in range(1, 6):
            s.append(_pos(i), step=i)  # (no group holds the frames back)
    finally:
        s.close()


def test_the_producers_archiver_outlives_a_pause_longer_than_instride_timeout(
        tmp_path: Path) -> None:
    """The archiver took the producer's INSTRIDE_TIMEOUT as its own: frames coming slower than
    that ended it with an error, and the producer's close() raised ArchiveError."""
    code = textwrap.dedent("""
        import sys, time, numpy as np, instride
        with instride.Stream("slow", mode="w", retain=2, archive=sys.argv[1]) as s:
            for i in range(3):
                s.append(np.full((10, 3), float(i), np.float32), step=i)
                time.sleep(1.5)
        print("closed")
        """)
    env = dict(os.environ, INSTRIDE_DIR=str(tmp_path / "m"), INSTRIDE_TIMEOUT="0.5")
    env.pop("INSTRIDE_REDIS_URL", None)
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "slow.h5")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "closed" in res.stdout, res.stderr[-2000:]
    archive = open_reader(tmp_path / "slow.h5")
    try:
        assert list(archive.indices()) == [0, 1, 2]
    finally:
        archive.close()


def test_ctrl_c_to_the_producers_process_group_spares_its_archiver(tmp_path: Path) -> None:
    """A terminal's Ctrl-C goes to the whole foreground process group: the archiver, in the
    producer's, died of it — a producer that caught it and ended its run cleanly got an
    ArchiveError (with an empty message) and a short archive."""
    code = textwrap.dedent("""
        import sys, time, numpy as np, instride
        s = instride.Stream("cc", mode="w", retain=2, archive=sys.argv[1], timeout=60)
        try:
            for i in range(10_000):
                s.append(np.full((10, 3), float(i), np.float32), step=i)
                if i == 3:
                    print("running", flush=True)
                time.sleep(0.05)
        except KeyboardInterrupt:
            pass
        s.close()
        print("closed", len(s), flush=True)
        """)
    env = dict(os.environ, INSTRIDE_DIR=str(tmp_path / "m"))
    env.pop("INSTRIDE_REDIS_URL", None)
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "cc.h5")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().decode().strip() == "running"
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)  # (as a terminal does)
    rc, out, err = finish(proc, timeout=120)
    assert rc == 0, err[-2000:]
    written = int(out.split()[-1])
    archive = open_reader(tmp_path / "cc.h5")
    try:
        assert list(archive.indices()) == list(range(written))
    finally:
        archive.close()


def test_an_archive_of_an_unknown_format_is_refused_at_once(managed_dir: Path,
                                                             tmp_path: Path) -> None:
    """A wrong suffix was told only when the producer first waited for the archive group: under
    a dropping policy at close(), after every frame had gone unarchived."""
    with pytest.raises(instride.ConfigError, match="unknown archive format"):
        instride.Stream("bad", mode="w", retain=2, on_full="drop-oldest",
                        archive=tmp_path / "run.xtc")


def test_an_archive_in_a_missing_directory_is_refused_by_the_producer_at_once(
        managed_dir: Path, tmp_path: Path) -> None:
    """The archiver makes no directory (a mistyped path would leave a tree behind): a
    producer's ``archive=`` in a directory that does not exist is an ``ArchiveError`` at
    ``Stream(...)``, before anything starts, not the archiver's failure after frames went."""
    with pytest.raises(ArchiveError, match="does not exist"):
        instride.Stream("md", mode="w", archive=tmp_path / "no" / "such" / "a.h5")
    assert not (tmp_path / "no").exists()
    assert not (managed_dir / "md").exists()


def test_an_archive_path_that_is_a_directory_is_an_archive_error_on_a_rerun(
        managed_dir: Path, tmp_path: Path) -> None:
    """``overwrite=True`` removes an earlier run's archive; where the path was a directory the
    producer's first append raised a bare ``IsADirectoryError``."""
    (tmp_path / "d.h5").mkdir()
    s = instride.Stream("dirarch", mode="w", overwrite=True, archive=tmp_path / "d.h5")
    with pytest.raises(ArchiveError, match="cannot replace it"):
        s.append(_pos(0), step=0)
    s.abandon()


def test_an_archiver_that_cannot_be_started_fails_every_append(
        managed_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The archiver's process could not be started: the producer appended on without one
    (nothing archived), or, told to try again, began its run again (its groups reset under
    their readers). Every append and close refuses now, naming why; abandon() ends it, and
    the file's lock is let go of."""
    from instride.archive import process

    def refused(*_args: object, **_kw: object) -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(process.ArchiverProcess, "__init__", refused)
    s = instride.Stream("nostart", mode="w", archive=tmp_path / "n.h5", timeout=10)
    for _ in range(2):
        with pytest.raises((OSError, ArchiveError), match="Too many open files"):
            s.append(_pos(0), step=0)
    with pytest.raises(ArchiveError, match="its archiver could not be started"):
        s.close()
    s.abandon()
    assert not list(tmp_path.glob(".*.lock"))

