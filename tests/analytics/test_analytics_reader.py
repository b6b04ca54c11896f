"""The instride:// MDAnalysis reader: registration, live iteration, len/random access,
standard analyses unchanged, refusals, timeouts and corruption as errors."""

from __future__ import annotations

import json
import pickle
import textwrap
import time
from pathlib import Path

import MDAnalysis as mda
import numpy as np
import pytest
from MDAnalysis.analysis import rms
from MDAnalysis.lib.mdamath import triclinic_vectors
from MDAnalysisTests.datafiles import DCD, PSF

import instride
from instride.analytics import InstrideReader
from instride.errors import ConsumeTimeout, EndOfStream, FramesMissed, IntegrityError
from tests.conftest import finish, spawn_py

NFRAMES = 20
DIMS = np.array([50.0, 60.0, 70.0, 80.0, 90.0, 100.0])  # a triclinic box, a b c alpha beta gamma


@pytest.fixture(scope="module")
def adk() -> mda.Universe:
    """Adenylate kinase (3,341 atoms), the first NFRAMES frames of the MDAnalysis test DCD."""
    return mda.Universe(PSF, DCD)


def publish_dcd(name: str, universe: mda.Universe, n: int = NFRAMES, close: bool = True) -> None:
    stream = instride.Stream(name, mode="w")
    box = triclinic_vectors(DIMS)
    for ts in universe.trajectory[:n]:
        stream.append(universe.atoms.positions, step=ts.frame * 10, time=ts.time, box=box)
    if close:
        stream.close()


def test_reader_is_registered_with_format_hint(managed_dir: Path) -> None:
    from MDAnalysis.coordinates.core import get_reader_for

    assert get_reader_for("instride://run7") is InstrideReader
    assert get_reader_for("run7.dcd") is not InstrideReader


def test_frames_match_source_and_len_is_final_after_end(managed_dir: Path, adk) -> None:
    publish_dcd("adk", adk)
    u = mda.Universe(PSF, "instride://adk")
    assert isinstance(u.trajectory, InstrideReader)
    assert u.trajectory.ended and len(u.trajectory) == NFRAMES
    seen = 0
    for ts, ref in zip(u.trajectory, adk.trajectory[:NFRAMES], strict=True):
        assert ts.frame == ref.frame
        np.testing.assert_allclose(u.atoms.positions, adk.atoms.positions, atol=1e-5)
        np.testing.assert_allclose(ts.dimensions, DIMS, atol=1e-4)
        assert ts.data["step"] == ref.frame * 10
        assert ts.time == pytest.approx(ref.time)
        seen += 1
    assert seen == NFRAMES
    assert u.trajectory.ts.frame == 0  # rewound at the end, like every MDAnalysis reader
    u.trajectory[-1]
    assert u.trajectory.ts.frame == NFRAMES - 1
    assert [ts.frame for ts in u.trajectory[2:9:3]] == [2, 5, 8]
    assert u.trajectory.dt == pytest.approx(adk.trajectory.dt, rel=1e-5)


def test_rmsd_and_rmsf_run_unchanged(managed_dir: Path, adk) -> None:
    publish_dcd("adk", adk)
    u = mda.Universe(PSF, "instride://adk")
    got = rms.RMSD(u, select="backbone").run().results.rmsd
    ref_u = mda.Universe(PSF, DCD)
    want = rms.RMSD(ref_u, select="backbone").run(stop=NFRAMES).results.rmsd
    np.testing.assert_allclose(got, want, atol=1e-4)
    got_f = rms.RMSF(u.select_atoms("name CA")).run().results.rmsf
    want_f = rms.RMSF(ref_u.select_atoms("name CA")).run(stop=NFRAMES).results.rmsf
    np.testing.assert_allclose(got_f, want_f, atol=1e-4)


