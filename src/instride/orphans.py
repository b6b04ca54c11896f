"""Keeping child processes from outliving the process that started them.

:func:`die_with_parent` (in a child, before ``exec``: Linux's parent-death signal) covers a
child's first process only. What that process starts in turn — the programs a shell script
runs, an ``mpiexec``'s ranks, a module's subprocesses — would run on when the parent is
killed outright (``SIGKILL``: no teardown of its own). So the parent starts one small
:class:`Watchdog` process and tells it, on a pipe, each child's process group (the child
starts a session of its own: group id = its PID) as it starts (``+PGID``) and as its leader
is reaped (``-PGID``: once the group is empty, its number may be reused by another process).
When the pipe ends without ``done``, the parent died: the watchdog sends ``SIGTERM`` to every
group it holds, waits up to the grace, then sends ``SIGKILL`` to those still there. A parent
that tears down itself sends ``done`` after stopping its children, and the watchdog exits
without a signal. Used by ``instride flow run`` (every module instance).

A program's descendants may also leave its process group (``setsid``, a daemon). Those are
found by an entry of their environment (``=NAME=VALUE``: a cookie the parent gave the
program, which its descendants inherit — as Jenkins finds a build's leftovers) and signalled
with the groups. Directories told with ``@PATH`` are removed once the processes are gone
(``instride job``'s working directory).
:func:`become_subreaper` and :func:`stop_adopted`: ``instride job`` adopts what its command
leaves running and stops it before the services it uses.

The watchdog imports nothing from instride (``python -I``: it starts in ~20 ms).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

#: The watchdog's code (``python -I -c CODE GRACE``).
CODE = r"""
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
grace, groups, cookies, dirs, done = float(sys.argv[1]), set(), set(), [], False
for line in sys.stdin:
    line = line.rstrip("\n")
    if line == "done":
        done = True
        break
    if line[:1] == "+":
        groups.add(int(line[1:]))
    elif line[:1] == "-":
        groups.discard(int(line[1:]))
    elif line[:1] == "=":
        cookies.add(os.fsencode(line[1:]))
    elif line[:1] == "@":
        dirs.append(line[1:])

def marked():
    found, me = [], os.getpid()
    if not cookies:
        return found
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        if cookies.intersection(env):
            found.append(int(name))
    return found

def signal_all(sig):
    alive = []
    for g in sorted(groups):
        try:
            os.killpg(g, sig)
            alive.append(g)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in marked():
        try:
            os.kill(pid, sig)
            alive.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return alive

if not done:
    if signal_all(signal.SIGTERM):
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and signal_all(0):
            time.sleep(0.05)
        for _ in range(20):  # (what forks meanwhile is found again)
            if not signal_all(signal.SIGKILL):
                break
            time.sleep(0.05)
    if dirs:
        import shutil
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
"""


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """In a child before ``exec`` (``preexec_fn``): get ``sig`` when the parent dies (Linux
    ``PR_SET_PDEATHSIG``; kept across ``exec``). Nothing elsewhere.

    ``parent``: the parent's process id, taken before the fork (see :func:`dies_with_me`): a
    parent that died between the fork and this call sends no signal any more, so the child
    then signals itself (else it ran on, an orphan).
    """
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def dies_with_me(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` for a child that gets ``sig`` when this process dies, also where it
    dies before the child has asked for that (:func:`die_with_parent`)."""
    parent = os.getpid()
    return functools.partial(die_with_parent, sig, parent)


