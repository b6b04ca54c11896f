"""Recycled frame files: slot reuse, leases that keep a held file from being rewritten."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from instride.errors import FileTypeError, UnsafePathError
from instride.store.ring import Leases, SlotPool, collect_pool
from tests.conftest import finish, spawn_py


def _write(pool: SlotPool, root: Path, name: str, data: bytes) -> int:
    slot = pool.take(len(data))
    pool.mapping(slot)[:] = data  # (a new file of a pool that does not recycle: mapped now)
    pool.publish(slot, root / name, name, overwrite=False, fsync=False)
    return slot.ino


def _slots(pool: Path) -> list[str]:
    """The frame files in a pool directory (not the producer's alive file)."""
    return sorted(n for n in os.listdir(pool) if n.startswith("slot-"))


def test_retired_file_is_reused_and_its_key_is_gone(tmp_path: Path) -> None:
    pool = SlotPool(tmp_path / "pool", recycle=True)
    ino = _write(pool, tmp_path, "a", b"A" * 4096)
    assert (tmp_path / "a").read_bytes() == b"A" * 4096
    pool.retire(ino)
    assert not (tmp_path / "a").exists()  # unpublished in one rename
    again = _write(pool, tmp_path, "b", b"B" * 4096)
    assert again == ino  # the same file (its pages) now holds the new frame
    assert (tmp_path / "b").read_bytes() == b"B" * 4096
    assert len(os.listdir(tmp_path / "pool")) == 1  # (its alive file, locked)
    pool.close()
    assert os.listdir(tmp_path / "pool") == []  # (the alive file too)


def test_a_frame_is_retired_even_when_the_pool_directory_was_removed(tmp_path: Path) -> None:
    # someone removed the pool directory (a clean-up of hidden files): retiring a frame must
    # still take its key away (never a frame left published past its retention)
    import shutil

    pool = SlotPool(tmp_path / "pool", recycle=True)
    ino = _write(pool, tmp_path, "a", b"A" * 4096)
    shutil.rmtree(tmp_path / "pool")
    pool.retire(ino)
    assert not (tmp_path / "a").exists()
    # its alive file made again with the directory: a collector leaves the retired file
    assert collect_pool(tmp_path / "pool") == [] and len(_slots(tmp_path / "pool")) == 1
    assert _write(pool, tmp_path, "b", b"B" * 4096) == ino  # and its file is reused
    # a key deleted under us: the file is gone, forgotten
    os.unlink(tmp_path / "b")
    pool.retire(ino)
    assert pool.files == 0
    pool.close()


def test_a_published_frame_carries_its_publication_time_to_the_nanosecond(tmp_path: Path) -> None:
    """Both ways of publishing (encoded and renamed in one native call, or renamed from Python)
    stamp the file's modification time with the moment of publication: a data server reports
    it to readers on other nodes, and the kernel's own stamps lag by up to a clock tick."""
    from instride.frames import frame_size, native_frame

    pool = SlotPool(tmp_path / "pool", recycle=True)
    pos = np.zeros((100, 3), dtype=np.float32)
    for i in range(6):
        slot = pool.take(frame_size(100, "xyz32"))
        os.write(slot.fd, b"x")  # (its times set now, by the kernel)
        time.sleep(0.02)
        before = time.time_ns()
        if i % 2:
            slot.mm[:] = b"x" * len(slot.mm)
            pool.publish(slot, str(tmp_path / f"k{i}"), f"k{i}", overwrite=False, fsync=False)
        else:
            frame = native_frame(pos, step=i, time=0.0, box=None, layout="xyz32", ids=None)
            assert frame is not None
            assert pool.write_and_publish(slot, frame, os.fsencode(tmp_path / f"k{i}"),
                                          overwrite=False, fsync=False)
        after = time.time_ns()
        assert before <= os.stat(tmp_path / f"k{i}").st_mtime_ns <= after, i
    pool.close()


def test_held_file_is_never_rewritten(tmp_path: Path) -> None:
    pool = SlotPool(tmp_path / "pool", recycle=True)
    leases = Leases()
    ino = _write(pool, tmp_path, "a", b"A" * 4096)
    got = leases.open(tmp_path / "a")
    assert got is not None
    view, release = got
    pool.retire(ino)
    other = _write(pool, tmp_path, "b", b"B" * 4096)
    assert other != ino  # the held file was skipped: a new one was made
    assert bytes(view) == b"A" * 4096
    del view
    release()
    third = _write(pool, tmp_path, "c", b"C" * 4096)  # released: now it may be reused
    assert third == ino
    pool.close()


def test_lease_refuses_a_retired_key(tmp_path: Path) -> None:
    pool = SlotPool(tmp_path / "pool", recycle=True)
    ino = _write(pool, tmp_path, "a", b"A" * 100)
    pool.retire(ino)
    assert Leases().open(tmp_path / "a") is None
    assert Leases().open(tmp_path / "missing") is None
    os.symlink(tmp_path / "pool", tmp_path / "link")
    with pytest.raises(UnsafePathError, match="symbolic link"):  # never followed
        Leases().open(tmp_path / "link")
    with pytest.raises(FileTypeError, match="regular file") as info:
        Leases().open(tmp_path / "pool")
    assert info.value.errno == errno.EISDIR
    pool.close()


def test_lease_with_a_confined_opener_refuses_a_linked_directory(tmp_path: Path) -> None:
    from instride.paths import ConfinedOpener

    root = tmp_path / "root"
    (root / "real").mkdir(parents=True)
    (root / "real" / "f").write_bytes(b"x" * 10)
    os.symlink(root / "real", root / "linked")
    opener = ConfinedOpener(root)
    buf, release = Leases().open(root / "real" / "f", lambda: opener.open("real/f"))
    assert bytes(buf) == b"x" * 10
    release()
    with pytest.raises(UnsafePathError, match="'linked' is a symbolic link"):
        Leases().open(root / "linked" / "f", lambda: opener.open("linked/f"))
    assert Leases().open(root / "real" / "g", lambda: opener.open("real/g")) is None
    opener.close()


def test_killed_producer_leaves_nothing_published_and_its_pool_is_reclaimed(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import os, sys
        from pathlib import Path
        from instride.store.ring import SlotPool
        pool = SlotPool(Path({str(tmp_path / "pool")!r}), recycle=True)
        slot = pool.take(1 << 20)
        slot.mm[:4] = b"half"
        print("writing", flush=True)
        sys.stdin.read()
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"writing"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    left = sorted(os.listdir(tmp_path / "pool"))  # its unfinished frame and its alive file
    assert len(left) == 2 and left[0].startswith("alive-") and not (tmp_path / "a").exists()
    removed = collect_pool(tmp_path / "pool")
    assert sorted(p.name for p in removed) == left
    assert os.listdir(tmp_path / "pool") == []


LIVE_PRODUCER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from instride.store.ring import SlotPool
    pool = SlotPool(Path(sys.argv[1]), recycle=True)
    slot = pool.take(1 << 16)
    print(slot.path, flush=True)
    sys.stdin.read()
    pool.close()
    """
)
COLLECT = "import sys; from pathlib import Path; from instride.store.ring import collect_pool; " \
    "print(len(collect_pool(Path(sys.argv[1]))))"


def test_a_collector_in_another_pid_namespace_leaves_a_running_producers_pool(
    tmp_path: Path
) -> None:
    # a producer's pool judged by the lock of its alive file, not by its process id: a
    # collector in a new PID namespace (where the producer's id names nothing, or another
    # process) leaves the running producer's files; once the producer is killed, it
    # collects them
    unshare = shutil.which("unshare")
    assert unshare is not None, "util-linux's unshare is needed (apt-get install util-linux)"
    assert os.geteuid() == 0, "a new PID namespace needs root"
    pool = tmp_path / "pool"
    proc = subprocess.Popen([sys.executable, "-c", LIVE_PRODUCER, str(pool)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        slot = Path(proc.stdout.readline().strip())
        assert slot.exists() and str(proc.pid) in slot.name
        inside = [unshare, "--pid", "--fork", sys.executable, "-c", COLLECT, str(pool)]
        assert subprocess.run(inside, capture_output=True, text=True, check=True).stdout.strip() == "0"
        assert slot.exists()
        # (and none outside it either: the lock, not the id, tells)
        assert collect_pool(pool) == [] and slot.exists()
        proc.kill()
        proc.wait(timeout=30)
        out = subprocess.run(inside, capture_output=True, text=True, check=True).stdout.strip()
        assert out == "2" and os.listdir(pool) == []  # its frame file and its alive file
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


FORKING_PRODUCER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from instride.store.ring import SlotPool
    pool = SlotPool(Path(sys.argv[1]), recycle=True)
    pool.take(1 << 16)
    if os.fork() == 0:  # a child that outlives its producer (no exec)
        os.write(1, b"child\\n")  # (it has let go: instride's at-fork handler ran; one write)
        time.sleep(60)
        os._exit(0)
    os.write(1, b"ready\\n")
    sys.stdin.read()
    """
)


def test_a_forked_child_does_not_keep_a_dead_producers_pool(tmp_path: Path) -> None:
    # the alive file's lock belongs to the open file, which a forked child shares: the child
    # lets go of it, so the producer's files are collected once the producer is gone, while
    # the child still runs
    pool = tmp_path / "pool"
    proc = subprocess.Popen([sys.executable, "-c", FORKING_PRODUCER, str(pool)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        # both: the producer ready, its child past the fork (on a loaded machine the child may
        # not have run at all yet when the producer is killed, and then still holds the lock)
        assert sorted(proc.stdout.readline().strip() for _ in range(2)) == ["child", "ready"]
        assert collect_pool(pool) == []  # (running)
        proc.kill()
        proc.wait(timeout=30)
        assert len(collect_pool(pool)) == 2 and os.listdir(pool) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # (the child too)
        proc.wait()


def test_pool_files_of_an_older_version_are_judged_by_their_process_id(tmp_path: Path) -> None:
    # files named by a bare process id (an older instride's producer): collected once no
    # process has that id, kept while one has
    pool = tmp_path / "pool"
    pool.mkdir()
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # (no process has it)
    (pool / f"slot-{dead}-1").write_bytes(b"x")
    (pool / f"slot-{os.getpid()}-1").write_bytes(b"y")
    assert [p.name for p in collect_pool(pool)] == [f"slot-{dead}-1"]
    assert os.listdir(pool) == [f"slot-{os.getpid()}-1"]


def _until(what: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, "not within 10 s"
        time.sleep(0.001)


def test_prepare_has_the_next_file_made_ahead_and_close_removes_it(tmp_path: Path) -> None:
    # made by a helper thread while the CPU is idle (instride.store.spare), its pages
    # allocated and without a name; mapped (and named, in the pool) by the next prepare,
    # taken by the frame after
    pool = SlotPool(tmp_path / "pool", recycle=False)
    pool.prepare(8192)
    _until(lambda: pool.spare_ready)
    assert _slots(tmp_path / "pool") == []  # made, nameless
    pool.prepare(8192)  # mapped now, named; the next one asked for
    [made] = _slots(tmp_path / "pool")
    st = os.stat(tmp_path / "pool" / made)
    assert st.st_size == 8192 and st.st_blocks * 512 >= 8192  # allocated, not sparse
    ino = _write(pool, tmp_path, "a", b"A" * 8192)
    assert ino == st.st_ino == os.stat(tmp_path / "a").st_ino
    assert _slots(tmp_path / "pool") == []  # it became frame "a"
    _until(lambda: pool.spare_ready)
    pool.prepare(8192)  # the next one mapped, a third asked for
    [made] = _slots(tmp_path / "pool")
    _until(lambda: pool.spare_ready)  # (the third made: a frame written would take it)
    ino_b = _write(pool, tmp_path, "b", b"B" * 1000)  # another size: a new file instead
    assert (tmp_path / "b").read_bytes() == b"B" * 1000
    assert ino_b != ino
    assert _slots(tmp_path / "pool") == []  # the mapped one of the wrong size deleted
    assert pool.spare_ready  # the one made is left to prepare(), which drops it (wrong size)
    pool.prepare(4096)  # nothing made to map; a 4096 one asked for
    assert not pool.spare_ready
    assert _slots(tmp_path / "pool") == []
    _until(lambda: pool.spare_ready)
    pool.prepare(4096)
    assert len(_slots(tmp_path / "pool")) == 1  # one mapped (and one made, nameless)
    pool.close()  # unused ones are deleted; published frames stay
    assert _slots(tmp_path / "pool") == []
    assert (tmp_path / "a").read_bytes() == b"A" * 8192


def _resident_kib(addr: int) -> int:
    """Rss of this process's mapping that starts at ``addr`` (its page-table entries present)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{addr:x}" or line.split("-", 1)[0] == f"{addr:08x}":
            return next(int(x.split()[1]) for x in lines[i + 1:] if x.startswith("Rss:"))
    raise AssertionError(f"no mapping at {addr:#x}")


def test_the_next_files_mapping_is_prefaulted_by_the_helper_not_by_prepare(
        tmp_path: Path) -> None:
    """prepare maps the file made ahead without filling its page tables (~70 µs for a JAC
    frame, right after a publication); the next helper fills them first, while the CPU is
    idle — the frame written into it afterwards is exact. A helper asked to prefault a mapping
    that goes first is settled (waited for or called off) before the unmap."""
    size = 64 * 4096
    pool = SlotPool(tmp_path / "pool", recycle=False)
    pool.prepare(size)
    _until(lambda: pool.spare_ready)
    pool.prepare(size)  # mapped now, unfilled; the helper asked to fill it
    mapped = pool._mapped
    assert mapped is not None and mapped.settle is not None  # (a helper prefaults it)
    _until(lambda: pool._spare.populated)
    assert _resident_kib(mapped.addr) == size // 1024  # every page table entry there
    ino = _write(pool, tmp_path, "a", b"P" * size)
    assert ino == mapped.ino and (tmp_path / "a").read_bytes() == b"P" * size
    for i in range(30):  # closed or unmapped at once, prefault under way or not
        _until(lambda: pool.spare_ready)
        pool.prepare(size)
        _write(pool, tmp_path, f"f{i}", bytes([i]) * size)
        assert (tmp_path / f"f{i}").read_bytes() == bytes([i]) * size
    pool.prepare(size)
    pool.close()
    _until(lambda: _slots(tmp_path / "pool") == [])


def test_a_frame_does_not_wait_for_its_file_to_be_made_and_a_dropped_one_is_deleted(
        tmp_path: Path) -> None:
    # the next append never waits for the helper: a file not made yet is made the usual way;
    # the pool closed while the helper is at work: the helper deletes its file when done
    pool = SlotPool(tmp_path / "pool", recycle=False)
    for i in range(50):
        pool.prepare(1 << 20)
        _write(pool, tmp_path, f"f{i}", bytes([i]) * (1 << 20))  # taken at once, ready or not
        assert (tmp_path / f"f{i}").read_bytes() == bytes([i]) * (1 << 20)
    pool.prepare(1 << 20)
    pool.close()
    _until(lambda: _slots(tmp_path / "pool") == [])
    assert len(list(tmp_path.glob("f*"))) == 50


def test_prepare_locks_a_retired_file_for_the_next_frame_unless_a_reader_holds_it(
    tmp_path: Path,
) -> None:
    # between frames a recycling pool locks the file the next take will reuse (no flock then);
    # a file a reader still holds is left alone, and the frame gets another file
    pool = SlotPool(tmp_path / "pool", recycle=True)
    leases = Leases()
    first = _write(pool, tmp_path, "a", b"A" * 4096)
    pool.retire(first)
    pool.prepare(4096)
    pooled = tmp_path / "pool" / _slots(tmp_path / "pool")[0]
    fd = os.open(pooled, os.O_RDONLY)
    try:  # locked ahead: a reader that opened it under its old key could not hold it now
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    assert _write(pool, tmp_path, "b", b"B" * 4096) == first  # the locked file, reused
    # a reader holds the frame when it is retired: prepare leaves its file alone
    got = leases.open(tmp_path / "b")
    assert got is not None
    view, release = got
    pool.retire(first)
    pool.prepare(4096)
    second = _write(pool, tmp_path, "c", b"C" * 4096)
    assert second != first and bytes(view) == b"B" * 4096
    del view
    release()
    pool.retire(second)
    pool.prepare(4096)  # (the longest-retired file, released meanwhile, goes first)
    assert _write(pool, tmp_path, "d", b"D" * 4096) == first
    leases.close()
    pool.close()
    assert _slots(tmp_path / "pool") == []


def test_recycling_pool_makes_no_spare(tmp_path: Path) -> None:
    pool = SlotPool(tmp_path / "pool", recycle=True)
    pool.prepare(4096)
    assert _slots(tmp_path / "pool") == []
    pool.close()


def _managed(tmp_path: Path) -> tuple[Path, SlotPool, Any, Leases]:
    """A managed directory with a stream directory ``s``, a recycling pool beneath it, its
    confined opener and a reader's leases keeping 4 mappings."""
    from instride.paths import ConfinedOpener

    root = tmp_path / "root"
    (root / "s").mkdir(parents=True)
    opener = ConfinedOpener(root)
    return root, SlotPool(root / ".pool", recycle=True), opener, Leases(4, opener)


def test_a_lease_by_key_in_one_native_call_gives_what_open_gives(tmp_path: Path) -> None:
    # Leases.open_key (isl_lease: openat2 beneath the managed directory, shared lock, the key
    # checked to still name the file) against every case open() knows
    root, pool, opener, leases = _managed(tmp_path)
    ino = _write(pool, root / "s", "a", b"A" * 4096)
    buf, release = leases.open_key("s/a", f"{root}/s/a")
    assert bytes(buf) == b"A" * 4096
    with pytest.raises(BlockingIOError):  # held: the producer cannot rewrite it
        fcntl.flock(os.open(root / "s" / "a", os.O_RDONLY), fcntl.LOCK_EX | fcntl.LOCK_NB)
    del buf
    release()
    again, release = leases.open_key("s/a", f"{root}/s/a")  # the same mapping, kept by inode
    del again
    release()
    assert leases.open_key("s/missing", f"{root}/s/missing") is None
    slot = pool._slots[ino]
    fcntl.flock(slot.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # being rewritten: not held, no error
    assert leases.open_key("s/a", f"{root}/s/a") is None
    fcntl.flock(slot.fd, fcntl.LOCK_UN)
    pool.retire(ino)
    assert leases.open_key("s/a", f"{root}/s/a") is None  # retired: the key is gone
    os.symlink(root / "s", root / "linked")
    with pytest.raises(UnsafePathError, match="symbolic link"):
        leases.open_key("linked/b", f"{root}/linked/b")
    (root / "s" / "d").mkdir()
    with pytest.raises(FileTypeError, match="regular file"):
        leases.open_key("s/d", f"{root}/s/d")
    (root / "s" / "empty").write_bytes(b"")
    got = leases.open_key("s/empty", f"{root}/s/empty")
    assert got is not None and got[0] == b""
    leases.close()
    opener.close()
    pool.close()


def test_the_one_call_publish_refuses_an_existing_key_and_keeps_nothing(tmp_path: Path) -> None:
    import numpy as np

    from instride.errors import KeyExistsError
    from instride.frames import decode_frame, frame_size, native_frame

    pool = SlotPool(tmp_path / "pool", recycle=True)
    pos = np.random.default_rng(1).random((100, 3))
    frame = native_frame(pos, step=4, time=0.5, box=None, layout="paper-soa", ids=None)
    assert frame is not None
    slot = pool.take(frame_size(100, "paper-soa"))
    assert pool.write_and_publish(slot, frame, os.fsencode(tmp_path / "f0"), overwrite=False,
                                  fsync=False)
    got = decode_frame((tmp_path / "f0").read_bytes(), "f0")
    assert got.step == 4 and np.array_equal(got.positions, pos)
    # an existing key: encoded, not published; publish() then names the error and discards
    slot = pool.take(frame_size(100, "paper-soa"))
    assert not pool.write_and_publish(slot, frame, os.fsencode(tmp_path / "f0"),
                                      overwrite=False, fsync=False)
    assert slot.pooled and os.path.exists(slot.path)
    with pytest.raises(KeyExistsError):
        pool.publish(slot, str(tmp_path / "f0"), "f0", overwrite=False, fsync=False)
    assert pool.files == 1  # the unpublished slot is gone, its file deleted
    assert _slots(tmp_path / "pool") == []
    # a missing directory: not published by the one call; publish() makes it
    slot = pool.take(frame_size(100, "paper-soa"))
    final = tmp_path / "new" / "f1"
    if not pool.write_and_publish(slot, frame, os.fsencode(final), overwrite=False, fsync=True):
        pool.publish(slot, str(final), "new/f1", overwrite=False, fsync=True)
    assert decode_frame((tmp_path / "new" / "f1").read_bytes(), "f1").step == 4
    pool.close()


def test_a_frame_published_in_one_call_carries_its_record_checksum(tmp_path: Path) -> None:
    """write_and_publish (isl_append): the frame published in one call; the checksum a cluster
    record of it carries is its own header checksum, read from the producer's mapping (no
    pass over the frame): it verifies the published file, header and payload, as a consumer
    on another node checks it. An existing key: nothing published, False (the caller's slow
    path names the error)."""
    import xxhash

    from instride.errors import IntegrityError
    from instride.frames import HEADER_SIZE, frame_size, header_checksum, native_frame
    from instride.record import Record, frame_checksum

    pool = SlotPool(tmp_path / "pool", recycle=True)
    rng = np.random.default_rng(7)
    for i, (layout, n) in enumerate([("paper", 23_558), ("paper-soa", 1_000), ("xyz32", 3),
                                     ("paper", 0)]):
        pos = rng.random((n, 3)).astype(np.float32 if layout == "xyz32" else np.float64)
        frame = native_frame(pos, step=i, time=0.5, box=None, layout=layout, ids=None)
        assert frame is not None
        slot = pool.take(frame_size(n, layout))
        final = tmp_path / f"f{i}"
        assert pool.write_and_publish(slot, frame, os.fsencode(final), overwrite=False, fsync=False)
        assert not slot.pooled and slot.path == str(final)
        data = final.read_bytes()
        rec = Record(f"s/f{i}", "o:1", len(data), frame_checksum(header_checksum(slot.mm)), 1, 0.0)
        rec.verify(xxhash.xxh3_64_hexdigest(data[HEADER_SIZE:]), len(data), data)
        for where in [8] + ([len(data) - 1] if n else []):  # a header field, the last byte
            bad = bytearray(data)
            bad[where] ^= 1
            with pytest.raises(IntegrityError):
                rec.verify(xxhash.xxh3_64_hexdigest(bad[HEADER_SIZE:]), len(bad), bad)
    slot = pool.take(frame_size(3, "xyz32"))
    frame = native_frame(np.ones((3, 3), np.float32), step=9, time=0.0, box=None,
                         layout="xyz32", ids=None)
    assert frame is not None
    assert not pool.write_and_publish(slot, frame, os.fsencode(tmp_path / "f2"), overwrite=False,
                                      fsync=False)
    assert slot.pooled and (tmp_path / "f2").read_bytes() != bytes(slot.mm)
    pool.discard(slot)
    pool.close()


def _published_frame(pool: SlotPool, root: Path, key: str, pos: Any, step: int) -> int:
    """Encode and publish a paper-soa frame of ``pos`` under ``root/key``; its inode."""
    from instride.frames import frame_size, native_frame

    frame = native_frame(pos, step=step, time=0.25, box=np.eye(3) * 7, layout="paper-soa",
                         ids=None)
    assert frame is not None
    slot = pool.take(frame_size(len(pos), "paper-soa"))
    assert pool.write_and_publish(slot, frame, os.fsencode(root / key), overwrite=False,
                                  fsync=False)
    return slot.ino


def test_the_native_take_holds_checks_or_copies_a_frame_in_one_call(tmp_path: Path) -> None:
    # Leases.take (isl_take): the wait, the lease, the frame's checks in the kept mapping,
    # and for a copying reader the copy into its arrays; every other case goes back to Python
    import ctypes
    import threading

    from instride.frames import checked_header, frame_arrays, frame_views
    from instride.store.ring import TAKE_OTHER, TAKE_TIMEOUT, Taken
    from instride.store.wait import armed

    root, pool, opener, leases = _managed(tmp_path)
    ifd = armed(root / "s")
    assert ifd is not None
    keys = (ctypes.c_char_p * 2)(b"s/f0", b"s/end")
    pos = np.random.default_rng(2).random((300, 3))
    # nothing there: a timeout; published meanwhile (another thread): woken, held. (The
    # thread's inotify descriptor is shared with earlier tests: watches of their directories,
    # removed since, come back first as watch descriptors gone, as the reader's loop takes them)
    got = leases.take(ifd, keys, 0.05, (0.0, 0.0), True)
    while isinstance(got, list):
        got = leases.take(ifd, keys, 0.05, (0.0, 0.0), True)
    assert got == TAKE_TIMEOUT
    inos: list[int] = []
    # (published 0.5 s later: the take waits for it even on a loaded machine)
    later = threading.Timer(0.5, lambda: inos.append(_published_frame(pool, root, "s/f0", pos, 0)))
    later.start()
    got = leases.take(ifd, keys, 5.0, (0.0, 0.0), True)
    later.join()
    assert isinstance(got, Taken) and got.waited > 0 and not got.copied
    assert not got.checked  # a file never mapped before: the caller maps and decodes it
    got.release()
    # mapped now (kept by inode): checked in the call, the box written where asked
    box = np.zeros((3, 3))
    got = leases.take(ifd, keys, 1.0, (0.0, 0.0), True, None, box)
    assert isinstance(got, Taken) and got.checked and got.waited == 0.0
    assert np.array_equal(box, np.eye(3) * 7)
    frame = frame_views(got.buf, checked_header(got.buf, box), got.release)
    assert frame.step == 0 and frame.time == 0.25 and np.array_equal(frame.positions, pos)
    assert np.array_equal(frame.ids, np.arange(300))
    del frame
    got.release()
    # a copying reader: copied into its arrays, checked, released in the call
    into = frame_arrays("paper-soa", 300)
    got = leases.take(ifd, keys, 1.0, (0.0, 0.0), True, into, np.zeros((3, 3)))
    assert isinstance(got, Taken) and got.copied
    assert checked_header(got.buf, box).step == 0
    assert np.array_equal(into[0], pos) and np.array_equal(into[1], np.arange(300))
    pool.retire(inos[0])  # not held any more: the producer recycles it at once
    # arrays of another size: held instead (the caller decodes), nothing copied
    _published_frame(pool, root, "s/f0", pos[:200], 1)
    small = frame_arrays("paper-soa", 300)
    got = leases.take(ifd, keys, 1.0, (0.0, 0.0), True, small)
    assert isinstance(got, Taken) and not got.copied
    got.release()
    # a frame corrupted in its file: not checked (the caller's decode names it), not copied
    with open(root / "s" / "f0", "r+b") as fh:
        fh.seek(200)
        fh.write(b"\xff" * 8)
    for arrays in (None, frame_arrays("paper-soa", 200)):
        got = leases.take(ifd, keys, 1.0, (0.0, 0.0), True, arrays)
        assert isinstance(got, Taken) and not got.checked and not got.copied
        got.release()
    # without verification, only the header is checked
    got = leases.take(ifd, keys, 1.0, (0.0, 0.0), False)
    assert isinstance(got, Taken) and got.checked
    got.release()
    # the end marker there: nothing held, Python looks
    (root / "s" / "end").write_text("{}")
    assert leases.take(ifd, (ctypes.c_char_p * 2)(b"s/f9", b"s/end"), 1.0, (0.0, 0.0),
                       True) == TAKE_OTHER
    leases.close()
    opener.close()
    pool.close()


@pytest.mark.parametrize(("hard", "ok"), [(4096, True), (256, False)])
def test_a_long_ring_raises_the_soft_limit_of_open_files_or_says_why_it_cannot(
        managed_dir: Path, hard: int, ok: bool) -> None:
    """300 frames kept hold 600 descriptors: over a soft limit of 256 the producer raises it
    (within the hard limit) and goes on; where the hard limit is 256 too, a typed error names
    the limit and what to do."""
    proc = spawn_py(textwrap.dedent(f"""
        import resource
        import numpy as np
        import instride
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, {hard}))
        try:
            with instride.Stream("ring", mode="w", retain=300) as s:
                for i in range(300):
                    s.append(np.full((10, 3), float(i)), step=i)
        except instride.ConfigError as exc:
            print("refused:", exc)
        else:
            print("kept", len(instride.Stream("ring")), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    """))
    rc, out, err = finish(proc, timeout=120)
    assert rc == 0, err
    if ok:
        kept, soft = out.split()[1:]
        assert kept == "300" and 256 < int(soft) <= hard
    else:
        assert out.startswith("refused: bad setting RLIMIT_NOFILE=256: a stream's producer"
                              " holds 2 open files")
        assert "ulimit -Hn" in out


def test_a_new_file_of_a_pool_that_does_not_recycle_is_written_not_mapped(tmp_path: Path) -> None:
    """A frame file that was not made ahead (a producer flat out: the helper had no idle time)
    is written with write(2), never mapped (isl_append_fd): the frame published is exact in
    every layout, its header (kept in ``slot.head``) carries the record's checksum, and no
    mapping of it exists in the process. An existing key: written, not published (False);
    the slow path names the error and deletes the file."""
    import xxhash

    from instride.errors import KeyExistsError
    from instride.frames import HEADER_SIZE, decode_frame, frame_size, header_checksum, native_frame
    from instride.record import Record, frame_checksum

    pool = SlotPool(tmp_path / "pool", recycle=False)
    rng = np.random.default_rng(11)
    cases = [("paper", 23_558, None), ("paper-soa", 70_000, None), ("xyz32", 100_003, None),
             ("paper-soa", 1_000, np.arange(1_000, dtype=np.int32)[::-1].copy()),
             ("paper", 500, np.arange(7, 507, dtype=np.int32)), ("paper", 0, None)]
    for i, (layout, n, ids) in enumerate(cases):
        pos = rng.random((n, 3)).astype(np.float32 if layout == "xyz32" else np.float64)
        frame = native_frame(pos, step=i, time=0.25 * i, box=np.eye(3) * 9, layout=layout,
                             ids=ids)
        assert frame is not None
        slot = pool.take(frame_size(n, layout))
        assert slot.mm is None  # (a new file: written, not mapped)
        final = tmp_path / f"f{i}"
        assert pool.write_and_publish(slot, frame, os.fsencode(final), overwrite=False,
                                      fsync=i % 2 == 1)
        data = final.read_bytes()
        assert len(data) == frame_size(n, layout)
        got = decode_frame(data, final.name, copy=True)
        assert got.step == i and got.time == 0.25 * i and got.header.layout == layout
        assert np.array_equal(got.header.box, np.eye(3) * 9)
        assert np.array_equal(got.positions, pos)
        if layout != "xyz32":
            assert np.array_equal(got.ids, np.arange(n) if ids is None else ids)
        assert slot.head == data[:HEADER_SIZE]
        rec = Record(f"s/f{i}", "o:1", len(data), frame_checksum(header_checksum(slot.head)), 1,
                     0.0)
        rec.verify(xxhash.xxh3_64_hexdigest(data[HEADER_SIZE:]), len(data), data)
        assert str(final) not in Path("/proc/self/maps").read_text()
    pos = rng.random((10, 3))
    frame = native_frame(pos, step=1, time=0.0, box=None, layout="paper", ids=None)
    assert frame is not None
    slot = pool.take(frame_size(10, "paper"))
    assert not pool.write_and_publish(slot, frame, os.fsencode(tmp_path / "f0"), overwrite=False,
                                      fsync=False)
    with pytest.raises(KeyExistsError):
        pool.publish(slot, str(tmp_path / "f0"), "f0", overwrite=False, fsync=True)
    assert decode_frame((tmp_path / "f0").read_bytes(), "f0").step == 0  # (the first kept)
    assert _slots(tmp_path / "pool") == []
    pool.close()


def test_a_file_made_ahead_serves_a_written_frame_at_once(tmp_path: Path) -> None:
    """A file the helper made (allocated) while nothing was mapped for the next frame — a
    frame has gone by since it was asked for, and the prepare() after that one found it not
    made yet (a producer flat out) — is taken by the next frame at once, not mapped, and
    written in place: no second file is made. The frame right after the ask does not take
    it: that one is for prepare() to map (see the next test)."""
    from instride.frames import decode_frame, frame_size, native_frame

    size = frame_size(5_000, "paper")
    pool = SlotPool(tmp_path / "pool", recycle=False)
    pool.prepare(size)  # (nothing made yet: the helper asked for one)
    _until(lambda: pool.spare_ready)
    first = pool.take(size)  # (the frame right after the ask: a new file, written)
    assert first.mm is None and pool.spare_ready
    pool.discard(first)
    slot = pool.take(size)
    assert slot.mm is None and not pool.spare_ready  # the file made, taken unmapped
    st = os.fstat(slot.fd)
    assert st.st_size == size and st.st_blocks * 512 >= size  # (allocated ahead, in place)
    pos = np.random.default_rng(3).random((5_000, 3))
    frame = native_frame(pos, step=5, time=0.0, box=None, layout="paper", ids=None)
    assert frame is not None
    assert pool.write_and_publish(slot, frame, os.fsencode(tmp_path / "f"), overwrite=False,
                                  fsync=False)
    assert os.stat(tmp_path / "f").st_ino == st.st_ino
    got = decode_frame((tmp_path / "f").read_bytes(), "f")
    assert got.step == 5 and np.array_equal(got.positions, pos)
    assert _slots(tmp_path / "pool") == []
    pool.close()


def test_a_paced_producers_frames_go_into_mapped_prefaulted_files_made_ahead(
        tmp_path: Path) -> None:
    """Frames with idle time between them (a paced producer): after the first two, every
    frame is encoded straight into a mapping of a file made ahead, its page tables filled by
    the helper — none is written with ``write``. (A frame that took the file made right after
    the frame before would leave prepare() nothing to map, and so would every frame after it:
    all of a paced stream's frames went through ``write``.)"""
    from instride.frames import decode_frame, frame_size, native_frame

    size = frame_size(5_000, "paper")
    pos = np.random.default_rng(4).random((5_000, 3))
    pool = SlotPool(tmp_path / "pool", recycle=False)
    mapped = []
    for i in range(8):
        slot = pool.take(size)
        mapped.append(slot.mm is not None)
        frame = native_frame(pos + i, step=i, time=0.0, box=None, layout="paper", ids=None)
        assert frame is not None
        assert pool.write_and_publish(slot, frame, os.fsencode(tmp_path / f"f{i}"),
                                      overwrite=False, fsync=False)
        pool.prepare(size)
        _until(lambda: pool.spare_ready)  # (the pause between frames)
        if pool._mapped is not None and pool._mapped.settle is not None:
            _until(lambda: pool._spare.populated)
    assert mapped[2:] == [True] * 6, mapped
    for i in range(8):
        got = decode_frame((tmp_path / f"f{i}").read_bytes(), f"f{i}")
        assert got.step == i and np.array_equal(got.positions, pos + i)
    pool.close()


def test_a_failed_flush_lets_go_of_its_slot(tmp_path: Path) -> None:
    """``publish(..., fsync=True)`` whose flush fails (EIO, ENOSPC) left the slot taken and
    exclusively locked, with its descriptor and mapping, until the pool closed: one more per
    failed append. Its file goes now, as a failed write's."""
    pool = SlotPool(tmp_path / "pool", recycle=True)
    slot = pool.take(64)
    pool.mapping(slot)[:] = b"x" * 64

    class Failing:
        def flush(self) -> None:
            raise OSError(errno.EIO, "Input/output error")

        def close(self) -> None:
            pass

    real, slot.mm = slot.mm, Failing()  # type: ignore[assignment]
    try:
        with pytest.raises(OSError, match="Input/output"):
            pool.publish(slot, str(tmp_path / "k"), "k", overwrite=False, fsync=True)
        assert slot.ino not in pool._slots
        with pytest.raises(OSError):
            os.fstat(slot.fd)  # (closed)
        assert _slots(tmp_path / "pool") == [] and not (tmp_path / "k").exists()
    finally:
        assert real is not None
        real.close()
        pool.close()


def test_retiring_a_key_another_producer_published_since_leaves_its_file(tmp_path: Path) -> None:
    """A second producer (a re-run with overwrite=True while the first still ran) published its
    own file under a key of the first one's. The first one's retirement renamed that file into
    its pool — the second one's frame gone while its head said it was kept — and rewrote it
    later as one of its own frames, published under another key with wrong bytes."""
    pool = SlotPool(tmp_path / "pool", recycle=True)
    ino = _write(pool, tmp_path, "k", b"A" * 4096)
    theirs = tmp_path / ".theirs"
    theirs.write_bytes(b"B" * 4096)
    os.replace(theirs, tmp_path / "k")  # (the other producer's publication)
    pool.retire(ino)
    assert (tmp_path / "k").read_bytes() == b"B" * 4096  # theirs, where it was
    assert _slots(tmp_path / "pool") == [] and pool.files == 0  # ours let go of
    again = _write(pool, tmp_path, "m", b"C" * 4096)  # a new file of ours, not theirs
    assert again != os.stat(tmp_path / "k").st_ino
    assert (tmp_path / "k").read_bytes() == b"B" * 4096
    assert (tmp_path / "m").read_bytes() == b"C" * 4096
    pool.close()


STALE_VIEW = """
import mmap, os, sys
from pathlib import Path
from instride.store.ring import SlotPool
root = Path(sys.argv[1])
pool = SlotPool(root / "pool", recycle=True)
slot = pool.take(8192)
pool.mapping(slot)[:] = b"A" * 8192
pool.publish(slot, str(root / "a"), "a", overwrite=False, fsync=False)
fd = os.open(root / "a", os.O_RDONLY)
view = mmap.mmap(fd, 8192, prot=mmap.PROT_READ)  # (a reader's arrays, kept past release)
os.close(fd)
pool.retire(slot.ino)
smaller = pool.take(4096)  # (the next frames are smaller)
pool.mapping(smaller)[:] = b"B" * 4096
pool.publish(smaller, str(root / "b"), "b", overwrite=False, fsync=False)
print(view[8000:8001].decode(), flush=True)  # (past the smaller frame's end)
"""


def test_a_file_is_never_shrunk_under_a_stale_view(tmp_path: Path) -> None:
    """A recycled frame file was cut (ftruncate) to the next, smaller frame: a reader that
    kept the arrays of a frame it had released from it still mapped the old length, and
    touching a page past the new end killed it with SIGBUS. The file goes instead."""
    proc = subprocess.Popen([sys.executable, "-c", STALE_VIEW, str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    rc, out, err = finish(proc, 60)
    assert rc == 0, f"status {rc}: {err}"
    assert out.strip() == "A"


LAYOUT_MIX = """
import ctypes, mmap, os, sys
import numpy as np
from instride.frames import frame_arrays, write_frame
from instride.native import library
from instride.store.ring import TAKE_COPIED, TAKE_HELD
lib, n, d = library(), 1000, sys.argv[3]
write_frame(os.path.join(d, "f.isf"), np.ones((n, 3)), layout=sys.argv[1])
fd = os.open(os.path.join(d, "f.isf"), os.O_RDONLY)
st = os.fstat(fd)
mm = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)  # (the reader's kept mapping of the file)
table = (ctypes.c_int64 * 4)(st.st_dev, st.st_ino, st.st_size,
                             np.frombuffer(mm, np.uint8).__array_interface__["data"][0])
pos, ids = frame_arrays(sys.argv[2], n)  # (the reader's arrays: of the last frame's layout)
out, gone, gone_n = (ctypes.c_int64 * 22)(), (ctypes.c_int * 4)(), ctypes.c_int()
dirfd = os.open(d, os.O_RDONLY)
rc = lib.isl_take(-1, dirfd, (ctypes.c_char_p * 1)(b"f.isf"), 1, 0, 0, 0, table, 1, 1,
                  pos.__array_interface__["data"][0],
                  None if ids is None else ids.__array_interface__["data"][0], n, None,
                  gone, 4, ctypes.byref(gone_n), out)
print({TAKE_COPIED: "copied", TAKE_HELD: "held"}.get(rc, rc))
"""


@pytest.mark.parametrize(("frame", "arrays", "taken"), [
    ("paper", "xyz32", "held"), ("xyz32", "paper", "held"), ("paper-soa", "paper", "copied")])
def test_a_frame_is_copied_only_into_arrays_of_its_types(tmp_path: Path, frame: str, arrays: str,
                                                         taken: str) -> None:
    """The native take copied a kept file's frame into the reader's arrays when its atom
    count matched, whatever its layout: a paper frame into xyz32 arrays wrote ids through a
    NULL pointer and 24 bytes per atom into a 12-byte-per-atom array (SIGSEGV), an xyz32
    frame into paper arrays gave float64 positions of float32 bytes, checked. A frame of
    the other kind is held now (decoded by the caller); the paper layouts share their types."""
    proc = subprocess.Popen([sys.executable, "-c", LAYOUT_MIX, frame, arrays, str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    rc, out, err = finish(proc, 60)
    assert rc == 0, f"status {rc}: {err[-2000:]}"
    assert out.strip() == taken


_MANY_FRAMES = textwrap.dedent(
    """
    import os, resource, sys, numpy as np, instride
    soft, hard = int(sys.argv[1]), int(sys.argv[2])
    with instride.Stream("many", mode="w", retain=150, on_full="drop-oldest") as w:
        for i in range(150):
            w.append(np.full((4, 3), i, np.float32), step=i)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    r = instride.Stream("many", timeout=2)
    try:
        print(sum(1 for _ in r))
    except instride.InstrideError as exc:
        print(type(exc).__name__, exc)
    """
)


@pytest.mark.parametrize("hard", [4096, 64])
def test_a_reader_keeping_many_frames_raises_its_limit_of_open_files(
        managed_dir: Path, hard: int) -> None:
    """A reader of a stream with a large ``retain`` keeps a mapping, an open file, per frame
    file (up to retain + 8): under a soft limit below that it **failed with a bare
    ``OSError(EMFILE)``** partway through. It raises its soft limit, as the producer does, and
    where the hard limit allows no more it is a ``ConfigError`` naming ``RLIMIT_NOFILE``."""
    rc, out, err = finish(subprocess.Popen(
        [sys.executable, "-c", _MANY_FRAMES, "64", str(hard)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    assert rc == 0, err
    if hard > 64:
        assert out.strip() == "150"
    else:
        assert out.startswith("ConfigError") and "RLIMIT_NOFILE" in out, out


def test_an_alive_file_left_aside_by_a_killed_producer_is_collected(tmp_path: Path) -> None:
    """A producer killed between making its alive file aside (``.alive-<owner>``) and renaming
    it left that file in the pool **for good**: neither gc nor a later producer removed it.
    Removed once unlocked and a minute old; a fresh one (a producer making it now) and a
    locked one stay."""
    pool = tmp_path / "pool"
    pool.mkdir()
    old, fresh, locked = (pool / f".alive-{n}" for n in ("dead", "new", "held"))
    for path in (old, fresh, locked):
        path.touch()
    for path in (old, locked):
        os.utime(path, (time.time() - 120, time.time() - 120))
    fd = os.open(locked, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert collect_pool(pool) == [old]
    finally:
        os.close(fd)
    assert sorted(p.name for p in pool.iterdir()) == [".alive-held", ".alive-new"]


def test_a_forked_child_does_not_keep_a_frame_its_parent_released(managed_dir: Path) -> None:
    """A reader holding a frame forks a child (a ``multiprocessing`` worker), then releases
    the frame: the child's inherited descriptor **kept the file's lock**, so its producer
    could not reuse the file while the child lived (a new file made for every pinned one).
    The child closes its copies at the fork: the parent's release lets the file go."""
    import instride
    from instride.store.gc import lock_held

    with instride.Stream("pin", mode="w", retain=4, on_full="drop-oldest") as w:
        for i in range(3):
            w.append(np.full((10, 3), i, np.float32), step=i)
    r = instride.Stream("pin", timeout=5)
    frame = r.read(2)
    path = managed_dir / "pin" / "frame_000000002.isf"
    assert lock_held(path, exclusive=True) is True
    up, down = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(down, b"1")  # (started: its fork handlers have run)
        time.sleep(5)
        os._exit(0)
    try:
        assert os.read(up, 1) == b"1"
        assert lock_held(path, exclusive=True) is True  # (the parent's hold)
        frame.release()
        assert lock_held(path, exclusive=True) is False
    finally:
        os.close(up)
        os.close(down)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        r.close()


_END_IN_BATCH = textwrap.dedent(
    """
    import ctypes, sys, time
    from pathlib import Path
    from instride.paths import ConfinedOpener
    from instride.store.ring import Leases
    from instride.store.wait import armed
    root = Path(sys.argv[1])
    leases = Leases(4, ConfinedOpener(root))
    ifd = armed(root / "b")  # (this thread reads stream b too: its watch stays)
    assert armed(root / "a") == ifd
    keys = (ctypes.c_char_p * 2)(b"a/frame_000000000.isf", b"a/end")
    print("ready", flush=True)
    start = time.monotonic()
    got = leases.take(ifd, keys, 12.0, (0.0, 0.0), True)
    print(got, time.monotonic() - start, flush=True)
    """
)


def test_the_native_take_sees_an_end_marker_named_with_a_frame_of_another_stream(
        tmp_path: Path) -> None:
    """A reader thread of two streams (one inotify descriptor, both directories watched)
    waits for stream a's frame 0; stream b publishes its own frame 0 (the same file name)
    and stream a its end marker, read by the native take in one batch of events. The take
    looked at the lowest key the batch named (the frame's name, b's file: a's frame not
    there) and **dropped the end marker's event**: it slept until its timeout (a reader's
    slice: the end seen up to 0.5 s late). A miss like this looks at the other keys now."""
    from instride.store.ring import TAKE_OTHER

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _END_IN_BATCH, str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 20  # (asleep in the take's poll: both events after it)
        while "poll" not in Path(f"/proc/{proc.pid}/wchan").read_text():
            assert time.monotonic() < deadline, "the take never went to sleep"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGSTOP)  # (so that both events are read in one batch)
        while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.01)
        for name, data in (("b/frame_000000000.isf", b"b0"), ("a/end", b"{}")):
            tmp = tmp_path / f"{name}.tmp"
            tmp.write_bytes(data)
            os.rename(tmp, tmp_path / name)  # (published as keys are: a rename)
        os.kill(proc.pid, signal.SIGCONT)
        rc, out, err = finish(proc, 60)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert rc == 0, err
    got, took = out.split()
    assert int(got) == TAKE_OTHER and float(took) < 6, out


def test_the_one_call_publish_of_an_unknown_layout_publishes_nothing(tmp_path: Path) -> None:
    """isl_append answered an unknown layout code with -EINVAL, nothing written: a negative
    answer is "encoded, the rename failed" to its caller, whose slow path then publishes the
    slot — a recycled file, still holding an older frame that passes every check, under the
    new key. (Only this module's own NativeFrame reaches the call, with a known code; the
    contract is isl_append_fd's now: a positive errno, the slot dropped, nothing published.)"""
    import ctypes

    from instride.frames import NativeFrame, decode_frame, frame_size

    root, pool, opener, leases = _managed(tmp_path)
    pos = np.ones((10, 3))
    ino = _published_frame(pool, root, "s/f0", pos, 0)
    pool.retire(ino)
    slot = pool.take(frame_size(10, "paper-soa"))
    assert slot.ino == ino  # (recycled: frame 0's bytes are in it)
    good = NativeFrame((3, 10, pos.ctypes.data, None, 1, 0.0, (ctypes.c_double * 9)()), (pos,))
    bad = NativeFrame((9, *good.args[1:]), good.keep)
    final = root / "s" / "f1"
    try:
        published = pool.write_and_publish(slot, bad, os.fsencode(final), overwrite=False,
                                           fsync=False)
        if not published:  # (what the stream's producer does then)
            pool.publish(slot, str(final), "s/f1", overwrite=False, fsync=False)
    except OSError as exc:
        assert exc.errno == errno.EINVAL
    assert not final.exists(), f"published: step {decode_frame(final.read_bytes()).step}"
    leases.close()
    opener.close()
    pool.close()


@pytest.mark.parametrize("way", ["take", "open"])
def test_a_child_forked_while_a_thread_takes_a_frame_does_not_keep_it(tmp_path: Path,
                                                                      way: str) -> None:
    """A thread takes a frame (the native take, or the portable open: the file opened and
    locked, its hold not recorded yet) while another forks (a ``multiprocessing`` worker): the
    child **kept its copy of that descriptor, so the lock**, and the producer could not reuse
    the file while the child lived, though the parent had released it. The window (microseconds)
    is widened here: the taking thread stops in the mapping of the file until 0.5 s later."""
    import ctypes
    import threading

    from instride.store.gc import lock_held
    from instride.store.ring import Taken
    from instride.store.wait import armed

    root, pool, opener, leases = _managed(tmp_path)
    _published_frame(pool, root, "s/f0", np.zeros((100, 3)), 0)
    path = root / "s" / "f0"
    inside, go = threading.Event(), threading.Event()
    mapping = leases._map

    def slow_map(*args: Any) -> Any:  # (the thread is between its lock and its record)
        inside.set()
        go.wait(30)
        return mapping(*args)

    leases._map = slow_map  # type: ignore[method-assign]
    got: list[Any] = []

    def take() -> None:
        if way == "take":
            ifd = armed(root / "s")
            keys = (ctypes.c_char_p * 1)(b"s/f0")
            got.append(leases.take(ifd, keys, 5.0, (0.0, 0.0), True))
        else:
            got.append(leases.open(str(path), lambda: opener.open("s/f0")))

    taker = threading.Thread(target=take)
    taker.start()
    assert inside.wait(30)
    threading.Timer(0.5, go.set).start()
    up, down = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(down, b"1")  # (started: its fork handlers have run)
        time.sleep(20)
        os._exit(0)
    try:
        assert os.read(up, 1) == b"1"
        taker.join(30)
        [held] = got
        release = held.release if isinstance(held, Taken) else held[1]
        assert lock_held(path, exclusive=True) is True  # (the parent's hold)
        release()
        assert lock_held(path, exclusive=True) is False  # the child keeps nothing
    finally:
        go.set()
        os.close(up)
        os.close(down)
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        leases.close()
        opener.close()
        pool.close()


def test_children_forked_while_a_thread_leases_frames_in_a_loop_keep_no_lock(
        tmp_path: Path) -> None:
    """The same, unwidened: a thread leases a frame by key and releases it, over and over
    (``isl_lease``), while the main thread forks 100 children, each of which looks for a lock
    of that file among its descriptors (``/proc/self/fdinfo``). Before, about two children in
    three held one."""
    import threading

    root, pool, opener, leases = _managed(tmp_path)
    _published_frame(pool, root, "s/f0", np.zeros((100, 3)), 0)
    st = os.stat(root / "s" / "f0")
    mine = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} "
    stop = threading.Event()

    def lease() -> None:
        while not stop.is_set():
            got = leases.open_key("s/f0", f"{root}/s/f0")
            assert got is not None
            got[1]()

    leasing = threading.Thread(target=lease)
    leasing.start()
    holding = 0
    try:
        for _ in range(100):
            up, down = os.pipe()
            child = os.fork()
            if child == 0:
                locks = 0
                for fd in os.listdir("/proc/self/fd"):
                    with contextlib.suppress(OSError), open(f"/proc/self/fdinfo/{fd}") as fh:
                        locks += any(mine in line and "FLOCK" in line for line in fh)
                os.write(down, b"1" if locks else b"0")
                os._exit(0)
            os.close(down)
            try:
                holding += os.read(up, 1) == b"1"
            finally:
                os.close(up)
                os.waitpid(child, 0)
    finally:
        stop.set()
        leasing.join(30)
        leases.close()
        opener.close()
        pool.close()
    assert holding == 0


_FORK_DURING_A_HUNG_LEASE = r'''
import ctypes, os, sys, threading, time
from pause_openat2 import pause_openat2
from instride import native

lib = native.library()
root = sys.argv[1] + "/m"
os.mkdir(root)
with open(f"{root}/k", "wb") as fh:
    fh.write(b"frame")
dirfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
paused = threading.Event()


def on_call(n):
    paused.set()
    return False  # (never let go: a hard-mounted file system that does not answer)


def lease():
    pause_openat2(on_call)  # (this thread's calls only)
    lib.isl_lease(dirfd, b"k", (ctypes.c_int64 * 4)())


threading.Thread(target=lease, daemon=True).start()
assert paused.wait(60)
for _ in range(2):
    began = time.monotonic()
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    print(round(time.monotonic() - began, 1), flush=True)
os._exit(0)  # (the lease stays in the kernel: the process ends it)
'''


def test_a_fork_waits_a_bounded_time_for_a_lease_stuck_in_the_file_system(
        tmp_path: Path) -> None:
    """A fork waits for the native leases under way (``isl_lease`` holds the fork guard shared
    from its open until its descriptor is handed over), so that no child inherits a lease's
    descriptor and lock. Its wait had no bound: a lease in an open that hangs (a hard-mounted
    NFS or Lustre directory whose server does not answer) made every ``fork()`` --
    multiprocessing's, subprocess's -- wait as long, the forking thread holding the GIL. It
    waits 5 s at most now, as the Python half of the guard (``ring._FORK_WAIT``), then forks.
    The open here waits in the kernel for good (a seccomp user notification never answered);
    two forks follow."""
    from tests.test_paths import _PAUSE_OPENAT2, SECCOMP_HOLD_DIR

    (tmp_path / "pause_openat2.py").write_text(_PAUSE_OPENAT2)
    (tmp_path / "script.py").write_text(_FORK_DURING_A_HUNG_LEASE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path), str(SECCOMP_HOLD_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]))
    try:
        proc = subprocess.run([sys.executable, str(tmp_path / "script.py"), str(tmp_path)],
                              env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("a fork waited over a minute for a lease stuck in an open")
    if proc.returncode == 77:
        pytest.fail("seccomp user notifications are not available here (needed to hold an "
                    "openat2 in the kernel)")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    waits = [float(w) for w in proc.stdout.split()]
    assert len(waits) == 2 and all(w < 20 for w in waits), waits


def test_a_fork_is_not_held_off_by_threads_opening_frames_back_to_back(tmp_path: Path) -> None:
    """A fork waits for the portable path's opens under way (their holds not recorded yet);
    with threads opening frames one after the other there was always one under way, and
    every fork (a ``multiprocessing`` worker's start) waited the whole bound, 5 s, then went
    on inside the very window it waited for. Opens that begin once a fork waits wait for it."""
    import threading
    import time

    from instride.store.ring import _FORK_WAIT, Leases

    path = tmp_path / "frame"
    path.write_bytes(b"x" * 4096)
    stop = threading.Event()

    def reader() -> None:
        leases = Leases()
        while not stop.is_set():
            got = leases.open(path)
            if got is not None:
                got[1]()

    threads = [threading.Thread(target=reader) for _ in range(12)]
    for th in threads:
        th.start()
    took = []
    try:
        time.sleep(0.3)
        for _ in range(3):
            t0 = time.monotonic()
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            took.append(time.monotonic() - t0)
            os.waitpid(pid, 0)
    finally:
        stop.set()
        for th in threads:
            th.join(30)
    assert max(took) < _FORK_WAIT * 0.8, took  # (the bound is what it waited before)


_TWO_FORKS = r'''
import os, sys, threading, time
import concurrent.futures.thread  # (its own fork lock: registered first, taken last)
delay = {}


def other_library_hook():  # registered first: runs after instride's before-fork hook
    d = delay.get(threading.get_ident())
    if d:
        time.sleep(d)


os.register_at_fork(before=other_library_hook)
from instride.store import ring  # noqa: E402

path = sys.argv[1]
inherited = []


def second_forker():
    delay[threading.get_ident()] = 1.0  # (past instride's hook, not forked yet, for 1 s)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        held = [f for f in os.listdir("/proc/self/fd")
                if os.path.realpath(f"/proc/self/fd/{f}") == os.path.realpath(path)]
        os.write(w, repr(held).encode())
        os._exit(0)
    os.close(w)
    inherited.append(os.read(r, 1000).decode())
    os.waitpid(pid, 0)


def slow_opener():
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    time.sleep(1.5)  # (an open under way: a slow file system)
    return fd


def reader():
    got = ring.Leases().open(path, slow_opener)
    if got is not None:
        got[1]()


second = threading.Thread(target=second_forker)
second.start()
time.sleep(0.1)
pid = os.fork()  # the first fork (this thread), done at once, while the second waits
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
time.sleep(0.1)
r = threading.Thread(target=reader)
r.start()
second.join()
r.join()
print(inherited[0])
'''


def test_two_forks_at_once_each_hold_off_the_opens(tmp_path: Path) -> None:
    """Two threads forking at once: the first one's end cleared the one flag that held new
    opens off while the second had passed the hook and not forked yet — an open that began
    then was under way at the second fork, whose child inherited its descriptor (and the
    lock the parent then took on the shared open file). Each fork holds them off now."""
    import subprocess
    import sys

    path = tmp_path / "frame"
    path.write_bytes(b"x" * 4096)
    out = subprocess.run([sys.executable, "-c", _TWO_FORKS, str(path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout  # the second child inherited no frame
