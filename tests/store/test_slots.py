"""Node-wide try-locks by name on one file (instride.store.slots): one holder per name among
threads and processes, none inherited by a forked child, none lost when another part of the
process is done with the file."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

from instride.store.slots import SlotLocks, slot_locks

HOLD = """
import sys, time
from pathlib import Path
from instride.store.slots import slot_locks
with slot_locks(Path(sys.argv[1])).held(sys.argv[2]) as taken:
    print(taken, flush=True)
    sys.stdin.readline()  # (held until told)
"""


def test_a_name_held_by_another_process_is_refused_until_it_lets_go(tmp_path: Path) -> None:
    path = tmp_path / "asking.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path), "k/0001"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "True"
        locks = slot_locks(path)
        with locks.held("k/0001") as taken:
            assert taken is False
        with locks.held("k/0002") as taken:  # (another name: its own byte)
            assert taken is True
    finally:
        holder.communicate("\n", timeout=20)
    with slot_locks(path).held("k/0001") as taken:
        assert taken is True
    assert os.listdir(tmp_path) == ["asking.lock"]  # (one file for every name)


def test_the_holder_of_a_name_is_the_other_process_that_holds_it(tmp_path: Path) -> None:
    """``holder`` names the other process holding a name (the kernel's ``F_GETLK``), nobody
    for a free name, another name, or a name this process holds itself."""
    path = tmp_path / "fetch.lock"
    locks = slot_locks(path)
    assert locks.holder("k/0001") is None
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path), "k/0001"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "True"
        assert locks.holder("k/0001") == holder.pid
        assert locks.holder("k/0002") is None
        with locks.held("k/0002") as taken:
            assert taken is True and locks.holder("k/0002") is None  # (its own)
    finally:
        holder.communicate("\n", timeout=20)
    assert locks.holder("k/0001") is None  # (let go of with the process's exit)


def test_threads_of_one_process_are_kept_apart(tmp_path: Path) -> None:
    locks = slot_locks(tmp_path / "asking.lock")
    seen: list[bool] = []
    with locks.held("k") as first:
        thread = threading.Thread(target=lambda: seen.append(locks.held("k").__enter__()))
        thread.start()
        thread.join(10)
    assert first is True and seen == [False]
    with locks.held("k") as again:
        assert again is True


def test_every_caller_of_a_process_gets_one_object_per_file(tmp_path: Path) -> None:
    """A second descriptor of the file, closed, would let go of the process's locks on it (POSIX
    record locks): so a process has one object, and one descriptor, per file."""
    a = slot_locks(tmp_path / "asking.lock")
    assert slot_locks(tmp_path / "." / "asking.lock") is a
    assert isinstance(a, SlotLocks) and slot_locks(tmp_path / "other.lock") is not a


def _child(path: str, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    with slot_locks(Path(path)).held("k") as taken:
        out.put(taken)


def test_a_forked_child_holds_none_of_its_parents_locks(tmp_path: Path) -> None:
    """A child made by fork while its parent holds a name: the child is refused it (the
    parent holds it), and its own set of held names starts empty (it does not think it holds
    the name, nor lets go of the parent's)."""
    path = tmp_path / "asking.lock"
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    with slot_locks(path).held("k") as taken:
        assert taken is True
        child = ctx.Process(target=_child, args=(str(path), out))
        child.start()
        assert out.get(timeout=20) is False
        child.join(20)
    child = ctx.Process(target=_child, args=(str(path), out))
    child.start()
    assert out.get(timeout=20) is True  # (let go of by the parent: the child takes it)
    child.join(20)
    assert child.exitcode == 0


def test_a_child_forked_while_a_thread_held_the_objects_own_lock_does_not_hang(
        tmp_path: Path) -> None:
    """``fork`` while another thread is inside the object (its in-process lock held, as during
    its system call): the child gets locks of its own and takes the name."""
    locks = slot_locks(tmp_path / "asking.lock")
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    with locks._mu:  # (as another thread inside held() at the fork)
        child = ctx.Process(target=_child, args=(str(tmp_path / "asking.lock"), out))
        child.start()
    try:
        assert out.get(timeout=20) is True
    finally:
        child.join(20)
        if child.is_alive():
            child.kill()
            child.join()
