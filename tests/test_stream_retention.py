"""Bounded streams: retention, back-pressure, consumer groups, recycled storage, zero copy."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

import instride
import instride.stream as stream_mod
from instride.errors import (
    ConfigError,
    ConsumeTimeout,
    FramesMissed,
    GroupBusy,
    IntegrityError,
    KeyExistsError,
    StreamFull,
)
from tests.conftest import files_held, finish, spawn_py, stop_process, wait_ready

NATOMS = 2000


def _frames_on_disk(root: Path, name: str) -> list[str]:
    return sorted(n for n in os.listdir(root / name) if n.startswith("frame_"))


def _positions(i: int) -> np.ndarray:
    pos = np.zeros((NATOMS, 3), dtype=np.float32)
    pos[:, 0] = i
    return pos


PRODUCER = textwrap.dedent(
    """
    import sys, time, numpy as np, instride
    name, n, retain, policy = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    delay = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    pos = np.zeros((2000, 3), dtype=np.float32)
    with instride.Stream(name, mode="w", retain=retain, on_full=policy, groups=["g"], timeout=60) as s:
        for i in range(n):
            pos[:, 0] = i
            s.append(pos, step=i)
            time.sleep(delay)
    print("done", flush=True)
    """
)


def _produce(name: str, n: int, retain: int, policy: str, delay: float = 0.0) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", PRODUCER, name, str(n), str(retain), policy, str(delay)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


def test_group_sees_every_frame_and_disk_stays_bounded(managed_dir: Path) -> None:
    producer = _produce("bounded", 300, 8, "block")
    inodes, most = set(), 0
    try:
        for i, frame in enumerate(instride.Stream("bounded", group="g", timeout=60)):
            assert frame.step == i and frame.positions[0, 0] == i and frame.positions[-1, 0] == i
            most = max(most, len(_frames_on_disk(managed_dir, "bounded")))
            inodes.add(os.stat(managed_dir / "bounded" / f"frame_{i:09d}.isf").st_ino)
    finally:
        rc, out, err = finish(producer)
    assert rc == 0, err
    assert i == 299
    assert most <= 9  # retain + the one being published
    assert len(inodes) <= 8 + 4  # storage recycled: a handful of files for 300 frames
    assert len(_frames_on_disk(managed_dir, "bounded")) <= 8


def test_views_are_zero_copy_and_never_change_while_held(managed_dir: Path) -> None:
    reader = instride.Stream("held", on_gap="count", timeout=30)
    with instride.Stream("held", mode="w", retain=2, on_full="drop-oldest") as s:
        s.append(_positions(0), step=0)
        frame = reader.read(0)
        assert not frame.positions.flags.owndata and not frame.positions.flags.writeable
        for i in range(1, 40):  # the held frame is retired, its file is not reused
            s.append(_positions(i), step=i)
        assert not (managed_dir / "held" / "frame_000000000.isf").exists()
        assert frame.step == 0 and np.all(frame.positions[:, 0] == 0)
        frame.release()


@pytest.mark.parametrize("how", ["open", "open_fd", "consume_bytes"])
def test_a_frame_read_through_its_key_is_held_like_a_stream_readers(managed_dir: Path,
                                                                    how: str) -> None:
    """A bounded stream's frame opened by key (``instride.open``, ``Client.open_fd``,
    ``consume_bytes``), not through ``Stream``, is held too: retired meanwhile, its file is
    not rewritten for a later frame while it is open (or mapped); released, it is reused."""
    client = instride.get_client()
    with instride.Stream(f"bykey-{how}", mode="w", retain=2, on_full="drop-oldest") as s:
        s.append(_positions(0), step=0)
        key = s.frame_key(0)
        ino = os.stat(managed_dir / key).st_ino
        if how == "open":
            fh = instride.open(key)
            before = fh.read()
            fh.seek(0)
        elif how == "open_fd":
            fd = client.open_fd(key)
            before = os.pread(fd, 1 << 20, 0)
        else:
            view = instride.consume_bytes(key)
            before = bytes(view)
        for i in range(1, 40):  # frame 0 retired: its file is not reused while held
            s.append(_positions(i), step=i)
        assert not (managed_dir / key).exists()
        inodes = {os.stat(managed_dir / s.frame_key(i)).st_ino for i in (38, 39)}
        assert ino not in inodes
        if how == "open":
            assert fh.read() == before
            fh.close()
        elif how == "open_fd":
            assert os.pread(fd, 1 << 20, 0) == before
            os.close(fd)
        else:
            assert bytes(view) == before
            view.release()
            del view
            import gc
            gc.collect()  # (the mapping, and with it the hold, goes with its last view)
        reused = set()
        for i in range(40, 60):  # released: its storage comes back into use
            s.append(_positions(i), step=i)
            reused.add(os.stat(managed_dir / s.frame_key(i)).st_ino)
        assert ino in reused


def test_a_retired_frame_is_not_opened_by_its_key(managed_dir: Path) -> None:
    """A frame retired before it was opened: its key waits like any missing key (it names no
    file), never the storage a later frame reuses."""
    with instride.Stream("gone", mode="w", retain=2, on_full="drop-oldest") as s:
        for i in range(10):
            s.append(_positions(i), step=i)
        with pytest.raises(instride.errors.ConsumeTimeout):
            instride.open(s.frame_key(0), timeout=0.2)


@pytest.mark.parametrize("layout", ["xyz32", "paper", "paper-soa"])
def test_a_producer_rewriting_one_array_in_place_publishes_each_frames_values(
    managed_dir: Path, layout: str
) -> None:
    # the usual MD loop: one positions array (and one ids array) rewritten in place; every
    # frame after the first takes the last frame's encode arguments again, and still carries
    # its own values; a resized array is seen
    dtype = np.float32 if layout == "xyz32" else np.float64
    pos, ids = np.zeros((NATOMS, 3), dtype), np.arange(NATOMS, dtype=np.int32)
    with instride.Stream(f"inplace-{layout}", mode="w", retain=3, groups=["g"], layout=layout,
                         timeout=5) as s:
        reader = instride.Stream(f"inplace-{layout}", group="g", timeout=5)
        for i in range(8):
            if i == 5:
                pos.resize((NATOMS + 7, 3), refcheck=False)
                ids = np.arange(NATOMS + 7, dtype=np.int32)
            pos[:, 0] = i
            ids[0] = 1000 + i
            s.append(pos, step=i, ids=ids)
            frame = next(reader)
            assert frame.step == i and len(frame.positions) == len(pos)
            assert np.all(frame.positions[:, 0] == i)
            if layout != "xyz32":
                assert frame.ids[0] == 1000 + i
            frame.release()
        reader.close()


def test_copies_are_verified_arrays_of_their_own_and_hold_nothing(managed_dir: Path) -> None:
    """copy=True: each frame is the reader's own (writable) arrays, verified on the way; its file
    is released at once, so a reader keeping every frame never holds the producer back."""
    kept = []
    with instride.Stream("copies", mode="w", retain=2, groups=["g"], timeout=5) as s:
        reader = instride.Stream("copies", group="g", copy=True, timeout=5)
        for i in range(10):  # retain=2 under "block": only works if nothing stays held
            s.append(_positions(i), step=i)
            frame = next(reader)
            assert frame.step == i and frame.positions.flags.writeable and np.all(frame.positions[:, 0] == i)
            kept.append(frame)
    assert [int(f.positions[0, 0]) for f in kept] == list(range(10))  # still intact
    # a corrupted frame is refused by the copying reader too
    with instride.Stream("copies2", mode="w") as s:
        s.append(_positions(3), step=3)
    path = managed_dir / "copies2" / "frame_000000000.isf"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="payload checksum"):
        instride.Stream("copies2", copy=True, timeout=5).read(0)


def test_spinning_reader_gets_every_frame_across_processes(managed_dir: Path) -> None:
    consumer = spawn_py(textwrap.dedent(
        """
        import instride
        for f in instride.Stream("spun", spin=0.01, copy=True, timeout=30):
            print(f.step)
        """
    ))
    time.sleep(0.3)
    with instride.Stream("spun", mode="w") as s:
        for i in range(30):
            s.append(_positions(i), step=i)
            time.sleep(0.002 if i % 2 else 0.05)  # within the 10 ms spin, or past it
    rc, out, err = finish(consumer)
    assert rc == 0, err
    assert [int(x) for x in out.split()] == list(range(30))


def test_hybrid_polling_reader_learns_the_cadence_and_gets_every_frame(managed_dir: Path) -> None:
    """``spin="auto"``: a reader of a producer that publishes every 30 ms learns when frames
    are due and polls around then; every frame comes, in order, also one that is late (past
    its window: waited for asleep) or early, and the end marker, which comes instead of a
    frame due, ends the iteration."""
    consumer = spawn_py(textwrap.dedent(
        """
        import instride
        s = instride.Stream("hybrid", spin="auto", copy=True, timeout=30)
        print("ready", flush=True)
        for f in s:
            print(f.step, float(f.positions[0, 0]), s._cadence.window(f.step + 1) is not None)
        print("polled", s.windows_polled)
        """
    ))
    # waiting before frame 0 (a frame already there when the reader looks tells no gap)
    assert wait_ready(consumer), "the consumer did not start"
    time.sleep(0.2)
    gaps = [0.03] * 8 + [0.12] + [0.03] * 4 + [0.005] + [0.03] * 4  # late, then early
    with instride.Stream("hybrid", mode="w") as s:
        for i, gap in enumerate(gaps):
            s.append(_positions(i), step=i)
            time.sleep(gap)
    rc, out, err = finish(consumer)
    assert rc == 0, err
    *rows, polled = [line.split() for line in out.splitlines()]
    assert [int(r[0]) for r in rows] == list(range(len(gaps)))
    assert [float(r[1]) for r in rows] == [float(i) for i in range(len(gaps))]
    assert any(r[2] == "True" for r in rows[5:])  # the cadence learned
    assert polled[0] == "polled" and int(polled[1]) >= 1  # and polled around a due frame


def test_hybrid_polling_reader_of_a_slow_producer_sleeps_until_the_window(managed_dir: Path) -> None:
    """Frames 0.7 s apart, longer than a wait's slice (0.5 s): the reader sleeps slice after
    slice until the next frame is due and still polls in its window."""
    consumer = spawn_py(textwrap.dedent(
        """
        import instride
        s = instride.Stream("slowhybrid", spin="auto", timeout=30)
        print("ready", flush=True)
        for f in s:
            print(f.step)
        print(s.windows_polled)
        """
    ))
    assert wait_ready(consumer), "the consumer did not start"  # (waiting before frame 0)
    time.sleep(0.2)
    with instride.Stream("slowhybrid", mode="w") as s:
        for i in range(6):
            s.append(_positions(i), step=i)
            time.sleep(0.7)
    rc, out, err = finish(consumer)
    assert rc == 0, err
    *steps, polled = out.split()
    assert [int(x) for x in steps] == list(range(6))
    assert int(polled) >= 1  # frame 4's or 5's window (three gaps known), reached across slices


def test_block_producer_raises_stream_full_naming_the_group(managed_dir: Path) -> None:
    instride.Stream("stuck", group="slow").close()  # registered, never reads
    with instride.Stream("stuck", mode="w", retain=3, timeout=0.5) as s:
        for i in range(4):
            s.append(_positions(i), step=i)
        with pytest.raises(StreamFull, match="slow") as info:
            s.append(_positions(4), step=4)
        assert info.value.holders == ["slow"]
    assert len(_frames_on_disk(managed_dir, "stuck")) == 4


def test_a_single_group_name_is_one_group(managed_dir: Path) -> None:
    """``groups="ana"`` (a name, not a list) registered a group per letter, which nobody ever
    reads: a "block" producer waited for them for good, whatever group "ana" took."""
    with instride.Stream("onegroup", mode="w", retain=2, groups="ana", timeout=0.5) as s:
        for i in range(3):
            s.append(_positions(i), step=i)
        with pytest.raises(StreamFull) as info:
            s.append(_positions(3), step=3)
        assert info.value.holders == ["ana"]


def test_drop_oldest_counts_or_raises_the_missed_frames(managed_dir: Path) -> None:
    with instride.Stream("drop", mode="w", retain=3, on_full="drop-oldest") as s:
        for i in range(10):
            s.append(_positions(i), step=i)
    counting = instride.Stream("drop", on_gap="count")
    steps = [f.step for f in counting]
    assert steps == [7, 8, 9] and counting.missed == 7
    raising = instride.Stream("drop")
    with pytest.raises(FramesMissed) as info:
        next(raising)
    assert (info.value.missed, info.value.resume) == (7, 7)
    assert [f.step for f in raising] == [7, 8, 9]  # goes on from the oldest frame kept


def test_latest_policy_keeps_only_the_newest_frame(managed_dir: Path) -> None:
    with instride.Stream("newest", mode="w", on_full="latest") as s:
        for i in range(5):
            s.append(_positions(i), step=i)
            assert _frames_on_disk(managed_dir, "newest") == [f"frame_{i:09d}.isf"]
    frame = instride.Stream("newest").latest()
    assert frame.step == 4


def test_latest_sampling_under_a_fast_producer(managed_dir: Path) -> None:
    producer = _produce("fast", 400, 1, "latest", 0.001)
    seen = []
    try:
        sampler = instride.Stream("fast", timeout=30)
        while True:
            try:
                frame = sampler.latest()
            except instride.errors.EndOfStream:
                break
            seen.append(frame.step)
            assert frame.positions[0, 0] == frame.step
            time.sleep(0.01)
    finally:
        rc, _, err = finish(producer)
    assert rc == 0, err
    assert seen == sorted(set(seen)) and seen[-1] == 399 and len(seen) < 400


def test_a_reader_stopped_while_its_frames_come_and_go_resumes_from_the_head(
        managed_dir: Path) -> None:
    """``drop-oldest`` with ``retain=1``: the reader process is stopped (``SIGSTOP``) while it
    waits for frame 1, and frames 1 and 2 are published and dropped meanwhile — its wake-up
    finds neither file. Continued, it learns from the stream's head that it missed them and
    reads frame 3, while the producer publishes nothing more. (This checks what it gets; how
    soon — within a short wait slice, not a whole one — is measured by
    ``benchmarks/bench_drop_policies.py``.)"""
    code = textwrap.dedent(
        """
        import instride
        s = instride.Stream("gone", timeout=30, on_gap="count")
        for f in s:
            print(f.step, s.missed, flush=True)
        """
    )
    reader = spawn_py(code)
    try:
        with instride.Stream("gone", mode="w", retain=1, on_full="drop-oldest") as s:
            s.append(_positions(0), step=0)
            assert reader.stdout is not None and reader.stdout.readline().split() == [b"0", b"0"]
            time.sleep(0.1)  # (it waits for frame 1 now)
            stop_process(reader.pid)
            try:
                for i in (1, 2, 3):
                    s.append(_positions(i), step=i)
            finally:
                os.kill(reader.pid, signal.SIGCONT)
            assert reader.stdout.readline().split() == [b"3", b"2"]  # before anything else comes
    finally:
        rc, out, err = finish(reader)
    assert rc == 0, err
    assert out == ""  # (and nothing after the end)


def _read_as_group_until_killed(name: str, *, hold: int, frames: int, commit_every: int = 1,
                                meanwhile: Callable[[], None] | None = None) -> list[int]:
    """A reader process iterating ``name`` as group "g" that holds frame ``hold`` until it is
    killed (``SIGKILL``, after ``frames`` frames and ``meanwhile``): the steps it got."""
    code = textwrap.dedent(
        f"""
        import sys, instride
        for f in instride.Stream({name!r}, group="g", commit_every={commit_every}, timeout=30):
            print(f.step, flush=True)
            if f.step == {hold}:
                sys.stdin.read()   # holds the frame until killed
        """
    )
    proc = spawn_py(code, stdin=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        got = [int(proc.stdout.readline()) for _ in range(frames)]
        if meanwhile is not None:
            meanwhile()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return got


def test_group_resumes_after_its_reader_is_killed(managed_dir: Path) -> None:
    with instride.Stream("resume", mode="w", retain=50, groups=["g"]) as s:
        for i in range(20):
            s.append(_positions(i), step=i)
    def busy() -> None:
        with pytest.raises(GroupBusy):
            instride.Stream("resume", group="g")  # the group has a live reader

    got = _read_as_group_until_killed("resume", hold=6, frames=7, meanwhile=busy)
    assert got == list(range(7))
    again = [f.step for f in instride.Stream("resume", group="g", timeout=30)]
    assert again == list(range(6, 20))  # frame 6 was held, not finished: delivered again


def test_group_position_recorded_every_few_frames_loses_none(managed_dir: Path) -> None:
    """``commit_every=4``: the group's position is recorded every 4 frames, exactly at close;
    a reader killed in between resumes at most 3 frames before the frame it held (delivered
    again, none skipped)."""
    with instride.Stream("every", mode="w", retain=50, groups=["g"]) as s:
        for i in range(30):
            s.append(_positions(i), step=i)
    reader = instride.Stream("every", group="g", commit_every=4, timeout=30)
    recorded = []
    for _ in range(10):  # holds frame 9
        next(reader)
        recorded.append(reader._cursor_file.value)
    assert recorded == [0, 0, 0, 0, 4, 4, 4, 4, 8, 8]
    reader.close()  # the frame held (9) is delivered again; every one before it is done
    with instride.Stream("every", group="g") as again_reader:  # holds frame 10 at close
        assert [f.step for f in itertools.islice(again_reader, 2)] == [9, 10]
    got = _read_as_group_until_killed("every", hold=16, frames=7, commit_every=4)
    assert got == list(range(10, 17))
    again = [f.step for f in instride.Stream("every", group="g", timeout=30)]
    assert 16 - 3 <= again[0] <= 16 and again == list(range(again[0], 30))


def test_group_position_every_few_frames_never_stalls_a_blocked_producer(
        managed_dir: Path) -> None:
    """``commit_every`` larger than the producer's ``retain`` under "block": positions are
    recorded often enough for the producer to go on (every frame seen, no StreamFull)."""
    producer = _produce("every-small", 60, 2, "block")
    try:
        seen = [f.step for f in instride.Stream("every-small", group="g", commit_every=50,
                                                 timeout=60)]
    finally:
        rc, out, err = finish(producer)
    assert rc == 0, err
    assert seen == list(range(60))


def test_group_position_every_few_frames_with_a_byte_bound_never_stalls(
        managed_dir: Path) -> None:
    """``retain_bytes`` binding before ``retain`` under "block": the group's position is
    recorded after every frame (how many frames fit the bytes is not known), so the producer
    goes on and the group sees every frame."""
    frame = 128 + 2000 * 12  # (xyz32 frames of _positions)
    got: list[int] = []
    errors: list[BaseException] = []
    with instride.Stream("every-bytes", mode="w", retain=10, retain_bytes=2 * frame,
                         groups=["g"], timeout=10) as s:
        s.append(_positions(0), step=0)

        def consume() -> None:
            try:
                reader = instride.Stream("every-bytes", group="g", commit_every=10, timeout=10)
                got.extend(f.step for f in reader)
                reader.close()
            except BaseException as exc:  # (raised again below)
                errors.append(exc)

        thread = threading.Thread(target=consume)
        thread.start()
        for i in range(1, 8):
            s.append(_positions(i), step=i)
    thread.join(30)
    assert not errors and got == list(range(8))


def test_latest_then_close_never_moves_the_group_back(managed_dir: Path) -> None:
    """The frames ``latest()`` skipped count as taken, also once the reader closes: the
    group resumes at the frame it held, not at its first frame."""
    with instride.Stream("latest-group", mode="w", retain=50, groups=["g"]) as s:
        for i in range(10):
            s.append(_positions(i), step=i)
    reader = instride.Stream("latest-group", group="g", timeout=5)
    assert reader.latest().step == 9
    reader.close()
    with instride.Stream("latest-group", group="g", timeout=5) as again:
        assert [f.step for f in again] == [9]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_commit_every_must_be_a_whole_number_of_frames(managed_dir: Path, bad: object) -> None:
    with pytest.raises(ConfigError, match="commit_every"):
        instride.Stream("x", group="g", commit_every=bad)  # type: ignore[arg-type]


def test_producer_killed_mid_frame_publishes_nothing_and_gc_reclaims(managed_dir: Path) -> None:
    code = textwrap.dedent(
        """
        import numpy as np, instride
        from instride.store import ring
        real = ring.SlotPool.publish
        def stall(self, *a, **k):
            print("stalled", flush=True)
            import time; time.sleep(600)
        s = instride.Stream("crash", mode="w", retain=4)
        s.append(np.zeros((10, 3)), step=0)
        ring.SlotPool.publish = stall
        s.append(np.ones((10, 3)), step=1)
        """
    )
    proc = spawn_py(code)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"stalled"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _frames_on_disk(managed_dir, "crash") == ["frame_000000000.isf"]
    pool = managed_dir / ".instride" / "streams" / "crash.stream" / "pool"
    # the unfinished frame, never visible, and the producer's alive file (its lock gone)
    assert sorted(n.split("-")[0] for n in os.listdir(pool)) == ["alive", "slot"]
    removed = instride.get_client().gc()
    assert any(p.parent == pool for p in removed) and os.listdir(pool) == []


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        ({"mode": "w", "retain": 0}, "retain"),
        ({"mode": "w", "retain_bytes": -5}, "retain_bytes"),
        ({"mode": "w", "on_full": "sometimes"}, "on_full"),
        ({"group": "bad name"}, "group"),
        ({"group": ".hidden"}, "group"),
        ({"on_gap": "ignore"}, "on_gap"),
        ({"spin": -1}, "spin"),
        ({"spin": float("nan")}, "spin"),
        ({"spin": float("inf")}, "spin"),
        ({"spin": "fast"}, "spin"),
        ({"spin": True}, "spin"),
    ],
)
def test_bad_settings_are_config_errors(managed_dir: Path, kwargs: dict, what: str) -> None:
    with pytest.raises(ConfigError, match=what):
        instride.Stream("bad", **kwargs)


def test_retain_bytes_bounds_the_stream(managed_dir: Path) -> None:
    size = os.path.getsize
    with instride.Stream("bytes", mode="w", retain_bytes=5 * 24_128, on_full="drop-oldest") as s:
        for i in range(20):
            s.append(_positions(i), step=i)
            on_disk = _frames_on_disk(managed_dir, "bytes")
            assert sum(size(managed_dir / "bytes" / n) for n in on_disk) <= 5 * 24_128


def test_a_frame_larger_than_the_byte_bound_stays_readable(managed_dir: Path) -> None:
    """The newest frame is kept even when it alone exceeds ``retain_bytes`` (the atom count
    grew): the older frames go, the new one is published and readable."""
    small = 128 + 100 * 12
    with instride.Stream("grown", mode="w", retain_bytes=4 * small, on_full="drop-oldest") as s:
        for i in range(3):
            s.append(np.full((100, 3), i, np.float32), step=i)
        s.append(np.full((1000, 3), 3, np.float32), step=3)
        assert s.published() == [3]
        assert _frames_on_disk(managed_dir, "grown") == ["frame_000000003.isf"]
        frame = instride.Stream("grown", timeout=5).read(3)
        assert frame.positions.shape == (1000, 3) and frame.step == 3
        s.append(np.full((100, 3), 4, np.float32), step=4)  # (then retired as usual)
        assert s.published() == [4]


def test_a_forked_child_leaves_the_producers_files_alone(managed_dir: Path) -> None:
    """A child forked from a producer that drops its copy of the stream deletes none of
    the producer's pooled frame files: the producer goes on appending."""
    s = instride.Stream("forked", mode="w", retain=2, on_full="drop-oldest")
    for i in range(5):
        s.append(_positions(i), step=i)
    assert s._pool is not None
    pool = s._pool.pool_dir
    before = sorted(os.listdir(pool))
    assert before  # (a retired frame's file waits there for reuse)
    pid = os.fork()
    if pid == 0:  # the child: drops its copy (Stream.__del__ closes the pool) and exits
        try:
            del s
            import gc

            gc.collect()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert sorted(os.listdir(pool)) == before
    for i in range(5, 8):
        s.append(_positions(i), step=i)
    assert s.published() == [6, 7]
    s.close()
    reader = instride.Stream("forked", timeout=5)
    assert [reader.read(i).step for i in (6, 7)] == [6, 7]