class Watchdog:
    """The parent's end of the watchdog (see the module docstring).

    Parameters
    ----------
    grace
        Seconds between the ``SIGTERM`` and the ``SIGKILL`` of the groups left.
    """

    def __init__(self, grace: float) -> None:
        self._grace = grace
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-c", CODE, str(grace)], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, start_new_session=True, text=True)

    def _say(self, line: str) -> None:
        assert self._proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # (a watchdog gone: nothing to tell)
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()

    def watch(self, pgid: int) -> None:
        """Stop process group ``pgid`` if the parent dies."""
        self._say(f"+{pgid}")

    def watch_env(self, entry: str) -> None:
        """Stop also the processes whose environment holds ``entry`` (``"NAME=VALUE"``, a
        cookie given to a program, inherited by its descendants) if the parent dies."""
        if "\n" in entry or "\0" in entry:
            raise ValueError(f"an environment entry on one line, without NUL: {entry!r}")
        self._say(f"={entry}")

    def remove_after(self, path: str | os.PathLike[str]) -> None:
        """Remove directory ``path`` if the parent dies (once its processes are stopped)."""
        text = os.fspath(path)
        if "\n" in text:
            raise ValueError(f"a directory named on one line: {text!r}")
        self._say(f"@{text}")

    def forget(self, pgid: int) -> None:
        """Group ``pgid``'s leader was reaped: leave the group (once it is empty its number
        may be reused; what the instance left running is left, as on a normal end)."""
        self._say(f"-{pgid}")

    def done(self) -> None:
        """The parent stopped its children itself: the watchdog exits, signalling nothing."""
        self._say("done")
        self._end(10.0)

    def stop_now(self) -> None:
        """Have the watchdog stop what it watches now, as if the parent had died (the groups
        not forgotten, the processes marked by a cookie), and wait until it has: for a
        parent whose children exited but may have left processes running (a program's
        background child)."""
        self._end(self._grace + 10.0)  # (SIGTERM, the grace, SIGKILL)

    def _end(self, wait: float) -> None:
        assert self._proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self._proc.stdin.close()
        try:
            self._proc.wait(wait)
        except subprocess.TimeoutExpired:  # pragma: no cover - it reads a line and exits
            self._proc.kill()
            self._proc.wait()


def become_subreaper(on: bool = True) -> bool:
    """Make this process adopt its descendants' orphans (Linux ``PR_SET_CHILD_SUBREAPER``),
    or stop; return whether the kernel agreed. The orphans of a command it started — what a
    shell script left running — become its children, which :func:`stop_adopted` stops."""
    try:
        import ctypes

        return int(ctypes.CDLL(None, use_errno=True).prctl(36, int(on))) == 0
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return False


def children() -> set[int]:
    """The PIDs of this process's children (every thread's, from ``/proc``)."""
    out: set[int] = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # pragma: no cover - no /proc
        return out
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children") as fh:
                out.update(int(x) for x in fh.read().split())
        except OSError:
            continue
    return out


def stop_adopted(exclude: set[int], grace: float) -> list[int]:
    """Stop this process's children that are not in ``exclude`` — the orphans a subreaper
    adopted (:func:`become_subreaper`) — SIGTERM first, SIGKILL once ``grace`` s have passed
    (one grace for all of them), and reap them; again for the orphans that stopping them makes.
    A child is this process's until it reaps it, so its PID cannot name another process
    meanwhile. One that SIGKILL does not end within 5 s (asleep in a hung file system) is left.
    Every child not in ``exclude`` counts: the caller is the process's only spawner meanwhile.
    Returns the PIDs stopped."""
    stopped: list[int] = []
    deadline = time.monotonic() + grace
    for _ in range(16):  # (each round: one more level of descendants, orphaned by the last)
        found = sorted(children() - exclude - set(stopped))
        if not found:
            break
        late = time.monotonic() >= deadline
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL if late else signal.SIGTERM)
        left = _reap_until(set(found), deadline)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _reap_until(left, time.monotonic() + 5.0)
        stopped += found
    return stopped


def _reap_until(pids: set[int], deadline: float) -> set[int]:
    """Reap the children of ``pids`` that end before ``deadline``; return those left."""
    left = set(pids)
    while left:
        left = {pid for pid in left if not _reaped(pid)}
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return left


def _reaped(pid: int) -> bool:
    """Reap child ``pid`` if it has ended; whether it is gone."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == pid
