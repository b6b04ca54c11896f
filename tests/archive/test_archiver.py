"""The durable tier: archiver process, crash-safe H5MD, reads of retired frames from the archive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import instride
from instride.archive import open_reader
from instride.errors import FramesMissed
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
    def slow_writer(path):
        w = real(path)
        flush = w.flush
        def slow():
            flush()
            print("flushed", flush=True)
        w.flush = slow
        return w
    archiver.open_writer = slow_writer
    archive_stream("crashy", sys.argv[1], timeout=60)
    """
)


def test_killed_archiver_loses_no_acknowledged_frame(managed_dir: Path, tmp_path: Path) -> None:
    dest = tmp_path / "crash.h5"
    producer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(
            """
            import numpy as np, instride
            with instride.Stream("crashy", mode="w", retain=3, groups=["archive"], timeout=120) as s:
                for i in range(40):
                    p = np.full((500, 3), float(i))
                    s.append(p, step=i)
            """
        )],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    victim = subprocess.Popen([sys.executable, "-c", ARCHIVER_VICTIM, str(dest)],
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
