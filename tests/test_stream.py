"""Streams across processes: ordered iteration, latest(), end-of-stream, timeouts."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import instride
from instride.errors import ConsumeTimeout, EndOfStream, FramesMissed
from tests.conftest import files_held, finish, spawn_py

PRODUCER = textwrap.dedent(
    """
    import sys, time, numpy as np, instride
    name, n, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    with instride.Stream(name, mode="w") as s:
        for i in range(n):
            s.append(np.full((50, 3), i, dtype=np.float32), step=10 * i, time=0.02 * i)
            time.sleep(delay)
    """
)


def _producer(name: str, n: int, delay: float) -> object:
    return subprocess.Popen([sys.executable, "-c", PRODUCER, name, str(n), str(delay)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_iteration_in_order_across_processes(managed_dir: Path) -> None:
    consumer = spawn_py(textwrap.dedent(
        """
        import instride
        for f in instride.Stream("live", timeout=30):
            print(f.step, float(f.positions[0, 0]), round(f.time, 3))
        """
    ))
    time.sleep(0.3)
    producer = _producer("live", 20, 0.01)
    assert finish(producer)[0] == 0
    rc, out, err = finish(consumer)
    assert rc == 0, err
    rows = [line.split() for line in out.splitlines()]
    assert [int(r[0]) for r in rows] == [10 * i for i in range(20)]
    assert [float(r[1]) for r in rows] == [float(i) for i in range(20)]


def test_end_of_stream_len_seek_and_getitem(client: instride.Client) -> None:
    with instride.Stream("fin", mode="w", client=client) as s:
        for i in range(5):
            s.append(np.full((4, 3), i, dtype=np.float32))
    r = instride.Stream("fin", client=client)
    assert len(r) == 5 and r.ended
    r.seek(3)
    assert [int(f.positions[0, 0]) for f in r] == [3, 4]
    assert int(r[-1].positions[0, 0]) == 4
    with pytest.raises(IndexError):
        r[5]
    with pytest.raises(EndOfStream):
        r.read(7)
    with pytest.raises(ValueError):
        r.append(np.zeros((4, 3)))


def test_latest_skips_older_frames(client: instride.Client) -> None:
    w = instride.Stream("sample", mode="w", client=client)
    for i in range(6):
        w.append(np.full((2, 3), i, dtype=np.float32))
    r = instride.Stream("sample", client=client, timeout=5)
    assert int(r.latest().positions[0, 0]) == 5
    assert r.tell() == 6
    w.append(np.full((2, 3), 6, dtype=np.float32))
    w.append(np.full((2, 3), 7, dtype=np.float32))
    assert int(r.latest().positions[0, 0]) == 7
    w.close()
    with pytest.raises(EndOfStream):
        r.latest()


def test_latest_waits_for_a_newer_frame_across_processes(managed_dir: Path) -> None:
    consumer = spawn_py(textwrap.dedent(
        """
        import instride
        s = instride.Stream("slow", timeout=30)
        seen = []
        try:
            while True:
                seen.append(int(s.latest().step))
        except instride.EndOfStream:
            pass
        print(" ".join(map(str, seen)))
        """
    ))
    assert finish(_producer("slow", 30, 0.02))[0] == 0
    rc, out, err = finish(consumer)
    assert rc == 0, err
    seen = [int(x) for x in out.split()]
    assert seen == sorted(set(seen))  # strictly increasing: never an older frame
    assert seen[-1] == 290  # the newest frame is always delivered


def test_silent_producer_times_out_not_ends(client: instride.Client) -> None:
    w = instride.Stream("silent", mode="w", client=client)
    w.append(np.zeros((2, 3)))
    r = instride.Stream("silent", client=client, timeout=0.3)
    next(r)
    with pytest.raises(ConsumeTimeout) as info:
        next(r)
    assert "silent/frame_000000001.isf" in str(info.value)


def test_crashed_producer_does_not_end_stream(client: instride.Client) -> None:
    with pytest.raises(RuntimeError):
        with instride.Stream("crashy", mode="w", client=client) as w:
            w.append(np.zeros((2, 3)))
            raise RuntimeError("boom")
    assert not instride.Stream("crashy", client=client).ended


def test_abandon_lets_go_of_the_producer_and_ends_nothing(client: instride.Client) -> None:
    w = instride.Stream("gave-up", mode="w", retain=4, client=client)
    for i in range(6):
        w.append(np.full((1000, 3), float(i)), step=i)
    assert files_held(Path(client.root))  # (its frames, mapped; its head)
    w.abandon()
    w.abandon()  # (again: nothing)
    assert files_held(Path(client.root)) == []  # no descriptor nor mapping left
    with pytest.raises(ValueError, match="closed"):
        w.append(np.zeros((1000, 3)))
    w.close()  # (closed already: no end marker now either)
    r = instride.Stream("gave-up", client=client, timeout=0.3, on_gap="count")
    assert not r.ended
    assert [next(r).step for _ in range(4)] == [2, 3, 4, 5]  # what it kept stays readable
    with pytest.raises(ConsumeTimeout):
        next(r)
    r.close()


def test_paper_layout_stream(client: instride.Client) -> None:
    with instride.Stream("paper", mode="w", layout="paper", client=client) as w:
        w.append(np.ones((23_558, 3)), box=[50.0, 50.0, 50.0])
    f = next(iter(instride.Stream("paper", client=client)))
    assert f.header.layout == "paper"
    assert f.positions.shape == (23_558, 3)
    assert f.box[2, 2] == 50.0


def test_overwritten_stream_drops_the_old_end_marker(client: instride.Client) -> None:
    with instride.Stream("rerun", mode="w", client=client) as w:
        for i in range(3):
            w.append(np.full((2, 3), i, dtype=np.float32))
    again = instride.Stream("rerun", mode="w", overwrite=True, client=client)
    again.append(np.full((2, 3), 10, dtype=np.float32))
    assert not instride.Stream("rerun", client=client).ended  # the re-run is still going
    again.close()
    frames = [int(f.positions[0, 0]) for f in instride.Stream("rerun", client=client)]
    assert frames == [10]
    # a re-run that ends before its first frame replaces the old run all the same
    instride.Stream("rerun", mode="w", overwrite=True, client=client).close()
    empty = instride.Stream("rerun", client=client)
    assert empty.ended and empty.frame_count() == 0 and list(empty) == []


def test_unbounded_stream_holds_no_descriptor_per_frame(managed_dir: Path) -> None:
    """A stream without retention keeps every frame, but not a descriptor and a mapping per
    frame: 600 frames under a limit of 256 open files (a long MD run would hit EMFILE)."""
    proc = spawn_py(textwrap.dedent("""
        import os, resource
        import numpy as np
        import instride
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        s = instride.Stream("long", mode="w")
        for i in range(600):
            s.append(np.full((10, 3), i, dtype=np.float32), step=i)
        s.close()
        print(len(os.listdir("/proc/self/fd")))
    """))
    rc, out, err = finish(proc, timeout=120)
    assert rc == 0, err
    assert int(out.split()[-1]) < 64  # open descriptors at the end
    got = instride.Stream("long")
    assert [f.step for f in got] == list(range(600))


@pytest.mark.parametrize("retain", [None, 4])
def test_a_frame_the_file_system_refuses_is_an_oserror_and_the_next_one_goes(
        managed_dir: Path, retain: int | None) -> None:
    """A frame file the file system refuses (here: over the process's file size limit,
    EFBIG; a full disk is ENOSPC the same way) is an OSError naming the frame file, never a
    SIGBUS: nothing of it is published, no file of the producer's pool is left, and the next
    frame — smaller, under the limit — is published under the same index. In a process of its
    own (the limit; a SIGBUS would kill it)."""
    code = textwrap.dedent(
        """
        import errno, resource, sys, numpy as np, instride
        retain = None if sys.argv[1] == "None" else int(sys.argv[1])
        kw = {} if retain is None else dict(retain=retain)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # (Python ignores SIGXFSZ)
        with instride.Stream("big", mode="w", layout="paper", **kw) as s:
            try:
                s.append(np.random.default_rng(0).random((23_558, 3)), step=1)
                print("appended")
            except OSError as exc:
                print(errno.errorcode[exc.errno], exc.filename)
            s.append(np.ones((100, 3)), step=2)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(retain)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    rc, out, err = finish(proc)
    assert rc == 0, err
    said, where = out.split()
    assert said == "EFBIG" and where.endswith("big/frame_000000000.isf")
    frames = sorted((managed_dir / "big").glob("frame_*.isf"))
    assert [f.name for f in frames] == ["frame_000000000.isf"]
    got = instride.frames.decode_frame(frames[0].read_bytes(), frames[0].name)
    assert got.step == 2 and got.positions.shape == (100, 3)
    pools = list((managed_dir / ".instride").rglob("slot-*"))
    assert pools == [], pools
    assert [f.step for f in instride.Stream("big", timeout=5)] == [2]


