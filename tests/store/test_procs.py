"""What the kernel says of another process (instride.store.procs): stopped or not, its state
and start time, and the PID space its number belongs to."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from instride.store.procs import pid_space, proc_stat, stopped


def _state_becomes(pid: int, states: str) -> bool:
    for _ in range(500):
        stat = proc_stat(pid)
        if stat is not None and stat[0] in states:
            return True
        time.sleep(0.01)
    return False


def test_a_stopped_process_is_told_from_a_running_sleeping_or_gone_one() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert _state_becomes(child.pid, "S") and not stopped(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        assert _state_becomes(child.pid, "T") and stopped(child.pid)
        os.kill(child.pid, signal.SIGCONT)
        assert _state_becomes(child.pid, "RS") and not stopped(child.pid)
        spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            assert _state_becomes(spin.pid, "R") and not stopped(spin.pid)
        finally:
            spin.kill()
            spin.wait(30)
    finally:
        child.kill()
        child.wait(30)
    assert proc_stat(child.pid) is None and not stopped(child.pid)  # (reaped: gone)


def test_a_process_has_its_state_and_start_time_and_this_pid_space() -> None:
    stat = proc_stat(os.getpid())
    assert stat is not None and stat[0] == "R" and stat[1].isdigit()
    space = pid_space()
    assert space is not None and space.count("/") >= 1
    with open("/proc/sys/kernel/random/boot_id") as fh:
        assert space.startswith(fh.read().strip() + "/")
