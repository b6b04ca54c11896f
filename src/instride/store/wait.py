"""Waiting for a file to appear on node-local storage (inotify).

A wait arms an inotify watch on the file's directory and re-checks after arming, so a
publication that lands between the first check and the watch is never missed. No polling, no
busy wait by default: the thread sleeps in ``read()`` until an event names an awaited file
(``spin=`` busy-polls first, for a caller that would rather keep a core busy than pay the
wake-up of a sleeping one). When the
per-user inotify limits are reached (a thousand waiting threads exceed the default 128
instances) a wait falls back to polling (1 ms doubling to 50 ms), still ending correctly. A
failed wait (timeout, interruption) removes the directories it created to watch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

from inotify_simple import INotify
from inotify_simple import flags as inflags

from ..busypoll import poll_paths
from ..errors import ConsumeTimeout

_MAX_WAIT_MS = 60_000  # one read() at most; longer waits loop (poll() takes an int)
_LOST = int(inflags.Q_OVERFLOW)
_GONE = int(inflags.IGNORED | inflags.DELETE_SELF | inflags.MOVE_SELF)
_WATCH = inflags.CREATE | inflags.MOVED_TO | inflags.DELETE_SELF | inflags.MOVE_SELF


class _Watcher(threading.local):
    """One inotify instance per thread, kept for the life of the thread.

    Closing an inotify descriptor waits for an RCU grace period (milliseconds on some
    kernels), so waits reuse one instance and its directory watches instead of making and
    closing one each time. Watches are bounded; stale events of other files are ignored.
    """

    MAX_WATCHES = 64

    def __init__(self) -> None:
        self.ino: INotify | None = None
        self.pid = 0
        self.wds: OrderedDict[Path, int] = OrderedDict()

    def get(self) -> INotify:
        if self.ino is None or self.pid != os.getpid():  # new thread, or a forked child
            self.ino = INotify()
            self.pid = os.getpid()
            self.wds.clear()
        return self.ino

    def watch(self, directory: Path) -> None:
        ino = self.get()
        if directory in self.wds:
            self.wds.move_to_end(directory)
            return
        directory.mkdir(parents=True, exist_ok=True)
        self.wds[directory] = ino.add_watch(directory, _WATCH)
        while len(self.wds) > self.MAX_WATCHES:
            _old, wd = self.wds.popitem(last=False)
            with contextlib.suppress(OSError):
                ino.rm_watch(wd)

    def drop(self, directory: Path) -> None:
        """Stop watching ``directory`` (about to be removed)."""
        wd = self.wds.pop(directory, None)
        if wd is not None:
            with contextlib.suppress(OSError):
                self.get().rm_watch(wd)

    def forget(self, wd: int) -> None:
        for directory, w in list(self.wds.items()):
            if w == wd:
                del self.wds[directory]
                with contextlib.suppress(OSError):
                    self.get().rm_watch(w)

    def reset(self) -> None:
        """Drop every watch (after a queue overflow); waits re-arm what they need."""
        ino = self.get()
        for wd in self.wds.values():
            with contextlib.suppress(OSError):
                ino.rm_watch(wd)
        self.wds.clear()


_watcher = _Watcher()


def _missing_dirs(dirs: Iterable[Path]) -> list[Path]:
    """The directories (deepest first) that watching ``dirs`` would create."""
    missing: list[Path] = []
    for directory in dirs:
        d = directory
        while d not in missing and not os.path.isdir(d) and d != d.parent:
            missing.append(d)
            d = d.parent
    return sorted(missing, key=lambda p: len(p.parts), reverse=True)


def wait_any(
    paths: Sequence[Path],
    timeout: float | None,
    *,
    label: str,
    spin: float = 0.0,
) -> Path:
    """Block until one of ``paths`` exists and return it.

    Parameters
    ----------
    paths
        Candidate files; their directories are created if missing so they can be watched, and
        removed again (when still empty) if the wait fails: a failed wait leaves nothing behind.
    timeout
        Seconds to wait; ``None`` waits forever.
    label
        What is being waited for, named in the :class:`ConsumeTimeout`.
    spin
        Seconds to busy-poll before sleeping (within ``timeout``); ``0`` sleeps at once.

    Raises
    ------
    ConsumeTimeout
        If none appears within ``timeout``.
    """
    for path in paths:
        if os.path.exists(path):
            return path
    if spin > 0:
        start = time.monotonic()
        found = poll_paths(paths, spin if timeout is None else min(spin, timeout))
        if found is not None:
            return Path(found)
        if timeout is not None:
            timeout = max(0.0, timeout - (time.monotonic() - start))
    created = _missing_dirs(dict.fromkeys(p.parent for p in paths))  # [cleanup]
    try:
        return _wait_any(paths, timeout, label)
    except BaseException:
        for directory in created:  # [cleanup] deepest first; a non-empty one stays
            _watcher.drop(directory)
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        raise


#: errno of inotify_init / inotify_add_watch when the per-user limits are reached
#: (fs.inotify.max_user_instances, 128 by default; max_user_watches) or memory is short.
_NO_INOTIFY = (errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.ENOMEM)
#: Longest sleep between two checks of a polling wait.
_POLL_MAX = 0.05


def _poll_any(paths: Sequence[Path], timeout: float | None, label: str, start: float) -> Path:
    """Wait by polling (1 ms doubling to 50 ms): the fallback when no inotify is available.

    A process can hold only so many inotify instances (a thousand waiting threads exceed the
    default per-user limit of 128); their waits still end correctly, at most 50 ms late.
    """
    delay = 0.001
    while True:
        for path in paths:
            if os.path.exists(path):
                return path
        elapsed = time.monotonic() - start
        if timeout is not None and elapsed >= timeout:
            raise ConsumeTimeout(label, elapsed)
        time.sleep(delay if timeout is None else max(0.0, min(delay, timeout - elapsed)))
        delay = min(delay * 2, _POLL_MAX)


def _wait_any(paths: Sequence[Path], timeout: float | None, label: str) -> Path:
    start = time.monotonic()
    names = {p.name for p in paths}
    dirs = list(dict.fromkeys(p.parent for p in paths))
    try:
        ino = _watcher.get()
        for directory in dirs:
            _watcher.watch(directory)
    except OSError as exc:  # [limits] out of inotify instances or watches: poll instead
        if exc.errno not in _NO_INOTIFY:
            raise
        return _poll_any(paths, timeout, label, start)
    # Re-check after arming: a publication between the first check and the watch produced
    # no event we could see.
    for path in paths:
        if os.path.exists(path):
            return path
    while True:
        if timeout is None:
            wait_ms = _MAX_WAIT_MS
        else:
            remaining = timeout - (time.monotonic() - start)
            if remaining <= 0:
                raise ConsumeTimeout(label, time.monotonic() - start)
            wait_ms = min(max(1, int(remaining * 1000)), _MAX_WAIT_MS)
        wake = rearm = False
        for ev in ino.read(timeout=wait_ms):  # the cheapest test first: this is the hot path
            if ev.name in names:
                wake = True
            elif ev.mask & _LOST:  # events (maybe IN_IGNORED) were lost
                _watcher.reset()
                rearm = True
            elif ev.mask & _GONE:  # a watched directory went away or moved
                _watcher.forget(ev.wd)
                rearm = True
        if rearm:
            for directory in dirs:
                _watcher.watch(directory)
        if wake or rearm:
            for path in paths:
                if os.path.exists(path):
                    return path


__all__ = ["wait_any"]
