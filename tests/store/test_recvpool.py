"""The receive pool: dropped copies' files reused for the next fetches, never while held."""

from __future__ import annotations

import fcntl
import mmap
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from instride.store.recvpool import ReceivePool, map_to_receive
from tests.conftest import finish


def _pooled(pool_dir: Path) -> list[str]:
    """The dropped copies in the pool (not the file made ahead for the next fetch)."""
    return [n for n in os.listdir(pool_dir) if n.startswith("copy-")]


def _file(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_a_dropped_copy_is_reused_in_place(tmp_path: Path) -> None:
    pool = ReceivePool(tmp_path / "recv")
    copy = _file(tmp_path / "frame_0.isf", b"a" * 5000)
    ino = os.stat(copy).st_ino
    assert pool.give(copy) and not os.path.exists(copy)  # the key is gone at once
    staged = str(tmp_path / "frame_1.isf.tmp")
    fd = pool.take(staged, 3000)
    assert fd is not None and pool.reused == 1
    try:
        st = os.fstat(fd)
        assert st.st_ino == ino and st.st_size == 3000  # the same storage, sized to the frame
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0
        os.write(fd, b"b" * 3000)
    finally:
        os.close(fd)
    assert Path(staged).read_bytes() == b"b" * 3000
    assert pool.take(str(tmp_path / "again.tmp"), 10) is None  # empty now: the caller makes a file


def test_only_a_file_whose_pages_are_allocated_is_mapped_to_receive_into(tmp_path: Path) -> None:
    """A fetch receives into a mapping of its file only where no store into it can find the
    file system full (a SIGBUS): a file whose pages are all there (a pooled or made-ahead
    file); a new, a sparse or a too short file is written the usual way (None)."""
    path = tmp_path / "staged"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert map_to_receive(fd, 8192) is None  # (empty: nothing allocated)
        os.ftruncate(fd, 8192)
        assert map_to_receive(fd, 8192) is None  # (sized, sparse)
        os.posix_fallocate(fd, 0, 8192)
        assert map_to_receive(fd, 16384) is None  # (shorter than the body expected)
        assert map_to_receive(fd, 0) is None
        mm = map_to_receive(fd, 8192)
        assert mm is not None and len(mm) == 8192
        try:
            mm[:5] = b"bytes"  # (a shared mapping: the file's own pages)
            mm[8187:] = b"ended"
        finally:
            mm.close()
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert data[:5] == b"bytes" and data[-5:] == b"ended" and len(data) == 8192


def test_a_file_a_reader_holds_is_never_rewritten(tmp_path: Path) -> None:
    pool = ReceivePool(tmp_path / "recv")
    copy = _file(tmp_path / "held.isf", b"frame one")
    reader = os.open(copy, os.O_RDONLY)  # a plain reader: no lock, just an open file
    try:
        assert pool.give(copy)
        staged = str(tmp_path / "next.tmp")
        assert pool.take(staged, 100) is None and pool.reused == 0  # held: not reused
        assert not os.path.exists(staged) and len(_pooled(tmp_path / "recv")) == 1  # kept
        assert os.pread(reader, 100, 0) == b"frame one"  # the reader's bytes are untouched
    finally:
        os.close(reader)
    fd = pool.take(staged, 100)  # nobody holds it now: reused
    assert fd is not None and pool.reused == 1
    os.close(fd)


def test_a_mapped_file_is_never_rewritten_or_shrunk(tmp_path: Path) -> None:
    # a reader's numpy views of a released frame keep its mapping (the descriptor is closed):
    # the file must neither change nor shrink under them (a shrink would be SIGBUS)
    pool = ReceivePool(tmp_path / "recv")
    copy = _file(tmp_path / "mapped.isf", b"m" * 65536)
    with open(copy, "rb") as fh:
        view = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
    try:
        assert pool.give(copy)
        assert pool.take(str(tmp_path / "small.tmp"), 10) is None
        assert view[:] == b"m" * 65536  # readable to its end, unchanged
    finally:
        view.close()
    fd = pool.take(str(tmp_path / "small.tmp"), 10)
    assert fd is not None and os.fstat(fd).st_size == 10
    os.close(fd)


def test_a_stream_frame_is_reused_once_no_reader_holds_its_lock(tmp_path: Path) -> None:
    # a bounded stream's copy (locked=True): readers hold a shared flock while they hold the
    # frame; a released frame's mapping a reader keeps for reuse does not hold it
    pool = ReceivePool(tmp_path / "recv")
    copy = _file(tmp_path / "leased.isf", b"frame two")
    reader = os.open(copy, os.O_RDONLY)
    with open(copy, "rb") as fh:
        kept = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
    try:
        fcntl.flock(reader, fcntl.LOCK_SH)  # a reader's lease (instride.store.ring.Leases)
        assert pool.give(copy, locked=True)
        assert pool.take(str(tmp_path / "n.tmp"), 9) is None  # held: not reused
        assert os.pread(reader, 100, 0) == b"frame two"
        os.close(reader)  # released (the kept mapping stays)
        fd = pool.take(str(tmp_path / "n.tmp"), 9)
        assert fd is not None and pool.reused == 1
        os.write(fd, b"frame 3!!")
        os.close(fd)
        assert kept[:] == b"frame 3!!"  # a released frame's mapping may show the next frame
    finally:
        kept.close()


def test_the_pool_is_bounded_in_files_and_bytes(tmp_path: Path) -> None:
    pool = ReceivePool(tmp_path / "recv", keep_files=2, keep_bytes=10_000)
    a, b, c = (_file(tmp_path / f"{n}.isf", b"x" * 4000) for n in "abc")
    assert pool.give(a) and pool.give(b)
    assert not pool.give(c) and os.path.exists(c)  # full: the caller deletes it
    pool = ReceivePool(tmp_path / "recv2", keep_bytes=6000)
    assert pool.give(c)
    d = _file(tmp_path / "d.isf", b"y" * 4000)
    assert not pool.give(d)  # 8000 bytes would exceed the bound
    assert pool.give(str(tmp_path / "gone.isf"))  # nothing to drop: fine
    empty = _file(tmp_path / "empty.isf", b"")
    assert not pool.give(empty)  # nothing worth keeping
    link = tmp_path / "link.isf"
    link.symlink_to(d)
    assert not pool.give(str(link)) and link.is_symlink()  # only regular files


def test_clear_removes_every_pooled_file(tmp_path: Path) -> None:
    pool = ReceivePool(tmp_path / "recv")
    for n in "ab":
        pool.give(_file(tmp_path / f"{n}.isf", b"z" * 10))
    removed = pool.clear()
    assert len(removed) == 2 and not _pooled(tmp_path / "recv")
    assert ReceivePool(tmp_path / "never-made").clear() == []


def _until(what, seconds: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    import time

    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, "not within 10 s"
        time.sleep(0.001)


def test_a_node_that_keeps_its_copies_receives_into_a_file_made_ahead(tmp_path: Path) -> None:
    # nothing pooled (no cache bound): after two fetches of one size, the next file of that
    # size is made by an idle helper (nameless until taken), and the next fetch receives into
    # it, its pages written; a one-off size, or one beyond AHEAD_BYTES, makes none
    from instride.store.recvpool import AHEAD_BYTES

    bounded = ReceivePool(tmp_path / "bounded")  # (a cache bound: evicted copies come next)
    for i in range(2):
        assert bounded.take(str(tmp_path / f"b{i}.tmp"), 70_000) is None
    assert not bounded.spare_ready
    pool = ReceivePool(tmp_path / "recv", ahead=True)
    assert pool.take(str(tmp_path / "f0.tmp"), 70_000) is None
    assert not pool.spare_ready and not pool._spare.pending  # noqa: SLF001 (one fetch: no)
    assert pool.take(str(tmp_path / "f1.tmp"), 1000) is None  # (another size)
    assert pool.take(str(tmp_path / "f2.tmp"), 1000) is None  # two in a row: asked for
    _until(lambda: pool.spare_ready)
    assert not os.path.exists(tmp_path / "recv") or os.listdir(tmp_path / "recv") == []
    staged = str(tmp_path / "f3.tmp")
    fd = pool.take(staged, 1000)
    assert fd is not None and pool.spares_used == 1
    try:
        st = os.fstat(fd)
        assert st.st_ino == os.stat(staged).st_ino and st.st_size == 1000 and st.st_nlink == 1
        assert st.st_blocks * 512 >= 1000 and os.lseek(fd, 0, os.SEEK_CUR) == 0
        os.write(fd, b"x" * 1000)
    finally:
        os.close(fd)
    assert Path(staged).read_bytes() == b"x" * 1000
    _until(lambda: pool.spare_ready)  # (the next one, asked for at once)
    pool.close()  # the one made and not taken: gone with its descriptor
    assert not pool.spare_ready
    big = ReceivePool(tmp_path / "big", ahead=True)
    for i in range(2):
        assert big.take(str(tmp_path / f"g{i}.tmp"), AHEAD_BYTES + 1) is None
    assert not big._spare.pending  # noqa: SLF001
    none = ReceivePool(tmp_path / "none", ahead=True, ahead_bytes=0)  # INSTRIDE_AHEAD_BYTES=0
    for i in range(2):
        assert none.take(str(tmp_path / f"n{i}.tmp"), 1000) is None
    assert not none._spare.pending  # noqa: SLF001
    more = ReceivePool(tmp_path / "more", ahead=True, ahead_bytes=AHEAD_BYTES * 2)
    for i in range(2):
        assert more.take(str(tmp_path / f"m{i}.tmp"), AHEAD_BYTES + 1) is None
    assert more._spare.pending  # noqa: SLF001 (a larger bound: asked for)
    more.close()


def test_threads_sharing_a_pool_never_get_the_same_file_made_ahead(tmp_path: Path) -> None:
    # a node agent fetches from a thread pool through one engine: the file made ahead goes to
    # one fetch only (taken under a lock), and nothing crashes or is handed out twice
    import threading
    import time

    pool = ReceivePool(tmp_path / "recv", ahead=True)
    got: list[tuple[int, int]] = []
    errors: list[BaseException] = []

    def fetch(t: int) -> None:
        try:
            for i in range(150):
                staged = str(tmp_path / f"t{t}-{i}.tmp")
                fd = pool.take(staged, 4096)
                if fd is not None:
                    got.append((os.fstat(fd).st_ino, os.stat(staged).st_ino))
                    os.close(fd)
                time.sleep(0.0005)  # (idle moments: the helper makes files meanwhile)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    for i in range(2):  # two fetches of that size in a row: one made ahead before the threads
        assert pool.take(str(tmp_path / f"pre{i}.tmp"), 4096) is None
    _until(lambda: pool.spare_ready)  # (so one is handed out even if the helper starves later)
    threads = [threading.Thread(target=fetch, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    pool.close()
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert all(a == b for a, b in got)  # each named where its fetch staged it
    assert len({a for a, _ in got}) == len(got) == pool.spares_used  # never the same file twice
    assert pool.spares_used > 0  # (files made ahead were handed out: the race was exercised)


def test_a_file_made_ahead_waits_while_a_receive_is_under_way(tmp_path: Path) -> None:
    # A file made ahead is written twice (zeros, then the bytes): beside a transfer, its zeros
    # would take the memory bandwidth the transfer needs. So the helper writes only while no
    # receive of this process is under way; the TCP engine's receive loop counts them.
    import ctypes
    import socket
    import threading
    import time

    from instride.native import RECEIVING
    from instride.store.spare import SpareMaker
    from instride.transport.tcp.engine import load_library

    lib, size = load_library(), 1 << 20
    a, b = socket.socketpair()
    mem = ctypes.create_string_buffer(size)
    digest, got = ctypes.create_string_buffer(17), ctypes.c_uint64()
    rc: list[int] = []
    receive = threading.Thread(target=lambda: rc.append(lib.isc_recv_mem(
        a.fileno(), ctypes.addressof(mem), size, 0, 10_000, digest, ctypes.byref(got))))
    spare = SpareMaker()
    try:
        assert RECEIVING[0] == 0
        receive.start()
        b.sendall(b"x" * 1000)  # a receive under way, some of its bytes here
        _until(lambda: RECEIVING[0] == 1)
        spare.ask(str(tmp_path), 256 << 10)
        time.sleep(0.3)
        assert spare.pending and not spare.ready  # the helper waits for the receive
        b.sendall(b"x" * (size - 1000))
        receive.join(10)
        assert rc == [0] and got.value == size and mem.raw == b"x" * size
        assert RECEIVING[0] == 0 and RECEIVING[1] > 0  # (the end of the last stamped)
        _until(lambda: spare.ready)  # made once the receive is over
        fd = spare.take(256 << 10, str(tmp_path / "made"))
        assert fd is not None
        try:
            assert os.fstat(fd).st_size == 256 << 10
        finally:
            os.close(fd)
    finally:
        spare.close()
        b.close()  # (first: a receive still under way ends, its descriptor still open)
        receive.join(10)
        a.close()


def test_a_forked_child_has_none_of_its_parents_receives() -> None:
    # a child forked while its parent receives has no such receive: its helpers must not wait
    # for it forever
    from instride.native import RECEIVING

    RECEIVING[0] += 1
    try:
        pid = os.fork()
        if pid == 0:  # the child: report by exit status only
            os._exit(0 if RECEIVING[0] == 0 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert RECEIVING[0] == 1  # (the parent's own count untouched)
    finally:
        RECEIVING[0] -= 1



_CLAIM_AT_THE_LIMIT = textwrap.dedent(
    """
    import errno, os, resource, sys
    from pathlib import Path
    from instride.store.recvpool import ReceivePool
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    pool_dir, copy, staged = sys.argv[1:4]
    pool = ReceivePool(Path(pool_dir))
    assert pool.give(copy)
    held = []
    listing = ReceivePool._entries

    def entries(self):  # the listing done, another thread opens a file: the last one free
        got = listing(self)
        held.append(os.open(os.devnull, os.O_RDONLY))
        return got

    ReceivePool._entries = entries
    while True:  # every descriptor up to the limit taken, but one (for the listing)
        try:
            held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError as exc:
            assert exc.errno == errno.EMFILE
            break
    os.close(held.pop())
    try:
        pool.take(staged, 100)
    except OSError as exc:
        print("raised", errno.errorcode[exc.errno], flush=True)
    """
)


def test_a_claim_that_runs_out_of_descriptors_gives_the_file_back(tmp_path: Path) -> None:
    """A claimed file (renamed to the fetch's temporary name) that could not be opened, the
    process out of descriptors (EMFILE, a real limit), stayed under that name: a hidden file
    beside its key that no ``gc`` removed while the process ran, and the pool lost it. It goes
    back into the pool; the fetch sees the error."""
    pool_dir = tmp_path / "recv"
    copy = _file(tmp_path / "frame_0.isf", b"a" * 5000)
    staged = tmp_path / ".frame_1.isf.instride-1-ab.tmp"
    proc = subprocess.Popen([sys.executable, "-c", _CLAIM_AT_THE_LIMIT, str(pool_dir), copy,
                             str(staged)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    rc, out, err = finish(proc)
    assert rc == 0, err
    assert out.strip() == "raised EMFILE"
    assert not staged.exists()  # not left under the temporary name
    assert len(_pooled(pool_dir)) == 1  # back in the pool, for a later fetch
