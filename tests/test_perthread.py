"""Per-thread state is not inherited by a forked child (it would share the parent's sockets)."""

from __future__ import annotations

import os
import threading

from instride.perthread import PerThread


def test_child_of_fork_starts_empty_and_parent_keeps_its_state() -> None:
    per = PerThread()
    per.get().conn = "parent's socket"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must not see the parent's object
        os.close(r)
        os.write(w, repr(getattr(per.get(), "conn", None)).encode())
        os._exit(0)
    os.close(w)
    seen = os.read(r, 100).decode()
    os.close(r)
    os.waitpid(pid, 0)
    assert seen == "None"
    assert per.get().conn == "parent's socket"


def test_threads_do_not_share() -> None:
    per = PerThread()
    per.get().x = 1
    seen = []
    t = threading.Thread(target=lambda: seen.append(getattr(per.get(), "x", None)))
    t.start()
    t.join()
    assert seen == [None]