def test_block_with_a_live_consumer_in_threads(managed_dir: Path) -> None:
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            steps = [f.step for f in instride.Stream("threads", group="g", timeout=30)]
            assert steps == list(range(100))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    with instride.Stream("threads", mode="w", retain=2, groups=["g"], timeout=30) as s:
        t = threading.Thread(target=consume)
        t.start()
        for i in range(100):
            s.append(_positions(i), step=i)
    t.join(60)
    assert not errors, errors


# ---------------------------------------------------------------------- cluster mode
CLUSTER_PRODUCER = textwrap.dedent(
    """
    import sys, numpy as np, instride
    from instride.store.ring import SlotPool
    n, retain, policy = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    encoded = []  # frames encoded and published in one native call (the record's checksum: read)
    one_call = SlotPool.write_and_publish
    SlotPool.write_and_publish = lambda *a, **kw: (encoded.append(1), one_call(*a, **kw))[1]
    pos = np.zeros((2000, 3), dtype=np.float32)
    with instride.Stream("cl", mode="w", retain=retain, on_full=policy, groups=["remote"],
                         timeout=60) as s:
        for i in range(n):
            pos[:, 0] = i
            s.append(pos, step=i)
    print(len(encoded))
    """
)
CLUSTER_CONSUMER = textwrap.dedent(
    """
    import os, sys, instride
    group = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "-" else None
    root = os.environ["INSTRIDE_DIR"]
    s = instride.Stream("cl", group=group, on_gap="count", timeout=60)
    steps, most = [], 0
    for f in s:
        assert f.positions[0, 0] == f.step
        steps.append(f.step)
        most = max(most, len([n for n in os.listdir(os.path.join(root, "cl")) if n.startswith("frame_")]))
    print(" ".join(map(str, steps)), "|", s.missed, most)
    """
)