def test_live_stream_len_grows_and_random_access_refuses_unpublished(
    managed_dir: Path, adk
) -> None:
    stream = instride.Stream("live", mode="w")
    for ts in adk.trajectory[:5]:
        stream.append(adk.atoms.positions, step=ts.frame, time=ts.time)
    u = mda.Universe(PSF, "instride://live", timeout=0.5)
    assert len(u.trajectory) == 5 and not u.trajectory.ended
    assert u.dimensions is None  # published without a box
    # analyses run over the frames published so far, without waiting
    assert rms.RMSD(u, select="name CA").run().results.rmsd.shape[0] == 5
    with pytest.raises(IndexError, match="frame 7 of stream 'live' is not published yet"):
        u.trajectory[7]
    for ts in adk.trajectory[5:8]:
        stream.append(adk.atoms.positions, step=ts.frame, time=ts.time)
    assert len(u.trajectory) == 8
    u.trajectory[7]
    np.testing.assert_allclose(u.atoms.positions, adk.trajectory[7].positions, atol=1e-5)
    # "final" length waits for end-of-stream: here it never comes -> a timeout, not a guess
    with pytest.raises(ConsumeTimeout):
        len(mda.Universe(PSF, "instride://live", timeout=0.3, length="final").trajectory)
    stream.close()
    assert len(mda.Universe(PSF, "instride://live", length="final").trajectory) == 8


def test_iteration_timeout_raises_instead_of_ending(managed_dir: Path, adk) -> None:
    publish_dcd("stalled", adk, n=3, close=False)
    u = mda.Universe(PSF, "instride://stalled", timeout=0.3)
    frames = []
    with pytest.raises(ConsumeTimeout):
        for ts in u.trajectory:
            frames.append(ts.frame)
    assert frames == [0, 1, 2]


def test_corrupt_frame_raises_integrity_error(managed_dir: Path, adk) -> None:
    publish_dcd("bad", adk, n=3)
    path = managed_dir / "bad" / "frame_000000001.isf"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    u = mda.Universe(PSF, "instride://bad")
    with pytest.raises(IntegrityError):
        for _ in u.trajectory:
            pass