def test_an_archiver_that_missed_its_sigterm_is_sent_another() -> None:
    """Python drops the exception of a signal handler that runs inside a finalizer: an
    archiver whose SIGTERM came then ran on, and was killed 30 s later (a CI run saw it).
    SIGTERM is sent again every 2 s; here to a process that lets its first one pass."""
    import subprocess
    import sys

    from instride.stream import _stop_archiver

    code = ("import signal, sys, time\n"
            "seen = []\n"
            "def on_term(*_):\n"
            "    seen.append(1)\n"
            "    if len(seen) > 1:\n"
            "        sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, on_term)\n"
            "print('ready', flush=True)\n"
            "while True:\n"
            "    time.sleep(0.1)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    t0 = time.monotonic()
    _stop_archiver(proc)
    assert proc.returncode == 0 and time.monotonic() - t0 < 15


# ---------------------------------------------------------------------- round 45's review
def _ended(client: instride.Client, name: str, n: int, **kw: object) -> None:
    with instride.Stream(name, mode="w", client=client, **kw) as w:  # type: ignore[arg-type]
        for i in range(n):
            w.append(np.full((10, 3), float(i), np.float32), step=i)


@pytest.mark.parametrize("retain", [None, 2])
def test_a_timeout_of_0_still_sees_the_end(client: instride.Client, retain: int | None) -> None:
    """``timeout=0`` (do not wait) over a stream that has ended: iteration gave every frame,
    then ConsumeTimeout instead of ending (the end marker is looked at only by a wait, which
    a timeout of 0 never made); read() past the end likewise."""
    _ended(client, "t0", 3, retain=retain, on_full="drop-oldest")
    r = instride.Stream("t0", client=client, timeout=0, on_gap="count")
    assert [f.step for f in r] == ([0, 1, 2] if retain is None else [1, 2])
    with pytest.raises(EndOfStream):
        r.read(3)
    r.close()


@pytest.mark.parametrize("bad", [float("nan"), -1.0])
def test_a_timeout_that_no_wait_reaches_is_refused(client: instride.Client, bad: float) -> None:
    """A timeout of NaN (``waited >= nan`` is never true) waited for ever; a negative one was
    taken as 0. Both are a ConfigError, as ``consume`` says; inf is no limit."""
    _ended(client, "nan", 1)
    with pytest.raises(instride.ConfigError, match="timeout"):
        instride.Stream("nan", client=client, timeout=bad)
    r = instride.Stream("nan", client=client, timeout=math.inf)
    assert r.timeout is None
    with pytest.raises(instride.ConfigError, match="timeout"):
        r.read(0, timeout=bad)
    assert r.read(0, timeout=math.inf).step == 0
    r.close()


def test_an_archive_suffix_and_a_mode_are_checked_whatever_the_mode(
        client: instride.Client, tmp_path: Path) -> None:
    """A bad ``archive=`` suffix was refused by ``Stream(...)`` only with ``mode="w"``: with
    the default mode (a producer once it appends) frames went unarchived until ``close()``
    raised; an unknown ``mode`` was a bare ValueError (every error is an InstrideError). The
    stream's errors are importable from ``instride``."""
    with pytest.raises(instride.ConfigError, match="archive"):
        instride.Stream("sfx", archive=tmp_path / "a.xyz", client=client)
    with pytest.raises(instride.ArchiveError, match="does not exist"):
        instride.Stream("sfx", archive=tmp_path / "no" / "a.h5", client=client)
    with pytest.raises(instride.ConfigError, match="mode"):
        instride.Stream("sfx", mode="x", client=client)
    assert instride.FramesMissed is FramesMissed and issubclass(instride.StreamRerun, OSError)


def test_an_unknown_layout_is_refused_at_once(client: instride.Client) -> None:
    """An unknown ``layout`` was a bare KeyError at the first append."""
    with pytest.raises(instride.ConfigError, match="layout"):
        instride.Stream("lay", mode="w", layout="bogus", client=client)


def test_a_reader_of_an_unbounded_run_sees_a_bounded_rerun_drop_frames(
        client: instride.Client) -> None:
    """A reader that knew the stream as unbounded (its first run) looked past the retention
    of a re-run that bounds it (``overwrite=True, retain=2``): a dropped frame was never
    FramesMissed, and once the end was there the reader spun at full CPU until its timeout
    (for ever without one)."""
    _ended(client, "p", 3)
    r = instride.Stream("p", client=client, timeout=5)
    with pytest.raises(EndOfStream):  # (the policy learnt, no frame read: see StreamRerun)
        r.read(3)
    _ended(client, "p", 10, overwrite=True, retain=2, on_full="drop-oldest")
    t0, c0 = time.monotonic(), time.process_time()
    with pytest.raises(FramesMissed):
        r.read(0)
    assert time.monotonic() - t0 < 2 and time.process_time() - c0 < 1
    r.close()


def test_a_group_reader_dropped_without_close_lets_go_of_its_group(
        client: instride.Client) -> None:
    """``for f in Stream(name, group=g): ... break`` without close(): the group's lock stayed
    with the process, and the next reader of the group in it (a notebook's cell run again)
    got GroupBusy. The reader's group goes with it; the next one resumes where it was."""
    import gc

    _ended(client, "g", 5, groups=("a",))

    def analyse(stop: int) -> list[int]:
        steps = []
        for f in instride.Stream("g", group="a", client=client):
            steps.append(f.step)
            if f.step == stop:
                break
        return steps

    assert analyse(1) == [0, 1]
    gc.collect()
    assert analyse(99) == [1, 2, 3, 4]  # (frame 1 was held, not done: again)
    gc.collect()
    assert analyse(99) == []


def test_a_closed_reader_takes_no_frame(client: instride.Client) -> None:
    """After close(), read()/next()/latest() gave frames: held for good (a second close did
    nothing), and a group's frames outside its group (another reader took the group, both
    got its frames)."""
    _ended(client, "c", 3, groups=("a",))
    for group in (None, "a"):
        r = instride.Stream("c", group=group, client=client)
        assert next(r).step == 0
        r.close()
        with pytest.raises(ValueError, match="closed"):
            next(r)
        with pytest.raises(ValueError, match="closed"):
            r.read(1)
        with pytest.raises(ValueError, match="closed"):
            r.latest()
        assert [f for f in files_held(Path(client.root), maps=False) if "frame_" in f] == []


def test_frames_read_before_the_producer_started_are_released_at_close(
        managed_dir: Path) -> None:
    """A reader opened before its producer reads a frame, then another: the second read
    replaced the reader's table of holds (the producer's policy now known) and the first
    frame's hold was forgotten — kept for the life of the process (close() releases every
    frame taken, as docs/streams.md says)."""
    import threading

    client = instride.Client(instride.Settings.from_env())
    r = instride.Stream("w", client=client, timeout=30)
    got: dict[str, object] = {}
    th = threading.Thread(target=lambda: got.setdefault("f0", r.read(0)))
    th.start()
    time.sleep(0.3)  # (waiting: no policy known yet)
    producer = spawn_py(textwrap.dedent("""
        import time, numpy as np, instride
        s = instride.Stream("w", mode="w", retain=2, on_full="drop-oldest")
        for i in range(3):
            s.append(np.full((10, 3), i, np.float32)); time.sleep(0.2)
        time.sleep(1.0)
        s.close()
        """))
    try:
        th.join(30)
        assert got["f0"].step == 0  # type: ignore[attr-defined]
        r.read(-1)
        r.close()
        got.clear()
        assert [f for f in files_held(managed_dir, maps=False) if "frame_" in f] == []
    finally:
        rc, _out, err = finish(producer)
        client.close()
    assert rc == 0, err


def test_a_forked_childs_copy_of_a_group_reader_records_nothing(client: instride.Client) -> None:
    """A group reader dropped without close() records its position as it goes (round 45); a
    forked child's copy of one, dropped in the child, wrote the child's stale position into
    the group's cursor: the parent's group was set back, its frames delivered again."""
    import gc
    import os

    _ended(client, "fk", 12, groups=("a",))
    r = instride.Stream("fk", group="a", client=client, commit_every=4)
    for _ in range(3):
        next(r)
    go_r, go_w = os.pipe()
    child = os.fork()
    if child == 0:  # (the child drops its copy once the parent read on, then leaves)
        os.close(go_w)
        os.read(go_r, 1)
        del r
        gc.collect()
        os._exit(0)
    os.close(go_r)
    for _ in range(6):
        next(r)  # (its position recorded at 4 and 8)
    os.write(go_w, b"x")
    os.close(go_w)
    assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
    r.close()
    again = instride.Stream("fk", group="a", client=client)
    assert next(again).step == 8  # (the frame the parent held, again; not the child's 2)
    again.close()
