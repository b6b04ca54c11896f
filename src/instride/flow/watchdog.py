"""The run's watchdog: stops every instance's process group when the runner dies.

Each instance starts in its own session with a parent-death signal (``PR_SET_PDEATHSIG``):
when the runner is killed (``SIGKILL``: no teardown of its own), the kernel kills the
instance's first process only. Whatever that process started — the programs of a
``command=`` module run by a shell script, an ``mpiexec``'s ranks, a module's subprocesses —
would run on. So the runner starts one small watchdog process and tells it, on a pipe, each
instance's process group as it starts (``+PGID``) and as its leader is reaped (``-PGID``:
once the group is empty, its number may be reused by another process). When the pipe ends without ``done``,
the runner died: the watchdog sends ``SIGTERM`` to every group it holds, waits up to the
grace, then sends ``SIGKILL`` to those still there. A runner that tears down itself sends
``done`` after stopping the instances, and the watchdog exits without a signal.

The watchdog imports nothing from instride (``python -I``: it starts in ~20 ms).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

#: The watchdog's code (``python -I -c CODE GRACE``).
CODE = r"""
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
grace, groups, done = float(sys.argv[1]), set(), False
for line in sys.stdin:
    line = line.strip()
    if line == "done":
        done = True
        break
    if line[:1] == "+":
        groups.add(int(line[1:]))
    elif line[:1] == "-":
        groups.discard(int(line[1:]))

def signal_all(sig):
    alive = []
    for g in sorted(groups):
        try:
            os.killpg(g, sig)
            alive.append(g)
        except (ProcessLookupError, PermissionError):
            pass
    return alive

if not done and signal_all(signal.SIGTERM):
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and signal_all(0):
        time.sleep(0.05)
    signal_all(signal.SIGKILL)
"""


class Watchdog:
    """The runner's end of the watchdog (see the module docstring).

    Parameters
    ----------
    grace
        Seconds between the ``SIGTERM`` and the ``SIGKILL`` of the groups left.
    """

    def __init__(self, grace: float) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-c", CODE, str(grace)], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, start_new_session=True, text=True)

    def _say(self, line: str) -> None:
        assert self._proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # (a watchdog gone: nothing to tell)
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()

    def watch(self, pgid: int) -> None:
        """Stop process group ``pgid`` if the runner dies."""
        self._say(f"+{pgid}")

    def forget(self, pgid: int) -> None:
        """Group ``pgid``'s leader was reaped: leave the group (once it is empty its number
        may be reused; what the instance left running is left, as on a normal end)."""
        self._say(f"-{pgid}")

    def done(self) -> None:
        """The runner stopped the instances itself: the watchdog exits, signalling nothing."""
        self._say("done")
        assert self._proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover - it reads a line and exits
            self._proc.kill()
            self._proc.wait()
