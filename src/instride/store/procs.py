"""What the kernel says of another process of the node: its state, its start time, and the
space its PID is a number of — for a holder of a lease or a lock that another process must
tell gone, or stopped, before it takes over.

``/proc/PID/stat`` is read directly (two fields of one line, no library: ``psutil`` would be
a dependency for one read).
"""

from __future__ import annotations

import contextlib
import os


def proc_stat(pid: int) -> tuple[str, str] | None:
    """Process ``pid``'s state letter and start time (``/proc/PID/stat``'s 3rd and 22nd
    fields; the start time in clock ticks since boot: a number reused by a later process
    starts later), or ``None`` where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), fields[19].decode()
    except (OSError, IndexError, UnicodeDecodeError):
        return None


def pid_space() -> str | None:
    """The space this process's PIDs and start times are numbers of: the running kernel (its
    boot's id), the PID namespace and the time namespace (their inodes; start times are
    counted from the reader's time namespace's boot) — the same for the emulated nodes of
    one machine, another for each machine, boot and container with namespaces of its own.
    ``None`` where it cannot be read, or where ``/proc`` is not this PID namespace's (mounted
    from another: its PIDs name other processes)."""
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return None
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
        space = f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
        with contextlib.suppress(FileNotFoundError):  # (Linux before 5.6: no time namespaces)
            space += f"/{os.stat('/proc/self/ns/time').st_ino}"
        return space
    except OSError:
        return None


_space: tuple[int, str | None] = (0, None)


def _space_of_pid() -> tuple[int, str | None]:
    """:func:`pid_space`, read once per process (a waiter asks at every poll)."""
    global _space
    if _space[0] != os.getpid() or _space[1] is None:  # (a failed read is tried again)
        _space = (os.getpid(), pid_space())
    return _space


def stopped(pid: int) -> bool:
    """Whether process ``pid`` (a number of this process's PID namespace, as the kernel gives
    it for a lock's holder) is stopped: by ``SIGSTOP`` or ``SIGTSTP`` (``Ctrl-Z``), or at a
    debugger's breakpoint. ``False`` for a running, sleeping or gone process, and wherever it
    cannot be told (``/proc`` of another PID namespace, a process this one may not look at)."""
    if _space_of_pid()[1] is None:
        return False
    stat = proc_stat(pid)
    return stat is not None and stat[0] in ("T", "t")


__all__ = ["pid_space", "proc_stat", "stopped"]