def test_cluster_remote_group_holds_frames_on_the_owner(loopback_nodes: list) -> None:
    owner, remote = loopback_nodes[0], loopback_nodes[1]
    consumer = subprocess.Popen([sys.executable, "-c", CLUSTER_CONSUMER, "remote"], env=remote.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    producer = subprocess.Popen([sys.executable, "-c", CLUSTER_PRODUCER, "60", "4", "block"],
                                env=owner.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    rc, encoded, err = finish(producer, 120)
    assert rc == 0, err
    assert int(encoded) == 60  # every frame published by the native call, in cluster mode too
    rc, out, err = finish(consumer, 120)
    assert rc == 0, err
    steps, rest = out.split("|")
    assert [int(x) for x in steps.split()] == list(range(60))  # every frame, in order
    missed, most = map(int, rest.split())
    assert missed == 0 and most <= 2  # fetched copies dropped once the frame is released
    on_owner = sorted(n for n in os.listdir(owner.dir / "cl") if n.startswith("frame_"))
    assert len(on_owner) <= 5  # retain + the newest, which the group had not taken yet


def _deleted_files_held(under: Path) -> int:
    """Descriptors and mappings of this process on deleted frame files beneath ``under``."""
    # (an unnamed file made ahead for the next frame, O_TMPFILE, shows as "#<inode>")
    return sum(1 for h in files_held(under) if h.endswith("(deleted)")
               and not os.path.basename(h).startswith("#"))


@pytest.mark.parametrize(("retain", "overwrite"), [(8, False), (None, False), (8, True)])
def test_a_frame_whose_record_fails_is_recorded_again_and_nothing_is_lost(
    tmp_path: Path, redis_server: Any, retain: int | None, overwrite: bool
) -> None:
    # cluster mode, Redis gone between two frames. A frame's record is confirmed by a later
    # append (at most _UNCONFIRMED_MAX frames later): the error (MetadataUnavailable)
    # surfaces there, and the append that raises publishes nothing (no key, no deleted file
    # held). Once Redis is back, the next append sends the unconfirmed records again (as
    # the same publications) before its own frame, and a reader gets every frame.
    from instride.errors import MetadataUnavailable
    from instride.stream import _UNCONFIRMED_MAX
    from tests.conftest import LoopbackNode

    node = LoopbackNode(tmp_path, 1, redis_server.url, "test-token")
    client = node.client()
    frames = node.dir / "wd"
    total = 4 + _UNCONFIRMED_MAX
    try:
        with instride.Stream("wd", mode="w", retain=retain, overwrite=overwrite, client=client,
                             timeout=5) as s:
            for i in range(3):
                s.append(_positions(i), step=i)
            redis_server.stop()
            written = 3
            with pytest.raises(MetadataUnavailable):
                for i in range(3, total):
                    s.append(_positions(i), step=i)
                    written = i + 1
            assert 3 <= written <= 3 + _UNCONFIRMED_MAX
            assert not (frames / f"frame_{written:09d}.isf").exists()
            assert _deleted_files_held(node.dir) == 0
            redis_server.start()
            for i in range(written, total):
                assert s.append(_positions(i), step=i) == i
        reader = instride.Stream("wd", client=client, timeout=5)
        got = [(f.step, float(f.positions[0, 0])) for f in itertools.islice(reader, total)]
        assert got == [(i, float(i)) for i in range(total)]
        reader.close()
    finally:
        client.close()


def test_close_confirms_the_last_frames_record(tmp_path: Path, redis_server: Any) -> None:
    # cluster mode: close() confirms the records still pending, so after close every frame
    # has its record (size and checksum of its file: its own header checksum, which verifies
    # the file, header and payload). With Redis gone, close raises (the
    # end marker cannot be recorded) and the stream stays open; once Redis is back, close()
    # again ends the stream.
    import xxhash

    from instride.errors import MetadataUnavailable, PublicationUnsettled
    from instride.frames import HEADER_SIZE
    from tests.conftest import LoopbackNode

    node = LoopbackNode(tmp_path, 1, redis_server.url, "test-token")
    client = node.client()

    def recorded(key: str) -> bool:
        rec = client.metadata.lookup(key)
        data = (node.dir / key).read_bytes()
        if rec is None or rec.checksum is None or not rec.checksum.startswith("isf:"):
            return False
        rec.verify(xxhash.xxh3_64_hexdigest(data[HEADER_SIZE:]), len(data), data)  # (or raises)
        return True

    try:
        with instride.Stream("cc", mode="w", retain=4, client=client, timeout=5) as s:
            for i in range(3):
                s.append(_positions(i), step=i)
        assert all(recorded(s.frame_key(i)) for i in range(3))
        s = instride.Stream("cc2", mode="w", retain=4, client=client, timeout=5)
        for i in range(3):
            s.append(_positions(i), step=i)
        # (the frames' records answered before Redis goes: appended flat out, the last ones
        # are held back to go together, and go out on their own after at most 0.2 s, TCP's
        # cork ceiling -- one still held when Redis stopped may or may not have left, and its
        # confirmation is rightly PublicationUnsettled, not the end marker's plain failure)
        time.sleep(0.5)
        redis_server.stop()
        time.sleep(0.1)  # (Redis's close seen before the end marker is sent: not sent)
        try:
            with pytest.raises(MetadataUnavailable) as info:
                s.close()
        finally:
            redis_server.start()
        assert not isinstance(info.value, PublicationUnsettled)
        assert not (node.dir / s.end_key).exists()
        s.close()
        assert (node.dir / s.end_key).exists()
        assert client.metadata.lookup(s.end_key) is not None
    finally:
        client.close()


def test_an_end_marker_redis_never_answered_stays_and_the_next_close_settles_it(
    tmp_path: Path, redis_server: Any
) -> None:
    """Cluster mode: Redis stores the end marker's record and goes out of reach before its
    answer. close() raises PublicationUnsettled and leaves the marker's file in place (a record
    names it); no frame may follow it; once Redis is back, close() again confirms its record
    (it would be refused as existing if written again) and the stream ends, readable."""
    from instride.config import Settings
    from instride.errors import PublicationUnsettled
    from tests.conftest import LoopbackNode
    from tests.relay import ReplyDropper

    node = LoopbackNode(tmp_path, 1, redis_server.url, "test-token")
    relay = ReplyDropper((redis_server.host, redis_server.port), refuse=True)
    client = instride.Client(Settings.from_env(
        {**node.env, "INSTRIDE_REDIS_URL": f"redis://127.0.0.1:{relay.port}/0",
         "INSTRIDE_CONNECT_TIMEOUT": "0.5"}))
    try:
        s = instride.Stream("unsettled", mode="w", retain=4, client=client, timeout=5)
        for i in range(3):
            s.append(_positions(i), step=i)
        s._confirm_records(all_=True)  # (the frames' answers in: the next EVALSHA is the marker's)
        relay.armed = True
        with pytest.raises(PublicationUnsettled):
            s.close()
        assert (node.dir / s.end_key).exists()  # (kept: its record is stored)
        with pytest.raises(ValueError, match="is ending"):
            s.append(_positions(3), step=3)
        relay.resume()
        s.close()
        stored = node.client().lookup(s.end_key)
        assert stored is not None
        frames = [f.step for f in instride.Stream("unsettled", client=node.client(), timeout=5)]
        assert frames == [0, 1, 2]
    finally:
        client.close()
        relay.close()


def test_a_lost_answer_is_sent_again_once_and_never_brings_a_retired_frame_back(
    tmp_path: Path, redis_server: Any
) -> None:
    # cluster mode, retain=1: each frame's record retires the frame before it. The answer to
    # frame 2's record is lost (the connection fails after Redis ran it): its confirmation
    # sends it again as the same publication — before frame 3's record retires frame 2 — so
    # frame 2's record is stored once and gone with its retirement, never brought back as a
    # second version, and the head ends where the producer is.
    from tests.conftest import LoopbackNode
    from tests.relay import ReplyDropper

    relay = ReplyDropper((redis_server.host, redis_server.port))
    node = LoopbackNode(tmp_path, 1, f"redis://127.0.0.1:{relay.port}/0", "test-token")
    client = node.client()
    clock = redis.Redis(host=redis_server.host, port=redis_server.port)
    try:
        before = int(clock.get("instride:clock") or 0)  # (every publication's version is its next)
        with instride.Stream("lost", mode="w", retain=1, client=client, timeout=5) as s:
            s.append(_positions(0), step=0)
            s.append(_positions(1), step=1)
            relay.armed = True
            s.append(_positions(2), step=2)
            for i in range(3, 6):
                s.append(_positions(i), step=i)
        assert relay.dropped == 1
        meta = client.metadata
        assert [meta.lookup(s.frame_key(i)) for i in range(5)] == [None] * 5  # all retired
        last = meta.lookup(s.frame_key(5))
        assert last is not None and last.version == before + 6  # (6 publications, not 7)
        assert client.engine.stream_state("lost").head() == (5, 6)
        reader = instride.Stream("lost", client=client, timeout=5)
        assert reader.frame_count() == 6 and reader.read(5).step == 5
        reader.close()
    finally:
        clock.close()
        client.close()
        relay.close()


def test_cluster_remote_reader_learns_of_dropped_frames(loopback_nodes: list) -> None:
    owner, remote = loopback_nodes[0], loopback_nodes[1]
    producer = subprocess.Popen([sys.executable, "-c", CLUSTER_PRODUCER, "30", "3", "drop-oldest"],
                                env=owner.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    rc, _, err = finish(producer, 120)
    assert rc == 0, err
    consumer = subprocess.Popen([sys.executable, "-c", CLUSTER_CONSUMER, "-"], env=remote.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    rc, out, err = finish(consumer, 120)
    assert rc == 0, err
    steps, rest = out.split("|")
    assert [int(x) for x in steps.split()] == [27, 28, 29]
    assert int(rest.split()[0]) == 27  # counted, never a silent gap


LEASED_PRODUCER = textwrap.dedent(
    """
    import time, numpy as np, instride
    pos = np.zeros((100, 3), dtype=np.float32)
    with instride.Stream("leased", mode="w", groups=["g"], timeout=60) as s:
        for i in range(150):
            pos[:, 0] = i
            s.append(pos, step=i)
            time.sleep(0.03)
    """
)
LEASED_READER = textwrap.dedent(
    """
    import sys, time, instride
    import instride.store.streamstate as state
    from instride.errors import GroupBusy, GroupLeaseLost
    state.LEASE_S = 1.0  # (a short lease: the test pauses a reader for longer than it)
    log = open(sys.argv[1], "a", buffering=1)
    while True:
        try:
            s = instride.Stream("leased", group="g", timeout=60)
            break
        except GroupBusy:  # (the first reader's lease has not run out yet)
            time.sleep(0.05)
    try:
        for f in s:
            log.write(f"{f.step}\\n")
    except GroupLeaseLost as exc:
        print("LOST", exc, flush=True)
        s.close()
        sys.exit(3)
    s.close()
    print("END", flush=True)
    """
)


def _steps(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def test_cluster_group_reader_paused_past_its_lease_stops_reading_as_the_group(
        loopback_nodes: list, tmp_path: Path) -> None:
    """A group reader stopped for longer than its lease loses the group to a reader waiting
    for it; resumed, it raises ``GroupLeaseLost`` instead of taking frames as the group, and
    the two together take every frame — only the frame held at the pause twice. (The first is
    resumed once the second holds the group's lease, not once the second has read: stopped
    while it waited for a key it had asked for, the first holds that key's fetch lock on the
    node, which the second then waits for up to its timeout.)"""
    import redis as redis_py

    owner, remote = loopback_nodes[0], loopback_nodes[1]
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    producer = spawn_py(LEASED_PRODUCER, env=owner.env)
    first = subprocess.Popen([sys.executable, "-c", LEASED_READER, str(first_log)], env=remote.env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    second = None
    meta = redis_py.Redis.from_url(owner.env["INSTRIDE_REDIS_URL"])
    lease = "instride:stream:leased:group:g:lease"
    try:
        deadline = time.monotonic() + 60
        while len(_steps(first_log)) < 5:
            assert time.monotonic() < deadline and first.poll() is None, "first reader stalled"
            time.sleep(0.02)
        held = meta.get(lease)
        assert held is not None
        stop_process(first.pid)
        before = _steps(first_log)
        second = subprocess.Popen([sys.executable, "-c", LEASED_READER, str(second_log)],
                                  env=remote.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60  # (its own minute: the first may have been slow)
        while meta.get(lease) in (held, None):  # (it takes the group once the lease ran out)
            if time.monotonic() >= deadline or second.poll() is not None:
                second.kill()
                _, err = second.communicate(timeout=30)
                raise AssertionError(f"the second reader did not take the group (exit "
                                     f"{second.returncode}): {err.decode(errors='replace')[-2000:]}")
            time.sleep(0.02)
    finally:
        os.kill(first.pid, signal.SIGCONT)
        meta.close()
    rc, out, err = finish(first, 60)
    assert rc == 3 and "LOST" in out and "lost the lease on consumer group 'g'" in out, (rc, out, err)
    assert _steps(first_log) == before  # not one frame taken as the group after the pause
    rc, _, err = finish(second, 120)
    assert rc == 0, err
    rc, _, err = finish(producer, 120)
    assert rc == 0, err
    later = _steps(second_log)
    assert later == list(range(later[0], 150))
    assert before[-1] <= later[0] <= before[-1] + 1 and before == list(range(len(before)))


def test_a_bounded_stream_under_a_name_beyond_ascii_reads_back_every_frame(
    managed_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the one-call append (here with fsync: the managed directory is not on tmpfs) and the
    # one-call lease take the paths as the file system's bytes (a "%" in them as it is)
    from instride.store.ring import SlotPool

    native: list[bool] = []
    one_call = SlotPool.write_and_publish

    def counted(self: SlotPool, *args: Any, **kw: Any) -> bool:
        published = one_call(self, *args, **kw)
        native.append(kw["fsync"] and published)
        return published

    monkeypatch.setattr(SlotPool, "write_and_publish", counted)
    with instride.Stream("émulsion/répl☃ 100%d", mode="w", retain=3, groups=["g"], timeout=5) as s:
        reader = instride.Stream("émulsion/répl☃ 100%d", group="g", timeout=5)
        for i in range(6):
            s.append(_positions(i), step=i)
            frame = next(reader)
            assert frame.step == i and np.all(frame.positions[:, 0] == i)
    assert (managed_dir / "émulsion" / "répl☃ 100%d" / "frame_000000005.isf").exists()
    assert native == [True] * 6  # every frame published by the one call, flushed
    reader.close()


@pytest.mark.parametrize("copy", [False, True])
def test_a_local_reader_takes_each_frame_in_one_native_call_and_refuses_a_corrupt_one(
    managed_dir: Path, monkeypatch: pytest.MonkeyPatch, copy: bool
) -> None:
    # once a recycled file is mapped, the frame is waited for, held and checked (copied, for a
    # copying reader) by isl_take; a frame corrupted in its file still raises IntegrityError
    from instride.store.ring import Leases

    taken: list[Any] = []
    one_call = Leases.take

    def counted(self: Leases, *args: Any, **kw: Any) -> Any:
        got = one_call(self, *args, **kw)
        taken.append(got)
        return got

    monkeypatch.setattr(Leases, "take", counted)
    with instride.Stream("native", mode="w", retain=2, groups=["g"], timeout=5) as s:
        reader = instride.Stream("native", group="g", timeout=5, copy=copy)
        for i in range(12):
            s.append(_positions(i), step=i)
            frame = next(reader)
            assert frame.step == i and np.all(frame.positions[:, 0] == i)
            assert frame.positions.flags.writeable == copy
        later = [t for t in taken[6:] if not isinstance(t, int)]
        assert len(later) == 6 and all(t.checked for t in later)  # (files mapped by then)
        assert all(t.copied == copy for t in later)
        s.append(_positions(12), step=12)
        path = managed_dir / "native" / "frame_000000012.isf"
        with open(path, "r+b") as fh:  # (the producer's recycled file: mapped by the reader)
            fh.seek(300)
            fh.write(b"\x00\x01" * 8)
        with pytest.raises(IntegrityError, match="checksum"):
            next(reader)
    reader.close()


def test_a_bounded_stream_is_not_rerun_without_overwrite(client: instride.Client) -> None:
    """Run 1 keeps its last 2 frames and ends. A second run of the name without ``overwrite``
    is refused at its first append, before anything is touched (its first frames, retired by
    run 1, used to publish over a zeroed head, beside run 1's last frames and end marker,
    until frame 3 met run 1's)."""
    with instride.Stream("again", mode="w", retain=2, client=client) as s:
        for i in range(5):
            s.append(_positions(i), step=i)
    rerun = instride.Stream("again", mode="w", retain=2, client=client)
    with pytest.raises(KeyExistsError, match="again/"):
        rerun.append(_positions(9), step=9)
    rerun.abandon()
    r = instride.Stream("again", client=client, timeout=1, on_gap="count")
    assert r.ended and [f.step for f in r] == [3, 4]  # run 1, untouched
    with instride.Stream("again", mode="w", retain=2, overwrite=True, client=client) as s:
        s.append(_positions(7), step=7)
    assert [f.step for f in instride.Stream("again", client=client, timeout=1)] == [7]


def _read_two_then_rerun(name: str, retain: int, n: int, writer: instride.Client,
                         reader: instride.Client, *, timeout: float
                         ) -> tuple[instride.Stream, instride.Stream]:
    """Run 1 of stream ``name`` (``n`` frames, group "g"), a group reader of it that took
    frames 0 and 1 (``reader``'s), then run 2's producer (``overwrite=True``, ``writer``'s),
    nothing appended yet: the reader and run 2's producer."""
    with instride.Stream(name, mode="w", retain=retain, groups=["g"], client=writer) as w:
        for i in range(n):
            w.append(_positions(i), step=i)
    r = instride.Stream(name, group="g", client=reader, timeout=timeout)
    assert [next(r).step for _ in range(2)] == [0, 1]
    return r, instride.Stream(name, mode="w", retain=retain, groups=["g"], overwrite=True,
                              client=writer)


@pytest.mark.parametrize("mode", ["local", "cluster"])
def test_a_rerun_stops_a_group_reader_of_the_earlier_run(
        mode: str, client: instride.Client, tmp_path: Path, redis_server: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A group reader of run 1 (it holds frame 1) while the stream is re-run
    (``overwrite=True``): it raises ``GroupReset`` at its next frame, and a reader of the new
    run takes the group from frame 0. Its position used to stay, and a re-run's reset was
    overwritten by its next commit: it waited for its run's frame 2 in the new run (skipping
    the new run's frames before it), and on one node it kept the group from the new run's
    reader (``GroupBusy``)."""
    import instride.store.streamstate as state
    from instride.errors import GroupReset
    from tests.conftest import LoopbackNode

    node = None
    if mode == "cluster":
        monkeypatch.setattr(state, "LEASE_S", 1.0)  # (renewed every ~0.33 s: it learns soon)
        node = LoopbackNode(tmp_path, 1, redis_server.url, "test-token")
        client = node.client()
    try:
        r, w2 = _read_two_then_rerun("rr", 4, 4, client, client, timeout=5)
        w2.append(_positions(10), step=10)
        time.sleep(1.0 if mode == "cluster" else 0.0)
        with pytest.raises(GroupReset, match="re-run"):
            next(r)
        r.close()
        r2 = instride.Stream("rr", group="g", client=client, timeout=5)
        w2.append(_positions(11), step=11)
        w2.close()
        assert [f.step for f in r2] == [10, 11]
        r2.close()
    finally:
        if node is not None:
            client.close()


@pytest.mark.parametrize("where", ["same node", "other node"])
def test_a_cluster_reader_learns_of_a_rerun_from_its_first_refused_commit(
        where: str, tmp_path: Path, redis_server: Any) -> None:
    """A cluster group reader of run 1 reads on while the stream is re-run and the new run's
    frames come: it raises ``GroupReset`` at once, having taken at most ``commit_every`` (1)
    of the new run's frames — those it took while Redis's answer to its first commit after the
    re-run, a refusal, was on its way (the answer before a commit is waited for). It used to
    learn of the re-run only at its lease's next renewal, up to a third of the lease later
    (3.3 s), and took the new run's frames meanwhile as the earlier run's (here: all four).
    The other node's reader takes the frames its owner streams to it."""
    from instride.errors import GroupReset
    from tests.conftest import running_nodes

    ids = (1,) if where == "same node" else (1, 2)
    with running_nodes(tmp_path, redis_server.url, "test-token", ids) as nodes:
        writer, reader = nodes[0].client(), nodes[-1].client()
        try:
            r, w2 = _read_two_then_rerun("rc", 8, 2, writer, reader, timeout=20)
            for i in range(6):  # (the new run's frames 2-5: what the old reader would take)
                w2.append(_positions(10 + i), step=10 + i)
            taken: list[int] = []
            t0 = time.monotonic()
            with pytest.raises(GroupReset, match="re-run"):
                for _ in range(4):
                    taken.append(next(r).step)
            assert len(taken) <= 1, taken  # (taken while the refusal was on its way)
            assert time.monotonic() - t0 < 2.0  # (not the lease's renewal, 3.3 s on)
            r.close()
            w2.close()
            again = instride.Stream("rc", group="g", client=reader, timeout=5)
            assert [f.step for f in again] == list(range(10, 16))
            again.close()
        finally:
            writer.close()
            reader.close()


def _iterating(stream: instride.Stream) -> tuple[threading.Thread, list[object]]:
    """A thread iterating ``stream``, started; the list gets the steps it took, then what
    it raised (if it raised)."""
    got: list[object] = []

    def run() -> None:
        try:
            got.extend(f.step for f in stream)
        except Exception as exc:  # noqa: BLE001 (what it raised is the result)
            got.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, got


@contextlib.contextmanager
def _two_clients(where: str, client: instride.Client, tmp_path: Path, redis_url: str
                 ) -> Iterator[tuple[instride.Client, instride.Client]]:
    """A writer's and a reader's client: ``client`` for both (``"local"``), one loopback
    node's (``"same node"``) or two nodes' (``"other node"``)."""
    if where == "local":
        yield client, client
        return
    from tests.conftest import running_nodes

    with running_nodes(tmp_path, redis_url, "test-token",
                       (1,) if where == "same node" else (1, 2)) as nodes:
        writer, reader = nodes[0].client(), nodes[-1].client()
        try:
            yield writer, reader
        finally:
            writer.close()
            reader.close()


@pytest.mark.parametrize("retain", [None, 4])
@pytest.mark.parametrize("where", ["local", "same node", "other node"])
def test_a_plain_reader_waiting_when_its_stream_is_rerun_raises_stream_rerun(
        where: str, retain: int | None, client: instride.Client, tmp_path: Path,
        redis_server: Any) -> None:
    """A plain reader of run 1, whose producer died after 3 frames, waits for frame 3 when
    the stream is re-run (``overwrite=True``): it raises ``StreamRerun``. It used to read on
    at frame 3 **of the new run**, the new run's frames 0-2 skipped, as if the runs were
    one. A reader opened afterwards reads the new run whole."""
    from instride.errors import StreamRerun

    with _two_clients(where, client, tmp_path, redis_server.url) as (writer, reader):
        w1 = instride.Stream("pr", mode="w", retain=retain, client=writer)
        for i in range(3):
            w1.append(_positions(i), step=i)
        r = instride.Stream("pr", client=reader, timeout=20)
        assert [next(r).step for _ in range(3)] == [0, 1, 2]
        got: list[object] = []

        def wait() -> None:
            try:
                got.append(next(r).step)
            except Exception as exc:  # noqa: BLE001 (what it raised is the result)
                got.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        # (waiting for frame 3; in cluster mode the run is asked after a wait of half a second
        # or more: a producer started again takes longer than that)
        time.sleep(0.3 if where == "local" else stream_mod._RUN_WAITED + 0.3)
        w1.abandon()  # (the producer died)
        with instride.Stream("pr", mode="w", retain=retain, overwrite=True,
                             client=writer) as w2:
            for i in range(4):  # (retain=4: all kept for the reader after)
                w2.append(_positions(10 + i), step=10 + i)
        waiter.join(30)
        assert not waiter.is_alive()
        assert len(got) == 1 and isinstance(got[0], StreamRerun), got
        assert "re-run" in str(got[0]) and got[0].errno == errno.ESTALE
        with pytest.raises(StreamRerun):  # (and it stays so)
            next(r)
        r.close()
        again = instride.Stream("pr", client=reader, timeout=5)
        assert [f.step for f in again] == list(range(10, 14))
        again.close()


@pytest.mark.parametrize("where", ["local", "same node", "other node"])
def test_a_plain_reader_reading_on_through_a_rerun_raises_stream_rerun(
        where: str, client: instride.Client, tmp_path: Path, redis_server: Any) -> None:
    """A plain reader of run 1 (it read frames 0 and 1 of 5) reads on after the stream was
    re-run and the new run's frames came: its next frame is ``StreamRerun``, not the new
    run's frame 2 — at once on one node (the run's count is in the stream's mapped head),
    and in cluster mode once Redis is asked again (a quarter of a second after it last was:
    here, after that). A reader that ended with run 1 gets ``StreamRerun`` too, not the end
    of the new, shorter run."""
    from instride.errors import StreamRerun

    with _two_clients(where, client, tmp_path, redis_server.url) as (writer, reader):
        with instride.Stream("pn", mode="w", client=writer) as w1:
            for i in range(5):
                w1.append(_positions(i), step=i)
        r = instride.Stream("pn", client=reader, timeout=20)
        done = instride.Stream("pn", client=reader, timeout=20)
        assert [next(r).step for _ in range(2)] == [0, 1]
        assert [f.step for f in done] == list(range(5))
        with instride.Stream("pn", mode="w", overwrite=True, client=writer) as w2:
            for i in range(4):
                w2.append(_positions(10 + i), step=10 + i)
        if where != "local":
            time.sleep(stream_mod._RUN_LOOK + 0.05)
        with pytest.raises(StreamRerun, match="frame 2 "):
            next(r)
        with pytest.raises(StreamRerun):
            next(done)
        r.close()
        done.close()


def test_a_plain_reader_that_read_nothing_reads_the_rerun(client: instride.Client) -> None:
    """A reader opened on run 1 that took no frame before the stream was re-run reads the new
    run, from its first frame (the run it reads is the one it finds at its first frame)."""
    with instride.Stream("pz", mode="w", client=client) as w1:
        for i in range(3):
            w1.append(_positions(i), step=i)
    r = instride.Stream("pz", client=client, timeout=5)
    with instride.Stream("pz", mode="w", overwrite=True, client=client) as w2:
        for i in range(2):
            w2.append(_positions(10 + i), step=10 + i)
    assert [f.step for f in r] == [10, 11]
    r.close()


def _a_lease_run_out(tmp_path: Path, redis_url: str, name: str
                     ) -> tuple[instride.Client, instride.Stream, instride.Stream]:
    """A cluster node's client, a producer of stream ``name`` (4 frames, group "g") and a
    group reader that took frames 0 and 1, whose lease then ran out (deleted, as if it had;
    nobody took the group)."""
    from tests.conftest import LoopbackNode

    client = LoopbackNode(tmp_path, 1, redis_url, "test-token").client()
    w = instride.Stream(name, mode="w", retain=8, groups=["g"], client=client)
    for i in range(4):
        w.append(_positions(i), step=i)
    r = instride.Stream(name, group="g", client=client, timeout=5)
    assert [next(r).step for _ in range(2)] == [0, 1]
    client.metadata.redis.delete(f"instride:stream:{client.key(name)}:group:g:lease")
    return client, w, r


def test_a_commit_refused_while_the_lease_ran_out_is_sent_again_once_it_is_taken_back(
        tmp_path: Path, redis_server: Any) -> None:
    """A cluster group reader whose lease ran out (nobody took the group) commits: Redis
    refuses it; the reader reads the refusal, takes the lease back and sends that commit again
    (the group's position used to lag until its next commit). Once closed, it never takes the
    lease back (a commit's refusal read after its release could have)."""
    client, w, r = _a_lease_run_out(tmp_path, redis_server.url, "rs")
    try:
        redis_ = client.metadata.redis
        assert next(r).step == 2  # (its commit of frame 1 done: refused)
        cursor = r._cursor_file
        assert cursor is not None
        cursor.state.metadata.flush()  # (the refusal read)
        cursor.check()  # (the lease taken back, the commit sent again)
        cursor.state.metadata.flush()
        assert redis_.hget(f"instride:stream:{client.key('rs')}:groups", "g") == b"2"
        assert next(r).step == 3
        r.close()
        assert not cursor._extend()
        w.close()
    finally:
        client.close()


def test_a_group_reader_waiting_when_its_stream_is_rerun_stops_at_once(
        client: instride.Client) -> None:
    """A group reader of run 1 waits for frame 2, which the re-run never writes: it raises
    ``GroupReset`` within a slice of its wait (it used to wait until its timeout, for ever
    without one)."""
    from instride.errors import GroupReset

    w1 = instride.Stream("rw", mode="w", retain=4, groups=["g"], client=client)
    for i in range(2):
        w1.append(_positions(i), step=i)
    r = instride.Stream("rw", group="g", client=client, timeout=20)
    assert [next(r).step for _ in range(2)] == [0, 1]
    got: list[object] = []

    def wait() -> None:
        t0 = time.monotonic()
        try:
            got.append(next(r))
        except Exception as exc:  # noqa: BLE001 (what it raised is the result)
            got.append(exc)
        got.append(time.monotonic() - t0)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)  # (waiting for frame 2)
    w1.abandon()
    w2 = instride.Stream("rw", mode="w", retain=4, groups=["g"], overwrite=True, client=client)
    w2.append(_positions(10), step=10)
    waiter.join(30)
    w2.close()
    r.close()
    assert isinstance(got[0], GroupReset), got
    assert got[1] < 5, got


@pytest.mark.parametrize("taken_meanwhile", [False, True])
def test_a_group_reader_whose_lease_ran_out_takes_it_back_unless_taken_meanwhile(
        taken_meanwhile: bool, tmp_path: Path, redis_server: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster group reader's lease runs out (it was paused) while nobody waits for the
    group: it takes the lease back at its next renewal and reads on (it used to raise
    ``GroupLeaseLost`` though no other reader had the group). If another reader took the
    group and let it go meanwhile, it must not: ``GroupLeaseLost``."""
    import instride.store.streamstate as state
    from instride.errors import GroupLeaseLost

    monkeypatch.setattr(state, "LEASE_S", 1.0)  # (renewed every ~0.33 s)
    client, w, r = _a_lease_run_out(tmp_path, redis_server.url, "rt")
    try:
        if taken_meanwhile:
            other = instride.Stream("rt", group="g", client=client, timeout=5)
            assert next(other).step == 1  # (the frame the first one held: again)
            other.close()
        time.sleep(0.6)  # (a renewal or two)
        if taken_meanwhile:
            with pytest.raises(GroupLeaseLost):
                next(r)
        else:
            assert [next(r).step for _ in range(2)] == [2, 3]
        r.close()
        w.close()
    finally:
        client.close()


def test_closing_a_reader_ends_the_holds_of_frames_it_never_released(managed_dir: Path) -> None:
    """Frames taken with ``read()`` or ``stream[i]`` and never released kept their descriptor
    and shared lock after the reader's ``close()`` — for the life of the process: the
    producer could never reuse their files (its pool growing past its bound)."""
    with instride.Stream("unreleased", mode="w", retain=4) as s:
        for i in range(3):
            s.append(np.full((10, 3), float(i)), step=i)
    r = instride.Stream("unreleased")
    kept = [r.read(0), r[2]]
    assert kept[1].step == 2
    files = [managed_dir / "unreleased" / f"frame_00000000{i}.isf" for i in (0, 2)]

    def lockable(path: Path) -> bool:  # (as the producer must lock a file to reuse it)
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)

    assert not any(map(lockable, files))  # (held while the reader is open)
    r.close()
    assert all(map(lockable, files))  # (the arrays kept stay mapped: their bytes may change)
    assert kept[0].step == 0


CLOSED_WHILE_TAKING = textwrap.dedent(
    """
    import threading, time, numpy as np, instride
    pos = np.zeros((2000, 3), dtype=np.float32)
    w = instride.Stream("s", mode="w", retain=2, groups=["g"], timeout=10)
    r = instride.Stream("s", group="g", timeout=10)
    it = iter(r)
    for i in range(6):  # (the reader's kept mappings of the recycled files)
        pos[:, 0] = i
        w.append(pos, step=i)
        f = next(it)
        f.release()
    got = {}
    def worker():
        try:
            got["frame"] = next(it).step
        except BaseException as exc:  # noqa: BLE001
            got["error"] = type(exc).__name__
    t = threading.Thread(target=worker)
    t.start()
    time.sleep(0.2)  # (the worker waits in the native take)
    r.close()
    pos[:, 0] = 6
    w.append(pos, step=6)  # (into a recycled file the take's table names)
    t.join(10)
    w.close()
    print(got, flush=True)
    """
)


def test_closing_a_reader_while_another_thread_takes_does_not_crash(managed_dir: Path) -> None:
    """A group reader iterating on a worker thread, closed from the main one while the worker
    waited in the native take (GIL released): the close unmapped the kept mappings the take's
    table named, and the producer's next frame, in one of those recycled files, made the take
    read the unmapped memory — SIGSEGV. The mappings go once the take is done."""
    rc, out, err = finish(spawn_py(CLOSED_WHILE_TAKING), 60)
    assert rc == 0, f"status {rc}: {err[-2000:]}"
    assert out.strip().startswith("{") and "frame" in out or "error" in out, out


@pytest.mark.parametrize("where", ["local", "same node"])
def test_a_stream_made_again_after_its_keys_were_deleted_starts_its_groups_over(
        where: str, client: instride.Client, tmp_path: Path, redis_server: Any) -> None:
    """A stream whose keys were all deleted is produced again without ``overwrite=True``
    (nothing refuses it: no end marker, no last frame): the earlier run's group positions
    stayed — **the new run's group reader started at the earlier run's position and took
    nothing** of the new run, whose frames its "block" producer retired unread. A new
    producer never continues a stream: the groups start over wherever an earlier run left
    state."""
    with _two_clients(where, client, tmp_path, redis_server.url) as (writer, reader):
        with instride.Stream("del", mode="w", retain=16, groups=["g"], client=writer) as w:
            for i in range(6):
                w.append(_positions(i), step=i)
        r = instride.Stream("del", group="g", client=reader, timeout=5)
        assert [f.step for f in r] == list(range(6))
        r.close()
        for key in writer.list("del/"):
            writer.delete(key)
        with instride.Stream("del", mode="w", retain=4, groups=["g"], client=writer,
                             timeout=5) as w:
            for i in range(4):
                w.append(_positions(100 + i), step=100 + i)
        r = instride.Stream("del", group="g", client=reader, timeout=5)
        assert r.tell() == 0
        assert [f.step for f in r] == [100, 101, 102, 103]
        r.close()


def _a_broken_off_run_read_by_g(name: str, writer: instride.Client,
                                reader: instride.Client) -> None:
    """A run of stream ``name`` that broke off after 3 frames (``retain=8``, group "g"),
    all 3 read by group "g" (its position, 3, recorded)."""
    w1 = instride.Stream(name, mode="w", retain=8, groups=["g"], client=writer)
    for i in range(3):
        w1.append(_positions(i), step=i)
    w1.abandon()
    r1 = instride.Stream(name, group="g", client=reader, timeout=20)
    assert [next(r1).step for _ in range(3)] == [0, 1, 2]
    r1._move_on()
    r1.close()


@pytest.mark.parametrize("earlier", [False, True])
@pytest.mark.parametrize("where", ["local", "same node", "other node"])
def test_a_group_reader_started_before_a_rerunning_producer_reads_the_new_run(
        where: str, earlier: bool, client: instride.Client, tmp_path: Path,
        redis_server: Any) -> None:
    """A job script starts a group reader and its producer, with ``overwrite=True`` (so that
    the job can be run again), at once: the reader, which had read nothing, **raised
    GroupReset** (its position "the earlier run's") — at once on one node, after taking
    frame 0 in cluster mode. It takes its group again, at the new run's start. (``earlier``:
    a run broke off before, its 3 frames read by the group: the reader waits at frame 3.)"""
    with _two_clients(where, client, tmp_path, redis_server.url) as (writer, reader):
        if earlier:
            _a_broken_off_run_read_by_g("early", writer, reader)
        r = instride.Stream("early", group="g", client=reader, timeout=20)
        assert r.tell() == (3 if earlier else 0)
        t, got = _iterating(r)
        time.sleep(0.3)  # (the reader waits for frame 0)
        with instride.Stream("early", mode="w", retain=8, groups=["g"], overwrite=True,
                             client=writer) as w:
            for i in range(5):
                w.append(_positions(10 + i), step=10 + i)
        t.join(30)
        r.close()
        assert got == [10, 11, 12, 13, 14], got


@pytest.mark.parametrize("how", ["read", "latest"])
@pytest.mark.parametrize("where", ["local", "same node", "other node"])
def test_a_group_readers_first_random_read_of_a_rerun_reads_the_new_run(
        where: str, how: str, client: instride.Client, tmp_path: Path,
        redis_server: Any) -> None:
    """As above, but the group reader's first read is random access (``read(i)``, or
    ``latest()``), not iteration: it **raised GroupReset** having returned nothing (only
    iteration took the group again). It takes the group again too, and returns the new
    run's frame."""
    with _two_clients(where, client, tmp_path, redis_server.url) as (writer, reader):
        _a_broken_off_run_read_by_g("rr", writer, reader)
        r = instride.Stream("rr", group="g", client=reader, timeout=20)
        with instride.Stream("rr", mode="w", retain=8, groups=["g"], overwrite=True,
                             client=writer) as w:
            for i in range(5):
                w.append(_positions(10 + i), step=10 + i)
        try:
            if how == "read":
                assert r.read(1).step == 11
                assert r.tell() == 0  # (the new run's position: random access moves nothing)
                assert next(r).step == 10
            else:
                assert r.latest().step == 14
                assert r.tell() == 5
        finally:
            r.close()




def test_a_forked_child_does_not_keep_the_group_of_its_parents_reader(
        client: instride.Client) -> None:
    """One node: a child forked while a group reader was open (a ``multiprocessing`` pool)
    inherited the locked cursor file: after the parent closed its reader, **every new reader
    of the group got GroupBusy** until the child ended."""
    with instride.Stream("fk", mode="w", retain=4, on_full="drop-oldest", groups=["g"],
                         client=client) as w:
        for i in range(3):
            w.append(_positions(i), step=i)
    r = instride.Stream("fk", group="g", client=client, timeout=5)
    assert [next(r).step for _ in range(2)] == [0, 1]  # (frame 0 done; 1 held)
    up, down = os.pipe()
    child = os.fork()
    if child == 0:  # (alive while the parent reopens the group)
        os.write(down, b"1")  # (started: its fork handlers have run)
        time.sleep(3)
        os._exit(0)
    try:
        assert os.read(up, 1) == b"1"
        r.close()
        again = instride.Stream("fk", group="g", client=client, timeout=5)
        assert again.tell() == 1
        again.close()
    finally:
        os.close(up)
        os.close(down)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


@pytest.mark.parametrize("where", ["local", "same node"])
def test_a_rerun_drops_a_group_its_reader_finished_for_good(
        where: str, client: instride.Client, tmp_path: Path, redis_server: Any) -> None:
    """A group a reader finished for good (``leave_group``) was set back to 0 by a re-run:
    its "block" producer **waited for a reader that never comes** (for ever, or StreamFull
    with a timeout). A re-run drops such a group (and the earlier archiver's); the groups the
    producer names, and the others, start over at 0."""
    with _two_clients(where, client, tmp_path, redis_server.url) as (writer, reader):
        with instride.Stream("fin", mode="w", retain=4, groups=["kept"], client=writer) as w:
            for i in range(3):
                w.append(_positions(i), step=i)
        for group in ("oneoff", "other", "kept"):
            r = instride.Stream("fin", group=group, client=reader, timeout=5)
            next(r)
            if group == "oneoff":
                r.leave_group()
            else:
                r.close()
        w = instride.Stream("fin", mode="w", retain=4, overwrite=True, groups=["kept"],
                            client=writer, timeout=5)
        w.append(_positions(10), step=10)  # (the run starts with its first frame)
        cursors = w._share.cursors()
        w.abandon()
        assert cursors == {"kept": 0, "other": 0}, cursors


@pytest.mark.parametrize("where", ["local", "same node"])
def test_a_reader_closed_from_another_thread_takes_no_frame(
        where: str, client: instride.Client, tmp_path: Path, redis_server: Any) -> None:
    """A group reader waiting for frame 2 in a thread, closed from another: when frame 2
    came, **the closed reader's thread returned it**, while a second reader took the group
    at 2 — both took frame 2 as the group. It raises ``ValueError`` (closed) instead."""
    with _two_clients(where, client, tmp_path, redis_server.url) as (writer, reader):
        w = instride.Stream("cl", mode="w", retain=4, groups=["g"], client=writer, timeout=30)
        for i in range(2):
            w.append(_positions(i), step=i)
        r = instride.Stream("cl", group="g", client=reader, timeout=8)
        t, got = _iterating(r)
        time.sleep(0.5)  # (frames 0 and 1 taken; waiting for 2)
        r.close()
        second = instride.Stream("cl", group="g", client=reader, timeout=8)
        w.append(_positions(2), step=2)
        w.append(_positions(3), step=3)
        t.join(15)
        assert got[:2] == [0, 1] and isinstance(got[2], ValueError), got
        assert [next(second).step, next(second).step] == [2, 3]
        second.close()
        w.close()


def test_a_forked_child_closing_its_copy_of_a_group_reader_records_nothing(
        client: instride.Client) -> None:
    """A forked child that closed its copy of a group reader (or left its ``with`` block)
    **recorded the parent's position as of the fork**: the group's cursor went back."""
    with instride.Stream("fc", mode="w", groups=["g"], client=client) as w:
        for i in range(20):
            w.append(_positions(i), step=i)
    r = instride.Stream("fc", group="g", client=client, timeout=5, commit_every=4)
    for _ in range(7):
        next(r)
    child = os.fork()
    if child == 0:
        try:
            time.sleep(1.0)  # (the parent reads on meanwhile)
            r.close()
        finally:
            os._exit(0)
    for _ in range(10):
        next(r)
    r._move_on()  # (frame 16 released: its position recorded, every 4 frames)
    before = r._share.cursors()["g"]
    assert before >= 14
    os.waitpid(child, 0)
    assert r._share.cursors()["g"] == before  # (not 7, the child's copy's)
    r.close()


def test_a_cursor_file_cut_short_counts_as_the_start(client: instride.Client) -> None:
    """A group's cursor file cut short (a crash before it reached the disk, or by hand) made
    every open of the group raise a bare ``struct.error``, and its producer ignored the
    group. It counts as 0: the group reads the stream again — frames twice, none skipped."""
    from instride.store.streamstate import state_dir

    with instride.Stream("cut", mode="w", retain=8, groups=["g"], client=client) as w:
        for i in range(3):
            w.append(_positions(i), step=i)
    cursor = state_dir(client.root, "cut") / "groups" / "g"
    cursor.write_bytes(b"\\x01")
    r = instride.Stream("cut", group="g", client=client, timeout=5)
    assert [f.step for f in r] == [0, 1, 2]
    r.close()
    cursor.write_bytes(b"")
    assert instride.Stream("cut", mode="r", client=client)._share.cursors() == {"g": 0}


def test_a_plain_cluster_reader_waits_through_a_redis_restart(tmp_path: Path) -> None:
    """A plain reader on another node that had read frames waits for the next one while
    Redis (persisted) is down a few seconds: its look at the stream's run (a re-run?) **ended
    the wait with ``MetadataUnavailable``** once the connect timeout passed, where waiters
    survive a Redis restart (they re-subscribe and re-check). The look is advisory now. And
    ``read(i, timeout=0)`` with Redis away is a ``ConsumeTimeout`` again."""
    from tests.conftest import RedisServer, running_nodes

    data = tmp_path / "redis"
    data.mkdir()
    server = RedisServer()

    def start() -> None:
        server.start("--dir", str(data), "--appendonly", "yes", "--appendfsync", "always")

    start()
    try:
        with running_nodes(tmp_path, server.url, "test-token", (1, 2)) as nodes:
            writer, reader = nodes[0].client(), nodes[1].client()
            try:
                w = instride.Stream("rr", mode="w", client=writer)
                for i in range(3):
                    w.append(_positions(i), step=i)
                r = instride.Stream("rr", client=reader)  # (no timeout: for ever)
                other = instride.Stream("rr", client=reader)
                for i in range(3):
                    r.read(i).release()
                other.read(0).release()
                got: list[object] = []

                def wait() -> None:
                    try:
                        got.append(r.read(3).step)
                    except Exception as exc:  # noqa: BLE001 (what it raised is the result)
                        got.append(exc)

                t = threading.Thread(target=wait)
                t.start()
                time.sleep(0.5)
                server.stop()
                try:
                    with pytest.raises(ConsumeTimeout):
                        other.read(5, timeout=0)
                    time.sleep(3.0)  # (past the connect timeout)
                finally:
                    start()
                time.sleep(0.3)
                w.append(_positions(3), step=3)
                t.join(30)
                assert got == [3], got
                w.close()
                r.close()
                other.close()
            finally:
                writer.close()
                reader.close()
    finally:
        server.stop()
