"""Garbage collection of temporary files left by producers that died mid-write."""

from __future__ import annotations

import contextlib
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


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def collect_garbage(root: Path, *, min_age: float = 0.0) -> list[Path]:
    """Remove temporary files left by producers that died mid-write.

    A temporary file is removed when its writer's PID is gone, or when it is older than
    ``min_age`` seconds and ``min_age`` is positive (for PIDs reused since).
    """
    removed = []
    now = time.time()
    for path, pid in iter_tmp_files(root):
        try:
            age = now - path.stat().st_mtime
        except FileNotFoundError:
            continue
        if (pid != os.getpid() and not pid_alive(pid)) or (min_age > 0 and age > min_age):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
    return removed


__all__ = ["collect_garbage", "iter_tmp_files", "pid_alive"]
