"""Garbage collection of temporary files left by producers that died mid-write."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterable
from pathlib import Path

from ..keys import TMP_PATTERN


def iter_tmp_files(root: Path) -> Iterable[tuple[Path, int]]:
    """Yield ``(path, pid)`` for every instride temporary file under ``root``."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            match = TMP_PATTERN.match(name)
            if match:
                yield Path(dirpath) / name, int(match.group("pid"))


#: the largest process id Linux can give (``PID_MAX_LIMIT`` on 64-bit kernels: 2**22)
_PID_MAX = 1 << 22


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists on this machine (``False`` for a number no
    process can have: 0 or less — ``kill`` would ask about a process group, or all of them —
    or beyond the kernel's limit, which ``kill`` cannot even be handed)."""
    if not 0 < pid <= _PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_held(path: Path, *, exclusive: bool) -> bool | None:
    """Whether a process holds a ``flock`` on ``path`` that conflicts with a probe of the
    given kind (``exclusive``: any lock conflicts; shared: only an exclusive one), taken
    without waiting and let go at once. ``False`` also when the file is gone; ``None`` when
    it cannot be told (another user's file, a file system without ``flock``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)
    return False


def being_written(path: Path) -> bool:
    """Whether a writer holds ``path`` open: it locks its temporary file (shared) for as
    long as it writes (``mark_writing``), and the lock goes with its process however that
    ends. Files of writers that take no lock (an older instride), and files whose locks
    cannot be told, never count as held (their writer's process id decides)."""
    return lock_held(path, exclusive=True) is True


#: seconds within which a writer locks the temporary file it made (or claimed from the
#: receive pool, a rename): microseconds after, in fact; one not locked yet that changed less
#: than this ago is looked at again once it is this old (see :func:`collect_garbage`)
LOCK_GRACE = 1.0


def collect_garbage(root: Path, *, min_age: float = 0.0) -> list[Path]:
    """Remove temporary files left by producers that died mid-write.

    A temporary file a writer still holds (its lock, see :func:`being_written`) is never
    removed. Any other is removed when its writer's PID is gone, or when it was last written
    or renamed more than ``min_age`` seconds ago and ``min_age`` is positive (for PIDs reused
    since). The lock is
    what keeps a running writer's file safe from a collector in another PID namespace (a
    container sharing the file system), where its process id names nothing or another
    process. A writer makes its file, then locks it: a file found unlocked that changed less
    than :data:`LOCK_GRACE` seconds ago is probed again once it is that old (the collector
    waits for it, at most that long), so that such a collector never takes a file from
    between its writer's two steps.
    """
    removed: list[Path] = []
    young: list[tuple[Path, float]] = []
    now = time.time()
    for path, pid in iter_tmp_files(root):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        # (its last write, or its last rename: a receive file claimed from the pool a moment
        # ago is an old file under a new temporary name, not locked yet)
        changed = max(st.st_mtime, st.st_ctime)
        age = now - changed
        if ((pid != os.getpid() and not pid_alive(pid)) or (min_age > 0 and age > min_age)) \
                and not being_written(path):
            if age < LOCK_GRACE:
                young.append((path, changed))
            else:
                _remove(path, removed)
    if young:
        # (bounded: a clock set back makes a file look changed in the future)
        time.sleep(min(LOCK_GRACE, max(0.0, max(c for _, c in young) + LOCK_GRACE
                                       - time.time())))
        for path, changed in young:
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            # (changed since: someone works on it — a writer that had not locked it yet)
            if max(st.st_mtime, st.st_ctime) == changed and not being_written(path):
                _remove(path, removed)
    return removed


def _remove(path: Path, removed: list[Path]) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
        removed.append(path)


__all__ = ["being_written", "collect_garbage", "iter_tmp_files", "lock_held", "pid_alive"]
