"""Waiting for a file to appear on node-local storage (inotify).

A wait arms an inotify watch on the file's directory and re-checks after arming, so a
publication that lands between the first check and the watch is never missed. No polling, no
busy wait by default: the thread sleeps in ``read()`` until an event names an awaited file
(``spin=`` busy-polls first, for a caller that would rather keep a core busy than pay the
wake-up of a sleeping one). When the
per-user inotify limits are reached (a thousand waiting threads exceed the default 128
instances) a wait falls back to polling (1 ms doubling to 50 ms), still ending correctly. A
failed wait (timeout, interruption) removes the directories it created to watch.

The sleep itself is C where ``libinstride_local.so`` was built (``pip install`` builds it;
:mod:`instride.native`):
``isl_wait`` (``csrc/local/wait.c``) polls the thread's inotify descriptor, reads the events
and checks the awaited files, GIL released, and returns only when a key is there — so a woken
consumer runs no Python until then (~35 µs less from publication to the consumer's return on
the development VM). Without the library the same loop runs in Python (``inotify_simple``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from stat import S_ISDIR as stat_is_dir
from stat import S_ISREG as stat_is_reg

from inotify_simple import INotify
from inotify_simple import flags as inflags

from ..busypoll import poll_paths
from ..errors import ConsumeTimeout
from ..native import library
from ..perthread import forks

#: how often a waiter looks whether each directory it watches is still the one at its path
#: (also the longest single read of a wait; longer waits loop)
_LOOK_MS = 1000
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
        self.forks = -1
        self.wds: OrderedDict[Path, int] = OrderedDict()
        #: the directory each watch is on (device, inode), wherever it goes
        self.ids: dict[Path, tuple[int, int]] = {}

    def get(self) -> INotify:
        if self.ino is None or self.forks != forks():  # new thread, or a forked child
            self.ino = INotify()
            self.forks = forks()
            self.wds.clear()
            self.ids.clear()
        return self.ino

    def moved(self, directory: Path) -> bool:
        """Whether the directory at ``directory`` is no longer the one watched (a directory
        above it renamed, another made in its place: the watch went with the old one, which
        gets no events); its watch is dropped then (:meth:`watch` makes one anew)."""
        held = self.ids.get(directory)
        try:
            st = os.stat(directory)
            now: tuple[int, int] | None = (st.st_dev, st.st_ino)
        except OSError:
            now = None
        if held is not None and now == held:
            return False
        self.drop(directory)
        return True

    def watch(self, directory: Path, keep: int = 0) -> None:
        """Watch ``directory`` (the most recently used); the oldest watches beyond
        :attr:`MAX_WATCHES`, or beyond ``keep`` (the directories one wait needs: none of
        them is evicted by another, which would re-arm it without end), are dropped."""
        ino = self.get()
        if directory in self.wds:
            self.wds.move_to_end(directory)
            return
        for attempt in range(5):
            directory.mkdir(parents=True, exist_ok=True)
            try:
                self.wds[directory] = ino.add_watch(directory, _WATCH)
                with contextlib.suppress(OSError):
                    st = os.stat(directory)
                    self.ids[directory] = (st.st_dev, st.st_ino)
                break
            except FileNotFoundError:
                # (another waiter's failed wait removed the empty directory it made, between
                # the mkdir and the watch: made again, as publishers do)
                if attempt == 4:
                    raise
        while len(self.wds) > max(self.MAX_WATCHES, keep):
            old, wd = self.wds.popitem(last=False)
            self.ids.pop(old, None)
            with contextlib.suppress(OSError):
                ino.rm_watch(wd)

    def drop(self, directory: Path) -> None:
        """Stop watching ``directory`` (about to be removed)."""
        wd = self.wds.pop(directory, None)
        self.ids.pop(directory, None)
        if wd is not None:
            with contextlib.suppress(OSError):
                self.get().rm_watch(wd)

    def forget(self, wd: int) -> bool:
        """Forget the watch ``wd`` (its directory went away); whether this thread held it.

        An ``IN_IGNORED`` of a watch no longer held is one this thread removed itself
        (evicted, or dropped): nothing to arm again. Re-arming for it would evict or
        remove another watch, whose own ``IN_IGNORED`` woke the wait again, without end."""
        held = False
        for directory, w in list(self.wds.items()):
            if w == wd:
                del self.wds[directory]
                self.ids.pop(directory, None)
                held = True
                with contextlib.suppress(OSError):
                    self.get().rm_watch(w)
        return held

    def reset(self) -> None:
        """After events were lost (a queue overflow, or more watches gone at once than a
        native wait reports): find out which watches are gone and forget them.

        Each held directory is watched again: ``inotify_add_watch`` answers the descriptor of
        the watch already on the directory now at that path, so a live watch is kept as it
        is — removing and re-adding it would queue an ``IN_IGNORED`` for each, which woke
        the wait to do the same again, a core spinning. A directory gone, or replaced (a
        new descriptor), is forgotten; waits arm what they need."""
        ino = self.get()
        for directory, wd in list(self.wds.items()):
            try:
                now = ino.add_watch(directory, _WATCH) if os.path.isdir(directory) else None
            except OSError:
                now = None
            if now == wd:
                continue
            del self.wds[directory]
            self.ids.pop(directory, None)
            with contextlib.suppress(OSError):
                ino.rm_watch(wd)  # (one that moved away with its directory)
            if now is not None:  # (a new directory at the path: its watch is new too)
                self.wds[directory] = now
                with contextlib.suppress(OSError):
                    st = os.stat(directory)
                    self.ids[directory] = (st.st_dev, st.st_ino)


_watcher = _Watcher()


def armed(directory: Path) -> int | None:
    """The calling thread's inotify descriptor with a watch on ``directory``, for a wait in
    native code (:meth:`~instride.store.ring.Leases.take`); ``None`` where ``directory`` does
    not exist (a wait through :func:`wait_keys` makes it, and removes it if the wait fails)
    or the inotify limits are reached. Watch after the first look: see :func:`wait_keys`."""
    if directory not in _watcher.wds and not os.path.isdir(directory):
        return None
    try:
        ino = _watcher.get()
        _watcher.watch(directory)
    except OSError as exc:
        if exc.errno not in _NO_INOTIFY:
            raise
        return None
    return ino.fileno()


def lost_watches(gone: Sequence[int]) -> None:
    """After a native wait found watches gone (their descriptors; none: the event queue
    overflowed, every watch is suspect): forget them, so that the next wait arms them again."""
    if not gone:
        _watcher.reset()
    for wd in gone:
        _watcher.forget(wd)  # (the wait looks again the general way: it arms what it needs)


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
    return paths[_wait("", [os.fspath(p) for p in paths], False, timeout, label, spin, None)]


def wait_keys(
    root: str,
    keys: Sequence[str],
    timeout: float | None,
    *,
    label: str,
    refuse: Callable[[str], object],
    spin: float = 0.0,
) -> int:
    """Block until one of ``keys`` is published under ``root``; return its index.

    Published means a regular file at ``root/key`` reached through directories only — the
    check a consumer makes before it hands out a path, made here right after the wake-up (in
    C when the library is there) rather than by the caller in Python.

    Parameters
    ----------
    root
        The managed directory.
    keys
        Normalized keys.
    timeout, label, spin
        As for :func:`wait_any`.
    refuse
        Called with a key that has something else on its way (a symbolic link, a directory
        or special file as the key, a file as a directory): it raises the error that names
        it; should it return (the obstacle went away meanwhile), the wait goes on.

    Raises
    ------
    ConsumeTimeout
        If none is published within ``timeout``.
    """
    return _wait(root, list(keys), True, timeout, label, spin, refuse)


def _there(root: str, key: str, confined: bool, refuse: Callable[[str], object] | None) -> bool:
    lib = library()
    state = lib.isl_state(os.fsencode(root), os.fsencode(key), confined) if lib else (
        _py_state(root, key, confined))
    if state < 0 and refuse is not None:
        refuse(key)
        return False
    return state > 0


def _first_there(root: str, keys: list[str], confined: bool,
                 refuse: Callable[[str], object] | None) -> int | None:
    """The index of the first of ``keys`` that is there (see :func:`_there`), else ``None``."""
    for i, key in enumerate(keys):
        if _there(root, key, confined, refuse):
            return i
    return None


def _py_state(root: str, key: str, confined: bool) -> int:
    """``isl_state`` in Python (for when the library is missing)."""
    if not confined:
        return 1 if os.path.exists(key) else 0
    head, parts = root, key.split("/")
    for comp in parts[:-1]:
        head = f"{head}/{comp}"
        try:
            if not stat_is_dir(os.lstat(head).st_mode):
                return -1
        except (FileNotFoundError, NotADirectoryError):
            return 0
    try:
        mode = os.lstat(f"{root}/{key}").st_mode
    except (FileNotFoundError, NotADirectoryError):
        return 0
    return 1 if stat_is_reg(mode) else -1


def _wait(root: str, keys: list[str], confined: bool, timeout: float | None, label: str,
          spin: float, refuse: Callable[[str], object] | None) -> int:
    found = _first_there(root, keys, confined, refuse)
    if found is not None:
        return found
    full = [f"{root}/{k}" for k in keys] if confined else keys
    if spin > 0:
        start = time.monotonic()
        end = start + (spin if timeout is None else min(spin, timeout))
        while (left := end - time.monotonic()) > 0:
            found = poll_paths(full, left)
            if found is None:
                break
            i = full.index(os.fspath(found))
            if _there(root, keys[i], confined, refuse):
                return i
        if timeout is not None:
            timeout = max(0.0, timeout - (time.monotonic() - start))
    created = _missing_dirs(dict.fromkeys(Path(p).parent for p in full))  # [cleanup]
    try:
        return _sleep(root, keys, full, confined, timeout, label, refuse)
    except BaseException:
        _remove_made(created)
        raise


def _remove_made(created: list[Path]) -> None:
    """Remove the directories a failed wait made to watch (deepest first; a non-empty one
    stays). A signal's exception while it runs (a second Ctrl-C; GNU ``timeout`` signals the
    child and then its whole process group) does not stop it: it is raised once every one
    is removed — it left some behind."""
    todo = list(created)
    interrupted: BaseException | None = None
    while todo:
        try:
            while todo:  # [cleanup]
                _watcher.drop(todo[0])
                with contextlib.suppress(OSError):
                    os.rmdir(todo[0])
                del todo[0]
        except BaseException as exc:  # (taken up again where it stopped)
            interrupted = exc
    if interrupted is not None:
        raise interrupted


#: errno of inotify_init / inotify_add_watch when the per-user limits are reached
#: (fs.inotify.max_user_instances, 128 by default; max_user_watches) or memory is short.
_NO_INOTIFY = (errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.ENOMEM)
#: Longest sleep between two checks of a polling wait.
_POLL_MAX = 0.05


def _poll_any(root: str, keys: list[str], confined: bool, timeout: float | None, label: str,
              start: float, refuse: Callable[[str], object] | None) -> int:
    """Wait by polling (1 ms doubling to 50 ms): the fallback when no inotify is available.

    A process can hold only so many inotify instances (a thousand waiting threads exceed the
    default per-user limit of 128); their waits still end correctly, at most 50 ms late.
    """
    delay = 0.001
    while True:
        found = _first_there(root, keys, confined, refuse)
        if found is not None:
            return found
        elapsed = time.monotonic() - start
        if timeout is not None and elapsed >= timeout:
            raise ConsumeTimeout(label, elapsed)
        time.sleep(delay if timeout is None else max(0.0, min(delay, timeout - elapsed)))
        delay = min(delay * 2, _POLL_MAX)


#: isl_wait's results (csrc/local/wait.c)
_FOUND, _TIMEOUT, _INTERRUPTED, _REARM, _CHECK = range(5)
_GONE_CAP = 16


def _looked(dirs: list[Path]) -> bool:
    """Whether a watched directory of a wait is no longer the one at its path: a directory
    above a key's renamed (a restart's clean-up moving the run away, another made in its
    place) took the watch with it, and the wait slept for good while the key was published
    at its path. Looked at every :data:`_LOOK_MS` of a wait; the caller arms them again."""
    return any([_watcher.moved(directory) for directory in dirs])


def _sleep(root: str, keys: list[str], full: list[str], confined: bool, timeout: float | None,
           label: str, refuse: Callable[[str], object] | None) -> int:
    start = time.monotonic()
    dirs = list(dict.fromkeys(Path(p).parent for p in full))
    try:
        ino = _watcher.get()
        for directory in dirs:
            _watcher.watch(directory, keep=len(dirs))
    except OSError as exc:  # [limits] out of inotify instances or watches: poll instead
        if exc.errno not in _NO_INOTIFY:
            raise
        return _poll_any(root, keys, confined, timeout, label, start, refuse)
    # Re-check after arming: a publication between the first check and the watch produced
    # no event we could see.
    there = _first_there(root, keys, confined, refuse)
    if there is not None:
        return there
    lib = library()
    if lib is not None:
        ckeys = (ctypes.c_char_p * len(keys))(*(os.fsencode(k) for k in keys))
        croot = os.fsencode(root)
        found = ctypes.c_int(0)
        gone = (ctypes.c_int * _GONE_CAP)()
    names = {Path(p).name for p in full}
    while True:
        if timeout is None:
            wait_us = _LOOK_MS * 1000
        else:
            remaining = timeout - (time.monotonic() - start)
            if remaining <= 0:
                raise ConsumeTimeout(label, time.monotonic() - start)
            # (to the µs: a hybrid-polling reader sleeps until its window opens, not ~1 ms past)
            wait_us = min(max(1, int(remaining * 1e6)), _LOOK_MS * 1000)
        wait_ms = max(1, -(-wait_us // 1000))  # (the Python fallback's read: whole ms)
        if lib is not None:  # the hot path: sleep, read and check in C, GIL released
            rc = lib.isl_wait(ino.fileno(), croot, ckeys, len(keys), confined, wait_us,
                              ctypes.byref(found), gone, _GONE_CAP)
            if rc == _FOUND:
                return found.value
            if rc < 0:
                raise OSError(-rc, f"waiting for {label}: {os.strerror(-rc)}")
            if rc == _CHECK:  # something else than a file on the way: named, unless it went
                if refuse is not None:  # away meanwhile (then the check below looks again)
                    refuse(keys[found.value])
                wake, rearm = True, False
            elif rc == _REARM:
                if found.value < 0:  # the queue overflowed (or too many went to list them)
                    _watcher.reset()
                    rearm = True
                else:  # watched directories that went away; those this thread still held
                    # (not those whose watches it removed itself: their IN_IGNORED is no news)
                    rearm = any([_watcher.forget(wd) for wd in gone[: found.value]])
                wake = True  # (the batch may have named a key too: look)
            else:  # timed out (the loop's clock says whether for good) or a signal
                wake = False
                rearm = _looked(dirs)
        else:
            wake = rearm = False
            events = ino.read(timeout=wait_ms)
            if not events:
                rearm = _looked(dirs)
            for ev in events:  # the cheapest test first: the hot path
                if ev.name in names:
                    wake = True
                elif ev.mask & _LOST:  # events (maybe IN_IGNORED) were lost
                    _watcher.reset()
                    rearm = True
                elif ev.mask & _GONE:  # a watched directory went away or moved (see forget)
                    rearm = _watcher.forget(ev.wd) or rearm
        if rearm:
            for directory in dirs:
                _watcher.watch(directory, keep=len(dirs))
        if wake or rearm:
            there = _first_there(root, keys, confined, refuse)
            if there is not None:
                return there


__all__ = ["armed", "lost_watches", "wait_any", "wait_keys"]