def test_a_bounded_stream_is_read_from_its_oldest_frame_to_its_end(managed_dir: Path,
                                                                   adk) -> None:
    """A stream that keeps 3 frames: a universe opened after frame 0 was dropped starts at the
    oldest frame kept; a loop that kept up with the producer ends at the end of the stream
    (its rewind to a dropped frame made it raise FramesMissed after all the work)."""
    w = instride.Stream("kept", mode="w", retain=3)
    for i in range(10):
        w.append(adk.atoms.positions + i, step=i)
    w.close()
    u = mda.Universe(PSF, "instride://kept")
    assert [ts.data["step"] for ts in u.trajectory] == [7, 8, 9]
    assert [ts.frame for ts in u.trajectory] == [7, 8, 9]
    # read while it is written: frame 0 is gone by the end
    w = instride.Stream("live3", mode="w", retain=3)
    w.append(adk.atoms.positions, step=0)
    traj = mda.Universe(PSF, "instride://live3", timeout=10).trajectory
    steps = [traj.ts.data["step"]]
    for i in range(1, 10):
        w.append(adk.atoms.positions + i, step=i)
        steps.append(traj.next().data["step"])
    w.close()
    with pytest.raises(StopIteration):
        traj.next()
    assert steps == list(range(10))


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # (a refused
# reader's clean-up, run by MDAnalysis's __del__, raised AttributeError)
def test_a_timeout_that_is_no_number_of_seconds_is_refused(managed_dir: Path, adk) -> None:
    """``timeout=nan`` waited for ever, ``-1`` gave up at once: refused, as everywhere."""
    publish_dcd("tm", adk, n=2)
    for bad in (float("nan"), -1.0):
        with pytest.raises(instride.ConfigError, match="timeout"):
            mda.Universe(PSF, "instride://tm", timeout=bad)
    assert len(mda.Universe(PSF, "instride://tm", timeout=float("inf")).trajectory) == 2


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # (a refused
# reader's clean-up, run by MDAnalysis's __del__, raised AttributeError)
def test_refusals(managed_dir: Path, adk) -> None:
    instride.Stream("empty", mode="w").close()
    with pytest.raises(EndOfStream):
        mda.Universe(PSF, "instride://empty")
    instride.Stream("small", mode="w").append(np.zeros((10, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="10 atoms per frame but the topology has 3341"):
        mda.Universe(PSF, "instride://small")
    with pytest.raises(ValueError, match="no stream name"):
        InstrideReader("instride://")
    with pytest.raises(ValueError, match="length must be"):
        InstrideReader("instride://small", length="soon")
    with pytest.raises(instride.KeyValidationError):
        InstrideReader("instride://../etc")


def test_pickle_roundtrip(managed_dir: Path, adk) -> None:
    publish_dcd("pk", adk, n=4)
    u = mda.Universe(PSF, "instride://pk")
    u.trajectory[2]
    u2 = pickle.loads(pickle.dumps(u))
    assert u2.trajectory.ts.frame == 2
    np.testing.assert_allclose(u2.atoms.positions, u.atoms.positions)
    assert len(u2.trajectory) == 4
    copy = u.trajectory.copy()
    assert copy.ts.frame == 2 and len(copy) == 4 and copy._kwargs["filename"] == "instride://pk"


CONSUMER = textwrap.dedent(
    """
    import json, sys
    import MDAnalysis as mda
    import instride.analytics
    from instride.analytics import RMSDToFirst
    from MDAnalysisTests.datafiles import PSF
    print("waiting", flush=True)
    u = mda.Universe(PSF, "instride://early", timeout=60)   # blocks: no frame yet
    r = RMSDToFirst(u.select_atoms("backbone"))
    steps = []
    for ts in u.trajectory:                                  # blocks for each frame
        steps.append(int(ts.data["step"]))
        r.update()
    r.finish()
    print(json.dumps({"steps": steps, "rmsd": r.results.rmsd.tolist(),
                      "idle": u.trajectory.wait_seconds}))
    """
)


def test_consumer_started_before_producer(managed_dir: Path, adk) -> None:
    consumer = spawn_py(CONSUMER)
    assert consumer.stdout.readline().strip() == b"waiting"
    time.sleep(0.5)  # the consumer is now blocked waiting for frame 0
    assert consumer.poll() is None
    stream = instride.Stream("early", mode="w")
    for ts in adk.trajectory[:10]:
        stream.append(adk.atoms.positions, step=ts.frame, time=ts.time)
        time.sleep(0.15)  # slower than the consumer, also on a loaded machine
    stream.close()
    rc, out, err = finish(consumer, timeout=60)
    assert rc == 0, err
    got = json.loads(out.splitlines()[-1])
    assert got["steps"] == list(range(10))
    assert got["idle"] > 0.1  # it really waited for frames
    want = rms.RMSD(mda.Universe(PSF, DCD), select="backbone").run(stop=10).results.rmsd[:, 2]
    np.testing.assert_allclose(got["rmsd"], want, atol=1e-4)


@pytest.mark.parametrize(("retain", "n"), [(None, 400), (100, 100)])
def test_a_long_stream_is_read_under_a_low_limit_of_open_files(managed_dir: Path,
                                                               retain: int | None, n: int) -> None:
    """Each frame the reader copies into its timestep is released: 400 frames (iterated, then
    read by index, with ``dt``) under a limit of 256 open files; a bounded stream's producer
    holds two descriptors per frame it keeps (100 frames), the reader none once it moved on."""
    proc = spawn_py(textwrap.dedent(f"""
        import resource
        import numpy as np, MDAnalysis as mda
        import instride
        import instride.analytics  # (registers the instride:// reader)
        from MDAnalysisTests.datafiles import PSF
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        u = mda.Universe(PSF)
        with instride.Stream("long", mode="w", retain={retain}) as s:
            for i in range({n}):
                s.append(np.full((len(u.atoms), 3), float(i)), step=i, time=0.5 * i)
        u = mda.Universe(PSF, "instride://long", timeout=10)
        seen = [int(ts.positions[0, 0]) for ts in u.trajectory]
        picked = [int(u.trajectory[i].positions[0, 0]) for i in ({n} - 1, 0, {n} // 2)]
        print(len(seen), seen == list(range({n})), *picked, u.trajectory.dt)
    """))
    rc, out, err = finish(proc, timeout=120)
    assert rc == 0, err
    assert out.split() == [str(n), "True", str(n - 1), "0", str(n // 2), "0.5"]


def test_a_universe_reads_as_a_consumer_group_and_resumes_where_it_stopped(
        managed_dir: Path, adk) -> None:
    """``group=``: a producer that keeps 3 frames and blocks for group "ana" drops none of
    them before the universe took it; a second universe of the group starts where the first
    closed (at the frame it held, as a restarted Stream reader of a group does)."""
    import threading

    w = instride.Stream("grp", mode="w", retain=3, groups=["ana"], timeout=30)

    def produce() -> None:
        for i in range(12):
            w.append(adk.atoms.positions + i, step=i)
        w.close()

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        u = mda.Universe(PSF, "instride://grp", group="ana", timeout=30)
        traj = u.trajectory
        steps = []
        for ts in traj:
            steps.append(ts.data["step"])
            np.testing.assert_allclose(u.atoms.positions, adk.atoms.positions + ts.frame,
                                       atol=1e-4)
            if ts.frame == 4:
                break
        traj.close()  # the group's position recorded: frames 0..3 are done
        assert steps == [0, 1, 2, 3, 4]
        again = mda.Universe(PSF, "instride://grp", group="ana", timeout=30).trajectory
        # (where the group was, not frame 0: the frame it held when it stopped comes again)
        assert again.ts.frame == 4
        rest = [ts.data["step"] for ts in again]
        again.close()
    finally:
        producer.join(60)
    assert not producer.is_alive()
    assert rest == list(range(4, 12))
    assert again.missed == 0


def test_a_universe_that_falls_behind_counts_the_frames_it_missed(managed_dir: Path,
                                                                  adk) -> None:
    """``on_gap="count"``: frames dropped before the loop got to them are skipped and counted
    (without it, FramesMissed)."""
    w = instride.Stream("gap", mode="w", retain=3, on_full="drop-oldest")
    w.append(adk.atoms.positions, step=0)
    counted = mda.Universe(PSF, "instride://gap", on_gap="count", timeout=10).trajectory
    raising = mda.Universe(PSF, "instride://gap", timeout=10).trajectory
    for i in range(1, 8):
        w.append(adk.atoms.positions + i, step=i)
    w.close()
    # (the loop starts at frame 0, which the universe read at its opening: gone since)
    assert [ts.data["step"] for ts in counted] == [5, 6, 7]
    assert counted.missed == 5
    with pytest.raises(FramesMissed):
        for _ts in raising:
            pass


def test_a_pickled_group_reader_reads_without_the_group(managed_dir: Path, adk) -> None:
    """A copy in a parallel analysis's worker would be a second live reader of the group
    (GroupBusy): it reads without it."""
    w = instride.Stream("pgrp", mode="w", retain=4, groups=["ana"])
    for i in range(3):
        w.append(adk.atoms.positions + i, step=i)
    w.close()
    u = mda.Universe(PSF, "instride://pgrp", group="ana", timeout=10)
    copy = pickle.loads(pickle.dumps(u))
    assert [ts.data["step"] for ts in copy.trajectory] == [0, 1, 2]
    assert [ts.data["step"] for ts in u.trajectory] == [0, 1, 2]
    u.trajectory.close()


def test_a_group_reader_moved_by_next_and_random_access_keeps_the_group_going(
        managed_dir: Path, adk) -> None:
    """``next()`` right after opening, and a jump by random access in the middle of a loop,
    move the group on (frames jumped over count as taken): it used to stay behind while the
    reader read past it without the group, and the producer waited for it (StreamFull)."""
    import threading

    w = instride.Stream("grpn", mode="w", retain=3, groups=["ana"], timeout=30)

    def produce() -> None:
        for i in range(12):
            w.append(adk.atoms.positions + i, step=i)
        w.close()

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        traj = mda.Universe(PSF, "instride://grpn", group="ana", timeout=30).trajectory
        steps = [traj.ts.data["step"]] + [traj.next().data["step"] for _ in range(3)]
        assert steps == [0, 1, 2, 3] and traj.stream.tell() == 4
        assert traj[3].data["step"] == 3  # (random access to the frame the group holds)
        rest = [ts.data["step"] for ts in traj]  # (from the group's position on)
        assert [ts.frame for ts in traj] == []  # (every frame taken: nothing left to loop)
        copied = traj.copy()  # (reads without the group: it would be GroupBusy)
        assert copied.ts.frame == traj.ts.frame
        traj.close()
    finally:
        producer.join(60)
    assert not producer.is_alive()
    assert rest == list(range(4, 12))


def test_a_reader_that_fails_to_open_lets_its_group_go(managed_dir: Path, adk) -> None:
    """A wrong atom count refused at the opening: the group is free again at once (it stayed
    held until the reader was collected: GroupBusy to a retry of the same process)."""
    publish_dcd("grpf", adk, n=2)
    failed = []
    try:
        InstrideReader("instride://grpf", n_atoms=5, group="ana", timeout=5)
    except ValueError as exc:
        failed.append(exc)  # (kept, as IPython keeps the last traceback)
    assert failed
    traj = mda.Universe(PSF, "instride://grpf", group="ana", timeout=5).trajectory
    assert [ts.frame for ts in traj] == [0, 1]
    traj.close()


def test_a_run_on_a_bounded_stream_that_dropped_its_first_frame_keeps_its_results(
        managed_dir: Path, adk) -> None:
    """``run()`` (and slices) rewind at the end through MDAnalysis's own ``rewind()``, which
    read the reader's first frame: a bounded stream had dropped it by then, and ``run()``
    raised FramesMissed after all the work, its results empty."""
    from MDAnalysis.analysis.base import AnalysisFromFunction

    w = instride.Stream("dropped", mode="w", retain=3, on_full="drop-oldest")
    for i in range(3):
        w.append(adk.atoms.positions + i, step=i)
    u = mda.Universe(PSF, "instride://dropped", timeout=10)
    for i in range(3, 6):  # (frame 0, the reader's first, dropped meanwhile)
        w.append(adk.atoms.positions + i, step=i)
    w.close()
    steps = AnalysisFromFunction(lambda ag: ag.universe.trajectory.ts.data["step"],
                                 u.atoms).run(start=3, stop=6).results.timeseries
    assert list(steps) == [3, 4, 5]
    assert [ts.data["step"] for ts in u.trajectory[3:6]] == [3, 4, 5]
    u.trajectory.close()


def test_a_slice_over_every_frame_of_a_live_stream_stops_at_its_length(managed_dir: Path,
                                                                        adk) -> None:
    """``u.trajectory[:]`` was MDAnalysis's iteration of every frame — the live, blocking one
    — while ``timeseries()`` and ``transfer_to_memory()`` size their arrays by the length
    just read: a frame published meanwhile, IndexError; none, a wait for ever."""
    w = instride.Stream("sliced", mode="w")
    for i in range(3):
        w.append(adk.atoms.positions + i, step=i)
    u = mda.Universe(PSF, "instride://sliced", timeout=2)
    assert [ts.data["step"] for ts in u.trajectory[:]] == [0, 1, 2]  # (no wait for a 4th)
    assert u.trajectory.timeseries(u.atoms[:2]).shape == (3, 2, 3)  # (frames, atoms, xyz)
    w.close()
    u.trajectory.close()


def test_closing_a_reader_lets_go_of_its_frames_files(managed_dir: Path, adk) -> None:
    """The reader's first frame was never released, and ``close()`` let go of nothing on a
    plain reader: its kept mappings and the first frame's hold stayed, and the producer
    could never reuse that file (its pool growing past its bound)."""
    w = instride.Stream("held", mode="w", retain=2)
    w.append(adk.atoms.positions, step=0)
    u = mda.Universe(PSF, "instride://held", timeout=10)
    leases = u.trajectory.stream._leases
    assert leases is not None and not leases._held  # (the first frame let go of)
    u.trajectory.close()
    assert not leases._maps
    w.close()
    assert [ts.data["step"] for ts in u.trajectory] == [0]  # (opened again: usable)


def test_dt_and_a_raised_gap_on_a_bounded_stream(managed_dir: Path, adk) -> None:
    """``dt`` read frames 0 and 1, which a bounded stream had dropped: FramesMissed from a
    property MDAnalysis reads anywhere. And a reader with ``on_gap="raise"`` raised again for
    the same dropped frame at every ``next()``: it never went on to the oldest frame kept."""
    w = instride.Stream("gaps", mode="w", retain=2, on_full="drop-oldest")
    for i in range(2):
        w.append(adk.atoms.positions, step=i, time=0.5 * i)
    traj = mda.Universe(PSF, "instride://gaps", timeout=5, on_gap="raise").trajectory
    for i in range(2, 6):  # (frames 1-3 dropped before the reader's next)
        w.append(adk.atoms.positions, step=i, time=0.5 * i)
    w.close()
    assert traj.dt == pytest.approx(0.5)  # (from the frames kept)
    with pytest.raises(FramesMissed):
        traj.next()
    assert traj.next().data["step"] == 4  # (then the oldest frame kept)
    assert traj.next().data["step"] == 5


def test_a_frame_waited_for_is_read_once(managed_dir: Path, adk) -> None:
    """A frame the reader had to wait for was read twice — the second read only to time a
    read apart from the wait — and in cluster mode the first read was the transfer from the
    producer's node, charged as idle time (the second read a local copy). The wait is now a
    wait for the frame's publication, and the frame is read once, as read time."""
    import threading

    producer = instride.Stream("once", mode="w")
    producer.append(adk.atoms.positions, step=0)

    def later() -> None:
        for i in range(1, 6):
            time.sleep(0.2)  # (the reader waits for each)
            producer.append(adk.atoms.positions, step=i)
        producer.close()

    reader = InstrideReader("instride://once", n_atoms=adk.atoms.n_atoms, timeout=30)
    reads = []
    read = reader.stream.read

    def counted(index: int, timeout: float | None = None) -> instride.Frame:
        reads.append(index)
        return read(index, timeout)

    reader.stream.read = counted  # type: ignore[method-assign]
    thread = threading.Thread(target=later)
    thread.start()
    steps = [ts.data["step"] for ts in reader]
    thread.join()
    assert steps == list(range(6))
    # (frame 0: read at the opening, again after the rewind; each later one waited for)
    assert [reads.count(i) for i in range(1, 6)] == [1] * 5, reads
    assert reader.wait_seconds > 0.5  # (five waits of ~0.2 s)
    reader.close()


def test_a_frame_that_never_comes_times_out_once(managed_dir: Path, adk) -> None:
    """The wait for a frame's publication took the reader's whole timeout, then the read
    after it waited the whole timeout again: ``ConsumeTimeout`` after twice the timeout. The
    read gets what is left."""
    producer = instride.Stream("late", mode="w")
    producer.append(adk.atoms.positions, step=0)
    reader = InstrideReader("instride://late", n_atoms=adk.atoms.n_atoms, timeout=1.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(ConsumeTimeout) as info:
            reader._fetch(1, wait=True)
        assert time.monotonic() - t0 < 1.8
        # (it names the whole wait, not the read's remnant of it: "after 0.000 s" before)
        assert info.value.waited >= 0.9
        assert f"timed out after {info.value.waited:.3f} s" in str(info.value)
    finally:
        reader.close()
        producer.close()


def test_a_timeout_the_reader_names_again_keeps_its_cause(managed_dir: Path, adk) -> None:
    """The reader names the whole wait in a read's ``ConsumeTimeout``; raised again without
    its cause, a timeout because Redis was out of reach (the cause: ``MetadataUnavailable``)
    made ``instride`` exit 3 (timeout) instead of 6 (unavailable)."""
    from instride.errors import MetadataUnavailable

    producer = instride.Stream("causal", mode="w")
    producer.append(adk.atoms.positions, step=0)
    reader = InstrideReader("instride://causal", n_atoms=adk.atoms.n_atoms, timeout=0.3)
    stream = reader._reopened()

    def unreachable(index: int, timeout: float | None = None) -> None:
        try:
            raise MetadataUnavailable("redis://node:6379/0", "connection refused")
        except MetadataUnavailable as exc:
            raise ConsumeTimeout(stream.frame_key(index), 0.0) from exc

    stream.read = unreachable  # type: ignore[method-assign]
    try:
        with pytest.raises(ConsumeTimeout) as info:
            reader._fetch(1, wait=True)
        assert isinstance(info.value.__cause__, MetadataUnavailable)
    finally:
        reader.close()
        producer.close()

